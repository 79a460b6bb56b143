// Attention backward core: its kernels (row preparation, dk/dv per KV block, dq per query block, the atomic mode's
// rounding) and their launcher. Device building blocks: device/attention_bwd_sm90.cuh. Shape rules and workspace
// size: attention_bwd_host.cpp.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>

#include "device/attention_bwd_sm90.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/attention_bwd.hpp"

namespace tandem::kernels {
namespace attn_bwd_detail {
[[noreturn]] void failCuda(const std::string& what);
[[noreturn]] void failUnsupported(const std::string& what);
struct WorkspaceLayout {
  size_t rowLse2, rowDot, dqAccum, total;  // byte offsets
  int64_t sqPad;
};
WorkspaceLayout workspaceLayout(const AttentionBwdParams& p);
}  // namespace attn_bwd_detail

namespace attn_bwd {

// One warp per (row, head); kWarps rows per CTA.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads) prepareKernel(const __grid_constant__ BwdKernelParams p) {
  const int32_t row = static_cast<int32_t>(blockIdx.x) * kWarps + static_cast<int32_t>(threadIdx.x) / 32;
  if (row < p.sqPad) prepareRow<T, HD>(p, row, static_cast<int32_t>(blockIdx.y), static_cast<int>(threadIdx.x) % 32);
}

// blockIdx.x = KV block (causal: the first blocks see the most queries, so they start first), blockIdx.y = KV head.
template <class T, int HD, bool AtomicDq>
__global__ void __launch_bounds__(kThreads, 1) kvKernel(const __grid_constant__ BwdKernelParams p) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  runKvBlock<T, HD, AtomicDq>(p, *reinterpret_cast<KvSmem<HD, AtomicDq>*>(smemRaw),
                              static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y));
}

// blockIdx.x counts query blocks from the last (causal: the last see the most keys), blockIdx.y = query head.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) qKernel(const __grid_constant__ BwdKernelParams p) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  runQBlock<T, HD>(p, *reinterpret_cast<QSmem<HD>*>(smemRaw),
                   static_cast<int32_t>(gridDim.x - 1 - blockIdx.x), static_cast<int32_t>(blockIdx.y));
}

template <class T>
__global__ void __launch_bounds__(kThreads) roundKernel(const __grid_constant__ BwdKernelParams p, int64_t n) {
  roundDq<T>(p, n, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * kThreads);
}

namespace {

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    attn_bwd_detail::failCuda(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                              ")");
  }
}

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, size_t smemBytes, cudaStream_t stream, const char* what, const Args&... args) {
  if (smemBytes > 48 * 1024) {
    checkCuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smemBytes)),
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
  kernel<<<grid, kThreads, smemBytes, stream>>>(args...);
  checkCuda(cudaGetLastError(), what);
}

template <class T, int HD>
void launchTyped(const BwdKernelParams& p, bool atomicDq, cudaStream_t stream) {
  launch(&prepareKernel<T, HD>, dim3(static_cast<unsigned>(p.sqPad / kWarps), static_cast<unsigned>(p.heads)), 0,
         stream, "launching the attention backward's row preparation", p);
  const dim3 kvGrid(static_cast<unsigned>((p.sk + kBlockKv - 1) / kBlockKv), static_cast<unsigned>(p.kvHeads));
  if (atomicDq) {
    launch(&kvKernel<T, HD, true>, kvGrid, sizeof(KvSmem<HD, true>), stream,
           "launching the attention backward's dk/dv kernel", p);
    const int64_t n = static_cast<int64_t>(p.sq) * p.heads * HD;
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    launch(&roundKernel<T>, dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096)), 0, stream,
           "launching the attention backward's dq rounding", p, n);
    return;
  }
  launch(&kvKernel<T, HD, false>, kvGrid, sizeof(KvSmem<HD, false>), stream,
         "launching the attention backward's dk/dv kernel", p);
  launch(&qKernel<T, HD>, dim3(static_cast<unsigned>((p.sq + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.heads)),
         sizeof(QSmem<HD>), stream, "launching the attention backward's dq kernel", p);
}

}  // namespace
}  // namespace attn_bwd

void launchAttentionBwd(const AttentionBwdParams& g, cudaStream_t stream) {
  using namespace attn_bwd;
  validateAttentionBwd(g);
  const int32_t kvHeads = g.kvHeads == 0 ? g.heads : g.kvHeads;
  const size_t rowBytes = static_cast<size_t>(g.headDim) * 2;
  if (g.sq == 0 || g.sk == 0) {  // no pairs: the other side's gradients are zero
    if (g.sk > 0) {
      checkCuda(cudaMemsetAsync(g.dk, 0, static_cast<size_t>(g.sk) * kvHeads * rowBytes, stream), "cudaMemsetAsync(dk)");
      checkCuda(cudaMemsetAsync(g.dv, 0, static_cast<size_t>(g.sk) * kvHeads * rowBytes, stream), "cudaMemsetAsync(dv)");
    }
    if (g.sq > 0) {
      checkCuda(cudaMemsetAsync(g.dq, 0, static_cast<size_t>(g.sq) * g.heads * rowBytes, stream), "cudaMemsetAsync(dq)");
    }
    return;
  }
  int device = 0, major = 0, minor = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  checkCuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  checkCuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    attn_bwd_detail::failUnsupported("the kernels are built for sm_90a (H100/H200); device " + std::to_string(device) +
                                     " is sm_" + std::to_string(major) + std::to_string(minor) +
                                     ". Run on a Hopper GPU");
  }

  const attn_bwd_detail::WorkspaceLayout ws = attn_bwd_detail::workspaceLayout(g);
  auto* const base = static_cast<uint8_t*>(g.workspace);
  const bool atomicDq = g.dqMode == AttentionBwdDq::kAtomic;
  BwdKernelParams p;
  std::memset(&p, 0, sizeof(p));
  p.q = g.q;
  p.k = g.k;
  p.v = g.v;
  p.o = g.o;
  p.dout = g.dout;
  p.lse = g.lse;
  p.dq = g.dq;
  p.dk = g.dk;
  p.dv = g.dv;
  p.rowLse2 = reinterpret_cast<float*>(base + ws.rowLse2);
  p.rowDot = reinterpret_cast<float*>(base + ws.rowDot);
  p.dqAccum = atomicDq ? reinterpret_cast<float*>(base + ws.dqAccum) : nullptr;
  p.qStart = g.qStart;
  p.kStart = g.kStart;
  p.sq = static_cast<int32_t>(g.sq);
  p.sk = static_cast<int32_t>(g.sk);
  p.sqPad = static_cast<int32_t>(ws.sqPad);
  p.heads = g.heads;
  p.kvHeads = kvHeads;
  p.group = g.heads / kvHeads;
  p.scale = g.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(g.headDim)) : g.scale;
  p.scaleLog2 = p.scale * 1.4426950408889634f;
  p.causal = g.causal ? 1 : 0;
  if (atomicDq) {
    checkCuda(cudaMemsetAsync(p.dqAccum, 0, static_cast<size_t>(g.sq) * g.heads * g.headDim * sizeof(float), stream),
              "cudaMemsetAsync(dq accumulator)");
  }
  const bool bf16 = g.dtype == AttentionDtype::kBf16;
  if (g.headDim == 64) {
    bf16 ? launchTyped<__nv_bfloat16, 64>(p, atomicDq, stream) : launchTyped<__half, 64>(p, atomicDq, stream);
  } else {
    bf16 ? launchTyped<__nv_bfloat16, 128>(p, atomicDq, stream) : launchTyped<__half, 128>(p, atomicDq, stream);
  }
}

void preloadAttentionBwdKernels(int device) {
  using namespace attn_bwd;
  using Fn = void (*)(BwdKernelParams);
  const Fn fns[] = {&prepareKernel<__nv_bfloat16, 64>,      &prepareKernel<__half, 64>,
                    &prepareKernel<__nv_bfloat16, 128>,     &prepareKernel<__half, 128>,
                    &kvKernel<__nv_bfloat16, 64, false>,    &kvKernel<__half, 64, false>,
                    &kvKernel<__nv_bfloat16, 128, false>,   &kvKernel<__half, 128, false>,
                    &kvKernel<__nv_bfloat16, 64, true>,     &kvKernel<__half, 64, true>,
                    &kvKernel<__nv_bfloat16, 128, true>,    &kvKernel<__half, 128, true>,
                    &qKernel<__nv_bfloat16, 64>,            &qKernel<__half, 64>,
                    &qKernel<__nv_bfloat16, 128>,           &qKernel<__half, 128>};
  preloadOn(device, fns, "preloadAttentionBwdKernels");
  using RoundFn = void (*)(BwdKernelParams, int64_t);
  const RoundFn rounds[] = {&roundKernel<__nv_bfloat16>, &roundKernel<__half>};
  preloadOn(device, rounds, "preloadAttentionBwdKernels");
}

}  // namespace tandem::kernels
