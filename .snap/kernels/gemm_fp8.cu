// The FP8 GEMM core (gemm_fp8.hpp): the kernels and the host launcher (validation, TMA descriptors, launch geometry).
// Device building blocks: device/gemm_fp8_sm90.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "device/gemm_fp8_sm90.cuh"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm_fp8.hpp"

namespace tandem::kernels {
namespace gemm_fp8 {

// One CTA: warpgroup 0 produces (TMA), warpgroups 1..2 consume (wgmma + epilogue). Persistent over the tiles.
template <class TA, class TB, class Out, Scaling S>
__global__ void __launch_bounds__(kThreads, 1) gemmFp8Kernel(const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smemRaw[];
  runCta<TA, TB, Out, S>(p, smemRaw, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

namespace {

constexpr int kGroupRows = 16;  // raster group height in 128-row tiles (L2 reuse), as the 16-bit cores
static_assert(kFp8ScaleBlock == kBlockK, "the public scale block is the kernel's k-block");

[[noreturn]] void invalid(const std::string& msg) { throw std::invalid_argument("tandem gemm_fp8: " + msg); }
[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tandem gemm_fp8: " + msg); }

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
std::string str(int64_t v) { return std::to_string(v); }
bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- kernel variants ------------------------------------------------------------------------------------------

using KernelFn = void (*)(KernelParams);

struct Variant {
  KernelFn fn;
  size_t smemBytes;
};

template <class TA, class TB, class Out, Scaling S>
Variant variant() {
  return {&gemmFp8Kernel<TA, TB, Out, S>, kSmemBytes<S>};
}

template <class TA, class TB, class Out>
Variant pickScaling(Fp8Scaling s) {
  return s == Fp8Scaling::kBlock ? variant<TA, TB, Out, Scaling::kBlock>()
                                 : variant<TA, TB, Out, Scaling::kPerTensor>();
}

template <class TA, class TB>
Variant pickOut(const GemmFp8Params& g) {
  return g.out == Fp8Out::kFp32 ? pickScaling<TA, TB, float>(g.scaling)
                                : pickScaling<TA, TB, __nv_bfloat16>(g.scaling);
}

Variant pickVariant(const GemmFp8Params& g) {
  const bool a5 = g.aFormat == Fp8Format::kE5M2, b5 = g.bFormat == Fp8Format::kE5M2;
  if (a5) return b5 ? pickOut<E5M2, E5M2>(g) : pickOut<E5M2, E4M3>(g);
  return b5 ? pickOut<E4M3, E5M2>(g) : pickOut<E4M3, E4M3>(g);
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

// Row-major [rows, cols] with row stride ld elements of elemBytes each, boxes of boxRows x boxCols. Encoded on every
// launch (about a microsecond of host time, against a GEMM of tens of microseconds or more).
CUtensorMap encodeMatrix(const void* ptr, CUtensorMapDataType dt, int64_t elemBytes, int64_t rows, int64_t cols,
                         int64_t ld, uint32_t boxRows, uint32_t boxCols, CUtensorMapSwizzle swizzle, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * elemBytes)};
  const cuuint32_t box[2] = {boxCols, boxRows};
  const cuuint32_t elemStrides[2] = {1, 1};
  CUtensorMap map;
  const CUresult r = tensorMapEncodeTiled()(&map, dt, 2, const_cast<void*>(ptr), dims, strides, box, elemStrides,
                                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fail(std::string("cuTensorMapEncodeTiled failed for ") + what + " (" + driverErrorName(r) + "): " + str(rows) +
         "x" + str(cols) + ", ld " + str(ld));
  }
  return map;
}

// ---- validation -------------------------------------------------------------------------------------------------

void validate(const GemmFp8Params& g) {
  const auto isFormat = [](Fp8Format f) { return f == Fp8Format::kE4M3 || f == Fp8Format::kE5M2; };
  if (!isFormat(g.aFormat)) invalid("aFormat must be kE4M3 or kE5M2, got " + str(static_cast<int>(g.aFormat)));
  if (!isFormat(g.bFormat)) invalid("bFormat must be kE4M3 or kE5M2, got " + str(static_cast<int>(g.bFormat)));
  if (g.scaling != Fp8Scaling::kPerTensor && g.scaling != Fp8Scaling::kBlock) {
    invalid("scaling must be kPerTensor or kBlock, got " + str(static_cast<int>(g.scaling)));
  }
  if (g.out != Fp8Out::kBf16 && g.out != Fp8Out::kFp32) {
    invalid("out must be kBf16 or kFp32, got " + str(static_cast<int>(g.out)));
  }
  if (g.m < 0 || g.n < 0 || g.k < 0) invalid("negative size m=" + str(g.m) + " n=" + str(g.n) + " k=" + str(g.k));
  constexpr int64_t kMax = 0x7fffffff;
  if (g.m > kMax || g.n > kMax || g.k > kMax) invalid("m, n and k must each be below 2^31");
  if (g.k % 16 != 0) {
    invalid("k must be a multiple of 16 (TMA's 16-byte row strides), got k=" + str(g.k) +
            "; pad A and B with zero columns up to the next multiple of 16");
  }
  if (g.m == 0 || g.n == 0) return;
  if (g.c == nullptr) invalid("c is null");
  if (!aligned(g.c, 16)) invalid("c must be 16-byte aligned");
  const int64_t cAlign = g.out == Fp8Out::kFp32 ? 4 : 8;
  if (g.ldc < g.n || g.ldc % cAlign != 0) {
    invalid("ldc must be >= n and a multiple of " + str(cAlign) + ", got ldc=" + str(g.ldc) + " n=" + str(g.n));
  }
  if (g.k == 0) return;
  if (g.a == nullptr || g.b == nullptr) invalid("a or b is null");
  if (!aligned(g.a, 16) || !aligned(g.b, 16)) invalid("a and b must be 16-byte aligned");
  if (g.c == g.a || g.c == g.b) invalid("c must not alias a or b");
  if (g.lda < g.k || g.lda % 16 != 0) {
    invalid("lda must be >= k (A is [m, k], K-major) and a multiple of 16, got lda=" + str(g.lda) + " k=" + str(g.k));
  }
  if (g.ldb < g.k || g.ldb % 16 != 0) {
    invalid("ldb must be >= k (B is [n, k], K-major) and a multiple of 16, got ldb=" + str(g.ldb) + " k=" + str(g.k));
  }
  if (g.scaleA == nullptr || g.scaleB == nullptr) invalid("scaleA or scaleB is null");
  if (g.scaling == Fp8Scaling::kPerTensor) {
    if (!aligned(g.scaleA, 4) || !aligned(g.scaleB, 4)) invalid("scaleA and scaleB must be 4-byte aligned");
  } else {
    if (!aligned(g.scaleA, 16)) invalid("scaleA must be 16-byte aligned in kBlock scaling (a TMA source)");
    if (!aligned(g.scaleB, 4)) invalid("scaleB must be 4-byte aligned");
    if (g.ldsa < g.m || g.ldsa % 4 != 0) {
      invalid("ldsa must be >= m and a multiple of 4 in kBlock scaling (scaleA is [ceil(k/128), ldsa], M-major; "
              "gemmFp8ScaleALd(m) gives the smallest), got ldsa=" + str(g.ldsa) + " m=" + str(g.m));
    }
  }
}

}  // namespace
}  // namespace gemm_fp8

void preloadGemmFp8Kernels(int device) {
  using namespace gemm_fp8;
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  for (const Fp8Format a : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const Fp8Format b : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const Fp8Out out : {Fp8Out::kBf16, Fp8Out::kFp32}) {
        for (const Fp8Scaling s : {Fp8Scaling::kPerTensor, Fp8Scaling::kBlock}) {
          GemmFp8Params g{};
          g.aFormat = a;
          g.bFormat = b;
          g.out = out;
          g.scaling = s;
          prepareKernel(device, pickVariant(g));  // cudaFuncSetAttribute loads the kernel
        }
      }
    }
  }
  checkCuda(cudaSetDevice(previous), "cudaSetDevice");
}

void launchGemmFp8(const GemmFp8Params& g, cudaStream_t stream) {
  using namespace gemm_fp8;
  validate(g);
  if (g.m == 0 || g.n == 0) return;
  const size_t cElem = g.out == Fp8Out::kFp32 ? 4 : 2;
  if (g.k == 0) {
    checkCuda(cudaMemset2DAsync(g.c, static_cast<size_t>(g.ldc) * cElem, 0, static_cast<size_t>(g.n) * cElem,
                                static_cast<size_t>(g.m), stream),
              "cudaMemset2DAsync (k == 0)");
    return;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const int numSms = deviceSms(device);
  const int64_t tilesRows = ceilDiv(g.m, kBlockRows), tilesCols = ceilDiv(g.n, kBlockCols);
  if (tilesRows * tilesCols > 0x7fffffff) invalid("too many tiles: " + str(tilesRows * tilesCols));

  const Variant v = pickVariant(g);
  prepareKernel(device, v);

  KernelParams p;
  std::memset(&p, 0, sizeof(p));
  const auto u32 = [](int v32) { return static_cast<uint32_t>(v32); };
  p.tmA = encodeMatrix(g.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.m, g.k, g.lda, u32(kBlockRows), u32(kBlockK),
                       CU_TENSOR_MAP_SWIZZLE_128B, "A [m, k]");
  p.tmB = encodeMatrix(g.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g.n, g.k, g.ldb, u32(kBlockCols), u32(kBlockK),
                       CU_TENSOR_MAP_SWIZZLE_128B, "B [n, k]");
  p.tmC = g.out == Fp8Out::kFp32
              ? encodeMatrix(g.c, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, g.m, g.n, g.ldc, u32(kRowsPerConsumer), 32,
                             CU_TENSOR_MAP_SWIZZLE_128B, "C [m, n] fp32")
              : encodeMatrix(g.c, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, g.m, g.n, g.ldc, u32(kRowsPerConsumer), 64,
                             CU_TENSOR_MAP_SWIZZLE_128B, "C [m, n] bf16");
  const int64_t numKBlocks = ceilDiv(g.k, kBlockK);
  if (g.scaling == Fp8Scaling::kBlock) {
    // [k-blocks, ldsa] fp32 with m valid columns: one box is a tile's 128 row scales of one k-block and 4 more that
    // nothing reads (kScaleABoxRows; rows past m read as zeros and scale only rows the epilogue never stores).
    p.tmSfa = encodeMatrix(g.scaleA, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, numKBlocks, g.m, g.ldsa, 1,
                           u32(kScaleABoxRows), CU_TENSOR_MAP_SWIZZLE_NONE, "scaleA [k/128, ldsa]");
  }
  p.scaleA = g.scaleA;
  p.scaleB = g.scaleB;
  p.c = g.c;
  p.ldc = g.ldc;
  p.rows = static_cast<int32_t>(g.m);
  p.cols = static_cast<int32_t>(g.n);
  p.numKBlocks = static_cast<int32_t>(numKBlocks);
  p.tilesRows = static_cast<int32_t>(tilesRows);
  p.tilesCols = static_cast<int32_t>(tilesCols);
  p.groupRows = kGroupRows;

  const int64_t ctas = std::min<int64_t>(tilesRows * tilesCols, numSms);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = v.smemBytes;
  cfg.stream = stream;
  checkCuda(cudaLaunchKernelEx(&cfg, v.fn, p), "launching the FP8 GEMM kernel");
}

}  // namespace tandem::kernels
