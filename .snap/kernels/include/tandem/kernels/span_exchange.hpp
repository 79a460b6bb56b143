// The GPU-issued exchange between nodes (tandemd's cuda_multinode.cpp; the region layout and the protocol are in
// daemon/src/cuda/gpu_exchange_plan.hpp): four one-warp kernels on the streams of the communicator's GPU.
//   free      per peer: consumed[p] >= prevEpoch (the peer read the previous op's payload), on the stream that fills
//             the send area, before the fill: a transport may read a write's source after the post;
//   push      per peer ascending: the peer's writes and its flag arrived[self] = epoch as one destination batch
//             (proxyPushWritesThenFlag: one claim, one fence); or, for a pass ahead of the last (plan.flag 0), the
//             writes of that pass alone (proxyPushWrites), as soon as their rows are in the send area;
//   wait      per peer: arrived[p] >= epoch;
//   consumed  consumed[self] = epoch to every peer (flag commands only, one batch).
// tandemd's HostStaging runs the push kernel with stream waits in place of free and wait by default, and those two
// kernels only with TANDEM_SPAN_WAIT=kernel (cuda_multinode.hpp); the wait kernel is the building block for an exchange inside a
// fused kernel, where no stream wait can stand in.
// Every command names the region's buffer id and offsets, never an address; the proxy validates them against its table.
//
// The plan they read lives in host memory mapped for the GPU (one per communicator; the host fills it before the
// launches of an op and does not touch it again until they are done). Waits poll the communicator's abort word and a
// %globaltimer deadline and report {op, role, rank = node, expected, observed} through the ErrorSlot (wait.cuh); no
// trap. The first failure also sets `failed`, and every later kernel of the plan returns at once, so an op whose
// exchange failed never pushes more. A push never watches the abort word: only the FIFO's stop word and its timeout
// end a wait for room (a half-claimed batch would leave the FIFO, shared by every communicator on the GPU, dead).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/common/proxy_fifo_layout.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

inline constexpr uint32_t kSpanPlanMaxPeers = 64;
inline constexpr uint32_t kSpanPlanMaxWrites = 512;
// An op's push may come in passes (one plan each), each launched once the data of its writes is in the send area:
// the writes of every pass but the last go out without the flag, the last pass's end with it.
inline constexpr uint32_t kSpanMaxPasses = 4;

// `failed` values: 0, or why the exchange stopped.
inline constexpr uint32_t kSpanFailedWait = 1;      // a wait ended by the abort word or the deadline (see errorSlot)
inline constexpr uint32_t kSpanFailedPush = 2;      // a push returned pushStatus (ProxyPushStatus)

// The layout of proxy_push.cuh's ProxyWriteDesc (static_asserts in span_exchange.cu), so the push reads it in place.
struct SpanPlanWrite {
  uint32_t srcBuffer;  // the region's id (bufferId)
  uint32_t dstBuffer;  // the same id: the proxy's table maps it to each peer's region
  uint64_t srcOffset;  // in this node's region
  uint64_t dstOffset;  // in the peer's region
  uint32_t bytes;      // > 0
};

// Host-written, GPU-read (mapped pinned memory). Plain data: zero it and fill it.
struct SpanExchangePlan {
  ::tandem::proxy::ProxyFifoDeviceRef fifo;
  const uint64_t* abortWord;  // device view of the communicator's abort word (host mapped); non-zero aborts
  ErrorSlot* errorSlot;       // device view (host mapped)
  uint32_t* failed;           // device view (host mapped): kSpanFailed*, written once by the first failure
  uint32_t* pushStatus;       // device view: the ProxyPushStatus of a failed push
  uint64_t* lastTicket;       // device view: one past the last ticket this op's kernels pushed (0: none)
  const uint64_t* arrived[kSpanPlanMaxPeers];   // device pointers into this node's region: arrived[peer]
  const uint64_t* consumed[kSpanPlanMaxPeers];  // device pointers into this node's region: consumed[peer]
  uint64_t timeoutNs;         // each kernel's waits give up this long after it started
  uint64_t epoch, prevEpoch;  // prevEpoch 0: no earlier GPU-exchange op, nothing to wait for
  uint64_t arrivedFlagOffset;   // arrived[self] in a peer's region
  uint64_t consumedFlagOffset;  // consumed[self] in a peer's region
  uint32_t bufferId;          // the region's id in the proxy's table, as source and destination
  uint32_t op;                // OpKind, for the error slot
  uint32_t self;              // this node's index (the error slot's rank)
  uint32_t peers;
  uint32_t flag;              // push: non-zero ends each peer's writes with its arrived flag (the last pass)
  uint32_t peerNode[kSpanPlanMaxPeers];
  uint32_t firstWrite[kSpanPlanMaxPeers], writeCount[kSpanPlanMaxPeers];
  SpanPlanWrite writes[kSpanPlanMaxWrites];
};

// Each launches one warp on `stream` with the plan's device view; returns the launch's error.
cudaError_t launchSpanFree(const SpanExchangePlan* plan, cudaStream_t stream);
cudaError_t launchSpanPush(const SpanExchangePlan* plan, cudaStream_t stream);
cudaError_t launchSpanWait(const SpanExchangePlan* plan, cudaStream_t stream);
cudaError_t launchSpanConsumed(const SpanExchangePlan* plan, cudaStream_t stream);

// Loads the four kernels on `device` now (tandem/kernels/preload.hpp says why). Throws std::runtime_error.
void preloadSpanExchangeKernels(int device);

}  // namespace tandem::kernels
