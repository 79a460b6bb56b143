// The one way kernels wait: spin on a monotonic flag with an abort word and a globaltimer deadline.
// On failure the first thread to fail fills the host-mapped ErrorSlot and every waiter returns false,
// so kernels unwind instead of trapping.
#pragma once

#include "ordering.cuh"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

inline constexpr uint32_t kSpinsPerAbortCheck = 64;

struct WaitCtx {
  const uint64_t* abortWord;  // host-mapped or device; kAbortValue or any non-zero value aborts
  ErrorSlot* errorSlot;       // host-mapped
  uint64_t deadlineNs;        // absolute %globaltimer value; 0 = no deadline
  uint32_t op, role, rank;
};

// Claims the slot with kErrorSlotWriting, fills it, then publishes kErrorSlotReady: a host that polls a host-mapped slot
// reads the fields only once they are all written.
__device__ __forceinline__ void reportWaitError(WaitCtx& ctx, WaitError code, uint32_t chunk, uint64_t expected,
                                                uint64_t observed) {
  if (ctx.errorSlot == nullptr) return;
  if (atomicCAS(&ctx.errorSlot->claimed, 0u, kErrorSlotWriting) == 0u) {
    ctx.errorSlot->code = static_cast<uint32_t>(code);
    ctx.errorSlot->op = ctx.op;
    ctx.errorSlot->role = ctx.role;
    ctx.errorSlot->rank = ctx.rank;
    ctx.errorSlot->chunk = chunk;
    ctx.errorSlot->expected = expected;
    ctx.errorSlot->observed = observed;
    // release: publishes the fields; pairs with the host poller's acquire load of `claimed` (== kErrorSlotReady).
    stReleaseSysU32(&ctx.errorSlot->claimed, kErrorSlotReady);
  }
}

// The flag epoch of the op a kernel runs: its params' epoch, or in device-epoch mode (tandem/kernels/op_entry.hpp) the
// one the op's entry wrote into this rank's workspace before the kernel (stream order; L2, not L1). A graph replays
// the params as captured, so only the word changes from one replay to the next.
template <class KernelParams>
__device__ __forceinline__ uint64_t opEpoch(const KernelParams& kp) {
  return kp.epochWord != nullptr ? __ldcg(kp.epochWord) : kp.epoch;
}

// Waits until *flag >= expected (acquire, system scope: pairs with stReleaseSys/redAddReleaseSys by the
// producer, local or on a peer GPU). Returns false on abort or deadline, after reporting.
__device__ __forceinline__ bool waitGeq(const uint64_t* flag, uint64_t expected, WaitCtx& ctx, uint32_t chunk = 0) {
  uint32_t spins = 0;
  for (;;) {
    const uint64_t seen = ldAcquireSys(flag);
    if (seen >= expected) return seen != kAbortValue || expected == kAbortValue;
    if (++spins % kSpinsPerAbortCheck == 0) {
      if (ctx.abortWord != nullptr && ldRelaxedSys(ctx.abortWord) != 0) {
        reportWaitError(ctx, WaitError::kAborted, chunk, expected, seen);
        return false;
      }
      if (ctx.deadlineNs != 0 && globaltimerNs() > ctx.deadlineNs) {
        reportWaitError(ctx, WaitError::kTimeout, chunk, expected, seen);
        return false;
      }
    }
  }
}

}  // namespace tandem::kernels
