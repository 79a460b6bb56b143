// The FP8 grouped GEMM (tandem/kernels/grouped_gemm_fp8.hpp) against an fp64 host reference of the dequantized
// inputs (x e4m3 with 1 x 128 scales, w e4m3 with 128 x 128 block scales or one scale per expert): 1 to 8 experts,
// empty groups, groups ending off the 64-row epilogue chunk and the 128-row tile, rows before and after the groups
// left untouched, n and k off the tile, padded strides, the row scale, a grid small enough that every CTA runs many
// tiles, a deep K; the SwiGLU epilogue's e4m3 h and its 1 x 128 scales (scale = amax / 448, each block's largest
// value at 448, every value within e4m3 rounding of the reference); bitwise repeats (static and dynamic tile order);
// the shape rules. This process initialises CUDA itself, so it is its own executable (tandem_grouped_gemm_fp8_tests).
#include "tandem/kernels/grouped_gemm_fp8.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "fp8_ref.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"

using tandem::kernels::Fp8Format;
using tandem::kernels::gemmFp8ScaleALd;
using tandem::kernels::GroupedFp8WeightScaling;
using tandem::kernels::GroupedGemmEpilogue;
using tandem::kernels::GroupedGemmFp8Params;
using tandem::kernels::launchGroupedGemmFp8;
using tandem::kernels::validateGroupedGemmFp8;

namespace {

using tandem::gputest::ck;
using tandem::gputest::decodeFp8;
using tandem::gputest::DeviceMem;
using tandem::gputest::randomFp8;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;

constexpr int64_t kBlock = 128;
constexpr uint8_t kPoisonByte = 0xFF;  // NaN in bf16, e4m3 and fp32
constexpr double kE4M3Max = 448.0;

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
double e4m3(uint8_t v) { return decodeFp8(v, Fp8Format::kE4M3); }

struct Case {
  GroupedGemmEpilogue epi = GroupedGemmEpilogue::kStore;
  GroupedFp8WeightScaling wScaling = GroupedFp8WeightScaling::kBlock;
  int64_t n = 0, k = 0;
  std::vector<int32_t> counts;  // rows per expert
  int32_t lead = 0, tail = 0;   // rows before the first and after the last group (must stay untouched)
  bool scale = false;           // rowScale
  bool padded = false;          // ldx, ldOut, ldxScale and ldOutScale past their dense values
  int numSms = 0;
  uint64_t seed = 1;
};

// Host copies of one case's inputs, and its device buffers.
struct Problem {
  Case c;
  bool swiglu;
  int64_t e, mTotal, nOut, kBlocks, ldx, ldOut, ldxs, ldos, outBlocks, outElem, wScales;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> x, w;
  std::vector<float> xs, ws, rowScale;
  DeviceMem dx, dxs, dw, dws, dout, dos, doff, drs;

  explicit Problem(const Case& cs)
      : c(cs),
        swiglu(cs.epi == GroupedGemmEpilogue::kSwiGlu),
        e(static_cast<int64_t>(cs.counts.size())),
        mTotal(total(cs)),
        nOut(swiglu ? cs.n / 2 : cs.n),
        kBlocks(ceilDiv(cs.k, kBlock)),
        ldx(cs.k + (cs.padded ? 32 : 0)),
        ldOut(nOut + (cs.padded ? 16 : 0)),
        ldxs(gemmFp8ScaleALd(mTotal) + (cs.padded ? 8 : 0)),
        ldos(gemmFp8ScaleALd(mTotal) + (cs.padded ? 4 : 0)),
        outBlocks(ceilDiv(nOut, kBlock)),
        outElem(swiglu ? 1 : 2),
        wScales(cs.wScaling == GroupedFp8WeightScaling::kBlock ? e * ceilDiv(cs.n, kBlock) * kBlocks : e),
        dx(size_t(mTotal * ldx)),
        dxs(size_t(kBlocks * ldxs) * 4),
        dw(size_t(e * cs.n * cs.k)),
        dws(size_t(wScales) * 4),
        dout(size_t(mTotal * ldOut * outElem)),
        dos(size_t(outBlocks * ldos) * 4),
        doff(size_t(e + 1) * 4),
        drs(size_t(mTotal) * 4) {
    std::mt19937_64 rng(cs.seed);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    // Scales 2^-3 .. 2^2 with a mantissa: a misplaced one shows as a large error.
    const auto randomScale = [&] { return std::ldexp(1.0f + u(rng), static_cast<int>(rng() % 6) - 3); };
    offsets.push_back(cs.lead);
    for (int32_t n : cs.counts) offsets.push_back(offsets.back() + n);
    x.assign(size_t(mTotal * ldx), 0);
    for (int64_t r = 0; r < mTotal; ++r) {
      for (int64_t kk = 0; kk < cs.k; ++kk) x[size_t(r * ldx + kk)] = randomFp8(rng, Fp8Format::kE4M3);
    }
    xs.assign(size_t(kBlocks * ldxs), 0.0f);
    for (int64_t kb = 0; kb < kBlocks; ++kb) {
      for (int64_t r = 0; r < mTotal; ++r) xs[size_t(kb * ldxs + r)] = randomScale();
    }
    w.resize(size_t(e * cs.n * cs.k));
    for (auto& v : w) v = randomFp8(rng, Fp8Format::kE4M3);
    ws.resize(size_t(wScales));
    for (auto& v : ws) v = randomScale() / 64;  // keeps the products (and h) in a moderate range
    rowScale.resize(size_t(mTotal));
    for (auto& v : rowScale) v = 0.25f + 0.75f * u(rng);
    ck(cudaMemcpy(dx.p, x.data(), x.size(), cudaMemcpyHostToDevice), "copy x");
    ck(cudaMemcpy(dxs.p, xs.data(), xs.size() * 4, cudaMemcpyHostToDevice), "copy xScale");
    ck(cudaMemcpy(dw.p, w.data(), w.size(), cudaMemcpyHostToDevice), "copy w");
    ck(cudaMemcpy(dws.p, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice), "copy wScale");
    ck(cudaMemcpy(doff.p, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice), "copy offsets");
    ck(cudaMemcpy(drs.p, rowScale.data(), rowScale.size() * 4, cudaMemcpyHostToDevice), "copy rowScale");
  }

  static int64_t total(const Case& cs) {
    int64_t m = cs.lead + cs.tail;
    for (int32_t n : cs.counts) m += n;
    return m;
  }

  GroupedGemmFp8Params params() const {
    GroupedGemmFp8Params p{};
    p.x = dx.p;
    p.xScale = dxs.as<float>();
    p.w = dw.p;
    p.wScale = dws.as<float>();
    p.out = dout.p;
    p.outScale = swiglu ? dos.as<float>() : nullptr;
    p.groupOffsets = doff.as<int32_t>();
    p.rowScale = c.scale ? drs.as<float>() : nullptr;
    p.mTotal = mTotal;
    p.n = c.n;
    p.k = c.k;
    p.numExperts = e;
    p.ldx = c.padded ? ldx : 0;
    p.ldOut = c.padded ? ldOut : 0;
    p.ldxScale = c.padded ? ldxs : 0;
    p.ldOutScale = c.padded && swiglu ? ldos : 0;
    p.epilogue = c.epi;
    p.wScaling = c.wScaling;
    return p;
  }

  float wScaleOf(int64_t ex, int64_t row, int64_t kb) const {
    if (c.wScaling == GroupedFp8WeightScaling::kPerExpert) return ws[size_t(ex)];
    return ws[size_t((ex * ceilDiv(c.n, kBlock) + row / kBlock) * kBlocks + kb)];
  }

  struct Result {
    std::vector<uint8_t> out, outScale;
  };

  Result run(cudaStream_t s, int numSms, uint32_t* counter = nullptr) const {
    ck(cudaMemsetAsync(dout.p, kPoisonByte, size_t(mTotal * ldOut * outElem), s), "poison out");
    ck(cudaMemsetAsync(dos.p, kPoisonByte, size_t(outBlocks * ldos) * 4, s), "poison outScale");
    GroupedGemmFp8Params g = params();
    if (counter != nullptr) {
      ck(cudaMemsetAsync(counter, 0, 4, s), "cudaMemsetAsync(tile counter)");
      g.tileCounter = counter;
    }
    launchGroupedGemmFp8(g, s, numSms);
    ck(cudaGetLastError(), "launch");
    syncWithin(s, 20, "FP8 grouped GEMM");
    Result res;
    res.out.resize(size_t(mTotal * ldOut * outElem));
    res.outScale.resize(size_t(outBlocks * ldos) * 4);
    ck(cudaMemcpy(res.out.data(), dout.p, res.out.size(), cudaMemcpyDeviceToHost), "copy out");
    ck(cudaMemcpy(res.outScale.data(), dos.p, res.outScale.size(), cudaMemcpyDeviceToHost), "copy outScale");
    return res;
  }

  // The fp64 reference of out's group rows (h before quantisation with SwiGLU); inGroup marks them.
  std::vector<double> reference(std::vector<bool>& inGroup) const {
    std::vector<double> xd(x.size()), wd(w.size());  // the fp8 values, decoded once
    for (size_t i = 0; i < x.size(); ++i) xd[i] = e4m3(x[i]);
    for (size_t i = 0; i < w.size(); ++i) wd[i] = e4m3(w[i]);
    // x[r] · w[ex][row] of the dequantized inputs: per k-block sums, scaled.
    const auto dot = [&](int64_t r, int64_t ex, int64_t row) {
      const double* xr = xd.data() + r * ldx;
      const double* wr = wd.data() + (ex * c.n + row) * c.k;
      double acc = 0;
      for (int64_t kb = 0; kb < kBlocks; ++kb) {
        double part = 0;
        for (int64_t kk = kb * kBlock; kk < std::min(c.k, (kb + 1) * kBlock); ++kk) part += xr[kk] * wr[kk];
        acc += part * double(xs[size_t(kb * ldxs + r)]) * double(wScaleOf(ex, row, kb));
      }
      return acc;
    };
    std::vector<double> ref(size_t(mTotal * nOut), 0.0);
    inGroup.assign(size_t(mTotal), false);
    for (int64_t ex = 0; ex < e; ++ex) {
      for (int64_t r = offsets[size_t(ex)]; r < offsets[size_t(ex + 1)]; ++r) {
        inGroup[size_t(r)] = true;
        for (int64_t col = 0; col < nOut; ++col) {
          double v;
          if (swiglu) {
            const double g = dot(r, ex, col), up = dot(r, ex, col + nOut);
            v = g / (1.0 + std::exp(-g)) * up;
          } else {
            v = dot(r, ex, col);
          }
          if (c.scale) v *= rowScale[size_t(r)];
          ref[size_t(r * nOut + col)] = v;
        }
      }
    }
    return ref;
  }

  // Rows outside every group, out's padding columns and outScale's padding rows still poison.
  size_t untouchedViolations(const Result& res, const std::vector<bool>& inGroup) const {
    size_t touched = 0;
    for (int64_t r = 0; r < mTotal; ++r) {
      for (int64_t b = 0; b < ldOut * outElem; ++b) {
        const bool written = inGroup[size_t(r)] && b < nOut * outElem;
        if (!written && res.out[size_t(r * ldOut * outElem + b)] != kPoisonByte) ++touched;
      }
    }
    if (swiglu) {
      for (int64_t blk = 0; blk < outBlocks; ++blk) {
        for (int64_t r = 0; r < ldos; ++r) {
          const bool written = r < mTotal && inGroup[size_t(r)];
          for (int i = 0; i < 4; ++i) {
            if (!written && res.outScale[size_t((blk * ldos + r) * 4 + i)] != kPoisonByte) ++touched;
          }
        }
      }
    }
    return touched;
  }

  void checkStore(const Result& res, const std::vector<double>& ref, const std::vector<bool>& inGroup) const {
    double sumSq = 0, errSq = 0;
    size_t count = 0;
    for (int64_t r = 0; r < mTotal; ++r) {
      if (!inGroup[size_t(r)]) continue;
      for (int64_t col = 0; col < nOut; ++col) {
        sumSq += ref[size_t(r * nOut + col)] * ref[size_t(r * nOut + col)];
        ++count;
      }
    }
    const double rms = count > 0 ? std::sqrt(sumSq / double(count)) : 0.0;
    size_t bad = 0, nonFinite = 0;
    std::string first;
    for (int64_t r = 0; r < mTotal; ++r) {
      if (!inGroup[size_t(r)]) continue;
      for (int64_t col = 0; col < nOut; ++col) {
        uint16_t bits;
        std::memcpy(&bits, res.out.data() + (r * ldOut + col) * 2, 2);
        const double o = tandem::bf16ToFloat(bits), want = ref[size_t(r * nOut + col)];
        if (!std::isfinite(o)) {
          ++nonFinite;
          continue;
        }
        errSq += (o - want) * (o - want);
        // bf16 rounds at 2^-9 relative; the fp8 tensor-core sums within a k-block add about 2^-14 of the block's
        // magnitude, the rms term.
        if (std::fabs(o - want) > std::fabs(want) / 128 + 1e-2 * rms) {
          if (bad++ == 0) {
            first = "row " + std::to_string(r) + " col " + std::to_string(col) + ": got " + std::to_string(o) +
                    ", want " + std::to_string(want);
          }
        }
      }
    }
    CHECK_MESSAGE(nonFinite == 0, nonFinite << " group elements are NaN/inf (unwritten or overflow)");
    CHECK_MESSAGE(bad == 0, bad << " elements off the fp64 reference; first: " << first);
    if (count > 0) {
      const double rel = std::sqrt(errSq / sumSq);
      MESSAGE("relative error " << rel);
      CHECK_MESSAGE(rel < 1e-2, "relative error " << rel);
    }
  }

  // h as e4m3 with one scale per row and 128 columns.
  void checkSwiGlu(const Result& res, const std::vector<double>& ref, const std::vector<bool>& inGroup) const {
    size_t badScale = 0, badValue = 0, noMax = 0, nonFinite = 0, blocks = 0;
    std::string firstScale, firstValue;
    for (int64_t r = 0; r < mTotal; ++r) {
      if (!inGroup[size_t(r)]) continue;
      for (int64_t blk = 0; blk < outBlocks; ++blk) {
        ++blocks;
        const int64_t c0 = blk * kBlock, c1 = std::min(nOut, c0 + kBlock);
        double amax = 0;
        for (int64_t col = c0; col < c1; ++col) amax = std::max(amax, std::fabs(ref[size_t(r * nOut + col)]));
        float s;
        std::memcpy(&s, res.outScale.data() + (blk * ldos + r) * 4, 4);
        if (!std::isfinite(s)) {
          ++nonFinite;
          continue;
        }
        // The kernel's amax comes from its fp32 h: within the accumulation error of the reference's.
        const double wantScale = amax / kE4M3Max;
        if (std::fabs(double(s) - wantScale) > 4e-3 * wantScale + 1e-30) {
          if (badScale++ == 0) {
            firstScale = "row " + std::to_string(r) + " block " + std::to_string(blk) + ": scale " + std::to_string(s) +
                         ", want " + std::to_string(wantScale);
          }
        }
        bool hasMax = false;
        for (int64_t col = c0; col < c1; ++col) {
          const uint8_t q = res.out[size_t(r * ldOut + col)];
          if ((q & 0x7F) == 0x7F) {  // e4m3 NaN (never produced with satfinite)
            ++nonFinite;
            continue;
          }
          hasMax = hasMax || (q & 0x7F) == 0x7E;  // +-448: the block's amax lands on e4m3's largest value
          const double got = e4m3(q) * double(s), want = ref[size_t(r * nOut + col)];
          // e4m3 rounds at 2^-4 relative (normal) or 2^-10 of the scale (subnormal); plus the accumulation error.
          if (std::fabs(got - want) > std::fabs(want) / 16 + double(s) / 1024 + 4e-3 * amax) {
            if (badValue++ == 0) {
              firstValue = "row " + std::to_string(r) + " col " + std::to_string(col) + ": got " + std::to_string(got) +
                           " (e4m3 " + std::to_string(q) + "), want " + std::to_string(want);
            }
          }
        }
        if (!hasMax && amax > 0) ++noMax;
      }
    }
    MESSAGE(blocks << " row blocks of h checked");
    CHECK_MESSAGE(nonFinite == 0, nonFinite << " NaN/inf values or scales in the group rows");
    CHECK_MESSAGE(badScale == 0, badScale << " scales off amax / 448; first: " << firstScale);
    CHECK_MESSAGE(badValue == 0, badValue << " values off the reference; first: " << firstValue);
    CHECK_MESSAGE(noMax == 0, noMax << " row blocks without a value at +-448");
  }
};

void runAndCheck(const Case& c) {
  Problem pr(c);
  Stream st;
  const Problem::Result res = pr.run(st.s, c.numSms);
  std::vector<bool> inGroup;
  const std::vector<double> ref = pr.reference(inGroup);
  const size_t touched = pr.untouchedViolations(res, inGroup);
  CHECK_MESSAGE(touched == 0, touched << " bytes outside the group rows (or in padding) were written");
  if (pr.swiglu) {
    pr.checkSwiGlu(res, ref, inGroup);
  } else {
    pr.checkStore(res, ref, inGroup);
  }
  // Same inputs, same result, to the bit: one owner per output element, a fixed k order; the dynamic tile order
  // changes which CTA computes a tile, never a value.
  const Problem::Result again = pr.run(st.s, c.numSms);
  CHECK_MESSAGE(res.out == again.out, "second run's out differs bitwise");
  CHECK_MESSAGE(res.outScale == again.outScale, "second run's outScale differs bitwise");
  DeviceMem counter(4);
  const Problem::Result dyn = pr.run(st.s, c.numSms, counter.as<uint32_t>());
  CHECK_MESSAGE(res.out == dyn.out, "the dynamic tile order's out differs bitwise");
  CHECK_MESSAGE(res.outScale == dyn.outScale, "the dynamic tile order's outScale differs bitwise");
}

// 8 experts: empty ones, a 1-row group, groups ending just before and after a 64-row epilogue chunk and a 128-row
// tile, rows before and after the groups.
const std::vector<int32_t> kUneven = {0, 1, 127, 129, 0, 300, 64, 65};

std::string scalingName(GroupedFp8WeightScaling s) {
  return s == GroupedFp8WeightScaling::kBlock ? "w 128x128 blocks" : "w per expert";
}

}  // namespace

TEST_CASE("grouped gemm fp8: store matches fp64 with uneven and empty groups, n and k off the tile") {
  for (GroupedFp8WeightScaling ws : {GroupedFp8WeightScaling::kBlock, GroupedFp8WeightScaling::kPerExpert}) {
    for (int sms : {0, 3}) {
      const std::string scaling = scalingName(ws);  // a std::string: doctest prints a const char* as its address
      CAPTURE(scaling);
      CAPTURE(sms);
      Case c;
      c.wScaling = ws;
      c.n = 264;  // two column tiles: the second 8 columns wide (its second 128-column half past n)
      c.k = 400;  // four k-blocks, the last 16 deep
      c.counts = kUneven;
      c.lead = 3;
      c.tail = 5;
      c.scale = sms != 0;
      c.numSms = sms;  // 3 CTAs: each runs many tiles, the ring wraps across tiles
      c.seed = 11 + static_cast<uint64_t>(sms) + (ws == GroupedFp8WeightScaling::kBlock ? 0 : 100);
      runAndCheck(c);
    }
  }
}

TEST_CASE("grouped gemm fp8: 1 to 8 experts, padded strides, a deep K") {
  SUBCASE("1 to 8 experts") {
    for (int experts = 1; experts <= 8; ++experts) {
      CAPTURE(experts);
      Case c;
      for (int ex = 0; ex < experts; ++ex) c.counts.push_back(ex % 3 == 2 ? 0 : (ex * 53 + experts * 17) % 200 + 1);
      c.n = 384;
      c.k = 256;
      c.numSms = experts % 2 == 0 ? 0 : 4;
      c.seed = 200 + static_cast<uint64_t>(experts);
      runAndCheck(c);
    }
  }
  SUBCASE("padded ldx, ldOut and ldxScale, row scale") {
    Case c;
    c.counts = {70, 0, 190};
    c.n = 520;
    c.k = 272;
    c.lead = 2;
    c.scale = true;
    c.padded = true;
    c.seed = 301;
    runAndCheck(c);
  }
  SUBCASE("deep K: 16 k-blocks through the 4-stage ring") {
    Case c;
    c.counts = {130, 0, 70};
    c.n = 512;
    c.k = 2048;
    c.numSms = 2;
    c.seed = 302;
    runAndCheck(c);
  }
}

TEST_CASE("grouped gemm fp8: SwiGLU quantises h to e4m3 with 1x128 scales, with and without the row scale") {
  for (GroupedFp8WeightScaling ws : {GroupedFp8WeightScaling::kBlock, GroupedFp8WeightScaling::kPerExpert}) {
    for (bool scale : {false, true}) {
      const std::string scaling = scalingName(ws);
      CAPTURE(scaling);
      CAPTURE(scale);
      Case c;
      c.epi = GroupedGemmEpilogue::kSwiGlu;
      c.wScaling = ws;
      // kBlock needs f % 128 == 0; per expert, f = 144 leaves a last h block of 16 columns.
      c.n = ws == GroupedFp8WeightScaling::kBlock ? 512 : 288;
      c.k = 272;
      c.counts = kUneven;
      c.lead = 3;
      c.tail = 5;
      c.scale = scale;
      c.numSms = scale ? 3 : 0;
      c.seed = 401 + (scale ? 1 : 0) + (ws == GroupedFp8WeightScaling::kBlock ? 0 : 10);
      runAndCheck(c);
    }
  }
  SUBCASE("padded h and scale strides, 1 expert") {
    Case c;
    c.epi = GroupedGemmEpilogue::kSwiGlu;
    c.n = 256;
    c.k = 128;
    c.counts = {200};
    c.padded = true;
    c.seed = 420;
    runAndCheck(c);
  }
}

TEST_CASE("grouped gemm fp8: the shape rules name the field") {
  DeviceMem buf(1 << 20);
  GroupedGemmFp8Params g{};
  g.x = buf.p;
  g.xScale = buf.as<float>() + 4096;
  g.w = buf.as<uint8_t>() + 65536;
  g.wScale = buf.as<float>() + 65536;
  g.out = buf.as<uint8_t>() + 524288;
  g.groupOffsets = buf.as<int32_t>() + 200000;
  g.mTotal = 64;
  g.n = 256;
  g.k = 256;
  g.numExperts = 2;
  CHECK_NOTHROW(validateGroupedGemmFp8(g));
  const auto refused = [](GroupedGemmFp8Params p, const char* needle) {
    try {
      validateGroupedGemmFp8(p);
      FAIL("accepted; wanted an error naming " << needle);
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
  };
  GroupedGemmFp8Params p = g;
  p.k = 24;
  refused(p, "k must be a positive multiple of 16");
  p = g;
  p.epilogue = GroupedGemmEpilogue::kSwiGlu;
  refused(p, "outScale");
  p.outScale = buf.as<float>() + 180000;
  CHECK_NOTHROW(validateGroupedGemmFp8(p));
  p.n = 2 * 144;
  refused(p, "multiple of 128");
  p.wScaling = GroupedFp8WeightScaling::kPerExpert;
  CHECK_NOTHROW(validateGroupedGemmFp8(p));
  p = g;
  p.ldxScale = 66;
  refused(p, "ldxScale");
  p = g;
  p.xScale = buf.as<float>() + 4097;
  refused(p, "16-byte aligned");
  p = g;
  p.out = buf.as<uint8_t>() + 65536;  // on w
  refused(p, "must not overlap");
}
