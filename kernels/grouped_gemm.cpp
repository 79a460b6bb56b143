// Grouped GEMM host launcher: the shape and pointer rules, the tensor maps, the persistent grid. The kernels are in
// grouped_gemm.cu (nvcc cannot compile fmt, which tandem::Error's helpers use, so the host side lives here).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "tandem/kernels/driver.hpp"
#include "grouped_gemm_desc.hpp"
#include "grouped_gemm_swap_desc.hpp"
#include "launch_support.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/grouped_gemm_plan.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace grouped {
namespace {

constexpr int kBoxK = 64;            // gemm::kBlockK
constexpr int kMnBox = 64;           // grouped::kMnBoxCols: an MN-major w's {64 columns, 64 k} box
constexpr int kEpiBox = 64;          // gemm::kEpiCols and gemm::kRowsPerConsumer
constexpr int64_t kMax32 = 0x7fffffff;

void checkCuda(cudaError_t e, const char* what) { checkCudaFor("grouped gemm", e, what); }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t outCols(const GroupedGemmParams& g) { return g.epilogue == GroupedGemmEpilogue::kSwiGlu ? g.n / 2 : g.n; }
int64_t tileCols(const GroupedGemmParams& g) {
  return g.epilogue == GroupedGemmEpilogue::kSwiGlu ? kSwiGluTileCols : kStoreTileCols;
}
int64_t ldxOf(const GroupedGemmParams& g) { return g.ldx == 0 ? g.k : g.ldx; }
int64_t ldOutOf(const GroupedGemmParams& g) { return g.ldOut == 0 ? outCols(g) : g.ldOut; }

// Tensor maps (tensor_map_cache.hpp): 2-byte elements, 128-byte swizzle, up to 4 dims (innermost first).
CUtensorMap tensorMap(const TensorMapKey& k) {
  return cachedTensorMap("grouped gemm", k);
}

// Loaded once per (device, variant): launch_support.hpp.
int prepare(int device, GroupedGemmVariant v) {
  const uint32_t variant =
      (static_cast<uint32_t>(v.dtype) * 2 + static_cast<uint32_t>(v.epi)) * 2 + (v.layout == GemmLayout::kAB ? 1 : 0);
  return prepareOnce("grouped gemm", device, variant, [&] { return groupedGemmPrepare(v); });
}

}  // namespace
}  // namespace grouped

int64_t groupedGemmMaxRowTiles(int64_t mTotal, int64_t numExperts) {
  return grouped::ceilDiv(std::max<int64_t>(mTotal, 0), grouped::kTileRows) + std::max<int64_t>(numExperts, 0);
}

void validateGroupedGemm(const GroupedGemmParams& g) {
  using namespace grouped;
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  if (g.dtype != GemmDtype::kBf16 && g.dtype != GemmDtype::kFp16) {
    fail(kBad, "grouped gemm: dtype must be bf16 or fp16 (GemmDtype), got {}", static_cast<int>(g.dtype));
  }
  const bool swiglu = g.epilogue == GroupedGemmEpilogue::kSwiGlu;
  if (g.epilogue != GroupedGemmEpilogue::kStore && !swiglu) {
    fail(kBad, "grouped gemm: epilogue must be kStore or kSwiGlu, got {}", static_cast<int>(g.epilogue));
  }
  const bool nMajorW = g.layout == GemmLayout::kAB;
  if (g.layout != GemmLayout::kABt && !nMajorW) {
    fail(kBad,
         "grouped gemm: layout must be kABt (w [E, n, k]) or kAB (w [E, k, n]), got {}; x is always [mTotal, k] "
         "(K-major), so kAtB has no grouped form",
         static_cast<int>(g.layout));
  }
  if (nMajorW && swiglu) {
    fail(kBad,
         "grouped gemm: the SwiGLU epilogue takes layout kABt only (w [E, 2f, k]); with layout kAB use epilogue "
         "kStore, or store the gate|up weight as [E, 2f, k]");
  }
  if (g.mTotal < 0 || g.n < 0 || g.k < 0 || g.numExperts < 0) {
    fail(kBad, "grouped gemm: sizes must be >= 0, got mTotal={} n={} k={} numExperts={}", g.mTotal, g.n, g.k,
         g.numExperts);
  }
  if (g.mTotal > kMax32 || g.n > kMax32 || g.k > kMax32 || g.numExperts > kMax32) {
    fail(kBad, "grouped gemm: mTotal, n, k and numExperts must each be below 2^31, got mTotal={} n={} k={} numExperts={}",
         g.mTotal, g.n, g.k, g.numExperts);
  }
  if (g.k == 0 || g.k % 8 != 0) {
    fail(kBad, "grouped gemm: k must be a positive multiple of 8 (16-byte TMA row strides), got k={}; pad K with zeros",
         g.k);
  }
  if (nMajorW && g.n % 8 != 0) {
    fail(kBad,
         "grouped gemm: with layout kAB, n must be a multiple of 8 (w [E, k, n]'s rows are n elements: 16-byte TMA "
         "strides; also out's rows), got n={}; pad n with zero columns of w",
         g.n);
  }
  if (!swiglu && g.n % 8 != 0) {
    fail(kBad, "grouped gemm: n must be a multiple of 8 (16-byte rows of out), got n={}; pad n with zero rows of w",
         g.n);
  }
  if (swiglu && g.n % 16 != 0) {
    fail(kBad,
         "grouped gemm: with the SwiGLU epilogue n = 2f must be a multiple of 16 (f a multiple of 8, 16-byte rows of "
         "h), got n={}; pad f",
         g.n);
  }
  if (g.groupM < 0) fail(kBad, "grouped gemm: groupM must be >= 0 (0 = default), got {}", g.groupM);
  if (g.path != GroupedGemmPath::kAuto && g.path != GroupedGemmPath::kTiled && g.path != GroupedGemmPath::kSwapAB) {
    fail(kBad, "grouped gemm: path must be kAuto, kTiled or kSwapAB (GroupedGemmPath), got {}",
         static_cast<int>(g.path));
  }
  if (nMajorW && g.path == GroupedGemmPath::kSwapAB) {
    fail(kBad,
         "grouped gemm: the swap-AB path reads w [E, n, k] (layout kABt) only; with layout kAB use path kAuto or "
         "kTiled");
  }
  if (g.maxGroupRows < 0) {
    fail(kBad, "grouped gemm: maxGroupRows must be >= 0 (0 = no bound known), got {}", g.maxGroupRows);
  }
  const int64_t nOut = outCols(g);
  if (g.ldx != 0 && (g.ldx < g.k || g.ldx % 8 != 0 || g.ldx > kMax32)) {
    fail(kBad, "grouped gemm: ldx must be 0 (dense) or a multiple of 8 that is >= k and below 2^31, got ldx={} k={}",
         g.ldx, g.k);
  }
  if (g.ldOut != 0 && (g.ldOut < nOut || g.ldOut % 8 != 0 || g.ldOut > kMax32)) {
    fail(kBad,
         "grouped gemm: ldOut must be 0 (dense) or a multiple of 8 that is >= the output columns ({}) and below 2^31, "
         "got ldOut={}",
         nOut, g.ldOut);
  }
  if (g.mTotal == 0 || g.n == 0 || g.numExperts == 0) return;  // nothing to compute, nothing is read

  const int64_t tiles = groupedGemmMaxRowTiles(g.mTotal, g.numExperts) * ceilDiv(nOut, tileCols(g));
  if (2 * tiles > kMax32) {  // the device scan's work indices reach up to about twice the tile count
    fail(kBad, "grouped gemm: too many tiles ({}, at most 2^31 - 1): split the experts over several launches", tiles);
  }
  if (g.x == nullptr || g.w == nullptr || g.out == nullptr) {
    fail(kBad, "grouped gemm: x, w and out must be non-null (x={} w={} out={})", g.x, g.w, static_cast<void*>(g.out));
  }
  if (!aligned(g.x, 16) || !aligned(g.w, 16) || !aligned(g.out, 16)) {
    fail(kBad, "grouped gemm: x, w and out must be 16-byte aligned (TMA), got x={} w={} out={}", g.x, g.w,
         static_cast<void*>(g.out));
  }
  if (g.groupOffsets == nullptr || !aligned(g.groupOffsets, 4)) {
    fail(kBad, "grouped gemm: groupOffsets must point to numExperts + 1 = {} int32 in device memory (4-byte aligned)",
         g.numExperts + 1);
  }
  if (g.rowScale != nullptr && !aligned(g.rowScale, 4)) {
    fail(kBad, "grouped gemm: rowScale must be 4-byte aligned (fp32), got {}", static_cast<const void*>(g.rowScale));
  }
  if (g.rowTileReady != nullptr && !aligned(g.rowTileReady, 8)) {
    fail(kBad, "grouped gemm: rowTileReady must be 8-byte aligned (uint64 counters), got {}",
         static_cast<const void*>(g.rowTileReady));
  }
  if (g.tileCounter != nullptr && !aligned(g.tileCounter, 4)) {
    fail(kBad, "grouped gemm: tileCounter must be 4-byte aligned (a uint32), got {}", static_cast<void*>(g.tileCounter));
  }
  if (g.abortWord != nullptr && !aligned(g.abortWord, 8)) {
    fail(kBad, "grouped gemm: abortWord must be 8-byte aligned, got {}", static_cast<const void*>(g.abortWord));
  }
  const uint64_t xBytes = static_cast<uint64_t>((g.mTotal - 1) * ldxOf(g) + g.k) * 2;
  const uint64_t wBytes = static_cast<uint64_t>(g.numExperts) * static_cast<uint64_t>(g.n * g.k) * 2;
  const uint64_t outBytes = static_cast<uint64_t>((g.mTotal - 1) * ldOutOf(g) + nOut) * 2;
  if (overlaps(g.out, outBytes, g.x, xBytes) || overlaps(g.out, outBytes, g.w, wBytes) ||
      overlaps(g.out, outBytes, g.groupOffsets, static_cast<uint64_t>(g.numExperts + 1) * 4) ||
      overlaps(g.out, outBytes, g.rowScale, static_cast<uint64_t>(g.mTotal) * 4)) {
    fail(kBad, "grouped gemm: out must not overlap x, w, groupOffsets or rowScale (the kernel reads them while "
               "writing out); give out its own buffer");
  }
}

void launchGroupedGemm(const GroupedGemmParams& g, cudaStream_t stream, int numSms) {
  using namespace grouped;
  validateGroupedGemm(g);
  if (g.mTotal == 0 || g.n == 0 || g.numExperts == 0) return;
  // The swap-AB path reads K-major weights only, so layout kAB (the backward's dgrad) always tiles.
  const GroupedGemmPlan plan = g.layout == GemmLayout::kAB ? GroupedGemmPlan{}
                                                           : groupedGemmPlanFor(g.mTotal, g.maxGroupRows, g.path);
  if (plan.path == GroupedGemmPath::kSwapAB) {
    grouped_swap::launchGroupedGemmSwap(g, plan, stream, numSms);
    return;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const GroupedGemmVariant variant{g.dtype, g.epilogue, g.layout};
  const int sms = prepare(device, variant);
  const bool swiglu = g.epilogue == GroupedGemmEpilogue::kSwiGlu;
  const int64_t nOut = outCols(g);
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };

  GroupedGemmKernelParams p;
  std::memset(&p, 0, sizeof(p));
  p.tmX = tensorMap({g.x, 2, {u64(g.k), u64(g.mTotal), 1, 1}, {u64(ldxOf(g)) * 2, 0, 0},
                     {kBoxK, kTileRows, 1, 1}, g.dtype});
  if (swiglu) {
    const int64_t f = g.n / 2;
    p.tmW = tensorMap({g.w, 4, {u64(g.k), u64(f), 2, u64(g.numExperts)},
                       {u64(g.k) * 2, u64(f * g.k) * 2, u64(g.n * g.k) * 2}, {kBoxK, kSwiGluTileCols, 1, 1}, g.dtype});
  } else if (g.layout == GemmLayout::kAB) {
    // w [E, k, n]: n innermost, loaded MN-major in {64 columns, 64 k} boxes (device/grouped_gemm_sm90.cuh tmaLoadW).
    p.tmW = tensorMap({g.w, 3, {u64(g.n), u64(g.k), u64(g.numExperts), 1}, {u64(g.n) * 2, u64(g.n * g.k) * 2, 0},
                       {kMnBox, kBoxK, 1, 1}, g.dtype});
  } else {
    p.tmW = tensorMap({g.w, 3, {u64(g.k), u64(g.n), u64(g.numExperts), 1}, {u64(g.k) * 2, u64(g.n * g.k) * 2, 0},
                       {kBoxK, kStoreTileCols, 1, 1}, g.dtype});
  }
  p.tmOut = tensorMap({g.out, 2, {u64(nOut), u64(g.mTotal), 1, 1}, {u64(ldOutOf(g)) * 2, 0, 0},
                       {kEpiBox, kEpiBox, 1, 1}, g.dtype});
  grouped::fillTileOrder(p, g, nOut, ldOutOf(g), ceilDiv(g.k, kBoxK), tileCols(g));
  p.skipIdleHalves = g.skipIdleHalves != 0 ? 1 : 0;

  // Persistent: one CTA per SM, fewer when even the most tiles any grouping can have would not fill them.
  const int64_t maxTiles = groupedGemmMaxRowTiles(g.mTotal, g.numExperts) * p.tilesN;
  const int64_t cap = numSms > 0 ? std::min(numSms, sms) : sms;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min(cap, maxTiles)));
  checkCuda(groupedGemmLaunchKernel(p, variant, ctas, stream), "launching the grouped GEMM kernel");
}

void preloadGroupedGemmKernels(int device) {
  using namespace grouped;
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  try {
    for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
      prepare(device, {dt, GroupedGemmEpilogue::kStore, GemmLayout::kABt});
      prepare(device, {dt, GroupedGemmEpilogue::kSwiGlu, GemmLayout::kABt});
      prepare(device, {dt, GroupedGemmEpilogue::kStore, GemmLayout::kAB});
    }
    grouped_swap::preloadGroupedGemmSwapKernels(device);
  } catch (...) {
    cudaSetDevice(previous);
    throw;
  }
  checkCuda(cudaSetDevice(previous), "cudaSetDevice");
}

}  // namespace tandem::kernels
