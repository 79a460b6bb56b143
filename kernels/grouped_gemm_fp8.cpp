// FP8 grouped GEMM host launcher: the shape and pointer rules, the tensor maps, the persistent grid. The kernels are
// in grouped_gemm_fp8.cu (nvcc cannot compile fmt, which tandem::Error's helpers use, so the host side lives here).
#include "tandem/kernels/grouped_gemm_fp8.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "grouped_gemm_desc.hpp"
#include "grouped_gemm_fp8_desc.hpp"
#include "launch_support.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace grouped_fp8 {
namespace {

constexpr const char* kFamily = "grouped gemm fp8";
constexpr int kTileRows = grouped::kTileRows;
constexpr int kEpiRows = 64;    // gemm_fp8::kRowsPerConsumer: an epilogue chunk's rows
constexpr int kEpiBytes = 128;  // and its bytes per row
constexpr int64_t kMax32 = 0x7fffffff;

void checkCuda(cudaError_t e, const char* what) { checkCudaFor(kFamily, e, what); }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool swiGlu(const GroupedGemmFp8Params& g) { return g.epilogue == GroupedGemmEpilogue::kSwiGlu; }
int64_t outCols(const GroupedGemmFp8Params& g) { return swiGlu(g) ? g.n / 2 : g.n; }
int64_t outElemBytes(const GroupedGemmFp8Params& g) { return swiGlu(g) ? 1 : 2; }
int64_t tileCols(const GroupedGemmFp8Params& g) {
  return swiGlu(g) ? grouped::kSwiGluTileCols : grouped::kStoreTileCols;
}
int64_t ldxOf(const GroupedGemmFp8Params& g) { return g.ldx == 0 ? g.k : g.ldx; }
int64_t ldOutOf(const GroupedGemmFp8Params& g) { return g.ldOut == 0 ? outCols(g) : g.ldOut; }
int64_t ldxScaleOf(const GroupedGemmFp8Params& g) { return g.ldxScale == 0 ? gemmFp8ScaleALd(g.mTotal) : g.ldxScale; }
int64_t ldOutScaleOf(const GroupedGemmFp8Params& g) {
  return g.ldOutScale == 0 ? gemmFp8ScaleALd(g.mTotal) : g.ldOutScale;
}
int64_t wScaleCount(const GroupedGemmFp8Params& g) {
  if (g.wScaling == GroupedFp8WeightScaling::kPerExpert) return g.numExperts;
  return g.numExperts * ceilDiv(g.n, kBlockK) * ceilDiv(g.k, kBlockK);
}

// A tensor map of fp8 bytes (128-byte swizzle), bf16 (128-byte swizzle) or fp32 scales (no swizzle).
CUtensorMap tensorMap(TensorMapKey k, TensorMapElem elem, const char* what) {
  k.elem = elem;
  k.swizzle128 = elem != TensorMapElem::kF32;
  return cachedTensorMap(kFamily, k, what);
}

int prepare(int device, GroupedGemmEpilogue epi) {
  return prepareOnce(kFamily, device, static_cast<uint32_t>(epi), [&] { return groupedGemmFp8Prepare(epi); });
}

}  // namespace
}  // namespace grouped_fp8

void validateGroupedGemmFp8(const GroupedGemmFp8Params& g) {
  using namespace grouped_fp8;
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  const bool swiglu = swiGlu(g);
  if (g.epilogue != GroupedGemmEpilogue::kStore && !swiglu) {
    fail(kBad, "grouped gemm fp8: epilogue must be kStore or kSwiGlu, got {}", static_cast<int>(g.epilogue));
  }
  const bool blockW = g.wScaling == GroupedFp8WeightScaling::kBlock;
  if (!blockW && g.wScaling != GroupedFp8WeightScaling::kPerExpert) {
    fail(kBad, "grouped gemm fp8: wScaling must be kBlock or kPerExpert (GroupedFp8WeightScaling), got {}",
         static_cast<int>(g.wScaling));
  }
  if (g.mTotal < 0 || g.n < 0 || g.k < 0 || g.numExperts < 0) {
    fail(kBad, "grouped gemm fp8: sizes must be >= 0, got mTotal={} n={} k={} numExperts={}", g.mTotal, g.n, g.k,
         g.numExperts);
  }
  if (g.mTotal > kMax32 || g.n > kMax32 || g.k > kMax32 || g.numExperts > kMax32) {
    fail(kBad,
         "grouped gemm fp8: mTotal, n, k and numExperts must each be below 2^31, got mTotal={} n={} k={} "
         "numExperts={}",
         g.mTotal, g.n, g.k, g.numExperts);
  }
  if (g.k == 0 || g.k % 16 != 0) {
    fail(kBad,
         "grouped gemm fp8: k must be a positive multiple of 16 (16-byte TMA rows of fp8), got k={}; pad x and w "
         "with zero columns",
         g.k);
  }
  if (!swiglu && g.n % 8 != 0) {
    fail(kBad,
         "grouped gemm fp8: n must be a multiple of 8 (16-byte rows of bf16 out), got n={}; pad n with zero "
         "rows of w",
         g.n);
  }
  if (swiglu && g.n % 32 != 0) {
    fail(kBad,
         "grouped gemm fp8: with the SwiGLU epilogue n = 2f must be a multiple of 32 (f a multiple of 16: 16-byte "
         "rows of e4m3 h), got n={}; pad f",
         g.n);
  }
  if (swiglu && blockW && (g.n / 2) % kBlockK != 0) {
    fail(kBad,
         "grouped gemm fp8: with the SwiGLU epilogue and kBlock weight scales f = n / 2 must be a multiple of 128 "
         "(the up rows' 128 x 128 scale blocks then start at row f), got f={}; pad f to a multiple of 128 or use "
         "kPerExpert scales",
         g.n / 2);
  }
  if (g.groupM < 0) fail(kBad, "grouped gemm fp8: groupM must be >= 0 (0 = default), got {}", g.groupM);
  const int64_t nOut = outCols(g);
  if (g.ldx != 0 && (g.ldx < g.k || g.ldx % 16 != 0 || g.ldx > kMax32)) {
    fail(kBad,
         "grouped gemm fp8: ldx must be 0 (dense) or a multiple of 16 bytes that is >= k and below 2^31, got ldx={} "
         "k={}",
         g.ldx, g.k);
  }
  const int64_t outAlign = 16 / outElemBytes(g);
  if (g.ldOut != 0 && (g.ldOut < nOut || g.ldOut % outAlign != 0 || g.ldOut > kMax32)) {
    fail(kBad,
         "grouped gemm fp8: ldOut must be 0 (dense) or a multiple of {} that is >= the output columns ({}) and below "
         "2^31, got ldOut={}",
         outAlign, nOut, g.ldOut);
  }
  if (g.ldxScale != 0 && (g.ldxScale < g.mTotal || g.ldxScale % 4 != 0 || g.ldxScale > kMax32)) {
    fail(kBad,
         "grouped gemm fp8: ldxScale must be 0 (gemmFp8ScaleALd(mTotal)) or a multiple of 4 that is >= mTotal ({}), "
         "got ldxScale={}",
         g.mTotal, g.ldxScale);
  }
  if (swiglu && g.ldOutScale != 0 && (g.ldOutScale < g.mTotal || g.ldOutScale % 4 != 0 || g.ldOutScale > kMax32)) {
    fail(kBad,
         "grouped gemm fp8: ldOutScale must be 0 (gemmFp8ScaleALd(mTotal)) or a multiple of 4 that is >= mTotal "
         "({}), got ldOutScale={}",
         g.mTotal, g.ldOutScale);
  }
  if (g.mTotal == 0 || g.n == 0 || g.numExperts == 0) return;  // nothing to compute, nothing is read

  const int64_t tiles = groupedGemmMaxRowTiles(g.mTotal, g.numExperts) * ceilDiv(nOut, tileCols(g));
  if (2 * tiles > kMax32) {  // the device scan's work indices reach up to about twice the tile count
    fail(kBad, "grouped gemm fp8: too many tiles ({}, at most 2^31 - 1): split the experts over several launches",
         tiles);
  }
  if (g.x == nullptr || g.w == nullptr || g.out == nullptr || g.xScale == nullptr || g.wScale == nullptr) {
    fail(kBad, "grouped gemm fp8: x, xScale, w, wScale and out must be non-null (x={} xScale={} w={} wScale={} out={})",
         g.x, static_cast<const void*>(g.xScale), g.w, static_cast<const void*>(g.wScale), static_cast<void*>(g.out));
  }
  if (swiglu && g.outScale == nullptr) {
    fail(kBad,
         "grouped gemm fp8: the SwiGLU epilogue writes h's scales: outScale must point to [ceil(f / 128), "
         "ldOutScale] fp32");
  }
  if (!swiglu && g.outScale != nullptr) {
    fail(kBad, "grouped gemm fp8: outScale is written by the SwiGLU epilogue only; pass null with kStore");
  }
  if (!aligned(g.x, 16) || !aligned(g.w, 16) || !aligned(g.out, 16) || !aligned(g.xScale, 16)) {
    fail(kBad, "grouped gemm fp8: x, xScale, w and out must be 16-byte aligned (TMA), got x={} xScale={} w={} out={}",
         g.x, static_cast<const void*>(g.xScale), g.w, static_cast<void*>(g.out));
  }
  if (!aligned(g.wScale, 4) || !aligned(g.outScale, 4)) {
    fail(kBad, "grouped gemm fp8: wScale and outScale must be 4-byte aligned (fp32), got wScale={} outScale={}",
         static_cast<const void*>(g.wScale), static_cast<void*>(g.outScale));
  }
  if (g.groupOffsets == nullptr || !aligned(g.groupOffsets, 4)) {
    fail(kBad,
         "grouped gemm fp8: groupOffsets must point to numExperts + 1 = {} int32 in device memory (4-byte aligned)",
         g.numExperts + 1);
  }
  if (g.rowScale != nullptr && !aligned(g.rowScale, 4)) {
    fail(kBad, "grouped gemm fp8: rowScale must be 4-byte aligned (fp32), got {}",
         static_cast<const void*>(g.rowScale));
  }
  if (g.rowTileReady != nullptr && !aligned(g.rowTileReady, 8)) {
    fail(kBad, "grouped gemm fp8: rowTileReady must be 8-byte aligned (uint64 counters), got {}",
         static_cast<const void*>(g.rowTileReady));
  }
  if (g.tileCounter != nullptr && !aligned(g.tileCounter, 4)) {
    fail(kBad, "grouped gemm fp8: tileCounter must be 4-byte aligned (a uint32), got {}",
         static_cast<void*>(g.tileCounter));
  }
  if (g.abortWord != nullptr && !aligned(g.abortWord, 8)) {
    fail(kBad, "grouped gemm fp8: abortWord must be 8-byte aligned, got {}", static_cast<const void*>(g.abortWord));
  }
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const uint64_t xBytes = u64((g.mTotal - 1) * ldxOf(g) + g.k);
  const uint64_t xScaleBytes = u64((ceilDiv(g.k, kBlockK) - 1) * ldxScaleOf(g) + g.mTotal) * 4;
  const uint64_t wBytes = u64(g.numExperts) * u64(g.n * g.k);
  const uint64_t wScaleBytes = u64(wScaleCount(g)) * 4;
  const uint64_t outBytes = u64((g.mTotal - 1) * ldOutOf(g) + nOut) * u64(outElemBytes(g));
  const uint64_t outScaleBytes = swiglu ? u64((ceilDiv(nOut, kBlockK) - 1) * ldOutScaleOf(g) + g.mTotal) * 4 : 0;
  const uint64_t offsetsBytes = u64(g.numExperts + 1) * 4;
  const uint64_t rowScaleBytes = u64(g.mTotal) * 4;
  const auto hitsInput = [&](const void* p, uint64_t n) {
    return overlaps(p, n, g.x, xBytes) || overlaps(p, n, g.xScale, xScaleBytes) || overlaps(p, n, g.w, wBytes) ||
           overlaps(p, n, g.wScale, wScaleBytes) || overlaps(p, n, g.groupOffsets, offsetsBytes) ||
           overlaps(p, n, g.rowScale, rowScaleBytes);
  };
  if (hitsInput(g.out, outBytes) || hitsInput(g.outScale, outScaleBytes) ||
      overlaps(g.out, outBytes, g.outScale, outScaleBytes)) {
    fail(kBad,
         "grouped gemm fp8: out and outScale must not overlap each other or x, xScale, w, wScale, groupOffsets or "
         "rowScale (the kernel reads those while writing); give each output its own buffer");
  }
}

void launchGroupedGemmFp8(const GroupedGemmFp8Params& g, cudaStream_t stream, int numSms) {
  using namespace grouped_fp8;
  validateGroupedGemmFp8(g);
  if (g.mTotal == 0 || g.n == 0 || g.numExperts == 0) return;
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const int sms = prepare(device, g.epilogue);
  const bool swiglu = swiGlu(g);
  const int64_t nOut = outCols(g);
  const int64_t numKBlocks = ceilDiv(g.k, kBlockK);
  const bool blockW = g.wScaling == GroupedFp8WeightScaling::kBlock;
  const auto u64 = [](int64_t v) { return static_cast<uint64_t>(v); };
  const auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };

  GroupedGemmFp8KernelParams p;
  std::memset(&p, 0, sizeof(p));
  grouped::GroupedGemmKernelParams& b = p.g;
  b.tmX = tensorMap({g.x, 2, {u64(g.k), u64(g.mTotal), 1, 1}, {u64(ldxOf(g)), 0, 0}, {kBlockK, kTileRows, 1, 1}},
                    TensorMapElem::kU8, "x [mTotal, k] e4m3");
  if (swiglu) {
    const int64_t f = g.n / 2;
    b.tmW = tensorMap({g.w,
                       4,
                       {u64(g.k), u64(f), 2, u64(g.numExperts)},
                       {u64(g.k), u64(f * g.k), u64(g.n * g.k)},
                       {kBlockK, u32(grouped::kSwiGluTileCols), 1, 1}},
                      TensorMapElem::kU8, "w [E, 2f, k] e4m3 (gate, up)");
    b.tmOut =
        tensorMap({g.out, 2, {u64(nOut), u64(g.mTotal), 1, 1}, {u64(ldOutOf(g)), 0, 0}, {kEpiBytes, kEpiRows, 1, 1}},
                  TensorMapElem::kU8, "h [mTotal, f] e4m3");
  } else {
    b.tmW = tensorMap({g.w,
                       3,
                       {u64(g.k), u64(g.n), u64(g.numExperts), 1},
                       {u64(g.k), u64(g.n * g.k), 0},
                       {kBlockK, u32(grouped::kStoreTileCols), 1, 1}},
                      TensorMapElem::kU8, "w [E, n, k] e4m3");
    b.tmOut = tensorMap({g.out,
                         2,
                         {u64(nOut), u64(g.mTotal), 1, 1},
                         {u64(ldOutOf(g)) * 2, 0, 0},
                         {kEpiBytes / 2, kEpiRows, 1, 1},
                         GemmDtype::kBf16},
                        TensorMapElem::kDtype, "out [mTotal, n] bf16");
  }
  // [k-blocks, ldxScale] fp32 with mTotal valid columns: one box holds a tile's 128 row scales of one k-block, from the
  // multiple of 4 at or below its first row (kScaleABoxRows; rows past mTotal read as zeros and scale only rows the
  // epilogue never stores).
  p.tmXScale = tensorMap({g.xScale,
                          2,
                          {u64(g.mTotal), u64(numKBlocks), 1, 1},
                          {u64(ldxScaleOf(g)) * 4, 0, 0},
                          {u32(kScaleABoxRows), 1, 1, 1}},
      TensorMapElem::kF32, "xScale [k/128, ldxScale] fp32");
  grouped::fillTileOrder(b, g, nOut, ldOutOf(g), numKBlocks, tileCols(g));
  b.skipIdleHalves = 0;
  p.wScale = g.wScale;
  p.outScale = g.outScale;
  p.ldOutScale = swiglu ? ldOutScaleOf(g) : 0;
  p.wScaleExpert = blockW ? ceilDiv(g.n, kBlockK) * numKBlocks : 1;
  p.wScaleRowBlock = blockW ? static_cast<int32_t>(numKBlocks) : 0;
  p.wScaleKStep = blockW ? 1 : 0;
  p.f = swiglu ? static_cast<int32_t>(g.n / 2) : 0;

  // Persistent: one CTA per SM, fewer when even the most tiles any grouping can have would not fill them.
  const int64_t maxTiles = groupedGemmMaxRowTiles(g.mTotal, g.numExperts) * b.tilesN;
  const int64_t cap = numSms > 0 ? std::min(numSms, sms) : sms;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min(cap, maxTiles)));
  checkCuda(groupedGemmFp8LaunchKernel(p, g.epilogue, ctas, stream), "launching the FP8 grouped GEMM kernel");
}

void preloadGroupedGemmFp8Kernels(int device) {
  using namespace grouped_fp8;
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  try {
    prepare(device, GroupedGemmEpilogue::kStore);
    prepare(device, GroupedGemmEpilogue::kSwiGlu);
  } catch (...) {
    cudaSetDevice(previous);
    throw;
  }
  checkCuda(cudaSetDevice(previous), "cudaSetDevice");
}

}  // namespace tandem::kernels
