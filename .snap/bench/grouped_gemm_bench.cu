// Grouped GEMM (tandem/kernels/grouped_gemm.hpp) on MoE expert shapes, one GPU: correctness of sampled groups
// against an fp32 reference, then timing (CUDA events, median, two input sets rotated so L2 does not flatter).
// Its PyTorch baseline (torch._grouped_mm on the same group sizes and the same math) is bench/grouped_mm_baseline.py.
//
//   grouped_gemm_bench [--iters N] [--counts FILE] [--sweep] [--dtype bf16|fp16|fp8] [--ops fwd|dgrad|wgrad|all]
//                      [--torch FILE] [--decode]
//
// fwd (DeepSeek-V3: 32 experts, hidden 7168, ffn 2048; layout kABt): gemm1 x [M, 7168] · w1 [32, 4096, 7168]ᵀ (plain
// store, and with the SwiGLU epilogue writing h [M, 2048]); gemm2 h [M, 2048] · w2 [32, 7168, 2048]ᵀ (plain, and
// scaled per row). Groups: 256 / 512 / 1024 / 2048 rows on every expert, and "skew" (16384 rows, 80% on expert 0).
// --counts adds cases from a file of lines "name c0 c1 ... c31" (e.g. the random routing the baseline script drew).
// dgrad (layout kAB, the backward's data gradients through the forward's own weights, w [E, k, n] as stored):
// dgrad-h dy [M, hidden] · w2[e] [hidden, ffn] -> [M, ffn]; dgrad-x d(gate|up) [M, 2 ffn] · w1[e] [2 ffn, hidden] ->
// [M, hidden]; DeepSeek-V3 and Mixtral 8x7B (8 experts, hidden 4096, ffn 14336), 256 / 512 / 1024 / 2048 / 4096 rows
// on every expert.
// wgrad (tandem/kernels/grouped_gemm_wgrad.hpp, the backward's weight gradients, out[e] = a_eᵀ · b_e over the group's
// rows): dw2 [E, hidden, ffn] = dyᵀ · h; dw1 [E, 2 ffn, hidden] = d(gate|up)ᵀ · x; same models and rows per expert as
// dgrad. TFLOP/s count 2 * rows * m * n.
// --torch FILE reads the baseline script's --ms-out lines "model case op ms" and adds torch's ms and the ratio
// torch ms / tandem ms (above 1: tandem is faster) for the ops both ran.
// TFLOP/s count 2 * rows * n * k (n = 4096 for gemm1 with or without SwiGLU). Exits 1 on any correctness failure.
//
// --decode: instead, decode routings: 1, 8, 32 and 128 tokens, each routed to 8 distinct experts of 32 (seeded), so
// a few rows per expert. Every expert that has rows is checked, and each op is timed on the path the plan rule picks
// (maxGroupRows = tokens: swap-AB) and on the tiled path. The figure of merit is memory: the routed experts' weights
// read once, in GB/s and as a multiple of the time a device-to-device copy (bytes read + written, measured in this
// run) takes to move them (target <= 1.3x). "ffn" sums gemm1+swiglu and gemm2+scale, the expert half of moe_ffn.
// torch._grouped_mm on the same shapes: grouped_mm_baseline.py --decode.
//
// --dtype fp8: instead, the FP8 grouped GEMM (tandem/kernels/grouped_gemm_fp8.hpp; e4m3, x and h scaled per 1 x 128,
// w per 128 x 128) on the forward ops gemm1, gemm1+swiglu (h quantised to e4m3 with its scales), gemm2 and
// gemm2+scale, DeepSeek-V3 and Mixtral at 256 / 512 / 1024 / 2048 / 4096 rows on every expert: sampled groups checked
// against an fp32 GEMM of the dequantized inputs, then each op timed beside the bf16 grouped GEMM of the same shape in
// this process ("x bf16" = bf16 ms / fp8 ms) and, with --torch, torch._scaled_grouped_mm's ms (rowwise scales) from
// grouped_mm_baseline.py --fp8 --ms-out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checks.hpp"
#include "ref_gemm.cuh"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/grouped_gemm_fp8.hpp"
#include "tandem/kernels/grouped_gemm_wgrad.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GemmLayout;
using tandem::kernels::GroupedFp8WeightScaling;
using tandem::kernels::GroupedGemmEpilogue;
using tandem::kernels::GroupedGemmFp8Params;
using tandem::kernels::GroupedGemmPath;
using tandem::kernels::GroupedGemmParams;
using tandem::kernels::GroupedWgradParams;
using tandem::kernels::launchGroupedGemm;
using tandem::kernels::launchGroupedGemmFp8;
using tandem::kernels::launchGroupedWgrad;

namespace {

constexpr int kSets = 2;

using tandem::bench::fillUniform;
using tandem::bench::copyBandwidthGBs;
using tandem::bench::syncOrDie;
using tandem::bench::refGemmStrided;
using tandem::bench::relErrorKernel;
using tandem::bench::toFloat;

struct Model {
  const char* name;
  int experts;
  int64_t hidden, ffn;
};
constexpr Model kDeepSeekV3{"dsv3", 32, 7168, 2048};
constexpr Model kMixtral{"mixtral", 8, 4096, 14336};

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
  int32_t maxGroup() const { return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end()); }
};

std::vector<Case> equalCases(const Model& m, std::initializer_list<int> rowsPerExpert) {
  std::vector<Case> cases;
  for (int r : rowsPerExpert) {
    cases.push_back({"equal" + std::to_string(r), std::vector<int32_t>(size_t(m.experts), r)});
  }
  return cases;
}

std::vector<Case> forwardCases() {
  std::vector<Case> cases = equalCases(kDeepSeekV3, {256, 512, 1024, 2048});
  // 16384 rows, 80% on expert 0; all counts multiples of 16 (13104 + 19 x 112 + 12 x 96), as in the baseline script.
  Case skew{"skew", std::vector<int32_t>(size_t(kDeepSeekV3.experts), 96)};
  skew.counts[0] = 13104;
  for (int e = 1; e <= 19; ++e) skew.counts[size_t(e)] = 112;
  cases.push_back(skew);
  return cases;
}

std::vector<Case> readCases(const std::string& path, int experts) {
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
    if (c.counts.size() != size_t(experts)) {
      std::fprintf(stderr, "--counts %s: line '%s' has %zu counts, want %d\n", path.c_str(), c.name.c_str(),
                   c.counts.size(), experts);
      std::exit(2);
    }
    cases.push_back(c);
  }
  return cases;
}

// torch._grouped_mm's median ms per (model, case, op), from grouped_mm_baseline.py --ms-out.
struct TorchTimes {
  std::vector<std::pair<std::string, double>> entries;  // "model case op" -> ms
  static TorchTimes read(const std::string& path) {
    TorchTimes t;
    std::ifstream in(path);
    if (!in) {
      std::fprintf(stderr, "cannot read --torch %s\n", path.c_str());
      std::exit(2);
    }
    std::string model, name, op;
    double ms = 0;
    while (in >> model >> name >> op >> ms) t.entries.emplace_back(model + " " + name + " " + op, ms);
    return t;
  }
  double find(const std::string& model, const std::string& name, const std::string& op) const {
    const std::string key = model + " " + name + " " + op;
    for (const auto& [k, ms] : entries) {
      if (k == key) return ms;
    }
    return 0.0;
  }
};

enum class Op { kG1Store, kG1SwiGlu, kG2Store, kG2Scaled, kDgradH, kDgradX, kWgradW2, kWgradW1 };
bool isWgrad(Op op) { return op == Op::kWgradW2 || op == Op::kWgradW1; }
const char* opName(Op op) {
  switch (op) {
    case Op::kG1Store: return "gemm1";
    case Op::kG1SwiGlu: return "gemm1+swiglu";
    case Op::kG2Store: return "gemm2";
    case Op::kG2Scaled: return "gemm2+scale";
    case Op::kDgradH: return "dgrad-h";
    case Op::kDgradX: return "dgrad-x";
    case Op::kWgradW2: return "dw2";
    case Op::kWgradW1: return "dw1";
  }
  return "?";
}

// The buffers of one model. x doubles as dgrad-h's dy [rows, hidden]; gu is dgrad-x's d(gate|up) [rows, 2 ffn].
// w1 [E, 2 ffn, hidden] and w2 [E, hidden, ffn] are read as [E, n, k] by gemm1/gemm2 and as [E, k, n] by the dgrads.
struct Buffers {
  Model model{};
  int64_t maxRows = 0;
  void* x[kSets];   // [maxRows, hidden]
  void* h[kSets];   // [maxRows, ffn] (gemm2's input)
  void* gu[kSets];  // [maxRows, 2 ffn] (dgrad-x's input)
  void* w1[kSets];  // [E, 2 ffn, hidden]
  void* w2[kSets];  // [E, hidden, ffn]
  void* out1;       // [maxRows, 2 ffn]: gemm1's output (h [maxRows, ffn] with SwiGLU), dgrad-h's [maxRows, ffn]
  void* out2;       // [maxRows, hidden]: gemm2's and dgrad-x's output
  float* scale;     // [maxRows]
  void* dw;         // wgrad sections only: [E, 2 ffn, hidden], dw2's [E, hidden, ffn] and dw1's out
  float* refW;      // wgrad sections only: fp32 reference of one expert's gradient [2 ffn, hidden]
  int32_t* offsets[kSets];
  float* ref;       // fp32 reference of one group: [maxGroup, max(2 ffn, hidden)]
  float* refH;      // [maxGroup, ffn]
  double* sums;
  unsigned long long* bad;
};

// wgrad ops: out[e] is [k, n] (k = a's columns, the grouped rows are the sum's index), so 2 rows n k still counts
// the flops.
struct OpShape {
  int64_t n, k, nOut;
  GemmLayout layout;
};
OpShape shapeOf(Op op, const Model& m) {
  switch (op) {
    case Op::kG1Store: return {2 * m.ffn, m.hidden, 2 * m.ffn, GemmLayout::kABt};
    case Op::kG1SwiGlu: return {2 * m.ffn, m.hidden, m.ffn, GemmLayout::kABt};
    case Op::kG2Store:
    case Op::kG2Scaled: return {m.hidden, m.ffn, m.hidden, GemmLayout::kABt};
    case Op::kDgradH: return {m.ffn, m.hidden, m.ffn, GemmLayout::kAB};
    case Op::kDgradX: return {m.hidden, 2 * m.ffn, m.hidden, GemmLayout::kAB};
    case Op::kWgradW2: return {m.ffn, m.hidden, m.ffn, GemmLayout::kAtB};
    case Op::kWgradW1: return {m.hidden, 2 * m.ffn, m.hidden, GemmLayout::kAtB};
  }
  return {};
}
const void* inputOf(Op op, const Buffers& b, int set) {
  switch (op) {
    case Op::kG1Store:
    case Op::kG1SwiGlu:
    case Op::kDgradH:
    case Op::kWgradW2: return b.x[set];  // dw2's a: dy
    case Op::kG2Store:
    case Op::kG2Scaled: return b.h[set];
    case Op::kDgradX:
    case Op::kWgradW1: return b.gu[set];  // dw1's a: d(gate|up)
  }
  return nullptr;
}
// wgrad ops: the second operand b [rows, n]: h for dw2, x for dw1.
const void* wgradBOf(Op op, const Buffers& b, int set) { return op == Op::kWgradW2 ? b.h[set] : b.x[set]; }
const void* weightOf(Op op, const Buffers& b, int set) {
  return op == Op::kG1Store || op == Op::kG1SwiGlu || op == Op::kDgradX ? b.w1[set] : b.w2[set];
}
void* outputOf(Op op, const Buffers& b) {
  return op == Op::kG1Store || op == Op::kG1SwiGlu || op == Op::kDgradH ? b.out1 : b.out2;
}

template <class T>
Buffers allocate(const Model& m, int64_t maxRows, int64_t maxGroup, cudaStream_t s) {
  Buffers b{};
  b.model = m;
  b.maxRows = maxRows;
  const size_t nx = size_t(maxRows) * m.hidden, nh = size_t(maxRows) * m.ffn, ngu = size_t(maxRows) * 2 * m.ffn;
  const size_t nw = size_t(m.experts) * 2 * m.ffn * m.hidden, nw2 = size_t(m.experts) * m.hidden * m.ffn;
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMalloc(&b.x[i], nx * 2));
    CK(cudaMalloc(&b.h[i], nh * 2));
    CK(cudaMalloc(&b.gu[i], ngu * 2));
    CK(cudaMalloc(&b.w1[i], nw * 2));
    CK(cudaMalloc(&b.w2[i], nw2 * 2));
    CK(cudaMalloc(&b.offsets[i], size_t(m.experts + 1) * sizeof(int32_t)));
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.x[i]), nx, 100 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.w1[i]), nw, 101 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.h[i]), nh, 102 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.w2[i]), nw2, 103 + 10 * i);
    fillUniform<T><<<4096, 256, 0, s>>>(static_cast<T*>(b.gu[i]), ngu, 104 + 10 * i);
    CK(cudaGetLastError());
  }
  CK(cudaMalloc(&b.out1, ngu * 2));
  CK(cudaMalloc(&b.out2, nx * 2));
  CK(cudaMalloc(&b.scale, size_t(maxRows) * sizeof(float)));
  fillScale<<<1024, 256, 0, s>>>(b.scale, maxRows, 7);
  CK(cudaGetLastError());
  CK(cudaMalloc(&b.ref, size_t(std::max<int64_t>(maxGroup, 1)) * std::max(2 * m.ffn, m.hidden) * sizeof(float)));
  CK(cudaMalloc(&b.refH, size_t(std::max<int64_t>(maxGroup, 1)) * m.ffn * sizeof(float)));
  CK(cudaMalloc(&b.sums, 2 * sizeof(double)));
  CK(cudaMalloc(&b.bad, sizeof(unsigned long long)));
  syncOrDie(s, 120, "fill");
  return b;
}

void release(Buffers& b) {
  for (int i = 0; i < kSets; ++i) {
    for (void* p : {b.x[i], b.h[i], b.gu[i], b.w1[i], b.w2[i], static_cast<void*>(b.offsets[i])}) CK(cudaFree(p));
  }
  for (void* p : {b.out1, b.out2, static_cast<void*>(b.scale), static_cast<void*>(b.ref),
                  static_cast<void*>(b.refH), static_cast<void*>(b.sums), static_cast<void*>(b.bad), b.dw,
                  static_cast<void*>(b.refW)}) {
    CK(cudaFree(p));
  }
  b = Buffers{};
}

GroupedGemmParams paramsOf(Op op, const Buffers& b, int set, const Case& c, GemmDtype dt, int32_t groupM,
                           GroupedGemmPath path = GroupedGemmPath::kAuto) {
  const OpShape sh = shapeOf(op, b.model);
  const int64_t rows = c.rows();
  GroupedGemmParams p{};
  p.x = inputOf(op, b, set);
  p.w = weightOf(op, b, set);
  p.out = outputOf(op, b);
  p.groupOffsets = b.offsets[set];
  p.rowScale = op == Op::kG2Scaled ? b.scale : nullptr;
  p.mTotal = rows;
  p.n = sh.n;
  p.k = sh.k;
  p.numExperts = b.model.experts;
  p.dtype = dt;
  p.epilogue = op == Op::kG1SwiGlu ? GroupedGemmEpilogue::kSwiGlu : GroupedGemmEpilogue::kStore;
  p.layout = sh.layout;
  p.groupM = groupM;
  p.maxGroupRows = c.maxGroupRows;
  p.path = path;
  return p;
}

void uploadOffsets(const Case& c, const Buffers& b, cudaStream_t s) {
  std::vector<int32_t> off(1, 0);
  for (int32_t n : c.counts) off.push_back(off.back() + n);
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMemcpyAsync(b.offsets[i], off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  }
  syncOrDie(s, 60, "offsets");  // off is a host temporary
}

bool gFailed = false;

GroupedWgradParams wgradParamsOf(Op op, const Buffers& b, int set, const Case& c, GemmDtype dt) {
  const OpShape sh = shapeOf(op, b.model);
  GroupedWgradParams p{};
  p.a = inputOf(op, b, set);
  p.b = wgradBOf(op, b, set);
  p.out = b.dw;
  p.groupOffsets = b.offsets[set];
  p.mTotal = c.rows();
  p.m = sh.k;
  p.n = sh.n;
  p.numExperts = b.model.experts;
  p.dtype = dt;
  return p;
}

// The wgrad ops: the first, middle and last experts' gradients of set 0 against the fp32 reference; an expert without
// rows must be all zeros (its reference is).
template <class T>
void checkWgrad(Op op, const Case& c, const Buffers& b, GemmDtype dt, cudaStream_t s) {
  const OpShape sh = shapeOf(op, b.model);
  const int64_t m = sh.k, n = sh.n;
  CK(cudaMemsetAsync(b.dw, 0xFF, size_t(b.model.experts) * size_t(m * n) * 2, s));  // NaN poison
  try {
    launchGroupedWgrad(wgradParamsOf(op, b, 0, c, dt), s);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-7s %-10s %-13s launch threw: %s\n", b.model.name, c.name.c_str(), opName(op), e.what());
    gFailed = true;
    return;
  }
  CK(cudaGetLastError());
  syncOrDie(s, 60, std::string("grouped wgrad ") + opName(op));
  std::vector<int32_t> off(1, 0);
  for (int32_t cnt : c.counts) off.push_back(off.back() + cnt);
  double worst = 0;
  unsigned long long badTotal = 0;
  const int experts = b.model.experts;
  for (int e : {0, experts / 2, experts - 1}) {
    const int64_t r0 = off[size_t(e)], nr = c.counts[size_t(e)];
    const T* a = static_cast<const T*>(inputOf(op, b, 0)) + r0 * m;
    const T* bb = static_cast<const T*>(wgradBOf(op, b, 0)) + r0 * n;
    // ref [m, n] = sum over the group's rows r of a[r, i] * b[r, j]: A(i, r) = a[r * m + i], B(r, j) = b[r * n + j].
    dim3 grid(unsigned((n + 63) / 64), unsigned((m + 63) / 64));
    refGemmStrided<T><<<grid, dim3(16, 16), 0, s>>>(a, 1, m, bb, n, 1, b.refW, int(m), int(n), int(nr));
    CK(cudaGetLastError());
    CK(cudaMemsetAsync(b.sums, 0, 2 * sizeof(double), s));
    CK(cudaMemsetAsync(b.bad, 0, sizeof(unsigned long long), s));
    const T* out = static_cast<const T*>(b.dw) + int64_t(e) * m * n;
    relErrorKernel<T, float><<<1024, 256, 0, s>>>(out, n, b.refW, m, n, b.sums, b.bad);
    CK(cudaGetLastError());
    double h[2];
    unsigned long long nb = 0;
    CK(cudaMemcpyAsync(h, b.sums, sizeof(h), cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(&nb, b.bad, sizeof(nb), cudaMemcpyDeviceToHost, s));
    syncOrDie(s, 120, "reference check");
    // An empty expert: zero reference, so the error itself (must be 0) rather than the ratio.
    worst = std::max(worst, nr == 0 ? std::sqrt(h[0]) : std::sqrt(h[0] / std::max(h[1], 1e-300)));
    badTotal += nb;
  }
  const bool ok = badTotal == 0 && std::isfinite(worst) && worst < 1e-2;
  std::printf("  %s %-7s %-10s %-13s rel_err %.3e non-finite %llu\n", ok ? "ok  " : "FAIL", b.model.name,
              c.name.c_str(), opName(op), worst, badTotal);
  if (!ok) gFailed = true;
}

// Checks the first, middle and last groups (those that have rows) of set 0 against the fp32 reference.
template <class T>
void check(Op op, const Case& c, const Buffers& b, GemmDtype dt, cudaStream_t s) {
  const OpShape sh = shapeOf(op, b.model);
  const int64_t rows = c.rows();
  CK(cudaMemsetAsync(outputOf(op, b), 0xFF, size_t(rows) * sh.nOut * 2, s));  // NaN poison
  try {
    launchGroupedGemm(paramsOf(op, b, 0, c, dt, 0), s);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-7s %-10s %-13s launch threw: %s\n", b.model.name, c.name.c_str(), opName(op), e.what());
    gFailed = true;
    return;
  }
  CK(cudaGetLastError());
  syncOrDie(s, 60, std::string("grouped gemm ") + opName(op));
  std::vector<int32_t> off(1, 0);
  for (int32_t n : c.counts) off.push_back(off.back() + n);
  double worst = 0;
  unsigned long long badTotal = 0;
  const int experts = b.model.experts;
  std::vector<int> groups = {0, experts / 2, experts - 1};
  if (c.checkAll) {
    groups.clear();
    for (int e = 0; e < experts; ++e) groups.push_back(e);
  }
  for (int e : groups) {
    const int64_t r0 = off[size_t(e)], nr = c.counts[size_t(e)];
    if (nr == 0) continue;
    const T* a = static_cast<const T*>(inputOf(op, b, 0)) + r0 * sh.k;
    const T* w = static_cast<const T*>(weightOf(op, b, 0)) + int64_t(e) * sh.n * sh.k;
    // w(kk, col) = w[col * k + kk] ([n, k], kABt) or w[kk * n + col] ([k, n], kAB).
    const bool kn = sh.layout == GemmLayout::kAB;
    dim3 grid(unsigned((sh.n + 63) / 64), unsigned((nr + 63) / 64));
    refGemmStrided<T><<<grid, dim3(16, 16), 0, s>>>(a, sh.k, 1, w, kn ? sh.n : 1, kn ? 1 : sh.k, b.ref, int(nr),
                                                    int(sh.n), int(sh.k));
    CK(cudaGetLastError());
    const float* want = b.ref;
    if (op == Op::kG1SwiGlu) {
      swigluRefCopy<<<2048, 256, 0, s>>>(b.ref, b.refH, nr, b.model.ffn);
      want = b.refH;
    } else if (op == Op::kG2Scaled) {
      scaleRowsRef<<<2048, 256, 0, s>>>(b.ref, nr, sh.n, b.scale + r0);
    }
    CK(cudaGetLastError());
    CK(cudaMemsetAsync(b.sums, 0, 2 * sizeof(double), s));
    CK(cudaMemsetAsync(b.bad, 0, sizeof(unsigned long long), s));
    const T* out = static_cast<const T*>(outputOf(op, b)) + r0 * sh.nOut;
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
  std::printf("  %s %-7s %-10s %-13s rel_err %.3e non-finite %llu\n", ok ? "ok  " : "FAIL", b.model.name,
              c.name.c_str(), opName(op), worst, badTotal);
  if (!ok) gFailed = true;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median ms of `iters` calls of launch(set), alternating the two input sets. All are enqueued back to back (each
// between its own pair of events) and synchronised once, so the host's launch cost stays out of the numbers.
template <class Launch>
double timeLaunches(int iters, cudaStream_t s, const Launch& launch) {
  constexpr int kWarm = 3;
  std::vector<cudaEvent_t> ev(2 * size_t(iters + kWarm));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int it = 0; it < iters + kWarm; ++it) {
    CK(cudaEventRecord(ev[2 * size_t(it)], s));
    launch(it % kSets);
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

double timeOp(Op op, const Case& c, const Buffers& b, GemmDtype dt, int iters, int32_t groupM, cudaStream_t s,
              GroupedGemmPath path = GroupedGemmPath::kAuto) {
  return timeLaunches(iters, s, [&](int set) {
    if (isWgrad(op)) {
      launchGroupedWgrad(wgradParamsOf(op, b, set, c, dt), s);
    } else {
      launchGroupedGemm(paramsOf(op, b, set, c, dt, groupM, path), s);
    }
  });
}

double tflops(Op op, const Model& m, int64_t rows, double ms) {
  const OpShape sh = shapeOf(op, m);
  return 2.0 * double(rows) * double(sh.n) * double(sh.k) / (ms * 1e-3) / 1e12;
}

struct Options {
  GemmDtype dtype = GemmDtype::kBf16;
  bool fp8 = false;  // --dtype fp8: the FP8 grouped GEMM beside bf16 (runFp8)
  int iters = 30;
  bool sweep = false;
  const TorchTimes* torch = nullptr;
};

// One model's cases and ops: correctness first, then timing.
template <class T>
void runSection(const Model& m, const std::vector<Case>& cases, const std::vector<Op>& ops, const Options& o,
                cudaStream_t s) {
  int64_t maxRows = 0, maxGroup = 0;
  for (const Case& c : cases) {
    maxRows = std::max(maxRows, c.rows());
    maxGroup = std::max<int64_t>(maxGroup, c.maxGroup());
  }
  Buffers b = allocate<T>(m, maxRows, maxGroup, s);
  if (std::any_of(ops.begin(), ops.end(), isWgrad)) {
    const size_t dwElems = size_t(m.experts) * size_t(2 * m.ffn * m.hidden);  // dw1's; dw2's is half
    CK(cudaMalloc(&b.dw, dwElems * 2));
    CK(cudaMalloc(&b.refW, size_t(2 * m.ffn * m.hidden) * sizeof(float)));
  }
  std::printf("\n%s: %d experts, hidden %lld, ffn %lld\n", m.name, m.experts, static_cast<long long>(m.hidden),
              static_cast<long long>(m.ffn));
  std::printf("correctness (first, middle and last group of each case vs fp32 reference):\n");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
    for (Op op : ops) {
      if (isWgrad(op)) {
        checkWgrad<T>(op, c, b, o.dtype, s);
      } else {
        check<T>(op, c, b, o.dtype, s);
      }
    }
  }

  std::printf("timing (median of %d, 2 rotated input sets; TFLOP/s = 2 rows n k / t; x torch = torch ms / ms):\n",
              o.iters);
  std::printf("%-7s %-10s %7s  %-13s %9s %9s %9s %8s\n", "model", "case", "rows", "op", "ms", "TFLOP/s", "torch ms",
              "x torch");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
    for (Op op : ops) {
      const double ms = timeOp(op, c, b, o.dtype, o.iters, 0, s);
      std::printf("%-7s %-10s %7lld  %-13s %9.4f %9.1f", m.name, c.name.c_str(), static_cast<long long>(c.rows()),
                  opName(op), ms, tflops(op, m, c.rows(), ms));
      const double tms = o.torch != nullptr ? o.torch->find(m.name, c.name, opName(op)) : 0.0;
      if (tms > 0) {
        std::printf(" %9.4f %7.2fx\n", tms, tms / ms);
      } else {
        std::printf(" %9s %8s\n", "-", "-");
      }
      std::fflush(stdout);
    }
    if (o.sweep) {
      for (int32_t gm : {2, 4, 8, 32}) {
        for (Op op : ops) {
          if (op == Op::kG1SwiGlu || op == Op::kG2Scaled) continue;  // same mainloop as the plain store
          if (isWgrad(op)) continue;  // no raster parameter
          const double ms = timeOp(op, c, b, o.dtype, o.iters, gm, s);
          std::printf("%-7s %-10s %7lld  %-13s %9.4f %9.1f  (groupM %d)\n", m.name, c.name.c_str(),
                      static_cast<long long>(c.rows()), opName(op), ms, tflops(op, m, c.rows(), ms), gm);
        }
      }
    }
  }
  release(b);
}

template <class T>
int run(const Options& o, const std::vector<Case>& extraCases, bool fwd, bool dgrad, bool wgrad) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (fwd) {
    std::vector<Case> cases = forwardCases();
    cases.insert(cases.end(), extraCases.begin(), extraCases.end());
    runSection<T>(kDeepSeekV3, cases, {Op::kG1Store, Op::kG1SwiGlu, Op::kG2Store, Op::kG2Scaled}, o, s);
  }
  if (dgrad) {
    for (const Model& m : {kDeepSeekV3, kMixtral}) {
      runSection<T>(m, equalCases(m, {256, 512, 1024, 2048, 4096}), {Op::kDgradH, Op::kDgradX}, o, s);
    }
  }
  if (wgrad) {
    for (const Model& m : {kDeepSeekV3, kMixtral}) {
      runSection<T>(m, equalCases(m, {256, 512, 1024, 2048, 4096}), {Op::kWgradW2, Op::kWgradW1}, o, s);
    }
  }
  CK(cudaStreamDestroy(s));
  return gFailed ? 1 : 0;
}

// ---- decode mode ------------------------------------------------------------------------------------------------

constexpr int kTopK = 8;

// `tokens` tokens, each routed to kTopK distinct experts drawn uniformly (seeded by the token count).
Case decodeCase(int tokens) {
  constexpr int kExperts = kDeepSeekV3.experts;
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


// Bytes of the routed experts' weights for `op`, each read once.
double weightBytes(Op op, const Case& c) {
  const OpShape sh = shapeOf(op, kDeepSeekV3);
  return double(c.activeExperts()) * double(sh.n) * double(sh.k) * 2.0;
}

template <class T>
int runDecode(GemmDtype dt, int iters) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copyGBs = copyBandwidthGBs(s);
  std::vector<Case> cases;
  for (int tokens : {1, 8, 32, 128}) cases.push_back(decodeCase(tokens));
  int64_t maxRows = 0, maxGroup = 0;
  for (const Case& c : cases) {
    maxRows = std::max(maxRows, c.rows());
    maxGroup = std::max<int64_t>(maxGroup, c.maxGroup());
  }
  Buffers b = allocate<T>(kDeepSeekV3, maxRows, maxGroup, s);
  const Op ops[] = {Op::kG1Store, Op::kG1SwiGlu, Op::kG2Store, Op::kG2Scaled};

  std::printf("device-to-device copy %.0f GB/s (read + write)\n", copyGBs);
  std::printf("correctness (every expert with rows vs fp32 reference, the plan's path):\n");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
    for (Op op : ops) check<T>(op, c, b, dt, s);
  }

  std::printf("\ntiming (median of %d, 2 rotated input sets). weights: the routed experts' weights once; x copy: that "
              "time over the time a copy moves those bytes (target <= 1.3)\n", iters);
  std::printf("%-6s %5s %7s  %-13s %-11s %9s %9s %9s %8s %7s\n", "case", "rows", "experts", "op", "plan", "ms",
              "tiled ms", "weight MB", "GB/s", "x copy");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
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
  release(b);
  CK(cudaStreamDestroy(s));
  return gFailed ? 1 : 0;
}

// ---- fp8 mode ---------------------------------------------------------------------------------------------------

// One model's FP8 operands (tandem/kernels/grouped_gemm_fp8.hpp), two sets: e4m3 with DeepSeek-V3 scales, x and h per
// 1 x 128 (M-major [k / 128, ldScale]), the weights per 128 x 128 block of each expert; and the outputs.
struct Fp8Buffers {
  int64_t ldScale = 0;  // row stride of the 1 x 128 scales: gemmFp8ScaleALd(maxRows)
  uint8_t* x[kSets];    // [maxRows, hidden]
  float* xs[kSets];     // [hidden / 128, ldScale]
  uint8_t* h[kSets];    // [maxRows, ffn]: gemm2's input
  float* hs[kSets];     // [ffn / 128, ldScale]
  uint8_t* w1[kSets];   // [E, 2 ffn, hidden]
  float* w1s[kSets];    // [E, 2 ffn / 128, hidden / 128]
  uint8_t* w2[kSets];   // [E, hidden, ffn]
  float* w2s[kSets];    // [E, hidden / 128, ffn / 128]
  void* out1;           // bf16 [maxRows, 2 ffn]: gemm1's output
  uint8_t* hq;          // e4m3 [maxRows, ffn]: gemm1+swiglu's h
  float* hqs;           // [ffn / 128, ldScale]: its scales
  void* out2;           // bf16 [maxRows, hidden]: gemm2's output
  float* deqA;          // one group's dequantized input [maxGroup, hidden]
  float* deqW;          // one expert's dequantized weight [2 ffn, hidden]
  float* deqH;          // one group's dequantized h [maxGroup, ffn]
};

__device__ __forceinline__ float e4m3ToFloat(uint8_t v) {
  __nv_fp8_e4m3 f;
  f.__x = v;
  return static_cast<float>(f);
}

// Rows [r0, r0 + rows) of q [*, cols] e4m3 with 1 x 128 scales [cols / 128, ld] (M-major) -> out [rows, cols] fp32.
__global__ void dequantRows(const uint8_t* q, const float* scale, int64_t ld, int64_t r0, int64_t rows, int64_t cols,
                            float* out) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = r0 + i / cols, c = i % cols;
    out[i] = e4m3ToFloat(q[r * cols + c]) * scale[(c / 128) * ld + r];
  }
}

// w [n, k] e4m3 with 128 x 128 block scales [n / 128, k / 128] -> out [n, k] fp32.
__global__ void dequantBlocks(const uint8_t* w, const float* scale, int64_t n, int64_t k, float* out) {
  const int64_t total = n * k, kBlocks = (k + 127) / 128;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    out[i] = e4m3ToFloat(w[i]) * scale[(r / 128) * kBlocks + c / 128];
  }
}

Fp8Buffers allocateFp8(const Model& m, int64_t maxRows, int64_t maxGroup, cudaStream_t s) {
  using tandem::bench::fillFp8;
  using tandem::bench::fillScales;
  Fp8Buffers f{};
  f.ldScale = tandem::kernels::gemmFp8ScaleALd(maxRows);
  const size_t nx = size_t(maxRows) * m.hidden, nh = size_t(maxRows) * m.ffn;
  const size_t nw1 = size_t(m.experts) * 2 * m.ffn * m.hidden, nw2 = size_t(m.experts) * m.hidden * m.ffn;
  const size_t nxs = size_t(m.hidden / 128) * f.ldScale, nhs = size_t(m.ffn / 128) * f.ldScale;
  const size_t nw1s = size_t(m.experts) * (2 * m.ffn / 128) * (m.hidden / 128);
  const size_t nw2s = size_t(m.experts) * (m.hidden / 128) * (m.ffn / 128);
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMalloc(&f.x[i], nx));
    CK(cudaMalloc(&f.h[i], nh));
    CK(cudaMalloc(&f.w1[i], nw1));
    CK(cudaMalloc(&f.w2[i], nw2));
    CK(cudaMalloc(&f.xs[i], nxs * 4));
    CK(cudaMalloc(&f.hs[i], nhs * 4));
    CK(cudaMalloc(&f.w1s[i], nw1s * 4));
    CK(cudaMalloc(&f.w2s[i], nw2s * 4));
    fillFp8<<<4096, 256, 0, s>>>(f.x[i], nx, 300 + 10 * i);
    fillFp8<<<4096, 256, 0, s>>>(f.h[i], nh, 301 + 10 * i);
    fillFp8<<<4096, 256, 0, s>>>(f.w1[i], nw1, 302 + 10 * i);
    fillFp8<<<4096, 256, 0, s>>>(f.w2[i], nw2, 303 + 10 * i);
    fillScales<<<1024, 256, 0, s>>>(f.xs[i], nxs, 304 + 10 * i, 0.0f);
    fillScales<<<1024, 256, 0, s>>>(f.hs[i], nhs, 305 + 10 * i, 0.0f);
    fillScales<<<1024, 256, 0, s>>>(f.w1s[i], nw1s, 306 + 10 * i, 0.0f);
    fillScales<<<1024, 256, 0, s>>>(f.w2s[i], nw2s, 307 + 10 * i, 0.0f);
    CK(cudaGetLastError());
  }
  CK(cudaMalloc(&f.out1, nh * 4));  // bf16 [maxRows, 2 ffn]
  CK(cudaMalloc(&f.hq, nh));
  CK(cudaMalloc(&f.hqs, nhs * 4));
  CK(cudaMalloc(&f.out2, nx * 2));
  const size_t g = size_t(std::max<int64_t>(maxGroup, 1));
  CK(cudaMalloc(&f.deqA, g * size_t(std::max(m.hidden, m.ffn)) * 4));
  CK(cudaMalloc(&f.deqW, size_t(2 * m.ffn * m.hidden) * 4));
  CK(cudaMalloc(&f.deqH, g * size_t(m.ffn) * 4));
  syncOrDie(s, 120, "fp8 fill");
  return f;
}

void releaseFp8(Fp8Buffers& f) {
  for (int i = 0; i < kSets; ++i) {
    for (void* p : {static_cast<void*>(f.x[i]), static_cast<void*>(f.h[i]), static_cast<void*>(f.w1[i]),
                    static_cast<void*>(f.w2[i]), static_cast<void*>(f.xs[i]), static_cast<void*>(f.hs[i]),
                    static_cast<void*>(f.w1s[i]), static_cast<void*>(f.w2s[i])}) {
      CK(cudaFree(p));
    }
  }
  for (void* p : {f.out1, static_cast<void*>(f.hq), static_cast<void*>(f.hqs), f.out2, static_cast<void*>(f.deqA),
                  static_cast<void*>(f.deqW), static_cast<void*>(f.deqH)}) {
    CK(cudaFree(p));
  }
  f = Fp8Buffers{};
}

bool isGemm1(Op op) { return op == Op::kG1Store || op == Op::kG1SwiGlu; }

// The FP8 form of a forward op: the same shape as the bf16 op (shapeOf), weights with 128 x 128 block scales.
GroupedGemmFp8Params fp8ParamsOf(Op op, const Fp8Buffers& f, const Buffers& b, int set, const Case& c) {
  const OpShape sh = shapeOf(op, b.model);
  GroupedGemmFp8Params p{};
  p.x = isGemm1(op) ? f.x[set] : f.h[set];
  p.xScale = isGemm1(op) ? f.xs[set] : f.hs[set];
  p.w = isGemm1(op) ? f.w1[set] : f.w2[set];
  p.wScale = isGemm1(op) ? f.w1s[set] : f.w2s[set];
  p.out = op == Op::kG1Store ? f.out1 : op == Op::kG1SwiGlu ? static_cast<void*>(f.hq) : f.out2;
  p.outScale = op == Op::kG1SwiGlu ? f.hqs : nullptr;
  p.groupOffsets = b.offsets[set];
  p.rowScale = op == Op::kG2Scaled ? b.scale : nullptr;
  p.mTotal = c.rows();
  p.n = sh.n;
  p.k = sh.k;
  p.numExperts = b.model.experts;
  p.ldxScale = f.ldScale;
  p.ldOutScale = op == Op::kG1SwiGlu ? f.ldScale : 0;
  p.epilogue = op == Op::kG1SwiGlu ? GroupedGemmEpilogue::kSwiGlu : GroupedGemmEpilogue::kStore;
  p.wScaling = GroupedFp8WeightScaling::kBlock;
  return p;
}

// The first, middle and last groups of set 0 against an fp32 GEMM of the dequantized inputs (h dequantized with its
// scales for gemm1+swiglu).
void checkFp8(Op op, const Case& c, const Fp8Buffers& f, const Buffers& b, cudaStream_t s) {
  const OpShape sh = shapeOf(op, b.model);
  const bool swiglu = op == Op::kG1SwiGlu;
  void* const out = fp8ParamsOf(op, f, b, 0, c).out;
  CK(cudaMemsetAsync(out, 0xFF, size_t(c.rows()) * sh.nOut * (swiglu ? 1 : 2), s));  // NaN poison
  try {
    launchGroupedGemmFp8(fp8ParamsOf(op, f, b, 0, c), s);
  } catch (const std::exception& e) {
    std::printf("  FAIL %-7s %-10s %-13s launch threw: %s\n", b.model.name, c.name.c_str(), opName(op), e.what());
    gFailed = true;
    return;
  }
  CK(cudaGetLastError());
  syncOrDie(s, 60, std::string("fp8 grouped gemm ") + opName(op));
  std::vector<int32_t> off(1, 0);
  for (int32_t n : c.counts) off.push_back(off.back() + n);
  double worst = 0;
  unsigned long long badTotal = 0;
  const int experts = b.model.experts;
  for (int e : {0, experts / 2, experts - 1}) {
    const int64_t r0 = off[size_t(e)], nr = c.counts[size_t(e)];
    if (nr == 0) continue;
    dequantRows<<<2048, 256, 0, s>>>(isGemm1(op) ? f.x[0] : f.h[0], isGemm1(op) ? f.xs[0] : f.hs[0], f.ldScale, r0,
                                     nr, sh.k, f.deqA);
    const int64_t wScales = (sh.n / 128) * (sh.k / 128);
    dequantBlocks<<<2048, 256, 0, s>>>((isGemm1(op) ? f.w1[0] : f.w2[0]) + int64_t(e) * sh.n * sh.k,
                                       (isGemm1(op) ? f.w1s[0] : f.w2s[0]) + int64_t(e) * wScales, sh.n, sh.k, f.deqW);
    dim3 grid(unsigned((sh.n + 63) / 64), unsigned((nr + 63) / 64));
    refGemmStrided<float><<<grid, dim3(16, 16), 0, s>>>(f.deqA, sh.k, 1, f.deqW, 1, sh.k, b.ref, int(nr), int(sh.n),
                                                        int(sh.k));
    CK(cudaGetLastError());
    const float* want = b.ref;
    if (swiglu) {
      swigluRefCopy<<<2048, 256, 0, s>>>(b.ref, b.refH, nr, b.model.ffn);
      want = b.refH;
    } else if (op == Op::kG2Scaled) {
      scaleRowsRef<<<2048, 256, 0, s>>>(b.ref, nr, sh.n, b.scale + r0);
    }
    CK(cudaMemsetAsync(b.sums, 0, 2 * sizeof(double), s));
    CK(cudaMemsetAsync(b.bad, 0, sizeof(unsigned long long), s));
    if (swiglu) {
      dequantRows<<<2048, 256, 0, s>>>(f.hq, f.hqs, f.ldScale, r0, nr, sh.nOut, f.deqH);
      relErrorKernel<float, float><<<1024, 256, 0, s>>>(f.deqH, sh.nOut, want, nr, sh.nOut, b.sums, b.bad);
    } else {
      const auto* o = static_cast<const __nv_bfloat16*>(out) + r0 * sh.nOut;
      relErrorKernel<__nv_bfloat16, float><<<1024, 256, 0, s>>>(o, sh.nOut, want, nr, sh.nOut, b.sums, b.bad);
    }
    CK(cudaGetLastError());
    double h[2];
    unsigned long long nb = 0;
    CK(cudaMemcpyAsync(h, b.sums, sizeof(h), cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(&nb, b.bad, sizeof(nb), cudaMemcpyDeviceToHost, s));
    syncOrDie(s, 120, "reference check");
    worst = std::max(worst, std::sqrt(h[0] / std::max(h[1], 1e-300)));
    badTotal += nb;
  }
  // bf16 out: 2^-9 rounding plus the fp8 accumulation within a k-block. e4m3 h: 3 mantissa bits, an rms relative
  // rounding error near 2^-5.
  const double tol = swiglu ? 5e-2 : 1e-2;
  const bool ok = badTotal == 0 && std::isfinite(worst) && worst < tol;
  std::printf("  %s %-7s %-10s %-13s rel_err %.3e non-finite %llu\n", ok ? "ok  " : "FAIL", b.model.name,
              c.name.c_str(), opName(op), worst, badTotal);
  if (!ok) gFailed = true;
}

// One model: correctness of the FP8 ops, then each FP8 op timed beside the bf16 grouped GEMM of the same shape.
void runFp8Section(const Model& m, const std::vector<Case>& cases, const Options& o, cudaStream_t s) {
  int64_t maxRows = 0, maxGroup = 0;
  for (const Case& c : cases) {
    maxRows = std::max(maxRows, c.rows());
    maxGroup = std::max<int64_t>(maxGroup, c.maxGroup());
  }
  Buffers b = allocate<__nv_bfloat16>(m, maxRows, maxGroup, s);
  Fp8Buffers f = allocateFp8(m, maxRows, maxGroup, s);
  const Op ops[] = {Op::kG1Store, Op::kG1SwiGlu, Op::kG2Store, Op::kG2Scaled};
  std::printf("\n%s: %d experts, hidden %lld, ffn %lld; e4m3, x and h scaled per 1x128, w per 128x128\n", m.name,
              m.experts, static_cast<long long>(m.hidden), static_cast<long long>(m.ffn));
  std::printf("correctness (first, middle and last group of each case vs fp32 GEMM of the dequantized inputs):\n");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
    for (Op op : ops) checkFp8(op, c, f, b, s);
  }
  std::printf("timing (median of %d, 2 rotated input sets; TFLOP/s = 2 rows n k / t; x bf16 = bf16 ms / fp8 ms; "
              "x torch = torch ms / fp8 ms):\n", o.iters);
  std::printf("%-7s %-10s %7s  %-13s %9s %9s %9s %9s %7s %9s %8s\n", "model", "case", "rows", "op", "fp8 ms",
              "TFLOP/s", "bf16 ms", "TFLOP/s", "x bf16", "torch ms", "x torch");
  for (const Case& c : cases) {
    uploadOffsets(c, b, s);
    for (Op op : ops) {
      const double ms = timeLaunches(o.iters, s, [&](int set) { launchGroupedGemmFp8(fp8ParamsOf(op, f, b, set, c), s); });
      const double bf16Ms = timeOp(op, c, b, GemmDtype::kBf16, o.iters, 0, s);
      std::printf("%-7s %-10s %7lld  %-13s %9.4f %9.1f %9.4f %9.1f %6.2fx", m.name, c.name.c_str(),
                  static_cast<long long>(c.rows()), opName(op), ms, tflops(op, m, c.rows(), ms), bf16Ms,
                  tflops(op, m, c.rows(), bf16Ms), bf16Ms / ms);
      // torch._scaled_grouped_mm (grouped_mm_baseline.py --fp8 --ms-out): op names "gemm1/fp8", "gemm2/fp8".
      const double tms = o.torch != nullptr ? o.torch->find(m.name, c.name, std::string(opName(op)) + "/fp8") : 0.0;
      if (tms > 0) {
        std::printf(" %9.4f %7.2fx\n", tms, tms / ms);
      } else {
        std::printf(" %9s %8s\n", "-", "-");
      }
      std::fflush(stdout);
    }
  }
  releaseFp8(f);
  release(b);
}

int runFp8(const Options& o) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const Model& m : {kDeepSeekV3, kMixtral}) runFp8Section(m, equalCases(m, {256, 512, 1024, 2048, 4096}), o, s);
  CK(cudaStreamDestroy(s));
  return gFailed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bool decode = false;
  std::string countsPath, torchPath, ops = "all";
  const char* usage =
      "usage: grouped_gemm_bench [--iters N] [--counts FILE] [--sweep] [--dtype bf16|fp16|fp8] "
      "[--ops fwd|dgrad|wgrad|all] "
      "[--torch FILE] [--decode]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--counts" && i + 1 < argc) {
      countsPath = argv[++i];
    } else if (a == "--sweep") {
      o.sweep = true;
    } else if (a == "--decode") {
      decode = true;
    } else if (a == "--dtype" && i + 1 < argc) {
      const std::string d = argv[++i];
      if (d != "bf16" && d != "fp16" && d != "fp8") {
        std::fputs(usage, stderr);
        return 2;
      }
      o.fp8 = d == "fp8";
      o.dtype = d == "fp16" ? GemmDtype::kFp16 : GemmDtype::kBf16;
    } else if (a == "--ops" && i + 1 < argc) {
      ops = argv[++i];
    } else if (a == "--torch" && i + 1 < argc) {
      torchPath = argv[++i];
    } else {
      std::fputs(usage, stderr);
      return 2;
    }
  }
  if (ops != "fwd" && ops != "dgrad" && ops != "wgrad" && ops != "all") {
    std::fputs(usage, stderr);
    return 2;
  }
  const std::vector<Case> extra = countsPath.empty() ? std::vector<Case>{} : readCases(countsPath, kDeepSeekV3.experts);
  TorchTimes torch;
  if (!torchPath.empty()) {
    torch = TorchTimes::read(torchPath);
    o.torch = &torch;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: grouped_gemm_bench needs an H100/H200\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; dtype %s\n", prop.name, prop.multiProcessorCount,
              o.fp8 ? "fp8 (e4m3) beside bf16" : o.dtype == GemmDtype::kBf16 ? "bf16" : "fp16");
  const bool fwd = ops == "fwd" || ops == "all", dgrad = ops == "dgrad" || ops == "all";
  const bool wgrad = ops == "wgrad" || ops == "all";
  try {
    int rc = 0;
    if (o.fp8) {
      rc = runFp8(o);
    } else if (decode) {
      rc = o.dtype == GemmDtype::kBf16 ? runDecode<__nv_bfloat16>(o.dtype, o.iters) : runDecode<__half>(o.dtype, o.iters);
    } else {
      rc = o.dtype == GemmDtype::kBf16 ? run<__nv_bfloat16>(o, extra, fwd, dgrad, wgrad)
                                         : run<__half>(o, extra, fwd, dgrad, wgrad);
    }
    std::printf("%s\n", rc == 0 ? "ALL OK" : "SOME CHECKS FAILED");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 2;
  }
}
