// Ring attention's finish kernel: the end-of-op handshake that keeps every rank's workspace KV alive until all its
// readers are done (ring_attention.hpp says where it sits in the op).
#include <cuda_runtime.h>

#include <string>

#include "device/ordering.cuh"
#include "preload_on.hpp"
#include "device/wait.cuh"
#include "tandem/kernels/ring_attention.hpp"

namespace tandem::kernels {
namespace ring_detail {
[[noreturn]] void failCuda(const std::string& what);
}

namespace {

// One warp; thread q speaks with peer q.
__global__ void __launch_bounds__(32) ringFinishKernel(const __grid_constant__ RingFinishParams p) {
  const uint32_t q = threadIdx.x;
  if (q >= p.nranks || q == p.rank) return;
  // Device-epoch mode: the op entry's epoch, written earlier in this stream (L2, not L1).
  const uint64_t value = p.epochWord != nullptr ? __ldcg(p.epochWord) : p.value;
  // release: this rank's reads of q's KV (the attention kernel before this one, complete in stream order) happen
  // before q may reuse its workspace; pairs with q's waitGeq on its done[rank] below. The fence makes it cumulative
  // over the stream's earlier writes too: ring attention's backward runs this kernel after copying its inputs into its
  // workspace, to tell the peers they are there (ring_attention_bwd.hpp).
  fenceAcqRelSys();
  stReleaseSys(p.peerDone[q], value);
  WaitCtx ctx{p.abortWord, p.errorSlot, p.timeoutNs != 0 ? globaltimerNs() + p.timeoutNs : 0, p.op,
              static_cast<uint32_t>(Role::kCompute), p.rank};
  // acquire: q has finished reading this rank's KV; pairs with q's stReleaseSys above. A failed wait has reported.
  waitGeq(p.myDone[q], value, ctx, q);
}

// One thread: the words of steps 1 and 2 with the op entry's epoch (device-epoch mode; ring_attention.hpp).
__global__ void __launch_bounds__(32) ringPublishKernel(const __grid_constant__ RingPublishParams p) {
  if (threadIdx.x != 0) return;
  // Written by this op's entry kernel, earlier in this stream (a kernel boundary orders it); L2, not L1.
  const uint64_t epoch = __ldcg(p.epochWord);
  if (p.kvReady == 0) {
    stRelaxedSys(&p.mine->kvLength, p.kvLength);
    // release: publishes kvLength; pairs with the peers' attention kernels' waitGeq on `started` (buildRuns).
    stReleaseSys(&p.mine->started, epoch);
    return;
  }
  // release: the KV copies into this rank's workspace (earlier in this stream, complete at this kernel's start) happen
  // before the peers see kvReady = F; pairs with their attention kernels' waitGeq on kvReady (runKvWaiter). The fence
  // makes the release cumulative over the copies, as the stream memory operation's system fence did.
  fenceAcqRelSys();
  stReleaseSys(&p.mine->kvReady, epoch);
}

}  // namespace

void launchRingFinish(const RingFinishParams& p, cudaStream_t stream) {
  ringFinishKernel<<<1, 32, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ring_detail::failCuda(std::string("launching the ring attention finish kernel: ") +
                                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void launchRingPublish(const RingPublishParams& p, cudaStream_t stream) {
  ringPublishKernel<<<1, 32, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ring_detail::failCuda(std::string("launching the ring attention publish kernel: ") +
                                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void preloadRingFinishKernel(int device) {
  const void* fns[] = {reinterpret_cast<const void*>(&ringFinishKernel),
                       reinterpret_cast<const void*>(&ringPublishKernel)};
  preloadOn(device, fns, "preloadRingFinishKernel");
}

}  // namespace tandem::kernels
