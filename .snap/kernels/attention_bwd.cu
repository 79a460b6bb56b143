// Attention backward core: its kernels (row preparation, dk/dv per KV block and dq per query block on the wgmma or the
// mma.sync core, the atomic mode's rounding) and their launcher. Device building blocks: device/attention_bwd_sm90.cuh,
// device/attention_bwd_wgmma_sm90.cuh and device/attention_bwd_wgmma_dq_sm90.cuh. Shape rules and workspace size:
// attention_bwd_host.cpp.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "device/attention_bwd_sm90.cuh"
#include "preload_on.hpp"
#include "device/attention_bwd_wgmma_dq_sm90.cuh"
#include "device/attention_bwd_wgmma_sm90.cuh"
#include "tandem/kernels/attention_bwd.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace attn_bwd_detail {
[[noreturn]] void failCuda(const std::string& what);
[[noreturn]] void failUnsupported(const std::string& what);
[[noreturn]] void failInvalidConfig(const std::string& what);
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

// The wgmma core's dk/dv kernel (and atomic dq): same grid as kvKernel, wg::kThreads threads.
template <class T, int HD, bool AtomicDq>
__global__ void __launch_bounds__(wg::kThreads, 1) wgKvKernel(const __grid_constant__ wg::WgKernelParams p) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  wg::runKvCta<T, HD, AtomicDq>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y));
}

// The wgmma core's deterministic dq kernel: same grid as qKernel (query blocks of wg::kDqBlockQ rows, the last
// first), wg::kThreads threads.
template <class T, int HD, int BK>
__global__ void __launch_bounds__(wg::kThreads, 1) wgDqKernel(const __grid_constant__ wg::WgKernelParams p) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  wg::runDqCta<T, HD, BK>(p, smemRaw, static_cast<int32_t>(gridDim.x - 1 - blockIdx.x),
                          static_cast<int32_t>(blockIdx.y));
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
void launch(Kernel kernel, dim3 grid, int threads, size_t smemBytes, cudaStream_t stream, const char* what,
            const Args&... args) {
  if (smemBytes > 48 * 1024) {
    checkCuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smemBytes)),
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
  kernel<<<grid, threads, smemBytes, stream>>>(args...);
  checkCuda(cudaGetLastError(), what);
}

// Row-major [rows, cols] matrix of 16-bit elements in boxes of boxRows x 64 columns, 128-byte swizzle; rows past
// `rows` read as zeros. Through a tensor-map cache: training encodes the same tensors step after step.
CUtensorMap encodeMap(const void* base, int64_t rows, int64_t cols, uint32_t boxRows, bool bf16) {
  static TensorMapCache cache;
  CUtensorMap map;
  const TensorMapKey key =
      TensorMapKey::matrix(base, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), static_cast<uint64_t>(cols),
                           boxRows, static_cast<uint32_t>(wg::kSwizzleCols), bf16 ? GemmDtype::kBf16 : GemmDtype::kFp16);
  const CUresult r = cache.get(key, &map);
  if (r != CUDA_SUCCESS) {
    attn_bwd_detail::failCuda("cuTensorMapEncodeTiled -> CUresult " + std::to_string(static_cast<int>(r)) + " for a " +
                              std::to_string(rows) + " x " + std::to_string(cols) + " tensor at " +
                              std::to_string(reinterpret_cast<uintptr_t>(base)));
  }
  return map;
}

template <class T, int HD, bool AtomicDq>
void launchKv(const BwdKernelParams& p, bool wgmma, cudaStream_t stream) {
  const char* const what = "launching the attention backward's dk/dv kernel";
  if (!wgmma) {
    const dim3 grid(static_cast<unsigned>((p.sk + kBlockKv - 1) / kBlockKv), static_cast<unsigned>(p.kvHeads));
    launch(&kvKernel<T, HD, AtomicDq>, grid, kThreads, sizeof(KvSmem<HD, AtomicDq>), stream, what, p);
    return;
  }
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr uint32_t kBq = wg::kBlockQ<HD, AtomicDq>;
  wg::WgKernelParams w;
  std::memset(&w, 0, sizeof(w));
  w.tmQ = encodeMap(p.q, p.sq, static_cast<int64_t>(p.heads) * HD, kBq, kBf16);
  w.tmDout = encodeMap(p.dout, p.sq, static_cast<int64_t>(p.heads) * HD, kBq, kBf16);
  w.tmK = encodeMap(p.k, p.sk, static_cast<int64_t>(p.kvHeads) * HD, wg::kBlockKv, kBf16);
  w.tmV = encodeMap(p.v, p.sk, static_cast<int64_t>(p.kvHeads) * HD, wg::kBlockKv, kBf16);
  w.b = p;
  const dim3 grid(static_cast<unsigned>((p.sk + wg::kBlockKv - 1) / wg::kBlockKv), static_cast<unsigned>(p.kvHeads));
  launch(&wgKvKernel<T, HD, AtomicDq>, grid, wg::kThreads, wg::kSmemBytes<HD, AtomicDq>, stream, what, w);
}

// Keys per step of the wgmma dq kernel: wg::kDqBlockKv<HD>, or TANDEM_ATTENTION_BWD_DQ_BLOCK_KV (64 or 128) for A/B
// runs (device/attention_bwd_wgmma_dq_sm90.cuh says what each costs). Read once per process.
int dqBlockKv(int hd) {
  static const int fromEnv = [] {
    const char* const env = std::getenv("TANDEM_ATTENTION_BWD_DQ_BLOCK_KV");
    if (env == nullptr) return 0;
    if (std::strcmp(env, "64") == 0) return 64;
    if (std::strcmp(env, "128") == 0) return 128;
    attn_bwd_detail::failInvalidConfig(std::string("TANDEM_ATTENTION_BWD_DQ_BLOCK_KV is \"") + env +
                                       "\"; set it to 64 or 128, or unset it for the default");
  }();
  return fromEnv != 0 ? fromEnv : (hd == 64 ? wg::kDqBlockKv<64> : wg::kDqBlockKv<128>);
}

template <class T, int HD, int BK>
void launchWgDq(const BwdKernelParams& p, cudaStream_t stream) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr uint32_t kBk = static_cast<uint32_t>(BK);
  wg::WgKernelParams w;
  std::memset(&w, 0, sizeof(w));
  w.tmQ = encodeMap(p.q, p.sq, static_cast<int64_t>(p.heads) * HD, wg::kDqBlockQ, kBf16);
  w.tmDout = encodeMap(p.dout, p.sq, static_cast<int64_t>(p.heads) * HD, wg::kDqBlockQ, kBf16);
  w.tmK = encodeMap(p.k, p.sk, static_cast<int64_t>(p.kvHeads) * HD, kBk, kBf16);
  w.tmV = encodeMap(p.v, p.sk, static_cast<int64_t>(p.kvHeads) * HD, kBk, kBf16);
  w.b = p;
  const dim3 grid(static_cast<unsigned>((p.sq + wg::kDqBlockQ - 1) / wg::kDqBlockQ), static_cast<unsigned>(p.heads));
  launch(&wgDqKernel<T, HD, BK>, grid, wg::kThreads, wg::kDqSmemBytes<HD, BK>, stream,
         "launching the attention backward's dq kernel", w);
}

// Deterministic dq: one CTA per query block and head, KV blocks in order (bitwise repeatable).
template <class T, int HD>
void launchDq(const BwdKernelParams& p, bool wgmma, cudaStream_t stream) {
  if (!wgmma) {
    launch(&qKernel<T, HD>, dim3(static_cast<unsigned>((p.sq + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.heads)),
           kThreads, sizeof(QSmem<HD>), stream, "launching the attention backward's dq kernel", p);
  } else if (dqBlockKv(HD) == 64) {
    launchWgDq<T, HD, 64>(p, stream);
  } else {
    launchWgDq<T, HD, 128>(p, stream);
  }
}

template <class T, int HD>
void launchTyped(const BwdKernelParams& p, bool atomicDq, bool wgmma, cudaStream_t stream) {
  launch(&prepareKernel<T, HD>, dim3(static_cast<unsigned>(p.sqPad / kWarps), static_cast<unsigned>(p.heads)),
         kThreads, 0, stream, "launching the attention backward's row preparation", p);
  if (atomicDq) {
    launchKv<T, HD, true>(p, wgmma, stream);
    const int64_t n = static_cast<int64_t>(p.sq) * p.heads * HD;
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    launch(&roundKernel<T>, dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096)), kThreads, 0, stream,
           "launching the attention backward's dq rounding", p, n);
    return;
  }
  launchKv<T, HD, false>(p, wgmma, stream);
  launchDq<T, HD>(p, wgmma, stream);
}

// params.core, with kAuto resolved through TANDEM_ATTENTION_BWD_CORE.
bool useWgmma(AttentionBwdCore core) {
  if (core != AttentionBwdCore::kAuto) return core == AttentionBwdCore::kWgmma;
  const char* const env = std::getenv("TANDEM_ATTENTION_BWD_CORE");
  return env == nullptr || std::strcmp(env, "mma_sync") != 0;
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
  const bool wgmma = useWgmma(g.core);
  if (g.headDim == 64) {
    bf16 ? launchTyped<__nv_bfloat16, 64>(p, atomicDq, wgmma, stream)
         : launchTyped<__half, 64>(p, atomicDq, wgmma, stream);
  } else {
    bf16 ? launchTyped<__nv_bfloat16, 128>(p, atomicDq, wgmma, stream)
         : launchTyped<__half, 128>(p, atomicDq, wgmma, stream);
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
  using WgFn = void (*)(wg::WgKernelParams);
  const WgFn wgFns[] = {&wgKvKernel<__nv_bfloat16, 64, false>,  &wgKvKernel<__half, 64, false>,
                        &wgKvKernel<__nv_bfloat16, 128, false>, &wgKvKernel<__half, 128, false>,
                        &wgKvKernel<__nv_bfloat16, 64, true>,   &wgKvKernel<__half, 64, true>,
                        &wgKvKernel<__nv_bfloat16, 128, true>,  &wgKvKernel<__half, 128, true>,
                        &wgDqKernel<__nv_bfloat16, 64, 64>,     &wgDqKernel<__half, 64, 64>,
                        &wgDqKernel<__nv_bfloat16, 64, 128>,    &wgDqKernel<__half, 64, 128>,
                        &wgDqKernel<__nv_bfloat16, 128, 64>,    &wgDqKernel<__half, 128, 64>,
                        &wgDqKernel<__nv_bfloat16, 128, 128>,   &wgDqKernel<__half, 128, 128>};
  preloadOn(device, wgFns, "preloadAttentionBwdKernels");
}

}  // namespace tandem::kernels
