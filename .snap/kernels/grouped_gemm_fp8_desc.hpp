// The FP8 grouped GEMM's kernel parameters and raw launch entry points: plain data shared by the host launcher
// (grouped_gemm_fp8.cpp, g++) and the kernels (grouped_gemm_fp8.cu, nvcc). Private to the kernels library; the public
// API is tandem/kernels/grouped_gemm_fp8.hpp.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "grouped_gemm_desc.hpp"
#include "tandem/kernels/grouped_gemm.hpp"

namespace tandem::kernels::grouped_fp8 {

inline constexpr int kBlockK = 128;  // gemm_fp8::kBlockK: one k-block is one scale block
// gemm_fp8::kScaleABoxRows: a tile's 128 row scales plus 4, loaded from the multiple of 4 at or below its first row
// (a box's first element must be 16-byte aligned in global memory).
inline constexpr int kScaleABoxRows = 132;

// POD, passed as const __grid_constant__. `g` is the 16-bit kernels' parameter block, whose tile-order fields (group
// offsets, tilesN, groupM, waits, tile counter) the shared scheduler reads as they are; its maps hold fp8 tensors:
//   g.tmX    x [mTotal, k] e4m3: dims {k, mTotal}, box {128, 128}, 128B swizzle
//   g.tmW    kStore: w [E, n, k] as {k, n, E}, box {128, 256, 1}; kSwiGlu: {k, f, 2, E}, box {128, 128, 1, 1}
//   g.tmOut  kStore: out bf16 {n, mTotal}, box {64, 64}; kSwiGlu: h e4m3 {f, mTotal}, box {128, 64}; 128B swizzle
// and g.numKBlocks counts k-blocks of 128.
struct GroupedGemmFp8KernelParams {
  grouped::GroupedGemmKernelParams g;
  CUtensorMap tmXScale;  // xScale [k-blocks, ldxScale] fp32: dims {mTotal, k-blocks}, box {132, 1}, no swizzle
  const float* wScale;   // see GroupedGemmFp8Params::wScale
  float* outScale;       // kSwiGlu: [ceil(f / 128), ldOutScale]
  int64_t ldOutScale;
  int64_t wScaleExpert;    // floats between experts' scales: ceil(n / 128) * numKBlocks (kBlock) or 1
  int32_t wScaleRowBlock;  // floats between 128-row blocks: numKBlocks (kBlock) or 0
  int32_t wScaleKStep;     // floats between k-blocks: 1 (kBlock) or 0
  int32_t f;               // kSwiGlu: n / 2 (the up half's first row)
  int32_t pad0[7];
};
static_assert(sizeof(GroupedGemmFp8KernelParams) % 64 == 0);

// Dynamic shared memory the kernels take.
size_t groupedGemmFp8SmemBytes();
// Raises the dynamic shared-memory limit of the epilogue's kernel on the current device and loads it.
cudaError_t groupedGemmFp8Prepare(GroupedGemmEpilogue epi);
// Enqueues the epilogue's persistent kernel with `ctas` CTAs.
cudaError_t groupedGemmFp8LaunchKernel(const GroupedGemmFp8KernelParams& p, GroupedGemmEpilogue epi, int ctas,
                                       cudaStream_t stream);

}  // namespace tandem::kernels::grouped_fp8
