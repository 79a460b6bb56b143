// GEMM core vs cuBLASLt on H200: correctness against an fp32 reference, then timing (CUDA events, median, rotated
// input sets larger than L2, ours and cuBLAS interleaved). Exits non-zero on any correctness failure.
//
//   gemm_bench [--json FILE] [--iters N] [--no-sweep] [--only big|odd] [--cluster 1|2] [--shape I]
//              [--profile clusterM,epilogue,groupM]   (for ncu: that configuration only, 5 launches per shape)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"  // after <cublasLt.h> and <nccl.h>: it defines BK/NK for those it finds
#include "cublaslt_gemm.hpp"
#include "ref_gemm.cuh"
#include "tandem/kernels/gemm.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GemmParams;
using tandem::kernels::launchGemm;

namespace {

using tandem::bench::fillUniform;
using tandem::bench::syncOrDie;
using tandem::bench::refGemm;
using tandem::bench::relErrorKernel;


struct ErrResult {
  double rel;
  unsigned long long bad;
  bool ok() const { return bad == 0 && std::isfinite(rel) && rel < 1e-2; }
};

template <class T>
ErrResult compare(const T* out, int64_t ldc, const float* ref, int64_t m, int64_t n, cudaStream_t s, double* dSums,
                  unsigned long long* dBad) {
  CK(cudaMemsetAsync(dSums, 0, 2 * sizeof(double), s));
  CK(cudaMemsetAsync(dBad, 0, sizeof(unsigned long long), s));
  relErrorKernel<T, float><<<1024, 256, 0, s>>>(out, ldc, ref, int64_t(m), int64_t(n), dSums, dBad);
  CK(cudaGetLastError());
  double h[2];
  unsigned long long b;
  CK(cudaMemcpyAsync(h, dSums, sizeof(h), cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&b, dBad, sizeof(b), cudaMemcpyDeviceToHost, s));
  syncOrDie(s, 60, "compare");
  return {std::sqrt(h[0] / std::max(h[1], 1e-300)), b};
}

using tandem::bench::LtGemm;

struct Shape {
  int64_t m, n, k;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: packed
  const char* note = "";
};

struct Config {
  int clusterM, epilogue, groupM;
  std::string name() const {
    return "c" + std::to_string(clusterM) + (epilogue == 2 ? "/direct" : "/tma") + "/g" + std::to_string(groupM);
  }
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double tflops(const Shape& s, double ms) { return 2.0 * double(s.m) * double(s.n) * double(s.k) / (ms * 1e-3) / 1e12; }

struct Buffers {
  int64_t lda, ldb, ldc;
  std::vector<void*> a, b, c, cBlas;
  float* ref = nullptr;
};

bool gFailed = false;

template <class T>
Buffers allocFill(const Shape& sh, int sets, cudaStream_t s, uint64_t seed) {
  Buffers buf;
  buf.lda = sh.lda ? sh.lda : sh.k;
  buf.ldb = sh.ldb ? sh.ldb : sh.k;
  buf.ldc = sh.ldc ? sh.ldc : sh.n;
  for (int i = 0; i < sets; ++i) {
    void *a, *b, *c, *cb;
    const size_t na = size_t(sh.m) * buf.lda, nb = size_t(sh.n) * buf.ldb, nc = size_t(sh.m) * buf.ldc;
    CK(cudaMalloc(&a, na * 2));
    CK(cudaMalloc(&b, nb * 2));
    CK(cudaMalloc(&c, nc * 2));
    CK(cudaMalloc(&cb, nc * 2));
    fillUniform<T><<<2048, 256, 0, s>>>(static_cast<T*>(a), na, seed + 2 * i);
    fillUniform<T><<<2048, 256, 0, s>>>(static_cast<T*>(b), nb, seed + 2 * i + 1);
    CK(cudaGetLastError());
    buf.a.push_back(a);
    buf.b.push_back(b);
    buf.c.push_back(c);
    buf.cBlas.push_back(cb);
  }
  CK(cudaMalloc(&buf.ref, size_t(sh.m) * sh.n * sizeof(float)));
  dim3 grid(unsigned((sh.n + 63) / 64), unsigned((sh.m + 63) / 64));
  refGemm<T><<<grid, dim3(16, 16), 0, s>>>(static_cast<const T*>(buf.a[0]), static_cast<const T*>(buf.b[0]), buf.ref,
                                           int(sh.m), int(sh.n), int(sh.k), buf.lda, buf.ldb, 0);
  CK(cudaGetLastError());
  syncOrDie(s, 120, "fill + reference");
  return buf;
}

void freeBuffers(Buffers& b) {
  for (auto* p : b.a) cudaFree(p);
  for (auto* p : b.b) cudaFree(p);
  for (auto* p : b.c) cudaFree(p);
  for (auto* p : b.cBlas) cudaFree(p);
  cudaFree(b.ref);
}

GemmParams makeParams(const Shape& sh, const Buffers& buf, int set, GemmDtype dt, const Config& cfg, bool blasOut) {
  GemmParams p{};
  p.a = buf.a[set];
  p.b = buf.b[set];
  p.c = blasOut ? buf.cBlas[set] : buf.c[set];
  p.m = sh.m;
  p.n = sh.n;
  p.k = sh.k;
  p.lda = buf.lda;
  p.ldb = buf.ldb;
  p.ldc = buf.ldc;
  p.dtype = dt;
  p.clusterM = cfg.clusterM;
  p.epilogue = cfg.epilogue;
  p.groupM = cfg.groupM;
  return p;
}

template <class T>
bool checkOurs(const Shape& sh, const Buffers& buf, GemmDtype dt, const Config& cfg, cudaStream_t s, double* dSums,
               unsigned long long* dBad, const char* label) {
  CK(cudaMemsetAsync(buf.c[0], 0xFF, size_t(sh.m) * buf.ldc * 2, s));  // NaN poison
  const GemmParams p = makeParams(sh, buf, 0, dt, cfg, false);
  try {
    launchGemm(p, s);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-6s %-22s launch threw: %s\n", label, cfg.name().c_str(), e.what());
    gFailed = true;
    return false;
  }
  syncOrDie(s, 30, std::string("gemm ") + cfg.name());
  const ErrResult r = compare(static_cast<const T*>(buf.c[0]), buf.ldc, buf.ref, sh.m, sh.n, s, dSums, dBad);
  std::printf("  %s %-6s %-22s rel_err %.3e  non-finite %llu\n", r.ok() ? "ok  " : "FAIL", label, cfg.name().c_str(),
              r.rel, r.bad);
  if (!r.ok()) gFailed = true;
  return r.ok();
}

std::vector<Config> kCheckConfigs = {{1, 1, 16}, {2, 1, 16}, {1, 2, 16}, {2, 2, 16}};

std::vector<Config> onlyCluster(std::vector<Config> v, int cluster) {
  if (cluster == 0) return v;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const Config& c) { return c.clusterM != cluster; }), v.end());
  return v;
}

void expectReject(const char* what, GemmParams p) {
  try {
    launchGemm(p, nullptr);
    std::printf("  FAIL reject %-28s: accepted\n", what);
    gFailed = true;
  } catch (const std::runtime_error& e) {
    std::printf("  ok   reject %-28s: %s\n", what, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* jsonPath = nullptr;
  int iters = 30;
  bool sweep = true;
  std::string only;
  int forceCluster = 0;  // --cluster N: only configurations with clusterM == N (default one included)
  int onlyShape = -1;    // --shape I: only big shape I
  bool profileMode = false;  // --profile c,e,g: run that configuration 5 times on the chosen big shape(s), no checks
  Config profileCfg{0, 0, 0};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) jsonPath = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(20, std::atoi(argv[++i]));
    else if (a == "--no-sweep") sweep = false;
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--cluster" && i + 1 < argc) forceCluster = std::atoi(argv[++i]);
    else if (a == "--shape" && i + 1 < argc) onlyShape = std::atoi(argv[++i]);
    else if (a == "--profile" && i + 1 < argc) {
      profileMode = true;
      if (std::sscanf(argv[++i], "%d,%d,%d", &profileCfg.clusterM, &profileCfg.epilogue, &profileCfg.groupM) != 3) {
        std::fprintf(stderr, "--profile takes clusterM,epilogue,groupM\n");
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--iters N>=20] [--no-sweep] [--only big|odd] [--cluster 1|2] [--shape I] [--profile c,e,g]\n", argv[0]);
      return 2;
    }
  }
  kCheckConfigs = onlyCluster(kCheckConfigs, forceCluster);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB, smem/block opt-in %zu KB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin >> 10);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double* dSums;
  unsigned long long* dBad;
  CK(cudaMalloc(&dSums, 2 * sizeof(double)));
  CK(cudaMalloc(&dBad, sizeof(unsigned long long)));
  cublasLtHandle_t lt;
  BK(cublasLtCreate(&lt));
  const size_t wsSize = 64u << 20;
  void* ws;
  CK(cudaMalloc(&ws, wsSize));

  // ---- argument checks
  std::printf("\n== argument validation\n");
  {
    GemmParams p{};
    static __nv_bfloat16* dummy = nullptr;
    if (!dummy) CK(cudaMalloc(&dummy, 1 << 20));
    p.a = dummy;
    p.b = dummy;
    p.c = dummy;
    p.m = 4097;
    p.n = 4095;
    p.k = 4095;
    p.lda = 4096;
    p.ldb = 4096;
    p.ldc = 4096;
    expectReject("k=4095 (not a multiple of 8)", p);
    p.k = 4104;
    p.lda = 4100;
    expectReject("lda=4100 (not a multiple of 8)", p);
    p.lda = 4104;
    p.ldb = 4104;
    p.c = reinterpret_cast<char*>(dummy) + 2;
    expectReject("misaligned c", p);
    p.c = dummy;
    p.ldc = 4000;
    expectReject("ldc < n", p);
  }

  // ---- odd shapes: correctness of every kernel variant, bf16 and fp16
  const std::vector<Shape> odd = {
      {1000, 1000, 520, 0, 0, 0, "M=1000 N=1000 K=520"},
      {4097, 4095, 4104, 0, 0, 4096, "M=4097 N=4095 K=4104, ldc 4096"},
      {300, 600, 200, 264, 208, 0, "3x3 tiles, strided A/B"},
      {129, 257, 72, 0, 0, 264, "tiny edges"},
      {1, 8, 8, 0, 0, 0, "1x8x8"},
      {2048, 512, 32, 0, 0, 0, "K < 64"},
  };
  if (only != "big") {
    std::printf("\n== correctness, odd shapes (M x N x K)\n");
    for (const Shape& sh : odd) {
      std::printf(" %lld x %lld x %lld  (%s)\n", (long long)sh.m, (long long)sh.n, (long long)sh.k, sh.note);
      {
        Buffers buf = allocFill<__nv_bfloat16>(sh, 1, s, 1234);
        for (const Config& c : kCheckConfigs) checkOurs<__nv_bfloat16>(sh, buf, GemmDtype::kBf16, c, s, dSums, dBad, "bf16");
        freeBuffers(buf);
      }
      {
        Buffers buf = allocFill<__half>(sh, 1, s, 777);
        for (const Config& c : kCheckConfigs) checkOurs<__half>(sh, buf, GemmDtype::kFp16, c, s, dSums, dBad, "fp16");
        freeBuffers(buf);
      }
    }
    // Host cost of a launch: cached descriptors vs a miss on every call (distinct C pointers).
    {
      const Shape sh{256, 256, 64};
      Buffers buf = allocFill<__nv_bfloat16>(sh, 1, s, 99);
      void* bigC;
      CK(cudaMalloc(&bigC, size_t(256) * 256 * 2 + 256 * 16));
      GemmParams p = makeParams(sh, buf, 0, GemmDtype::kBf16, {0, 0, 0}, false);
      for (int i = 0; i < 10; ++i) launchGemm(p, s);
      syncOrDie(s, 30, "warm");
      const int n = 200;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) launchGemm(p, s);
      auto t1 = std::chrono::steady_clock::now();
      syncOrDie(s, 30, "hits");
      auto t2 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) {
        p.c = static_cast<char*>(bigC) + 16 * (i % 256);
        launchGemm(p, s);
      }
      auto t3 = std::chrono::steady_clock::now();
      syncOrDie(s, 30, "misses");
      std::printf("\n== host cost of launchGemm: %.2f us with cached TMA maps, %.2f us when C's map is re-encoded\n",
                  std::chrono::duration<double, std::micro>(t1 - t0).count() / n,
                  std::chrono::duration<double, std::micro>(t3 - t2).count() / n);
      cudaFree(bigC);
      freeBuffers(buf);
    }
  }

  // ---- big shapes: correctness, sweep, timing vs cuBLASLt
  const std::vector<Shape> big = {
      {4096, 8192, 8192, 0, 0, 0, "M=4096 K=8192 N=8192"},
      {8192, 8192, 8192, 0, 0, 0, "M=8192 K=8192 N=8192"},
      {16384, 14336, 8192, 0, 0, 0, "M=16384 K=8192 N=14336"},
      {8192, 8192, 28672, 0, 0, 0, "M=8192 K=28672 N=8192"},
  };
  struct Row {
    Shape sh;
    double ours, blas;
    std::string cfg;
    double relOurs, relBlas;
  };
  std::vector<Row> rows;
  std::vector<std::string> sweepLines;
  if (only != "odd") {
    std::vector<float> t(iters), tb(iters);
    std::vector<cudaEvent_t> ev(3 * iters);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (size_t si = 0; si < big.size(); ++si) {
      const Shape& sh = big[si];
      if (onlyShape >= 0 && size_t(onlyShape) != si) continue;
      if (profileMode) {
        Buffers buf = allocFill<__nv_bfloat16>(sh, 2, s, 42);
        for (int i = 0; i < 5; ++i) launchGemm(makeParams(sh, buf, i % 2, GemmDtype::kBf16, profileCfg, false), s);
        syncOrDie(s, 120, "profile");
        std::printf("profiled %s with %s\n", sh.note, profileCfg.name().c_str());
        freeBuffers(buf);
        continue;
      }
      const double bytesPerSet = double(sh.m + sh.n) * sh.k * 2;
      const int sets = std::max(2, int(std::ceil(3 * 60e6 / bytesPerSet)));
      std::printf("\n== %s (M x N x K = %lld x %lld x %lld), %d input sets\n", sh.note, (long long)sh.m,
                  (long long)sh.n, (long long)sh.k, sets);
      Buffers buf = allocFill<__nv_bfloat16>(sh, sets, s, 42);
      for (const Config& c : kCheckConfigs) checkOurs<__nv_bfloat16>(sh, buf, GemmDtype::kBf16, c, s, dSums, dBad, "bf16");
      LtGemm blas(lt, sh.m, sh.n, sh.k, buf.lda, buf.ldb, buf.ldc, ws, wsSize);
      CK(cudaMemsetAsync(buf.cBlas[0], 0xFF, size_t(sh.m) * buf.ldc * 2, s));
      blas.run(buf.a[0], buf.b[0], buf.cBlas[0], s);
      syncOrDie(s, 30, "cublas");
      const ErrResult rb = compare(static_cast<const __nv_bfloat16*>(buf.cBlas[0]), buf.ldc, buf.ref, sh.m, sh.n, s,
                                   dSums, dBad);
      std::printf("  %s cuBLASLt                    rel_err %.3e  non-finite %llu\n", rb.ok() ? "ok  " : "FAIL", rb.rel,
                  rb.bad);
      if (!rb.ok()) gFailed = true;

      if (sweep) {
        // Round-robin over the configurations, one launch each per round, so that clock and power drift (the GPU
        // runs at its power cap here) hits every configuration alike.
        const std::vector<Config> configs = onlyCluster({{1, 1, 16}, {1, 1, 8}, {1, 1, 32}, {1, 2, 16},
                                                         {2, 1, 16}, {2, 1, 32}},
                                                        forceCluster);
        const int sweepIters = 20;
        std::vector<cudaEvent_t> sev(configs.size() * sweepIters * 2);
        for (auto& e : sev) CK(cudaEventCreate(&e));
        for (const Config& c : configs) launchGemm(makeParams(sh, buf, 0, GemmDtype::kBf16, c, false), s);
        for (int i = 0; i < sweepIters; ++i) {
          for (size_t ci = 0; ci < configs.size(); ++ci) {
            const size_t slot = (size_t(i) * configs.size() + ci) * 2;
            CK(cudaEventRecord(sev[slot], s));
            launchGemm(makeParams(sh, buf, int(i % sets), GemmDtype::kBf16, configs[ci], false), s);
            CK(cudaEventRecord(sev[slot + 1], s));
          }
        }
        syncOrDie(s, 120, "sweep");
        for (size_t ci = 0; ci < configs.size(); ++ci) {
          std::vector<float> ts(sweepIters);
          for (int i = 0; i < sweepIters; ++i) {
            const size_t slot = (size_t(i) * configs.size() + ci) * 2;
            CK(cudaEventElapsedTime(&ts[i], sev[slot], sev[slot + 1]));
          }
          const double ms = median(ts);
          char line[256];
          std::snprintf(line, sizeof(line), "  sweep %-16s %8.3f ms  %6.1f TF/s", configs[ci].name().c_str(), ms,
                        tflops(sh, ms));
          std::printf("%s\n", line);
          sweepLines.push_back(std::string(sh.note) + ": " + line);
        }
        for (auto& e : sev) cudaEventDestroy(e);
      }

      // Default configuration vs cuBLASLt, interleaved so clocks and power affect both alike.
      const Config def{forceCluster, 0, 0};
      for (int i = 0; i < 5; ++i) {
        launchGemm(makeParams(sh, buf, i % sets, GemmDtype::kBf16, def, false), s);
        blas.run(buf.a[i % sets], buf.b[i % sets], buf.cBlas[i % sets], s);
      }
      // Even iterations run ours first, odd ones cuBLASLt first, so neither always follows the other.
      for (int i = 0; i < iters; ++i) {
        const int set = i % sets;
        const bool oursFirst = i % 2 == 0;
        CK(cudaEventRecord(ev[3 * i], s));
        if (oursFirst) launchGemm(makeParams(sh, buf, set, GemmDtype::kBf16, def, false), s);
        else blas.run(buf.a[set], buf.b[set], buf.cBlas[set], s);
        CK(cudaEventRecord(ev[3 * i + 1], s));
        if (oursFirst) blas.run(buf.a[set], buf.b[set], buf.cBlas[set], s);
        else launchGemm(makeParams(sh, buf, set, GemmDtype::kBf16, def, false), s);
        CK(cudaEventRecord(ev[3 * i + 2], s));
      }
      syncOrDie(s, 120, "timing");
      for (int i = 0; i < iters; ++i) {
        const bool oursFirst = i % 2 == 0;
        CK(cudaEventElapsedTime(oursFirst ? &t[i] : &tb[i], ev[3 * i], ev[3 * i + 1]));
        CK(cudaEventElapsedTime(oursFirst ? &tb[i] : &t[i], ev[3 * i + 1], ev[3 * i + 2]));
      }
      // Re-check the default configuration's output of the timed runs (set 0, written by the last iteration on it).
      const ErrResult rd = compare(static_cast<const __nv_bfloat16*>(buf.c[0]), buf.ldc, buf.ref, sh.m, sh.n, s, dSums, dBad);
      if (!rd.ok()) {
        std::printf("  FAIL default config after timing: rel_err %.3e non-finite %llu\n", rd.rel, rd.bad);
        gFailed = true;
      }
      GemmParams dp = makeParams(sh, buf, 0, GemmDtype::kBf16, def, false);
      rows.push_back({sh, median(t), median(tb), tandem::kernels::gemmConfigName(dp), rd.rel, rb.rel});
      std::printf("  ours %.3f ms (%.1f TF/s)  cuBLASLt %.3f ms (%.1f TF/s)  ratio %.3f\n", median(t),
                  tflops(sh, median(t)), median(tb), tflops(sh, median(tb)), median(tb) / median(t));
      // Throttling check: medians of the first and the last 10 timed iterations.
      std::printf("  first10/last10 medians: ours %.3f / %.3f ms, cuBLASLt %.3f / %.3f ms\n",
                  median({t.begin(), t.begin() + 10}), median({t.end() - 10, t.end()}),
                  median({tb.begin(), tb.begin() + 10}), median({tb.end() - 10, tb.end()}));
      freeBuffers(buf);
    }
    for (auto& e : ev) cudaEventDestroy(e);
  }

  if (!rows.empty()) {
    std::printf("\n| shape (M x K x N) | ours ms | ours TF/s | cuBLASLt ms | cuBLASLt TF/s | ours/cuBLAS throughput |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      std::printf("| %lld x %lld x %lld | %.3f | %.1f | %.3f | %.1f | %.3f |\n", (long long)r.sh.m, (long long)r.sh.k,
                  (long long)r.sh.n, r.ours, tflops(r.sh, r.ours), r.blas, tflops(r.sh, r.blas), r.blas / r.ours);
    }
    std::printf("(ours: %s; median of %d, interleaved with cuBLASLt in alternating order; bf16 in/out, fp32 accumulate)\n",
                rows[0].cfg.c_str(), iters);
  }
  if (jsonPath) {
    FILE* f = std::fopen(jsonPath, "w");
    if (f) {
      std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"iters\": %d,\n  \"failed\": %s,\n  \"shapes\": [\n", prop.name,
                   iters, gFailed ? "true" : "false");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "    {\"m\": %lld, \"n\": %lld, \"k\": %lld, \"config\": \"%s\", \"ours_ms\": %.5f, \"ours_tflops\": "
                     "%.2f, \"cublaslt_ms\": %.5f, \"cublaslt_tflops\": %.2f, \"ratio\": %.4f, \"rel_err\": %.3e, "
                     "\"cublaslt_rel_err\": %.3e}%s\n",
                     (long long)r.sh.m, (long long)r.sh.n, (long long)r.sh.k, r.cfg.c_str(), r.ours,
                     tflops(r.sh, r.ours), r.blas, tflops(r.sh, r.blas), r.blas / r.ours, r.relOurs, r.relBlas,
                     i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "  ],\n  \"sweep\": [\n");
      for (size_t i = 0; i < sweepLines.size(); ++i) {
        std::fprintf(f, "    \"%s\"%s\n", sweepLines[i].c_str(), i + 1 < sweepLines.size() ? "," : "");
      }
      std::fprintf(f, "  ]\n}\n");
      std::fclose(f);
    }
  }
  std::printf("\n%s\n", gFailed ? "RESULT: FAIL (correctness)" : "RESULT: all correctness checks passed");
  return gFailed ? 1 : 0;
}
