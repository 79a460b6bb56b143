// Grouped GEMM kernels (one per dtype x epilogue) and their raw launch entry points. The host launcher (validation,
// tensor maps, grid) is grouped_gemm.cpp; the device code is device/grouped_gemm_sm90.cuh.
#include <cuda_runtime.h>

#include "device/grouped_gemm_sm90.cuh"
#include "grouped_gemm_desc.hpp"

namespace tandem::kernels::grouped {

template <class T, GroupedGemmEpilogue Epi>
__global__ void __launch_bounds__(kThreads, 1) groupedGemmKernel(const __grid_constant__ GroupedGemmKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runGroupedGemmCta<T, Epi>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

using KernelFn = void (*)(GroupedGemmKernelParams);

KernelFn pick(GemmDtype dtype, GroupedGemmEpilogue epi) {
  const bool swiglu = epi == GroupedGemmEpilogue::kSwiGlu;
  if (dtype == GemmDtype::kBf16) {
    return swiglu ? &groupedGemmKernel<__nv_bfloat16, GroupedGemmEpilogue::kSwiGlu>
                  : &groupedGemmKernel<__nv_bfloat16, GroupedGemmEpilogue::kStore>;
  }
  return swiglu ? &groupedGemmKernel<__half, GroupedGemmEpilogue::kSwiGlu>
                : &groupedGemmKernel<__half, GroupedGemmEpilogue::kStore>;
}

}  // namespace

size_t groupedGemmSmemBytes() { return gemm::kSmemBytes<kStages>; }

cudaError_t groupedGemmPrepare(GemmDtype dtype, GroupedGemmEpilogue epi) {
  const KernelFn fn = pick(dtype, epi);
  const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(groupedGemmSmemBytes()));
  if (e != cudaSuccess) return e;
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));  // loads a lazily loaded kernel now
}

cudaError_t groupedGemmLaunchKernel(const GroupedGemmKernelParams& p, GemmDtype dtype, GroupedGemmEpilogue epi,
                                    int ctas, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = groupedGemmSmemBytes();
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, pick(dtype, epi), p);
}

}  // namespace tandem::kernels::grouped
