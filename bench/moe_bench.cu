// The MoE ops' kernels (tandem/kernels/moe.hpp) at one rank on DeepSeek-V3's expert layer: hidden 7168, ffn 2048,
// top-8 over 32 experts; random routings of 256, 512, 1024 and 2048 rows per expert on average, and a skewed one (80%
// of the tokens pick expert 0). Times, with CUDA events (median of --iters, two input sets rotated):
//   dispatch+GEMM   launchMoe without the FFN, n_out 4096 (gemm1's shape): routing, dispatch and the grouped GEMM;
//   FFN             launchMoe with the FFN: routing, dispatch, gemm1 + SwiGLU, gemm2, combine;
//   GEMMs alone     tandem's grouped gemm1 (plain, and with SwiGLU) and gemm2 on the same groups, rows already
//                   permuted: the overlap limit the FFN is held to (its time over these two).
// One token per case is checked against a host reference (gemm rows and the whole FFN output row); every output is
// checked for non-finite values. Writes each routing (ids int32 [tokens, 8], weights fp32 [tokens, 8]) to --routing-dir
// for bench/moe_baseline.py (PyTorch on the same routings), and a JSON of its numbers to --json.
//
//   moe_bench [--iters N] [--routing-dir DIR] [--json FILE] [--cases all|small]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/moe.hpp"

namespace k = tandem::kernels;

namespace {

using tandem::bench::syncOrDie;

constexpr int kExperts = 32;
constexpr int64_t kHidden = 7168;
constexpr int64_t kFfn = 2048;
constexpr int kTopk = 8;
constexpr int kSets = 2;
constexpr int kWarm = 3;

float bf16ToFloat(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float roundBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

struct Routing {
  std::string name;
  int64_t tokens = 0;
  std::vector<int32_t> ids;     // [tokens, 8]
  std::vector<float> wts;       // [tokens, 8]
  std::vector<int32_t> counts;  // rows per expert
};

Routing makeRouting(const std::string& name, int64_t tokens, bool skew, uint64_t seed) {
  Routing r;
  r.name = name;
  r.tokens = tokens;
  r.ids.resize(static_cast<size_t>(tokens * kTopk));
  r.wts.resize(r.ids.size());
  r.counts.assign(kExperts, 0);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> chosen;
    if (skew && rng() % 10 < 8) chosen.push_back(0);
    while (chosen.size() < kTopk) {
      const auto e = static_cast<int32_t>(rng() % kExperts);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    float sum = 0;
    float w[kTopk];
    for (int j = 0; j < kTopk; ++j) sum += (w[j] = std::exp(u(rng)));
    for (int j = 0; j < kTopk; ++j) {
      r.ids[size_t(t * kTopk + j)] = chosen[size_t(j)];
      r.wts[size_t(t * kTopk + j)] = w[j] / sum;
      ++r.counts[size_t(chosen[size_t(j)])];
    }
  }
  return r;
}


// Median ms of iters calls of fn(i % kSets), each between its own pair of events, enqueued back to back.
template <class F>
double timeCalls(cudaStream_t s, int iters, F&& fn) {
  const int total = iters + kWarm;
  std::vector<cudaEvent_t> ev(size_t(2 * total));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < total; ++i) {
    CK(cudaEventRecord(ev[size_t(2 * i)], s));
    fn(i % kSets);
    CK(cudaEventRecord(ev[size_t(2 * i + 1)], s));
  }
  syncOrDie(s, 120, "timed calls");
  std::vector<double> ms;
  for (int i = kWarm; i < total; ++i) {
    float m = 0;
    CK(cudaEventElapsedTime(&m, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]));
    ms.push_back(m);
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double tflops(double flops, double ms) { return flops / (ms * 1e-3) / 1e12; }

std::vector<uint16_t> download16(const void* p, size_t n) {
  std::vector<uint16_t> v(n);
  CK(cudaMemcpy(v.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return v;
}

bool allFinite(const void* p, size_t n) {
  const std::vector<uint16_t> v = download16(p, n);
  for (uint16_t b : v) {
    if ((b & 0x7F80) == 0x7F80) return false;
  }
  return true;
}

struct Set {
  void* x = nullptr;
  int32_t* ids = nullptr;
  float* wts = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  std::string routingDir, jsonPath, which = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--routing-dir" && i + 1 < argc)
      routingDir = argv[++i];
    else if (a == "--json" && i + 1 < argc)
      jsonPath = argv[++i];
    else if (a == "--cases" && i + 1 < argc)
      which = argv[++i];
    else {
      std::fprintf(stderr, "usage: moe_bench [--iters N] [--routing-dir DIR] [--json FILE] [--cases all|small]\n");
      return 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("SKIPPED moe_bench: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; bf16, hidden %lld, ffn %lld, top-%d of %d experts, 1 rank\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(kHidden), static_cast<long long>(kFfn), kTopk, kExperts);

  std::vector<Routing> routings;
  std::vector<int> perExpert = which == "small" ? std::vector<int>{256} : std::vector<int>{256, 512, 1024, 2048};
  for (int rpe : perExpert) {
    routings.push_back(makeRouting("random" + std::to_string(rpe), int64_t(rpe) * kExperts / kTopk, false, 7 + rpe));
  }
  routings.push_back(makeRouting("skew512", 512 * kExperts / kTopk, true, 99));
  int64_t maxTokens = 0;
  for (const auto& r : routings) maxTokens = std::max(maxTokens, r.tokens);
  const int64_t maxRows = maxTokens * kTopk;

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *w1, *w2, *outG, *outF, *control, *recv, *scratch;
  int32_t *rowInfo, *counts, *offsets;
  CK(cudaMalloc(&w1, size_t(kExperts) * 2 * kFfn * kHidden * 2));
  CK(cudaMalloc(&w2, size_t(kExperts) * kHidden * kFfn * 2));
  Set sets[kSets];
  for (auto& st : sets) {
    CK(cudaMalloc(&st.x, size_t(maxTokens) * kHidden * 2));
    CK(cudaMalloc(&st.ids, size_t(maxRows) * 4));
    CK(cudaMalloc(&st.wts, size_t(maxRows) * 4));
  }
  CK(cudaMalloc(&outG, size_t(maxRows) * 2 * kFfn * 2));
  CK(cudaMalloc(&outF, size_t(maxTokens) * kHidden * 2));
  CK(cudaMalloc(&rowInfo, size_t(maxRows) * 16));
  CK(cudaMalloc(&counts, kExperts * 4));
  CK(cudaMalloc(&offsets, (kExperts + 1) * 4));
  CK(cudaMalloc(&control, k::kMoeControlBytes));
  CK(cudaMemset(control, 0, k::kMoeControlBytes));
  const uint64_t recvBytes = k::moeRecvBytes(maxRows, kHidden, kFfn);
  const uint64_t scratchBytes = k::moeScratchBytes(maxTokens, kTopk, kExperts);
  CK(cudaMalloc(&recv, recvBytes));
  CK(cudaMalloc(&scratch, scratchBytes));
  // Uniform in [-1, 1): activations grow with sqrt(k), which bf16's range takes; fine for timing and relative checks.
  tandem::bench::fillUniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w1), size_t(kExperts) * 2 * kFfn * kHidden, 11);
  tandem::bench::fillUniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w2), size_t(kExperts) * kHidden * kFfn, 12);
  for (int i = 0; i < kSets; ++i) {
    tandem::bench::fillUniform<<<1024, 256>>>(static_cast<__nv_bfloat16*>(sets[i].x), size_t(maxTokens) * kHidden,
                                              uint64_t(21 + i));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  k::MoeComm comm;
  comm.rank = 0;
  comm.nranks = 1;
  comm.control[0] = control;
  comm.recv[0] = recv;
  comm.recvBytes = recvBytes;
  comm.scratch = scratch;
  comm.scratchBytes = scratchBytes;
  comm.timeoutNs = 20'000'000'000ull;
  uint64_t epoch = 0;

  bool ok = true;
  std::string json = "{\"cases\": [";
  std::printf("\n%-10s %6s %7s  %-22s %9s %8s\n", "case", "tokens", "rows", "op", "ms", "TFLOP/s");
  for (size_t ci = 0; ci < routings.size(); ++ci) {
    const Routing& r = routings[ci];
    const int64_t rows = r.tokens * kTopk;
    for (int i = 0; i < kSets; ++i) {
      CK(cudaMemcpy(sets[i].ids, r.ids.data(), r.ids.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sets[i].wts, r.wts.data(), r.wts.size() * 4, cudaMemcpyHostToDevice));
    }
    if (!routingDir.empty()) {
      std::ofstream(routingDir + "/" + r.name + ".ids", std::ios::binary)
          .write(reinterpret_cast<const char*>(r.ids.data()), std::streamsize(r.ids.size() * 4));
      std::ofstream(routingDir + "/" + r.name + ".wts", std::ios::binary)
          .write(reinterpret_cast<const char*>(r.wts.data()), std::streamsize(r.wts.size() * 4));
    }
    std::vector<int32_t> offs(kExperts + 1, 0);
    for (int e = 0; e < kExperts; ++e) offs[size_t(e + 1)] = offs[size_t(e)] + r.counts[size_t(e)];
    CK(cudaMemcpy(offsets, offs.data(), offs.size() * 4, cudaMemcpyHostToDevice));

    const auto params = [&](int set, bool ffn, int skip) {
      k::MoeParams p;
      p.gemmSkipIdleHalves = skip;
      p.dtype = k::GemmDtype::kBf16;
      p.ffn = ffn;
      p.tokens = r.tokens;
      p.hidden = kHidden;
      p.nOut = 2 * kFfn;
      p.ffnDim = kFfn;
      p.experts = kExperts;
      p.topk = kTopk;
      p.capacity = rows;
      p.x = sets[set].x;
      p.topkIds = sets[set].ids;
      p.topkWeights = sets[set].wts;
      p.w = w1;
      p.w1 = w1;
      p.w2 = w2;
      p.out = ffn ? outF : outG;
      p.rowInfo = rowInfo;
      p.expertCounts = counts;
      return p;
    };
    std::string plan;
    const auto run = [&](int set, bool ffn, int skip = 0) {
      comm.epoch = ++epoch;
      plan = k::launchMoe(params(set, ffn, skip), comm, s);
    };
    const double g1Flops = 2.0 * double(rows) * kHidden * 2 * kFfn;
    const double g2Flops = 2.0 * double(rows) * kFfn * kHidden;

    // ---- correctness: token 0's rows of dispatch+GEMM and its FFN output, against the host
    run(0, false);
    syncOrDie(s, 60, "dispatch+GEMM");
    std::vector<int32_t> info(size_t(rows) * 4);
    CK(cudaMemcpy(info.data(), rowInfo, info.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<int32_t> gotCounts(kExperts);
    CK(cudaMemcpy(gotCounts.data(), counts, kExperts * 4, cudaMemcpyDeviceToHost));
    bool layoutOk = gotCounts == r.counts;
    for (int64_t i = 0, e = 0, seen = 0; i < rows && layoutOk; ++i) {  // expert order, then token order
      while (e < kExperts && seen == offs[size_t(e + 1)] - offs[size_t(e)]) {
        ++e;
        seen = 0;
      }
      const int32_t* ri = &info[size_t(i * 4)];
      layoutOk = ri[0] == 0 && ri[3] == e && r.ids[size_t(ri[1] * kTopk + ri[2])] == e &&
                 (seen == 0 || ri[1] > info[size_t((i - 1) * 4 + 1)]);
      ++seen;
    }
    const bool gFinite = allFinite(outG, size_t(rows) * 2 * kFfn);
    run(0, true);
    syncOrDie(s, 60, "FFN");
    const bool fFinite = allFinite(outF, size_t(r.tokens) * kHidden);
    const int64_t t0 = r.tokens / 2;  // a token away from the edges
    const std::vector<uint16_t> xt = download16(static_cast<char*>(sets[0].x) + t0 * kHidden * 2, kHidden);
    std::vector<double> yRef(kHidden, 0.0);
    double gErr = 0, gRef = 0;
    for (int j = 0; j < kTopk; ++j) {
      const int32_t e = r.ids[size_t(t0 * kTopk + j)];
      const std::vector<uint16_t> w1e =
          download16(static_cast<char*>(w1) + size_t(e) * 2 * kFfn * kHidden * 2, size_t(2 * kFfn * kHidden));
      const std::vector<uint16_t> w2e =
          download16(static_cast<char*>(w2) + size_t(e) * kHidden * kFfn * 2, size_t(kHidden * kFfn));
      std::vector<float> gu(size_t(2 * kFfn));
      for (int64_t c = 0; c < 2 * kFfn; ++c) {
        double acc = 0;
        for (int64_t kk = 0; kk < kHidden; ++kk)
          acc += double(bf16ToFloat(xt[size_t(kk)])) * bf16ToFloat(w1e[size_t(c * kHidden + kk)]);
        gu[size_t(c)] = float(acc);
      }
      // This pair's row of dispatch+GEMM.
      int64_t row = -1;
      for (int64_t i = 0; i < rows; ++i) {
        if (info[size_t(i * 4 + 1)] == t0 && info[size_t(i * 4 + 2)] == j) row = i;
      }
      if (row < 0) {
        layoutOk = false;
      } else {
        const std::vector<uint16_t> got = download16(static_cast<char*>(outG) + row * 2 * kFfn * 2, size_t(2 * kFfn));
        for (int64_t c = 0; c < 2 * kFfn; ++c) {
          const double d = double(bf16ToFloat(got[size_t(c)])) - gu[size_t(c)];
          gErr += d * d;
          gRef += double(gu[size_t(c)]) * gu[size_t(c)];
        }
      }
      std::vector<float> h(static_cast<size_t>(kFfn));
      for (int64_t f = 0; f < kFfn; ++f) {
        const float g = gu[size_t(f)], up = gu[size_t(kFfn + f)];
        h[size_t(f)] = roundBf16(g / (1.0f + std::exp(-g)) * up);
      }
      const double wt = r.wts[size_t(t0 * kTopk + j)];
      for (int64_t c = 0; c < kHidden; ++c) {
        double acc = 0;
        for (int64_t f = 0; f < kFfn; ++f) acc += double(h[size_t(f)]) * bf16ToFloat(w2e[size_t(c * kFfn + f)]);
        yRef[size_t(c)] += wt * acc;
      }
    }
    const std::vector<uint16_t> outRow = download16(static_cast<char*>(outF) + t0 * kHidden * 2, kHidden);
    double fErr = 0, fRef = 0;
    for (int64_t c = 0; c < kHidden; ++c) {
      const double d = double(bf16ToFloat(outRow[size_t(c)])) - yRef[size_t(c)];
      fErr += d * d;
      fRef += yRef[size_t(c)] * yRef[size_t(c)];
    }
    const double gRel = std::sqrt(gErr / std::max(gRef, 1e-30)), fRel = std::sqrt(fErr / std::max(fRef, 1e-30));
    const bool caseOk = layoutOk && gFinite && fFinite && gRel < 1e-2 && fRel < 2e-2;
    ok = ok && caseOk;
    std::printf("%s %s: layout %s, finite %s/%s, token %lld: gemm rel_err %.2e, ffn rel_err %.2e\n",
                caseOk ? "ok  " : "FAIL", r.name.c_str(), layoutOk ? "exact" : "WRONG", gFinite ? "yes" : "NO",
                fFinite ? "yes" : "NO", static_cast<long long>(t0), gRel, fRel);

    // ---- timing
    const double msGemm = timeCalls(s, iters, [&](int set) { run(set, false); });
    const std::string planGemm = plan;
    const double msFfn = timeCalls(s, iters, [&](int set) { run(set, true); });
    const std::string planFfn = plan;
    k::GroupedGemmParams g1{};
    g1.dtype = k::GemmDtype::kBf16;
    g1.groupOffsets = offsets;
    g1.numExperts = kExperts;
    g1.mTotal = rows;
    g1.k = kHidden;
    g1.n = 2 * kFfn;
    g1.w = w1;
    g1.x = recv;  // already permuted rows (whatever the last run left there)
    g1.out = outG;
    g1.epilogue = k::GroupedGemmEpilogue::kStore;
    const double msG1 = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g1, s); });
    k::GroupedGemmParams g1s = g1;
    g1s.epilogue = k::GroupedGemmEpilogue::kSwiGlu;
    g1s.out = outG;
    const double msG1s = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g1s, s); });
    k::GroupedGemmParams g2{};
    g2.dtype = k::GemmDtype::kBf16;
    g2.groupOffsets = offsets;
    g2.numExperts = kExperts;
    g2.mTotal = rows;
    g2.k = kFfn;
    g2.n = kHidden;
    g2.w = w2;
    g2.x = outG;  // h-shaped rows [rows, ffn] (values from the SwiGLU run)
    g2.out = static_cast<char*>(recv) + size_t(rows) * kHidden * 2 + 4096;  // past the x rows; never read back
    g2.out = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(g2.out) + 255) & ~uintptr_t{255});
    g2.epilogue = k::GroupedGemmEpilogue::kStore;
    const double msG2 = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g2, s); });
    // The same with skipIdleHalves (a warpgroup whose rows all lie past its group's end skips its wgmmas).
    k::GroupedGemmParams g1k = g1, g1sk = g1s, g2k = g2;
    g1k.skipIdleHalves = g1sk.skipIdleHalves = g2k.skipIdleHalves = 1;
    const double msG1k = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g1k, s); });
    const double msG1sk = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g1sk, s); });
    const double msG2k = timeCalls(s, iters, [&](int) { k::launchGroupedGemm(g2k, s); });
    const double msFfnK = timeCalls(s, iters, [&](int set) { run(set, true, 1); });
    run(0, true, 1);
    syncOrDie(s, 60, "FFN with skipIdleHalves");
    const std::vector<uint16_t> outRowK = download16(static_cast<char*>(outF) + t0 * kHidden * 2, kHidden);
    const bool skipSame = outRowK == outRow;
    const double twoGemms = msG1s + msG2;
    std::printf("%-10s %6lld %7lld  %-22s %9.4f %8.1f\n", r.name.c_str(), static_cast<long long>(r.tokens),
                static_cast<long long>(rows), "dispatch+GEMM", msGemm, tflops(g1Flops, msGemm));
    std::printf("%-10s %6s %7s  %-22s %9.4f %8.1f\n", "", "", "", "FFN (whole layer)", msFfn,
                tflops(g1Flops + g2Flops, msFfn));
    std::printf("%-10s %6s %7s  %-22s %9.4f %8.1f\n", "", "", "", "gemm1 alone", msG1, tflops(g1Flops, msG1));
    std::printf("%-10s %6s %7s  %-22s %9.4f %8.1f\n", "", "", "", "gemm1+SwiGLU alone", msG1s, tflops(g1Flops, msG1s));
    std::printf("%-10s %6s %7s  %-22s %9.4f %8.1f\n", "", "", "", "gemm2 alone", msG2, tflops(g2Flops, msG2));
    std::printf("%-10s %6s %7s  %-22s %9.3f  (the two GEMMs / the FFN; target >= 0.95)\n", "", "", "", "overlap ratio",
                twoGemms / msFfn);
    std::printf("%-10s %6s %7s  %-22s %9.4f %9.4f %9.4f %9.4f  (gemm1, gemm1+SwiGLU, gemm2, FFN; FFN row %s)\n", "", "",
                "", "skipIdleHalves", msG1k, msG1sk, msG2k, msFfnK, skipSame ? "bitwise the same" : "DIFFERS");
    ok = ok && skipSame;
    std::printf("  plans: %s | %s\n", planGemm.c_str(), planFfn.c_str());
    std::fflush(stdout);
    char buf[768];
    std::snprintf(
        buf, sizeof buf,
        "%s{\"case\": \"%s\", \"tokens\": %lld, \"rows\": %lld, \"dispatch_gemm_ms\": %.5f, \"ffn_ms\": %.5f, "
        "\"gemm1_ms\": %.5f, \"gemm1_swiglu_ms\": %.5f, \"gemm2_ms\": %.5f, \"gemm1_skip_ms\": %.5f, "
        "\"gemm1_swiglu_skip_ms\": %.5f, \"gemm2_skip_ms\": %.5f, \"ffn_skip_ms\": %.5f, \"ok\": %s}",
        ci == 0 ? "" : ", ", r.name.c_str(), static_cast<long long>(r.tokens), static_cast<long long>(rows), msGemm,
        msFfn, msG1, msG1s, msG2, msG1k, msG1sk, msG2k, msFfnK, caseOk && skipSame ? "true" : "false");
    json += buf;
  }
  json += "]}\n";
  if (!jsonPath.empty()) std::ofstream(jsonPath) << json;
  std::printf("%s\n", ok ? "ALL OK" : "SOME CHECKS FAILED");
  std::fflush(stdout);

  // ---- experiment, after everything above is written: the grouped GEMMs' dynamic tile order (tileCounter), alone
  // and with skipIdleHalves, on every routing; the FFN with both, checked bitwise against the default FFN.
  uint32_t* counter = nullptr;
  CK(cudaMalloc(&counter, 4));
  std::printf("\nexperiment: dynamic tile order (ms; +skip = with skipIdleHalves)\n");
  std::printf("%-10s %9s %9s %9s %9s %9s %9s %9s %9s  %s\n", "case", "g1", "g1 dyn", "g1s dyn", "g1s +skip", "g2 dyn",
              "g2 +skip", "FFN dyn", "FFN +skip", "FFN row");
  bool expOk = true;
  for (const Routing& r : routings) {
    const int64_t rows = r.tokens * kTopk;
    for (int i = 0; i < kSets; ++i) {
      CK(cudaMemcpy(sets[i].ids, r.ids.data(), r.ids.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sets[i].wts, r.wts.data(), r.wts.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<int32_t> offs(kExperts + 1, 0);
    for (int e = 0; e < kExperts; ++e) offs[size_t(e + 1)] = offs[size_t(e)] + r.counts[size_t(e)];
    CK(cudaMemcpy(offsets, offs.data(), offs.size() * 4, cudaMemcpyHostToDevice));
    const auto ffnParams = [&](int set, bool dyn, int skip) {
      k::MoeParams p;
      p.dtype = k::GemmDtype::kBf16;
      p.ffn = true;
      p.tokens = r.tokens;
      p.hidden = kHidden;
      p.ffnDim = kFfn;
      p.experts = kExperts;
      p.topk = kTopk;
      p.x = sets[set].x;
      p.topkIds = sets[set].ids;
      p.topkWeights = sets[set].wts;
      p.w1 = w1;
      p.w2 = w2;
      p.out = outF;
      p.gemmDynamicTiles = dyn;
      p.gemmSkipIdleHalves = skip;
      return p;
    };
    const auto ffn = [&](int set, bool dyn, int skip) {
      comm.epoch = ++epoch;
      k::launchMoe(ffnParams(set, dyn, skip), comm, s);
    };
    ffn(0, false, 0);
    syncOrDie(s, 30, "experiment: default FFN");
    const std::vector<uint16_t> want = download16(outF, size_t(r.tokens) * kHidden);
    const auto gemm = [&](const void* x, const void* w, void* out, int64_t n, int64_t kk, k::GroupedGemmEpilogue epi,
                          bool dyn, int skip) {
      k::GroupedGemmParams g{};
      g.dtype = k::GemmDtype::kBf16;
      g.groupOffsets = offsets;
      g.numExperts = kExperts;
      g.mTotal = rows;
      g.k = kk;
      g.n = n;
      g.w = w;
      g.x = x;
      g.out = out;
      g.epilogue = epi;
      g.skipIdleHalves = skip;
      if (dyn) {
        CK(cudaMemsetAsync(counter, 0, 4, s));
        g.tileCounter = counter;
      }
      k::launchGroupedGemm(g, s);
    };
    void* yOut = reinterpret_cast<void*>(
        (reinterpret_cast<uintptr_t>(static_cast<char*>(recv) + size_t(rows) * kHidden * 2) + 4096 + 255) &
        ~uintptr_t{255});
    using E = k::GroupedGemmEpilogue;
    const double g1 = timeCalls(s, iters, [&](int) { gemm(recv, w1, outG, 2 * kFfn, kHidden, E::kStore, false, 0); });
    const double g1d = timeCalls(s, iters, [&](int) { gemm(recv, w1, outG, 2 * kFfn, kHidden, E::kStore, true, 0); });
    const double g1sd = timeCalls(s, iters, [&](int) { gemm(recv, w1, outG, 2 * kFfn, kHidden, E::kSwiGlu, true, 0); });
    const double g1sdk =
        timeCalls(s, iters, [&](int) { gemm(recv, w1, outG, 2 * kFfn, kHidden, E::kSwiGlu, true, 1); });
    const double g2d = timeCalls(s, iters, [&](int) { gemm(outG, w2, yOut, kHidden, kFfn, E::kStore, true, 0); });
    const double g2dk = timeCalls(s, iters, [&](int) { gemm(outG, w2, yOut, kHidden, kFfn, E::kStore, true, 1); });
    const double fd = timeCalls(s, iters, [&](int set) { ffn(set, true, 0); });
    const double fdk = timeCalls(s, iters, [&](int set) { ffn(set, true, 1); });
    ffn(0, true, 1);
    syncOrDie(s, 30, "experiment: FFN, dynamic + skip");
    const bool same = download16(outF, size_t(r.tokens) * kHidden) == want;
    expOk = expOk && same;
    std::printf("%-10s %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f  %s\n", r.name.c_str(), g1, g1d, g1sd, g1sdk,
                g2d, g2dk, fd, fdk, same ? "bitwise the same" : "DIFFERS");
    std::fflush(stdout);
  }
  std::printf("experiment %s\n", expOk ? "OK" : "FAILED");
  return ok && expOk ? 0 : 1;
}
