// Hopper GEMM core: C[M, N] = A[M, K] * B[N, K]^T (both K-major, row-major storage), fp32 accumulation.
// bf16 or fp16 in; C has the input type. sm_90a only (wgmma, TMA); see kernels/device/gemm_sm90.cuh for the design.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::kernels {

enum class GemmDtype : uint8_t { kBf16 = 0, kFp16 = 1 };

// POD; zero-initialise (GemmParams p{}) and fill. Tuning fields left at 0 take the measured defaults.
struct GemmParams {
  const void* a;  // [m, k], row stride lda elements; 16-byte aligned
  const void* b;  // [n, k], row stride ldb elements; 16-byte aligned
  void* c;        // [m, n], row stride ldc elements; 16-byte aligned; must not alias a or b
  int64_t m, n, k;
  int64_t lda, ldb, ldc;  // elements; multiples of 8 (16-byte TMA strides); lda, ldb >= k, ldc >= n
  GemmDtype dtype;
  // Tuning (0 = default).
  int32_t groupM;    // raster group height in 128-row tiles (L2 reuse)
  int32_t clusterM;  // 1, or 2: two CTAs along M share the B tile through TMA multicast
  int32_t epilogue;  // 1: TMA store through shared memory, 2: direct masked global stores
};

// Enqueues the GEMM on `stream`. numSms > 0 caps the persistent grid (for running next to communication kernels);
// 0 uses every SM. Throws std::runtime_error, with the reason, on bad arguments (k not a multiple of 8, bad strides,
// misaligned or null pointers, sizes past 2^31 - 1) or a CUDA failure; M or N == 0 enqueues nothing, K == 0 zeroes C.
// Thread-safe. The TMA descriptors are cached per (pointer, shape, stride).
void launchGemm(const GemmParams& params, cudaStream_t stream, int numSms = 0);

// The configuration launchGemm resolves for these params (defaults filled in), e.g. "cluster2/tma/group16".
const char* gemmConfigName(const GemmParams& params);

}  // namespace tandem::kernels
