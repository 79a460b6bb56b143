// The fp32 reference GEMM the CUDA benchmarks check against: C[m][n] (+)= sum_k A[m][k] * B[n][k] with bf16 or fp16
// inputs, row strides lda/ldb, 64x64 tiles, 16x16 threads, 4x4 outputs each. Launch with grid
// ((n + 63) / 64, (m + 63) / 64) and block (16, 16). `accumulate`: add to C instead of overwriting it.
#pragma once

#include <cstdint>

#include "bench_kernels.cuh"

namespace tandem::bench {

template <class T>
__global__ void refGemm(const T* a, const T* b, float* c, int m, int n, int k, int64_t lda, int64_t ldb,
                        int accumulate) {
  __shared__ float as[16][65];
  __shared__ float bs[16][65];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int i = tid; i < 64 * 16; i += 256) {
      const int r = i / 16, kk = i % 16;
      as[kk][r] = (m0 + r < m && k0 + kk < k) ? toFloat(a[int64_t(m0 + r) * lda + k0 + kk]) : 0.0f;
      bs[kk][r] = (n0 + r < n && k0 + kk < k) ? toFloat(b[int64_t(n0 + r) * ldb + k0 + kk]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m0 + ty + 16 * i, col = n0 + tx + 16 * j;
      if (r < m && col < n) {
        float* const dst = c + int64_t(r) * n + col;
        *dst = accumulate ? *dst + acc[i][j] : acc[i][j];
      }
    }
}

}  // namespace tandem::bench
