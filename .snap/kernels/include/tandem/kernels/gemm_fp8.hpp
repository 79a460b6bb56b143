// Hopper FP8 GEMM core: C [M, N] = A [M, K] * B [N, K]^T with fp8 operands (e4m3, or e5m2 for gradients, per operand),
// fp32 accumulation and bf16 or fp32 output, in two scaling modes:
//
//   kPerTensor  C = (sa * sb) * (A * B^T), sa and sb one fp32 each.
//   kBlock      DeepSeek-V3 style: A scaled per 1 x 128 tile (one row, 128 consecutive k), B per 128 x 128 tile:
//               C[m][n] = sum over k-blocks kb of sa[kb][m] * sb[n / 128][kb] * sum_{k in kb} A[m][k] * B[n][k].
//
// Both operands K-major (each stored row holds K contiguous fp8 bytes): the tensor cores' fp8 wgmma reads K-major
// operands only (no transpose bit for 8-bit types). An operand stored otherwise (e.g. B as [K, N] for dgrad, or a
// transposed activation for wgrad) needs a transpose, which belongs in the producer of that fp8 tensor (the
// quantisation kernel can write either layout). The scales are device pointers, so they can be produced on the GPU in
// the same stream. sm_90a only (wgmma, TMA); kernels/device/gemm_fp8_sm90.cuh has the design.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::kernels {

/// An fp8 encoding (OCP FP8): e4m3 (max 448, no infinities) for weights and activations, e5m2 (max 57344) for
/// gradients.
enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

/// How the fp32 scales apply (see the table above).
enum class Fp8Scaling : uint8_t { kPerTensor = 0, kBlock = 1 };

/// The type of C.
enum class Fp8Out : uint8_t { kBf16 = 0, kFp32 = 1 };

/// The k extent of one block scale (both A's 1 x 128 and B's 128 x 128 tiles).
inline constexpr int64_t kFp8ScaleBlock = 128;

// POD; zero-initialise (GemmFp8Params p{}) and fill.
struct GemmFp8Params {
  Fp8Format aFormat, bFormat;
  Fp8Scaling scaling;
  Fp8Out out;
  const void* a;  // [m, k] fp8, row stride lda bytes; 16-byte aligned
  const void* b;  // [n, k] fp8, row stride ldb bytes; 16-byte aligned
  void* c;        // [m, n], row stride ldc elements; 16-byte aligned; must not overlap a, b or the scales;
                  // its padding columns [n, ldc) are never written
  // kPerTensor: one fp32 each (4-byte aligned), read by the kernel (stream-ordered after whatever wrote them).
  // kBlock: scaleA is [ceil(k / 128), ldsa] fp32, M-major: the scales of k-block kb for rows 0..m-1 are contiguous at
  //   scaleA + kb * ldsa (as DeepGEMM's transposed LHS scales, so that one TMA copy moves a tile's 128 row scales);
  //   16-byte aligned. scaleB is [ceil(n / 128), ceil(k / 128)] fp32, row-major (dense); 4-byte aligned.
  const float* scaleA;
  const float* scaleB;
  int64_t m, n, k;  // k a multiple of 16 (see launchGemmFp8)
  int64_t lda, ldb;  // bytes (= elements): >= k, multiples of 16 (TMA strides)
  int64_t ldc;       // elements: >= n, a multiple of 8 (bf16) or 4 (fp32)
  int64_t ldsa;      // kBlock: scaleA's row stride in floats, >= m and a multiple of 4 (gemmFp8ScaleALd); else unused
};

/// The smallest valid ldsa for m rows: m rounded up to a multiple of 4 (16-byte TMA strides).
constexpr int64_t gemmFp8ScaleALd(int64_t m) { return (m + 3) / 4 * 4; }

/// FP8 operands of a fused GEMM op (AgGemmParams::fp8, GemmRsParams::fp8). With `enabled` set the op's GEMM runs on
/// this core instead of the 16-bit cores: its a and b (and ag-gemm's gathered buffer) hold fp8 bytes, both K-major
/// (layout kABt only), and its C is `out`. The scales are this rank's, laid out as the op table says
/// (common/descriptor.hpp, kFlagFp8BlockScale): kPerTensor one fp32 each; kBlock aScale [ceil(k / 128), rows] M-major
/// with row stride rows (ag-gemm: this rank's shard rows; gemm-rs/ar: m) and bScale [ceil(n / 128), ceil(k / 128)].
/// POD; zero-initialise.
struct Fp8Operands {
  uint8_t enabled;
  Fp8Format aFormat, bFormat;
  Fp8Scaling scaling;
  Fp8Out out;
  const float* aScale;
  const float* bScale;
};

/// Bytes of one element of C.
constexpr int64_t fp8OutBytes(Fp8Out out) { return out == Fp8Out::kFp32 ? 4 : 2; }

/// Enqueues C = A * B^T with the scaling of `params` on `stream`. M or N == 0 enqueues nothing; K == 0 zeroes C.
/// Needs no workspace; results are bitwise repeatable (no split-K, a fixed summation order per element). Thread-safe.
/// K must be a multiple of 16: packed operands (lda = ldb = k) then meet TMA's 16-byte row-stride rule, and the last
/// partial wgmma k-step of 32 is zero-filled by TMA. Other K need padded operands (zeros up to a multiple of 16).
/// @throws std::invalid_argument on bad arguments (the message names the field: formats, sizes past 2^31 - 1, K not a
///         multiple of 16, strides, null or misaligned pointers, C aliasing an input);
///         std::runtime_error on a CUDA failure or a non-sm_90 device.
void launchGemmFp8(const GemmFp8Params& params, cudaStream_t stream);

/// Loads every FP8 core kernel on `device` now and sets its shared-memory size (tandem/kernels/preload.hpp says why:
/// the fused GEMM ops launch it after kernels that wait on peers). Idempotent. @throws std::runtime_error.
void preloadGemmFp8Kernels(int device);

}  // namespace tandem::kernels
