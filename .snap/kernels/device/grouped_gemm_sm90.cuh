// Grouped GEMM on the Hopper GEMM core (device/gemm_sm90.cuh): same CTA (warpgroup 0 produces with TMA, warpgroups
// 1 and 2 consume with m64n256k16 wgmma), same 128x256x64 tile, same 4-stage ring, same swizzled epilogue buffers.
// What differs is the work: a tile is (expert, row tile, column tile), found on the device from the group offsets,
// and the epilogue stops at the group's last row.
//
// Tile order. Work index w runs over the experts in order; inside expert e the core's GroupedRaster walks its
// ceil(rows / 128) x tilesN tiles. CTA c takes w = c, c + G, c + 2G, ... (G = grid), so every tile costs the same
// (one full K loop) and a skewed routing spreads its big expert over all SMs. Every warp that needs the mapping
// (the producer warp, each consumer warp) finds its tiles itself with a warp-wide scan over the offsets, resuming
// from the expert of its previous tile: no shared state, no smem, no limit on the number of experts.
//
// Rows. A tile's A box is 128 rows starting at the tile's first row: rows past the group's end belong to the next
// group (or lie past mTotal and read as zeros); their results are never stored. Column tiles of w come from a 3D
// (kStore) or 4D (kSwiGlu: gate and up halves) tensor map, so a partial column tile reads zeros past n, never the
// next expert's rows.
//
// Weight layouts (template parameter BMn, the GEMM core's). false: w [E, n, k], K-major, one {64 k, 256 columns} box
// per k-block. true (layout kAB, the backward's dgrad): w [E, k, n] through a 3D map over {n, k, E}, loaded MN-major as
// the core's tmaLoadB<true> loads a [K, N] B (four {64 columns, 64 k} boxes of 8 KiB per k-block) and read with the
// core's MN-major descriptor and wgmma's transpose bit for B. The expert is the map's third dim, so k past K and
// columns past n read zeros, never the next expert's weight. kStore only.
//
// Epilogue. Each consumer warpgroup writes its 64 rows through the core's swizzled 64x64 smem chunks. A chunk whose
// 64 rows all belong to the group goes out by TMA store (clipped at nOut); the group's last, partial chunk is copied
// out by the warpgroup with 16-byte stores masked by row and column. kSwiGlu: a tile's B is 128 gate rows then the
// 128 matching up rows, so thread-local accumulator j (gate) pairs with j + 16 (up) in the wgmma m64n256 layout.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/gemm_sm90.cuh"
#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "grouped_gemm_desc.hpp"

namespace tandem::kernels::grouped {

using gemm::kBBytes;
using gemm::kABytes;
using gemm::kBlockK;
using gemm::kBlockM;
using gemm::kBlockN;
using gemm::kEpiCols;
using gemm::kRowsPerConsumer;
using gemm::kStages;
using gemm::kThreads;

static_assert(kTileRows == kBlockM && kStoreTileCols == kBlockN && 2 * kSwiGluTileCols == kBlockN);

template <GroupedGemmEpilogue Epi>
inline constexpr int kTileCols = Epi == GroupedGemmEpilogue::kSwiGlu ? kSwiGluTileCols : kStoreTileCols;

// ---------------------------------------------------------------------------------------------------------------
// PTX the core does not have: 3D / 4D tile loads, and 16-byte shared loads for the masked epilogue copy.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void tmaLoad3d(const CUtensorMap* map, void* dst, uint64_t* bar, int32_t c0, int32_t c1,
                                          int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(gemm::smemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(gemm::smemAddr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tmaLoad4d(const CUtensorMap* map, void* dst, uint64_t* bar, int32_t c0, int32_t c1,
                                          int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(gemm::smemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(gemm::smemAddr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ uint4 ldShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// One k-block of w for a tile: kSwiGlu's gate and up halves (4D map), or kStore's 256 columns (3D map), the latter
// K-major or, BMn, as four MN-major boxes (gemm::tmaLoadB<true> with the expert as a third coordinate). An MN-major
// box wholly past n is neither loaded nor expected (as in the layouts core, gemm_layouts_sm90.cuh): the stale shared
// memory it leaves feeds only accumulator columns past n, whose 64-column epilogue chunks are never stored.
inline constexpr int kMnBoxCols = 64;  // gemm::makeSmemDescMn's leading byte offset: 64 columns x 64 k x 2 bytes
inline constexpr uint32_t kMnBoxBytes = kMnBoxCols * kBlockK * 2;
static_assert(kMnBoxCols == kEpiCols, "a box wholly past n must cover whole epilogue chunks");

// The bytes of w one k-block of the tile at col0 brings (its mbarrier's expected transaction count, with A's).
template <GroupedGemmEpilogue Epi, bool BMn>
__device__ __forceinline__ uint32_t wBytes(int32_t col0, int32_t n) {
  if constexpr (BMn) {
    uint32_t bytes = 0;
#pragma unroll
    for (int j = 0; j < kBlockN / kMnBoxCols; ++j) bytes += col0 + kMnBoxCols * j < n ? kMnBoxBytes : 0;
    return bytes;
  } else {
    return kBBytes;  // one or two boxes, whole even where they reach past n (TMA zero-fills and counts those bytes)
  }
}

template <GroupedGemmEpilogue Epi, bool BMn>
__device__ __forceinline__ void tmaLoadW(const CUtensorMap* map, uint16_t* dst, uint64_t* bar, int32_t k0,
                                         int32_t col0, int32_t n, int32_t expert) {
  if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
    static_assert(!BMn, "the SwiGLU epilogue takes w [E, 2f, k] (layout kABt) only");
    tmaLoad4d(map, dst, bar, k0, col0, 0, expert);
    tmaLoad4d(map, dst + kSwiGluTileCols * kBlockK, bar, k0, col0, 1, expert);
  } else if constexpr (BMn) {
#pragma unroll
    for (int j = 0; j < kBlockN / kMnBoxCols; ++j) {
      if (col0 + kMnBoxCols * j < n) {
        tmaLoad3d(map, dst + j * kMnBoxCols * kBlockK, bar, col0 + kMnBoxCols * j, k0, expert);
      }
    }
  } else {
    tmaLoad3d(map, dst, bar, k0, col0, expert);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Tile scheduler.
// ---------------------------------------------------------------------------------------------------------------
struct GroupTile {
  int32_t expert;
  int32_t row0;     // first row of the tile (x and out)
  int32_t rowEnd;   // end of the group's rows (exclusive): rows [row0, rowEnd) of the tile are stored
  int32_t col0;     // first output column (of out; with SwiGLU also the first gate row of w[e], up at + f)
  int32_t rowTile;  // the tile's row-tile index over all experts (its arrival counter)
};

// Where a warp's last lookup ended: expert `expert` starts at work index workBase and row tile rowTileBase.
// Work indices a warp asks for only grow, so the scan never goes back.
struct GroupCursor {
  int32_t expert = 0;
  int32_t workBase = 0;
  int32_t rowTileBase = 0;
};

__device__ __forceinline__ int32_t clampRow(int32_t v, int32_t mTotal) { return min(max(v, 0), mTotal); }

// Dynamic tile order (p.tileCounter set): a CTA's first work index is its id, each later one comes from a global
// counter (atomicAdd + the grid size), so a CTA that drew cheap tiles (a group's short last tile, an idle half) takes
// more. The producer warp draws them and hands each to the 8 consumer warps through this ring, in order.
inline constexpr int kWorkSlots = 4;
struct WorkRing {
  int32_t work[kWorkSlots];
  alignas(8) uint64_t full[kWorkSlots];   // the producer's lane 0 arrives once work[slot] is written (count 1)
  uint64_t empty[kWorkSlots];             // each consumer warp's lane 0 arrives once it read work[slot] (count 8)
};
inline constexpr uint32_t kConsumerWarps = 8;

struct RingPos {
  uint32_t slot = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kWorkSlots) {
      slot = 0;
      phase ^= 1;
    }
  }
};

// Finds work index w. Called by all 32 lanes of a warp together (converged); every lane gets the same answer.
// Returns false when w lies past the last tile.
template <GroupedGemmEpilogue Epi>
__device__ __forceinline__ bool findTile(const GroupedGemmKernelParams& p, GroupCursor& cur, int32_t w,
                                         GroupTile& tile) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  while (cur.expert < p.numExperts) {
    const int32_t e = cur.expert + lane;
    int32_t lo = 0;
    int32_t rows = 0;
    if (e < p.numExperts) {
      lo = clampRow(p.groupOffsets[e], p.mTotal);
      rows = max(clampRow(p.groupOffsets[e + 1], p.mTotal) - lo, 0);
    }
    const int32_t tilesM = (rows + kTileRows - 1) / kTileRows;
    int32_t incl = tilesM;  // inclusive scan of row tiles over the 32 experts of this step
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const uint32_t hit = __ballot_sync(0xffffffffu, w < cur.workBase + incl * p.tilesN);
    if (hit != 0) {
      const int src = __ffs(static_cast<int>(hit)) - 1;  // the first expert whose tiles reach past w: it has tiles
      const int32_t before = __shfl_sync(0xffffffffu, incl - tilesM, src);
      const int32_t eLo = __shfl_sync(0xffffffffu, lo, src);
      const int32_t eRows = __shfl_sync(0xffffffffu, rows, src);
      const int32_t eTilesM = __shfl_sync(0xffffffffu, tilesM, src);
      cur.expert += src;
      cur.workBase += before * p.tilesN;
      cur.rowTileBase += before;
      const gemm::GroupedRaster raster{eTilesM, p.tilesN, p.groupM};
      const gemm::TileCoord tc = raster(w - cur.workBase);
      tile.expert = cur.expert;
      tile.row0 = eLo + tc.unitM * kTileRows;
      tile.rowEnd = eLo + eRows;
      tile.col0 = tc.tileN * kTileCols<Epi>;
      tile.rowTile = cur.rowTileBase + tc.unitM;
      return true;
    }
    const int32_t stepTiles = __shfl_sync(0xffffffffu, incl, 31);
    cur.expert += 32;
    cur.workBase += stepTiles * p.tilesN;
    cur.rowTileBase += stepTiles;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: one warp walks the tiles; lane 0 waits for the tile's rows (when counters are given) and streams its
// k-blocks into the ring. After a failed wait (abort or deadline, already reported in the error slot) it stops
// waiting and keeps the ring fed, so the consumers finish and the kernel ends; out is then garbage and the slot says
// why. What one k-block loads is the loader's: loader.bytes(tile) is the expected transaction count of every k-block
// of the tile, loader.load(tile, kb, stage, bar) issues its TMA copies into ring stage `stage`, completing on bar. The
// FP8 grouped GEMM walks its tiles with this same loop and a loader of its own.
// ---------------------------------------------------------------------------------------------------------------
template <GroupedGemmEpilogue Epi, int Stages, class Loader>
__device__ __forceinline__ void runGroupedProducerWith(const GroupedGemmKernelParams& p, uint64_t (&full)[Stages],
                                                       uint64_t (&empty)[Stages], WorkRing& ring, int32_t firstWork,
                                                       int32_t workStride, const Loader& loader) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  gemm::PipeState<Stages> ps;
  GroupCursor cur;
  WaitCtx ctx{p.abortWord, p.errorSlot, 0, 0, 0, 0};
  if (p.rowTileReady != nullptr && p.timeoutNs != 0) ctx.deadlineNs = globaltimerNs() + p.timeoutNs;
  bool waitFailed = false;
  GroupTile tile;
  const bool dynamic = p.tileCounter != nullptr;
  RingPos rp;
  int32_t next = 0;  // lane 0: the next dynamic work index, drawn one tile ahead so the atomic's latency hides
  if (dynamic && lane == 0) next = static_cast<int32_t>(atomicAdd(p.tileCounter, 1u)) + workStride;
  int32_t w = firstWork;
  for (;;) {
    if (dynamic) {
      if (lane == 0) {
        gemm::mbarWait(&ring.empty[rp.slot], rp.phase ^ 1);  // a fresh barrier reports its parity-1 phase done
        ring.work[rp.slot] = w;
        gemm::mbarArrive(&ring.full[rp.slot]);  // release: publishes work[slot]; pairs with the consumers' mbarWait
      }
      rp.advance();
    }
    if (!findTile<Epi>(p, cur, w, tile)) break;  // the consumers got this w too, and stop on it as well
    if (lane == 0) {
      if (p.rowTileReady != nullptr && !waitFailed) {
        // acquire: pairs with the release (store or reduction) of whoever wrote this tile's rows.
        if (!waitGeq(p.rowTileReady + tile.rowTile, p.readyValue, ctx, static_cast<uint32_t>(tile.rowTile))) {
          waitFailed = true;
        }
        // The rows were written by generic-proxy stores (SMs, possibly a peer's); TMA reads them next.
        fenceProxyAsyncGlobal();
      }
      const uint32_t bytes = loader.bytes(tile);
      for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
        // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
        gemm::mbarWait(&empty[ps.stage], ps.phase ^ 1);
        gemm::mbarArriveExpectTx(&full[ps.stage], bytes);
        loader.load(tile, kb, ps.stage, &full[ps.stage]);
        ps.advance();
      }
    }
    __syncwarp();
    if (dynamic) {
      w = __shfl_sync(0xffffffffu, next, 0);
      if (lane == 0) next = static_cast<int32_t>(atomicAdd(p.tileCounter, 1u)) + workStride;
    } else {
      w += workStride;
    }
  }
}

// The 16-bit kernels' loader: x's 128 rows and w's columns of one k-block of 64.
template <GroupedGemmEpilogue Epi, bool BMn>
struct Bf16Loader {
  const GroupedGemmKernelParams& p;
  gemm::SharedStorage<kStages>& s;
  __device__ __forceinline__ uint32_t bytes(const GroupTile& tile) const {
    return kABytes + wBytes<Epi, BMn>(tile.col0, p.nOut);
  }
  __device__ __forceinline__ void load(const GroupTile& tile, int32_t kb, int stage, uint64_t* bar) const {
    const int32_t k0 = kb * kBlockK;
    gemm::tmaLoad2d(&p.tmX, s.a[stage], bar, k0, tile.row0);
    tmaLoadW<Epi, BMn>(&p.tmW, s.b[stage], bar, k0, tile.col0, p.nOut, tile.expert);
  }
};

template <GroupedGemmEpilogue Epi, bool BMn>
__device__ __forceinline__ void runGroupedProducer(const GroupedGemmKernelParams& p, gemm::SharedStorage<kStages>& s,
                                                   WorkRing& ring, int32_t firstWork, int32_t workStride) {
  runGroupedProducerWith<Epi>(p, s.full, s.empty, ring, firstWork, workStride, Bf16Loader<Epi, BMn>{p, s});
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer side of the tile order: work index w (static order) or the producer's next one from the ring (dynamic
// order), found in the grouping. Called by all 32 lanes of a warp together. Returns false past the last tile.
// ---------------------------------------------------------------------------------------------------------------
template <GroupedGemmEpilogue Epi>
__device__ __forceinline__ bool nextConsumerTile(const GroupedGemmKernelParams& p, WorkRing& ring, RingPos& rp,
                                                 GroupCursor& cur, int32_t w, GroupTile& tile) {
  if (p.tileCounter != nullptr) {
    gemm::mbarWait(&ring.full[rp.slot], rp.phase);  // acquire: the producer's work[slot]
    w = ring.work[rp.slot];
    __syncwarp();
    if (static_cast<int>(threadIdx.x) % 32 == 0) gemm::mbarArrive(&ring.empty[rp.slot]);  // this warp has read it
    rp.advance();
  }
  return findTile<Epi>(p, cur, w, tile);
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogue pieces shared with the FP8 grouped GEMM. A consumer warpgroup writes its 64 rows [rowBase, rowBase + 64)
// in chunks of 64 rows x 128 bytes (64 16-bit or 128 fp8 columns), staged in shared memory with the 128-byte swizzle.
// ---------------------------------------------------------------------------------------------------------------
inline constexpr uint32_t kEpiChunkBytes = kRowsPerConsumer * 128;

// One chunk to out at column chunkCol: waits until chunk buffer epiChunks % Bufs (of Bufs at bufBase, kEpiChunkBytes
// apart) is free, has stage(base) write the swizzled chunk there, then TMA-stores it when all 64 rows belong to the
// group (clipped at nOut), or else copies the group's rows out with 16-byte stores masked by row and column
// (nOut * sizeof(OutT) % 16 == 0). barId: the warpgroup's named barrier (128 threads); t: thread in the warpgroup.
template <class OutT, int Bufs, class Stage>
__device__ __forceinline__ void storeGroupChunk(uint32_t bufBase, const CUtensorMap* tmOut, void* out, int64_t ldOut,
                                                int32_t nOut, int32_t rowBase, int32_t rowsHere, int32_t chunkCol,
                                                uint32_t barId, int t, uint32_t& epiChunks, const Stage& stage) {
  constexpr int kPieceElems = 16 / static_cast<int>(sizeof(OutT));
  const uint32_t buf = epiChunks % Bufs;
  if (epiChunks >= static_cast<uint32_t>(Bufs)) {
    // This buffer's previous chunk: its TMA store has read it (bulk groups of thread 0), and every thread's masked
    // copy out of it is done (the barrier).
    if (t == 0) gemm::bulkWaitRead<Bufs - 1>();
    gemm::namedBarSyncId(barId, 128);
  }
  const uint32_t base = bufBase + buf * kEpiChunkBytes;
  stage(base);
  gemm::fenceProxyAsyncShared();       // our st.shared -> visible to the TMA engine
  gemm::namedBarSyncId(barId, 128);  // publishes the whole chunk to thread 0 (and to every copier)
  if (rowsHere >= kRowsPerConsumer) {
    if (t == 0) {
      gemm::tmaStore2d(tmOut, base, chunkCol, rowBase);
      gemm::bulkCommit();
    }
  } else {
    // The group ends inside this chunk: 64 rows x 8 16-byte pieces, masked by row and column.
    OutT* const outBase = static_cast<OutT*>(out);
#pragma unroll
    for (int i = t; i < kRowsPerConsumer * 8; i += 128) {
      const int row = i / 8;
      const int piece = i % 8;
      const int32_t colG = chunkCol + piece * kPieceElems;
      if (row < rowsHere && colG < nOut) {
        const uint4 v = ldShared128(base + static_cast<uint32_t>(row) * 128 +
                                    ((static_cast<uint32_t>(piece) ^ static_cast<uint32_t>(row & 7)) << 4));
        *reinterpret_cast<uint4*>(outBase + static_cast<int64_t>(rowBase + row) * ldOut + colG) = v;
      }
    }
  }
  ++epiChunks;
}

// Fast reciprocal division (MUFU.RCP and a multiply, about 2 ulp) instead of IEEE division's ~20 instructions, 64
// times per thread and tile: h is rounded to 16 bits (or 8) right after, far coarser. For g -> -inf, exp(-g) = inf
// and the quotient is g * 0 = -0, silu's limit.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// The 16-bit chunk c of a tile (64 columns) from the m64n256 accumulators: kStore's columns, or kSwiGlu's
// silu(gate) * up (thread-local accumulator group j pairs with j + 16), times the rows' scales, into the swizzled
// chunk at base. rowOff0 / rowOff1: byte offsets of this thread's accumulator rows r and r + 8 in the chunk; phase:
// r & 7 (their swizzle phase); lane: this thread's lane.
template <class T, GroupedGemmEpilogue Epi>
__device__ __forceinline__ void stageChunk16(uint32_t base, const float (&acc)[128], int c, uint32_t rowOff0,
                                             uint32_t rowOff1, uint32_t phase, int lane, float scale0, float scale1) {
#pragma unroll
  for (int jj = 0; jj < kEpiCols / 8; ++jj) {
    const int j = c * (kEpiCols / 8) + jj;  // 8-column group of the accumulator (of the gate half for SwiGLU)
    float v0, v1, v2, v3;
    if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
      constexpr int kUp = kSwiGluTileCols / 8;  // the up column group matching gate group j
      v0 = silu(acc[4 * j + 0]) * acc[4 * (j + kUp) + 0];
      v1 = silu(acc[4 * j + 1]) * acc[4 * (j + kUp) + 1];
      v2 = silu(acc[4 * j + 2]) * acc[4 * (j + kUp) + 2];
      v3 = silu(acc[4 * j + 3]) * acc[4 * (j + kUp) + 3];
    } else {
      v0 = acc[4 * j + 0];
      v1 = acc[4 * j + 1];
      v2 = acc[4 * j + 2];
      v3 = acc[4 * j + 3];
    }
    // 128B swizzle: 16-byte chunk index XOR (row & 7), as the TMA store map expects.
    const uint32_t col = ((static_cast<uint32_t>(jj) ^ phase) << 4) + static_cast<uint32_t>(lane & 3) * 4;
    gemm::stShared32(base + rowOff0 + col, gemm::packPair<T>(v0 * scale0, v1 * scale0));
    gemm::stShared32(base + rowOff1 + col, gemm::packPair<T>(v2 * scale1, v3 * scale1));
  }
}

// The rows' scales of a warpgroup's rows r and r + 8 (1 without rowScale, or past the group).
__device__ __forceinline__ void rowScales(const float* rowScale, int32_t rowBase, int32_t rowsHere, int r,
                                          float& scale0, float& scale1) {
  scale0 = 1.0f;
  scale1 = 1.0f;
  if (rowScale != nullptr) {
    if (r < rowsHere) scale0 = rowScale[rowBase + r];
    if (r + 8 < rowsHere) scale1 = rowScale[rowBase + r + 8];
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): rows [64 wg, 64 wg + 64) of each tile; t = thread index in the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, GroupedGemmEpilogue Epi, bool BMn>
__device__ __forceinline__ void runGroupedConsumer(const GroupedGemmKernelParams& p, gemm::SharedStorage<kStages>& s,
                                                   WorkRing& ring, int32_t firstWork, int32_t workStride, int wg,
                                                   int t) {
  constexpr int kChunks = kTileCols<Epi> / kEpiCols;
  static_assert(sizeof(s.c[0][0]) == kEpiChunkBytes, "the core's epilogue chunk is 64 rows of 128 bytes");
  float acc[128];
  gemm::PipeState<kStages> ps;
  GroupCursor cur;
  uint32_t epiChunks = 0;  // epilogue chunks written so far by this warpgroup (buffer parity)
  const uint32_t aOffset = static_cast<uint32_t>(wg) * kRowsPerConsumer * kBlockK * 2;
  const gemm::Barrier epiBar = wg == 0 ? gemm::Barrier::kConsumerEpilogue0 : gemm::Barrier::kConsumerEpilogue1;
  const int warp = t / 32;
  const int lane = t % 32;
  const int r = warp * 16 + lane / 4;  // this thread's accumulator rows r and r + 8 (same swizzle phase r & 7)
  const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
  const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
  const uint32_t phase = static_cast<uint32_t>(r & 7);

  GroupTile tile;
  RingPos rp;
  for (int32_t i = 0;; ++i) {
    if (!nextConsumerTile<Epi>(p, ring, rp, cur, firstWork + i * workStride, tile)) break;
    const int32_t rowBase = tile.row0 + wg * kRowsPerConsumer;
    const int32_t rowsHere = tile.rowEnd - rowBase;  // rows of ours inside the group (warpgroup-uniform)
    if (p.skipIdleHalves != 0 && rowsHere <= 0) {
      // The group ends in the other warpgroup's half of this tile: nothing of ours is stored, so hand each stage
      // back as it lands and leave the tensor cores to the other warpgroup (it then runs about twice as fast).
      for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
        gemm::mbarWait(&s.full[ps.stage], ps.phase);  // keeps this warpgroup's pipeline position in step
        gemm::releaseStage<T, kStages, 1>(s, ps.stage, t);
        ps.advance();
      }
      continue;
    }
    // ---- mainloop (as the core's): one k-block in flight behind the one being issued.
    int prevStage = 0;
    for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
      gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage landed
      const uint64_t descA = gemm::makeSmemDesc(gemm::smemAddr(s.a[ps.stage]) + aOffset);
      const uint64_t descB = gemm::makeBDesc<BMn>(gemm::smemAddr(s.b[ps.stage]));
      gemm::fenceAccumulators(acc);
      gemm::wgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / gemm::kMmaK; ++kk) {
        gemm::Wgmma64x256<T, BMn>::run(acc, descA + 2 * kk, descB + gemm::kBDescKStep<BMn> * kk,
                                       (kb > 0 || kk > 0) ? 1u : 0u);
      }
      gemm::wgmmaCommit();
      gemm::fenceAccumulators(acc);
      gemm::wgmmaWait<1>();  // the previous k-block's wgmmas are done: its stage can be refilled
      if (kb > 0) gemm::releaseStage<T, kStages, 1>(s, prevStage, t);
      prevStage = ps.stage;
      ps.advance();
    }
    gemm::wgmmaWait<0>();
    gemm::fenceAccumulators(acc);
    gemm::releaseStage<T, kStages, 1>(s, prevStage, t);  // numKBlocks >= 1 (the host refuses k == 0)

    // ---- epilogue
    if (rowsHere <= 0) continue;
    float scale0, scale1;
    rowScales(p.rowScale, rowBase, rowsHere, r, scale0, scale1);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int32_t chunkCol = tile.col0 + c * kEpiCols;
      if (chunkCol >= p.nOut) break;  // uniform: the rest of the tile lies past nOut
      storeGroupChunk<T, 2>(gemm::smemAddr(s.c[wg][0]), &p.tmOut, p.out, p.ldOut, p.nOut, rowBase, rowsHere, chunkCol,
                            static_cast<uint32_t>(epiBar), t, epiChunks, [&](uint32_t base) {
                              stageChunk16<T, Epi>(base, acc, c, rowOff0, rowOff1, phase, lane, scale0, scale1);
                            });
    }
  }
  if (t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads; global writes complete with the grid
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), dynamic smem groupedGemmSmemBytes(),
// no cluster. This CTA is worker `ctaId` of `numCtas`.
// ---------------------------------------------------------------------------------------------------------------
template <class T, GroupedGemmEpilogue Epi, bool BMn>
__device__ __forceinline__ void runGroupedGemmCta(const GroupedGemmKernelParams& p, uint8_t* smemRaw, int32_t ctaId,
                                                  int32_t numCtas) {
  auto& s = *reinterpret_cast<gemm::SharedStorage<kStages>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                               ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  __shared__ WorkRing ring;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
    for (int i = 0; i < kWorkSlots; ++i) {
      gemm::mbarInit(&ring.full[i], 1);
      gemm::mbarInit(&ring.empty[i], kConsumerWarps);
    }
    gemm::initBarriers<kStages, 1>(s);  // ends with the barrier-init fence, which covers the ring's too
    gemm::prefetchTensorMap(&p.tmX);
    gemm::prefetchTensorMap(&p.tmW);
    gemm::prefetchTensorMap(&p.tmOut);
  }
  __syncthreads();  // barriers initialised before any thread uses them

  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<gemm::kProducerRegs>();
      if (t < 32) runGroupedProducer<Epi, BMn>(p, s, ring, ctaId, numCtas);
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<gemm::kConsumerRegs>();
      runGroupedConsumer<T, Epi, BMn>(p, s, ring, ctaId, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::grouped
