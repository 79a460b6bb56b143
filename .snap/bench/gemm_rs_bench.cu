// Fused GEMM + ReduceScatter and GEMM + AllReduce (kernels/gemm_rs.cu, kernels/gemm_ar.cu) vs cuBLASLt + NCCL, one
// process driving every GPU (one NCCL communicator per GPU through ncclCommInitAll). K is split across the ranks.
//
// 1. Correctness against an fp32 reference (‖out − ref‖ / ‖ref‖ < 1e-2, no non-finite value, outputs poisoned with
//    NaN first): every plan at odd shapes (tile non-multiples, uneven rows) on 2 ranks and on 1 rank, and at the
//    benchmark shapes.
// 2. Determinism: a plan repeated --det-reps times on the same inputs must give bitwise identical outputs.
// 3. Timing: per shape, every candidate (baseline cuBLASLt GEMM then NCCL, GEMM alone, our plans) in round-robin
//    order; each iteration starts with a cross-GPU barrier kernel so no rank starts early, CUDA events on every rank,
//    the max over ranks per iteration, the median over --iters iterations; two input sets alternate (> L2).
//
//   gemm_rs_bench [--iters N] [--det-reps N] [--json FILE] [--skip-big] [--shape I]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"  // after <cublasLt.h> and <nccl.h>: it defines BK/NK for those it finds
#include "cublaslt_gemm.hpp"
#include "ref_gemm.cuh"
#include "device/ordering.cuh"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_ar.hpp"
#include "tandem/kernels/gemm_rs.hpp"

using namespace tandem::kernels;

namespace {


constexpr int kMaxDev = 8;
int gRanks = 2;
cudaStream_t gStream[kMaxDev];
ErrorSlot* gSlotHost[kMaxDev];
ErrorSlot* gSlotDev[kMaxDev];
uint64_t gEpoch = 0;
bool gFailed = false;

bool gSlotTripped = false;  // a device-side wait failed (reported and cleared); the op's output is invalid
void checkSlots(const std::string& what) {
  for (int r = 0; r < gRanks; ++r) {
    ErrorSlot& e = *gSlotHost[r];
    if (e.claimed) {
      std::printf("FAIL: %s: rank %d wait error code %u op %u role %u rank %u chunk %u expected %llu observed %llu\n",
                  what.c_str(), r, e.code, e.op, e.role, e.rank, e.chunk, (unsigned long long)e.expected,
                  (unsigned long long)e.observed);
      std::fflush(stdout);
      std::memset(&e, 0, sizeof(e));
      gSlotTripped = true;
      gFailed = true;
    }
  }
}

// A hung kernel must not eat the device lease: give up after `seconds`.
void syncAll(double seconds, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < gRanks; ++r) {
    for (;;) {
      CK(cudaSetDevice(r));
      const cudaError_t e = cudaStreamQuery(gStream[r]);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        std::printf("FAIL: %s: %s (%s)\n", what.c_str(), cudaGetErrorName(e), cudaGetErrorString(e));
        std::fflush(stdout);
        std::_Exit(4);
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
        checkSlots(what);
        std::printf("FAIL: %s: still running after %.0f s (hang?)\n", what.c_str(), seconds);
        std::fflush(stdout);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  checkSlots(what);
}

using tandem::bench::refGemm;
using tandem::bench::fillUniform;
using tandem::bench::relErrorKernel;

__global__ void addInto(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}


// Counts 16-bit words that differ between a and b ([rows, n], row stride ld).
__global__ void diffBits(const uint16_t* a, const uint16_t* b, int64_t ld, int rows, int n, unsigned long long* diff) {
  unsigned long long d = 0;
  const int64_t total = int64_t(rows) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t off = (i / n) * ld + i % n;
    d += a[off] != b[off];
  }
  for (int o = 16; o > 0; o /= 2) d += __shfl_down_sync(0xffffffffu, d, o);
  if ((threadIdx.x & 31) == 0 && d) atomicAdd(diff, d);
}

// Cross-GPU barrier: rank r writes `epoch` into every rank's slot r, then waits for every slot >= epoch (5 s limit).
struct BarrierPtrs {
  uint64_t* slots[kMaxDev];  // rank q's slot array, mapped here
};
__global__ void crossBarrier(BarrierPtrs bp, int rank, int nranks, uint64_t epoch) {
  if (threadIdx.x != 0) return;
  for (int q = 0; q < nranks; ++q) stReleaseSys(bp.slots[q] + rank, epoch);
  const uint64_t t0 = globaltimerNs();
  for (int q = 0; q < nranks; ++q) {
    while (ldAcquireSys(bp.slots[rank] + q) < epoch) {
      if (globaltimerNs() - t0 > 5000000000ull) return;
    }
  }
}

using tandem::bench::LtGemm;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// ---- per-process state
struct Rank {
  cublasLtHandle_t lt{};
  void* ltWs = nullptr;
  void* workspace = nullptr;
  uint64_t* barSlots = nullptr;
  double* sums = nullptr;
  unsigned long long* bad = nullptr;
};
Rank gR[kMaxDev];
ncclComm_t gComm[kMaxDev];
BarrierPtrs gBar;
uint64_t gBarEpoch = 0;
constexpr int64_t kWsMaxM = 16384, kWsMaxN = 14336;
size_t gWsBytes = 0;
int gSms = 132;

struct Shape {
  int64_t m, n, kTotal;
  bool time;  // benchmark shape (baseline + timing) or correctness only
};

struct ShapeBufs {
  int nranks;
  int64_t m, n, kr;
  int sets;
  std::vector<void*> a[kMaxDev], b[kMaxDev];
  void* outRs[kMaxDev]{};
  void* outAr[kMaxDev]{};
  void* cPart[kMaxDev]{};
  void* ncRs[kMaxDev]{};
  void* ncAr[kMaxDev]{};
  void* det[kMaxDev]{};
  float* ref[kMaxDev]{};  // full C, fp32, on every rank
};

void allocShape(ShapeBufs& sb, const Shape& sh, int nranks, int sets) {
  sb.nranks = nranks;
  sb.m = sh.m;
  sb.n = sh.n;
  sb.kr = sh.kTotal / nranks;
  sb.sets = sets;
  const size_t mn = size_t(sh.m) * sh.n;
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    for (int s = 0; s < sets; ++s) {
      void *a, *b;
      CK(cudaMalloc(&a, size_t(sh.m) * sb.kr * 2));
      CK(cudaMalloc(&b, size_t(sh.n) * sb.kr * 2));
      fillUniform<__nv_bfloat16><<<2048, 256, 0, gStream[r]>>>(static_cast<__nv_bfloat16*>(a), size_t(sh.m) * sb.kr,
                                               0x1000 + 97 * r + 13 * s + sh.m * 7 + sh.n * 3);
      fillUniform<__nv_bfloat16><<<2048, 256, 0, gStream[r]>>>(static_cast<__nv_bfloat16*>(b), size_t(sh.n) * sb.kr,
                                               0x5000 + 89 * r + 17 * s + sh.m * 5 + sh.n * 11);
      CK(cudaGetLastError());
      sb.a[r].push_back(a);
      sb.b[r].push_back(b);
    }
    CK(cudaMalloc(&sb.outRs[r], mn * 2));
    CK(cudaMalloc(&sb.outAr[r], mn * 2));
    CK(cudaMalloc(&sb.cPart[r], mn * 2));
    CK(cudaMalloc(&sb.ncRs[r], mn * 2));
    CK(cudaMalloc(&sb.ncAr[r], mn * 2));
    CK(cudaMalloc(&sb.det[r], mn * 2));
    CK(cudaMalloc(&sb.ref[r], mn * 4));
  }
  // Reference: each rank's fp32 partial of set 0, summed on rank 0, copied to every rank.
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    dim3 grid(unsigned((sh.n + 63) / 64), unsigned((sh.m + 63) / 64));
    refGemm<__nv_bfloat16><<<grid, dim3(16, 16), 0, gStream[r]>>>(static_cast<const __nv_bfloat16*>(sb.a[r][0]),
                                                    static_cast<const __nv_bfloat16*>(sb.b[r][0]), sb.ref[r], int(sh.m),
                                                    int(sh.n), int(sb.kr), sb.kr, sb.kr, 0);
    CK(cudaGetLastError());
  }
  syncAll(300, "reference");
  if (nranks > 1) {
    CK(cudaSetDevice(0));
    float* tmp = nullptr;
    CK(cudaMalloc(&tmp, mn * 4));
    for (int r = 1; r < nranks; ++r) {
      CK(cudaMemcpyPeerAsync(tmp, 0, sb.ref[r], r, mn * 4, gStream[0]));
      addInto<<<2048, 256, 0, gStream[0]>>>(sb.ref[0], tmp, mn);
      CK(cudaGetLastError());
    }
    for (int r = 1; r < nranks; ++r) CK(cudaMemcpyPeerAsync(sb.ref[r], r, sb.ref[0], 0, mn * 4, gStream[0]));
    syncAll(60, "reference sum");
    CK(cudaFree(tmp));
  }
}

void freeShape(ShapeBufs& sb) {
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    for (auto* p : sb.a[r]) cudaFree(p);
    for (auto* p : sb.b[r]) cudaFree(p);
    sb.a[r].clear();
    sb.b[r].clear();
    for (void* p : {sb.outRs[r], sb.outAr[r], sb.cPart[r], sb.ncRs[r], sb.ncAr[r], sb.det[r]}) cudaFree(p);
    cudaFree(sb.ref[r]);
  }
}

uint64_t* gTrace[kMaxDev];  // non-null while a traced run is enqueued
constexpr int kTraceTiles = 64;
constexpr size_t kTraceWords = size_t(132) * 2 * (kTraceTiles + 1) * 4;

enum class Op { kRs, kAr };
enum class CandType { kBaseline, kGemmLt, kGemmOurs, kOurs };
struct Cand {
  std::string name;
  CandType type;
  Op op;
  GemmRsPlan plan;
  std::string ran;  // the plan that ran (auto resolves through the chooser)
};

GemmRsPlan fused(GemmRsTransport t, GemmRsPartial part, bool epi, int reduce, int send = 0, bool oneShot = false) {
  GemmRsPlan p{};
  p.kind = GemmRsPlanKind::kFused;
  p.transport = t;
  p.partial = part;
  p.epiReduce = epi ? 1 : 0;
  p.oneShot = oneShot ? 1 : 0;
  p.numReduce = static_cast<int16_t>(reduce);
  p.numSend = static_cast<int16_t>(send);
  return p;
}
GemmRsPlan decomposed(int reduce, bool oneShot = false) {
  GemmRsPlan p{};
  p.kind = GemmRsPlanKind::kDecomposed;
  p.numReduce = static_cast<int16_t>(reduce);
  p.oneShot = oneShot ? 1 : 0;
  return p;
}

std::vector<Cand> ourPlans(Op op) {
  using T = GemmRsTransport;
  using P = GemmRsPartial;
  std::vector<Cand> v;
  const auto add = [&](const GemmRsPlan& p) { v.push_back({"", CandType::kOurs, op, p, ""}); };
  add(GemmRsPlan{});  // auto
  if (op == Op::kRs) {
    add(fused(T::kCopy, P::kInput, true, 0));
    add(fused(T::kCopy, P::kFp32, true, 0));
    add(fused(T::kPush, P::kInput, true, 0));
    add(fused(T::kPush, P::kFp32, true, 0));
    add(fused(T::kPush, P::kInput, false, 8));
    add(fused(T::kPush, P::kInput, false, 16));
    add(fused(T::kPush, P::kFp32, false, 16));
    add(fused(T::kSend, P::kInput, true, 0, 8));
    add(fused(T::kPull, P::kInput, false, 16));
    add(decomposed(32));
    add(decomposed(132));
  } else {
    add(fused(T::kCopy, P::kInput, true, 0));
    add(fused(T::kCopy, P::kFp32, true, 0));
    add(fused(T::kPush, P::kInput, true, 0));
    add(fused(T::kPush, P::kFp32, true, 0));
    add(fused(T::kPush, P::kInput, false, 16));
    add(fused(T::kSend, P::kInput, true, 0, 8));
    add(fused(T::kPull, P::kInput, false, 8, 0, true));
    add(fused(T::kPull, P::kInput, false, 16, 0, true));
    add(fused(T::kPull, P::kFp32, false, 16, 0, true));
    add(decomposed(132, true));
    add(decomposed(32, false));
    add(decomposed(132, false));
  }
  for (auto& c : v) {
    c.name = c.plan.kind == GemmRsPlanKind::kAuto ? std::string("ours: auto")
                                                   : std::string("ours: ") + gemmRsPlanName(c.plan, op == Op::kAr);
  }
  return v;
}

GemmRsParams makeParams(const ShapeBufs& sb, int r, int set, Op op, const GemmRsPlan& plan, uint64_t epoch) {
  GemmRsParams p{};
  p.rank = r;
  p.nranks = sb.nranks;
  p.m = sb.m;
  p.n = sb.n;
  p.k = sb.kr;
  p.dtype = GemmDtype::kBf16;
  p.a = sb.a[r][set];
  p.b = sb.b[r][set];
  p.lda = sb.kr;
  p.ldb = sb.kr;
  void* const* outs = op == Op::kRs ? sb.outRs : sb.outAr;
  p.out = outs[r];
  p.ldOut = sb.n;
  for (int q = 0; q < sb.nranks; ++q) {
    p.peerOut[q] = outs[q];
    p.workspace[q] = gR[q].workspace;
  }
  p.wsMaxM = kWsMaxM;
  p.wsMaxN = kWsMaxN;
  p.epoch = epoch;
  p.errorSlot = gSlotDev[r];
  p.timeoutNs = 3000000000ull;
  p.plan = plan;
  p.trace = gTrace[r];
  p.traceTiles = kTraceTiles;
  return p;
}

LtGemm* gLt[kMaxDev];

// Enqueues one op on every rank of sb (no barrier, no events).
void enqueue(Cand& c, const ShapeBufs& sb, int set) {
  const size_t rowsPer = size_t(sb.m / sb.nranks);
  switch (c.type) {
    case CandType::kBaseline:
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        gLt[r]->run(sb.a[r][set], sb.b[r][set], sb.cPart[r], gStream[r]);
      }
      NK(ncclGroupStart());
      for (int r = 0; r < sb.nranks; ++r) {
        if (c.op == Op::kRs) {
          NK(ncclReduceScatter(sb.cPart[r], sb.ncRs[r], rowsPer * sb.n, ncclBfloat16, ncclSum, gComm[r],
                                       gStream[r]));
        } else {
          NK(ncclAllReduce(sb.cPart[r], sb.ncAr[r], size_t(sb.m) * sb.n, ncclBfloat16, ncclSum, gComm[r],
                                   gStream[r]));
        }
      }
      NK(ncclGroupEnd());
      break;
    case CandType::kGemmLt:
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        gLt[r]->run(sb.a[r][set], sb.b[r][set], sb.cPart[r], gStream[r]);
      }
      break;
    case CandType::kGemmOurs:
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        GemmParams g{};
        g.a = sb.a[r][set];
        g.b = sb.b[r][set];
        g.c = sb.cPart[r];
        g.m = sb.m;
        g.n = sb.n;
        g.k = sb.kr;
        g.lda = sb.kr;
        g.ldb = sb.kr;
        g.ldc = sb.n;
        g.dtype = GemmDtype::kBf16;
        launchGemm(g, gStream[r]);
      }
      break;
    case CandType::kOurs: {
      ++gEpoch;
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        const GemmRsParams p = makeParams(sb, r, set, c.op, c.plan, gEpoch);
        try {
          const GemmRsPlan ran = c.op == Op::kRs ? launchGemmRs(p, gStream[r]) : launchGemmAr(p, gStream[r]);
          c.ran = gemmRsPlanName(ran, c.op == Op::kAr);
        } catch (const std::exception& e) {
          std::printf("FAIL: %s threw: %s\n", c.name.c_str(), e.what());
          std::fflush(stdout);
          std::_Exit(6);
        }
      }
      break;
    }
  }
}

// Correctness of one candidate on input set 0: rel. error per rank vs the fp32 reference; returns the worst.
double checkCand(Cand& c, const ShapeBufs& sb, bool* ok) {
  const size_t mn = size_t(sb.m) * sb.n;
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    for (void* p : {sb.outRs[r], sb.outAr[r], sb.ncRs[r], sb.ncAr[r]}) CK(cudaMemsetAsync(p, 0xFF, mn * 2, gStream[r]));
  }
  gSlotTripped = false;
  enqueue(c, sb, 0);
  syncAll(30, c.name);
  double worst = 0;
  *ok = !gSlotTripped;
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    const bool rsOut = c.op == Op::kRs;
    const int64_t rows = rsOut ? rsRowsOf(sb.m, r, sb.nranks) : sb.m;
    const int64_t off = rsOut ? rsRowOffset(sb.m, r, sb.nranks) : 0;
    const void* out = c.type == CandType::kBaseline ? (rsOut ? sb.ncRs[r] : sb.ncAr[r]) : (rsOut ? sb.outRs[r] : sb.outAr[r]);
    CK(cudaMemsetAsync(gR[r].sums, 0, 2 * sizeof(double), gStream[r]));
    CK(cudaMemsetAsync(gR[r].bad, 0, sizeof(unsigned long long), gStream[r]));
    if (rows > 0) {
      relErrorKernel<<<1024, 256, 0, gStream[r]>>>(static_cast<const __nv_bfloat16*>(out), int64_t(sb.n),
                                                   sb.ref[r] + off * sb.n, int64_t(rows), int64_t(sb.n), gR[r].sums,
                                                   gR[r].bad);
      CK(cudaGetLastError());
    }
    double h[2];
    unsigned long long b;
    CK(cudaMemcpyAsync(h, gR[r].sums, sizeof(h), cudaMemcpyDeviceToHost, gStream[r]));
    CK(cudaMemcpyAsync(&b, gR[r].bad, sizeof(b), cudaMemcpyDeviceToHost, gStream[r]));
    CK(cudaStreamSynchronize(gStream[r]));
    const double rel = rows > 0 ? std::sqrt(h[0] / std::max(h[1], 1e-300)) : 0.0;
    if (b != 0 || !std::isfinite(rel) || rel >= 1e-2) *ok = false;
    worst = std::max(worst, b != 0 ? INFINITY : rel);
  }
  return worst;
}

// Determinism: reps runs on input set 0; every output must equal the first bit for bit. Returns differing words.
unsigned long long checkDeterminism(Cand& c, const ShapeBufs& sb, int reps) {
  const size_t mn = size_t(sb.m) * sb.n;
  enqueue(c, sb, 0);
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMemcpyAsync(sb.det[r], c.op == Op::kRs ? sb.outRs[r] : sb.outAr[r], mn * 2, cudaMemcpyDeviceToDevice,
                               gStream[r]));
    CK(cudaMemsetAsync(gR[r].bad, 0, sizeof(unsigned long long), gStream[r]));
  }
  for (int i = 1; i < reps; ++i) {
    for (int r = 0; r < sb.nranks; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaMemsetAsync(c.op == Op::kRs ? sb.outRs[r] : sb.outAr[r], 0xFF, mn * 2, gStream[r]));
    }
    enqueue(c, sb, 0);
    for (int r = 0; r < sb.nranks; ++r) {
      CK(cudaSetDevice(r));
      const int rows = int(c.op == Op::kRs ? rsRowsOf(sb.m, r, sb.nranks) : sb.m);
      if (rows > 0) {
        diffBits<<<512, 256, 0, gStream[r]>>>(static_cast<const uint16_t*>(c.op == Op::kRs ? sb.outRs[r] : sb.outAr[r]),
                                              static_cast<const uint16_t*>(sb.det[r]), sb.n, rows, int(sb.n), gR[r].bad);
        CK(cudaGetLastError());
      }
    }
    if (i % 20 == 0) syncAll(60, "determinism " + c.name);
  }
  syncAll(60, "determinism " + c.name);
  unsigned long long total = 0;
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    unsigned long long b = 0;
    CK(cudaMemcpy(&b, gR[r].bad, sizeof(b), cudaMemcpyDeviceToHost));
    total += b;
  }
  return total;
}

// Events for timing, created once: [cand][iter][rank][start/end].
std::vector<cudaEvent_t> gEvents;
constexpr int kMaxCands = 40, kMaxIters = 100;
cudaEvent_t& ev(int c, int it, int r, int which) {
  return gEvents[((size_t(c) * kMaxIters + it) * kMaxDev + r) * 2 + which];
}

// Round-robin timing of cands: returns the median (over iterations) of the max (over ranks) per candidate, ms.
std::vector<double> timeCands(std::vector<Cand>& cands, const ShapeBufs& sb, int iters, int warm) {
  for (int it = 0; it < warm + iters; ++it) {
    for (size_t c = 0; c < cands.size(); ++c) {
      const int set = it % sb.sets;
      ++gBarEpoch;
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        crossBarrier<<<1, 32, 0, gStream[r]>>>(gBar, r, sb.nranks, gBarEpoch);
        if (it >= warm) CK(cudaEventRecord(ev(int(c), it - warm, r, 0), gStream[r]));
      }
      enqueue(cands[c], sb, set);
      for (int r = 0; r < sb.nranks; ++r) {
        CK(cudaSetDevice(r));
        if (it >= warm) CK(cudaEventRecord(ev(int(c), it - warm, r, 1), gStream[r]));
      }
    }
    syncAll(60, "timing round");
  }
  std::vector<double> med;
  for (size_t c = 0; c < cands.size(); ++c) {
    std::vector<double> v;
    for (int it = 0; it < iters; ++it) {
      double mx = 0;
      for (int r = 0; r < sb.nranks; ++r) {
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ev(int(c), it, r, 0), ev(int(c), it, r, 1)));
        mx = std::max(mx, double(ms));
      }
      v.push_back(mx);
    }
    med.push_back(median(v));
  }
  return med;
}

std::vector<std::string> gSummary;  // one line per (shape, op), printed last
FILE* gJson = nullptr;
bool gJsonFirst = true;
void jsonRow(const char* section, const Shape& sh, int nranks, const std::string& cand, const std::string& ran, double ms,
             double ratio, double err, long long detDiff) {
  if (!gJson) return;
  std::fprintf(gJson, "%s{\"section\":\"%s\",\"m\":%lld,\"n\":%lld,\"k_total\":%lld,\"nranks\":%d,\"cand\":\"%s\",\"ran\":\"%s\","
               "\"ms\":%.5f,\"ratio\":%.4f,\"rel_err\":%.3e,\"det_diff\":%lld}\n",
               gJsonFirst ? "[" : ",", section, (long long)sh.m, (long long)sh.n, (long long)sh.kTotal, nranks, cand.c_str(),
               ran.c_str(), ms, ratio, err, detDiff);
  gJsonFirst = false;
  std::fflush(gJson);
}

// Correctness (+ determinism) of every plan of both ops at one shape and rank count.
void correctnessShape(const Shape& sh, int nranks, int detReps) {
  ShapeBufs sb;
  allocShape(sb, sh, nranks, 1);
  std::printf("\n== correctness %lld x %lld x %lld (M x K_total x N), %d rank(s), k slice %lld\n", (long long)sh.m,
              (long long)sh.kTotal, (long long)sh.n, nranks, (long long)sb.kr);
  for (Op op : {Op::kRs, Op::kAr}) {
    std::vector<Cand> cands = ourPlans(op);
    for (auto& c : cands) {
      bool ok = false;
      const double err = checkCand(c, sb, &ok);
      const unsigned long long diff = (ok && detReps > 1) ? checkDeterminism(c, sb, detReps) : 0;
      const bool pass = ok && diff == 0;
      if (!pass) gFailed = true;
      std::printf("  %s %-3s %-44s ran %-34s rel_err %.3e  det(%d) diff %llu\n", pass ? "ok  " : "FAIL",
                  op == Op::kRs ? "RS" : "AR", c.name.c_str(), c.ran.c_str(), err, detReps, diff);
      jsonRow(op == Op::kRs ? "check_rs" : "check_ar", sh, nranks, c.name, c.ran, 0, 0, err, (long long)diff);
    }
  }
  std::fflush(stdout);
  freeShape(sb);
}

// One traced run of a fused plan: per tile kind, the mean mainloop time (previous epilogue exit to this epilogue's
// entry), wait for peers, and epilogue time, over every compute CTA's consumer warpgroups of rank 0 and 1.
void traceCand(Cand c, const ShapeBufs& sb) {
  std::vector<uint64_t*> dev(sb.nranks);
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMalloc(&dev[r], kTraceWords * 8));
    CK(cudaMemset(dev[r], 0, kTraceWords * 8));
    gTrace[r] = dev[r];
  }
  ++gBarEpoch;
  for (int r = 0; r < sb.nranks; ++r) {
    CK(cudaSetDevice(r));
    crossBarrier<<<1, 32, 0, gStream[r]>>>(gBar, r, sb.nranks, gBarEpoch);
  }
  enqueue(c, sb, 0);
  syncAll(30, "trace " + c.name);
  for (int r = 0; r < sb.nranks; ++r) gTrace[r] = nullptr;
  for (int r = 0; r < sb.nranks; ++r) {
    std::vector<uint64_t> h(kTraceWords);
    CK(cudaSetDevice(r));
    CK(cudaMemcpy(h.data(), dev[r], kTraceWords * 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(dev[r]));
    double sum[2][3] = {};
    long cnt[2] = {};
    uint64_t t0 = ~0ull, tEnd = 0;
    double lastExitSum = 0;
    int seqs = 0;
    for (int blk = 0; blk < 132 * 2; ++blk) {
      const uint64_t* b = h.data() + size_t(blk) * (kTraceTiles + 1) * 4;
      const uint64_t start = b[0];
      if (start == 0) continue;
      t0 = std::min(t0, start);
      uint64_t prev = start;
      int j = 0;
      for (; j < kTraceTiles; ++j) {
        const uint64_t* f = b + (1 + j) * 4;
        if (f[0] == 0) break;
        const int kind = int(f[3]);
        sum[kind][0] += double(f[0] - prev);
        if (kind == 1) {
          sum[kind][1] += double(f[1] - f[0]);
          sum[kind][2] += double(f[2] - f[1]);
        } else {
          sum[kind][2] += double(f[2] - f[0]);
        }
        ++cnt[kind];
        prev = f[2];
      }
      tEnd = std::max(tEnd, prev);
      lastExitSum += double(prev - start);
      ++seqs;
    }
    std::printf("  trace %-40s rank %d: span %.1f us, mean last exit %.1f us; sent tiles %ld: mainloop %.2f us, epilogue %.2f us;"
                " reduced tiles %ld: mainloop %.2f us, wait %.2f us, epilogue %.2f us\n",
                c.name.c_str(), r, double(tEnd - t0) / 1e3, seqs ? lastExitSum / seqs / 1e3 : 0.0, cnt[0],
                cnt[0] ? sum[0][0] / cnt[0] / 1e3 : 0.0, cnt[0] ? sum[0][2] / cnt[0] / 1e3 : 0.0, cnt[1],
                cnt[1] ? sum[1][0] / cnt[1] / 1e3 : 0.0, cnt[1] ? sum[1][1] / cnt[1] / 1e3 : 0.0,
                cnt[1] ? sum[1][2] / cnt[1] / 1e3 : 0.0);
  }
  std::fflush(stdout);
}

void benchShape(const Shape& sh, int iters, int detReps) {
  ShapeBufs sb;
  allocShape(sb, sh, gRanks, 2);
  for (int r = 0; r < gRanks; ++r) {
    CK(cudaSetDevice(r));
    gLt[r] = new LtGemm(gR[r].lt, sh.m, sh.n, sb.kr, gR[r].ltWs, 64u << 20);
  }
  for (Op op : {Op::kRs, Op::kAr}) {
    const bool rs = op == Op::kRs;
    std::printf("\n== %s %lld x %lld x %lld (M x K_total x N), %d ranks, k slice %lld\n", rs ? "GEMM+ReduceScatter" : "GEMM+AllReduce",
                (long long)sh.m, (long long)sh.kTotal, (long long)sh.n, gRanks, (long long)sb.kr);
    std::vector<Cand> cands;
    cands.push_back({rs ? "baseline: cuBLASLt GEMM + ncclReduceScatter" : "baseline: cuBLASLt GEMM + ncclAllReduce",
                     CandType::kBaseline, op, GemmRsPlan{}, "nccl"});
    cands.push_back({"GEMM alone (cuBLASLt, local K slice)", CandType::kGemmLt, op, GemmRsPlan{}, "-"});
    cands.push_back({"GEMM alone (our core, local K slice)", CandType::kGemmOurs, op, GemmRsPlan{}, "-"});
    for (auto& c : ourPlans(op)) cands.push_back(c);
    std::vector<double> err(cands.size(), 0);
    std::vector<int> okv(cands.size(), 1);
    for (size_t i = 0; i < cands.size(); ++i) {
      if (cands[i].type == CandType::kGemmLt || cands[i].type == CandType::kGemmOurs) continue;
      bool ok = false;
      err[i] = checkCand(cands[i], sb, &ok);
      okv[i] = ok;
      if (!ok) {
        gFailed = true;
        std::printf("  FAIL correctness %-44s rel_err %.3e\n", cands[i].name.c_str(), err[i]);
      }
    }
    std::fflush(stdout);
    std::vector<Cand> timed;
    std::vector<size_t> timedIdx;
    for (size_t i = 0; i < cands.size(); ++i) {
      if (okv[i]) {
        timed.push_back(cands[i]);
        timedIdx.push_back(i);
      }
    }
    const std::vector<double> msTimed = timeCands(timed, sb, iters, 3);
    std::vector<double> ms(cands.size(), NAN);
    for (size_t i = 0; i < timed.size(); ++i) {
      ms[timedIdx[i]] = msTimed[i];
      cands[timedIdx[i]].ran = timed[i].ran;
    }
    const double base = ms[0];
    double bestFused = 1e30, bestDec = 1e30;
    std::string bestFusedName, bestDecName;
    for (size_t i = 0; i < cands.size(); ++i) {
      if (cands[i].type != CandType::kOurs || cands[i].plan.kind == GemmRsPlanKind::kAuto || !okv[i]) continue;
      if (cands[i].plan.kind == GemmRsPlanKind::kFused && ms[i] < bestFused) {
        bestFused = ms[i];
        bestFusedName = cands[i].ran;
      }
      if (cands[i].plan.kind == GemmRsPlanKind::kDecomposed && ms[i] < bestDec) {
        bestDec = ms[i];
        bestDecName = cands[i].ran;
      }
    }
    std::printf("  %-46s %-36s %9s %9s %10s\n", "candidate", "plan that ran", "ms", "base/this", "rel_err");
    for (size_t i = 0; i < cands.size(); ++i) {
      std::printf("  %-46s %-36s %9.4f %9.3f %10.2e%s\n", cands[i].name.c_str(), cands[i].ran.c_str(), ms[i], base / ms[i],
                  err[i], okv[i] ? "" : "  FAIL");
      jsonRow(rs ? "time_rs" : "time_ar", sh, gRanks, cands[i].name, cands[i].ran, ms[i], base / ms[i], err[i], -1);
    }
    std::printf("  best fused: %s %.4f ms (%.3fx)   best decomposed: %s %.4f ms (%.3fx)\n", bestFusedName.c_str(),
                bestFused, base / bestFused, bestDecName.c_str(), bestDec, base / bestDec);
    {
      char line[512];
      const size_t autoIdx = 3;  // baseline, GEMM (cuBLASLt), GEMM (ours), then ourPlans() starting with auto
      std::snprintf(line, sizeof(line), "%s %5lldx%5lldx%5lld base %.4f gemmLt %.4f gemmOurs %.4f | auto %.4f (%.3fx) %s | fused %.4f (%.3fx) %s | dec %.4f (%.3fx) %s",
                    rs ? "RS" : "AR", (long long)sh.m, (long long)sh.kTotal, (long long)sh.n, base, ms[1], ms[2], ms[autoIdx],
                    base / ms[autoIdx], cands[autoIdx].ran.c_str(), bestFused, base / bestFused, bestFusedName.c_str(), bestDec,
                    base / bestDec, bestDecName.c_str());
      gSummary.push_back(line);
    }
    // Determinism of the auto plan at this shape.
    if (detReps > 1) {
      for (size_t i = 0; i < cands.size(); ++i) {
        Cand& c = cands[i];
        if (c.type == CandType::kOurs && c.plan.kind == GemmRsPlanKind::kAuto && okv[i]) {
          const unsigned long long diff = checkDeterminism(c, sb, detReps);
          if (diff) gFailed = true;
          std::printf("  determinism %s (%s), %d runs: %llu differing words%s\n", c.name.c_str(), c.ran.c_str(), detReps,
                      diff, diff ? "  FAIL" : "");
          jsonRow(rs ? "det_rs" : "det_ar", sh, gRanks, c.name, c.ran, 0, 0, 0, (long long)diff);
        }
      }
    }
    if (sh.m >= 4096) {
      for (size_t i = 0; i < cands.size(); ++i) {
        const GemmRsPlan& p = cands[i].plan;
        if (cands[i].type == CandType::kOurs && p.kind == GemmRsPlanKind::kFused && p.epiReduce &&
            p.partial == GemmRsPartial::kInput && okv[i] &&
            (p.transport == GemmRsTransport::kPush || p.transport == GemmRsTransport::kCopy)) {
          traceCand(cands[i], sb);
        }
      }
    }
    std::fflush(stdout);
  }
  for (int r = 0; r < gRanks; ++r) {
    CK(cudaSetDevice(r));
    delete gLt[r];
    gLt[r] = nullptr;
  }
  freeShape(sb);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 25, detReps = 100, onlyShape = -1;
  bool skipBig = false, skipOdd = false;
  const char* jsonPath = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::min(kMaxIters, std::max(20, std::atoi(argv[++i])));
    else if (a == "--det-reps" && i + 1 < argc) detReps = std::atoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) jsonPath = argv[++i];
    else if (a == "--skip-big") skipBig = true;
    else if (a == "--skip-odd") skipOdd = true;
    else if (a == "--shape" && i + 1 < argc) onlyShape = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--iters N>=20] [--det-reps N] [--json FILE] [--skip-big] [--skip-odd] [--shape I]\n", argv[0]);
      return 2;
    }
  }
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (ndev < 2) {
    std::printf("needs 2 GPUs, found %d\n", ndev);
    return 77;
  }
  gRanks = 2;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  gSms = prop.multiProcessorCount;
  std::printf("devices: %d x %s, %d SMs; NCCL %d\n", ndev, prop.name, gSms, NCCL_VERSION_CODE);
  if (jsonPath) gJson = std::fopen(jsonPath, "w");
  gWsBytes = gemmRsWorkspaceBytes(kWsMaxM, kWsMaxN, gRanks);
  for (int r = 0; r < gRanks; ++r) {
    CK(cudaSetDevice(r));
    for (int q = 0; q < gRanks; ++q) {
      if (q != r) {
        int can = 0;
        CK(cudaDeviceCanAccessPeer(&can, r, q));
        if (!can) {
          std::printf("no peer access %d -> %d\n", r, q);
          return 2;
        }
        CK(cudaDeviceEnablePeerAccess(q, 0));
      }
    }
    CK(cudaStreamCreateWithFlags(&gStream[r], cudaStreamNonBlocking));
    BK(cublasLtCreate(&gR[r].lt));
    CK(cudaMalloc(&gR[r].ltWs, 64u << 20));
    CK(cudaMalloc(&gR[r].workspace, gWsBytes));
    CK(cudaMemset(gR[r].workspace, 0, gWsBytes));  // flags start at 0 once; epochs only grow
    CK(cudaMalloc(&gR[r].barSlots, 64 * sizeof(uint64_t)));
    CK(cudaMemset(gR[r].barSlots, 0, 64 * sizeof(uint64_t)));
    CK(cudaMalloc(&gR[r].sums, 2 * sizeof(double)));
    CK(cudaMalloc(&gR[r].bad, sizeof(unsigned long long)));
    CK(cudaHostAlloc(&gSlotHost[r], sizeof(ErrorSlot), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(gSlotHost[r], 0, sizeof(ErrorSlot));
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gSlotDev[r]), gSlotHost[r], 0));
    gBar.slots[r] = gR[r].barSlots;
    gEvents.resize(size_t(kMaxCands) * kMaxIters * kMaxDev * 2);
  }
  for (int c = 0; c < kMaxCands; ++c)
    for (int it = 0; it < kMaxIters; ++it)
      for (int r = 0; r < gRanks; ++r)
        for (int w = 0; w < 2; ++w) {
          CK(cudaSetDevice(r));
          CK(cudaEventCreate(&ev(c, it, r, w)));
        }
  std::printf("workspace per rank: %.2f GB\n", double(gWsBytes) / 1e9);
  int devs[kMaxDev];
  for (int r = 0; r < gRanks; ++r) devs[r] = r;
  NK(ncclCommInitAll(gComm, gRanks, devs));

  // ---- argument validation
  {
    std::printf("\n== argument validation\n");
    Shape sh{256, 256, 64, false};
    ShapeBufs sb;
    allocShape(sb, sh, 2, 1);
    const auto expectReject = [&](const char* what, std::function<void(GemmRsParams&)> edit, bool ar = false) {
      GemmRsParams p = makeParams(sb, 0, 0, ar ? Op::kAr : Op::kRs, GemmRsPlan{}, gEpoch + 1);
      edit(p);
      try {
        if (ar) {
          launchGemmAr(p, gStream[0]);
        } else {
          launchGemmRs(p, gStream[0]);
        }
        std::printf("  FAIL reject %-34s: accepted\n", what);
        gFailed = true;
      } catch (const std::runtime_error& e) {
        std::printf("  ok   reject %-34s: %s\n", what, e.what());
      }
    };
    CK(cudaSetDevice(0));
    expectReject("n not a multiple of 8", [](GemmRsParams& p) { p.n = 250; });
    expectReject("k slice not a multiple of 8", [](GemmRsParams& p) { p.k = 30; p.lda = 32; p.ldb = 32; });
    expectReject("m past the workspace", [](GemmRsParams& p) { p.m = kWsMaxM + 1; });
    expectReject("epoch 0", [](GemmRsParams& p) { p.epoch = 0; });
    expectReject("epiReduce one-shot", [](GemmRsParams& p) { p.plan = fused(GemmRsTransport::kPull, GemmRsPartial::kInput, true, 0, 0, true); }, true);
    expectReject("no reduce CTAs, no epiReduce", [](GemmRsParams& p) { p.plan = fused(GemmRsTransport::kPush, GemmRsPartial::kInput, false, 0); });
    expectReject("role table past the SMs", [](GemmRsParams& p) { p.plan = fused(GemmRsTransport::kPush, GemmRsPartial::kInput, false, 100, 0); p.plan.numCompute = 100; });
    expectReject("missing peer workspace", [](GemmRsParams& p) { p.workspace[1] = nullptr; });
    freeShape(sb);
  }

  // ---- correctness at odd shapes, 2 ranks and 1 rank, with determinism
  const std::vector<Shape> odd = {{1000, 1000, 1040, false}, {777, 1024, 512, false}, {300, 520, 272, false},
                                  {1, 8, 16, false}, {4097, 4104, 1040, false}};
  if (!skipOdd) {
    for (const auto& sh : odd) correctnessShape(sh, 2, 20);
    correctnessShape(odd[0], 2, detReps);
    // 1 rank: gRanks stays 2 for syncing; the op runs on GPU 0 only.
    for (const auto& sh : {odd[0], odd[1]}) correctnessShape(sh, 1, 5);
  }

  // ---- benchmark shapes
  const std::vector<Shape> big = {{8192, 8192, 8192, true}, {4096, 8192, 8192, true}, {16384, 14336, 8192, true},
                                  {1024, 8192, 8192, true}, {2048, 8192, 8192, true}};
  if (!skipBig) {
    for (size_t i = 0; i < big.size(); ++i) {
      if (onlyShape >= 0 && int(i) != onlyShape) continue;
      benchShape(big[i], iters, detReps);
    }
  }
  if (gJson) {
    std::fprintf(gJson, "%s]\n", gJsonFirst ? "[" : "");
    std::fclose(gJson);
  }
  std::printf("\n== summary (ms; ratio = baseline / this)\n");
  for (const auto& l : gSummary) std::printf("%s\n", l.c_str());
  std::printf("\n%s\n", gFailed ? "SOME CHECKS FAILED" : "ALL CHECKS PASSED");
  return gFailed ? 1 : 0;
}
