// The grouped TN GEMM (MoE weight gradients): kernel parameters and raw launch entry points, plain data shared by the
// host launcher (grouped_gemm_wgrad.cpp, g++) and the kernels (grouped_gemm_wgrad.cu, nvcc). Private to the kernels
// library; the public API is tandem/kernels/grouped_gemm_wgrad.hpp, the device code device/grouped_gemm_wgrad_sm90.cuh.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing links libcuda)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_layouts.hpp"

namespace tandem::kernels::grouped_wgrad {

// Output tile: 128 rows of out[e] (a's columns: wgmma M, two consumer warpgroups of 64) x 256 columns (b's columns:
// wgmma N). K (the group's rows) is walked in blocks of 64 rows, both operands MN-major.
inline constexpr int kTileRows = 128;
inline constexpr int kTileCols = 256;
inline constexpr int kBlockRows = 64;  // group rows per k-block: one 64 x 64 TMA box of a and of b per 64 columns
inline constexpr int kBox = 64;        // the {64 columns, 64 rows} box of a and b (MN-major, 128-byte swizzle)
inline constexpr int kOutBoxRows = 64;  // TMA-store chunk rows: one consumer warpgroup's rows
inline constexpr int kRasterRows = 16;  // raster group height in row tiles inside one expert (L2 reuse of b's slices)

// POD, passed as const __grid_constant__ (the tensor maps live in param space).
struct WgradKernelParams {
  CUtensorMap tmA;    // a [mTotal, m]: dims {m, mTotal}, box {64, 64}, 128B swizzle (wgmma A, MN-major)
  CUtensorMap tmB;    // b [mTotal, n]: dims {n, mTotal}, box {64, 64}, 128B swizzle (wgmma B, MN-major)
  CUtensorMap tmOut;  // out [E, m, n]: dims {n, m, E}, box {128 bytes of elements, 64, 1}, 128B swizzle
  const int32_t* groupOffsets;  // numExperts + 1 row offsets, read on the device
  int32_t mTotal;
  int32_t m, n;
  int32_t numExperts;
  int32_t tilesM, tilesN;  // tiles of one expert's out: ceil(m / 128) x ceil(n / 256)
  int32_t rasterRows;
  const int32_t* runIf;  // optional: the kernel writes nothing unless *runIf == runValue
  int32_t runValue;
  int32_t reserved[4];
};
static_assert(sizeof(WgradKernelParams) % 64 == 0);

// A kernel variant: input dtype x output type.
struct WgradVariant {
  GemmDtype dtype;
  GemmOut out;
};

// Dynamic shared memory the kernels take.
size_t wgradSmemBytes();
// Raises the dynamic shared-memory limit of the variant's kernel on the current device and loads it.
cudaError_t wgradPrepare(WgradVariant v);
// Enqueues the variant's persistent kernel with `ctas` CTAs (gemm_layouts::kThreads each).
cudaError_t wgradLaunchKernel(const WgradKernelParams& p, WgradVariant v, int ctas, cudaStream_t stream);

}  // namespace tandem::kernels::grouped_wgrad
