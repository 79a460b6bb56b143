// The grouped TN GEMM (MoE weight gradients), host side: the shape and pointer rules, the tensor maps, the persistent
// grid. The kernels are in grouped_gemm_wgrad.cu (nvcc cannot compile fmt, which tandem::Error's helpers use).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "grouped_gemm_wgrad_desc.hpp"
#include "launch_support.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/grouped_gemm_wgrad.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {
namespace grouped_wgrad {
namespace {

constexpr int64_t kMax32 = 0x7fffffff;
constexpr uint64_t kMaxTmaStride = uint64_t{1} << 40;  // cuTensorMapEncodeTiled: global strides below 2^40 bytes

void checkCuda(cudaError_t e, const char* what) { checkCudaFor("grouped wgrad", e, what); }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }
int64_t ldaOf(const GroupedWgradParams& g) { return g.lda == 0 ? g.m : g.lda; }
int64_t ldbOf(const GroupedWgradParams& g) { return g.ldb == 0 ? g.n : g.ldb; }
int64_t outElemBytes(const GroupedWgradParams& g) { return g.outDtype == GemmOut::kFp32 ? 4 : 2; }
// 16-bit maps through the shared cache (tensor_map_cache.hpp).
CUtensorMap cachedMap(const TensorMapKey& k, const char* what) {
  return cachedTensorMap("grouped wgrad", k, what);
}

// fp32 out [E, m, n] as {n, m, E}, boxes of 32 columns (128 bytes) x 64 rows, 128-byte swizzle. The cache holds 16-bit
// maps only, so this one is encoded per launch (about a microsecond of host time).
CUtensorMap outF32Map(const GroupedWgradParams& g) {
  const cuuint64_t dims[3] = {u64(g.n), u64(g.m), u64(g.numExperts)};
  const cuuint64_t strides[2] = {u64(g.n) * 4, u64(g.m * g.n) * 4};
  const cuuint32_t box[3] = {32, static_cast<cuuint32_t>(kOutBoxRows), 1};
  const cuuint32_t elemStrides[3] = {1, 1, 1};
  CUtensorMap map;
  CUresult r = CUDA_SUCCESS;
  try {
    r = tensorMapEncodeTiled()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, g.out, dims, strides, box, elemStrides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } catch (const std::runtime_error& e) {
    fail(ErrorCode::kCuda, "grouped wgrad: {}", e.what());
  }
  if (r != CUDA_SUCCESS) {
    fail(ErrorCode::kCuda, "grouped wgrad: cuTensorMapEncodeTiled failed for the fp32 out [{}, {}, {}] [-> {}]",
         g.numExperts, g.m, g.n, driverErrorName(r));
  }
  return map;
}

// Loaded once per (device, variant): launch_support.hpp.
int prepare(int device, WgradVariant v) {
  const uint32_t variant = static_cast<uint32_t>(v.dtype) * 2 + static_cast<uint32_t>(v.out);
  return prepareOnce("grouped wgrad", device, variant, [&] { return wgradPrepare(v); });
}

}  // namespace
}  // namespace grouped_wgrad

void validateGroupedWgrad(const GroupedWgradParams& g) {
  using namespace grouped_wgrad;
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  if (g.dtype != GemmDtype::kBf16 && g.dtype != GemmDtype::kFp16) {
    fail(kBad, "grouped wgrad: dtype must be bf16 or fp16 (GemmDtype), got {}", static_cast<int>(g.dtype));
  }
  if (g.outDtype != GemmOut::kInput && g.outDtype != GemmOut::kFp32) {
    fail(kBad, "grouped wgrad: outDtype must be kInput (the input dtype) or kFp32 (GemmOut), got {}",
         static_cast<int>(g.outDtype));
  }
  if (g.mTotal < 0 || g.m < 0 || g.n < 0 || g.numExperts < 0) {
    fail(kBad, "grouped wgrad: sizes must be >= 0, got mTotal={} m={} n={} numExperts={}", g.mTotal, g.m, g.n,
         g.numExperts);
  }
  if (g.mTotal > kMax32 || g.m > kMax32 || g.n > kMax32 || g.numExperts >= kMax32) {
    fail(kBad, "grouped wgrad: mTotal, m, n and numExperts must each be below 2^31, got mTotal={} m={} n={} "
               "numExperts={}; split the rows or the experts over several launches",
         g.mTotal, g.m, g.n, g.numExperts);
  }
  if (g.m % 8 != 0 || g.n % 8 != 0) {
    fail(kBad,
         "grouped wgrad: m and n must be multiples of 8 (a's and b's rows are TMA rows with 16-byte strides; so are "
         "out's), got m={} n={}; pad a or b with zero columns",
         g.m, g.n);
  }
  if (g.lda != 0 && (g.lda < g.m || g.lda % 8 != 0 || g.lda > kMax32)) {
    fail(kBad, "grouped wgrad: lda must be 0 (dense) or a multiple of 8 that is >= m and below 2^31, got lda={} m={}",
         g.lda, g.m);
  }
  if (g.ldb != 0 && (g.ldb < g.n || g.ldb % 8 != 0 || g.ldb > kMax32)) {
    fail(kBad, "grouped wgrad: ldb must be 0 (dense) or a multiple of 8 that is >= n and below 2^31, got ldb={} n={}",
         g.ldb, g.n);
  }
  if (g.m == 0 || g.n == 0 || g.numExperts == 0) return;  // nothing to compute, nothing is read or written

  const int64_t units = g.numExperts * ceilDiv(g.m, kTileRows) * ceilDiv(g.n, kTileCols);
  if (units > kMax32) {
    fail(kBad, "grouped wgrad: too many output tiles ({} = numExperts x ceil(m / 128) x ceil(n / 256), at most "
               "2^31 - 1): split the experts over several launches",
         units);
  }
  const uint64_t expertBytes = u64(g.m * g.n * outElemBytes(g));
  if (expertBytes >= kMaxTmaStride) {
    fail(kBad, "grouped wgrad: one expert's out (m x n = {} x {}, {} bytes) must be below 2^40 bytes (TMA strides); "
               "split the experts' columns over several launches",
         g.m, g.n, expertBytes);
  }
  if (g.out == nullptr) fail(kBad, "grouped wgrad: out must be non-null");
  if (!aligned(g.out, 16)) {
    fail(kBad, "grouped wgrad: out must be 16-byte aligned (TMA), got {}", static_cast<void*>(g.out));
  }
  const uint64_t outBytes = u64(g.numExperts) * expertBytes;
  if (g.runIf != nullptr && (g.mTotal == 0 || !aligned(g.runIf, 4))) {
    fail(kBad,
         "grouped wgrad: runIf must be 4-byte aligned and needs mTotal > 0 (with no rows the launch zeroes out "
         "without a kernel, so nothing would read the gate), got runIf={} mTotal={}",
         static_cast<const void*>(g.runIf), g.mTotal);
  }
  if (g.mTotal == 0) return;  // out is zeroed; a, b and the offsets are not read

  if (g.a == nullptr || g.b == nullptr) {
    fail(kBad, "grouped wgrad: a and b must be non-null (a={} b={})", g.a, g.b);
  }
  if (!aligned(g.a, 16) || !aligned(g.b, 16)) {
    fail(kBad, "grouped wgrad: a and b must be 16-byte aligned (TMA), got a={} b={}", g.a, g.b);
  }
  if (g.groupOffsets == nullptr || !aligned(g.groupOffsets, 4)) {
    fail(kBad, "grouped wgrad: groupOffsets must point to numExperts + 1 = {} int32 in device memory (4-byte aligned)",
         g.numExperts + 1);
  }
  const uint64_t aBytes = u64((g.mTotal - 1) * ldaOf(g) + g.m) * 2;
  const uint64_t bBytes = u64((g.mTotal - 1) * ldbOf(g) + g.n) * 2;
  if (overlaps(g.out, outBytes, g.a, aBytes) || overlaps(g.out, outBytes, g.b, bBytes) ||
      overlaps(g.out, outBytes, g.groupOffsets, u64(g.numExperts + 1) * 4)) {
    fail(kBad, "grouped wgrad: out must not overlap a, b or groupOffsets (the kernel reads them while writing out); "
               "give out its own buffer");
  }
}

void launchGroupedWgrad(const GroupedWgradParams& g, cudaStream_t stream, int numSms) {
  using namespace grouped_wgrad;
  validateGroupedWgrad(g);
  if (g.m == 0 || g.n == 0 || g.numExperts == 0) return;
  if (g.mTotal == 0) {
    // No rows at all: every expert's gradient is zero. (A tensor map cannot describe a 0-row a.)
    checkCuda(cudaMemsetAsync(g.out, 0, u64(g.numExperts * g.m * g.n * outElemBytes(g)), stream),
              "cudaMemsetAsync (mTotal == 0)");
    return;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const WgradVariant variant{g.dtype, g.outDtype};
  const int sms = prepare(device, variant);

  WgradKernelParams p;
  std::memset(&p, 0, sizeof(p));
  p.tmA = cachedMap(TensorMapKey::matrix(g.a, u64(g.mTotal), u64(g.m), u64(ldaOf(g)), kBox, kBox, g.dtype), "a");
  p.tmB = cachedMap(TensorMapKey::matrix(g.b, u64(g.mTotal), u64(g.n), u64(ldbOf(g)), kBox, kBox, g.dtype), "b");
  if (g.outDtype == GemmOut::kFp32) {
    p.tmOut = outF32Map(g);
  } else {
    p.tmOut = cachedMap({g.out, 3, {u64(g.n), u64(g.m), u64(g.numExperts), 1}, {u64(g.n) * 2, u64(g.m * g.n) * 2, 0},
                         {64, static_cast<uint32_t>(kOutBoxRows), 1, 1}, g.dtype},
                        "out");
  }
  p.groupOffsets = g.groupOffsets;
  p.mTotal = static_cast<int32_t>(g.mTotal);
  p.m = static_cast<int32_t>(g.m);
  p.n = static_cast<int32_t>(g.n);
  p.numExperts = static_cast<int32_t>(g.numExperts);
  p.tilesM = static_cast<int32_t>(ceilDiv(g.m, kTileRows));
  p.tilesN = static_cast<int32_t>(ceilDiv(g.n, kTileCols));
  p.rasterRows = kRasterRows;
  p.runIf = g.runIf;
  p.runValue = g.runValue;

  // Persistent: one CTA per SM, fewer when there are fewer output tiles.
  const int64_t units = g.numExperts * p.tilesM * p.tilesN;
  const int64_t cap = numSms > 0 ? std::min(numSms, sms) : sms;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min(cap, units)));
  checkCuda(wgradLaunchKernel(p, variant, ctas, stream), "launching the grouped wgrad kernel");
}

void preloadGroupedWgradKernels(int device) {
  using namespace grouped_wgrad;
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  try {
    for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
      for (GemmOut out : {GemmOut::kInput, GemmOut::kFp32}) prepare(device, {dt, out});
    }
  } catch (...) {
    cudaSetDevice(previous);
    throw;
  }
  checkCuda(cudaSetDevice(previous), "cudaSetDevice");
}

}  // namespace tandem::kernels
