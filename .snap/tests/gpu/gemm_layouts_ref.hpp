// Device helpers of the layout GEMM test (gemm_layouts_ref.cu): random inputs and an fp32 reference GEMM in any
// layout. Plain host API so the doctest file compiles with the host compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/gemm_layouts.hpp"

namespace tandem::gputest {

/// Fills `count` 16-bit elements (bf16 or fp16 by dtype) at `p` with uniform values in [-1, 1) from `seed`.
void fillRandom16(void* p, size_t count, kernels::GemmDtype dtype, uint64_t seed, cudaStream_t stream);

/// ref [m, n] (dense fp32) = op(A) * op(B) for `layout`, A and B as launchGemmLayout takes them (row strides lda, ldb),
/// fp32 products and sums in k order.
void referenceGemm(kernels::GemmLayout layout, kernels::GemmDtype dtype, const void* a, int64_t lda, const void* b,
                   int64_t ldb, float* ref, int64_t m, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace tandem::gputest
