// The grouped GEMM kernels (tandem/kernels/grouped_gemm.hpp) against an fp64 reference on the host: uneven, empty and
// skewed groups, rows outside every group left untouched, n and k that are multiples of 8 but not of the tile, both
// weight layouts (w [E, n, k] and the backward's w [E, k, n]), the SwiGLU and row-scale epilogues, bf16 and fp16, a
// grid small enough that every CTA runs many tiles, the arrival counters (ready, released by the host after the
// launch, abort, deadline), bitwise repeats, and the shape rules.
// The swap-AB path (decode: a few rows per expert) runs the same checks on decode-sized routings, including groups
// longer than its token tile, and a 20-run bitwise repeat.
// This process initialises CUDA itself (no forked ranks), so it is its own executable (tandem_grouped_gemm_tests).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"
#include "tandem/kernels/grouped_gemm.hpp"

using tandem::kernels::ErrorSlot;
using tandem::kernels::GemmDtype;
using tandem::kernels::GemmLayout;
using tandem::kernels::GroupedGemmEpilogue;
using tandem::kernels::GroupedGemmPath;
using tandem::kernels::GroupedGemmParams;
using tandem::kernels::launchGroupedGemm;
using tandem::kernels::validateGroupedGemm;
using tandem::kernels::WaitError;

namespace {

constexpr uint16_t kPoison = 0xFFFF;  // NaN in bf16 and in fp16

using tandem::gputest::ck;
using tandem::gputest::DeviceMem;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;

float toF(GemmDtype dt, uint16_t v) { return dt == GemmDtype::kBf16 ? tandem::bf16ToFloat(v) : tandem::halfToFloat(v); }
uint16_t fromF(GemmDtype dt, float v) { return dt == GemmDtype::kBf16 ? tandem::floatToBf16(v) : tandem::floatToHalf(v); }

struct Case {
  GemmDtype dtype = GemmDtype::kBf16;
  GroupedGemmEpilogue epi = GroupedGemmEpilogue::kStore;
  GemmLayout layout = GemmLayout::kABt;  // w [E, n, k]; kAB: w [E, k, n]
  int64_t n = 0, k = 0;
  std::vector<int32_t> counts;  // rows per expert
  int32_t lead = 0, tail = 0;   // rows before the first and after the last group (must stay untouched)
  bool scale = false;
  int numSms = 0;
  uint64_t seed = 1;
  GroupedGemmPath path = GroupedGemmPath::kAuto;
  int64_t maxGroupRows = 0;  // GroupedGemmParams::maxGroupRows (picks the swap-AB tile width)
};

// Host copies of one case's inputs, and its device buffers.
struct Problem {
  Case c;
  int64_t mTotal = 0, nOut = 0;
  std::vector<int32_t> offsets;
  std::vector<uint16_t> x, w;
  std::vector<float> scale;
  DeviceMem dx, dw, dout, doff, dscale;

  explicit Problem(const Case& cs)
      : c(cs),
        mTotal(total(cs)),
        nOut(cs.epi == GroupedGemmEpilogue::kSwiGlu ? cs.n / 2 : cs.n),
        dx(size_t(mTotal * cs.k) * 2),
        dw(cs.counts.size() * size_t(cs.n * cs.k) * 2),
        dout(size_t(mTotal * nOut) * 2),
        doff((cs.counts.size() + 1) * 4),
        dscale(size_t(mTotal) * 4) {
    std::mt19937_64 rng(cs.seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    offsets.push_back(cs.lead);
    for (int32_t n : cs.counts) offsets.push_back(offsets.back() + n);
    x.resize(size_t(mTotal * cs.k));
    for (auto& v : x) v = fromF(cs.dtype, u(rng));
    w.resize(cs.counts.size() * size_t(cs.n * cs.k));
    for (auto& v : w) v = fromF(cs.dtype, u(rng));
    scale.resize(size_t(mTotal));
    for (auto& v : scale) v = 0.25f + 0.75f * (u(rng) + 1.0f) / 2.0f;
    ck(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "copy x");
    ck(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), "copy w");
    ck(cudaMemcpy(doff.p, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice), "copy offsets");
    ck(cudaMemcpy(dscale.p, scale.data(), scale.size() * 4, cudaMemcpyHostToDevice), "copy scale");
  }

  static int64_t total(const Case& cs) {
    int64_t m = cs.lead + cs.tail;
    for (int32_t n : cs.counts) m += n;
    return m;
  }

  GroupedGemmParams params() const {
    GroupedGemmParams p{};
    p.x = dx.p;
    p.w = dw.p;
    p.out = dout.p;
    p.groupOffsets = doff.as<int32_t>();
    p.rowScale = c.scale ? dscale.as<float>() : nullptr;
    p.mTotal = mTotal;
    p.n = c.n;
    p.k = c.k;
    p.numExperts = static_cast<int64_t>(c.counts.size());
    p.dtype = c.dtype;
    p.epilogue = c.epi;
    p.layout = c.layout;
    p.path = c.path;
    p.maxGroupRows = c.maxGroupRows;
    return p;
  }

  void poison(cudaStream_t s) const {
    ck(cudaMemsetAsync(dout.p, 0xFF, size_t(mTotal * nOut) * 2, s), "poison out");
  }

  std::vector<uint16_t> fetch(cudaStream_t s) const {
    std::vector<uint16_t> out(size_t(mTotal * nOut));
    ck(cudaMemcpyAsync(out.data(), dout.p, out.size() * 2, cudaMemcpyDeviceToHost, s), "copy out");
    ck(cudaStreamSynchronize(s), "sync");
    return out;
  }

  // Every group row against fp64; every other row still poison.
  void check(const std::vector<uint16_t>& out) const {
    const bool bf = c.dtype == GemmDtype::kBf16;
    const double relTol = bf ? 1.0 / 128 : 1.0 / 1024;  // a few units of the output's last place
    std::vector<float> xf(x.size()), wf(w.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = toF(c.dtype, x[i]);
    for (size_t i = 0; i < w.size(); ++i) wf[i] = toF(c.dtype, w[i]);
    std::vector<double> ref(size_t(mTotal * nOut), 0.0);
    std::vector<bool> inGroup(size_t(mTotal), false);
    double sumSq = 0;
    size_t count = 0;
    for (size_t e = 0; e < c.counts.size(); ++e) {
      const float* we = wf.data() + e * size_t(c.n * c.k);
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        inGroup[size_t(r)] = true;
        const float* xr = xf.data() + r * c.k;
        // w[e](col, kk): row col of [n, k], or column col of [k, n].
        const int64_t colStride = c.layout == GemmLayout::kAB ? 1 : c.k;
        const int64_t kStride = c.layout == GemmLayout::kAB ? c.n : 1;
        const auto dot = [&](int64_t col) {
          double acc = 0;
          for (int64_t kk = 0; kk < c.k; ++kk) acc += double(xr[kk]) * double(we[col * colStride + kk * kStride]);
          return acc;
        };
        for (int64_t col = 0; col < nOut; ++col) {
          double v;
          if (c.epi == GroupedGemmEpilogue::kSwiGlu) {
            const double g = dot(col), up = dot(col + nOut);
            v = g / (1.0 + std::exp(-g)) * up;
          } else {
            v = dot(col);
          }
          if (c.scale) v *= scale[size_t(r)];
          ref[size_t(r * nOut + col)] = v;
          sumSq += v * v;
          ++count;
        }
      }
    }
    const double rms = count > 0 ? std::sqrt(sumSq / double(count)) : 0.0;
    double errSq = 0;
    size_t bad = 0, touched = 0, nonFinite = 0;
    std::string first;
    for (int64_t r = 0; r < mTotal; ++r) {
      for (int64_t col = 0; col < nOut; ++col) {
        const uint16_t bits = out[size_t(r * nOut + col)];
        if (!inGroup[size_t(r)]) {
          if (bits != kPoison) ++touched;
          continue;
        }
        const double o = toF(c.dtype, bits), want = ref[size_t(r * nOut + col)];
        if (!std::isfinite(o)) {
          ++nonFinite;
          continue;
        }
        errSq += (o - want) * (o - want);
        if (std::fabs(o - want) > relTol * std::fabs(want) + 1e-2 * rms) {
          if (bad++ == 0) first = "row " + std::to_string(r) + " col " + std::to_string(col) + ": got " +
                                  std::to_string(o) + ", want " + std::to_string(want);
        }
      }
    }
    CHECK_MESSAGE(touched == 0, touched << " elements of rows outside every group were written");
    CHECK_MESSAGE(nonFinite == 0, nonFinite << " group elements are NaN/inf (unwritten or overflow)");
    CHECK_MESSAGE(bad == 0, bad << " elements off the fp64 reference; first: " << first);
    if (count > 0) {
      const double rel = std::sqrt(errSq / sumSq);
      CHECK_MESSAGE(rel < (bf ? 1e-2 : 2e-3), "relative error " << rel);
    }
  }
};

// counter: the dynamic tile order (zeroed here first); skip: skipIdleHalves.
std::vector<uint16_t> runOnce(const Problem& pr, cudaStream_t s, int numSms, uint32_t* counter = nullptr,
                              int skip = 0) {
  pr.poison(s);
  GroupedGemmParams g = pr.params();
  g.skipIdleHalves = skip;
  if (counter != nullptr) {
    ck(cudaMemsetAsync(counter, 0, 4, s), "cudaMemsetAsync(tile counter)");
    g.tileCounter = counter;
  }
  launchGroupedGemm(g, s, numSms);
  ck(cudaGetLastError(), "launch");
  syncWithin(s, 20, "grouped GEMM");
  return pr.fetch(s);
}

void runAndCheck(const Case& c) {
  Problem pr(c);
  Stream st;
  const std::vector<uint16_t> out = runOnce(pr, st.s, c.numSms);
  pr.check(out);
  // Same inputs, same result, to the bit (one owner per output element, fixed K order).
  const std::vector<uint16_t> again = runOnce(pr, st.s, c.numSms);
  CHECK_MESSAGE(std::memcmp(out.data(), again.data(), out.size() * 2) == 0, "second run differs bitwise");
  // The dynamic tile order and the idle-half skip change which CTA computes a tile (and whether a warpgroup whose
  // rows all lie past the group computes at all), never a stored value.
  DeviceMem counter(4);
  for (int skip : {0, 1}) {
    const std::vector<uint16_t> dyn = runOnce(pr, st.s, c.numSms, counter.as<uint32_t>(), skip);
    CHECK_MESSAGE(std::memcmp(out.data(), dyn.data(), out.size() * 2) == 0,
                  "the dynamic tile order" << (skip != 0 ? " with skipIdleHalves" : "") << " differs bitwise");
  }
  const std::vector<uint16_t> skipped = runOnce(pr, st.s, c.numSms, nullptr, 1);
  CHECK_MESSAGE(std::memcmp(out.data(), skipped.data(), out.size() * 2) == 0, "skipIdleHalves differs bitwise");
}

// 8 experts: empty ones, a 1-row group, groups ending just before and after a 64-row epilogue chunk and a 128-row
// tile, rows before and after the groups.
const std::vector<int32_t> kUneven = {0, 1, 127, 129, 0, 300, 64, 65};

const char* dtypeName(GemmDtype d) { return d == GemmDtype::kBf16 ? "bf16" : "fp16"; }

}  // namespace

TEST_CASE("grouped gemm: plain store matches fp64 with uneven and empty groups, n and k off the tile") {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (int sms : {0, 3}) {
      CAPTURE(dtypeName(dt));
      CAPTURE(sms);
      Case c;
      c.dtype = dt;
      c.n = 264;  // two column tiles, the second 8 columns wide
      c.k = 136;  // three k-blocks, the last 8 deep
      c.counts = kUneven;
      c.lead = 3;
      c.tail = 5;
      c.numSms = sms;  // 3 CTAs: each runs many tiles, the ring wraps across tiles
      c.seed = 11 + static_cast<uint64_t>(sms);
      runAndCheck(c);
    }
  }
}

TEST_CASE("grouped gemm: NN layout (w [E, k, n]) matches fp64 with uneven and empty groups, n and k off the tile") {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (int sms : {0, 3}) {
      CAPTURE(dtypeName(dt));
      CAPTURE(sms);
      Case c;
      c.dtype = dt;
      c.layout = GemmLayout::kAB;
      c.n = 264;  // two column tiles; the second's first 64-column box is 8 wide, its other three are past n
      c.k = 136;  // three k-blocks, the last 8 deep (k past 136 must read zeros, not the next expert's rows)
      c.counts = kUneven;
      c.lead = 3;
      c.tail = 5;
      c.numSms = sms;
      c.seed = 71 + static_cast<uint64_t>(sms);
      runAndCheck(c);
    }
  }
}

TEST_CASE("grouped gemm: NN layout with the row scale, a narrow n, a deep K and many experts") {
  SUBCASE("row scale, n narrower than one 64-column box") {
    Case c;
    c.layout = GemmLayout::kAB;
    c.n = 40;
    c.k = 200;
    c.counts = kUneven;
    c.tail = 2;
    c.scale = true;
    c.seed = 81;
    runAndCheck(c);
  }
  SUBCASE("deep K: 17 k-blocks through the 4-stage ring, fp16") {
    Case c;
    c.dtype = GemmDtype::kFp16;
    c.layout = GemmLayout::kAB;
    c.counts = {130, 0, 70};
    c.n = 328;
    c.k = 1032;
    c.numSms = 2;
    c.seed = 82;
    runAndCheck(c);
  }
  SUBCASE("70 experts, n = k (a transposed read would still be wrong)") {
    Case c;
    c.layout = GemmLayout::kAB;
    for (int e = 0; e < 70; ++e) c.counts.push_back((e * 29) % 45);
    c.n = 72;
    c.k = 72;
    c.lead = 1;
    c.numSms = 5;
    c.seed = 83;
    runAndCheck(c);
  }
}

TEST_CASE("grouped gemm: SwiGLU epilogue matches silu(x·gateᵀ)·(x·upᵀ) in fp64, with and without the row scale") {
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (bool scale : {false, true}) {
      CAPTURE(dtypeName(dt));
      CAPTURE(scale);
      Case c;
      c.dtype = dt;
      c.epi = GroupedGemmEpilogue::kSwiGlu;
      c.n = 2 * 136;  // f = 136: two column tiles of h, the second 8 wide
      c.k = 200;
      c.counts = kUneven;
      c.lead = 2;
      c.tail = 7;
      c.scale = scale;
      c.numSms = scale ? 2 : 0;
      c.seed = 21 + (scale ? 1u : 0u);
      runAndCheck(c);
    }
  }
}

TEST_CASE("grouped gemm: the per-row scale multiplies every output row by its weight") {
  Case c;
  c.n = 136;
  c.k = 64;
  c.counts = kUneven;
  c.tail = 1;
  c.scale = true;
  c.seed = 31;
  runAndCheck(c);
}

TEST_CASE("grouped gemm: skewed routing (80% of the rows on one expert) and a deep K") {
  SUBCASE("skewed") {
    Case c;
    c.counts.assign(16, 32);
    c.counts[3] = 1920;  // 1920 of 2400 rows
    c.n = 136;
    c.k = 72;
    c.seed = 41;
    runAndCheck(c);
  }
  SUBCASE("deep K: 17 k-blocks, 4 stages") {
    Case c;
    c.counts = {130, 0, 70};
    c.n = 256;
    c.k = 1032;
    c.numSms = 2;
    c.seed = 42;
    runAndCheck(c);
  }
}

TEST_CASE("grouped gemm: many experts (the scheduler's scan crosses several 32-expert steps)") {
  Case c;
  for (int e = 0; e < 70; ++e) c.counts.push_back((e * 37) % 50);  // includes empty experts (e = 0, 50)
  c.n = 40;
  c.k = 64;
  c.lead = 1;
  c.numSms = 5;
  c.seed = 51;
  runAndCheck(c);
}

TEST_CASE("grouped gemm: every expert empty writes nothing") {
  for (GroupedGemmPath path : {GroupedGemmPath::kTiled, GroupedGemmPath::kSwapAB}) {
    CAPTURE(static_cast<int>(path));
    Case c;
    c.counts.assign(6, 0);
    c.n = 64;
    c.k = 64;
    c.lead = 10;
    c.tail = 10;
    c.path = path;
    runAndCheck(c);
  }
}

TEST_CASE("grouped gemm: arrival counters gate the tiles") {
  Case c;
  c.n = 264;
  c.k = 136;
  c.counts = kUneven;
  c.lead = 3;
  c.seed = 61;
  Problem pr(c);
  Stream st;
  const int64_t tiles = tandem::kernels::groupedGemmMaxRowTiles(pr.mTotal, int64_t(c.counts.size()));
  int64_t rowTiles = 0;  // the tiles this grouping really has
  for (int32_t n : c.counts) rowTiles += (n + 127) / 128;
  REQUIRE(rowTiles <= tiles);
  constexpr uint64_t kReady = 7;

  uint64_t* host = nullptr;  // host-mapped: counters, abort word, error slot
  const size_t bytes = size_t(tiles + 1) * 8 + sizeof(ErrorSlot);
  ck(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes + 64, cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(host, 0, bytes + 64);
  uint64_t* dev = nullptr;
  ck(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), "cudaHostGetDevicePointer");
  uint64_t* counters = host;
  uint64_t* abortWord = host + tiles;
  auto* slot = reinterpret_cast<ErrorSlot*>(reinterpret_cast<uintptr_t>(host + tiles + 1 + 7) & ~uintptr_t(63));
  auto* devSlot = reinterpret_cast<ErrorSlot*>(reinterpret_cast<uintptr_t>(dev) +
                                               (reinterpret_cast<uintptr_t>(slot) - reinterpret_cast<uintptr_t>(host)));
  GroupedGemmParams p = pr.params();
  p.rowTileReady = dev;
  p.readyValue = kReady;
  p.abortWord = dev + tiles;
  p.errorSlot = devSlot;

  SUBCASE("every counter ready: the result is right") {
    for (int64_t i = 0; i < tiles; ++i) counters[i] = kReady;
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 4);
    syncWithin(st.s, 20, "grouped GEMM");
    pr.check(pr.fetch(st.s));
    CHECK(slot->claimed == 0);
  }
  SUBCASE("counters released by the host after the launch: the result is right") {
    p.timeoutNs = 5'000'000'000;  // a kernel that never sees them fails with a timeout instead of hanging
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 4);
    for (int64_t i = rowTiles - 1; i >= 0; --i) {
      // release: publishes nothing but readiness (x was copied before the launch); pairs with the kernel's acquire.
      std::atomic_ref<uint64_t>(counters[i]).store(kReady, std::memory_order_release);
    }
    syncWithin(st.s, 20, "grouped GEMM");
    pr.check(pr.fetch(st.s));
    CHECK_MESSAGE(slot->claimed == 0, "wait failed: code " << slot->code << " chunk " << slot->chunk);
  }
  SUBCASE("abort while waiting: the kernel ends and reports the tile it waited for") {
    counters[0] = kReady;  // the first row tile is there; the others never come
    std::atomic_ref<uint64_t>(*abortWord).store(1, std::memory_order_release);
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 4);
    syncWithin(st.s, 20, "grouped GEMM");
    REQUIRE(std::atomic_ref<uint32_t>(slot->claimed).load(std::memory_order_acquire) == tandem::kernels::kErrorSlotReady);
    CHECK(slot->code == static_cast<uint32_t>(WaitError::kAborted));
    CHECK(slot->chunk >= 1);
    CHECK(slot->chunk < rowTiles);
    CHECK(slot->expected == kReady);
    CHECK(slot->observed == 0);
  }
  SUBCASE("a counter that never arrives: the wait times out and the kernel ends") {
    for (int64_t i = 0; i < rowTiles; ++i) counters[i] = kReady;
    counters[rowTiles - 1] = kReady - 1;  // one stale counter (an older epoch)
    p.timeoutNs = 2'000'000;              // 2 ms
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 4);
    syncWithin(st.s, 20, "grouped GEMM");
    REQUIRE(std::atomic_ref<uint32_t>(slot->claimed).load(std::memory_order_acquire) == tandem::kernels::kErrorSlotReady);
    CHECK(slot->code == static_cast<uint32_t>(WaitError::kTimeout));
    CHECK(slot->chunk == rowTiles - 1);
    CHECK(slot->observed == kReady - 1);
  }
  cudaFreeHost(host);
}

TEST_CASE("grouped gemm: shapes and pointers the kernel cannot take are refused with the rule named") {
  Case c;
  c.n = 64;
  c.k = 64;
  c.counts = {10, 20};
  Problem pr(c);
  const GroupedGemmParams good = pr.params();
  CHECK_NOTHROW(validateGroupedGemm(good));

  struct Bad {
    const char* what;
    void (*mutate)(GroupedGemmParams&);
  };
  const Bad bad[] = {
      {"dtype must be bf16 or fp16", [](GroupedGemmParams& p) { p.dtype = static_cast<GemmDtype>(7); }},
      {"epilogue must be", [](GroupedGemmParams& p) { p.epilogue = static_cast<GroupedGemmEpilogue>(9); }},
      {"sizes must be >= 0", [](GroupedGemmParams& p) { p.mTotal = -1; }},
      {"below 2^31", [](GroupedGemmParams& p) { p.n = int64_t(1) << 32; }},
      {"k must be a positive multiple of 8", [](GroupedGemmParams& p) { p.k = 0; }},
      {"k must be a positive multiple of 8", [](GroupedGemmParams& p) { p.k = 12; }},
      {"n must be a multiple of 8", [](GroupedGemmParams& p) { p.n = 60; }},
      {"layout must be kABt (w [E, n, k]) or kAB", [](GroupedGemmParams& p) { p.layout = GemmLayout::kAtB; }},
      {"with layout kAB, n must be a multiple of 8", [](GroupedGemmParams& p) {
         p.layout = GemmLayout::kAB;
         p.n = 60;
       }},
      {"the SwiGLU epilogue takes layout kABt only", [](GroupedGemmParams& p) {
         p.layout = GemmLayout::kAB;
         p.epilogue = GroupedGemmEpilogue::kSwiGlu;
       }},
      {"n = 2f must be a multiple of 16", [](GroupedGemmParams& p) {
         p.epilogue = GroupedGemmEpilogue::kSwiGlu;
         p.n = 56;
       }},
      {"ldx must be 0 (dense) or a multiple of 8 that is >= k", [](GroupedGemmParams& p) { p.ldx = 32; }},
      {"ldOut must be 0 (dense) or a multiple of 8", [](GroupedGemmParams& p) { p.ldOut = 68; }},
      {"groupM must be >= 0", [](GroupedGemmParams& p) { p.groupM = -2; }},
      {"path must be kAuto, kTiled or kSwapAB", [](GroupedGemmParams& p) { p.path = static_cast<GroupedGemmPath>(5); }},
      {"maxGroupRows must be >= 0", [](GroupedGemmParams& p) { p.maxGroupRows = -1; }},
      {"x, w and out must be non-null", [](GroupedGemmParams& p) { p.x = nullptr; }},
      {"16-byte aligned", [](GroupedGemmParams& p) { p.out = static_cast<char*>(p.out) + 2; }},
      {"groupOffsets must point to", [](GroupedGemmParams& p) { p.groupOffsets = nullptr; }},
      {"rowScale must be 4-byte aligned", [](GroupedGemmParams& p) {
         p.rowScale = reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(p.x) + 2);
       }},
      {"rowTileReady must be 8-byte aligned", [](GroupedGemmParams& p) {
         p.rowTileReady = reinterpret_cast<const uint64_t*>(reinterpret_cast<uintptr_t>(p.x) + 4);
       }},
      {"out must not overlap", [](GroupedGemmParams& p) { p.out = const_cast<void*>(p.x); }},
  };
  Stream st;
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    GroupedGemmParams p = good;
    b.mutate(p);
    for (int viaLaunch = 0; viaLaunch < 2; ++viaLaunch) {
      try {
        if (viaLaunch != 0) {
          launchGroupedGemm(p, st.s);
        } else {
          validateGroupedGemm(p);
        }
        FAIL("accepted");
      } catch (const tandem::Error& e) {
        CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
        CHECK_MESSAGE(std::string(e.what()).find(b.what) != std::string::npos, e.what());
      }
    }
  }
  // Nothing to compute: accepted without pointers, and nothing is launched.
  GroupedGemmParams empty{};
  empty.n = 64;
  empty.k = 64;
  empty.numExperts = 4;
  CHECK_NOTHROW(launchGroupedGemm(empty, st.s));
  ck(cudaStreamSynchronize(st.s), "sync");
}

// ---- the swap-AB path (decode) ------------------------------------------------------------------------------------

namespace {

// A decode routing: `experts` groups of 0..maxRows rows, about a quarter of them empty, the first always empty and
// the last holding maxRows (a group ending at mTotal: its token box reads past the last row).
std::vector<int32_t> decodeCounts(int experts, int32_t maxRows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> rows(1, maxRows);
  std::vector<int32_t> counts(size_t(experts), 0);
  for (int e = 1; e < experts; ++e) counts[size_t(e)] = rng() % 4 == 0 ? 0 : rows(rng);
  counts.back() = maxRows;
  return counts;
}

// The swap-AB path against fp64, then `repeats` more runs equal to the first, bit for bit (one owner per output,
// K summed in order).
void runSwapAndCheck(Case c, int repeats = 1) {
  c.path = GroupedGemmPath::kSwapAB;
  Problem pr(c);
  Stream st;
  const std::vector<uint16_t> out = runOnce(pr, st.s, c.numSms);
  pr.check(out);
  for (int i = 0; i < repeats; ++i) {
    const std::vector<uint16_t> again = runOnce(pr, st.s, c.numSms);
    REQUIRE_MESSAGE(std::memcmp(out.data(), again.data(), out.size() * 2) == 0, "run " << i + 2 << " differs bitwise");
  }
}

}  // namespace

TEST_CASE("grouped gemm swap-AB: decode routings (0-32 rows, 8-32 experts, empty experts) match fp64, every width") {
  // maxGroupRows picks the token tile: 16 -> n16, 32 and 64 -> n64, 128 -> n128 (grouped_gemm_plan.hpp).
  struct Routing {
    int experts;
    int32_t maxRows;
    int64_t bound;
  };
  const Routing routings[] = {{8, 1, 1}, {8, 16, 16}, {32, 8, 16}, {17, 32, 32}, {32, 32, 64}, {32, 32, 128}};
  uint64_t seed = 71;
  for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
    for (GroupedGemmEpilogue epi : {GroupedGemmEpilogue::kStore, GroupedGemmEpilogue::kSwiGlu}) {
      for (const Routing& r : routings) {
        CAPTURE(dtypeName(dt));
        CAPTURE(static_cast<int>(epi));
        CAPTURE(r.experts);
        CAPTURE(r.maxRows);
        CAPTURE(r.bound);
        Case c;
        c.dtype = dt;
        c.epi = epi;
        // kStore: 3 weight tiles, the last 8 rows; kSwiGlu: f = 136, 3 tiles of 64 columns, the last 8 wide.
        c.n = epi == GroupedGemmEpilogue::kSwiGlu ? 2 * 136 : 264;
        c.k = 136;  // three k-blocks, the last 8 deep
        c.counts = decodeCounts(r.experts, r.maxRows, ++seed);
        c.lead = 2;
        c.tail = 3;
        c.scale = (seed % 2) == 0;
        c.maxGroupRows = r.bound;
        c.seed = seed;
        runSwapAndCheck(c);
      }
    }
  }
}

TEST_CASE("grouped gemm swap-AB: the plan takes it at decode sizes without being asked") {
  // 8 experts of at most 8 rows (mTotal <= 64) and no bound given: the rule bounds every group by mTotal.
  Case c;
  c.n = 136;
  c.k = 64;
  c.counts = decodeCounts(8, 8, 81);
  c.seed = 81;
  REQUIRE(tandem::kernels::groupedGemmPlanFor(Problem::total(c), 0, GroupedGemmPath::kAuto).path ==
          GroupedGemmPath::kSwapAB);
  runAndCheck(c);
}

TEST_CASE("grouped gemm swap-AB: groups longer than the token tile take more token tiles") {
  for (int64_t bound : {16, 64, 128}) {
    CAPTURE(bound);
    for (GroupedGemmEpilogue epi : {GroupedGemmEpilogue::kStore, GroupedGemmEpilogue::kSwiGlu}) {
      CAPTURE(static_cast<int>(epi));
      Case c;
      c.epi = epi;
      c.n = epi == GroupedGemmEpilogue::kSwiGlu ? 2 * 72 : 136;
      c.k = 200;
      // 40: three 16-wide tiles; 130 and 300: past one arrival-counter tile (128 rows); 17 and 65: one row past a tile.
      c.counts = {0, 40, 3, 130, 16, 17, 0, 65, 300, 1};
      c.lead = 4;
      c.tail = 2;
      c.scale = true;
      c.maxGroupRows = bound;
      c.numSms = 3;  // few CTAs: each runs many units, the stage ring wraps across them
      c.seed = 91 + static_cast<uint64_t>(bound);
      runSwapAndCheck(c);
    }
  }
}

TEST_CASE("grouped gemm swap-AB: many experts (the scan crosses several 32-expert steps), deep K") {
  Case c;
  for (int e = 0; e < 70; ++e) c.counts.push_back((e * 37) % 21);  // 0..20 rows, empty experts at e = 0, 21, ...
  c.n = 40;
  c.k = 1032;  // 17 k-blocks: more than the 12 stages of the 16-wide tile
  c.lead = 1;
  c.numSms = 5;
  c.maxGroupRows = 16;
  c.seed = 101;
  runSwapAndCheck(c);
}

TEST_CASE("grouped gemm swap-AB: 20 runs are bitwise equal (DeepSeek-V3-like k, SwiGLU and store)") {
  for (GroupedGemmEpilogue epi : {GroupedGemmEpilogue::kSwiGlu, GroupedGemmEpilogue::kStore}) {
    CAPTURE(static_cast<int>(epi));
    Case c;
    c.epi = epi;
    c.n = epi == GroupedGemmEpilogue::kSwiGlu ? 2 * 256 : 512;
    c.k = 1024;
    c.counts = decodeCounts(32, 32, 111);
    c.scale = epi == GroupedGemmEpilogue::kStore;
    c.maxGroupRows = 32;
    c.seed = 111;
    runSwapAndCheck(c, 20);
  }
}

TEST_CASE("grouped gemm swap-AB: arrival counters gate the token tiles") {
  Case c;
  c.n = 136;
  c.k = 136;
  c.counts = {5, 0, 130, 32, 0, 1};  // 130 rows: its second 64-row token tile waits on its second counter
  c.lead = 3;
  c.maxGroupRows = 64;
  c.path = GroupedGemmPath::kSwapAB;
  c.seed = 121;
  Problem pr(c);
  Stream st;
  int64_t rowTiles = 0;
  for (int32_t n : c.counts) rowTiles += (n + 127) / 128;
  REQUIRE(rowTiles == 5);
  constexpr uint64_t kReady = 3;
  uint64_t* host = nullptr;  // host-mapped: counters, abort word (never set), error slot
  const size_t bytes = size_t(rowTiles + 1) * 8 + sizeof(ErrorSlot);
  ck(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes + 64, cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(host, 0, bytes + 64);
  uint64_t* dev = nullptr;
  ck(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), "cudaHostGetDevicePointer");
  auto* slot = reinterpret_cast<ErrorSlot*>(reinterpret_cast<uintptr_t>(host + rowTiles + 1 + 7) & ~uintptr_t(63));
  GroupedGemmParams p = pr.params();
  p.rowTileReady = dev;
  p.readyValue = kReady;
  p.abortWord = dev + rowTiles;
  p.errorSlot = reinterpret_cast<ErrorSlot*>(reinterpret_cast<uintptr_t>(dev) +
                                             (reinterpret_cast<uintptr_t>(slot) - reinterpret_cast<uintptr_t>(host)));

  SUBCASE("counters released by the host after the launch: the result is right") {
    p.timeoutNs = 5'000'000'000;  // a kernel that never sees them fails with a timeout instead of hanging
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 2);
    for (int64_t i = rowTiles - 1; i >= 0; --i) {
      // release: publishes nothing but readiness (x was copied before the launch); pairs with the kernel's acquire.
      std::atomic_ref<uint64_t>(host[i]).store(kReady, std::memory_order_release);
    }
    syncWithin(st.s, 20, "grouped GEMM (swap-AB)");
    pr.check(pr.fetch(st.s));
    CHECK_MESSAGE(slot->claimed == 0, "wait failed: code " << slot->code << " chunk " << slot->chunk);
  }
  SUBCASE("the counter of a group's second 128 rows never arrives: the wait times out and names it") {
    for (int64_t i = 0; i < rowTiles; ++i) host[i] = kReady;
    host[2] = kReady - 1;  // expert 2's rows 128..129 (counters: e0 -> 0, e2 -> 1 and 2, e3 -> 3, e5 -> 4)
    p.timeoutNs = 2'000'000;  // 2 ms
    pr.poison(st.s);
    launchGroupedGemm(p, st.s, 2);
    syncWithin(st.s, 20, "grouped GEMM (swap-AB)");
    REQUIRE(std::atomic_ref<uint32_t>(slot->claimed).load(std::memory_order_acquire) ==
            tandem::kernels::kErrorSlotReady);
    CHECK(slot->code == static_cast<uint32_t>(WaitError::kTimeout));
    CHECK(slot->chunk == 2);
    CHECK(slot->observed == kReady - 1);
  }
  cudaFreeHost(host);
}
