// Fused AllGather+GEMM (launchAgGemm) vs NCCL all-gather then cuBLASLt, on 2 GPUs driven by ONE process and ONE host
// thread (one stream per GPU, peer access enabled both ways). Checks C and the gathered A on every rank against an
// fp32 reference (odd shapes, uneven splits, 1 and 2 ranks), then times per shape, round-robin over the variants:
//   baseline  = ncclAllGather (ncclCommInitAll, NVLS off) then cuBLASLt (bf16, fp32 compute)
//   cublas-alone = cuBLASLt GEMM alone on the gathered A  ours-gemm-alone = our GEMM core alone on the gathered A
//   fused/{lsu|tma}/cN = fused kernel, N comm SMs pushing with the LSU loop or TMA bulk copies (auto comm-CTA tail)
//   decomposed/cN      = SM all-gather kernel (N CTAs) then the GEMM core
//   chosen(...)        = plan 0 (chooseAgGemmPlan); the "pre-timing" check lines show each plan as launched
// Each timed op is preceded by a cross-GPU event barrier; time = max over ranks of the per-GPU event interval,
// median over the iterations. Exits non-zero on any correctness failure.
//
//   ag_gemm_bench [--iters N] [--only check|time] [--shape I]
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
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"  // after <cublasLt.h> and <nccl.h>: it defines BK/NK for those it finds
#include "cublaslt_gemm.hpp"
#include "ref_gemm.cuh"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/gemm.hpp"

using namespace tandem::kernels;

namespace {

using tandem::bench::refGemm;
using tandem::bench::fillUniform;
using tandem::bench::relErrorKernel;

// bad += elements that differ bit for bit (the gathered A must be an exact copy).
__global__ void compareExact(const uint16_t* out, const uint16_t* ref, int64_t total, unsigned long long* bad) {
  unsigned long long nb = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    nb += out[i] != ref[i];
  }
  for (int off = 16; off > 0; off /= 2) nb += __shfl_down_sync(0xffffffffu, nb, off);
  if ((threadIdx.x & 31) == 0 && nb) atomicAdd(bad, nb);
}

using tandem::bench::LtGemm;

constexpr int kMaxGpus = 2;
constexpr int64_t kFlagWords = 4096;
constexpr uint64_t kTimeoutNs = 3ull * 1000 * 1000 * 1000;

struct Gpu {
  int dev = 0;
  cudaStream_t s{};
  cublasLtHandle_t lt{};
  void* ws = nullptr;
  size_t wsSize = 64u << 20;
  uint64_t* flags = nullptr;
  uint64_t* abortWord = nullptr;
  ErrorSlot* err = nullptr;  // host-mapped
  double* dSums = nullptr;
  unsigned long long* dBad = nullptr;
  cudaEvent_t barrier{};
  ncclComm_t comm{};
};

int gNumGpus = 0;
Gpu gGpu[kMaxGpus];
uint64_t gEpoch = 0;
bool gFailed = false;

// Waits for every GPU's stream; a hang must not eat the device lease.
void syncAll(int nranks, const std::string& what, double seconds = 60) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    for (;;) {
      const cudaError_t e = cudaStreamQuery(gGpu[r].s);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        std::printf("FAIL: %s: GPU %d: %s (%s)\n", what.c_str(), r, cudaGetErrorName(e), cudaGetErrorString(e));
        std::fflush(stdout);
        std::_Exit(4);
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
        std::printf("FAIL: %s: GPU %d still running after %.0f s (hang?)\n", what.c_str(), r, seconds);
        std::fflush(stdout);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  for (int r = 0; r < nranks; ++r) {
    if (gGpu[r].err->claimed) {
      const ErrorSlot& e = *gGpu[r].err;
      std::printf("FAIL: %s: rank %d error slot: code %u role %u rank %u chunk %u expected %llu observed %llu\n",
                  what.c_str(), r, e.code, e.role, e.rank, e.chunk, (unsigned long long)e.expected,
                  (unsigned long long)e.observed);
      std::fflush(stdout);
      std::memset(gGpu[r].err, 0, sizeof(ErrorSlot));  // report once; later ops use fresh epochs
      gFailed = true;
    }
  }
}

// Cross-GPU barrier in stream order: each stream waits until every other stream reached this point.
void streamBarrier(int nranks) {
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaEventRecord(gGpu[r].barrier, gGpu[r].s));
  }
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    for (int q = 0; q < nranks; ++q) {
      if (q != r) CK(cudaStreamWaitEvent(gGpu[r].s, gGpu[q].barrier, 0));
    }
  }
}

struct Problem {
  int64_t m, n, k;
  int nranks;
  int sets;
  std::vector<void*> a[kMaxGpus], b[kMaxGpus];  // per rank, per set: shard, B
  void* gathered[kMaxGpus] = {};                  // ours
  void* gatheredNccl[kMaxGpus] = {};
  void* c[kMaxGpus] = {};
  void* cBlas[kMaxGpus] = {};
  void* refGathered[kMaxGpus] = {};  // built by peer copies of set 0
  float* refC[kMaxGpus] = {};        // fp32 reference of set 0
  int64_t rows(int r) const { return agRowsOf(m, r, nranks); }
  int64_t off(int r) const { return agRowOffset(m, r, nranks); }
};

void* dmalloc(size_t bytes) {
  void* p = nullptr;
  if (bytes > 0) CK(cudaMalloc(&p, bytes));
  return p;
}

Problem makeProblem(int64_t m, int64_t n, int64_t k, int nranks, int sets, uint64_t seed, bool nccl) {
  Problem P;
  P.m = m;
  P.n = n;
  P.k = k;
  P.nranks = nranks;
  P.sets = sets;
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    const cudaStream_t s = gGpu[r].s;
    for (int i = 0; i < sets; ++i) {
      void* a = dmalloc(size_t(P.rows(r)) * k * 2);
      void* b = dmalloc(size_t(n) * k * 2);
      if (a) fillUniform<__nv_bfloat16><<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(a), size_t(P.rows(r)) * k, seed + 100 * r + 2 * i);
      fillUniform<__nv_bfloat16><<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(b), size_t(n) * k, seed + 100 * r + 2 * i + 1);
      CK(cudaGetLastError());
      P.a[r].push_back(a);
      P.b[r].push_back(b);
    }
    P.gathered[r] = dmalloc(size_t(m) * k * 2);
    if (nccl) P.gatheredNccl[r] = dmalloc(size_t(m) * k * 2);
    P.c[r] = dmalloc(size_t(m) * n * 2);
    if (nccl) P.cBlas[r] = dmalloc(size_t(m) * n * 2);
    P.refGathered[r] = dmalloc(size_t(m) * k * 2);
    P.refC[r] = static_cast<float*>(dmalloc(size_t(m) * n * 4));
  }
  syncAll(nranks, "fill");
  // Reference gathered A (set 0) on every rank by plain peer copies, then the fp32 reference C with that rank's B.
  for (int r = 0; r < nranks; ++r) {
    CK(cudaSetDevice(r));
    for (int q = 0; q < nranks; ++q) {
      if (P.rows(q) == 0) continue;
      CK(cudaMemcpyPeerAsync(static_cast<char*>(P.refGathered[r]) + size_t(P.off(q)) * k * 2, r, P.a[q][0], q,
                                     size_t(P.rows(q)) * k * 2, gGpu[r].s));
    }
    dim3 grid(unsigned((n + 63) / 64), unsigned((m + 63) / 64));
    refGemm<__nv_bfloat16><<<grid, dim3(16, 16), 0, gGpu[r].s>>>(
        static_cast<const __nv_bfloat16*>(P.refGathered[r]), static_cast<const __nv_bfloat16*>(P.b[r][0]), P.refC[r],
        int(m), int(n), int(k), k, k, 0);
    CK(cudaGetLastError());
  }
  syncAll(nranks, "reference", 120);
  return P;
}

void freeProblem(Problem& P) {
  for (int r = 0; r < P.nranks; ++r) {
    CK(cudaSetDevice(r));
    for (void* p : P.a[r]) cudaFree(p);
    for (void* p : P.b[r]) cudaFree(p);
    for (void* p : {P.gathered[r], P.gatheredNccl[r], P.c[r], P.cBlas[r], P.refGathered[r], static_cast<void*>(P.refC[r])}) {
      if (p) cudaFree(p);
    }
  }
}

AgGemmParams makeParams(const Problem& P, int r, int set, int plan, int commSms, int mode = 0, int tail = 0,
                        int groupM = 0) {
  AgGemmParams p{};
  p.rank = r;
  p.nranks = P.nranks;
  p.m = P.m;
  p.n = P.n;
  p.k = P.k;
  p.dtype = GemmDtype::kBf16;
  p.a = P.a[r][set];
  p.b = P.b[r][set];
  p.c = P.c[r];
  p.aGathered = P.gathered[r];
  for (int q = 0; q < P.nranks; ++q) {
    p.peerGathered[q] = P.gathered[q];
    p.peerFlags[q] = gGpu[q].flags;
  }
  p.flags = gGpu[r].flags;
  p.flagWords = kFlagWords;
  p.epoch = gEpoch;
  p.abortWord = gGpu[r].abortWord;
  p.errorSlot = gGpu[r].err;
  p.timeoutNs = kTimeoutNs;
  p.plan = plan;
  p.commSms = commSms;
  p.commMode = mode;
  p.commTail = tail;
  p.groupM = groupM;
  return p;
}

// One op of ours on every rank (same epoch). Returns rank 0's plan.
AgGemmPlanChoice runOurs(const Problem& P, int set, int plan, int commSms, int mode = 0, int tail = 0,
                         int groupM = 0) {
  ++gEpoch;
  AgGemmPlanChoice choice{};
  for (int r = 0; r < P.nranks; ++r) {
    CK(cudaSetDevice(r));
    const AgGemmPlanChoice c = launchAgGemm(makeParams(P, r, set, plan, commSms, mode, tail, groupM), gGpu[r].s);
    if (r == 0) choice = c;
  }
  return choice;
}

struct Check {
  double rel = 0;
  unsigned long long bad = 0, gatherBad = 0;
  bool ok() const { return bad == 0 && gatherBad == 0 && std::isfinite(rel) && rel < 1e-2; }
};

Check checkRank(const Problem& P, int r, const void* cOut, const void* gOut) {
  CK(cudaSetDevice(r));
  Gpu& g = gGpu[r];
  CK(cudaMemsetAsync(g.dSums, 0, 2 * sizeof(double), g.s));
  CK(cudaMemsetAsync(g.dBad, 0, sizeof(unsigned long long), g.s));
  relErrorKernel<<<1024, 256, 0, g.s>>>(static_cast<const __nv_bfloat16*>(cOut), int64_t(P.n), P.refC[r], int64_t(P.m),
                                        int64_t(P.n), g.dSums, g.dBad);
  CK(cudaGetLastError());
  double h[2];
  Check c;
  CK(cudaMemcpyAsync(h, g.dSums, sizeof(h), cudaMemcpyDeviceToHost, g.s));
  CK(cudaMemcpyAsync(&c.bad, g.dBad, sizeof(c.bad), cudaMemcpyDeviceToHost, g.s));
  if (gOut != nullptr) {
    CK(cudaMemsetAsync(g.dBad, 0, sizeof(unsigned long long), g.s));
    compareExact<<<1024, 256, 0, g.s>>>(static_cast<const uint16_t*>(gOut), static_cast<const uint16_t*>(P.refGathered[r]),
                                        P.m * P.k, g.dBad);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(&c.gatherBad, g.dBad, sizeof(c.gatherBad), cudaMemcpyDeviceToHost, g.s));
  }
  CK(cudaStreamSynchronize(g.s));
  c.rel = std::sqrt(h[0] / std::max(h[1], 1e-300));
  return c;
}

void poison(const Problem& P) {
  for (int r = 0; r < P.nranks; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMemsetAsync(P.c[r], 0xFF, size_t(P.m) * P.n * 2, gGpu[r].s));  // NaN
    CK(cudaMemsetAsync(P.gathered[r], 0xFF, size_t(P.m) * P.k * 2, gGpu[r].s));
  }
}

// Runs our op (set 0) with poisoned outputs and checks C and the gathered A on every rank.
std::string choiceName(const AgGemmPlanChoice& c) {
  std::string s = agGemmPlanName(c.plan);
  if (c.plan == AgGemmPlan::kFused) {
    s += c.commMode == 2 ? "/tma" : "/lsu";
    s += "/c" + std::to_string(c.commSms);
    if (c.tailTiles > 0) s += "/tail" + std::to_string(c.tailTiles);
  } else if (c.plan == AgGemmPlan::kDecomposed) {
    s += "/c" + std::to_string(c.commSms);
  }
  return s;
}

bool checkOurs(const Problem& P, int plan, int commSms, const char* label, int mode = 0, int tail = 0,
               int groupM = 0) {
  poison(P);
  AgGemmPlanChoice ch{};
  try {
    ch = runOurs(P, 0, plan, commSms, mode, tail, groupM);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-14s launch threw: %s\n", label, e.what());
    gFailed = true;
    return false;
  }
  syncAll(P.nranks, label);
  bool ok = true;
  for (int r = 0; r < P.nranks; ++r) {
    const Check c = checkRank(P, r, P.c[r], P.gathered[r]);
    std::printf("  %s %-18s rank %d (%s)  rel_err %.3e  non-finite %llu  gathered mismatches %llu\n",
                c.ok() ? "ok  " : "FAIL", label, r, choiceName(ch).c_str(), c.rel, c.bad, c.gatherBad);
    ok = ok && c.ok();
  }
  if (!ok) gFailed = true;
  return ok;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Variant {
  std::string name;
  std::function<void(int set)> run;
  std::string plan;  // for ours: the plan that ran
};

struct ShapeResult {
  int64_t m, k, n;
  std::vector<std::string> names;
  std::vector<double> ms;
  std::string chosenPlan;
  double rel = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  std::string only;
  int onlyShape = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::max(20, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--shape" && i + 1 < argc) onlyShape = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--iters N>=20] [--only check|time] [--shape I]\n", argv[0]);
      return 2;
    }
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast
  // Every kernel loaded at start: a lazily loaded kernel can block this (only) host thread in the middle of a
  // two-GPU op while the other GPU's half of it waits (ARCHITECTURE.md: CUDA_MODULE_LOADING=EAGER).
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  CK(cudaGetDeviceCount(&gNumGpus));
  gNumGpus = std::min(gNumGpus, kMaxGpus);
  for (int r = 0; r < gNumGpus; ++r) {
    CK(cudaSetDevice(r));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, r));
    std::printf("GPU %d: %s, %d SMs\n", r, prop.name, prop.multiProcessorCount);
    Gpu& g = gGpu[r];
    g.dev = r;
    CK(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking));
    BK(cublasLtCreate(&g.lt));
    g.ws = dmalloc(g.wsSize);
    g.flags = static_cast<uint64_t*>(dmalloc(kFlagWords * 8));
    CK(cudaMemset(g.flags, 0, kFlagWords * 8));  // once; epochs are monotonic
    g.abortWord = static_cast<uint64_t*>(dmalloc(8));
    CK(cudaMemset(g.abortWord, 0, 8));
    CK(cudaHostAlloc(reinterpret_cast<void**>(&g.err), sizeof(ErrorSlot), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(g.err, 0, sizeof(ErrorSlot));
    g.dSums = static_cast<double*>(dmalloc(2 * sizeof(double)));
    g.dBad = static_cast<unsigned long long*>(dmalloc(sizeof(unsigned long long)));
    CK(cudaEventCreateWithFlags(&g.barrier, cudaEventDisableTiming));
  }
  if (gNumGpus >= 2) {
    for (int r = 0; r < gNumGpus; ++r) {
      CK(cudaSetDevice(r));
      for (int q = 0; q < gNumGpus; ++q) {
        if (q == r) continue;
        int can = 0;
        CK(cudaDeviceCanAccessPeer(&can, r, q));
        if (!can) {
          std::printf("GPU %d cannot access GPU %d: 2-rank parts need peer access\n", r, q);
          return 2;
        }
        CK(cudaDeviceEnablePeerAccess(q, 0));
      }
    }
    ncclComm_t comms[kMaxGpus];
    int devs[kMaxGpus] = {0, 1};
    NK(ncclCommInitAll(comms, gNumGpus, devs));
    for (int r = 0; r < gNumGpus; ++r) gGpu[r].comm = comms[r];
  }
  const int maxRanks = gNumGpus;

  // ---------------- correctness
  if (only != "time") {
    struct CShape {
      int64_t m, n, k;
      int nranks;
      const char* note;
    };
    const std::vector<CShape> shapes = {
        {1000, 1000, 520, 2, "500/500 rows, no tile multiple"},
        {777, 1000, 520, 2, "389/388 rows"},
        {4097, 4096, 4104, 2, "2049/2048 rows, K % 64 != 0, straddling chunks"},
        {129, 264, 72, 2, "65/64 rows, one straddling tile"},
        {3, 8, 8, 2, "2/1 rows"},
        {1, 8, 8, 2, "1/0 rows (empty shard)"},
        {1000, 1000, 520, 1, "1 rank"},
        {777, 1000, 520, 1, "1 rank"},
    };
    std::printf("\n== correctness (M x N x K, ranks): C vs fp32 reference (rel < 1e-2, no NaN), gathered A bit-exact\n");
    for (const CShape& cs : shapes) {
      if (cs.nranks > maxRanks) continue;
      std::printf(" %lld x %lld x %lld, %d rank(s)  (%s)\n", (long long)cs.m, (long long)cs.n, (long long)cs.k,
                  cs.nranks, cs.note);
      Problem P = makeProblem(cs.m, cs.n, cs.k, cs.nranks, 1, 7 + cs.m, false);
      if (cs.nranks == 1) {
        checkOurs(P, 0, 0, "auto");
      } else {
        checkOurs(P, 1, 1, "fused/lsu/c1", 1);
        checkOurs(P, 1, 4, "fused/lsu/c4", 1);
        checkOurs(P, 1, 16, "fused/lsu/c16", 1);
        checkOurs(P, 1, 1, "fused/tma/c1", 2);
        checkOurs(P, 1, 4, "fused/tma/c4", 2);
        checkOurs(P, 1, 4, "fused/tma/c4/tail", 2, 1 + int(cs.m / 300));
        checkOurs(P, 1, 2, "fused/lsu/c2/tail", 1, 1 + int(cs.m / 200));
        checkOurs(P, 2, 8, "decomp/c8");
        checkOurs(P, 2, 132, "decomp/c132");
        checkOurs(P, 0, 0, "auto");
        checkOurs(P, 0, 0, "auto again");  // next epoch on the same flags
      }
      freeProblem(P);
    }
  }

  // ---------------- timing
  std::vector<ShapeResult> results;
  if (only != "check" && maxRanks >= 2) {
    struct TShape {
      int64_t m, k, n;
    };
    const std::vector<TShape> shapes = {
        {8192, 8192, 8192}, {4096, 8192, 8192}, {16384, 8192, 14336}, {1024, 8192, 8192}, {2048, 8192, 8192}};
    const int nr = 2;
    for (size_t si = 0; si < shapes.size(); ++si) {
      if (onlyShape >= 0 && size_t(onlyShape) != si) continue;
      const TShape& ts = shapes[si];
      std::printf("\n== M x K x N = %lld x %lld x %lld, 2 ranks (bf16)\n", (long long)ts.m, (long long)ts.k,
                  (long long)ts.n);
      Problem P = makeProblem(ts.m, ts.n, ts.k, nr, 2, 42 + si, true);
      LtGemm* lt[kMaxGpus];
      for (int r = 0; r < nr; ++r) {
        CK(cudaSetDevice(r));
        lt[r] = new LtGemm(gGpu[r].lt, P.m, P.n, P.k, gGpu[r].ws, gGpu[r].wsSize);
      }
      const size_t shardElems = size_t(P.rows(0)) * P.k;
      auto ncclGather = [&](int set) {
        NK(ncclGroupStart());
        for (int r = 0; r < nr; ++r) {
          NK(ncclAllGather(P.a[r][set], P.gatheredNccl[r], shardElems, ncclBfloat16, gGpu[r].comm, gGpu[r].s));
        }
        NK(ncclGroupEnd());
      };
      // Baseline correctness (and it leaves gatheredNccl filled for the GEMM-alone variants).
      for (int r = 0; r < nr; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaMemsetAsync(P.cBlas[r], 0xFF, size_t(P.m) * P.n * 2, gGpu[r].s));
      }
      ncclGather(0);
      for (int r = 0; r < nr; ++r) {
        CK(cudaSetDevice(r));
        lt[r]->run(P.gatheredNccl[r], P.b[r][0], P.cBlas[r], gGpu[r].s);
      }
      syncAll(nr, "baseline");
      for (int r = 0; r < nr; ++r) {
        const Check c = checkRank(P, r, P.cBlas[r], P.gatheredNccl[r]);
        std::printf("  %s baseline       rank %d  rel_err %.3e  non-finite %llu  gathered mismatches %llu\n",
                    c.ok() ? "ok  " : "FAIL", r, c.rel, c.bad, c.gatherBad);
        if (!c.ok()) gFailed = true;
      }
      std::vector<Variant> vs;
      vs.push_back({"baseline", [&](int set) {
                      ncclGather(set);
                      for (int r = 0; r < nr; ++r) {
                        CK(cudaSetDevice(r));
                        lt[r]->run(P.gatheredNccl[r], P.b[r][set], P.cBlas[r], gGpu[r].s);
                      }
                    }, ""});
      vs.push_back({"nccl-allgather-alone", [&](int set) { ncclGather(set); }, ""});
      vs.push_back({"cublas-alone", [&](int set) {
                      for (int r = 0; r < nr; ++r) {
                        CK(cudaSetDevice(r));
                        lt[r]->run(P.gatheredNccl[r], P.b[r][set], P.cBlas[r], gGpu[r].s);
                      }
                    }, ""});
      vs.push_back({"ours-gemm-alone", [&](int set) {
                      for (int r = 0; r < nr; ++r) {
                        CK(cudaSetDevice(r));
                        GemmParams g{};
                        g.a = P.gatheredNccl[r];
                        g.b = P.b[r][set];
                        g.c = P.c[r];
                        g.m = P.m;
                        g.n = P.n;
                        g.k = P.k;
                        g.lda = P.k;
                        g.ldb = P.k;
                        g.ldc = P.n;
                        g.dtype = GemmDtype::kBf16;
                        launchGemm(g, gGpu[r].s);
                      }
                    }, ""});
      struct OurVariant {
        int plan, commSms, mode, tail, groupM;
      };
      const std::vector<OurVariant> ours = {{1, 4, 1, -1, 0}, {1, 4, 1, 0, 0},  {1, 4, 1, 0, 16}, {1, 8, 1, 0, 0},
                                            {1, 4, 2, 0, 0},  {1, 8, 2, 0, 0},  {1, 16, 1, 0, 0}, {2, 132, 1, 0, 0}};
      for (const OurVariant& o : ours) {
        const AgGemmPlanChoice ch = resolveAgGemmPlan(makeParams(P, 0, 0, o.plan, o.commSms, o.mode, o.tail));
        std::string name = choiceName(ch) + (o.tail < 0 ? "/notail" : "") + (o.groupM ? "/g" + std::to_string(o.groupM) : "");
        vs.push_back({name, [&P, o](int set) { runOurs(P, set, o.plan, o.commSms, o.mode, o.tail, o.groupM); }, ""});
      }
      AgGemmParams probe = makeParams(P, 0, 0, 0, 0);
      const AgGemmPlanChoice chosen = resolveAgGemmPlan(probe);
      const std::string chosenName = "chosen(" + choiceName(chosen) + ")";
      vs.push_back({chosenName, [&P](int set) { runOurs(P, set, 0, 0); }, ""});

      // Correctness of every variant of ours before timing.
      for (const OurVariant& o : ours) checkOurs(P, o.plan, o.commSms, "pre-timing", o.mode, o.tail, o.groupM);

      // Warm-up, then round-robin timing.
      for (int w = 0; w < 3; ++w)
        for (auto& v : vs) v.run(w % P.sets);
      syncAll(nr, "warm-up");
      const size_t nv = vs.size();
      std::vector<cudaEvent_t> ev[kMaxGpus];
      for (int r = 0; r < nr; ++r) {
        CK(cudaSetDevice(r));
        ev[r].resize(nv * iters * 2);
        for (auto& e : ev[r]) CK(cudaEventCreate(&e));
      }
      for (int it = 0; it < iters; ++it) {
        for (size_t vi = 0; vi < nv; ++vi) {
          const size_t slot = (size_t(it) * nv + vi) * 2;
          streamBarrier(nr);
          for (int r = 0; r < nr; ++r) {
            CK(cudaSetDevice(r));
            CK(cudaEventRecord(ev[r][slot], gGpu[r].s));
          }
          vs[vi].run(it % P.sets);
          for (int r = 0; r < nr; ++r) {
            CK(cudaSetDevice(r));
            CK(cudaEventRecord(ev[r][slot + 1], gGpu[r].s));
          }
        }
        if (it % 5 == 4) syncAll(nr, "timing", 120);  // keep the queues short
      }
      syncAll(nr, "timing", 120);
      ShapeResult res{ts.m, ts.k, ts.n, {}, {}, chosenName, 0};
      for (size_t vi = 0; vi < nv; ++vi) {
        std::vector<float> t(iters);
        for (int it = 0; it < iters; ++it) {
          float worst = 0;
          for (int r = 0; r < nr; ++r) {
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, ev[r][(size_t(it) * nv + vi) * 2], ev[r][(size_t(it) * nv + vi) * 2 + 1]));
            worst = std::max(worst, ms);
          }
          t[it] = worst;
        }
        res.names.push_back(vs[vi].name);
        res.ms.push_back(median(t));
        const double tf = 2.0 * double(P.m) * double(P.n) * double(P.k) / (median(t) * 1e-3) / 1e12;
        std::printf("  %-28s %8.3f ms  %6.1f TF/s/GPU  (min %.3f, max %.3f)\n", vs[vi].name.c_str(), median(t), tf,
                    *std::min_element(t.begin(), t.end()), *std::max_element(t.begin(), t.end()));
      }
      // The chosen plan's output of a fresh run, checked again.
      if (checkOurs(P, 0, 0, "chosen")) {
        const Check c = checkRank(P, 0, P.c[0], nullptr);
        res.rel = c.rel;
      }
      for (int r = 0; r < nr; ++r) {
        CK(cudaSetDevice(r));
        for (auto& e : ev[r]) cudaEventDestroy(e);
        delete lt[r];
      }
      freeProblem(P);
      results.push_back(res);
    }
  }

  if (!results.empty()) {
    std::printf("\n| shape M x K x N | baseline ms | cuBLASLt alone | ours GEMM alone | best fused (SMs) | best decomposed | "
                "chosen plan | chosen ms | TF/s/GPU | baseline / chosen | chosen / ours GEMM alone | chosen / cuBLASLt alone |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const ShapeResult& r : results) {
      const auto at = [&](const std::string& name) {
        for (size_t i = 0; i < r.names.size(); ++i)
          if (r.names[i] == name) return r.ms[i];
        return 0.0;
      };
      double bestF = 1e30, bestD = 1e30;
      std::string bf, bd;
      for (size_t i = 0; i < r.names.size(); ++i) {
        if (r.names[i].rfind("fused/", 0) == 0 && r.ms[i] < bestF) {
          bestF = r.ms[i];
          bf = r.names[i];
        }
        if (r.names[i].rfind("decomposed/", 0) == 0 && r.ms[i] < bestD) {
          bestD = r.ms[i];
          bd = r.names[i];
        }
      }
      const double ch = r.ms.back();
      const double tf = 2.0 * double(r.m) * double(r.n) * double(r.k) / (ch * 1e-3) / 1e12;
      std::printf("| %lld x %lld x %lld | %.3f | %.3f | %.3f | %.3f (%s) | %.3f (%s) | %s | %.3f | %.1f | %.3f | %.3f | %.3f |\n",
                  (long long)r.m, (long long)r.k, (long long)r.n, at("baseline"), at("cublas-alone"),
                  at("ours-gemm-alone"), bestF, bf.c_str(), bestD, bd.c_str(), r.chosenPlan.c_str(), ch, tf,
                  at("baseline") / ch, ch / at("ours-gemm-alone"), ch / at("cublas-alone"));
    }
    std::printf("(median of %d; per iteration the max over the 2 GPUs; variants round-robin, each after a cross-GPU "
                "stream barrier)\n", iters);
  }
  std::printf("\n%s\n", gFailed ? "RESULT: FAIL (correctness)" : "RESULT: all correctness checks passed");
  return gFailed ? 1 : 0;
}
