// The grouped GEMM's swap-AB (small groups) path: kernel parameters and raw launch entry points, plain data shared by
// the host launcher (grouped_gemm_swap.cpp, g++) and the kernels (grouped_gemm_swap.cu, nvcc). Private to the kernels
// library; the public API is tandem/kernels/grouped_gemm.hpp, the device code device/grouped_gemm_swap_sm90.cuh.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing links libcuda)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/grouped_gemm_plan.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels::grouped_swap {

// Weight rows one tile covers (wgmma M: two consumer warpgroups of 64), and the output columns that makes: kStore
// 128 columns of out; kSwiGlu 64 gate rows and their 64 up rows, so 64 columns of h.
inline constexpr int kWeightTileRows = 128;
inline constexpr int kStoreTileCols = 128;
inline constexpr int kSwiGluTileCols = 64;
// kSwiGlu interleaves gate and up in 8-row groups (one 128-byte-swizzle atom each): tile rows [16 i, 16 i + 8) are
// gate rows f0 + 8 i .. f0 + 8 i + 7 and rows [16 i + 8, 16 i + 16) the matching up rows.
inline constexpr int kSwiGluGroupRows = 8;
// Rows of x one arrival counter covers (GroupedGemmParams::rowTileReady): the tiled path's row tile.
inline constexpr int kReadyTileRows = 128;

// POD, passed as const __grid_constant__ (the tensor maps live in param space).
struct SwapKernelParams {
  CUtensorMap tmW;  // wgmma A. kStore: w [E, n, k] as dims {k, n, E}, box {64, 128, 1};
                    // kSwiGlu: w [E, 2f, k] as dims {k, 8, 2, f / 8, E} (row in group, gate/up, group, expert),
                    // box {64, 8, 2, 8, 1}: 16 eight-row atoms alternating gate and up
  CUtensorMap tmX;  // wgmma B: x [mTotal, k] as dims {k, mTotal}, box {64, tileN}
  void* out;
  int64_t ldOut;                 // elements
  const int32_t* groupOffsets;   // numExperts + 1 row offsets, read on the device
  const float* rowScale;         // optional [mTotal]
  const uint64_t* rowTileReady;  // optional, one counter per (expert, 128-row tile); see GroupedGemmParams
  uint64_t readyValue;
  const uint64_t* abortWord;     // optional
  ErrorSlot* errorSlot;          // optional
  uint64_t timeoutNs;            // 0 = no deadline
  int32_t mTotal;
  int32_t nOut;        // columns of out (n, or n / 2 with SwiGLU)
  int32_t numKBlocks;  // ceil(k / 64)
  int32_t numExperts;
  int32_t tilesW;      // weight tiles per expert: ceil(nOut / tile columns)
  int32_t reserved0;
};
static_assert(sizeof(SwapKernelParams) % 64 == 0);

// Dynamic shared memory the tileN-wide kernels take.
size_t swapSmemBytes(int tileN);
// Raises the dynamic shared-memory limit of the variant's kernel on the current device and loads it.
cudaError_t swapPrepare(GemmDtype dtype, GroupedGemmEpilogue epi, int tileN);
// Enqueues the variant's persistent kernel with `ctas` CTAs (gemm_layouts::kThreads each).
cudaError_t swapLaunchKernel(const SwapKernelParams& p, GemmDtype dtype, GroupedGemmEpilogue epi, int tileN, int ctas,
                             cudaStream_t stream);

// Host side (grouped_gemm_swap.cpp): the tensor maps and the grid for `g` (already validated, non-empty) under `plan`
// (path kSwapAB), enqueued on `stream`. @throws tandem::Error (kInvalidArgument, kCuda).
void launchGroupedGemmSwap(const GroupedGemmParams& g, const GroupedGemmPlan& plan, cudaStream_t stream, int numSms);
// Loads every swap-AB kernel on the current device. @throws tandem::Error (kCuda).
void preloadGroupedGemmSwapKernels(int device);

}  // namespace tandem::kernels::grouped_swap
