// The GPU-issued exchange's kernels: see tandem/kernels/span_exchange.hpp (and daemon/src/cuda/gpu_exchange_plan.hpp
// for the region and the protocol).
#include <cstddef>

#include "device/ordering.cuh"
#include "device/proxy_push.cuh"
#include "device/wait.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/span_exchange.hpp"

namespace tandem::kernels {

// The plan's writes are read in place as the push's write descriptors.
static_assert(sizeof(SpanPlanWrite) == sizeof(ProxyWriteDesc));
static_assert(offsetof(SpanPlanWrite, srcBuffer) == offsetof(ProxyWriteDesc, srcBuffer));
static_assert(offsetof(SpanPlanWrite, dstBuffer) == offsetof(ProxyWriteDesc, dstBuffer));
static_assert(offsetof(SpanPlanWrite, srcOffset) == offsetof(ProxyWriteDesc, srcOffset));
static_assert(offsetof(SpanPlanWrite, dstOffset) == offsetof(ProxyWriteDesc, dstOffset));
static_assert(offsetof(SpanPlanWrite, bytes) == offsetof(ProxyWriteDesc, bytes));

namespace {

// Whether an earlier kernel of this op failed. acquire: pairs with the release store in fail() (the kernels run in
// stream order, so an earlier kernel's store is already visible; the system-scope load reads host memory, not a cache).
__device__ __forceinline__ bool failedBefore(const SpanExchangePlan& p) { return ldAcquireSysU32(p.failed) != 0; }

// Records the first failure (one thread of one kernel at a time writes: the kernels run in stream order).
__device__ __forceinline__ void fail(const SpanExchangePlan& p, uint32_t why, uint32_t pushStatus = 0) {
  if (ldAcquireSysU32(p.failed) != 0) return;
  stReleaseSysU32(p.pushStatus, pushStatus);
  // release: the push status (and the error slot a wait filled) before the word the host and later kernels read.
  stReleaseSysU32(p.failed, why);
}

__device__ __forceinline__ WaitCtx waitCtx(const SpanExchangePlan& p, Role role) {
  return WaitCtx{p.abortWord, p.errorSlot, globaltimerNs() + p.timeoutNs, p.op, static_cast<uint32_t>(role), p.self};
}

// One thread: per peer, consumed >= prevEpoch: the peer has read its inbox of the previous op, so it has every byte
// we sent then. Runs before anything fills the send area: a transport may read a write's source after the post (verbs
// always, tcp from a host region), so the previous op's payload must have reached every peer first.
__global__ void spanFreeKernel(const SpanExchangePlan* plan) {
  if (threadIdx.x != 0) return;
  const SpanExchangePlan& p = *plan;
  if (failedBefore(p) || p.prevEpoch == 0) return;
  WaitCtx ctx = waitCtx(p, Role::kInterSend);
  for (uint32_t i = 0; i < p.peers; ++i) {
    // acquire (waitGeq): pairs with the peer's consumed flag, stored by its transport after it read its inbox.
    if (!waitGeq(p.consumed[i], p.prevEpoch, ctx, p.peerNode[i])) return fail(p, kSpanFailedWait);
  }
}

// One thread: per peer, its destination batch (writes, then the arrived flag; a pass ahead of the last: its writes
// only), after the free wait and the fill of those writes' data (stream order).
__global__ void spanPushKernel(const SpanExchangePlan* plan) {
  if (threadIdx.x != 0) return;
  const SpanExchangePlan& p = *plan;
  if (failedBefore(p)) return;
  ProxyPusher pusher = makeProxyPusher(p.fifo, p.timeoutNs);
  for (uint32_t i = 0; i < p.peers; ++i) {
    const auto peer = static_cast<uint16_t>(p.peerNode[i]);
    const auto* writes = reinterpret_cast<const ProxyWriteDesc*>(p.writes + p.firstWrite[i]);
    if (p.flag == 0 && p.writeCount[i] == 0) continue;  // nothing of this pass for that peer
    uint64_t last = 0;
    const ProxyPushStatus s =
        p.flag != 0 ? proxyPushWritesThenFlag(pusher, peer, writes, p.writeCount[i], p.bufferId, p.arrivedFlagOffset,
                                              p.epoch, false, &last)
                    : proxyPushWrites(pusher, peer, writes, p.writeCount[i], &last);
    if (s != ProxyPushStatus::kOk) return fail(p, kSpanFailedPush, static_cast<uint32_t>(s));
    // release: the host reads it after the stream is done; ordered with nothing else (the passes run in stream
    // order, so the last pass's ticket is the largest).
    stReleaseSys(p.lastTicket, last + 1);
  }
}

// One thread: per peer, arrived >= epoch (its payload is in our inbox: the transport stored the flag after the data).
__global__ void spanWaitKernel(const SpanExchangePlan* plan) {
  if (threadIdx.x != 0) return;
  const SpanExchangePlan& p = *plan;
  if (failedBefore(p)) return;
  WaitCtx ctx = waitCtx(p, Role::kInterReduce);
  for (uint32_t i = 0; i < p.peers; ++i) {
    // acquire (waitGeq): pairs with the flag the receiving transport stored after the payload's bytes.
    if (!waitGeq(p.arrived[i], p.epoch, ctx, p.peerNode[i])) return fail(p, kSpanFailedWait);
  }
}

// One thread: consumed[self] = epoch to every peer, after the work that read the inboxes (stream order).
__global__ void spanConsumedKernel(const SpanExchangePlan* plan) {
  if (threadIdx.x != 0) return;
  const SpanExchangePlan& p = *plan;
  if (failedBefore(p)) return;
  ProxyPusher pusher = makeProxyPusher(p.fifo, p.timeoutNs);
  for (uint32_t i = 0; i < p.peers; ++i) {
    const ProxyCommand c =
        ::tandem::proxy::fifo::makeFlag(static_cast<uint16_t>(p.peerNode[i]), p.bufferId, p.consumedFlagOffset, p.epoch, 0);
    uint64_t ticket = 0;
    const ProxyPushStatus s = proxyPush(pusher, c, &ticket);
    if (s != ProxyPushStatus::kOk) return fail(p, kSpanFailedPush, static_cast<uint32_t>(s));
    stReleaseSys(p.lastTicket, ticket + 1);  // release: as in the push kernel
  }
}

}  // namespace

cudaError_t launchSpanFree(const SpanExchangePlan* plan, cudaStream_t stream) {
  spanFreeKernel<<<1, 32, 0, stream>>>(plan);
  return cudaGetLastError();
}
cudaError_t launchSpanPush(const SpanExchangePlan* plan, cudaStream_t stream) {
  spanPushKernel<<<1, 32, 0, stream>>>(plan);
  return cudaGetLastError();
}
cudaError_t launchSpanWait(const SpanExchangePlan* plan, cudaStream_t stream) {
  spanWaitKernel<<<1, 32, 0, stream>>>(plan);
  return cudaGetLastError();
}
cudaError_t launchSpanConsumed(const SpanExchangePlan* plan, cudaStream_t stream) {
  spanConsumedKernel<<<1, 32, 0, stream>>>(plan);
  return cudaGetLastError();
}

void preloadSpanExchangeKernels(int device) {
  using Fn = void (*)(const SpanExchangePlan*);
  static constexpr Fn kFns[] = {spanFreeKernel, spanPushKernel, spanWaitKernel, spanConsumedKernel};
  preloadOn(device, kFns, "span exchange");
}

}  // namespace tandem::kernels
