// Hopper GEMM core: the persistent warp-specialised kernel and its host launcher (validation, TMA descriptors,
// launch geometry). Device building blocks live in device/gemm_sm90.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "device/gemm_sm90.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace gemm {

// One CTA: warpgroup 0 produces (TMA), warpgroups 1..2 consume (wgmma + epilogue). Persistent over the tile order.
template <class T, int ClusterM, Epilogue Epi>
__global__ void __launch_bounds__(kThreads, 1) gemmKernel(const __grid_constant__ GemmKernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  const GroupedRaster order{p.unitsM, p.tilesN, p.groupM};
  runGemmCta<T, ClusterM, Epi>(p, smemRaw, order, NoRowWait{}, static_cast<int32_t>(blockIdx.x) / ClusterM,
                               static_cast<int32_t>(gridDim.x) / ClusterM);
}

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tandem gemm: " + msg); }

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}


// Row-major [rows, cols] matrix of 2-byte elements, tiled in boxes of boxRows x boxCols, 128-byte swizzle; encoded and
// cached by tensor_map_cache.hpp (shared with the grouped GEMM).
struct MatrixMap {
  const void* ptr;
  uint64_t rows, cols, ld;
  uint32_t boxRows, boxCols;
  GemmDtype dtype;
};

bool cacheDisabled() {
  static const bool off = [] {
    const char* v = std::getenv("TANDEM_GEMM_NO_TMA_CACHE");
    return v != nullptr && v[0] == '1';
  }();
  return off;
}

CUtensorMap tensorMap(const MatrixMap& m) {
  static TensorMapCache cache;
  const TensorMapKey k = TensorMapKey::matrix(m.ptr, m.rows, m.cols, m.ld, m.boxRows, m.boxCols, m.dtype);
  CUtensorMap map;
  const CUresult r = cacheDisabled() ? encodeTensorMap(k, &map) : cache.get(k, &map);
  if (r != CUDA_SUCCESS) {
    fail("cuTensorMapEncodeTiled failed (CUresult " + std::to_string(static_cast<int>(r)) + ") for a " +
         std::to_string(m.rows) + "x" + std::to_string(m.cols) + " matrix, ld " + std::to_string(m.ld));
  }
  return map;
}

using KernelFn = void (*)(GemmKernelParams);

struct Variant {
  KernelFn fn;
  int clusterM;
  Epilogue epi;
};

template <class T, int ClusterM, Epilogue Epi>
Variant variant() {
  return {&gemmKernel<T, ClusterM, Epi>, ClusterM, Epi};
}

Variant pickVariant(GemmDtype dt, int clusterM, Epilogue epi) {
  const bool bf = dt == GemmDtype::kBf16;
  const bool tma = epi == Epilogue::kTmaStore;
  if (clusterM == 2) {
    if (bf) return tma ? variant<__nv_bfloat16, 2, Epilogue::kTmaStore>() : variant<__nv_bfloat16, 2, Epilogue::kDirect>();
    return tma ? variant<__half, 2, Epilogue::kTmaStore>() : variant<__half, 2, Epilogue::kDirect>();
  }
  if (bf) return tma ? variant<__nv_bfloat16, 1, Epilogue::kTmaStore>() : variant<__nv_bfloat16, 1, Epilogue::kDirect>();
  return tma ? variant<__half, 1, Epilogue::kTmaStore>() : variant<__half, 1, Epilogue::kDirect>();
}

// Per (device, kernel): the opt-in smem attribute is set once and the co-resident cluster count is measured once.
struct LaunchInfo {
  int device = -1;
  KernelFn fn = nullptr;
  int numSms = 0;
  int maxClusters = 0;
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
  int major = 0;
  checkCuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  int minor = 0;
  checkCuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    fail("needs an sm_90 (Hopper) GPU; device " + std::to_string(device) + " is sm_" + std::to_string(major) +
         std::to_string(minor));
  }
  checkCuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(v.fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(gemm::kSmemBytes<kStages>)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (v.clusterM > 1) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(v.clusterM * (info.numSms / v.clusterM)), 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = gemm::kSmemBytes<kStages>;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(v.clusterM);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    checkCuda(cudaOccupancyMaxActiveClusters(&info.maxClusters, reinterpret_cast<const void*>(v.fn), &cfg),
              "cudaOccupancyMaxActiveClusters");
    if (info.maxClusters <= 0) fail("no cluster of the GEMM kernel fits on this device");
  } else {
    info.maxClusters = info.numSms;
  }
  if (used < table.size()) table[used++] = info;
  return info;
}

constexpr int kDefaultClusterM = 1;
constexpr int kDefaultGroupM = 16;
constexpr Epilogue kDefaultEpilogue = Epilogue::kTmaStore;

struct Resolved {
  int clusterM;
  int groupM;  // in 128-row tiles
  Epilogue epi;
};

Resolved resolve(const GemmParams& g) {
  Resolved r{};
  r.clusterM = g.clusterM == 0 ? kDefaultClusterM : g.clusterM;
  r.groupM = g.groupM == 0 ? kDefaultGroupM : g.groupM;
  r.epi = g.epilogue == 0 ? kDefaultEpilogue : (g.epilogue == 1 ? Epilogue::kTmaStore : Epilogue::kDirect);
  if (r.clusterM != 1 && r.clusterM != 2) fail("clusterM must be 0 (default), 1 or 2, got " + std::to_string(g.clusterM));
  if (r.groupM < 1) fail("groupM must be >= 0, got " + std::to_string(g.groupM));
  if (g.epilogue < 0 || g.epilogue > 2) fail("epilogue must be 0, 1 or 2, got " + std::to_string(g.epilogue));
  return r;
}

void validate(const GemmParams& g) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (g.dtype != GemmDtype::kBf16 && g.dtype != GemmDtype::kFp16) fail("unknown dtype");
  if (g.m < 0 || g.n < 0 || g.k < 0) fail("negative size m=" + str(g.m) + " n=" + str(g.n) + " k=" + str(g.k));
  constexpr int64_t kMax = 0x7fffffff;
  if (g.m > kMax || g.n > kMax || g.k > kMax) fail("m, n and k must each be below 2^31");
  if (g.k % 8 != 0) {
    fail("k must be a multiple of 8 (16-byte TMA row strides), got k=" + str(g.k) + "; pad K with zeros");
  }
  if (g.m == 0 || g.n == 0) return;
  if (g.c == nullptr) fail("c is null");
  if (reinterpret_cast<uintptr_t>(g.c) % 16 != 0) fail("c must be 16-byte aligned");
  if (g.ldc < g.n || g.ldc % 8 != 0) fail("ldc must be >= n and a multiple of 8, got ldc=" + str(g.ldc) + " n=" + str(g.n));
  if (g.k == 0) return;
  if (g.a == nullptr || g.b == nullptr) fail("a or b is null");
  if (reinterpret_cast<uintptr_t>(g.a) % 16 != 0 || reinterpret_cast<uintptr_t>(g.b) % 16 != 0) {
    fail("a and b must be 16-byte aligned");
  }
  if (g.lda < g.k || g.lda % 8 != 0) fail("lda must be >= k and a multiple of 8, got lda=" + str(g.lda) + " k=" + str(g.k));
  if (g.ldb < g.k || g.ldb % 8 != 0) fail("ldb must be >= k and a multiple of 8, got ldb=" + str(g.ldb) + " k=" + str(g.k));
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace
}  // namespace gemm

const char* gemmConfigName(const GemmParams& params) {
  const gemm::Resolved r = gemm::resolve(params);
  thread_local std::string name;
  name = "cluster" + std::to_string(r.clusterM) + (r.epi == gemm::Epilogue::kTmaStore ? "/tma" : "/direct") +
         "/group" + std::to_string(r.groupM);
  return name.c_str();
}

// Every variant pickVariant can return, so that none is loaded lazily mid-op (preload.hpp).
void preloadGemmKernels(int device) {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (int clusterM : {1, 2}) {
      for (gemm::Epilogue epi : {gemm::Epilogue::kTmaStore, gemm::Epilogue::kDirect}) {
        gemm::launchInfo(device, gemm::pickVariant(dt, clusterM, epi));
      }
    }
  }
}

void launchGemm(const GemmParams& g, cudaStream_t stream, int numSms) {
  using namespace gemm;
  validate(g);
  const Resolved r = resolve(g);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    checkCuda(cudaMemset2DAsync(g.c, static_cast<size_t>(g.ldc) * 2, 0, static_cast<size_t>(g.n) * 2,
                                static_cast<size_t>(g.m), stream),
              "cudaMemset2DAsync (k == 0)");
    return;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const Variant v = pickVariant(g.dtype, r.clusterM, r.epi);
  const LaunchInfo info = launchInfo(device, v);

  GemmKernelParams p;
  std::memset(&p, 0, sizeof(p));
  const auto u64 = [](int64_t x) { return static_cast<uint64_t>(x); };
  p.tmA = tensorMap({g.a, u64(g.m), u64(g.k), u64(g.lda), kBlockM, kBlockK, g.dtype});
  p.tmB = tensorMap({g.b, u64(g.n), u64(g.k), u64(g.ldb), static_cast<uint32_t>(kBlockN / r.clusterM), kBlockK, g.dtype});
  if (r.epi == Epilogue::kTmaStore) p.tmC = tensorMap({g.c, u64(g.m), u64(g.n), u64(g.ldc), kRowsPerConsumer, kEpiCols, g.dtype});
  p.c = g.c;
  p.ldc = g.ldc;
  p.m = static_cast<int32_t>(g.m);
  p.n = static_cast<int32_t>(g.n);
  p.k = static_cast<int32_t>(g.k);
  p.numKBlocks = static_cast<int32_t>(ceilDiv(g.k, kBlockK));
  p.unitsM = static_cast<int32_t>(ceilDiv(ceilDiv(g.m, kBlockM), r.clusterM));
  p.tilesN = static_cast<int32_t>(ceilDiv(g.n, kBlockN));
  p.groupM = std::max(1, r.groupM / r.clusterM);

  const int64_t work = static_cast<int64_t>(p.unitsM) * p.tilesN;
  if (work > 0x7fffffff) fail("too many tiles");
  int sms = numSms > 0 ? std::min(numSms, info.numSms) : info.numSms;
  int64_t clusters = std::min<int64_t>({sms / r.clusterM, info.maxClusters, work});
  clusters = std::max<int64_t>(clusters, 1);

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * r.clusterM), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmemBytes<kStages>;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(r.clusterM);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = r.clusterM > 1 ? 1 : 0;
  checkCuda(cudaLaunchKernelEx(&cfg, v.fn, p), "launching the GEMM kernel");
}

}  // namespace tandem::kernels
