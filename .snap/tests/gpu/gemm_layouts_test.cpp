// The GEMM core's layouts (tandem/kernels/gemm_layouts.hpp) against an fp32 reference on the GPU: every layout x
// dtype x output type, M, N and K off the tiles (M = 1, 7, 64, 128, 1000; K not a multiple of 8 where the layout
// allows it; padded row strides), each plan path (the rule's choice, the tiled path with K splits, the swap-AB path
// with several column tiles and 2 to 4 K splits), C's padding columns left untouched, split-K bitwise repeatable over
// 20 launches, plans of different tile counts sharing one workspace back to back, and the argument checks. The plan
// rule's own test is CPU-only (tests/unit/gemm_plan_test.cpp). This process initialises CUDA itself, so it is its
// own executable.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.hpp"
#include "gemm_layouts_ref.hpp"
#include "tandem/kernels/gemm_layouts.hpp"

using tandem::kernels::GemmDtype;
using tandem::kernels::GemmLayout;
using tandem::kernels::GemmLayoutParams;
using tandem::kernels::GemmLayoutPlan;
using tandem::kernels::GemmOut;
using tandem::kernels::GemmPath;
using tandem::kernels::gemmLayoutWorkspaceBytes;
using tandem::kernels::gemmPlanFor;
using tandem::kernels::gemmPlanName;
using tandem::kernels::launchGemmLayout;

namespace {

constexpr uint8_t kPoisonByte = 0xFF;  // all-ones: NaN in bf16, fp16 and fp32
constexpr size_t kWorkspaceBytes = size_t(256) << 20;

using tandem::gputest::ck;
using tandem::gputest::DeviceMem;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;

// The split-K workspace: zero-filled once, as the API asks; every launch leaves it zero-filled.
struct Workspace {
  DeviceMem mem{kWorkspaceBytes};
  explicit Workspace(cudaStream_t s) {
    ck(cudaMemsetAsync(mem.p, 0, kWorkspaceBytes, s), "zero the workspace");
    syncWithin(s, 30, "zero the workspace");
  }
};

const char* layoutName(GemmLayout l) {
  return l == GemmLayout::kABt ? "A*B^T" : l == GemmLayout::kAB ? "A*B" : "A^T*B";
}

float half16ToFloat(uint16_t v, GemmDtype dt) {
  if (dt == GemmDtype::kBf16) {
    uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  __half_raw raw;
  raw.x = v;
  return __half2float(__half(raw));
}

struct Shape {
  int64_t m, n, k;
  int64_t pad = 0;  // extra elements on every row stride (a multiple of 8)
};

// Row strides (elements) of A, B and C as stored, rounded up to 8 plus the shape's padding.
struct Strides {
  int64_t lda, ldb, ldc;
  size_t aElems, bElems, cElems;
};

int64_t up8(int64_t v) { return (v + 7) / 8 * 8; }

Strides stridesOf(GemmLayout l, const Shape& s) {
  Strides st{};
  const int64_t aRow = l == GemmLayout::kAtB ? s.m : s.k;
  const int64_t aRows = l == GemmLayout::kAtB ? s.k : s.m;
  const int64_t bRow = l == GemmLayout::kABt ? s.k : s.n;
  const int64_t bRows = l == GemmLayout::kABt ? s.n : s.k;
  st.lda = up8(aRow) + s.pad;
  st.ldb = up8(bRow) + s.pad;
  st.ldc = up8(s.n) + s.pad;
  st.aElems = size_t(aRows) * st.lda;
  st.bElems = size_t(bRows) * st.ldb;
  st.cElems = size_t(s.m) * st.ldc;
  return st;
}

// One layout x dtype x shape: inputs, the reference, and C.
struct Problem {
  GemmLayout layout;
  GemmDtype dtype;
  Shape shape;
  Strides st;
  DeviceMem a, b, c, ref;
  Problem(GemmLayout l, GemmDtype dt, const Shape& s, cudaStream_t stream, uint64_t seed)
      : layout(l),
        dtype(dt),
        shape(s),
        st(stridesOf(l, s)),
        a(st.aElems * 2),
        b(st.bElems * 2),
        c(st.cElems * 4),
        ref(size_t(s.m) * s.n * 4) {
    tandem::gputest::fillRandom16(a.p, st.aElems, dt, seed, stream);
    tandem::gputest::fillRandom16(b.p, st.bElems, dt, seed + 1, stream);
    tandem::gputest::referenceGemm(l, dt, a.p, st.lda, b.p, st.ldb, static_cast<float*>(ref.p), s.m, s.n, s.k, stream);
    ck(cudaGetLastError(), "fill + reference launch");
    syncWithin(stream, 60, "fill + reference");
  }
  GemmLayoutParams params(GemmOut out, void* ws) const {
    GemmLayoutParams p{};
    p.layout = layout;
    p.dtype = dtype;
    p.out = out;
    p.a = a.p;
    p.b = b.p;
    p.c = c.p;
    p.m = shape.m;
    p.n = shape.n;
    p.k = shape.k;
    p.lda = st.lda;
    p.ldb = st.ldb;
    p.ldc = st.ldc;
    p.workspace = ws;
    p.workspaceBytes = kWorkspaceBytes;
    return p;
  }
};

std::string describe(const Problem& pr, GemmOut out, const GemmLayoutPlan& plan) {
  return std::string(layoutName(pr.layout)) + (pr.dtype == GemmDtype::kBf16 ? " bf16" : " fp16") +
         (out == GemmOut::kFp32 ? "->fp32 " : " ") + std::to_string(pr.shape.m) + "x" + std::to_string(pr.shape.n) +
         "x" + std::to_string(pr.shape.k) + " pad " + std::to_string(pr.shape.pad) + " plan " + gemmPlanName(plan);
}

// Launches with `plan` `launches` times back to back over a poisoned C; returns C's bytes (m rows of ldc elements).
// exactWorkspace: pass the plan's own workspace size (gemmLayoutWorkspaceBytes), not the whole allocation.
std::vector<uint8_t> runOnce(const Problem& pr, GemmOut out, const GemmLayoutPlan& plan, void* ws, cudaStream_t s,
                             int launches = 1, bool exactWorkspace = false) {
  const size_t elem = out == GemmOut::kFp32 ? 4 : 2;
  const size_t bytes = pr.st.cElems * elem;
  ck(cudaMemsetAsync(pr.c.p, kPoisonByte, bytes, s), "poison C");
  GemmLayoutParams p = pr.params(out, ws);
  if (exactWorkspace) p.workspaceBytes = gemmLayoutWorkspaceBytes(p, plan);
  for (int i = 0; i < launches; ++i) REQUIRE_NOTHROW(launchGemmLayout(p, s, &plan));
  ck(cudaGetLastError(), "launch");
  syncWithin(s, 30, describe(pr, out, plan));
  std::vector<uint8_t> host(bytes);
  ck(cudaMemcpy(host.data(), pr.c.p, bytes, cudaMemcpyDeviceToHost), "copy C");
  return host;
}

// ||C - ref|| / ||ref|| over [m, n], and every C element inside is finite, every padding element still poison.
void checkAgainstReference(const Problem& pr, GemmOut out, const GemmLayoutPlan& plan, const std::vector<uint8_t>& c) {
  const int64_t m = pr.shape.m, n = pr.shape.n, ldc = pr.st.ldc;
  std::vector<float> ref(size_t(m) * n);
  ck(cudaMemcpy(ref.data(), pr.ref.p, ref.size() * 4, cudaMemcpyDeviceToHost), "copy reference");
  double err = 0, norm = 0;
  int64_t nonFinite = 0, paddingWritten = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const size_t idx = size_t(i) * ldc + j;
      float v;
      bool poison;
      if (out == GemmOut::kFp32) {
        uint32_t bits;
        std::memcpy(&bits, c.data() + idx * 4, 4);
        poison = bits == 0xFFFFFFFFu;
        std::memcpy(&v, &bits, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, c.data() + idx * 2, 2);
        poison = bits == 0xFFFFu;
        v = half16ToFloat(bits, pr.dtype);
      }
      if (j >= n) {
        paddingWritten += poison ? 0 : 1;
        continue;
      }
      if (!std::isfinite(v)) {
        ++nonFinite;
        continue;
      }
      const double r = ref[size_t(i) * n + j];
      err += (double(v) - r) * (double(v) - r);
      norm += r * r;
    }
  }
  const double rel = std::sqrt(err / std::max(norm, 1e-300));
  // bf16 output rounds at 2^-9 relative, fp16 at 2^-12; fp32 output differs from the reference only in the order of
  // its fp32 sums.
  const double tol = out == GemmOut::kFp32 ? 1e-4 : pr.dtype == GemmDtype::kBf16 ? 1e-2 : 2e-3;
  INFO(describe(pr, out, plan) << ": rel err " << rel << ", non-finite " << nonFinite << ", padding written "
                               << paddingWritten);
  CHECK(nonFinite == 0);
  CHECK(paddingWritten == 0);
  CHECK(rel < tol);
}

// The plans to try for a problem, in an order where the tile count changes from one split plan to the next (all share
// one workspace): the rule's, the tiled path with 3 K splits, and for kABt / kAB the swap-AB path with several column
// tiles when M > the tile width (16 wide with 4 splits, 64 wide with 2, 128 wide with 3).
std::vector<GemmLayoutPlan> plansFor(GemmLayout l, const Shape& s) {
  std::vector<GemmLayoutPlan> plans{gemmPlanFor(l, s.m, s.n, s.k, 132)};
  plans.push_back({GemmPath::kTiled, 256, 3});
  if (l != GemmLayout::kAtB) {
    plans.push_back({GemmPath::kSwapAB, 64, 2});
    plans.push_back({GemmPath::kSwapAB, 16, 4});
    plans.push_back({GemmPath::kSwapAB, 128, 3});
  }
  return plans;
}

const std::vector<Shape> kShapes = {
    {1, 520, 1000, 0},    // one token row; N off the 128 / 256 tiles
    {7, 1000, 264, 8},    // padded strides
    {64, 384, 1000, 0},   //
    {128, 1000, 520, 0},  //
    {1000, 520, 1000, 8}, // the tiled path by rule
    {7, 200, 100, 0},     // K not a multiple of 8 (row strides rounded up to 8)
    {300, 136, 40, 0},    // K below one k-block
};

}  // namespace

TEST_CASE("every layout, dtype and output type matches the fp32 reference, on every plan path") {
  Stream stream;
  Workspace ws(stream.s);
  uint64_t seed = 1;
  for (const Shape& sh : kShapes) {
    for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB, GemmLayout::kAtB}) {
      for (GemmDtype dt : {GemmDtype::kBf16, GemmDtype::kFp16}) {
        const Problem pr(l, dt, sh, stream.s, seed += 2);
        for (GemmOut out : {GemmOut::kInput, GemmOut::kFp32}) {
          for (const GemmLayoutPlan& plan : plansFor(l, sh)) {
            checkAgainstReference(pr, out, plan, runOnce(pr, out, plan, ws.mem.p, stream.s));
          }
        }
      }
    }
  }
}

TEST_CASE("split-K results are bitwise repeatable over 20 launches") {
  Stream stream;
  Workspace ws(stream.s);
  struct Rep {
    GemmLayout layout;
    Shape shape;
    GemmLayoutPlan plan;
  };
  const std::vector<Rep> reps = {
      {GemmLayout::kABt, {16, 4096, 4096, 0}, gemmPlanFor(GemmLayout::kABt, 16, 4096, 4096, 132)},
      {GemmLayout::kAB, {64, 4096, 4096, 0}, gemmPlanFor(GemmLayout::kAB, 64, 4096, 4096, 132)},
      {GemmLayout::kAB, {200, 1024, 8192, 0}, {GemmPath::kSwapAB, 256, 7}},
      {GemmLayout::kAtB, {256, 256, 8192, 0}, gemmPlanFor(GemmLayout::kAtB, 256, 256, 8192, 132)},
      {GemmLayout::kABt, {300, 512, 4096, 0}, {GemmPath::kTiled, 256, 4}},
  };
  for (const Rep& r : reps) {
    REQUIRE_MESSAGE(r.plan.splits > 1, "the case must exercise split-K: " << gemmPlanName(r.plan));
    const Problem pr(r.layout, GemmDtype::kBf16, r.shape, stream.s, 99);
    for (GemmOut out : {GemmOut::kInput, GemmOut::kFp32}) {
      const std::vector<uint8_t> first = runOnce(pr, out, r.plan, ws.mem.p, stream.s);
      checkAgainstReference(pr, out, r.plan, first);
      int differing = 0;
      for (int i = 1; i < 20; ++i) differing += runOnce(pr, out, r.plan, ws.mem.p, stream.s) == first ? 0 : 1;
      INFO(describe(pr, out, r.plan));
      CHECK(differing == 0);
    }
  }
}

// One workspace, plans whose tile counts rise and fall from one launch to the next (each launch given exactly its
// plan's workspace size), each launched several times back to back: every result matches the reference, and a
// second pass in the opposite order gives the same bytes.
TEST_CASE("plans of different tile counts share one workspace back to back, bitwise repeatable") {
  Stream stream;
  Workspace ws(stream.s);
  const std::vector<GemmLayoutPlan> plans = {
      {GemmPath::kTiled, 256, 3},    // 2 x 8 = 16 tiles
      {GemmPath::kSwapAB, 16, 4},    // 16 row tiles x 16 column tiles = 256 tiles
      {GemmPath::kSwapAB, 256, 2},   // 16 tiles
      {GemmPath::kSwapAB, 64, 2},    // 64 tiles
      {GemmPath::kSwapAB, 16, 2},    // 256 tiles
      {GemmPath::kSwapAB, 128, 4},   // 32 tiles
      {GemmPath::kSwapAB, 64, 4},    // 64 tiles
      {GemmPath::kTiled, 256, 2},    // 16 tiles
      {GemmPath::kSwapAB, 16, 1},    // no workspace
      {GemmPath::kSwapAB, 16, 3},    // 256 tiles
  };
  for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB}) {
    const Problem pr(l, GemmDtype::kBf16, {256, 2048, 2048, 0}, stream.s, 123);
    std::vector<std::vector<uint8_t>> first(plans.size());
    for (size_t i = 0; i < plans.size(); ++i) {
      first[i] = runOnce(pr, GemmOut::kInput, plans[i], ws.mem.p, stream.s, 3, true);
      checkAgainstReference(pr, GemmOut::kInput, plans[i], first[i]);
    }
    for (size_t j = plans.size(); j-- > 0;) {
      const std::vector<uint8_t> again = runOnce(pr, GemmOut::kInput, plans[j], ws.mem.p, stream.s, 2, true);
      INFO(describe(pr, GemmOut::kInput, plans[j]) << ", second pass in reverse order");
      CHECK(again == first[j]);
    }
  }
}

TEST_CASE("bad arguments are rejected with the field named") {
  Stream stream;
  const Problem pr(GemmLayout::kAB, GemmDtype::kBf16, {16, 256, 256, 0}, stream.s, 7);
  const auto rejects = [&](GemmLayoutParams p, const char* field, const GemmLayoutPlan* plan = nullptr) {
    try {
      launchGemmLayout(p, stream.s, plan);
      FAIL("accepted, expected a complaint about " << field);
    } catch (const std::invalid_argument& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  GemmLayoutParams p = pr.params(GemmOut::kInput, nullptr);
  p.ldb = 255;  // B is [k, n] in kAB: ldb >= n
  rejects(p, "ldb");
  p = pr.params(GemmOut::kInput, nullptr);
  p.lda = 8;  // < k
  rejects(p, "lda");
  p = pr.params(GemmOut::kInput, nullptr);
  p.c = nullptr;
  rejects(p, "c is null");
  p = pr.params(GemmOut::kInput, nullptr);
  p.a = static_cast<const uint8_t*>(p.a) + 2;
  rejects(p, "aligned");
  p = pr.params(GemmOut::kInput, nullptr);
  p.layout = static_cast<GemmLayout>(7);
  rejects(p, "layout");
  p = pr.params(GemmOut::kInput, nullptr);
  const GemmLayoutPlan split{GemmPath::kSwapAB, 16, 2};
  rejects(p, "workspace", &split);  // no workspace for a split plan
  p.layout = GemmLayout::kAtB;
  p.lda = 16;  // A is [k, m] in kAtB
  const GemmLayoutPlan swap{GemmPath::kSwapAB, 16, 1};
  rejects(p, "kAtB", &swap);
  CHECK(gemmLayoutWorkspaceBytes(pr.params(GemmOut::kInput, nullptr), GemmLayoutPlan{}) == 0);
  CHECK(gemmLayoutWorkspaceBytes(pr.params(GemmOut::kInput, nullptr), split) > 0);
}
