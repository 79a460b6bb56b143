// Attention backward core on one Hopper GPU: time of launchAttentionBwd in both dq modes on both cores (wgmma and
// mma.sync, AttentionBwdCore: the core runs the dk/dv pass and either dq mode; CUDA events around every launch,
// median), with o and lse from the forward core on the same inputs. TANDEM_ATTENTION_BWD_DQ_BLOCK_KV=64|128 in the
// environment sets the wgmma deterministic dq kernel's keys per step (default 64 at head_dim 128, 128 at 64) for A/B
// runs. bench/sdpa_bwd_baseline.py times torch SDPA's backward (cuDNN and flash backends) on the same shapes; run both
// in the same device call.
//
//   attention_bwd_bench [--iters N] [--warmup N] [--seqs 4096,8192,16384] [--heads 16] [--hds 128,64]
//                       [--causal both|0|1] [--fp16] [--cores wgmma,mma_sync]
// FLOPs counted as FlashAttention's benchmarks count them: 2.5 x the forward's 4 * seq^2 * heads * hd (five matrix
// products of the backward, against two of the forward), half of that with causal masking; the deterministic mode's
// extra products (it recomputes S and dP for dq) are not counted. One sequence of `seq` tokens, heads == kv heads.
// Check at full size: every (core, mode)'s dq, dk and dv must agree with the first one's (relative error < 1e-2, every
// element finite); exits 1 otherwise. Prints one "RESULT ..." line per (shape, core, mode) and a table at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"
#include "tandem/kernels/attention.hpp"
#include "tandem/kernels/attention_bwd.hpp"

using tandem::kernels::AttentionBwdCore;
using tandem::kernels::AttentionBwdDq;
using tandem::kernels::AttentionBwdParams;
using tandem::kernels::AttentionDtype;
using tandem::kernels::AttentionParams;

namespace {

using tandem::bench::syncOrDie;

struct Options {
  int iters = 20;
  int warmup = 3;
  std::vector<int> seqs{4096, 8192, 16384};
  std::vector<int> hds{128, 64};
  int heads = 16;
  std::vector<int> causal{0, 1};
  bool fp16 = false;
  std::vector<AttentionBwdCore> cores{AttentionBwdCore::kWgmma, AttentionBwdCore::kMmaSync};
};

const char* coreName(AttentionBwdCore c) { return c == AttentionBwdCore::kWgmma ? "wgmma" : "mma_sync"; }

std::vector<int> parseList(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t comma = s.find(',', pos);
    out.push_back(std::stoi(s.substr(pos, comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--seqs") o.seqs = parseList(next());
    else if (a == "--hds") o.hds = parseList(next());
    else if (a == "--heads") o.heads = std::stoi(next());
    else if (a == "--causal") {
      const std::string c = next();
      o.causal = c == "both" ? std::vector<int>{0, 1} : std::vector<int>{std::stoi(c)};
    } else if (a == "--fp16") o.fp16 = true;
    else if (a == "--cores") {
      o.cores.clear();
      const std::string list = next() + ",";
      for (size_t pos = 0, comma; (comma = list.find(',', pos)) != std::string::npos; pos = comma + 1) {
        const std::string name = list.substr(pos, comma - pos);
        if (name == "wgmma") o.cores.push_back(AttentionBwdCore::kWgmma);
        else if (name == "mma_sync") o.cores.push_back(AttentionBwdCore::kMmaSync);
        else {
          std::fprintf(stderr, "--cores: unknown core %s (wgmma, mma_sync)\n", name.c_str());
          std::exit(2);
        }
      }
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.iters < 10) o.iters = 10;
  return o;
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) { CK(cudaMalloc(&p, bytes == 0 ? 16 : bytes)); }
  ~Buffer() { cudaFree(p); }
  Buffer(Buffer&& o) noexcept : p(o.p) { o.p = nullptr; }  // vector<Buffer>
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

template <class T>
void fill(void* p, size_t n, uint64_t seed, cudaStream_t s) {
  tandem::bench::fillUniform<T><<<1024, 256, 0, s>>>(static_cast<T*>(p), n, seed);
  CK(cudaGetLastError());
}

// Relative error of `out` against `ref` (n elements of T) and the count of non-finite elements.
template <class T>
double relError(const void* out, const void* ref, int64_t n, unsigned long long& bad, cudaStream_t s) {
  Buffer sums(2 * sizeof(double) + sizeof(unsigned long long));
  CK(cudaMemsetAsync(sums.p, 0, 2 * sizeof(double) + sizeof(unsigned long long), s));
  auto* d = static_cast<double*>(sums.p);
  auto* b = reinterpret_cast<unsigned long long*>(d + 2);
  tandem::bench::relErrorKernel<T, T><<<1024, 256, 0, s>>>(static_cast<const T*>(out), n, static_cast<const T*>(ref),
                                                          1, n, d, b);
  CK(cudaGetLastError());
  double h[2];
  CK(cudaMemcpyAsync(h, d, sizeof(h), cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&bad, b, sizeof(bad), cudaMemcpyDeviceToHost, s));
  syncOrDie(s, 60, "relative error");
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : std::sqrt(h[0]);
}

struct Row {
  int seq, hd, causal;
  const char* core;
  const char* mode;
  double ms, tflops;
};

template <class T>
bool runShape(const Options& o, int seq, int hd, bool causal, cudaStream_t s, std::vector<Row>& rows) {
  const AttentionDtype dt = o.fp16 ? AttentionDtype::kFp16 : AttentionDtype::kBf16;
  const size_t n = static_cast<size_t>(seq) * o.heads * hd, bytes = n * 2;
  Buffer q(bytes), k(bytes), v(bytes), out(bytes), dout(bytes), lse(static_cast<size_t>(o.heads) * seq * 4);
  // Outputs per (core, mode) run, in run order; run 0 is the reference of the check.
  const int runs = 2 * static_cast<int>(o.cores.size());
  std::vector<Buffer> dq, dk, dv;
  dq.reserve(runs);
  dk.reserve(runs);
  dv.reserve(runs);
  for (int i = 0; i < runs; ++i) {
    dq.emplace_back(bytes);
    dk.emplace_back(bytes);
    dv.emplace_back(bytes);
  }
  fill<T>(q.p, n, 1, s);
  fill<T>(k.p, n, 2, s);
  fill<T>(v.p, n, 3, s);
  fill<T>(dout.p, n, 4, s);

  AttentionParams f{};
  f.q = q.p;
  f.out = out.p;
  f.lse = static_cast<float*>(lse.p);
  f.sq = seq;
  f.heads = o.heads;
  f.headDim = hd;
  f.numKv = 1;
  f.kv[0].k = k.p;
  f.kv[0].v = v.p;
  f.kv[0].length = seq;
  f.dtype = dt;
  f.causal = causal;
  tandem::kernels::launchAttention(f, s);

  const double flops = 2.5 * 4.0 * seq * static_cast<double>(seq) * o.heads * hd * (causal ? 0.5 : 1.0);
  const AttentionBwdDq modes[2] = {AttentionBwdDq::kDeterministic, AttentionBwdDq::kAtomic};
  for (int m = 0; m < runs; ++m) {
    const AttentionBwdCore core = o.cores[m / 2];
    AttentionBwdParams p{};
    p.q = q.p;
    p.k = k.p;
    p.v = v.p;
    p.o = out.p;
    p.dout = dout.p;
    p.lse = static_cast<const float*>(lse.p);
    p.dq = dq[m].p;
    p.dk = dk[m].p;
    p.dv = dv[m].p;
    p.sq = p.sk = seq;
    p.heads = p.kvHeads = o.heads;
    p.headDim = hd;
    p.dtype = dt;
    p.causal = causal;
    p.dqMode = modes[m % 2];
    p.core = core;
    p.workspaceBytes = tandem::kernels::attentionBwdWorkspaceBytes(p);
    Buffer ws(p.workspaceBytes);
    p.workspace = ws.p;
    for (int i = 0; i < o.warmup; ++i) tandem::kernels::launchAttentionBwd(p, s);
    syncOrDie(s, 120, "warm-up");
    std::vector<cudaEvent_t> ev(2 * o.iters);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (int i = 0; i < o.iters; ++i) {
      CK(cudaEventRecord(ev[2 * i], s));
      tandem::kernels::launchAttentionBwd(p, s);
      CK(cudaEventRecord(ev[2 * i + 1], s));
    }
    syncOrDie(s, 300, "timed runs");
    std::vector<float> t(o.iters);
    for (int i = 0; i < o.iters; ++i) CK(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
    for (auto& e : ev) CK(cudaEventDestroy(e));
    std::sort(t.begin(), t.end());
    const double ms = t[o.iters / 2];
    const char* name = m % 2 == 0 ? "deterministic" : "atomic";
    rows.push_back({seq, hd, causal ? 1 : 0, coreName(core), name, ms, flops / (ms * 1e-3) / 1e12});
    std::printf(
        "RESULT seq=%d heads=%d hd=%d causal=%d core=%s mode=%s median_ms=%.4f min_ms=%.4f max_ms=%.4f tflops=%.1f\n",
        seq, o.heads, hd, causal ? 1 : 0, coreName(core), name, ms, t.front(), t.back(), rows.back().tflops);
    std::fflush(stdout);
  }
  bool ok = true;
  const char* names[3] = {"dq", "dk", "dv"};
  std::vector<Buffer>* bufs[3] = {&dq, &dk, &dv};
  for (int m = 1; m < runs; ++m) {
    for (int i = 0; i < 3; ++i) {
      unsigned long long bad = 0, badRef = 0;
      const double e = relError<T>((*bufs[i])[m].p, (*bufs[i])[0].p, static_cast<int64_t>(n), bad, s);
      relError<T>((*bufs[i])[0].p, (*bufs[i])[0].p, static_cast<int64_t>(n), badRef, s);
      const bool pass = bad == 0 && badRef == 0 && e < 1e-2;
      std::printf("CHECK seq=%d hd=%d causal=%d %s %s/%s_vs_%s/deterministic relerr=%.2e nonfinite=%llu/%llu %s\n",
                  seq, hd, causal ? 1 : 0, names[i], coreName(o.cores[m / 2]),
                  m % 2 == 0 ? "deterministic" : "atomic", coreName(o.cores[0]), e, badRef, bad, pass ? "ok" : "FAIL");
      ok = ok && pass;
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<Row> rows;
  bool ok = true;
  for (const int hd : o.hds) {
    for (const int seq : o.seqs) {
      for (const int c : o.causal) {
        ok = (o.fp16 ? runShape<__half>(o, seq, hd, c != 0, s, rows)
                     : runShape<__nv_bfloat16>(o, seq, hd, c != 0, s, rows)) &&
             ok;
      }
    }
  }
  std::printf("\n| seq | hd | causal | core | dq mode | median ms | TFLOP/s |\n|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %d | %d | %s | %s | %s | %.3f | %.1f |\n", r.seq, r.hd, r.causal ? "yes" : "no", r.core, r.mode,
                r.ms, r.tflops);
  }
  CK(cudaStreamDestroy(s));
  if (!ok) std::printf("attention_bwd_bench: CHECK failed\n");
  return ok ? 0 : 1;
}
