// The GEMM core's layouts (C = A*B^T, A*B, A^T*B) and its small-M path against cuBLASLt in the same layout, same
// process: correctness of both against an fp32 reference, then timing (CUDA events, median of interleaved launches,
// input sets rotated so that L2 holds none of the next launch's operands). Exits 1 on any correctness failure.
//
//   gemm_layouts_bench [--iters N (>= 20, default 30)] [--only big|llama|decode] [--dtype bf16|fp16] [--shape MxNxK]
//
// --shape keeps only the cases of that size (every layout listed for it): one case to put under a profiler.
//
// ratio = cuBLASLt time / ours (above 1: ours is faster). Decode rows also show GB/s: the bytes of A, B and C once
// over the time, against the device-to-device copy bandwidth measured first.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"  // after <cublasLt.h>: defines BK
#include "ref_gemm.cuh"
#include "tandem/kernels/gemm_layouts.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GemmLayout;
using tandem::kernels::GemmLayoutParams;
using tandem::kernels::GemmLayoutPlan;
using tandem::kernels::GemmOut;

namespace {

using tandem::bench::fillUniform;
using tandem::bench::refGemmStrided;
using tandem::bench::relErrorKernel;
using tandem::bench::copyBandwidthGBs;
using tandem::bench::syncOrDie;
using tandem::bench::toFloat;

constexpr size_t kOurWorkspace = size_t(256) << 20;
constexpr size_t kLtWorkspace = size_t(64) << 20;

const char* layoutName(GemmLayout l) {
  return l == GemmLayout::kABt ? "A*B^T (fwd)" : l == GemmLayout::kAB ? "A*B (dgrad)" : "A^T*B (wgrad)";
}

struct Case {
  GemmLayout layout;
  int64_t m, n, k;
  GemmOut out;
  bool decode;
};

// Row lengths (= packed row strides) and row counts of A and B as stored.
struct Dims {
  int64_t lda, ldb, ldc, aRows, bRows;
};
Dims dimsOf(const Case& c) {
  Dims d{};
  d.lda = c.layout == GemmLayout::kAtB ? c.m : c.k;
  d.aRows = c.layout == GemmLayout::kAtB ? c.k : c.m;
  d.ldb = c.layout == GemmLayout::kABt ? c.k : c.n;
  d.bRows = c.layout == GemmLayout::kABt ? c.n : c.k;
  d.ldc = c.n;
  return d;
}

// cuBLASLt in the case's layout. cuBLAS is column-major: our row-major C [m, n] is its C^T [n, m], computed as
// C^T = op(B) * op(A) with our B as its first operand:
//   A*B^T: C^T = B * A^T: B (col-major [k, n], ld ldb) transposed, A ([k, m], lda) as is;
//   A*B:   C^T = B^T * A^T: B (col-major [n, k]) as is, A ([k, m]) as is;
//   A^T*B: C^T = B^T * A:   B ([n, k]) as is, A (col-major [m, k]) transposed.
struct LtLayoutGemm {
  cublasLtHandle_t handle{};
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulAlgo_t algo{};
  void* ws;
  size_t wsSize;

  LtLayoutGemm(cublasLtHandle_t h, const Case& c, GemmDtype dt, void* workspace, size_t workspaceSize)
      : handle(h), ws(workspace), wsSize(workspaceSize) {
    const Dims d = dimsOf(c);
    const cudaDataType_t in = dt == GemmDtype::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
    const cudaDataType_t outT = c.out == GemmOut::kFp32 ? CUDA_R_32F : in;
    BK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = c.layout == GemmLayout::kABt ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = c.layout == GemmLayout::kAtB ? CUBLAS_OP_T : CUBLAS_OP_N;
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    // Stored (pre-op) column-major shapes: rows = the row-major row length.
    BK(cublasLtMatrixLayoutCreate(&la, in, u(d.ldb), u(d.bRows), d.ldb));
    BK(cublasLtMatrixLayoutCreate(&lb, in, u(d.lda), u(d.aRows), d.lda));
    BK(cublasLtMatrixLayoutCreate(&lc, outT, u(c.n), u(c.m), d.ldc));
    cublasLtMatmulPreference_t pref;
    BK(cublasLtMatmulPreferenceCreate(&pref));
    BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsSize, sizeof(wsSize)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    BK(cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, pref, 1, &res, &found));
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt found no algorithm for %s %lldx%lldx%lld\n", layoutName(c.layout),
                   (long long)c.m, (long long)c.n, (long long)c.k);
      std::exit(2);
    }
    algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  ~LtLayoutGemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }
  LtLayoutGemm(const LtLayoutGemm&) = delete;
  LtLayoutGemm& operator=(const LtLayoutGemm&) = delete;

  void run(const void* a, const void* b, void* c, cudaStream_t s) const {
    const float alpha = 1.0f, beta = 0.0f;
    BK(cublasLtMatmul(handle, op, &alpha, b, la, a, lb, &beta, c, lc, c, lc, &algo, ws, wsSize, s));
  }
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Row {
  Case c;
  std::string plan;
  double ours, blas, errOurs, errBlas;
  bool ok;
};

bool gFailed = false;

// ||out - ref|| / ||ref|| and the non-finite count over [m, n].
template <class T>
std::pair<double, unsigned long long> relErr(const void* out, const float* ref, const Case& c, double* dSums,
                                             unsigned long long* dBad, cudaStream_t s) {
  CK(cudaMemsetAsync(dSums, 0, 2 * sizeof(double), s));
  CK(cudaMemsetAsync(dBad, 0, sizeof(unsigned long long), s));
  relErrorKernel<T, float><<<1024, 256, 0, s>>>(static_cast<const T*>(out), c.n, ref, c.m, c.n, dSums, dBad);
  CK(cudaGetLastError());
  double h[2];
  unsigned long long bad;
  CK(cudaMemcpyAsync(h, dSums, sizeof(h), cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&bad, dBad, sizeof(bad), cudaMemcpyDeviceToHost, s));
  syncOrDie(s, 60, "relative error");
  return {std::sqrt(h[0] / std::max(h[1], 1e-300)), bad};
}

// Decode shapes: every swap-AB tile width that needs at most 4 column tiles, at 1, 2 and 4 K splits and the rule's
// count, each timed alone (median) and checked against the reference before and after its timed launches (all plans
// share one workspace), so that a run shows where the rule stands.
template <class T, class Params>
void sweepPlans(const Case& c, int iters, const Params& params, int sets, void* cOurs, const float* ref, double* dSums,
                unsigned long long* dBad, cudaStream_t s) {
  const GemmLayoutPlan rule = tandem::kernels::gemmLayoutDefaultPlan(params(0));
  const double bytes = 2.0 * double(c.m * c.k + c.n * c.k) + 2.0 * double(c.m * c.n);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int tileN : {16, 64, 128, 256}) {
    if (int64_t(tileN) * 4 < c.m) continue;
    std::vector<int> splitCounts{1, 2, 4};
    if (rule.splits > 4) splitCounts.push_back(rule.splits);
    for (int splits : splitCounts) {
      const GemmLayoutPlan plan{tandem::kernels::GemmPath::kSwapAB, tileN, splits};
      const auto check = [&] {
        CK(cudaMemsetAsync(cOurs, 0xFF, size_t(c.m) * c.n * 2, s));
        tandem::kernels::launchGemmLayout(params(0), s, &plan);
        const auto e = relErr<T>(cOurs, ref, c, dSums, dBad, s);
        return std::make_pair(e.first, e.second == 0 && std::isfinite(e.first) && e.first < 1e-2);
      };
      const auto [err, okBefore] = check();
      std::vector<float> t(iters);
      for (int i = 0; i < 3; ++i) tandem::kernels::launchGemmLayout(params(i % sets), s, &plan);
      for (int i = 0; i < iters; ++i) {
        CK(cudaEventRecord(e0, s));
        tandem::kernels::launchGemmLayout(params(i % sets), s, &plan);
        CK(cudaEventRecord(e1, s));
        syncOrDie(s, 30, "plan sweep");
        CK(cudaEventElapsedTime(&t[i], e0, e1));
      }
      const double ms = median(t);
      const bool ok = okBefore && check().second;
      if (!ok) gFailed = true;
      std::printf("    plan %-20s %8.4f ms %6.0f GB/s  err %.1e%s%s\n", tandem::kernels::gemmPlanName(plan).c_str(), ms,
                  bytes / (ms * 1e6), err, ok ? "" : "  FAIL",
                  plan.tileN == rule.tileN && plan.splits == rule.splits ? "  (rule)" : "");
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

template <class T>
Row runCase(const Case& c, GemmDtype dt, int iters, cublasLtHandle_t lt, void* ourWs, void* ltWs, double* dSums,
            unsigned long long* dBad, cudaStream_t s) {
  const Dims d = dimsOf(c);
  const size_t aElems = size_t(d.aRows) * d.lda, bElems = size_t(d.bRows) * d.ldb, cElems = size_t(c.m) * d.ldc;
  const size_t cBytes = cElems * (c.out == GemmOut::kFp32 ? 4 : 2);
  const double setBytes = double(aElems + bElems) * 2;
  const int sets = std::max(2, int(std::ceil(3 * 60e6 / setBytes)));  // > 3x the largest L2 (H200: 60 MB)
  std::vector<void*> a(sets), b(sets);
  for (int i = 0; i < sets; ++i) {
    CK(cudaMalloc(&a[i], aElems * 2));
    CK(cudaMalloc(&b[i], bElems * 2));
    fillUniform<T><<<2048, 256, 0, s>>>(static_cast<T*>(a[i]), aElems, 1000 + 2 * i);
    fillUniform<T><<<2048, 256, 0, s>>>(static_cast<T*>(b[i]), bElems, 1001 + 2 * i);
    CK(cudaGetLastError());
  }
  void *cOurs, *cBlas;
  float* ref;
  CK(cudaMalloc(&cOurs, cBytes));
  CK(cudaMalloc(&cBlas, cBytes));
  CK(cudaMalloc(&ref, size_t(c.m) * c.n * sizeof(float)));
  const int64_t sam = c.layout == GemmLayout::kAtB ? 1 : d.lda, sak = c.layout == GemmLayout::kAtB ? d.lda : 1;
  const int64_t sbk = c.layout == GemmLayout::kABt ? 1 : d.ldb, sbn = c.layout == GemmLayout::kABt ? d.ldb : 1;
  refGemmStrided<T><<<dim3(unsigned((c.n + 63) / 64), unsigned((c.m + 63) / 64)), dim3(16, 16), 0, s>>>(
      static_cast<const T*>(a[0]), sam, sak, static_cast<const T*>(b[0]), sbk, sbn, ref, int(c.m), int(c.n), int(c.k));
  CK(cudaGetLastError());
  syncOrDie(s, 300, "fill + reference");

  const auto params = [&](int set) {
    GemmLayoutParams p{};
    p.layout = c.layout;
    p.dtype = dt;
    p.out = c.out;
    p.a = a[set];
    p.b = b[set];
    p.c = cOurs;
    p.m = c.m;
    p.n = c.n;
    p.k = c.k;
    p.lda = d.lda;
    p.ldb = d.ldb;
    p.ldc = d.ldc;
    p.workspace = ourWs;
    p.workspaceBytes = kOurWorkspace;
    return p;
  };
  const LtLayoutGemm blas(lt, c, dt, ltWs, kLtWorkspace);
  Row row{c, "", 0, 0, 0, 0, true};
  try {
    row.plan = tandem::kernels::gemmPlanName(tandem::kernels::gemmLayoutDefaultPlan(params(0)));
    // Correctness: both outputs poisoned (NaN), then against the reference.
    CK(cudaMemsetAsync(cOurs, 0xFF, cBytes, s));
    CK(cudaMemsetAsync(cBlas, 0xFF, cBytes, s));
    tandem::kernels::launchGemmLayout(params(0), s);
    blas.run(a[0], b[0], cBlas, s);
    syncOrDie(s, 60, "first launches");
    const auto eo = c.out == GemmOut::kFp32 ? relErr<float>(cOurs, ref, c, dSums, dBad, s)
                                            : relErr<T>(cOurs, ref, c, dSums, dBad, s);
    const auto eb = c.out == GemmOut::kFp32 ? relErr<float>(cBlas, ref, c, dSums, dBad, s)
                                            : relErr<T>(cBlas, ref, c, dSums, dBad, s);
    row.errOurs = eo.first;
    row.errBlas = eb.first;
    const double tol = c.out == GemmOut::kFp32 ? 1e-4 : 1e-2;
    row.ok = eo.second == 0 && std::isfinite(eo.first) && eo.first < tol;
    if (!row.ok) gFailed = true;

    // Timing: warm-up, then per iteration both back to back between three events, the order alternating.
    for (int i = 0; i < 5; ++i) {
      tandem::kernels::launchGemmLayout(params(i % sets), s);
      blas.run(a[i % sets], b[i % sets], cBlas, s);
    }
    std::vector<cudaEvent_t> ev(3 * iters);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    std::vector<float> tOurs(iters), tBlas(iters);
    for (int i = 0; i < iters; ++i) {
      const int set = i % sets;
      const bool oursFirst = i % 2 == 0;
      CK(cudaEventRecord(ev[3 * i], s));
      if (oursFirst) tandem::kernels::launchGemmLayout(params(set), s);
      else blas.run(a[set], b[set], cBlas, s);
      CK(cudaEventRecord(ev[3 * i + 1], s));
      if (oursFirst) blas.run(a[set], b[set], cBlas, s);
      else tandem::kernels::launchGemmLayout(params(set), s);
      CK(cudaEventRecord(ev[3 * i + 2], s));
    }
    syncOrDie(s, 300, "timed launches");
    for (int i = 0; i < iters; ++i) {
      const bool oursFirst = i % 2 == 0;
      CK(cudaEventElapsedTime(oursFirst ? &tOurs[i] : &tBlas[i], ev[3 * i], ev[3 * i + 1]));
      CK(cudaEventElapsedTime(oursFirst ? &tBlas[i] : &tOurs[i], ev[3 * i + 1], ev[3 * i + 2]));
    }
    for (auto& e : ev) cudaEventDestroy(e);
    row.ours = median(tOurs);
    row.blas = median(tBlas);
    // Again after the timed launches: a launch must leave the workspace fit for the next one.
    CK(cudaMemsetAsync(cOurs, 0xFF, cBytes, s));
    tandem::kernels::launchGemmLayout(params(0), s);
    const auto after = c.out == GemmOut::kFp32 ? relErr<float>(cOurs, ref, c, dSums, dBad, s)
                                               : relErr<T>(cOurs, ref, c, dSums, dBad, s);
    if (!(after.second == 0 && std::isfinite(after.first) && after.first < tol)) {
      row.ok = false;
      gFailed = true;
    }
    if (c.decode) sweepPlans<T>(c, iters, params, sets, cOurs, ref, dSums, dBad, s);
  } catch (const std::exception& e) {
    std::printf("FAIL %s %lldx%lldx%lld: %s\n", layoutName(c.layout), (long long)c.m, (long long)c.n, (long long)c.k,
                e.what());
    row.ok = false;
    gFailed = true;
    CK(cudaStreamSynchronize(s));
  }
  for (int i = 0; i < sets; ++i) {
    cudaFree(a[i]);
    cudaFree(b[i]);
  }
  cudaFree(cOurs);
  cudaFree(cBlas);
  cudaFree(ref);
  return row;
}


}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  std::string only, dtypeName = "bf16", shape;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) iters = std::max(20, std::atoi(argv[++i]));
    else if (arg == "--only" && i + 1 < argc) only = argv[++i];
    else if (arg == "--dtype" && i + 1 < argc) dtypeName = argv[++i];
    else if (arg == "--shape" && i + 1 < argc) shape = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--iters N>=20] [--only big|llama|decode] [--dtype bf16|fp16] [--shape MxNxK]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!only.empty() && only != "big" && only != "llama" && only != "decode") {
    std::fprintf(stderr, "--only must be big, llama or decode\n");
    return 2;
  }
  if (dtypeName != "bf16" && dtypeName != "fp16") {
    std::fprintf(stderr, "--dtype must be bf16 or fp16\n");
    return 2;
  }
  const GemmDtype dt = dtypeName == "bf16" ? GemmDtype::kBf16 : GemmDtype::kFp16;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copyGBs = copyBandwidthGBs(s);
  std::printf("device: %s, %d SMs, L2 %d MB; %s; device-to-device copy %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, dtypeName.c_str(), copyGBs);

  std::vector<Case> cases;
  if (only.empty() || only == "big") {
    for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB, GemmLayout::kAtB}) {
      cases.push_back({l, 8192, 8192, 8192, GemmOut::kInput, false});
      cases.push_back({l, 4096, 8192, 8192, GemmOut::kInput, false});
    }
    for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB, GemmLayout::kAtB})
      cases.push_back({l, 16384, 14336, 8192, GemmOut::kInput, false});
    cases.push_back({GemmLayout::kAtB, 8192, 8192, 16384, GemmOut::kInput, false});
    cases.push_back({GemmLayout::kAtB, 8192, 8192, 16384, GemmOut::kFp32, false});
  }
  if (only.empty() || only == "llama") {
    // The backward GEMMs of a Llama-70B MLP (hidden 8192, ffn 28672, gate and up fused) over 8192 tokens, sliced for
    // tensor parallelism t: the column-parallel gate/up weight is [2*ffn/t, hidden], the row-parallel down weight
    // [hidden, ffn/t]. dgrad is A*B, wgrad A^T*B (the tokens are the reduction).
    constexpr int64_t kHidden = 8192, kFfn = 28672, kTokens = 8192;
    for (int64_t t : {2, 4, 8}) {
      cases.push_back({GemmLayout::kAB, kTokens, kHidden, 2 * kFfn / t, GemmOut::kInput, false});   // gate/up dX
      cases.push_back({GemmLayout::kAtB, 2 * kFfn / t, kHidden, kTokens, GemmOut::kInput, false});  // gate/up dW
      cases.push_back({GemmLayout::kAB, kTokens, kFfn / t, kHidden, GemmOut::kInput, false});       // down dA
      cases.push_back({GemmLayout::kAtB, kHidden, kFfn / t, kTokens, GemmOut::kInput, false});      // down dW
    }
  }
  if (only.empty() || only == "decode") {
    // The decode shapes of TP linear layers (N, K): square, Llama-70B's up and down projections, Llama-8B's MLP.
    const std::pair<int64_t, int64_t> decodeNK[] = {{8192, 8192}, {28672, 8192}, {8192, 28672}, {14336, 4096}};
    for (const auto& [n, k] : decodeNK)
      for (int64_t m : {1, 2, 4, 8, 16, 32, 64, 128, 256})
        cases.push_back({GemmLayout::kABt, m, n, k, GemmOut::kInput, true});
    for (int64_t m : {1, 16, 64, 128, 256}) cases.push_back({GemmLayout::kAB, m, 8192, 8192, GemmOut::kInput, true});
  }

  if (!shape.empty()) {
    cases.erase(std::remove_if(cases.begin(), cases.end(), [&](const Case& c) {
      return shape != std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k);
    }), cases.end());
    if (cases.empty()) {
      std::fprintf(stderr, "--shape %s: no case of that size (MxNxK, as the summary prints it)\n", shape.c_str());
      return 2;
    }
  }

  cublasLtHandle_t lt;
  BK(cublasLtCreate(&lt));
  void *ourWs, *ltWs;
  CK(cudaMalloc(&ourWs, kOurWorkspace));
  CK(cudaMemset(ourWs, 0, kOurWorkspace));  // zero-filled once, as launchGemmLayout asks
  CK(cudaMalloc(&ltWs, kLtWorkspace));
  double* dSums;
  unsigned long long* dBad;
  CK(cudaMalloc(&dSums, 2 * sizeof(double)));
  CK(cudaMalloc(&dBad, sizeof(unsigned long long)));

  std::vector<Row> rows;
  for (const Case& c : cases) {
    const Row r = dt == GemmDtype::kBf16 ? runCase<__nv_bfloat16>(c, dt, iters, lt, ourWs, ltWs, dSums, dBad, s)
                                         : runCase<__half>(c, dt, iters, lt, ourWs, ltWs, dSums, dBad, s);
    rows.push_back(r);
    std::printf("%-14s %5lld x %5lld x %5lld %-4s %-20s ours %8.4f ms  cuBLASLt %8.4f ms  ratio %.3f  err %.1e / %.1e %s\n",
                layoutName(c.layout), (long long)c.m, (long long)c.n, (long long)c.k,
                c.out == GemmOut::kFp32 ? "f32" : "in", r.plan.c_str(), r.ours, r.blas, r.ours > 0 ? r.blas / r.ours : 0,
                r.errOurs, r.errBlas, r.ok ? "ok" : "FAIL");
    std::fflush(stdout);
  }

  std::printf("\n== summary (%s, %s; median of %d; ratio = cuBLASLt time / ours)\n", prop.name, dtypeName.c_str(),
              iters);
  std::printf("%-14s %-21s %-4s %-20s %10s %10s %8s %8s %7s\n", "layout", "M x N x K", "C", "plan", "ours ms", "blas ms",
              "ours", "blas", "ratio");
  for (const Row& r : rows) {
    const Case& c = r.c;
    const double flops = 2.0 * double(c.m) * double(c.n) * double(c.k);
    const Dims d = dimsOf(c);
    const double bytes = 2.0 * double(d.aRows * d.lda + d.bRows * d.ldb) +
                         double(c.m * c.n) * (c.out == GemmOut::kFp32 ? 4 : 2);
    char mnk[32];
    std::snprintf(mnk, sizeof mnk, "%lldx%lldx%lld", (long long)c.m, (long long)c.n, (long long)c.k);
    if (c.decode) {
      std::printf("%-14s %-21s %-4s %-20s %10.4f %10.4f %6.0fGB %6.0fGB %7.3f%s\n", layoutName(c.layout), mnk,
                  c.out == GemmOut::kFp32 ? "f32" : "in", r.plan.c_str(), r.ours, r.blas, bytes / (r.ours * 1e6),
                  bytes / (r.blas * 1e6), r.ours > 0 ? r.blas / r.ours : 0, r.ok ? "" : "  FAIL");
    } else {
      std::printf("%-14s %-21s %-4s %-20s %10.4f %10.4f %6.0fTF %6.0fTF %7.3f%s\n", layoutName(c.layout), mnk,
                  c.out == GemmOut::kFp32 ? "f32" : "in", r.plan.c_str(), r.ours, r.blas, flops / (r.ours * 1e9),
                  flops / (r.blas * 1e9), r.ours > 0 ? r.blas / r.ours : 0, r.ok ? "" : "  FAIL");
    }
  }
  std::printf("decode rows: GB/s of A + B + C once; copy ceiling %.0f GB/s\n", copyGBs);
  cudaFree(ourWs);
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
