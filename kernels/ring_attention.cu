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
  // release: this rank's reads of q's KV (the attention kernel before this one, complete in stream order) happen
  // before q may reuse its workspace; pairs with q's waitGeq on its done[rank] below.
  stReleaseSys(p.peerDone[q], p.value);
  WaitCtx ctx{p.abortWord, p.errorSlot, p.timeoutNs != 0 ? globaltimerNs() + p.timeoutNs : 0, p.op,
              static_cast<uint32_t>(Role::kCompute), p.rank};
  // acquire: q has finished reading this rank's KV; pairs with q's stReleaseSys above. A failed wait has reported.
  waitGeq(p.myDone[q], p.value, ctx, q);
}

}  // namespace

void launchRingFinish(const RingFinishParams& p, cudaStream_t stream) {
  ringFinishKernel<<<1, 32, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ring_detail::failCuda(std::string("launching the ring attention finish kernel: ") +
                                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void preloadRingFinishKernel(int device) {
  using Fn = void (*)(RingFinishParams);
  const Fn fns[] = {&ringFinishKernel};
  preloadOn(device, fns, "preloadRingFinishKernel");
}

}  // namespace tandem::kernels
