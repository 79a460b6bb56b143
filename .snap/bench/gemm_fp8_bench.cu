// The FP8 GEMM core against cuBLASLt's FP8 GEMM in the same process: C [m, n] = A [m, k] * B [n, k]^T, e4m3 operands,
// bf16 C. Per-tensor scaling against cuBLASLt with scale pointers, with fast accumulation (no promotion, as ours) and
// without (cuBLASLt's default, torch._scaled_mm's use_fast_accum=False); block scaling (DeepSeek-V3) against our
// per-tensor speed. Correctness first (poisoned outputs, an fp32 reference of the unscaled product; block scaling
// checked with constant scales equal to the per-tensor ones), then timing: CUDA events around each launch, the four
// GEMMs interleaved per iteration (the order rotating), median after warm-up, input sets rotated so that L2 holds
// none of the next launch's operands. Exits 1 on any correctness failure.
//
//   gemm_fp8_bench [--iters N (>= 20, default 30)]
//
// ratio = their time / ours (above 1: ours is faster).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"  // after <cublasLt.h>: defines BK
#include "ref_gemm.cuh"
#include "tandem/kernels/gemm_fp8.hpp"

using tandem::kernels::Fp8Format;
using tandem::kernels::Fp8Out;
using tandem::kernels::Fp8Scaling;
using tandem::kernels::GemmFp8Params;

namespace {

using tandem::bench::fillFp8;
using tandem::bench::fillScales;
using tandem::bench::mix;
using tandem::bench::refGemm;
using tandem::bench::syncOrDie;

constexpr size_t kLtWorkspace = size_t(64) << 20;
constexpr float kScaleA = 0.37f, kScaleB = 1.9f;  // per-tensor scales (and the constant block scales of the check)

// sums[0] += Σ (out - scale * ref)², sums[1] += Σ (scale * ref)², bad += non-finite outputs; out bf16 [m, n] dense.
__global__ void relErrScaled(const __nv_bfloat16* out, const float* ref, float scale, int64_t total, double* sums,
                             unsigned long long* bad) {
  double e = 0, r = 0;
  unsigned long long nb = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const float o = __bfloat162float(out[i]);
    const double f = double(ref[i]) * scale;
    if (!isfinite(o)) {
      ++nb;
      continue;
    }
    e += (double(o) - f) * (double(o) - f);
    r += f * f;
  }
  atomicAdd(&sums[0], e);
  atomicAdd(&sums[1], r);
  if (nb != 0) atomicAdd(bad, nb);
}

// cuBLASLt FP8: our row-major C [m, n] is its column-major C^T [n, m] = B * A^T, with our B [n, k] its first operand
// (k x n column-major, transposed: FP8 needs the "TN" form, which is ours). Its A scale is our B's and vice versa.
struct LtFp8Gemm {
  cublasLtHandle_t handle{};
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulAlgo_t algo{};
  void* ws;

  LtFp8Gemm(cublasLtHandle_t h, int64_t m, int64_t n, int64_t k, const float* scaleA, const float* scaleB, bool fastAccum,
            void* workspace)
      : handle(h), ws(workspace) {
    BK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scaleB, sizeof(scaleB)));
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scaleA, sizeof(scaleA)));
    const int8_t fast = fastAccum ? 1 : 0;
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    BK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, u(k), u(n), k));
    BK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, u(k), u(m), k));
    BK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, u(n), u(m), n));
    cublasLtMatmulPreference_t pref;
    BK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t wsSize = kLtWorkspace;
    BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsSize, sizeof(wsSize)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    BK(cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, pref, 1, &res, &found));
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt found no FP8 algorithm for %lldx%lldx%lld\n", (long long)m, (long long)n,
                   (long long)k);
      std::exit(2);
    }
    algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  ~LtFp8Gemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }
  LtFp8Gemm(const LtFp8Gemm&) = delete;
  LtFp8Gemm& operator=(const LtFp8Gemm&) = delete;

  // A failed call is reported (once) and leaves this contender's times empty; the other contenders still run.
  void run(const void* a, const void* b, void* c, cudaStream_t s) const {
    if (failed) return;
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st = cublasLtMatmul(handle, op, &alpha, b, la, a, lb, &beta, c, lc, c, lc, &algo, ws,
                                             kLtWorkspace, s);
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::printf("cuBLASLt FP8 matmul failed: status %d (run with CUBLASLT_LOG_LEVEL=2 for the reason)\n",
                  static_cast<int>(st));
      failed = true;
    }
  }
  mutable bool failed = false;
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Shape {
  int64_t m, n, k;
};

// The contenders, in the order of the columns below.
enum Contender { kOursTensor = 0, kOursBlock, kLtFast, kLtDefault, kContenders };
const char* const kNames[kContenders] = {"ours per-tensor", "ours block", "cuBLASLt fast-accum", "cuBLASLt default"};

struct Row {
  Shape s;
  double ms[kContenders];
  double err[kContenders];
  bool ok;
};

bool gFailed = false;

Row runShape(const Shape& sh, int iters, cublasLtHandle_t lt, void* ltWs, double* dSums, unsigned long long* dBad,
             cudaStream_t s) {
  const size_t aBytes = size_t(sh.m) * sh.k, bBytes = size_t(sh.n) * sh.k, cElems = size_t(sh.m) * sh.n;
  const int sets = std::max(2, int(std::ceil(3 * 60e6 / double(aBytes + bBytes))));  // > 3x the largest L2 (H200)
  const int64_t kBlocks = (sh.k + 127) / 128, nBlocks = (sh.n + 127) / 128;
  const int64_t ldsa = tandem::kernels::gemmFp8ScaleALd(sh.m);
  std::vector<uint8_t*> a(sets), b(sets);
  for (int i = 0; i < sets; ++i) {
    CK(cudaMalloc(&a[i], aBytes));
    CK(cudaMalloc(&b[i], bBytes));
    fillFp8<<<2048, 256, 0, s>>>(a[i], aBytes, 5000 + 2 * i);
    fillFp8<<<2048, 256, 0, s>>>(b[i], bBytes, 5001 + 2 * i);
  }
  float *tensorScales, *sa, *sb, *ref;
  // Two per-tensor scales 16 bytes apart: each pointer as aligned as a tensor of its own would be.
  CK(cudaMalloc(&tensorScales, 8 * sizeof(float)));
  CK(cudaMalloc(&sa, size_t(kBlocks) * ldsa * sizeof(float)));
  CK(cudaMalloc(&sb, size_t(nBlocks) * kBlocks * sizeof(float)));
  CK(cudaMalloc(&ref, cElems * sizeof(float)));
  const float hostScales[8] = {kScaleA, 0, 0, 0, kScaleB, 0, 0, 0};
  CK(cudaMemcpyAsync(tensorScales, hostScales, sizeof hostScales, cudaMemcpyHostToDevice, s));
  fillScales<<<256, 256, 0, s>>>(sa, size_t(kBlocks) * ldsa, 1, kScaleA);  // constant for the check
  fillScales<<<256, 256, 0, s>>>(sb, size_t(nBlocks) * kBlocks, 2, kScaleB);
  std::vector<__nv_bfloat16*> c(kContenders);
  for (auto& p : c) CK(cudaMalloc(&p, cElems * 2));
  refGemm<__nv_fp8_e4m3><<<dim3(unsigned((sh.n + 63) / 64), unsigned((sh.m + 63) / 64)), dim3(16, 16), 0, s>>>(
      reinterpret_cast<const __nv_fp8_e4m3*>(a[0]), reinterpret_cast<const __nv_fp8_e4m3*>(b[0]), ref, int(sh.m),
      int(sh.n), int(sh.k), sh.k, sh.k, 0);
  CK(cudaGetLastError());
  syncOrDie(s, 300, "fill + reference");

  const auto params = [&](int set, Fp8Scaling scaling, __nv_bfloat16* out) {
    GemmFp8Params p{};
    p.aFormat = Fp8Format::kE4M3;
    p.bFormat = Fp8Format::kE4M3;
    p.scaling = scaling;
    p.out = Fp8Out::kBf16;
    p.a = a[set];
    p.b = b[set];
    p.c = out;
    p.scaleA = scaling == Fp8Scaling::kBlock ? sa : tensorScales;
    p.scaleB = scaling == Fp8Scaling::kBlock ? sb : tensorScales + 4;
    p.m = sh.m;
    p.n = sh.n;
    p.k = sh.k;
    p.lda = sh.k;
    p.ldb = sh.k;
    p.ldc = sh.n;
    p.ldsa = ldsa;
    return p;
  };
  const LtFp8Gemm ltFast(lt, sh.m, sh.n, sh.k, tensorScales, tensorScales + 4, true, ltWs);
  const LtFp8Gemm ltDefault(lt, sh.m, sh.n, sh.k, tensorScales, tensorScales + 4, false, ltWs);
  const auto launch = [&](int who, int set) {
    switch (who) {
      case kOursTensor:
        tandem::kernels::launchGemmFp8(params(set, Fp8Scaling::kPerTensor, c[kOursTensor]), s);
        break;
      case kOursBlock:
        tandem::kernels::launchGemmFp8(params(set, Fp8Scaling::kBlock, c[kOursBlock]), s);
        break;
      case kLtFast:
        ltFast.run(a[set], b[set], c[kLtFast], s);
        break;
      default:
        ltDefault.run(a[set], b[set], c[kLtDefault], s);
        break;
    }
  };
  Row row{sh, {}, {}, true};
  try {
    // Correctness: every output poisoned (NaN), one launch each on set 0, against scale * reference.
    for (auto& p : c) CK(cudaMemsetAsync(p, 0xFF, cElems * 2, s));
    for (int who = 0; who < kContenders; ++who) {
      launch(who, 0);
      CK(cudaGetLastError());
      syncOrDie(s, 60, std::string("first launch of ") + kNames[who]);
    }
    for (int who = 0; who < kContenders; ++who) {
      CK(cudaMemsetAsync(dSums, 0, 2 * sizeof(double), s));
      CK(cudaMemsetAsync(dBad, 0, sizeof(unsigned long long), s));
      relErrScaled<<<1024, 256, 0, s>>>(c[who], ref, kScaleA * kScaleB, int64_t(cElems), dSums, dBad);
      CK(cudaGetLastError());
      double h[2];
      unsigned long long bad;
      CK(cudaMemcpyAsync(h, dSums, sizeof(h), cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(&bad, dBad, sizeof(bad), cudaMemcpyDeviceToHost, s));
      syncOrDie(s, 60, "relative error");
      row.err[who] = std::sqrt(h[0] / std::max(h[1], 1e-300));
      // bf16 output (2^-9) plus the tensor cores' ~14-bit fp8 accumulation over K without promotion.
      const bool ok = bad == 0 && std::isfinite(row.err[who]) && row.err[who] < 2e-2;
      if (!ok && who <= kOursBlock) row.ok = false;
    }
    if (!row.ok) gFailed = true;
    // Timing with random block scales (the check above used constant ones).
    fillScales<<<256, 256, 0, s>>>(sa, size_t(kBlocks) * ldsa, 11, 0.0f);
    fillScales<<<256, 256, 0, s>>>(sb, size_t(nBlocks) * kBlocks, 12, 0.0f);
    for (int i = 0; i < 3; ++i) {
      for (int who = 0; who < kContenders; ++who) launch(who, i % sets);
    }
    std::vector<cudaEvent_t> ev(size_t(kContenders + 1) * iters);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    std::vector<std::vector<float>> t(kContenders, std::vector<float>(iters));
    for (int i = 0; i < iters; ++i) {
      cudaEvent_t* e = &ev[size_t(kContenders + 1) * i];
      CK(cudaEventRecord(e[0], s));
      for (int j = 0; j < kContenders; ++j) {
        launch((i + j) % kContenders, i % sets);
        CK(cudaEventRecord(e[j + 1], s));
      }
    }
    syncOrDie(s, 300, "timed launches");
    for (int i = 0; i < iters; ++i) {
      cudaEvent_t* e = &ev[size_t(kContenders + 1) * i];
      for (int j = 0; j < kContenders; ++j) CK(cudaEventElapsedTime(&t[(i + j) % kContenders][i], e[j], e[j + 1]));
    }
    for (auto& e : ev) cudaEventDestroy(e);
    for (int who = 0; who < kContenders; ++who) row.ms[who] = median(t[who]);
    if (ltFast.failed) row.ms[kLtFast] = 0;
    if (ltDefault.failed) row.ms[kLtDefault] = 0;
  } catch (const std::exception& e) {
    std::printf("FAIL %lldx%lldx%lld: %s\n", (long long)sh.m, (long long)sh.n, (long long)sh.k, e.what());
    row.ok = false;
    gFailed = true;
    CK(cudaStreamSynchronize(s));
  }
  for (int i = 0; i < sets; ++i) {
    cudaFree(a[i]);
    cudaFree(b[i]);
  }
  for (auto& p : c) cudaFree(p);
  cudaFree(tensorScales);
  cudaFree(sa);
  cudaFree(sb);
  cudaFree(ref);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) {
      iters = std::max(20, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--iters N>=20]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("device: %s, %d SMs, L2 %d MB; e4m3 x e4m3 -> bf16\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  cublasLtHandle_t lt;
  BK(cublasLtCreate(&lt));
  void* ltWs;
  CK(cudaMalloc(&ltWs, kLtWorkspace));
  double* dSums;
  unsigned long long* dBad;
  CK(cudaMalloc(&dSums, 2 * sizeof(double)));
  CK(cudaMalloc(&dBad, sizeof(unsigned long long)));

  const std::vector<Shape> shapes = {{8192, 8192, 8192}, {4096, 8192, 8192}, {16384, 14336, 8192}};
  std::vector<Row> rows;
  for (const Shape& sh : shapes) {
    const Row r = runShape(sh, iters, lt, ltWs, dSums, dBad, s);
    rows.push_back(r);
    std::printf("%5lld x %5lld x %5lld:", (long long)sh.m, (long long)sh.n, (long long)sh.k);
    for (int who = 0; who < kContenders; ++who) {
      std::printf("  %s %.4f ms (err %.1e)", kNames[who], r.ms[who], r.err[who]);
    }
    std::printf("%s\n", r.ok ? "" : "  FAIL");
    std::fflush(stdout);
  }

  std::printf("\n== summary (%s; median of %d; TFLOP/s; ratio = their time / ours)\n", prop.name, iters);
  std::printf("%-21s %9s %9s %9s %9s  %9s %9s %9s\n", "M x N x K", "ours-pt", "ours-blk", "lt-fast", "lt-dflt",
              "pt/fast", "pt/dflt", "blk/pt");
  for (const Row& r : rows) {
    const double flops = 2.0 * double(r.s.m) * double(r.s.n) * double(r.s.k);
    char mnk[32];
    std::snprintf(mnk, sizeof mnk, "%lldx%lldx%lld", (long long)r.s.m, (long long)r.s.n, (long long)r.s.k);
    const auto tf = [&](int who) { return r.ms[who] > 0 ? flops / (r.ms[who] * 1e9) : 0.0; };
    const auto ratio = [&](int them, int us) { return r.ms[us] > 0 ? r.ms[them] / r.ms[us] : 0.0; };
    std::printf("%-21s %9.0f %9.0f %9.0f %9.0f  %9.3f %9.3f %9.3f%s\n", mnk, tf(kOursTensor), tf(kOursBlock),
                tf(kLtFast), tf(kLtDefault), ratio(kLtFast, kOursTensor), ratio(kLtDefault, kOursTensor),
                ratio(kOursTensor, kOursBlock), r.ok ? "" : "  FAIL");
  }
  std::printf("blk/pt = our per-tensor time / our block-scaled time (block-scaled speed relative to per-tensor)\n");
  cudaFree(ltWs);
  cudaFree(dSums);
  cudaFree(dBad);
  cublasLtDestroy(lt);
  if (gFailed) {
    std::printf("FAILED: a correctness check failed (see above)\n");
    return 1;
  }
  return 0;
}
