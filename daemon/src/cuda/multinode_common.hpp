// What the three files of a multi-node cuda communicator share (cuda_multinode.hpp says which file runs which path):
// the constants both exchanges keep to, the lookups of a collective's ranks and tensors, and the stream-ordered
// copy, sum and GEMM calls that turn a CUDA or GEMM-core refusal into an Error. Private to those files.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/gpu_exchange_plan.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/span_reduce.hpp"

namespace tandem::daemon::cuda::multinode {

constexpr uint32_t kExchangeTimeoutMs = 60000;  // as the cpu backend's: a peer daemon alive but sending nothing
constexpr uint64_t kAlign = 256;                // workspace sub-buffers start on 256 bytes

using RowRuns = std::vector<std::pair<uint64_t, uint64_t>>;  // (first row, rows)

inline uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The ranks of `c` on node `node`, ascending.
inline std::vector<uint32_t> ranksOn(const Collective& c, uint32_t node) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < c.ops.size(); ++r) {
    if (c.nodeOfRank[r] == node) out.push_back(r);
  }
  return out;
}

// The ranks of `c` on this node, ascending: the first is the lead (its GPU sums and exchanges for the node).
inline std::vector<uint32_t> localRanksOf(const Collective& c) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < c.ops.size(); ++r) {
    if (c.ops[r].local()) out.push_back(r);
  }
  return out;
}

// Slot `s` of local rank op `op` in tandemd's address space; null when absent.
inline std::byte* slotPtr(const PendingOp& op, int s) {
  const auto i = static_cast<std::size_t>(s);
  if (!op.buffers[i] || op.desc.bufs[i].bytes == 0) return nullptr;
  return resolveDevice(*op.buffers[i], op.desc.bufs[i].offset);
}

inline kernels::SpanElem spanElem(DType d) {
  switch (d) {
    case DType::kBF16: return kernels::SpanElem::kBf16;
    case DType::kF16: return kernels::SpanElem::kFp16;
    default: return kernels::SpanElem::kF32;
  }
}

inline void copyAsync(void* dst, const void* src, uint64_t bytes, cudaStream_t s, const char* what) {
  if (bytes == 0) return;
  kernels::checkCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync({})", what);
}

inline void syncStream(int device, cudaStream_t s, const char* what) {
  kernels::CudaDeviceGuard guard(device);
  kernels::checkCuda(cudaStreamSynchronize(s), "cudaStreamSynchronize({})", what);
}

inline void sum(const kernels::SpanSum& p, cudaStream_t s, const char* what) {
  kernels::checkCuda(kernels::launchSpanSum(p, s), "span sum ({})", what);
}

// A GEMM op's layout in the plan lines: nothing for NT (the forward), " layout nn" / " layout tn" otherwise.
inline std::string layoutSuffix(GemmOperands layout) {
  return layout == GemmOperands::kNT ? std::string() : fmt::format(" layout {}", gemmLayoutName(layout));
}

// One GEMM: C[rows, cols] (row stride ldc) = op(A) · op(B) in `layout` (descriptor.hpp's operands, row strides lda and
// ldb in elements), on `stream` (its device current). 16-bit NT runs on the forward core (launchGemm), NN and TN on the
// layouts core without a split-K workspace (so every result is bitwise repeatable); FP8 inputs (NT only) on the FP8
// core with their scales (block scales: scaleA [ceil(k/128), ldsa]) and C in `out` (bf16 or fp32). A launch's
// std::runtime_error becomes Error(kCuda): past the checks of fallbackReason only CUDA itself refuses a launch, and the
// node must then leave the communicator.
struct GemmCall {
  GemmOperands layout = GemmOperands::kNT;
  DType dtype = DType::kBF16;
  const std::byte* a = nullptr;
  const std::byte* b = nullptr;
  std::byte* c = nullptr;
  uint64_t rows = 0, cols = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  // FP8 inputs only.
  DType out = DType::kBF16;
  bool blockScale = false;
  const float* scaleA = nullptr;
  const float* scaleB = nullptr;
  uint64_t ldsa = 0;
};

inline void gemm(const GemmCall& g, cudaStream_t stream, const char* what) {
  auto fill = [&g](auto& p) {  // the fields every core's params share
    p.a = g.a;
    p.b = g.b;
    p.c = g.c;
    p.m = static_cast<int64_t>(g.rows);
    p.n = static_cast<int64_t>(g.cols);
    p.k = static_cast<int64_t>(g.k);
    p.lda = static_cast<int64_t>(g.lda);
    p.ldb = static_cast<int64_t>(g.ldb);
    p.ldc = static_cast<int64_t>(g.ldc);
  };
  const auto dt = g.dtype == DType::kF16 ? kernels::GemmDtype::kFp16 : kernels::GemmDtype::kBf16;
  try {
    if (isFp8(g.dtype)) {
      kernels::GemmFp8Params p{};
      fill(p);
      p.aFormat = p.bFormat = g.dtype == DType::kF8E5M2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
      p.scaling = g.blockScale ? kernels::Fp8Scaling::kBlock : kernels::Fp8Scaling::kPerTensor;
      p.out = g.out == DType::kF32 ? kernels::Fp8Out::kFp32 : kernels::Fp8Out::kBf16;
      p.scaleA = g.scaleA;
      p.scaleB = g.scaleB;
      p.ldsa = static_cast<int64_t>(g.ldsa);
      kernels::launchGemmFp8(p, stream);
    } else if (g.layout == GemmOperands::kNT) {
      kernels::GemmParams p{};
      fill(p);
      p.dtype = dt;
      kernels::launchGemm(p, stream);
    } else {
      kernels::GemmLayoutParams p{};
      fill(p);
      p.dtype = dt;
      p.layout = g.layout == GemmOperands::kNN ? kernels::GemmLayout::kAB : kernels::GemmLayout::kAtB;
      p.out = kernels::GemmOut::kInput;
      const kernels::GemmLayoutPlan plan = kernels::gemmLayoutPlanWithin(p);  // no workspace: no K splits
      kernels::launchGemmLayout(p, stream, &plan);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ErrorCode::kCuda, "{}GEMM core ({}): {}", isFp8(g.dtype) ? "FP8 " : "", what, e.what());
  }
}

// ag-gemm with FP8 inputs: where each rank's A scales go in a local rank's scales region, n + 1 offsets (the last is
// the region's size). Rank q's take 16 bytes per tensor, or [ceil(k/128), ldsa] block scales with ldsa its rows
// rounded up to 4 (gemm_fp8.hpp's gemmFp8ScaleALd): every start 16-byte aligned, as the FP8 core reads them.
inline std::vector<uint64_t> agScaleOffsets(const OpDescriptor& d, uint32_t n) {
  const bool block = (d.flags & kFlagFp8BlockScale) != 0;
  const uint64_t m = d.dims[dim::kM], kBlocks = (d.dims[dim::kK] + 127) / 128;
  std::vector<uint64_t> off{0};
  for (uint32_t q = 0; q < n; ++q) {
    const auto ldsa = static_cast<uint64_t>(kernels::gemmFp8ScaleALd(static_cast<int64_t>(rowsOf(m, q, n))));
    off.push_back(off.back() + (block ? kBlocks * ldsa * sizeof(float) : 16));
  }
  return off;
}

// Contiguous row runs [first, first + rows) of the ranks that are (local) or are not (!local) on this node.
inline RowRuns rowRuns(const Collective& c, uint64_t m, bool local) {
  const auto n = static_cast<uint32_t>(c.ops.size());
  std::vector<uint32_t> ranks;
  for (uint32_t r = 0; r < n; ++r) {
    if (c.ops[r].local() == local) ranks.push_back(r);
  }
  return rowRunsOf(m, n, ranks);
}

// A host thread's wait between polls of the GPU or the proxy: yields for the first 2048 spins, then sleeps 20 us.
inline void backoff(uint32_t spins) {
  if (spins < 2048) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// The staged exchange's payload check (multinode_staged.cpp), made before the op starts on every node alike: throws
// Error(kInvalidArgument) naming cluster.staging_bytes when a node would send another more than a CommLink slot holds.
void checkStaging(const Collective& c);

// Tensors the GEMM core cannot take in place (not 16-byte aligned) on the GPU exchange, where a node-local fact must
// not change the path: an input is copied aside before the GEMM reads it, an output is computed aside and copied back
// after (flush). Stream-ordered memory on the stream of the GEMM that uses it (no device-wide synchronisation, which a
// spinning exchange kernel of another communicator could hold up), freed on that stream.
class Aside {
 public:
  Aside() = default;
  Aside(const Aside&) = delete;
  Aside& operator=(const Aside&) = delete;
  ~Aside();
  // `p` itself when null or aligned, else an aligned copy of its `bytes`, queued on `s` (device `dev`).
  const std::byte* input(int dev, cudaStream_t s, const std::byte* p, uint64_t bytes);
  // `p` itself when null or aligned, else aligned memory of `bytes` that flush() copies to `p`.
  std::byte* output(int dev, cudaStream_t s, std::byte* p, uint64_t bytes);
  // The outputs' copies back, each on its stream after what was queued there before.
  void flush();

 private:
  struct Block {
    int dev;
    cudaStream_t stream;
    std::byte* mem;
    std::byte* back;  // an output's home; null for an input
    uint64_t bytes;
  };
  std::byte* allocate(int dev, cudaStream_t s, uint64_t bytes, std::byte* back);
  std::vector<Block> blocks_;
};

}  // namespace tandem::daemon::cuda::multinode
