// The fused GEMM+ReduceScatter and GEMM+AllReduce kernels forced onto their fused plans at one rank, against the GEMM
// alone, on one GPU. At one rank nothing is exchanged, so what the fused kernel costs over the GEMM core is its own
// epilogue and role machinery: the "lean epilogue" target is at most 1.05x the GEMM alone at 8192^3 and
// 16384x14336x8192 (M x N x K). gemm_rs_bench needs two GPUs; this needs one.
//
// Candidates per shape, timed round robin (each iteration every candidate once; the median over --iters iterations;
// two input sets alternate so L2 holds neither): cuBLASLt, the GEMM core (launchGemm: what tandem runs at one rank),
// gemm-rs auto (the chooser: the GEMM core at one rank), gemm-rs and gemm-ar forced fused (copy transport, bf16
// partials, epilogue reduction: the plan that wins at two ranks) with each own-tile epilogue of the test knob
// GemmRsParams::epilogue (default: TMA store at one rank; generic: the reducing path), and gemm-rs fused with 8 send
// CTAs.
//
// Two times per candidate: "us" has CUDA events around the host call (so it includes the launcher's host work, as
// before), "gpu us" has the host call hidden behind a 200 us spin kernel queued first (the kernel's own time). Every
// candidate's output is checked against an fp32 reference (relative error < 1e-2, nothing non-finite), and every
// tandem candidate's output must equal the GEMM core's bitwise (the same wgmma order, rounded once). With --trace
// (default on) each fused candidate runs once more with GemmRsParams::trace and prints its per-tile mainloop and
// epilogue times (%globaltimer in the kernel).
//
// With --two-ranks (default on), each shape whose K splits in two also runs gemm-rs and gemm-ar at TWO ranks sharing
// this GPU in this process: each rank's fused kernel on half the SMs (so both are co-resident), rank r multiplying
// columns [r K/2, (r + 1) K/2) of A and B, partials exchanged through device memory. That is not the two-GPU timing
// (no NVLink, half the SMs each); it checks the multi-rank paths (against the reference, bitwise across kernels and
// repeats) and shows, from rank 0's trace, what an own tile's epilogue costs next to a sent one's; the candidates
// there are the default (gemm-rs: the own tile adds the peer's partial in smem, then TMA store), kTmaPeerEarly (the
// copier warps load the first chunks during the mainloop), the generic own-tile epilogue, and the all-reduce with
// kTmaPeer and kTmaPeerEarly.
//
// --two-ranks-only skips the one-rank candidates; --no-early leaves out the kTmaPeerEarly candidates.
//
//   gemm_rs_one_rank_bench [--iters N] [--warmup N] [--json FILE] [--no-trace] [--no-two-ranks] [--two-ranks-only]
//                          [--no-early] [--shape MxNxK]...
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "checks.hpp"
#include "cublaslt_gemm.hpp"
#include "ref_gemm.cuh"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_ar.hpp"
#include "tandem/kernels/gemm_rs.hpp"

using namespace tandem::kernels;
using namespace tandem::bench;

namespace {

struct Shape {
  int64_t m, n, k;
};

__device__ __forceinline__ uint64_t nowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Keeps the stream busy while the host enqueues the timed launch, so the events around it see only GPU time.
__global__ void spinKernel(uint64_t ns) {
  const uint64_t t0 = nowNs();
  while (nowNs() - t0 < ns) {
  }
}
// Counts the 16-bit words of a [m, n] (row stride ld) that differ from b (same layout).
__global__ void countDiffKernel(const uint16_t* a, const uint16_t* b, int64_t m, int64_t n, int64_t ld,
                                unsigned long long* diff) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t off = (i / n) * ld + i % n;
    d += a[off] != b[off];
  }
  if (d) atomicAdd(diff, d);
}

GemmRsPlan fusedPlan(GemmRsTransport t, int send) {
  GemmRsPlan p{};
  p.kind = GemmRsPlanKind::kFused;
  p.transport = t;
  p.partial = GemmRsPartial::kInput;
  p.epiReduce = 1;
  p.numSend = static_cast<int16_t>(send);
  return p;
}

struct Cand {
  std::string name;
  std::function<void(int set, cudaStream_t s)> run;
  std::string ran;
  std::vector<float> ms, gpuMs;
  double relErr = -1;
  unsigned long long bad = 0;
  bool fused = false;         // a fused candidate (traceable)
  bool tandem = true;         // must equal the GEMM core bitwise
  long long diffWords = -1;   // words that differ from the GEMM core's output (-1: not compared)
  uint64_t* trace = nullptr;  // set while the traced launch runs
};

// Per-tile times from a GemmRsParams::trace buffer (see gemm_rs.hpp for the layout): the mean over every compute
// warpgroup's tiles of the mainloop (from the previous tile's epilogue exit; the first tile's, which includes the
// start, left out) and of the epilogue, the latter split into tiles reduced here (own: wait for peers, then the rest)
// and partials sent; the tiles per warpgroup; the span from the earliest start to the last epilogue exit.
struct TraceSummary {
  double mainloopUs = 0, ownWaitUs = 0, ownEpiUs = 0, sentEpiUs = 0, tilesPerWg = 0, ownPerWg = 0, spanUs = 0;
};
TraceSummary summarize(const std::vector<uint64_t>& tr, int ctas, int traceTiles) {
  TraceSummary s;
  double mainSum = 0, waitSum = 0, ownSum = 0, sentSum = 0;
  long long mainN = 0, ownN = 0, sentN = 0;
  uint64_t t0 = ~0ull, t1 = 0;
  int wgs = 0;
  for (int b = 0; b < ctas * 2; ++b) {
    const uint64_t* blk = tr.data() + static_cast<size_t>(b) * (traceTiles + 1) * 4;
    if (blk[0] == 0) continue;  // not a compute CTA
    ++wgs;
    t0 = std::min(t0, blk[0]);
    uint64_t prevExit = 0;
    for (int j = 0; j < traceTiles; ++j) {
      const uint64_t* f = blk + (1 + j) * 4;
      if (f[0] == 0 || f[2] < f[0]) break;
      if (f[3] == 1) {
        ++ownN;
        const uint64_t after = f[1] >= f[0] && f[1] <= f[2] ? f[1] : f[0];
        waitSum += double(after - f[0]);
        ownSum += double(f[2] - f[0]);
      } else {
        ++sentN;
        sentSum += double(f[2] - f[0]);
      }
      if (prevExit != 0) {
        mainSum += double(f[0] - prevExit);
        ++mainN;
      }
      prevExit = f[2];
      t1 = std::max(t1, f[2]);
    }
  }
  s.mainloopUs = mainN ? mainSum / mainN * 1e-3 : 0;
  s.ownWaitUs = ownN ? waitSum / ownN * 1e-3 : 0;
  s.ownEpiUs = ownN ? ownSum / ownN * 1e-3 : 0;
  s.sentEpiUs = sentN ? sentSum / sentN * 1e-3 : 0;
  s.tilesPerWg = wgs ? double(ownN + sentN) / wgs : 0;
  s.ownPerWg = wgs ? double(ownN) / wgs : 0;
  s.spanUs = t1 > t0 ? double(t1 - t0) * 1e-3 : 0;
  return s;
}
void printTrace(std::FILE* json, const char* section, int64_t m, int64_t n, int64_t k, const std::string& name,
                const TraceSummary& t) {
  std::printf("  %-28s mainloop %7.2f us | own tiles: wait %5.2f, epilogue %6.2f us | sent: epilogue %6.2f us | "
              "tiles/wg %5.2f (own %5.2f) | span %8.1f us\n",
              name.c_str(), t.mainloopUs, t.ownWaitUs, t.ownEpiUs, t.sentEpiUs, t.tilesPerWg, t.ownPerWg, t.spanUs);
  if (json) {
    std::fprintf(json,
                 "{\"section\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"candidate\": \"%s\", "
                 "\"trace_mainloop_us\": %.3f, \"trace_own_wait_us\": %.3f, \"trace_own_epilogue_us\": %.3f, "
                 "\"trace_sent_epilogue_us\": %.3f, \"trace_tiles_per_wg\": %.2f, \"trace_span_us\": %.1f}\n",
                 section, (long long)m, (long long)n, (long long)k, name.c_str(), t.mainloopUs, t.ownWaitUs, t.ownEpiUs,
                 t.sentEpiUs, t.tilesPerWg, t.spanUs);
  }
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Two ranks sharing this GPU (see the header comment). Returns false on a failed check.
bool runTwoRanks(const Shape& sh, void* const (&a)[2], void* const (&b)[2], const float* ref, int iters, int warmup,
                 bool early, uint64_t* traceBuf, size_t traceWords, int traceTiles, ErrorSlot* slot, ErrorSlot* slotDev,
                 uint64_t& epoch, cudaStream_t s, const cudaDeviceProp& prop, std::FILE* json) {
  constexpr int kRanks = 2;
  const int64_t kr = sh.k / kRanks;
  const size_t mn = size_t(sh.m) * sh.n;
  bool ok = true;
  void *outR[kRanks], *wsR[kRanks], *base[kRanks];
  cudaStream_t st[kRanks];
  cudaEvent_t ev0, ev1, evR[kRanks];
  CK(cudaEventCreate(&ev0));
  CK(cudaEventCreate(&ev1));
  const size_t wsBytes = gemmRsWorkspaceBytes(sh.m, sh.n, kRanks);
  for (int r = 0; r < kRanks; ++r) {
    CK(cudaMalloc(&outR[r], mn * 2));  // room for the all-reduce's whole output
    CK(cudaMalloc(&base[r], mn * 2));
    CK(cudaMalloc(&wsR[r], wsBytes));
    CK(cudaMemsetAsync(wsR[r], 0, wsBytes, s));  // flags zeroed once, never reset: every launch takes a fresh epoch
    CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&evR[r], cudaEventDisableTiming));
  }
  CK(cudaStreamSynchronize(s));
  struct Cand2 {
    std::string name;
    bool allReduce;
    GemmRsEpilogue epi;
    std::vector<float> ms, gpuMs;
    std::string ran;
  };
  std::vector<Cand2> cands = {{"gemm-rs fused copy", false, GemmRsEpilogue::kDefault},
                              {"gemm-rs fused copy generic", false, GemmRsEpilogue::kGeneric},
                              {"gemm-ar fused copy", true, GemmRsEpilogue::kDefault},
                              {"gemm-ar fused copy tma-peer", true, GemmRsEpilogue::kTmaPeer},
                              {"gemm-rs fused copy early", false, GemmRsEpilogue::kTmaPeerEarly},
                              {"gemm-ar fused copy early", true, GemmRsEpilogue::kTmaPeerEarly}};
  if (!early) {
    cands.erase(std::remove_if(cands.begin(), cands.end(),
                               [](const Cand2& c) { return c.epi == GemmRsEpilogue::kTmaPeerEarly; }),
                cands.end());
  }
  GemmRsPlan plan = fusedPlan(GemmRsTransport::kCopy, 0);
  plan.numCompute = static_cast<int16_t>(prop.multiProcessorCount / kRanks);
  // Enqueues one op on both ranks' streams, after everything on s, and makes s wait for both.
  const auto launch = [&](Cand2& c, int set, uint64_t* trace) {
    const uint64_t e = ++epoch;
    CK(cudaEventRecord(ev0, s));
    for (int r = 0; r < kRanks; ++r) {
      CK(cudaStreamWaitEvent(st[r], ev0, 0));
      GemmRsParams p{};
      p.rank = r;
      p.nranks = kRanks;
      p.m = sh.m;
      p.n = sh.n;
      p.k = kr;
      p.dtype = GemmDtype::kBf16;
      p.a = static_cast<const __nv_bfloat16*>(a[set]) + r * kr;
      p.b = static_cast<const __nv_bfloat16*>(b[set]) + r * kr;
      p.lda = sh.k;
      p.ldb = sh.k;
      p.out = outR[r];
      p.ldOut = sh.n;
      for (int q = 0; q < kRanks; ++q) {
        p.peerOut[q] = outR[q];
        p.workspace[q] = wsR[q];
      }
      p.wsMaxM = sh.m;
      p.wsMaxN = sh.n;
      p.epoch = e;
      p.errorSlot = slotDev;
      p.timeoutNs = 5'000'000'000ull;
      p.plan = plan;
      p.epilogue = c.epi;
      p.trace = r == 0 ? trace : nullptr;
      p.traceTiles = r == 0 && trace ? traceTiles : 0;
      const GemmRsPlan ran = c.allReduce ? launchGemmAr(p, st[r]) : launchGemmRs(p, st[r]);
      c.ran = gemmRsPlanName(ran, c.allReduce);
      CK(cudaEventRecord(evR[r], st[r]));
      CK(cudaStreamWaitEvent(s, evR[r], 0));
    }
  };
  double* sums = nullptr;
  unsigned long long* cnt = nullptr;
  CK(cudaMalloc(&sums, 2 * sizeof(double)));
  CK(cudaMalloc(&cnt, sizeof(unsigned long long)));
  const auto relErr = [&](const void* out, const float* r0, int64_t rows, double& err, unsigned long long& bad) {
    CK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), s));
    CK(cudaMemsetAsync(cnt, 0, sizeof(unsigned long long), s));
    relErrorKernel<__nv_bfloat16, float><<<1024, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(out), sh.n, r0, rows,
                                                               sh.n, sums, cnt);
    CK(cudaStreamSynchronize(s));
    double h[2];
    CK(cudaMemcpy(h, sums, sizeof h, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&bad, cnt, sizeof bad, cudaMemcpyDeviceToHost));
    err = h[1] > 0 ? std::sqrt(h[0] / h[1]) : 1.0;
  };
  const auto diff = [&](const void* x, const void* y, int64_t rows) {
    CK(cudaMemsetAsync(cnt, 0, sizeof(unsigned long long), s));
    countDiffKernel<<<1024, 256, 0, s>>>(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(y), rows, sh.n,
                                         sh.n, cnt);
    CK(cudaGetLastError());
    unsigned long long d = 0;
    CK(cudaMemcpy(&d, cnt, sizeof d, cudaMemcpyDeviceToHost));
    return d;
  };
  const auto rowsOf = [&](int r) { return rsRowsOf(sh.m, r, kRanks); };
  const auto offOf = [&](int r) { return rsRowOffset(sh.m, r, kRanks); };
  const auto rowPtr = [&](void* p, int64_t row) { return static_cast<uint16_t*>(p) + row * sh.n; };
  // Checks the candidate's outputs (set 0): against the reference, and bitwise against the first candidate's rows
  // (an all-reduce's rows of rank r equal rank r's reduce-scatter rows: the same sum in the same order).
  const auto check = [&](Cand2& c, bool first, const char* what) {
    for (int r = 0; r < kRanks; ++r) CK(cudaMemsetAsync(outR[r], 0xff, mn * 2, s));
    launch(c, 0, nullptr);
    CK(cudaStreamSynchronize(s));
    if (slot->claimed) {
      std::printf("FAIL: two ranks %s %s: a device wait failed (code %u, role %u, rank %u)\n", c.name.c_str(), what,
                  slot->code, slot->role, slot->rank);
      std::memset(slot, 0, sizeof(ErrorSlot));
      ok = false;
      return;
    }
    std::string msg;
    for (int r = 0; r < kRanks; ++r) {
      double err = 0;
      unsigned long long bad = 0;
      const int64_t rows = c.allReduce ? sh.m : rowsOf(r);
      relErr(outR[r], ref + (c.allReduce ? 0 : offOf(r)) * sh.n, rows, err, bad);
      if (!(err < 1e-2) || bad != 0) {
        std::printf("FAIL: two ranks %s %s, rank %d: relative error %.3g, %llu non-finite\n", c.name.c_str(), what, r,
                    err, bad);
        ok = false;
      }
      void* mine = c.allReduce ? static_cast<void*>(rowPtr(outR[r], offOf(r))) : outR[r];
      if (first) {
        CK(cudaMemcpy(base[r], mine, size_t(rowsOf(r)) * sh.n * 2, cudaMemcpyDeviceToDevice));
      } else {
        const unsigned long long d = diff(mine, base[r], rowsOf(r));
        if (d != 0) {
          std::printf("FAIL: two ranks %s %s, rank %d: %llu words differ from the first candidate's\n", c.name.c_str(),
                      what, r, d);
          ok = false;
        }
      }
      msg += " rank " + std::to_string(r) + " rel err " + std::to_string(err).substr(0, 8);
    }
    if (c.allReduce) {
      const unsigned long long d = diff(outR[0], outR[1], sh.m);
      if (d != 0) {
        std::printf("FAIL: two ranks %s %s: the ranks' all-reduce outputs differ in %llu words\n", c.name.c_str(),
                    what, d);
        ok = false;
      }
    }
    std::printf("  check %-28s %s:%s%s\n", c.name.c_str(), what, msg.c_str(), first ? "" : ", == first bitwise");
  };
  std::printf("\n%lldx%lldx%lld, TWO ranks sharing this GPU (%d SMs each, K %lld per rank)\n", (long long)sh.m,
              (long long)sh.n, (long long)sh.k, int(plan.numCompute), (long long)kr);
  for (size_t i = 0; i < cands.size() && ok; ++i) check(cands[i], i == 0, "first run");  // a failure ends the section
  for (int it = -warmup; it < iters && ok; ++it) {
    for (Cand2& c : cands) {
      for (int mode = 0; mode < 2; ++mode) {
        cudaEvent_t t0, t1;
        CK(cudaEventCreate(&t0));
        CK(cudaEventCreate(&t1));
        if (mode == 1) spinKernel<<<1, 1, 0, s>>>(200'000);
        CK(cudaEventRecord(t0, s));
        launch(c, (it + 2) & 1, nullptr);
        CK(cudaEventRecord(t1, s));
        CK(cudaEventSynchronize(t1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        if (it >= 0) (mode == 0 ? c.ms : c.gpuMs).push_back(ms);
        CK(cudaEventDestroy(t0));
        CK(cudaEventDestroy(t1));
      }
    }
  }
  if (slot->claimed) {
    std::printf("FAIL: two ranks: a device wait failed while timing (code %u)\n", slot->code);
    std::memset(slot, 0, sizeof(ErrorSlot));
    ok = false;
  }
  if (ok) {
    check(cands[0], false, "repeat after timing");
    const double ref0 = median(cands[0].gpuMs);
    std::printf("  %-28s %10s %10s %8s  %s\n", "candidate", "us", "gpu us", "/first", "plan run");
    for (Cand2& c : cands) {
      const double med = median(c.ms), gpu = median(c.gpuMs);
      std::printf("  %-28s %10.1f %10.1f %8.3f  %s\n", c.name.c_str(), med * 1e3, gpu * 1e3, gpu / ref0, c.ran.c_str());
      if (json) {
        std::fprintf(json,
                     "{\"section\": \"two ranks\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"candidate\": \"%s\", "
                     "\"plan\": \"%s\", \"us\": %.2f, \"gpu_us\": %.2f}\n",
                     (long long)sh.m, (long long)sh.n, (long long)sh.k, c.name.c_str(), c.ran.c_str(), med * 1e3,
                     gpu * 1e3);
      }
    }
    if (traceBuf) {
      std::printf("  per-tile trace of rank 0:\n");
      for (Cand2& c : cands) {
        CK(cudaMemsetAsync(traceBuf, 0, traceWords * 8, s));
        launch(c, 0, traceBuf);
        CK(cudaStreamSynchronize(s));
        std::vector<uint64_t> tr(traceWords);
        CK(cudaMemcpy(tr.data(), traceBuf, traceWords * 8, cudaMemcpyDeviceToHost));
        printTrace(json, "two ranks", sh.m, sh.n, sh.k, c.name, summarize(tr, prop.multiProcessorCount, traceTiles));
      }
    }
  }
  CK(cudaStreamSynchronize(s));
  for (int r = 0; r < kRanks; ++r) {
    CK(cudaFree(outR[r]));
    CK(cudaFree(base[r]));
    CK(cudaFree(wsR[r]));
    CK(cudaStreamDestroy(st[r]));
    CK(cudaEventDestroy(evR[r]));
  }
  CK(cudaEventDestroy(ev0));
  CK(cudaEventDestroy(ev1));
  CK(cudaFree(sums));
  CK(cudaFree(cnt));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30, warmup = 5;
  bool traceOn = true, twoRanks = true, oneRank = true, early = true;
  std::string jsonPath;
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::max(3, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else if (a == "--json" && i + 1 < argc) jsonPath = argv[++i];
    else if (a == "--no-trace") traceOn = false;
    else if (a == "--no-two-ranks") twoRanks = false;
    else if (a == "--two-ranks-only") oneRank = false;
    else if (a == "--no-early") early = false;
    else if (a == "--shape" && i + 1 < argc) {
      long long m = 0, n = 0, k = 0;
      if (std::sscanf(argv[++i], "%lldx%lldx%lld", &m, &n, &k) != 3 || m <= 0 || n <= 0 || k <= 0 || n % 8 || k % 8) {
        std::fprintf(stderr, "--shape %s: expected MxNxK with N and K multiples of 8\n", argv[i]);
        return 2;
      }
      shapes.push_back({m, n, k});
    } else {
      std::fprintf(stderr,
                   "usage: %s [--iters N] [--warmup N] [--json FILE] [--no-trace] [--no-two-ranks] [--two-ranks-only] "
                   "[--no-early] [--shape MxNxK]...\n",
                   argv[0]);
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a run killed by its timeout keeps what it printed
  if (shapes.empty()) shapes = {{8192, 8192, 8192}, {16384, 14336, 8192}, {4096, 8192, 8192}, {1024, 8192, 8192}};
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
    std::printf("SKIP: gemm_rs_one_rank_bench needs a GPU\n");
    return 77;
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::FILE* json = jsonPath.empty() ? nullptr : std::fopen(jsonPath.c_str(), "w");
  if (json) std::setvbuf(json, nullptr, _IOLBF, 0);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasLtHandle_t lt;
  ltCheck(cublasLtCreate(&lt), "cublasLtCreate");
  void* ltWs = nullptr;
  const size_t ltWsBytes = size_t{64} << 20;
  CK(cudaMalloc(&ltWs, ltWsBytes));
  ErrorSlot* slot = nullptr;
  CK(cudaHostAlloc(&slot, sizeof(ErrorSlot), cudaHostAllocMapped));
  std::memset(slot, 0, sizeof(ErrorSlot));
  ErrorSlot* slotDev = nullptr;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&slotDev), slot, 0));
  std::printf("gemm_rs_one_rank_bench on %s (%d SMs), %d iterations (median), bf16\n", prop.name,
              prop.multiProcessorCount, iters);
  bool failed = false;
  uint64_t epoch = 0;
  for (const Shape& sh : shapes) {
    const size_t mn = size_t(sh.m) * sh.n;
    void *a[2], *b[2], *out, *ws;
    float* ref;
    for (int set = 0; set < 2; ++set) {
      CK(cudaMalloc(&a[set], size_t(sh.m) * sh.k * 2));
      CK(cudaMalloc(&b[set], size_t(sh.n) * sh.k * 2));
      fillUniform<__nv_bfloat16><<<2048, 256, 0, s>>>(static_cast<__nv_bfloat16*>(a[set]), size_t(sh.m) * sh.k,
                                                      0x1000 + 13 * set + sh.m);
      fillUniform<__nv_bfloat16><<<2048, 256, 0, s>>>(static_cast<__nv_bfloat16*>(b[set]), size_t(sh.n) * sh.k,
                                                      0x5000 + 17 * set + sh.n);
    }
    CK(cudaMalloc(&out, mn * 2));
    CK(cudaMalloc(&ref, mn * 4));
    void* coreOut = nullptr;  // the GEMM core's output, which every tandem candidate must match bitwise
    CK(cudaMalloc(&coreOut, mn * 2));
    // Trace buffer: 2 warpgroups per CTA, up to traceTiles tiles each (more tiles than that go unrecorded).
    const int traceTiles = 128;
    const size_t traceWords = size_t(prop.multiProcessorCount) * 2 * (traceTiles + 1) * 4;
    uint64_t* traceBuf = nullptr;
    if (traceOn) CK(cudaMalloc(&traceBuf, traceWords * 8));
    // The fused kernels' workspace (flags zeroed once and never reset, so every launch takes a fresh epoch); one rank
    // stages nothing in it.
    const size_t wsBytes = gemmRsWorkspaceBytes(sh.m, sh.n, 1);
    CK(cudaMalloc(&ws, wsBytes));
    CK(cudaMemsetAsync(ws, 0, wsBytes, s));
    dim3 grid(unsigned((sh.n + 63) / 64), unsigned((sh.m + 63) / 64));
    refGemm<__nv_bfloat16><<<grid, dim3(16, 16), 0, s>>>(static_cast<const __nv_bfloat16*>(a[0]),
                                                         static_cast<const __nv_bfloat16*>(b[0]), ref, int(sh.m),
                                                         int(sh.n), int(sh.k), sh.k, sh.k, 0);
    CK(cudaGetLastError());
    LtGemm ltGemm(lt, sh.m, sh.n, sh.k, ltWs, ltWsBytes);

    const auto rsParams = [&](int set, const GemmRsPlan& plan, GemmRsEpilogue epi, uint64_t* trace) {
      GemmRsParams p{};
      p.rank = 0;
      p.nranks = 1;
      p.m = sh.m;
      p.n = sh.n;
      p.k = sh.k;
      p.dtype = GemmDtype::kBf16;
      p.a = a[set];
      p.b = b[set];
      p.lda = sh.k;
      p.ldb = sh.k;
      p.out = out;
      p.ldOut = sh.n;
      p.peerOut[0] = out;
      p.workspace[0] = ws;
      p.wsMaxM = sh.m;
      p.wsMaxN = sh.n;
      p.epoch = ++epoch;
      p.errorSlot = slotDev;
      p.timeoutNs = 10'000'000'000ull;
      p.plan = plan;
      p.epilogue = epi;
      p.trace = trace;
      p.traceTiles = trace ? traceTiles : 0;
      return p;
    };
    std::vector<Cand> cands;
    cands.push_back({"cuBLASLt", [&](int set, cudaStream_t st) { ltGemm.run(a[set], b[set], out, st); }, "cuBLASLt"});
    cands.back().tandem = false;
    cands.push_back({"GEMM core alone", [&](int set, cudaStream_t st) {
                       GemmParams g{};
                       g.a = a[set];
                       g.b = b[set];
                       g.c = out;
                       g.m = sh.m;
                       g.n = sh.n;
                       g.k = sh.k;
                       g.lda = sh.k;
                       g.ldb = sh.k;
                       g.ldc = sh.n;
                       g.dtype = GemmDtype::kBf16;
                       launchGemm(g, st);
                     }});
    const auto addRs = [&](const std::string& name, GemmRsPlan plan, bool allReduce, GemmRsEpilogue epi) {
      cands.push_back({name, nullptr});
      Cand& c = cands.back();
      c.fused = plan.kind == GemmRsPlanKind::kFused;
      c.run = [&, plan, allReduce, epi, idx = cands.size() - 1](int set, cudaStream_t st) {
        const GemmRsParams p = rsParams(set, plan, epi, cands[idx].trace);
        const GemmRsPlan ran = allReduce ? launchGemmAr(p, st) : launchGemmRs(p, st);
        cands[idx].ran = gemmRsPlanName(ran, allReduce);
      };
    };
    const GemmRsPlan copy = fusedPlan(GemmRsTransport::kCopy, 0);
    addRs("gemm-rs auto (one rank)", GemmRsPlan{}, false, GemmRsEpilogue::kDefault);
    addRs("gemm-rs fused copy", copy, false, GemmRsEpilogue::kDefault);
    addRs("gemm-rs fused copy generic", copy, false, GemmRsEpilogue::kGeneric);
    addRs("gemm-ar fused copy", copy, true, GemmRsEpilogue::kDefault);
    addRs("gemm-ar fused copy generic", copy, true, GemmRsEpilogue::kGeneric);
    addRs("gemm-rs fused send8", fusedPlan(GemmRsTransport::kSend, 8), false, GemmRsEpilogue::kDefault);

    if (!oneRank) cands.clear();
    // Correctness first (set 0 against the reference), then the timing.
    double* sums = nullptr;
    unsigned long long* bad = nullptr;
    CK(cudaMalloc(&sums, 2 * sizeof(double)));
    CK(cudaMalloc(&bad, sizeof(unsigned long long)));
    bool haveCore = false;
    for (size_t ci = 0; ci < cands.size(); ++ci) {
      Cand& c = cands[ci];
      CK(cudaMemsetAsync(out, 0xff, mn * 2, s));  // NaN poison: a tile the kernel skips shows up
      try {
        c.run(0, s);
      } catch (const std::exception& e) {
        std::printf("FAIL: %dx%dx%d %s: %s\n", int(sh.m), int(sh.n), int(sh.k), c.name.c_str(), e.what());
        failed = true;
        c.run = nullptr;
        continue;
      }
      CK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), s));
      CK(cudaMemsetAsync(bad, 0, sizeof(unsigned long long), s));
      relErrorKernel<__nv_bfloat16, float><<<1024, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(out), sh.n, ref,
                                                                 sh.m, sh.n, sums, bad);
      CK(cudaStreamSynchronize(s));
      double h[2];
      CK(cudaMemcpy(h, sums, sizeof h, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&c.bad, bad, sizeof c.bad, cudaMemcpyDeviceToHost));
      c.relErr = h[1] > 0 ? std::sqrt(h[0] / h[1]) : 1.0;
      if (slot->claimed) {
        std::printf("FAIL: %s: a device wait failed (code %u)\n", c.name.c_str(), slot->code);
        std::memset(slot, 0, sizeof(ErrorSlot));
        failed = true;
      }
      if (!(c.relErr < 1e-2) || c.bad != 0) {
        std::printf("FAIL: %dx%dx%d %s: relative error %.3g, %llu non-finite\n", int(sh.m), int(sh.n), int(sh.k),
                    c.name.c_str(), c.relErr, c.bad);
        failed = true;
      }
      if (ci == 1) {  // the GEMM core: every later tandem candidate must reproduce it bit for bit
        CK(cudaMemcpyAsync(coreOut, out, mn * 2, cudaMemcpyDeviceToDevice, s));
        haveCore = true;
      } else if (c.tandem && haveCore) {
        CK(cudaMemsetAsync(bad, 0, sizeof(unsigned long long), s));
        countDiffKernel<<<1024, 256, 0, s>>>(static_cast<const uint16_t*>(out), static_cast<const uint16_t*>(coreOut),
                                             sh.m, sh.n, sh.n, bad);
        CK(cudaGetLastError());
        unsigned long long d = 0;
        CK(cudaMemcpy(&d, bad, sizeof d, cudaMemcpyDeviceToHost));
        c.diffWords = static_cast<long long>(d);
        if (d != 0) {
          std::printf("FAIL: %dx%dx%d %s: %llu of %zu output words differ from the GEMM core's\n", int(sh.m),
                      int(sh.n), int(sh.k), c.name.c_str(), d, mn);
          failed = true;
        }
      }
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int it = -warmup; it < iters; ++it) {
      for (Cand& c : cands) {
        if (!c.run) continue;
        for (int mode = 0; mode < 2; ++mode) {  // 0: events around the host call; 1: host call behind a spin kernel
          if (mode == 1) spinKernel<<<1, 1, 0, s>>>(200'000);
          CK(cudaEventRecord(e0, s));
          c.run((it + 2) & 1, s);
          CK(cudaEventRecord(e1, s));
          CK(cudaEventSynchronize(e1));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= 0) (mode == 0 ? c.ms : c.gpuMs).push_back(ms);
        }
      }
    }
    const double core = cands.empty() ? 1 : median(cands[1].ms), blas = cands.empty() ? 1 : median(cands[0].ms);
    const double coreGpu = cands.empty() ? 1 : median(cands[1].gpuMs);
    const double blasGpu = cands.empty() ? 1 : median(cands[0].gpuMs);
    if (!cands.empty()) std::printf("\n%lldx%lldx%lld (M x N x K)\n", (long long)sh.m, (long long)sh.n, (long long)sh.k);
    if (!cands.empty()) {
      std::printf("  %-28s %10s %8s %10s %8s %8s %9s  %s\n", "candidate", "us", "/core", "gpu us", "/core", "/cuBLAS",
                  "TFLOP/s", "plan run");
    }
    for (Cand& c : cands) {
      if (c.ms.empty()) continue;
      const double med = median(c.ms), gpu = median(c.gpuMs);
      const double tflops = 2.0 * sh.m * sh.n * sh.k / (gpu * 1e-3) / 1e12;
      const std::string bits = c.diffWords < 0 ? "" : c.diffWords == 0 ? ", == core bitwise" : ", DIFFERS from core";
      std::printf("  %-28s %10.1f %8.3f %10.1f %8.3f %8.3f %9.1f  %s (rel err %.2g%s)\n", c.name.c_str(), med * 1e3,
                  med / core, gpu * 1e3, gpu / coreGpu, gpu / blasGpu, tflops, c.ran.c_str(), c.relErr, bits.c_str());
      if (json) {
        std::fprintf(json,
                     "{\"m\": %lld, \"n\": %lld, \"k\": %lld, \"candidate\": \"%s\", \"plan\": \"%s\", \"us\": %.2f, "
                     "\"vs_core\": %.4f, \"vs_cublaslt\": %.4f, \"gpu_us\": %.2f, \"gpu_vs_core\": %.4f, "
                     "\"gpu_vs_cublaslt\": %.4f, \"rel_err\": %.3g, \"diff_words_vs_core\": %lld}\n",
                     (long long)sh.m, (long long)sh.n, (long long)sh.k, c.name.c_str(), c.ran.c_str(), med * 1e3,
                     med / core, med / blas, gpu * 1e3, gpu / coreGpu, gpu / blasGpu, c.relErr, c.diffWords);
      }
    }
    if (traceOn && !cands.empty()) {
      // One traced launch per fused candidate (the trace's stores and timer reads cost a little; not timed above).
      std::printf("  per-tile trace (%%globaltimer; core alone: %.1f us per tile at the same tiles per CTA)\n",
                  coreGpu * 1e3 / std::max(1.0, double((sh.m + 127) / 128 * ((sh.n + 255) / 256)) /
                                                     prop.multiProcessorCount));
      for (Cand& c : cands) {
        if (!c.fused || !c.run) continue;
        CK(cudaMemsetAsync(traceBuf, 0, traceWords * 8, s));
        c.trace = traceBuf;
        c.run(0, s);
        c.trace = nullptr;
        CK(cudaStreamSynchronize(s));
        std::vector<uint64_t> tr(traceWords);
        CK(cudaMemcpy(tr.data(), traceBuf, traceWords * 8, cudaMemcpyDeviceToHost));
        const TraceSummary t = summarize(tr, prop.multiProcessorCount, traceTiles);
        printTrace(json, "one rank", sh.m, sh.n, sh.k, c.name, t);
      }
    }
    if (twoRanks && sh.k % 16 == 0) {
      if (!runTwoRanks(sh, a, b, ref, iters, warmup, early, traceBuf, traceWords, traceTiles, slot, slotDev, epoch, s,
                       prop, json)) {
        failed = true;
      }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaFree(sums));
    CK(cudaFree(bad));
    for (int set = 0; set < 2; ++set) {
      CK(cudaFree(a[set]));
      CK(cudaFree(b[set]));
    }
    CK(cudaFree(out));
    CK(cudaFree(ref));
    CK(cudaFree(ws));
    CK(cudaFree(coreOut));
    if (traceBuf) CK(cudaFree(traceBuf));
  }
  if (json) std::fclose(json);
  std::printf("\n%s\n", failed ? "FAIL: see above"
                               : "PASS: every candidate matched the reference, every tandem one the GEMM core bitwise");
  return failed ? 1 : 0;
}
