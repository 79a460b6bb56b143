// The element-wise sums of communicators that span nodes (tandemd's cuda_multinode.cpp): a node's partial products
// summed in rank order, node partials added in node order, and the one rounding to the output dtype. fp32 math, the
// sources added strictly in the order given (no reassociation, no FMA), so a sum is bitwise the same wherever and
// however often it runs, and bitwise the same as the cpu backend's loop over the same fp32 values.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::kernels {

enum class SpanElem : uint8_t { kBf16 = 0, kFp16 = 1, kF32 = 2 };

inline constexpr int kSpanMaxSources = 8;

// POD; zero-initialise and fill. dst[r][c] = (accumulate ? dst[r][c] : 0.0f) + src[0][r][c] + ... + src[count-1][r][c],
// in that order, in fp32, then converted to dstType (round to nearest even). Sources share srcType and srcLd.
struct SpanSum {
  const void* src[kSpanMaxSources];
  int32_t count;  // 1..kSpanMaxSources
  SpanElem srcType;
  void* dst;      // may be one of the sources only when it is the only one and the types match (in place)
  SpanElem dstType;
  bool accumulate;  // dst is fp32 and holds the running sum (its earlier terms come first)
  int64_t rows, cols;
  int64_t srcLd, dstLd;  // elements
};

// Enqueues the sum on `stream`; rows or cols == 0 enqueues nothing. Returns the launch's error (cudaSuccess, or
// cudaErrorInvalidValue for a malformed SpanSum) for the caller's check.
cudaError_t launchSpanSum(const SpanSum& s, cudaStream_t stream);

}  // namespace tandem::kernels
