// Device helpers the CUDA benchmarks share: random inputs, and the relative error of an output against a reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>

namespace tandem::bench {

__device__ __forceinline__ float toFloat(float v) { return v; }
__device__ __forceinline__ float toFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float toFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float toFloat(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

template <class T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) { return __float2half_rn(v); }

// A 64-bit finaliser (splitmix / murmur3): a different, well-spread value for every (index, seed).
__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Uniform in [-1, 1), never all zeros; the padding columns of a strided matrix get values too.
template <class T>
__global__ void fillUniform(T* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix(i * 0x9E3779B97F4A7C15ULL + seed);
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    p[i] = fromFloat<T>(2.0f * u - 1.0f);
  }
}

// out [m, n] with row stride ldo against a dense ref [m, n]: sums[0] += Σ (out - ref)², sums[1] += Σ ref², bad += the
// elements where either is not finite (poison an op left behind shows up here). Zero sums and bad before; the
// relative error is sqrt(sums[0] / sums[1]).
template <class T, class R>
__global__ void relErrorKernel(const T* out, int64_t ldo, const R* ref, int64_t m, int64_t n, double* sums,
                               unsigned long long* bad) {
  double e = 0, r = 0;
  unsigned long long nb = 0;
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const float o = toFloat(out[(i / n) * ldo + i % n]);
    const float f = toFloat(ref[i]);
    if (!isfinite(o) || !isfinite(f)) {
      ++nb;
      continue;
    }
    const double d = double(o) - double(f);
    e += d * d;
    r += double(f) * double(f);
  }
  for (int off = 16; off > 0; off /= 2) {
    e += __shfl_down_sync(0xffffffffu, e, off);
    r += __shfl_down_sync(0xffffffffu, r, off);
    nb += __shfl_down_sync(0xffffffffu, nb, off);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sums[0], e);
    atomicAdd(&sums[1], r);
    if (nb) atomicAdd(bad, nb);
  }
}

// Random e4m3 bytes (Byte: uint8_t) of magnitudes 2^-4 .. 2^5 (exponent field 3..11): both signs, every mantissa,
// never NaN or zero-only. This and fillScales are templates so that several units of one program can include this
// header.
template <class Byte>
__global__ void fillFp8(Byte* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix(i * 0x9E3779B97F4A7C15ULL + seed);
    p[i] = static_cast<Byte>(((h >> 12) & 1) << 7) | static_cast<Byte>((3 + h % 9) << 3) |
           static_cast<Byte>((h >> 8) & 7);
  }
}

// FP8 scales (F: float): `value` everywhere when value > 0, else log-uniform in [2^-3, 2^3].
template <class F>
__global__ void fillScales(F* p, size_t n, uint64_t seed, F value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix(i * 0x9E3779B97F4A7C15ULL + seed) >> 40) * (1.0f / 16777216.0f);
    p[i] = value > 0 ? value : exp2f(6.0f * u - 3.0f);
  }
}

}  // namespace tandem::bench
