// The three fused GEMMs as an application runs them: through libtandem (tandem_ag_gemm, tandem_gemm_rs,
// tandem_gemm_ar) on a tandemd of the benchmark's own (backend cuda, --executor client (default) or daemon, which needs
// MPS running), one process per rank and GPU,
// against NCCL + cuBLASLt in the same processes, on the same input buffers, interleaved per iteration.
//
//   fused_e2e_bench [--iters 20] [--warmup 3] [--op ag-gemm|gemm-rs|gemm-ar] [--shape I] [--ranks 2]
//                   [--executor client|daemon] [--alloc tandem|cudamalloc] [--gathered] [--workspace BYTES]
//                   [--json FILE] [--socket PATH] [--layout nt|nn|tn] [--decode]
//                   [--fp8 e4m3|e5m2 [--scaling tensor|block] [--out bf16|fp32]]
//
// Shapes M x K x N (K is the full K; bf16 in and out, fp32 accumulation, C = A·Bᵀ with A [M,K] and B [N,K]):
//   ag-gemm (A sharded by rows): 8192x8192x8192, 4096x8192x8192, 16384x8192x14336, 1024x8192x8192, 2048x8192x8192
//     baseline: ncclAllGather of the shard, then cuBLASLt on the gathered A [M, K]
//   gemm-rs / gemm-ar (K split, k = K / ranks per rank): 8192x8192x8192, 4096x8192x8192, 16384x8192x14336,
//     1024x8192x8192; baseline: cuBLASLt on the local K slice into a bf16 [M, N] partial, then ncclReduceScatter /
//     ncclAllReduce (as bench/gemm_rs_bench.cu)
// --layout: the operands' layout (tandem_gemm_layout_t: NT A [M,K] B [N,K]; NN A [M,K] B [K,N]; TN A [K,M] B [K,N]),
// the baseline's cuBLASLt in the same layout (ag-gemm TN runs at one rank only: its gathered A is per-rank blocks).
// --decode: the decode shapes of a tensor-parallel layer instead, M = 1, 2, 4, ..., 256 at N x K = 8192 x 8192,
// 28672 x 8192, 8192 x 28672 and 14336 x 4096 (K the full K).
// --fp8: a and b in FP8 (layout nt only: fp8 tensor cores read K-major operands, tandem's and cuBLASLt's alike) with
// fp32 scales per tensor (--scaling tensor, the default) or in blocks (--scaling block: A 1x128, B 128x128, as tandem.h's
// tandem_fp8_scaling_t), c in --out (bf16, the default, or fp32). Shapes M x K x N: 8192x8192x8192, 8192x8192x28672,
// 8192x28672x8192 (N x K of a 70B-class layer's square, up and down projections); with --decode M = 1, 2, ..., 256 at
// N x K = 8192 x 8192 (block scales: M >= 4, tandem reads them in place and needs M % 4 == 0). Scales are random powers
// of two, the same on every rank. The baseline is NCCL (fp8 rows gathered as bytes; partials in c's dtype) + cuBLASLt's
// FP8 GEMM: per tensor through CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER with fast accumulation (tandem's per-tensor core
// does not promote either); block scales through CUBLASLT_MATMUL_DESC_A/B_SCALE_MODE VEC128_32F (A) and BLK128x128_32F
// (B), cuBLAS 12.9+ on sm_90, accumulation promoted (as tandem's block core). Where cuBLASLt has no FP8 GEMM for the
// inputs (e5m2 x e5m2: its FP8 kernels take e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3) the row times tandem alone, says
// why, and checks it against cuBLASLt bf16 (+ NCCL) on the dequantized inputs (exact in bf16: power-of-two scales).
// ag-gemm with block scales runs at one rank only (the baseline takes the gathered A's scales as one [k/128, M] array).
// --alloc cudamalloc gives every tensor cudaMalloc memory registered with tandem_register (default: tandem_alloc,
// tandemd's cuMem memory); --shape I runs shape I of each selected op; --gathered makes ag-gemm also write the gathered A (the baseline has it
// anyway); --workspace overrides the per-rank workspace given to tandemd (default: computed from the shapes, with room).
//
// Timing: every iteration runs tandem, the baseline and the baseline's GEMM alone, in rotating order; each op is
// preceded by a cross-rank barrier (an NCCL all-reduce of one float on the same stream) and bracketed by CUDA events on
// the rank's stream. GEMM alone is the limit of a perfect overlap; tand/gemm says how close tandem gets. Everything is
// enqueued ahead (as a training loop does) and synchronised once per shape. Per iteration the max over ranks, then
// the median over --iters after --warmup. TFLOP/s are per GPU: ag-gemm 2·M·N·K (every rank computes all of C),
// gemm-rs/ar 2·M·N·K/ranks (each rank its K slice).
// Correctness, once per shape before timing: both outputs NaN-poisoned, one op each, tandem's C against the
// baseline's C: ‖tandem − baseline‖ / ‖baseline‖ < 1e-2 (--fp8: 2e-2) and no non-finite value on any rank, else a FAIL
// line.
// Exit status: 0, 1 if a check failed, 2 on a fatal error.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_kernels.cuh"
#include "cublaslt_gemm.hpp"
#include "private_daemon.hpp"
#include "tandem/tandem.h"

#include "checks.hpp"  // after the library headers: it defines TK/NK/BK for those it finds

namespace {


// ---- shapes ---------------------------------------------------------------------------------------------------
enum class Op { kAgGemm, kGemmRs, kGemmAr };
const char* opName(Op op) { return op == Op::kAgGemm ? "ag-gemm" : op == Op::kGemmRs ? "gemm-rs" : "gemm-ar"; }

struct Shape {
  uint64_t m, k, n;  // K is the full K (gemm-rs/ar: split over the ranks)
};
const Shape kAgShapes[] = {{8192, 8192, 8192}, {4096, 8192, 8192}, {16384, 8192, 14336}, {1024, 8192, 8192},
                           {2048, 8192, 8192}};
const Shape kReduceShapes[] = {{8192, 8192, 8192}, {4096, 8192, 8192}, {16384, 8192, 14336}, {1024, 8192, 8192}};
// --decode: N x K of a TP layer's GEMMs, each at M = 1 .. 256.
const std::pair<uint64_t, uint64_t> kDecodeNK[] = {{8192, 8192}, {28672, 8192}, {8192, 28672}, {14336, 4096}};
// --fp8: M 8192 at N x K 8192 x 8192, 28672 x 8192 and 8192 x 28672; --fp8 --decode: M = 1 .. 256 at 8192 x 8192.
const Shape kFp8Shapes[] = {{8192, 8192, 8192}, {8192, 8192, 28672}, {8192, 28672, 8192}};
const std::pair<uint64_t, uint64_t> kFp8DecodeNK[] = {{8192, 8192}};

struct Case {
  Op op;
  Shape s;
  int index;  // within the op's list
};

struct Options {
  uint32_t ranks = 2;
  int iters = 20, warmup = 3;
  int shape = -1;  // -1: all
  std::string op;  // "": all three
  bool gathered = false;
  uint64_t workspace = 0;  // 0: computed
  std::string json, socket;
  std::string executor = "client";
  bool registered = false;  // --alloc cudamalloc: tensors from cudaMalloc, registered (tandem_register) instead of
                            // tandem_alloc'd (tandemd's cuMem pool)
  tandem_gemm_layout_t layout = TANDEM_GEMM_NT;
  bool decode = false;
  tandem_dtype_t dtype = TANDEM_DTYPE_BF16;  // a's and b's: bf16, or --fp8's TANDEM_DTYPE_FP8_E4M3 / _E5M2
  bool blockScale = false;                   // --scaling block (FP8 only)
  tandem_dtype_t out = TANDEM_DTYPE_BF16;    // c's (--out fp32: FP8 only)

  bool fp8() const { return dtype != TANDEM_DTYPE_BF16; }
  uint64_t inBytes() const { return fp8() ? 1 : 2; }
  uint64_t outBytes() const { return out == TANDEM_DTYPE_FP32 ? 4 : 2; }
};
const char* layoutName(tandem_gemm_layout_t l) { return l == TANDEM_GEMM_NN ? "nn" : l == TANDEM_GEMM_TN ? "tn" : "nt"; }
const char* dtypeName(tandem_dtype_t t) {
  return t == TANDEM_DTYPE_FP8_E4M3 ? "fp8-e4m3" : t == TANDEM_DTYPE_FP8_E5M2 ? "fp8-e5m2" : t == TANDEM_DTYPE_FP32 ? "fp32" : "bf16";
}

// tandem's C against the baseline's. FP8 2e-2: per tensor, tandem's core and cuBLASLt's fast accumulation each keep the
// tensor cores' fp8 accumulator (about 14 mantissa bits) over all of K, up to about 1e-2 each off the exact product
// (tandem.h); with fp32 c too.
float relErrLimit(const Options& o) { return o.fp8() ? 2e-2f : 1e-2f; }

std::vector<Shape> shapesOf(const Options& o, Op op) {
  if (o.fp8()) return {std::begin(kFp8Shapes), std::end(kFp8Shapes)};
  if (op == Op::kAgGemm) return {std::begin(kAgShapes), std::end(kAgShapes)};
  return {std::begin(kReduceShapes), std::end(kReduceShapes)};
}
std::vector<std::pair<uint64_t, uint64_t>> decodeNKOf(const Options& o) {
  if (o.fp8()) return {std::begin(kFp8DecodeNK), std::end(kFp8DecodeNK)};
  return {std::begin(kDecodeNK), std::end(kDecodeNK)};
}

std::vector<Case> casesOf(const Options& o) {
  std::vector<Case> v;
  for (Op op : {Op::kAgGemm, Op::kGemmRs, Op::kGemmAr}) {
    if (!o.op.empty() && o.op != opName(op)) continue;
    if (o.decode) {
      int i = 0;
      for (const auto& [n, k] : decodeNKOf(o)) {
        for (uint64_t m = 1; m <= 256; m *= 2, ++i) {
          // TN stores A [k, m]: m (ag-gemm: every rank's rows) a multiple of 8, as tandem requires.
          if (o.layout == TANDEM_GEMM_TN && m % (op == Op::kAgGemm ? 8 * o.ranks : 8) != 0) continue;
          // Block scales read in place: tandem needs m % 4 == 0 (16-byte rows of a_scale).
          if (o.blockScale && m % 4 != 0) continue;
          if (o.shape < 0 || o.shape == i) v.push_back({op, {m, k, n}, i});
        }
      }
      continue;
    }
    const std::vector<Shape> list = shapesOf(o, op);
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      if (o.shape < 0 || o.shape == i) v.push_back({op, list[static_cast<size_t>(i)], i});
    }
  }
  return v;
}

uint64_t roundUp(uint64_t x, uint64_t unit) { return (x + unit - 1) / unit * unit; }

// Per-rank workspace that every case fits in, with room. libtandem (client/src/cuda_client.cpp, WorkspaceLayout) lays
// out ~33 MiB of AllGather slots, flags of 1/64 of a matrix, a gemm-rs staging area of (2·ranks + 2) matrices and two
// data matrices, where a matrix holds the gathered A (ag-gemm: m·k bytes per matrix) or the bf16 partials padded to
// 128 x 256 tiles (gemm-rs/ar), or the output. Counted here as 64 MiB + (2·ranks + 5) matrices, a matrix taken at
// twice ag-gemm's need and at the largest of the reduce ops' needs. FP8: the gathered A is fp8, the partials fp32 (gemm-rs
// and gemm-ar reduce fp32 partials), the output in --out.
uint64_t workspaceFor(const std::vector<Case>& cases, const Options& o) {
  const uint64_t partialBytes = o.fp8() ? 4 : 2;
  uint64_t mat = 0;
  for (const Case& c : cases) {
    if (c.op == Op::kAgGemm) {
      mat = std::max(mat, c.s.m * c.s.k * 2);
    } else {
      mat = std::max(mat, roundUp(c.s.m, 128) * roundUp(c.s.n, 256) * partialBytes);
      mat = std::max(mat, c.s.m * c.s.n * o.outBytes());
    }
  }
  return roundUp((uint64_t{64} << 20) + (2 * uint64_t{o.ranks} + 5) * mat, uint64_t{64} << 20);
}

using tandem::bench::fillUniform;
using tandem::bench::LtFp8;
using tandem::bench::LtGemm;
using tandem::bench::mix;
using tandem::bench::relErrorKernel;

// ---- FP8 inputs ----------------------------------------------------------------------------------------------
// Uniform in [-1, 1) rounded to the format, as the bf16 mode's fillUniform.
template <class F>
__global__ void fillFp8(F* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix(i * 0x9E3779B97F4A7C15ULL + seed) >> 40) * (1.0f / 16777216.0f);
    p[i] = F(2.0f * u - 1.0f);
  }
}

// Scales 2^-3 .. 2^3 at random: an fp8 value times a power of two is exact in bf16, so the bf16 reference of the
// dequantized inputs (where cuBLASLt has no FP8 GEMM) differs from the exact product by its fp32 sums only.
__global__ void fillPow2Scales(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = ldexpf(1.0f, static_cast<int>(mix(i * 0x9E3779B97F4A7C15ULL + seed) % 7) - 3);
  }
}

// How a scale array covers q [rows, k] (tandem.h, tandem_fp8_scaling_t): one scale; A's 1x128 blocks,
// scale[(p / 128) * rows + i]; B's 128x128 blocks, scale[(i / 128) * ceil(k / 128) + p / 128].
enum class ScaleLayout { kTensor, kRowBlocks, kTileBlocks };

// out [rows, k] bf16 = q * its scale.
template <class F>
__global__ void dequantize(const F* q, int64_t rows, int64_t k, const float* scale, ScaleLayout layout,
                           __nv_bfloat16* out) {
  const int64_t kBlocks = (k + 127) / 128;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < rows * k; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = x / k, p = x % k;
    const float sc = layout == ScaleLayout::kTensor      ? scale[0]
                     : layout == ScaleLayout::kRowBlocks ? scale[(p / 128) * rows + i]
                                                         : scale[(i / 128) * kBlocks + p / 128];
    out[x] = __float2bfloat16_rn(static_cast<float>(q[x]) * sc);
  }
}

// Device memory owned for one case (the dequantized reference inputs).
struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes) { CK(cudaMalloc(&p, bytes)); }
  ~DeviceMem() { cudaFree(p); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
};

// ---- host helpers --------------------------------------------------------------------------------------------
using tandem::bench::readAll;
using tandem::bench::writeAll;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Everything one rank holds.
struct RankState {
  uint32_t rank = 0, nranks = 0;
  cudaStream_t stream{};
  ncclComm_t nccl{};
  tandem_session_t session{};
  tandem_comm_t comm{};
  cublasLtHandle_t lt{};
  void* ltWs = nullptr;
  float* scratch = nullptr;  // barrier word, then the floats maxOverRanks exchanges
  size_t scratchFloats = 0;
  double* sums = nullptr;
  unsigned long long* bad = nullptr;
  tandem_buffer_t a{}, b{}, c{}, gathered{};  // tandem buffers: inputs shared by both methods, tandem's outputs
  tandem_buffer_t scales{};                    // FP8: a_scale at 0, b_scale at Extents::bScaleOffset
  void* baseC = nullptr;                       // baseline's output
  void* baseAux = nullptr;                     // baseline's gathered A (ag-gemm) or bf16 partial (gemm-rs/ar)

  void barrier() { NK(ncclAllReduce(scratch, scratch, 1, ncclFloat, ncclSum, nccl, stream)); }
  // Elementwise max over the ranks, in place (synchronous).
  void maxOverRanks(std::vector<float>& v) {
    if (v.empty()) return;
    if (v.size() + 1 > scratchFloats) {
      std::fprintf(stderr, "rank %u: %zu floats to exchange, room for %zu\n", rank, v.size(), scratchFloats - 1);
      std::exit(2);
    }
    CK(cudaMemcpyAsync(scratch + 1, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
    NK(ncclAllReduce(scratch + 1, scratch + 1, v.size(), ncclFloat, ncclMax, nccl, stream));
    CK(cudaMemcpyAsync(v.data(), scratch + 1, v.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CK(cudaStreamSynchronize(stream));
  }
};

// The extents of one case on one rank, in elements.
struct Extents {
  uint64_t rows;     // ag-gemm: this rank's rows of A; gemm-rs: this rank's rows of C
  uint64_t kLocal;   // K of this rank's A and B
  uint64_t aElems, bElems, cElems, baseAuxElems;
  uint64_t aScaleFloats, bScaleFloats;  // FP8: tandem_fp8_scaling_t's extents (1 each per tensor)
  uint64_t bScaleOffset() const { return roundUp(aScaleFloats * sizeof(float), 256); }  // bytes
  uint64_t scaleBytes() const { return bScaleOffset() + bScaleFloats * sizeof(float); }
};
Extents extentsOf(const Case& c, uint32_t nranks, bool blockScale) {
  Extents e{};
  const Shape& s = c.s;
  if (c.op == Op::kAgGemm) {
    e.rows = s.m / nranks;
    e.kLocal = s.k;
    e.aElems = e.rows * s.k;
    e.bElems = s.n * s.k;
    e.cElems = s.m * s.n;
    e.baseAuxElems = s.m * s.k;  // gathered A
  } else {
    e.rows = c.op == Op::kGemmRs ? s.m / nranks : s.m;
    e.kLocal = s.k / nranks;
    e.aElems = s.m * e.kLocal;
    e.bElems = s.n * e.kLocal;
    e.cElems = e.rows * s.n;
    e.baseAuxElems = s.m * s.n;  // partial
  }
  const uint64_t kBlocks = (e.kLocal + 127) / 128;
  e.aScaleFloats = blockScale ? kBlocks * (e.aElems / e.kLocal) : 1;  // [ceil(k/128), rows of a]
  e.bScaleFloats = blockScale ? (s.n + 127) / 128 * kBlocks : 1;
  return e;
}

struct Result {
  double tandemMs = 0, baselineMs = 0, tandemMinMs = 0, baselineMinMs = 0;
  double gemmMs = 0;  // the baseline's cuBLASLt GEMM alone: the time a perfectly overlapped fused op would take
  bool baselineTimed = true;  // false: no cuBLASLt GEMM for these FP8 inputs (`note`); tandem checked against a reference
  std::string note;
  float relErr = 0, nonFinite = 0;
  std::string failure;  // "" = ok
};

// FP8 tensors are launched on their format's type.
template <class Fn>
void withFp8Type(tandem_dtype_t t, Fn&& fn) {
  if (t == TANDEM_DTYPE_FP8_E5M2) fn(__nv_fp8_e5m2{});
  else fn(__nv_fp8_e4m3{});
}

// One case on one rank. Every rank makes the same calls in the same order; failures detected by every rank alike
// (a refused submission) skip the timing on every rank.
Result runCase(RankState& st, const Options& o, const Case& c, uint32_t seed) {
  Result res;
  const Shape& s = c.s;
  const Extents e = extentsOf(c, st.nranks, o.blockScale);
  const cudaStream_t stream = st.stream;
  void* aPtr = tandem_buffer_ptr(st.a);
  void* bPtr = tandem_buffer_ptr(st.b);
  float* const aScale = o.fp8() ? static_cast<float*>(tandem_buffer_ptr(st.scales)) : nullptr;
  float* const bScale = o.fp8() ? aScale + e.bScaleOffset() / sizeof(float) : nullptr;
  if (o.fp8()) {
    withFp8Type(o.dtype, [&](auto f) {
      using F = decltype(f);
      fillFp8<<<1024, 256, 0, stream>>>(static_cast<F*>(aPtr), e.aElems, uint64_t{seed} * 64 + st.rank);
      fillFp8<<<1024, 256, 0, stream>>>(static_cast<F*>(bPtr), e.bElems, uint64_t{seed} * 64 + 32 + st.rank);
    });
    // Seeded by the case alone: every rank's per-tensor a_scale is the same, as the baseline's one scale for the
    // gathered A needs.
    fillPow2Scales<<<64, 256, 0, stream>>>(aScale, e.aScaleFloats, uint64_t{seed} * 64 + 16);
    fillPow2Scales<<<64, 256, 0, stream>>>(bScale, e.bScaleFloats, uint64_t{seed} * 64 + 48);
  } else {
    fillUniform<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(aPtr), e.aElems, uint64_t{seed} * 64 + st.rank);
    fillUniform<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(bPtr), e.bElems,
                                          uint64_t{seed} * 64 + 32 + st.rank);
  }
  CK(cudaGetLastError());

  // The baseline's GEMM: cuBLASLt in the mode's precision. Without an FP8 algorithm for these inputs, cuBLASLt bf16 on
  // the dequantized inputs (exact: power-of-two scales) stands in as the reference, checked against but not timed.
  std::optional<LtGemm> lt, refLt;
  std::optional<DeviceMem> refA, refB;
  if (o.fp8()) {
    LtFp8 f;
    f.ab = o.dtype == TANDEM_DTYPE_FP8_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    f.c = o.out == TANDEM_DTYPE_FP32 ? CUDA_R_32F : CUDA_R_16BF;
    f.block = o.blockScale;
    f.aScale = aScale;
    f.bScale = bScale;
    f.fastAccum = !o.blockScale;  // as tandem's cores: per tensor no promotion, block scales promoted every 128 k
    lt.emplace(st.lt, s.m, s.n, e.kLocal, f, st.ltWs, 64u << 20);
  } else {
    lt.emplace(st.lt, s.m, s.n, e.kLocal, o.layout == TANDEM_GEMM_TN, o.layout != TANDEM_GEMM_NT, st.ltWs, 64u << 20);
  }
  res.baselineTimed = lt->available;
  if (!lt->available) {
    res.note = lt->why;
    refA.emplace(e.aElems * sizeof(__nv_bfloat16));
    refB.emplace(e.bElems * sizeof(__nv_bfloat16));
    const int64_t aRows = static_cast<int64_t>(e.aElems / e.kLocal), k = static_cast<int64_t>(e.kLocal);
    withFp8Type(o.dtype, [&](auto f) {
      using F = decltype(f);
      dequantize<<<1024, 256, 0, stream>>>(static_cast<const F*>(aPtr), aRows, k, aScale,
                                           o.blockScale ? ScaleLayout::kRowBlocks : ScaleLayout::kTensor,
                                           static_cast<__nv_bfloat16*>(refA->p));
      dequantize<<<1024, 256, 0, stream>>>(static_cast<const F*>(bPtr), static_cast<int64_t>(s.n), k, bScale,
                                           o.blockScale ? ScaleLayout::kTileBlocks : ScaleLayout::kTensor,
                                           static_cast<__nv_bfloat16*>(refB->p));
    });
    CK(cudaGetLastError());
    refLt.emplace(st.lt, s.m, s.n, e.kLocal, st.ltWs, 64u << 20);
  }
  const LtGemm& gemm = refLt ? *refLt : *lt;
  const void* baseA = refA ? refA->p : aPtr;
  const void* baseB = refB ? refB->p : bPtr;
  const bool baseFp8 = o.fp8() && !refLt;
  const tandem_dtype_t baseOut = refLt ? TANDEM_DTYPE_BF16 : o.out;  // the baseline's C and partials
  const ncclDataType_t gatherType = baseFp8 ? ncclUint8 : ncclBfloat16;  // fp8 rows travel as bytes
  const ncclDataType_t reduceType = baseOut == TANDEM_DTYPE_FP32 ? ncclFloat : ncclBfloat16;

  const auto fillArgs = [&](auto& args, uint64_t k) {
    args.struct_size = sizeof args;
    args.dtype = o.dtype;
    args.m = s.m;
    args.n = s.n;
    args.k = k;
    args.a = {st.a, 0};
    args.b = {st.b, 0};
    args.c = {st.c, 0};
    args.cuda_stream = stream;
    args.layout = o.layout;
    if (o.fp8()) {
      args.out_dtype = o.out;
      args.scaling = o.blockScale ? TANDEM_FP8_SCALE_BLOCK : TANDEM_FP8_SCALE_TENSOR;
      args.a_scale = {st.scales, 0};
      args.b_scale = {st.scales, e.bScaleOffset()};
    }
  };
  const auto submitTandem = [&](tandem_op_t* op) -> tandem_status_t {
    if (c.op == Op::kAgGemm) {
      tandem_ag_gemm_args_t args{};
      fillArgs(args, s.k);
      args.a_gathered = {o.gathered ? st.gathered : nullptr, 0};
      return tandem_ag_gemm(st.comm, &args, op);
    }
    if (c.op == Op::kGemmRs) {
      tandem_gemm_rs_args_t args{};
      fillArgs(args, e.kLocal);
      return tandem_gemm_rs(st.comm, &args, op);
    }
    tandem_gemm_ar_args_t args{};
    fillArgs(args, e.kLocal);
    return tandem_gemm_ar(st.comm, &args, op);
  };
  // The baseline's GEMM alone (for ag-gemm on the A the baseline gathered last time).
  const auto runGemmAlone = [&] {
    if (c.op == Op::kAgGemm) gemm.run(st.baseAux, baseB, st.baseC, stream);
    else gemm.run(baseA, baseB, st.baseAux, stream);
  };
  const auto runBaseline = [&] {
    if (c.op == Op::kAgGemm) {
      NK(ncclAllGather(baseA, st.baseAux, e.aElems, gatherType, st.nccl, stream));
      gemm.run(st.baseAux, baseB, st.baseC, stream);
    } else {
      gemm.run(baseA, baseB, st.baseAux, stream);
      if (c.op == Op::kGemmRs) {
        NK(ncclReduceScatter(st.baseAux, st.baseC, e.cElems, reduceType, ncclSum, st.nccl, stream));
      } else {
        NK(ncclAllReduce(st.baseAux, st.baseC, e.cElems, reduceType, ncclSum, st.nccl, stream));
      }
    }
  };
  // Agrees across ranks: 1 if any rank saw a failure.
  const auto anyRank = [&](bool failed) {
    std::vector<float> v{failed ? 1.0f : 0.0f};
    st.maxOverRanks(v);
    return v[0] != 0.0f;
  };

  // ---- correctness: one op each on poisoned outputs, tandem's C against the baseline's.
  void* cPtr = tandem_buffer_ptr(st.c);
  CK(cudaMemsetAsync(cPtr, 0xFF, e.cElems * o.outBytes(), stream));
  CK(cudaMemsetAsync(st.baseC, 0xFF, e.cElems * (baseOut == TANDEM_DTYPE_FP32 ? 4 : 2), stream));
  // The baseline first, on its own: its first launches (cuBLASLt's kernel for this shape, lazily loaded) then never
  // wait behind a fused kernel that waits for a peer.
  st.barrier();
  runBaseline();
  CK(cudaStreamSynchronize(stream));
  st.barrier();
  tandem_op_t op{};
  std::string failure;
  if (submitTandem(&op) != TANDEM_SUCCESS) failure = std::string("submit: ") + tandem_last_error();
  CK(cudaStreamSynchronize(stream));
  if (failure.empty() && tandem_wait(op, 120000) != TANDEM_SUCCESS) failure = std::string("op: ") + tandem_last_error();
  if (anyRank(!failure.empty())) {
    res.failure = failure.empty() ? "failed on another rank (see its stderr)" : failure;
    std::fprintf(stderr, "rank %u: %s %llux%llux%llu: %s\n", st.rank, opName(c.op), static_cast<unsigned long long>(s.m),
                 static_cast<unsigned long long>(s.k), static_cast<unsigned long long>(s.n), res.failure.c_str());
    return res;
  }
  CK(cudaMemsetAsync(st.sums, 0, 2 * sizeof(double), stream));
  CK(cudaMemsetAsync(st.bad, 0, sizeof(unsigned long long), stream));
  {
    const int64_t rows = static_cast<int64_t>(e.cElems / s.n), n = static_cast<int64_t>(s.n);
    const auto bf16 = [](const void* p) { return static_cast<const __nv_bfloat16*>(p); };
    const auto f32 = [](const void* p) { return static_cast<const float*>(p); };
    if (o.out != TANDEM_DTYPE_FP32) {
      relErrorKernel<<<1024, 256, 0, stream>>>(bf16(cPtr), n, bf16(st.baseC), rows, n, st.sums, st.bad);
    } else if (baseOut == TANDEM_DTYPE_FP32) {
      relErrorKernel<<<1024, 256, 0, stream>>>(f32(cPtr), n, f32(st.baseC), rows, n, st.sums, st.bad);
    } else {
      relErrorKernel<<<1024, 256, 0, stream>>>(f32(cPtr), n, bf16(st.baseC), rows, n, st.sums, st.bad);
    }
  }
  CK(cudaGetLastError());
  double sums[2] = {};
  unsigned long long bad = 0;
  CK(cudaMemcpyAsync(sums, st.sums, sizeof sums, cudaMemcpyDeviceToHost, stream));
  CK(cudaMemcpyAsync(&bad, st.bad, sizeof bad, cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  {
    std::vector<float> v{static_cast<float>(sums[1] > 0 ? std::sqrt(sums[0] / sums[1]) : (sums[0] > 0 ? 1.0 : 0.0)),
                         static_cast<float>(bad)};
    st.maxOverRanks(v);
    res.relErr = v[0];
    res.nonFinite = v[1];
  }
  const float limit = relErrLimit(o);
  if (!(res.relErr < limit) || res.nonFinite != 0) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "tandem vs baseline: relative error %.3g (limit %.0e), %.0f non-finite values",
                  static_cast<double>(res.relErr), static_cast<double>(limit), static_cast<double>(res.nonFinite));
    res.failure = msg;
  }
  refA.reset();  // the reference is not timed
  refB.reset();

  // ---- timing: every method every iteration (tandem, baseline, the baseline's GEMM alone; tandem alone where the
  // baseline is only a reference), rotating the order, a barrier before each op.
  const int methods = res.baselineTimed ? 3 : 1;
  const int total = o.warmup + o.iters;
  std::vector<cudaEvent_t> ev(static_cast<size_t>(total) * methods * 2);  // [it][method][start, stop]
  for (auto& x : ev) CK(cudaEventCreate(&x));
  std::vector<tandem_op_t> ops;
  ops.reserve(static_cast<size_t>(total));
  failure.clear();
  for (int it = 0; it < total; ++it) {
    for (int j = 0; j < methods; ++j) {
      const int method = (it + j) % methods;  // 0 tandem, 1 baseline, 2 GEMM alone
      cudaEvent_t* pair = &ev[(static_cast<size_t>(it) * methods + static_cast<size_t>(method)) * 2];
      st.barrier();
      CK(cudaEventRecord(pair[0], stream));
      if (method == 0) {
        // After a refused submission this rank skips its tandem ops but keeps the NCCL calls in step with its peers
        // (whose fused kernels then fail at their deadline instead of hanging NCCL).
        if (failure.empty()) {
          if (submitTandem(&op) == TANDEM_SUCCESS) ops.push_back(op);
          else failure = std::string("timed submit: ") + tandem_last_error();
        }
      } else if (method == 1) {
        runBaseline();
      } else {
        runGemmAlone();
      }
      CK(cudaEventRecord(pair[1], stream));
    }
  }
  CK(cudaStreamSynchronize(stream));
  for (const tandem_op_t& x : ops) {
    if (failure.empty() && tandem_wait(x, 120000) != TANDEM_SUCCESS) failure = std::string("timed op: ") + tandem_last_error();
  }
  if (anyRank(!failure.empty())) {
    res.failure = failure.empty() ? "timing failed on another rank (see its stderr)" : failure;
    std::fprintf(stderr, "rank %u: %s: %s\n", st.rank, opName(c.op), res.failure.c_str());
  } else {
    std::vector<float> ms(static_cast<size_t>(o.iters) * methods);
    for (int it = o.warmup; it < total; ++it) {
      for (int method = 0; method < methods; ++method) {
        const cudaEvent_t* pair = &ev[(static_cast<size_t>(it) * methods + static_cast<size_t>(method)) * 2];
        CK(cudaEventElapsedTime(&ms[static_cast<size_t>(it - o.warmup) * methods + static_cast<size_t>(method)],
                                pair[0], pair[1]));
      }
    }
    st.maxOverRanks(ms);  // per iteration and method: the slowest rank
    std::vector<double> t[3];
    for (int i = 0; i < o.iters; ++i) {
      for (int method = 0; method < methods; ++method) {
        t[method].push_back(ms[static_cast<size_t>(i) * methods + static_cast<size_t>(method)]);
      }
    }
    res.tandemMs = median(t[0]);
    res.tandemMinMs = *std::min_element(t[0].begin(), t[0].end());
    if (res.baselineTimed) {
      res.baselineMs = median(t[1]);
      res.gemmMs = median(t[2]);
      res.baselineMinMs = *std::min_element(t[1].begin(), t[1].end());
    }
  }
  for (auto& x : ev) CK(cudaEventDestroy(x));
  return res;
}

// One rank. Rank 0 prints the table. Returns the process exit code.
int rankMain(const Options& o, uint32_t rank, int up, int down, const std::string& socket, uint64_t workspace) {
  int devices = 0;
  CK(cudaGetDeviceCount(&devices));
  if (static_cast<uint32_t>(devices) < o.ranks) {
    std::fprintf(stderr, "rank %u: %u ranks need %u GPUs, this host has %d\n", rank, o.ranks, o.ranks, devices);
    return 2;
  }
  CK(cudaSetDevice(static_cast<int>(rank)));
  CK(cudaFree(nullptr));
  RankState st;
  st.rank = rank;
  st.nranks = o.ranks;
  ncclUniqueId ncclId;
  if (rank == 0) {
    NK(ncclGetUniqueId(&ncclId));
    writeAll(up, &ncclId, sizeof ncclId);
  }
  readAll(down, &ncclId, sizeof ncclId);
  NK(ncclCommInitRank(&st.nccl, static_cast<int>(o.ranks), ncclId, static_cast<int>(rank)));
  tandem_unique_id_t tid;
  if (rank == 0) {
    TK(tandem_get_unique_id(&tid));
    writeAll(up, &tid, sizeof tid);
  }
  readAll(down, &tid, sizeof tid);
  TK(tandem_connect(socket.c_str(), &st.session));
  if (std::strcmp(tandem_session_backend(st.session), "cuda") != 0) {
    std::fprintf(stderr, "rank %u: tandemd runs backend %s; this benchmark needs cuda\n", rank,
                 tandem_session_backend(st.session));
    return 2;
  }
  TK(tandem_comm_init(st.session, &tid, o.ranks, rank, 120000, &st.comm));
  CK(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking));
  BK(cublasLtCreate(&st.lt));
  CK(cudaMalloc(&st.ltWs, 64u << 20));
  st.scratchFloats = 1 + 3 * static_cast<size_t>(o.iters) + 64;  // the barrier word, then 3 methods' times
  CK(cudaMalloc(&st.scratch, st.scratchFloats * sizeof(float)));
  CK(cudaMemset(st.scratch, 0, st.scratchFloats * sizeof(float)));
  CK(cudaMalloc(&st.sums, 2 * sizeof(double)));
  CK(cudaMalloc(&st.bad, sizeof(unsigned long long)));

  // Buffers once, at the largest extent of any case (every tensor at offset 0).
  const std::vector<Case> cases = casesOf(o);
  // Bytes: a, b (and the gathered A) in the input dtype, c in --out; the baseline's gathered A at bf16 size (fp8 rows,
  // or a reference's bf16 ones) and its partials as its C.
  uint64_t aBytes = 0, bBytes = 0, cBytes = 0, baseAuxBytes = 0, gatheredBytes = 0, scaleBytes = 0;
  for (const Case& c : cases) {
    const Extents e = extentsOf(c, o.ranks, o.blockScale);
    aBytes = std::max(aBytes, e.aElems * o.inBytes());
    bBytes = std::max(bBytes, e.bElems * o.inBytes());
    cBytes = std::max(cBytes, e.cElems * o.outBytes());
    baseAuxBytes = std::max(baseAuxBytes, e.baseAuxElems * (c.op == Op::kAgGemm ? 2 : o.outBytes()));
    if (c.op == Op::kAgGemm) gatheredBytes = std::max(gatheredBytes, c.s.m * c.s.k * o.inBytes());
    scaleBytes = std::max(scaleBytes, e.scaleBytes());
  }
  std::vector<void*> ownMemory;  // --alloc cudamalloc
  const auto buffer = [&](uint64_t bytes, tandem_buffer_t* out) {
    if (!o.registered) {
      TK(tandem_alloc(st.session, bytes, out));
      return;
    }
    void* p = nullptr;
    CK(cudaMalloc(&p, bytes));
    ownMemory.push_back(p);
    TK(tandem_register(st.session, p, bytes, -1, 0, out));
  };
  buffer(aBytes, &st.a);
  buffer(bBytes, &st.b);
  buffer(cBytes, &st.c);
  if (o.gathered && gatheredBytes > 0) buffer(gatheredBytes, &st.gathered);
  if (o.fp8()) buffer(scaleBytes, &st.scales);
  CK(cudaMalloc(&st.baseC, cBytes));
  CK(cudaMalloc(&st.baseAux, baseAuxBytes));

  if (rank == 0) {
    if (o.socket.empty()) {
      std::printf("fused_e2e_bench: %u ranks (one process and GPU each), private tandemd: backend cuda, executor "
                  "%s, cuda.workspace_bytes %llu MiB\n", o.ranks, o.executor.c_str(),
                  static_cast<unsigned long long>(workspace >> 20));
    } else {
      std::printf("fused_e2e_bench: %u ranks (one process and GPU each), tandemd at %s (its config and executor), "
                  "workspace needed about %llu MiB\n", o.ranks, socket.c_str(),
                  static_cast<unsigned long long>(workspace >> 20));
    }
    if (o.fp8()) {
      std::printf("inputs %s (layout nt), %s scales (random powers of two), c %s; baseline: NCCL (AllGather of the fp8 "
                  "rows as bytes / ReduceScatter / AllReduce of %s partials) + cuBLASLt FP8 (%s), same processes, same "
                  "inputs and scales; ag-gemm %s\n",
                  dtypeName(o.dtype), o.blockScale ? "block (A 1x128, B 128x128)" : "per-tensor", dtypeName(o.out),
                  dtypeName(o.out),
                  o.blockScale ? "A/B_SCALE_MODE VEC128_32F for A, BLK128x128_32F for B; accumulation promoted, as "
                                 "tandem's block core"
                               : "A/B_SCALE_POINTER; fast accumulation, as tandem's per-tensor core",
                  o.gathered ? "also writes the gathered A" : "without a_gathered");
    } else {
      std::printf("baseline: NCCL (AllGather / ReduceScatter / AllReduce, bf16) + cuBLASLt (bf16 in/out, fp32 "
                  "accumulate), same processes, same inputs; ag-gemm %s\n",
                  o.gathered ? "also writes the gathered A" : "without a_gathered");
    }
    std::printf("median over %d iterations (after %d warm-ups) of the per-iteration max over ranks; methods "
                "rotate; NCCL 1-float all-reduce barrier before each op; gemm ms = the baseline's cuBLASLt GEMM alone, "
                "tand/gemm = tandem's time as a fraction of it (1.0 = communication fully hidden)\n",
                o.iters, o.warmup);
    std::printf("%-11s %-19s %10s %11s %10s %10s %10s %9s %9s %9s %s\n", "op", "M x K x N", "tandem ms", "baseline ms",
                "base/tand", "tand TF/s", "base TF/s", "gemm ms", "tand/gemm", "rel.err", "check");
    std::fflush(stdout);
  }
  int failures = 0;
  std::string jsonRows, lastNote;
  std::vector<std::string> failLines;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Result r = runCase(st, o, c, static_cast<uint32_t>(i + 1));
    if (!r.failure.empty()) ++failures;
    if (rank != 0) continue;
    const double flops = c.op == Op::kAgGemm ? 2.0 * static_cast<double>(c.s.m) * c.s.n * c.s.k
                                             : 2.0 * static_cast<double>(c.s.m) * c.s.n * c.s.k / o.ranks;
    const auto tflops = [&](double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; };
    char shape[48];
    std::snprintf(shape, sizeof shape, "%llux%llux%llu", static_cast<unsigned long long>(c.s.m),
                  static_cast<unsigned long long>(c.s.k), static_cast<unsigned long long>(c.s.n));
    const double ratio = r.tandemMs > 0 ? r.baselineMs / r.tandemMs : 0.0;
    const double ofGemm = r.gemmMs > 0 ? r.tandemMs / r.gemmMs : 0.0;
    const std::string opText = std::string(opName(c.op)) + "/" + layoutName(o.layout);
    // A baseline's figures, or "-" where there is none to time (FP8 inputs cuBLASLt cannot multiply).
    const auto base = [&](const char* format, double v) {
      char buf[32];
      std::snprintf(buf, sizeof buf, format, v);
      return std::string(r.baselineTimed ? buf : "-");
    };
    if (!r.note.empty() && r.note != lastNote) {
      std::printf("note: %s: tandem timed alone, checked against cuBLASLt bf16 (+ NCCL) on the dequantized inputs\n",
                  r.note.c_str());
      lastNote = r.note;
    }
    std::printf("%-11s %-19s %10.4f %11s %10s %10.0f %10s %9s %9s %9.2e %s\n", opText.c_str(), shape, r.tandemMs,
                base("%.4f", r.baselineMs).c_str(), base("%.3f", ratio).c_str(), tflops(r.tandemMs),
                base("%.0f", tflops(r.baselineMs)).c_str(), base("%.4f", r.gemmMs).c_str(), base("%.3f", ofGemm).c_str(),
                static_cast<double>(r.relErr), r.failure.empty() ? "ok" : "FAIL");
    std::fflush(stdout);
    if (!r.failure.empty()) failLines.push_back(std::string("FAIL ") + opName(c.op) + " " + shape + ": " + r.failure);
    // JSON null where there is no baseline to time.
    const auto jbase = [&](const char* format, double v) { return r.baselineTimed ? base(format, v) : std::string("null"); };
    char row[1024];
    std::snprintf(row, sizeof row,
                  "    {\"op\": \"%s\", \"m\": %llu, \"k\": %llu, \"n\": %llu, \"tandem_ms\": %.5f, \"baseline_ms\": %s, "
                  "\"baseline_over_tandem\": %s, \"tandem_min_ms\": %.5f, \"baseline_min_ms\": %s, "
                  "\"tandem_tflops_per_gpu\": %.1f, \"baseline_tflops_per_gpu\": %s, \"gemm_alone_ms\": %s, "
                  "\"tandem_over_gemm_alone\": %s, \"rel_err\": %.3e, \"reference\": \"%s\", \"ok\": %s}",
                  opName(c.op), static_cast<unsigned long long>(c.s.m), static_cast<unsigned long long>(c.s.k),
                  static_cast<unsigned long long>(c.s.n), r.tandemMs, jbase("%.5f", r.baselineMs).c_str(),
                  jbase("%.4f", ratio).c_str(), r.tandemMinMs, jbase("%.5f", r.baselineMinMs).c_str(),
                  tflops(r.tandemMs), jbase("%.1f", tflops(r.baselineMs)).c_str(), jbase("%.5f", r.gemmMs).c_str(),
                  jbase("%.4f", ofGemm).c_str(), static_cast<double>(r.relErr),
                  r.baselineTimed ? "baseline" : "cublaslt-bf16-dequantized", r.failure.empty() ? "true" : "false");
    jsonRows += (jsonRows.empty() ? "" : ",\n") + std::string(row);
  }
  if (rank == 0) {
    for (const auto& l : failLines) std::printf("%s\n", l.c_str());
    std::printf("correctness (tandem vs baseline, rel. error < %.0e, no non-finite value, every rank): %s\n",
                static_cast<double>(relErrLimit(o)), failures == 0 ? "PASS" : "FAIL");
    std::fflush(stdout);
    if (!o.json.empty()) {
      std::ofstream(o.json) << "{\n  \"bench\": \"fused_e2e_bench\", \"ranks\": " << o.ranks
                            << ", \"executor\": \"" << o.executor << "\", \"iters\": " << o.iters << ", \"warmup\": " << o.warmup
                            << ", \"workspace_bytes\": " << workspace << ", \"gathered\": "
                            << (o.gathered ? "true" : "false") << ", \"dtype\": \"" << dtypeName(o.dtype)
                            << "\", \"scaling\": \"" << (o.fp8() ? (o.blockScale ? "block" : "tensor") : "none")
                            << "\", \"out\": \"" << dtypeName(o.out) << "\",\n  \"rows\": [\n" << jsonRows << "\n  ]\n}\n";
    }
  }
  CK(cudaStreamSynchronize(st.stream));
  CK(cudaFree(st.baseC));
  CK(cudaFree(st.baseAux));
  CK(cudaFree(st.ltWs));
  CK(cudaFree(st.scratch));
  CK(cudaFree(st.sums));
  CK(cudaFree(st.bad));
  cublasLtDestroy(st.lt);
  for (tandem_buffer_t b : {st.a, st.b, st.c, st.gathered, st.scales}) {
    if (b != nullptr) o.registered ? tandem_deregister(b) : tandem_free(b);
  }
  for (void* p : ownMemory) CK(cudaFree(p));
  ncclCommDestroy(st.nccl);
  tandem_comm_destroy(st.comm);
  tandem_disconnect(st.session);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const char* usage =
      "usage: fused_e2e_bench [--iters N] [--warmup N] [--op ag-gemm|gemm-rs|gemm-ar] [--shape I] [--ranks N] "
      "[--executor client|daemon] [--alloc tandem|cudamalloc] [--gathered] [--workspace BYTES] [--json FILE] "
      "[--socket PATH] [--layout nt|nn|tn] [--decode] [--fp8 e4m3|e5m2 [--scaling tensor|block] [--out bf16|fp32]]\n"
      "  --fp8: FP8 a and b (layout nt) against cuBLASLt's FP8 GEMM; shapes M 8192 at N x K 8192 x 8192, 28672 x 8192, "
      "8192 x 28672, or with --decode M 1..256 at 8192 x 8192\n";
  bool fp8Only = false;  // --scaling or --out given
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&] {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "--iters") o.iters = std::stoi(next());
      else if (a == "--warmup") o.warmup = std::stoi(next());
      else if (a == "--op") o.op = next();
      else if (a == "--shape") o.shape = std::stoi(next());
      else if (a == "--ranks") o.ranks = static_cast<uint32_t>(std::stoul(next()));
      else if (a == "--gathered") o.gathered = true;
      else if (a == "--decode") o.decode = true;
      else if (a == "--layout") {
        const std::string v = next();
        if (v != "nt" && v != "nn" && v != "tn") throw std::invalid_argument("--layout " + v + ": expected nt, nn or tn");
        o.layout = v == "nn" ? TANDEM_GEMM_NN : v == "tn" ? TANDEM_GEMM_TN : TANDEM_GEMM_NT;
      }
      else if (a == "--fp8") {
        const std::string v = next();
        if (v != "e4m3" && v != "e5m2") throw std::invalid_argument("--fp8 " + v + ": expected e4m3 or e5m2");
        o.dtype = v == "e4m3" ? TANDEM_DTYPE_FP8_E4M3 : TANDEM_DTYPE_FP8_E5M2;
      }
      else if (a == "--scaling") {
        const std::string v = next();
        if (v != "tensor" && v != "block") throw std::invalid_argument("--scaling " + v + ": expected tensor or block");
        o.blockScale = v == "block";
        fp8Only = true;
      }
      else if (a == "--out") {
        const std::string v = next();
        if (v != "bf16" && v != "fp32") throw std::invalid_argument("--out " + v + ": expected bf16 or fp32");
        o.out = v == "fp32" ? TANDEM_DTYPE_FP32 : TANDEM_DTYPE_BF16;
        fp8Only = true;
      }
      else if (a == "--executor") o.executor = next();
      else if (a == "--alloc") {
        const std::string v = next();
        if (v != "tandem" && v != "cudamalloc") throw std::invalid_argument("--alloc takes tandem or cudamalloc");
        o.registered = v == "cudamalloc";
      }
      else if (a == "--workspace") o.workspace = std::stoull(next());
      else if (a == "--json") o.json = next();
      else if (a == "--socket") o.socket = next();
      else throw std::invalid_argument("unknown argument " + a);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n%s", e.what(), usage);
    return 2;
  }
  if (!o.op.empty() && o.op != "ag-gemm" && o.op != "gemm-rs" && o.op != "gemm-ar") {
    std::fprintf(stderr, "--op %s: expected ag-gemm, gemm-rs or gemm-ar\n%s", o.op.c_str(), usage);
    return 2;
  }
  if (o.executor != "client" && o.executor != "daemon") {
    std::fprintf(stderr, "--executor %s: expected client or daemon (daemon needs MPS running)\n%s", o.executor.c_str(),
                 usage);
    return 2;
  }
  if (o.iters < 1 || o.warmup < 0 || o.ranks < 1) {
    std::fprintf(stderr, "--iters must be >= 1, --warmup >= 0, --ranks >= 1\n%s", usage);
    return 2;
  }
  if (fp8Only && !o.fp8()) {
    std::fprintf(stderr, "--scaling and --out go with --fp8 (without it a, b and c are bf16)\n%s", usage);
    return 2;
  }
  if (o.fp8() && o.layout != TANDEM_GEMM_NT) {
    std::fprintf(stderr, "--fp8 takes --layout nt only: fp8 tensor cores read K-major operands (tandem refuses nn and tn "
                 "with FP8, and cuBLASLt's FP8 GEMM on Hopper is TN, which is nt here)\n");
    return 2;
  }
  if (o.fp8() && o.blockScale && o.ranks > 1 && (o.op.empty() || o.op == "ag-gemm")) {
    std::fprintf(stderr, "--fp8 --scaling block: ag-gemm runs at one rank only (the baseline's cuBLASLt takes the "
                 "gathered A's scales as one [k/128, M] array, the ranks' gathered scales are per-rank blocks); run it "
                 "with --ranks 1 or --op gemm-rs / gemm-ar\n");
    return 2;
  }
  const std::vector<Case> cases = casesOf(o);
  if (cases.empty()) {
    std::fprintf(stderr, "no shape selected (--shape %d: ag-gemm has %zu shapes, gemm-rs/ar %zu%s)\n", o.shape,
                 shapesOf(o, Op::kAgGemm).size(), shapesOf(o, Op::kGemmRs).size(), o.decode ? "; --decode: its index" : "");
    return 2;
  }
  if (o.layout == TANDEM_GEMM_TN && o.ranks > 1 && (o.op.empty() || o.op == "ag-gemm")) {
    std::fprintf(stderr, "--layout tn: ag-gemm's gathered A is per-rank [k, rows] blocks, which the cuBLASLt baseline "
                 "does not take; run it with --ranks 1 or --op gemm-rs / gemm-ar\n");
    return 2;
  }
  for (const Case& c : cases) {  // NCCL's collectives need equal shards; the kernels need k slices % 8 == 0 (FP8: % 16)
    if (c.s.m % o.ranks != 0 || (c.op != Op::kAgGemm && (c.s.k % o.ranks != 0 || (c.s.k / o.ranks) % (o.fp8() ? 16 : 8) != 0))) {
      std::fprintf(stderr, "%s %llux%llux%llu does not split evenly over %u ranks\n", opName(c.op),
                   static_cast<unsigned long long>(c.s.m), static_cast<unsigned long long>(c.s.k),
                   static_cast<unsigned long long>(c.s.n), o.ranks);
      return 2;
    }
  }
  // NVLink multicast stays off on these machines (NVLS); gpu-check.sh exports the same.
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);
  ::signal(SIGPIPE, SIG_IGN);
  const uint64_t workspace = o.workspace != 0 ? o.workspace : workspaceFor(cases, o);
  std::unique_ptr<tandem::bench::PrivateDaemon> daemon;
  const std::string config =
      "daemon:\n  backend: cuda\n  executor: " + o.executor + "\ncuda:\n  workspace_bytes: " + std::to_string(workspace) + "\n";
  const std::string socket = tandem::bench::useDaemon(o.socket, TANDEMD_PATH, config, daemon);
  if (socket.empty()) return 2;
  tandem::bench::RankProcesses ranks(o.ranks, [&](uint32_t r, int up, int down) {
    return rankMain(o, r, up, down, socket, workspace);
  });
  // Rank 0's ids (NCCL's, then tandem's) to every rank.
  if (ranks.started() && ranks.relay(sizeof(ncclUniqueId))) ranks.relay(sizeof(tandem_unique_id_t));
  const int rc = ranks.wait();
  if (rc == 2 && daemon) std::fprintf(stderr, "---- tandemd log ----\n%s\n", daemon->log().c_str());
  return rc;
}
