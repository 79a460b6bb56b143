// The CPU backend against the independent double-precision reference, for every op, dtype and a spread
// of rank counts, with shapes that are multiples of nothing.
#include "cpu/cpu_ops.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/common/validate.hpp"

namespace {

using tandem::DType;
using tandem::kMaxOpBuffers;
using tandem::OpDescriptor;
using tandem::OpKind;
using tandem::GemmOperands;
using tandem::daemon::RankOp;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

// One collective op's descriptors and host memory, one allocation per rank per slot.
class Harness {
 public:
  Harness(std::vector<OpDescriptor> descs, uint64_t seed) : descs_(std::move(descs)), memory_(descs_.size()) {
    for (std::size_t r = 0; r < descs_.size(); ++r) {
      OpDescriptor& d = descs_[r];
      for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
        if (d.bufs[s].bytes == 0) continue;
        d.bufs[s].bufferId = 1 + r * kMaxOpBuffers + s;
        memory_[r][s].resize(d.bufs[s].bytes);
      }
      INFO("rank " << r);
      REQUIRE_NOTHROW(tandem::validateDescriptor(d));
      ref::fillInputs(d, pointers(r), seed);
    }
    REQUIRE_NOTHROW(tandem::validateCollective(descs_));
  }

  Harness(const ref::OpShape& shape, uint32_t nranks, uint64_t seed = 1) : Harness(describe(shape, nranks), seed) {}

  static std::vector<OpDescriptor> describe(const ref::OpShape& shape, uint32_t nranks) {
    std::vector<OpDescriptor> descs;
    for (uint32_t r = 0; r < nranks; ++r) descs.push_back(ref::makeDescriptor(shape, r, nranks));
    return descs;
  }

  std::array<std::byte*, kMaxOpBuffers> pointers(std::size_t r) {
    std::array<std::byte*, kMaxOpBuffers> p{};
    for (std::size_t s = 0; s < kMaxOpBuffers; ++s) p[s] = memory_[r][s].empty() ? nullptr : memory_[r][s].data();
    return p;
  }

  void run() {
    std::vector<RankOp> ops(descs_.size());
    for (std::size_t r = 0; r < descs_.size(); ++r) ops[r] = RankOp{descs_[r], pointers(r)};
    tandem::daemon::runCpuOp(ops);
  }

  // Runs the reference and compares every rank; fails the test with the comparison's detail. Returns the worst
  // relative error.
  double checkAgainstReference() {
    std::vector<std::array<const std::byte*, kMaxOpBuffers>> inputs(descs_.size());
    for (std::size_t r = 0; r < descs_.size(); ++r) {
      const auto p = pointers(r);
      std::copy(p.begin(), p.end(), inputs[r].begin());
    }
    const ref::Expected expected = ref::compute(descs_, inputs);
    REQUIRE(expected.size() == descs_.size());
    double worst = 0;
    for (std::size_t r = 0; r < descs_.size(); ++r) {
      const auto p = pointers(r);
      std::array<const std::byte*, kMaxOpBuffers> cp{};
      std::copy(p.begin(), p.end(), cp.begin());
      const ref::Comparison c = ref::compareRank(descs_[r], cp, expected[r]);
      INFO(c.detail);
      CHECK(c.ok);
      worst = std::max(worst, c.relError);
    }
    return worst;
  }

  // Every byte of every output slot, for determinism and "nothing written" checks.
  std::vector<std::byte> outputBytes() const {
    std::vector<std::byte> all;
    for (std::size_t r = 0; r < descs_.size(); ++r) {
      const tandem::SlotRules rules = tandem::validateDescriptor(descs_[r]);
      for (std::size_t s = 0; s < kMaxOpBuffers; ++s)
        if (rules[s].output) all.insert(all.end(), memory_[r][s].begin(), memory_[r][s].end());
    }
    return all;
  }

  void poisonOutputs() {
    for (std::size_t r = 0; r < descs_.size(); ++r) {
      const tandem::SlotRules rules = tandem::validateDescriptor(descs_[r]);
      for (std::size_t s = 0; s < kMaxOpBuffers; ++s)
        if (rules[s].output) std::fill(memory_[r][s].begin(), memory_[r][s].end(), std::byte{0xFF});
    }
  }

  std::vector<OpDescriptor>& descs() { return descs_; }
  std::vector<std::byte>& memory(std::size_t r, int s) { return memory_[r][static_cast<std::size_t>(s)]; }

 private:
  std::vector<OpDescriptor> descs_;
  std::vector<std::array<std::vector<std::byte>, kMaxOpBuffers>> memory_;
};

ref::OpShape shapeFor(OpKind kind, DType dtype, uint32_t nranks) {
  ref::OpShape s;
  s.kind = kind;
  s.dtype = dtype;
  s.m = 37;
  s.n = 19;
  s.k = 23;
  if (kind == OpKind::kMoeDispatchGemm || kind == OpKind::kMoeDispatchFfnCombine || kind == OpKind::kMoeFfnBackward) {
    s.m = 13;  // tokens per rank
    s.experts = nranks == 3 ? 6 : 8;
    s.topk = 2;
  }
  s.seq = 29;
  s.heads = 3;
  s.headDim = 11;
  s.causal = true;
  s.bytes = 13;
  return s;
}

bool allPoisoned(const std::vector<std::byte>& bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == std::byte{0xFF}; });
}

int32_t readInt(const std::vector<std::byte>& mem, std::size_t index) {
  int32_t v;
  std::memcpy(&v, mem.data() + index * 4, 4);
  return v;
}

void writeInt(std::vector<std::byte>& mem, std::size_t index, int32_t v) { std::memcpy(mem.data() + index * 4, &v, 4); }

std::string runExpectingError(Harness& h) {
  try {
    h.run();
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("runCpuOp accepted bad data");
  return {};
}

}  // namespace

TEST_CASE("every cpu op matches the reference for every dtype and rank count") {
  for (const tandem::OpSpec& op : tandem::ops()) {  // every op of the table: one the cpu backend lacks fails here
    const OpKind kind = op.kind;
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (uint32_t nranks : {1u, 2u, 3u, 4u, 8u}) {
        for (bool causal : {true, false}) {
          if (!causal && kind != OpKind::kRingAttention) continue;
          for (const GemmOperands layout : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
            if (layout != GemmOperands::kNT && (op.flags & tandem::kFlagGemmLayout) == 0) continue;
            ref::OpShape shape = shapeFor(kind, dtype, nranks);
            shape.causal = causal;
            shape.layout = layout;
            const std::string what =
                fmt::format("{} {} nranks {}{} layout {}", tandem::opKindName(kind), tandem::dtypeName(dtype), nranks,
                            causal ? "" : " non-causal", tandem::gemmLayoutName(layout));
            INFO(what);
            Harness h(shape, nranks, 1000 + nranks);
            h.run();
            h.checkAgainstReference();
          }
        }
      }
    }
  }
}

// The layouts' meaning, checked without the reference: the same product with its operands stored transposed gives the
// same c (and, for ag-gemm, a_gathered holds each rank's shard as that rank stored it).
TEST_CASE("every GEMM layout is the NT product of its operands as the layout stores them") {
  // Element (i, j) of a row-major [rows, cols] matrix of `es`-byte elements, moved to (j, i) of [cols, rows].
  const auto transpose = [](const std::vector<std::byte>& in, std::size_t rows, std::size_t cols, std::size_t es) {
    std::vector<std::byte> out(in.size());
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) std::memcpy(&out[(j * rows + i) * es], &in[(i * cols + j) * es], es);
    return out;
  };
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    for (const GemmOperands layout : {GemmOperands::kNN, GemmOperands::kTN}) {
      const uint32_t nranks = 3;
      CAPTURE(tandem::opKindName(kind));
      CAPTURE(tandem::gemmLayoutName(layout));
      ref::OpShape shape = shapeFor(kind, DType::kBF16, nranks);
      Harness nt(shape, nranks, 77);
      shape.layout = layout;
      Harness other(shape, nranks, 78);
      const std::size_t es = 2;
      for (uint32_t r = 0; r < nranks; ++r) {
        const OpDescriptor& d = nt.descs()[r];
        const std::size_t m = d.dims[tandem::dim::kM], n = d.dims[tandem::dim::kN], k = d.dims[tandem::dim::kK];
        const std::size_t aRows = kind == OpKind::kAgGemm ? tandem::rowsOf(m, r, nranks) : m;
        other.memory(r, slot::kA) = tandem::aTransposed(layout) ? transpose(nt.memory(r, slot::kA), aRows, k, es)
                                                                : nt.memory(r, slot::kA);
        other.memory(r, slot::kB) = transpose(nt.memory(r, slot::kB), n, k, es);
      }
      nt.run();
      other.run();
      for (uint32_t r = 0; r < nranks; ++r) {
        CHECK(other.memory(r, slot::kC) == nt.memory(r, slot::kC));
        if (kind == OpKind::kAgGemm) {
          std::vector<std::byte> want;
          for (uint32_t src = 0; src < nranks; ++src) {
            want.insert(want.end(), other.memory(src, slot::kA).begin(), other.memory(src, slot::kA).end());
          }
          CHECK(other.memory(r, slot::kAGathered) == want);
        }
      }
    }
  }
}

TEST_CASE("ring attention with grouped-query attention, at every rank count and layout") {
  for (uint32_t nranks : {1u, 2u, 3u, 4u}) {
    for (uint64_t kvHeads : {1u, 2u, 3u, 6u}) {
      for (bool zigzag : {false, true}) {
        for (bool causal : {true, false}) {
          CAPTURE(nranks);
          CAPTURE(kvHeads);
          CAPTURE(zigzag);
          CAPTURE(causal);
          ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kF32, nranks);
          shape.heads = 6;
          shape.kvHeads = kvHeads;
          shape.zigzag = zigzag;
          shape.causal = causal;
          Harness h(shape, nranks, 500 + kvHeads);
          h.run();
          h.checkAgainstReference();
        }
      }
    }
  }
}

// Grouped-query attention's meaning, checked without the reference: each KV head repeated for its group of query
// heads gives the same output as the grouped op.
TEST_CASE("grouped-query ring attention is attention with each KV head repeated over its group") {
  const uint32_t nranks = 2;
  ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kBF16, nranks);
  shape.heads = 4;
  shape.kvHeads = 2;
  Harness gqa(shape, nranks, 9);
  shape.kvHeads = 4;
  Harness mha(shape, nranks, 10);
  const std::size_t es = 2, hd = shape.headDim;
  for (uint32_t r = 0; r < nranks; ++r) {
    mha.memory(r, slot::kQ) = gqa.memory(r, slot::kQ);
    const std::size_t seq = gqa.descs()[r].dims[dim::kSeq];
    for (int s : {slot::kKey, slot::kValue}) {
      const std::vector<std::byte>& in = gqa.memory(r, s);
      std::vector<std::byte>& out = mha.memory(r, s);
      for (std::size_t i = 0; i < seq; ++i)
        for (std::size_t h = 0; h < 4; ++h)
          std::memcpy(&out[(i * 4 + h) * hd * es], &in[(i * 2 + h / 2) * hd * es], hd * es);
    }
  }
  gqa.run();
  mha.run();
  for (uint32_t r = 0; r < nranks; ++r) {
    CHECK(gqa.memory(r, slot::kAttnOut) == mha.memory(r, slot::kAttnOut));
    CHECK(gqa.memory(r, slot::kAttnLse) == mha.memory(r, slot::kAttnLse));
  }
}

TEST_CASE("cheap ops run at 64 ranks, including ranks that own no rows") {
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kAllGather, OpKind::kNop}) {
    INFO(tandem::opKindName(kind));
    ref::OpShape shape = shapeFor(kind, DType::kBF16, 64);
    shape.n = 5;
    shape.k = 7;  // ag-gemm: m = 37 < 64, so ranks 37..63 hold an empty shard
    Harness h(shape, 64, 7);
    h.run();
    h.checkAgainstReference();
  }
}

TEST_CASE("gemms with a long K, so the columns run in several cache blocks") {
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs}) {
    ref::OpShape shape = shapeFor(kind, DType::kF32, 2);
    shape.m = 5;
    shape.k = 2 * 2100 + 1;  // a CPU gemm block holds 96 KiB of b: about 11 rows of this K
    Harness h(shape, 2, 4);
    h.run();
    h.checkAgainstReference();
  }
}

TEST_CASE("ag-gemm without a_gathered writes only c") {
  std::vector<OpDescriptor> descs = Harness::describe(shapeFor(OpKind::kAgGemm, DType::kF16, 3), 3);
  for (OpDescriptor& d : descs) d.bufs[slot::kAGathered] = {};
  Harness h(descs, 3);
  h.run();
  h.checkAgainstReference();
}

TEST_CASE("ring attention with ranks of unequal and empty sequence shards") {
  SUBCASE("fewer positions than ranks") {
    for (bool causal : {true, false}) {
      ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kF32, 8);
      shape.causal = causal;
      shape.seq = 5;  // ranks 5..7 hold no positions
      Harness h(shape, 8, 11);
      h.run();
      h.checkAgainstReference();
    }
  }
  SUBCASE("lengths chosen per rank, with a non-default scale") {
    std::vector<OpDescriptor> descs = Harness::describe(shapeFor(OpKind::kRingAttention, DType::kBF16, 3), 3);
    const uint64_t seqs[3] = {17, 0, 40};
    for (std::size_t r = 0; r < 3; ++r) {
      descs[r].dims[dim::kSeq] = seqs[r];
      descs[r].scale = 0.2f;
      for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut}) {
        descs[r].bufs[static_cast<std::size_t>(s)].bytes = seqs[r] * 3 * 11 * 2;
      }
      descs[r].bufs[slot::kAttnLse].bytes = 3 * seqs[r] * 4;
    }
    for (const bool zigzag : {false, true}) {
      CAPTURE(zigzag);
      std::vector<OpDescriptor> d = descs;
      for (OpDescriptor& x : d) {
        x.flags = static_cast<uint16_t>(tandem::kFlagCausal | (zigzag ? tandem::kFlagZigzag : 0));
      }
      Harness h(d, 12);
      h.run();
      h.checkAgainstReference();
    }
  }
}

TEST_CASE("ring attention in the zigzag layout, with and without lse, at every rank count") {
  for (uint32_t nranks : {1u, 2u, 3u, 4u, 8u}) {
    for (bool causal : {true, false}) {
      for (bool withLse : {true, false}) {
        CAPTURE(nranks);
        CAPTURE(causal);
        CAPTURE(withLse);
        ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kF32, nranks);
        shape.causal = causal;
        shape.zigzag = true;
        std::vector<OpDescriptor> descs = Harness::describe(shape, nranks);
        if (!withLse) {
          for (OpDescriptor& d : descs) d.bufs[slot::kAttnLse] = {};
        }
        Harness h(descs, 40 + nranks);
        h.run();
        h.checkAgainstReference();
        if (!withLse) {
          for (uint32_t r = 0; r < nranks; ++r) CHECK(h.memory(r, slot::kAttnLse).empty());
        }
      }
    }
  }
}

// The layout spelled out by hand (not through the code under test): with 2 ranks of seq 5 and 4, the chunks are
// rank 0 rows 0-2, rank 1 rows 0-1, rank 1 rows 2-3, rank 0 rows 3-4. One rank holding those rows in that order,
// contiguously, must compute the same outputs and lse, row for row.
TEST_CASE("zigzag puts a rank's rows where the layout says") {
  const uint64_t heads = 2, headDim = 8, seqs[2] = {5, 4};
  const std::size_t row = heads * headDim;
  ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kF32, 2);
  shape.heads = heads;
  shape.headDim = headDim;
  shape.causal = true;
  shape.zigzag = true;
  std::vector<OpDescriptor> descs = Harness::describe(shape, 2);
  for (std::size_t r = 0; r < 2; ++r) {
    descs[r].dims[dim::kSeq] = seqs[r];
    for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut}) {
      descs[r].bufs[static_cast<std::size_t>(s)].bytes = seqs[r] * row * 4;
    }
    descs[r].bufs[slot::kAttnLse].bytes = heads * seqs[r] * 4;
  }
  Harness zz(descs, 77);
  zz.run();

  shape.zigzag = false;
  shape.seq = 9;
  Harness one(shape, 1, 78);
  // Global order: (rank, first local row, rows).
  const std::tuple<std::size_t, std::size_t, std::size_t> order[4] = {{0, 0, 3}, {1, 0, 2}, {1, 2, 2}, {0, 3, 2}};
  std::size_t g = 0;
  for (const auto& [r, first, rows] : order) {
    for (int s : {slot::kQ, slot::kKey, slot::kValue}) {
      std::memcpy(one.memory(0, s).data() + g * row * 4, zz.memory(r, s).data() + first * row * 4, rows * row * 4);
    }
    g += rows;
  }
  one.run();
  g = 0;
  for (const auto& [r, first, rows] : order) {
    for (std::size_t i = 0; i < rows; ++i) {
      CAPTURE(r);
      CAPTURE(first + i);
      float a[16], b[16];
      std::memcpy(a, zz.memory(r, slot::kAttnOut).data() + (first + i) * row * 4, row * 4);
      std::memcpy(b, one.memory(0, slot::kAttnOut).data() + (g + i) * row * 4, row * 4);
      for (std::size_t c = 0; c < row; ++c) CHECK(a[c] == doctest::Approx(b[c]).epsilon(1e-5));
      for (std::size_t h = 0; h < heads; ++h) {
        float la, lb;
        std::memcpy(&la, zz.memory(r, slot::kAttnLse).data() + (h * seqs[r] + first + i) * 4, 4);
        std::memcpy(&lb, one.memory(0, slot::kAttnLse).data() + (h * 9 + g + i) * 4, 4);
        CHECK(la == doctest::Approx(lb).epsilon(1e-5));
      }
    }
    g += rows;
  }
}

// lse from first principles: one position sees only itself, so lse = scale * q.k (and out = v).
TEST_CASE("ring attention lse of a lone position is scale times q.k") {
  ref::OpShape shape = shapeFor(OpKind::kRingAttention, DType::kF32, 1);
  shape.seq = 1;
  shape.heads = 1;
  shape.headDim = 4;
  std::vector<OpDescriptor> descs = Harness::describe(shape, 1);
  descs[0].scale = 0.75f;
  Harness h(descs, 5);
  float q[4], k[4], v[4], out[4], lse;
  std::memcpy(q, h.memory(0, slot::kQ).data(), 16);
  std::memcpy(k, h.memory(0, slot::kKey).data(), 16);
  std::memcpy(v, h.memory(0, slot::kValue).data(), 16);
  h.run();
  std::memcpy(out, h.memory(0, slot::kAttnOut).data(), 16);
  std::memcpy(&lse, h.memory(0, slot::kAttnLse).data(), 4);
  const double dotQk = double(q[0]) * k[0] + double(q[1]) * k[1] + double(q[2]) * k[2] + double(q[3]) * k[3];
  CHECK(lse == doctest::Approx(0.75 * dotQk).epsilon(1e-5));
  for (int c = 0; c < 4; ++c) CHECK(out[c] == doctest::Approx(v[c]).epsilon(1e-6));
}

TEST_CASE("moe ops with a different number of tokens on every rank") {
  for (OpKind kind : {OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    INFO(tandem::opKindName(kind));
    const uint64_t tokens[4] = {13, 1, 0, 6};
    std::vector<OpDescriptor> descs;
    for (uint32_t r = 0; r < 4; ++r) {
      ref::OpShape shape = shapeFor(kind, DType::kBF16, 4);
      shape.m = tokens[r];
      OpDescriptor d = ref::makeDescriptor(shape, r, 4);
      if (kind == OpKind::kMoeDispatchGemm) {
        const uint64_t capacity = 20 * 2;  // all 20 tokens' top-2 rows could land on one rank
        d.dims[dim::kCapacity] = capacity;
        d.bufs[slot::kMoeOut].bytes = capacity * shape.n * 2;
        d.bufs[slot::kRowInfo].bytes = capacity * 16;
      }
      descs.push_back(d);
    }
    Harness h(descs, 21);
    h.run();
    h.checkAgainstReference();
  }
}

TEST_CASE("moe-dispatch-gemm writes the row layout of tandem.h") {
  Harness h(shapeFor(OpKind::kMoeDispatchGemm, DType::kF32, 2), 2, 5);
  h.run();
  const uint64_t local = 4;
  for (uint32_t d = 0; d < 2; ++d) {
    uint64_t rows = 0;
    for (uint64_t le = 0; le < local; ++le) rows += static_cast<uint64_t>(readInt(h.memory(d, slot::kExpertCounts), le));
    // Rows are grouped by local expert, then source rank, then token: (expert, src, token) strictly increases.
    for (uint64_t i = 0; i < rows; ++i) {
      const auto& info = h.memory(d, slot::kRowInfo);
      const int32_t e = readInt(info, i * 4 + 3);
      CHECK(static_cast<uint64_t>(e) / local == d);
      if (i > 0) {
        const auto key = [&](uint64_t row) {
          return std::tuple{readInt(info, row * 4 + 3), readInt(info, row * 4), readInt(info, row * 4 + 1)};
        };
        CHECK(key(i - 1) < key(i));
      }
    }
    // Rows past the last routed row are not written.
    const auto& info = h.memory(d, slot::kRowInfo);
    CHECK(allPoisoned(std::vector<std::byte>(info.begin() + static_cast<std::ptrdiff_t>(rows * 16), info.end())));
  }
}

TEST_CASE("moe-dispatch-gemm with too small a capacity fails before writing anything") {
  Harness h(shapeFor(OpKind::kMoeDispatchGemm, DType::kBF16, 4), 4, 9);
  // Count what rank 1 (experts 2 and 3) receives, straight from the ids.
  int32_t rows = 0;
  for (std::size_t s = 0; s < 4; ++s)
    for (std::size_t i = 0; i < 13 * 2; ++i) rows += readInt(h.memory(s, slot::kTopkIds), i) / 2 == 1 ? 1 : 0;
  REQUIRE(rows > 1);
  OpDescriptor& d1 = h.descs()[1];
  d1.dims[dim::kCapacity] = static_cast<uint64_t>(rows - 1);
  d1.bufs[slot::kMoeOut].bytes = static_cast<uint64_t>(rows - 1) * 19 * 2;
  d1.bufs[slot::kRowInfo].bytes = static_cast<uint64_t>(rows - 1) * 16;
  REQUIRE_NOTHROW(tandem::validateDescriptor(d1));
  const std::string message = runExpectingError(h);
  CHECK(message == fmt::format("moe-dispatch-gemm: rank 1 receives {} rows but capacity is {}; pass capacity >= {}",
                               rows, rows - 1, rows));
  CHECK(allPoisoned(h.outputBytes()));
}

ref::OpShape savedShape(OpKind kind, DType dtype, uint32_t nranks) {
  ref::OpShape shape = shapeFor(kind, dtype, nranks);
  shape.savedRows = uint64_t{nranks} * shape.m * shape.topk;  // the worst case: every rank's rows on one rank
  return shape;
}

// The forward with saved activations, then the backward from them and the backward that recomputes them, on the
// same inputs (fillInputs draws x, topk_ids, topk_weights, w1 and w2 alike: same seed, same slot indices).
TEST_CASE("moe-ffn-backward from the forward's saved gate|up is the recomputing backward: bitwise in fp32, and "
          "matches the reference in every dtype") {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (uint32_t nranks : {1u, 2u, 3u}) {
      INFO(tandem::dtypeName(dtype) << " at " << nranks << " ranks");
      Harness fwd(savedShape(OpKind::kMoeDispatchFfnCombine, dtype, nranks), nranks, 31);
      fwd.run();
      fwd.checkAgainstReference();
      Harness plainFwd(shapeFor(OpKind::kMoeDispatchFfnCombine, dtype, nranks), nranks, 31);
      plainFwd.run();
      Harness bwd(savedShape(OpKind::kMoeFfnBackward, dtype, nranks), nranks, 31);
      Harness plain(shapeFor(OpKind::kMoeFfnBackward, dtype, nranks), nranks, 31);
      for (uint32_t r = 0; r < nranks; ++r) {
        REQUIRE(bwd.memory(r, slot::kMoeBwdSaved).size() == fwd.memory(r, slot::kFfnSaved).size());
        bwd.memory(r, slot::kMoeBwdSaved) = fwd.memory(r, slot::kFfnSaved);
        REQUIRE(bwd.memory(r, slot::kX) == plain.memory(r, slot::kX));
      }
      bwd.run();
      plain.run();
      bwd.checkAgainstReference();
      if (dtype == DType::kF32) {  // rounding gate|up to fp32 changes nothing: the same math, the same bits
        for (uint32_t r = 0; r < nranks; ++r) {
          CHECK(fwd.memory(r, slot::kFfnOut) == plainFwd.memory(r, slot::kFfnOut));
          for (int s : {slot::kMoeDx, slot::kMoeDtopkWeights, slot::kMoeDw1, slot::kMoeDw2}) {
            CHECK(bwd.memory(r, s) == plain.memory(r, s));
          }
        }
      }
    }
  }
}

TEST_CASE("moe ffn ops whose rows exceed saved_rows fail before writing anything") {
  for (OpKind kind : {OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    INFO(tandem::opKindName(kind));
    const int savedSlot = kind == OpKind::kMoeFfnBackward ? slot::kMoeBwdSaved : slot::kFfnSaved;
    std::vector<OpDescriptor> descs = Harness::describe(savedShape(kind, DType::kBF16, 4), 4);
    {
      // Count what rank 1 (experts 2 and 3) receives, with the ids fillInputs draws for seed 9.
      Harness probe(descs, 9);
      int32_t rows = 0;
      for (std::size_t s = 0; s < 4; ++s)
        for (std::size_t i = 0; i < 13 * 2; ++i) rows += readInt(probe.memory(s, slot::kTopkIds), i) / 2 == 1 ? 1 : 0;
      REQUIRE(rows > 1);
      descs[1].dims[dim::kSavedRows] = static_cast<uint64_t>(rows - 1);
      descs[1].bufs[static_cast<std::size_t>(savedSlot)].bytes = static_cast<uint64_t>(rows - 1) * 2 * 19 * 2;
      Harness h(descs, 9);
      CHECK(runExpectingError(h) ==
            fmt::format("{}: rank 1 receives {} rows but its saved tensor holds saved_rows = {}; nothing was written: "
                        "pass saved_rows >= {} with saved [saved_rows, 2*ffn] (at most nranks * tokens * topk rows)",
                        tandem::opKindName(kind), rows, rows - 1, rows));
      CHECK(allPoisoned(h.outputBytes()));
    }
  }
}

TEST_CASE("moe ffn ops take saved exactly when saved_rows is set") {
  for (OpKind kind : {OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    INFO(tandem::opKindName(kind));
    const auto savedSlot = static_cast<std::size_t>(kind == OpKind::kMoeFfnBackward ? slot::kMoeBwdSaved
                                                                                     : slot::kFfnSaved);
    OpDescriptor d = ref::makeDescriptor(savedShape(kind, DType::kBF16, 2), 0, 2);
    for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
      if (d.bufs[s].bytes != 0) d.bufs[s].bufferId = s + 1;
    }
    REQUIRE_NOTHROW(tandem::validateDescriptor(d));
    OpDescriptor absent = d;
    absent.bufs[savedSlot] = {};
    const std::string absentText =
        fmt::format("{}: saved_rows is 52 but saved is absent; pass saved [saved_rows, 2*ffn]",
                    tandem::opKindName(kind));
    CHECK_THROWS_WITH(tandem::validateDescriptor(absent), doctest::Contains(absentText.c_str()));
    OpDescriptor ignored = absent;
    ignored.dims[dim::kSavedRows] = 0;
    REQUIRE_NOTHROW(tandem::validateDescriptor(ignored));  // neither: gate|up is not saved (recomputed)
    ignored.bufs[savedSlot].bufferId = 7;
    const std::string ignoredText = fmt::format("{}: saved is given but saved_rows is 0", tandem::opKindName(kind));
    CHECK_THROWS_WITH(tandem::validateDescriptor(ignored), doctest::Contains(ignoredText.c_str()));
    OpDescriptor wrong = d;
    wrong.bufs[savedSlot].bytes -= 2;  // not [saved_rows, 2*ffn] of the dtype
    CHECK_THROWS_WITH(tandem::validateDescriptor(wrong), doctest::Contains("buffer saved claims"));
  }
}

TEST_CASE("moe ops reject bad expert ids before writing anything") {
  for (OpKind kind : {OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    INFO(tandem::opKindName(kind));
    {  // an id out of range
      Harness h(shapeFor(kind, DType::kBF16, 4), 4, 3);
      writeInt(h.memory(2, slot::kTopkIds), 5 * 2 + 1, 8);
      CHECK(runExpectingError(h).find("rank 2 topk_ids[5][1] = 8 is out of range [0, 8)") != std::string::npos);
      CHECK(allPoisoned(h.outputBytes()));
      writeInt(h.memory(2, slot::kTopkIds), 5 * 2 + 1, -1);
      CHECK(runExpectingError(h).find("topk_ids[5][1] = -1 is out of range") != std::string::npos);
      CHECK(allPoisoned(h.outputBytes()));
    }
    {  // an id repeated within a token
      Harness h(shapeFor(kind, DType::kBF16, 4), 4, 3);
      auto& ids = h.memory(3, slot::kTopkIds);
      writeInt(ids, 7 * 2 + 1, readInt(ids, 7 * 2));
      CHECK(runExpectingError(h).find(fmt::format("rank 3 token 7 names expert {} twice", readInt(ids, 14))) !=
            std::string::npos);
      CHECK(allPoisoned(h.outputBytes()));
    }
  }
}

TEST_CASE("cpu ops are deterministic: the same inputs give bitwise the same outputs") {
  for (const tandem::OpSpec& op : tandem::ops()) {
    if (std::none_of(op.slots.begin(), op.slots.begin() + op.slotCount, [](const auto& s) { return s.output; })) {
      continue;  // writes nothing (barrier)
    }
    const OpKind kind = op.kind;
    INFO(tandem::opKindName(kind));
    Harness h(shapeFor(kind, DType::kBF16, 3), 3, 17);
    h.run();
    const std::vector<std::byte> first = h.outputBytes();
    CHECK_FALSE(allPoisoned(first));
    h.poisonOutputs();
    h.run();
    CHECK(first == h.outputBytes());
  }
}

// FP8 inputs: the cpu backend against the reference on the dequantized inputs (value * scale) in fp64, per tensor and
// block-scaled, in every layout, with K and N off the 128 tile (the last k- and n-blocks partial).
TEST_CASE("the GEMM ops take FP8 inputs: per tensor and block-scaled, against the dequantized fp64 reference") {
  double worstBf16 = 0, worstF32 = 0;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    for (DType dtype : {DType::kF8E4M3, DType::kF8E5M2}) {
      for (uint32_t nranks : {1u, 2u, 3u, 4u}) {
        for (bool block : {false, true}) {
          for (DType out : {DType::kBF16, DType::kF32}) {
            for (const GemmOperands layout : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
              ref::OpShape shape = shapeFor(kind, dtype, nranks);
              shape.m = 37, shape.n = 131, shape.k = kind == OpKind::kAgGemm ? 300 : 300 * nranks / 2 + 7;
              shape.blockScale = block, shape.outDtype = out, shape.layout = layout;
              INFO(fmt::format("{} {} nranks {} {} out {} layout {}", tandem::opKindName(kind),
                               tandem::dtypeName(dtype), nranks, block ? "block" : "per tensor",
                               tandem::dtypeName(out), tandem::gemmLayoutName(layout)));
              Harness h(shape, nranks, 77 + nranks);
              h.run();
              double& worst = out == DType::kBF16 ? worstBf16 : worstF32;
              worst = std::max(worst, h.checkAgainstReference());
            }
          }
        }
      }
    }
  }
  MESSAGE("FP8 GEMM ops, worst relative error vs the dequantized fp64 product: bf16 c " << worstBf16 << ", fp32 c "
                                                                                         << worstF32);
}

// The scales' layout, written out by hand here rather than through the reference: a_scale [ceil(k/128), m] M-major,
// b_scale [ceil(n/128), ceil(k/128)].
TEST_CASE("FP8 block scales apply per 1x128 of A and per 128x128 of B") {
  ref::OpShape shape = shapeFor(OpKind::kGemmAr, DType::kF8E4M3, 1);
  shape.m = 3, shape.n = 130, shape.k = 200, shape.blockScale = true, shape.outDtype = DType::kF32;
  Harness h(shape, 1, 5);
  const std::size_t m = 3, n = 130, k = 200, kb = 2;
  REQUIRE(h.memory(0, slot::kReduceAScale).size() == kb * m * 4);
  REQUIRE(h.memory(0, slot::kReduceBScale).size() == 2 * kb * 4);
  h.run();
  const auto at = [&](int s, std::size_t i, DType t = DType::kF32) {
    return tandem::loadElement(h.memory(0, s).data(), t, i);
  };
  const DType f8 = DType::kF8E4M3;
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double want = 0;
      for (std::size_t p = 0; p < k; ++p) {
        const double a = at(slot::kA, i * k + p, f8) * at(slot::kReduceAScale, (p / 128) * m + i);
        const double b = at(slot::kB, j * k + p, f8) * at(slot::kReduceBScale, (j / 128) * kb + p / 128);
        want += a * b;
      }
      CAPTURE(i);
      CAPTURE(j);
      CHECK(at(slot::kC, i * n + j) == doctest::Approx(want).epsilon(1e-5));
    }
}

TEST_CASE("fp8 conversions round to nearest even and do not saturate") {
  using tandem::roundTo;
  CHECK(roundTo(DType::kF8E4M3, 448.0f) == 448.0f);
  CHECK(roundTo(DType::kF8E4M3, 464.0f) == 448.0f);        // the tie rounds to the even 448
  CHECK(std::isnan(roundTo(DType::kF8E4M3, 465.0f)));      // e4m3 has no Inf
  CHECK(roundTo(DType::kF8E4M3, 0.0625f * 1.0625f) == 0.0625f);  // 1.0625 ties to 1.0 (even mantissa)
  CHECK(roundTo(DType::kF8E4M3, 1.0f / 512.0f) == 1.0f / 512.0f);  // the smallest subnormal, 2^-9
  CHECK(roundTo(DType::kF8E4M3, 1.0f / 2048.0f) == 0.0f);
  CHECK(roundTo(DType::kF8E4M3, -3.3f) == -3.25f);
  CHECK(roundTo(DType::kF8E5M2, 57344.0f) == 57344.0f);
  CHECK(std::isinf(roundTo(DType::kF8E5M2, 61440.0f)));     // the tie above the largest finite goes to Inf
  CHECK(roundTo(DType::kF8E5M2, 1.0f / 65536.0f) == 1.0f / 65536.0f);  // the smallest subnormal, 2^-16
  CHECK(roundTo(DType::kF8E5M2, 0.3f) == 0.3125f);
  // every code decodes and re-encodes to itself (NaNs aside)
  for (DType t : {DType::kF8E4M3, DType::kF8E5M2}) {
    for (int code = 0; code < 256; ++code) {
      std::byte in{static_cast<uint8_t>(code)}, out{};
      const float v = tandem::loadElement(&in, t, 0);
      if (std::isnan(v)) continue;
      tandem::storeElement(&out, t, 0, v);
      CAPTURE(code);
      CHECK(std::to_integer<int>(out) == code);
    }
  }
}

// FP8 weights of the MoE FFN: the cpu backend against the reference of the quantised math (tandem.h: x and h quantised
// per 1 x 128 block, the weights dequantised with their 128 x 128 block scales) in fp64, with hidden and ffn off the
// 128 blocks (partial last blocks), uneven routing and a rank with no tokens.
TEST_CASE("the MoE FFN takes FP8 weights: against the fp64 reference of the quantised layer, 1 to 4 ranks") {
  double worst = 0;
  for (uint32_t nranks : {1u, 2u, 3u, 4u}) {
    for (const auto& [hidden, ffn] : {std::pair<uint64_t, uint64_t>{300, 136}, {256, 128}}) {
      INFO(fmt::format("nranks {} hidden {} ffn {}", nranks, hidden, ffn));
      std::vector<OpDescriptor> descs;
      for (uint32_t r = 0; r < nranks; ++r) {
        ref::OpShape shape = shapeFor(OpKind::kMoeDispatchFfnCombine, DType::kBF16, nranks);
        shape.weightDtype = DType::kF8E4M3;
        shape.k = hidden, shape.n = ffn;
        shape.m = r == 1 ? 0 : 5 + 4 * r;  // rank 1 (of several) has no tokens
        descs.push_back(ref::makeDescriptor(shape, r, nranks));
      }
      Harness h(descs, 31 + nranks);
      h.run();
      worst = std::max(worst, h.checkAgainstReference());
      // Deterministic: a second run writes the same bits.
      const std::vector<std::byte> first = h.outputBytes();
      h.poisonOutputs();
      h.run();
      CHECK(first == h.outputBytes());
    }
  }
  MESSAGE("FP8 MoE FFN, worst relative error vs the fp64 reference of the quantised layer: " << worst);
}

namespace {

// Writes `from`'s e4m3 weight in slot `w` (experts x rows x cols, fp32 scales per 128 x 128 block in slot `scale`),
// dequantised, into `to`'s bf16 weight in the same slot: the bf16 op on the FP8 op's exact weights.
void dequantiseWeight(Harness& from, Harness& to, int w, int scale, std::size_t experts, std::size_t rows,
                      std::size_t cols) {
  const std::size_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  for (std::size_t e = 0; e < experts; ++e)
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t p = 0; p < cols; ++p) {
        const std::size_t at = (e * rows + i) * cols + p;
        const float v = tandem::loadElement(from.memory(0, w).data(), DType::kF8E4M3, at) *
                        tandem::loadElement(from.memory(0, scale).data(), DType::kF32, (e * rb + i / 128) * cb + p / 128);
        tandem::storeElement(to.memory(0, w).data(), DType::kBF16, at, v);
      }
}

// The relative L2 difference of the first `count` bf16 elements of slot `out` in two harnesses.
double relativeDifference(Harness& a, Harness& b, int out, std::size_t count) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double x = tandem::loadElement(a.memory(0, out).data(), DType::kBF16, i);
    const double y = tandem::loadElement(b.memory(0, out).data(), DType::kBF16, i);
    diff += (x - y) * (x - y), norm += y * y;
  }
  return std::sqrt(diff / norm);
}

}  // namespace

// The quantisation is part of the contract: an FP8 layer differs from the bf16 layer on the same (dequantised)
// weights by about e4m3's rounding of x and h, far more than the reference's tolerance allows, so the check above
// would catch a backend that skipped it.
TEST_CASE("the FP8 MoE FFN quantises x and h: it is not the bf16 layer on the dequantised weights") {
  ref::OpShape shape = shapeFor(OpKind::kMoeDispatchFfnCombine, DType::kBF16, 1);
  shape.weightDtype = DType::kF8E4M3;
  shape.k = 256, shape.n = 128, shape.experts = 2, shape.topk = 1, shape.m = 4;
  Harness fp8(shape, 1, 3);
  fp8.run();
  // The same layer in bf16: the dequantised weights (e4m3 values times their scale, exact in bf16 for these
  // scales only up to bf16's rounding, so compare loosely) with x and h unquantised.
  ref::OpShape bf = shape;
  bf.weightDtype = DType::kInvalid;
  Harness plain(bf, 1, 3);
  for (int s : {slot::kX, slot::kTopkIds, slot::kTopkWeights}) plain.memory(0, s) = fp8.memory(0, s);
  dequantiseWeight(fp8, plain, slot::kW1, slot::kFfnW1Scale, shape.experts, 2 * shape.n, shape.k);
  dequantiseWeight(fp8, plain, slot::kW2, slot::kFfnW2Scale, shape.experts, shape.k, shape.n);
  plain.run();
  const double rel = relativeDifference(fp8, plain, slot::kFfnOut, shape.m * shape.k);
  MESSAGE("FP8 MoE FFN vs the bf16 layer on the dequantised weights: relative difference " << rel);
  CHECK(rel > 1e-2);  // e4m3 keeps 3 mantissa bits: x's and h's rounding moves out by a few percent
  CHECK(rel < 0.2);   // but it is the same layer
}

TEST_CASE("moe-dispatch-gemm takes FP8 weights: against the fp64 reference of the quantised op, 1 to 4 ranks") {
  double worst = 0;
  for (uint32_t nranks : {1u, 2u, 3u, 4u}) {
    for (const auto& [hidden, nOut] : {std::pair<uint64_t, uint64_t>{300, 136}, {256, 128}}) {
      INFO(fmt::format("nranks {} hidden {} n_out {}", nranks, hidden, nOut));
      std::vector<uint64_t> tokens;
      for (uint32_t r = 0; r < nranks; ++r) tokens.push_back(r == 1 ? 0 : 5 + 4 * r);  // rank 1 (of several): none
      const uint64_t capacity = std::accumulate(tokens.begin(), tokens.end(), uint64_t{0}) * 2;  // every row, topk 2
      std::vector<OpDescriptor> descs;
      for (uint32_t r = 0; r < nranks; ++r) {
        ref::OpShape shape = shapeFor(OpKind::kMoeDispatchGemm, DType::kBF16, nranks);
        shape.weightDtype = DType::kF8E4M3;
        shape.k = hidden, shape.n = nOut, shape.m = tokens[r];
        OpDescriptor d = ref::makeDescriptor(shape, r, nranks);
        d.dims[dim::kCapacity] = capacity;
        d.bufs[slot::kMoeOut].bytes = capacity * nOut * 2;
        d.bufs[slot::kRowInfo].bytes = capacity * 16;
        descs.push_back(d);
      }
      const uint64_t local = descs[0].dims[dim::kExperts] / nranks;
      CHECK(descs[0].bufs[slot::kW].bytes == local * nOut * hidden);  // one byte per weight
      // w_scale [E/n, ceil(n_out/128), ceil(hidden/128)] fp32
      CHECK(descs[0].bufs[slot::kMoeWScale].bytes == local * ((nOut + 127) / 128) * ((hidden + 127) / 128) * 4);
      Harness h(descs, 41 + nranks);
      h.run();
      worst = std::max(worst, h.checkAgainstReference());
      // Deterministic: a second run writes the same bits.
      const std::vector<std::byte> first = h.outputBytes();
      h.poisonOutputs();
      h.run();
      CHECK(first == h.outputBytes());
    }
  }
  MESSAGE("FP8 moe-dispatch-gemm, worst relative error vs the fp64 reference of the quantised op: " << worst);
}

// As the FFN's: the quantisation of x is part of the contract, and it moves out further than the reference's
// tolerance, so the check above would catch a backend that skipped it.
TEST_CASE("FP8 moe-dispatch-gemm quantises x: it is not the bf16 op on the dequantised weights") {
  ref::OpShape shape = shapeFor(OpKind::kMoeDispatchGemm, DType::kBF16, 1);
  shape.weightDtype = DType::kF8E4M3;
  shape.k = 256, shape.n = 128, shape.experts = 2, shape.topk = 1, shape.m = 4;
  Harness fp8(shape, 1, 3);
  fp8.run();
  ref::OpShape bf = shape;
  bf.weightDtype = DType::kInvalid;
  Harness plain(bf, 1, 3);
  for (int s : {slot::kX, slot::kTopkIds, slot::kTopkWeights}) plain.memory(0, s) = fp8.memory(0, s);
  dequantiseWeight(fp8, plain, slot::kW, slot::kMoeWScale, shape.experts, shape.n, shape.k);
  plain.run();
  // every token's one row (topk 1: rows 0..m-1 all defined)
  const double rel = relativeDifference(fp8, plain, slot::kMoeOut, shape.m * shape.n);
  MESSAGE("FP8 moe-dispatch-gemm vs the bf16 op on the dequantised weights: relative difference " << rel);
  CHECK(rel > 1e-2);  // e4m3 keeps 3 mantissa bits: x's rounding moves out by a few percent
  CHECK(rel < 0.2);   // but it is the same op
}

TEST_CASE("e4m3 block quantisation: amax maps to 448, values round to nearest even, a zero block stays zero") {
  std::vector<float> v{2.0f, -1.0f, 0.5f, 1.0f / 3.0f, 0.0f};
  std::vector<float> q(v.size());
  const float scale = tandem::quantizeE4m3Block(v.data(), v.size(), q.data());
  CHECK(scale == 2.0f / 448.0f);
  // The dequantised value is the e4m3 code's value times the scale (one fp32 product).
  CHECK(q[0] == 448.0f * scale);
  CHECK(q[1] == -224.0f * scale);
  CHECK(q[2] == 112.0f * scale);
  CHECK(q[4] == 0.0f);
  // 1/3 * 224 = 74.67 lies between e4m3's 72 and 80 (3 mantissa bits: step 8 in [64, 128)): nearest is 72.
  CHECK(q[3] == 72.0f * scale);
  std::vector<float> zeros(128, 0.0f);
  CHECK(tandem::quantizeE4m3Block(zeros.data(), zeros.size(), zeros.data()) == 1e-30f / 448.0f);
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](float z) { return z == 0.0f; }));
}
