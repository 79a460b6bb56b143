// Kernels of the proxy FIFO GPU test (proxy_gpu_kernels.cu), behind plain launchers so that the test itself is host
// C++ (doctest, the tcp transport). Every wait in them has a %globaltimer deadline: no kernel can hang the test.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/common/proxy_fifo_layout.hpp"

namespace tandem::test {

/// Status words the kernels store: ProxyPushStatus (kernels/device/proxy_push.cuh) + 1, so that 0 means "not
/// written". The .cu checks these against the enum.
inline constexpr uint32_t kPushOk = 1, kPushStopped = 2, kPushTimeout = 3, kPushTooLarge = 4;

/// The word every producer warp writes at word index i of the source buffer in round `round`.
TANDEM_PROXY_HD constexpr uint32_t patternWord(uint64_t i, uint32_t round) {
  return static_cast<uint32_t>(i * 2654435761u) ^ (round * 0x9e3779b9u) ^ 0x5bd1e995u;
}

/// Loads every kernel below on the current device now. Under CUDA's lazy loading a kernel's first launch may wait
/// for the context to go idle, and this test's kernels wait on each other and on the proxy (whose DeviceCopier calls
/// then wait too): see tandem/kernels/preload.hpp. Call it before the first launch of each test case.
cudaError_t preloadProxyTestKernels();

/// Producer (node 0's GPU): warp w of the grid fills words [w*wordsPerWarp, (w+1)*wordsPerWarp) of `src` with the
/// round's pattern, then its lane 0 pushes writesPerWarp kWrite commands for that range to the peer's dstBuffer and
/// one kFlag (value `round`) at flagBuffer offset 8*w: warps 0 mod 4 with proxyPushWritesThenFlagWarp, 2 mod 4 with
/// proxyPushWritesThenFlag (one claim, one fence), odd warps one proxyPush per command. The last warp to finish (a
/// GPU counter) then pushes the final flag at offset 8*totalWarps, after every other warp's commands. status[w] (and
/// status[totalWarps] for the final flag) get ProxyPushStatus + 1.
struct ProducerParams {
  ::tandem::proxy::ProxyFifoDeviceRef fifo;
  uint32_t* src;             ///< device, totalWarps * wordsPerWarp words
  uint64_t wordsPerWarp;
  uint32_t writesPerWarp;    ///< 1..8; wordsPerWarp divisible by it
  uint32_t round;            ///< >= 1: the flag value and pattern seed
  uint16_t peer;
  uint32_t srcBuffer, dstBuffer, flagBuffer;
  uint64_t timeoutNs;
  uint64_t* arrivals;        ///< device counter, zeroed before the launch
  uint32_t* status;          ///< device, totalWarps + 1 words
};
cudaError_t launchProducer(const ProducerParams& p, int ctas, int warpsPerCta, cudaStream_t stream);

/// Receiver (node 1's GPU): CTA w < totalWarps waits (thread 0, ld.acquire.sys with a deadline) until flags[w] >=
/// round, then checks producer warp w's words of `dst`; CTA totalWarps waits for the final flag flags[totalWarps] and
/// then checks every word. Adds the words that differ to *mismatches and the timed-out waits to *timeouts.
struct CheckParams {
  const uint64_t* flags;     ///< device, totalWarps + 1 words
  const uint32_t* dst;       ///< device
  uint64_t wordsPerWarp;
  uint32_t totalWarps;
  uint32_t round;
  uint64_t timeoutNs;
  uint32_t* mismatches;      ///< device counters
  uint32_t* timeouts;
};
cudaError_t launchChecker(const CheckParams& p, cudaStream_t stream);

/// One thread pushes three malformed commands (unknown destination id, out-of-bounds destination, opcode 7), waits
/// until the FIFO's errors word has gone up by three, then pushes a good write of `goodBytes` bytes from offset 0 of
/// srcBuffer to goodOffset of dstBuffer and a signalled flag (value flagValue at offset 0 of flagBuffer) and waits for
/// its completion. out[0]: errors seen before, out[1]: errors seen after the bad ones, out[2]: status of the good
/// pushes + 1, out[3]: status of the completion wait + 1.
struct MalformedParams {
  ::tandem::proxy::ProxyFifoDeviceRef fifo;
  uint16_t peer;
  uint32_t srcBuffer, dstBuffer, flagBuffer, unknownBuffer;
  uint64_t dstBytes;
  uint64_t goodOffset;
  uint32_t goodBytes;
  uint64_t flagValue;
  uint64_t timeoutNs;
  uint64_t* out;             ///< device, 4 words
};
cudaError_t launchMalformed(const MalformedParams& p, cudaStream_t stream);

/// One thread pushes `fill` nops into a FIFO nobody drains, stores fill into *progress (host-mapped, release), then
/// pushes once more; *status (host-mapped) gets that push's ProxyPushStatus + 1 and *elapsedNs how long it waited.
struct BlockedParams {
  ::tandem::proxy::ProxyFifoDeviceRef fifo;
  uint32_t fill;
  uint64_t timeoutNs;
  uint32_t* progress;        ///< host-mapped
  uint32_t* status;          ///< host-mapped
  uint64_t* elapsedNs;       ///< host-mapped
};
cudaError_t launchBlocked(const BlockedParams& p, cudaStream_t stream);

/// One thread tries a proxyPushBatch of capacity+1 nops and a proxyPushWritesThenFlag of capacity writes (capacity <=
/// 16); out[0] and out[1] get their ProxyPushStatus + 1. Neither may claim a ticket.
cudaError_t launchTooLarge(const ::tandem::proxy::ProxyFifoDeviceRef& fifo, uint32_t* out, cudaStream_t stream);

/// Waits (one thread) until *flag >= value or timeoutNs passes; *result = 1 if it saw it, 2 on timeout.
cudaError_t launchWaitFlag(const uint64_t* flag, uint64_t value, uint64_t timeoutNs, uint32_t* result,
                           cudaStream_t stream);

}  // namespace tandem::test
