// The attention core (kernels/attention.cu) on one GPU against a straightforward fp64 reference computed here from
// the same 16-bit inputs: bf16 and fp16, head_dim 64 and 128, causal and not, lengths that are no tile multiple,
// several KV segments at arbitrary global positions, rows that see no key, the lse output, default and custom
// scales, several tiles per CTA, every tuning variant; outputs are poisoned before each launch and a guard row past
// sq must stay untouched. Then bitwise repeatability and the host-side shape rules.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/kernels/attention.hpp"

namespace {

using tandem::ErrorCode;
using tandem::kernels::AttentionDtype;
using tandem::kernels::AttentionKvSegment;
using tandem::kernels::AttentionParams;
using tandem::kernels::attentionConfigName;
using tandem::kernels::kMaxAttentionKvSegments;
using tandem::kernels::launchAttention;
using tandem::kernels::validateAttention;

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    FAIL(std::string(what) << ": " << std::string(cudaGetErrorName(e)) << " (" << std::string(cudaGetErrorString(e))
                           << ")");
  }
}

// One device allocation, freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) checkCuda(cudaMalloc(&ptr_, bytes_), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

uint16_t toBits(float f, AttentionDtype dt) {
  if (dt == AttentionDtype::kBf16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(f)).x;
  return static_cast<__half_raw>(__float2half_rn(f)).x;
}
float fromBits(uint16_t b, AttentionDtype dt) {
  if (dt == AttentionDtype::kBf16) {
    __nv_bfloat16_raw r;
    r.x = b;
    return __bfloat162float(__nv_bfloat16(r));
  }
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

struct Segment {
  int64_t length;
  int64_t start;
};

struct Case {
  std::string name;
  AttentionDtype dtype = AttentionDtype::kBf16;
  int headDim = 128;
  int heads = 2;
  int64_t sq = 0;
  int64_t qStart = 0;
  bool causal = false;
  float scale = 0.0f;
  std::vector<Segment> kv;
  int numSms = 0;
  int blockN = 0;
  int pingPong = 0;
  int headGroup = 0;
  int tileOrder = 0;
  // Zigzag: query rows >= qSplit sit at qStart2 + (row - qSplit); segment 0's rows >= kvSplit at kvStart2 + ...
  int64_t qSplit = 0, qStart2 = 0, kvSplit = 0, kvStart2 = 0;
  int rotateFrom = 0;  // segments from here on walked from a CTA-dependent one
};

int64_t queryPos(const Case& c, int64_t i) {
  return c.qSplit > 0 && i >= c.qSplit ? c.qStart2 + (i - c.qSplit) : c.qStart + i;
}
int64_t keyPos(const Case& c, size_t s, int64_t j) {
  return s == 0 && c.kvSplit > 0 && j >= c.kvSplit ? c.kvStart2 + (j - c.kvSplit) : c.kv[s].start + j;
}

// Host copies of the inputs (16-bit, as the GPU sees them) and the fp64 reference.
struct Problem {
  std::vector<uint16_t> q;
  std::vector<std::vector<uint16_t>> k, v;
  std::vector<double> out;  // [sq, heads, hd]
  std::vector<double> lse;  // [heads, sq]
};

Problem makeProblem(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const size_t row = static_cast<size_t>(c.heads) * c.headDim;
  Problem pr;
  pr.q.resize(static_cast<size_t>(c.sq) * row);
  for (auto& x : pr.q) x = toBits(uni(rng), c.dtype);
  for (const Segment& s : c.kv) {
    std::vector<uint16_t> k(static_cast<size_t>(s.length) * row), v(k.size());
    for (auto& x : k) x = toBits(uni(rng), c.dtype);
    for (auto& x : v) x = toBits(uni(rng), c.dtype);
    pr.k.push_back(std::move(k));
    pr.v.push_back(std::move(v));
  }
  const double scale = c.scale == 0.0f ? 1.0 / std::sqrt(static_cast<double>(c.headDim)) : c.scale;
  pr.out.assign(static_cast<size_t>(c.sq) * row, 0.0);
  pr.lse.assign(static_cast<size_t>(c.heads) * c.sq, -std::numeric_limits<double>::infinity());
  std::vector<double> sc, qd(c.headDim), acc(c.headDim);
  for (int h = 0; h < c.heads; ++h) {
    for (int64_t i = 0; i < c.sq; ++i) {
      const int64_t qPos = queryPos(c, i);
      for (int d = 0; d < c.headDim; ++d) qd[d] = fromBits(pr.q[i * row + h * c.headDim + d], c.dtype);
      sc.clear();
      double m = -std::numeric_limits<double>::infinity();
      for (size_t s = 0; s < c.kv.size(); ++s) {
        for (int64_t j = 0; j < c.kv[s].length; ++j) {
          if (c.causal && keyPos(c, s, j) > qPos) continue;
          double dot = 0;
          for (int d = 0; d < c.headDim; ++d) dot += qd[d] * fromBits(pr.k[s][j * row + h * c.headDim + d], c.dtype);
          sc.push_back(dot * scale);
          m = std::max(m, dot * scale);
        }
      }
      if (sc.empty()) continue;  // no visible key: out 0, lse -inf
      std::fill(acc.begin(), acc.end(), 0.0);
      double l = 0;
      size_t idx = 0;
      for (size_t s = 0; s < c.kv.size(); ++s) {
        for (int64_t j = 0; j < c.kv[s].length; ++j) {
          if (c.causal && keyPos(c, s, j) > qPos) continue;
          const double p = std::exp(sc[idx++] - m);
          l += p;
          for (int d = 0; d < c.headDim; ++d) acc[d] += p * fromBits(pr.v[s][j * row + h * c.headDim + d], c.dtype);
        }
      }
      for (int d = 0; d < c.headDim; ++d) pr.out[i * row + h * c.headDim + d] = acc[d] / l;
      pr.lse[h * c.sq + i] = m + std::log(l);
    }
  }
  return pr;
}

struct DeviceProblem {
  DeviceBuffer q, out, lse, counter{4};
  std::vector<std::unique_ptr<DeviceBuffer>> k, v;
  AttentionParams params{};
  size_t outBytes;  // sq rows; one guard row follows

  DeviceProblem(const Case& c, const Problem& pr)
      : q(pr.q.size() * 2),
        out((static_cast<size_t>(c.sq) + 1) * c.heads * c.headDim * 2),
        lse(static_cast<size_t>(c.heads) * c.sq * 4),
        outBytes(static_cast<size_t>(c.sq) * c.heads * c.headDim * 2) {
    checkCuda(cudaMemcpy(q.get(), pr.q.data(), q.bytes(), cudaMemcpyHostToDevice), "copy q");
    params.q = q.get();
    params.out = out.get();
    params.lse = static_cast<float*>(lse.get());
    params.sq = c.sq;
    params.heads = c.heads;
    params.headDim = c.headDim;
    params.qStart = c.qStart;
    params.numKv = static_cast<int32_t>(c.kv.size());
    params.dtype = c.dtype;
    params.causal = c.causal;
    params.scale = c.scale;
    params.numSms = c.numSms;
    params.blockN = c.blockN;
    params.pingPong = c.pingPong;
    params.headGroup = c.headGroup;
    params.tileOrder = c.tileOrder;
    params.tileCounter = c.tileOrder == 3 ? static_cast<uint32_t*>(counter.get()) : nullptr;
    params.rotateFrom = c.rotateFrom;
    params.qSplit = c.qSplit;
    params.qStart2 = c.qStart2;
    for (size_t s = 0; s < c.kv.size(); ++s) {
      k.push_back(std::make_unique<DeviceBuffer>(pr.k[s].size() * 2));
      v.push_back(std::make_unique<DeviceBuffer>(pr.v[s].size() * 2));
      if (!pr.k[s].empty()) {
        checkCuda(cudaMemcpy(k[s]->get(), pr.k[s].data(), k[s]->bytes(), cudaMemcpyHostToDevice), "copy k");
        checkCuda(cudaMemcpy(v[s]->get(), pr.v[s].data(), v[s]->bytes(), cudaMemcpyHostToDevice), "copy v");
      }
      AttentionKvSegment& seg = params.kv[s];
      seg.k = k[s]->get();
      seg.v = v[s]->get();
      seg.length = c.kv[s].length;
      seg.start = c.kv[s].start;
      if (s == 0) {
        seg.split = c.kvSplit;
        seg.start2 = c.kvStart2;
      }
    }
  }

  // Poison (0xFF: NaN in both 16-bit types and in fp32) the outputs, a guard pattern on the row after sq, launch.
  void run() {
    checkCuda(cudaMemset(out.get(), 0xFF, outBytes), "poison out");
    checkCuda(cudaMemset(static_cast<char*>(out.get()) + outBytes, 0x5A, out.bytes() - outBytes), "guard row");
    if (lse.bytes() > 0) checkCuda(cudaMemset(lse.get(), 0xFF, lse.bytes()), "poison lse");
    launchAttention(params, nullptr);
    checkCuda(cudaGetLastError(), "attention launch");
    checkCuda(cudaDeviceSynchronize(), "attention kernel");
  }
};

double tolerance(AttentionDtype dt) { return dt == AttentionDtype::kBf16 ? 1e-2 : 3e-3; }

// One launch's outputs: out with its guard row, and lse.
struct Outputs {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};
Outputs fetch(const DeviceProblem& dp) {
  Outputs o{std::vector<uint16_t>(dp.out.bytes() / 2), std::vector<float>(dp.lse.bytes() / 4)};
  checkCuda(cudaMemcpy(o.out.data(), dp.out.get(), dp.out.bytes(), cudaMemcpyDeviceToHost), "copy out");
  if (!o.lse.empty()) {
    checkCuda(cudaMemcpy(o.lse.data(), dp.lse.get(), dp.lse.bytes(), cudaMemcpyDeviceToHost), "copy lse");
  }
  return o;
}
bool sameBits(const Outputs& a, const Outputs& b) {
  return a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0;
}

void checkOutputs(const Case& c, const Problem& pr, const Outputs& run, const char* loop) {
  const std::vector<uint16_t>& out = run.out;
  const std::vector<float>& lse = run.lse;
  const size_t n = pr.out.size();
  size_t nonFinite = 0;
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    const float o = fromBits(out[i], c.dtype);
    if (!std::isfinite(o)) {
      ++nonFinite;
      continue;
    }
    err += (o - pr.out[i]) * (o - pr.out[i]);
    ref += pr.out[i] * pr.out[i];
  }
  CHECK_MESSAGE(nonFinite == 0, nonFinite << " of " << n << " outputs not finite (unwritten or NaN)");
  const double rel = ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
  MESSAGE(c.name << " (" << loop << "): rel. error " << rel);
  CHECK(rel < tolerance(c.dtype));
  size_t guardTouched = 0;
  for (size_t i = n; i < out.size(); ++i) guardTouched += out[i] != 0x5A5A;
  CHECK_MESSAGE(guardTouched == 0, guardTouched << " elements written past row sq");

  size_t lseBad = 0, emptyRowsBad = 0;
  double lseMaxErr = 0;
  for (int h = 0; h < c.heads; ++h) {
    for (int64_t i = 0; i < c.sq; ++i) {
      const double want = pr.lse[h * c.sq + i];
      const float got = lse[h * c.sq + i];
      if (std::isinf(want)) {
        // A row that sees no key: lse -inf and an all-zero output row, exactly.
        bool zero = true;
        for (int d = 0; d < c.headDim; ++d) {
          zero = zero && fromBits(out[(i * c.heads + h) * c.headDim + d], c.dtype) == 0.0f;  // +0 or -0
        }
        if (!(std::isinf(got) && got < 0) || !zero) ++emptyRowsBad;
        continue;
      }
      if (!std::isfinite(got)) {
        ++lseBad;
        continue;
      }
      lseMaxErr = std::max(lseMaxErr, std::abs(got - want));
    }
  }
  CHECK_MESSAGE(lseBad == 0, lseBad << " lse values not finite where the row sees keys");
  CHECK_MESSAGE(emptyRowsBad == 0, emptyRowsBad << " rows that see no key are not (0, lse -inf)");
  CHECK_MESSAGE(lseMaxErr < 2e-3, "lse max abs error " << lseMaxErr);
}

// One case against the reference.
void checkCase(const Case& c, uint64_t seed) {
  INFO("case: " << c.name);
  const Problem pr = makeProblem(c, seed);
  DeviceProblem dp(c, pr);
  CHECK(std::string(attentionConfigName(dp.params)).ends_with("/lane0"));
  dp.run();
  checkOutputs(c, pr, fetch(dp), "lane0");
}

}  // namespace

TEST_CASE("attention core matches the fp64 reference") {
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(std::move(c)); };
  add({.name = "bf16 hd128 full, sq 200 x kv 333", .sq = 200, .kv = {{333, 0}}});
  add({.name = "bf16 hd128 causal, square 300", .sq = 300, .causal = true, .kv = {{300, 0}}});
  add({.name = "fp16 hd128 causal, square 257, scale 0.3",
       .dtype = AttentionDtype::kFp16, .sq = 257, .causal = true, .scale = 0.3f, .kv = {{257, 0}}});
  add({.name = "bf16 hd64 full, 3 heads, sq 190 x kv 129",
       .headDim = 64, .heads = 3, .sq = 190, .kv = {{129, 0}}});
  add({.name = "fp16 hd64 causal, square 200", .dtype = AttentionDtype::kFp16, .headDim = 64, .sq = 200,
       .causal = true, .kv = {{200, 0}}});
  // A ring step: the local chunk first, then two earlier chunks and one in the future (causal: skipped).
  add({.name = "bf16 hd128 causal, 4 segments at global positions, scale 1.0",
       .sq = 150, .qStart = 400, .causal = true, .scale = 1.0f, .kv = {{150, 400}, {200, 0}, {130, 200}, {100, 700}}});
  add({.name = "fp16 hd64 full, segments 70 + empty + 181", .dtype = AttentionDtype::kFp16, .headDim = 64,
       .sq = 100, .kv = {{70, 0}, {0, 70}, {181, 1000}}});
  add({.name = "fp16 hd128 full, sq 129 x kv 1000", .dtype = AttentionDtype::kFp16, .sq = 129, .kv = {{1000, 0}}});
  add({.name = "bf16 hd64 causal, 2 segments out of order (zigzag-like)", .headDim = 64, .sq = 160, .qStart = 300,
       .causal = true, .kv = {{160, 300}, {140, 0}}});
  for (size_t i = 0; i < cases.size(); ++i) {
    SUBCASE(cases[i].name.c_str()) { checkCase(cases[i], 1000 + i); }
  }
}

TEST_CASE("attention core: rows that see no key give 0 and lse -inf, never NaN") {
  SUBCASE("causal, the first 100 queries precede every key") {
    checkCase({.name = "no-key rows", .sq = 150, .causal = true, .kv = {{200, 100}}}, 7);
  }
  SUBCASE("a whole tile precedes every key (the tile loads nothing)") {
    checkCase({.name = "no-key tile", .headDim = 64, .sq = 300, .causal = true, .kv = {{90, 250}}}, 8);
  }
  SUBCASE("no KV segment at all") { checkCase({.name = "no segments", .sq = 70, .kv = {}}, 9); }
  SUBCASE("only empty segments") { checkCase({.name = "empty segments", .sq = 70, .kv = {{0, 0}, {0, 5}}}, 10); }
}

TEST_CASE("attention core: persistent CTAs, tuning variants") {
  SUBCASE("2 CTAs take 5 tiles each (the rings wrap many times)") {
    checkCase({.name = "2 SMs causal", .sq = 520, .causal = true, .kv = {{520, 0}}, .numSms = 2}, 11);
  }
  SUBCASE("3 CTAs, hd64 full, fp16") {
    checkCase({.name = "3 SMs hd64", .dtype = AttentionDtype::kFp16, .headDim = 64, .heads = 3, .sq = 400,
               .kv = {{300, 0}}, .numSms = 3},
              12);
  }
  SUBCASE("causal tile orders: heads in groups of 2 and 3 (a smaller last group), snake rounds, 3 CTAs") {
    checkCase({.name = "causal g2 snake", .heads = 5, .sq = 700, .causal = true, .kv = {{700, 0}}, .numSms = 3,
               .headGroup = 2, .tileOrder = 2},
              17);
    checkCase({.name = "causal g3", .heads = 5, .sq = 390, .causal = true, .kv = {{390, 0}}, .headGroup = 3,
               .tileOrder = 1},
              18);
    checkCase({.name = "causal g1 dynamic", .heads = 3, .sq = 900, .causal = true, .kv = {{900, 0}}, .numSms = 4,
               .headGroup = 1, .tileOrder = 3},
              20);
    checkCase({.name = "full dynamic", .heads = 2, .sq = 500, .kv = {{300, 0}, {200, 300}}, .tileOrder = 3}, 21);
  }
  SUBCASE("segments after the first walked from a CTA-dependent one (ring attention's peers), 5 CTAs") {
    Case c{.name = "rotated causal", .sq = 300, .causal = true, .kv = {{100, 0}, {120, 100}, {80, 220}}, .numSms = 5};
    c.rotateFrom = 1;
    checkCase(c, 22);
    Case f{.name = "rotated full", .heads = 3, .sq = 260, .kv = {{0, 0}, {90, 0}, {130, 90}, {40, 220}}};
    f.rotateFrom = 1;
    checkCase(f, 23);
  }
  SUBCASE("zigzag queries and KV: two runs of positions per tensor") {
    Case c{.name = "zigzag causal", .sq = 300, .causal = true, .kv = {{300, 0}}};
    c.qSplit = 150;
    c.qStart2 = 1000;
    c.kvSplit = 150;
    c.kvStart2 = 1000;
    checkCase(c, 19);
  }
  SUBCASE("free-running consumer warpgroups (ping-pong off)") {
    checkCase({.name = "pingpong off causal", .sq = 300, .causal = true, .kv = {{300, 0}}, .pingPong = 2}, 13);
  }
  SUBCASE("blockN 128 without causal masking (the default there is 176)") {
    checkCase({.name = "bn128 full", .sq = 200, .kv = {{333, 0}}, .blockN = 128}, 16);
  }
  SUBCASE("blockN 176, kv not a multiple of 176") {
    checkCase({.name = "bn176", .sq = 200, .kv = {{500, 0}}, .blockN = 176}, 14);
  }
  SUBCASE("blockN 176 fp16, two segments, 2 CTAs, ping-pong off") {
    checkCase({.name = "bn176 fp16 segs", .dtype = AttentionDtype::kFp16, .sq = 300, .kv = {{177, 0}, {100, 177}},
               .numSms = 2, .blockN = 176, .pingPong = 2},
              15);
  }
}

TEST_CASE("attention core: results repeat bitwise over 20 launches") {
  const Case c{.name = "repeat", .sq = 333, .causal = true, .kv = {{200, 0}, {133, 200}}};
  const Problem pr = makeProblem(c, 21);
  DeviceProblem dp(c, pr);
  dp.run();
  const Outputs first = fetch(dp);
  int differing = 0;
  for (int r = 0; r < 20; ++r) {
    dp.run();
    differing += !sameBits(fetch(dp), first);
  }
  CHECK_MESSAGE(differing == 0, differing << " of 20 launches differ from the first");
}

TEST_CASE("attention core: shape rules are refused with the rule named") {
  alignas(16) static uint16_t q[2 * 128 * 8], k[2 * 128 * 8], v[2 * 128 * 8], out[2 * 128 * 8];
  AttentionParams ok{};
  ok.q = q;
  ok.out = out;
  ok.sq = 8;
  ok.heads = 2;
  ok.headDim = 128;
  ok.numKv = 1;
  ok.kv[0].k = k;
  ok.kv[0].v = v;
  ok.kv[0].length = 8;
  CHECK_NOTHROW(validateAttention(ok));

  const auto refused = [](AttentionParams p, const char* ruleName, ErrorCode code = ErrorCode::kInvalidArgument) {
    INFO("expected refusal: " << ruleName);
    try {
      validateAttention(p);
      FAIL("accepted");
    } catch (const tandem::Error& e) {
      CHECK(e.code() == code);
      CHECK_MESSAGE(std::string(e.what()).find(ruleName) != std::string::npos, e.what());
    }
  };
  AttentionParams p = ok;
  p.headDim = 96;
  refused(p, "rule head_dim");
  p = ok;
  p.heads = 0;
  refused(p, "rule heads");
  p = ok;
  p.sq = -1;
  refused(p, "rule sq");
  p = ok;
  p.numKv = kMaxAttentionKvSegments + 1;
  refused(p, "rule num_kv");
  p = ok;
  p.scale = -1.0f;
  refused(p, "rule scale");
  p = ok;
  p.scale = std::numeric_limits<float>::quiet_NaN();
  refused(p, "rule scale");
  p = ok;
  p.blockN = 64;
  refused(p, "rule block_n");
  p = ok;
  p.blockN = 176;
  p.causal = true;
  refused(p, "rule block_n");
  p = ok;
  p.q = reinterpret_cast<const char*>(q) + 2;
  refused(p, "rule alignment");
  p = ok;
  p.out = nullptr;
  refused(p, "rule pointers");
  p = ok;
  p.out = const_cast<uint16_t*>(q) + 128;
  refused(p, "rule aliasing");
  p = ok;
  p.kv[0].length = -1;
  refused(p, "rule kv_length");
  p = ok;
  p.kv[0].v = nullptr;
  refused(p, "rule pointers");
  p = ok;
  p.pingPong = 3;
  refused(p, "rule ping_pong");
  p = ok;
  static const uint64_t flag = 0;
  p.kv[0].arrival = &flag;
  CHECK_NOTHROW(validateAttention(p));  // one flag for the segment
  p.kv[0].arrivalRows = 4;
  refused(p, "arrivalRows", ErrorCode::kUnsupported);
  p = ok;
  p.kv[0].split = 9;
  refused(p, "rule kv_split");
  p = ok;
  p.qSplit = 4;
  p.qStart2 = 2;
  refused(p, "rule q_split");
}
