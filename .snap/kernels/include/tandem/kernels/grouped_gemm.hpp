// Grouped GEMM on the Hopper GEMM core (sm_90a): the expert GEMMs of an MoE layer in one persistent kernel.
//
// Rows of x [mTotal, k] are grouped by expert: group e is rows [offsets[e], offsets[e + 1]) of x and of out, and is
// multiplied by expert e's weight w[e]. Two weight layouts (GroupedGemmParams::layout):
//   kABt (default)  w [E, n, k] (nn.Linear layout, K-major): out_g = x_g · w[e]ᵀ (the forward).
//   kAB             w [E, k, n] (N-major): out_g = x_g · w[e] (the backward's data gradients: dh = dy · w2[e] with
//                   the forward's w2 [E, hidden, ffn], dx = d(gate|up) · w1[e] with w1 [E, 2 ffn, hidden]).
// bf16 or fp16 in, fp32 accumulation, out in the input type. The offsets live in device memory and are read by the
// kernel, so a launch needs no host synchronisation (it can be captured in a CUDA graph, and the offsets can come
// from a routing kernel earlier in the stream).
//
// Epilogues:
//   kStore   out [mTotal, n] = x · wᵀ (kABt) or x · w (kAB).
//   kSwiGlu  (kABt only) w [E, 2f, k] holds the gate (rows [0, f)) and the up projection (rows [f, 2f)); out is
//            h [mTotal, f] = silu(x · gateᵀ) * (x · upᵀ), computed in fp32 and rounded once to the dtype.
//   Either can scale each output row by rowScale[row] (fp32, e.g. the routing weight) before the rounding.
//
// Scheduling: a persistent grid walks the tiles of every (expert, row tile, column tile) in expert order; an empty
// expert has no tiles, and tiles of one large expert are spread over all SMs like any others.
//
// Paths (grouped_gemm_plan.hpp picks one per launch from mTotal and maxGroupRows, without reading the offsets):
//   kTiled   128 x 256 tiles over each group's rows (x rows are wgmma M): for groups of hundreds of rows.
//   kSwapAB  decode: each group holds a few rows. The weight's rows are wgmma M in 128-row tiles and a group's rows
//            are wgmma N (tiles of 16, 64 or 128), so the work of expert e is its weight tiles x ceil(rows / tile)
//            token tiles: a group of a few rows costs one pass over its expert's weight, an empty one nothing. A
//            group longer than the tile takes more token tiles (more passes), so the path is right for any grouping.
//            kSwiGlu keeps each gate row and its up row in one tile, so the epilogue stays tile-local. It ignores
//            groupM, skipIdleHalves and tileCounter (no K split: every output has one owner, bitwise repeatable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/gemm.hpp"     // GemmDtype
#include "tandem/kernels/gemm_layouts_plan.hpp"  // GemmLayout
#include "tandem/kernels/grouped_gemm_plan.hpp"  // GroupedGemmPath
#include "tandem/kernels/signals.hpp"  // ErrorSlot

namespace tandem::kernels {

enum class GroupedGemmEpilogue : uint8_t { kStore = 0, kSwiGlu = 1 };

/// POD; zero-initialise (GroupedGemmParams p{}) and fill.
struct GroupedGemmParams {
  const void* x;                 ///< [mTotal, k], row stride ldx elements; 16-byte aligned
  const void* w;                 ///< [numExperts, n, k] (layout kABt) or [numExperts, k, n] (kAB), dense;
                                 ///< 16-byte aligned
  void* out;                     ///< [mTotal, nOut], row stride ldOut; nOut = n (kStore) or n / 2 (kSwiGlu);
                                 ///< 16-byte aligned; must not overlap any input
  const int32_t* groupOffsets;   ///< device memory, numExperts + 1 non-decreasing row offsets in [0, mTotal].
                                 ///< Rows outside [offsets[0], offsets[numExperts]) are neither read for any group's
                                 ///< result nor written. Offsets out of order give unspecified values in out but
                                 ///< never an access outside x or out (they are clamped to [0, mTotal]).
  const float* rowScale;         ///< optional, device [mTotal]: out row r is multiplied by rowScale[r]
  /// Optional arrival counters, one uint64 per (expert, row tile) in expert order: the row tiles of expert e are
  /// numbered from sum over e' < e of ceil(rows(e') / 128). Before loading the rows of a tile the kernel waits until
  /// its counter is >= readyValue (acquire, system scope: pair it with a release store or reduction, after the
  /// rows are written). Null: every row is ready. Size the array with groupedGemmMaxRowTiles().
  const uint64_t* rowTileReady;
  uint64_t readyValue;
  const uint64_t* abortWord;     ///< optional: a non-zero value ends every wait (reported in errorSlot)
  ErrorSlot* errorSlot;          ///< optional: the first failed wait is reported here (timeout or abort)
  uint64_t timeoutNs;            ///< per launch; 0 = wait forever
  int64_t mTotal, n, k, numExperts;
  int64_t ldx, ldOut;            ///< elements; 0 = dense (k, nOut); otherwise multiples of 8, ldx >= k, ldOut >= nOut
  GemmDtype dtype;
  GroupedGemmEpilogue epilogue;
  /// w's layout: kABt (0, the default) or kAB; kAtB is refused (x is always [mTotal, k], K-major). kAB takes the
  /// kStore epilogue only, and needs n % 8 == 0 (w's rows are n elements: 16-byte TMA strides).
  GemmLayout layout;
  int32_t groupM;                ///< tuning: raster group height in row tiles within an expert (0 = default 16)
  /// tuning: a consumer warpgroup whose 64 rows of a tile all lie past its group's end skips its wgmmas (the tile's
  /// other half then has the tensor cores alone). 0 = off, the default: measured slower on an H200 (bench/RESULTS.md,
  /// "MoE ops at one rank": gemm1 1.20 against 0.92 ms at 256 rows per expert), not yet understood.
  int32_t skipIdleHalves;
  /// Optional dynamic tile order: a zeroed uint32 in device memory (zero it before every launch, e.g. with
  /// cudaMemsetAsync on the same stream). Each CTA then draws its next tile from it, so CTAs that drew cheap tiles
  /// take more. Null: CTA c takes tiles c, c + grid, ... Either way every output is the same, bit for bit. Null is
  /// the default: the dynamic order measured slower on an H200 (bench/RESULTS.md, "MoE ops at one rank").
  uint32_t* tileCounter;
  /// tuning: the most rows any group can hold, when the caller knows a bound (a top-k routing of T tokens gives each
  /// expert at most T rows); 0 = mTotal. It picks the path (groupedGemmPlanFor); any grouping gives right results.
  int64_t maxGroupRows;
  /// kAuto (the default): groupedGemmPlanFor picks (layout kAB always tiles); kTiled or kSwapAB forces that path
  /// (tests, benchmarks; kSwapAB takes layout kABt only).
  GroupedGemmPath path;
};

/// Checks `params` against every rule the kernel needs, without touching the GPU.
/// @throws tandem::Error (kInvalidArgument) naming the rule broken and how to satisfy it.
void validateGroupedGemm(const GroupedGemmParams& params);

/// Enqueues the grouped GEMM on `stream`. numSms > 0 caps the persistent grid (0: every SM). mTotal, n or
/// numExperts == 0 enqueues nothing. Thread-safe; tensor maps are cached per (pointer, shape, stride).
/// @throws tandem::Error kInvalidArgument (validateGroupedGemm's rules), kCuda (a CUDA call failed, or the device
///         is not sm_90).
void launchGroupedGemm(const GroupedGemmParams& params, cudaStream_t stream, int numSms = 0);

/// The most row tiles (and so arrival counters) any grouping of mTotal rows into numExperts groups has:
/// ceil(mTotal / 128) + numExperts.
int64_t groupedGemmMaxRowTiles(int64_t mTotal, int64_t numExperts);

/// Loads every grouped-GEMM kernel on `device` now (see preload.hpp for why). @throws tandem::Error (kCuda).
void preloadGroupedGemmKernels(int device);

}  // namespace tandem::kernels
