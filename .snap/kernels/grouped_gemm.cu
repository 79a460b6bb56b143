// Grouped GEMM kernels (one per dtype x epilogue x weight layout) and their raw launch entry points. The host
// launcher (validation, tensor maps, grid) is grouped_gemm.cpp; the device code is device/grouped_gemm_sm90.cuh.
#include <cuda_runtime.h>

#include "device/grouped_gemm_sm90.cuh"
#include "grouped_gemm_desc.hpp"

namespace tandem::kernels::grouped {

// BMn: w stored [E, k, n] (layout kAB), loaded MN-major (gemm_sm90.cuh's tmaLoadB / makeBDesc / wgmma transpose bit).
template <class T, GroupedGemmEpilogue Epi, bool BMn>
__global__ void __launch_bounds__(kThreads, 1) groupedGemmKernel(const __grid_constant__ GroupedGemmKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runGroupedGemmCta<T, Epi, BMn>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

using KernelFn = void (*)(GroupedGemmKernelParams);

template <class T>
KernelFn pickFor(GroupedGemmVariant v) {
  if (v.layout == GemmLayout::kAB) return &groupedGemmKernel<T, GroupedGemmEpilogue::kStore, true>;
  return v.epi == GroupedGemmEpilogue::kSwiGlu ? &groupedGemmKernel<T, GroupedGemmEpilogue::kSwiGlu, false>
                                               : &groupedGemmKernel<T, GroupedGemmEpilogue::kStore, false>;
}

KernelFn pick(GroupedGemmVariant v) {
  return v.dtype == GemmDtype::kBf16 ? pickFor<__nv_bfloat16>(v) : pickFor<__half>(v);
}

}  // namespace

size_t groupedGemmSmemBytes() { return gemm::kSmemBytes<kStages>; }

cudaError_t groupedGemmPrepare(GroupedGemmVariant v) {
  const KernelFn fn = pick(v);
  const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(groupedGemmSmemBytes()));
  if (e != cudaSuccess) return e;
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));  // loads a lazily loaded kernel now
}

cudaError_t groupedGemmLaunchKernel(const GroupedGemmKernelParams& p, GroupedGemmVariant v, int ctas,
                                    cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = groupedGemmSmemBytes();
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, pick(v), p);
}

}  // namespace tandem::kernels::grouped
