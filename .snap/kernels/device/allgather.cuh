// AllGather's device code over NVLink, driven by SMs, through every rank's symmetric workspace: one CTA's share of
// one op, for the client executor's kernel (allgather.cu) and the daemon executor's persistent kernel (persistent.cu),
// which runs the same code from its work queue. See allgather.hpp for the workspace layout and the tuning (which
// protocol runs for which shard size), control_page.hpp for the stream protocol.
//
// Chunked protocol (kPush, kPull: shards above TANDEM_AG_LL_MAX). Per chunk i of a rank's shard (slot
// s = i % kAgSlots, use u = i / kAgSlots, value v = (e << 32) | (u + 1)):
//   produce: wait until every consumer acked the slot's previous value, copy the chunk into the slot (pull:
//            own region; push: each consumer's region) and into our own recv, then publish filled[me][s] = v
//            in every consumer's header;
//   consume: for every peer q, wait filled[q][s] >= v in our header, copy the slot into recv, ack q.
// Every CTA runs its chunks in increasing order and each wait only needs a strictly earlier step of a peer
// (or the same step's produce), so any CTA count on any rank makes progress. kAgSlots is a multiple of the
// CTA count, so a slot belongs to one CTA within an op. Flags are epoch-tagged and never reset; lastFill
// carries each slot's last value into the next op on the same GPU (kernel boundaries order it).
//
// LL protocol (kLL: shards up to TANDEM_AG_LL_MAX, 512 KiB by default; 2 ranks or more). No fence, no flag word, no
// ack: a 16-byte line {data0, flag, data1, flag} carries 8 payload bytes and flag = (uint32_t)e in each 8-byte half
// (one 16-byte volatile store; only 8-byte halves are single-copy atomic, so a reader takes a line only when both
// flags say e). With k = this rank's count of LL ops run so far (llCount, equal on every rank: see below):
//   produce (every CTA, at once): write our shard's lines (last one zero-padded; at least line 0, even for 0 bytes)
//            into buffer [me][k % 2] of every peer's LL region; meanwhile thread 0 of CTA 0 reads the abort word
//            and, in the client executor, the verdict (host memory, off the critical path) and hands the outcome
//            to the other CTAs through the gate word (opGate, epoch-tagged): host-mapped reads from many CTAs queue, ~1 us each;
//   then     abort: report (as opMayRun) and stop; rejected: stop (recv untouched, k unchanged);
//   consume: copy our own shard into recv, then for every peer q spin on each line of buffer [q][k % 2] of our own
//            LL region until both flags say e and store its payload into recv (any alignment); k += 1.
// While a CTA waits, its thread 0 reads the abort word every kLLAbortPeriodNs (and reports, as opMayRun); the
// spinning threads check its stop flag and the deadline every kLLSpinsPerCheck polls and report a timeout like
// waitGeq, with chunk = the line, expected = (e << 32) | flag, observed = the two flags seen.
// Reuse: rank p writes its (k+2)-th LL op's lines into q's buffer [p][k % 2] only after p's (k+1)-th LL op ended,
// which read q's (k+1)-th lines, which q wrote only after its k-th LL op (and its reads of p's k-th lines) ended.
// That needs every rank to run the same sequence of LL ops, which holds for accepted ops (same shard size, same
// tuning); ops that do not run (rejected in the client executor, nops in the daemon's) leave k alone, so their
// count does not matter. Which is why the parity follows k, not e: a daemon-executor rank skips a rejected op
// outright, and a client-executor rank may not even pick LL for it (shard sizes of a rejected op may differ).
// A rejected op's lines, written before its verdict was read, land in buffer [p][k % 2], which no peer reads before
// p's next LL op (q finished reading it before p's previous LL op could end); they carry flag e of an op no one
// waits for, and p's next LL op overwrites them (kernel order). LL ops touch neither the slots nor their flags, and
// chunked ops neither LL buffers nor llCount, so the two alternate freely on one communicator.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "tandem/kernels/allgather.hpp"

namespace tandem::kernels::allgather_impl {

inline constexpr uint32_t kOpAllGather = 7;  // OpKind::kAllGather (common/descriptor.hpp)

__device__ __forceinline__ WorkspaceHeader* header(void* ws) { return static_cast<WorkspaceHeader*>(ws); }
__device__ __forceinline__ char* slotPtr(void* ws, uint32_t region, uint32_t slot) {
  return static_cast<char*>(ws) + kWorkspaceHeaderBytes +
         (uint64_t{region} * kAgSlots + slot) * uint64_t{kAgChunkMax};
}

// ---- copies: one source to up to kMaxLocalRanks destinations, any alignment ----------------------------------
// Loads and stores go through L2 (cg): slots are rewritten by other GPUs between uses, so L1 must not keep them.
template <int kMaxDst>
__device__ __forceinline__ void copyMulti(char* const (&dst)[kMaxDst], int nd, const char* src, uint64_t n) {
  const uint32_t tid = threadIdx.x, nthr = blockDim.x;
  bool aligned = (reinterpret_cast<uintptr_t>(src) & 15) == 0;
#pragma unroll
  for (int d = 0; d < kMaxDst; ++d) {
    if (d < nd) aligned = aligned && (reinterpret_cast<uintptr_t>(dst[d]) & 15) == 0;
  }
  const uint64_t n16 = n / 16;
  if (aligned) {
    const int4* s = reinterpret_cast<const int4*>(src);
    constexpr int kU = 4;
    uint64_t i = tid;
    for (; i + (kU - 1) * uint64_t{nthr} < n16; i += kU * uint64_t{nthr}) {
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = __ldcg(s + i + u * nthr);
#pragma unroll
      for (int d = 0; d < kMaxDst; ++d) {
        if (d < nd) {
#pragma unroll
          for (int u = 0; u < kU; ++u) __stcg(reinterpret_cast<int4*>(dst[d]) + i + u * nthr, v[u]);
        }
      }
    }
    for (; i < n16; i += nthr) {
      const int4 v = __ldcg(s + i);
#pragma unroll
      for (int d = 0; d < kMaxDst; ++d) {
        if (d < nd) __stcg(reinterpret_cast<int4*>(dst[d]) + i, v);
      }
    }
  } else {
    // Misaligned: 16-byte blocks assembled from (or spilled into) bytes where a side is not 16-aligned.
    const bool srcAligned = (reinterpret_cast<uintptr_t>(src) & 15) == 0;
    for (uint64_t i = tid; i < n16; i += nthr) {
      int4 v;
      if (srcAligned) {
        v = __ldcg(reinterpret_cast<const int4*>(src) + i);
      } else {
        unsigned char b[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) b[k] = static_cast<unsigned char>(src[i * 16 + k]);
        memcpy(&v, b, 16);
      }
#pragma unroll
      for (int d = 0; d < kMaxDst; ++d) {
        if (d >= nd) continue;
        if ((reinterpret_cast<uintptr_t>(dst[d]) & 15) == 0) {
          __stcg(reinterpret_cast<int4*>(dst[d]) + i, v);
        } else {
          unsigned char b[16];
          memcpy(b, &v, 16);
#pragma unroll
          for (int k = 0; k < 16; ++k) dst[d][i * 16 + k] = static_cast<char>(b[k]);
        }
      }
    }
  }
  for (uint64_t i = n16 * 16 + tid; i < n; i += nthr) {
    const char c = src[i];
#pragma unroll
    for (int d = 0; d < kMaxDst; ++d) {
      if (d < nd) dst[d][i] = c;
    }
  }
}

// A kernel whose wait failed copies the device-memory claim into the host-visible slot of its control page.
__device__ inline void mirrorError(const WorkspaceHeader* hdr, CommControl* ctl) {
  fenceAcqRelGpu();  // acquire: the claimer's fields (written before its fence in reportWaitError)
  const ErrorSlot& d = hdr->errorClaim;
  // Still being written by another CTA: that CTA's thread 0 made the claim and mirrors it when it unwinds.
  if (d.claimed != kErrorSlotReady || ctl == nullptr) return;
  ErrorSlot& h = ctl->error;
  // The rank's first failure stays: an op entry that found the ranks diverged reported there before it set the abort
  // word this kernel then saw (op_entry.cu).
  if (ldAcquireSysU32(&h.claimed) != 0) return;
  h.code = d.code;
  h.op = d.op;
  h.role = d.role;
  h.rank = d.rank;
  h.chunk = d.chunk;
  h.expected = d.expected;
  h.observed = d.observed;
  stReleaseSysU32(&h.claimed, kErrorSlotReady);  // release: publishes the fields; pairs with the daemon's acquire load
}

// One CTA's share of one AllGather. Returns false if a wait failed (already reported through ctx).
__device__ inline bool allgatherCta(const AllGatherParams& p, uint64_t epoch, uint32_t cta, uint32_t ncta,
                                    WaitCtx& ctx) {
  __shared__ int sFail;
  const uint32_t tid = threadIdx.x;
  const uint64_t S = p.bytes;
  const uint64_t C = p.chunkBytes;
  const uint64_t nChunks = (S + C - 1) / C;
  const uint32_t me = p.rank, n = p.nranks;
  const bool push = p.mode == AgMode::kPush;
  WorkspaceHeader* mine = header(p.workspaces[me]);
  const char* send = static_cast<const char*>(p.send);
  char* recv = static_cast<char*>(p.recv);

  for (uint64_t i = cta; i < nChunks; i += ncta) {
    const uint32_t s = static_cast<uint32_t>(i % kAgSlots);
    const uint64_t u = i / kAgSlots;
    const uint64_t off = i * C;
    const uint64_t len = (S - off < C) ? S - off : C;
    const uint64_t val = (epoch << 32) | (u + 1);
    if (n == 1) {
      char* const d1[1] = {recv + off};
      copyMulti<1>(d1, 1, send + off, len);
      continue;
    }
    // ---- produce ----
    if (tid == 0) {
      const uint64_t prev = u == 0 ? mine->lastFill[s] : ((epoch << 32) | u);
      bool ok = true;
      for (uint32_t q = 0; q < n && ok; ++q) {
        // acquire: pairs with consumer q's stReleaseSys of acked[q][s] after it read the slot.
        if (q != me) ok = waitGeq(&mine->acked[q][s], prev, ctx, static_cast<uint32_t>(i));
      }
      sFail = ok ? 0 : 1;
    }
    __syncthreads();
    if (sFail) return false;
    {
      // Own recv first, then the slot(s): peers in ring order (push) or our own region (pull). Indexed only
      // by unrolled constants so the array stays in registers.
      char* dsts[kMaxLocalRanks];
#pragma unroll
      for (uint32_t d = 0; d < kMaxLocalRanks; ++d) {
        if (d == 0) {
          dsts[d] = recv + uint64_t{me} * S + off;
        } else if (push) {
          dsts[d] = d < n ? slotPtr(p.workspaces[(me + d) % n], me, s) : nullptr;
        } else {
          dsts[d] = d == 1 ? slotPtr(p.workspaces[me], me, s) : nullptr;
        }
      }
      copyMulti<kMaxLocalRanks>(dsts, push ? static_cast<int>(n) : 2, send + off, len);
    }
    __syncthreads();  // the whole CTA's slot writes precede thread 0's release below
    if (tid == 0) {
      if (n == 2) {
        // release: publishes the slot; pairs with the consumer's waitGeq (ldAcquireSys) on filled[me][s].
        stReleaseSys(&header(p.workspaces[1 - me])->filled[me][s], val);
      } else {
        fenceAcqRelSys();  // release for all consumers' flags below (one fence, relaxed stores)
        for (uint32_t q = 0; q < n; ++q) {
          if (q != me) stRelaxedSys(&header(p.workspaces[q])->filled[me][s], val);
        }
      }
    }
    // ---- consume ----
    for (uint32_t k = 1; k < n; ++k) {
      const uint32_t q = (me + k) % n;
      if (tid == 0) {
        // acquire: pairs with producer q's release of filled[q][s].
        sFail = waitGeq(&mine->filled[q][s], val, ctx, static_cast<uint32_t>(i)) ? 0 : 1;
      }
      __syncthreads();
      if (sFail) return false;
      const char* src = push ? slotPtr(p.workspaces[me], q, s) : slotPtr(p.workspaces[q], q, s);
      char* const d1[1] = {recv + uint64_t{q} * S + off};
      copyMulti<1>(d1, 1, src, len);
      __syncthreads();  // every thread's reads of the slot precede the ack
      // release: our reads of slot s happen before producer q may refill it; pairs with its waitGeq on acked.
      if (tid == 0) stReleaseSys(&header(p.workspaces[q])->acked[me][s], val);
    }
    // Carry the slot's last value of this op into the next one (read after a kernel or item boundary).
    if (tid == 0 && i + kAgSlots >= nChunks) mine->lastFill[s] = val;
  }
  return true;
}

inline constexpr uint32_t kGateSpinsPerCheck = 1024;

// Whether op e may run, for thread 0 of every CTA: 1 run, 0 rejected by the daemon (client executor: its verdict),
// -1 aborted (reported) or failed. `epoch` is the op's flag epoch (p.epoch, or the device epoch): it tags the gate
// word, which must differ from one replay to the next; the verdict is tandemd's, of p.epoch. Only CTA 0 reads the
// host-mapped abort word and verdict: host-mapped reads from many
// CTAs queue behind each other (about 1 us per CTA, measured), so the other CTAs take the outcome from the gate word
// in this rank's workspace header, tagged with the epoch.
__device__ inline int opGate(const AllGatherParams& p, uint64_t epoch, uint32_t cta, uint32_t ncta, WaitCtx& ctx) {
  WorkspaceHeader* mine = header(p.workspaces[p.rank]);
  int run = 1;
  if (cta == 0) {
    // The client executor's stream does not wait for go before an AllGather (one stream memop less per op): the kernel
    // polls the verdict until the daemon has decided op e (every rank submitted it). The daemon keeps its decisions
    // within half the verdict ring of this rank's done, so slot e % ring holds e's verdict or an older op's, never a
    // newer one's. Both reads are in flight at once (one PCIe round trip, not two): the relaxed load may still be
    // pending when the acquire load issues, and nothing before the branch depends on either.
    for (uint32_t polls = 1;; ++polls) {
      const uint64_t abortWord = ldRelaxedSys(&p.ctl->abort);
      // acquire: pairs with the daemon's release of the verdict.
      const uint64_t verdict = p.checkVerdict != 0 ? ldAcquireSys(&p.ctl->verdict[p.epoch % kVerdictRing]) : p.epoch;
      if (abortWord != 0) {
        reportWaitError(ctx, WaitError::kAborted, ~0u, epoch << 32, abortWord);
        run = -1;
        break;
      }
      if ((verdict & ~kVerdictRejected) == p.epoch) {
        run = verdict == p.epoch ? 1 : 0;
        break;
      }
      if (polls % 64 == 0 && ctx.deadlineNs != 0 && globaltimerNs() > ctx.deadlineNs) {
        reportWaitError(ctx, WaitError::kTimeout, ~0u, epoch << 32, verdict);
        run = -1;
        break;
      }
    }
    // release: publishes the outcome (and orders the reads above) for the op's other CTAs.
    if (ncta > 1) stReleaseGpu(&mine->gate, (epoch << 2) | static_cast<uint64_t>(run + 1));
    return run;
  }
  // CTA 0 publishes without waiting for anything; the deadline only guards against it never being scheduled.
  for (uint32_t spins = 1;; ++spins) {
    const uint64_t g = ldAcquireGpu(&mine->gate);  // acquire: pairs with CTA 0's stReleaseGpu
    if (g >> 2 == (epoch & (~uint64_t{0} >> 2))) return static_cast<int>(g & 3) - 1;
    if (spins % kGateSpinsPerCheck == 0 && ctx.deadlineNs != 0 && globaltimerNs() > ctx.deadlineNs) {
      reportWaitError(ctx, WaitError::kTimeout, ~0u, epoch << 32, g);
      return -1;
    }
  }
}

// opGate for the whole CTA, before the chunked protocol touches any flag.
__device__ inline int opMayRun(const AllGatherParams& p, uint64_t epoch, uint32_t cta, uint32_t ncta, WaitCtx& ctx) {
  __shared__ int sRun;
  if (threadIdx.x == 0) sRun = opGate(p, epoch, cta, ncta, ctx);
  __syncthreads();
  return sRun;
}

// ---- the LL protocol -------------------------------------------------------------------------------------------
inline constexpr uint32_t kLLSpinsPerCheck = 64;     // line polls between checks of the CTA's stop flag and the deadline
inline constexpr uint64_t kLLAbortPeriodNs = 50'000;  // each CTA's watchdog reads the host-mapped abort word this often
inline constexpr int kLLBatch = 4;                    // lines a thread has in flight at once
static_assert(kAgThreads > 32 && kAgThreads % 32 == 0, "warp 0 reads the control page and watches; the others copy");
static_assert(kAgMaxCtas <= kAgSlots && (kAgMaxCtas & (kAgMaxCtas - 1)) == 0);

// 16-byte LL line accesses. Kept here rather than in ordering.cuh: they order nothing. Volatile (relaxed, system scope,
// never cached in L1) so each poll reaches memory that a peer writes over NVLink; each 8-byte half is single-copy
// atomic and carries its own flag, so no fence is needed between data and flag.
__device__ __forceinline__ uint4 ldVolatileLine(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void stVolatileLine(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Buffer [src][parity] of the LL region of workspace `ws`.
__device__ __forceinline__ uint4* llBuffer(void* ws, uint32_t nranks, uint32_t src, uint32_t parity) {
  return reinterpret_cast<uint4*>(static_cast<char*>(ws) + agLLOffset(nranks) +
                                  (uint64_t{src} * 2 + parity) * kAgLLBufBytes);
}

// Up to 8 bytes at p (len 1..8; 0 reads nothing), little-endian into a word; any alignment.
__device__ __forceinline__ uint64_t loadPayload(const char* p, uint64_t len) {
  if (len >= 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (uint32_t k = 0; k < 8 && k < len; ++k) v |= uint64_t{static_cast<unsigned char>(p[k])} << (8 * k);
  return v;
}
__device__ __forceinline__ void storePayload(char* p, uint64_t v, uint64_t len) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (len >= 8 && (a & 7) == 0) {
    *reinterpret_cast<uint64_t*>(p) = v;
  } else if (len >= 8 && (a & 3) == 0) {
    reinterpret_cast<uint32_t*>(p)[0] = static_cast<uint32_t>(v);
    reinterpret_cast<uint32_t*>(p)[1] = static_cast<uint32_t>(v >> 32);
  } else {
    for (uint32_t k = 0; k < 8 && k < len; ++k) p[k] = static_cast<char>(v >> (8 * k));
  }
}

// Spins until both flags of `line` (v: its latest load) say `flag`. Returns false once the CTA's watchdog saw the
// abort word (it reported) or on the deadline, reporting {chunk = line index, expected = (e << 32) | flag,
// observed = (flag seen in half 0 << 32) | flag in half 1}.
__device__ __forceinline__ bool llWait(const uint4* line, uint4& v, uint32_t flag, uint64_t epoch, uint64_t index,
                                       const uint32_t* stop, WaitCtx& ctx) {
  uint32_t spins = 0;
  while (v.y != flag || v.w != flag) {
    if (++spins % kLLSpinsPerCheck == 0) {
      if (ldAcquireCtaSharedU32(stop) != 0) return false;  // acquire: nothing to order; the watchdog reported
      if (ctx.deadlineNs != 0 && globaltimerNs() > ctx.deadlineNs) {
        reportWaitError(ctx, WaitError::kTimeout, static_cast<uint32_t>(index), (epoch << 32) | flag,
                        (uint64_t{v.y} << 32) | v.w);
        return false;
      }
    }
    v = ldVolatileLine(line);
  }
  return true;
}

// One CTA's share of one LL AllGather (nranks >= 2; any ncta in 1..kAgMaxCtas, any CTA count on the peers). Makes
// opMayRun's checks itself, overlapped with the first writes, and in CTA 0 only (host-mapped reads from many CTAs
// queue behind each other, about 1 us per CTA). Returns false if the op was aborted or a wait failed (reported
// through ctx); true if it ran or was rejected.
__device__ inline bool allgatherLLCta(const AllGatherParams& p, uint64_t epoch, uint32_t cta, uint32_t ncta,
                                      WaitCtx& ctx) {
  __shared__ int sRun;          // 1 run, 0 rejected, -1 aborted (or failed)
  __shared__ uint32_t sStop;    // the watchdog saw the abort word set (and reported)
  __shared__ uint32_t sActive;  // copying warps still waiting for lines
  const uint32_t tid = threadIdx.x, nthr = blockDim.x;
  const uint64_t S = p.bytes;
  const uint64_t lines = S == 0 ? 1 : (S + 7) / 8;  // line 0 travels even without payload: every LL op exchanges
  const uint32_t me = p.rank, n = p.nranks;
  const uint32_t flag = static_cast<uint32_t>(epoch);
  WorkspaceHeader* mine = header(p.workspaces[me]);
  // Written by this CTA index's previous LL op on this GPU (ordered by the kernel or item boundary); L2, not L1.
  const uint32_t count = __ldcg(&mine->llCount[cta]);
  const uint32_t parity = count & 1;
  const char* send = static_cast<const char*>(p.send);
  char* recv = static_cast<char*>(p.recv);
  const uint64_t nw = nthr - 32;               // warps 1.. copy, warp 0 reads the control page and watches
  const uint64_t stride = uint64_t{ncta} * nw;
  const uint64_t first = uint64_t{cta} * nw + (tid - 32);

  // ---- produce: warps 1.. write our lines into every peer; thread 0 learns whether the op runs meanwhile ----
  if (tid < 32) {
    if (tid == 0) {
      const int run = opGate(p, epoch, cta, ncta, ctx);
      sRun = run;
      sStop = 0;
      sActive = nthr / 32 - 1;
    }
  } else {
    for (uint64_t j0 = first; j0 < lines; j0 += kLLBatch * stride) {
      uint64_t data[kLLBatch];
#pragma unroll
      for (int u = 0; u < kLLBatch; ++u) {
        const uint64_t j = j0 + u * stride;
        data[u] = j * 8 < S ? loadPayload(send + j * 8, S - j * 8) : 0;  // zero-padded past the shard
      }
      for (uint32_t k = 1; k < n; ++k) {
        uint4* dst = llBuffer(p.workspaces[(me + k) % n], n, me, parity);
#pragma unroll
        for (int u = 0; u < kLLBatch; ++u) {
          const uint64_t j = j0 + u * stride;
          if (j < lines) {
            stVolatileLine(dst + j, make_uint4(static_cast<uint32_t>(data[u]), flag,
                                               static_cast<uint32_t>(data[u] >> 32), flag));
          }
        }
      }
    }
  }
  __syncthreads();
  const int run = sRun;
  if (run < 0) return false;
  if (run == 0) return true;  // rejected: our lines are harmless (see the top of this file); recv and count untouched

  // ---- consume: our own shard (this CTA's contiguous share), then every peer's lines ----
  {
    const uint64_t share = ((S + ncta - 1) / ncta + 15) & ~uint64_t{15};
    const uint64_t off = uint64_t{cta} * share;
    if (off < S) {
      char* const d1[1] = {recv + uint64_t{me} * S + off};
      copyMulti<1>(d1, 1, send + off, S - off < share ? S - off : share);
    }
  }
  bool ok = true;
  if (tid < 32) {
    if (tid == 0) {
      // Watchdog: reads the host-mapped abort word now and then (not every copying thread: those reads queue) until
      // the copying warps are done; the copiers check its flag and the deadline themselves.
      uint64_t next = globaltimerNs() + kLLAbortPeriodNs;
      while (ldAcquireCtaSharedU32(&sActive) != 0) {  // acquire: nothing to order; a count of warps
        __nanosleep(100);  // short: the CTA's last barrier waits for this thread
        const uint64_t now = globaltimerNs();
        if (now < next) continue;
        next = now + kLLAbortPeriodNs;
        const uint64_t abortWord = ldRelaxedSys(&p.ctl->abort);
        if (abortWord != 0) {
          reportWaitError(ctx, WaitError::kAborted, ~0u, epoch << 32, abortWord);
          stReleaseCtaSharedU32(&sStop, 1);  // release: after the report; pairs with the copiers' acquire
          ok = false;
          break;
        }
      }
    }
  } else {
    for (uint32_t k = 1; k < n && ok; ++k) {
      const uint32_t q = (me + k) % n;
      const uint4* src = llBuffer(p.workspaces[me], n, q, parity);
      char* dst = recv + uint64_t{q} * S;
      for (uint64_t j0 = first; j0 < lines && ok; j0 += kLLBatch * stride) {
        uint4 v[kLLBatch];
#pragma unroll
        for (int u = 0; u < kLLBatch; ++u) {
          const uint64_t j = j0 + u * stride;
          if (j < lines) v[u] = ldVolatileLine(src + j);
        }
#pragma unroll
        for (int u = 0; u < kLLBatch; ++u) {
          const uint64_t j = j0 + u * stride;
          if (ok && j < lines) {
            ok = llWait(src + j, v[u], flag, epoch, j, &sStop, ctx);
            if (ok && j * 8 < S) storePayload(dst + j * 8, uint64_t{v[u].x} | (uint64_t{v[u].z} << 32), S - j * 8);
          }
        }
      }
    }
    __syncwarp();
    if (tid % 32 == 0) atomicSub(&sActive, 1u);
  }
  // Every thread's read of llCount[cta] (above) precedes the update; the CTA agrees on the outcome.
  ok = __syncthreads_and(ok ? 1 : 0) != 0;
  if (tid == 0) {
    // Counted even after a failed wait, so that every word stays equal (the communicator fails anyway).
    for (uint32_t j = cta; j < kAgMaxCtas; j += ncta) mine->llCount[j] = count + 1;
  }
  return ok;
}

// One CTA's share of AllGather `p` (CTA `cta` of `ncta`): the LL protocol or the gate and the chunked protocol. A
// failed wait has reported through the rank's workspace claim; thread 0 mirrors it into the control page.
__device__ __forceinline__ void allgatherShare(const AllGatherParams& p, uint32_t cta, uint32_t ncta) {
  WorkspaceHeader* mine = header(p.workspaces[p.rank]);
  WaitCtx ctx{&p.ctl->abort, &mine->errorClaim, globaltimerNs() + p.timeoutNs, kOpAllGather,
              static_cast<uint32_t>(Role::kIntraComm), p.rank};
  // Device-epoch mode: the op's entry wrote the epoch before this kernel (stream order); L2, not L1.
  const uint64_t epoch = p.epochWord != nullptr ? __ldcg(p.epochWord) : p.epoch;
  bool ok;
  if (p.mode == AgMode::kLL && p.nranks > 1) {
    ok = allgatherLLCta(p, epoch, cta, ncta, ctx);  // reads the verdict itself, off the critical path
  } else {
    const int run = opMayRun(p, epoch, cta, ncta, ctx);
    ok = run > 0 ? allgatherCta(p, epoch, cta, ncta, ctx) : run == 0;  // rejected: nothing to do or report
  }
  if (!ok && threadIdx.x == 0) mirrorError(mine, p.ctl);
}

}  // namespace tandem::kernels::allgather_impl
