// Device pieces of the fused AllGather + GEMM (kernels/ag_gemm.cu wires them into kernels). Reuses the GEMM core of
// gemm_sm90.cuh (shared storage, pipeline, consumer warpgroups, PTX wrappers, B loaded K-major or MN-major); adds the
// tile order (local shard first, then peer shards in arrival order), a producer that reads local tiles from the shard
// and peer tiles from the gathered buffer after waiting on their chunk flags, and the communication role (push chunks
// + publish flags).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/gemm_sm90.cuh"
#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels::ag {

using gemm::GemmKernelParams;
using gemm::kBlockK;
using gemm::kBlockM;
using gemm::kBlockN;

inline constexpr uint32_t kOpAgGemm = 1;  // WaitCtx.op (OpKind::kAgGemm's value in common/descriptor.hpp)

struct AgGemmKernelParams {
  GemmKernelParams g;   // tmA: the gathered buffer [m, k]; tmB: B [n, k] or (NN) [k, n]; tmC: C; sizes; tilesN
  CUtensorMap tmALocal;  // this rank's shard [rows, k] (same box); unused when the shard is empty
  const uint4* shard;    // this rank's shard, as 16-byte words
  uint4* gathered[kAgGemmMaxRanks];  // rank q's gathered buffer (this rank's own at [rank])
  uint64_t* flags[kAgGemmMaxRanks];  // rank q's flag array (this rank's own at [rank])
  const uint64_t* abortWord;
  ErrorSlot* errorSlot;
  uint64_t epoch;
  const uint64_t* epochWord;  // device-epoch mode: the epoch is *epochWord (opEpoch, wait.cuh); null: epoch
  uint64_t timeoutNs;
  int64_t rowWords;  // 16-byte words per row of A (k / 8)
  int32_t rank, nranks;
  int32_t localRow0, localRow1;  // this rank's rows in the gathered matrix
  int32_t maxChunks;             // chunk flags per source rank in the flag array layout
  int32_t chunkRows;             // rows per pushed chunk (same on every rank)
  int32_t commCtas;              // fused: CTAs [0, commCtas) communicate
  int32_t tailTiles;             // fused: the last tailTiles work items of the order go to the comm CTAs once they
                                 // have pushed (the main compute CTAs take the first numWork - tailTiles)
  // Tile order: virtual tile row v -> real tile row (startTile + v) mod tilesM. Segment d (source rank
  // (rank + d) % nranks) holds virtual rows [segEnd[d - 1], segEnd[d]).
  int32_t tilesM, startTile, groupM, nseg;
  int32_t segEnd[kAgGemmMaxRanks];
};

// ---------------------------------------------------------------------------------------------------------------
// Tile order: segments in consumption order (local tiles first, then each source's tiles as its chunks arrive), a
// grouped raster (groupM tile rows high) inside each segment.
// ---------------------------------------------------------------------------------------------------------------
// A window [base, base + count) of that order, renumbered from 0 (main compute CTAs: the head; comm CTAs: the tail).
struct SegmentedOrder {
  const AgGemmKernelParams* kp;
  int32_t base, count;
  __device__ __forceinline__ int32_t numWork() const { return count; }
  __device__ __forceinline__ gemm::TileCoord operator()(int32_t wLocal) const {
    const int32_t w = base + wLocal;
    const int32_t tilesN = kp->g.tilesN;
    int32_t segStart = 0;
    int32_t segRows = kp->segEnd[0];
    for (int d = 0; d < kp->nseg - 1 && w >= kp->segEnd[d] * tilesN; ++d) {
      segStart = kp->segEnd[d];
      segRows = kp->segEnd[d + 1] - segStart;
    }
    const gemm::GroupedRaster raster{segRows, tilesN, kp->groupM};
    const gemm::TileCoord v = raster(w - segStart * tilesN);
    int32_t real = kp->startTile + segStart + v.unitM;
    if (real >= kp->tilesM) real -= kp->tilesM;
    return {real, v.tileN};
  }
};

__device__ __forceinline__ int32_t rowsOfDev(int32_t m, int32_t r, int32_t n) { return m / n + (r < m % n ? 1 : 0); }
__device__ __forceinline__ int32_t rowOffsetDev(int32_t m, int32_t r, int32_t n) {
  return r * (m / n) + min(r, m % n);
}
__device__ __forceinline__ int32_t chunkFlagIndex(const AgGemmKernelParams& kp, int32_t src, int32_t chunk) {
  return kAgGemmMaxRanks + src * kp.maxChunks + chunk;
}

__device__ __forceinline__ WaitCtx makeWaitCtx(const AgGemmKernelParams& kp, Role role, uint64_t startNs) {
  return WaitCtx{kp.abortWord, kp.errorSlot, startNs + kp.timeoutNs, kOpAgGemm, static_cast<uint32_t>(role),
                 static_cast<uint32_t>(kp.rank)};
}

// Producer thread: blocks until every chunk holding gathered rows [r0, r1) has landed in this rank's gathered buffer.
__device__ __forceinline__ bool waitRows(const AgGemmKernelParams& kp, int32_t r0, int32_t r1, WaitCtx& ctx) {
  const int32_t m = kp.g.m;
  for (int32_t s = 0; s < kp.nranks; ++s) {
    const int32_t off = rowOffsetDev(m, s, kp.nranks);
    const int32_t end = off + rowsOfDev(m, s, kp.nranks);
    const int32_t lo = max(r0, off), hi = min(r1, end);
    if (lo >= hi) continue;
    const int32_t c0 = (lo - off) / kp.chunkRows;
    const int32_t c1 = (hi - 1 - off) / kp.chunkRows;
    for (int32_t c = c0; c <= c1; ++c) {
      const int32_t idx = chunkFlagIndex(kp, s, c);
      // acquire: pairs with the pushing rank's stReleaseSys in pushChunk (after its data stores to us).
      if (!waitGeq(kp.flags[kp.rank] + idx, opEpoch(kp), ctx, static_cast<uint32_t>(idx))) return false;
    }
  }
  // The rows were written by generic-proxy stores (a peer's SMs over NVLink, or ours); TMA reads them next.
  fenceProxyAsyncGlobal();
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer (one thread): the core's runProducer with ClusterM = 1, plus the choice of A source per tile: tiles wholly
// inside the local shard load from the shard (no wait); the others wait on their chunk flags and load from the
// gathered buffer. After a failed wait (abort / deadline, already reported) it stops waiting and keeps the pipeline
// fed, so the consumers finish and the kernel unwinds; C is then garbage and the error slot says why. BMn: B is the
// NN layout's weight [K, N], loaded MN-major (the core's tmaLoadB); otherwise [N, K].
// ---------------------------------------------------------------------------------------------------------------
template <int Stages, class Order, bool BMn>
__device__ __forceinline__ void runAgProducer(const AgGemmKernelParams& kp, gemm::SharedStorage<Stages>& s,
                                              const Order& order, int32_t firstWork, int32_t workStride,
                                              WaitCtx& ctx) {
  using namespace gemm;
  const GemmKernelParams& p = kp.g;
  PipeState<Stages> ps;
  bool failed = false;
  const int32_t numWork = order.numWork();
  for (int32_t w = firstWork; w < numWork; w += workStride) {
    const TileCoord tc = order(w);
    const int32_t m0 = tc.unitM * kBlockM;
    const int32_t n0 = tc.tileN * kBlockN;
    const int32_t r1 = min(m0 + kBlockM, p.m);
    const bool local = m0 >= kp.localRow0 && r1 <= kp.localRow1;
    const CUtensorMap* mapA = local ? &kp.tmALocal : &p.tmA;
    const int32_t aRow = local ? m0 - kp.localRow0 : m0;
    if (!local && !failed) failed = !waitRows(kp, m0, r1, ctx);
    for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
      mbarWait(&s.empty[ps.stage], ps.phase ^ 1);  // first pass: parity 1 counts as complete on a fresh barrier
      mbarArriveExpectTx(&s.full[ps.stage], kABytes + kBBytes);
      const int32_t k0 = kb * kBlockK;
      tmaLoad2d(mapA, s.a[ps.stage], &s.full[ps.stage], k0, aRow);
      tmaLoadB<BMn>(&p.tmB, s.b[ps.stage], &s.full[ps.stage], k0, n0);
      ps.advance();
    }
  }
}

// A compute CTA: the core's runGemmCta glue (ClusterM = 1) with the producer above. computeId / numCompute: this
// CTA's index among the compute CTAs. BMn as for runAgProducer (the consumers then read B with the transpose bit).
template <class T, bool BMn>
__device__ __forceinline__ void runCompute(const AgGemmKernelParams& kp, uint8_t* smemRaw, const SegmentedOrder& order,
                                           int32_t computeId, int32_t numCompute, uint64_t startNs) {
  using namespace gemm;
  auto& s = *reinterpret_cast<SharedStorage<kStages>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                         ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    initBarriers<kStages, 1>(s);
    prefetchTensorMap(&kp.g.tmA);
    prefetchTensorMap(&kp.tmALocal);
    prefetchTensorMap(&kp.g.tmB);
    prefetchTensorMap(&kp.g.tmC);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      setMaxNRegDec<kProducerRegs>();
      if (t == 0) {
        WaitCtx ctx = makeWaitCtx(kp, tandem::kernels::Role::kCompute, startNs);
        runAgProducer<kStages, SegmentedOrder, BMn>(kp, s, order, computeId, numCompute, ctx);
      }
      break;
    case gemm::Role::kConsumer:
      setMaxNRegInc<kConsumerRegs>();
      runConsumer<T, kStages, 1, Epilogue::kTmaStore, SegmentedOrder, NoEpiHook, BMn>(kp.g, s, order, computeId,
                                                                                      numCompute, 0u, wg - 1, t);
      break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Communication role. Work items (d, chunk), d = 1 .. nranks-1 (destination rank (rank - d) mod nranks, which
// consumes this rank's shard d-th), chunks in row order; item i goes to comm CTA i % numComm. The d = 1 pass also
// writes the chunk into this rank's own gathered buffer. All threads of the CTA copy; thread 0 waits and publishes.
// `bcast` is one word of shared memory for the CTA.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint4 ldStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Copies `words` 16-byte words, kUnroll loads in flight per thread before the stores (predicated at the tail, so the
// last partial sweep keeps the same number of loads in flight).
template <bool kAlsoLocal>
__device__ __forceinline__ void copyWords(const uint4* __restrict__ src, uint4* dst, uint4* dstLocal, int64_t words) {
  constexpr int kUnroll = 12;
  const int64_t tid = threadIdx.x;
  const int64_t nt = blockDim.x;
  for (int64_t base = tid; base < words; base += kUnroll * nt) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * nt < words) v[u] = ldStreaming(src + base + u * nt);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * nt < words) {
        dst[base + u * nt] = v[u];
        if constexpr (kAlsoLocal) dstLocal[base + u * nt] = v[u];
      }
    }
  }
}

// ---- TMA (bulk copy engine) push: one thread streams a chunk through kTmaStages smem buffers: bulk load from the
// local shard (completing on an mbarrier), bulk store to the destination (and to our own gathered buffer). Many more
// bytes in flight per SM than the LSU loop, with one thread.
inline constexpr uint32_t kTmaBufBytes = 32768;
inline constexpr int kTmaStages = 6;
static_assert(kTmaStages * kTmaBufBytes + 1024 + kTmaStages * 8 <= gemm::kSmemBytes<gemm::kStages>);

enum class CommMode : int { kLsu = 1, kTma = 2 };

struct TmaPushState {
  uint8_t* buf;     // kTmaStages * kTmaBufBytes, 1024-aligned
  uint64_t* bars;   // kTmaStages mbarriers (1 arrival + tx bytes each)
  uint32_t pieces;  // pieces streamed so far by this CTA: buffer = pieces % stages, parity = (pieces / stages) & 1
};

__device__ __forceinline__ void bulkStore(void* dst, const void* srcSmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(reinterpret_cast<uint64_t>(dst)),
               "r"(gemm::smemAddr(srcSmem)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarInval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(gemm::smemAddr(bar)) : "memory");
}

// One thread. On return every byte of the chunk has been written (bulk group complete) and ordered before the
// generic-proxy flag release that follows.
__device__ __forceinline__ void tmaCopyChunk(TmaPushState& st, const uint8_t* src, uint8_t* dst, uint8_t* dstLocal,
                                             int64_t bytes) {
  using namespace gemm;
  const uint32_t pieces = static_cast<uint32_t>((bytes + kTmaBufBytes - 1) / kTmaBufBytes);
  const auto pieceBytes = [&](uint32_t i) {
    return static_cast<uint32_t>(min(static_cast<int64_t>(kTmaBufBytes), bytes - static_cast<int64_t>(i) * kTmaBufBytes));
  };
  const auto issueLoad = [&](uint32_t i) {
    const uint32_t g = st.pieces + i;
    const uint32_t b = g % kTmaStages;
    mbarArriveExpectTx(&st.bars[b], pieceBytes(i));
    bulkLoad(st.buf + b * kTmaBufBytes, src + static_cast<int64_t>(i) * kTmaBufBytes, pieceBytes(i), &st.bars[b]);
  };
  bulkWaitRead<0>();  // the previous chunk's stores have read their buffers
  for (uint32_t i = 0; i < pieces && i < static_cast<uint32_t>(kTmaStages); ++i) issueLoad(i);
  for (uint32_t i = 0; i < pieces; ++i) {
    const uint32_t g = st.pieces + i;
    const uint32_t b = g % kTmaStages;
    mbarWait(&st.bars[b], (g / kTmaStages) & 1);  // acquire: the piece landed in smem
    const int64_t off = static_cast<int64_t>(i) * kTmaBufBytes;
    bulkStore(dst + off, st.buf + b * kTmaBufBytes, pieceBytes(i));
    if (dstLocal != nullptr) bulkStore(dstLocal + off, st.buf + b * kTmaBufBytes, pieceBytes(i));
    bulkCommit();
    if (i + kTmaStages < pieces) {
      bulkWaitRead<0>();  // this piece's stores have read buffer b: refill it
      issueLoad(i + kTmaStages);
    }
  }
  st.pieces += pieces;
  bulkWait<0>();             // the chunk's bulk writes are complete
  fenceProxyAsyncGlobal();   // async-proxy writes ordered before the generic-proxy release that publishes them
}

// Writes arrive[rank] = epoch into every peer's flag array: "my op of this epoch started, my gathered buffer is free
// for your pushes". One thread. release: pairs with the peers' waitGeq in runComm (nothing to publish but the fact;
// stream order already finished our previous op's reads of the gathered buffer).
__device__ __forceinline__ void announceArrival(const AgGemmKernelParams& kp) {
  for (int32_t q = 0; q < kp.nranks; ++q) {
    if (q != kp.rank) stReleaseSys(kp.flags[q] + kp.rank, opEpoch(kp));
  }
}

// smem: kMode == kTma needs the 1024-aligned staging area (the fused kernel's dynamic smem); bcast is one word of
// shared memory that does not overlap it.
template <CommMode kMode>
__device__ __forceinline__ void runComm(const AgGemmKernelParams& kp, int32_t commId, int32_t numComm,
                                        uint32_t* bcast, uint8_t* tmaSmem, uint64_t startNs) {
  const int32_t n = kp.nranks;
  const int32_t rows = kp.localRow1 - kp.localRow0;
  const int32_t chunks = (rows + kp.chunkRows - 1) / kp.chunkRows;
  const int32_t items = (n - 1) * chunks;
  if (commId == 0 && threadIdx.x == 0) announceArrival(kp);
  WaitCtx ctx = makeWaitCtx(kp, Role::kIntraComm, startNs);
  uint32_t arrivedMask = 0;  // thread 0 only: destinations already seen arrived
  bool failed = false;
  TmaPushState tma{};
  if constexpr (kMode == CommMode::kTma) {
    tma.buf = tmaSmem;
    tma.bars = reinterpret_cast<uint64_t*>(tmaSmem + kTmaStages * kTmaBufBytes);
    if (threadIdx.x == 0) {
      for (int b = 0; b < kTmaStages; ++b) gemm::mbarInit(&tma.bars[b], 1);
      gemm::fenceBarrierInit();  // visible to the async proxy before the first bulk load completes on them
    }
  }
  for (int32_t i = commId; i < items && !failed; i += numComm) {
    const int32_t d = 1 + i / chunks;
    const int32_t c = i % chunks;
    const int32_t dest = (kp.rank - d + n) % n;
    if (threadIdx.x == 0) {
      uint32_t ok = 1;
      if (!(arrivedMask & (1u << dest))) {
        // acquire: pairs with announceArrival on rank `dest`.
        ok = waitGeq(kp.flags[kp.rank] + dest, opEpoch(kp), ctx, static_cast<uint32_t>(dest)) ? 1u : 0u;
        arrivedMask |= 1u << dest;
      }
      *bcast = ok;
    }
    __syncthreads();  // publishes *bcast to the CTA
    failed = *bcast == 0;
    __syncthreads();  // everyone read *bcast before thread 0 may overwrite it
    if (failed) break;
    const int32_t r0 = c * kp.chunkRows;
    const int32_t r1 = min(r0 + kp.chunkRows, rows);
    const int64_t w0 = static_cast<int64_t>(r0) * kp.rowWords;
    const int64_t words = static_cast<int64_t>(r1 - r0) * kp.rowWords;
    const int64_t dstOff = static_cast<int64_t>(kp.localRow0) * kp.rowWords + w0;
    if constexpr (kMode == CommMode::kTma) {
      if (threadIdx.x == 0) {
        tmaCopyChunk(tma, reinterpret_cast<const uint8_t*>(kp.shard + w0),
                     reinterpret_cast<uint8_t*>(kp.gathered[dest] + dstOff),
                     d == 1 ? reinterpret_cast<uint8_t*>(kp.gathered[kp.rank] + dstOff) : nullptr, words * 16);
      }
    } else if (d == 1) {
      copyWords<true>(kp.shard + w0, kp.gathered[dest] + dstOff, kp.gathered[kp.rank] + dstOff, words);
    } else {
      copyWords<false>(kp.shard + w0, kp.gathered[dest] + dstOff, nullptr, words);
    }
    __syncthreads();  // every thread's stores of this chunk are ordered before thread 0's release below
    if (threadIdx.x == 0) {
      fenceAcqRelSys();  // cumulative: the CTA's stores (ordered by the barrier) before the flags, at system scope
      const int32_t idx = chunkFlagIndex(kp, kp.rank, c);
      // release: publishes the chunk in dest's gathered buffer; pairs with waitRows (fused) / waitIncoming on dest.
      stReleaseSys(kp.flags[dest] + idx, opEpoch(kp));
      // release: publishes our own copy; pairs with waitRows / waitIncoming on this rank.
      if (d == 1) stReleaseSys(kp.flags[kp.rank] + idx, opEpoch(kp));
    }
  }
  if constexpr (kMode == CommMode::kTma) {
    if (threadIdx.x == 0) {
      for (int b = 0; b < kTmaStages; ++b) mbarInval(&tma.bars[b]);  // the smem may be reused (tail compute)
    }
  }
  __syncthreads();  // the CTA leaves the comm role together (smem reuse by a following compute role)
}

// Decomposed plan: after pushing, CTA `id` of `num` waits for its share of every chunk of the gathered matrix, so the
// all-gather kernel completes only when the whole gathered buffer has landed (the GEMM kernel follows in stream order).
__device__ __forceinline__ void waitIncoming(const AgGemmKernelParams& kp, int32_t id, int32_t num, uint64_t startNs) {
  if (threadIdx.x != 0) return;
  WaitCtx ctx = makeWaitCtx(kp, Role::kIntraComm, startNs);
  const int32_t m = kp.g.m;
  int32_t j = 0;
  for (int32_t s = 0; s < kp.nranks; ++s) {
    const int32_t rows = rowsOfDev(m, s, kp.nranks);
    const int32_t chunks = (rows + kp.chunkRows - 1) / kp.chunkRows;
    for (int32_t c = 0; c < chunks; ++c, ++j) {
      if (j % num != id) continue;
      const int32_t idx = chunkFlagIndex(kp, s, c);
      // acquire: pairs with the stReleaseSys in runComm of rank s (or ours for s == rank).
      if (!waitGeq(kp.flags[kp.rank] + idx, opEpoch(kp), ctx, static_cast<uint32_t>(idx))) return;
    }
  }
}

}  // namespace tandem::kernels::ag
