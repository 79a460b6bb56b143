// The daemon executor's persistent kernel: pops the work queue, runs each item on the whole grid (or on one lingering
// CTA), and completes it, until told to stop or idle for long enough. Design: tandem/kernels/persistent.hpp; the queue:
// tandem/kernels/work_queue.hpp; AllGather's device code: device/allgather.cuh.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "device/allgather.cuh"
#include "device/ordering.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/persistent.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace {

using allgather_impl::allgatherShare;

__global__ void __launch_bounds__(kAgThreads) persistentKernel(const __grid_constant__ PersistentParams pp) {
  WorkQueue* q = pp.queue;
  PersistentDeviceState* st = pp.state;
  const uint32_t cta = blockIdx.x, grid = gridDim.x, tid = threadIdx.x;
  constexpr uint32_t kItemWords = sizeof(WorkItem) / 8;
  static_assert(kItemWords <= kAgThreads, "one thread per word of the work item");
  __shared__ uint64_t sItemIndex;
  __shared__ int sCmd;   // 0 run, 1 exit
  __shared__ int sSolo;  // CTA 0 only: the grid has shrunk to this CTA (thread 0 decides, the CTA follows)
  __shared__ __align__(16) WorkItem sItem;
  uint64_t* const sWords = reinterpret_cast<uint64_t*>(&sItem);
  bool solo = grid == 1;
  uint64_t next = 0, executed = 0;  // CTA 0: next item index; every CTA: items run in this launch (full grid)
  if (cta == 0 && tid == 0) {
    // acquire: the previous launch's last `consumed` (stream order already guarantees it).
    next = ldAcquireSys(&q->consumed);
    stRelaxedSys(&q->phase, phaseWord(pp.generation, solo ? KernelState::kSolo : KernelState::kFull));
  }
  uint64_t lastGo = 0;  // CTAs > 0: goIndex last seen
  for (;;) {
    if (cta == 0) {
      // Thread 0 waits for an item (or decides to shrink or exit); then the CTA reads it from host memory, once: every
      // host-mapped read costs a PCIe round trip and such reads queue, so the other CTAs get it from device memory.
      if (tid == 0) {
        int cmd = 1;
        uint64_t idleStart = globaltimerNs();
        for (uint32_t polls = 0;; ++polls) {
          if (polls % 64 == 0 && ldRelaxedSys(&q->stop) != 0) {  // rarely: each read of host memory is a round trip
            if (!solo) stReleaseGpu(&st->exitAll, 1);  // the other CTAs leave too (release: pairs with their acquire)
            break;
          }
          if (ldAcquireSys(&q->tail) > next) {  // acquire: pairs with the host's release after the item
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
        sCmd = cmd;
        sItemIndex = next;
      }
      __syncthreads();
      if (sCmd != 0) return;
      // One word per thread, all in flight at once; thread 0's acquire of tail and the barrier order these after the
      // host's writes of the item.
      const auto* item = reinterpret_cast<const uint64_t*>(&q->items[sItemIndex % kWorkQueueCapacity]);
      if (tid < kItemWords) sWords[tid] = ldRelaxedSys(item + tid);
      __syncthreads();
      if (tid == 0) {
        int cmd = 0;
        if (sItem.kind == WorkKind::kYield) {
          // Leave for a kernel that needs every SM: the others first, once the previous item is done everywhere.
          if (!solo) {
            while (ldAcquireGpu(&st->ctaDone) < uint64_t{grid} * executed) {
            }
            stReleaseGpu(&st->exitAll, 1);
          }
          stRelaxedSys(&q->consumed, next + 1);
          stRelaxedSys(&q->finished, next + 1);
          // release: consumed and finished before the state; the host launches the next kernel after this one in
          // stream order anyway, so nothing waits for it.
          stReleaseSys(&q->phase, phaseWord(pp.generation, KernelState::kExited));
          cmd = 1;
        } else if (solo && sItem.needsGrid != 0) {
          cmd = 1;  // the host launched a full grid behind this kernel: leave it the item
        } else {
          if (!solo) {
            // Item barrier: every CTA finished the previous item (and its reads of st->item) before this one.
            while (ldAcquireGpu(&st->ctaDone) < uint64_t{grid} * executed) {
            }
          }
          stRelaxedSys(&q->consumed, next + 1);
          ++next;
        }
        sCmd = cmd;
        sSolo = solo ? 1 : 0;
      }
      __syncthreads();
      if (sCmd != 0) return;
      if (sSolo == 0) {
        if (tid < kItemWords) st->item[tid] = sWords[tid];  // the other CTAs' copy, in device memory
        __syncthreads();
        // release (cumulative over the CTA's writes above, ordered by the barrier): item `sItemIndex` may run.
        if (tid == 0) stReleaseGpu(&st->goIndex, sItemIndex + 1);
      }
    } else {
      if (tid == 0) {
        int cmd = 1;
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
        sCmd = cmd;
        sSolo = 0;
      }
      __syncthreads();
      if (sCmd != 0) return;
      if (tid < kItemWords) sWords[tid] = __ldcg(&st->item[tid]);  // L2: this SM's L1 may hold the last item's words
      __syncthreads();
    }
    const bool soloNow = sSolo != 0;  // uniform across the CTA (thread 0's `solo` is the only one kept current)
    const uint32_t ncta = soloNow ? 1 : grid;
    if (sItem.kind == WorkKind::kAllGather) allgatherShare(sItem.ag, cta, ncta);
    __syncthreads();  // this CTA's writes precede thread 0's completion count
    if (tid == 0) {
      bool last = true;
      if (!soloNow) {
        // acq_rel: publishes this CTA's writes and acquires the earlier finishers'.
        last = fetchAddAcqRelGpu(&st->ctaDone, 1) + 1 == uint64_t{grid} * (executed + 1);
      }
      if (last) {
        fenceAcqRelSys();  // every CTA's recv writes are visible system-wide before done
        // After an abort the daemon owns done (it wrote a lead past every epoch). An older value written here would
        // only hold back waits the lead had released, and the daemon writes the lead again when it sees one (its poll
        // of an aborted communicator), so no read of the host-mapped abort word (a PCIe round trip) precedes it.
        stReleaseSysU32(sItem.doneWord, static_cast<uint32_t>(sItem.epoch));  // pairs with the stream's WaitValue
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

}  // namespace

void preloadPersistentKernels(int device) {
  const void* fns[] = {reinterpret_cast<const void*>(&persistentKernel)};
  preloadOn(device, fns, "persistent kernel");
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

}  // namespace tandem::kernels
