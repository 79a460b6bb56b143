// Host side shared by kernels/gemm_rs.cu and kernels/gemm_ar.cu: workspace layout, validation, kernel parameters
// (TMA maps of this rank's slice, the role table, the phase order, every rank's staging / flag / output pointers) and
// the launch of a resolved plan. Each .cu passes its own kernel instantiations (one kernel family per .cu). Host code,
// but nvcc only: the kernel parameters it fills are the device code's (device/gemm_rs_sm90.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "device/gemm_rs_sm90.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/gemm_rs.hpp"
#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels::rs {

using FusedFn = void (*)(FusedKernelParams);
static_assert(kBlockM == kGemmRsTileM && kBlockN == kGemmRsTileN, "gemm_rs.hpp's public tile size is the core's");

// The kernels one .cu instantiates: fused[dtype][partial] (dtype 0 bf16 / 1 fp16; partial 0 fp32 / 1 input dtype),
// reduce[dtype] (decomposed plan) and reduceFp8[out] (decomposed plan with FP8 operands: fp32 partials, output 0 bf16 /
// 1 fp32).
struct KernelTable {
  FusedFn fused[2][2][2];  // [bf16, fp16][fp32 partials, input-type partials][B stored [N, K], B stored [K, N]]
  FusedFn reduce[2];
  FusedFn reduceFp8[2];
};

[[noreturn]] inline void fail(const char* op, const std::string& msg) {
  throw std::runtime_error(std::string("tandem ") + op + ": " + msg);
}
inline void checkCuda(const char* op, cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(op, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

struct Layout {
  int64_t maxHalf;  // half tiles per flag row
  size_t readyOff, inFlagsOff, outFlagsOff, finFlagsOff, stagingOff, matBytes, total;
};
inline Layout layoutWith(int64_t maxHalf, size_t matBytes, int nranks) {
  Layout l{};
  l.maxHalf = maxHalf;
  const size_t words = static_cast<size_t>(l.maxHalf);
  l.readyOff = 0;
  l.inFlagsOff = 256;
  l.outFlagsOff = l.inFlagsOff + kMaxRanks * words * 8;
  l.finFlagsOff = l.outFlagsOff + words * 8;
  const size_t flagsEnd = l.finFlagsOff + kMaxRanks * words * 8;
  l.stagingOff = (flagsEnd + 65535) / 65536 * 65536;
  l.matBytes = matBytes;
  l.total = l.stagingOff + static_cast<size_t>(2 * nranks + 2) * l.matBytes;
  return l;
}
// Sized for a maximum shape: fp32 matrices of ceil(maxM / 128) * 128 x ceil(maxN / 256) * 256.
inline Layout layoutFor(int64_t maxM, int64_t maxN, int nranks) {
  const int64_t capM = (std::max<int64_t>(maxM, 1) + kBlockM - 1) / kBlockM * kBlockM;
  const int64_t capN = (std::max<int64_t>(maxN, 1) + kBlockN - 1) / kBlockN * kBlockN;
  return layoutWith((capM / kHalfRows) * (capN / kBlockN), static_cast<size_t>(capM) * static_cast<size_t>(capN) * 4,
                    nranks);
}
// Fixed matrix size: flags for as many half tiles as matrices of 16-bit partials can hold (fp32 partials fit half as
// many, so the flags always cover an op whose partials fit).
inline Layout layoutFixed(int64_t matBytes, int nranks) {
  return layoutWith(matBytes / (kHalfRows * kBlockN * 2), static_cast<size_t>(matBytes), nranks);
}
inline Layout layoutOf(const GemmRsParams& p) {
  return p.wsMatBytes > 0 ? layoutFixed(p.wsMatBytes, p.nranks) : layoutFor(p.wsMaxM, p.wsMaxN, p.nranks);
}

inline std::string planName(const GemmRsPlan& p, bool allReduce) {
  if (p.kind == GemmRsPlanKind::kAuto) return "auto";
  if (p.kind == GemmRsPlanKind::kDecomposed) {
    return std::string("decomposed/") + (allReduce ? (p.oneShot ? "1shot/" : "2shot/") : "") + "r" +
           std::to_string(p.numReduce);
  }
  std::string s = "fused/";
  if (allReduce) s += p.oneShot ? "1shot/" : "2shot/";
  s += p.transport == GemmRsTransport::kPush   ? "push"
       : p.transport == GemmRsTransport::kSend ? "send"
       : p.transport == GemmRsTransport::kPull ? "pull"
                                               : "copy";
  s += p.partial == GemmRsPartial::kFp32 ? "/fp32" : "/bf16";
  s += p.epiReduce ? "/epi" : "/r" + std::to_string(p.numReduce);
  if (p.numSend > 0) s += "/s" + std::to_string(p.numSend);
  if (p.numCompute > 0) s += "/c" + std::to_string(p.numCompute);
  return s;
}

inline int smCount(const char* op) {
  int device = 0;
  checkCuda(op, cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  checkCuda(op, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  int major = 0;
  checkCuda(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  if (major != 9) fail(op, "needs an sm_90 (Hopper) GPU; device " + std::to_string(device) + " is sm_" + std::to_string(major) + "x");
  return sms;
}

// The opt-in shared memory of a fused kernel, set once per (device, kernel).
inline void prepareFused(const char* op, FusedFn fn) {
  static std::mutex mu;
  static std::pair<int, FusedFn> done[64];
  static int used = 0;
  int device = 0;
  checkCuda(op, cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; ++i) {
    if (done[i].first == device && done[i].second == fn) return;
  }
  checkCuda(op, cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(gemm::kSmemBytes<gemm::kStages> + kExtraSmem)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (used < 64) done[used++] = {device, fn};
}

// A [rows, cols] matrix of 16-bit elements (row stride ld), 64-column boxes of boxRows rows, 128-byte swizzle. Cached
// (tensor_map_cache.hpp): a launch encodes up to four maps, about a microsecond of host time each, the same ones op
// after op.
inline CUtensorMap encodeMap(const char* op, const void* ptr, int64_t rows, int64_t cols, int64_t ld, uint32_t boxRows,
                             GemmDtype dt) {
  static TensorMapCache cache;
  CUtensorMap map;
  const TensorMapKey key = TensorMapKey::matrix(ptr, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols),
                                                static_cast<uint64_t>(ld), boxRows, static_cast<uint32_t>(gemm::kBlockK),
                                                dt);
  const CUresult r = cache.get(key, &map);
  if (r != CUDA_SUCCESS) fail(op, "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(static_cast<int>(r)) + ")");
  return map;
}

inline void validate(const char* op, const GemmRsParams& p, bool allReduce) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (p.nranks < 1 || p.nranks > kMaxRanks) fail(op, "nranks must be in [1, " + str(kMaxRanks) + "], got " + str(p.nranks));
  if (p.rank < 0 || p.rank >= p.nranks) fail(op, "rank " + str(p.rank) + " out of [0, " + str(p.nranks) + ")");
  if (p.dtype != GemmDtype::kBf16 && p.dtype != GemmDtype::kFp16) fail(op, "dtype must be bf16 or fp16");
  if (p.m < 1 || p.n < 1 || p.k < 1) fail(op, "m, n, k must be >= 1, got m=" + str(p.m) + " n=" + str(p.n) + " k=" + str(p.k));
  if (p.m > 0x7fffffff || p.n > 0x7fffffff || p.k > 0x7fffffff) fail(op, "m, n and k must each be below 2^31");
  if (p.k % 8 != 0) fail(op, "this rank's k slice must be a multiple of 8 (16-byte TMA strides), got " + str(p.k));
  if (p.n % 8 != 0) fail(op, "n must be a multiple of 8, got " + str(p.n));
  if (p.a == nullptr || p.b == nullptr || p.out == nullptr) fail(op, "a, b or out is null");
  const auto misaligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 != 0; };
  if (misaligned(p.a) || misaligned(p.b) || misaligned(p.out)) fail(op, "a, b and out must be 16-byte aligned");
  if (p.layout != GemmLayout::kABt && p.layout != GemmLayout::kAB && p.layout != GemmLayout::kAtB) {
    fail(op, "layout must be kABt, kAB or kAtB");
  }
  // Row lengths of A and B as stored (gemm_layouts.hpp's table).
  const bool aKM = p.layout == GemmLayout::kAtB;
  const bool bKN = p.layout != GemmLayout::kABt;
  const int64_t aRow = aKM ? p.m : p.k, bRow = bKN ? p.n : p.k;
  if (p.lda < aRow || p.lda % 8 != 0) {
    fail(op, std::string("lda must be >= ") + (aKM ? "m" : "k") + " and a multiple of 8, got " + str(p.lda));
  }
  if (p.ldb < bRow || p.ldb % 8 != 0) {
    fail(op, std::string("ldb must be >= ") + (bKN ? "n" : "k") + " and a multiple of 8, got " + str(p.ldb));
  }
  if (p.ldOut < p.n || p.ldOut % 8 != 0) fail(op, "ldOut must be >= n and a multiple of 8, got " + str(p.ldOut));
  if (p.wsMatBytes < 0 || p.wsMatBytes % 65536 != 0) {
    fail(op, "wsMatBytes must be 0 or a multiple of 64 KiB, got " + str(p.wsMatBytes));
  }
  if (p.wsMatBytes == 0 && (p.m > p.wsMaxM || p.n > p.wsMaxN)) {
    fail(op, "the workspace was sized for m <= " + str(p.wsMaxM) + ", n <= " + str(p.wsMaxN) + "; got m=" + str(p.m) +
                 " n=" + str(p.n) + " (see gemmRsWorkspaceBytes)");
  }
  for (int q = 0; q < p.nranks; ++q) {
    if (p.workspace[q] == nullptr) fail(op, "workspace of rank " + str(q) + " is null");
    if (q != p.rank && p.nranks > 1 && p.peerOut[q] == nullptr) fail(op, "peerOut of rank " + str(q) + " is null");
  }
  if (p.epoch == 0 || p.epoch == kAbortValue) fail(op, "epoch must be in [1, 2^64 - 2]");
  const auto knob = static_cast<int32_t>(p.epilogue);
  if (knob < 0 || knob > static_cast<int32_t>(GemmRsEpilogue::kTmaPeerEarly)) {
    fail(op, "epilogue must be a GemmRsEpilogue (0 default, 1 generic, 2 TMA with the peer's partial, 3 the same "
             "with early loads), got " + str(knob) + "; leave it 0 outside benchmarks");
  }
  if (p.fp8.enabled != 0) {
    if (p.layout != GemmLayout::kABt) {
      fail(op, "FP8 operands take layout kABt only (fp8 wgmma reads K-major operands): transpose in the producer");
    }
    if (p.plan.kind == GemmRsPlanKind::kFused) fail(op, "FP8 operands run the decomposed plan (or kAuto)");
    if (p.k % 16 != 0) fail(op, "FP8 operands need this rank's k slice a multiple of 16, got " + str(p.k));
    if (p.lda % 16 != 0 || p.ldb % 16 != 0) fail(op, "FP8 operands need lda and ldb multiples of 16 bytes");
    if (p.fp8.aScale == nullptr || p.fp8.bScale == nullptr) fail(op, "FP8 operands need aScale and bScale");
    if (p.fp8.scaling == Fp8Scaling::kBlock && (p.m % 4 != 0 || reinterpret_cast<uintptr_t>(p.fp8.aScale) % 16 != 0)) {
      fail(op, "block scaling reads aScale [k/128, m] in place: m must be a multiple of 4 and aScale 16-byte aligned, "
               "got m = " + str(p.m));
    }
  }
  (void)allReduce;
}

// Plan with defaults filled in and checked against the role rules (throws on an inconsistent plan).
inline GemmRsPlan finishPlan(const char* op, GemmRsPlan plan, bool allReduce, int nranks, int numSms) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (plan.kind == GemmRsPlanKind::kDecomposed) {
    if (plan.numReduce <= 0) plan.numReduce = static_cast<int16_t>(numSms);
    if (!allReduce) plan.oneShot = 0;
    return plan;
  }
  if (plan.kind != GemmRsPlanKind::kFused) fail(op, "unknown plan kind");
  if (!allReduce) plan.oneShot = 0;
  if (plan.oneShot) {
    plan.transport = GemmRsTransport::kPull;
    if (plan.epiReduce) fail(op, "a one-shot plan reduces in reduce CTAs (epiReduce would deadlock)");
  }
  if (plan.transport != GemmRsTransport::kSend) plan.numSend = 0;
  if (plan.transport == GemmRsTransport::kCopy && !plan.epiReduce) {
    fail(op, "transport copy reduces the own rows in the epilogue: set epiReduce");
  }
  if (plan.epiReduce) plan.numReduce = 0;
  if (!plan.epiReduce && plan.numReduce < 1) fail(op, "a plan without epiReduce needs reduce CTAs");
  if (plan.transport == GemmRsTransport::kSend && nranks > 1 && plan.numSend < 1) fail(op, "transport send needs send CTAs");
  if (plan.numCompute <= 0) plan.numCompute = static_cast<int16_t>(numSms - plan.numReduce - plan.numSend);
  if (plan.numCompute < 1 || plan.numCompute + plan.numReduce + plan.numSend > numSms) {
    fail(op, "role table does not fit: " + str(plan.numReduce) + " reduce + " + str(plan.numSend) + " send + " +
                 str(plan.numCompute) + " compute CTAs on " + str(numSms) + " SMs (all must be co-resident)");
  }
  return plan;
}

inline FusedKernelParams buildParams(const char* op, const GemmRsParams& p, const GemmRsPlan& plan, bool allReduce) {
  FusedKernelParams kp;
  std::memset(&kp, 0, sizeof(kp));
  const Layout l = layoutOf(p);
  const int64_t tilesM = (p.m + kBlockM - 1) / kBlockM;
  const int64_t tilesN = (p.n + kBlockN - 1) / kBlockN;
  if (tilesM * tilesN > 0x7fffffff / 2) fail(op, "too many tiles");
  const bool decomposed = plan.kind == GemmRsPlanKind::kDecomposed;
  const bool fp8 = p.fp8.enabled != 0;
  const auto psize = static_cast<size_t>(gemmRsPartialBytes(plan, fp8));
  const int64_t need = gemmRsMatBytesNeeded(p.m, p.n, plan, fp8);
  // One rank stages nothing (its partials stay in registers), so only the fixed layout of a real exchange must fit.
  if (p.wsMatBytes > 0 && p.nranks > 1 && need > p.wsMatBytes) {
    fail(op, "the workspace's staging matrices hold " + std::to_string(p.wsMatBytes) + " bytes; m=" + std::to_string(p.m) +
                 " n=" + std::to_string(p.n) + " with this plan needs " + std::to_string(need) +
                 " (see gemmRsFixedWorkspaceBytes)");
  }

  if (gemmRsFusedTakes(p)) {  // the fused kernel's maps; the layouts and FP8 cores encode their own
    kp.g.tmA = encodeMap(op, p.a, p.m, p.k, p.lda, kBlockM, p.dtype);
    // kABt: B [n, k], 256-row boxes. kAB: B [k, n] loaded MN-major, {64 columns, 64 k} boxes (gemm_sm90.cuh tmaLoadB).
    kp.g.tmB = p.layout == GemmLayout::kABt ? encodeMap(op, p.b, p.n, p.k, p.ldb, kBlockN, p.dtype)
                                            : encodeMap(op, p.b, p.k, p.n, p.ldb, gemm::kBlockK, p.dtype);
  }
  kp.g.c = p.out;
  kp.g.ldc = p.ldOut;
  kp.g.m = static_cast<int32_t>(p.m);
  kp.g.n = static_cast<int32_t>(p.n);
  kp.g.k = static_cast<int32_t>(p.k);
  kp.g.numKBlocks = static_cast<int32_t>((p.k + gemm::kBlockK - 1) / gemm::kBlockK);
  kp.g.unitsM = static_cast<int32_t>(tilesM);
  kp.g.tilesN = static_cast<int32_t>(tilesN);
  kp.g.groupM = p.groupM > 0 ? p.groupM : 16;

  kp.rank = p.rank;
  kp.nranks = p.nranks;
  kp.tilesM = static_cast<int32_t>(tilesM);
  kp.tilesN = static_cast<int32_t>(tilesN);
  kp.allReduce = allReduce ? 1 : 0;
  kp.oneShot = (allReduce && plan.oneShot) ? 1 : 0;
  kp.transport = decomposed ? static_cast<int32_t>(GemmRsTransport::kPull) : static_cast<int32_t>(plan.transport);
  kp.epiReduce = (!decomposed && plan.epiReduce) ? 1 : 0;
  kp.numReduce = plan.numReduce;
  kp.numSend = decomposed ? 0 : plan.numSend;
  kp.numCompute = decomposed ? 0 : plan.numCompute;
  // Stores that crossed NVLink are published one tile later, when the fence finds them long completed.
  kp.deferRelease = (!decomposed && !kp.oneShot && plan.transport == GemmRsTransport::kPush) ? 1 : 0;
  kp.groupM = kp.g.groupM;

  // Tile rows reduced by each rank: the owner of a tile row's first row (monotone, so contiguous ranges).
  {
    const int64_t q = p.m / p.nranks, rem = p.m % p.nranks, big = rem * (q + 1);
    for (int d = 0; d < kMaxRanks; ++d) kp.redTr0[d] = kp.redTr1[d] = -1;
    for (int64_t tr = 0; tr < tilesM; ++tr) {
      const int64_t row = tr * kBlockM;
      const int d = static_cast<int>(row < big ? row / (q + 1) : rem + (row - big) / q);
      if (kp.redTr0[d] < 0) kp.redTr0[d] = static_cast<int32_t>(tr);
      kp.redTr1[d] = static_cast<int32_t>(tr + 1);
    }
    for (int d = 0; d < kMaxRanks; ++d) {
      if (kp.redTr0[d] < 0) kp.redTr0[d] = kp.redTr1[d] = 0;  // reduces nothing
    }
  }
  if (kp.oneShot) {
    kp.numPhases = 1;
    kp.phaseTr0[0] = 0;
    kp.phaseTr1[0] = static_cast<int32_t>(tilesM);
    kp.ownWork0 = 0;
  } else {
    kp.numPhases = p.nranks;
    int32_t start = 0;
    for (int ph = 0; ph < p.nranks; ++ph) {
      const int d = (p.rank + 1 + ph) % p.nranks;  // own rows (d == rank) last
      kp.phaseTr0[ph] = kp.redTr0[d];
      kp.phaseTr1[ph] = kp.redTr1[d];
      if (ph == p.nranks - 1) kp.ownWork0 = start;
      start += (kp.redTr1[d] - kp.redTr0[d]) * static_cast<int32_t>(tilesN);
    }
  }
  kp.numWork = static_cast<int32_t>(tilesM * tilesN);

  kp.ldP = tilesN * kBlockN;
  kp.ldOut = p.ldOut;
  kp.srcStride = static_cast<int64_t>(l.matBytes / psize);
  kp.flagStride = l.maxHalf;
  kp.epoch = p.epoch;
  kp.epochWord = p.epochWord;
  kp.timeoutNs = p.timeoutNs ? p.timeoutNs : 10ull * 1000 * 1000 * 1000;
  const size_t parity = p.epoch & 1;
  for (int q = 0; q < p.nranks; ++q) {
    char* const base = static_cast<char*>(p.workspace[q]);
    kp.ready[q] = reinterpret_cast<uint64_t*>(base + l.readyOff);
    kp.inFlags[q] = reinterpret_cast<uint64_t*>(base + l.inFlagsOff);
    kp.outFlags[q] = reinterpret_cast<uint64_t*>(base + l.outFlagsOff);
    kp.finFlags[q] = reinterpret_cast<uint64_t*>(base + l.finFlagsOff);
    kp.inbox[q] = base + l.stagingOff + parity * static_cast<size_t>(p.nranks) * l.matBytes;
    kp.outbox[q] = base + l.stagingOff + static_cast<size_t>(2 * p.nranks) * l.matBytes + parity * l.matBytes;
    kp.out[q] = q == p.rank ? p.out : p.peerOut[q];
  }
  kp.abortWord = p.abortWord;
  kp.errorSlot = p.errorSlot;
  kp.trace = decomposed ? nullptr : p.trace;
  kp.traceTiles = p.traceTiles;
  kp.finViaCopier = (!decomposed && allReduce && !kp.oneShot && plan.transport == GemmRsTransport::kCopy) ? 1 : 0;
  // One rank adds nothing to its own tiles: they leave through the GEMM core's TMA-store epilogue (rows of the tile are
  // rows of this rank's output, which at one rank is the whole [m, n] output of either op), unless the test knob asks
  // for the generic path. At two ranks with 16-bit partials copied by the copier warps, a reduce-scatter (and with
  // kTmaPeer an all-reduce) does it too, adding the peer's partial from the inbox in smem first (the half tiles whose
  // rows are all this rank's; the device code checks that per half tile): measured on one H200 with two ranks on 66 SMs
  // each, that own-tile epilogue took 5.3 us instead of 11.1 (gemm_rs_one_rank_bench). An all-reduce's copier warps
  // then broadcast the stored rows as before.
  const bool early = p.epilogue == GemmRsEpilogue::kTmaPeerEarly;
  const bool tmaKnob = p.epilogue == GemmRsEpilogue::kDefault || p.epilogue == GemmRsEpilogue::kTmaPeer || early;
  const bool peerKnob = p.epilogue == GemmRsEpilogue::kTmaPeer || early ||
                        (p.epilogue == GemmRsEpilogue::kDefault && !allReduce);
  const int64_t myRows = allReduce ? p.m : rsRowsOf(p.m, p.rank, p.nranks);
  if (!decomposed && kp.epiReduce && tmaKnob && p.nranks == 1) {
    kp.ownTma = 1;
  } else if (!decomposed && kp.epiReduce && peerKnob && p.nranks == 2 && psize == 2 &&
             plan.transport == GemmRsTransport::kCopy && myRows > 0) {
    kp.ownTma = early ? 3 : 2;
    const int peer = 1 - p.rank;
    const void* peerPartials = static_cast<const char*>(kp.inbox[p.rank]) + static_cast<size_t>(peer) * l.matBytes;
    kp.tmPeer = encodeMap(op, peerPartials, tilesM * kBlockM, kp.ldP, kp.ldP, gemm::kRowsPerConsumer, p.dtype);
  }
  if (kp.ownTma != 0) kp.g.tmC = encodeMap(op, p.out, myRows, p.n, p.ldOut, gemm::kRowsPerConsumer, p.dtype);
  return kp;
}

// Enqueues a resolved plan (finishPlan) on `stream`.
// The decomposed plan's GEMM on the layouts core into c (row stride ldc), K splits fitted to p.splitK.
inline void layoutsCoreGemm(const GemmRsParams& p, void* c, int64_t ldc, cudaStream_t stream) {
  GemmLayoutParams g{};
  g.layout = p.layout;
  g.dtype = p.dtype;
  g.out = GemmOut::kInput;
  g.a = p.a;
  g.b = p.b;
  g.c = c;
  g.m = p.m;
  g.n = p.n;
  g.k = p.k;
  g.lda = p.lda;
  g.ldb = p.ldb;
  g.ldc = ldc;
  g.workspace = p.splitK;
  g.workspaceBytes = p.splitK != nullptr ? p.splitKBytes : 0;
  const GemmLayoutPlan plan = gemmLayoutPlanWithin(g);
  launchGemmLayout(g, stream, &plan);
}

// The decomposed plan's GEMM with FP8 operands into c (row stride ldc elements of `out`).
inline void fp8CoreGemm(const char* op, const GemmRsParams& p, void* c, int64_t ldc, Fp8Out out, cudaStream_t stream) {
  GemmFp8Params g{};
  g.aFormat = p.fp8.aFormat;
  g.bFormat = p.fp8.bFormat;
  g.scaling = p.fp8.scaling;
  g.out = out;
  g.a = p.a;
  g.b = p.b;
  g.c = c;
  g.scaleA = p.fp8.aScale;
  g.scaleB = p.fp8.bScale;
  g.m = p.m;
  g.n = p.n;
  g.k = p.k;
  g.lda = p.lda;
  g.ldb = p.ldb;
  g.ldc = ldc;
  g.ldsa = p.m;  // aScale [ceil(k / 128), m] as the op lays it out (validate: m % 4 == 0 in block scaling)
  try {
    launchGemmFp8(g, stream);
  } catch (const std::exception& e) {  // launchGemmFp8 throws std::invalid_argument too
    fail(op, e.what());
  }
}

inline void launchReduction(const char* op, FusedFn fn, const FusedKernelParams& kp, int numReduce,
                            cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(numReduce), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  checkCuda(op, cudaLaunchKernelEx(&cfg, fn, kp), "launching the reduction kernel");
}

inline void launchPlan(const char* op, const KernelTable& kt, const GemmRsParams& p, const GemmRsPlan& plan,
                       bool allReduce, cudaStream_t stream) {
  const int dt = p.dtype == GemmDtype::kBf16 ? 0 : 1;
  if (p.fp8.enabled != 0) {  // launchFamily made the plan decomposed
    if (p.nranks == 1) {     // nothing to reduce: the core writes the output
      fp8CoreGemm(op, p, p.out, p.ldOut, p.fp8.out, stream);
      return;
    }
    const FusedKernelParams kp = buildParams(op, p, plan, allReduce);
    fp8CoreGemm(op, p, kp.outbox[p.rank], kp.ldP, Fp8Out::kFp32, stream);
    launchReduction(op, kt.reduceFp8[p.fp8.out == Fp8Out::kFp32 ? 1 : 0], kp, plan.numReduce, stream);
    return;
  }
  if (plan.kind == GemmRsPlanKind::kDecomposed && gemmRsOnLayoutsCore(p)) {
    if (p.nranks == 1) {  // nothing to reduce: the GEMM writes the output
      layoutsCoreGemm(p, p.out, p.ldOut, stream);
      return;
    }
    const FusedKernelParams kp = buildParams(op, p, plan, allReduce);
    layoutsCoreGemm(p, kp.outbox[p.rank], kp.ldP, stream);
    launchReduction(op, kt.reduce[dt], kp, plan.numReduce, stream);
    return;
  }
  if (plan.kind == GemmRsPlanKind::kDecomposed) {
    GemmParams g{};
    g.a = p.a;
    g.b = p.b;
    g.m = p.m;
    g.n = p.n;
    g.k = p.k;
    g.lda = p.lda;
    g.ldb = p.ldb;
    g.dtype = p.dtype;
    if (p.nranks == 1) {  // nothing to reduce: the GEMM writes the output
      g.c = p.out;
      g.ldc = p.ldOut;
      launchGemm(g, stream);
      return;
    }
    const FusedKernelParams kp = buildParams(op, p, plan, allReduce);
    g.c = kp.outbox[p.rank];
    g.ldc = kp.ldP;
    launchGemm(g, stream);
    launchReduction(op, kt.reduce[dt], kp, plan.numReduce, stream);
    return;
  }
  const FusedKernelParams kp = buildParams(op, p, plan, allReduce);
  const FusedFn fn = kt.fused[dt][plan.partial == GemmRsPartial::kFp32 ? 0 : 1][p.layout == GemmLayout::kAB ? 1 : 0];
  prepareFused(op, fn);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.numReduce + plan.numSend + plan.numCompute), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = gemm::kSmemBytes<gemm::kStages> + kExtraSmem;
  cfg.stream = stream;
  checkCuda(op, cudaLaunchKernelEx(&cfg, fn, kp), "launching the fused kernel");
}

// The plan measured fastest for both ops at every benchmark shape (the choosers in gemm_rs.cu and gemm_ar.cu say
// where): one fused kernel on every SM, partials copied in the input dtype, reduced in the epilogue.
inline GemmRsPlan fusedCopyPlan() {
  GemmRsPlan p{};
  p.kind = GemmRsPlanKind::kFused;
  p.transport = GemmRsTransport::kCopy;
  p.partial = GemmRsPartial::kInput;
  p.epiReduce = 1;
  return p;
}

// One rank reduces nothing: the op is the GEMM core alone (launchPlan's decomposed path at one rank), since the fused
// kernel's epilogue only costs time there (13-35% over the GEMM alone, measured with fused_e2e_bench --ranks 1).
inline GemmRsPlan plainGemmPlan() {
  GemmRsPlan p{};
  p.kind = GemmRsPlanKind::kDecomposed;
  return p;
}

// Loads every kernel of a family now (tandem/kernels/preload.hpp says why).
inline void preloadTable(int device, const KernelTable& kt, const char* op) {
  const FusedFn fns[] = {kt.fused[0][0][0], kt.fused[0][0][1], kt.fused[0][1][0], kt.fused[0][1][1],
                         kt.fused[1][0][0], kt.fused[1][0][1], kt.fused[1][1][0], kt.fused[1][1][1],
                         kt.reduce[0],      kt.reduce[1],      kt.reduceFp8[0],   kt.reduceFp8[1]};
  preloadOn(device, fns, op);
}

// Validates, resolves the plan (`chosen` stands in for kAuto) and enqueues it. Returns the plan enqueued.
inline GemmRsPlan launchFamily(const char* op, const KernelTable& kt, const GemmRsParams& params,
                               const GemmRsPlan& chosen, bool allReduce, cudaStream_t stream) {
  validate(op, params, allReduce);
  const int sms = smCount(op);
  GemmRsPlan plan = params.plan.kind == GemmRsPlanKind::kAuto ? chosen : params.plan;
  if (!gemmRsFusedTakes(params)) {
    if (params.plan.kind == GemmRsPlanKind::kFused) {
      fail(op, "the fused plans take 16-bit layouts kABt and kAB on the forward core only; use the decomposed plan "
               "(or kAuto) with FP8 operands, kAtB or layoutsCore");
    }
    if (params.plan.kind == GemmRsPlanKind::kAuto) plan = GemmRsPlan{GemmRsPlanKind::kDecomposed};
  }
  plan = finishPlan(op, plan, allReduce, params.nranks, sms);
  launchPlan(op, kt, params, plan, allReduce, stream);
  return plan;
}

}  // namespace tandem::kernels::rs
