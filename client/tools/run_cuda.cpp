// One rank on the cuda backend: buffers are tandemd's GPU memory (tandem_alloc), inputs are made on the GPU
// (inputs.hpp, so any rank can regenerate them), each op runs on the rank's stream after a tandem barrier and is timed
// with CUDA events. --check: the fp64 host reference for moderate shapes (outputs copied back), an fp32 GPU reference
// GEMM for large GEMMs. --compare: the unfused baseline (NCCL + cuBLASLt) in the same process, interleaved.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#ifdef TANDEM_HAVE_NCCL
#include <nccl.h>
#endif

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include "cublaslt_gemm.hpp"
#include "gpu_kernels.hpp"
#include "inputs.hpp"
#include "op_metrics.hpp"
#include "rank.hpp"

namespace tandem::ctl {
namespace {

void ck(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {} [{}]", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

// cudaMalloc memory of our own (scratch, baseline outputs), freed on every path out.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(uint64_t bytes, const std::string& what) {
    if (bytes > 0) ck(cudaMalloc(&p_, bytes), fmt::format("cudaMalloc {} MiB for {}", bytes >> 20, what));
  }
  ~DeviceMemory() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceMemory(DeviceMemory&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  template <class T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

class Stream {
 public:
  Stream() { ck(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_{};
};

class Events {
 public:
  explicit Events(std::size_t n) : ev_(n) {
    for (auto& e : ev_) ck(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~Events() {
    for (auto e : ev_) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](std::size_t i) const { return ev_[i]; }
  double microsBetween(std::size_t a, std::size_t b) const {
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, ev_[a], ev_[b]), "cudaEventElapsedTime");
    return static_cast<double>(ms) * 1000.0;
  }

 private:
  std::vector<cudaEvent_t> ev_;
};

// This rank's tensors in tandemd's GPU memory.
struct GpuBuffers {
  std::vector<tandem_buffer_t> owned;
  std::array<tandem_tensor_t, kMaxOpBuffers> tensors{};
  std::array<void*, kMaxOpBuffers> ptrs{};
  GpuBuffers() = default;
  GpuBuffers(const GpuBuffers&) = delete;
  GpuBuffers& operator=(const GpuBuffers&) = delete;
  ~GpuBuffers() {
    for (tandem_buffer_t b : owned) tandem_free(b);
  }
};

// Inputs of `d` (rank d.rank) into device memory `ptrs`, outputs poisoned (0xFF: NaN in every float dtype).
void fillDevice(const OpDescriptor& d, const std::array<void*, kMaxOpBuffers>& ptrs, uint64_t seed, cudaStream_t s) {
  const OpSpec& op = opSpec(d.kind);
  for (int i = 0; i < op.slotCount; ++i) {
    const auto si = static_cast<std::size_t>(i);
    const uint64_t bytes = d.bufs[si].bytes;
    if (bytes == 0 || ptrs[si] == nullptr) continue;
    const SlotSpec& sl = op.slots[si];
    if (sl.output) {
      ck(cudaMemsetAsync(ptrs[si], 0xFF, bytes, s), "poison an output");
    } else if (hashFilled(op, i) && sl.type == ElementType::kRaw) {
      gpu::fillBytes(ptrs[si], bytes, slotKey(seed, d.rank, static_cast<uint32_t>(i)), s);
    } else if (hashFilled(op, i) && !isFp8(slotDtype(sl, d))) {
      gpu::fillUniform(ptrs[si], slotDtype(sl, d), bytes / slotElementSize(sl, d),
                       slotKey(seed, d.rank, static_cast<uint32_t>(i)), s);
    } else {
      // Made on the host, copied: routing tables (distinct expert ids), FP8 scales (reference::fillInputs), and FP8
      // tensors, which fillUniform does not store: the host's conversion (numeric.hpp) is the one definition of their
      // values, so the cpu backend, this rank and the host check all see the same bytes.
      std::vector<std::byte> host(bytes);
      fillHostSlot(d, i, host.data(), seed);
      ck(cudaMemcpyAsync(ptrs[si], host.data(), bytes, cudaMemcpyHostToDevice, s), "copy an input to the GPU");
      ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    }
  }
}

// Multiply-adds the fp64 host reference would spend on the whole collective (every rank's flops, an upper bound on
// what one rank's check costs); above kHostCheckMacs a GEMM is checked on the GPU instead.
constexpr double kHostCheckMacs = 1.5e9;  // 1024^3 and a little: seconds of naive fp64 loops
double hostCheckMacs(const RunOptions& o) {
  double macs = 0;
  for (uint32_t r = 0; r < o.ranks; ++r) {
    if (const auto m = metricsOf(reference::makeDescriptor(o.shape, r, o.ranks))) macs += m->flops / 2;
  }
  return macs;
}

// The ops with an fp32 GPU reference: the GEMMs whose reference is a sum of plain GEMMs of regenerable inputs.
bool hasGpuReference(OpKind kind) {
  return kind == OpKind::kAgGemm || kind == OpKind::kGemmRs || kind == OpKind::kGemmAr;
}
// Whether checkOnGpu can check `d`: its reference GEMM reads a [m, k] and b [n, k] (the nt layout) in bf16, fp16 or
// fp32, with no scales, so FP8 inputs and the nn and tn layouts are checked on the host whatever their size.
bool gpuCheckable(const OpDescriptor& d) {
  return hasGpuReference(d.kind) && !isFp8(d.dtype) && gemmOperandsOf(d.flags) == GemmOperands::kNT;
}

reference::Comparison checkOnGpu(RankContext& ctx, const GpuBuffers& buf, cudaStream_t s) {
  const RunOptions& o = ctx.o;
  const OpDescriptor& d = ctx.desc;
  const uint32_t n = o.ranks, r = ctx.rank;
  const uint64_t M = d.dims[dim::kM], N = d.dims[dim::kN];
  const std::size_t es = dtypeSize(d.dtype);
  DeviceMemory ref(M * N * sizeof(float), "the reference C");
  if (d.kind == OpKind::kAgGemm) {
    const uint64_t K = d.dims[dim::kK];
    DeviceMemory a(M * K * es, "the gathered A");
    for (uint32_t src = 0; src < n; ++src) {
      gpu::fillUniform(a.get<std::byte>() + rowOffset(M, src, n) * K * es, d.dtype, rowsOf(M, src, n) * K,
                       slotKey(o.seed, src, slot::kA), s);
    }
    gpu::referenceGemm(a.get(), buf.ptrs[slot::kB], ref.get<float>(), d.dtype, static_cast<int>(M), static_cast<int>(N),
                       static_cast<int>(K), static_cast<int64_t>(K), static_cast<int64_t>(K), false, s);
  } else {
    const uint64_t K = o.shape.k;  // the total K, split over the ranks
    const uint64_t kMax = rowsOf(K, 0, n);
    DeviceMemory a(M * kMax * es, "a rank's A"), b(N * kMax * es, "a rank's B");
    for (uint32_t src = 0; src < n; ++src) {
      const uint64_t k = rowsOf(K, src, n);
      gpu::fillUniform(a.get(), d.dtype, M * k, slotKey(o.seed, src, slot::kA), s);
      gpu::fillUniform(b.get(), d.dtype, N * k, slotKey(o.seed, src, slot::kB), s);
      gpu::referenceGemm(a.get(), b.get(), ref.get<float>(), d.dtype, static_cast<int>(M), static_cast<int>(N),
                         static_cast<int>(k), static_cast<int64_t>(k), static_cast<int64_t>(k), src > 0, s);
    }
  }
  // gemm-rs: this rank's rows of the sum.
  const uint64_t first = d.kind == OpKind::kGemmRs ? rowOffset(M, r, n) : 0;
  const uint64_t rows = d.kind == OpKind::kGemmRs ? rowsOf(M, r, n) : M;
  DeviceMemory sums(2 * sizeof(double), "error sums"), bad(sizeof(unsigned long long), "error count");
  ck(cudaMemsetAsync(sums.get(), 0, 2 * sizeof(double), s), "cudaMemsetAsync");
  ck(cudaMemsetAsync(bad.get(), 0, sizeof(unsigned long long), s), "cudaMemsetAsync");
  gpu::relError(buf.ptrs[slot::kC], d.dtype, static_cast<int64_t>(N), ref.get<float>() + first * N,
                static_cast<int64_t>(rows), static_cast<int64_t>(N), sums.get<double>(), bad.get<unsigned long long>(),
                s);
  double host[2] = {};
  unsigned long long nonFinite = 0;
  ck(cudaMemcpyAsync(host, sums.get(), sizeof host, cudaMemcpyDeviceToHost, s), "copy the error sums");
  ck(cudaMemcpyAsync(&nonFinite, bad.get(), sizeof nonFinite, cudaMemcpyDeviceToHost, s), "copy the error count");
  ck(cudaStreamSynchronize(s), "the GPU reference check");
  reference::Comparison cmp;
  cmp.tolerance = reference::tolerance(d.dtype);
  cmp.relError = host[1] > 0 ? std::sqrt(host[0] / host[1]) : std::sqrt(host[0]);
  cmp.ok = nonFinite == 0 && cmp.relError <= cmp.tolerance;
  if (nonFinite != 0) {
    cmp.relError = std::nan("");
    cmp.detail = fmt::format("rank {} c: {} elements are not finite (unwritten, or overflowed)", r, nonFinite);
  } else if (!cmp.ok) {
    cmp.detail = fmt::format("rank {} c: relative error {:.3g} > tolerance {:.3g} against the fp32 GPU reference GEMM",
                             r, cmp.relError, cmp.tolerance);
  }
  return cmp;
}

// The unfused baseline of an op, run in the same process on the same inputs: NCCL for the communication, cuBLASLt for
// the GEMM. Absent (with a note saying why) where the build, the op, the dtype or the placement rules it out.
class Baseline {
 public:
  virtual ~Baseline() = default;
  virtual void run(cudaStream_t s) = 0;
};

#ifdef TANDEM_HAVE_NCCL
void nk(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw std::runtime_error(fmt::format("{}: {}", what, ncclGetErrorString(r)));
}

class Nccl {
 public:
  // Rank 0 makes the id; the parent relays it to the node's other ranks (--compare runs on one node only).
  explicit Nccl(RankContext& ctx) {
    ncclUniqueId id{};
    if (ctx.rank == 0) {
      nk(ncclGetUniqueId(&id), "ncclGetUniqueId");
      std::string hex;
      for (std::size_t i = 0; i < sizeof id.internal; ++i) hex += fmt::format("{:02x}", static_cast<uint8_t>(id.internal[i]));
      ctx.link.send({{"event", "relay"}, {"line", hex}});
    } else {
      const std::string hex = ctx.link.receive();
      if (hex.size() != 2 * sizeof id.internal) throw std::runtime_error("the NCCL id relayed by rank 0 is malformed");
      for (std::size_t i = 0; i < sizeof id.internal; ++i) {
        id.internal[i] = static_cast<char>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
      }
    }
    nk(ncclCommInitRank(&comm_, static_cast<int>(ctx.o.ranks), id, static_cast<int>(ctx.rank)), "ncclCommInitRank");
  }
  ~Nccl() {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_{};
};

class LtHandle {
 public:
  LtHandle() : ws_(kWorkspace, "the cuBLASLt workspace") {
    if (cublasLtCreate(&h_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasLtCreate failed");
  }
  ~LtHandle() { cublasLtDestroy(h_); }
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  cublasLtHandle_t get() const { return h_; }
  void* workspace() const { return ws_.get(); }
  static constexpr std::size_t kWorkspace = 32u << 20;

 private:
  cublasLtHandle_t h_{};
  DeviceMemory ws_;
};

// ag-gemm: ncclAllGather of the shard, then one GEMM on the gathered A.
class AgGemmBaseline : public Baseline {
 public:
  AgGemmBaseline(std::shared_ptr<Nccl> nccl, const OpDescriptor& d, const GpuBuffers& buf)
      : nccl_(std::move(nccl)), d_(d), buf_(buf),
        gathered_(d.dims[dim::kM] * d.dims[dim::kK] * 2, "the baseline's gathered A"),
        c_(d.dims[dim::kM] * d.dims[dim::kN] * 2, "the baseline's C"),
        gemm_(lt_.get(), static_cast<int64_t>(d.dims[dim::kM]), static_cast<int64_t>(d.dims[dim::kN]),
              static_cast<int64_t>(d.dims[dim::kK]), lt_.workspace(), LtHandle::kWorkspace) {}
  void run(cudaStream_t s) override {
    const uint64_t shard = d_.dims[dim::kM] / d_.nranks * d_.dims[dim::kK];
    nk(ncclAllGather(buf_.ptrs[slot::kA], gathered_.get(), shard, ncclBfloat16, nccl_->get(), s), "ncclAllGather");
    gemm_.run(gathered_.get(), buf_.ptrs[slot::kB], c_.get(), s);
  }

 private:
  std::shared_ptr<Nccl> nccl_;
  OpDescriptor d_;
  const GpuBuffers& buf_;
  LtHandle lt_;
  DeviceMemory gathered_, c_;
  bench::LtGemm gemm_;
};

// gemm-rs / gemm-ar: one GEMM of the local K slice into a bf16 partial, then ncclReduceScatter / ncclAllReduce.
class GemmReduceBaseline : public Baseline {
 public:
  GemmReduceBaseline(std::shared_ptr<Nccl> nccl, const OpDescriptor& d, const GpuBuffers& buf)
      : nccl_(std::move(nccl)), d_(d), buf_(buf),
        partial_(d.dims[dim::kM] * d.dims[dim::kN] * 2, "the baseline's partial sums"),
        c_(d.dims[dim::kM] * d.dims[dim::kN] * 2, "the baseline's C"),
        gemm_(lt_.get(), static_cast<int64_t>(d.dims[dim::kM]), static_cast<int64_t>(d.dims[dim::kN]),
              static_cast<int64_t>(d.dims[dim::kK]), lt_.workspace(), LtHandle::kWorkspace) {}
  void run(cudaStream_t s) override {
    gemm_.run(buf_.ptrs[slot::kA], buf_.ptrs[slot::kB], partial_.get(), s);
    const uint64_t mn = d_.dims[dim::kM] * d_.dims[dim::kN];
    if (d_.kind == OpKind::kGemmRs) {
      nk(ncclReduceScatter(partial_.get(), c_.get(), mn / d_.nranks, ncclBfloat16, ncclSum, nccl_->get(), s),
         "ncclReduceScatter");
    } else {
      nk(ncclAllReduce(partial_.get(), c_.get(), mn, ncclBfloat16, ncclSum, nccl_->get(), s), "ncclAllReduce");
    }
  }

 private:
  std::shared_ptr<Nccl> nccl_;
  OpDescriptor d_;
  const GpuBuffers& buf_;
  LtHandle lt_;
  DeviceMemory partial_, c_;
  bench::LtGemm gemm_;
};

class AllGatherBaseline : public Baseline {
 public:
  AllGatherBaseline(std::shared_ptr<Nccl> nccl, const OpDescriptor& d, const GpuBuffers& buf)
      : nccl_(std::move(nccl)), d_(d), buf_(buf), recv_(d.dims[dim::kBytes] * d.nranks, "the baseline's output") {}
  void run(cudaStream_t s) override {
    nk(ncclAllGather(buf_.ptrs[slot::kSend], recv_.get(), d_.dims[dim::kBytes], ncclUint8, nccl_->get(), s),
       "ncclAllGather");
  }

 private:
  std::shared_ptr<Nccl> nccl_;
  OpDescriptor d_;
  const GpuBuffers& buf_;
  DeviceMemory recv_;
};
#endif

// The baseline for this run, or null with `note` saying why there is none. Every rank decides alike (the same op,
// shape and device count), so either all of them join NCCL or none.
std::unique_ptr<Baseline> makeBaseline(RankContext& ctx, const GpuBuffers& buf, int devices, std::string* note,
                                       std::string* name) {
#ifndef TANDEM_HAVE_NCCL
  (void)ctx, (void)buf, (void)devices, (void)name;
  *note = "this tandemctl was built without NCCL (nccl.h / libnccl were not found when it was configured)";
  return nullptr;
#else
  const OpDescriptor& d = ctx.desc;
  const uint32_t n = d.nranks;
  const bool gemm = hasGpuReference(d.kind);
  if (!gemm && d.kind != OpKind::kAllGather) {
    *note = fmt::format("no NCCL baseline for {}", opKindName(d.kind));
    return nullptr;
  }
  if (static_cast<int>(n) > devices) {
    *note = fmt::format("NCCL needs a GPU per rank ({} ranks share {} GPU{}); run --compare with --ranks <= {}", n,
                        devices, devices == 1 ? "" : "s", devices);
    return nullptr;
  }
  if (gemm && d.dtype != DType::kBF16) {
    *note = "the cuBLASLt baseline is bf16 only; pass --dtype bf16";
    return nullptr;
  }
  if ((d.kind == OpKind::kAgGemm || d.kind == OpKind::kGemmRs) && d.dims[dim::kM] % n != 0) {
    *note = fmt::format("NCCL's collectives need equal shards: --m {} is not a multiple of --ranks {}", d.dims[dim::kM], n);
    return nullptr;
  }
  auto nccl = std::make_shared<Nccl>(ctx);
  switch (d.kind) {
    case OpKind::kAgGemm:
      *name = "ncclAllGather + cuBLASLt";
      return std::make_unique<AgGemmBaseline>(nccl, d, buf);
    case OpKind::kGemmRs:
      *name = "cuBLASLt + ncclReduceScatter";
      return std::make_unique<GemmReduceBaseline>(nccl, d, buf);
    case OpKind::kGemmAr:
      *name = "cuBLASLt + ncclAllReduce";
      return std::make_unique<GemmReduceBaseline>(nccl, d, buf);
    default:
      *name = "ncclAllGather";
      return std::make_unique<AllGatherBaseline>(nccl, d, buf);
  }
#endif
}

}  // namespace

void runCudaRank(RankContext& ctx) {
  const RunOptions& o = ctx.o;
  const OpSpec& op = *o.op;
  int devices = 0;
  ck(cudaGetDeviceCount(&devices), "cudaGetDeviceCount (is a GPU visible to this process? check CUDA_VISIBLE_DEVICES)");
  // Ranks spread over the visible GPUs in order; with more ranks than GPUs, several share one.
  const int device = static_cast<int>(o.localIndex % static_cast<uint32_t>(devices));
  ck(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device));
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  ctx.result["device"] = {{"ordinal", device}, {"name", prop.name}, {"sms", prop.multiProcessorCount},
                          {"driver", fmt::format("{}.{}", driver / 1000, driver % 1000 / 10)},
                          {"runtime", fmt::format("{}.{}", runtime / 1000, runtime % 1000 / 10)}};
  ctx.join();  // after cudaSetDevice: libtandem binds the communicator to the current device

  Stream stream;
  const cudaStream_t s = stream.get();
  GpuBuffers buf;
  for (int i = 0; i < op.slotCount; ++i) {
    const auto si = static_cast<std::size_t>(i);
    const uint64_t bytes = ctx.desc.bufs[si].bytes;
    if (bytes == 0) continue;
    tandem_buffer_t b = nullptr;
    checkC(tandem_alloc(ctx.session, bytes, &b), fmt::format("allocate {} ({} bytes of GPU memory)", op.slots[si].name, bytes));
    buf.owned.push_back(b);
    buf.tensors[si] = {b, 0};
    buf.ptrs[si] = tandem_buffer_ptr(b);
  }
  fillDevice(ctx.desc, buf.ptrs, o.seed, s);
  ck(cudaStreamSynchronize(s), "fill the inputs");
  const std::span<const tandem_tensor_t> tensors(buf.tensors.data(), op.slotCount);

  const auto barrier = [&](std::vector<tandem_op_t>& ops) {
    const tandem_barrier_args_t args{sizeof args, s};
    tandem_op_t b{};
    checkC(tandem_barrier_stream(ctx.comm, &args, &b), "submit the barrier before an op (tandem_barrier_stream)");
    ops.push_back(b);
  };
  const auto waitAll = [&](std::vector<tandem_op_t>& ops, const std::string& what) {
    ck(cudaStreamSynchronize(s), what);
    for (const tandem_op_t& x : ops) checkC(tandem_wait(x, o.timeoutMs), what);
    ops.clear();
  };

  // The checked op first, on poisoned outputs.
  std::vector<tandem_op_t> pending;
  bool checkOk = true;
  if (o.check) {
    tandem_op_t first{};
    checkC(submit(ctx.comm, ctx.desc, tensors, s, &first), fmt::format("submit {}", op.name));
    pending.push_back(first);
    waitAll(pending, fmt::format("{} (the checked run)", op.name));
    reference::Comparison cmp;
    if (gpuCheckable(ctx.desc) && hostCheckMacs(o) > kHostCheckMacs) {
      ctx.result["check_method"] = "fp32 GPU reference GEMM";
      cmp = checkOnGpu(ctx, buf, s);
    } else {
      ctx.result["check_method"] = "fp64 host reference";
      if (!gpuCheckable(ctx.desc) && hasGpuReference(op.kind) && hostCheckMacs(o) > kHostCheckMacs) {
        ctx.result["check_note"] = "FP8 inputs and the nn and tn layouts are checked on the host (the GPU reference "
                                   "GEMM takes neither), which is slow at this size";
      }
      std::vector<std::vector<std::byte>> host(kMaxOpBuffers);
      std::array<const std::byte*, kMaxOpBuffers> outputs{};
      for (int i = 0; i < op.slotCount; ++i) {
        const auto si = static_cast<std::size_t>(i);
        if (!op.slots[si].output || ctx.desc.bufs[si].bytes == 0) continue;
        host[si].resize(ctx.desc.bufs[si].bytes);
        ck(cudaMemcpy(host[si].data(), buf.ptrs[si], host[si].size(), cudaMemcpyDeviceToHost), "copy an output back");
        outputs[si] = host[si].data();
      }
      cmp = checkOnHost(ctx, outputs);
    }
    ctx.result["check"] = cmp.ok;
    ctx.result["rel_error"] = cmp.relError;
    ctx.result["tolerance"] = cmp.tolerance;
    checkOk = cmp.ok;
    // A mismatch is reported, but the timing still runs: the other ranks' ops and barriers need this rank's.
    if (!cmp.ok) ctx.result["message"] = cmp.detail;
  }

  std::unique_ptr<Baseline> baseline;
  if (o.compare) {
    std::string note, name;
    baseline = makeBaseline(ctx, buf, devices, &note, &name);
    if (baseline) ctx.result["baseline"] = name;
    else ctx.result["baseline_note"] = note;
  }

  // Timing: per iteration a barrier, then the op between two events; with a baseline, the two alternate which goes
  // first. Enqueued ahead in chunks, synchronised once per chunk (progress, and ops waited).
  const uint64_t total = uint64_t{o.warmup} + o.iters;
  const std::size_t methods = baseline ? 2 : 1;
  constexpr uint64_t kChunk = 50;
  Events ev(static_cast<std::size_t>(std::min<uint64_t>(total, kChunk)) * methods * 2);
  std::vector<double> samples, baseSamples;
  for (uint64_t first = 0; first < total; first += kChunk) {
    const uint64_t count = std::min(kChunk, total - first);
    for (uint64_t j = 0; j < count; ++j) {
      const uint64_t it = first + j;
      for (std::size_t k = 0; k < methods; ++k) {
        const std::size_t method = (static_cast<std::size_t>(it) + k) % methods;  // 0 tandem, 1 baseline
        const std::size_t e = (static_cast<std::size_t>(j) * methods + method) * 2;
        barrier(pending);
        ck(cudaEventRecord(ev[e], s), "cudaEventRecord");
        if (method == 0) {
          tandem_op_t x{};
          checkC(submit(ctx.comm, ctx.desc, tensors, s, &x), fmt::format("submit {} #{}", op.name, it + 1));
          pending.push_back(x);
        } else {
          baseline->run(s);
        }
        ck(cudaEventRecord(ev[e + 1], s), "cudaEventRecord");
      }
    }
    waitAll(pending, fmt::format("{} iterations {}..{}", op.name, first + 1, first + count));
    for (uint64_t j = 0; j < count; ++j) {
      if (first + j < o.warmup) continue;
      for (std::size_t method = 0; method < methods; ++method) {
        const std::size_t e = (static_cast<std::size_t>(j) * methods + method) * 2;
        (method == 0 ? samples : baseSamples).push_back(ev.microsBetween(e, e + 1));
      }
    }
    ctx.link.progress(first + count, total);
  }
  putStats(ctx.result, "", samples);
  if (!baseSamples.empty()) putStats(ctx.result, "baseline_", baseSamples);
  ctx.result["timing"] = "CUDA events on the rank's stream, each op after a tandem barrier";
  ctx.result["ok"] = checkOk;
}

}  // namespace tandem::ctl
