// Grouped GEMM (tandem/kernels/grouped_gemm.hpp) on DeepSeek-V3's expert shapes, one H200: correctness of sampled
// groups against an fp32 reference, then timing (CUDA events, median, two input sets rotated so L2 does not flatter).
// Its PyTorch baseline (torch._grouped_mm on the same group sizes) is bench/grouped_mm_baseline.py.
//
//   grouped_gemm_bench [--iters N] [--counts FILE] [--sweep] [--dtype bf16|fp16] [--decode]
//
// Shapes: 32 experts, hidden 7168, ffn 2048. GEMM1 x [M, 7168] · w1 [32, 4096, 7168]ᵀ (plain store, and with the
// SwiGLU epilogue writing h [M, 2048]); GEMM2 h [M, 2048] · w2 [32, 7168, 2048]ᵀ (plain, and scaled per row).
// Groups: 256 / 512 / 1024 / 2048 rows on every expert, and "skew" (16384 rows, 80% on expert 0). --counts adds
// cases from a file of lines "name c0 c1 ... c31" (e.g. the random routing the baseline script drew).
// TFLOP/s count 2 * rows * n * k (n = 4096 for GEMM1 with or without SwiGLU). Exits 1 on any correctness failure.
//
// --decode: instead, decode routings: 1, 8, 32 and 128 tokens, each routed to 8 distinct experts of 32 (seeded), so
// a few rows per expert. Every expert that has rows is checked, and each op is timed on the path the plan rule picks
// (maxGroupRows = tokens: swap-AB) and on the tiled path. The figure of merit is memory: the routed experts' weights
// read once, in GB/s and as a multiple of the time a device-to-device copy (bytes read + written, measured in this
// run) takes to move them (target <= 1.3x). "ffn" sums gemm1+swiglu and gemm2+scale, the expert half of moe_ffn.
// torch._grouped_mm on the same shapes: grouped_mm_baseline.py --decode.
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
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"
#include "ref_gemm.cuh"
#include "tandem/kernels/grouped_gemm.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GroupedGemmEpilogue;
using tandem::kernels::GroupedGemmPath;
using tandem::kernels::GroupedGemmParams;
using tandem::kernels::launchGroupedGemm;

namespace {

constexpr int kExperts = 32;
constexpr int64_t kHidden = 7168;
constexpr int64_t kFfn = 2048;
constexpr int kSets = 2;


using tandem::bench::fillUniform;
using tandem::bench::syncOrDie;
using tandem::bench::refGemm;
using tandem::bench::relErrorKernel;
using tandem::bench::toFloat;

// gu [rows, 2f] (gate | up, fp32) -> h [rows, f] = silu(gate) * up.
__global__ void swigluRefCopy(const float* gu, float* h, int64_t rows, int64_t f) {
  const int64_t total = rows * f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = gu[r * 2 * f + c], u = gu[r * 2 * f + f + c];
    h[i] = g / (1.0f + expf(-g)) * u;
  }
}
__global__ void scaleRowsRef(float* ref, int64_t rows, int64_t n, const float* scale) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    ref[i] *= scale[i / n];
  }
}
__global__ void fillScale(float* s, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = tandem::bench::mix(uint64_t(i) * 0x9E3779B97F4A7C15ULL + seed);
    s[i] = 0.05f + 0.9f * static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
  }
}

struct Case {
  std::string name;
  std::vector<int32_t> counts;
  int64_t maxGroupRows = 0;  // GroupedGemmParams::maxGroupRows: the decode cases' tokens
  bool checkAll = false;     // check every group that has rows (decode), not only groups 0, 16 and 31
  int64_t activeExperts() const {
    int64_t a = 0;
    for (int32_t c : counts) a += c > 0 ? 1 : 0;
    return a;
  }
  int64_t rows() const {
    int64_t m = 0;
    for (int32_t c : counts) m += c;
    return m;
  }
};

std::vector<Case> builtinCases() {
  std::vector<Case> cases;
  for (int r : {256, 512, 1024, 2048}) cases.push_back({"equal" + std::to_string(r), std::vector<int32_t>(kExperts, r)});
  // 16384 rows, 80% on expert 0; all counts multiples of 16 (13104 + 19 x 112 + 12 x 96), as in the baseline script.
  Case skew{"skew", std::vector<int32_t>(kExperts, 96)};
  skew.counts[0] = 13104;
  for (int e = 1; e <= 19; ++e) skew.counts[size_t(e)] = 112;
  cases.push_back(skew);
  return cases;
}

std::vector<Case> readCases(const std::string& path) {
  std::vector<Case> cases;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cannot read --counts %s\n", path.c_str());
    std::exit(2);
  }
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    Case c;
    if (!(ls >> c.name)) continue;
    int32_t v;
    while (ls >> v) c.counts.push_back(v);
    if (c.counts.size() != size_t(kExperts)) {
      std::fprintf(stderr, "--counts %s: line '%s' has %zu counts, want %d\n", path.c_str(), c.name.c_str(),
                   c.counts.size(), kExperts);
      std::exit(2);
    }
    cases.push_back(c);
  }
  return cases;
}

enum class Op { kG1Store, kG1SwiGlu, kG2Store, kG2Scaled };
const char* opName(Op op) {
  switch (op) {
    case Op::kG1Store: return "gemm1";
    case Op::kG1SwiGlu: return "gemm1+swiglu";
    case Op::kG2Store: return "gemm2";
    case Op::kG2Scaled: return "gemm2+scale";
  }
  return "?";
}
bool isG1(Op op) { return op == Op::kG1Store || op == Op::kG1SwiGlu; }

struct Buffers {
  int64_t maxRows = 0;
  void* x[kSets];   // [maxRows, hidden]
  void* w1[kSets];  // [E, 2 ffn, hidden]
  void* h[kSets];   // [maxRows, ffn] (gemm2's input)
  void* w2[kSets];  // [E, hidden, ffn]
  void* out1;       // [maxRows, 2 ffn] (gemm1's output; h [maxRows, ffn] with SwiGLU)
  void* out2;       // [maxRows, hidden]
  float* scale;     // [maxRows]
  int32_t* offsets[kSets];
  float* ref;       // [maxRows, 2 ffn] or [maxRows, hidden] fp32, one group at a time
  float* refH;      // [maxRows, ffn]
  double* sums;
  unsigned long long* bad;
};

template <class T>
Buffers allocate(int64_t maxRows, cudaStream_t s) {
  Buffers b{};
  b.maxRows = maxRows;
  const size_t nx = size_t(maxRows) * kHidden, nw1 = size_t(kExperts) * 2 * kFfn * kHidden;
  const size_t nh = size_t(maxRows) * kFfn, nw2 = size_t(kExperts) * kHidden * kFfn;
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMalloc(&b.x[i], nx * 2));
    CK(cudaMalloc(&b.w1[i], nw1 * 2));
    CK(cudaMalloc(&b.h[i], nh * 2));
    CK(cudaMalloc(&b.w2[i], nw2 * 2));
    CK(cudaMalloc(&b.offsets[i], (kExperts + 1) * sizeof(int32_t)));
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.x[i]), nx, 100 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.w1[i]), nw1, 101 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.h[i]), nh, 102 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.w2[i]), nw2, 103 + 10 * i);
    CK(cudaGetLastError());
  }
  CK(cudaMalloc(&b.out1, size_t(maxRows) * 2 * kFfn * 2));
  CK(cudaMalloc(&b.out2, size_t(maxRows) * kHidden * 2));
  CK(cudaMalloc(&b.scale, size_t(maxRows) * sizeof(float)));
  fillScale<<<1024, 256, 0, s>>>(b.scale, maxRows, 7);
  CK(cudaGetLastError());
  CK(cudaMalloc(&b.ref, size_t(maxRows) * std::max(2 * kFfn, kHidden) * sizeof(float)));
  CK(cudaMalloc(&b.refH, size_t(maxRows) * kFfn * sizeof(float)));
  CK(cudaMalloc(&b.sums, 2 * sizeof(double)));
  CK(cudaMalloc(&b.bad, sizeof(unsigned long long)));
  syncOrDie(s, 120, "fill");
  return b;
}

struct OpShape {
  int64_t n, k, nOut;
};
OpShape shapeOf(Op op) {
  switch (op) {
    case Op::kG1Store: return {2 * kFfn, kHidden, 2 * kFfn};
    case Op::kG1SwiGlu: return {2 * kFfn, kHidden, kFfn};
    default: return {kHidden, kFfn, kHidden};
  }
}

GroupedGemmParams paramsOf(Op op, const Buffers& b, int set, const Case& c, GemmDtype dt, int32_t groupM,
                           GroupedGemmPath path = GroupedGemmPath::kAuto) {
  const OpShape sh = shapeOf(op);
  const int64_t rows = c.rows();
  GroupedGemmParams p{};
  p.x = isG1(op) ? b.x[set] : b.h[set];
  p.w = isG1(op) ? b.w1[set] : b.w2[set];
  p.out = isG1(op) ? b.out1 : b.out2;
  p.groupOffsets = b.offsets[set];
  p.rowScale = op == Op::kG2Scaled ? b.scale : nullptr;
  p.mTotal = rows;
  p.n = sh.n;
  p.k = sh.k;
  p.numExperts = kExperts;
  p.dtype = dt;
  p.epilogue = op == Op::kG1SwiGlu ? GroupedGemmEpilogue::kSwiGlu : GroupedGemmEpilogue::kStore;
  p.groupM = groupM;
  p.maxGroupRows = c.maxGroupRows;
  p.path = path;
  return p;
}

bool gFailed = false;

// Checks groups 0, E/2 and E-1 (those that have rows) of set 0 against the fp32 reference.
template <class T>
void check(Op op, const Case& c, const Buffers& b, GemmDtype dt, cudaStream_t s) {
  const OpShape sh = shapeOf(op);
  const int64_t rows = c.rows();
  CK(cudaMemsetAsync(isG1(op) ? b.out1 : b.out2, 0xFF, size_t(rows) * sh.nOut * 2, s));  // NaN poison
  try {
    launchGroupedGemm(paramsOf(op, b, 0, c, dt, 0), s);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-8s %-13s launch threw: %s\n", c.name.c_str(), opName(op), e.what());
    gFailed = true;
    return;
  }
  CK(cudaGetLastError());
  syncOrDie(s, 60, std::string("grouped gemm ") + opName(op));
  std::vector<int32_t> off(1, 0);
  for (int32_t n : c.counts) off.push_back(off.back() + n);
  double worst = 0;
  unsigned long long badTotal = 0;
  std::vector<int> groups = {0, kExperts / 2, kExperts - 1};
  if (c.checkAll) {
    groups.clear();
    for (int e = 0; e < kExperts; ++e) groups.push_back(e);
  }
  for (int e : groups) {
    const int64_t r0 = off[size_t(e)], nr = c.counts[size_t(e)];
    if (nr == 0) continue;
    const T* a = static_cast<const T*>(isG1(op) ? b.x[0] : b.h[0]) + r0 * sh.k;
    const T* w = static_cast<const T*>(isG1(op) ? b.w1[0] : b.w2[0]) + int64_t(e) * sh.n * sh.k;
    dim3 grid(unsigned((sh.n + 63) / 64), unsigned((nr + 63) / 64));
    refGemm<T><<<grid, dim3(16, 16), 0, s>>>(a, w, b.ref, int(nr), int(sh.n), int(sh.k), sh.k, sh.k, 0);
    CK(cudaGetLastError());
    const float* want = b.ref;
    if (op == Op::kG1SwiGlu) {
      swigluRefCopy<<<2048, 256, 0, s>>>(b.ref, b.refH, nr, kFfn);
      want = b.refH;
    } else if (op == Op::kG2Scaled) {
      scaleRowsRef<<<2048, 256, 0, s>>>(b.ref, nr, sh.n, b.scale + r0);
    }
    CK(cudaGetLastError());
    CK(cudaMemsetAsync(b.sums, 0, 2 * sizeof(double), s));
    CK(cudaMemsetAsync(b.bad, 0, sizeof(unsigned long long), s));
    const T* out = static_cast<const T*>(isG1(op) ? b.out1 : b.out2) + r0 * sh.nOut;
    relErrorKernel<T, float><<<1024, 256, 0, s>>>(out, sh.nOut, want, nr, sh.nOut, b.sums, b.bad);
    CK(cudaGetLastError());
    double h[2];
    unsigned long long nb = 0;
    CK(cudaMemcpyAsync(h, b.sums, sizeof(h), cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(&nb, b.bad, sizeof(nb), cudaMemcpyDeviceToHost, s));
    syncOrDie(s, 120, "reference check");
    worst = std::max(worst, std::sqrt(h[0] / std::max(h[1], 1e-300)));
    badTotal += nb;
  }
  const bool ok = badTotal == 0 && std::isfinite(worst) && worst < 1e-2;
  std::printf("  %s %-8s %-13s rel_err %.3e non-finite %llu\n", ok ? "ok  " : "FAIL", c.name.c_str(), opName(op), worst,
              badTotal);
  if (!ok) gFailed = true;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median ms of `iters` launches, alternating the two input sets. All are enqueued back to back (each between its own
// pair of events) and synchronised once, so the host's launch cost stays out of the numbers.
double timeOp(Op op, const Case& c, const Buffers& b, GemmDtype dt, int iters, int32_t groupM, cudaStream_t s,
              GroupedGemmPath path = GroupedGemmPath::kAuto) {
  constexpr int kWarm = 3;
  std::vector<cudaEvent_t> ev(2 * size_t(iters + kWarm));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int it = 0; it < iters + kWarm; ++it) {
    const GroupedGemmParams p = paramsOf(op, b, it % kSets, c, dt, groupM, path);
    CK(cudaEventRecord(ev[2 * size_t(it)], s));
    launchGroupedGemm(p, s);
    CK(cudaEventRecord(ev[2 * size_t(it) + 1], s));
  }
  syncOrDie(s, 60, "timing");
  std::vector<float> ms;
  for (int it = kWarm; it < iters + kWarm; ++it) {
    float t = 0;
    CK(cudaEventElapsedTime(&t, ev[2 * size_t(it)], ev[2 * size_t(it) + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  return median(ms);
}

double tflops(Op op, int64_t rows, double ms) {
  const OpShape sh = shapeOf(op);
  return 2.0 * double(rows) * double(sh.n) * double(sh.k) / (ms * 1e-3) / 1e12;
}

template <class T>
int run(GemmDtype dt, int iters, const std::vector<Case>& cases, bool sweep) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int64_t maxRows = 0;
  for (const Case& c : cases) maxRows = std::max(maxRows, c.rows());
  Buffers b = allocate<T>(maxRows, s);
  const Op ops[] = {Op::kG1Store, Op::kG1SwiGlu, Op::kG2Store, Op::kG2Scaled};

  std::printf("correctness (groups 0, 16, 31 of each case vs fp32 reference):\n");
  for (const Case& c : cases) {
    std::vector<int32_t> off(1, 0);
    for (int32_t n : c.counts) off.push_back(off.back() + n);
    for (int i = 0; i < kSets; ++i) {
      CK(cudaMemcpyAsync(b.offsets[i], off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    }
    for (Op op : ops) check<T>(op, c, b, dt, s);
  }

  std::printf("\ntiming (median of %d, 2 rotated input sets; TFLOP/s = 2 rows n k / t):\n", iters);
  std::printf("%-10s %7s  %-13s %9s %9s\n", "case", "rows", "op", "ms", "TFLOP/s");
  for (const Case& c : cases) {
    std::vector<int32_t> off(1, 0);
    for (int32_t n : c.counts) off.push_back(off.back() + n);
    for (int i = 0; i < kSets; ++i) {
      CK(cudaMemcpyAsync(b.offsets[i], off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    }
    for (Op op : ops) {
      const double ms = timeOp(op, c, b, dt, iters, 0, s);
      std::printf("%-10s %7lld  %-13s %9.4f %9.1f\n", c.name.c_str(), static_cast<long long>(c.rows()), opName(op), ms,
                  tflops(op, c.rows(), ms));
      std::fflush(stdout);
    }
    if (sweep) {
      for (int32_t gm : {2, 4, 8, 32}) {
        for (Op op : {Op::kG1Store, Op::kG2Store}) {
          const double ms = timeOp(op, c, b, dt, iters, gm, s);
          std::printf("%-10s %7lld  %-13s %9.4f %9.1f  (groupM %d)\n", c.name.c_str(),
                      static_cast<long long>(c.rows()), opName(op), ms, tflops(op, c.rows(), ms), gm);
        }
      }
    }
  }
  CK(cudaStreamDestroy(s));
  return gFailed ? 1 : 0;
}

// ---- decode mode ------------------------------------------------------------------------------------------------

constexpr int kTopK = 8;

// `tokens` tokens, each routed to kTopK distinct experts drawn uniformly (seeded by the token count).
Case decodeCase(int tokens) {
  std::mt19937_64 rng(1000 + uint64_t(tokens));
  Case c{"tok" + std::to_string(tokens), std::vector<int32_t>(kExperts, 0)};
  std::vector<int> ids(kExperts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < kExperts; ++e) ids[size_t(e)] = e;
    for (int i = 0; i < kTopK; ++i) {  // partial Fisher-Yates: the first kTopK of a random permutation
      const int j = i + int(rng() % uint64_t(kExperts - i));
      std::swap(ids[size_t(i)], ids[size_t(j)]);
      ++c.counts[size_t(ids[size_t(i)])];
    }
  }
  c.maxGroupRows = tokens;  // a token's experts are distinct: no expert gets more than `tokens` rows
  c.checkAll = true;
  return c;
}

// Device-to-device copy bandwidth (bytes read + written per second), the ceiling of a weight-streaming GEMM.
double copyBandwidthGBs(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemsetAsync(src, 1, bytes, s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t(10);
  for (int i = 0; i < 12; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e1, s));
    syncOrDie(s, 30, "copy");
    if (i >= 2) CK(cudaEventElapsedTime(&t[size_t(i - 2)], e0, e1));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * double(bytes) / (median(t) * 1e-3) / 1e9;
}

// Bytes of the routed experts' weights for `op`, each read once.
double weightBytes(Op op, const Case& c) {
  const OpShape sh = shapeOf(op);
  return double(c.activeExperts()) * double(sh.n) * double(sh.k) * 2.0;
}

template <class T>
int runDecode(GemmDtype dt, int iters) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copyGBs = copyBandwidthGBs(s);
  std::vector<Case> cases;
  for (int tokens : {1, 8, 32, 128}) cases.push_back(decodeCase(tokens));
  int64_t maxRows = 0;
  for (const Case& c : cases) maxRows = std::max(maxRows, c.rows());
  Buffers b = allocate<T>(maxRows, s);
  const Op ops[] = {Op::kG1Store, Op::kG1SwiGlu, Op::kG2Store, Op::kG2Scaled};
  const auto upload = [&](const Case& c) {
    std::vector<int32_t> off(1, 0);
    for (int32_t n : c.counts) off.push_back(off.back() + n);
    for (int i = 0; i < kSets; ++i) {
      CK(cudaMemcpyAsync(b.offsets[i], off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    }
  };

  std::printf("device-to-device copy %.0f GB/s (read + write)\n", copyGBs);
  std::printf("correctness (every expert with rows vs fp32 reference, the plan's path):\n");
  for (const Case& c : cases) {
    upload(c);
    for (Op op : ops) check<T>(op, c, b, dt, s);
  }

  std::printf("\ntiming (median of %d, 2 rotated input sets). weights: the routed experts' weights once; x copy: that "
              "time over the time a copy moves those bytes (target <= 1.3)\n", iters);
  std::printf("%-6s %5s %7s  %-13s %-11s %9s %9s %9s %8s %7s\n", "case", "rows", "experts", "op", "plan", "ms",
              "tiled ms", "weight MB", "GB/s", "x copy");
  for (const Case& c : cases) {
    upload(c);
    double ffnMs = 0, ffnBytes = 0;
    int maxCount = 0;
    for (int32_t n : c.counts) maxCount = std::max(maxCount, int(n));
    for (Op op : ops) {
      const GroupedGemmParams p = paramsOf(op, b, 0, c, dt, 0);
      const std::string plan = tandem::kernels::groupedGemmPlanName(
          tandem::kernels::groupedGemmPlanFor(p.mTotal, p.maxGroupRows, p.path));
      const double ms = timeOp(op, c, b, dt, iters, 0, s);
      const double tiledMs = timeOp(op, c, b, dt, iters, 0, s, GroupedGemmPath::kTiled);
      const double bytes = weightBytes(op, c);
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("%-6s %5lld %7lld  %-13s %-11s %9.4f %9.4f %9.1f %8.0f %7.2f\n", c.name.c_str(),
                  static_cast<long long>(c.rows()), static_cast<long long>(c.activeExperts()), opName(op),
                  plan.c_str(), ms, tiledMs, bytes / 1e6, gbs, copyGBs / gbs);
      if (op == Op::kG1SwiGlu || op == Op::kG2Scaled) {
        ffnMs += ms;
        ffnBytes += bytes;
      }
      std::fflush(stdout);
    }
    const double ffnGBs = ffnBytes / (ffnMs * 1e-3) / 1e9;
    std::printf("%-6s %5lld %7lld  %-13s %-11s %9.4f %9s %9.1f %8.0f %7.2f  (largest group %d rows)\n",
                c.name.c_str(), static_cast<long long>(c.rows()), static_cast<long long>(c.activeExperts()), "ffn",
                "", ffnMs, "", ffnBytes / 1e6, ffnGBs, copyGBs / ffnGBs, maxCount);
  }
  CK(cudaStreamDestroy(s));
  return gFailed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  bool sweep = false;
  bool decode = false;
  GemmDtype dt = GemmDtype::kBf16;
  std::vector<Case> cases = builtinCases();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--counts" && i + 1 < argc) {
      for (const Case& c : readCases(argv[++i])) cases.push_back(c);
    } else if (a == "--sweep") {
      sweep = true;
    } else if (a == "--decode") {
      decode = true;
    } else if (a == "--dtype" && i + 1 < argc) {
      const std::string d = argv[++i];
      dt = d == "fp16" ? GemmDtype::kFp16 : GemmDtype::kBf16;
    } else {
      std::fprintf(stderr,
                   "usage: grouped_gemm_bench [--iters N] [--counts FILE] [--sweep] [--dtype bf16|fp16] [--decode]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; dtype %s\n", prop.name, prop.multiProcessorCount,
              dt == GemmDtype::kBf16 ? "bf16" : "fp16");
  try {
    int rc = 0;
    if (decode) {
      rc = dt == GemmDtype::kBf16 ? runDecode<__nv_bfloat16>(dt, iters) : runDecode<__half>(dt, iters);
    } else {
      rc = dt == GemmDtype::kBf16 ? run<__nv_bfloat16>(dt, iters, cases, sweep) : run<__half>(dt, iters, cases, sweep);
    }
    std::printf("%s\n", rc == 0 ? "ALL OK" : "SOME CHECKS FAILED");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 2;
  }
}
