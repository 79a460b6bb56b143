// FP8 grouped GEMM (sm_90a): the expert GEMMs of an FP8 MoE layer in one persistent kernel, on the FP8 GEMM core's
// main loop (gemm_fp8.hpp) and the grouped GEMM's tile order and epilogue (grouped_gemm.hpp).
//
// Rows of x [mTotal, k] (e4m3) are grouped by expert as in the 16-bit grouped GEMM: group e is rows
// [offsets[e], offsets[e + 1]) of x and of out, multiplied by expert e's weight w[e] [n, k] (e4m3, K-major); the
// offsets live in device memory (no host synchronisation). Scaling is DeepSeek-V3's:
//   x   per 1 x 128 tile (one row, 128 consecutive k): xScale [ceil(k / 128), ldxScale] fp32, M-major (as
//       GemmFp8Params::scaleA: the scales of k-block kb for rows 0..mTotal-1 are contiguous at xScale + kb * ldxScale).
//   w   kBlock: per 128 x 128 tile of each expert, wScale [E, ceil(n / 128), ceil(k / 128)] fp32, dense;
//       kPerExpert: one fp32 per expert, wScale [E].
// fp32 accumulation; every 128 k the partial product is scaled and added in fp32 (the core's promotion).
//
// Epilogues:
//   kStore   out [mTotal, n] bf16 = x · w[e]ᵀ, times rowScale[row] when given.
//   kSwiGlu  w [E, 2f, k] holds the gate (rows [0, f)) and the up projection (rows [f, 2f)); h = silu(x · gateᵀ) *
//            (x · upᵀ) (times rowScale[row] when given) is computed in fp32 and quantised for the next FP8 GEMM: out
//            is h [mTotal, f] e4m3 and outScale [ceil(f / 128), ldOutScale] fp32 (M-major, the xScale layout of the
//            next launch), one scale per row and 128 columns: scale = amax / 448 over those 128 values, e4m3 =
//            round(h / scale) (satfinite). Rows outside the groups are neither written in out nor in outScale.
// Tiles, order and determinism are the 16-bit grouped GEMM's tiled path (128 x 256 tiles, 128 x 128 of h with
// SwiGLU): no K split, so every output is bitwise repeatable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/gemm_fp8.hpp"      // gemmFp8ScaleALd
#include "tandem/kernels/grouped_gemm.hpp"  // GroupedGemmEpilogue
#include "tandem/kernels/signals.hpp"       // ErrorSlot

namespace tandem::kernels {

/// How w's scales apply (see the table above).
enum class GroupedFp8WeightScaling : uint8_t { kBlock = 0, kPerExpert = 1 };

/// POD; zero-initialise (GroupedGemmFp8Params p{}) and fill.
struct GroupedGemmFp8Params {
  const void* x;                ///< [mTotal, k] e4m3, row stride ldx bytes; 16-byte aligned
  const float* xScale;          ///< [ceil(k / 128), ldxScale] fp32, M-major; 16-byte aligned
  const void* w;                ///< [numExperts, n, k] e4m3, dense; 16-byte aligned
  const float* wScale;          ///< kBlock: [numExperts, ceil(n / 128), ceil(k / 128)]; kPerExpert: [numExperts];
                                ///< fp32, 4-byte aligned
  void* out;                    ///< kStore: [mTotal, n] bf16; kSwiGlu: h [mTotal, n / 2] e4m3; row stride ldOut
                                ///< elements; 16-byte aligned; must not overlap any input
  float* outScale;              ///< kSwiGlu: [ceil(n / 2 / 128), ldOutScale] fp32, M-major; 4-byte aligned; else null
  const int32_t* groupOffsets;  ///< device memory, numExperts + 1 non-decreasing row offsets in [0, mTotal] (as
                                ///< GroupedGemmParams::groupOffsets, clamped likewise)
  const float* rowScale;        ///< optional, device [mTotal]: out row r is multiplied by rowScale[r] (before the
                                ///< quantisation with kSwiGlu)
  /// Optional arrival counters and their wait, as GroupedGemmParams::rowTileReady (one uint64 per (expert, row
  /// tile) in expert order; size with groupedGemmMaxRowTiles()).
  const uint64_t* rowTileReady;
  uint64_t readyValue;
  const uint64_t* abortWord;  ///< optional: a non-zero value ends every wait (reported in errorSlot)
  ErrorSlot* errorSlot;       ///< optional: the first failed wait is reported here (timeout or abort)
  uint64_t timeoutNs;         ///< per launch; 0 = wait forever
  int64_t mTotal, n, k, numExperts;
  int64_t ldx;         ///< bytes; 0 = dense (k); otherwise a multiple of 16, >= k
  int64_t ldOut;       ///< elements; 0 = dense (n, or n / 2 with kSwiGlu); otherwise >= that and a multiple
                       ///< of 8 (bf16) or 16 (e4m3)
  int64_t ldxScale;    ///< floats; 0 = gemmFp8ScaleALd(mTotal); otherwise >= mTotal and a multiple of 4
  int64_t ldOutScale;  ///< kSwiGlu, floats; 0 = gemmFp8ScaleALd(mTotal); otherwise >= mTotal and a multiple
                       ///< of 4 (so that outScale, 16-byte aligned, can be the next launch's xScale)
  GroupedGemmEpilogue epilogue;
  GroupedFp8WeightScaling wScaling;
  int32_t groupM;  ///< tuning: raster group height in row tiles within an expert (0 = default 16)
  /// Optional dynamic tile order, as GroupedGemmParams::tileCounter (a zeroed uint32, zeroed before every launch).
  uint32_t* tileCounter;
};

/// Checks `params` against every rule the kernel needs, without touching the GPU. The rules: k a positive multiple of
/// 16 (TMA's 16-byte rows of fp8); kStore: n a multiple of 8 (16-byte rows of bf16 out); kSwiGlu: n = 2f with f a
/// multiple of 16 (16-byte rows of e4m3 h), and with kBlock weight scales f a multiple of 128 (each 128-row tile of
/// the up half then lies in one scale block).
/// @throws tandem::Error (kInvalidArgument) naming the rule broken and how to satisfy it.
void validateGroupedGemmFp8(const GroupedGemmFp8Params& params);

/// Enqueues the FP8 grouped GEMM on `stream`. numSms > 0 caps the persistent grid (0: every SM). mTotal, n or
/// numExperts == 0 enqueues nothing. Thread-safe; tensor maps are cached per (pointer, shape, stride).
/// @throws tandem::Error kInvalidArgument (validateGroupedGemmFp8's rules), kCuda (a CUDA call failed, or the device
///         is not sm_90).
void launchGroupedGemmFp8(const GroupedGemmFp8Params& params, cudaStream_t stream, int numSms = 0);

/// Loads every FP8 grouped-GEMM kernel on `device` now (see preload.hpp for why). @throws tandem::Error (kCuda).
void preloadGroupedGemmFp8Kernels(int device);

}  // namespace tandem::kernels
