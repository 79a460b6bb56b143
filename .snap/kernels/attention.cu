// Attention forward core: the persistent warp-specialised kernels and their launcher (TMA descriptors, variant
// choice, launch geometry). Device building blocks: device/attention_sm90.cuh. Shape rules: attention_host.cpp.
#include <cuda.h>
#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>

#include "device/attention_sm90.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/attention.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace attn_detail {
[[noreturn]] void failCuda(const std::string& what);
[[noreturn]] void failUnsupported(const std::string& what);
struct Resolved {
  int blockN;
  bool pingPong;
  int headGroup;
  bool snake;
  bool dynamic;
};
Resolved resolveAttention(const AttentionParams& p);
}  // namespace attn_detail

namespace attn {

template <class T, int HD, int BN, bool Causal>
__global__ void __launch_bounds__(kThreads, 1) attentionKernel(const __grid_constant__ AttnKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runAttentionCta<T, HD, BN, Causal>(p, smemRaw);
}

namespace {

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    attn_detail::failCuda(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

using KernelFn = void (*)(AttnKernelParams);

struct Variant {
  KernelFn fn;
  size_t smemBytes;
};

template <class T, int HD, int BN, bool Causal>
Variant variant() {
  return {&attentionKernel<T, HD, BN, Causal>, kSmemBytes<HD, BN>};
}

template <class T>
Variant pickShape(int hd, int bn, bool causal) {
  if (hd == 64) return causal ? variant<T, 64, 128, true>() : variant<T, 64, 128, false>();
  if (bn == 176) return variant<T, 128, 176, false>();
  return causal ? variant<T, 128, 128, true>() : variant<T, 128, 128, false>();
}

Variant pickVariant(AttentionDtype dt, int hd, int bn, bool causal) {
  return dt == AttentionDtype::kBf16 ? pickShape<__nv_bfloat16>(hd, bn, causal) : pickShape<__half>(hd, bn, causal);
}

// Every kernel of one dtype, in pickShape's set.
template <class T>
constexpr std::array<KernelFn, 5> kernelsOf() {
  return {&attentionKernel<T, 64, 128, false>, &attentionKernel<T, 64, 128, true>,
          &attentionKernel<T, 128, 128, false>, &attentionKernel<T, 128, 128, true>,
          &attentionKernel<T, 128, 176, false>};
}

// Per (device, kernel): the opt-in shared-memory limit is raised once and the SM count read once.
struct LaunchInfo {
  int device = -1;
  KernelFn fn = nullptr;
  int numSms = 0;
};

LaunchInfo launchInfo(int device, const Variant& v) {
  static std::mutex mu;
  static std::array<LaunchInfo, 64> table{};
  static size_t used = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (size_t i = 0; i < used; ++i) {
    if (table[i].device == device && table[i].fn == v.fn) return table[i];
  }
  LaunchInfo info;
  info.device = device;
  info.fn = v.fn;
  checkCuda(cudaDeviceGetAttribute(&info.numSms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  int major = 0, minor = 0;
  checkCuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  checkCuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    attn_detail::failUnsupported("the kernels are built for sm_90a (H100/H200); device " + std::to_string(device) +
                                 " is sm_" + std::to_string(major) + std::to_string(minor) +
                                 ". Run on a Hopper GPU or use the cpu backend");
  }
  checkCuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(v.fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(v.smemBytes)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (used < table.size()) table[used++] = info;
  return info;
}

// Row-major [rows, heads * hd] matrix of 2-byte elements in boxes of boxRows x 64 columns, 128-byte swizzle. Rows
// past `rows` read as zeros (the kernel masks or drops them). Through the kernels' shared tensor-map cache: ring
// attention encodes the same peer workspaces op after op.
CUtensorMap encodeMap(const void* base, int64_t rows, int64_t cols, uint32_t boxRows, AttentionDtype dt) {
  static TensorMapCache cache;
  CUtensorMap map;
  const TensorMapKey key =
      TensorMapKey::matrix(base, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), static_cast<uint64_t>(cols),
                           boxRows, static_cast<uint32_t>(kSwizzleCols),
                           dt == AttentionDtype::kBf16 ? GemmDtype::kBf16 : GemmDtype::kFp16);
  const CUresult r = cache.get(key, &map);
  if (r != CUDA_SUCCESS) {
    attn_detail::failCuda("cuTensorMapEncodeTiled -> CUresult " + std::to_string(static_cast<int>(r)) + " for a " +
                          std::to_string(rows) + " x " + std::to_string(cols) + " tensor at " +
                          std::to_string(reinterpret_cast<uintptr_t>(base)));
  }
  return map;
}

}  // namespace
}  // namespace attn

void preloadAttentionKernels(int device) {
  using namespace attn;
  const std::array<std::array<KernelFn, 5>, 2> sets{kernelsOf<__nv_bfloat16>(), kernelsOf<__half>()};
  KernelFn fns[2 * 5];
  for (size_t i = 0; i < sets.size(); ++i) {
    for (size_t j = 0; j < sets[i].size(); ++j) fns[5 * i + j] = sets[i][j];
  }
  preloadOn(device, fns, "preloadAttentionKernels");
}

void launchAttention(const AttentionParams& g, cudaStream_t stream) {
  using namespace attn;
  validateAttention(g);
  if (g.sq == 0) return;
  const attn_detail::Resolved r = attn_detail::resolveAttention(g);
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const Variant v = pickVariant(g.dtype, g.headDim, r.blockN, g.causal);
  const LaunchInfo info = launchInfo(device, v);

  AttnKernelParams p;
  std::memset(&p, 0, sizeof(p));
  const int64_t cols = static_cast<int64_t>(g.heads) * g.headDim;
  const int32_t kvHeads = g.kvHeads == 0 ? g.heads : g.kvHeads;
  const int64_t kvCols = static_cast<int64_t>(kvHeads) * g.headDim;
  p.tmQ = encodeMap(g.q, g.sq, cols, kBlockM, g.dtype);
  // One tensor map pair per non-empty segment, in segment order; the kernel splits each into its runs.
  int maps = 0;
  for (int i = 0; i < g.numKv; ++i) {
    const AttentionKvSegment& s = g.kv[i];
    if (s.length == 0) continue;  // nothing to see: leave it out of the walk
    p.tmK[maps] = encodeMap(s.k, s.length, kvCols, static_cast<uint32_t>(r.blockN), g.dtype);
    p.tmV[maps] = encodeMap(s.v, s.length, kvCols, static_cast<uint32_t>(r.blockN), g.dtype);
    AttnKvMap& m = p.maps[maps++];
    m.start = s.start;
    m.start2 = s.start2;
    m.ready = s.arrival;
    m.readyValue = s.arrivalValue;
    m.lengthWord = s.lengthWord;
    m.lengthReady = s.lengthReady;
    m.lengthReadyValue = s.lengthReadyValue;
    m.length = static_cast<int32_t>(s.length);
    m.split = s.splitHalves ? -1 : static_cast<int32_t>(s.split > 0 ? s.split : s.length);
  }
  p.numMaps = maps;
  // Segments map to tensors in order, but empty segments have none: rotate from the tensor of the first segment.
  int rotateFrom = 0;
  for (int i = 0; i < g.numKv && i < g.rotateFrom; ++i) rotateFrom += g.kv[i].length != 0 ? 1 : 0;
  p.rotateFrom = g.rotateFrom > 0 ? rotateFrom : 0;
  p.qStart2 = g.qStart2;
  p.qSplit = static_cast<int32_t>(g.qSplit > 0 && g.qSplit < g.sq ? g.qSplit : g.sq);
  p.abortWord = g.abortWord;
  p.errorSlot = g.errorSlot;
  p.timeoutNs = g.timeoutNs;
  p.waitOp = g.waitOp;
  p.waitRank = g.waitRank;
  p.epochWord = g.epochWord;
  p.out = g.out;
  p.lse = g.lse;
  p.qStart = g.qStart;
  p.sq = static_cast<int32_t>(g.sq);
  p.heads = g.heads;
  p.kvGroup = g.heads / kvHeads;
  p.numQTiles = static_cast<int32_t>((g.sq + kBlockM - 1) / kBlockM);
  const int64_t work = static_cast<int64_t>(p.numQTiles) * g.heads;
  if (work > 0x7fffffff) attn_detail::failUnsupported("more than 2^31 - 1 query tiles x heads; split the launch");
  p.numWork = static_cast<int32_t>(work);
  const float scale = g.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(g.headDim)) : g.scale;
  p.scaleLog2 = scale * 1.4426950408889634f;
  p.pingPong = r.pingPong ? 1 : 0;
  p.headGroup = r.headGroup;
  p.snake = r.snake ? 1 : 0;
  if (r.dynamic) {  // tileOrder 3, or the default with a counter (resolveAttention)
    checkCuda(cudaMemsetAsync(g.tileCounter, 0, sizeof(uint32_t), stream), "cudaMemsetAsync(tile counter)");
    p.tileCounter = g.tileCounter;
  }

  const int sms = g.numSms > 0 && g.numSms < info.numSms ? g.numSms : info.numSms;
  const int64_t grid = work < sms ? work : sms;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = v.smemBytes;
  cfg.stream = stream;
  checkCuda(cudaLaunchKernelEx(&cfg, v.fn, p), "launching the attention kernel");
}

}  // namespace tandem::kernels
