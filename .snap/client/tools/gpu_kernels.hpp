// The device side of `tandemctl run` on GPUs, behind a plain host interface (so that only gpu_kernels.cu goes
// through nvcc): the inputs of inputs.hpp made on the device, the fp32 reference GEMM and the error reductions the
// CUDA benchmarks use (bench/ref_gemm.cuh, bench/bench_kernels.cuh). Every call is asynchronous on `stream` and
// throws std::runtime_error if the launch fails.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/common/descriptor.hpp"

namespace tandem::ctl::gpu {

// p[i] = uniformAt(key, i) (inputs.hpp) for i < count, stored as dtype (bf16, fp16 or fp32).
void fillUniform(void* p, DType dtype, uint64_t count, uint64_t key, cudaStream_t stream);
// p[i] = byteAt(key, i) for i < count.
void fillBytes(void* p, uint64_t count, uint64_t key, cudaStream_t stream);

// c [m, n] (fp32, dense) = (or +=, with accumulate) a [m, k] · b [n, k]ᵀ with row strides lda and ldb, in fp32.
void referenceGemm(const void* a, const void* b, float* c, DType dtype, int m, int n, int k, int64_t lda, int64_t ldb,
                   bool accumulate, cudaStream_t stream);

// Against a dense fp32 ref [m, n]: sums[0] += Σ (out - ref)², sums[1] += Σ ref², *bad += elements where either is not
// finite. out is dtype with row stride ldo. Zero sums and bad first.
void relError(const void* out, DType dtype, int64_t ldo, const float* ref, int64_t m, int64_t n, double* sums,
              unsigned long long* bad, cudaStream_t stream);

}  // namespace tandem::ctl::gpu
