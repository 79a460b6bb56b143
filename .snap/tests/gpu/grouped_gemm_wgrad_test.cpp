// The grouped TN GEMM (tandem/kernels/grouped_gemm_wgrad.hpp: out[e] = a_eᵀ · b_e over each group's rows) against an
// fp64 reference on the host: uneven and empty groups, groups that are not multiples of the 64-row k-block (so a
// block straddles two groups), a 1-row group, every row in one group, m and n multiples of 8 but not of the tile,
// padded row strides, bf16 and fp16, out in the input type and in fp32, NaN and inf in the rows after the last group
// (they must contribute nothing), no rows at all, capture in a CUDA graph with the offsets changed between replays,
// 20 bitwise repeats and grid-size independence, and the shape rules.
// This process initialises CUDA itself (no forked ranks), so it is its own executable (tandem_grouped_wgrad_tests).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"
#include "tandem/kernels/grouped_gemm_wgrad.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GemmOut;
using tandem::kernels::GroupedWgradParams;
using tandem::kernels::launchGroupedWgrad;
using tandem::kernels::validateGroupedWgrad;

namespace {

using tandem::gputest::ck;
using tandem::gputest::DeviceMem;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;

constexpr size_t kGuardBytes = 4096;  // poisoned bytes after out: a store past out[E - 1] shows there

float toF(GemmDtype dt, uint16_t v) { return dt == GemmDtype::kBf16 ? tandem::bf16ToFloat(v) : tandem::halfToFloat(v); }
uint16_t fromF(GemmDtype dt, float v) { return dt == GemmDtype::kBf16 ? tandem::floatToBf16(v) : tandem::floatToHalf(v); }
const char* dtypeName(GemmDtype d) { return d == GemmDtype::kBf16 ? "bf16" : "fp16"; }
const char* outName(GemmOut o) { return o == GemmOut::kFp32 ? "fp32 out" : "16-bit out"; }

struct Case {
  GemmDtype dtype = GemmDtype::kBf16;
  GemmOut out = GemmOut::kInput;
  int64_t m = 0, n = 0;
  int64_t padA = 0, padB = 0;   // lda = m + padA, ldb = n + padB (0, 0: dense, passed as 0)
  std::vector<int32_t> counts;  // rows per expert
  int32_t lead = 0, tail = 0;   // rows before the first and after the last group (never summed)
  bool poisonTail = false;      // the tail rows of a and b hold inf and NaN
  int numSms = 0;
  uint64_t seed = 1;
};

// Host copies of one case's inputs, and its device buffers.
struct Problem {
  Case c;
  int64_t mTotal = 0, lda = 0, ldb = 0;
  size_t outElem = 2, outBytes = 0;
  std::vector<int32_t> offsets;
  std::vector<uint16_t> a, b;
  DeviceMem da, db, dout, doff;

  explicit Problem(const Case& cs)
      : c(cs),
        mTotal(total(cs)),
        lda(cs.m + cs.padA),
        ldb(cs.n + cs.padB),
        outElem(cs.out == GemmOut::kFp32 ? 4 : 2),
        outBytes(cs.counts.size() * size_t(cs.m * cs.n) * outElem),
        da(size_t(mTotal * lda) * 2),
        db(size_t(mTotal * ldb) * 2),
        dout(outBytes + kGuardBytes),
        doff((cs.counts.size() + 1) * 4) {
    std::mt19937_64 rng(cs.seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    offsets.push_back(cs.lead);
    for (int32_t n : cs.counts) offsets.push_back(offsets.back() + n);
    a.resize(size_t(mTotal * lda));
    for (auto& v : a) v = fromF(cs.dtype, u(rng));
    b.resize(size_t(mTotal * ldb));
    for (auto& v : b) v = fromF(cs.dtype, u(rng));
    if (cs.poisonTail) {
      const float inf = std::numeric_limits<float>::infinity();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t r = offsets.back(); r < mTotal; ++r) {
        for (int64_t i = 0; i < lda; ++i) a[size_t(r * lda + i)] = fromF(cs.dtype, (i % 2) != 0 ? inf : nan);
        for (int64_t j = 0; j < ldb; ++j) b[size_t(r * ldb + j)] = fromF(cs.dtype, (j % 2) != 0 ? nan : -inf);
      }
    }
    upload();
  }

  static int64_t total(const Case& cs) {
    int64_t m = cs.lead + cs.tail;
    for (int32_t n : cs.counts) m += n;
    return m;
  }

  void upload() {
    if (mTotal > 0) {
      ck(cudaMemcpy(da.p, a.data(), a.size() * 2, cudaMemcpyHostToDevice), "copy a");
      ck(cudaMemcpy(db.p, b.data(), b.size() * 2, cudaMemcpyHostToDevice), "copy b");
    }
    ck(cudaMemcpy(doff.p, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice), "copy offsets");
  }

  GroupedWgradParams params() const {
    GroupedWgradParams p{};
    p.a = da.p;
    p.b = db.p;
    p.out = dout.p;
    p.groupOffsets = doff.as<int32_t>();
    p.mTotal = mTotal;
    p.m = c.m;
    p.n = c.n;
    p.numExperts = static_cast<int64_t>(c.counts.size());
    p.lda = c.padA != 0 ? lda : 0;
    p.ldb = c.padB != 0 ? ldb : 0;
    p.dtype = c.dtype;
    p.outDtype = c.out;
    return p;
  }

  void poison(cudaStream_t s) const { ck(cudaMemsetAsync(dout.p, 0xFF, outBytes + kGuardBytes, s), "poison out"); }

  std::vector<uint8_t> fetch(cudaStream_t s) const {
    std::vector<uint8_t> out(outBytes + kGuardBytes);
    ck(cudaMemcpyAsync(out.data(), dout.p, out.size(), cudaMemcpyDeviceToHost, s), "copy out");
    ck(cudaStreamSynchronize(s), "sync");
    return out;
  }

  double value(const std::vector<uint8_t>& out, size_t idx) const {
    if (outElem == 4) {
      float f;
      std::memcpy(&f, out.data() + idx * 4, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, out.data() + idx * 2, 2);
    return toF(c.dtype, h);
  }

  // Every expert's out against fp64 (an empty group's exactly +0), and the guard after out untouched.
  void check(const std::vector<uint8_t>& out) const {
    const bool f32 = c.out == GemmOut::kFp32;
    // fp32 out: a quarter of a bf16 half-ulp, so an output rounded to bf16 on the way fails.
    const double relTol = f32 ? 5e-4 : (c.dtype == GemmDtype::kBf16 ? 1.0 / 128 : 1.0 / 1024);
    const double absTol = f32 ? 5e-4 : 1e-2;  // times the rms of the expert's reference
    std::vector<float> af(a.size()), bf(b.size());
    for (size_t i = 0; i < a.size(); ++i) af[i] = toF(c.dtype, a[i]);
    for (size_t i = 0; i < b.size(); ++i) bf[i] = toF(c.dtype, b[i]);
    const size_t mn = size_t(c.m * c.n);
    std::vector<double> ref(mn);
    size_t bad = 0, nonFinite = 0, nonZero = 0;
    std::string first;
    for (size_t e = 0; e < c.counts.size(); ++e) {
      std::fill(ref.begin(), ref.end(), 0.0);
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        const float* ar = af.data() + r * lda;
        const float* br = bf.data() + r * ldb;
        for (int64_t i = 0; i < c.m; ++i) {
          const double ai = ar[i];
          double* row = ref.data() + i * c.n;
          for (int64_t j = 0; j < c.n; ++j) row[j] += ai * double(br[j]);
        }
      }
      double sumSq = 0;
      for (double v : ref) sumSq += v * v;
      const double rms = std::sqrt(sumSq / double(mn));
      for (size_t idx = 0; idx < mn; ++idx) {
        const double o = value(out, e * mn + idx), want = ref[idx];
        if (c.counts[e] == 0) {
          // +0 exactly: not the poison (NaN), not -0
          if (!(o == 0.0 && !std::signbit(o)) && nonZero++ == 0) {
            first = "expert " + std::to_string(e) + " (empty) element " + std::to_string(idx) + " is " + std::to_string(o);
          }
          continue;
        }
        if (!std::isfinite(o)) {
          if (nonFinite++ == 0 && first.empty()) {
            first = "expert " + std::to_string(e) + " row " + std::to_string(idx / size_t(c.n)) + " col " +
                    std::to_string(idx % size_t(c.n)) + " is not finite";
          }
          continue;
        }
        if (std::fabs(o - want) > relTol * std::fabs(want) + absTol * rms) {
          if (bad++ == 0 && first.empty()) {
            first = "expert " + std::to_string(e) + " row " + std::to_string(idx / size_t(c.n)) + " col " +
                    std::to_string(idx % size_t(c.n)) + ": got " + std::to_string(o) + ", want " +
                    std::to_string(want);
          }
        }
      }
    }
    size_t guard = 0;
    for (size_t i = outBytes; i < out.size(); ++i) guard += out[i] != 0xFF ? 1 : 0;
    CHECK_MESSAGE(nonZero == 0, nonZero << " elements of empty experts are not +0; " << first);
    CHECK_MESSAGE(nonFinite == 0, nonFinite << " elements are NaN/inf (unwritten, or a neighbour's row leaked); "
                                            << first);
    CHECK_MESSAGE(bad == 0, bad << " elements off the fp64 reference; first: " << first);
    CHECK_MESSAGE(guard == 0, guard << " bytes after out were written");
  }
};

std::vector<uint8_t> runOnce(const Problem& pr, cudaStream_t s, int numSms) {
  pr.poison(s);
  launchGroupedWgrad(pr.params(), s, numSms);
  ck(cudaGetLastError(), "launch");
  syncWithin(s, 20, "grouped wgrad");
  return pr.fetch(s);
}

// Against fp64, then once more with the same result to the bit.
void runAndCheck(const Case& c) {
  Problem pr(c);
  Stream st;
  const std::vector<uint8_t> out = runOnce(pr, st.s, c.numSms);
  pr.check(out);
  const std::vector<uint8_t> again = runOnce(pr, st.s, c.numSms);
  CHECK_MESSAGE(std::memcmp(out.data(), again.data(), out.size()) == 0, "second run differs bitwise");
}

// 9 experts: empty ones (first and in the middle), a 1-row group, groups of 63, 64, 65 and 127 rows (a group ends
// inside, or exactly at, a 64-row block; the next group's first block starts mid-block), and a long one.
const std::vector<int32_t> kUneven = {0, 1, 63, 64, 0, 65, 300, 127, 17};

}  // namespace

TEST_CASE("grouped wgrad: matches fp64 with uneven, empty and straddling groups, m and n off the tile") {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (GemmOut o : {GemmOut::kInput, GemmOut::kFp32}) {
      for (int sms : {0, 3}) {
        CAPTURE(dtypeName(dt));
        CAPTURE(outName(o));
        CAPTURE(sms);
        Case c;
        c.dtype = dt;
        c.out = o;
        c.m = 200;  // two row tiles, the second 72 rows (its second 64-row box 8 rows)
        c.n = 264;  // two column tiles, the second 8 columns wide (three of its four boxes past n)
        c.counts = kUneven;
        c.lead = 3;
        c.tail = 5;
        c.numSms = sms;  // 3 CTAs: each runs many units, the ring wraps across units and experts
        c.seed = 11 + static_cast<uint64_t>(sms) + (o == GemmOut::kFp32 ? 100 : 0);
        runAndCheck(c);
      }
    }
  }
}

TEST_CASE("grouped wgrad: every row in one group, a 1-row group alone, narrow m and n, padded strides") {
  SUBCASE("all rows in one expert of four (deep K: 11 blocks, the last 61 rows)") {
    Case c;
    c.counts = {0, 701, 0, 0};
    c.m = 136;
    c.n = 72;
    c.numSms = 2;
    c.seed = 21;
    runAndCheck(c);
  }
  SUBCASE("a single expert with a single row") {
    Case c;
    c.counts = {1};
    c.m = 8;
    c.n = 8;
    c.seed = 22;
    runAndCheck(c);
  }
  SUBCASE("padded lda and ldb, fp16, fp32 out") {
    Case c;
    c.dtype = GemmDtype::kFp16;
    c.out = GemmOut::kFp32;
    c.counts = {40, 0, 129, 7};
    c.m = 48;
    c.n = 520;
    c.padA = 24;
    c.padB = 8;
    c.lead = 2;
    c.tail = 9;
    c.seed = 23;
    runAndCheck(c);
  }
  SUBCASE("40 experts of 0..44 rows") {
    Case c;
    for (int e = 0; e < 40; ++e) c.counts.push_back((e * 29) % 45);
    c.m = 64;
    c.n = 256;
    c.numSms = 5;
    c.seed = 24;
    runAndCheck(c);
  }
}

TEST_CASE("grouped wgrad: inf and NaN in the rows after the last group contribute nothing") {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    CAPTURE(dtypeName(dt));
    Case c;
    c.dtype = dt;
    c.counts = {5, 0, 70};  // the last group's second block holds 6 of its rows and 58 poisoned rows
    c.tail = 100;
    c.poisonTail = true;
    c.m = 128;
    c.n = 256;
    c.seed = 31;
    runAndCheck(c);
  }
}

TEST_CASE("grouped wgrad: no rows at all, or rows outside every group only, give zeros") {
  for (GemmOut o : {GemmOut::kInput, GemmOut::kFp32}) {
    CAPTURE(outName(o));
    SUBCASE("mTotal = 0") {
      Case c;
      c.out = o;
      c.counts = {0, 0, 0};
      c.m = 72;
      c.n = 40;
      runAndCheck(c);
    }
    SUBCASE("every group empty, rows before and after") {
      Case c;
      c.out = o;
      c.counts = {0, 0, 0, 0, 0};
      c.lead = 10;
      c.tail = 70;
      c.m = 136;
      c.n = 264;
      runAndCheck(c);
    }
  }
}

TEST_CASE("grouped wgrad: the runIf gate writes nothing unless its word equals runValue") {
  Case c;
  c.counts = {0, 40, 70};
  c.m = 128;
  c.n = 256;
  c.seed = 41;
  Problem pr(c);
  Stream st;
  DeviceMem word(4);
  for (int32_t v : {2, 1}) {  // 2: a failed op's state (nothing written); 1: run
    CAPTURE(v);
    ck(cudaMemcpy(word.p, &v, 4, cudaMemcpyHostToDevice), "copy gate");
    pr.poison(st.s);
    GroupedWgradParams p = pr.params();
    p.runIf = word.as<int32_t>();
    p.runValue = 1;
    launchGroupedWgrad(p, st.s);
    ck(cudaGetLastError(), "launch");
    syncWithin(st.s, 20, "grouped wgrad");
    const std::vector<uint8_t> out = pr.fetch(st.s);
    if (v == 1) {
      pr.check(out);
    } else {
      CHECK_MESSAGE(std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0xFF; }),
                    "a gated launch wrote out");
    }
  }
}

TEST_CASE("grouped wgrad: 20 runs and every grid size give the same bits") {
  Case c;
  c.m = 256;
  c.n = 512;
  std::mt19937_64 rng(41);
  for (int e = 0; e < 16; ++e) c.counts.push_back(rng() % 5 == 0 ? 0 : static_cast<int32_t>(1 + rng() % 400));
  c.seed = 42;
  Problem pr(c);
  Stream st;
  const std::vector<uint8_t> out = runOnce(pr, st.s, 0);
  pr.check(out);
  for (int i = 0; i < 20; ++i) {
    const std::vector<uint8_t> again = runOnce(pr, st.s, 0);
    REQUIRE_MESSAGE(std::memcmp(out.data(), again.data(), out.size()) == 0, "run " << i + 2 << " differs bitwise");
  }
  for (int sms : {1, 7, 64}) {
    CAPTURE(sms);
    const std::vector<uint8_t> other = runOnce(pr, st.s, sms);
    CHECK_MESSAGE(std::memcmp(out.data(), other.data(), out.size()) == 0, "a grid of " << sms << " CTAs differs");
  }
}

TEST_CASE("grouped wgrad: a captured launch reads the offsets on the device at each replay") {
  Case c;
  c.counts = {100, 0, 60, 40};
  c.m = 128;
  c.n = 128;
  c.seed = 51;
  Problem pr(c);
  Stream st;
  // Kernels loaded and the tensor maps cached before the capture (an eager run does both).
  CHECK_NOTHROW(tandem::kernels::preloadGroupedWgradKernels(0));
  pr.check(runOnce(pr, st.s, 0));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ck(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  launchGroupedWgrad(pr.params(), st.s);
  ck(cudaStreamEndCapture(st.s, &graph), "cudaStreamEndCapture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  // Two routings of the same 200 rows, replayed with the same graph: the second moves rows between experts.
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{100, 0, 60, 40}, std::vector<int32_t>{0, 130, 3, 67}}) {
    pr.c.counts = counts;
    pr.offsets = {0};
    for (int32_t n : counts) pr.offsets.push_back(pr.offsets.back() + n);
    pr.upload();
    pr.poison(st.s);
    ck(cudaGraphLaunch(exec, st.s), "cudaGraphLaunch");
    syncWithin(st.s, 20, "graph replay");
    pr.check(pr.fetch(st.s));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("grouped wgrad: shapes and pointers the kernel cannot take are refused with the rule named") {
  Case c;
  c.m = 64;
  c.n = 64;
  c.counts = {10, 20};
  Problem pr(c);
  const GroupedWgradParams good = pr.params();
  CHECK_NOTHROW(validateGroupedWgrad(good));

  struct Bad {
    const char* what;
    void (*mutate)(GroupedWgradParams&);
  };
  const Bad bad[] = {
      {"dtype must be bf16 or fp16", [](GroupedWgradParams& p) { p.dtype = static_cast<GemmDtype>(7); }},
      {"outDtype must be kInput", [](GroupedWgradParams& p) { p.outDtype = static_cast<GemmOut>(3); }},
      {"sizes must be >= 0", [](GroupedWgradParams& p) { p.mTotal = -1; }},
      {"below 2^31", [](GroupedWgradParams& p) { p.n = int64_t(1) << 32; }},
      {"below 2^31", [](GroupedWgradParams& p) { p.mTotal = int64_t(1) << 31; }},
      {"m and n must be multiples of 8", [](GroupedWgradParams& p) { p.m = 60; }},
      {"m and n must be multiples of 8", [](GroupedWgradParams& p) { p.n = 12; }},
      {"lda must be 0 (dense) or a multiple of 8 that is >= m", [](GroupedWgradParams& p) { p.lda = 32; }},
      {"lda must be 0 (dense) or a multiple of 8 that is >= m", [](GroupedWgradParams& p) { p.lda = 68; }},
      {"ldb must be 0 (dense) or a multiple of 8 that is >= n", [](GroupedWgradParams& p) { p.ldb = 60; }},
      {"too many output tiles", [](GroupedWgradParams& p) {
         p.numExperts = int64_t(1) << 24;
         p.m = int64_t(1) << 16;
       }},
      {"must be below 2^40 bytes", [](GroupedWgradParams& p) {
         p.m = int64_t(1) << 21;
         p.n = int64_t(1) << 20;
         p.outDtype = GemmOut::kFp32;
       }},
      {"out must be non-null", [](GroupedWgradParams& p) { p.out = nullptr; }},
      {"out must be 16-byte aligned", [](GroupedWgradParams& p) { p.out = static_cast<char*>(p.out) + 2; }},
      {"a and b must be non-null", [](GroupedWgradParams& p) { p.b = nullptr; }},
      {"a and b must be 16-byte aligned", [](GroupedWgradParams& p) { p.a = static_cast<const char*>(p.a) + 8; }},
      {"groupOffsets must point to", [](GroupedWgradParams& p) { p.groupOffsets = nullptr; }},
      {"out must not overlap", [](GroupedWgradParams& p) { p.out = const_cast<void*>(p.b); }},
      {"out must not overlap", [](GroupedWgradParams& p) {
         p.out = static_cast<char*>(const_cast<void*>(p.a)) + 64;  // inside a's rows
       }},
  };
  Stream st;
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    GroupedWgradParams p = good;
    b.mutate(p);
    for (int viaLaunch = 0; viaLaunch < 2; ++viaLaunch) {
      try {
        if (viaLaunch != 0) {
          launchGroupedWgrad(p, st.s);
        } else {
          validateGroupedWgrad(p);
        }
        FAIL("accepted");
      } catch (const tandem::Error& e) {
        CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
        CHECK_MESSAGE(std::string(e.what()).find(b.what) != std::string::npos, e.what());
      }
    }
  }
  // Nothing to compute: accepted without pointers, and nothing is launched.
  GroupedWgradParams empty{};
  empty.m = 64;
  empty.n = 64;
  CHECK_NOTHROW(launchGroupedWgrad(empty, st.s));
  ck(cudaStreamSynchronize(st.s), "sync");
}
