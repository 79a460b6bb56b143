// AllGather's kernel for the client executor: one launch per op on the caller's stream (device code:
// device/allgather.cuh; tuning: allgather_tuning.cpp; design: tandem/kernels/allgather.hpp).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "device/allgather.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace {

using allgather_impl::allgatherShare;

__global__ void __launch_bounds__(kAgThreads) allgatherKernel(const __grid_constant__ AllGatherParams p) {
  allgatherShare(p, blockIdx.x, gridDim.x);
}

std::string cudaFailure(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

}  // namespace

void preloadAllGatherKernels(int device) {
  const void* fns[] = {reinterpret_cast<const void*>(&allgatherKernel)};
  preloadOn(device, fns, "allgather kernel");
}

void launchAllGather(const AllGatherParams& p, cudaStream_t stream) {
  if (p.nranks == 0 || p.nranks > kMaxLocalRanks || p.rank >= p.nranks) {
    throw std::runtime_error("launchAllGather: rank " + std::to_string(p.rank) + " of " + std::to_string(p.nranks) +
                             " is out of range (1.." + std::to_string(kMaxLocalRanks) + " ranks on one node)");
  }
  if (p.chunkBytes == 0 || p.chunkBytes > kAgChunkMax || p.chunkBytes % 16 != 0 || p.numCtas == 0 ||
      p.numCtas > kAgMaxCtas || (p.numCtas & (p.numCtas - 1)) != 0 || p.ctl == nullptr || p.epoch == 0) {
    throw std::runtime_error("launchAllGather: bad tuning or control page (chunk " + std::to_string(p.chunkBytes) +
                             ", ctas " + std::to_string(p.numCtas) + ")");
  }
  for (uint32_t r = 0; r < p.nranks; ++r) {
    if (p.workspaces[r] == nullptr) throw std::runtime_error("launchAllGather: workspace of a rank is not mapped");
  }
  allgatherKernel<<<p.numCtas, kAgThreads, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaFailure("allgather kernel launch", e));
}

}  // namespace tandem::kernels
