// FP8 grouped GEMM (sm_90a): the device code of kernels/grouped_gemm_fp8.cu (public API
// tandem/kernels/grouped_gemm_fp8.hpp). No __global__ here.
//
// Composed of two existing kernels' pieces, not a third copy of either:
//   - the FP8 core's CTA (device/gemm_fp8_sm90.cuh): warpgroup 0 produces, warpgroups 1 and 2 consume 64 rows each of
//     a 128 x 256 tile; its block-scaled shared storage (4 stages of A, B and A's 128 row scales per k-block of 128)
//     and its main loop mainLoopBlock (per k-block and 128-column half, a fresh m64n128 accumulator promoted into the
//     fp32 tile accumulator with sa[row] * sb[half]);
//   - the grouped GEMM's tile order and epilogue (device/grouped_gemm_sm90.cuh): findTile over the device-side group
//     offsets, the producer loop with its optional row-tile waits and dynamic order (runGroupedProducerWith, here
//     with an FP8 loader), and storeGroupChunk (swizzled chunk, TMA store, masked copy of a group's last rows).
//
// Weight scales per half: kStore's halves are w rows [col0, col0 + 128) and [col0 + 128, col0 + 256), kSwiGlu's the
// gate rows [col0, col0 + 128) and the up rows [f + col0, f + col0 + 128) (the 4D map loads them as the two halves of
// B). kBlock reads each half's 128 x 128 block row of scales (one per k-block); kPerExpert one scale for both.
//
// kSwiGlu's quantisation: a tile's 128 h columns are one 1 x 128 scale block, so each row's amax is a reduction over
// the 4 lanes that hold its columns (lanes 4i..4i+3 of a warp hold rows r and r + 8, 32 columns each), with no shared
// memory and no second pass. The e4m3 chunk (64 rows x 128 bytes) then goes out as the 16-bit kernels' chunks do.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "device/gemm_fp8_sm90.cuh"
#include "device/grouped_gemm_sm90.cuh"
#include "grouped_gemm_fp8_desc.hpp"

namespace tandem::kernels::grouped_fp8 {

using gemm_fp8::E4M3;
using gemm_fp8::kHalfCols;
using gemm_fp8::kRowsPerConsumer;
using gemm_fp8::kThreads;
using grouped::GroupTile;
using Storage = gemm_fp8::SharedStorage<gemm_fp8::Scaling::kBlock>;
using Geometry = gemm_fp8::Geometry<gemm_fp8::Scaling::kBlock>;

static_assert(kBlockK == gemm_fp8::kBlockK && kScaleABoxRows == gemm_fp8::kScaleABoxRows);
static_assert(grouped::kTileRows == gemm_fp8::kBlockRows && grouped::kStoreTileCols == gemm_fp8::kBlockCols &&
                  grouped::kSwiGluTileCols == kHalfCols,
              "the grouped tile order walks the FP8 core's tiles");
static_assert(grouped::kEpiChunkBytes == gemm_fp8::kChunkBytes, "one epilogue chunk geometry");
static_assert(kRowsPerConsumer == grouped::kRowsPerConsumer);
static_assert(gemm_fp8::kSmemBytes<gemm_fp8::Scaling::kBlock> + sizeof(grouped::WorkRing) <= gemm_fp8::kSmemLimit,
              "the core's block-scaled storage plus the tile-order ring must fit the opt-in shared memory");

inline constexpr float kE4M3Max = 448.0f;
// The smallest amax a row block is quantised with: keeps kE4M3Max / amax finite (and the scale a normal fp32) for an
// all-zero block, whose values then all quantise to zero.
inline constexpr float kMinAmax = 1e-30f;

__device__ __forceinline__ void stShared16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// ---------------------------------------------------------------------------------------------------------------
// Producer side: what one k-block of a tile loads (runGroupedProducerWith's loader).
// ---------------------------------------------------------------------------------------------------------------
template <GroupedGemmEpilogue Epi>
struct Fp8Loader {
  const GroupedGemmFp8KernelParams& p;
  Storage& s;
  // Every box whole, also where it reaches past mTotal, n or k (TMA zero-fills those bytes and counts them).
  __device__ __forceinline__ uint32_t bytes(const GroupTile&) const { return Geometry::kStageBytes; }
  __device__ __forceinline__ void load(const GroupTile& tile, int32_t kb, int stage, uint64_t* bar) const {
    const int32_t k0 = kb * kBlockK;
    gemm::tmaLoad2d(&p.g.tmX, s.a[stage], bar, k0, tile.row0);
    if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
      grouped::tmaLoad4d(&p.g.tmW, s.b[stage], bar, k0, tile.col0, 0, tile.expert);
      grouped::tmaLoad4d(&p.g.tmW, s.b[stage] + kHalfCols * kBlockK, bar, k0, tile.col0, 1, tile.expert);
    } else {
      grouped::tmaLoad3d(&p.g.tmW, s.b[stage], bar, k0, tile.col0, tile.expert);
    }
    // The tile's 128 row scales of k-block kb, from the multiple of 4 at or below its first row (kScaleABoxRows).
    gemm::tmaLoad2d(&p.tmXScale, s.sfa[stage], bar, tile.row0 & ~3, kb);
  }
};

// The weight scales of a tile's two halves (see the file comment).
template <GroupedGemmEpilogue Epi>
__device__ __forceinline__ gemm_fp8::BlockScalesB weightScales(const GroupedGemmFp8KernelParams& p,
                                                               const GroupTile& tile) {
  constexpr bool kSwiGlu = Epi == GroupedGemmEpilogue::kSwiGlu;
  const float* const base = p.wScale + static_cast<int64_t>(tile.expert) * p.wScaleExpert;
  const bool secondHalf = kSwiGlu || tile.col0 + kHalfCols < p.g.nOut;  // kStore: a half wholly past n is skipped
  const int32_t row1 = kSwiGlu ? p.f + tile.col0 : tile.col0 + kHalfCols;
  const float* const half0 = base + static_cast<int64_t>(tile.col0 / kHalfCols) * p.wScaleRowBlock;
  const float* const half1 = secondHalf ? base + static_cast<int64_t>(row1 / kHalfCols) * p.wScaleRowBlock : half0;
  return gemm_fp8::BlockScalesB{{half0, half1}, p.wScaleKStep, secondHalf};
}

// ---------------------------------------------------------------------------------------------------------------
// kSwiGlu epilogue: h = silu(gate) * up (times the row scale) for the warpgroup's 64 rows x 128 columns, quantised
// to e4m3 with one scale per row, written as one chunk plus the rows' scales.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void storeSwiGluFp8(const GroupedGemmFp8KernelParams& p, Storage& s, float (&acc)[128],
                                               const GroupTile& tile, int32_t rowBase, int32_t rowsHere, int wg, int t,
                                               uint32_t barId, uint32_t& epiChunks) {
  constexpr int kUp = kHalfCols / 8;  // the up column group matching gate group j
  const int lane = t % 32;
  const int r = (t / 32) * 16 + lane / 4;
  float scale0, scale1;
  grouped::rowScales(p.g.rowScale, rowBase, rowsHere, r, scale0, scale1);
  float amax0 = 0.0f;
  float amax1 = 0.0f;
#pragma unroll
  for (int j = 0; j < kUp; ++j) {  // h in place of the gate accumulators
    acc[4 * j + 0] = grouped::silu(acc[4 * j + 0]) * acc[4 * (j + kUp) + 0] * scale0;
    acc[4 * j + 1] = grouped::silu(acc[4 * j + 1]) * acc[4 * (j + kUp) + 1] * scale0;
    acc[4 * j + 2] = grouped::silu(acc[4 * j + 2]) * acc[4 * (j + kUp) + 2] * scale1;
    acc[4 * j + 3] = grouped::silu(acc[4 * j + 3]) * acc[4 * (j + kUp) + 3] * scale1;
    amax0 = fmaxf(amax0, fmaxf(fabsf(acc[4 * j + 0]), fabsf(acc[4 * j + 1])));
    amax1 = fmaxf(amax1, fmaxf(fabsf(acc[4 * j + 2]), fabsf(acc[4 * j + 3])));
  }
  // The row's other 96 columns are in the 3 lanes of the same lane / 4.
#pragma unroll
  for (int d = 1; d < 4; d *= 2) {
    amax0 = fmaxf(amax0, __shfl_xor_sync(0xffffffffu, amax0, d));
    amax1 = fmaxf(amax1, __shfl_xor_sync(0xffffffffu, amax1, d));
  }
  amax0 = fmaxf(amax0, kMinAmax);
  amax1 = fmaxf(amax1, kMinAmax);
  const float inv0 = kE4M3Max / amax0;
  const float inv1 = kE4M3Max / amax1;
  const uint32_t q = static_cast<uint32_t>(lane & 3);
  const uint32_t phase = static_cast<uint32_t>(r & 7);
  const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
  const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
  grouped::storeGroupChunk<uint8_t, Geometry::kEpiBufs>(
      gemm::smemAddr(s.c[wg][0]), &p.g.tmOut, p.g.out, p.g.ldOut, p.g.nOut, rowBase, rowsHere, tile.col0, barId, t,
      epiChunks, [&](uint32_t base) {
#pragma unroll
        for (int j = 0; j < kUp; ++j) {
          // Columns 8 j + 2 q + {0, 1} are bytes of 16-byte piece j / 2, swizzled by the row (128B swizzle).
          const uint32_t col =
              (((static_cast<uint32_t>(j) >> 1) ^ phase) << 4) + (static_cast<uint32_t>(j) & 1) * 8 + q * 2;
          const __nv_fp8x2_storage_t v0 = __nv_cvt_float2_to_fp8x2(
              make_float2(acc[4 * j + 0] * inv0, acc[4 * j + 1] * inv0), __NV_SATFINITE, __NV_E4M3);
          const __nv_fp8x2_storage_t v1 = __nv_cvt_float2_to_fp8x2(
              make_float2(acc[4 * j + 2] * inv1, acc[4 * j + 3] * inv1), __NV_SATFINITE, __NV_E4M3);
          stShared16(base + rowOff0 + col, v0);
          stShared16(base + rowOff1 + col, v1);
        }
      });
  if (q == 0) {
    float* const scales = p.outScale + static_cast<int64_t>(tile.col0 / kHalfCols) * p.ldOutScale + rowBase;
    if (r < rowsHere) scales[r] = amax0 / kE4M3Max;
    if (r + 8 < rowsHere) scales[r + 8] = amax1 / kE4M3Max;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): rows [64 wg, 64 wg + 64) of each tile; t = thread index in the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <GroupedGemmEpilogue Epi>
__device__ __forceinline__ void runConsumer(const GroupedGemmFp8KernelParams& p, Storage& s, grouped::WorkRing& ring,
                                            int32_t firstWork, int32_t workStride, int wg, int t) {
  float acc[128];
  gemm::PipeState<Geometry::kStages> ps;
  grouped::GroupCursor cur;
  grouped::RingPos rp;
  GroupTile tile;
  uint32_t epiChunks = 0;  // epilogue chunks written so far by this warpgroup (thread 0 tracks the bulk groups)
  const uint32_t barId = static_cast<uint32_t>(wg == 0 ? gemm_fp8::Barrier::kEpilogue0 : gemm_fp8::Barrier::kEpilogue1);
  const int lane = t % 32;
  const int r = (t / 32) * 16 + lane / 4;
  for (int32_t i = 0;; ++i) {
    if (!grouped::nextConsumerTile<Epi>(p.g, ring, rp, cur, firstWork + i * workStride, tile)) break;
    gemm_fp8::mainLoopBlock<E4M3, E4M3>(s, ps, acc, p.g.numKBlocks, weightScales<Epi>(p, tile), tile.row0 & 3, wg,
                                        t);
    const int32_t rowBase = tile.row0 + wg * kRowsPerConsumer;
    const int32_t rowsHere = tile.rowEnd - rowBase;  // rows of ours inside the group (warpgroup-uniform)
    if (rowsHere <= 0) continue;
    if constexpr (Epi == GroupedGemmEpilogue::kSwiGlu) {
      storeSwiGluFp8(p, s, acc, tile, rowBase, rowsHere, wg, t, barId, epiChunks);
    } else {
      float scale0, scale1;
      grouped::rowScales(p.g.rowScale, rowBase, rowsHere, r, scale0, scale1);
      const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
      const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
      const uint32_t phase = static_cast<uint32_t>(r & 7);
#pragma unroll
      for (int c = 0; c < grouped::kStoreTileCols / grouped::kEpiCols; ++c) {
        const int32_t chunkCol = tile.col0 + c * grouped::kEpiCols;
        if (chunkCol >= p.g.nOut) break;  // uniform: the rest of the tile lies past n
        grouped::storeGroupChunk<__nv_bfloat16, Geometry::kEpiBufs>(
            gemm::smemAddr(s.c[wg][0]), &p.g.tmOut, p.g.out, p.g.ldOut, p.g.nOut, rowBase, rowsHere, chunkCol, barId, t,
            epiChunks, [&](uint32_t base) {
              grouped::stageChunk16<__nv_bfloat16, GroupedGemmEpilogue::kStore>(base, acc, c, rowOff0, rowOff1, phase,
                                                                                lane, scale0, scale1);
            });
      }
    }
  }
  if (t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads; global writes complete with the grid
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), dynamic smem groupedGemmFp8SmemBytes(),
// no cluster. This CTA is worker `ctaId` of `numCtas`.
// ---------------------------------------------------------------------------------------------------------------
template <GroupedGemmEpilogue Epi>
__device__ __forceinline__ void runCta(const GroupedGemmFp8KernelParams& p, uint8_t* smemRaw, int32_t ctaId,
                                       int32_t numCtas) {
  auto& s = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) & ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  __shared__ grouped::WorkRing ring;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
    for (int i = 0; i < grouped::kWorkSlots; ++i) {
      gemm::mbarInit(&ring.full[i], 1);
      gemm::mbarInit(&ring.empty[i], grouped::kConsumerWarps);
    }
#pragma unroll
    for (int i = 0; i < Geometry::kStages; ++i) {
      gemm::mbarInit(&s.full[i], 1);
      gemm::mbarInit(&s.empty[i], gemm_fp8::kConsumerWarpgroups);
    }
    gemm::fenceBarrierInit();
    gemm::prefetchTensorMap(&p.g.tmX);
    gemm::prefetchTensorMap(&p.g.tmW);
    gemm::prefetchTensorMap(&p.g.tmOut);
    gemm::prefetchTensorMap(&p.tmXScale);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<gemm_fp8::kProducerRegs>();
      if (t < 32) {
        grouped::runGroupedProducerWith<Epi>(p.g, s.full, s.empty, ring, ctaId, numCtas, Fp8Loader<Epi>{p, s});
      }
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<gemm_fp8::kConsumerRegs>();
      runConsumer<Epi>(p, s, ring, ctaId, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::grouped_fp8
