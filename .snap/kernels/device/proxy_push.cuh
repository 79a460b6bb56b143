// The device-side producer of the proxy FIFO: kernels push 32-byte transfer commands (buffer ids and offsets, never
// addresses) that the daemon's proxy thread validates and posts through the transport (daemon/src/transport/
// proxy_fifo.hpp has the FIFO, the consumer and the protocol; tandem/common/proxy_fifo_layout.hpp the layout and the
// encode helpers, which host producers use too).
//
// Who calls it: ONE thread per warp (lane 0 by convention; proxyPushWritesThenFlagWarp does that for a whole warp),
// with its own ProxyPusher in registers. Any number of warps and CTAs (and host threads, where the ticket counter
// allows it: below) may push into one FIFO at once; each pusher's commands reach the proxy in the order it pushed
// them. The FIFO lives in host memory registered as mapped (daemon/src/cuda/proxy_fifo_mapping.hpp gives the
// ProxyFifoDeviceRef); every access here goes over PCIe, so a push costs a few of its round trips (bench/
// proxy_push_bench.cu measures it).
//
// Protocol, as proxy_fifo.hpp specifies it for every producer, and the pairs this side takes part in:
//   t = fetchAddRelaxedSys(head, n)          claims tickets t..t+n-1 (relaxed: the counter orders nothing)
//   while slot of t+n-1 is still in use        only then: tail = ldAcquireSys(control->tail)         (P2, acquire)
//       (stop word and %globaltimer deadline checked each time round)
//   plain stores of words 1..3 of each slot
//   stReleaseSys(slot.control, seq|op|flags|peer)   publishes a slot; pairs with the proxy's acquire load  (P1)
//   (a batch: fenceAcqRelSys once, then stRelaxedSys of each control: a release pattern per slot, one fence)
//   ldAcquireSys(control->completed / errors)       pairs with the proxy's release stores of the watermarks  (P3)
// The release (or the batch's one fence) also publishes, at system scope, what the calling thread wrote before it and
// what it observed others write (cumulativity): so the data a kWrite reads must be written, and made visible to the
// pushing thread by a barrier of its writers (__syncthreads or a named barrier), BEFORE the push. The proxy reads it
// after its acquire of the slot (a device-to-host copy, or the NIC). One fence per destination batch, not per tile:
// proxyPushWritesThenFlag claims the writes and their flag together and fences once.
//
// Errors (ProxyPushStatus; no trap, no assert: the caller unwinds and surfaces the code, e.g. into its ErrorSlot):
//   kStopped  the FIFO's stop word was set while waiting for room: the daemon is tearing the FIFO down.
//   kTimeout  no room within the pusher's timeout: the proxy is stuck or gone.
//   kTooLarge a batch of more commands than the FIFO has slots; nothing was claimed.
// After a push returned kStopped or kTimeout its claimed tickets stay unpublished and the proxy stops at the first of
// them, so the FIFO is dead: the communicator must be aborted and the FIFO formatted afresh (proxyWaitCompleted's
// kTimeout claims nothing: only that wait gave up). A command the proxy rejects (unknown
// buffer id, out of bounds, bad opcode or flags, peer out of range) is no push error: it is skipped, nothing is
// written, and the FIFO's errors word (proxyErrors) goes up by one; later commands still go through.
//
// The ticket counter: with ProxyFifoDeviceRef::head in the region, every claim is a system-scope atomic on host memory
// across PCIe, and host producers (ProxyFifoProducer) may share the FIFO only where host and GPU atomics on one word
// are atomic with each other (cudaDevAttrHostNativeAtomicSupported: NVLink-C2C hosts, not PCIe ones). A FIFO that
// only one GPU's kernels push into keeps its head in that GPU's memory instead (GpuMappedProxyFifo::useDeviceHead):
// claims are then GPU-local atomics, and the consumer, which never reads head, is unchanged.
//
// Lazy loading: load every kernel that pushes or waits here before the first one runs (tandem/kernels/preload.hpp).
// A first launch under CUDA's lazy module loading may wait for the context to go idle, and it holds up other CUDA calls
// meanwhile, the proxy's DeviceCopier copies among them: a kernel waiting for the proxy (for room, a completion, or a
// flag the proxy's transfers deliver) while another kernel is launched for the first time then sits out its timeout
// (seen on the H200: 10 s, every kernel stalled, until the waiting one gave up).
//
// Watermarks: proxyCompleted(fifo) > t once ticket t was consumed (unsignalled) or, for a kProxyFlagSignal command,
// its transfer completed locally (the source may be reused); proxyWaitCompleted waits for that.
#pragma once

#include <cstdint>

#include "device/ordering.cuh"
#include "tandem/common/proxy_fifo_layout.hpp"

namespace tandem::kernels {

using ::tandem::proxy::ProxyCommand;
using ::tandem::proxy::ProxyFifoDeviceRef;
using ::tandem::proxy::ProxyOpcode;

enum class ProxyPushStatus : uint32_t {
  kOk = 0,
  kStopped = 1,   ///< stop word set while waiting; the FIFO is being torn down
  kTimeout = 2,   ///< no room (or no completion) within the timeout; the proxy is stuck or gone
  kTooLarge = 3,  ///< more commands in one batch than the FIFO has slots; nothing claimed
};

/// One pushing thread's state: kept in registers, one per pushing warp. Not shared between threads.
struct ProxyPusher {
  ProxyFifoDeviceRef fifo;
  uint64_t tailCache;  ///< this pusher's stale copy of the consumer's tail (re-read only when the ring looks full)
  uint64_t timeoutNs;  ///< longest wait for room or a completion, in %globaltimer ns; 0: wait until stopped only
  uint32_t fullWaits;  ///< how often a push found the ring full (re-read tail)
};

/// A pusher for `fifo`; each of its waits gives up after timeoutNs (0: only the stop word ends a wait; avoid).
__device__ __forceinline__ ProxyPusher makeProxyPusher(const ProxyFifoDeviceRef& fifo, uint64_t timeoutNs) {
  return ProxyPusher{fifo, 0, timeoutNs, 0};
}

/// The watermarks (P3): acquire loads of the words the proxy publishes with release stores.
__device__ __forceinline__ uint64_t proxyCompleted(const ProxyFifoDeviceRef& fifo) {
  return ldAcquireSys(&fifo.control->completed);  // acquire: pairs with Proxy::publishWatermarks' release (P3)
}
__device__ __forceinline__ uint64_t proxyErrors(const ProxyFifoDeviceRef& fifo) {
  return ldAcquireSys(&fifo.control->errors);  // acquire: pairs with Proxy::publishWatermarks' release (P3)
}
__device__ __forceinline__ bool proxyStopRequested(const ProxyFifoDeviceRef& fifo) {
  return ldAcquireSysU32(&fifo.control->stop) != 0;  // acquire: pairs with ProxyFifoView::requestStop's release
}

namespace detail {

// Waits until the slot of held ticket `last` is free: the consumer's tail has passed its previous lap. Every slot of
// an earlier held ticket is then free too (tail only grows).
__device__ __forceinline__ ProxyPushStatus proxyWaitForRoom(ProxyPusher& p, uint64_t last) {
  if (!::tandem::proxy::fifo::looksFull(last, p.tailCache, p.fifo.capacity)) return ProxyPushStatus::kOk;
  const uint64_t start = globaltimerNs();
  // No backoff between re-reads: one of 64 ns doubling to 2 us was measured on the H200 (proxy_push_bench) and cut draining
  // with 8 and 32 CTAs x 4 warps from 24-27 to 20 M commands/s, without helping 132 CTAs (7 M/s either way;
  // likely cause: claimed tickets still waiting to be published, at which the consumer stalls).
  for (;;) {
    // acquire: pairs with the release store of tail in ProxyFifoConsumer::publishTail (P2): every slot below tail has
    // been copied out, so it may be overwritten.
    p.tailCache = ldAcquireSys(&p.fifo.control->tail);
    if (!::tandem::proxy::fifo::looksFull(last, p.tailCache, p.fifo.capacity)) return ProxyPushStatus::kOk;
    ++p.fullWaits;
    if (proxyStopRequested(p.fifo)) return ProxyPushStatus::kStopped;
    if (p.timeoutNs != 0 && globaltimerNs() - start > p.timeoutNs) return ProxyPushStatus::kTimeout;
  }
}

// Words 1..3 of a held slot: plain stores, published by the control store that follows (P1). No reader looks at them
// before it sees this ticket's seq, and no other producer holds the slot until the consumer has passed it (P2).
__device__ __forceinline__ void proxyWriteBody(ProxyCommand* slot, const ProxyCommand& c) {
  slot->srcBuffer = c.srcBuffer;
  slot->dstBuffer = c.dstBuffer;
  slot->a = c.a;
  slot->b = c.b;
}

__device__ __forceinline__ uint64_t proxyControlFor(uint64_t ticket, uint64_t control) {
  namespace f = ::tandem::proxy::fifo;
  return f::packControl(f::seqOf(ticket), f::opcodeField(control), f::flagsField(control), f::peerField(control));
}

__device__ __forceinline__ ProxyCommand* proxySlot(const ProxyPusher& p, uint64_t ticket) {
  return &p.fifo.slots[::tandem::proxy::fifo::slotOf(ticket, p.fifo.capacity)];
}

}  // namespace detail

/// Pushes one command (seq filled in here; build it with fifo::makeWrite / makeFlag). On kOk, *ticket (if given)
/// holds its ticket. One thread only; see the file comment for the ordering it gives and the errors.
__device__ __forceinline__ ProxyPushStatus proxyPush(ProxyPusher& p, const ProxyCommand& c,
                                                     uint64_t* ticket = nullptr) {
  // relaxed: the counter only hands out unique tickets; the slot's release store below publishes the command (P1).
  const uint64_t t = fetchAddRelaxedSys(p.fifo.head, 1);
  const ProxyPushStatus s = detail::proxyWaitForRoom(p, t);
  if (s != ProxyPushStatus::kOk) return s;
  ProxyCommand* slot = detail::proxySlot(p, t);
  detail::proxyWriteBody(slot, c);
  // release: publishes words 1..3 (and the data this thread wrote or observed before); pairs with the acquire load of
  // slot.control in ProxyFifoConsumer::pop (P1).
  stReleaseSys(&slot->control, detail::proxyControlFor(t, c.control));
  if (ticket != nullptr) *ticket = t;
  return ProxyPushStatus::kOk;
}

/// Pushes n commands (n <= capacity) with one fetch_add and one fence: consecutive tickets, first in *firstTicket.
/// The proxy sees them in order, and no other producer's command between them.
__device__ __forceinline__ ProxyPushStatus proxyPushBatch(ProxyPusher& p, const ProxyCommand* cmds, uint32_t n,
                                                          uint64_t* firstTicket = nullptr) {
  if (n == 0) return ProxyPushStatus::kOk;
  if (n > p.fifo.capacity) return ProxyPushStatus::kTooLarge;
  const uint64_t t = fetchAddRelaxedSys(p.fifo.head, n);  // relaxed: see proxyPush
  const ProxyPushStatus s = detail::proxyWaitForRoom(p, t + n - 1);
  if (s != ProxyPushStatus::kOk) return s;
  for (uint32_t i = 0; i < n; ++i) detail::proxyWriteBody(detail::proxySlot(p, t + i), cmds[i]);
  // release (one fence for the batch): with each relaxed store after it a release pattern that publishes words 1..3
  // of every slot of the batch and the data before it; pairs with the acquire load in ProxyFifoConsumer::pop (P1).
  fenceAcqRelSys();
  for (uint32_t i = 0; i < n; ++i) {
    stRelaxedSys(&detail::proxySlot(p, t + i)->control, detail::proxyControlFor(t + i, cmds[i].control));
  }
  if (firstTicket != nullptr) *firstTicket = t;
  return ProxyPushStatus::kOk;
}

/// One write of a destination batch (proxyPushWritesThenFlag).
struct ProxyWriteDesc {
  uint32_t srcBuffer;   ///< local buffer id
  uint32_t dstBuffer;   ///< the peer's buffer id
  uint64_t srcOffset;   ///< < 2^48
  uint64_t dstOffset;   ///< < 2^48
  uint32_t bytes;       ///< > 0
};

namespace detail {

// n writes to `peer`, then `flag` if it is non-null: one claim, one fence (the batch forms of the two below).
__device__ __forceinline__ ProxyPushStatus proxyPushWritesBatch(ProxyPusher& p, uint16_t peer,
                                                                const ProxyWriteDesc* writes, uint32_t n,
                                                                const ProxyCommand* flag, uint64_t* lastTicket) {
  namespace f = ::tandem::proxy::fifo;
  const uint32_t total = n + (flag != nullptr ? 1u : 0u);
  if (total == 0) return ProxyPushStatus::kOk;
  if (uint64_t{total} > p.fifo.capacity) return ProxyPushStatus::kTooLarge;
  const uint64_t t = fetchAddRelaxedSys(p.fifo.head, total);  // relaxed: see proxyPush
  const ProxyPushStatus s = proxyWaitForRoom(p, t + total - 1);
  if (s != ProxyPushStatus::kOk) return s;
  for (uint32_t i = 0; i < n; ++i) {
    const ProxyWriteDesc& w = writes[i];
    proxyWriteBody(proxySlot(p, t + i), f::makeWrite(peer, w.srcBuffer, w.srcOffset, w.dstBuffer, w.dstOffset, w.bytes));
  }
  if (flag != nullptr) proxyWriteBody(proxySlot(p, t + n), *flag);
  // release (one fence for the destination batch): see proxyPushBatch (P1).
  fenceAcqRelSys();
  const uint64_t writeControl = f::packControl(0, ProxyOpcode::kWrite, 0, peer);
  for (uint32_t i = 0; i < n; ++i) stRelaxedSys(&proxySlot(p, t + i)->control, proxyControlFor(t + i, writeControl));
  if (flag != nullptr) stRelaxedSys(&proxySlot(p, t + n)->control, proxyControlFor(t + n, flag->control));
  if (lastTicket != nullptr) *lastTicket = t + total - 1;
  return ProxyPushStatus::kOk;
}

}  // namespace detail

/// The destination batch: n writes to `peer`, then one flag store of flagValue at the peer's flagBuffer+flagOffset
/// (8-byte aligned), which the transport orders after the writes (a receiver that acquires the flag sees their bytes).
/// n+1 <= capacity. One claim, one fence. `signal` asks for a completion on the flag (proxyWaitCompleted on
/// *flagTicket then means every write of the batch completed locally: their source may be reused).
__device__ __forceinline__ ProxyPushStatus proxyPushWritesThenFlag(ProxyPusher& p, uint16_t peer,
                                                                   const ProxyWriteDesc* writes, uint32_t n,
                                                                   uint32_t flagBuffer, uint64_t flagOffset,
                                                                   uint64_t flagValue, bool signal,
                                                                   uint64_t* flagTicket = nullptr) {
  const ProxyCommand flag = ::tandem::proxy::fifo::makeFlag(peer, flagBuffer, flagOffset, flagValue,
                                                            signal ? ::tandem::proxy::kProxyFlagSignal : uint8_t{0});
  return detail::proxyPushWritesBatch(p, peer, writes, n, &flag, flagTicket);
}

/// Part of a destination batch sent ahead of the rest (its data is ready before the rest's): n writes to `peer`,
/// one claim, one fence, no flag; a later proxyPushWritesThenFlag to the same peer orders its flag after these too.
/// n <= capacity; n = 0 pushes nothing. *lastTicket: the last write's ticket.
__device__ __forceinline__ ProxyPushStatus proxyPushWrites(ProxyPusher& p, uint16_t peer, const ProxyWriteDesc* writes,
                                                           uint32_t n, uint64_t* lastTicket = nullptr) {
  return detail::proxyPushWritesBatch(p, peer, writes, n, nullptr, lastTicket);
}

/// Waits until proxyCompleted(fifo) > ticket (P3), checking the stop word and the pusher's timeout.
__device__ __forceinline__ ProxyPushStatus proxyWaitCompleted(ProxyPusher& p, uint64_t ticket) {
  const uint64_t start = globaltimerNs();
  for (uint32_t spins = 0;; ++spins) {
    if (proxyCompleted(p.fifo) > ticket) return ProxyPushStatus::kOk;
    if (spins % 8 == 7) {  // each load is a PCIe round trip: the checks need not run on every one
      if (proxyStopRequested(p.fifo)) return ProxyPushStatus::kStopped;
      if (p.timeoutNs != 0 && globaltimerNs() - start > p.timeoutNs) return ProxyPushStatus::kTimeout;
    }
  }
}

/// Warp-collective form of proxyPushWritesThenFlag: every lane of a converged warp calls it with the same arguments;
/// lane 0 pushes (with its own pusher) and every lane gets the status and the flag's ticket.
__device__ __forceinline__ ProxyPushStatus proxyPushWritesThenFlagWarp(ProxyPusher& p, uint16_t peer,
                                                                       const ProxyWriteDesc* writes, uint32_t n,
                                                                       uint32_t flagBuffer, uint64_t flagOffset,
                                                                       uint64_t flagValue, bool signal,
                                                                       uint64_t* flagTicket = nullptr) {
  uint32_t status = 0;
  uint64_t ticket = 0;
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  if (lane == 0) {
    status = static_cast<uint32_t>(
        proxyPushWritesThenFlag(p, peer, writes, n, flagBuffer, flagOffset, flagValue, signal, &ticket));
  }
  status = __shfl_sync(0xffffffffu, status, 0);
  ticket = __shfl_sync(0xffffffffu, ticket, 0);
  if (flagTicket != nullptr) *flagTicket = ticket;
  return static_cast<ProxyPushStatus>(status);
}

}  // namespace tandem::kernels
