// Kernels of the proxy FIFO GPU test; see proxy_gpu_kernels.hpp.
#include "proxy_gpu_kernels.hpp"

#include "device/ordering.cuh"
#include "device/proxy_push.cuh"

namespace tandem::test {

using namespace tandem::kernels;
namespace f = ::tandem::proxy::fifo;

namespace {

constexpr uint32_t kMaxWritesPerWarp = 8;
static_assert(kPushOk == static_cast<uint32_t>(ProxyPushStatus::kOk) + 1 &&
              kPushStopped == static_cast<uint32_t>(ProxyPushStatus::kStopped) + 1 &&
              kPushTimeout == static_cast<uint32_t>(ProxyPushStatus::kTimeout) + 1 &&
              kPushTooLarge == static_cast<uint32_t>(ProxyPushStatus::kTooLarge) + 1);

__global__ void producerKernel(const __grid_constant__ ProducerParams p) {
  const uint32_t warpsPerCta = blockDim.x / 32;
  const uint32_t warp = blockIdx.x * warpsPerCta + threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t totalWarps = gridDim.x * warpsPerCta;
  const uint64_t first = uint64_t{warp} * p.wordsPerWarp;
  for (uint64_t i = lane; i < p.wordsPerWarp; i += 32) p.src[first + i] = patternWord(first + i, p.round);
  // The tile's writers reach a barrier before the push: the push's release then publishes their data (see
  // proxy_push.cuh), which the proxy reads with a device-to-host copy.
  __syncthreads();
  ProxyPusher pusher = makeProxyPusher(p.fifo, p.timeoutNs);
  const uint64_t bytesPerWarp = p.wordsPerWarp * 4;
  const uint64_t piece = bytesPerWarp / p.writesPerWarp;
  ProxyWriteDesc writes[kMaxWritesPerWarp];
  for (uint32_t k = 0; k < p.writesPerWarp; ++k) {
    const uint64_t off = first * 4 + k * piece;
    writes[k] = ProxyWriteDesc{p.srcBuffer, p.dstBuffer, off, off, static_cast<uint32_t>(piece)};
  }
  // Three ways to push the same destination batch: the warp-collective helper (every lane calls), the same helper from
  // lane 0, and one proxyPush per command from lane 0.
  ProxyPushStatus s = ProxyPushStatus::kOk;
  if (warp % 4 == 0) {
    s = proxyPushWritesThenFlagWarp(pusher, p.peer, writes, p.writesPerWarp, p.flagBuffer, 8 * uint64_t{warp},
                                    p.round, false);
  }
  if (lane != 0) return;
  if (warp % 4 == 2) {
    s = proxyPushWritesThenFlag(pusher, p.peer, writes, p.writesPerWarp, p.flagBuffer, 8 * uint64_t{warp}, p.round,
                                false);
  } else if (warp % 2 == 1) {
    for (uint32_t k = 0; k < p.writesPerWarp && s == ProxyPushStatus::kOk; ++k) {
      const ProxyWriteDesc& w = writes[k];
      s = proxyPush(pusher, f::makeWrite(p.peer, w.srcBuffer, w.srcOffset, w.dstBuffer, w.dstOffset, w.bytes));
    }
    if (s == ProxyPushStatus::kOk)
      s = proxyPush(pusher, f::makeFlag(p.peer, p.flagBuffer, 8 * uint64_t{warp}, p.round));
  }
  p.status[warp] = static_cast<uint32_t>(s) + 1;
  // acq_rel at GPU scope: this warp's claims on head come before the increment, and the last warp's claim after its
  // increment, so the final flag's ticket follows every other warp's commands.
  const uint64_t before = fetchAddAcqRelGpu(p.arrivals, 1);
  if (before + 1 == totalWarps) {
    const ProxyPushStatus fs =
        proxyPush(pusher, f::makeFlag(p.peer, p.flagBuffer, 8 * uint64_t{totalWarps}, p.round));
    p.status[totalWarps] = static_cast<uint32_t>(fs) + 1;
  }
}

// Thread 0 waits for *flag >= value; returns false on timeout. The barrier after it hands the acquire to the CTA.
__device__ bool waitFlagCta(const uint64_t* flag, uint64_t value, uint64_t timeoutNs) {
  __shared__ uint32_t ok;
  if (threadIdx.x == 0) {
    ok = 0;
    const uint64_t start = globaltimerNs();
    for (;;) {
      // acquire: pairs with the receiving transport's flag store, made after the data copies completed (the
      // DeviceCopier's toDevice is synchronous), so every byte written before the flag is visible after it.
      if (ldAcquireSys(flag) >= value) {
        ok = 1;
        break;
      }
      if (globaltimerNs() - start > timeoutNs) break;
    }
  }
  __syncthreads();
  return ok != 0;
}

__global__ void checkerKernel(const __grid_constant__ CheckParams p) {
  const uint32_t w = blockIdx.x;
  const bool all = w == p.totalWarps;
  if (!waitFlagCta(p.flags + w, p.round, p.timeoutNs)) {
    if (threadIdx.x == 0) atomicAdd(p.timeouts, 1u);
    return;
  }
  const uint64_t first = all ? 0 : uint64_t{w} * p.wordsPerWarp;
  const uint64_t count = all ? uint64_t{p.totalWarps} * p.wordsPerWarp : p.wordsPerWarp;
  uint32_t bad = 0;
  for (uint64_t i = threadIdx.x; i < count; i += blockDim.x) bad += p.dst[first + i] != patternWord(first + i, p.round);
  if (bad != 0) atomicAdd(p.mismatches, bad);
}

__global__ void malformedKernel(const __grid_constant__ MalformedParams p) {
  ProxyPusher pusher = makeProxyPusher(p.fifo, p.timeoutNs);
  const uint64_t before = proxyErrors(p.fifo);
  p.out[0] = before;
  // Unknown destination id; a destination range past the end; an opcode the proxy does not know (with the fields of
  // a valid write, so that only the opcode is wrong).
  proxyPush(pusher, f::makeWrite(p.peer, p.srcBuffer, 0, p.unknownBuffer, 0, 256));
  proxyPush(pusher, f::makeWrite(p.peer, p.srcBuffer, 0, p.dstBuffer, p.dstBytes - 128, 256));
  ProxyCommand badOp = f::makeWrite(p.peer, p.srcBuffer, 0, p.dstBuffer, 0, 256);
  badOp.control = f::packControl(0, static_cast<ProxyOpcode>(7), 0, p.peer);
  proxyPush(pusher, badOp);
  const uint64_t start = globaltimerNs();
  uint64_t seen = before;
  while ((seen = proxyErrors(p.fifo)) < before + 3 && globaltimerNs() - start < p.timeoutNs) {
  }
  p.out[1] = seen;
  ProxyPushStatus s = proxyPush(pusher, f::makeWrite(p.peer, p.srcBuffer, 0, p.dstBuffer, p.goodOffset, p.goodBytes));
  uint64_t flagTicket = 0;
  if (s == ProxyPushStatus::kOk)
    s = proxyPush(pusher, f::makeFlag(p.peer, p.flagBuffer, 0, p.flagValue, ::tandem::proxy::kProxyFlagSignal),
                  &flagTicket);
  p.out[2] = static_cast<uint64_t>(s) + 1;
  p.out[3] = s == ProxyPushStatus::kOk ? static_cast<uint64_t>(proxyWaitCompleted(pusher, flagTicket)) + 1 : 0;
}

__global__ void blockedKernel(const __grid_constant__ BlockedParams p) {
  ProxyPusher pusher = makeProxyPusher(p.fifo, p.timeoutNs);
  for (uint32_t i = 0; i < p.fill; ++i) {
    const ProxyPushStatus s = proxyPush(pusher, f::makeNop());
    if (s != ProxyPushStatus::kOk) {
      stReleaseSysU32(p.status, static_cast<uint32_t>(s) + 1);
      return;
    }
  }
  // release: the host polls progress (acquire) before it sets the stop word.
  stReleaseSysU32(p.progress, p.fill);
  const uint64_t start = globaltimerNs();
  const ProxyPushStatus s = proxyPush(pusher, f::makeNop());
  stRelaxedSys(p.elapsedNs, globaltimerNs() - start);
  // release: publishes elapsedNs with the status the host acquires.
  stReleaseSysU32(p.status, static_cast<uint32_t>(s) + 1);
}

__global__ void tooLargeKernel(const ::tandem::proxy::ProxyFifoDeviceRef fifo, uint32_t* out) {
  ProxyPusher pusher = makeProxyPusher(fifo, 1'000'000'000ull);
  ProxyCommand cmds[17];
  ProxyWriteDesc writes[16];
  const uint32_t n = fifo.capacity <= 16 ? fifo.capacity : 16;
  for (uint32_t i = 0; i <= n; ++i) cmds[i] = f::makeNop();
  for (uint32_t i = 0; i < n; ++i) writes[i] = ProxyWriteDesc{1, 2, 0, 0, 8};
  out[0] = static_cast<uint32_t>(proxyPushBatch(pusher, cmds, n + 1)) + 1;
  out[1] = static_cast<uint32_t>(proxyPushWritesThenFlag(pusher, 1, writes, n, 3, 0, 1, false)) + 1;
}

__global__ void waitFlagKernel(const uint64_t* flag, uint64_t value, uint64_t timeoutNs, uint32_t* result) {
  const uint64_t start = globaltimerNs();
  for (;;) {
    if (ldAcquireSys(flag) >= value) {  // acquire: as in waitFlagCta
      *result = 1;
      return;
    }
    if (globaltimerNs() - start > timeoutNs) {
      *result = 2;
      return;
    }
  }
}

}  // namespace

cudaError_t preloadProxyTestKernels() {
  const void* fns[] = {reinterpret_cast<const void*>(&producerKernel), reinterpret_cast<const void*>(&checkerKernel),
                       reinterpret_cast<const void*>(&malformedKernel), reinterpret_cast<const void*>(&blockedKernel),
                       reinterpret_cast<const void*>(&tooLargeKernel), reinterpret_cast<const void*>(&waitFlagKernel)};
  for (const void* fn : fns) {
    cudaFuncAttributes fa{};
    if (const cudaError_t e = cudaFuncGetAttributes(&fa, fn); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launchProducer(const ProducerParams& p, int ctas, int warpsPerCta, cudaStream_t stream) {
  if (p.writesPerWarp == 0 || p.writesPerWarp > kMaxWritesPerWarp || p.wordsPerWarp % p.writesPerWarp != 0)
    return cudaErrorInvalidValue;
  producerKernel<<<ctas, warpsPerCta * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchChecker(const CheckParams& p, cudaStream_t stream) {
  checkerKernel<<<p.totalWarps + 1, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMalformed(const MalformedParams& p, cudaStream_t stream) {
  malformedKernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchBlocked(const BlockedParams& p, cudaStream_t stream) {
  blockedKernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchTooLarge(const ::tandem::proxy::ProxyFifoDeviceRef& fifo, uint32_t* out, cudaStream_t stream) {
  if (fifo.capacity > 16) return cudaErrorInvalidValue;
  tooLargeKernel<<<1, 1, 0, stream>>>(fifo, out);
  return cudaGetLastError();
}

cudaError_t launchWaitFlag(const uint64_t* flag, uint64_t value, uint64_t timeoutNs, uint32_t* result,
                           cudaStream_t stream) {
  waitFlagKernel<<<1, 1, 0, stream>>>(flag, value, timeoutNs, result);
  return cudaGetLastError();
}

}  // namespace tandem::test
