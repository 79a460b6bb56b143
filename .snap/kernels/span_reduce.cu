// Element-wise sums for communicators that span nodes: see tandem/kernels/span_reduce.hpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tandem/kernels/span_reduce.hpp"

namespace tandem::kernels {
namespace {

struct Sources {
  const void* p[kSpanMaxSources];
};

template <SpanElem T>
__device__ __forceinline__ float load(const void* base, int64_t i) {
  if constexpr (T == SpanElem::kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  } else if constexpr (T == SpanElem::kFp16) {
    return __half2float(static_cast<const __half*>(base)[i]);
  } else {
    return static_cast<const float*>(base)[i];
  }
}

template <SpanElem T>
__device__ __forceinline__ void store(void* base, int64_t i, float v) {
  if constexpr (T == SpanElem::kBf16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else if constexpr (T == SpanElem::kFp16) {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

// A block per row (grid-stride over rows), its threads along the row: coalesced, no division per element; memory
// bound, so nothing cleverer pays. __fadd_rn keeps every add a separate, correctly rounded fp32 add in source order
// (nvcc never contracts or reorders it).
template <SpanElem S, SpanElem D>
__global__ void spanSumKernel(Sources src, int count, void* dst, bool accumulate, int64_t rows, int64_t cols,
                              int64_t srcLd, int64_t dstLd) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float acc = 0.0f;
      if constexpr (D == SpanElem::kF32) {
        if (accumulate) acc = static_cast<const float*>(dst)[r * dstLd + c];
      }
      // Unrolled with constant indices: a dynamic index into the parameter struct would copy it to local memory.
#pragma unroll
      for (int j = 0; j < kSpanMaxSources; ++j) {
        if (j < count) acc = __fadd_rn(acc, load<S>(src.p[j], r * srcLd + c));
      }
      store<D>(dst, r * dstLd + c, acc);
    }
  }
}

template <SpanElem S>
cudaError_t launchFor(const SpanSum& s, const Sources& src, dim3 grid, dim3 block, cudaStream_t stream) {
  switch (s.dstType) {
    case SpanElem::kBf16:
      spanSumKernel<S, SpanElem::kBf16><<<grid, block, 0, stream>>>(src, s.count, s.dst, false, s.rows, s.cols,
                                                                      s.srcLd, s.dstLd);
      break;
    case SpanElem::kFp16:
      spanSumKernel<S, SpanElem::kFp16><<<grid, block, 0, stream>>>(src, s.count, s.dst, false, s.rows, s.cols,
                                                                      s.srcLd, s.dstLd);
      break;
    case SpanElem::kF32:
      spanSumKernel<S, SpanElem::kF32><<<grid, block, 0, stream>>>(src, s.count, s.dst, s.accumulate, s.rows, s.cols,
                                                                     s.srcLd, s.dstLd);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launchSpanSum(const SpanSum& s, cudaStream_t stream) {
  if (s.rows <= 0 || s.cols <= 0) return cudaSuccess;
  if (s.count < 1 || s.count > kSpanMaxSources || s.dst == nullptr || s.srcLd < s.cols || s.dstLd < s.cols ||
      (s.accumulate && s.dstType != SpanElem::kF32)) {
    return cudaErrorInvalidValue;
  }
  Sources src{};
  for (int j = 0; j < s.count; ++j) {
    if (s.src[j] == nullptr) return cudaErrorInvalidValue;
    src.p[j] = s.src[j];
  }
  constexpr int64_t kMaxBlocks = 132 * 16;  // enough to fill an H200 several times over; the row loop covers the rest
  const int threads = s.cols >= 512 ? 512 : 256;
  const dim3 grid(static_cast<unsigned>(s.rows < kMaxBlocks ? s.rows : kMaxBlocks)), block(threads);
  switch (s.srcType) {
    case SpanElem::kBf16: return launchFor<SpanElem::kBf16>(s, src, grid, block, stream);
    case SpanElem::kFp16: return launchFor<SpanElem::kFp16>(s, src, grid, block, stream);
    case SpanElem::kF32: return launchFor<SpanElem::kF32>(s, src, grid, block, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tandem::kernels
