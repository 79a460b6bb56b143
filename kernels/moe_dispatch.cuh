// Pieces shared by the MoE kernels' files (moe.cu's bf16/fp16 copy, moe_fp8.cu's quantising dispatch): where a
// (token, slot) pair's row lies on its expert's rank, the dispatch's end (the flag that says this rank's rows are
// written), and the host's launch and load of a kernel. No __global__ here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "moe_desc.hpp"

namespace tandem::kernels::moe {

// Pair pi (token t, expert e) goes to this row of e's owner: the rows of e from lower sources (srcOffset, from the
// plan kernel), those of this rank's earlier token chunks (chunkBase, scanned by the plan kernel) and its index in its
// chunk.
__device__ __forceinline__ int32_t pairRow(const MoeKernelParams& p, int32_t pi, int32_t t, int32_t e) {
  return p.srcOffset[e] + p.chunkBase[static_cast<int64_t>(t / kRouteChunk) * p.experts + e] + p.localIdx[pi];
}

// Every CTA of a dispatch calls this once, after its writes. Even a failed op (nothing copied) releases the flag:
// owners wait for it before the next op may touch the table.
__device__ __forceinline__ void finishDispatch(const MoeKernelParams& p) {
  __syncthreads();  // this CTA's copies happen before thread 0's fence
  if (threadIdx.x == 0) {
    fenceAcqRelSys();  // release: this CTA's rows, before its count
    const uint32_t done = atomicAdd(&p.status->dispatchCtasDone, 1u) + 1u;
    if (done == gridDim.x) {
      fenceAcqRelSys();  // acquire: every CTA's rows (each fenced before its add)
      // release: this rank's rows for every owner; pairs with moeArriveKernel's waitGeq
      for (int q = 0; q < p.nranks; ++q) stReleaseSys(&p.ctl[q]->dispatchFlag[p.rank], opEpoch(p));
    }
  }
}

// Host side, for moe.cu and moe_fp8.cu alike: a kernel of `ctas` x `threads` (no dynamic shared memory) on s, and
// loading a lazily loaded kernel now (its first launch then costs no load).
template <class... A>
cudaError_t launchK(void (*fn)(A...), int ctas, int threads, cudaStream_t s, A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  return cudaLaunchKernelEx(&cfg, fn, args...);
}

template <class F>
cudaError_t loadKernel(F fn) {
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));
}

}  // namespace tandem::kernels::moe
