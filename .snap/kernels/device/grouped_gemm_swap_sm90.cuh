// The grouped GEMM's swap-AB path (decode: a few rows per expert) on the layouts core's small-M form
// (device/gemm_layouts_sm90.cuh): its shared storage and stage count, wgmma wrappers and descriptors, mainloop and
// accumulator fragment map are called from there. No __global__ here; the kernels are in grouped_gemm_swap.cu.
//
// D = W_e · X_gᵀ: wgmma A is a 128-row tile of expert e's weight (K-major), wgmma B the group's rows of x (K-major,
// a {64 k, BN rows} box), D[weight row, token] is stored transposed into out's rows of the group.
//
// Work. Unit w runs over the experts in order; expert e has ceil(rows_e / BN) token tiles x tilesW weight tiles (an
// empty expert has none, so it costs nothing), token-tile-major so consecutive CTAs share one token tile. CTA c takes
// units c, c + G, ... (G = grid): every unit is one full K loop of one weight tile, about the same cost. Each warp
// that needs the mapping (the producer warp, each consumer warp) scans the offsets itself, as the tiled path does
// (device/grouped_gemm_sm90.cuh), resuming from its previous unit's expert.
//
// Rows. A token box is BN rows from the tile's first row: rows past the group's end belong to the next group (or lie
// past mTotal and read as zeros). They only feed D columns the epilogue never stores. Weight tiles come from a 3D
// (kStore) or 5D (kSwiGlu) tensor map, so a partial tile reads zeros past n, never the next expert's weight.
//
// Epilogue: direct stores of D transposed, masked to the group's rows and to nOut, each scaled by rowScale[token] when
// given. kSwiGlu: the weight tile interleaves gate and up 8-row groups, so a thread's accumulator rows r and r + 8
// (wgmma fragment rows, h = 0 and 1) are gate row g and up row g of the same output column: SwiGLU is thread-local.
// No K split: one CTA owns each output element and sums K in order, so results are bitwise repeatable.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/gemm_layouts_sm90.cuh"
#include "device/grouped_gemm_sm90.cuh"  // tmaLoad3d, clampRow, silu
#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "grouped_gemm_swap_desc.hpp"

namespace tandem::kernels::grouped_swap {

namespace gl = gemm_layouts;
using gl::kThreads;

static_assert(kWeightTileRows == gl::kBlockRows, "a weight tile is the layouts core's wgmma M block");
static_assert(2 * kSwiGluTileCols == kWeightTileRows && kSwiGluGroupRows * 2 * 8 == kWeightTileRows);

template <int BN>
using Storage = gl::SharedStorage<BN, false>;  // no epilogue staging: the transposed stores go straight out
template <int BN>
using Geo = gl::Geometry<BN, false>;
template <int BN>
inline constexpr size_t kSmemBytes = gl::kSmemBytes<BN, false>;

template <GroupedGemmEpilogue Epi>
inline constexpr int kTileCols = Epi == GroupedGemmEpilogue::kSwiGlu ? kSwiGluTileCols : kStoreTileCols;

__device__ __forceinline__ void tmaLoad5d(const CUtensorMap* map, void* dst, uint64_t* bar, int32_t c0, int32_t c1,
                                          int32_t c2, int32_t c3, int32_t c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];" ::"r"(gemm::smemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(gemm::smemAddr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// ---------------------------------------------------------------------------------------------------------------
// Work units.
// ---------------------------------------------------------------------------------------------------------------
struct SwapTile {
  int32_t expert;
  int32_t tok0;     // first row of x (and of out) in the token tile
  int32_t tokRows;  // rows of the token tile inside the group, 1..BN
  int32_t col0;     // first output column (kSwiGlu: also the first gate row of w[e]; its up row is at + f)
  int32_t rowTile;  // the 128-row tile of the group (counted over all experts) holding the token tile
};

// Where a warp's last lookup ended: expert `expert` starts at unit workBase and 128-row tile rowTileBase.
struct SwapCursor {
  int32_t expert = 0;
  int32_t workBase = 0;
  int32_t rowTileBase = 0;
};

// Finds unit w. Called by all 32 lanes of a warp together (converged); every lane gets the same answer. Returns false
// when w lies past the last unit.
template <int BN, GroupedGemmEpilogue Epi>
__device__ __forceinline__ bool findSwapTile(const SwapKernelParams& p, SwapCursor& cur, int32_t w, SwapTile& tile) {
  static_assert(kReadyTileRows % BN == 0, "a token tile lies inside one arrival-counter tile");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  while (cur.expert < p.numExperts) {
    const int32_t e = cur.expert + lane;
    int32_t lo = 0;
    int32_t rows = 0;
    if (e < p.numExperts) {
      lo = grouped::clampRow(p.groupOffsets[e], p.mTotal);
      rows = max(grouped::clampRow(p.groupOffsets[e + 1], p.mTotal) - lo, 0);
    }
    const int32_t tokTiles = (rows + BN - 1) / BN;
    const int32_t readyTiles = (rows + kReadyTileRows - 1) / kReadyTileRows;
    int32_t inclTok = tokTiles;  // inclusive scans over the 32 experts of this step
    int32_t inclReady = readyTiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t vt = __shfl_up_sync(0xffffffffu, inclTok, d);
      const int32_t vr = __shfl_up_sync(0xffffffffu, inclReady, d);
      if (lane >= d) {
        inclTok += vt;
        inclReady += vr;
      }
    }
    const uint32_t hit = __ballot_sync(0xffffffffu, w < cur.workBase + inclTok * p.tilesW);
    if (hit != 0) {
      const int src = __ffs(static_cast<int>(hit)) - 1;  // the first expert whose units reach past w: it has units
      const int32_t beforeTok = __shfl_sync(0xffffffffu, inclTok - tokTiles, src);
      const int32_t beforeReady = __shfl_sync(0xffffffffu, inclReady - readyTiles, src);
      const int32_t eLo = __shfl_sync(0xffffffffu, lo, src);
      const int32_t eRows = __shfl_sync(0xffffffffu, rows, src);
      cur.expert += src;
      cur.workBase += beforeTok * p.tilesW;
      cur.rowTileBase += beforeReady;
      const int32_t local = w - cur.workBase;
      const int32_t tt = local / p.tilesW;
      tile.expert = cur.expert;
      tile.tok0 = eLo + tt * BN;
      tile.tokRows = min(BN, eRows - tt * BN);
      tile.col0 = (local - tt * p.tilesW) * kTileCols<Epi>;
      tile.rowTile = cur.rowTileBase + tt * BN / kReadyTileRows;
      return true;
    }
    cur.expert += 32;
    cur.workBase += __shfl_sync(0xffffffffu, inclTok, 31) * p.tilesW;
    cur.rowTileBase += __shfl_sync(0xffffffffu, inclReady, 31);
  }
  return false;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: one warp walks the units; lane 0 waits for the token tile's rows (when counters are given) and streams
// the weight tile and the token box of each k-block into the ring. After a failed wait (abort or deadline, already
// reported in the error slot) it stops waiting and keeps the ring fed, so the consumers finish and the kernel ends;
// out is then garbage and the slot says why.
// ---------------------------------------------------------------------------------------------------------------
template <int BN, GroupedGemmEpilogue Epi>
__device__ __forceinline__ void runSwapProducer(const SwapKernelParams& p, Storage<BN>& s, int32_t firstWork,
                                                int32_t workStride) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  gemm::PipeState<Geo<BN>::kStages> ps;
  SwapCursor cur;
  WaitCtx ctx{p.abortWord, p.errorSlot, 0, 0, 0, 0};
  if (p.rowTileReady != nullptr && p.timeoutNs != 0) ctx.deadlineNs = globaltimerNs() + p.timeoutNs;
  bool waitFailed = false;
  SwapTile tile;
  for (int32_t w = firstWork;; w += workStride) {
    if (!findSwapTile<BN, Epi>(p, cur, w, tile)) break;
    if (lane == 0) {
      if (p.rowTileReady != nullptr && !waitFailed) {
        // acquire: pairs with the release (store or reduction) of whoever wrote this tile's rows.
        if (!waitGeq(p.rowTileReady + tile.rowTile, p.readyValue, ctx, static_cast<uint32_t>(tile.rowTile))) {
          waitFailed = true;
        }
        // The rows were written by generic-proxy stores (SMs, possibly a peer's); TMA reads them next.
        fenceProxyAsyncGlobal();
      }
      for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
        // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
        gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
        gemm::mbarArriveExpectTx(&s.full[ps.stage], gl::kABytes + Geo<BN>::kBBytes);
        const int32_t k0 = kb * gl::kBlockK;
        if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
          tmaLoad5d(&p.tmW, s.a[ps.stage], &s.full[ps.stage], k0, 0, 0, tile.col0 / kSwiGluGroupRows, tile.expert);
        } else {
          grouped::tmaLoad3d(&p.tmW, s.a[ps.stage], &s.full[ps.stage], k0, tile.col0, tile.expert);
        }
        gemm::tmaLoad2d(&p.tmX, s.b[ps.stage], &s.full[ps.stage], k0, tile.tok0);
        ps.advance();
      }
    }
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): weight rows [64 wg, 64 wg + 64) of each tile; t = thread index in the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int BN, GroupedGemmEpilogue Epi>
__device__ __forceinline__ void runSwapConsumer(const SwapKernelParams& p, Storage<BN>& s, int32_t firstWork,
                                                int32_t workStride, int wg, int t) {
  float acc[BN / 2];
  gemm::PipeState<Geo<BN>::kStages> ps;
  SwapCursor cur;
  SwapTile tile;
  const uint32_t xOffset = static_cast<uint32_t>(wg) * gl::kChunkBytes;  // this warpgroup's 64 weight rows
  T* const out = static_cast<T*>(p.out);
  for (int32_t w = firstWork;; w += workStride) {
    if (!findSwapTile<BN, Epi>(p, cur, w, tile)) break;
    gl::mmaKBlocks<T, BN, gl::Major::kK, gl::Major::kK>(s, ps, acc, 0, p.numKBlocks, xOffset, t);

    // Token c of the tile is out row tok0 + c; only c < tokRows belong to the group.
    const auto scaleOf = [&](int c) { return p.rowScale != nullptr ? p.rowScale[tile.tok0 + c] : 1.0f; };
    if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
      // Fragment rows r (h = 0) and r + 8 (h = 1) are gate and up of one output column: tile row 16 i + q (q < 8)
      // is gate column col0 + 8 i + q, and r = fragRow(t, 0) = 16 (t / 32) + (t % 32) / 4 lies in group
      // i = 4 wg + t / 32.
      const int r = gl::fragRow(t, 0);
      const int32_t col = tile.col0 + (4 * wg + r / 16) * kSwiGluGroupRows + r % 16;
      if (col < p.nOut) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = gl::fragCol(t, j, e);
            if (c < tile.tokRows) {
              const float v = grouped::silu(acc[4 * j + e]) * acc[4 * j + 2 + e] * scaleOf(c);
              out[static_cast<int64_t>(tile.tok0 + c) * p.ldOut + col] = gl::fromFloat<T>(v);
            }
          }
        }
      }
    } else {
      const int32_t rowBase = tile.col0 + wg * gl::kRowsPerConsumer;
      gl::forEachFragment<BN>(acc, t, [&](int r, int c, float v) {
        const int32_t col = rowBase + r;  // a weight row: a column of out
        if (c < tile.tokRows && col < p.nOut) {
          out[static_cast<int64_t>(tile.tok0 + c) * p.ldOut + col] = gl::fromFloat<T>(v * scaleOf(c));
        }
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), dynamic smem kSmemBytes<BN>, no cluster.
// This CTA is worker `ctaId` of `numCtas`.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int BN, GroupedGemmEpilogue Epi>
__device__ __forceinline__ void runSwapCta(const SwapKernelParams& p, uint8_t* smemRaw, int32_t ctaId,
                                           int32_t numCtas) {
  auto& s = *reinterpret_cast<Storage<BN>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                            ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
#pragma unroll
    for (int i = 0; i < Geo<BN>::kStages; ++i) {
      gemm::mbarInit(&s.full[i], 1);                             // the producer's expect_tx
      gemm::mbarInit(&s.empty[i], gl::kConsumerWarpgroups);  // one arrival per consumer warpgroup (mmaKBlocks)
    }
    gemm::fenceBarrierInit();
    gemm::prefetchTensorMap(&p.tmW);
    gemm::prefetchTensorMap(&p.tmX);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<gl::kProducerRegs>();
      if (t < 32) runSwapProducer<BN, Epi>(p, s, ctaId, numCtas);
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<gl::kConsumerRegs>();
      runSwapConsumer<T, BN, Epi>(p, s, ctaId, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::grouped_swap
