// Ring attention backward's fp32 sums: the core's partial gradients added into fp32 accumulators in a fixed order, and
// the one rounding into the rank's gradients (ring_attention_bwd.hpp says where they sit in the op).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "preload_on.hpp"
#include "tandem/kernels/ring_attention_bwd.hpp"

namespace tandem::kernels {
namespace ring_bwd_detail {
[[noreturn]] void failCuda(const std::string& what);  // ring_attention_bwd.cpp (fmt does not compile under nvcc)
}

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

__device__ float toFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float toFloat(__half x) { return __half2float(x); }
template <class T>
__device__ T fromFloat(float x);
template <>
__device__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __half fromFloat<__half>(float x) { return __float2half_rn(x); }

// Each element is owned by one thread: no atomics, the same sum on every run.
template <class T>
__global__ void __launch_bounds__(kThreads) gradAccumulateKernel(const __grid_constant__ GradSumParams p) {
  const T* part = static_cast<const T*>(p.part);
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < p.count; i += int64_t{gridDim.x} * kThreads) {
    p.acc[i] += toFloat(part[i]);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) gradRoundKernel(const __grid_constant__ GradSumParams p) {
  T* out = static_cast<T*>(p.out);
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < p.count; i += int64_t{gridDim.x} * kThreads) {
    out[i] = fromFloat<T>(p.acc[i]);
  }
}

template <class Kernel>
void launchPass(Kernel kernel, const GradSumParams& p, cudaStream_t stream, const char* what) {
  if (p.count <= 0) return;
  const int64_t blocks = (p.count + kThreads - 1) / kThreads;
  kernel<<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    ring_bwd_detail::failCuda(std::string("launching ") + what + ": " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
  }
}

}  // namespace

void launchGradAccumulate(const GradSumParams& p, cudaStream_t stream) {
  p.bf16 ? launchPass(&gradAccumulateKernel<__nv_bfloat16>, p, stream, "the gradient accumulation")
         : launchPass(&gradAccumulateKernel<__half>, p, stream, "the gradient accumulation");
}

void launchGradRound(const GradSumParams& p, cudaStream_t stream) {
  p.bf16 ? launchPass(&gradRoundKernel<__nv_bfloat16>, p, stream, "the gradient rounding")
         : launchPass(&gradRoundKernel<__half>, p, stream, "the gradient rounding");
}

void preloadGradSumKernels(int device) {
  using Fn = void (*)(GradSumParams);
  const Fn fns[] = {&gradAccumulateKernel<__nv_bfloat16>, &gradAccumulateKernel<__half>,
                    &gradRoundKernel<__nv_bfloat16>, &gradRoundKernel<__half>};
  preloadOn(device, fns, "preloadGradSumKernels");
}

}  // namespace tandem::kernels
