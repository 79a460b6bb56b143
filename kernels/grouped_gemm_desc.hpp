// The grouped GEMM's kernel parameters and its raw launch entry points: plain data shared by the host launcher
// (grouped_gemm.cpp, g++) and the kernels (grouped_gemm.cu, nvcc). Private to the kernels library; the public API is
// tandem/kernels/grouped_gemm.hpp.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing links libcuda)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels::grouped {

// Output columns one tile covers: kStore computes 256 columns of w; kSwiGlu computes 128 gate and the 128 matching up
// columns and writes 128 columns of h.
inline constexpr int kStoreTileCols = 256;
inline constexpr int kSwiGluTileCols = 128;
inline constexpr int kTileRows = 128;

// POD, passed as const __grid_constant__ (the tensor maps live in param space).
struct GroupedGemmKernelParams {
  CUtensorMap tmX;    // x [mTotal, k]: dims {k, mTotal}, box {64, 128}, 128B swizzle
  CUtensorMap tmW;    // kStore, kABt: w [E, n, k] as dims {k, n, E}, box {64, 256, 1};
                      // kStore, kAB: w [E, k, n] as dims {n, k, E}, box {64, 64, 1} (four per k-block, MN-major);
                      // kSwiGlu (kABt): w [E, 2f, k] as dims {k, f, 2, E} (gate, up), box {64, 128, 1, 1}
  CUtensorMap tmOut;  // out [mTotal, nOut]: dims {nOut, mTotal}, box {64, 64}, 128B swizzle
  void* out;
  int64_t ldOut;                  // elements
  const int32_t* groupOffsets;    // numExperts + 1 row offsets, read on the device
  const float* rowScale;          // optional [mTotal]
  const uint64_t* rowTileReady;   // optional, one counter per (expert, row tile); see GroupedGemmParams
  uint64_t readyValue;
  const uint64_t* abortWord;      // optional
  ErrorSlot* errorSlot;           // optional
  uint32_t* tileCounter;          // optional: dynamic tile order (GroupedGemmParams::tileCounter)
  uint64_t timeoutNs;             // 0 = no deadline
  int32_t mTotal;
  int32_t nOut;        // columns of out (n, or n / 2 with SwiGLU)
  int32_t k;
  int32_t numKBlocks;  // ceil(k / 64)
  int32_t numExperts;
  int32_t tilesN;      // ceil(nOut / tile columns)
  int32_t groupM;      // raster group height in row tiles, within one expert
  int32_t skipIdleHalves;  // GroupedGemmParams::skipIdleHalves
};
static_assert(sizeof(GroupedGemmKernelParams) % 64 == 0);

inline constexpr int32_t kDefaultGroupM = 16;  // GroupedGemmParams::groupM 0

// The fields every grouped launcher (16-bit, FP8) copies from its params `g` into p (all but the tensor maps and
// skipIdleHalves): the output, the group offsets, the waits and the tile order. nOut, ldOut, numKBlocks and tileCols
// are the launcher's own readings of g.
template <class Params>
void fillTileOrder(GroupedGemmKernelParams& p, const Params& g, int64_t nOut, int64_t ldOut, int64_t numKBlocks,
                   int64_t tileCols) {
  p.out = g.out;
  p.ldOut = ldOut;
  p.groupOffsets = g.groupOffsets;
  p.rowScale = g.rowScale;
  p.rowTileReady = g.rowTileReady;
  p.readyValue = g.readyValue;
  p.abortWord = g.abortWord;
  p.errorSlot = g.errorSlot;
  p.timeoutNs = g.timeoutNs;
  p.mTotal = static_cast<int32_t>(g.mTotal);
  p.nOut = static_cast<int32_t>(nOut);
  p.k = static_cast<int32_t>(g.k);
  p.numKBlocks = static_cast<int32_t>(numKBlocks);
  p.numExperts = static_cast<int32_t>(g.numExperts);
  p.tilesN = static_cast<int32_t>((nOut + tileCols - 1) / tileCols);
  p.groupM = g.groupM == 0 ? kDefaultGroupM : g.groupM;
  p.tileCounter = g.tileCounter;
}

// Dynamic shared memory the kernels take (the GEMM core's 4-stage storage plus alignment slack).
size_t groupedGemmSmemBytes();
// A kernel variant. layout kAB exists with kStore only (the launcher refuses the rest).
struct GroupedGemmVariant {
  GemmDtype dtype;
  GroupedGemmEpilogue epi;
  GemmLayout layout;
};

// Raises the dynamic shared-memory limit of the variant's kernel on the current device and loads it.
cudaError_t groupedGemmPrepare(GroupedGemmVariant v);
// Enqueues the variant's persistent kernel with `ctas` CTAs (kThreads each).
cudaError_t groupedGemmLaunchKernel(const GroupedGemmKernelParams& p, GroupedGemmVariant v, int ctas,
                                    cudaStream_t stream);

}  // namespace tandem::kernels::grouped
