// Random inputs and the fp32 reference GEMM of the layout GEMM test (gemm_layouts_ref.hpp). Deliberately simple: one
// thread per output element, no tensor cores, so that it shares nothing with the kernels under test.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "gemm_layouts_ref.hpp"

namespace tandem::gputest {
namespace {

__device__ __forceinline__ float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float toF(__half v) { return __half2float(v); }

__device__ __forceinline__ uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

template <class T>
__global__ void fillKernel(T* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix(i * 0x9E3779B97F4A7C15ULL + seed) >> 40) * (1.0f / 16777216.0f);
    if constexpr (std::is_same_v<T, __half>) {
      p[i] = __float2half_rn(2.0f * u - 1.0f);
    } else {
      p[i] = __float2bfloat16_rn(2.0f * u - 1.0f);
    }
  }
}

// A(i, kk) = a[i * sam + kk * sak], B(kk, j) = b[kk * sbk + j * sbn].
template <class T>
__global__ void refKernel(const T* a, int64_t sam, int64_t sak, const T* b, int64_t sbk, int64_t sbn, float* ref,
                          int64_t m, int64_t n, int64_t k) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t i = blockIdx.y;
  if (j >= n || i >= m) return;
  float acc = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk) acc = fmaf(toF(a[i * sam + kk * sak]), toF(b[kk * sbk + j * sbn]), acc);
  ref[i * n + j] = acc;
}

}  // namespace

void fillRandom16(void* p, size_t count, kernels::GemmDtype dtype, uint64_t seed, cudaStream_t stream) {
  if (dtype == kernels::GemmDtype::kFp16) {
    fillKernel<__half><<<1024, 256, 0, stream>>>(static_cast<__half*>(p), count, seed);
  } else {
    fillKernel<__nv_bfloat16><<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), count, seed);
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
  const dim3 grid(static_cast<unsigned>((n + 127) / 128), static_cast<unsigned>(m));
  if (dtype == kernels::GemmDtype::kFp16) {
    refKernel<__half><<<grid, 128, 0, stream>>>(static_cast<const __half*>(a), sam, sak, static_cast<const __half*>(b),
                                                sbk, sbn, ref, m, n, k);
  } else {
    refKernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(a), sam, sak,
                                                       static_cast<const __nv_bfloat16*>(b), sbk, sbn, ref, m, n, k);
  }
}

}  // namespace tandem::gputest
