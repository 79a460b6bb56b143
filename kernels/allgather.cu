// AllGather over NVLink, driven by SMs, in chunks through every rank's symmetric workspace; and the daemon
// executor's persistent kernel, which runs the same device code from a work queue. See allgather.hpp for the
// stream protocol and the workspace layout.
//
// Per chunk i of a rank's shard (slot s = i % kAgSlots, use u = i / kAgSlots, value v = (e << 32) | (u + 1)):
//   produce: wait until every consumer acked the slot's previous value, copy the chunk into the slot (pull:
//            own region; push: each consumer's region) and into our own recv, then publish filled[me][s] = v
//            in every consumer's header;
//   consume: for every peer q, wait filled[q][s] >= v in our header, copy the slot into recv, ack q.
// Every CTA runs its chunks in increasing order and each wait only needs a strictly earlier step of a peer
// (or the same step's produce), so any CTA count on any rank makes progress. kAgSlots is a multiple of the
// CTA count, so a slot belongs to one CTA within an op. Flags are epoch-tagged and never reset; lastFill
// carries each slot's last value into the next op on the same GPU (kernel boundaries order it).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "device/preload_on.cuh"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace {

constexpr uint32_t kOpAllGather = 7;  // OpKind::kAllGather (common/descriptor.hpp)

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
__device__ void mirrorError(const WorkspaceHeader* hdr, CommControl* ctl) {
  fenceAcqRelGpu();  // acquire: the claimer's fields (written before its fence in reportWaitError)
  const ErrorSlot& d = hdr->errorClaim;
  // Still being written by another CTA: that CTA's thread 0 made the claim and mirrors it when it unwinds.
  if (d.claimed != kErrorSlotReady || ctl == nullptr) return;
  ErrorSlot& h = ctl->error;
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
__device__ bool allgatherCta(const AllGatherParams& p, uint32_t cta, uint32_t ncta, WaitCtx& ctx) {
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
    const uint64_t val = (p.epoch << 32) | (u + 1);
    if (n == 1) {
      char* const d1[1] = {recv + off};
      copyMulti<1>(d1, 1, send + off, len);
      continue;
    }
    // ---- produce ----
    if (tid == 0) {
      const uint64_t prev = u == 0 ? mine->lastFill[s] : ((p.epoch << 32) | u);
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

// Checks the abort word (and, in the client executor, the daemon's verdict) before touching any flag.
__device__ bool opMayRun(const AllGatherParams& p, WaitCtx& ctx) {
  __shared__ int sRun;
  if (threadIdx.x == 0) {
    int run = 1;
    const uint64_t abortWord = ldRelaxedSys(&p.ctl->abort);
    if (abortWord != 0) {
      reportWaitError(ctx, WaitError::kAborted, ~0u, p.epoch << 32, abortWord);
      run = 0;
    } else if (p.checkVerdict != 0) {
      // acquire: the daemon writes verdict before go; the stream waited for go >= epoch before launching us.
      const uint64_t verdict = ldAcquireSys(&p.ctl->verdict[p.epoch % kVerdictRing]);
      run = verdict == p.epoch ? 1 : 0;
    }
    sRun = run;
  }
  __syncthreads();
  return sRun != 0;
}

__global__ void __launch_bounds__(kAgThreads) allgatherKernel(const __grid_constant__ AllGatherParams p) {
  WorkspaceHeader* mine = header(p.workspaces[p.rank]);
  WaitCtx ctx{&p.ctl->abort, &mine->errorClaim, globaltimerNs() + p.timeoutNs, kOpAllGather,
              static_cast<uint32_t>(Role::kIntraComm), p.rank};
  bool ok = opMayRun(p, ctx);
  if (ok) {
    ok = allgatherCta(p, blockIdx.x, gridDim.x, ctx);
  } else if (threadIdx.x == 0 && ldRelaxedSys(&p.ctl->abort) == 0) {
    ok = true;  // rejected by the daemon: nothing to do, nothing to report
  }
  if (!ok && threadIdx.x == 0) mirrorError(mine, p.ctl);
}

// ---- the daemon executor -------------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t phaseWord(uint64_t gen, KernelState s) {
  return (gen << 8) | static_cast<uint64_t>(s);
}

__global__ void __launch_bounds__(kAgThreads) persistentKernel(const __grid_constant__ PersistentParams pp) {
  WorkQueue* q = pp.queue;
  PersistentDeviceState* st = pp.state;
  const uint32_t cta = blockIdx.x, grid = gridDim.x, tid = threadIdx.x;
  __shared__ uint64_t sItemIndex;
  __shared__ int sCmd;   // 0 run, 1 exit
  __shared__ int sSolo;  // CTA 0 only: the grid has shrunk to this CTA (thread 0 decides, the CTA follows)
  __shared__ __align__(16) WorkItem sItem;
  bool solo = grid == 1;
  uint64_t next = 0, executed = 0;  // CTA 0: next item index; every CTA: items run in this launch (full grid)
  if (cta == 0 && tid == 0) {
    // acquire: the previous launch's last `consumed` (stream order already guarantees it).
    next = ldAcquireSys(&q->consumed);
    stRelaxedSys(&q->phase, phaseWord(pp.generation, solo ? KernelState::kSolo : KernelState::kFull));
  }
  uint64_t lastGo = 0;  // CTAs > 0: goIndex last seen
  for (;;) {
    if (tid == 0) {
      int cmd = 1;
      if (cta == 0) {
        uint64_t idleStart = globaltimerNs();
        for (;;) {
          if (ldRelaxedSys(&q->stop) != 0) {
            if (!solo) stReleaseGpu(&st->exitAll, 1);  // the other CTAs leave too (release: pairs with their acquire)
            break;
          }
          const uint64_t tail = ldAcquireSys(&q->tail);  // acquire: pairs with the host's release after the item
          if (tail > next) {
            const uint64_t head = ldRelaxedSys(reinterpret_cast<const uint64_t*>(&q->items[next % kWorkQueueCapacity]));
            if (static_cast<WorkKind>(head & 0xffffffffu) == WorkKind::kYield) {
              // Leave for a kernel that needs every SM: the others first, once the previous item is done everywhere.
              if (!solo) {
                while (ldAcquireGpu(&st->ctaDone) < uint64_t{grid} * executed) {
                }
                stReleaseGpu(&st->exitAll, 1);
              }
              stRelaxedSys(&q->consumed, next + 1);
              stRelaxedSys(&q->finished, next + 1);
              // release: consumed and finished before the state; the host launches the next kernel after this one
              // in stream order anyway, so nothing waits for it.
              stReleaseSys(&q->phase, phaseWord(pp.generation, KernelState::kExited));
              break;
            }
            if (solo && head >> 32 != 0) {
              break;  // needsGrid (high half of the first word): the host launched a full grid; leave it the item
            }
            cmd = 0;
            break;
          }
          const uint64_t idle = globaltimerNs() - idleStart;
          if (!solo && idle > pp.idleShrinkNs) {
            // Dekker with the host's push: state first, then re-read tail (fence.sc pairs with the host's seq_cst).
            stRelaxedSys(&q->phase, phaseWord(pp.generation, KernelState::kShrinking));
            fenceScSys();
            if (ldAcquireSys(&q->tail) > next) {
              stRelaxedSys(&q->phase, phaseWord(pp.generation, KernelState::kFull));
              continue;
            }
            while (ldAcquireGpu(&st->ctaDone) < uint64_t{grid} * executed) {
            }
            stReleaseGpu(&st->exitAll, 1);  // release: the other CTAs leave; pairs with their ldAcquireGpu
            solo = true;
            // release: `consumed` (written when each item was taken) before the state the host acts on.
            stReleaseSys(&q->phase, phaseWord(pp.generation, KernelState::kSolo));
            idleStart = globaltimerNs();
            continue;
          }
          if (solo && idle > pp.lingerNs) {
            stRelaxedSys(&q->phase, phaseWord(pp.generation, KernelState::kExiting));
            fenceScSys();
            if (ldAcquireSys(&q->tail) > next) {
              stRelaxedSys(&q->phase, phaseWord(pp.generation, KernelState::kSolo));
              continue;
            }
            stReleaseSys(&q->phase, phaseWord(pp.generation, KernelState::kExited));
            break;
          }
        }
        if (cmd == 0) {
          if (!solo) {
            // Item barrier: every CTA finished the previous item before any starts this one.
            while (ldAcquireGpu(&st->ctaDone) < uint64_t{grid} * executed) {
            }
            stReleaseGpu(&st->goIndex, next + 1);  // release: item `next` may run; pairs with the CTAs' acquire
          }
          stRelaxedSys(&q->consumed, next + 1);
          sItemIndex = next;
          ++next;
        }
      } else {
        for (;;) {
          if (ldAcquireGpu(&st->exitAll) != 0) break;
          const uint64_t go = ldAcquireGpu(&st->goIndex);  // acquire: pairs with CTA 0's stReleaseGpu
          if (go > lastGo) {
            lastGo = go;
            sItemIndex = go - 1;
            cmd = 0;
            break;
          }
        }
      }
      sCmd = cmd;
      sSolo = solo ? 1 : 0;
    }
    __syncthreads();
    if (sCmd != 0) return;
    const bool soloNow = sSolo != 0;  // uniform across the CTA (thread 0's `solo` is the only one kept current)
    // Load the item (host-mapped) into shared memory; the acquire above ordered these reads after the push.
    {
      const uint64_t* src = reinterpret_cast<const uint64_t*>(&q->items[sItemIndex % kWorkQueueCapacity]);
      uint64_t* dst = reinterpret_cast<uint64_t*>(&sItem);
      for (uint32_t w = tid; w < sizeof(WorkItem) / 8; w += blockDim.x) dst[w] = ldRelaxedSys(src + w);
    }
    __syncthreads();
    const uint32_t ncta = soloNow ? 1 : grid;
    if (sItem.kind == WorkKind::kAllGather) {
      const AllGatherParams& p = sItem.ag;
      WorkspaceHeader* mine = header(p.workspaces[p.rank]);
      WaitCtx ctx{&p.ctl->abort, &mine->errorClaim, globaltimerNs() + p.timeoutNs, kOpAllGather,
                  static_cast<uint32_t>(Role::kIntraComm), p.rank};
      bool ok = opMayRun(p, ctx);
      if (ok) ok = allgatherCta(p, cta, ncta, ctx);
      if (!ok && tid == 0) mirrorError(mine, p.ctl);
    }
    __syncthreads();  // this CTA's writes precede thread 0's completion count
    if (tid == 0) {
      bool last = true;
      if (!soloNow) {
        // acq_rel: publishes this CTA's writes and acquires the earlier finishers'.
        last = fetchAddAcqRelGpu(&st->ctaDone, 1) + 1 == uint64_t{grid} * (executed + 1);
      }
      if (last) {
        fenceAcqRelSys();  // every CTA's recv writes are visible system-wide before done
        // After an abort the daemon owns done (it wrote a lead past every epoch); an older value must not follow.
        if (sItem.ag.ctl == nullptr || ldRelaxedSys(&sItem.ag.ctl->abort) == 0) {
          stReleaseSysU32(sItem.doneWord, static_cast<uint32_t>(sItem.epoch));  // pairs with the stream's WaitValue
        }
        stRelaxedSys(&q->finished, sItemIndex + 1);  // ordered after done by the release above; host frees memory
      }
    }
    ++executed;
    __syncthreads();
  }
}

std::string cudaFailure(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

uint64_t envU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 0);
}

uint32_t pow2Floor(uint64_t x) {
  uint32_t p = 1;
  while (uint64_t{p} * 2 <= x && p < (1u << 30)) p *= 2;
  return p;
}

}  // namespace

AgTuning allgatherTuning(uint64_t bytes, uint32_t maxCtas) {
  // Read on every call (a few hundred ns), so a benchmark can switch between ops; every rank must agree.
  const uint64_t envCtas = envU64("TANDEM_AG_CTAS", 0);
  const uint64_t envChunk = envU64("TANDEM_AG_CHUNK", 0);
  const char* m = std::getenv("TANDEM_AG_MODE");
  const AgMode envMode = (m != nullptr && std::strcmp(m, "pull") == 0) ? AgMode::kPull : AgMode::kPush;
  // Default CTA cap, measured on nvidia-h200-x2 (bench/RESULTS.md, session 1): from 64 MiB per rank 64 pushing CTAs
  // beat 32 (241 vs 209 GB/s bus bandwidth at 64 MiB, 299 vs 228 at 256 MiB, 322 vs 233 at 1 GiB) and beat NCCL; below
  // 32 MiB the extra CTAs only add flag traffic.
  uint32_t cap = maxCtas != 0 ? maxCtas : (bytes >= (uint64_t{32} << 20) ? 64 : 32);
  if (envCtas != 0) cap = static_cast<uint32_t>(envCtas);
  cap = pow2Floor(cap < 1 ? 1 : (cap > kAgMaxCtas ? kAgMaxCtas : cap));
  AgTuning t{};
  t.mode = envMode;
  t.numCtas = pow2Floor(bytes / (16u << 10));
  if (t.numCtas > cap) t.numCtas = cap;
  if (envCtas != 0) t.numCtas = cap;
  uint64_t chunk = (bytes + t.numCtas - 1) / t.numCtas;
  chunk = (chunk + 15) & ~uint64_t{15};
  if (chunk < 4096) chunk = 4096;
  if (chunk > kAgChunkMax) chunk = kAgChunkMax;
  if (envChunk != 0) chunk = envChunk > kAgChunkMax ? kAgChunkMax : ((envChunk + 15) & ~uint64_t{15});
  t.chunkBytes = static_cast<uint32_t>(chunk);
  return t;
}

void preloadRuntimeKernels(int device) {
  const void* fns[] = {reinterpret_cast<const void*>(&allgatherKernel), reinterpret_cast<const void*>(&persistentKernel)};
  preloadOn(device, fns, "runtime kernels");
}

void launchAllGather(const AllGatherParams& p, cudaStream_t stream) {
  if (p.nranks == 0 || p.nranks > kMaxLocalRanks || p.rank >= p.nranks) {
    throw std::runtime_error("launchAllGather: rank " + std::to_string(p.rank) + " of " + std::to_string(p.nranks) +
                             " is out of range (1.." + std::to_string(kMaxLocalRanks) + " ranks on one node)");
  }
  if (p.chunkBytes == 0 || p.chunkBytes > kAgChunkMax || p.chunkBytes % 16 != 0 || p.numCtas == 0 ||
      p.numCtas > kAgMaxCtas || (p.numCtas & (p.numCtas - 1)) != 0 || p.ctl == nullptr || p.epoch == 0) {
    throw std::runtime_error("launchAllGather: bad tuning or control page (chunk " + std::to_string(p.chunkBytes) +
                             ", ctas " + std::to_string(p.numCtas) + ")");
  }
  for (uint32_t r = 0; r < p.nranks; ++r) {
    if (p.workspaces[r] == nullptr) throw std::runtime_error("launchAllGather: workspace of a rank is not mapped");
  }
  allgatherKernel<<<p.numCtas, kAgThreads, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaFailure("allgather kernel launch", e));
}

void launchPersistent(const PersistentParams& params, uint32_t numCtas, cudaStream_t stream) {
  if (numCtas == 0 || numCtas > kAgMaxCtas || (numCtas & (numCtas - 1)) != 0) {
    throw std::runtime_error("launchPersistent: CTA count " + std::to_string(numCtas) +
                             " is not a power of two in 1.." + std::to_string(kAgMaxCtas));
  }
  cudaError_t e = cudaMemsetAsync(params.state, 0, sizeof(PersistentDeviceState), stream);
  if (e != cudaSuccess) throw std::runtime_error(cudaFailure("cudaMemsetAsync(persistent state)", e));
  persistentKernel<<<numCtas, kAgThreads, 0, stream>>>(params);
  e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaFailure("persistent kernel launch", e));
}

// ---- driver entry points ---------------------------------------------------------------------------------
namespace {
template <typename F>
void load(F& fn, const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || f == nullptr) {
    throw std::runtime_error(std::string("CUDA driver entry point ") + name + " is not available (" +
                             cudaGetErrorName(e) + "); install an NVIDIA driver for CUDA 12.0 or newer");
  }
  fn = reinterpret_cast<F>(f);
}
}  // namespace

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi a{};
    load(a.memCreate, "cuMemCreate");
    load(a.memRelease, "cuMemRelease");
    load(a.memExportToShareableHandle, "cuMemExportToShareableHandle");
    load(a.memImportFromShareableHandle, "cuMemImportFromShareableHandle");
    load(a.memGetAllocationGranularity, "cuMemGetAllocationGranularity");
    load(a.memAddressReserve, "cuMemAddressReserve");
    load(a.memAddressFree, "cuMemAddressFree");
    load(a.memMap, "cuMemMap");
    load(a.memUnmap, "cuMemUnmap");
    load(a.memSetAccess, "cuMemSetAccess");
    load(a.memRetainAllocationHandle, "cuMemRetainAllocationHandle");
    load(a.memGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    load(a.memGetAddressRange, "cuMemGetAddressRange");
    load(a.streamWaitValue32, "cuStreamWaitValue32");
    load(a.streamWriteValue32, "cuStreamWriteValue32");
    load(a.getErrorString, "cuGetErrorString");
    return a;
  }();
  return api;
}

const char* driverErrorName(CUresult r) {
  const char* s = nullptr;
  try {
    if (driver().getErrorString(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  } catch (...) {
  }
  return "unknown CUDA driver error";
}

}  // namespace tandem::kernels
