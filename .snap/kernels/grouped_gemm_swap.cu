// The grouped GEMM's swap-AB kernels (one per dtype x epilogue x token tile width) and their raw launch entry points.
// The host launcher (tensor maps, grid) is grouped_gemm_swap.cpp; the device code is device/grouped_gemm_swap_sm90.cuh.
#include <cuda_runtime.h>

#include "device/grouped_gemm_swap_sm90.cuh"
#include "grouped_gemm_swap_desc.hpp"

namespace tandem::kernels::grouped_swap {

template <class T, int BN, GroupedGemmEpilogue Epi>
__global__ void __launch_bounds__(kThreads, 1) groupedGemmSwapKernel(const __grid_constant__ SwapKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runSwapCta<T, BN, Epi>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

using KernelFn = void (*)(SwapKernelParams);

template <int BN>
KernelFn pickWidth(GemmDtype dtype, GroupedGemmEpilogue epi) {
  static_assert(kSmemBytes<BN> <= gl::kSmemLimit, "shared memory over the H100/H200 opt-in limit");
  const bool swiglu = epi == GroupedGemmEpilogue::kSwiGlu;
  if (dtype == GemmDtype::kBf16) {
    return swiglu ? &groupedGemmSwapKernel<__nv_bfloat16, BN, GroupedGemmEpilogue::kSwiGlu>
                  : &groupedGemmSwapKernel<__nv_bfloat16, BN, GroupedGemmEpilogue::kStore>;
  }
  return swiglu ? &groupedGemmSwapKernel<__half, BN, GroupedGemmEpilogue::kSwiGlu>
                : &groupedGemmSwapKernel<__half, BN, GroupedGemmEpilogue::kStore>;
}

// Null for a width without kernels (the host refuses it first).
KernelFn pick(GemmDtype dtype, GroupedGemmEpilogue epi, int tileN) {
  switch (tileN) {
    case 16:
      return pickWidth<16>(dtype, epi);
    case 64:
      return pickWidth<64>(dtype, epi);
    case 128:
      return pickWidth<128>(dtype, epi);
    default:
      return nullptr;
  }
}

}  // namespace

size_t swapSmemBytes(int tileN) {
  switch (tileN) {
    case 16:
      return kSmemBytes<16>;
    case 64:
      return kSmemBytes<64>;
    case 128:
      return kSmemBytes<128>;
    default:
      return 0;
  }
}

cudaError_t swapPrepare(GemmDtype dtype, GroupedGemmEpilogue epi, int tileN) {
  const KernelFn fn = pick(dtype, epi, tileN);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(swapSmemBytes(tileN)));
  if (e != cudaSuccess) return e;
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));  // loads a lazily loaded kernel now
}

cudaError_t swapLaunchKernel(const SwapKernelParams& p, GemmDtype dtype, GroupedGemmEpilogue epi, int tileN, int ctas,
                             cudaStream_t stream) {
  const KernelFn fn = pick(dtype, epi, tileN);
  if (fn == nullptr) return cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = swapSmemBytes(tileN);
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, fn, p);
}

}  // namespace tandem::kernels::grouped_swap
