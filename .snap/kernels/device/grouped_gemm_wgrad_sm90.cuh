// The grouped TN GEMM (MoE weight gradients: out[e] = a_eᵀ · b_e) on the layouts core's TN form
// (device/gemm_layouts_sm90.cuh, C = Aᵀ · B: X = A MN-major, Y = B MN-major): its shared storage and stage count, wgmma
// wrappers, descriptors and fragment map come from there. No __global__ here; the kernels are in grouped_gemm_wgrad.cu.
//
// D = out[e] tile [128 rows of m, 256 columns of n]; K = the group's rows. Per k-block, wgmma A is a's rows
// [k0, k0 + 64) x 128 columns (two {64 columns, 64 rows} boxes), wgmma B is b's rows [k0, k0 + 64) x 256 columns (four
// boxes), both MN-major: inside each 8 KiB box, group row r is the 128-byte smem row r (the 128-byte swizzle permutes
// 16-byte pieces inside a row, never across rows).
//
// Groups that share a k-block. A group's k-blocks start at its first row (TMA boxes may start at any row), so only
// its last block can reach past its end, into the next group's rows (or past mTotal, which TMA reads as zeros). After
// that block lands, the consumers overwrite its rows past the group's end with zeros in both a and b, then run the
// wgmmas: those rows contribute exactly 0, even where the neighbouring rows hold inf or NaN (zeroing only one operand
// would leave 0 · inf = NaN). The alternative, a tensor map per expert bounded at the group's end, needs maps built on
// the device per launch; the zeroing costs one 64-row block per (expert, tile) and nothing on the others. Each
// consumer warpgroup zeroes its own 64 columns of a (one box, read only by its wgmmas) and half of b's four boxes (read
// by both warpgroups, hence a barrier of both before the wgmmas). Both warpgroups walk the same work units and
// k-blocks, so both reach that barrier for the same block.
//
// Work. Unit w is (expert w / perExpert, tile w % perExpert) with perExpert = tilesM x tilesN, the tile in the core's
// grouped raster order; CTA c takes units c, c + G, ... (G = grid). Every expert has the same tiles, so the mapping
// needs only the two offsets of the unit's expert; consecutive CTAs take consecutive tiles of one expert, so a large
// expert's tiles spread over every SM. An expert without rows has units too: they skip the mainloop and store zeros.
//
// Epilogue: the core's swizzled 64-row chunks (128 bytes of out per row: 64 16-bit or 32 fp32 columns), stored by a
// 3D TMA map over out [E, m, n] that clips at m and n inside each expert. No split-K: one CTA owns each output tile and
// sums its group's rows in order, so results are bitwise repeatable.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/gemm_layouts_sm90.cuh"
#include "grouped_gemm_wgrad_desc.hpp"

namespace tandem::kernels::grouped_wgrad {

namespace gl = gemm_layouts;
using gl::kThreads;

static_assert(kTileRows == gl::kBlockRows && kBlockRows == gl::kBlockK && kBox * kBlockRows * 2 == gl::kChunkBytes &&
              kOutBoxRows == gl::kRowsPerConsumer);

using Storage = gl::SharedStorage<kTileCols, true>;
using Geo = gl::Geometry<kTileCols, true>;
inline constexpr size_t kSmemBytes = gl::kSmemBytes<kTileCols, true>;
inline constexpr int kChunkElems = gl::kChunkBytes / 2;
inline constexpr int kABoxes = kTileRows / kBox;  // 2: one per consumer warpgroup
inline constexpr int kBBoxes = kTileCols / kBox;  // 4: two zeroed by each consumer warpgroup
static_assert(kABoxes == gl::kConsumerWarpgroups && kBBoxes % gl::kConsumerWarpgroups == 0);

__device__ __forceinline__ void tmaStore3d(const CUtensorMap* map, uint32_t srcSmem, int32_t c0, int32_t c1,
                                           int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(srcSmem), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void stSharedZero128(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}

__device__ __forceinline__ int32_t clampRow(int32_t v, int32_t mTotal) { return min(max(v, 0), mTotal); }

// ---------------------------------------------------------------------------------------------------------------
// Work units.
// ---------------------------------------------------------------------------------------------------------------
struct WgradTile {
  int32_t expert;
  int32_t row0, col0;  // first row (of m) and column (of n) of out[expert]
  int32_t k0;          // the group's first row of a and b
  int32_t rows;        // the group's rows (0: store zeros)
  __device__ __forceinline__ int32_t numKBlocks() const { return (rows + kBlockRows - 1) / kBlockRows; }
};

__device__ __forceinline__ int32_t numWork(const WgradKernelParams& p) {
  return p.numExperts * p.tilesM * p.tilesN;
}

__device__ __forceinline__ WgradTile tileOf(const WgradKernelParams& p, int32_t w) {
  const int32_t perExpert = p.tilesM * p.tilesN;
  WgradTile tile;
  tile.expert = w / perExpert;
  const gemm::TileCoord tc = gl::GroupedRaster{p.tilesM, p.tilesN, p.rasterRows}(w - tile.expert * perExpert);
  tile.row0 = tc.unitM * kTileRows;
  tile.col0 = tc.tileN * kTileCols;
  const int32_t lo = clampRow(p.groupOffsets[tile.expert], p.mTotal);
  const int32_t hi = clampRow(p.groupOffsets[tile.expert + 1], p.mTotal);
  tile.k0 = lo;
  tile.rows = max(hi - lo, 0);
  return tile;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread streams each unit's k-blocks into the stage ring. A box wholly past m (a) or n (b) is neither
// loaded nor expected: the stale shared memory it leaves feeds only accumulator rows / columns past the edge, which
// the epilogue never stores (as in the layouts core).
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void runWgradProducer(const WgradKernelParams& p, Storage& s, int32_t firstWork,
                                                 int32_t workStride) {
  gemm::PipeState<Geo::kStages> ps;
  const int32_t units = numWork(p);
  for (int32_t w = firstWork; w < units; w += workStride) {
    const WgradTile tile = tileOf(p, w);
    uint32_t bytes = 0;
#pragma unroll
    for (int j = 0; j < kABoxes; ++j) bytes += tile.row0 + kBox * j < p.m ? gl::kChunkBytes : 0;
#pragma unroll
    for (int j = 0; j < kBBoxes; ++j) bytes += tile.col0 + kBox * j < p.n ? gl::kChunkBytes : 0;
    const int32_t kbs = tile.numKBlocks();
    for (int32_t kb = 0; kb < kbs; ++kb) {
      // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
      gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
      gemm::mbarArriveExpectTx(&s.full[ps.stage], bytes);  // boxes past mTotal are zero-filled and counted in full
      const int32_t k0 = tile.k0 + kb * kBlockRows;
#pragma unroll
      for (int j = 0; j < kABoxes; ++j) {
        if (tile.row0 + kBox * j < p.m) {
          gemm::tmaLoad2d(&p.tmA, s.a[ps.stage] + j * kChunkElems, &s.full[ps.stage], tile.row0 + kBox * j, k0);
        }
      }
#pragma unroll
      for (int j = 0; j < kBBoxes; ++j) {
        if (tile.col0 + kBox * j < p.n) {
          gemm::tmaLoad2d(&p.tmB, s.b[ps.stage] + j * kChunkElems, &s.full[ps.stage], tile.col0 + kBox * j, k0);
        }
      }
      ps.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The group's last k-block holds `valid` of its rows (1..63): consumer warpgroup wg (thread t) zeroes smem rows
// [valid, 64) of its a box and of b boxes 2 wg and 2 wg + 1 in this stage, then both warpgroups meet. Boxes that were
// not loaded (past m or n) are zeroed too; that is harmless.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void zeroRowsPastGroup(Storage& s, int stage, int32_t valid, int wg, int t) {
  const uint32_t pieces = static_cast<uint32_t>(kBlockRows - valid) * (128 / 16);  // 16-byte pieces per box
  const uint32_t first = static_cast<uint32_t>(valid) * 128;
  const uint32_t aBox = gemm::smemAddr(s.a[stage]) + static_cast<uint32_t>(wg) * gl::kChunkBytes;
  const uint32_t bBox = gemm::smemAddr(s.b[stage]) + static_cast<uint32_t>(2 * wg) * gl::kChunkBytes;
  for (uint32_t i = static_cast<uint32_t>(t); i < 3 * pieces; i += 128) {
    const uint32_t box = i / pieces;  // 0: a; 1, 2: b boxes 2 wg, 2 wg + 1
    const uint32_t off = first + (i - box * pieces) * 16;
    stSharedZero128((box == 0 ? aBox : bBox + (box - 1) * gl::kChunkBytes) + off);
  }
  gemm::fenceProxyAsyncShared();  // our st.shared -> visible to the wgmmas (async proxy)
  // Publishes both warpgroups' zeros: each warpgroup's wgmmas read all four b boxes.
  gl::barSync(gl::Barrier::kConsumers, gl::kConsumerThreads);
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): out rows [64 wg, 64 wg + 64) of each tile; t = thread index in the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, class Out>
__device__ __forceinline__ void runWgradConsumer(const WgradKernelParams& p, Storage& s, int32_t firstWork,
                                                 int32_t workStride, int wg, int t) {
  constexpr int R = kTileCols / 2;  // fp32 accumulators per thread (wgmma m64n256)
  constexpr gl::Major kMN = gl::Major::kMN;
  float acc[R];
  gemm::PipeState<Geo::kStages> ps;
  uint32_t epiChunks = 0;  // TMA-store chunks committed by this warpgroup (thread 0 tracks the bulk groups)
  const uint32_t xOffset = static_cast<uint32_t>(wg) * gl::kChunkBytes;  // this warpgroup's a box
  const gl::Barrier epiBar = wg == 0 ? gl::Barrier::kEpilogue0 : gl::Barrier::kEpilogue1;
  const int32_t units = numWork(p);

  for (int32_t w = firstWork; w < units; w += workStride) {
    const WgradTile tile = tileOf(p, w);
    const int32_t kbs = tile.numKBlocks();
    if (kbs == 0) {
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.f;
    }
    // ---- mainloop (the core's mmaKBlocks, plus the zeroing of the group's last, partial block)
    int prevStage = 0;
    for (int32_t kb = 0; kb < kbs; ++kb) {
      gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage landed
      const int32_t valid = tile.rows - kb * kBlockRows;
      if (valid < kBlockRows) zeroRowsPastGroup(s, ps.stage, valid, wg, t);  // CTA-uniform: the last block only
      const uint64_t descX = gl::makeDesc<kMN>(gemm::smemAddr(s.a[ps.stage]) + xOffset);
      const uint64_t descY = gl::makeDesc<kMN>(gemm::smemAddr(s.b[ps.stage]));
      gemm::fenceAccumulators(acc);
      gemm::wgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockRows / gl::kMmaK; ++kk) {
        gl::Wgmma<T, kTileCols>::template run<1, 1>(acc, descX + kk * gl::kDescKStep<kMN>,
                                                    descY + kk * gl::kDescKStep<kMN>, (kb > 0 || kk > 0) ? 1u : 0u);
      }
      gemm::wgmmaCommit();
      gemm::fenceAccumulators(acc);
      gemm::wgmmaWait<1>();  // the previous k-block's wgmmas are done: its stage can be refilled
      // Pairs with the producer's mbarWait(empty): both warpgroups' wgmma reads of that stage are complete.
      if (kb > 0 && t == 0) gemm::mbarArrive(&s.empty[prevStage]);
      prevStage = ps.stage;
      ps.advance();
    }
    // Unconditional (a no-op without wgmmas in flight): behind a branch, ptxas cannot prove the epilogue's reads of
    // acc come after the wait and serialises the mainloop's wgmmas instead (warning C7517).
    gemm::wgmmaWait<0>();
    gemm::fenceAccumulators(acc);
    if (kbs > 0 && t == 0) gemm::mbarArrive(&s.empty[prevStage]);

    // ---- epilogue (the core's swizzled TMA-store chunks, 3D: the expert is the map's third coordinate)
    const int32_t rowBase = tile.row0 + wg * gl::kRowsPerConsumer;
    if (rowBase >= p.m) continue;  // warpgroup-uniform: nothing of ours lies inside out[e]
    constexpr int kCols = 128 / static_cast<int>(sizeof(Out));  // output columns per 128-byte chunk row
    const int lane = t % 32;
    const int r = gl::fragRow(t, 0);  // accumulator rows r and r + 8 (same swizzle phase r & 7)
    const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
    const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
    const uint32_t phase = static_cast<uint32_t>(r & 7);
    const uint32_t q = static_cast<uint32_t>(lane & 3);
#pragma unroll
    for (int c = 0; c < kTileCols / kCols; ++c) {
      if (tile.col0 + c * kCols >= p.n) break;  // uniform: the rest of the tile lies past n
      const uint32_t buf = epiChunks & 1;
      if (epiChunks >= 2) {
        // The store issued from this buffer two chunks ago must have finished reading it.
        if (t == 0) gemm::bulkWaitRead<1>();
        gl::barSync(epiBar, 128);
      }
      const uint32_t base = gemm::smemAddr(s.c[wg][buf]);
      gl::stageSwizzledChunk<Out, T, kCols>(base, rowOff0, rowOff1, phase, q, acc, c);
      gemm::fenceProxyAsyncShared();  // our st.shared -> visible to the TMA engine
      gl::barSync(epiBar, 128);       // publishes the whole chunk to thread 0
      if (t == 0) {
        tmaStore3d(&p.tmOut, base, tile.col0 + c * kCols, rowBase, tile.expert);
        gemm::bulkCommit();
      }
      ++epiChunks;
    }
  }
  if (t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads, kSmemBytes of dynamic
// shared memory, no cluster. Worker `cta` of `numCtas` takes units cta, cta + numCtas, ...
// ---------------------------------------------------------------------------------------------------------------
template <class T, class Out>
__device__ __forceinline__ void runWgradCta(const WgradKernelParams& p, uint8_t* smemRaw, int32_t cta,
                                            int32_t numCtas) {
  auto& s = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) & ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
#pragma unroll
    for (int i = 0; i < Geo::kStages; ++i) {
      gemm::mbarInit(&s.full[i], 1);                         // the producer's expect_tx
      gemm::mbarInit(&s.empty[i], gl::kConsumerWarpgroups);  // one arrival per consumer warpgroup
    }
    gemm::fenceBarrierInit();
    gemm::prefetchTensorMap(&p.tmA);
    gemm::prefetchTensorMap(&p.tmB);
    gemm::prefetchTensorMap(&p.tmOut);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<gl::kProducerRegs>();
      if (t == 0) runWgradProducer(p, s, cta, numCtas);
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<gl::kConsumerRegs>();
      runWgradConsumer<T, Out>(p, s, cta, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::grouped_wgrad
