// Multi-node communicators on the cuda backend, the GPU work both exchanges share (multinode_staged.cpp,
// multinode_gpu_exchange.cpp): ag-gemm's gathered A and GEMMs, allgather's local copies, and gemm-rs/ar's partials,
// node sum, sum over nodes and rounding. One code for both, so that the two paths compute alike, bit for bit, and a
// node may take either for an op. See cuda_multinode.hpp.
#include <algorithm>

#include "cuda/cuda_multinode.hpp"
#include "cuda/multinode_common.hpp"

namespace tandem::daemon::cuda {

namespace k = tandem::kernels;
using namespace multinode;

// ---- Aside ---------------------------------------------------------------------------------------------------------

namespace multinode {

Aside::~Aside() {
  for (const Block& b : blocks_) {
    k::CudaDeviceGuard guard(b.dev);
    k::reportRelease(cudaFreeAsync(b.mem, b.stream), "cudaFreeAsync(aligned copy)");
  }
}

const std::byte* Aside::input(int dev, cudaStream_t s, const std::byte* p, uint64_t bytes) {
  if (p == nullptr || aligned16(p)) return p;
  std::byte* q = allocate(dev, s, bytes, nullptr);
  copyAsync(q, p, bytes, s, "input to an aligned copy");
  return q;
}

std::byte* Aside::output(int dev, cudaStream_t s, std::byte* p, uint64_t bytes) {
  if (p == nullptr || aligned16(p)) return p;
  return allocate(dev, s, bytes, p);
}

void Aside::flush() {
  for (const Block& b : blocks_) {
    if (b.back == nullptr) continue;
    k::CudaDeviceGuard guard(b.dev);
    copyAsync(b.back, b.mem, b.bytes, b.stream, "aligned copy to the output");
  }
}

std::byte* Aside::allocate(int dev, cudaStream_t s, uint64_t bytes, std::byte* back) {
  k::CudaDeviceGuard guard(dev);
  void* mem = nullptr;
  k::checkCuda(cudaMallocAsync(&mem, std::max<uint64_t>(bytes, 16), s), "cudaMallocAsync({} bytes, aligned copy)",
               bytes);
  blocks_.push_back({dev, s, static_cast<std::byte*>(mem), back, bytes});
  return static_cast<std::byte*>(mem);
}

}  // namespace multinode

// ---- ag-gemm and allgather -----------------------------------------------------------------------------------------

uint64_t HostStaging::AgGemmTensors::shardBytes(uint32_t r) const { return rowsOf(m, r, n) * rowBytes; }

HostStaging::AgGemmTensors HostStaging::agGemmTensors(const Collective& c, Aside* aside) {
  const OpDescriptor& d = c.ops[0].desc;
  AgGemmTensors t;
  t.n = static_cast<uint32_t>(c.ops.size());
  t.m = d.dims[dim::kM];
  t.cols = d.dims[dim::kN];
  t.kk = d.dims[dim::kK];
  t.es = dtypeSize(d.dtype);
  t.rowBytes = t.kk * t.es;
  t.dtype = d.dtype;
  t.layout = gemmOperandsOf(d.flags);
  t.mine = localRanksOf(c);
  t.gathered.assign(t.n, nullptr);
  t.home.assign(t.n, nullptr);
  t.c.assign(t.n, nullptr);
  t.a.assign(t.n, nullptr);
  t.b.assign(t.n, nullptr);
  for (uint32_t r : t.mine) {
    const int dev = deviceOf(r);
    t.devices.insert(dev);
    std::byte* g = slotPtr(c.ops[r], slot::kAGathered);
    t.home[r] = g != nullptr && !aligned16(g) ? g : nullptr;  // a misaligned gathered A: built in the workspace
    t.gathered[r] = g != nullptr && aligned16(g) ? g : workspace(r);
    t.a[r] = slotPtr(c.ops[r], slot::kA);  // null for a rank without rows
    t.b[r] = slotPtr(c.ops[r], slot::kB);
    t.c[r] = slotPtr(c.ops[r], slot::kC);
    if (aside != nullptr) {
      cudaStream_t cs = gpu(dev).compute.get();
      t.b[r] = aside->input(dev, cs, t.b[r], t.cols * t.kk * t.es);
      t.c[r] = aside->output(dev, cs, t.c[r], t.m * t.cols * t.es);
    }
  }
  return t;
}

void HostStaging::copyLocalShards(const AgGemmTensors& t) {
  for (uint32_t r : t.mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : t.mine) {
      std::byte* dst = t.gathered[r] + rowOffset(t.m, q, t.n) * t.rowBytes;
      if (t.shardBytes(q) == 0 || dst == t.a[q]) continue;
      copyAsync(dst, t.a[q], t.shardBytes(q), gpu(deviceOf(r)).copy.get(), "local shard to gathered A");
    }
  }
}

void HostStaging::copiesThenCompute(const std::set<int>& devices) {
  for (int dev : devices) order(dev, gpu(dev).copy.get(), gpu(dev).compute.get());
}

// In NT and NN the gathered A is [m, k], so a run of rows is one GEMM. In TN it is each rank's [k, rows] block in rank
// order (the same bytes at the same offsets): one GEMM per rank's shard, its rows the columns of the block.
void HostStaging::gemmRows(const AgGemmTensors& t, const RowRuns& runs) {
  RowRuns pieces;
  for (auto [first, rows] : runs) {
    if (t.layout != GemmOperands::kTN) {
      pieces.emplace_back(first, rows);
      continue;
    }
    for (uint32_t q = 0; q < t.n; ++q) {
      const uint64_t off = rowOffset(t.m, q, t.n), cnt = rowsOf(t.m, q, t.n);
      if (cnt != 0 && off >= first && off + cnt <= first + rows) pieces.emplace_back(off, cnt);
    }
  }
  for (uint32_t r : t.mine) {
    const int dev = deviceOf(r);
    k::CudaDeviceGuard guard(dev);
    for (auto [first, rows] : pieces) {
      GemmCall g;
      g.layout = t.layout;
      g.dtype = t.dtype;
      g.a = t.gathered[r] + first * t.rowBytes;
      g.b = t.b[r];
      g.c = t.c[r] + first * t.cols * t.es;
      g.rows = rows;
      g.cols = t.cols;
      g.k = t.kk;
      g.lda = t.layout == GemmOperands::kTN ? rows : t.kk;
      g.ldb = t.layout == GemmOperands::kNT ? t.kk : t.cols;
      g.ldc = t.cols;
      gemm(g, gpu(dev).compute.get(), "ag-gemm");
    }
  }
}

void HostStaging::copyLocalSends(const Collective& c, const std::vector<uint32_t>& mine, uint64_t bytes) {
  for (uint32_t r : mine) {
    std::byte* recv = slotPtr(c.ops[r], slot::kRecv);
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : mine) {
      copyAsync(recv + q * bytes, slotPtr(c.ops[q], slot::kSend), bytes, gpu(deviceOf(r)).copy.get(), "local send");
    }
  }
}

// ---- gemm-rs and gemm-ar -------------------------------------------------------------------------------------------

HostStaging::ReduceTensors HostStaging::reduceTensors(const Collective& c, Aside* aside) {
  const OpDescriptor& d = c.ops[0].desc;
  ReduceTensors t;
  t.m = d.dims[dim::kM];
  t.cols = d.dims[dim::kN];
  t.es = dtypeSize(d.dtype);
  t.ldp = alignUp(t.cols, 8);
  t.dtype = d.dtype;
  t.layout = gemmOperandsOf(d.flags);
  t.elem = spanElem(d.dtype);
  t.name = opKindName(d.kind).data();
  t.mine = localRanksOf(c);
  const uint32_t lead = t.mine.front();
  t.leadDev = deviceOf(lead);
  t.leadStream = gpu(t.leadDev).compute.get();
  t.partialBytes = alignUp(t.m * t.ldp * t.es, kAlign);
  t.f32Bytes = alignUp(t.m * t.cols * sizeof(float), kAlign);
  std::byte* ws = workspace(lead);
  t.nodeSum = reinterpret_cast<float*>(ws + t.partialBytes);
  t.total = reinterpret_cast<float*>(ws + t.partialBytes + t.f32Bytes);
  t.recvSlot = reinterpret_cast<float*>(ws + t.partialBytes + 2 * t.f32Bytes);
  t.next = ws + t.partialBytes + 3 * t.f32Bytes;
  // The inputs, once (copied aside where misaligned).
  for (uint32_t r : t.mine) {
    const int dev = deviceOf(r);
    t.devices.insert(dev);
    const uint64_t kr = c.ops[r].desc.dims[dim::kK];
    if (kr == 0) continue;
    const std::byte* a = slotPtr(c.ops[r], slot::kA);
    const std::byte* b = slotPtr(c.ops[r], slot::kB);
    if (aside != nullptr) {
      k::CudaDeviceGuard guard(dev);
      cudaStream_t cs = gpu(dev).compute.get();
      a = aside->input(dev, cs, a, t.m * kr * t.es);
      b = aside->input(dev, cs, b, t.cols * kr * t.es);
    }
    t.ab[r] = {a, b};
  }
  return t;
}

void HostStaging::partialRows(const Collective& c, const ReduceTensors& t, uint32_t r, uint64_t r0, uint64_t r1) {
  const int dev = deviceOf(r);
  k::CudaDeviceGuard guard(dev);
  cudaStream_t cs = gpu(dev).compute.get();
  const uint64_t kr = c.ops[r].desc.dims[dim::kK];
  if (kr == 0) {  // a rank without a k slice: its partial is zero (the GEMM core would need A and B)
    k::checkCuda(cudaMemsetAsync(workspace(r) + r0 * t.ldp * t.es, 0, (r1 - r0) * t.ldp * t.es, cs),
                 "cudaMemsetAsync(partial)");
    return;
  }
  const auto& [a, b] = t.ab.at(r);
  // Rows r0.. of op(A): rows of the stored [m, k] in NT and NN, columns of the stored [k, m] in TN.
  const bool tn = t.layout == GemmOperands::kTN;
  GemmCall g;
  g.layout = t.layout;
  g.dtype = t.dtype;
  g.a = a + r0 * (tn ? 1 : kr) * t.es;
  g.b = b;
  g.c = workspace(r) + r0 * t.ldp * t.es;
  g.rows = r1 - r0;
  g.cols = t.cols;
  g.k = kr;
  g.lda = tn ? t.m : kr;
  g.ldb = t.layout == GemmOperands::kNT ? kr : t.cols;
  g.ldc = t.ldp;
  gemm(g, cs, t.name);
}

void HostStaging::orderAfterPartials(const ReduceTensors& t) {
  for (int dev : t.devices) {
    if (dev != t.leadDev) order(dev, gpu(dev).compute.get(), t.leadStream);
  }
}

// Partials on other GPUs are first copied (those rows) to t.next on the lead's GPU, partialBytes apart, so the
// returned byte is the same for every row range.
std::byte* HostStaging::sumNodePartials(const ReduceTensors& t, uint64_t firstRow, uint64_t rows) {
  const uint64_t skip = firstRow * t.ldp * t.es;  // bytes into each partial
  std::byte* next = t.next;
  std::vector<const std::byte*> partials;
  for (uint32_t r : t.mine) {
    if (deviceOf(r) == t.leadDev) {
      partials.push_back(workspace(r) + skip);
    } else {
      copyAsync(next + skip, workspace(r) + skip, rows * t.ldp * t.es, t.leadStream, "partial to the lead GPU");
      partials.push_back(next + skip);
      next += t.partialBytes;
    }
  }
  for (std::size_t i = 0; i < partials.size(); i += k::kSpanMaxSources) {
    k::SpanSum s{};
    s.count = static_cast<int32_t>(std::min<std::size_t>(k::kSpanMaxSources, partials.size() - i));
    for (int j = 0; j < s.count; ++j) s.src[j] = partials[i + static_cast<std::size_t>(j)];
    s.srcType = t.elem;
    s.dst = t.nodeSum + firstRow * t.cols;
    s.dstType = k::SpanElem::kF32;
    s.accumulate = i != 0;
    s.rows = static_cast<int64_t>(rows);
    s.cols = static_cast<int64_t>(t.cols);
    s.srcLd = static_cast<int64_t>(t.ldp);
    s.dstLd = static_cast<int64_t>(t.cols);
    sum(s, t.leadStream, "node sum");
  }
  return next;
}

void HostStaging::addRowsToTotal(const ReduceTensors& t, const RowRuns& rows, const float* src, bool atOwnRows,
                                 bool accumulate) {
  k::CudaDeviceGuard guard(t.leadDev);
  uint64_t off = 0;
  for (auto [first, count] : rows) {
    k::SpanSum sm{};
    sm.count = 1;
    sm.src[0] = src + (atOwnRows ? first * t.cols : off);
    sm.srcType = k::SpanElem::kF32;
    sm.dst = t.total + first * t.cols;
    sm.dstType = k::SpanElem::kF32;
    sm.accumulate = accumulate;
    sm.rows = static_cast<int64_t>(count);
    sm.cols = static_cast<int64_t>(t.cols);
    sm.srcLd = sm.dstLd = static_cast<int64_t>(t.cols);
    sum(sm, t.leadStream, "sum over nodes");
    off += count * t.cols;
  }
}

// A rank on another GPU than the lead's gets its rows through `outStaging` on the lead's GPU (stream order on the
// lead keeps the staging's next writer behind each copy).
void HostStaging::roundOutputs(const Collective& c, const ReduceTensors& t, std::byte* outStaging) {
  const bool allReduce = c.ops[0].desc.kind == OpKind::kGemmAr;
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = t.m, cols = t.cols;
  k::CudaDeviceGuard guard(t.leadDev);
  for (uint32_t r : t.mine) {
    const uint64_t first = allReduce ? 0 : rowOffset(m, r, n), rows = allReduce ? m : rowsOf(m, r, n);
    if (rows == 0) continue;
    std::byte* cr = slotPtr(c.ops[r], slot::kC);
    const bool here = deviceOf(r) == t.leadDev;
    k::SpanSum s{};
    s.count = 1;
    s.src[0] = t.total + first * cols;
    s.srcType = k::SpanElem::kF32;
    s.dst = here ? cr : outStaging;
    s.dstType = t.elem;
    s.rows = static_cast<int64_t>(rows);
    s.cols = static_cast<int64_t>(cols);
    s.srcLd = s.dstLd = static_cast<int64_t>(cols);
    sum(s, t.leadStream, "output");
    if (!here) copyAsync(cr, outStaging, rows * cols * t.es, t.leadStream, "output to its GPU");
  }
}

}  // namespace tandem::daemon::cuda
