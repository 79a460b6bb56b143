// The GEMM core in every operand layout (gemm_layouts.hpp): the kernels and the host launcher (validation, TMA
// descriptors, launch geometry). The plan rule: gemm_layouts_plan.cpp. Device building blocks:
// device/gemm_layouts_sm90.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "device/gemm_layouts_sm90.cuh"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace gemm_layouts {

// One CTA: warpgroup 0 produces (TMA), warpgroups 1..2 consume (wgmma + epilogue). Persistent over the work units.
template <class T, class Out, int BN, bool Swapped, Major MX, Major MY>
__global__ void __launch_bounds__(kThreads, 1) gemmLayoutKernel(const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runCta<T, Out, BN, Swapped, MX, MY>(p, smemRaw, static_cast<int32_t>(blockIdx.x),
                                      static_cast<int32_t>(gridDim.x));
}

namespace {

constexpr int kTiledN = 256;
constexpr int kMaxSplits = kGemmLayoutMaxSplits;
constexpr int kGroupRows = 16;  // raster group height in 128-row tiles (L2 reuse), as the forward core
// The rule (gemm_layouts_plan.cpp) plans in the kernels' geometry.
static_assert(kGemmLayoutBlockRows == kBlockRows && kGemmLayoutBlockK == kBlockK);

// Split-K workspace: the arrival counters live in a fixed area at its start, the same for every plan and shape, and
// the partial tiles after it. A counter area sized per plan would let one plan's partial tiles land on another plan's
// counters when the two share a workspace: those counters would never count to the split count and their tiles
// would never be stored.
constexpr size_t kCounterAreaBytes = static_cast<size_t>(kGemmLayoutMaxSplitTiles) * sizeof(uint64_t);
static_assert(kCounterAreaBytes % 256 == 0, "partials start 256-byte aligned");

[[noreturn]] void invalid(const std::string& msg) { throw std::invalid_argument("tandem gemm_layouts: " + msg); }
[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tandem gemm_layouts: " + msg); }

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
std::string str(int64_t v) { return std::to_string(v); }

const char* layoutName(GemmLayout l) {
  switch (l) {
    case GemmLayout::kABt:
      return "kABt";
    case GemmLayout::kAB:
      return "kAB";
    case GemmLayout::kAtB:
      return "kAtB";
  }
  return "?";
}

// ---- kernel variants ------------------------------------------------------------------------------------------

using KernelFn = void (*)(KernelParams);

struct Variant {
  KernelFn fn;
  size_t smemBytes;
};

template <class T, class Out, int BN, bool Swapped, Major MX, Major MY>
Variant variant() {
  static_assert(kSmemBytes<BN, !Swapped> <= kSmemLimit, "shared memory over the H100/H200 opt-in limit");
  return {&gemmLayoutKernel<T, Out, BN, Swapped, MX, MY>, kSmemBytes<BN, !Swapped>};
}

// kTiled: X = A, Y = B (see the table in gemm_layouts_sm90.cuh).
template <class T, class Out>
Variant tiledVariant(GemmLayout l) {
  switch (l) {
    case GemmLayout::kABt:
      return variant<T, Out, kTiledN, false, Major::kK, Major::kK>();
    case GemmLayout::kAB:
      return variant<T, Out, kTiledN, false, Major::kK, Major::kMN>();
    case GemmLayout::kAtB:
      return variant<T, Out, kTiledN, false, Major::kMN, Major::kMN>();
  }
  invalid("unknown layout");
}

// kSwapAB: X = B (the weight), Y = A (the token rows, K-major in both layouts); the output type is a kernel argument.
template <class T, int BN>
Variant swapVariant(GemmLayout l) {
  return l == GemmLayout::kABt ? variant<T, T, BN, true, Major::kK, Major::kK>()
                               : variant<T, T, BN, true, Major::kMN, Major::kK>();
}

template <class T>
Variant swapVariant(GemmLayout l, int tileN) {
  switch (tileN) {
    case 16:
      return swapVariant<T, 16>(l);
    case 64:
      return swapVariant<T, 64>(l);
    case 128:
      return swapVariant<T, 128>(l);
    case 256:
      return swapVariant<T, 256>(l);
  }
  invalid("kSwapAB tileN must be 16, 64, 128 or 256, got " + str(tileN));
}

Variant pickVariant(const GemmLayoutParams& g, const GemmLayoutPlan& plan) {
  const bool bf = g.dtype == GemmDtype::kBf16;
  if (plan.path == GemmPath::kSwapAB) {
    return bf ? swapVariant<__nv_bfloat16>(g.layout, plan.tileN) : swapVariant<__half>(g.layout, plan.tileN);
  }
  const bool f32 = g.out == GemmOut::kFp32;
  if (bf) return f32 ? tiledVariant<__nv_bfloat16, float>(g.layout) : tiledVariant<__nv_bfloat16, __nv_bfloat16>(g.layout);
  return f32 ? tiledVariant<__half, float>(g.layout) : tiledVariant<__half, __half>(g.layout);
}

// ---- per-device launch facts ----------------------------------------------------------------------------------

int deviceSms(int device) {
  static std::mutex mu;
  static std::array<int, 64> sms{};  // 0: not read yet
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= static_cast<int>(sms.size())) fail("device ordinal " + str(device) + " out of range");
  if (sms[device] == 0) {
    int major = 0, minor = 0, count = 0;
    checkCuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    checkCuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
    if (major != 9 || minor != 0) {
      fail("needs an sm_90 (Hopper) GPU; device " + str(device) + " is sm_" + str(major) + str(minor));
    }
    checkCuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    sms[device] = count;
  }
  return sms[device];
}

// The opt-in shared-memory size, set once per (device, kernel).
void prepareKernel(int device, const Variant& v) {
  static std::mutex mu;
  static std::array<std::pair<int, KernelFn>, 256> done{};
  static size_t used = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (size_t i = 0; i < used; ++i) {
    if (done[i].first == device && done[i].second == v.fn) return;
  }
  checkCuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(v.fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(v.smemBytes)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (used < done.size()) done[used++] = {device, v.fn};
}

// ---- TMA descriptors --------------------------------------------------------------------------------------------

// Row-major [rows, cols] of 2-byte elements, boxes of boxRows x boxCols, 128-byte swizzle (cached).
CUtensorMap map16(const void* ptr, int64_t rows, int64_t cols, int64_t ld, uint32_t boxRows, uint32_t boxCols,
                  GemmDtype dt, const char* what) {
  static TensorMapCache cache;
  const auto u64 = [](int64_t x) { return static_cast<uint64_t>(x); };
  const TensorMapKey key = TensorMapKey::matrix(ptr, u64(rows), u64(cols), u64(ld), boxRows, boxCols, dt);
  CUtensorMap map;
  const CUresult r = cache.get(key, &map);
  if (r != CUDA_SUCCESS) {
    fail(std::string("cuTensorMapEncodeTiled failed for ") + what + " (" + driverErrorName(r) + "): " + str(rows) +
         "x" + str(cols) + ", ld " + str(ld));
  }
  return map;
}

// Row-major fp32 [rows, cols], boxes of 64 rows x 32 columns (128 bytes), 128-byte swizzle: the fp32 C of kTiled.
CUtensorMap mapF32(void* ptr, int64_t rows, int64_t cols, int64_t ld) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 4};
  const cuuint32_t box[2] = {32, static_cast<cuuint32_t>(kRowsPerConsumer)};
  const cuuint32_t elemStrides[2] = {1, 1};
  CUtensorMap map;
  const CUresult r = tensorMapEncodeTiled()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, ptr, dims, strides, box,
                                            elemStrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fail(std::string("cuTensorMapEncodeTiled failed for C (") + driverErrorName(r) + "): " + str(rows) + "x" +
         str(cols) + ", ld " + str(ld));
  }
  return map;
}

// ---- shapes -------------------------------------------------------------------------------------------------------

// Row lengths of A and B as stored.
int64_t aRowLength(const GemmLayoutParams& g) { return g.layout == GemmLayout::kAtB ? g.m : g.k; }
int64_t bRowLength(const GemmLayoutParams& g) { return g.layout == GemmLayout::kABt ? g.k : g.n; }

void validate(const GemmLayoutParams& g) {
  if (g.layout != GemmLayout::kABt && g.layout != GemmLayout::kAB && g.layout != GemmLayout::kAtB) {
    invalid("layout must be kABt, kAB or kAtB, got " + str(static_cast<int>(g.layout)));
  }
  if (g.dtype != GemmDtype::kBf16 && g.dtype != GemmDtype::kFp16) {
    invalid("dtype must be kBf16 or kFp16, got " + str(static_cast<int>(g.dtype)));
  }
  if (g.out != GemmOut::kInput && g.out != GemmOut::kFp32) {
    invalid("out must be kInput or kFp32, got " + str(static_cast<int>(g.out)));
  }
  if (g.m < 0 || g.n < 0 || g.k < 0) invalid("negative size m=" + str(g.m) + " n=" + str(g.n) + " k=" + str(g.k));
  constexpr int64_t kMax = 0x7fffffff;
  if (g.m > kMax || g.n > kMax || g.k > kMax) invalid("m, n and k must each be below 2^31");
  if (g.m == 0 || g.n == 0) return;
  if (g.c == nullptr) invalid("c is null");
  if (reinterpret_cast<uintptr_t>(g.c) % 16 != 0) invalid("c must be 16-byte aligned");
  const int64_t cAlign = g.out == GemmOut::kFp32 ? 4 : 8;
  if (g.ldc < g.n || g.ldc % cAlign != 0) {
    invalid("ldc must be >= n and a multiple of " + str(cAlign) + ", got ldc=" + str(g.ldc) + " n=" + str(g.n));
  }
  if (g.k == 0) return;
  if (g.a == nullptr || g.b == nullptr) invalid("a or b is null");
  if (reinterpret_cast<uintptr_t>(g.a) % 16 != 0 || reinterpret_cast<uintptr_t>(g.b) % 16 != 0) {
    invalid("a and b must be 16-byte aligned");
  }
  if (g.c == g.a || g.c == g.b) invalid("c must not alias a or b");
  const char* aLen = g.layout == GemmLayout::kAtB ? "m" : "k";
  const char* bLen = g.layout == GemmLayout::kABt ? "k" : "n";
  if (g.lda < aRowLength(g) || g.lda % 8 != 0) {
    invalid(std::string("lda must be >= ") + aLen + " (A is stored " +
            (g.layout == GemmLayout::kAtB ? "[k, m]" : "[m, k]") + " in layout " + layoutName(g.layout) +
            ") and a multiple of 8, got lda=" + str(g.lda) + " " + aLen + "=" + str(aRowLength(g)));
  }
  if (g.ldb < bRowLength(g) || g.ldb % 8 != 0) {
    invalid(std::string("ldb must be >= ") + bLen + " (B is stored " +
            (g.layout == GemmLayout::kABt ? "[n, k]" : "[k, n]") + " in layout " + layoutName(g.layout) +
            ") and a multiple of 8, got ldb=" + str(g.ldb) + " " + bLen + "=" + str(bRowLength(g)));
  }
}

// Extents of D (wgmma M and N directions) and its tiles under `plan`.
struct Tiling {
  int64_t rows, cols;
  int64_t tilesRows, tilesCols;
  int64_t numKBlocks;
  int64_t splits, kBlocksPerSplit;  // normalised: every split non-empty
  int64_t tiles() const { return tilesRows * tilesCols; }
};

Tiling tilingOf(const GemmLayoutParams& g, const GemmLayoutPlan& plan) {
  Tiling t{};
  const bool swap = plan.path == GemmPath::kSwapAB;
  t.rows = swap ? g.n : g.m;
  t.cols = swap ? g.m : g.n;
  t.tilesRows = ceilDiv(t.rows, kBlockRows);
  t.tilesCols = ceilDiv(t.cols, plan.tileN);
  t.numKBlocks = std::max<int64_t>(1, ceilDiv(g.k, kBlockK));
  // More tiles than the counter area holds: no split (such a GEMM fills the GPU many times over without one).
  const int64_t maxSplits = t.tiles() > kGemmLayoutMaxSplitTiles ? 1 : std::min<int64_t>(kMaxSplits, t.numKBlocks);
  const int64_t want = std::clamp<int64_t>(plan.splits, 1, maxSplits);
  t.kBlocksPerSplit = ceilDiv(t.numKBlocks, want);
  t.splits = ceilDiv(t.numKBlocks, t.kBlocksPerSplit);
  return t;
}

void validatePlan(const GemmLayoutParams& g, const GemmLayoutPlan& plan) {
  if (plan.path == GemmPath::kSwapAB) {
    if (g.layout == GemmLayout::kAtB) invalid("plan kSwapAB takes layouts kABt and kAB only, not kAtB");
    if (plan.tileN != 16 && plan.tileN != 64 && plan.tileN != 128 && plan.tileN != 256) {
      invalid("plan kSwapAB: tileN must be 16, 64, 128 or 256, got " + str(plan.tileN));
    }
  } else if (plan.path == GemmPath::kTiled) {
    if (plan.tileN != kTiledN) invalid("plan kTiled: tileN must be 256, got " + str(plan.tileN));
  } else {
    invalid("plan path must be kTiled or kSwapAB, got " + str(static_cast<int>(plan.path)));
  }
  if (plan.splits < 1 || plan.splits > kMaxSplits) {
    invalid("plan splits must be 1.." + str(kMaxSplits) + ", got " + str(plan.splits));
  }
}

size_t workspaceBytes(const Tiling& t, const GemmLayoutPlan& plan) {
  if (t.splits <= 1) return 0;
  const size_t tileFloats = static_cast<size_t>(kBlockRows) * static_cast<size_t>(plan.tileN);
  return kCounterAreaBytes +
         static_cast<size_t>(t.tiles()) * static_cast<size_t>(t.splits) * tileFloats * sizeof(float);
}

}  // namespace
}  // namespace gemm_layouts

size_t gemmLayoutWorkspaceBytes(const GemmLayoutParams& params, const GemmLayoutPlan& plan) {
  using namespace gemm_layouts;
  validatePlan(params, plan);
  if (params.m <= 0 || params.n <= 0 || params.k <= 0) return 0;
  return workspaceBytes(tilingOf(params, plan), plan);
}

GemmLayoutPlan gemmLayoutDefaultPlan(const GemmLayoutParams& params) {
  int device = 0;
  gemm_layouts::checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  return gemmPlanFor(params.layout, params.m, params.n, params.k, gemm_layouts::deviceSms(device));
}

GemmLayoutPlan gemmLayoutPlanWithin(const GemmLayoutParams& params) {
  GemmLayoutPlan plan = gemmLayoutDefaultPlan(params);
  const size_t room = params.workspace != nullptr ? params.workspaceBytes : 0;
  while (plan.splits > 1 && gemmLayoutWorkspaceBytes(params, plan) > room) --plan.splits;
  return plan;
}

void preloadGemmLayoutKernels(int device) {
  using namespace gemm_layouts;
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  GemmLayoutParams g{};
  const GemmLayout layouts[] = {GemmLayout::kABt, GemmLayout::kAB, GemmLayout::kAtB};
  const GemmDtype dtypes[] = {GemmDtype::kBf16, GemmDtype::kFp16};
  const GemmOut outs[] = {GemmOut::kInput, GemmOut::kFp32};
  const int swapTiles[] = {16, 64, 128, 256};
  cudaError_t e = cudaSuccess;
  const auto load = [&](const Variant& v) {
    cudaFuncAttributes fa{};
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(v.fn));
  };
  for (GemmLayout l : layouts) {
    for (GemmDtype dt : dtypes) {
      g.layout = l;
      g.dtype = dt;
      for (GemmOut o : outs) {
        g.out = o;
        load(pickVariant(g, GemmLayoutPlan{GemmPath::kTiled, kTiledN, 1}));
      }
      if (l == GemmLayout::kAtB) continue;
      for (int n : swapTiles) load(pickVariant(g, GemmLayoutPlan{GemmPath::kSwapAB, n, 1}));
    }
  }
  cudaSetDevice(previous);
  checkCuda(e, "loading the layout GEMM kernels");
}

void launchGemmLayout(const GemmLayoutParams& g, cudaStream_t stream, const GemmLayoutPlan* planIn) {
  using namespace gemm_layouts;
  validate(g);
  if (g.m == 0 || g.n == 0) return;
  const size_t cElem = g.out == GemmOut::kFp32 ? 4 : 2;
  if (g.k == 0) {
    checkCuda(cudaMemset2DAsync(g.c, static_cast<size_t>(g.ldc) * cElem, 0, static_cast<size_t>(g.n) * cElem,
                                static_cast<size_t>(g.m), stream),
              "cudaMemset2DAsync (k == 0)");
    return;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const int numSms = deviceSms(device);
  const GemmLayoutPlan plan = planIn != nullptr ? *planIn : gemmPlanFor(g.layout, g.m, g.n, g.k, numSms);
  validatePlan(g, plan);
  const Tiling t = tilingOf(g, plan);
  const size_t wsNeeded = workspaceBytes(t, plan);
  if (wsNeeded > 0) {
    if (g.workspace == nullptr || g.workspaceBytes < wsNeeded) {
      invalid("plan " + gemmPlanName(plan) + " needs a workspace of " + str(static_cast<int64_t>(wsNeeded)) +
              " bytes (gemmLayoutWorkspaceBytes), got " + str(static_cast<int64_t>(g.workspaceBytes)) +
              (g.workspace == nullptr ? " (null)" : ""));
    }
    if (reinterpret_cast<uintptr_t>(g.workspace) % 16 != 0) invalid("workspace must be 16-byte aligned");
  }
  const int64_t work = t.tiles() * t.splits;
  if (work > 0x7fffffff) invalid("too many tiles: " + str(work));

  const Variant v = pickVariant(g, plan);
  prepareKernel(device, v);

  KernelParams p;
  std::memset(&p, 0, sizeof(p));
  const bool swap = plan.path == GemmPath::kSwapAB;
  const uint32_t bk = static_cast<uint32_t>(kBlockK);
  if (swap) {
    // X = the weight B; Y = A's token rows (K-major), boxes of tileN rows.
    p.tmX = g.layout == GemmLayout::kABt ? map16(g.b, g.n, g.k, g.ldb, kBlockRows, bk, g.dtype, "B [n, k]")
                                         : map16(g.b, g.k, g.n, g.ldb, bk, 64, g.dtype, "B [k, n]");
    p.tmY = map16(g.a, g.m, g.k, g.lda, static_cast<uint32_t>(plan.tileN), bk, g.dtype, "A [m, k]");
  } else {
    p.tmX = g.layout == GemmLayout::kAtB ? map16(g.a, g.k, g.m, g.lda, bk, 64, g.dtype, "A [k, m]")
                                         : map16(g.a, g.m, g.k, g.lda, kBlockRows, bk, g.dtype, "A [m, k]");
    p.tmY = g.layout == GemmLayout::kABt ? map16(g.b, g.n, g.k, g.ldb, kTiledN, bk, g.dtype, "B [n, k]")
                                         : map16(g.b, g.k, g.n, g.ldb, bk, 64, g.dtype, "B [k, n]");
    p.tmC = g.out == GemmOut::kFp32 ? mapF32(g.c, g.m, g.n, g.ldc)
                                    : map16(g.c, g.m, g.n, g.ldc, kRowsPerConsumer, 64, g.dtype, "C [m, n]");
  }
  p.c = g.c;
  p.ldc = g.ldc;
  if (wsNeeded > 0) {
    p.counters = static_cast<uint64_t*>(g.workspace);
    p.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(g.workspace) + kCounterAreaBytes);
  }
  p.rows = static_cast<int32_t>(t.rows);
  p.cols = static_cast<int32_t>(t.cols);
  p.numKBlocks = static_cast<int32_t>(t.numKBlocks);
  p.splits = static_cast<int32_t>(t.splits);
  p.kBlocksPerSplit = static_cast<int32_t>(t.kBlocksPerSplit);
  p.tilesRows = static_cast<int32_t>(t.tilesRows);
  p.tilesCols = static_cast<int32_t>(t.tilesCols);
  p.groupRows = kGroupRows;
  p.outF32 = g.out == GemmOut::kFp32 ? 1 : 0;

  const int64_t ctas = std::min<int64_t>(work, numSms);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = v.smemBytes;
  cfg.stream = stream;
  checkCuda(cudaLaunchKernelEx(&cfg, v.fn, p), "launching the layout GEMM kernel");
}

}  // namespace tandem::kernels
