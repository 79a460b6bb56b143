// The grouped TN GEMM's kernels (MoE weight gradients; one per input dtype x output type) and their raw launch entry
// points. The host launcher (validation, tensor maps, grid) is grouped_gemm_wgrad.cpp; the device code is
// device/grouped_gemm_wgrad_sm90.cuh.
#include <cuda_runtime.h>

#include "device/grouped_gemm_wgrad_sm90.cuh"
#include "grouped_gemm_wgrad_desc.hpp"

namespace tandem::kernels::grouped_wgrad {

template <class T, class Out>
__global__ void __launch_bounds__(kThreads, 1) groupedWgradKernel(const __grid_constant__ WgradKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  if (p.runIf != nullptr && *p.runIf != p.runValue) return;  // the same word for every thread: the grid leaves whole
  runWgradCta<T, Out>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

static_assert(kSmemBytes <= gl::kSmemLimit, "shared memory over the H100/H200 opt-in limit");

using KernelFn = void (*)(WgradKernelParams);

template <class T>
KernelFn pickFor(GemmOut out) {
  return out == GemmOut::kFp32 ? &groupedWgradKernel<T, float> : &groupedWgradKernel<T, T>;
}

KernelFn pick(WgradVariant v) {
  return v.dtype == GemmDtype::kBf16 ? pickFor<__nv_bfloat16>(v.out) : pickFor<__half>(v.out);
}

}  // namespace

size_t wgradSmemBytes() { return kSmemBytes; }

cudaError_t wgradPrepare(WgradVariant v) {
  const KernelFn fn = pick(v);
  const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(wgradSmemBytes()));
  if (e != cudaSuccess) return e;
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));  // loads a lazily loaded kernel now
}

cudaError_t wgradLaunchKernel(const WgradKernelParams& p, WgradVariant v, int ctas, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = wgradSmemBytes();
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, pick(v), p);
}

}  // namespace tandem::kernels::grouped_wgrad
