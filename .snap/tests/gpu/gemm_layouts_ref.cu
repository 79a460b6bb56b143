// Random inputs and the fp32 reference GEMM of the layout GEMM test (gemm_layouts_ref.hpp): the CUDA benchmarks'
// (bench/bench_kernels.cuh, bench/ref_gemm.cuh), plain fp32 FMAs without tensor cores, so they share nothing with the
// kernels under test.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench_kernels.cuh"
#include "gemm_layouts_ref.hpp"
#include "ref_gemm.cuh"

namespace tandem::gputest {

using bench::fillUniform;
using bench::refGemmStrided;

void fillRandom16(void* p, size_t count, kernels::GemmDtype dtype, uint64_t seed, cudaStream_t stream) {
  if (dtype == kernels::GemmDtype::kFp16) {
    fillUniform<__half><<<1024, 256, 0, stream>>>(static_cast<__half*>(p), count, seed);
  } else {
    fillUniform<__nv_bfloat16><<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), count, seed);
  }
}

void referenceGemm(kernels::GemmLayout layout, kernels::GemmDtype dtype, const void* a, int64_t lda, const void* b,
                   int64_t ldb, float* ref, int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  using kernels::GemmLayout;
  // A [m, k] (kABt, kAB) or [k, m] (kAtB); B [n, k] (kABt) or [k, n] (kAB, kAtB).
  const int64_t sam = layout == GemmLayout::kAtB ? 1 : lda;
  const int64_t sak = layout == GemmLayout::kAtB ? lda : 1;
  const int64_t sbk = layout == GemmLayout::kABt ? 1 : ldb;
  const int64_t sbn = layout == GemmLayout::kABt ? ldb : 1;
  const dim3 grid(static_cast<unsigned>((n + 63) / 64), static_cast<unsigned>((m + 63) / 64));
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  if (dtype == kernels::GemmDtype::kFp16) {
    refGemmStrided<__half><<<grid, dim3(16, 16), 0, stream>>>(static_cast<const __half*>(a), sam, sak,
                                                              static_cast<const __half*>(b), sbk, sbn, ref, mi, ni, ki);
  } else {
    refGemmStrided<__nv_bfloat16><<<grid, dim3(16, 16), 0, stream>>>(static_cast<const __nv_bfloat16*>(a), sam, sak,
                                                                     static_cast<const __nv_bfloat16*>(b), sbk, sbn,
                                                                     ref, mi, ni, ki);
  }
}

}  // namespace tandem::gputest
