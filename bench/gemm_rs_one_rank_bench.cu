// The fused GEMM+ReduceScatter and GEMM+AllReduce kernels forced onto their fused plans at one rank, against the GEMM
// alone, on one GPU. At one rank nothing is exchanged, so what the fused kernel costs over the GEMM core is its own
// epilogue and role machinery: the "lean epilogue" target is at most 1.05x the GEMM alone at 8192^3 and
// 16384x14336x8192 (M x N x K). gemm_rs_bench needs two GPUs; this needs one.
//
// Candidates per shape, timed round robin (each iteration every candidate once, CUDA events around each launch; the
// median over --iters iterations; two input sets alternate so L2 holds neither): cuBLASLt, the GEMM core
// (launchGemm: what tandem runs at one rank), gemm-rs auto (the chooser: the GEMM core at one rank), gemm-rs and
// gemm-ar forced fused (copy transport, bf16 partials, epilogue reduction: the plan that wins at two ranks), and
// gemm-rs fused with 8 send CTAs. Every candidate's output is checked against an fp32 reference (relative error <
// 1e-2, nothing non-finite).
//
//   gemm_rs_one_rank_bench [--iters N] [--warmup N] [--json FILE] [--shape MxNxK]...
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
  std::vector<float> ms;
  double relErr = -1;
  unsigned long long bad = 0;
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30, warmup = 5;
  std::string jsonPath;
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::max(3, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else if (a == "--json" && i + 1 < argc) jsonPath = argv[++i];
    else if (a == "--shape" && i + 1 < argc) {
      long long m = 0, n = 0, k = 0;
      if (std::sscanf(argv[++i], "%lldx%lldx%lld", &m, &n, &k) != 3 || m <= 0 || n <= 0 || k <= 0 || n % 8 || k % 8) {
        std::fprintf(stderr, "--shape %s: expected MxNxK with N and K multiples of 8\n", argv[i]);
        return 2;
      }
      shapes.push_back({m, n, k});
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--json FILE] [--shape MxNxK]...\n", argv[0]);
      return 2;
    }
  }
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

    const auto rsParams = [&](int set, const GemmRsPlan& plan) {
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
      return p;
    };
    std::vector<Cand> cands;
    cands.push_back({"cuBLASLt", [&](int set, cudaStream_t st) { ltGemm.run(a[set], b[set], out, st); }, "cuBLASLt"});
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
    const auto addRs = [&](const std::string& name, GemmRsPlan plan, bool allReduce) {
      cands.push_back({name, nullptr});
      Cand& c = cands.back();
      c.run = [&, plan, allReduce, idx = cands.size() - 1](int set, cudaStream_t st) {
        const GemmRsParams p = rsParams(set, plan);
        const GemmRsPlan ran = allReduce ? launchGemmAr(p, st) : launchGemmRs(p, st);
        cands[idx].ran = gemmRsPlanName(ran, allReduce);
      };
    };
    addRs("gemm-rs auto (one rank)", GemmRsPlan{}, false);
    addRs("gemm-rs forced fused copy", fusedPlan(GemmRsTransport::kCopy, 0), false);
    addRs("gemm-ar forced fused copy", fusedPlan(GemmRsTransport::kCopy, 0), true);
    addRs("gemm-rs forced fused send8", fusedPlan(GemmRsTransport::kSend, 8), false);

    // Correctness first (set 0 against the reference), then the timing.
    double* sums = nullptr;
    unsigned long long* bad = nullptr;
    CK(cudaMalloc(&sums, 2 * sizeof(double)));
    CK(cudaMalloc(&bad, sizeof(unsigned long long)));
    for (Cand& c : cands) {
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
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int it = -warmup; it < iters; ++it) {
      for (Cand& c : cands) {
        if (!c.run) continue;
        CK(cudaEventRecord(e0, s));
        c.run((it + 2) & 1, s);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 0) c.ms.push_back(ms);
      }
    }
    const double core = median(cands[1].ms), blas = median(cands[0].ms);
    std::printf("\n%lldx%lldx%lld (M x N x K)\n", (long long)sh.m, (long long)sh.n, (long long)sh.k);
    std::printf("  %-28s %10s %8s %8s %9s  %s\n", "candidate", "us", "/core", "/cuBLAS", "TFLOP/s", "plan run");
    for (Cand& c : cands) {
      if (c.ms.empty()) continue;
      const double med = median(c.ms);
      const double tflops = 2.0 * sh.m * sh.n * sh.k / (med * 1e-3) / 1e12;
      std::printf("  %-28s %10.1f %8.3f %8.3f %9.1f  %s (rel err %.2g)\n", c.name.c_str(), med * 1e3, med / core,
                  med / blas, tflops, c.ran.c_str(), c.relErr);
      if (json) {
        std::fprintf(json,
                     "{\"m\": %lld, \"n\": %lld, \"k\": %lld, \"candidate\": \"%s\", \"plan\": \"%s\", \"us\": %.2f, "
                     "\"vs_core\": %.4f, \"vs_cublaslt\": %.4f, \"rel_err\": %.3g}\n",
                     (long long)sh.m, (long long)sh.n, (long long)sh.k, c.name.c_str(), c.ran.c_str(), med * 1e3,
                     med / core, med / blas, c.relErr);
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
  }
  if (json) std::fclose(json);
  std::printf("\n%s\n", failed ? "FAIL: see above" : "PASS: every candidate matched the reference");
  return failed ? 1 : 0;
}
