// Device pieces of the fused GEMM + ReduceScatter and GEMM + AllReduce (kernels/gemm_rs.cu and kernels/gemm_ar.cu wire
// them into kernels; tandem/kernels/gemm_rs.hpp describes the design). Reuses the GEMM core of gemm_sm90.cuh through
// its kCustom epilogue hook; adds the tile order (peers' rows first, own rows last), the epilogue (push a partial half
// tile, or reduce the own rows), the reduce and send roles, and the decomposed reduction kernel's body.
//
// Units: a tile is 128 x 256 (the core's), a half tile 64 x 256 (one consumer warpgroup's share). Every flag is per
// half tile, index ht = (row0 / 64) * tilesN + col0 / 256. Staging matrices are padded to whole tiles (ldP columns,
// tilesM * 128 rows), so partial tiles are written and read without masks; the output is masked.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device/gemm_sm90.cuh"
#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "tandem/kernels/gemm_rs.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels::rs {

using gemm::kBlockM;
using gemm::kBlockN;
inline constexpr int kMaxRanks = kGemmRsMaxRanks;
inline constexpr int kHalfRows = 64;
inline constexpr int kThreads = gemm::kThreads;  // every CTA of the fused kernel and of the reduction kernel
inline constexpr uint32_t kOpGemmRs = 2;         // WaitCtx.op: OpKind::kGemmRs / kGemmAr in common/descriptor.hpp
inline constexpr uint32_t kOpGemmAr = 3;
inline constexpr size_t kPeerBarOffset = 16;  // in a compute CTA's extra smem (see kExtraSmem)

struct FusedKernelParams {
  gemm::GemmKernelParams g;  // tmA / tmB of this rank's slice; m, n, k, numKBlocks, tilesN; tmC: see ownTma
  CUtensorMap tmPeer;        // ownTma 2: the peer's partials in this rank's inbox, [tilesM * 128, ldP], 64 x 64 boxes
  int32_t rank, nranks;
  int32_t tilesM, tilesN;
  int32_t allReduce, oneShot, transport, epiReduce;  // transport: GemmRsTransport
  int32_t numReduce, numSend, numCompute, deferRelease;
  int32_t groupM, numPhases, numWork, ownWork0;  // ownWork0: first work index of the last (own) phase
  int32_t phaseTr0[kMaxRanks], phaseTr1[kMaxRanks];  // tile rows visited in phase p, [tr0, tr1)
  int32_t redTr0[kMaxRanks], redTr1[kMaxRanks];      // tile rows reduced by rank d (two-shot)
  int64_t ldP;         // staging row stride, elements of the partial type
  int64_t ldOut;       // output row stride, elements
  int64_t srcStride;   // elements of the partial type between the inbox matrices of consecutive sources
  int64_t flagStride;  // words between the per-source rows of inFlags / finFlags
  uint64_t epoch;
  const uint64_t* epochWord;  // device-epoch mode: the epoch is *epochWord (opEpoch, wait.cuh); null: epoch
  uint64_t timeoutNs;
  void* inbox[kMaxRanks];      // rank q's inbox (this parity): [src][tilesM * 128][ldP]
  void* outbox[kMaxRanks];     // rank q's outbox (this parity): [tilesM * 128][ldP]
  uint64_t* inFlags[kMaxRanks];   // rank q: [src][half tiles]: src's partial landed in q's inbox
  uint64_t* outFlags[kMaxRanks];  // rank q: [half tiles]: q's partial is complete in q's outbox
  uint64_t* finFlags[kMaxRanks];  // rank q: [reducer][half tiles]: reduced values written into q's output
  uint64_t* ready[kMaxRanks];     // rank q: [src]: src's decomposed GEMM finished
  void* out[kMaxRanks];           // rank q's output
  const uint64_t* abortWord;
  ErrorSlot* errorSlot;
  uint64_t* trace;     // profiling, see GemmRsParams::trace (null = off)
  int32_t traceTiles;
  int32_t finViaCopier;  // all-reduce, transport kCopy: consumers write the local output only, copiers broadcast
  // Own tiles through TMA (g.tmC: this rank's output, [its rows, n], 64 x 64 boxes): 0 never; 1 one rank, nothing to
  // add; 2 two ranks: the peer's partial TMA-loaded (tmPeer) and added in smem first (peerTile says which half tiles);
  // 3 the same, the copier warps issuing the first two chunks' loads during the mainloop.
  int32_t ownTma;
};

// ---------------------------------------------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ WaitCtx makeWaitCtx(const FusedKernelParams& kp, Role role, uint64_t startNs) {
  return WaitCtx{kp.abortWord, kp.errorSlot, startNs + kp.timeoutNs, kp.allReduce ? kOpGemmAr : kOpGemmRs,
                 static_cast<uint32_t>(role), static_cast<uint32_t>(kp.rank)};
}

// Owner of output row `row` under the balanced split (rsRowsOf / rsRowOffset).
__device__ __forceinline__ int32_t ownerOf(const FusedKernelParams& kp, int32_t row) {
  const int32_t q = kp.g.m / kp.nranks;
  const int32_t rem = kp.g.m % kp.nranks;
  const int32_t big = rem * (q + 1);
  return row < big ? row / (q + 1) : rem + (row - big) / q;  // q > 0 whenever row >= big
}
__device__ __forceinline__ int32_t rowOffsetOf(const FusedKernelParams& kp, int32_t r) {
  const int32_t q = kp.g.m / kp.nranks;
  const int32_t rem = kp.g.m % kp.nranks;
  return r * q + min(r, rem);
}
// Two-shot: the rank that reduces tile row tr (the owner of its first row).
__device__ __forceinline__ int32_t reducerOf(const FusedKernelParams& kp, int32_t tr) {
  int32_t red = 0;
  for (int d = 0; d < kp.nranks; ++d) {
    if (tr >= kp.redTr0[d] && tr < kp.redTr1[d]) red = d;
  }
  return red;
}

// Where the reducer (this rank) finds source s's partial of this op, and its flag.
template <class P>
__device__ __forceinline__ const P* srcBase(const FusedKernelParams& kp, int32_t s) {
  if (kp.oneShot || kp.transport == static_cast<int32_t>(GemmRsTransport::kPull)) {
    return static_cast<const P*>(kp.outbox[s]);
  }
  if (s == kp.rank && kp.transport == static_cast<int32_t>(GemmRsTransport::kSend)) {
    return static_cast<const P*>(kp.outbox[s]);
  }
  return static_cast<const P*>(kp.inbox[kp.rank]) + s * kp.srcStride;
}
__device__ __forceinline__ const uint64_t* srcFlag(const FusedKernelParams& kp, int32_t s, int32_t ht) {
  if (kp.oneShot || kp.transport == static_cast<int32_t>(GemmRsTransport::kPull)) return kp.outFlags[s] + ht;
  if (s == kp.rank && kp.transport == static_cast<int32_t>(GemmRsTransport::kSend)) return kp.outFlags[s] + ht;
  return kp.inFlags[kp.rank] + s * kp.flagStride + ht;
}
// Where this rank's compute epilogue writes its partial of a half tile reduced by `red`, and the flag it releases.
// (kCopy: the local outbox, copied on by the copier warps, which release the reducer's inbox flag.)
template <class P>
__device__ __forceinline__ P* dstBase(const FusedKernelParams& kp, int32_t red) {
  if (kp.oneShot || kp.transport != static_cast<int32_t>(GemmRsTransport::kPush)) {
    return static_cast<P*>(kp.outbox[kp.rank]);
  }
  return static_cast<P*>(kp.inbox[red]) + kp.rank * kp.srcStride;
}
__device__ __forceinline__ uint64_t* dstFlag(const FusedKernelParams& kp, int32_t red, int32_t ht) {
  if (kp.oneShot || kp.transport != static_cast<int32_t>(GemmRsTransport::kPush)) return kp.outFlags[kp.rank] + ht;
  return kp.inFlags[red] + kp.rank * kp.flagStride + ht;
}
__device__ __forceinline__ bool isCopy(const FusedKernelParams& kp) {
  return kp.transport == static_cast<int32_t>(GemmRsTransport::kCopy);
}
// ownTma 2 / 3: whether this rank's own half tile at (row0, n0) takes the TMA path with the peer's partial: wholly
// inside N, every row this rank's. The consumers and (ownTma 3) the copier warps must agree on it.
__device__ __forceinline__ bool peerTile(const FusedKernelParams& kp, int32_t row0, int32_t n0) {
  return kp.ownTma >= 2 && n0 + kBlockN <= kp.g.n && ownerOf(kp, row0) == kp.rank &&
         ownerOf(kp, min(row0 + kHalfRows - 1, kp.g.m - 1)) == kp.rank;
}

// Ranks (other than this one) whose output receives reduced rows of the half tile at row0 from this rank.
struct RankRange {
  int32_t lo, hi;  // inclusive; empty when lo > hi
};
__device__ __forceinline__ RankRange finTargets(const FusedKernelParams& kp, int32_t row0) {
  if (kp.nranks == 1 || (kp.allReduce && kp.oneShot)) return {1, 0};
  if (kp.allReduce) return {0, kp.nranks - 1};
  return {ownerOf(kp, row0), ownerOf(kp, min(row0 + kHalfRows - 1, kp.g.m - 1))};
}
__device__ __forceinline__ bool needFin(const FusedKernelParams& kp, int32_t row0) {
  const RankRange r = finTargets(kp, row0);
  return r.lo < r.hi || (r.lo == r.hi && r.lo != kp.rank);
}
// One thread: publishes "reduced rows of half tile ht are in your output" to every target rank. The caller made every
// thread's stores of the half tile performed at system scope first (fenceAcqRelSys by each, then a barrier).
__device__ __forceinline__ void releaseFin(const FusedKernelParams& kp, int32_t row0, int32_t ht) {
  const RankRange r = finTargets(kp, row0);
  for (int32_t q = r.lo; q <= r.hi; ++q) {
    // release: publishes this rank's stores of the half tile into q's output; pairs with waitGeq in runFinalWaits.
    if (q != kp.rank) stReleaseSys(kp.finFlags[q] + kp.rank * kp.flagStride + ht, opEpoch(kp));
  }
}

template <class P>
__device__ __forceinline__ float4 loadP4(const P* p);
template <>
__device__ __forceinline__ float4 loadP4<float>(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));  // L2 only: the data was written by another SM or GPU
}
template <>
__device__ __forceinline__ float4 loadP4<__nv_bfloat16>(const __nv_bfloat16* p) {
  const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
template <>
__device__ __forceinline__ float4 loadP4<__half>(const __half* p) {
  const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
// The same, split in two so that a load can be issued chunks ahead of its use: loadRaw (the load) and toFloat4.
template <class P>
struct RawOf {
  using type = uint2;  // 4 x 16-bit
};
template <>
struct RawOf<float> {
  using type = float4;
};
template <class P>
__device__ __forceinline__ typename RawOf<P>::type loadRaw(const P* p) {
  if constexpr (sizeof(P) == 4) {
    return __ldcg(reinterpret_cast<const float4*>(p));
  } else {
    return __ldcg(reinterpret_cast<const uint2*>(p));
  }
}
template <class P>
__device__ __forceinline__ float4 toFloat4(typename RawOf<P>::type raw) {
  if constexpr (sizeof(P) == 4) {
    return raw;
  } else if constexpr (std::is_same_v<P, __nv_bfloat16>) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  } else {
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// 4 consecutive final values rounded once to T (16-bit: packed in pairs; fp32, the FP8 ops' fp32 output: as they are)
// and stored at dst.
template <class T>
__device__ __forceinline__ void storeQuad(T* dst, float4 v) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    uint2 w;
    w.x = gemm::packPair<T>(v.x, v.y);
    w.y = gemm::packPair<T>(v.z, v.w);
    *reinterpret_cast<uint2*>(dst) = w;
  }
}

// Final values of 4 consecutive columns of one row, rounded once to T, into the output(s) that hold the row.
template <class T>
__device__ __forceinline__ void storeFinal4(const FusedKernelParams& kp, int32_t row, int32_t col, float4 v) {
  if (row >= kp.g.m || col >= kp.g.n) return;
  const int64_t off = static_cast<int64_t>(row) * kp.ldOut + col;
  if (kp.allReduce) {
    if (kp.oneShot || kp.finViaCopier) {
      storeQuad<T>(static_cast<T*>(kp.out[kp.rank]) + off, v);
    } else {
      for (int q = 0; q < kp.nranks; ++q) storeQuad<T>(static_cast<T*>(kp.out[q]) + off, v);
    }
  } else {
    const int32_t q = ownerOf(kp, row);
    storeQuad<T>(static_cast<T*>(kp.out[q]) + static_cast<int64_t>(row - rowOffsetOf(kp, q)) * kp.ldOut + col, v);
  }
}

// Where a half tile's final values go, resolved once per half tile (the owner lookup costs integer divisions):
// one pointer when every row has one destination (the common case), else storeFinal4 per element. store<true> is for
// code that has branched on `single` already (no fallback code inlined).
template <class T>
struct FinalWriter {
  const FusedKernelParams* kp;
  T* base;       // element (row, col) at base + row * ldOut + col, when single
  bool single;
  __device__ __forceinline__ FinalWriter(const FusedKernelParams& p, int32_t row0) : kp(&p), base(nullptr), single(false) {
    if (p.allReduce) {
      if (p.oneShot || p.finViaCopier || p.nranks == 1) {
        base = static_cast<T*>(p.out[p.rank]);
        single = true;
      }
    } else {
      const int32_t lo = ownerOf(p, row0);
      const int32_t hi = ownerOf(p, min(row0 + kHalfRows - 1, p.g.m - 1));
      if (lo == hi) {
        base = static_cast<T*>(p.out[lo]) - static_cast<int64_t>(rowOffsetOf(p, lo)) * p.ldOut;
        single = true;
      }
    }
  }
  template <bool KnownSingle = false>
  __device__ __forceinline__ void store(int32_t row, int32_t col, float4 v) const {
    if constexpr (!KnownSingle) {
      if (!single) {
        storeFinal4<T>(*kp, row, col, v);
        return;
      }
    }
    if (row >= kp->g.m || col >= kp->g.n) return;
    storeQuad<T>(base + static_cast<int64_t>(row) * kp->ldOut + col, v);
  }
};

__device__ __forceinline__ uint32_t ldShared32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Two packed 16-bit values of P (bf16 or fp16) as floats.
template <class P>
__device__ __forceinline__ float2 toFloat2(uint32_t raw) {
  if constexpr (std::is_same_v<P, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&raw));
  }
}
__device__ __forceinline__ void stShared64(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ uint4 ldShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------------------------
// Tile order: phase p visits the tile rows reduced by rank (rank + 1 + p) % nranks (two-shot), so the own rows come
// last; one-shot has one phase with every tile row. A grouped raster inside each phase.
// ---------------------------------------------------------------------------------------------------------------
struct PhaseOrder {
  const FusedKernelParams* kp;
  __device__ __forceinline__ int32_t numWork() const { return kp->numWork; }
  __device__ __forceinline__ gemm::TileCoord operator()(int32_t w) const {
    const int32_t tilesN = kp->tilesN;
    int32_t p = 0;
    int32_t start = 0;
    while (p < kp->numPhases - 1 && w >= start + (kp->phaseTr1[p] - kp->phaseTr0[p]) * tilesN) {
      start += (kp->phaseTr1[p] - kp->phaseTr0[p]) * tilesN;
      ++p;
    }
    const gemm::GroupedRaster raster{kp->phaseTr1[p] - kp->phaseTr0[p], tilesN, kp->groupM};
    const gemm::TileCoord v = raster(w - start);
    return {kp->phaseTr0[p] + v.unitM, v.tileN};
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Compute epilogue (Epilogue::kCustom hook of the GEMM core). Per consumer warpgroup and half tile:
// - reduced by another rank (or by reduce CTAs): the partial goes through the warpgroup's smem (swizzled 64 x 128-byte
//   chunks) and out as 16-byte stores, whole 128-byte rows per 8 threads, into dstBase (a peer's inbox over NVLink, or
//   the local inbox / outbox); then the half tile's flag is released.
// - reduced here (epiReduce): waits for the other ranks' partials of the half tile, then per 64 x 32 fp32 chunk sums
//   all partials in rank order (its own straight from the accumulators) and stores the output.
// - reduced here with nothing to add (one rank): the GEMM core's TMA-store epilogue (storeOwnTma).
// Releases are deferred to the next tile's epilogue when the stores went over NVLink (deferRelease): by then they
// have long completed and the system-scope fence is cheap.
// ---------------------------------------------------------------------------------------------------------------
template <class T, class P>
struct RsEpilogue {
  const FusedKernelParams* kp;
  uint64_t startNs;
  uint32_t* done;    // smem [2]: half tiles finished per consumer warpgroup (transport kCopy: read by the copiers)
  uint32_t seq;      // half tiles this warpgroup has finished
  int32_t pendKind;  // 0 none, 1 partial flag (pendRed, pendHt), 2 output flags (pendRow0, pendHt)
  int32_t pendRed, pendHt, pendRow0;
  uint32_t tmaChunks;  // TMA-store chunks this warpgroup committed (thread 0 tracks the bulk groups)
  bool tmaReading;     // a committed TMA store may still read cbuf
  bool cbufGeneric;    // the last tile's epilogue read cbuf with ld.shared (other threads may still be at it)
  uint32_t peerLoads[2];  // ownTma 2: TMA loads issued into cbuf[b] (every thread counts; the parity of the next wait)

  __device__ __forceinline__ RsEpilogue(const FusedKernelParams* p, uint64_t start, uint32_t* doneCounters)
      : kp(p), startNs(start), done(doneCounters), seq(0), pendKind(0), pendRed(0), pendHt(0), pendRow0(0),
        tmaChunks(0), tmaReading(false), cbufGeneric(false), peerLoads{0, 0} {}
  // ownTma 2: the mbarrier that TMA loads into cbuf[b] of warpgroup wg complete on.
  __device__ __forceinline__ uint64_t* peerBar(int wg, int b) const {
    return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(done) + kPeerBarOffset) + wg * 2 + b;
  }

  // Profiling: field f of this warpgroup's tile `seq` (thread 0 only).
  __device__ __forceinline__ void trace(int wg, int f, uint64_t v) const {
    if (kp->trace == nullptr || static_cast<int32_t>(seq) >= kp->traceTiles) return;
    const int64_t block = (static_cast<int64_t>(blockIdx.x) * 2 + wg) * (kp->traceTiles + 1);
    kp->trace[(block + 1 + seq) * 4 + f] = v;
  }
  // The same with the time now, read only when tracing (%globaltimer is not free).
  __device__ __forceinline__ void traceNow(int wg, int f) const {
    if (kp->trace != nullptr) trace(wg, f, globaltimerNs());
  }

  static __device__ __forceinline__ gemm::Barrier barrierOf(int wg) {
    return wg == 0 ? gemm::Barrier::kConsumerEpilogue0 : gemm::Barrier::kConsumerEpilogue1;
  }

  __device__ __forceinline__ void release(int wg, int t) {
    if (pendKind == 0) return;  // warpgroup-uniform
    fenceAcqRelSys();           // this thread's stores of the pending half tile are performed at system scope
    gemm::namedBarSync(barrierOf(wg), 128);  // ... for all 128 threads, before thread 0 publishes
    if (t == 0) {
      if (pendKind == 1) {
        // release: publishes the partial half tile; pairs with waitGeq(srcFlag) in the reducer (epilogue or reduce
        // CTA) or with the send CTA's waitGeq(outFlags).
        stReleaseSys(dstFlag(*kp, pendRed, pendHt), opEpoch(*kp));
      } else {
        releaseFin(*kp, pendRow0, pendHt);
      }
    }
    pendKind = 0;
  }

  // acc -> smem chunk c: fp32 chunks are 64 rows x 32 columns, 16-bit chunks 64 rows x 64 columns; 128-byte rows,
  // 16-byte units swizzled by (row & 7). r = this thread's first accumulator row (the other is r + 8).
  template <class Q>
  static __device__ __forceinline__ void writeChunk(const float (&acc)[128], int c, uint32_t base, int r, int lane) {
    const uint32_t phase = static_cast<uint32_t>(r & 7);
    if constexpr (sizeof(Q) == 4) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * c + jj;
        const uint32_t u = static_cast<uint32_t>(jj * 2 + ((lane & 3) >> 1));
        const uint32_t off = ((u ^ phase) << 4) + static_cast<uint32_t>(lane & 1) * 8;
        stShared64(base + static_cast<uint32_t>(r) * 128 + off, acc[4 * j + 0], acc[4 * j + 1]);
        stShared64(base + static_cast<uint32_t>(r + 8) * 128 + off, acc[4 * j + 2], acc[4 * j + 3]);
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 8 * c + jj;
        const uint32_t off = ((static_cast<uint32_t>(jj) ^ phase) << 4) + static_cast<uint32_t>(lane & 3) * 4;
        gemm::stShared32(base + static_cast<uint32_t>(r) * 128 + off, gemm::packPair<Q>(acc[4 * j + 0], acc[4 * j + 1]));
        gemm::stShared32(base + static_cast<uint32_t>(r + 8) * 128 + off,
                         gemm::packPair<Q>(acc[4 * j + 2], acc[4 * j + 3]));
      }
    }
  }
  // Thread t's i-th 16-byte unit of a chunk: row (idx >> 3), unit (idx & 7); its swizzled smem address.
  static __device__ __forceinline__ uint32_t unitAddr(uint32_t base, int row, int u) {
    return base + static_cast<uint32_t>(row) * 128 + ((static_cast<uint32_t>(u) ^ static_cast<uint32_t>(row & 7)) << 4);
  }

  __device__ __forceinline__ void pushPartial(float (&acc)[128], int32_t row0, int32_t n0, int32_t red, int wg, int t,
                                              uint16_t (&cbuf)[2][64 * 64]) {
    constexpr int kColsPerChunk = 128 / static_cast<int>(sizeof(P));
    constexpr int kChunks = kBlockN / kColsPerChunk;
    constexpr int kElemsPerUnit = 16 / static_cast<int>(sizeof(P));
    const int lane = t % 32;
    const int r = (t / 32) * 16 + lane / 4;
    P* const dst = dstBase<P>(*kp, red) + static_cast<int64_t>(row0) * kp->ldP + n0;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t base = gemm::smemAddr(cbuf[c & 1]);
      // Double buffer: the last reads of this buffer (chunk c - 2) precede the barrier of chunk c - 1 in every thread.
      writeChunk<P>(acc, c, base, r, lane);
      gemm::namedBarSync(barrierOf(wg), 128);  // publishes the chunk to the warpgroup
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int idx = t + 128 * i;
        const int row = idx >> 3, u = idx & 7;
        const uint4 v = ldShared128(unitAddr(base, row, u));
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * kp->ldP + c * kColsPerChunk + u * kElemsPerUnit) = v;
      }
    }
  }

  __device__ __forceinline__ void reduceOwn(float (&acc)[128], int32_t row0, int32_t n0, int32_t ht, int wg, int t,
                                            uint16_t (&cbuf)[2][64 * 64]) {
    const int32_t me = kp->rank;
    WaitCtx ctx = makeWaitCtx(*kp, Role::kCompute, startNs);
    if (t < kp->nranks && t != me) waitGeq(srcFlag(*kp, t, ht), opEpoch(*kp), ctx, static_cast<uint32_t>(ht));
    // acquire by thread s (above), then this barrier: the partials of the half tile are visible to the warpgroup.
    gemm::namedBarSync(barrierOf(wg), 128);
    if (t == 0) traceNow(wg, 1);
    const FinalWriter<T> out(*kp, row0);
    if (__shfl_sync(0xffffffffu, out.single ? 1 : 0, 0) != 0) {
      // The common case on its own, with no multi-destination code inlined 32 times between its stores: that made
      // this path's code several times larger (28K instructions), fetched anew on every own tile.
      reduceOwnBody<true>(acc, row0, n0, wg, t, out, cbuf);
    } else {
      reduceOwnBody<false>(acc, row0, n0, wg, t, out, cbuf);
    }
  }
  // The reduction of reduceOwn once its inputs are visible: per 64 x 32 fp32 chunk, the own partial through smem, plus
  // the peers' in rank order, stored through `out` (KnownSingle: out.single holds).
  template <bool KnownSingle>
  __device__ __forceinline__ void reduceOwnBody(float (&acc)[128], int32_t row0, int32_t n0, int wg, int t,
                                                const FinalWriter<T>& out, uint16_t (&cbuf)[2][64 * 64]) {
    const int lane = t % 32;
    const int r = (t / 32) * 16 + lane / 4;
    const int32_t me = kp->rank;
    if (kp->nranks == 2) {
      // Two ranks: own + peer is one commutative add, so the peer's values are loaded kAhead chunks ahead of use
      // (a register ring: 32 registers either way), which hides the L2 latency behind the smem work of the chunks.
      using Raw = typename RawOf<P>::type;
      constexpr int kAhead = sizeof(P) == 4 ? 1 : 3;
      const P* const peer = srcBase<P>(*kp, 1 - me) + static_cast<int64_t>(row0) * kp->ldP + n0;
      Raw ring[kAhead][4];
#pragma unroll
      for (int c = 0; c < kAhead; ++c) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int idx = t + 128 * i;
          ring[c][i] = loadRaw<P>(peer + static_cast<int64_t>(idx >> 3) * kp->ldP + c * 32 + (idx & 7) * 4);
        }
      }
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        Raw cur[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) cur[i] = ring[c % kAhead][i];
        if (c + kAhead < 8) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int idx = t + 128 * i;
            ring[c % kAhead][i] =
                loadRaw<P>(peer + static_cast<int64_t>(idx >> 3) * kp->ldP + (c + kAhead) * 32 + (idx & 7) * 4);
          }
        }
        const uint32_t base = gemm::smemAddr(cbuf[c & 1]);
        writeChunk<float>(acc, c, base, r, lane);
        gemm::namedBarSync(barrierOf(wg), 128);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int idx = t + 128 * i;
          const int row = idx >> 3, u = idx & 7;
          const uint4 raw = ldShared128(unitAddr(base, row, u));
          const float4 own = make_float4(__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                                         __uint_as_float(raw.w));
          out.template store<KnownSingle>(row0 + row, n0 + c * 32 + u * 4, add4(own, toFloat4<P>(cur[i])));
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const uint32_t base = gemm::smemAddr(cbuf[c & 1]);
        writeChunk<float>(acc, c, base, r, lane);
        gemm::namedBarSync(barrierOf(wg), 128);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int idx = t + 128 * i;
          const int row = idx >> 3, u = idx & 7;
          const uint4 raw = ldShared128(unitAddr(base, row, u));
          const float4 own = make_float4(__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                                         __uint_as_float(raw.w));
          float4 v = own;
          for (int s = 0; s < kp->nranks; ++s) {  // rank order, whatever the arrival order
            const float4 term =
                s == me ? own
                        : loadP4<P>(srcBase<P>(*kp, s) + static_cast<int64_t>(row0 + row) * kp->ldP + n0 + c * 32 + u * 4);
            v = s == 0 ? term : add4(v, term);
          }
          out.template store<KnownSingle>(row0 + row, n0 + c * 32 + u * 4, v);
        }
      }
    }
  }

  // An own half tile with nothing to add (one rank) that lies wholly inside N: the GEMM core's TMA-store epilogue. The
  // accumulators go into smem as T, in 64 x 64 chunks swizzled as the output's tensor map (g.tmC) expects; one thread
  // stores each chunk by TMA (rows past M are clipped) and the warpgroup goes on to the next mainloop without waiting
  // for the global writes. A chunk buffer is written again once the store issued from it two chunks earlier has read
  // it. Costs no smem round trip in fp32, no per-element address math and little code (the generic path's unrolled
  // code misses the instruction cache). No early exit at the N edge on purpose: a data-dependent break out of this
  // loop made ptxas treat the tile loop as divergent again (see `mode` in tile()); edge tiles take the generic path.
  __device__ __forceinline__ void storeOwnTma(const float (&acc)[128], int32_t row0, int32_t n0, int wg, int t,
                                              uint16_t (&cbuf)[2][64 * 64]) {
    const int lane = t % 32;
    const int r = (t / 32) * 16 + lane / 4;  // accumulator rows r and r + 8 (same swizzle phase r & 7)
    const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
    const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
    const uint32_t phase = static_cast<uint32_t>(r & 7);
    if (cbufGeneric) {
      gemm::namedBarSync(barrierOf(wg), 128);  // every thread's ld.shared of the last tile precede our st.shared
      cbufGeneric = false;
    }
#pragma unroll
    for (int c = 0; c < kBlockN / gemm::kEpiCols; ++c) {
      const uint32_t buf = tmaChunks & 1;
      if (tmaChunks >= 2) {
        if (t == 0) gemm::bulkWaitRead<1>();  // the store issued from this buffer two chunks ago has read it
        gemm::namedBarSync(barrierOf(wg), 128);
      }
      const uint32_t base = gemm::smemAddr(cbuf[buf]);
#pragma unroll
      for (int jj = 0; jj < gemm::kEpiCols / 8; ++jj) {
        const int j = c * (gemm::kEpiCols / 8) + jj;
        // 128B swizzle: 16-byte unit index XOR (row & 7), as the TMA store map expects.
        const uint32_t col = ((static_cast<uint32_t>(jj) ^ phase) << 4) + static_cast<uint32_t>(lane & 3) * 4;
        gemm::stShared32(base + rowOff0 + col, gemm::packPair<T>(acc[4 * j + 0], acc[4 * j + 1]));
        gemm::stShared32(base + rowOff1 + col, gemm::packPair<T>(acc[4 * j + 2], acc[4 * j + 3]));
      }
      gemm::fenceProxyAsyncShared();           // our st.shared -> visible to the TMA engine
      gemm::namedBarSync(barrierOf(wg), 128);  // the whole 64 x 64 chunk is in smem
      if (t == 0) {
        gemm::tmaStore2d(&kp->g.tmC, base, n0 + c * gemm::kEpiCols, row0);
        gemm::bulkCommit();
      }
      ++tmaChunks;
    }
    tmaReading = true;
  }
  // ownTma 2 (two ranks): an own half tile wholly inside N whose rows are all this rank's. Thread 0 waits for the
  // peer's partial of the half tile (the copier warps saw it arrive and prefetched it into L2), then TMA-loads it
  // chunk by chunk (64 x 64, 16-bit, swizzled as the store map wants) into the two epilogue buffers; every thread adds
  // the peer's values at its own accumulator positions in fp32, writes the sum back in place rounded to T, and the
  // chunk leaves by TMA store like the core's. own + peer is one commutative add, so the result is bitwise that of the
  // generic path in either rank order. A buffer is loaded again once the store from it has read it.
  __device__ __forceinline__ void storeOwnTmaPeer(const float (&acc)[128], int32_t row0, int32_t n0, int wg, int t,
                                                  uint16_t (&cbuf)[2][64 * 64]) {
    constexpr int kChunks = kBlockN / gemm::kEpiCols;
    constexpr uint32_t kChunkBytes = gemm::kRowsPerConsumer * gemm::kEpiCols * 2;
    const int lane = t % 32;
    const int r = (t / 32) * 16 + lane / 4;  // accumulator rows r and r + 8 (same swizzle phase r & 7)
    const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
    const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
    const uint32_t phase = static_cast<uint32_t>(r & 7);
    const int32_t outRow = kp->allReduce ? row0 : row0 - rowOffsetOf(*kp, kp->rank);
    const bool early = kp->ownTma == 3;  // the copier warps issued the first two loads (runCopier)
    cbufGeneric = false;
    if (!early) {
      // Every thread's ld.shared of an earlier generic epilogue precedes the loads that overwrite cbuf.
      gemm::namedBarSync(barrierOf(wg), 128);
    }
    if (t == 0 && !early) {
      if (tmaReading) gemm::bulkWaitRead<0>();  // earlier stores from cbuf have read it (long done by now)
      // The copier warps acquired the peer's flag of this half tile during the mainloop (for their L2 prefetch) and
      // said so in smem: acquire that (pairs with runCopier's stReleaseCtaSharedU32) rather than the flag again, a
      // system-scope load of about a microsecond. They say so even after a failed wait, so this cannot hang.
      while (ldAcquireCtaSharedU32(done + 2 + wg) < seq + 1) {
      }
      traceNow(wg, 1);
      fenceProxyAsyncGlobal();  // generic-proxy data (landed from the peer) read by the async proxy (TMA) next
      for (int b = 0; b < 2; ++b) {
        gemm::mbarArriveExpectTx(peerBar(wg, b), kChunkBytes);
        gemm::tmaLoad2d(&kp->tmPeer, cbuf[b], peerBar(wg, b), n0 + b * gemm::kEpiCols, row0);
      }
    }
    tmaReading = false;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int b = c & 1;
      gemm::mbarWait(peerBar(wg, b), peerLoads[b] & 1);  // acquire: the chunk's bytes landed in cbuf[b]
      ++peerLoads[b];
      const uint32_t base = gemm::smemAddr(cbuf[b]);
#pragma unroll
      for (int jj = 0; jj < gemm::kEpiCols / 8; ++jj) {
        const int j = c * (gemm::kEpiCols / 8) + jj;
        const uint32_t col = ((static_cast<uint32_t>(jj) ^ phase) << 4) + static_cast<uint32_t>(lane & 3) * 4;
        const float2 p0 = toFloat2<P>(ldShared32(base + rowOff0 + col));
        const float2 p1 = toFloat2<P>(ldShared32(base + rowOff1 + col));
        gemm::stShared32(base + rowOff0 + col, gemm::packPair<T>(acc[4 * j + 0] + p0.x, acc[4 * j + 1] + p0.y));
        gemm::stShared32(base + rowOff1 + col, gemm::packPair<T>(acc[4 * j + 2] + p1.x, acc[4 * j + 3] + p1.y));
      }
      gemm::fenceProxyAsyncShared();           // our st.shared -> visible to the TMA engine
      gemm::namedBarSync(barrierOf(wg), 128);  // the whole summed chunk is in smem
      if (t == 0) {
        gemm::tmaStore2d(&kp->g.tmC, base, n0 + c * gemm::kEpiCols, outRow);
        gemm::bulkCommit();
        if (c + 2 < kChunks) {
          gemm::bulkWaitRead<0>();  // the store just issued has read cbuf[b]
          gemm::mbarArriveExpectTx(peerBar(wg, b), kChunkBytes);
          gemm::tmaLoad2d(&kp->tmPeer, cbuf[b], peerBar(wg, b), n0 + (c + 2) * gemm::kEpiCols, row0);
        }
      }
      ++tmaChunks;
    }
    if (kp->finViaCopier) {
      // All-reduce: the copier warps read these rows from our output to broadcast them, once `done` says so (released
      // after this, in tile()): the TMA writes must be complete and ordered before the generic-proxy reads.
      if (t == 0) {
        gemm::bulkWait<0>();
        fenceProxyAsyncGlobal();
      }
      tmaReading = false;  // every thread alike: cbufForGeneric's barrier must be all or none
    } else if (early) {
      // The copier warps load into cbuf once `done` (released after this) says this half tile is finished.
      if (t == 0) gemm::bulkWaitRead<0>();
      tmaReading = false;
    } else {
      tmaReading = true;
    }
  }

  // Before the generic paths write cbuf with st.shared: no TMA store may still be reading it.
  __device__ __forceinline__ void cbufForGeneric(int wg, int t) {
    if (tmaReading) {
      if (t == 0) gemm::bulkWaitRead<0>();
      gemm::namedBarSync(barrierOf(wg), 128);
      tmaReading = false;
    }
    cbufGeneric = true;
  }

  __device__ __forceinline__ void tile(float (&acc)[128], int32_t row0, int32_t n0, int wg, int t,
                                       uint16_t (&cbuf)[2][64 * 64]) {
    if (t == 0) traceNow(wg, 0);
    release(wg, t);  // the previous tile's deferred flag (its stores have long completed)
    const int32_t tr = row0 / kBlockM;
    const int32_t ht = (row0 / kHalfRows) * kp->tilesN + n0 / kBlockN;
    const int32_t red = kp->oneShot ? kp->rank : reducerOf(*kp, tr);
    // Which epilogue (0 push a partial, 1 reduce the own rows, 2 TMA-store the own rows, 3 add the peer's partial in
    // smem and TMA-store the own rows): warp-uniform in fact, but
    // ptxas cannot prove it (the reducer comes from a dynamically indexed parameter array, n0 from the phase table).
    // Branching on it as-is made ptxas treat the whole tile loop as divergent, and the mainloop then lost the uniform
    // datapath (wgmma descriptors built in vector registers and moved over with R2UR, a WARPSYNC before every
    // warpgroup.arrive; ncu: 1.66x the core's instructions). Broadcast from lane 0, it is provably uniform.
    const bool ownHere = kp->epiReduce && !kp->oneShot && red == kp->rank;
    int mode = ownHere ? 1 : 0;
    if (ownHere && kp->ownTma == 1 && n0 + kBlockN <= kp->g.n) mode = 2;
    if (ownHere && peerTile(*kp, row0, n0)) mode = 3;
    mode = __shfl_sync(0xffffffffu, mode, 0);
    const bool own = mode != 0;
    if (mode == 2) {
      storeOwnTma(acc, row0, n0, wg, t, cbuf);
      if (t == 0) traceNow(wg, 1);
    } else if (mode == 3) {
      if constexpr (sizeof(P) == 2) storeOwnTmaPeer(acc, row0, n0, wg, t, cbuf);  // the host sets 2 only then
    } else if (own) {
      cbufForGeneric(wg, t);
      reduceOwn(acc, row0, n0, ht, wg, t, cbuf);
      if (needFin(*kp, row0) && !kp->finViaCopier) {
        pendKind = 2;
        pendRow0 = row0;
        pendHt = ht;
      }
    } else {
      cbufForGeneric(wg, t);
      pushPartial(acc, row0, n0, red, wg, t, cbuf);
      if (!isCopy(*kp)) {
        pendKind = 1;
        pendRed = red;
        pendHt = ht;
      }
    }
    if (!kp->deferRelease) release(wg, t);
    if (isCopy(*kp)) {
      // Every thread's stores of this half tile precede the barrier; thread 0's CTA-scope release then hands them to
      // the copier warps (pairs with ldAcquireCtaSharedU32 in runCopier).
      gemm::namedBarSync(barrierOf(wg), 128);
      if (t == 0) stReleaseCtaSharedU32(done + wg, seq + 1);
    }
    if (t == 0) {
      traceNow(wg, 2);
      trace(wg, 3, own ? 1 : 0);
    }
    ++seq;
  }
  __device__ __forceinline__ void finish(int wg, int t) {
    release(wg, t);
    if (tmaChunks > 0 && t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Reduction of one half tile by a whole CTA (kThreads threads): sum the nranks partials in rank order (fp32), round
// once, store into the output(s); then flag the ranks whose output received rows. waitFlags: per-half-tile flags
// (fused); the decomposed kernel has waited for whole partials instead.
// ---------------------------------------------------------------------------------------------------------------
template <class T, class P>
__device__ __forceinline__ void reduceHalfTile(const FusedKernelParams& kp, int32_t row0, int32_t n0, int32_t ht,
                                               bool waitFlags, WaitCtx& ctx) {
  const int tid = static_cast<int>(threadIdx.x);
  if (waitFlags && tid < kp.nranks) waitGeq(srcFlag(kp, tid, ht), opEpoch(kp), ctx, static_cast<uint32_t>(ht));
  __syncthreads();  // acquire by thread s, then the barrier: every partial of the half tile is visible to the CTA
  constexpr int kQuads = kHalfRows * (kBlockN / 4);
  const FinalWriter<T> out(kp, row0);
  if (kp.nranks == 2) {
    // Two ranks: P0 + P1 is one commutative add, so both sources' loads go out together, 8 quads deep.
    constexpr int kBatch2 = 8;
    const P* const src0 = srcBase<P>(kp, 0) + static_cast<int64_t>(row0) * kp.ldP + n0;
    const P* const src1 = srcBase<P>(kp, 1) + static_cast<int64_t>(row0) * kp.ldP + n0;
    for (int first = 0; first < kQuads; first += kThreads * kBatch2) {
      float4 a[kBatch2], b[kBatch2];
#pragma unroll
      for (int q = 0; q < kBatch2; ++q) {
        const int idx = first + q * kThreads + tid;
        const int64_t off = static_cast<int64_t>(idx >> 6) * kp.ldP + (idx & 63) * 4;
        a[q] = idx < kQuads ? loadP4<P>(src0 + off) : make_float4(0.f, 0.f, 0.f, 0.f);
        b[q] = idx < kQuads ? loadP4<P>(src1 + off) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int q = 0; q < kBatch2; ++q) {
        const int idx = first + q * kThreads + tid;
        if (idx < kQuads) out.store(row0 + (idx >> 6), n0 + (idx & 63) * 4, add4(a[q], b[q]));
      }
    }
  } else {
    constexpr int kBatch = 4;
    for (int first = 0; first < kQuads; first += kThreads * kBatch) {
      float4 v[kBatch];
      for (int s = 0; s < kp.nranks; ++s) {  // rank order, whatever the arrival order
        const P* const src = srcBase<P>(kp, s) + static_cast<int64_t>(row0) * kp.ldP + n0;
        float4 term[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = first + b * kThreads + tid;
          term[b] = idx < kQuads ? loadP4<P>(src + static_cast<int64_t>(idx >> 6) * kp.ldP + (idx & 63) * 4)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) v[b] = s == 0 ? term[b] : add4(v[b], term[b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int idx = first + b * kThreads + tid;
        if (idx < kQuads) out.store(row0 + (idx >> 6), n0 + (idx & 63) * 4, v[b]);
      }
    }
  }
  if (needFin(kp, row0)) {  // CTA-uniform
    fenceAcqRelSys();       // this thread's output stores are performed at system scope
    __syncthreads();        // ... for every thread, before thread 0 publishes
    if (tid == 0) releaseFin(kp, row0, ht);
  }
}

// Reduce role of the fused kernel: the half tiles this rank reduces, in the order they are computed.
template <class T, class P>
__device__ __forceinline__ void runReduceRole(const FusedKernelParams& kp, int32_t idx, uint64_t startNs) {
  WaitCtx ctx = makeWaitCtx(kp, Role::kReduce, startNs);
  const PhaseOrder order{&kp};
  const int32_t total = (kp.numWork - kp.ownWork0) * 2;
  for (int32_t i = idx; i < total; i += kp.numReduce) {
    const gemm::TileCoord tc = order(kp.ownWork0 + i / 2);
    const int32_t row0 = tc.unitM * kBlockM + (i & 1) * kHalfRows;
    if (row0 >= kp.g.m) continue;  // CTA-uniform
    const int32_t ht = (row0 / kHalfRows) * kp.tilesN + tc.tileN;
    reduceHalfTile<T, P>(kp, row0, tc.tileN * kBlockN, ht, true, ctx);
  }
}

// Send role (transport kSend): copies the local partials of the peers' rows (the non-own phases, in compute order)
// from the outbox into the reducer's inbox over NVLink, kSendBatch half tiles per system-scope fence.
template <class P>
__device__ __forceinline__ void runSendRole(const FusedKernelParams& kp, int32_t idx, uint64_t startNs) {
  constexpr int kSendBatch = 4;
  constexpr int kVecPerRow = kBlockN * static_cast<int>(sizeof(P)) / 16;
  constexpr int kVecs = kHalfRows * kVecPerRow;
  constexpr int kInFlight = 8;
  WaitCtx ctx = makeWaitCtx(kp, Role::kIntraComm, startNs);
  const PhaseOrder order{&kp};
  const int tid = static_cast<int>(threadIdx.x);
  const int32_t me = kp.rank;
  const int32_t total = kp.ownWork0 * 2;
  const int64_t ldv = kp.ldP * static_cast<int64_t>(sizeof(P)) / 16;
  for (int32_t g = idx; g < total; g += kp.numSend * kSendBatch) {
#pragma unroll 1
    for (int b = 0; b < kSendBatch; ++b) {
      const int32_t i = g + b * kp.numSend;
      if (i >= total) break;
      const gemm::TileCoord tc = order(i / 2);
      const int32_t row0 = tc.unitM * kBlockM + (i & 1) * kHalfRows;
      if (row0 >= kp.g.m) continue;
      const int32_t ht = (row0 / kHalfRows) * kp.tilesN + tc.tileN;
      const int32_t red = reducerOf(kp, tc.unitM);
      if (tid == 0) waitGeq(kp.outFlags[me] + ht, opEpoch(kp), ctx, static_cast<uint32_t>(ht));
      __syncthreads();  // acquire by thread 0, then the barrier: the local partial is visible to the CTA
      const uint4* const src = reinterpret_cast<const uint4*>(static_cast<const P*>(kp.outbox[me]) +
                                                              static_cast<int64_t>(row0) * kp.ldP + tc.tileN * kBlockN);
      uint4* const dst = reinterpret_cast<uint4*>(static_cast<P*>(kp.inbox[red]) + me * kp.srcStride +
                                                  static_cast<int64_t>(row0) * kp.ldP + tc.tileN * kBlockN);
      for (int first = 0; first < kVecs; first += kThreads * kInFlight) {
        uint4 v[kInFlight];
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
          const int e = first + k * kThreads + tid;
          if (e < kVecs) v[k] = __ldcg(src + (e / kVecPerRow) * ldv + e % kVecPerRow);
        }
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
          const int e = first + k * kThreads + tid;
          if (e < kVecs) dst[(e / kVecPerRow) * ldv + e % kVecPerRow] = v[k];
        }
      }
    }
    fenceAcqRelSys();  // this thread's NVLink stores of the batch are performed at system scope
    __syncthreads();   // ... for every thread, before thread 0 publishes
    if (tid == 0) {
      for (int b = 0; b < kSendBatch; ++b) {
        const int32_t i = g + b * kp.numSend;
        if (i >= total) break;
        const gemm::TileCoord tc = order(i / 2);
        const int32_t row0 = tc.unitM * kBlockM + (i & 1) * kHalfRows;
        if (row0 >= kp.g.m) continue;
        const int32_t ht = (row0 / kHalfRows) * kp.tilesN + tc.tileN;
        // release: publishes the copied half tile; pairs with waitGeq(srcFlag) in the reducer.
        stReleaseSys(kp.inFlags[reducerOf(kp, tc.unitM)] + me * kp.flagStride + ht, opEpoch(kp));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Copier warps (transport kCopy): warps 1..3 of a compute CTA's producer warpgroup, idle beside the one TMA thread,
// running on the producer's 40 registers. They walk the CTA's tiles in the consumers' order and, as each consumer
// warpgroup publishes a half tile (smem counter `done`), copy its partial from the local outbox into the reducer's
// inbox over NVLink (all-reduce: broadcast its reduced output rows to the peers) and release the flag, so the
// NVLink traffic drains while the tensor cores run the next tile instead of stalling the epilogue. For a tile this
// rank reduces, they first prefetch the peers' partials into L2 once its mainloop has started.
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kCopiers = 96;
inline constexpr uint32_t kCopierBarrier = 3;  // named barrier id (0: CTA, 1-2: consumer epilogues)

__device__ __forceinline__ void waitSmemGeq(const uint32_t* p, uint32_t v) {
  while (ldAcquireCtaSharedU32(p) < v) __nanosleep(256);  // the consumers always progress; sleep to spare issue slots
}
__device__ __forceinline__ void copierSync() {
  gemm::namedBarSync(static_cast<gemm::Barrier>(kCopierBarrier), kCopiers);
}

template <class P>
__device__ __forceinline__ void runCopier(const FusedKernelParams& kp, uint32_t* done, uint16_t* cbuf, int32_t cid,
                                          uint64_t startNs, int ct) {
  const PhaseOrder order{&kp};
  const int32_t me = kp.rank;
  uint32_t seq[2] = {0, 0};
  for (int32_t w = cid; w < kp.numWork; w += kp.numCompute) {
    const gemm::TileCoord tc = order(w);
    const int32_t red = reducerOf(kp, tc.unitM);
    const int32_t n0 = tc.tileN * kBlockN;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t row0 = tc.unitM * kBlockM + h * kHalfRows;
      if (row0 >= kp.g.m) continue;
      const uint32_t mySeq = ++seq[h];
      const int32_t ht = (row0 / kHalfRows) * kp.tilesN + tc.tileN;
      if (red != me) {
        constexpr int kVecPerRow = kBlockN * static_cast<int>(sizeof(P)) / 16;
        constexpr int kVecs = kHalfRows * kVecPerRow;
        const int64_t ldv = kp.ldP * static_cast<int64_t>(sizeof(P)) / 16;
        const int64_t base = (static_cast<int64_t>(row0) * kp.ldP + n0) * static_cast<int64_t>(sizeof(P)) / 16;
        const uint4* const src = static_cast<const uint4*>(kp.outbox[me]) + base;
        uint4* const dst = reinterpret_cast<uint4*>(static_cast<P*>(kp.inbox[red]) + me * kp.srcStride) + base;
        waitSmemGeq(done + h, mySeq);  // acquire: the consumer warpgroup's stores of this half tile
        for (int e = ct; e < kVecs; e += 2 * kCopiers) {
          const int e2 = e + kCopiers;
          const uint4 v0 = __ldcg(src + (e / kVecPerRow) * ldv + e % kVecPerRow);
          uint4 v1 = make_uint4(0, 0, 0, 0);
          if (e2 < kVecs) v1 = __ldcg(src + (e2 / kVecPerRow) * ldv + e2 % kVecPerRow);
          dst[(e / kVecPerRow) * ldv + e % kVecPerRow] = v0;
          if (e2 < kVecs) dst[(e2 / kVecPerRow) * ldv + e2 % kVecPerRow] = v1;
        }
        fenceAcqRelSys();  // this thread's NVLink stores are performed at system scope
        copierSync();      // ... for all copier threads, before one publishes
        // release: publishes the partial half tile in the reducer's inbox; pairs with waitGeq(srcFlag) there.
        if (ct == 0) stReleaseSys(kp.inFlags[red] + me * kp.flagStride + ht, opEpoch(kp));
      } else if (kp.nranks > 1) {
        // Prefetch the peers' partials of this half tile into L2 once its mainloop runs (the previous one is done).
        waitSmemGeq(done + h, mySeq - 1);
        if (ct < kp.nranks && ct != me) {
          WaitCtx ctx = makeWaitCtx(kp, Role::kIntraComm, startNs);
          waitGeq(srcFlag(kp, ct, ht), opEpoch(kp), ctx, static_cast<uint32_t>(ht));
        }
        copierSync();  // acquire by thread s, then the barrier
        // ownTma 2: tell the consumer warpgroup that the peer's partial is here (it acquires this instead of the flag).
        // release (CTA scope, after the barrier that follows the system-scope acquire): pairs with storeOwnTmaPeer.
        if (kp.ownTma == 2 && ct == 0) stReleaseCtaSharedU32(done + 2 + h, mySeq);
        if (kp.ownTma == 3 && ct == 0 && peerTile(kp, row0, n0)) {
          // ownTma 3: load the first two chunks of the peer's partial into the warpgroup's epilogue buffers now, so
          // they are there when its epilogue starts. The buffers are free: `done` said the warpgroup finished its
          // previous half tile, whose epilogue had every read of them behind it (storeOwnTmaPeer waits for its
          // stores' reads in this mode). Issued after a failed wait too, so the consumers cannot hang on them.
          fenceProxyAsyncGlobal();  // generic-proxy data (landed from the peer) read by the async proxy next
          uint64_t* const bars = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(done) + kPeerBarOffset);
          for (int b = 0; b < 2; ++b) {
            gemm::mbarArriveExpectTx(bars + h * 2 + b, gemm::kRowsPerConsumer * gemm::kEpiCols * 2);
            gemm::tmaLoad2d(&kp.tmPeer, cbuf + (h * 2 + b) * (gemm::kRowsPerConsumer * gemm::kEpiCols), bars + h * 2 + b,
                            n0 + b * gemm::kEpiCols, row0);
          }
        }
        constexpr int kLinesPerRow = kBlockN * static_cast<int>(sizeof(P)) / 128;
        for (int s = 0; s < kp.nranks; ++s) {
          if (s == me) continue;
          const P* const src = srcBase<P>(kp, s) + static_cast<int64_t>(row0) * kp.ldP + n0;
          for (int e = ct; e < kHalfRows * kLinesPerRow; e += kCopiers) {
            prefetchL2(src + static_cast<int64_t>(e / kLinesPerRow) * kp.ldP + (e % kLinesPerRow) * (128 / sizeof(P)));
          }
        }
        if (kp.finViaCopier) {
          // All-reduce: broadcast the reduced rows (written by the consumers into the local output) to the peers.
          const int32_t rows = min(kHalfRows, kp.g.m - row0);
          const int32_t upr = min(kBlockN, kp.g.n - n0) / 8;  // 16-byte units per row (n % 8 == 0)
          waitSmemGeq(done + h, mySeq);
          const uint4* const src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(kp.out[me]) +
                                                                  static_cast<int64_t>(row0) * kp.ldOut + n0);
          const int64_t ldv = kp.ldOut / 8;
          for (int e = ct; e < rows * upr; e += kCopiers) {
            const uint4 v = __ldcg(src + (e / upr) * ldv + e % upr);
            for (int q = 0; q < kp.nranks; ++q) {
              if (q == me) continue;
              uint4* const dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(kp.out[q]) +
                                                          static_cast<int64_t>(row0) * kp.ldOut + n0);
              dst[(e / upr) * ldv + e % upr] = v;
            }
          }
          fenceAcqRelSys();
          copierSync();
          if (ct == 0) releaseFin(kp, row0, ht);
        }
      }
    }
  }
}

// Every rank waits, before its kernel ends, for the reduced rows that other ranks write into its output.
// Threads [idx, idx + count, ...) of the grid share the half tiles.
__device__ __forceinline__ void runFinalWaits(const FusedKernelParams& kp, uint64_t startNs, int32_t idx,
                                              int32_t count) {
  if (kp.nranks == 1 || (kp.allReduce && kp.oneShot)) return;
  WaitCtx ctx = makeWaitCtx(kp, Role::kReduce, startNs);
  const int32_t halves = kp.tilesM * 2 * kp.tilesN;
  for (int32_t j = idx; j < halves; j += count) {
    const int32_t row0 = (j / kp.tilesN) * kHalfRows;
    if (row0 >= kp.g.m) continue;
    const int32_t red = reducerOf(kp, row0 / kBlockM);
    if (red == kp.rank) continue;
    if (!kp.allReduce) {
      const RankRange r = finTargets(kp, row0);
      if (kp.rank < r.lo || kp.rank > r.hi) continue;
    }
    waitGeq(kp.finFlags[kp.rank] + red * kp.flagStride + j, opEpoch(kp), ctx, static_cast<uint32_t>(j));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The fused kernel's body: role from the role table, then the final waits (consumer warpgroups of compute CTAs: the
// producer warpgroup runs on 40 registers after setmaxnreg).
// ---------------------------------------------------------------------------------------------------------------
// Extra dynamic shared memory of a compute CTA beyond the GEMM core's: the two `done` counters (bytes 0-7), for ownTma
// 2 the copier warps' "peer's partial arrived" counters per consumer warpgroup (bytes 8-15) and one mbarrier per
// consumer warpgroup and epilogue buffer (bytes kPeerBarOffset.. + 31: [wg][buf]).
inline constexpr size_t kExtraSmem = 64;

// A compute CTA: the GEMM core's pieces (barriers, TMA producer, wgmma consumers with the RsEpilogue hook), plus the
// copier warps in the producer warpgroup (transport kCopy) and the final waits in the consumer warpgroups.
template <class T, class P, bool BMn>
__device__ __forceinline__ void runComputeCta(const FusedKernelParams& kp, uint8_t* smemRaw, int32_t cid,
                                              uint64_t startNs) {
  using namespace gemm;
  auto& s = *reinterpret_cast<SharedStorage<kStages>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                         ~static_cast<uintptr_t>(1023));
  uint32_t* const done = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(&s) + sizeof(SharedStorage<kStages>));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
    initBarriers<kStages, 1>(s);
    prefetchTensorMap(&kp.g.tmA);
    prefetchTensorMap(&kp.g.tmB);
    if (kp.ownTma) prefetchTensorMap(&kp.g.tmC);
    done[0] = 0;
    done[1] = 0;
    done[2] = 0;
    done[3] = 0;
    if (kp.ownTma >= 2) {
      prefetchTensorMap(&kp.tmPeer);
      uint64_t* const bars = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(done) + kPeerBarOffset);
      for (int i = 0; i < 4; ++i) mbarInit(&bars[i], 1);
      fenceBarrierInit();
    }
  }
  __syncthreads();  // barriers and counters initialised before any role uses them
  const PhaseOrder order{&kp};
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      setMaxNRegDec<kProducerRegs>();
      if (t == 0) {
        runProducer<kStages, 1, PhaseOrder, NoRowWait, BMn>(kp.g, s, order, NoRowWait{}, cid, kp.numCompute, 0u);
      } else if (t >= 32 && isCopy(kp)) {
        runCopier<P>(kp, done, &s.c[0][0][0], cid, startNs, t - 32);
      }
      break;
    case gemm::Role::kConsumer: {
      setMaxNRegInc<kConsumerRegs>();
      if (t == 0 && kp.trace != nullptr) {
        kp.trace[(static_cast<int64_t>(blockIdx.x) * 2 + (wg - 1)) * (kp.traceTiles + 1) * 4] = startNs;
      }
      runConsumer<T, kStages, 1, Epilogue::kCustom, PhaseOrder, RsEpilogue<T, P>, BMn>(
          kp.g, s, order, cid, kp.numCompute, 0u, wg - 1, t, RsEpilogue<T, P>(&kp, startNs, done));
      const int32_t cta = static_cast<int32_t>(blockIdx.x);
      runFinalWaits(kp, startNs, cta * (kThreads - 128) + static_cast<int32_t>(threadIdx.x) - 128,
                    static_cast<int32_t>(gridDim.x) * (kThreads - 128));
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The fused kernel's body: role from the role table; every role ends with its share of the final waits. BMn: B is
// stored [K, N] (the NN layout's weight, MN-major in shared memory); otherwise [N, K].
// ---------------------------------------------------------------------------------------------------------------
template <class T, class P, bool BMn>
__device__ __forceinline__ void runFusedCta(const FusedKernelParams& kp, uint8_t* smemRaw) {
  const uint64_t startNs = globaltimerNs();
  const GemmRsRoleLayout roles{kp.numReduce, kp.numSend, kp.numCompute};
  const int32_t cta = static_cast<int32_t>(blockIdx.x);
  const Role role = roles.roleOf(cta);
  if (role == Role::kCompute) {
    runComputeCta<T, P, BMn>(kp, smemRaw, roles.indexInRole(cta), startNs);
    return;
  }
  if (role == Role::kReduce) {
    runReduceRole<T, P>(kp, roles.indexInRole(cta), startNs);
  } else {
    runSendRole<P>(kp, roles.indexInRole(cta), startNs);
  }
  if (threadIdx.x >= 128) {
    runFinalWaits(kp, startNs, cta * (kThreads - 128) + static_cast<int32_t>(threadIdx.x) - 128,
                  static_cast<int32_t>(gridDim.x) * (kThreads - 128));
  }
}

// The decomposed plan's reduction kernel body (after the GEMM core wrote each rank's partial of type P into its outbox:
// the 16-bit input dtype, or fp32 from the FP8 core): a barrier on the ranks' "GEMM finished" flags, then the half
// tiles this rank reduces (all of them one-shot), pulling the peers' partials over NVLink, summed in fp32, output T.
template <class T, class P = T>
__device__ __forceinline__ void runDecomposedReduce(const FusedKernelParams& kp) {
  const uint64_t startNs = globaltimerNs();
  WaitCtx ctx = makeWaitCtx(kp, Role::kReduce, startNs);
  const int tid = static_cast<int>(threadIdx.x);
  const int32_t me = kp.rank;
  if (blockIdx.x == 0 && tid < kp.nranks && tid != me) {
    // release: this rank's partial (written by the GEMM kernel before this one in its stream) is complete; pairs with
    // the waitGeq below on rank tid.
    stReleaseSys(kp.ready[tid] + me, opEpoch(kp));
  }
  if (tid < kp.nranks && tid != me) waitGeq(kp.ready[me] + tid, opEpoch(kp), ctx, 0);
  __syncthreads();
  const bool all = kp.allReduce && kp.oneShot;
  const int32_t hr0 = all ? 0 : kp.redTr0[me] * 2;
  const int32_t hr1 = all ? kp.tilesM * 2 : kp.redTr1[me] * 2;
  const int32_t count = (hr1 - hr0) * kp.tilesN;
  for (int32_t i = static_cast<int32_t>(blockIdx.x); i < count; i += static_cast<int32_t>(gridDim.x)) {
    const int32_t j = hr0 * kp.tilesN + i;
    const int32_t row0 = (j / kp.tilesN) * kHalfRows;
    if (row0 >= kp.g.m) continue;
    reduceHalfTile<T, P>(kp, row0, (j % kp.tilesN) * kBlockN, j, false, ctx);
  }
  runFinalWaits(kp, startNs, static_cast<int32_t>(blockIdx.x) * kThreads + tid,
                static_cast<int32_t>(gridDim.x) * kThreads);
}

}  // namespace tandem::kernels::rs
