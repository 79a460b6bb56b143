// The fp32 reference GEMM the CUDA benchmarks check against: C[m][n] (+)= sum_k A[m][k] * B[n][k] with bf16 or fp16
// inputs, row strides lda/ldb, 64x64 tiles, 16x16 threads, 4x4 outputs each. Launch with grid
// ((n + 63) / 64, (m + 63) / 64) and block (16, 16). `accumulate`: add to C instead of overwriting it.
#pragma once

#include <cstdint>

#include "bench_kernels.cuh"

namespace tandem::bench {

// The tile loop of both kernels below: A(i, kk) = a[i * sam + kk * sak], B(kk, j) = b[kk * sbk + j * sbn], fp32
// products summed in k order; c [m, n] dense.
template <class T>
__device__ __forceinline__ void refGemmTile(const T* a, int64_t sam, int64_t sak, const T* b, int64_t sbk, int64_t sbn,
                                            float* c, int m, int n, int k, int accumulate) {
  __shared__ float as[16][65];
  __shared__ float bs[16][65];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int i = tid; i < 64 * 16; i += 256) {
      // Consecutive threads walk the operand's contiguous direction, so both layouts load coalesced.
      const int r = sak == 1 ? i / 16 : i % 64, kk = sak == 1 ? i % 16 : i / 64;
      as[kk][r] = (m0 + r < m && k0 + kk < k) ? toFloat(a[int64_t(m0 + r) * sam + int64_t(k0 + kk) * sak]) : 0.0f;
      const int col = sbk == 1 ? i / 16 : i % 64, kb = sbk == 1 ? i % 16 : i / 64;
      bs[kb][col] = (n0 + col < n && k0 + kb < k) ? toFloat(b[int64_t(k0 + kb) * sbk + int64_t(n0 + col) * sbn]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(as[kk][ty + 16 * i], bs[kk][tx + 16 * j], acc[i][j]);
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

template <class T>
__global__ void refGemm(const T* a, const T* b, float* c, int m, int n, int k, int64_t lda, int64_t ldb,
                        int accumulate) {
  refGemmTile(a, lda, 1, b, 1, ldb, c, m, n, k, accumulate);
}

// Any layout: A(i, kk) = a[i * sam + kk * sak], B(kk, j) = b[kk * sbk + j * sbn] (one of each pair 1); ref [m, n]
// dense, overwritten. Same grid and block as refGemm.
template <class T>
__global__ void refGemmStrided(const T* a, int64_t sam, int64_t sak, const T* b, int64_t sbk, int64_t sbn, float* ref,
                               int m, int n, int k) {
  refGemmTile(a, sam, sak, b, sbk, sbn, ref, m, n, k, 0);
}

}  // namespace tandem::bench
