// FP8 grouped GEMM kernels (one per epilogue) and their raw launch entry points. The host launcher (validation,
// tensor maps, grid) is grouped_gemm_fp8.cpp; the device code is device/grouped_gemm_fp8_sm90.cuh.
#include <cuda_runtime.h>

#include "device/grouped_gemm_fp8_sm90.cuh"
#include "grouped_gemm_fp8_desc.hpp"

namespace tandem::kernels::grouped_fp8 {

template <GroupedGemmEpilogue Epi>
__global__ void __launch_bounds__(kThreads, 1)
    groupedGemmFp8Kernel(const __grid_constant__ GroupedGemmFp8KernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runCta<Epi>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

using KernelFn = void (*)(GroupedGemmFp8KernelParams);

KernelFn pick(GroupedGemmEpilogue epi) {
  return epi == GroupedGemmEpilogue::kSwiGlu ? &groupedGemmFp8Kernel<GroupedGemmEpilogue::kSwiGlu>
                                             : &groupedGemmFp8Kernel<GroupedGemmEpilogue::kStore>;
}

}  // namespace

size_t groupedGemmFp8SmemBytes() { return gemm_fp8::kSmemBytes<gemm_fp8::Scaling::kBlock>; }

cudaError_t groupedGemmFp8Prepare(GroupedGemmEpilogue epi) {
  const KernelFn fn = pick(epi);
  const cudaError_t e =
      cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(groupedGemmFp8SmemBytes()));
  if (e != cudaSuccess) return e;
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));  // loads a lazily loaded kernel now
}

cudaError_t groupedGemmFp8LaunchKernel(const GroupedGemmFp8KernelParams& p, GroupedGemmEpilogue epi, int ctas,
                                       cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = groupedGemmFp8SmemBytes();
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, pick(epi), p);
}

}  // namespace tandem::kernels::grouped_fp8
