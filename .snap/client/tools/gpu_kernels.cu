#include "gpu_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "bench_kernels.cuh"
#include "inputs.hpp"
#include "ref_gemm.cuh"

namespace tandem::ctl::gpu {
namespace {

void launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Enough blocks to fill an H200 several times over; the grid-stride loops cover any size.
constexpr int kBlocks = 1024, kThreads = 256;

template <class T>
__global__ void fillUniformKernel(T* p, uint64_t count, uint64_t key) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += uint64_t(gridDim.x) * blockDim.x) {
    p[i] = tandem::bench::fromFloat<T>(uniformAt(key, i));
  }
}

__global__ void fillFloatKernel(float* p, uint64_t count, uint64_t key) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += uint64_t(gridDim.x) * blockDim.x) {
    p[i] = uniformAt(key, i);
  }
}

__global__ void fillBytesKernel(uint8_t* p, uint64_t count, uint64_t key) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += uint64_t(gridDim.x) * blockDim.x) {
    p[i] = byteAt(key, i);
  }
}

}  // namespace

void fillUniform(void* p, DType dtype, uint64_t count, uint64_t key, cudaStream_t stream) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kBF16: fillUniformKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(p), count, key); break;
    case DType::kF16: fillUniformKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<__half*>(p), count, key); break;
    case DType::kF32: fillFloatKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<float*>(p), count, key); break;
    default: throw std::runtime_error("fillUniform: dtype is not bf16, fp16 or fp32");
  }
  launched("fill an input on the GPU");
}

void fillBytes(void* p, uint64_t count, uint64_t key, cudaStream_t stream) {
  if (count == 0) return;
  fillBytesKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(p), count, key);
  launched("fill a byte input on the GPU");
}

void referenceGemm(const void* a, const void* b, float* c, DType dtype, int m, int n, int k, int64_t lda, int64_t ldb,
                   bool accumulate, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const dim3 grid((n + 63) / 64, (m + 63) / 64), block(16, 16);
  switch (dtype) {
    case DType::kBF16:
      tandem::bench::refGemm<<<grid, block, 0, stream>>>(static_cast<const __nv_bfloat16*>(a),
                                                        static_cast<const __nv_bfloat16*>(b), c, m, n, k, lda, ldb,
                                                        accumulate ? 1 : 0);
      break;
    case DType::kF16:
      tandem::bench::refGemm<<<grid, block, 0, stream>>>(static_cast<const __half*>(a), static_cast<const __half*>(b),
                                                        c, m, n, k, lda, ldb, accumulate ? 1 : 0);
      break;
    case DType::kF32:
      tandem::bench::refGemm<<<grid, block, 0, stream>>>(static_cast<const float*>(a), static_cast<const float*>(b), c,
                                                        m, n, k, lda, ldb, accumulate ? 1 : 0);
      break;
    default: throw std::runtime_error("referenceGemm: dtype is not bf16, fp16 or fp32");
  }
  launched("the fp32 reference GEMM");
}

void relError(const void* out, DType dtype, int64_t ldo, const float* ref, int64_t m, int64_t n, double* sums,
              unsigned long long* bad, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  switch (dtype) {
    case DType::kBF16:
      tandem::bench::relErrorKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(out), ldo, ref,
                                                                      m, n, sums, bad);
      break;
    case DType::kF16:
      tandem::bench::relErrorKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __half*>(out), ldo, ref, m, n,
                                                                      sums, bad);
      break;
    case DType::kF32:
      tandem::bench::relErrorKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const float*>(out), ldo, ref, m, n,
                                                                      sums, bad);
      break;
    default: throw std::runtime_error("relError: dtype is not bf16, fp16 or fp32");
  }
  launched("the relative-error reduction");
}

}  // namespace tandem::ctl::gpu
