// Attention core on one H200: correctness on sampled rows against an fp32 reference kernel, then timing (CUDA events
// around every launch, median, input sets rotated so that L2 holds none of them). bench/sdpa_baseline.py times torch
// SDPA (cuDNN and flash backends) on the same shapes; run both in the same device call.
//
//   attention_bench [--iters N] [--warmup N] [--seqs 4096,8192,16384,32768] [--heads 16] [--hd 128] [--fp16]
//                   [--variants default|all] [--check-rows N] [--causal both|0|1]
//                   [--rounds N]
// FLOPs counted as 4 * seq^2 * heads * hd, half of that with causal masking. One sequence of `seq` tokens.
// --rounds N times every configuration N times in turn, so that the rounds' spread shows the noise.
// Prints one "RESULT ..." line per (shape, variant) and a table at the end; exits 1 on any correctness failure.
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
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_kernels.cuh"
#include "checks.hpp"
#include "tandem/kernels/attention.hpp"

using tandem::kernels::AttentionDtype;
using tandem::kernels::AttentionParams;
using tandem::kernels::attentionConfigName;
using tandem::kernels::launchAttention;

namespace {

using tandem::bench::syncOrDie;

// Row of the r-th sampled query: spread over the sequence, at varying offsets inside the 128-row tiles.
__host__ __device__ inline int sampledRow(int r, int numRows, int sq) {
  const long long stride = (static_cast<long long>(sq) + numRows - 1) / numRows;
  const long long row = r * stride + (r * 37) % stride;
  return static_cast<int>(row < sq ? row : sq - 1);
}

// fp32 reference for one (sampled row, head) per block of 128 threads: online softmax over chunks of 128 keys.
template <class T>
__global__ void refAttentionKernel(const T* q, const T* k, const T* v, float* outRef, float* lseRef, int sq, int skv,
                                   int heads, int hd, float scale, int causal, int numRows) {
  using tandem::bench::toFloat;
  const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int row = sampledRow(r, numRows, sq);
  __shared__ float qs[128];
  __shared__ float ps[128];
  __shared__ float red[4];
  const long long ld = static_cast<long long>(heads) * hd;
  if (tid < hd) qs[tid] = toFloat(q[row * ld + h * hd + tid]);
  __syncthreads();
  float m = -INFINITY, l = 0.0f, acc = 0.0f;
  for (int j0 = 0; j0 < skv; j0 += 128) {
    const int j = j0 + tid;
    float s = -INFINITY;
    if (j < skv && (!causal || j <= row)) {
      const T* kr = k + j * ld + h * hd;
      float dot = 0.0f;
      for (int d = 0; d < hd; ++d) dot += qs[d] * toFloat(kr[d]);
      s = dot * scale;
    }
    float mb = s;
    for (int off = 16; off > 0; off /= 2) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, off));
    if (tid % 32 == 0) red[tid / 32] = mb;
    __syncthreads();
    mb = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    const float mNew = fmaxf(m, mb);
    if (mNew == -INFINITY) continue;  // nothing visible yet (uniform across the block)
    const float alpha = m == -INFINITY ? 0.0f : __expf(m - mNew);
    const float p = s == -INFINITY ? 0.0f : __expf(s - mNew);
    ps[tid] = p;
    float sum = p;
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (tid % 32 == 0) red[tid / 32] = sum;
    __syncthreads();
    sum = red[0] + red[1] + red[2] + red[3];
    if (tid < hd) {
      float a = 0.0f;
      const int jn = min(128, skv - j0);
      for (int jj = 0; jj < jn; ++jj) a += ps[jj] * toFloat(v[(j0 + jj) * ld + h * hd + tid]);
      acc = acc * alpha + a;
    }
    l = l * alpha + sum;
    m = mNew;
    __syncthreads();
  }
  if (tid < hd) outRef[(static_cast<long long>(r) * heads + h) * hd + tid] = l > 0.0f ? acc / l : 0.0f;
  if (tid == 0) lseRef[static_cast<long long>(r) * heads + h] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// sums[0] += (out - ref)^2, sums[1] += ref^2, sums[2] = max |lse - lseRef| (as atomicMax on the bits of a
// non-negative float), bad += non-finite outputs. One block per (sampled row, head).
template <class T>
__global__ void compareKernel(const T* out, const float* lse, const float* outRef, const float* lseRef, int sq,
                              int heads, int hd, int numRows, double* sums, unsigned* lseErrBits,
                              unsigned long long* bad) {
  using tandem::bench::toFloat;
  const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int row = sampledRow(r, numRows, sq);
  if (tid < hd) {
    const float o = toFloat(out[(static_cast<long long>(row) * heads + h) * hd + tid]);
    const float f = outRef[(static_cast<long long>(r) * heads + h) * hd + tid];
    if (!isfinite(o)) {
      atomicAdd(bad, 1ull);
    } else {
      atomicAdd(&sums[0], double(o - f) * double(o - f));
      atomicAdd(&sums[1], double(f) * double(f));
    }
  }
  if (tid == 0) {
    const float a = lse[static_cast<long long>(h) * sq + row];
    const float b = lseRef[static_cast<long long>(r) * heads + h];
    const float e = isfinite(a) && isfinite(b) ? fabsf(a - b) : (a == b ? 0.0f : INFINITY);
    atomicMax(lseErrBits, __float_as_uint(e));
  }
}

struct Options {
  int iters = 30;
  int warmup = 5;
  std::vector<int> seqs{4096, 8192, 16384, 32768};
  int heads = 16;
  int hd = 128;
  bool fp16 = false;
  bool allVariants = false;
  int checkRows = 1024;
  int causal = -1;  // -1: both
  std::vector<int> headGroups;  // causal: also time these head groups (AttentionParams::headGroup)
  int rounds = 1;
};

std::vector<int> parseList(const char* s) {
  std::vector<int> v;
  std::string str(s);
  size_t pos = 0;
  while (pos <= str.size()) {
    const size_t comma = str.find(',', pos);
    const std::string tok = str.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) v.push_back(std::atoi(tok.c_str()));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--iters") o.iters = std::atoi(next());
    else if (a == "--warmup") o.warmup = std::atoi(next());
    else if (a == "--seqs") o.seqs = parseList(next());
    else if (a == "--heads") o.heads = std::atoi(next());
    else if (a == "--hd") o.hd = std::atoi(next());
    else if (a == "--fp16") o.fp16 = true;
    else if (a == "--variants") o.allVariants = std::string(next()) == "all";
    else if (a == "--check-rows") o.checkRows = std::atoi(next());
    else if (a == "--head-groups") o.headGroups = parseList(next());
    else if (a == "--rounds") o.rounds = std::max(1, std::atoi(next()));
    else if (a == "--causal") {
      const std::string v = next();
      o.causal = v == "both" ? -1 : std::atoi(v.c_str());
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.iters < 20) o.iters = 20;  // medians of fewer runs are not reported
  return o;
}

struct Variant {
  int blockN;
  int pingPong;
  int headGroup = 0;
  int tileOrder = 0;
};

struct Row {
  int seq;
  bool causal;
  std::string config;
  double ms, tflops, relErr, lseErr;
  bool ok;
};

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  const AttentionDtype dt = opt.fp16 ? AttentionDtype::kFp16 : AttentionDtype::kBf16;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> evs(2 * static_cast<size_t>(opt.iters));
  for (auto& e : evs) CK(cudaEventCreate(&e));

  std::vector<Row> rows;
  bool allOk = true;
  for (const int seq : opt.seqs) {
    const size_t elems = static_cast<size_t>(seq) * opt.heads * opt.hd;
    const size_t setBytes = 4 * elems * 2;
    const int sets = std::max<int>(2, static_cast<int>((3ull * prop.l2CacheSize + setBytes - 1) / setBytes));
    std::vector<void*> q(sets), k(sets), v(sets), out(sets);
    std::vector<float*> lse(sets);
    for (int s = 0; s < sets; ++s) {
      CK(cudaMalloc(&q[s], elems * 2));
      CK(cudaMalloc(&k[s], elems * 2));
      CK(cudaMalloc(&v[s], elems * 2));
      CK(cudaMalloc(&out[s], elems * 2));
      CK(cudaMalloc(&lse[s], static_cast<size_t>(seq) * opt.heads * 4));
      for (void* p : {q[s], k[s], v[s]}) {
        const uint64_t seed = 0x1234 + 977ull * s + reinterpret_cast<uintptr_t>(p);
        if (opt.fp16) {
          tandem::bench::fillUniform<__half><<<1024, 256, 0, stream>>>(static_cast<__half*>(p), elems, seed);
        } else {
          tandem::bench::fillUniform<__nv_bfloat16>
              <<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), elems, seed);
        }
        CK(cudaGetLastError());
      }
    }
    const int numRows = std::min(opt.checkRows, seq);
    float *outRef = nullptr, *lseRef = nullptr;
    CK(cudaMalloc(&outRef, static_cast<size_t>(numRows) * opt.heads * opt.hd * 4));
    CK(cudaMalloc(&lseRef, static_cast<size_t>(numRows) * opt.heads * 4));
    double* sums = nullptr;
    uint32_t* tileCounter = nullptr;  // tileOrder 3; launches on one stream, one after the other
    CK(cudaMalloc(&tileCounter, sizeof(uint32_t)));
    unsigned* lseErrBits = nullptr;
    unsigned long long* bad = nullptr;
    CK(cudaMalloc(&sums, 3 * sizeof(double)));
    CK(cudaMalloc(&lseErrBits, sizeof(unsigned)));
    CK(cudaMalloc(&bad, sizeof(unsigned long long)));

    for (int causal = 0; causal <= 1; ++causal) {
      if (opt.causal >= 0 && causal != opt.causal) continue;
      const float scale = 1.0f / std::sqrt(static_cast<float>(opt.hd));
      // Reference for set 0, once per shape.
      const dim3 refGrid(static_cast<unsigned>(numRows), static_cast<unsigned>(opt.heads));
      if (opt.fp16) {
        refAttentionKernel<__half><<<refGrid, 128, 0, stream>>>(
            static_cast<const __half*>(q[0]), static_cast<const __half*>(k[0]), static_cast<const __half*>(v[0]),
            outRef, lseRef, seq, seq, opt.heads, opt.hd, scale, causal, numRows);
      } else {
        refAttentionKernel<__nv_bfloat16><<<refGrid, 128, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(q[0]), static_cast<const __nv_bfloat16*>(k[0]),
            static_cast<const __nv_bfloat16*>(v[0]), outRef, lseRef, seq, seq, opt.heads, opt.hd, scale, causal,
            numRows);
      }
      CK(cudaGetLastError());
      syncOrDie(stream, 120, "reference");

      std::vector<Variant> variants{{0, 0}};
      if (causal) {
        for (const int g : opt.headGroups) {
          variants.push_back({0, 0, g, 1});
          variants.push_back({0, 0, g, 2});
          variants.push_back({0, 0, g, 3});
        }
      }
      if (opt.allVariants) {
        variants = {{128, 1}, {128, 2}};
        if (!causal && opt.hd == 128) {
          variants.push_back({176, 1});
          variants.push_back({176, 2});
        }
      }
      std::vector<Variant> runs;  // configurations in timing order
      for (int r = 0; r < opt.rounds; ++r) runs.insert(runs.end(), variants.begin(), variants.end());
      for (const Variant& var : runs) {
        AttentionParams p{};
        p.sq = seq;
        p.heads = opt.heads;
        p.headDim = opt.hd;
        p.numKv = 1;
        p.dtype = dt;
        p.causal = causal != 0;
        p.blockN = var.blockN;
        p.pingPong = var.pingPong;
        p.headGroup = var.headGroup;
        p.tileOrder = var.tileOrder;
        p.tileCounter = tileCounter;
        const auto bind = [&](int s) {
          p.q = q[s];
          p.out = out[s];
          p.lse = lse[s];
          p.kv[0].k = k[s];
          p.kv[0].v = v[s];
          p.kv[0].length = seq;
          p.kv[0].start = 0;
        };
        bind(0);  // the name depends on the key count (the causal default's tile order)
        const std::string config = attentionConfigName(p);
        bool ok = true;
        double rel = 0, lseErr = 0;
        try {
          // Correctness on set 0: poison, run, compare the sampled rows.
          bind(0);
          CK(cudaMemsetAsync(out[0], 0xFF, elems * 2, stream));
          CK(cudaMemsetAsync(lse[0], 0xFF, static_cast<size_t>(seq) * opt.heads * 4, stream));
          launchAttention(p, stream);
          CK(cudaGetLastError());
          syncOrDie(stream, 20, "attention " + config);
          CK(cudaMemsetAsync(sums, 0, 3 * sizeof(double), stream));
          CK(cudaMemsetAsync(lseErrBits, 0, sizeof(unsigned), stream));
          CK(cudaMemsetAsync(bad, 0, sizeof(unsigned long long), stream));
          if (opt.fp16) {
            compareKernel<__half><<<refGrid, 128, 0, stream>>>(static_cast<const __half*>(out[0]), lse[0], outRef,
                                                               lseRef, seq, opt.heads, opt.hd, numRows, sums,
                                                               lseErrBits, bad);
          } else {
            compareKernel<__nv_bfloat16><<<refGrid, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(out[0]),
                                                                      lse[0], outRef, lseRef, seq, opt.heads, opt.hd,
                                                                      numRows, sums, lseErrBits, bad);
          }
          CK(cudaGetLastError());
          double hs[3];
          unsigned hl = 0;
          unsigned long long hb = 0;
          CK(cudaMemcpyAsync(hs, sums, 3 * sizeof(double), cudaMemcpyDeviceToHost, stream));
          CK(cudaMemcpyAsync(&hl, lseErrBits, sizeof(unsigned), cudaMemcpyDeviceToHost, stream));
          CK(cudaMemcpyAsync(&hb, bad, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
          syncOrDie(stream, 60, "compare");
          rel = hs[1] > 0 ? std::sqrt(hs[0] / hs[1]) : 1.0;
          float lf;
          std::memcpy(&lf, &hl, 4);
          lseErr = lf;
          ok = hb == 0 && rel < 1e-2 && lseErr < 1e-2;
          if (hb != 0) std::printf("  %llu non-finite outputs\n", hb);

          // Timing: warm up, then one event pair per launch, sets rotated.
          for (int i = 0; i < opt.warmup; ++i) {
            bind(i % sets);
            launchAttention(p, stream);
          }
          CK(cudaGetLastError());
          syncOrDie(stream, 120, "warmup " + config);
          for (int i = 0; i < opt.iters; ++i) {
            bind((i + 1) % sets);
            CK(cudaEventRecord(evs[2 * i], stream));
            launchAttention(p, stream);
            CK(cudaEventRecord(evs[2 * i + 1], stream));
          }
          CK(cudaGetLastError());
          syncOrDie(stream, 300, "timing " + config);
        } catch (const std::exception& e) {
          std::printf("FAIL %s: %s\n", config.c_str(), e.what());
          allOk = false;
          continue;
        }
        std::vector<float> ms(opt.iters);
        for (int i = 0; i < opt.iters; ++i) CK(cudaEventElapsedTime(&ms[i], evs[2 * i], evs[2 * i + 1]));
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        const double flops = 4.0 * seq * static_cast<double>(seq) * opt.heads * opt.hd * (causal ? 0.5 : 1.0);
        const double tf = flops / (med * 1e-3) / 1e12;
        std::printf("RESULT seq=%d causal=%d config=%s median_ms=%.4f min_ms=%.4f max_ms=%.4f tflops=%.1f "
                    "relerr=%.2e lse_err=%.2e %s\n",
                    seq, causal, config.c_str(), med, ms.front(), ms.back(), tf, rel, lseErr, ok ? "ok" : "WRONG");
        std::fflush(stdout);
        rows.push_back({seq, causal != 0, config, med, tf, rel, lseErr, ok});
        allOk = allOk && ok;
      }
    }
    for (int s = 0; s < sets; ++s) {
      cudaFree(q[s]);
      cudaFree(k[s]);
      cudaFree(v[s]);
      cudaFree(out[s]);
      cudaFree(lse[s]);
    }
    cudaFree(outRef);
    cudaFree(lseRef);
    cudaFree(sums);
    cudaFree(tileCounter);
    cudaFree(lseErrBits);
    cudaFree(bad);
  }

  std::printf("\n| seq | causal | config | median ms | TFLOP/s | rel. err | lse err | check |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %d | %s | %s | %.4f | %.1f | %.1e | %.1e | %s |\n", r.seq, r.causal ? "yes" : "no",
                r.config.c_str(), r.ms, r.tflops, r.relErr, r.lseErr, r.ok ? "ok" : "WRONG");
  }
  return allOk ? 0 : 1;
}
