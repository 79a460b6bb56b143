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

#include "tandem/kernels/gemm.hpp"  // GemmDtype

namespace tandem::kernels {

/// Which operand is K-major; see the table above.
enum class GemmLayout : uint8_t {
  kABt = 0,  ///< C = A * B^T; A [M, K], B [N, K]: both K-major (the forward GEMM, gemm.hpp's layout)
  kAB = 1,   ///< C = A * B;   A [M, K] K-major, B [K, N] N-major (dgrad)
  kAtB = 2,  ///< C = A^T * B; A [K, M] M-major, B [K, N] N-major (wgrad)
};

/// The type of C.
enum class GemmOut : uint8_t {
  kInput = 0,  ///< the input dtype (bf16 or fp16), rounded to nearest even
  kFp32 = 1,   ///< fp32 (e.g. weight gradients accumulated across micro-batches)
};

/// How a GEMM is tiled.
enum class GemmPath : uint8_t {
  kTiled = 0,   ///< 128 x 256 tiles of C, persistent grid; any layout
  kSwapAB = 1,  ///< small M: C^T = B' * A' with the weight's N as wgmma M (128-row tiles, no padding rows) and the M
                ///< token rows as wgmma N (tileN = 16, 64, 128 or 256); layouts kABt and kAB only
};

/// A plan: the path, its tile width along the wgmma N direction, and the K splits per tile. splits > 1 needs a
/// workspace (gemmLayoutWorkspaceBytes); the partial tiles are summed in split order, so results are bitwise
/// repeatable.
struct GemmLayoutPlan {
  GemmPath path = GemmPath::kTiled;
  int32_t tileN = 256;  ///< kTiled: 256; kSwapAB: 16, 64, 128 or 256 (>= M is one column of tiles)
  int32_t splits = 1;   ///< 1..64 K splits per tile; clamped so that every split gets at least one k-block
};

/// The rule (host logic, no device needed): kSwapAB for M <= 256 in layouts kABt and kAB, tileN 16 for M <= 16, 64
/// for M <= 128 (two column tiles past 64), 128 for M <= 256 (two column tiles past 128); else kTiled. Then K splits,
/// only while there are fewer tiles than SMs: the fewest that fill `numSms` SMs to within 90% of whole waves of work
/// units, keeping at least 4 k-blocks (of 64) per split. numSms: the device's multiprocessor count (132 on H100/H200).
GemmLayoutPlan gemmPlanFor(GemmLayout layout, int64_t m, int64_t n, int64_t k, int numSms);

/// "swapab/n16/split2", "tiled/n256/split1".
std::string gemmPlanName(const GemmLayoutPlan& plan);

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
  // Split-K scratch: partial tiles and one counter per tile. Must be zero-filled once before its first use
  // (cudaMemsetAsync); every launch leaves it zero-filled again. Launches that share a workspace must be ordered
  // (one stream). May be null when the plan has splits == 1.
  void* workspace;
  size_t workspaceBytes;
};

/// Bytes of workspace `plan` needs for these params (0 when plan.splits == 1). 16-byte aligned base required.
size_t gemmLayoutWorkspaceBytes(const GemmLayoutParams& params, const GemmLayoutPlan& plan);

/// The plan launchGemmLayout would use without an explicit one, for the current device.
/// @throws std::runtime_error when no CUDA device is current.
GemmLayoutPlan gemmLayoutDefaultPlan(const GemmLayoutParams& params);

/// Enqueues C = op(A) * op(B) on `stream` with `plan` (nullptr: gemmLayoutDefaultPlan). M or N == 0 enqueues
/// nothing; K == 0 zeroes C. Thread-safe.
/// @throws std::invalid_argument on bad arguments (the message names the field: sizes past 2^31 - 1, strides, null or
///         misaligned pointers, a plan the layout cannot take, a workspace smaller than gemmLayoutWorkspaceBytes);
///         std::runtime_error on a CUDA failure or a non-sm_90 device.
void launchGemmLayout(const GemmLayoutParams& params, cudaStream_t stream, const GemmLayoutPlan* plan = nullptr);

}  // namespace tandem::kernels
