// The grouped GEMM's swap-AB path, host side: tensor maps, the grid and the launch. The kernels are in
// grouped_gemm_swap.cu; launchGroupedGemm (grouped_gemm.cpp) validates the arguments and picks this path by the plan
// rule (grouped_gemm_plan.cpp).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "grouped_gemm_swap_desc.hpp"
#include "launch_support.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels::grouped_swap {
namespace {

constexpr uint32_t kBoxK = 64;  // gemm_layouts::kBlockK
constexpr int64_t kMax32 = 0x7fffffff;
constexpr int kTileWidths[] = {16, 64, 128};

void checkCuda(cudaError_t e, const char* what) { checkCudaFor("grouped gemm (swap-AB)", e, what); }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }

// 2D and 3D maps through the shared cache (tensor_map_cache.hpp).
CUtensorMap cachedMap(const TensorMapKey& k) {
  return cachedTensorMap("grouped gemm (swap-AB)", k);
}

// The SwiGLU weight w [E, 2f, k] as {k, 8, 2, f / 8, E}: row in an 8-row group, gate or up, group, expert. One
// {64, 8, 2, 8, 1} box is 16 atoms of 8 rows x 128 bytes alternating gate and up (grouped_gemm_swap_desc.hpp). The
// cache holds up to 4 dims, so this map is encoded per launch (about a microsecond of host time).
CUtensorMap swigluWeightMap(const GroupedGemmParams& g) {
  const int64_t f = g.n / 2;
  const cuuint64_t dims[5] = {u64(g.k), u64(kSwiGluGroupRows), 2, u64(f / kSwiGluGroupRows), u64(g.numExperts)};
  const cuuint64_t strides[4] = {u64(g.k) * 2, u64(f * g.k) * 2, u64(kSwiGluGroupRows * g.k) * 2, u64(g.n * g.k) * 2};
  const cuuint32_t box[5] = {kBoxK, kSwiGluGroupRows, 2, kSwiGluTileCols / kSwiGluGroupRows, 1};
  const cuuint32_t elemStrides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType dt =
      g.dtype == GemmDtype::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  CUresult r = CUDA_SUCCESS;
  try {
    r = tensorMapEncodeTiled()(&map, dt, 5, const_cast<void*>(g.w), dims, strides, box, elemStrides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } catch (const std::runtime_error& e) {
    fail(ErrorCode::kCuda, "grouped gemm (swap-AB): {}", e.what());
  }
  if (r != CUDA_SUCCESS) {
    fail(ErrorCode::kCuda,
         "grouped gemm (swap-AB): cuTensorMapEncodeTiled failed for the SwiGLU weight as {{k, 8, 2, f/8, E}} = "
         "{{{}, 8, 2, {}, {}}} [-> {}]. Force the tiled path (GroupedGemmParams::path = kTiled)",
         g.k, f / kSwiGluGroupRows, g.numExperts, driverErrorName(r));
  }
  return map;
}

// Loaded once per (device, variant): launch_support.hpp.
int prepare(int device, GemmDtype dtype, GroupedGemmEpilogue epi, int tileN) {
  const uint32_t variant = (static_cast<uint32_t>(dtype) * 2 + static_cast<uint32_t>(epi)) * 1024 +
                           static_cast<uint32_t>(tileN);
  return prepareOnce("grouped gemm (swap-AB)", device, variant, [&] { return swapPrepare(dtype, epi, tileN); });
}

}  // namespace

void launchGroupedGemmSwap(const GroupedGemmParams& g, const GroupedGemmPlan& plan, cudaStream_t stream, int numSms) {
  if (std::find(std::begin(kTileWidths), std::end(kTileWidths), plan.tileN) == std::end(kTileWidths)) {
    fail(ErrorCode::kInvalidArgument, "grouped gemm (swap-AB): token tile width must be 16, 64 or 128, got {}",
         plan.tileN);
  }
  const bool swiglu = g.epilogue == GroupedGemmEpilogue::kSwiGlu;
  const int64_t nOut = swiglu ? g.n / 2 : g.n;
  const int64_t tilesW = ceilDiv(nOut, swiglu ? kSwiGluTileCols : kStoreTileCols);
  // Token tiles: each group of r rows has ceil(r / tileN) <= r / tileN + 1, and at most min(E, mTotal) groups have
  // rows. The device scan's unit indices reach up to about twice the unit count.
  const int64_t maxUnits = (g.mTotal / plan.tileN + std::min(g.numExperts, g.mTotal)) * tilesW;
  if (2 * maxUnits > kMax32) {
    fail(ErrorCode::kInvalidArgument,
         "grouped gemm (swap-AB): too many work units ({}, at most 2^30): split the experts over several launches or "
         "force the tiled path (GroupedGemmParams::path = kTiled)",
         maxUnits);
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const int sms = prepare(device, g.dtype, g.epilogue, plan.tileN);

  SwapKernelParams p;
  std::memset(&p, 0, sizeof(p));
  const int64_t ldx = g.ldx == 0 ? g.k : g.ldx;
  p.tmX = cachedMap(TensorMapKey::matrix(g.x, u64(g.mTotal), u64(g.k), u64(ldx), static_cast<uint32_t>(plan.tileN),
                                         kBoxK, g.dtype));
  if (swiglu) {
    p.tmW = swigluWeightMap(g);
  } else {
    p.tmW = cachedMap({g.w, 3, {u64(g.k), u64(g.n), u64(g.numExperts), 1}, {u64(g.k) * 2, u64(g.n * g.k) * 2, 0},
                       {kBoxK, kWeightTileRows, 1, 1}, g.dtype});
  }
  p.out = g.out;
  p.ldOut = g.ldOut == 0 ? nOut : g.ldOut;
  p.groupOffsets = g.groupOffsets;
  p.rowScale = g.rowScale;
  p.rowTileReady = g.rowTileReady;
  p.readyValue = g.readyValue;
  p.abortWord = g.abortWord;
  p.errorSlot = g.errorSlot;
  p.timeoutNs = g.timeoutNs;
  p.mTotal = static_cast<int32_t>(g.mTotal);
  p.nOut = static_cast<int32_t>(nOut);
  p.numKBlocks = static_cast<int32_t>(ceilDiv(g.k, kBoxK));
  p.numExperts = static_cast<int32_t>(g.numExperts);
  p.tilesW = static_cast<int32_t>(tilesW);

  // Persistent: one CTA per SM, fewer when even the most units any grouping can have would not fill them.
  const int64_t cap = numSms > 0 ? std::min(numSms, sms) : sms;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min(cap, maxUnits)));
  checkCuda(swapLaunchKernel(p, g.dtype, g.epilogue, plan.tileN, ctas, stream),
            "launching the swap-AB grouped GEMM kernel");
}

void preloadGroupedGemmSwapKernels(int device) {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (GroupedGemmEpilogue epi : {GroupedGemmEpilogue::kStore, GroupedGemmEpilogue::kSwiGlu}) {
      for (int n : kTileWidths) prepare(device, dt, epi, n);
    }
  }
}

}  // namespace tandem::kernels::grouped_swap
