// Fused AllGather + GEMM: the persistent fused kernel (comm CTAs + compute CTAs from one role table), the
// all-gather kernel of the decomposed plan, and the host launcher. Device pieces: device/ag_gemm_sm90.cuh (which
// reuses the GEMM core of device/gemm_sm90.cuh).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "device/ag_gemm_sm90.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace ag {

__device__ __forceinline__ uint8_t* align1024(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~static_cast<uintptr_t>(1023));
}

// Fused: CTAs [0, commCtas) push this rank's shard to the peers and then take the tail of the tile order; the
// others run the head of the GEMM's tile order (one CTA per SM, all co-resident). BMn: B is the NN layout's weight
// [k, n], loaded MN-major; otherwise [n, k].
template <class T, CommMode kMode, bool BMn>
__global__ void __launch_bounds__(gemm::kThreads, 1) agGemmFusedKernel(const __grid_constant__ AgGemmKernelParams kp) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  const uint64_t startNs = globaltimerNs();
  const AgGemmRoleLayout layout{kp.commCtas, static_cast<int32_t>(gridDim.x) - kp.commCtas};
  const int32_t cta = static_cast<int32_t>(blockIdx.x);
  const int32_t numWork = kp.tilesM * kp.g.tilesN;
  switch (layout.roleOf(cta)) {
    case Role::kIntraComm: {
      uint8_t* base = align1024(smemRaw);
      uint32_t* bcast = reinterpret_cast<uint32_t*>(base + kTmaStages * kTmaBufBytes + 128);
      runComm<kMode>(kp, layout.indexInRole(cta), layout.commCtas, bcast, base, startNs);
      if (kp.tailTiles > 0) {
        runCompute<T, BMn>(kp, smemRaw, SegmentedOrder{&kp, numWork - kp.tailTiles, kp.tailTiles},
                           layout.indexInRole(cta), layout.commCtas, startNs);
      }
      break;
    }
    case Role::kCompute:
      runCompute<T, BMn>(kp, smemRaw, SegmentedOrder{&kp, 0, numWork - kp.tailTiles}, layout.indexInRole(cta),
                         layout.computeCtas, startNs);
      break;
    default:
      break;
  }
}

// Decomposed plan's GEMM: the core (runGemmCta, grouped raster, no waits) on the gathered buffer, instantiated here so
// that it is loaded together with the all-gather kernel (a lazily loaded kernel can block the launching thread while
// the all-gather kernel waits on a peer that thread has not launched yet).
template <class T>
__global__ void __launch_bounds__(gemm::kThreads, 1) agPlainGemmKernel(const __grid_constant__ AgGemmKernelParams kp) {
  extern __shared__ __align__(16) uint8_t smemRaw[];
  const gemm::GroupedRaster order{kp.g.unitsM, kp.g.tilesN, kp.g.groupM};
  gemm::runGemmCta<T, 1, gemm::Epilogue::kTmaStore>(kp.g, smemRaw, order, gemm::NoRowWait{},
                                                     static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x));
}

inline constexpr int kGatherThreads = 384;

// Decomposed: push + wait for every incoming chunk; the GEMM core runs after it in stream order.
__global__ void __launch_bounds__(kGatherThreads) agGatherKernel(const __grid_constant__ AgGemmKernelParams kp) {
  __shared__ uint32_t bcast;
  const uint64_t startNs = globaltimerNs();
  runComm<CommMode::kLsu>(kp, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x), &bcast, nullptr,
                          startNs);
  waitIncoming(kp, static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(gridDim.x), startNs);
}

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tandem ag_gemm: " + msg); }

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}


// Packed row-major [rows, cols] matrix of 2-byte elements in boxes of boxRows x boxCols, 128-byte swizzle.
CUtensorMap encodeMap(const void* ptr, int64_t rows, int64_t cols, uint32_t boxRows, uint32_t boxCols, GemmDtype dt) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {boxCols, boxRows};
  const cuuint32_t elemStrides[2] = {1, 1};
  const CUtensorMapDataType t = dt == GemmDtype::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = tensorMapEncodeTiled()(&map, t, 2, const_cast<void*>(ptr), dims, strides, box, elemStrides,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fail("cuTensorMapEncodeTiled failed (CUresult " + std::to_string(static_cast<int>(r)) + ") for a " +
         std::to_string(rows) + "x" + std::to_string(cols) + " matrix");
  }
  return map;
}

// Per device: the fused kernels' opt-in shared memory is set once; the SM count is read once.
struct DeviceInfo {
  int numSms = 0;
  bool ready = false;
};

DeviceInfo deviceInfo(int device) {
  static std::mutex mu;
  static DeviceInfo table[64];
  if (device < 0 || device >= 64) fail("device ordinal out of range");
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& d = table[device];
  if (d.ready) return d;
  checkCuda(cudaDeviceGetAttribute(&d.numSms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  int major = 0, minor = 0;
  checkCuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  checkCuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) fail("needs an sm_90 (Hopper) GPU");
  const int smem = static_cast<int>(gemm::kSmemBytes<gemm::kStages>);
  // Setting the attribute also loads each kernel now, not lazily in the middle of a multi-GPU op.
  const void* big[] = {reinterpret_cast<const void*>(&agGemmFusedKernel<__nv_bfloat16, CommMode::kLsu, false>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__nv_bfloat16, CommMode::kTma, false>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__half, CommMode::kLsu, false>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__half, CommMode::kTma, false>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__nv_bfloat16, CommMode::kLsu, true>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__nv_bfloat16, CommMode::kTma, true>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__half, CommMode::kLsu, true>),
                       reinterpret_cast<const void*>(&agGemmFusedKernel<__half, CommMode::kTma, true>),
                       reinterpret_cast<const void*>(&agPlainGemmKernel<__nv_bfloat16>),
                       reinterpret_cast<const void*>(&agPlainGemmKernel<__half>)};
  for (const void* f : big) {
    checkCuda(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
  cudaFuncAttributes fa{};
  checkCuda(cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(&agGatherKernel)), "cudaFuncGetAttributes");
  int perSm = 0;
  checkCuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, big[0], gemm::kThreads, smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (perSm < 1) fail("the fused kernel does not fit on an SM");
  d.ready = true;
  return d;
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The fused kernel for this dtype, copy mode and B layout.
template <class T>
void launchFusedKernel(const AgGemmKernelParams& kp, dim3 grid, size_t smem, cudaStream_t stream, bool tma, bool bMn) {
  if (bMn) {
    if (tma) agGemmFusedKernel<T, CommMode::kTma, true><<<grid, gemm::kThreads, smem, stream>>>(kp);
    else agGemmFusedKernel<T, CommMode::kLsu, true><<<grid, gemm::kThreads, smem, stream>>>(kp);
  } else {
    if (tma) agGemmFusedKernel<T, CommMode::kTma, false><<<grid, gemm::kThreads, smem, stream>>>(kp);
    else agGemmFusedKernel<T, CommMode::kLsu, false><<<grid, gemm::kThreads, smem, stream>>>(kp);
  }
}

// The GEMM on the layouts core, A the gathered rows `a` (or the shard at one rank): one GEMM, or for kAtB one per
// rank's [k, rows_r] block into C's rows of that rank. The split-K plan fits p.splitK (bitwise repeatable).
void layoutsCoreGemm(const AgGemmParams& p, const void* a, cudaStream_t stream) {
  GemmLayoutParams g{};
  g.layout = p.layout;
  g.dtype = p.dtype;
  g.out = GemmOut::kInput;
  g.b = p.b;
  g.n = p.n;
  g.k = p.k;
  g.ldb = p.layout == GemmLayout::kABt ? p.k : p.n;
  g.ldc = p.n;
  g.workspace = p.splitK;
  g.workspaceBytes = p.splitK != nullptr ? p.splitKBytes : 0;
  const auto run = [&](int64_t row0, int64_t rows, int64_t lda) {
    if (rows == 0) return;
    g.a = static_cast<const uint16_t*>(a) + row0 * p.k;
    g.c = static_cast<uint16_t*>(p.c) + row0 * p.n;
    g.m = rows;
    g.lda = lda;
    const GemmLayoutPlan plan = gemmLayoutPlanWithin(g);
    launchGemmLayout(g, stream, &plan);
  };
  if (p.layout != GemmLayout::kAtB) {
    run(0, p.m, p.k);
    return;
  }
  for (int q = 0; q < p.nranks; ++q) {
    const int64_t rows = agRowsOf(p.m, q, p.nranks);
    run(agRowOffset(p.m, q, p.nranks), rows, rows);
  }
}

void validate(const AgGemmParams& p) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (p.nranks < 1 || p.nranks > kAgGemmMaxRanks) fail("nranks must be in [1, 8], got " + str(p.nranks));
  if (p.rank < 0 || p.rank >= p.nranks) fail("rank " + str(p.rank) + " out of range for nranks " + str(p.nranks));
  if (p.dtype != GemmDtype::kBf16 && p.dtype != GemmDtype::kFp16) fail("unknown dtype");
  if (p.m < 0 || p.n < 0 || p.k < 0) fail("negative size");
  if (p.m > 0x7fffffff || p.n > 0x7fffffff || p.k > 0x7fffffff) fail("m, n and k must each be below 2^31");
  if (p.k % 8 != 0) fail("k must be a multiple of 8 (16-byte rows), got " + str(p.k));
  if (p.n % 8 != 0) fail("n must be a multiple of 8 (16-byte rows of C), got " + str(p.n));
  if (p.plan < 0 || p.plan > 2) fail("plan must be 0 (auto), 1 (fused) or 2 (decomposed)");
  if (p.commSms < 0 || p.groupM < 0) fail("commSms and groupM must be >= 0");
  if (p.commMode < 0 || p.commMode > 2) fail("commMode must be 0 (auto), 1 (LSU copy) or 2 (TMA bulk copy)");
  if (p.layout != GemmLayout::kABt && p.layout != GemmLayout::kAB && p.layout != GemmLayout::kAtB) {
    fail("layout must be kABt, kAB or kAtB");
  }
  if (p.fp8.enabled == 0 && !agGemmFusedTakes(p) && p.plan == 1) {
    fail("the fused plan takes layouts kABt and kAB (its producer loads the shard's rows K-major, so kAtB's [k, rows] "
         "shard cannot be gathered into it) and not layoutsCore; use plan 0 or 2 with kAtB or layoutsCore");
  }
  if (p.layout == GemmLayout::kAtB) {
    for (int q = 0; q < p.nranks; ++q) {
      if (agRowsOf(p.m, q, p.nranks) % 8 != 0) {
        fail("layout kAtB stores every shard [k, rows]: each rank's rows must be a multiple of 8 (16-byte TMA "
             "strides), rank " + str(q) + " has " + str(agRowsOf(p.m, q, p.nranks)) + " (m = " + str(p.m) + ")");
      }
    }
  }
  if (p.m == 0 || p.n == 0) return;
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (p.c == nullptr || !aligned(p.c)) fail("c must be non-null and 16-byte aligned");
  if (p.k == 0) return;
  const int64_t rows = agRowsOf(p.m, p.rank, p.nranks);
  if (p.b == nullptr || !aligned(p.b)) fail("b must be non-null and 16-byte aligned");
  if (rows > 0 && (p.a == nullptr || !aligned(p.a))) fail("a must be non-null and 16-byte aligned");
  if (p.aGathered != nullptr && !aligned(p.aGathered)) fail("aGathered must be 16-byte aligned");
  if (p.nranks == 1) return;
  if (p.aGathered == nullptr) fail("aGathered is required for nranks > 1 (peers push into it)");
  if (p.flags == nullptr) fail("flags is null");
  if (p.flagWords < agGemmFlagWords(p.m, p.nranks)) {
    fail("flag arrays hold " + str(p.flagWords) + " words, this shape needs " + str(agGemmFlagWords(p.m, p.nranks)));
  }
  for (int q = 0; q < p.nranks; ++q) {
    if (q == p.rank) continue;
    if (p.peerGathered[q] == nullptr || !aligned(p.peerGathered[q])) fail("peerGathered[" + str(q) + "] null or misaligned");
    if (p.peerFlags[q] == nullptr) fail("peerFlags[" + str(q) + "] is null");
  }
  if (p.epoch == 0 || p.epoch == kAbortValue) fail("epoch must be in [1, 2^64 - 2]");
  if (p.fp8.enabled != 0) {
    const Fp8Scaling s = p.fp8.scaling;
    if (p.flagWords < agGemmFp8FlagWords(p.m, p.k, p.nranks, s)) {
      fail("flag arrays hold " + str(p.flagWords) + " words, this FP8 shape needs " +
           str(agGemmFp8FlagWords(p.m, p.k, p.nranks, s)) + " (agGemmFp8FlagWords)");
    }
  }
}

// FP8 operands: what the all-gather and the FP8 core need beyond validate()'s rules.
void validateFp8(const AgGemmParams& p) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (p.layout != GemmLayout::kABt) {
    fail("FP8 operands take layout kABt only (fp8 wgmma reads K-major operands): transpose in the producer");
  }
  if (p.plan == 1) fail("FP8 operands run the decomposed plan: plan 0 or 2");
  if (p.k % 16 != 0) fail("FP8 operands need k a multiple of 16 (16-byte rows of fp8), got " + str(p.k));
  if (p.fp8.aScale == nullptr || p.fp8.bScale == nullptr) fail("FP8 operands need aScale and bScale");
  if (p.nranks == 1 && p.fp8.scaling == Fp8Scaling::kBlock &&
      (p.m % 4 != 0 || reinterpret_cast<uintptr_t>(p.fp8.aScale) % 16 != 0)) {
    fail("block scaling at one rank reads aScale [k/128, m] in place: m must be a multiple of 4 and aScale 16-byte "
         "aligned, got m = " + str(p.m));
  }
}

// The all-gather kernel over an [m, rowWords x 16 bytes] matrix whose rank-q rows start at `dstOff` bytes in rank q's
// gathered buffer, with its flags at word `flagOff` of every flag array: pushes this rank's rows (`shard`) and returns
// once every rank's rows have landed here (in stream order). `ctas` all-gather CTAs.
void gatherRows(const AgGemmParams& p, const void* shard, int64_t m, int64_t rowWords, int64_t dstOff, int64_t flagOff,
                int ctas, cudaStream_t stream) {
  AgGemmKernelParams kp;
  std::memset(&kp, 0, sizeof(kp));
  kp.g.m = static_cast<int32_t>(m);
  kp.shard = static_cast<const uint4*>(shard);
  for (int q = 0; q < p.nranks; ++q) {
    char* const base = static_cast<char*>(q == p.rank ? p.aGathered : p.peerGathered[q]);
    kp.gathered[q] = reinterpret_cast<uint4*>(base + dstOff);
    kp.flags[q] = (q == p.rank ? p.flags : p.peerFlags[q]) + flagOff;
  }
  kp.abortWord = p.abortWord;
  kp.errorSlot = p.errorSlot;
  kp.epoch = p.epoch;
  kp.epochWord = p.epochWord;
  kp.timeoutNs = p.timeoutNs > 0 ? p.timeoutNs : 10ull * 1000 * 1000 * 1000;
  kp.rowWords = rowWords;
  kp.rank = p.rank;
  kp.nranks = p.nranks;
  kp.localRow0 = static_cast<int32_t>(agRowOffset(m, p.rank, p.nranks));
  kp.localRow1 = static_cast<int32_t>(agRowOffset(m, p.rank, p.nranks) + agRowsOf(m, p.rank, p.nranks));
  kp.maxChunks = static_cast<int32_t>(agGemmMaxChunks(m, p.nranks));
  kp.chunkRows = static_cast<int32_t>(agGemmChunkRows(m, p.nranks, ctas));
  agGatherKernel<<<ctas, kGatherThreads, 0, stream>>>(kp);
  checkCuda(cudaGetLastError(), "launching the all-gather kernel");
}

// The FP8 core on rows [row0, row0 + rows) of A (row stride k bytes) into the same rows of C.
void fp8Gemm(const AgGemmParams& p, const void* a, int64_t row0, int64_t rows, const float* scaleA, int64_t ldsa,
             cudaStream_t stream) {
  if (rows == 0) return;
  GemmFp8Params g{};
  g.aFormat = p.fp8.aFormat;
  g.bFormat = p.fp8.bFormat;
  g.scaling = p.fp8.scaling;
  g.out = p.fp8.out;
  g.a = static_cast<const uint8_t*>(a) + row0 * p.k;
  g.b = p.b;
  g.c = static_cast<char*>(p.c) + row0 * p.n * fp8OutBytes(p.fp8.out);
  g.scaleA = scaleA;
  g.scaleB = p.fp8.bScale;
  g.m = rows;
  g.n = p.n;
  g.k = p.k;
  g.lda = p.k;
  g.ldb = p.k;
  g.ldc = p.n;
  g.ldsa = ldsa;
  try {
    launchGemmFp8(g, stream);
  } catch (const std::exception& e) {  // launchGemmFp8 throws std::invalid_argument too
    fail(e.what());
  }
}

// FP8 operands (AgGemmParams::fp8; ag_gemm.hpp's FP8 section has the design).
AgGemmPlanChoice launchFp8(const AgGemmParams& p, AgGemmPlanChoice choice, cudaStream_t stream) {
  validateFp8(p);
  const bool block = p.fp8.scaling == Fp8Scaling::kBlock;
  if (p.k == 0) {
    checkCuda(cudaMemsetAsync(p.c, 0, static_cast<size_t>(p.m * p.n * fp8OutBytes(p.fp8.out)), stream),
              "cudaMemsetAsync");
    return choice;
  }
  if (p.nranks == 1) {
    if (p.aGathered != nullptr && p.aGathered != p.a) {
      checkCuda(cudaMemcpyAsync(p.aGathered, p.a, static_cast<size_t>(p.m * p.k), cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync (gathered copy)");
    }
    fp8Gemm(p, p.a, 0, p.m, p.fp8.aScale, p.m, stream);
    return choice;
  }
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const int ctas = std::max(1, std::min(choice.commSms, deviceInfo(device).numSms));
  choice.commSms = ctas;
  const AgGemmFp8Layout l = agGemmFp8Layout(p.m, p.k, p.nranks, p.fp8.scaling);
  char* const mine = static_cast<char*>(p.aGathered);
  const int64_t rows = agRowsOf(p.m, p.rank, p.nranks);
  const int64_t kBlocks = ceilDiv(p.k, kFp8ScaleBlock);
  // This rank's scales into its stage, padded to whole words: the all-gather kernel reads whole 16-byte words, which
  // the caller's scale tensor need not hold. Peers never touch the stage, and our previous op read it in stream order.
  const int64_t scaleBytes = block ? kBlocks * rows * 4 : 4;
  if (scaleBytes > 0) {
    checkCuda(cudaMemcpyAsync(mine + l.stageOff, p.fp8.aScale, static_cast<size_t>(scaleBytes),
                              cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync (A scales into the stage)");
  }
  // A's fp8 rows (k / 16 words each), then the scales (scaleWords one-word rows per rank): the second gather's flags
  // follow the first's, so neither sees the other's epoch as its own.
  gatherRows(p, p.a, p.m, p.k / 16, 0, 0, ctas, stream);
  gatherRows(p, mine + l.stageOff, p.nranks * l.scaleWords, 1, l.scalesOff, agGemmFlagWords(p.m, p.nranks), ctas,
             stream);
  const float* const scales = reinterpret_cast<const float*>(mine + l.scalesOff);
  if (!block) {
    // Each rank's rows with that rank's scale: one launch per rank (a shared scale would need the ranks to agree,
    // which nothing checks on the device).
    for (int q = 0; q < p.nranks; ++q) {
      fp8Gemm(p, p.aGathered, agRowOffset(p.m, q, p.nranks), agRowsOf(p.m, q, p.nranks), scales + q * l.scaleWords * 4,
              0, stream);
    }
    return choice;
  }
  // Block scales: rank q's [kBlocks, rows_q] into columns [row0_q, row0_q + rows_q) of the core's [kBlocks, ldsa].
  float* const blockScales = reinterpret_cast<float*>(mine + l.blockOff);
  const int64_t ldsa = gemmFp8ScaleALd(p.m);
  for (int q = 0; q < p.nranks; ++q) {
    const int64_t rq = agRowsOf(p.m, q, p.nranks);
    if (rq == 0) continue;
    checkCuda(cudaMemcpy2DAsync(blockScales + agRowOffset(p.m, q, p.nranks), static_cast<size_t>(ldsa * 4),
                                scales + q * l.scaleWords * 4, static_cast<size_t>(rq * 4), static_cast<size_t>(rq * 4),
                                static_cast<size_t>(kBlocks), cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpy2DAsync (block scales of one rank)");
  }
  fp8Gemm(p, p.aGathered, 0, p.m, blockScales, ldsa, stream);
  return choice;
}

}  // namespace
}  // namespace ag

AgGemmPlanChoice resolveAgGemmPlan(const AgGemmParams& p) {
  if (p.nranks <= 1) return {AgGemmPlan::kLocal, 0, 0};
  if (p.fp8.enabled != 0) return {AgGemmPlan::kDecomposed, p.commSms > 0 ? p.commSms : 132, 1, 0};
  // kAtB (the wgrad: A stored [k, rows], which the fused producer cannot load) and layoutsCore run the whole gather,
  // then the layouts core. kABt and kAB take the chooser's plan: fused (kAB: the weight [k, n] loaded MN-major), or
  // decomposed (kAB: its GEMM then on the layouts core).
  if (!agGemmFusedTakes(p)) return {AgGemmPlan::kDecomposed, p.commSms > 0 ? p.commSms : 132, 1, 0};
  const AgGemmPlanChoice chosen = chooseAgGemmPlan(p.m, p.n, p.k, p.nranks);
  AgGemmPlanChoice r = chosen;
  if (p.plan == 1 && chosen.plan != AgGemmPlan::kFused) r = {AgGemmPlan::kFused, 4, 2};
  if (p.plan == 2 && chosen.plan != AgGemmPlan::kDecomposed) r = {AgGemmPlan::kDecomposed, 132, 1};
  if (p.commSms > 0) r.commSms = p.commSms;
  if (r.plan == AgGemmPlan::kFused && p.commMode > 0) r.commMode = p.commMode;
  if (r.plan == AgGemmPlan::kDecomposed) r.commMode = 1;
  return r;
}

void preloadAgGemmKernels(int device) { ag::deviceInfo(device); }  // sets up (and so loads) every ag kernel

AgGemmPlanChoice launchAgGemm(const AgGemmParams& p, cudaStream_t stream) {
  using namespace ag;
  validate(p);
  AgGemmPlanChoice choice = resolveAgGemmPlan(p);
  if (p.m == 0 || p.n == 0) return choice;
  if (p.fp8.enabled != 0) return launchFp8(p, choice, stream);
  const int64_t rows = agRowsOf(p.m, p.rank, p.nranks);
  const int64_t row0 = agRowOffset(p.m, p.rank, p.nranks);

  if (p.k == 0) {  // C = 0; the gathered matrix is empty; no rank waits on another
    checkCuda(cudaMemsetAsync(p.c, 0, static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * 2, stream), "cudaMemsetAsync");
    return choice;
  }

  if (choice.plan == AgGemmPlan::kLocal) {
    if (p.aGathered != nullptr && p.aGathered != p.a) {
      checkCuda(cudaMemcpyAsync(p.aGathered, p.a, static_cast<size_t>(p.m) * static_cast<size_t>(p.k) * 2,
                                cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync (gathered copy)");
    }
    if (agGemmOnLayoutsCore(p)) {
      layoutsCoreGemm(p, p.a, stream);
      return choice;
    }
    GemmParams g{};
    g.a = p.a;
    g.b = p.b;
    g.c = p.c;
    g.m = p.m;
    g.n = p.n;
    g.k = p.k;
    g.lda = p.k;
    g.ldb = p.k;
    g.ldc = p.n;
    g.dtype = p.dtype;
    launchGemm(g, stream);
    return choice;
  }

  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  const DeviceInfo info = deviceInfo(device);

  AgGemmKernelParams kp;
  std::memset(&kp, 0, sizeof(kp));
  const int64_t tilesM = ceilDiv(p.m, gemm::kBlockM);
  const int64_t tilesN = ceilDiv(p.n, gemm::kBlockN);
  if (tilesM * tilesN > 0x7fffffff) fail("too many tiles");
  kp.g.tmA = encodeMap(p.aGathered, p.m, p.k, gemm::kBlockM, gemm::kBlockK, p.dtype);
  // kABt: B [n, k], 256-row boxes. kAB: B [k, n] loaded MN-major, {64 columns, 64 k} boxes (gemm_sm90.cuh tmaLoadB).
  kp.g.tmB = p.layout == GemmLayout::kAB ? encodeMap(p.b, p.k, p.n, gemm::kBlockK, gemm::kBlockK, p.dtype)
                                         : encodeMap(p.b, p.n, p.k, gemm::kBlockN, gemm::kBlockK, p.dtype);
  kp.g.tmC = encodeMap(p.c, p.m, p.n, gemm::kRowsPerConsumer, gemm::kEpiCols, p.dtype);
  kp.tmALocal = rows > 0 ? encodeMap(p.a, rows, p.k, gemm::kBlockM, gemm::kBlockK, p.dtype) : kp.g.tmA;
  kp.g.c = p.c;
  kp.g.ldc = p.n;
  kp.g.m = static_cast<int32_t>(p.m);
  kp.g.n = static_cast<int32_t>(p.n);
  kp.g.k = static_cast<int32_t>(p.k);
  kp.g.numKBlocks = static_cast<int32_t>(ceilDiv(p.k, gemm::kBlockK));
  kp.g.unitsM = static_cast<int32_t>(tilesM);
  kp.g.tilesN = static_cast<int32_t>(tilesN);
  kp.g.groupM = p.groupM > 0 ? p.groupM : 8;
  kp.shard = static_cast<const uint4*>(p.a);
  for (int q = 0; q < p.nranks; ++q) {
    kp.gathered[q] = static_cast<uint4*>(q == p.rank ? p.aGathered : p.peerGathered[q]);
    kp.flags[q] = q == p.rank ? p.flags : p.peerFlags[q];
  }
  kp.abortWord = p.abortWord;
  kp.errorSlot = p.errorSlot;
  kp.epoch = p.epoch;
  kp.epochWord = p.epochWord;
  kp.timeoutNs = p.timeoutNs > 0 ? p.timeoutNs : 10ull * 1000 * 1000 * 1000;
  kp.rowWords = p.k / 8;
  kp.rank = p.rank;
  kp.nranks = p.nranks;
  kp.localRow0 = static_cast<int32_t>(row0);
  kp.localRow1 = static_cast<int32_t>(row0 + rows);
  kp.maxChunks = static_cast<int32_t>(agGemmMaxChunks(p.m, p.nranks));
  {
    const int pushCtas = choice.plan == AgGemmPlan::kFused ? agGemmRoleLayout(info.numSms, choice.commSms).commCtas
                                                           : std::max(1, std::min(choice.commSms, info.numSms));
    kp.chunkRows = static_cast<int32_t>(agGemmChunkRows(p.m, p.nranks, pushCtas));
  }

  // Tile order: start at the first tile row wholly at or after this rank's first row; segment d ends after the last
  // tile row (in that rotated order) whose rows all come from ranks rank .. rank + d.
  const int n = p.nranks;
  const auto rankOfRow = [&](int64_t row) {
    for (int s = 0; s < n; ++s) {
      if (row < agRowOffset(p.m, s, n) + agRowsOf(p.m, s, n)) return s;
    }
    return n - 1;
  };
  kp.tilesM = static_cast<int32_t>(tilesM);
  kp.startTile = static_cast<int32_t>(ceilDiv(row0, gemm::kBlockM) % tilesM);
  kp.groupM = kp.g.groupM;
  kp.nseg = n;
  {
    int32_t counts[kAgGemmMaxRanks] = {};
    int prevStep = 0;
    bool monotone = true;
    for (int64_t v = 0; v < tilesM; ++v) {
      const int64_t t = (kp.startTile + v) % tilesM;
      const int64_t a0 = t * gemm::kBlockM;
      const int64_t a1 = std::min<int64_t>(a0 + gemm::kBlockM, p.m) - 1;
      int step = 0;
      for (int s = rankOfRow(a0); s <= rankOfRow(a1); ++s) {
        if (agRowsOf(p.m, s, n) == 0) continue;
        step = std::max(step, (s - p.rank + n) % n);
      }
      if (step < prevStep) monotone = false;
      prevStep = step;
      ++counts[step];
    }
    if (monotone) {
      int32_t acc = 0;
      for (int d = 0; d < n; ++d) {
        acc += counts[d];
        kp.segEnd[d] = acc;
      }
    } else {  // cannot happen with the balanced split; stay correct anyway (every tile still waits on its flags)
      kp.startTile = 0;
      kp.nseg = 1;
      kp.segEnd[0] = static_cast<int32_t>(tilesM);
    }
  }

  const size_t smem = gemm::kSmemBytes<gemm::kStages>;
  const int64_t numWork = tilesM * tilesN;
  if (choice.plan == AgGemmPlan::kFused) {
    const AgGemmRoleLayout layout = agGemmRoleLayout(info.numSms, choice.commSms);
    choice.commSms = layout.commCtas;
    kp.commCtas = layout.commCtas;
    // Compute CTAs beyond the tile count would only idle: trim them (all CTAs must be co-resident: one per SM).
    const int32_t compute = static_cast<int32_t>(std::min<int64_t>(layout.computeCtas, numWork));
    // Tail: with every SM computing, the GEMM takes ceil(work / SMs) waves. When the compute CTAs alone would need
    // more, the comm CTAs (done pushing within the first part of the kernel) take the excess from the end of the
    // order, at most 60% of a full run each so that they finish in time.
    const int64_t waves = ceilDiv(numWork, info.numSms);
    const int64_t excess = numWork - static_cast<int64_t>(compute) * waves;
    const int64_t cap = static_cast<int64_t>(layout.commCtas) * (waves * 6 / 10);
    kp.tailTiles = p.commTail == 0 ? static_cast<int32_t>(std::clamp<int64_t>(excess, 0, cap))
                                   : (p.commTail < 0 ? 0 : static_cast<int32_t>(std::min<int64_t>(p.commTail, numWork)));
    choice.tailTiles = kp.tailTiles;
    const dim3 grid(static_cast<unsigned>(layout.commCtas + compute));
    const bool tma = choice.commMode == 2;
    const bool bMn = p.layout == GemmLayout::kAB;
    if (p.dtype == GemmDtype::kBf16) {
      launchFusedKernel<__nv_bfloat16>(kp, grid, smem, stream, tma, bMn);
    } else {
      launchFusedKernel<__half>(kp, grid, smem, stream, tma, bMn);
    }
    checkCuda(cudaGetLastError(), "launching the fused AllGather+GEMM kernel");
    return choice;
  }

  // Decomposed: all-gather kernel (waits for every incoming chunk), then the GEMM core on the gathered buffer.
  const int ctas = std::max(1, std::min(choice.commSms, info.numSms));
  choice.commSms = ctas;
  agGatherKernel<<<ctas, kGatherThreads, 0, stream>>>(kp);
  checkCuda(cudaGetLastError(), "launching the all-gather kernel");
  if (agGemmOnLayoutsCore(p)) {
    layoutsCoreGemm(p, p.aGathered, stream);
    return choice;
  }
  kp.g.groupM = p.groupM > 0 ? p.groupM : 16;  // the core's default raster
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(info.numSms, numWork)));
  if (p.dtype == GemmDtype::kBf16) {
    agPlainGemmKernel<__nv_bfloat16><<<grid, gemm::kThreads, smem, stream>>>(kp);
  } else {
    agPlainGemmKernel<__half><<<grid, gemm::kThreads, smem, stream>>>(kp);
  }
  checkCuda(cudaGetLastError(), "launching the GEMM kernel (decomposed plan)");
  return choice;
}

}  // namespace tandem::kernels
