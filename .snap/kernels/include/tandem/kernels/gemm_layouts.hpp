// Hopper GEMM core in the three operand layouts of a training step, plus its small-M (decode) path.
//
// All matrices are row-major with a row stride in elements; fp32 accumulation; bf16 or fp16 in; C in the input type
// or fp32. sm_90a only (wgmma, TMA). kernels/device/gemm_layouts_sm90.cuh has the design.
//
//   layout            C [M, N] =   A stored as          B stored as          BLAS (row-major) name / use
//   kABt              A * B^T      [M, K] (K-major)     [N, K] (K-major)     "NT": forward, Y = X * W^T
//   kAB               A * B        [M, K] (K-major)     [K, N] (N-major)     "NN": dgrad, dX = dY * W
//   kAtB              A^T * B      [K, M] (M-major)     [K, N] (N-major)     "TN": wgrad, dW = dY^T * X
//
// "K-major": each stored row holds K contiguous elements (the stride runs along M or N); "M-/N-major": each stored row
// is one k and holds M (or N) contiguous elements.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tandem/kernels/gemm.hpp"               // GemmDtype
#include "tandem/kernels/gemm_layouts_plan.hpp"  // GemmLayout, GemmPath, GemmLayoutPlan, gemmPlanFor

namespace tandem::kernels {

/// The type of C.
enum class GemmOut : uint8_t {
  kInput = 0,  ///< the input dtype (bf16 or fp16), rounded to nearest even
  kFp32 = 1,   ///< fp32 (e.g. weight gradients accumulated across micro-batches)
};

// POD; zero-initialise (GemmLayoutParams p{}) and fill.
struct GemmLayoutParams {
  GemmLayout layout;
  GemmDtype dtype;  // of A and B
  GemmOut out;      // of C
  const void* a;    // as the layout says; 16-byte aligned
  const void* b;    // as the layout says; 16-byte aligned
  void* c;          // [m, n]; 16-byte aligned; must not overlap a, b or the workspace
  int64_t m, n, k;
  // Row strides in elements of the matrices as stored: each >= that matrix's row length (k, m or n, by layout), and
  // a multiple of 8 (16-byte TMA strides; 4 suffices for an fp32 C).
  int64_t lda, ldb, ldc;
  // Split-K scratch: a fixed area of kGemmLayoutMaxSplitTiles arrival counters at its start, then the partial tiles.
  // Must be zero-filled once before its first use (cudaMemsetAsync); every launch leaves the counter area zero again
  // and writes each partial tile before reading it, so launches of any plans and shapes may share one workspace.
  // Launches that share a workspace must be ordered (one stream). May be null when the plan has splits == 1.
  void* workspace;
  size_t workspaceBytes;
};

/// Bytes of workspace `plan` needs for these params (0 when it runs without K splits). 16-byte aligned base required.
size_t gemmLayoutWorkspaceBytes(const GemmLayoutParams& params, const GemmLayoutPlan& plan);

/// The plan launchGemmLayout would use without an explicit one, for the current device.
/// @throws std::runtime_error when no CUDA device is current.
GemmLayoutPlan gemmLayoutDefaultPlan(const GemmLayoutParams& params);

/// gemmLayoutDefaultPlan with its K splits cut to what params.workspace holds (params.workspaceBytes; none when the
/// workspace is null): for callers with a fixed scratch area. The result stays bitwise repeatable for a given shape and
/// workspace size. @throws std::runtime_error when no CUDA device is current.
GemmLayoutPlan gemmLayoutPlanWithin(const GemmLayoutParams& params);

/// Loads every kernel variant on `device` now (tandem/kernels/preload.hpp says why); cheap after the first call.
/// @throws std::runtime_error if loading fails.
void preloadGemmLayoutKernels(int device);

/// Enqueues C = op(A) * op(B) on `stream` with `plan` (nullptr: gemmLayoutDefaultPlan). M or N == 0 enqueues
/// nothing; K == 0 zeroes C. Thread-safe.
/// @throws std::invalid_argument on bad arguments (the message names the field: sizes past 2^31 - 1, strides, null or
///         misaligned pointers, a plan the layout cannot take, a workspace smaller than gemmLayoutWorkspaceBytes);
///         std::runtime_error on a CUDA failure or a non-sm_90 device.
void launchGemmLayout(const GemmLayoutParams& params, cudaStream_t stream, const GemmLayoutPlan* plan = nullptr);

}  // namespace tandem::kernels
