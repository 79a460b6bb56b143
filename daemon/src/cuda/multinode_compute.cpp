// Multi-node communicators on the cuda backend, the GPU work both exchanges share (multinode_staged.cpp,
// multinode_gpu_exchange.cpp): ag-gemm's gathered A and GEMMs, allgather's local copies, and gemm-rs/ar's partials,
// node sum, sum over nodes and rounding. One code for both, so that the two paths compute alike, bit for bit, and a
// node may take either for an op. See cuda_multinode.hpp.
#include <algorithm>

#include "cuda/cuda_multinode.hpp"
#include "cuda/multinode_common.hpp"
#include "tandem/common/op_spec.hpp"

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

void HostStaging::AgGemmTensors::copyScales(uint32_t q, std::byte* dst, const std::byte* src, cudaStream_t s) const {
  if (scaleSent[q] == 0) return;
  if (!block) {
    copyAsync(dst, src, sizeof(float), s, "A scale");
    return;
  }
  const uint64_t rows = rowsOf(m, q, n);
  const auto ldsa = static_cast<uint64_t>(k::gemmFp8ScaleALd(static_cast<int64_t>(rows)));
  k::checkCuda(cudaMemcpy2DAsync(dst, ldsa * sizeof(float), src, rows * sizeof(float), rows * sizeof(float), kBlocks,
                                 cudaMemcpyDefault, s),
               "cudaMemcpy2DAsync(block scales of rank {})", q);
}

void HostStaging::AgGemmTensors::placeSent(uint32_t r, uint32_t q, const std::byte* src, cudaStream_t s) const {
  copyAsync(gathered[r] + rowOffset(m, q, n) * rowBytes, src, shardBytes(q), s, "shard to gathered A");
  if (fp8) copyScales(q, scales[r] + scaleOff[q], src + shardBytes(q), s);
}

void HostStaging::AgGemmTensors::placeOwn(uint32_t r, uint32_t q, cudaStream_t s) const {
  std::byte* dst = gathered[r] + rowOffset(m, q, n) * rowBytes;
  if (dst != a[q]) copyAsync(dst, a[q], shardBytes(q), s, "local shard to gathered A");
  if (fp8) copyScales(q, scales[r] + scaleOff[q], aScale[q], s);
}

void HostStaging::AgGemmTensors::pack(uint32_t q, std::byte* dst, cudaStream_t s) const {
  copyAsync(dst, a[q], shardBytes(q), s, "shard to the payload");
  if (fp8) copyAsync(dst + shardBytes(q), aScale[q], scaleSent[q], s, "A scales to the payload");
}

HostStaging::AgGemmTensors HostStaging::agGemmTensors(const Collective& c, Aside* aside) {
  const OpDescriptor& d = c.ops[0].desc;
  AgGemmTensors t;
  t.n = static_cast<uint32_t>(c.ops.size());
  t.m = d.dims[dim::kM];
  t.cols = d.dims[dim::kN];
  t.kk = d.dims[dim::kK];
  t.es = dtypeSize(d.dtype);
  t.ces = dtypeSize(gemmOutDtype(d.dtype, d.flags));
  t.rowBytes = t.kk * t.es;
  t.dtype = d.dtype;
  t.layout = gemmOperandsOf(d.flags);
  t.fp8 = isFp8(d.dtype);
  t.block = (d.flags & kFlagFp8BlockScale) != 0;
  t.kBlocks = (t.kk + 127) / 128;
  t.mine = localRanksOf(c);
  t.gathered.assign(t.n, nullptr);
  t.home.assign(t.n, nullptr);
  t.c.assign(t.n, nullptr);
  t.a.assign(t.n, nullptr);
  t.b.assign(t.n, nullptr);
  t.scales.assign(t.n, nullptr);
  t.aScale.assign(t.n, nullptr);
  t.bScale.assign(t.n, nullptr);
  const int sa = gemmScaleSlot(d.kind, false), sb = gemmScaleSlot(d.kind, true);
  if (t.fp8) {
    const OpSpec& spec = opSpec(d.kind);
    for (uint32_t q = 0; q < t.n; ++q) t.scaleSent.push_back(slotBytes(spec, sa, c.ops[q].desc));
    t.scaleOff = agScaleOffsets(d, t.n);
  }
  for (uint32_t r : t.mine) {
    const int dev = deviceOf(r);
    t.devices.insert(dev);
    const PendingOp& op = c.ops[r];
    std::byte* g = slotPtr(op, slot::kAGathered);
    t.home[r] = g != nullptr && !aligned16(g) ? g : nullptr;  // a misaligned gathered A: built in the workspace
    t.gathered[r] = g != nullptr && aligned16(g) ? g : workspace(r);
    // The scales region after a gathered A built in the workspace (checkWorkspaces counts both).
    t.scales[r] = workspace(r) + (t.gathered[r] == workspace(r) ? alignUp(t.m * t.rowBytes, kAlign) : 0);
    t.a[r] = slotPtr(op, slot::kA);  // null for a rank without rows
    t.b[r] = slotPtr(op, slot::kB);
    t.c[r] = slotPtr(op, slot::kC);
    if (t.fp8) {
      t.aScale[r] = slotPtr(op, sa);
      t.bScale[r] = slotPtr(op, sb);
    }
    if (aside != nullptr) {
      cudaStream_t cs = gpu(dev).compute.get();
      t.b[r] = aside->input(dev, cs, t.b[r], t.cols * t.kk * t.es);
      t.c[r] = aside->output(dev, cs, t.c[r], t.m * t.cols * t.ces);
      if (t.fp8) {
        t.aScale[r] = aside->input(dev, cs, t.aScale[r], t.scaleSent[r]);
        t.bScale[r] = aside->input(dev, cs, t.bScale[r], op.desc.bufs[static_cast<std::size_t>(sb)].bytes);
      }
    }
  }
  return t;
}

void HostStaging::copyLocalShards(const AgGemmTensors& t) {
  for (uint32_t r : t.mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : t.mine) {
      if (t.shardBytes(q) != 0) t.placeOwn(r, q, gpu(deviceOf(r)).copy.get());
    }
  }
}

void HostStaging::copiesThenCompute(const std::set<int>& devices) {
  for (int dev : devices) order(dev, gpu(dev).copy.get(), gpu(dev).compute.get());
}

// In NT and NN the gathered A is [m, k], so a run of rows is one GEMM. In TN it is each rank's [k, rows] block in rank
// order (the same bytes at the same offsets): one GEMM per rank's shard, its rows the columns of the block; so too with
// FP8 inputs, each shard with its own rank's scales.
void HostStaging::gemmRows(const AgGemmTensors& t, const RowRuns& runs) {
  struct Piece {
    uint64_t first, rows;
    uint32_t rank;  // the rank whose shard the rows are (perShard only)
  };
  const bool perShard = t.layout == GemmOperands::kTN || t.fp8;
  std::vector<Piece> pieces;
  for (auto [first, rows] : runs) {
    if (!perShard) {
      pieces.push_back({first, rows, 0});
      continue;
    }
    for (uint32_t q = 0; q < t.n; ++q) {
      const uint64_t off = rowOffset(t.m, q, t.n), cnt = rowsOf(t.m, q, t.n);
      if (cnt != 0 && off >= first && off + cnt <= first + rows) pieces.push_back({off, cnt, q});
    }
  }
  for (uint32_t r : t.mine) {
    const int dev = deviceOf(r);
    k::CudaDeviceGuard guard(dev);
    cudaStream_t cs = gpu(dev).compute.get();
    for (const Piece& pc : pieces) {
      GemmCall g;
      g.layout = t.layout;
      g.dtype = t.dtype;
      g.a = t.gathered[r] + pc.first * t.rowBytes;
      g.b = t.b[r];
      g.c = t.c[r] + pc.first * t.cols * t.ces;
      g.rows = pc.rows;
      g.cols = t.cols;
      g.k = t.kk;
      g.lda = t.layout == GemmOperands::kTN ? pc.rows : t.kk;
      g.ldb = t.layout == GemmOperands::kNT ? t.kk : t.cols;
      g.ldc = t.cols;
      if (t.fp8) {  // layout NT (gemmCoreRefusal); the shard's own scales
        g.out = t.ces == sizeof(float) ? DType::kF32 : DType::kBF16;
        g.blockScale = t.block;
        g.scaleA = reinterpret_cast<const float*>(t.scales[r] + t.scaleOff[pc.rank]);
        g.scaleB = reinterpret_cast<const float*>(t.bScale[r]);
        g.ldsa = static_cast<uint64_t>(k::gemmFp8ScaleALd(static_cast<int64_t>(pc.rows)));
      }
      gemm(g, cs, "ag-gemm");
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
  const bool fp8 = isFp8(d.dtype);
  const DType out = gemmOutDtype(d.dtype, d.flags);
  ReduceTensors t;
  t.m = d.dims[dim::kM];
  t.cols = d.dims[dim::kN];
  t.es = dtypeSize(d.dtype);
  t.pes = fp8 ? sizeof(float) : t.es;
  t.ces = dtypeSize(out);
  t.ldp = alignUp(t.cols, 8);
  t.dtype = d.dtype;
  t.layout = gemmOperandsOf(d.flags);
  t.partialElem = fp8 ? k::SpanElem::kF32 : spanElem(d.dtype);
  t.outElem = spanElem(out);
  t.name = opKindName(d.kind).data();
  t.mine = localRanksOf(c);
  const uint32_t lead = t.mine.front();
  t.leadDev = deviceOf(lead);
  t.leadStream = gpu(t.leadDev).compute.get();
  t.partialBytes = alignUp(t.m * t.ldp * t.pes, kAlign);
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
    const PendingOp& op = c.ops[r];
    const uint64_t kr = op.desc.dims[dim::kK];
    if (kr == 0) continue;
    ReduceTensors::Inputs in;
    in.a = slotPtr(op, slot::kA);
    in.b = slotPtr(op, slot::kB);
    const int sa = gemmScaleSlot(d.kind, false), sb = gemmScaleSlot(d.kind, true);
    const std::byte* aScale = fp8 ? slotPtr(op, sa) : nullptr;
    const std::byte* bScale = fp8 ? slotPtr(op, sb) : nullptr;
    if (aside != nullptr) {
      k::CudaDeviceGuard guard(dev);
      cudaStream_t cs = gpu(dev).compute.get();
      in.a = aside->input(dev, cs, in.a, t.m * kr * t.es);
      in.b = aside->input(dev, cs, in.b, t.cols * kr * t.es);
      aScale = aside->input(dev, cs, aScale, op.desc.bufs[static_cast<std::size_t>(sa)].bytes);
      bScale = aside->input(dev, cs, bScale, op.desc.bufs[static_cast<std::size_t>(sb)].bytes);
    }
    in.aScale = reinterpret_cast<const float*>(aScale);
    in.bScale = reinterpret_cast<const float*>(bScale);
    t.inputs[r] = in;
  }
  return t;
}

void HostStaging::partialRows(const Collective& c, const ReduceTensors& t, uint32_t r, uint64_t r0, uint64_t r1) {
  const int dev = deviceOf(r);
  k::CudaDeviceGuard guard(dev);
  cudaStream_t cs = gpu(dev).compute.get();
  const uint64_t kr = c.ops[r].desc.dims[dim::kK];
  std::byte* const partial = workspace(r) + r0 * t.ldp * t.pes;
  if (kr == 0) {  // a rank without a k slice: its partial is zero (the GEMM core would need A and B)
    k::checkCuda(cudaMemsetAsync(partial, 0, (r1 - r0) * t.ldp * t.pes, cs), "cudaMemsetAsync(partial)");
    return;
  }
  const ReduceTensors::Inputs& in = t.inputs.at(r);
  // Rows r0.. of op(A): rows of the stored [m, k] in NT and NN, columns of the stored [k, m] in TN.
  const bool tn = t.layout == GemmOperands::kTN;
  GemmCall g;
  g.layout = t.layout;
  g.dtype = t.dtype;
  g.a = in.a + r0 * (tn ? 1 : kr) * t.es;
  g.b = in.b;
  g.c = partial;
  g.rows = r1 - r0;
  g.cols = t.cols;
  g.k = kr;
  g.lda = tn ? t.m : kr;
  g.ldb = t.layout == GemmOperands::kNT ? kr : t.cols;
  g.ldc = t.ldp;
  if (isFp8(t.dtype)) {  // layout NT (gemmCoreRefusal): an fp32 partial
    g.out = DType::kF32;
    g.blockScale = (c.ops[r].desc.flags & kFlagFp8BlockScale) != 0;
    // a_scale [ceil(k/128), m]: rows r0.. start r0 floats in (r0 a multiple of 8, m of 4: 16-byte aligned).
    g.scaleA = g.blockScale ? in.aScale + r0 : in.aScale;
    g.scaleB = in.bScale;
    g.ldsa = t.m;
  }
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
  const uint64_t skip = firstRow * t.ldp * t.pes;  // bytes into each partial
  std::byte* next = t.next;
  std::vector<const std::byte*> partials;
  for (uint32_t r : t.mine) {
    if (deviceOf(r) == t.leadDev) {
      partials.push_back(workspace(r) + skip);
    } else {
      copyAsync(next + skip, workspace(r) + skip, rows * t.ldp * t.pes, t.leadStream, "partial to the lead GPU");
      partials.push_back(next + skip);
      next += t.partialBytes;
    }
  }
  for (std::size_t i = 0; i < partials.size(); i += k::kSpanMaxSources) {
    k::SpanSum s{};
    s.count = static_cast<int32_t>(std::min<std::size_t>(k::kSpanMaxSources, partials.size() - i));
    for (int j = 0; j < s.count; ++j) s.src[j] = partials[i + static_cast<std::size_t>(j)];
    s.srcType = t.partialElem;
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
    s.dstType = t.outElem;
    s.rows = static_cast<int64_t>(rows);
    s.cols = static_cast<int64_t>(cols);
    s.srcLd = s.dstLd = static_cast<int64_t>(cols);
    sum(s, t.leadStream, "output");
    if (!here) copyAsync(cr, outStaging, rows * cols * t.ces, t.leadStream, "output to its GPU");
  }
}

}  // namespace tandem::daemon::cuda
