// The MoE FFN layer's kernels (tandem/kernels/moe.hpp), forward and backward, at one rank on two expert shapes:
//   deepseek-v3  hidden 7168, ffn 2048, top-8 of 32 experts;
//   mixtral      hidden 4096, ffn 14336, top-2 of 8 experts.
// Random routings of 256, 512, 1024, 2048 and 4096 rows per expert on average, and a skewed one (80% of the tokens
// pick expert 0, 512 rows per expert on average). Times, with CUDA events (median of --iters, two input sets rotated):
//   forward (--pass fwd)
//     dispatch+GEMM   launchMoe without the FFN, n_out 2 ffn (gemm1's shape): routing, dispatch and the grouped GEMM;
//     FFN             launchMoe with the FFN: routing, dispatch, gemm1 + SwiGLU, gemm2, combine;
//     gemm1, gemm1+SwiGLU, gemm2 alone: tandem's grouped GEMMs on the same groups, rows already permuted; "overlap
//                     ratio" = (gemm1+SwiGLU + gemm2) / FFN (target >= 0.95); the same with skipIdleHalves.
//   backward (--pass bwd)
//     FFN             as above (the forward half of forward+backward);
//     backward        launchMoe with backward: routing, dispatch of x and dout, recompute gate|up, dout·w2, the act
//                     kernel, dw2 and dw1 (grouped wgrad), dx, combine;
//     fwd+bwd         the FFN then the backward, in one timed call;
//     its five GEMMs alone on the same groups: recompute gate|up = x·w1ᵀ, dout·w2 and dx = d(gate|up)·w1
//                     (launchGroupedGemm, layouts kABt and kAB), dw2 = doutᵀ·h and dw1 = d(gate|up)ᵀ·x
//                     (launchGroupedWgrad). "backward / its GEMMs" = backward / (all five) (target <= 1.10); the
//                     same over the four without the recompute is printed too (the recompute is the backward's own
//                     choice: it saves no activations in the forward).
//   saved activations (--saved, with the backward): the FFN saving gate|up (MoeParams::saved: gemm1 stores it, a
//                     SwiGLU pass gives h), the backward from it (no recompute GEMM), and fwd+bwd that way; the
//                     backward's outputs from saved are checked against the recomputing backward's (dx of the checked
//                     token against the fp64 reference, and whether every dx, dtopk, dw1 and dw2 are the same bits).
// Checks: one token per case against an fp64 host reference (its dispatch+GEMM rows, FFN output row, and the
// backward's dx row and d(topk weights)); every output (dw1 and dw2 whole) for non-finite values; skipIdleHalves
// bitwise against the default. Any failure exits 1.
//
// PyTorch (bench/moe_baseline.py, run after this program in the same device call): with --routing-dir DIR this writes,
// per case, DIR/<model>.<case>.{ids,wts} (routing: int32 / fp32 [tokens, topk]) and DIR/<model>.<case>.json (shapes,
// the seeds every input was drawn from with bench_kernels.cuh's fillUniform, and probe values of each input so the
// script can prove it regenerated the same tensors), and after the backward its gradient samples: .dx (bf16, the
// rows of the sampled tokens), .dtopk (fp32 [tokens, topk], all), .dw1 and .dw2 (bf16, the sampled rows of every
// expert). The script runs PyTorch's unfused layer (route, permute, torch._grouped_mm x2 with SwiGLU, weighted
// combine) on the same routing and weights, forward and forward+backward under autograd, checks these gradients
// against autograd's (relative error, failing above bf16 tolerance) and, with --tandem (this program's --json), prints
// tandem's speed-up over it (forward+backward target >= 1.5x).
//
// Several GPUs (expert parallel): this program runs one rank; python/bench/moe_step.py times the EP layer's forward
// and backward through tandemd under torchrun against PyTorch + NCCL.
//
// --experiment (after each case's numbers): the grouped GEMMs' dynamic tile order (tileCounter), alone and with
// skipIdleHalves, and the FFN with both, checked bitwise against the default FFN.
//
// --dtype fp8: the FFN with FP8 weights (tandem.h, w_dtype e4m3) beside the bf16 FFN on the same routings: the bf16
// weights quantised to e4m3 per 128 x 128 block on the device, x and h quantised per 1 x 128 block by the op. Rows
// "FFN FP8 (whole layer)" and, alone on the same groups, "FP8 gemm1+SwiGLU" and "FP8 gemm2"; the note "bf16 / FP8"
// = FFN ms / FFN FP8 ms (target >= 1.6 at DeepSeek-V3's shapes). Checked: one token against an fp64 host reference of
// the quantised layer (x and h quantised as the op does, the dequantised weights), finite outputs. With the forward
// pass also "dispatch+GEMM FP8" (w1's e4m3 as w, as the bf16 row uses w1) beside "dispatch+GEMM", the note
// "dg bf16 / FP8", and its check: the bf16 run's row layout, one token's rows against the quantised fp64 reference.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"
#include "tandem/common/numeric.hpp"  // quantizeE4m3Block: the op's activation quantisation, for the FP8 reference
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/grouped_gemm_fp8.hpp"
#include "tandem/kernels/grouped_gemm_wgrad.hpp"
#include "tandem/kernels/moe.hpp"

namespace k = tandem::kernels;

namespace {

using tandem::bench::syncOrDie;
using Epi = k::GroupedGemmEpilogue;
using Layout = k::GemmLayout;

constexpr int kSets = 2;
constexpr int kWarm = 3;
// fillUniform seeds of every input (moe_baseline.py draws the same tensors from them); set i adds i.
constexpr uint64_t kSeedW1 = 11, kSeedW2 = 12, kSeedX = 21, kSeedDout = 31, kSeedPool = 41;
// bf16 keeps 8 bits: one rounding is 2^-9 relative; the checks allow the few roundings each side makes (gate|up,
// h, d(gate|up), the output) plus the fp32 sums' order, as the MoE GPU tests do against their fp64 reference.
constexpr double kTolerance = 2e-2;
constexpr int kCheckTokens = 16;  // tokens whose dx rows go to PyTorch (all of d(topk weights) and rows of dw1, dw2 do)
// FP8: the GPU quantises h after its fp8 tensor-core sums, the host reference after fp64 ones; an h value near an e4m3
// rounding boundary then goes the other way (common/reference.cpp's FP8 MoE tolerance says how far that moves out).
constexpr double kFp8Tolerance = 3e-2;

struct Model {
  const char* name;
  int64_t hidden, ffn;
  int experts, topk;
};
constexpr Model kModels[] = {{"deepseek-v3", 7168, 2048, 32, 8}, {"mixtral", 4096, 14336, 8, 2}};

struct Options {
  int iters = 30;
  std::string routingDir, jsonPath;
  std::vector<std::string> models{"deepseek-v3", "mixtral"};
  std::vector<int> rowsPerExpert{256, 512, 1024, 2048, 4096};
  bool skew = true, fwd = true, bwd = true, experiment = false;
  bool saved = false;  // also time the backward with the forward's saved gate|up (--saved)
  bool fp8 = false;  // --dtype fp8: the FFN with FP8 weights too
};

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

// A cudaMalloc'd block freed at scope end (the bench exits on any CUDA error, so no error path needs more).
class DevMem {
 public:
  explicit DevMem(size_t bytes) : bytes_(bytes) { CK(cudaMalloc(&p_, std::max<size_t>(bytes, 256))); }
  ~DevMem() { cudaFree(p_); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  void* get() const { return p_; }
  char* at(size_t byteOffset) const { return static_cast<char*>(p_) + byteOffset; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

void fill(const DevMem& m, size_t elems, uint64_t seed) {
  tandem::bench::fillUniform<<<1024, 256>>>(m.as<__nv_bfloat16>(), elems, seed);
  CK(cudaGetLastError());
}

// w [E, rows, cols] bf16 -> e4m3 with one fp32 scale per 128 x 128 block (amax / 448): scale [E, ceil(rows/128),
// ceil(cols/128)], the layout of the op's w1_scale and w2_scale. One CTA per block.
__global__ void quantizeWeightBlocks(const __nv_bfloat16* w, int64_t rows, int64_t cols, __nv_fp8_e4m3* q,
                                     float* scale) {
  __shared__ float sMax[256];
  const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  const int64_t e = blockIdx.x / (rb * cb), br = blockIdx.x / cb % rb, bc = blockIdx.x % cb;
  const int64_t r0 = br * 128, c0 = bc * 128;
  const __nv_bfloat16* we = w + e * rows * cols;
  float amax = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < 128 * 128; i += blockDim.x) {
    const int64_t r = r0 + i / 128, c = c0 + i % 128;
    if (r < rows && c < cols) amax = fmaxf(amax, fabsf(__bfloat162float(we[r * cols + c])));
  }
  sMax[threadIdx.x] = amax;
  __syncthreads();
  for (int d = static_cast<int>(blockDim.x) / 2; d > 0; d /= 2) {
    if (static_cast<int>(threadIdx.x) < d) sMax[threadIdx.x] = fmaxf(sMax[threadIdx.x], sMax[threadIdx.x + d]);
    __syncthreads();
  }
  const float a = fmaxf(sMax[0], 1e-30f);
  for (int i = static_cast<int>(threadIdx.x); i < 128 * 128; i += blockDim.x) {
    const int64_t r = r0 + i / 128, c = c0 + i % 128;
    if (r < rows && c < cols) {
      q[e * rows * cols + r * cols + c] = __nv_fp8_e4m3(__bfloat162float(we[r * cols + c]) * (448.0f / a));
    }
  }
  if (threadIdx.x == 0) scale[blockIdx.x] = a / 448.0f;
}

void quantizeWeights(const DevMem& w, int experts, int64_t rows, int64_t cols, const DevMem& q, const DevMem& scale) {
  const int64_t blocks = experts * ((rows + 127) / 128) * ((cols + 127) / 128);
  quantizeWeightBlocks<<<static_cast<unsigned>(blocks), 256>>>(w.as<__nv_bfloat16>(), rows, cols,
                                                               q.as<__nv_fp8_e4m3>(), scale.as<float>());
  CK(cudaGetLastError());
}

__global__ void countNonFinite(const uint16_t* p, size_t n, unsigned long long* bad) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    c += (p[i] & 0x7F80) == 0x7F80;  // bf16 exponent all ones: inf or NaN
  }
  if (c) atomicAdd(bad, c);
}

bool allFinite(const void* p, size_t n) {
  DevMem bad(8);
  CK(cudaMemset(bad.get(), 0, 8));
  countNonFinite<<<1024, 256>>>(static_cast<const uint16_t*>(p), n, bad.as<unsigned long long>());
  CK(cudaGetLastError());
  unsigned long long h = 0;
  CK(cudaMemcpy(&h, bad.get(), 8, cudaMemcpyDeviceToHost));
  return h == 0;
}

__global__ void countDiff(const uint32_t* a, const uint32_t* b, size_t n, unsigned long long* diff) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    c += a[i] != b[i];
  }
  if (c) atomicAdd(diff, c);
}

// Whether two device buffers of `bytes` (a multiple of 4) hold the same bits, compared on the device (the weight
// gradients are gigabytes).
bool sameBits(const void* a, const void* b, size_t bytes) {
  DevMem diff(8);
  CK(cudaMemset(diff.get(), 0, 8));
  countDiff<<<1024, 256>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), bytes / 4,
                           diff.as<unsigned long long>());
  CK(cudaGetLastError());
  unsigned long long h = 0;
  CK(cudaMemcpy(&h, diff.get(), 8, cudaMemcpyDeviceToHost));
  return h == 0;
}

template <class T = uint16_t>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
const char* bytesOf(const void* p) { return static_cast<const char*>(p); }

template <class T>
void writeFile(const std::string& path, const std::vector<T>& v) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
}

template <class T>
std::string jsonList(const std::vector<T>& v) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << ']';
  return o.str();
}

// sqrt(Σ (got - want)²) / sqrt(Σ want²).
template <class G, class W>
double relError(const G& got, const W& want) {
  double e = 0, r = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    e += d * d;
    r += double(want[i]) * double(want[i]);
  }
  return std::sqrt(e / std::max(r, 1e-30));
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
  syncOrDie(s, 300, "timed calls");
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

struct Routing {
  std::string name;
  int64_t tokens = 0;
  std::vector<int32_t> ids;      // [tokens, topk]
  std::vector<float> wts;        // [tokens, topk], each token's sum 1
  std::vector<int32_t> counts;   // rows per expert
  std::vector<int32_t> offsets;  // experts + 1
  int64_t rows() const { return int64_t(ids.size()); }
};

Routing makeRouting(const Model& m, const std::string& name, int64_t tokens, bool skew, uint64_t seed) {
  Routing r;
  r.name = name;
  r.tokens = tokens;
  r.ids.resize(size_t(tokens * m.topk));
  r.wts.resize(r.ids.size());
  r.counts.assign(size_t(m.experts), 0);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<int32_t> chosen;
  std::vector<float> w(size_t(m.topk));
  for (int64_t t = 0; t < tokens; ++t) {
    chosen.clear();
    if (skew && rng() % 10 < 8) chosen.push_back(0);
    while (chosen.size() < size_t(m.topk)) {
      const auto e = static_cast<int32_t>(rng() % uint64_t(m.experts));
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    float sum = 0;
    for (auto& x : w) sum += (x = std::exp(u(rng)));
    for (int j = 0; j < m.topk; ++j) {
      r.ids[size_t(t * m.topk + j)] = chosen[size_t(j)];
      r.wts[size_t(t * m.topk + j)] = w[size_t(j)] / sum;
      ++r.counts[size_t(chosen[size_t(j)])];
    }
  }
  r.offsets.assign(size_t(m.experts + 1), 0);
  for (int e = 0; e < m.experts; ++e) r.offsets[size_t(e + 1)] = r.offsets[size_t(e)] + r.counts[size_t(e)];
  return r;
}

// {0, 1, n/4 + 3, n/2 - 1, n/2, 3n/4 + 5, n - 2, n - 1}: both ends, both halves (dw1's gate and up rows) and rows
// across the GEMMs' 128- and 256-wide tile edges.
std::vector<int64_t> sampleRows(int64_t n) {
  std::vector<int64_t> v{0, 1, n / 4 + 3, n / 2 - 1, n / 2, 3 * n / 4 + 5, n - 2, n - 1};
  for (auto& x : v) x = std::clamp<int64_t>(x, 0, n - 1);
  return v;
}

// fp64 reference of one token through the layer, from the device's bf16 inputs.
struct TokenRef {
  std::vector<std::vector<float>> gateUp;  // [topk][2 ffn]: each slot's dispatch+GEMM row
  std::vector<double> y;                   // [hidden]: the FFN's output row
  std::vector<double> dx;                  // [hidden]: the backward's (with dout)
  std::vector<double> dtopk;               // [topk]
};

TokenRef tokenReference(const Model& m, const Routing& r, int64_t t, const void* x, const void* dout, const void* w1,
                        const void* w2) {
  const int64_t H = m.hidden, F = m.ffn;
  const std::vector<uint16_t> xt = download(bytesOf(x) + t * H * 2, size_t(H));
  const std::vector<uint16_t> dt = dout ? download(bytesOf(dout) + t * H * 2, size_t(H)) : std::vector<uint16_t>{};
  struct Slot {
    std::vector<float> gu;
    std::vector<double> y, dx;
    double dtopk = 0;
  };
  // Slots are independent: one thread each (the host part of a case's check, seconds in one thread at these sizes).
  const auto slot = [&](int j) {
    Slot o;
    const int32_t e = r.ids[size_t(t * m.topk + j)];
    const double wt = r.wts[size_t(t * m.topk + j)];
    const std::vector<uint16_t> w1e = download(bytesOf(w1) + size_t(e) * 2 * F * H * 2, size_t(2 * F * H));
    const std::vector<uint16_t> w2e = download(bytesOf(w2) + size_t(e) * H * F * 2, size_t(H * F));
    o.gu.resize(size_t(2 * F));
    for (int64_t c = 0; c < 2 * F; ++c) {
      double acc = 0;
      for (int64_t kk = 0; kk < H; ++kk)
        acc += double(bf16ToFloat(xt[size_t(kk)])) * bf16ToFloat(w1e[size_t(c * H + kk)]);
      o.gu[size_t(c)] = float(acc);
    }
    std::vector<float> h(static_cast<size_t>(F));
    for (int64_t f = 0; f < F; ++f) {
      const float g = o.gu[size_t(f)], up = o.gu[size_t(F + f)];
      h[size_t(f)] = roundBf16(g / (1.0f + std::exp(-g)) * up);  // the forward's SwiGLU epilogue rounds h once
    }
    o.y.assign(size_t(H), 0.0);
    for (int64_t c = 0; c < H; ++c) {
      double acc = 0;
      for (int64_t f = 0; f < F; ++f) acc += double(h[size_t(f)]) * bf16ToFloat(w2e[size_t(c * F + f)]);
      o.y[size_t(c)] = wt * acc;
    }
    if (dout == nullptr) return o;
    // g = dout · w2[e] (w2[e] is [hidden, ffn]).
    std::vector<double> g(size_t(F), 0.0);
    for (int64_t c = 0; c < H; ++c) {
      const double d = bf16ToFloat(dt[size_t(c)]);
      for (int64_t f = 0; f < F; ++f) g[size_t(f)] += d * bf16ToFloat(w2e[size_t(c * F + f)]);
    }
    // The backward recomputes gate|up into the dtype, and rounds d(gate|up) to it before dx and dw1.
    std::vector<float> dgu(size_t(2 * F));
    for (int64_t f = 0; f < F; ++f) {
      const double gate = roundBf16(o.gu[size_t(f)]), up = roundBf16(o.gu[size_t(F + f)]);
      const double sg = 1.0 / (1.0 + std::exp(-gate)), silu = gate * sg;
      o.dtopk += g[size_t(f)] * silu * up;
      const double dh = wt * g[size_t(f)];
      dgu[size_t(f)] = roundBf16(float(dh * up * sg * (1.0 + gate * (1.0 - sg))));
      dgu[size_t(F + f)] = roundBf16(float(dh * silu));
    }
    // dx = d(gate|up) · w1[e] (w1[e] is [2 ffn, hidden]).
    o.dx.assign(size_t(H), 0.0);
    for (int64_t rr = 0; rr < 2 * F; ++rr) {
      const double d = dgu[size_t(rr)];
      for (int64_t c = 0; c < H; ++c) o.dx[size_t(c)] += d * bf16ToFloat(w1e[size_t(rr * H + c)]);
    }
    return o;
  };
  std::vector<std::future<Slot>> futures;
  for (int j = 0; j < m.topk; ++j) futures.push_back(std::async(std::launch::async, slot, j));
  TokenRef ref;
  ref.y.assign(size_t(H), 0.0);
  if (dout) ref.dx.assign(size_t(H), 0.0);
  for (auto& fu : futures) {  // summed in slot order, as the combine does
    Slot o = fu.get();
    for (int64_t c = 0; c < H; ++c) ref.y[size_t(c)] += o.y[size_t(c)];
    for (size_t c = 0; c < ref.dx.size(); ++c) ref.dx[c] += o.dx[c];
    ref.dtopk.push_back(o.dtopk);
    ref.gateUp.push_back(std::move(o.gu));
  }
  return ref;
}

// A row quantised per 1 x 128 block as the FP8 ops do (numeric.hpp's quantizeE4m3Block), dequantised in place.
void quantizeRowFp8(std::vector<float>& v) {
  for (size_t c = 0; c < v.size(); c += 128) tandem::quantizeE4m3Block(&v[c], std::min<size_t>(128, v.size() - c), &v[c]);
}

// Token t's x row (bf16 on the device), quantised as the FP8 ops' dispatch does.
std::vector<float> quantizedToken(const void* x, int64_t t, int64_t H) {
  std::vector<float> xt;
  for (uint16_t v : download(bytesOf(x) + t * H * 2, size_t(H))) xt.push_back(bf16ToFloat(v));
  quantizeRowFp8(xt);
  return xt;
}

// Expert e's e4m3 weight [rows, cols] (device) times its 128 x 128 block scales.
std::vector<float> dequantExpert(const void* q, const void* sc, int e, int64_t rows, int64_t cols) {
  const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  const auto bytes = download<uint8_t>(bytesOf(q) + size_t(e) * rows * cols, size_t(rows * cols));
  const auto scales = download<float>(bytesOf(sc) + size_t(e) * rb * cb * 4, size_t(rb * cb));
  std::vector<float> w(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = tandem::loadElement(reinterpret_cast<const std::byte*>(&bytes[size_t(i * cols + c)]),
                                          tandem::DType::kF8E4M3, 0);
      w[size_t(i * cols + c)] = v * scales[size_t((i / 128) * cb + c / 128)];
    }
  return w;
}

// fp64 reference of token t's dispatch+GEMM rows with FP8 weights (w1's e4m3 as w, n_out = 2 ffn), slot after slot:
// the quantised x times each slot's dequantised expert weight.
std::vector<float> tokenGemmReferenceFp8(const Model& m, const Routing& r, int64_t t, const void* x, const void* w1q,
                                         const void* w1s) {
  const int64_t H = m.hidden, N = 2 * m.ffn;
  const std::vector<float> xt = quantizedToken(x, t, H);
  std::vector<float> rows;
  for (int j = 0; j < m.topk; ++j) {
    const std::vector<float> w = dequantExpert(w1q, w1s, r.ids[size_t(t * m.topk + j)], N, H);
    for (int64_t o = 0; o < N; ++o) {
      double acc = 0;
      for (int64_t kk = 0; kk < H; ++kk) acc += double(xt[size_t(kk)]) * w[size_t(o * H + kk)];
      rows.push_back(float(acc));
    }
  }
  return rows;
}

// fp64 reference of one token through the FP8 layer (tandem.h, FP8 weights): x and h quantised per 1 x 128 block as
// the op does (numeric.hpp's quantizeE4m3Block), the weights dequantised with their block scales.
std::vector<double> tokenReferenceFp8(const Model& m, const Routing& r, int64_t t, const void* x, const void* w1q,
                                      const void* w1s, const void* w2q, const void* w2s) {
  const int64_t H = m.hidden, F = m.ffn;
  const std::vector<float> xt = quantizedToken(x, t, H);
  const auto slot = [&](int j) {
    const int32_t e = r.ids[size_t(t * m.topk + j)];
    const double wt = r.wts[size_t(t * m.topk + j)];
    const std::vector<float> w1e = dequantExpert(w1q, w1s, e, 2 * F, H), w2e = dequantExpert(w2q, w2s, e, H, F);
    std::vector<float> h(static_cast<size_t>(F));
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t kk = 0; kk < H; ++kk) {
        g += double(xt[size_t(kk)]) * w1e[size_t(f * H + kk)];
        u += double(xt[size_t(kk)]) * w1e[size_t((F + f) * H + kk)];
      }
      h[size_t(f)] = float(g / (1.0 + std::exp(-g)) * u);
    }
    quantizeRowFp8(h);
    std::vector<double> y(static_cast<size_t>(H));
    for (int64_t c = 0; c < H; ++c) {
      double acc = 0;
      for (int64_t f = 0; f < F; ++f) acc += double(h[size_t(f)]) * w2e[size_t(c * F + f)];
      y[size_t(c)] = wt * double(roundBf16(float(acc)));  // the cuda backend rounds y to bf16 before the combine
    }
    return y;
  };
  std::vector<std::future<std::vector<double>>> futures;
  for (int j = 0; j < m.topk; ++j) futures.push_back(std::async(std::launch::async, slot, j));
  std::vector<double> out(size_t(H), 0.0);
  for (auto& fu : futures) {  // slot order, as the combine
    const std::vector<double> y = fu.get();
    for (int64_t c = 0; c < H; ++c) out[size_t(c)] += y[size_t(c)];
  }
  return out;
}

// Timings of one case in print order: JSON key, label, ms, flops (0: no TFLOP/s column).
struct Timings {
  struct Row {
    std::string key, label;
    double ms, flops;
  };
  std::vector<Row> rows;
  std::vector<std::string> notes;  // ratio lines, printed under the rows
  double add(const std::string& key, const std::string& label, double ms, double flops) {
    rows.push_back({key, label, ms, flops});
    return ms;
  }
  void note(const char* label, double ratio, const std::string& what) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%-10s %6s %7s  %-24s %9.3f  ", "", "", "", label, ratio);
    notes.push_back(buf + what);
  }
};

// One model's buffers, sized for its largest routing.
struct Buffers {
  Buffers(const Model& m, int64_t tokens, int64_t rows, bool backward, bool saved, bool fp8)
      : w1(size_t(m.experts) * 2 * m.ffn * m.hidden * 2),
        w2(size_t(m.experts) * m.hidden * m.ffn * 2),
        dw1(backward ? w1.bytes() : 0),
        dw2(backward ? w2.bytes() : 0),
        x{DevMem(size_t(tokens) * m.hidden * 2), DevMem(size_t(tokens) * m.hidden * 2)},
        dout{DevMem(size_t(tokens) * m.hidden * 2), DevMem(size_t(tokens) * m.hidden * 2)},
        ids{DevMem(size_t(rows) * 4), DevMem(size_t(rows) * 4)},
        wts{DevMem(size_t(rows) * 4), DevMem(size_t(rows) * 4)},
        out(size_t(tokens) * m.hidden * 2),
        dx(size_t(tokens) * m.hidden * 2),
        dtopk(size_t(rows) * 4),
        rowInfo(size_t(rows) * 16),
        counts(size_t(m.experts) * 4),
        offsets(size_t(m.experts + 1) * 4),
        control(k::kMoeControlBytes),
        recv(k::moeRecvBytes(rows, m.hidden, m.ffn, backward)),
        scratch(k::moeScratchBytes(tokens, m.topk, m.experts)),
        px(size_t(rows) * m.hidden * 2),
        pdy(size_t(rows) * m.hidden * 2),
        pgu(size_t(rows) * 2 * m.ffn * 2),
        ph(size_t(rows) * m.ffn * 2),
        pg(size_t(rows) * m.ffn * 2),
        py(size_t(rows) * m.hidden * 2),
        saved(saved ? size_t(rows) * 2 * m.ffn * 2 : 0),
        tileCounter(4),
        w1q(fp8 ? w1.bytes() / 2 : 0),
        w2q(fp8 ? w2.bytes() / 2 : 0),
        w1s(fp8 ? size_t(m.experts) * ((2 * m.ffn + 127) / 128) * ((m.hidden + 127) / 128) * 4 : 0),
        w2s(fp8 ? size_t(m.experts) * ((m.hidden + 127) / 128) * ((m.ffn + 127) / 128) * 4 : 0),
        pxq(fp8 ? size_t(rows) * m.hidden : 0),
        pxs(fp8 ? size_t(m.hidden / 128) * size_t((rows + 3) / 4 * 4) * 4 : 0),
        phq(fp8 ? size_t(rows) * m.ffn : 0),
        phs(fp8 ? size_t(m.ffn / 128) * size_t((rows + 3) / 4 * 4) * 4 : 0) {
    // Uniform in [-1, 1): activations grow with sqrt(k), which bf16's range takes; fine for timing and relative checks.
    fill(w1, w1.bytes() / 2, kSeedW1);
    fill(w2, w2.bytes() / 2, kSeedW2);
    for (int i = 0; i < kSets; ++i) {
      fill(x[i], x[i].bytes() / 2, kSeedX + uint64_t(i));
      fill(dout[i], dout[i].bytes() / 2, kSeedDout + uint64_t(i));
    }
    // The GEMMs-alone operands: permuted rows of the same distribution (their values only set the power draw).
    int seed = 0;
    for (const DevMem* p : {&px, &pdy, &pgu, &ph, &pg, &py}) fill(*p, p->bytes() / 2, kSeedPool + uint64_t(seed++));
    CK(cudaMemset(control.get(), 0, k::kMoeControlBytes));
    if (fp8) {  // the same weights in e4m3; the GEMMs-alone operands in e4m3 with unit scales (they only set the load)
      quantizeWeights(w1, m.experts, 2 * m.ffn, m.hidden, w1q, w1s);
      quantizeWeights(w2, m.experts, m.hidden, m.ffn, w2q, w2s);
      CK(cudaMemset(pxq.get(), 0x38, pxq.bytes()));  // e4m3 0x38 = 1.0
      CK(cudaMemset(phq.get(), 0x38, phq.bytes()));
      CK(cudaMemset(pxs.get(), 0x3c, pxs.bytes()));  // fp32 0x3c3c3c3c: about 0.0115
      CK(cudaMemset(phs.get(), 0x3c, phs.bytes()));
    }
    CK(cudaDeviceSynchronize());
  }
  DevMem w1, w2, dw1, dw2;
  DevMem x[kSets], dout[kSets], ids[kSets], wts[kSets];
  DevMem out, dx, dtopk, rowInfo, counts, offsets;
  DevMem control, recv, scratch;
  // Rows already grouped by expert, for the GEMMs alone: x, dout, gate|up (or d(gate|up)), h, dout·w2, y (or dx).
  DevMem px, pdy, pgu, ph, pg, py;
  DevMem saved;  // the forward's saved gate|up [rows, 2 ffn] (--saved)
  DevMem tileCounter;
  // --dtype fp8: w1 and w2 in e4m3 with their block scales; the FP8 GEMMs-alone operands (x and h with 1 x 128 scales).
  DevMem w1q, w2q, w1s, w2s, pxq, pxs, phq, phs;
};

enum class Op { kDispatchGemm, kFfn, kBackward };

class ModelBench {
 public:
  ModelBench(const Model& m, const Options& o, int64_t maxTokens, cudaStream_t s)
      : m_(m), o_(o), s_(s), b_(m, maxTokens, maxTokens * m.topk, o.bwd, o.bwd && o.saved, o.fp8) {
    comm_.rank = 0;
    comm_.nranks = 1;
    comm_.control[0] = b_.control.get();
    comm_.recv[0] = b_.recv.get();
    comm_.recvBytes = b_.recv.bytes();
    comm_.scratch = b_.scratch.get();
    comm_.scratchBytes = b_.scratch.bytes();
    comm_.timeoutNs = 20'000'000'000ull;
  }

  // Checks, times and prints one routing; appends its JSON object to `json`. False when a check failed.
  bool runCase(const Routing& r, std::string& json);

 private:
  // saved: the FFN writes gate|up into b_.saved, the backward reads it from there (--saved); fp8: the FFN with the FP8
  // weights (--dtype fp8).
  std::string run(Op op, int set, int skip = 0, bool dyn = false, bool saved = false, bool fp8 = false) {
    k::MoeParams p;
    p.dtype = k::GemmDtype::kBf16;
    p.ffn = op != Op::kDispatchGemm;
    p.backward = op == Op::kBackward;
    p.tokens = r_->tokens;
    p.hidden = m_.hidden;
    p.nOut = 2 * m_.ffn;
    p.ffnDim = m_.ffn;
    p.experts = m_.experts;
    p.topk = m_.topk;
    p.capacity = r_->rows();
    p.x = b_.x[set].get();
    p.topkIds = b_.ids[set].as<int32_t>();
    p.topkWeights = b_.wts[set].as<float>();
    p.w = b_.w1.get();
    p.w1 = b_.w1.get();
    p.w2 = b_.w2.get();
    p.out = op == Op::kDispatchGemm ? b_.pgu.get() : b_.out.get();
    p.rowInfo = b_.rowInfo.as<int32_t>();
    p.expertCounts = b_.counts.as<int32_t>();
    p.dout = b_.dout[set].get();
    p.dx = b_.dx.get();
    p.dtopkWeights = b_.dtopk.as<float>();
    p.dw1 = b_.dw1.get();
    p.dw2 = b_.dw2.get();
    p.gemmSkipIdleHalves = skip;
    p.gemmDynamicTiles = dyn;
    if (saved) {
      p.saved = b_.saved.get();
      p.savedRows = r_->rows();
    }
    if (fp8) {  // dispatch+GEMM: w1's e4m3 as w (n_out 2 ffn), as its bf16 run uses w1
      p.fp8 = true;
      p.w = b_.w1q.get();
      p.w1 = b_.w1q.get();
      p.w2 = b_.w2q.get();
      p.wScale = b_.w1s.as<float>();
      p.w1Scale = b_.w1s.as<float>();
      p.w2Scale = b_.w2s.as<float>();
    }
    comm_.epoch = ++epoch_;
    return k::launchMoe(p, comm_, s_);
  }

  // One FP8 grouped GEMM on the case's groups (the op's gemm1 with SwiGLU or gemm2), rows already permuted.
  void gemmFp8(bool first) {
    const int64_t rows = r_->rows(), ld = (rows + 3) / 4 * 4;
    k::GroupedGemmFp8Params g{};
    g.x = first ? b_.pxq.get() : b_.phq.get();
    g.xScale = (first ? b_.pxs : b_.phs).as<float>();
    g.ldxScale = ld;
    g.w = first ? b_.w1q.get() : b_.w2q.get();
    g.wScale = (first ? b_.w1s : b_.w2s).as<float>();
    g.wScaling = k::GroupedFp8WeightScaling::kBlock;
    g.out = first ? b_.phq.get() : b_.py.get();
    g.outScale = first ? b_.phs.as<float>() : nullptr;
    g.ldOutScale = first ? ld : 0;
    g.groupOffsets = b_.offsets.as<int32_t>();
    g.mTotal = rows;
    g.n = first ? 2 * m_.ffn : m_.hidden;
    g.k = first ? m_.hidden : m_.ffn;
    g.numExperts = m_.experts;
    g.epilogue = first ? Epi::kSwiGlu : Epi::kStore;
    k::launchGroupedGemmFp8(g, s_);
  }
  bool checkFp8(std::string& line);
  void timeFp8(Timings& t);

  // One grouped GEMM on the case's groups: out = x · w[e]ᵀ (kABt) or x · w[e] (kAB), w as the layer stores it.
  void gemm(const DevMem& x, int64_t kk, const DevMem& w, int64_t n, const DevMem& out, Layout layout, Epi epi,
            int skip = 0, bool dyn = false) {
    k::GroupedGemmParams g{};
    g.dtype = k::GemmDtype::kBf16;
    g.groupOffsets = b_.offsets.as<int32_t>();
    g.numExperts = m_.experts;
    g.mTotal = r_->rows();
    g.x = x.get();
    g.k = kk;
    g.w = w.get();
    g.n = n;
    g.out = out.get();
    g.epilogue = epi;
    g.layout = layout;
    g.skipIdleHalves = skip;
    g.maxGroupRows = r_->tokens;  // as launchMoe passes it: the same path
    if (dyn) {
      CK(cudaMemsetAsync(b_.tileCounter.get(), 0, 4, s_));
      g.tileCounter = b_.tileCounter.as<uint32_t>();
    }
    k::launchGroupedGemm(g, s_);
  }
  // out[e] [mm, n] = a_eᵀ · b_e over the case's groups.
  void wgrad(const DevMem& a, int64_t mm, const DevMem& bb, int64_t n, const DevMem& out) {
    k::GroupedWgradParams w{};
    w.a = a.get();
    w.b = bb.get();
    w.out = out.get();
    w.groupOffsets = b_.offsets.as<int32_t>();
    w.mTotal = r_->rows();
    w.m = mm;
    w.n = n;
    w.numExperts = m_.experts;
    w.dtype = k::GemmDtype::kBf16;
    w.outDtype = k::GemmOut::kInput;
    k::launchGroupedWgrad(w, s_);
  }
  double time(const std::function<void(int)>& fn) { return timeCalls(s_, o_.iters, fn); }

  bool check(std::string& line);
  void writeInputs() const;
  void writeGradientSamples() const;
  void timeForward(Timings& t, bool& ok);
  void timeBackward(Timings& t);
  bool checkSaved(std::string& line);
  void timeSaved(Timings& t);
  bool experiment();

  const Model& m_;
  const Options& o_;
  cudaStream_t s_;
  Buffers b_;
  k::MoeComm comm_;
  uint64_t epoch_ = 0;
  const Routing* r_ = nullptr;
  std::vector<uint16_t> ffnRow_;  // the checked token's FFN row (default GEMM options), for the bitwise comparisons
  int64_t checkedToken_ = 0;
};

std::string prefixOf(const std::string& dir, const Model& m, const Routing& r) {
  return dir + "/" + m.name + "." + r.name;
}

// The routing, the seeds and probes of every input (moe_baseline.py regenerates the tensors and compares the probes).
void ModelBench::writeInputs() const {
  const std::string pre = prefixOf(o_.routingDir, m_, *r_);
  writeFile(pre + ".ids", r_->ids);
  writeFile(pre + ".wts", r_->wts);
  const auto probe = [&](const char* name, const DevMem& t, size_t elems, uint64_t seed) {
    const std::vector<size_t> at{0, 1, elems / 2, elems - 1};
    std::vector<unsigned> bits;
    for (size_t i : at) bits.push_back(download(bytesOf(t.get()) + i * 2, 1)[0]);
    return std::string("\"") + name + "\": {\"seed\": " + std::to_string(seed) +
           ", \"numel\": " + std::to_string(elems) + ", \"index\": " + jsonList(at) + ", \"bits\": " + jsonList(bits) +
           "}";
  };
  const size_t xElems = size_t(r_->tokens) * m_.hidden;
  std::ostringstream j;
  j << "{\"model\": \"" << m_.name << "\", \"case\": \"" << r_->name << "\", \"hidden\": " << m_.hidden
    << ", \"ffn\": " << m_.ffn << ", \"experts\": " << m_.experts << ", \"topk\": " << m_.topk
    << ", \"tokens\": " << r_->tokens << ", \"backward\": " << (o_.bwd ? "true" : "false") << ", \"inputs\": {"
    << probe("w1", b_.w1, b_.w1.bytes() / 2, kSeedW1) << ", " << probe("w2", b_.w2, b_.w2.bytes() / 2, kSeedW2);
  for (int i = 0; i < kSets; ++i) {
    j << ", " << probe(("x" + std::to_string(i)).c_str(), b_.x[i], xElems, kSeedX + uint64_t(i)) << ", "
      << probe(("dout" + std::to_string(i)).c_str(), b_.dout[i], xElems, kSeedDout + uint64_t(i));
  }
  j << "}";
  if (o_.bwd) {
    std::vector<int64_t> toks;
    for (int i = 0; i < kCheckTokens; ++i) toks.push_back((2 * i + 1) * r_->tokens / (2 * kCheckTokens));
    j << ", \"samples\": {\"tokens\": " << jsonList(toks) << ", \"dw1_rows\": " << jsonList(sampleRows(2 * m_.ffn))
      << ", \"dw2_rows\": " << jsonList(sampleRows(m_.hidden)) << "}";
  }
  j << "}\n";
  std::ofstream(pre + ".json") << j.str();
}

// The backward's outputs of set 0 at the samples writeInputs named.
void ModelBench::writeGradientSamples() const {
  const std::string pre = prefixOf(o_.routingDir, m_, *r_);
  const int64_t H = m_.hidden, F = m_.ffn;
  std::vector<uint16_t> dx;
  for (int i = 0; i < kCheckTokens; ++i) {
    const int64_t t = (2 * i + 1) * r_->tokens / (2 * kCheckTokens);
    const auto row = download(b_.dx.at(size_t(t * H * 2)), size_t(H));
    dx.insert(dx.end(), row.begin(), row.end());
  }
  writeFile(pre + ".dx", dx);
  writeFile(pre + ".dtopk", download<float>(b_.dtopk.get(), size_t(r_->rows())));
  const auto rowsOf = [&](const DevMem& dw, int64_t rowsPerExpert, int64_t cols) {
    std::vector<uint16_t> v;
    for (int e = 0; e < m_.experts; ++e) {
      for (int64_t rr : sampleRows(rowsPerExpert)) {
        const auto row = download(dw.at(size_t((e * rowsPerExpert + rr) * cols * 2)), size_t(cols));
        v.insert(v.end(), row.begin(), row.end());
      }
    }
    return v;
  };
  writeFile(pre + ".dw1", rowsOf(b_.dw1, 2 * F, H));
  writeFile(pre + ".dw2", rowsOf(b_.dw2, H, F));
}

// Runs each op once on set 0 and checks it: the dispatch's layout, finite outputs, one token against the host.
bool ModelBench::check(std::string& line) {
  const Routing& r = *r_;
  const int64_t rows = r.rows(), H = m_.hidden, F = m_.ffn;
  bool ok = true;
  std::ostringstream msg;
  char buf[96];
  std::vector<int32_t> info;
  if (o_.fwd) {
    run(Op::kDispatchGemm, 0);
    syncOrDie(s_, 60, "dispatch+GEMM");
    info = download<int32_t>(b_.rowInfo.get(), size_t(rows) * 4);
    bool layoutOk = download<int32_t>(b_.counts.get(), size_t(m_.experts)) == r.counts;
    for (int64_t i = 0, e = 0, seen = 0; i < rows && layoutOk; ++i) {  // expert order, then token order
      while (e < m_.experts && seen == r.counts[size_t(e)]) {
        ++e;
        seen = 0;
      }
      const int32_t* ri = &info[size_t(i * 4)];
      layoutOk = ri[0] == 0 && ri[3] == e && r.ids[size_t(ri[1] * m_.topk + ri[2])] == e &&
                 (seen == 0 || ri[1] > info[size_t((i - 1) * 4 + 1)]);
      ++seen;
    }
    const bool finite = allFinite(b_.pgu.get(), size_t(rows) * 2 * F);
    ok = ok && layoutOk && finite;
    msg << "layout " << (layoutOk ? "exact" : "WRONG") << ", gemm rows finite " << (finite ? "yes" : "NO") << "; ";
  }
  run(Op::kFfn, 0);
  syncOrDie(s_, 60, "FFN");
  const bool ffnFinite = allFinite(b_.out.get(), size_t(r.tokens) * H);
  ok = ok && ffnFinite;
  msg << "ffn finite " << (ffnFinite ? "yes" : "NO");
  const int64_t t0 = r.tokens / 2;  // a token away from the edges
  checkedToken_ = t0;
  ffnRow_ = download(b_.out.at(size_t(t0 * H * 2)), size_t(H));
  if (o_.bwd) {
    run(Op::kBackward, 0);
    syncOrDie(s_, 120, "backward");
    const std::vector<float> dtopk = download<float>(b_.dtopk.get(), size_t(rows));
    const bool finite = allFinite(b_.dx.get(), size_t(r.tokens) * H) && allFinite(b_.dw1.get(), b_.dw1.bytes() / 2) &&
                        allFinite(b_.dw2.get(), b_.dw2.bytes() / 2) &&
                        std::all_of(dtopk.begin(), dtopk.end(), [](float v) { return std::isfinite(v); });
    ok = ok && finite;
    msg << ", backward finite " << (finite ? "yes" : "NO");
    if (!o_.routingDir.empty()) writeGradientSamples();
  }

  const TokenRef ref =
      tokenReference(m_, r, t0, b_.x[0].get(), o_.bwd ? b_.dout[0].get() : nullptr, b_.w1.get(), b_.w2.get());
  const auto report = [&](const char* what, double err) {
    ok = ok && err < kTolerance;
    std::snprintf(buf, sizeof buf, " %s %.2e", what, err);
    msg << buf;
  };
  msg << "; token " << t0 << " rel_err:";
  if (o_.fwd) {
    std::vector<float> got, want;  // the token's slots' dispatch+GEMM rows
    for (int j = 0; j < m_.topk; ++j) {
      int64_t row = -1;
      for (int64_t i = 0; i < rows; ++i) {
        if (info[size_t(i * 4 + 1)] == t0 && info[size_t(i * 4 + 2)] == j) row = i;
      }
      if (row < 0) {
        line = "no dispatch+GEMM row for token " + std::to_string(t0) + ", slot " + std::to_string(j);
        return false;
      }
      for (uint16_t v : download(b_.pgu.at(size_t(row * 2 * F * 2)), size_t(2 * F))) got.push_back(bf16ToFloat(v));
      want.insert(want.end(), ref.gateUp[size_t(j)].begin(), ref.gateUp[size_t(j)].end());
    }
    report("gemm", relError(got, want));
  }
  std::vector<float> y;
  for (uint16_t v : ffnRow_) y.push_back(bf16ToFloat(v));
  report("ffn", relError(y, ref.y));
  if (o_.bwd) {
    std::vector<float> dx;
    for (uint16_t v : download(b_.dx.at(size_t(t0 * H * 2)), size_t(H))) dx.push_back(bf16ToFloat(v));
    report("dx", relError(dx, ref.dx));
    report("dtopk", relError(download<float>(b_.dtopk.at(size_t(t0 * m_.topk * 4)), size_t(m_.topk)), ref.dtopk));
  }
  line = msg.str();
  return ok;
}

// The FP8 FFN once on set 0: finite, and one token against the fp64 reference of the quantised layer.
bool ModelBench::checkFp8(std::string& line) {
  const int64_t H = m_.hidden;
  run(Op::kFfn, 0, 0, false, false, true);
  syncOrDie(s_, 60, "FFN FP8");
  const bool finite = allFinite(b_.out.get(), size_t(r_->tokens) * H);
  const int64_t t0 = r_->tokens / 2;
  std::vector<float> got;
  for (uint16_t v : download(b_.out.at(size_t(t0 * H * 2)), size_t(H))) got.push_back(bf16ToFloat(v));
  const double err = relError(got, tokenReferenceFp8(m_, *r_, t0, b_.x[0].get(), b_.w1q.get(), b_.w1s.get(),
                                                     b_.w2q.get(), b_.w2s.get()));
  // How far FP8 moves the layer's output from bf16's (the quantisation itself; not checked, for the record).
  std::vector<float> bf;
  for (uint16_t v : ffnRow_) bf.push_back(bf16ToFloat(v));
  char buf[160];
  std::snprintf(buf, sizeof buf, "fp8 ffn finite %s; token %lld rel_err vs the quantised reference %.2e (vs bf16 %.2e)",
                finite ? "yes" : "NO", static_cast<long long>(t0), err, relError(got, bf));
  line = buf;
  bool ok = finite && err < kFp8Tolerance;
  if (o_.fwd) {  // dispatch+GEMM with FP8 weights: the bf16 run's row layout, the token's rows against the reference
    const int64_t rows = r_->rows(), N = 2 * m_.ffn;
    run(Op::kDispatchGemm, 0);
    syncOrDie(s_, 60, "dispatch+GEMM");
    const std::vector<int32_t> info = download<int32_t>(b_.rowInfo.get(), size_t(rows) * 4);
    run(Op::kDispatchGemm, 0, 0, false, false, true);
    syncOrDie(s_, 60, "dispatch+GEMM FP8");
    const bool layoutOk = download<int32_t>(b_.rowInfo.get(), size_t(rows) * 4) == info &&
                          download<int32_t>(b_.counts.get(), size_t(m_.experts)) == r_->counts;
    const bool rowsFinite = allFinite(b_.pgu.get(), size_t(rows) * N);
    std::vector<float> rowsGot;
    for (int j = 0; j < m_.topk; ++j) {
      for (int64_t i = 0; i < rows; ++i) {
        if (info[size_t(i * 4 + 1)] != t0 || info[size_t(i * 4 + 2)] != j) continue;
        for (uint16_t v : download(b_.pgu.at(size_t(i * N * 2)), size_t(N))) rowsGot.push_back(bf16ToFloat(v));
      }
    }
    // One GEMM from the quantised x, no h to round: within bf16's tolerance of the fp64 reference.
    const double gemmErr =
        relError(rowsGot, tokenGemmReferenceFp8(m_, *r_, t0, b_.x[0].get(), b_.w1q.get(), b_.w1s.get()));
    std::snprintf(buf, sizeof buf, "; fp8 dispatch+GEMM layout %s, rows finite %s, token rel_err %.2e",
                  layoutOk ? "exact" : "WRONG", rowsFinite ? "yes" : "NO", gemmErr);
    line += buf;
    ok = ok && layoutOk && rowsFinite && gemmErr < kTolerance;
  }
  return ok;
}

void ModelBench::timeFp8(Timings& t) {
  const int64_t rows = r_->rows(), H = m_.hidden, F = m_.ffn;
  const double g1 = 2.0 * double(rows) * H * 2 * F, g2 = 2.0 * double(rows) * F * H;
  const double fp8 = t.add("ffn_fp8_ms", "FFN FP8 (whole layer)",
                           time([&](int set) { run(Op::kFfn, set, 0, false, false, true); }), g1 + g2);
  t.add("gemm1_swiglu_fp8_ms", "FP8 gemm1+SwiGLU alone", time([&](int) { gemmFp8(true); }), g1);
  t.add("gemm2_fp8_ms", "FP8 gemm2 alone", time([&](int) { gemmFp8(false); }), g2);
  const double bf16 = t.rows.front().key == "ffn_ms" ? t.rows.front().ms : 0;
  t.note("bf16 / FP8", bf16 / fp8, "(FFN bf16 ms / FFN FP8 ms, same routing; target >= 1.6 at DeepSeek-V3)");
}

void ModelBench::timeForward(Timings& t, bool& ok) {
  const int64_t rows = r_->rows(), H = m_.hidden, F = m_.ffn;
  const double g1 = 2.0 * double(rows) * H * 2 * F, g2 = 2.0 * double(rows) * F * H;
  const double dg = t.add("dispatch_gemm_ms", "dispatch+GEMM", time([&](int set) { run(Op::kDispatchGemm, set); }), g1);
  if (o_.fp8) {
    const double dg8 = t.add("dispatch_gemm_fp8_ms", "dispatch+GEMM FP8",
                             time([&](int set) { run(Op::kDispatchGemm, set, 0, false, false, true); }), g1);
    t.note("dg bf16 / FP8", dg / dg8, "(dispatch+GEMM bf16 ms / FP8 ms, same routing)");
  }
  t.add("gemm1_ms", "gemm1 alone", time([&](int) { gemm(b_.px, H, b_.w1, 2 * F, b_.pgu, Layout::kABt, Epi::kStore); }),
        g1);
  const double g1s = t.add("gemm1_swiglu_ms", "gemm1+SwiGLU alone",
                           time([&](int) { gemm(b_.px, H, b_.w1, 2 * F, b_.ph, Layout::kABt, Epi::kSwiGlu); }), g1);
  const double g2ms = t.add("gemm2_ms", "gemm2 alone",
                            time([&](int) { gemm(b_.ph, F, b_.w2, H, b_.py, Layout::kABt, Epi::kStore); }), g2);
  // The same with skipIdleHalves (a warpgroup whose rows all lie past its group's end skips its wgmmas).
  t.add("gemm1_skip_ms", "gemm1, skipIdleHalves",
        time([&](int) { gemm(b_.px, H, b_.w1, 2 * F, b_.pgu, Layout::kABt, Epi::kStore, 1); }), g1);
  t.add("gemm1_swiglu_skip_ms", "gemm1+SwiGLU, skip..",
        time([&](int) { gemm(b_.px, H, b_.w1, 2 * F, b_.ph, Layout::kABt, Epi::kSwiGlu, 1); }), g1);
  t.add("gemm2_skip_ms", "gemm2, skipIdleHalves",
        time([&](int) { gemm(b_.ph, F, b_.w2, H, b_.py, Layout::kABt, Epi::kStore, 1); }), g2);
  t.add("ffn_skip_ms", "FFN, skipIdleHalves", time([&](int set) { run(Op::kFfn, set, 1); }), g1 + g2);
  run(Op::kFfn, 0, 1);
  syncOrDie(s_, 60, "FFN with skipIdleHalves");
  const bool same = download(b_.out.at(size_t(checkedToken_ * H * 2)), size_t(H)) == ffnRow_;
  ok = ok && same;
  const double ffn = t.rows.front().key == "ffn_ms" ? t.rows.front().ms : 0;
  t.note("overlap ratio", (g1s + g2ms) / ffn,
         std::string("(gemm1+SwiGLU + gemm2 alone / FFN; target >= 0.95); skipIdleHalves FFN row ") +
             (same ? "bitwise the same" : "DIFFERS"));
}

void ModelBench::timeBackward(Timings& t) {
  const int64_t rows = r_->rows(), H = m_.hidden, F = m_.ffn;
  const double g1 = 2.0 * double(rows) * H * 2 * F, g2 = 2.0 * double(rows) * F * H;
  const double bwd = t.add("bwd_ms", "backward", time([&](int set) { run(Op::kBackward, set); }), 3 * g1 + 2 * g2);
  t.add("fwd_bwd_ms", "fwd+bwd", time([&](int set) {
          run(Op::kFfn, set);
          run(Op::kBackward, set);
        }),
        4 * g1 + 3 * g2);
  const double rec = t.add("bwd_recompute_ms", "recompute gate|up alone",
                           time([&](int) { gemm(b_.px, H, b_.w1, 2 * F, b_.pgu, Layout::kABt, Epi::kStore); }), g1);
  const double dh = t.add("bwd_dout_w2_ms", "dout·w2 alone",
                          time([&](int) { gemm(b_.pdy, H, b_.w2, F, b_.pg, Layout::kAB, Epi::kStore); }), g2);
  const double dx = t.add("bwd_dx_ms", "dx alone",
                          time([&](int) { gemm(b_.pgu, 2 * F, b_.w1, H, b_.py, Layout::kAB, Epi::kStore); }), g1);
  const double dw2 = t.add("bwd_dw2_ms", "dw2 alone", time([&](int) { wgrad(b_.pdy, H, b_.ph, F, b_.dw2); }), g2);
  const double dw1 = t.add("bwd_dw1_ms", "dw1 alone", time([&](int) { wgrad(b_.pgu, 2 * F, b_.px, H, b_.dw1); }), g1);
  const double four = dh + dx + dw2 + dw1;
  t.note("backward / its GEMMs", bwd / (four + rec),
         "(backward / its 5 GEMMs alone: recompute gate|up, dout·w2, dx, dw2, dw1; target <= 1.10)");
  t.note("backward / 4 GEMMs", bwd / four, "(backward / dout·w2, dx, dw2, dw1 alone: without the recompute)");
}

// The backward from the forward's saved gate|up against the recomputing backward (run by check() just before, set 0):
// the checked token's dx against the fp64 reference, and whether every output is the same bits.
bool ModelBench::checkSaved(std::string& line) {
  const int64_t H = m_.hidden, rows = r_->rows();
  run(Op::kBackward, 0);
  syncOrDie(s_, 120, "backward (recomputing)");
  const std::vector<uint16_t> plainDx = download(b_.dx.get(), size_t(r_->tokens * H));
  const std::vector<float> plainDtopk = download<float>(b_.dtopk.get(), size_t(rows));
  DevMem plainDw1(b_.dw1.bytes()), plainDw2(b_.dw2.bytes());
  CK(cudaMemcpy(plainDw1.get(), b_.dw1.get(), b_.dw1.bytes(), cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(plainDw2.get(), b_.dw2.get(), b_.dw2.bytes(), cudaMemcpyDeviceToDevice));
  CK(cudaDeviceSynchronize());  // the copies ran on the legacy stream; s_ does not wait for it
  run(Op::kFfn, 0, 0, false, true);
  run(Op::kBackward, 0, 0, false, true);
  syncOrDie(s_, 120, "backward from saved activations");
  const bool same = download(b_.dx.get(), size_t(r_->tokens * H)) == plainDx &&
                    download<float>(b_.dtopk.get(), size_t(rows)) == plainDtopk &&
                    sameBits(b_.dw1.get(), plainDw1.get(), b_.dw1.bytes()) &&
                    sameBits(b_.dw2.get(), plainDw2.get(), b_.dw2.bytes());
  const bool finite = allFinite(b_.dx.get(), size_t(r_->tokens) * H) && allFinite(b_.dw1.get(), b_.dw1.bytes() / 2) &&
                      allFinite(b_.dw2.get(), b_.dw2.bytes() / 2);
  const bool ffnSame = download(b_.out.at(size_t(checkedToken_ * H * 2)), size_t(H)) == ffnRow_;
  const TokenRef ref = tokenReference(m_, *r_, checkedToken_, b_.x[0].get(), b_.dout[0].get(), b_.w1.get(),
                                      b_.w2.get());
  std::vector<float> dx;
  for (uint16_t v : download(b_.dx.at(size_t(checkedToken_ * H * 2)), size_t(H))) dx.push_back(bf16ToFloat(v));
  const double err = relError(dx, ref.dx);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "saved activations: backward finite %s, token %ld dx rel_err %.2e, outputs %s the recomputing "
                "backward's, FFN row %s",
                finite ? "yes" : "NO", long(checkedToken_), err, same ? "bitwise" : "NOT bitwise",
                ffnSame ? "bitwise the same" : "differs (h from the rounded gate|up)");
  line = buf;
  return finite && err < kTolerance;
}

void ModelBench::timeSaved(Timings& t) {
  const int64_t rows = r_->rows(), H = m_.hidden, F = m_.ffn;
  const double g1 = 2.0 * double(rows) * H * 2 * F, g2 = 2.0 * double(rows) * F * H;
  const double ffn = t.add("ffn_saved_ms", "FFN saving gate|up",
                           time([&](int set) { run(Op::kFfn, set, 0, false, true); }), g1 + g2);
  const double bwd = t.add("bwd_saved_ms", "backward from saved",
                           time([&](int set) { run(Op::kBackward, set, 0, false, true); }), 2 * g1 + 2 * g2);
  const double fb = t.add("fwd_bwd_saved_ms", "fwd+bwd, saved", time([&](int set) {
                            run(Op::kFfn, set, 0, false, true);
                            run(Op::kBackward, set, 0, false, true);
                          }),
                          3 * g1 + 3 * g2);
  double recomputing = 0, plainFfn = 0, plainBwd = 0, four = 0;
  for (const auto& row : t.rows) {
    if (row.key == "fwd_bwd_ms") recomputing = row.ms;
    if (row.key == "ffn_ms") plainFfn = row.ms;
    if (row.key == "bwd_ms") plainBwd = row.ms;
    if (row.key == "bwd_dout_w2_ms" || row.key == "bwd_dx_ms" || row.key == "bwd_dw2_ms" || row.key == "bwd_dw1_ms")
      four += row.ms;
  }
  // The backward from saved runs exactly the four GEMMs timed alone by timeBackward (no recompute): the
  // "backward over its grouped GEMMs" of this mode.
  t.note("saved backward / its GEMMs", four > 0 ? bwd / four : 0.0,
         "(backward from saved / dout·w2, dx, dw2, dw1 alone; target <= 1.10)");
  char what[160];
  std::snprintf(what, sizeof what, "(fwd+bwd saved / recomputing; FFN %.3fx, backward %.3fx; saved %.1f MiB)",
                plainFfn > 0 ? ffn / plainFfn : 0.0, plainBwd > 0 ? bwd / plainBwd : 0.0,
                double(rows) * 2 * F * 2 / (1 << 20));
  t.note("saved / recompute", recomputing > 0 ? fb / recomputing : 0.0, what);
}

// The grouped GEMMs' dynamic tile order, alone and with skipIdleHalves; the FFN with both, bitwise against the default.
bool ModelBench::experiment() {
  const int64_t H = m_.hidden, F = m_.ffn;
  const auto g1 = [&](Epi epi, bool dyn, int skip) {
    return time(
        [&](int) { gemm(b_.px, H, b_.w1, 2 * F, epi == Epi::kStore ? b_.pgu : b_.ph, Layout::kABt, epi, skip, dyn); });
  };
  const auto g2 = [&](bool dyn, int skip) {
    return time([&](int) { gemm(b_.ph, F, b_.w2, H, b_.py, Layout::kABt, Epi::kStore, skip, dyn); });
  };
  const double a = g1(Epi::kStore, false, 0), bd = g1(Epi::kStore, true, 0), c = g1(Epi::kSwiGlu, true, 0),
               d = g1(Epi::kSwiGlu, true, 1), e = g2(true, 0), f = g2(true, 1);
  const double fd = time([&](int set) { run(Op::kFfn, set, 0, true); });
  const double fdk = time([&](int set) { run(Op::kFfn, set, 1, true); });
  run(Op::kFfn, 0, 1, true);
  syncOrDie(s_, 30, "experiment: FFN, dynamic + skip");
  const bool same = download(b_.out.at(size_t(checkedToken_ * H * 2)), size_t(H)) == ffnRow_;
  std::printf(
      "  experiment (ms; dyn = dynamic tile order, +skip = and skipIdleHalves): g1 %.4f, g1 dyn %.4f, g1s dyn "
      "%.4f, g1s +skip %.4f, g2 dyn %.4f, g2 +skip %.4f, FFN dyn %.4f, FFN +skip %.4f; FFN row %s\n",
      a, bd, c, d, e, f, fd, fdk, same ? "bitwise the same" : "DIFFERS");
  return same;
}

bool ModelBench::runCase(const Routing& r, std::string& json) {
  r_ = &r;
  for (int i = 0; i < kSets; ++i) {
    CK(cudaMemcpy(b_.ids[i].get(), r.ids.data(), r.ids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_.wts[i].get(), r.wts.data(), r.wts.size() * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(b_.offsets.get(), r.offsets.data(), r.offsets.size() * 4, cudaMemcpyHostToDevice));
  if (!o_.routingDir.empty()) writeInputs();

  std::string line;
  bool ok = check(line);
  std::printf("%s %s %s: %s\n", ok ? "ok  " : "FAIL", m_.name, r.name.c_str(), line.c_str());
  if (o_.bwd && o_.saved) {
    const bool savedOk = checkSaved(line);
    ok = ok && savedOk;
    std::printf("%s %s %s: %s\n", savedOk ? "ok  " : "FAIL", m_.name, r.name.c_str(), line.c_str());
  }
  if (o_.fp8) {
    const bool fp8ok = checkFp8(line);
    std::printf("%s %s %s: %s\n", fp8ok ? "ok  " : "FAIL", m_.name, r.name.c_str(), line.c_str());
    ok = ok && fp8ok;
  }

  Timings t;
  const int64_t rows = r.rows();
  const double ffnFlops = 2.0 * double(rows) * m_.hidden * 3 * m_.ffn;
  std::string plan = run(Op::kFfn, 0);
  t.add("ffn_ms", "FFN (whole layer)", time([&](int set) { run(Op::kFfn, set); }), ffnFlops);
  if (o_.fp8) {
    plan += " | " + run(Op::kFfn, 0, 0, false, false, true);
    timeFp8(t);
  }
  if (o_.fwd) timeForward(t, ok);
  if (o_.bwd) {
    plan += " | " + run(Op::kBackward, 0);
    timeBackward(t);
  }
  if (o_.bwd && o_.saved) {
    plan += " | " + run(Op::kFfn, 0, 0, false, true) + " | " + run(Op::kBackward, 0, 0, false, true);
    timeSaved(t);
  }
  for (size_t i = 0; i < t.rows.size(); ++i) {
    const auto& row = t.rows[i];
    std::printf("%-10s %6s %7s  %-24s %9.4f %8.1f\n", i == 0 ? r.name.c_str() : "",
                i == 0 ? std::to_string(r.tokens).c_str() : "", i == 0 ? std::to_string(rows).c_str() : "",
                row.label.c_str(), row.ms, row.flops / (row.ms * 1e-3) / 1e12);
  }
  for (const auto& n : t.notes) std::printf("%s\n", n.c_str());
  std::printf("  plans: %s\n", plan.c_str());
  if (o_.experiment) ok = experiment() && ok;
  std::fflush(stdout);

  std::ostringstream j;
  j << (json.back() == '[' ? "" : ", ") << "{\"model\": \"" << m_.name << "\", \"case\": \"" << r.name
    << "\", \"tokens\": " << r.tokens << ", \"rows\": " << rows;
  for (const auto& row : t.rows) j << ", \"" << row.key << "\": " << row.ms;
  j << ", \"ok\": " << (ok ? "true" : "false") << "}";
  json += j.str();
  return ok;
}

template <class T, class F>
std::vector<T> splitList(const std::string& s, F&& convert) {
  std::vector<T> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) v.push_back(convert(item));
  return v;
}

constexpr const char* kUsage =
    "usage: moe_bench [--iters N] [--models deepseek-v3,mixtral] [--rows-per-expert 256,512,1024,2048,4096]\n"
    "                 [--no-skew] [--pass fwd|bwd|all] [--saved] [--dtype bf16|fp8] [--routing-dir DIR] [--json FILE]\n"
    "                 [--experiment]\n"
    "  --dtype fp8: also the FFN with FP8 weights (e4m3, 128 x 128 block scales) on the same routings, its FP8\n"
    "              GEMMs alone, dispatch+GEMM with FP8 weights (forward pass), and bf16 ms / FP8 ms (--pass fwd\n"
    "              --dtype fp8 times the forward only)\n"
    "  --pass fwd: dispatch+GEMM, the FFN, its GEMMs alone; bwd: the FFN, the backward, fwd+bwd, the backward's\n"
    "              GEMMs alone; all (default): both\n"
    "  --saved: with the backward, also the forward saving gate|up and the backward from it (no recompute GEMM),\n"
    "           checked against the recomputing backward; their times go into --json (ffn_saved_ms, bwd_saved_ms,\n"
    "           fwd_bwd_saved_ms)\n"
    "  --routing-dir DIR: routings, input seeds and the backward's gradient samples for bench/moe_baseline.py\n"
    "                 (PyTorch's unfused layer on the same routing and weights; run it next in the same call:\n"
    "                 python3 bench/moe_baseline.py --routing-dir DIR --tandem FILE)\n"
    "  --json FILE: every case's times, for moe_baseline.py --tandem\n"
    "  Several GPUs (expert parallel): torchrun --nproc-per-node N python/bench/moe_step.py (through tandemd)\n"
    "  Exits 1 when a check fails, 77 without a CUDA device.\n";

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--iters" && more) {
      o.iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--routing-dir" && more) {
      o.routingDir = argv[++i];
    } else if (a == "--json" && more) {
      o.jsonPath = argv[++i];
    } else if (a == "--models" && more) {
      o.models = splitList<std::string>(argv[++i], [](const std::string& s) { return s; });
    } else if (a == "--rows-per-expert" && more) {
      o.rowsPerExpert = splitList<int>(argv[++i], [](const std::string& s) { return std::atoi(s.c_str()); });
    } else if (a == "--cases" && more) {  // the previous spelling: small = 256 rows per expert and the skewed case
      if (std::string(argv[++i]) == "small") o.rowsPerExpert = {256};
    } else if (a == "--no-skew") {
      o.skew = false;
    } else if (a == "--pass" && more &&
               (argv[i + 1] == std::string("fwd") || argv[i + 1] == std::string("bwd") ||
                argv[i + 1] == std::string("all"))) {
      const std::string p = argv[++i];
      o.fwd = p != "bwd";
      o.bwd = p != "fwd";
    } else if (a == "--experiment") {
      o.experiment = true;
    } else if (a == "--saved") {
      o.saved = true;
    } else if (a == "--dtype" && more &&
               (argv[i + 1] == std::string("bf16") || argv[i + 1] == std::string("fp8"))) {
      o.fp8 = std::string(argv[++i]) == "fp8";
    } else {
      const bool help = a == "--help" || a == "-h";
      std::fprintf(help ? stdout : stderr, "%s", kUsage);
      return help ? 0 : 2;
    }
  }
  for (const auto& name : o.models) {
    if (std::none_of(std::begin(kModels), std::end(kModels), [&](const Model& m) { return name == m.name; })) {
      std::fprintf(stderr, "moe_bench: unknown model '%s' (deepseek-v3, mixtral)\n%s", name.c_str(), kUsage);
      return 2;
    }
  }
  for (int rpe : o.rowsPerExpert) {
    if (rpe <= 0) {
      std::fprintf(stderr, "moe_bench: --rows-per-expert takes positive numbers\n");
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
  std::printf("device: %s, %d SMs; bf16%s, 1 rank, %s\n", prop.name, prop.multiProcessorCount,
              o.fp8 ? " and FP8 weights" : "",
              o.fwd && o.bwd ? "forward and backward"
              : o.fwd        ? "forward"
                             : "backward");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  bool ok = true;
  std::string json = "{\"cases\": [";
  for (const Model& m : kModels) {
    if (std::find(o.models.begin(), o.models.end(), m.name) == o.models.end()) continue;
    std::vector<Routing> routings;
    for (int rpe : o.rowsPerExpert) {
      routings.push_back(
          makeRouting(m, "random" + std::to_string(rpe), int64_t(rpe) * m.experts / m.topk, false, 7 + uint64_t(rpe)));
    }
    if (o.skew) routings.push_back(makeRouting(m, "skew512", int64_t(512) * m.experts / m.topk, true, 99));
    int64_t maxTokens = 0;
    for (const auto& r : routings) maxTokens = std::max(maxTokens, r.tokens);
    std::printf("\n%s: hidden %lld, ffn %lld, top-%d of %d experts\n%-10s %6s %7s  %-24s %9s %8s\n", m.name,
                static_cast<long long>(m.hidden), static_cast<long long>(m.ffn), m.topk, m.experts, "case", "tokens",
                "rows", "op", "ms", "TFLOP/s");
    ModelBench bench(m, o, maxTokens, s);
    for (const auto& r : routings) ok = bench.runCase(r, json) && ok;
  }
  json += "]}\n";
  if (!o.jsonPath.empty()) std::ofstream(o.jsonPath) << json;
  std::printf("%s\n", ok ? "ALL OK" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
