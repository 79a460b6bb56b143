// The FP8 GEMM core (tandem/kernels/gemm_fp8.hpp) against an fp64 host reference of the dequantized inputs: both
// scaling modes, every pair of fp8 formats, bf16 and fp32 output, M and N off the 128 x 256 tile, K off the 128-wide
// k-block (a multiple of 16 only), padded row strides, more tiles than SMs, every C element written and finite and
// C's padding untouched (n with ragged 16-byte granules);
// bitwise repeatable over 5 launches; K == 0 zeroes C; bad arguments refused with the field named. This process
// initialises CUDA itself, so it is its own executable.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "fp8_ref.hpp"
#include "tandem/kernels/gemm_fp8.hpp"

using tandem::kernels::Fp8Format;
using tandem::kernels::Fp8Out;
using tandem::kernels::Fp8Scaling;
using tandem::kernels::GemmFp8Params;
using tandem::kernels::gemmFp8ScaleALd;
using tandem::kernels::kFp8ScaleBlock;
using tandem::kernels::launchGemmFp8;

namespace {

using tandem::gputest::ck;
using tandem::gputest::decodeFp8;
using tandem::gputest::randomFp8;
using tandem::gputest::DeviceMem;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;

constexpr uint8_t kPoisonByte = 0xFF;  // all-ones: NaN in bf16 and fp32

const char* formatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

struct Shape {
  int64_t m, n, k;
  int64_t pad = 0;  // extra elements on every row stride (lda, ldb: a multiple of 16; ldc, ldsa: a multiple of 8)
};

int64_t kBlocksOf(int64_t k) { return (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock; }

// One shape x format pair: inputs and scales on host and device, the per-k-block dot products in fp64, and C.
struct Problem {
  Shape shape;
  Fp8Format fa, fb;
  int64_t lda, ldb, ldc, ldsa, kBlocks, nBlocks;
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;  // block scales: [kBlocks, ldsa] and [nBlocks, kBlocks]
  float tensorScaleA = 0.37f, tensorScaleB = 1.9f;
  std::vector<double> dots;  // [m][n][kBlocks]: sum over the k-block of decoded a * b
  DeviceMem dA, dB, dC, dSa, dSb, dTensorScales;

  Problem(const Shape& s, Fp8Format fmtA, Fp8Format fmtB, uint64_t seed)
      : shape(s),
        fa(fmtA),
        fb(fmtB),
        lda(s.k + s.pad * 16),
        ldb(s.k + s.pad * 16),
        ldc((s.n + 7) / 8 * 8 + s.pad * 8),
        ldsa(gemmFp8ScaleALd(s.m) + s.pad * 8),
        kBlocks(kBlocksOf(s.k)),
        nBlocks((s.n + kFp8ScaleBlock - 1) / kFp8ScaleBlock),
        a(size_t(s.m) * lda),
        b(size_t(s.n) * ldb),
        sa(size_t(kBlocks) * ldsa),
        sb(size_t(nBlocks) * kBlocks),
        dA(a.size()),
        dB(b.size()),
        dC(size_t(s.m) * ldc * 4),
        dSa(sa.size() * 4),
        dSb(sb.size() * 4),
        dTensorScales(2 * 4) {
    std::mt19937_64 rng(seed);
    // Padding bytes get values too: a kernel that read them would show it.
    for (auto& v : a) v = randomFp8(rng, fa);
    for (auto& v : b) v = randomFp8(rng, fb);
    // Scales spread over 2^-3 .. 2^3, not powers of two, so that a scale applied to the wrong row, column block or
    // k-block moves the result far past the tolerance.
    std::uniform_real_distribution<double> logScale(-3.0, 3.0);
    for (auto& v : sa) v = static_cast<float>(std::exp2(logScale(rng)));
    for (auto& v : sb) v = static_cast<float>(std::exp2(logScale(rng)));
    std::vector<double> da(a.size()), db(b.size());
    for (size_t i = 0; i < a.size(); ++i) da[i] = decodeFp8(a[i], fa);
    for (size_t i = 0; i < b.size(); ++i) db[i] = decodeFp8(b[i], fb);
    dots.assign(size_t(s.m) * s.n * kBlocks, 0.0);
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        const double* ar = da.data() + i * lda;
        const double* br = db.data() + j * ldb;
        for (int64_t kb = 0; kb < kBlocks; ++kb) {
          double acc = 0;
          for (int64_t kk = kb * kFp8ScaleBlock; kk < std::min(s.k, (kb + 1) * kFp8ScaleBlock); ++kk) {
            acc += ar[kk] * br[kk];
          }
          dots[(size_t(i) * s.n + j) * kBlocks + kb] = acc;
        }
      }
    }
    const float tensorScales[2] = {tensorScaleA, tensorScaleB};
    ck(cudaMemcpy(dA.p, a.data(), a.size(), cudaMemcpyHostToDevice), "copy A");
    ck(cudaMemcpy(dB.p, b.data(), b.size(), cudaMemcpyHostToDevice), "copy B");
    ck(cudaMemcpy(dSa.p, sa.data(), sa.size() * 4, cudaMemcpyHostToDevice), "copy A's scales");
    ck(cudaMemcpy(dSb.p, sb.data(), sb.size() * 4, cudaMemcpyHostToDevice), "copy B's scales");
    ck(cudaMemcpy(dTensorScales.p, tensorScales, sizeof tensorScales, cudaMemcpyHostToDevice), "copy tensor scales");
  }

  GemmFp8Params params(Fp8Scaling scaling, Fp8Out out) const {
    GemmFp8Params p{};
    p.aFormat = fa;
    p.bFormat = fb;
    p.scaling = scaling;
    p.out = out;
    p.a = dA.p;
    p.b = dB.p;
    p.c = dC.p;
    const bool block = scaling == Fp8Scaling::kBlock;
    p.scaleA = block ? dSa.as<float>() : dTensorScales.as<float>();
    p.scaleB = block ? dSb.as<float>() : dTensorScales.as<float>() + 1;
    p.m = shape.m;
    p.n = shape.n;
    p.k = shape.k;
    p.lda = lda;
    p.ldb = ldb;
    p.ldc = ldc;
    p.ldsa = ldsa;
    return p;
  }

  double reference(Fp8Scaling scaling, int64_t i, int64_t j) const {
    const double* d = dots.data() + (size_t(i) * shape.n + j) * kBlocks;
    double sum = 0;
    if (scaling == Fp8Scaling::kPerTensor) {
      for (int64_t kb = 0; kb < kBlocks; ++kb) sum += d[kb];
      return sum * double(tensorScaleA) * double(tensorScaleB);
    }
    for (int64_t kb = 0; kb < kBlocks; ++kb) {
      sum += d[kb] * double(sa[size_t(kb) * ldsa + i]) * double(sb[size_t(j / kFp8ScaleBlock) * kBlocks + kb]);
    }
    return sum;
  }

  std::string describe(Fp8Scaling scaling, Fp8Out out) const {
    return std::string(scaling == Fp8Scaling::kBlock ? "block" : "per-tensor") + " " + formatName(fa) + "x" +
           formatName(fb) + (out == Fp8Out::kFp32 ? "->fp32 " : "->bf16 ") + std::to_string(shape.m) + "x" +
           std::to_string(shape.n) + "x" + std::to_string(shape.k) + " pad " + std::to_string(shape.pad);
  }

  // Launches `launches` times over a poisoned C; returns C's bytes (m rows of ldc elements).
  std::vector<uint8_t> run(Fp8Scaling scaling, Fp8Out out, cudaStream_t s, int launches = 1) const {
    const size_t bytes = size_t(shape.m) * ldc * (out == Fp8Out::kFp32 ? 4 : 2);
    ck(cudaMemsetAsync(dC.p, kPoisonByte, bytes, s), "poison C");
    for (int i = 0; i < launches; ++i) REQUIRE_NOTHROW(launchGemmFp8(params(scaling, out), s));
    ck(cudaGetLastError(), "launch");
    syncWithin(s, 30, describe(scaling, out));
    std::vector<uint8_t> host(bytes);
    ck(cudaMemcpy(host.data(), dC.p, bytes, cudaMemcpyDeviceToHost), "copy C");
    return host;
  }
};

float bf16ToFloat(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ||C - ref|| / ||ref|| over [m, n]; every C element inside finite, every padding element still poison.
void checkAgainstReference(const Problem& pr, Fp8Scaling scaling, Fp8Out out, const std::vector<uint8_t>& c) {
  double err = 0, norm = 0;
  int64_t nonFinite = 0, paddingWritten = 0;
  for (int64_t i = 0; i < pr.shape.m; ++i) {
    for (int64_t j = 0; j < pr.ldc; ++j) {
      const size_t idx = size_t(i) * pr.ldc + j;
      float v;
      bool poison;
      if (out == Fp8Out::kFp32) {
        uint32_t bits;
        std::memcpy(&bits, c.data() + idx * 4, 4);
        poison = bits == 0xFFFFFFFFu;
        std::memcpy(&v, &bits, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, c.data() + idx * 2, 2);
        poison = bits == 0xFFFFu;
        v = bf16ToFloat(bits);
      }
      if (j >= pr.shape.n) {
        paddingWritten += poison ? 0 : 1;
        continue;
      }
      if (!std::isfinite(v)) {
        ++nonFinite;
        continue;
      }
      const double r = pr.reference(scaling, i, j);
      err += (double(v) - r) * (double(v) - r);
      norm += r * r;
    }
  }
  const double rel = std::sqrt(err / std::max(norm, 1e-300));
  // bf16 output rounds at 2^-9 relative. fp32 output: the tensor cores add fp8 products into an accumulator of about
  // 14 mantissa bits (DeepSeek-V3 report); block scaling promotes into true fp32 every 128 k, so its error stays near
  // one block's (4 wgmma k-steps), while per tensor it grows with K (up to K = 4096 here). Misplaced scales or a
  // dropped k-step of 32 give errors past 1e-1.
  const double tol = scaling == Fp8Scaling::kBlock ? (out == Fp8Out::kFp32 ? 2e-3 : 1e-2) : 1e-2;
  INFO(pr.describe(scaling, out) << ": rel err " << rel << ", non-finite " << nonFinite << ", padding written "
                                 << paddingWritten);
  MESSAGE(pr.describe(scaling, out) << ": rel err " << rel);
  CHECK(nonFinite == 0);
  CHECK(paddingWritten == 0);
  CHECK(rel < tol);
}

}  // namespace

TEST_CASE("FP8 GEMM matches the fp64 reference of the dequantized inputs in both scaling modes") {
  Stream stream;
  struct Case {
    Shape shape;
    bool allFormats;
  };
  const std::vector<Case> cases = {
      {{1000, 520, 1024, 0}, true},  // M, N off the tile; 8 k-blocks
      {{130, 264, 400, 1}, true},    // K off the k-block (400 = 3 x 128 + 16); padded strides
      {{7, 300, 272, 0}, false},     // a few rows
      {{129, 257, 144, 2}, false},   // one past the tile in M and N, padded strides
      {{64, 1000, 4096, 0}, false},  // long K (32 k-blocks)
      {{300, 136, 16, 0}, false},    // K = 16: one partial k-step
      {{2048, 2600, 256, 0}, false}, // 176 tiles: more than the SMs, so CTAs run several tiles (persistent loop)
  };
  uint64_t seed = 1;
  for (const Case& cs : cases) {
    std::vector<std::pair<Fp8Format, Fp8Format>> formats = {{Fp8Format::kE4M3, Fp8Format::kE4M3}};
    if (cs.allFormats) {
      formats.push_back({Fp8Format::kE4M3, Fp8Format::kE5M2});
      formats.push_back({Fp8Format::kE5M2, Fp8Format::kE4M3});
      formats.push_back({Fp8Format::kE5M2, Fp8Format::kE5M2});
    }
    for (const auto& [fa, fb] : formats) {
      const Problem pr(cs.shape, fa, fb, seed += 2);
      for (Fp8Scaling scaling : {Fp8Scaling::kPerTensor, Fp8Scaling::kBlock}) {
        for (Fp8Out out : {Fp8Out::kBf16, Fp8Out::kFp32}) {
          checkAgainstReference(pr, scaling, out, pr.run(scaling, out, stream.s));
        }
      }
    }
  }
}

TEST_CASE("FP8 GEMM results are bitwise repeatable over 5 launches") {
  Stream stream;
  const Problem pr({520, 1000, 1024, 0}, Fp8Format::kE4M3, Fp8Format::kE4M3, 77);
  for (Fp8Scaling scaling : {Fp8Scaling::kPerTensor, Fp8Scaling::kBlock}) {
    for (Fp8Out out : {Fp8Out::kBf16, Fp8Out::kFp32}) {
      const std::vector<uint8_t> first = pr.run(scaling, out, stream.s);
      checkAgainstReference(pr, scaling, out, first);
      int differing = 0;
      for (int i = 1; i < 5; ++i) differing += pr.run(scaling, out, stream.s, 2) == first ? 0 : 1;
      INFO(pr.describe(scaling, out));
      CHECK(differing == 0);
    }
  }
}

TEST_CASE("FP8 GEMM with K = 0 zeroes C") {
  Stream stream;
  const Problem pr({40, 72, 16, 0}, Fp8Format::kE4M3, Fp8Format::kE4M3, 5);
  GemmFp8Params p = pr.params(Fp8Scaling::kBlock, Fp8Out::kFp32);
  p.k = 0;
  const size_t bytes = size_t(pr.shape.m) * pr.ldc * 4;
  ck(cudaMemsetAsync(pr.dC.p, kPoisonByte, bytes, stream.s), "poison C");
  REQUIRE_NOTHROW(launchGemmFp8(p, stream.s));
  syncWithin(stream.s, 30, "k = 0");
  std::vector<float> c(bytes / 4);
  ck(cudaMemcpy(c.data(), pr.dC.p, bytes, cudaMemcpyDeviceToHost), "copy C");
  int64_t nonZero = 0;
  for (int64_t i = 0; i < pr.shape.m; ++i) {
    for (int64_t j = 0; j < pr.shape.n; ++j) nonZero += c[size_t(i) * pr.ldc + j] == 0.0f ? 0 : 1;
  }
  CHECK(nonZero == 0);
}

TEST_CASE("FP8 GEMM refuses bad arguments with the field named") {
  Stream stream;
  const Problem pr({16, 256, 256, 0}, Fp8Format::kE4M3, Fp8Format::kE4M3, 7);
  const auto rejects = [&](const GemmFp8Params& p, const char* field) {
    try {
      launchGemmFp8(p, stream.s);
      FAIL("accepted, expected a complaint about " << field);
    } catch (const std::invalid_argument& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  GemmFp8Params p = pr.params(Fp8Scaling::kBlock, Fp8Out::kBf16);
  p.k = 248;  // a multiple of 8, not of 16
  rejects(p, "k must be a multiple of 16");
  p = pr.params(Fp8Scaling::kBlock, Fp8Out::kBf16);
  p.lda = 240;  // < k
  rejects(p, "lda");
  p = pr.params(Fp8Scaling::kPerTensor, Fp8Out::kBf16);
  p.ldb = 264;  // not a multiple of 16
  rejects(p, "ldb");
  p = pr.params(Fp8Scaling::kBlock, Fp8Out::kBf16);
  p.ldsa = 8;  // < m
  rejects(p, "ldsa");
  p = pr.params(Fp8Scaling::kBlock, Fp8Out::kBf16);
  p.scaleB = nullptr;
  rejects(p, "scaleB");
  p = pr.params(Fp8Scaling::kPerTensor, Fp8Out::kBf16);
  p.aFormat = static_cast<Fp8Format>(3);
  rejects(p, "aFormat");
  p = pr.params(Fp8Scaling::kPerTensor, Fp8Out::kBf16);
  p.a = static_cast<const uint8_t*>(p.a) + 8;
  rejects(p, "aligned");
  p = pr.params(Fp8Scaling::kPerTensor, Fp8Out::kFp32);
  p.ldc = 258;  // fp32 C: a multiple of 4
  rejects(p, "ldc");
}
