// MoE routing, dispatch and combine kernels (tandem/kernels/moe.hpp says what each step does). The grouped GEMMs
// between them are grouped_gemm.cu's; the host side that sequences all of them is moe.cpp.
//
// Ordering across ranks (every rank's control area and receive area are mapped in every rank's process):
//   plan:     table row writes (every thread) -> bar.sync -> fence.acq_rel.sys + st.release.sys countsFlag (thread 0);
//             the owner's ld.acquire.sys of every countsFlag (waitGeq) -> bar.sync -> its threads read the table.
//   dispatch: row and row-info writes -> bar.sync -> fence + atomicAdd of a CTA counter (thread 0); the last CTA fences
//             again (acquiring every CTA's fence-then-add) and releases dispatchFlag on every owner.
//   arrive:   the owner acquires every source's dispatchFlag before the grouped GEMM reads the rows (a later kernel in
//             the stream).
//   combine:  the owner releases yFlag after its gemm2 (an earlier kernel in the stream); sources acquire it before
//             pulling y; the combine's last CTA releases finFlag and waits for every rank's, so no owner's y is reused
//             (by the next op's writes) while a source still reads it.
// A table row is rewritten by its source only in the next op, which the source reaches only after every owner has
// passed its plan (the dispatch flags it waited for come after each owner's plan), so nobody reads a row while it
// changes. Every rank takes the same decision from the same table, so on an error all of them write nothing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "moe_desc.hpp"
#include "moe_dispatch.cuh"

namespace tandem::kernels::moe {
namespace {

__device__ __forceinline__ WaitCtx waitCtxOf(const MoeKernelParams& p) {
  WaitCtx ctx{p.abortWord,
              p.errorSlot,
              0,
              static_cast<uint32_t>(p.op),
              static_cast<uint32_t>(Role::kIntraComm),
              static_cast<uint32_t>(p.rank)};
  if (p.timeoutNs != 0) ctx.deadlineNs = globaltimerNs() + p.timeoutNs;
  return ctx;
}

// Reports an error of the op itself (not of a wait) into its OpFault: the op fails, the communicator does not.
// `atFault` is the rank whose ids or capacity caused it. One thread (the plan kernel's thread 0) calls it, once per op.
// A replayed op (faultsDropped set) reports into the control page's one replay fault, which keeps the first error
// until the host took it (ControlPage::takeReplayFault); a later one while it is full only counts.
__device__ __forceinline__ void reportMoeError(const MoeKernelParams& p, WaitError code, uint32_t atFault,
                                               uint32_t chunk, uint64_t observed) {
  OpFault* const f = p.fault;
  if (f == nullptr) return;
  // acquire: pairs with the host's release store of 0 after it read the fields (takeReplayFault), so these writes
  // come after its reads. Only this rank's ops write here, one at a time (the op entry orders them), so no atomic.
  if (p.faultsDropped != nullptr && ldAcquireSys(&f->epoch) != 0) {
    stRelaxedSys(p.faultsDropped, ldRelaxedSys(p.faultsDropped) + 1);
    return;
  }
  f->code = static_cast<uint32_t>(code);
  f->atFault = atFault;
  f->chunk = chunk;
  f->op = static_cast<uint32_t>(p.op);
  f->observed = observed;
  // release: publishes the fields; pairs with ControlPage::fault's (or takeReplayFault's) acquire load of `epoch` on
  // the host. The host's epoch of the op: the ring entry's (tandemd compares it); any non-zero value for a replay.
  stReleaseSys(&f->epoch, p.epoch);
}

__device__ __forceinline__ int32_t ldState(const MoeKernelParams& p) {
  // Written by the plan kernel, earlier in this stream: kernel order makes it visible.
  return p.status->state;
}

// ---------------------------------------------------------------------------------------------------------------
// route: CTA (x, c) has a warp per global expert of group x and walks chunk c of this rank's tokens in order; a
// ballot gives each pair of the expert its index among the expert's pairs of the chunk (token order; a token names an
// expert at most once). The CTAs of x == 0 also check the chunk's ids.
// ---------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kRouteWarps * 32) moeRouteKernel(const __grid_constant__ MoeKernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int32_t topk = p.topk;
  const int32_t chunk = static_cast<int32_t>(blockIdx.y);
  const int32_t t0 = chunk * kRouteChunk;
  const int32_t t1 = min(p.tokens, t0 + kRouteChunk);
  if (blockIdx.x == 0) {
    for (int32_t t = t0 + static_cast<int32_t>(threadIdx.x); t < t1; t += static_cast<int32_t>(blockDim.x)) {
      const int32_t* row = p.ids + static_cast<int64_t>(t) * topk;
      for (int32_t j = 0; j < topk; ++j) {
        const int32_t e = row[j];
        bool bad = e < 0 || e >= p.experts;
        for (int32_t j2 = 0; j2 < j && !bad; ++j2) bad = row[j2] == e;
        if (bad) {
          // The first bad pair in (token, slot) order wins: the same one the cpu backend names.
          atomicMax(&p.status->bad, INT32_MAX - (t * topk + j));
          break;
        }
      }
    }
  }
  const int32_t e = static_cast<int32_t>(blockIdx.x) * kRouteWarps + warp;
  if (e >= p.experts) return;  // warp-uniform
  int32_t running = 0;
  for (int32_t base = t0; base < t1; base += 32) {
    const int32_t t = base + lane;
    int32_t hit = -1;
    if (t < t1) {
      const int32_t* row = p.ids + static_cast<int64_t>(t) * topk;
#pragma unroll 8
      for (int32_t j = 0; j < topk; ++j) {  // unrolled: the slots' loads go out together
        if (row[j] == e) hit = j;
      }
    }
    const uint32_t b = __ballot_sync(0xffffffffu, hit >= 0);
    if (hit >= 0) p.localIdx[t * topk + hit] = running + __popc(b & ((1u << lane) - 1u));
    running += __popc(b);
  }
  if (lane == 0) p.chunkBase[static_cast<int64_t>(chunk) * p.experts + e] = running;
}

// ---------------------------------------------------------------------------------------------------------------
// plan: one CTA of kPlanThreads (>= experts) threads.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void zeroGroups(const MoeKernelParams& p) {
  for (int i = static_cast<int>(threadIdx.x); i <= p.localExperts; i += static_cast<int>(blockDim.x)) {
    p.groupOffsets[i] = 0;
  }
}

// Exclusive scan of v over the CTA (kPlanThreads threads, one value each).
__device__ __forceinline__ int32_t blockExclusiveScan(int32_t v, int32_t* sWarp) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int32_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) sWarp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = sWarp[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    sWarp[lane] = w;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  return x - v + (warp > 0 ? sWarp[warp - 1] : 0);
}

__global__ void __launch_bounds__(kPlanThreads) moePlanKernel(const __grid_constant__ MoeKernelParams p) {
  __shared__ int32_t sWarp[32];
  __shared__ int32_t sExcl[kMoeMaxExperts];
  __shared__ int32_t sFail;
  __shared__ int32_t sState;
  __shared__ int32_t sRows[kMoeMaxRanks];
  __shared__ int32_t sRejected;
  const int tid = static_cast<int>(threadIdx.x);
  MoeStatus* const st = p.status;
  if (p.verdictSlot != nullptr) {
    // The verdict was published before go, which this stream waited for; a rejected op touches nothing (every rank
    // has the same verdict, so none of them waits for the others). One thread reads it: the slot is in host memory,
    // and a system-scope load from each of the 32 warps measured 41 us on an H100 (ncu: the CTA stalled on those
    // loads and on the barrier after them), where one round trip over PCIe takes about a microsecond.
    if (tid == 0) sRejected = ldAcquireSys(p.verdictSlot) == p.verdictRejected ? 1 : 0;
    __syncthreads();  // thread 0's acquire happens before every thread's work below
    if (sRejected != 0) {
      if (tid == 0) st->state = kSkip;
      zeroGroups(p);
      return;
    }
  }
  // ---- this rank's pairs per expert: scan the route kernel's chunk counts in place (chunk order = token order)
  const int32_t chunks = static_cast<int32_t>(routeChunks(p.tokens));
  for (int i = tid; i < p.experts; i += static_cast<int>(blockDim.x)) {
    int32_t running = 0;
    for (int32_t c = 0; c < chunks; ++c) {
      int32_t* cell = p.chunkBase + static_cast<int64_t>(c) * p.experts + i;
      const int32_t n = *cell;
      *cell = running;
      running += n;
    }
    p.localCounts[i] = running;
    // ---- publish this rank's row into every rank's table
    for (int q = 0; q < p.nranks; ++q) p.ctl[q]->table[p.rank][i] = running;
  }
  if (tid < p.nranks) {
    int32_t* extras = p.ctl[tid]->table[p.rank] + kMoeMaxExperts;
    const int32_t bad = st->bad;  // the route kernel's, earlier in this stream
    const int32_t pairIdx = bad == 0 ? -1 : INT32_MAX - bad;
    extras[kRowCapacity] = p.capacity;
    extras[kRowSavedRows] = p.savedRows;
    extras[kRowBad] = pairIdx + 1;
    extras[kRowBadValue] = pairIdx >= 0 ? p.ids[pairIdx] : 0;
  }
  if (tid == 0) sFail = 0;
  __syncthreads();  // every table write of this CTA happens before thread 0's fence
  if (tid == 0) {
    fenceAcqRelSys();
    // release: publishes this rank's table row; pairs with waitGeq below on every rank
    for (int q = 0; q < p.nranks; ++q) stReleaseSys(&p.ctl[q]->countsFlag[p.rank], opEpoch(p));
  }
  if (tid < p.nranks) {
    WaitCtx ctx = waitCtxOf(p);
    const bool ok = waitGeq(&p.ctl[p.rank]->countsFlag[tid], opEpoch(p), ctx, static_cast<uint32_t>(tid));
    if (!ok) atomicExch(&sFail, 1);
  }
  __syncthreads();  // the acquires above happen before every thread's table reads below
  if (sFail != 0) {
    if (tid == 0) st->state = kSkip;
    zeroGroups(p);
    return;
  }
  const MoeControl* const me = p.ctl[p.rank];
  const int L = p.localExperts;
  // ---- column sums (rows per global expert over every source) and their scan, segment by owner
  int32_t col = 0;
  if (tid < p.experts) {
    for (int s = 0; s < p.nranks; ++s) col += me->table[s][tid];
  }
  const int32_t excl = blockExclusiveScan(col, sWarp);
  if (tid < p.experts) sExcl[tid] = excl;
  if (tid < p.nranks) {
    const int32_t cap = me->table[tid][kMoeMaxExperts + kRowCapacity];
    st->capacity[tid] = cap;
  }
  __syncthreads();
  if (tid < p.nranks) {
    const int lo = tid * L, hi = lo + L;
    const int32_t total = (hi < p.experts ? sExcl[hi] : sWarp[31]) - sExcl[lo];
    sRows[tid] = total;
  }
  __syncthreads();
  if (tid == 0) {
    int32_t state = kRun;
    for (int s = 0; s < p.nranks && state == kRun; ++s) {
      const int32_t bad = me->table[s][kMoeMaxExperts + kRowBad];
      if (bad != 0) {
        // chunk: the token; observed: bit 62 set when the id repeats an expert of the token (else out of range),
        // the slot in bits 32..61, the id in the low 32 bits (node_comm.cpp moeErrorText reads them so).
        const int32_t pairIdx = bad - 1;
        const int32_t value = me->table[s][kMoeMaxExperts + kRowBadValue];
        const uint64_t repeat = value >= 0 && value < p.experts ? uint64_t{1} << 62 : 0;
        reportMoeError(p, WaitError::kMoeRouting, static_cast<uint32_t>(s), static_cast<uint32_t>(pairIdx / p.topk),
                       repeat | (static_cast<uint64_t>(pairIdx % p.topk) << 32) | static_cast<uint32_t>(value));
        state = kFailed;
      }
    }
    for (int d = 0; d < p.nranks && state == kRun; ++d) {
      const int32_t cap = me->table[d][kMoeMaxExperts + kRowCapacity];
      const int32_t saved = me->table[d][kMoeMaxExperts + kRowSavedRows];
      if (sRows[d] > cap) {
        reportMoeError(p, WaitError::kMoeCapacity, static_cast<uint32_t>(d), static_cast<uint32_t>(cap),
                       static_cast<uint64_t>(sRows[d]));
        state = kFailed;
      } else if (saved > 0 && sRows[d] > saved) {  // bit 63: the limit is rank d's saved gate|up (signals.hpp)
        reportMoeError(p, WaitError::kMoeCapacity, static_cast<uint32_t>(d), static_cast<uint32_t>(saved),
                       static_cast<uint64_t>(sRows[d]) | (uint64_t{1} << 63));
        state = kFailed;
      }
    }
    st->state = state;
    sState = state;
  }
  __syncthreads();
  if (sState != kRun) {
    zeroGroups(p);
    return;
  }
  // ---- this rank's groups, and its write offset in every expert's rows
  const int myLo = p.rank * L;
  if (tid < L) p.groupOffsets[tid] = sExcl[myLo + tid] - sExcl[myLo];
  if (tid == 0) p.groupOffsets[L] = sRows[p.rank];
  if (tid < L && p.expertCounts != nullptr) {
    int32_t c = 0;
    for (int s = 0; s < p.nranks; ++s) c += me->table[s][myLo + tid];
    p.expertCounts[tid] = c;
  }
  if (tid < p.experts) {
    const int owner = tid / L;
    int32_t before = 0;  // rows of this expert from lower source ranks
    for (int s = 0; s < p.rank; ++s) before += me->table[s][tid];
    p.srcOffset[tid] = sExcl[tid] - sExcl[owner * L] + before;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// dispatch: a warp per (token, slot) pair; 16-byte copies, four in flight per lane.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void copyRow(uint4* __restrict__ dst, const uint4* __restrict__ src, int32_t vecs,
                                        int lane) {
  int32_t i = lane;
  for (; i + 96 < vecs; i += 128) {
    const uint4 a = src[i], b = src[i + 32], c = src[i + 64], d = src[i + 96];
    dst[i] = a;
    dst[i + 32] = b;
    dst[i + 64] = c;
    dst[i + 96] = d;
  }
  for (; i < vecs; i += 32) dst[i] = src[i];
}

__global__ void __launch_bounds__(kCopyWarps * 32) moeDispatchKernel(const __grid_constant__ MoeKernelParams p) {
  const int32_t state = ldState(p);
  if (state == kSkip) return;  // uniform over the grid
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (state == kRun) {
    const int32_t pairs = p.tokens * p.topk;
    const int32_t vecs = p.hidden / 8;
    for (int32_t pi = static_cast<int32_t>(blockIdx.x) * kCopyWarps + warp; pi < pairs;
         pi += static_cast<int32_t>(gridDim.x) * kCopyWarps) {
      const int32_t e = p.ids[pi];
      const int32_t d = e / p.localExperts;
      const int32_t t = pi / p.topk;
      const int32_t row =
          p.srcOffset[e] + p.chunkBase[static_cast<int64_t>(t / kRouteChunk) * p.experts + e] + p.localIdx[pi];
      const RecvLayout lay = recvLayout(p.status->capacity[d], p.hidden, p.ffn, p.backward != 0);
      char* const base = p.recv[d];
      const auto* src =
          reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + static_cast<int64_t>(t) * p.hidden * 2);
      auto* dst = reinterpret_cast<uint4*>(base + lay.xOff + static_cast<uint64_t>(row) * p.hidden * 2);
      copyRow(dst, src, vecs, lane);
      if (p.backward != 0) {
        // The backward's owner needs the token's dout (in its y rows) and the weight as well.
        copyRow(reinterpret_cast<uint4*>(base + lay.yOff + static_cast<uint64_t>(row) * p.hidden * 2),
                reinterpret_cast<const uint4*>(static_cast<const char*>(p.dout) + static_cast<int64_t>(t) * p.hidden * 2),
                vecs, lane);
        if (lane == 0) reinterpret_cast<float*>(base + lay.weightOff)[row] = p.weights[pi];
      }
      if (lane == 0) {
        *reinterpret_cast<int4*>(base + lay.infoOff + static_cast<uint64_t>(row) * 16) =
            make_int4(p.rank, t, pi - t * p.topk, e);
      }
    }
  }
  finishDispatch(p);
}

// ---------------------------------------------------------------------------------------------------------------
// arrive: one CTA. waitY == 0: wait for every source's rows, then copy the row info out (dispatch+GEMM).
// waitY == 1: release this owner's y (written by gemm2, earlier in the stream), then wait for every owner's.
// ---------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kPlanThreads) moeArriveKernel(const __grid_constant__ MoeKernelParams p, int waitY) {
  __shared__ int32_t sFail;
  const int32_t state = ldState(p);
  if (state == kSkip) return;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) sFail = 0;
  if (waitY != 0 && tid == 0) {
    fenceAcqRelSys();
    // release: this owner's y rows; pairs with the waitGeq below on every source
    for (int q = 0; q < p.nranks; ++q) stReleaseSys(&p.ctl[q]->yFlag[p.rank], opEpoch(p));
  }
  __syncthreads();
  if (tid < p.nranks) {
    WaitCtx ctx = waitCtxOf(p);
    const uint64_t* flag = waitY != 0 ? &p.ctl[p.rank]->yFlag[tid] : &p.ctl[p.rank]->dispatchFlag[tid];
    if (!waitGeq(flag, opEpoch(p), ctx, static_cast<uint32_t>(tid))) atomicExch(&sFail, 1);
  }
  __syncthreads();  // the acquires happen before every thread's reads (and, by kernel order, the GEMM's)
  if (waitY != 0 || state != kRun || sFail != 0 || p.rowInfo == nullptr) return;
  const int32_t rows = p.groupOffsets[p.localExperts];
  const RecvLayout lay = recvLayout(p.capacity, p.hidden, p.ffn, p.backward != 0, p.fp8 != 0);
  const auto* info = reinterpret_cast<const int4*>(p.recv[p.rank] + lay.infoOff);
  for (int32_t r = tid; r < rows; r += static_cast<int32_t>(blockDim.x)) {
    const int4 v = info[r];
    int32_t* dst = p.rowInfo + static_cast<int64_t>(r) * 4;
    dst[0] = v.x;
    dst[1] = v.y;
    dst[2] = v.z;
    dst[3] = v.w;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// combine: a warp per token pulls its slots' y rows from their owners: out = sum_j weight_j * y_j, in fp32, slot
// order, rounded once. Then the end barrier (last CTA).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kMaxSlots = 32;

template <class T>
__device__ __forceinline__ void accumulate8(float (&acc)[8], const uint4& v, float w) {
  const auto* h = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      acc[i] = fmaf(w, __bfloat162float(h[i]), acc[i]);
    } else {
      acc[i] = fmaf(w, __half2float(h[i]), acc[i]);
    }
  }
}

template <class T>
__device__ __forceinline__ uint4 pack8(const float (&acc)[8]) {
  uint4 out;
  auto* h = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      h[i] = __float2bfloat16_rn(acc[i]);
    } else {
      h[i] = __float2half_rn(acc[i]);
    }
  }
  return out;
}

template <class T>
__global__ void __launch_bounds__(kCopyWarps * 32) moeCombineKernel(const __grid_constant__ MoeKernelParams p) {
  __shared__ const uint4* sRow[kCopyWarps][kMaxSlots];
  __shared__ float sWeight[kCopyWarps][kMaxSlots];
  const int32_t state = ldState(p);
  if (state == kSkip) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (state == kRun) {
    // Work item = (token, part): a warp sums one part of a token's row, so that many warps keep loads in flight.
    const int32_t vecs = p.hidden / 8;
    const int32_t parts = p.combineParts;
    const int32_t perPart = (vecs + parts - 1) / parts;
    const int32_t items = p.tokens * parts;
    for (int32_t w = static_cast<int32_t>(blockIdx.x) * kCopyWarps + warp; w < items;
         w += static_cast<int32_t>(gridDim.x) * kCopyWarps) {
      const int32_t t = w / parts;
      const int32_t part = w - t * parts;
      if (lane < p.topk) {
        const int32_t pi = t * p.topk + lane;
        const int32_t e = p.ids[pi];
        const int32_t d = e / p.localExperts;
        const int32_t row =
            p.srcOffset[e] + p.chunkBase[static_cast<int64_t>(t / kRouteChunk) * p.experts + e] + p.localIdx[pi];
        const RecvLayout lay = recvLayout(p.status->capacity[d], p.hidden, p.ffn, p.backward != 0, p.fp8 != 0);
        sRow[warp][lane] =
            reinterpret_cast<const uint4*>(p.recv[d] + lay.yOff + static_cast<uint64_t>(row) * p.hidden * 2);
        // The backward's rows are dx, already scaled by the weight (through dh): summed as they are; its dtopk
        // comes back with the token's first part.
        sWeight[warp][lane] = p.backward != 0 ? 1.0f : p.weights[pi];
        if (p.backward != 0 && part == 0) {
          p.dtopkOut[pi] = reinterpret_cast<const float*>(p.recv[d] + lay.dtopkOff)[row];
        }
      }
      __syncwarp();
      auto* dst = reinterpret_cast<uint4*>(static_cast<char*>(p.out) + static_cast<int64_t>(t) * p.hidden * 2);
      const int32_t end = min(vecs, (part + 1) * perPart);
      for (int32_t i = part * perPart + lane; i < end; i += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        // Up to 8 slots' loads in flight before their sums, which stay in slot order (bitwise repeatable).
        for (int32_t j0 = 0; j0 < p.topk; j0 += 8) {
          uint4 v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            if (j0 + u < p.topk) v[u] = sRow[warp][j0 + u][i];
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            if (j0 + u < p.topk) accumulate8<T>(acc, v[u], sWeight[warp][j0 + u]);
          }
        }
        dst[i] = pack8<T>(acc);
      }
      __syncwarp();  // the slot table is rewritten for the next item
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && p.nranks > 1) {
    fenceAcqRelSys();
    const uint32_t done = atomicAdd(&p.status->combineCtasDone, 1u) + 1u;
    if (done == gridDim.x) {
      // release: every y read of this rank is done; pairs with the waitGeq below on every owner
      for (int q = 0; q < p.nranks; ++q) stReleaseSys(&p.ctl[q]->finFlag[p.rank], opEpoch(p));
      WaitCtx ctx = waitCtxOf(p);
      for (int s = 0; s < p.nranks; ++s) {
        if (!waitGeq(&p.ctl[p.rank]->finFlag[s], opEpoch(p), ctx, static_cast<uint32_t>(s))) break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// backward act: a CTA per received row (grid-stride). The row's gate|up (a, b) comes from the GEMM before it or from
// the forward's saved rows, g = dout·w2 from the GEMM before it. h = silu(a) * b rounded to the dtype, as the
// forward's; dtopk = <g, h> in fp32 (a fixed tree order: bitwise repeatable); dh = weight * g; da = dh * b * silu'(a),
// db = dh * silu(a) go to the gate|up rows (over a and b when recomputed); h's place takes weight * h, so that
// dw2 = doutᵀ · (weight * h) needs no scaled copy of dout.
// ---------------------------------------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ float toF(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

template <class T>
__device__ __forceinline__ T fromF(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

template <class T>
__global__ void __launch_bounds__(kActThreads) moeBackwardActKernel(const __grid_constant__ MoeKernelParams p) {
  __shared__ float sPart[kActThreads / 32];
  // Rows received by this rank: the plan kernel's offsets (0 when the op was skipped or failed).
  const int32_t rows = p.groupOffsets[p.localExperts];
  const RecvLayout lay = recvLayout(p.capacity, p.hidden, p.ffn, true);
  char* const base = p.recv[p.rank];
  const int32_t f = p.ffn;
  const int32_t vecs = f / 8;
  const int tid = static_cast<int>(threadIdx.x);
  for (int32_t r = static_cast<int32_t>(blockIdx.x); r < rows; r += static_cast<int32_t>(gridDim.x)) {
    auto* gu = reinterpret_cast<uint4*>(base + lay.guOff + static_cast<uint64_t>(r) * 2 * f * 2);
    // a and b: the forward's saved row r (the caller's, only read), else the recomputed row that da, db overwrite.
    const uint4* abIn =
        p.saved != nullptr ? reinterpret_cast<const uint4*>(static_cast<const char*>(p.saved) +
                                                            static_cast<uint64_t>(r) * 2 * f * 2)
                           : gu;
    const auto* g = reinterpret_cast<const uint4*>(base + lay.gOff + static_cast<uint64_t>(r) * f * 2);
    auto* h = reinterpret_cast<uint4*>(base + lay.hOff + static_cast<uint64_t>(r) * f * 2);
    const float weight = reinterpret_cast<const float*>(base + lay.weightOff)[r];
    float dot = 0.0f;
    for (int32_t i = tid; i < vecs; i += kActThreads) {
      uint4 av = abIn[i], bv = abIn[vecs + i];
      const uint4 gv = g[i];
      uint4 hv;
      auto* a8 = reinterpret_cast<T*>(&av);
      auto* b8 = reinterpret_cast<T*>(&bv);
      const auto* g8 = reinterpret_cast<const T*>(&gv);
      auto* h8 = reinterpret_cast<T*>(&hv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float a = toF(a8[j]), b = toF(b8[j]), gj = toF(g8[j]);
        const float sig = 1.0f / (1.0f + __expf(-a));
        const float silu = a * sig;
        const float hr = toF(fromF<T>(silu * b));  // the forward's h, rounded to the dtype
        dot = fmaf(gj, hr, dot);
        const float dh = weight * gj;
        a8[j] = fromF<T>(dh * b * sig * (1.0f + a * (1.0f - sig)));
        b8[j] = fromF<T>(dh * silu);
        h8[j] = fromF<T>(weight * hr);
      }
      gu[i] = av;
      gu[vecs + i] = bv;
      h[i] = hv;
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, d);
    if (tid % 32 == 0) sPart[tid / 32] = dot;
    __syncthreads();
    if (tid == 0) {
      float sum = 0.0f;
      for (int w = 0; w < kActThreads / 32; ++w) sum += sPart[w];
      reinterpret_cast<float*>(base + lay.dtopkOff)[r] = sum;
    }
    __syncthreads();  // sPart is rewritten for the next row
  }
}

// ---------------------------------------------------------------------------------------------------------------
// forward SwiGLU from the saved gate|up: 16 bytes of h per thread (grid-stride over the received rows' h vectors).
// h = silu(a) * b from the rounded a and b, rounded once: the h the backward computes from the same saved rows.
// ---------------------------------------------------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(kActThreads) moeSwiGluKernel(const __grid_constant__ MoeKernelParams p) {
  const int64_t rows = p.groupOffsets[p.localExperts];  // 0 when the op was skipped or failed
  const RecvLayout lay = recvLayout(p.capacity, p.hidden, p.ffn, false);
  const int64_t vecs = p.ffn / 8;
  const auto* saved = static_cast<const uint4*>(p.saved);
  auto* h = reinterpret_cast<uint4*>(p.recv[p.rank] + lay.hOff);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vecs, c = i - r * vecs;
    uint4 av = saved[r * 2 * vecs + c], bv = saved[r * 2 * vecs + vecs + c];
    uint4 hv;
    const auto* a8 = reinterpret_cast<const T*>(&av);
    const auto* b8 = reinterpret_cast<const T*>(&bv);
    auto* h8 = reinterpret_cast<T*>(&hv);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = toF(a8[j]);
      const float sig = 1.0f / (1.0f + __expf(-a));  // as moeBackwardActKernel computes it, so h matches bitwise
      h8[j] = fromF<T>(a * sig * toF(b8[j]));
    }
    h[r * vecs + c] = hv;
  }
}

}  // namespace

cudaError_t launchRoute(const MoeKernelParams& p, int expertCtas, int chunks, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(expertCtas), static_cast<unsigned>(chunks), 1);
  cfg.blockDim = dim3(kRouteWarps * 32, 1, 1);
  cfg.stream = s;
  return cudaLaunchKernelEx(&cfg, &moeRouteKernel, p);
}

cudaError_t launchPlan(const MoeKernelParams& p, cudaStream_t s) {
  return launchK(&moePlanKernel, 1, kPlanThreads, s, p);
}

cudaError_t launchDispatch(const MoeKernelParams& p, int ctas, cudaStream_t s) {
  return launchK(&moeDispatchKernel, ctas, kCopyWarps * 32, s, p);
}

cudaError_t launchArrive(const MoeKernelParams& p, int waitY, cudaStream_t s) {
  return launchK(&moeArriveKernel, 1, kPlanThreads, s, p, waitY);
}

cudaError_t launchCombine(const MoeKernelParams& p, int ctas, cudaStream_t s) {
  if (p.dtype == static_cast<int32_t>(GemmDtype::kBf16)) {
    return launchK(&moeCombineKernel<__nv_bfloat16>, ctas, kCopyWarps * 32, s, p);
  }
  return launchK(&moeCombineKernel<__half>, ctas, kCopyWarps * 32, s, p);
}

cudaError_t launchBackwardAct(const MoeKernelParams& p, int ctas, cudaStream_t s) {
  if (p.dtype == static_cast<int32_t>(GemmDtype::kBf16)) {
    return launchK(&moeBackwardActKernel<__nv_bfloat16>, ctas, kActThreads, s, p);
  }
  return launchK(&moeBackwardActKernel<__half>, ctas, kActThreads, s, p);
}

cudaError_t launchSwiGlu(const MoeKernelParams& p, int ctas, cudaStream_t s) {
  if (p.dtype == static_cast<int32_t>(GemmDtype::kBf16)) {
    return launchK(&moeSwiGluKernel<__nv_bfloat16>, ctas, kActThreads, s, p);
  }
  return launchK(&moeSwiGluKernel<__half>, ctas, kActThreads, s, p);
}

cudaError_t prepareMoeKernels() {
  for (cudaError_t e : {loadKernel(&moeRouteKernel), loadKernel(&moePlanKernel), loadKernel(&moeDispatchKernel),
                        loadKernel(&moeArriveKernel), loadKernel(&moeCombineKernel<__nv_bfloat16>),
                        loadKernel(&moeCombineKernel<__half>), loadKernel(&moeBackwardActKernel<__nv_bfloat16>),
                        loadKernel(&moeBackwardActKernel<__half>), loadKernel(&moeSwiGluKernel<__nv_bfloat16>),
                        loadKernel(&moeSwiGluKernel<__half>)}) {
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace tandem::kernels::moe
