#include "tandem/common/validate.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/common/reference.hpp"

namespace {

using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

constexpr std::array kAllKinds{OpKind::kAgGemm,
                               OpKind::kGemmRs,
                               OpKind::kGemmAr,
                               OpKind::kMoeDispatchGemm,
                               OpKind::kMoeDispatchFfnCombine,
                               OpKind::kRingAttention,
                               OpKind::kAllGather,
                               OpKind::kNop};

ref::OpShape smallShape(OpKind kind, DType dtype = DType::kBF16) {
  ref::OpShape s;
  s.kind = kind;
  s.dtype = dtype;
  s.m = 37;
  s.n = 19;
  s.k = 23;
  s.experts = 8;
  s.topk = 2;
  s.seq = 29;
  s.heads = 3;
  s.headDim = 8;
  s.bytes = 13;
  return s;
}

// A descriptor as a client would submit it: makeDescriptor's shape plus fake buffer ids and aligned offsets.
OpDescriptor withBuffers(const OpDescriptor& desc) {
  OpDescriptor d = desc;
  for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
    if (d.bufs[s].bytes == 0) continue;
    d.bufs[s].bufferId = 100 + s;
    d.bufs[s].offset = 64 * s;
  }
  return d;
}

OpDescriptor good(OpKind kind, DType dtype = DType::kBF16, uint32_t rank = 1, uint32_t nranks = 4) {
  return withBuffers(ref::makeDescriptor(smallShape(kind, dtype), rank, nranks));
}

std::vector<OpDescriptor> goodCollective(const ref::OpShape& shape, uint32_t nranks) {
  std::vector<OpDescriptor> descs;
  for (uint32_t r = 0; r < nranks; ++r) descs.push_back(withBuffers(ref::makeDescriptor(shape, r, nranks)));
  return descs;
}

// Checks that validateDescriptor rejects `d` with kInvalidArgument and a message containing every fragment.
void rejects(const OpDescriptor& d, std::initializer_list<std::string_view> fragments) {
  try {
    tandem::validateDescriptor(d);
    FAIL("validateDescriptor accepted a bad descriptor; expected a message with: " << *fragments.begin());
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    for (std::string_view f : fragments) {
      INFO("message: " << what);
      CHECK(what.find(f) != std::string::npos);
    }
  }
}

void collectiveRejects(const std::vector<OpDescriptor>& descs, std::initializer_list<std::string_view> fragments) {
  try {
    tandem::validateCollective(descs);
    FAIL("validateCollective accepted a bad collective; expected a message with: " << *fragments.begin());
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    for (std::string_view f : fragments) {
      INFO("message: " << what);
      CHECK(what.find(f) != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("validateDescriptor accepts a good descriptor of every kind and dtype") {
  for (OpKind kind : kAllKinds) {
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (uint32_t nranks : {1u, 2u, 4u, 8u}) {
        for (uint32_t rank = 0; rank < nranks; ++rank) {
          const OpDescriptor d = good(kind, dtype, rank, nranks);
          INFO(tandem::opKindName(kind) << " " << tandem::dtypeName(dtype) << " rank " << rank << "/" << nranks);
          tandem::SlotRules rules;
          REQUIRE_NOTHROW(rules = tandem::validateDescriptor(d));
          for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) CHECK(rules[s].bytes == d.bufs[s].bytes);
        }
      }
    }
  }
}

TEST_CASE("validateDescriptor returns the slot rules of tandem.h") {
  const tandem::SlotRules ag = tandem::validateDescriptor(good(OpKind::kAgGemm, DType::kF16, 1, 4));
  CHECK(ag[slot::kA].name == "a");
  CHECK(ag[slot::kA].bytes == 9 * 23 * 2);  // rowsOf(37, 1, 4) = 9 rows
  CHECK_FALSE(ag[slot::kA].output);
  CHECK(ag[slot::kC].output);
  CHECK(ag[slot::kAGathered].optional);
  CHECK(ag[slot::kAgAScale].name == "a_scale");  // FP8 scales: none (0 bytes) for fp16 inputs
  CHECK(ag[slot::kAgAScale].bytes == 0);
  CHECK(ag[slot::kAgBScale].dtype == DType::kF32);
  CHECK(ag[6].name.empty());
  const tandem::SlotRules moe = tandem::validateDescriptor(good(OpKind::kMoeDispatchGemm, DType::kBF16, 0, 4));
  CHECK(moe[slot::kTopkIds].dtype == DType::kI32);
  CHECK(moe[slot::kTopkWeights].dtype == DType::kF32);
  CHECK(moe[slot::kRowInfo].dtype == DType::kI32);
  CHECK(moe[slot::kExpertCounts].bytes == 2 * 4);
  const tandem::SlotRules ag2 = tandem::validateDescriptor(good(OpKind::kAllGather, DType::kInvalid, 2, 4));
  CHECK(ag2[slot::kRecv].bytes == 4 * 13);
}

TEST_CASE("expectedSlots gives validateDescriptor's rules without looking at the buffers") {
  for (OpKind kind : kAllKinds) {
    const OpDescriptor d = good(kind, DType::kF16, 2, 4);
    OpDescriptor bare = d;
    bare.bufs = {};
    const tandem::SlotRules want = tandem::validateDescriptor(d);
    const tandem::SlotRules got = tandem::expectedSlots(bare);
    for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
      INFO(tandem::opKindName(kind) << " slot " << s);
      CHECK(got[s].name == want[s].name);
      CHECK(got[s].bytes == want[s].bytes);
      CHECK(got[s].dtype == want[s].dtype);
      CHECK(got[s].optional == want[s].optional);
      CHECK(got[s].output == want[s].output);
    }
  }
  OpDescriptor bad = good(OpKind::kGemmAr);
  bad.dims[dim::kN] = 0;
  CHECK_THROWS_WITH_AS(tandem::expectedSlots(bad), doctest::Contains("gemm-ar: dims[1] (n) is 0"), tandem::Error);
}

TEST_CASE("validateDescriptor accepts ranks that own no rows and absent optional outputs") {
  SUBCASE("ag-gemm with m < nranks: the last rank's a is empty, with or without a buffer id") {
    ref::OpShape s = smallShape(OpKind::kAgGemm);
    s.m = 3;
    OpDescriptor d = withBuffers(ref::makeDescriptor(s, 3, 4));
    CHECK(d.bufs[slot::kA].bytes == 0);
    CHECK_NOTHROW(tandem::validateDescriptor(d));
    d.bufs[slot::kA].bufferId = 7;
    CHECK_NOTHROW(tandem::validateDescriptor(d));
    d.bufs[slot::kA].bytes = 46;
    rejects(d, {"buffer a claims 46 bytes but rows*k*2 = 0", "rows=0"});
  }
  SUBCASE("a_gathered absent") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.bufs[slot::kAGathered] = {};
    CHECK_NOTHROW(tandem::validateDescriptor(d));
  }
  SUBCASE("ring attention with a rank of no positions, moe with a rank of no tokens") {
    ref::OpShape s = smallShape(OpKind::kRingAttention);
    s.seq = 3;
    CHECK_NOTHROW(tandem::validateDescriptor(withBuffers(ref::makeDescriptor(s, 5, 8))));
    s = smallShape(OpKind::kMoeDispatchFfnCombine);
    s.m = 0;
    CHECK_NOTHROW(tandem::validateDescriptor(withBuffers(ref::makeDescriptor(s, 0, 2))));
  }
}

TEST_CASE("validateDescriptor rejects bad headers, naming the field") {
  OpDescriptor d = good(OpKind::kAgGemm);
  SUBCASE("unknown version") {
    d.version = tandem::kDescriptorVersion + 1;
    const std::string what = "version " + std::to_string(tandem::kDescriptorVersion + 1) + " is not supported";
    rejects(d, {what});
  }
  SUBCASE("unknown kind") {
    d.kind = static_cast<OpKind>(42);
    rejects(d, {"op kind 42 is unknown"});
    d.kind = OpKind::kInvalid;
    rejects(d, {"op kind 0 is unknown"});
  }
  SUBCASE("dtype invalid for the kind") {
    d.dtype = DType::kI32;
    rejects(d, {"ag-gemm: dtype int32 not supported; use bf16, fp16 or fp32"});
    d.dtype = DType::kInvalid;
    rejects(d, {"ag-gemm: dtype invalid not supported"});
    d.dtype = static_cast<DType>(9);
    rejects(d, {"dtype 9 is unknown"});
  }
  SUBCASE("allgather and nop carry no typed data: any known dtype, unknown values still rejected") {
    for (OpKind kind : {OpKind::kAllGather, OpKind::kNop}) {
      for (DType t : {DType::kInvalid, DType::kF32, DType::kF16, DType::kBF16, DType::kI32}) {
        OpDescriptor g = good(kind, t);
        CHECK_NOTHROW(tandem::validateDescriptor(g));
      }
      OpDescriptor g = good(kind);
      g.dtype = static_cast<DType>(7);
      rejects(g, {"dtype 7 is unknown"});
    }
  }
  SUBCASE("unknown flags") {
    d.flags = tandem::kFlagCausal;
    rejects(d, {"ag-gemm: flags 0x1"});
    OpDescriptor attn = good(OpKind::kRingAttention);
    attn.flags = 0x7;  // causal and zigzag are ring attention's
    rejects(attn, {"ring-attention: flags 0x7 has bits 0x4"});
    OpDescriptor rs = good(OpKind::kGemmRs);
    rs.flags = tandem::kFlagGemmLayout;  // layout 3
    rejects(rs, {"gemm-rs: layout 3 (flags 0xc) is unknown; pass TANDEM_GEMM_NT (0)"});
    rs.flags = tandem::gemmLayoutFlags(tandem::GemmOperands::kTN);
    CHECK_NOTHROW(tandem::validateDescriptor(rs));
  }
  SUBCASE("grouped-query attention") {
    OpDescriptor attn = good(OpKind::kRingAttention);
    attn.dims[tandem::dim::kKvHeads] = 0;
    rejects(attn, {"kv_heads"});
    attn.dims[tandem::dim::kHeads] = 8;
    attn.dims[tandem::dim::kKvHeads] = 3;
    rejects(attn, {"ring-attention: kv_heads 3 does not divide heads 8"});
  }
  SUBCASE("nranks 0 or above 64") {
    d.nranks = 0;
    rejects(d, {"nranks 0"});
    d.nranks = 65;
    rejects(d, {"nranks 65", "1..64"});
  }
  SUBCASE("rank not below nranks") {
    d.rank = 4;
    rejects(d, {"rank 4 is not below nranks 4"});
  }
  SUBCASE("scale") {
    d.scale = 0.5f;
    rejects(d, {"ag-gemm: scale is 0.5 but only ring-attention uses it"});
    OpDescriptor attn = good(OpKind::kRingAttention);
    attn.scale = std::numeric_limits<float>::quiet_NaN();
    rejects(attn, {"scale nan is not finite"});
    attn.scale = -0.25f;  // any finite scale is meaningful
    CHECK_NOTHROW(tandem::validateDescriptor(attn));
  }
  SUBCASE("reserved fields") {
    d.reserved0 = 5;
    rejects(d, {"reserved0 is 5"});
    d.reserved0 = 0;
    d.reserved1[7] = 1;
    rejects(d, {"reserved1[7] is 1"});
    d.reserved1[7] = 0;
    d.bufs[tandem::kMaxOpBuffers - 1].bytes = 8;  // a slot past the op's last
    rejects(d, {"unused"});
  }
}

TEST_CASE("validateDescriptor rejects bad dims, naming the dim and the limit") {
  SUBCASE("a zero dim") {
    OpDescriptor d = good(OpKind::kGemmRs);
    d.dims[dim::kK] = 0;
    rejects(d, {"gemm-rs: dims[2] (k) is 0; pass k >= 1"});
    OpDescriptor moe = good(OpKind::kMoeDispatchGemm);
    moe.dims[dim::kCapacity] = 0;
    rejects(moe, {"dims[5] (capacity) is 0"});
    OpDescriptor ag = good(OpKind::kAllGather);
    ag.dims[dim::kBytes] = 0;
    rejects(ag, {"allgather: dims[0] (bytes) is 0"});
  }
  SUBCASE("a dim above 2^32") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.dims[dim::kM] = (uint64_t{1} << 32) + 1;
    rejects(d, {"dims[0] (m) is 4294967297, above 2^32"});
  }
  SUBCASE("a tensor above 2^40 bytes, with and without 64-bit overflow") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.dims[dim::kN] = uint64_t{1} << 32;
    d.dims[dim::kK] = uint64_t{1} << 32;
    rejects(d, {"buffer b would need more than 2^64 bytes", "capped at 2^40"});
    OpDescriptor a = good(OpKind::kRingAttention, DType::kF32);
    a.dims[dim::kSeq] = uint64_t{1} << 20;
    a.dims[dim::kHeads] = 1024;
    a.dims[dim::kKvHeads] = 1024;
    a.dims[dim::kHeadDim] = 512;  // 2^20 * 2^10 * 2^9 * 4 = 2^41
    rejects(a, {"buffer q would need 2199023255552 bytes", "2^40"});
  }
  SUBCASE("topk above experts") {
    OpDescriptor d = good(OpKind::kMoeDispatchFfnCombine);
    d.dims[dim::kTopk] = 9;
    rejects(d, {"topk 9 exceeds experts 8"});
  }
  SUBCASE("experts not divisible by nranks") {
    OpDescriptor d = good(OpKind::kMoeDispatchGemm);
    d.dims[dim::kExperts] = 6;
    rejects(d, {"moe-dispatch-gemm: experts 6 is not divisible by nranks 4; experts are spread evenly over ranks"});
  }
  SUBCASE("an unused dim set") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.dims[5] = 1;
    rejects(d, {"ag-gemm: dims[5] is 1 but ag-gemm uses 3 dims; zero it"});
    OpDescriptor nop = good(OpKind::kNop);
    nop.dims[0] = 3;
    rejects(nop, {"barrier: dims[0] is 3"});
  }
}

TEST_CASE("validateDescriptor rejects bad buffer slots, naming the buffer and the fix") {
  SUBCASE("claimed bytes disagree with the shape") {
    ref::OpShape s = smallShape(OpKind::kAgGemm);
    s.m = s.n = 32;
    OpDescriptor d = withBuffers(ref::makeDescriptor(s, 0, 2));
    d.bufs[slot::kC].bytes = 1000;
    rejects(d, {"ag-gemm: buffer c claims 1000 bytes but m*n*2 = 2048 for bf16 [m=32, n=32]; pass the tensor of [m, n]"});
    OpDescriptor moe = good(OpKind::kMoeDispatchGemm);
    moe.bufs[slot::kRowInfo].bytes += 4;
    rejects(moe, {"buffer row_info claims", "capacity*4*4", "int32"});
    OpDescriptor ag = good(OpKind::kAllGather);
    ag.bufs[slot::kRecv].bytes = 13;
    rejects(ag, {"buffer recv claims 13 bytes but nranks*bytes*1 = 52 for raw bytes"});
  }
  SUBCASE("a required slot without a buffer") {
    OpDescriptor d = good(OpKind::kGemmAr);
    d.bufs[slot::kB].bufferId = 0;
    rejects(d, {"gemm-ar: buffer b is absent (bufferId 0) but required; pass the tensor of [n, k]"});
  }
  SUBCASE("an absent optional slot with an extent") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.bufs[slot::kAGathered].bufferId = 0;
    rejects(d, {"buffer a_gathered is absent (bufferId 0) but has offset"});
  }
  SUBCASE("an unused slot set") {
    OpDescriptor d = good(OpKind::kRingAttention);
    d.bufs[6].bufferId = 3;
    rejects(d, {"ring-attention: buffer slot 6 is unused by ring-attention but set"});
    OpDescriptor nop = good(OpKind::kNop);
    nop.bufs[0].bytes = 8;
    rejects(nop, {"barrier: buffer slot 0 is unused"});
  }
  SUBCASE("an offset not a multiple of the element size") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.bufs[slot::kB].offset = 3;
    rejects(d, {"buffer b offset 3 is not a multiple of the bf16 element size 2"});
    OpDescriptor moe = good(OpKind::kMoeDispatchGemm, DType::kBF16);
    moe.bufs[slot::kTopkIds].offset = 2;  // int32 needs 4 even though the op's dtype is bf16
    rejects(moe, {"buffer topk_ids offset 2", "int32 element size 4"});
    OpDescriptor ag = good(OpKind::kAllGather, DType::kF32);
    ag.bufs[slot::kSend].offset = 3;  // raw bytes need no alignment
    CHECK_NOTHROW(tandem::validateDescriptor(ag));
  }
  SUBCASE("offset + bytes overflowing 64 bits") {
    OpDescriptor d = good(OpKind::kAgGemm);
    d.bufs[slot::kC].offset = std::numeric_limits<uint64_t>::max() - 1;
    rejects(d, {"buffer c offset 18446744073709551614 + bytes", "overflows"});
  }
}

TEST_CASE("validateCollective accepts agreeing ranks, with per-rank dims free to differ") {
  for (OpKind kind : kAllKinds) {
    INFO(tandem::opKindName(kind));
    CHECK_NOTHROW(tandem::validateCollective(goodCollective(smallShape(kind), 4)));
  }
  std::vector<OpDescriptor> rs = goodCollective(smallShape(OpKind::kGemmRs), 4);
  rs[2].dims[dim::kK] = 1;  // k is each rank's slice
  CHECK_NOTHROW(tandem::validateCollective(rs));
  std::vector<OpDescriptor> moe = goodCollective(smallShape(OpKind::kMoeDispatchGemm), 4);
  moe[1].dims[dim::kTokens] = 5;
  moe[3].dims[dim::kCapacity] = 7;
  CHECK_NOTHROW(tandem::validateCollective(moe));
  std::vector<OpDescriptor> attn = goodCollective(smallShape(OpKind::kRingAttention), 4);
  attn[0].dims[dim::kSeq] = 100;
  CHECK_NOTHROW(tandem::validateCollective(attn));
}

TEST_CASE("validateCollective rejects disagreeing ranks, naming the rank and the field") {
  std::vector<OpDescriptor> d = goodCollective(smallShape(OpKind::kAgGemm), 4);
  SUBCASE("wrong rank order") {
    std::swap(d[1], d[2]);
    collectiveRejects(d, {"ag-gemm: descriptor 1 comes from rank 2; pass one descriptor per rank, in rank order"});
  }
  SUBCASE("rank mismatch: a rank submitted twice") {
    d[3].rank = 2;
    collectiveRejects(d, {"descriptor 3 comes from rank 2"});
  }
  SUBCASE("missing rank") {
    d.pop_back();
    collectiveRejects(d, {"3 descriptors for a communicator of nranks 4"});
  }
  SUBCASE("nranks mismatch") {
    d[2].nranks = 8;
    collectiveRejects(d, {"rank 2 has nranks 8 but rank 0 has 4"});
  }
  SUBCASE("dtype mismatch") {
    d[2].dtype = DType::kF16;
    collectiveRejects(d, {"ag-gemm: rank 2 has dtype fp16 but rank 0 has bf16"});
  }
  SUBCASE("kind mismatch") {
    d[1].kind = OpKind::kGemmAr;
    collectiveRejects(d, {"rank 1 submitted gemm-ar but rank 0 submitted ag-gemm"});
  }
  SUBCASE("global dim mismatch") {
    d[3].dims[dim::kN] = 20;
    collectiveRejects(d, {"ag-gemm: rank 3 has dims[1] (n) = 20 but rank 0 has 19; n is global"});
    std::vector<OpDescriptor> moe = goodCollective(smallShape(OpKind::kMoeDispatchFfnCombine), 2);
    moe[1].dims[dim::kExperts] = 4;
    collectiveRejects(moe, {"rank 1 has dims[3] (experts) = 4 but rank 0 has 8"});
  }
  SUBCASE("flags and scale mismatch") {
    std::vector<OpDescriptor> attn = goodCollective(smallShape(OpKind::kRingAttention), 3);
    attn[1].flags = 0;
    collectiveRejects(attn, {"rank 1 has flags 0x0 but rank 0 has 0x1"});
    attn[1].flags = attn[0].flags;
    attn[2].scale = 0.125f;
    collectiveRejects(attn, {"rank 2 has scale 0.125 but rank 0 has 0"});
  }
  SUBCASE("no descriptors") { collectiveRejects({}, {"no descriptors"}); }
}

namespace {

// What tandem.h says each slot holds, recomputed here from scratch in 128-bit arithmetic.
__extension__ typedef unsigned __int128 U128;

struct ExpectedSlots {
  std::array<bool, tandem::kMaxOpBuffers> used{};
  std::array<bool, tandem::kMaxOpBuffers> optional{};
  std::array<U128, tandem::kMaxOpBuffers> bytes{};
  std::array<uint64_t, tandem::kMaxOpBuffers> align{};
};

ExpectedSlots independentSlots(const OpDescriptor& d) {
  ExpectedSlots x;
  // FP8 (dtype 5, 6): one byte, c in the output dtype of flags bits 4-5 (1 fp32, 2 fp16, 3 bf16), fp32 scales.
  const bool fp8 = d.dtype == DType::kF8E4M3 || d.dtype == DType::kF8E5M2;
  const U128 es = fp8 ? 1 : d.dtype == DType::kF32 ? 4 : 2;
  const unsigned outCode = (d.flags >> 4) & 3U;
  const U128 outEs = outCode == 0 ? es : outCode == 1 ? 4 : 2;
  const bool blockScales = (d.flags & 0x40U) != 0;
  const auto& v = d.dims;
  auto set = [&x](int s, U128 bytes, uint64_t align, bool optional = false) {
    x.used[static_cast<std::size_t>(s)] = true;
    x.bytes[static_cast<std::size_t>(s)] = bytes;
    x.align[static_cast<std::size_t>(s)] = align;
    x.optional[static_cast<std::size_t>(s)] = optional;
  };
  const uint64_t myRows = d.nranks == 0 ? 0 : v[0] / d.nranks + (d.rank < v[0] % d.nranks ? 1 : 0);
  const auto esAlign = static_cast<uint64_t>(es);
  const auto outAlign = static_cast<uint64_t>(outEs);
  const auto blocks = [](uint64_t extent) { return (U128{extent} + 127) / 128; };
  // a_scale [ceil(k/128), rows] and b_scale [ceil(n/128), ceil(k/128)] when block-scaled, one fp32 each per tensor,
  // none unless FP8.
  const auto scales = [&](int s, uint64_t rows) {
    set(s, !fp8 ? 0 : !blockScales ? 4 : blocks(v[2]) * rows * 4, 4);
    set(s + 1, !fp8 ? 0 : !blockScales ? 4 : blocks(v[1]) * blocks(v[2]) * 4, 4);
  };
  switch (d.kind) {
    case OpKind::kAgGemm:
      set(0, U128{myRows} * v[2] * es, esAlign);
      set(1, U128{v[1]} * v[2] * es, esAlign);
      set(2, U128{v[0]} * v[1] * outEs, outAlign);
      set(3, U128{v[0]} * v[2] * es, esAlign, true);
      scales(4, myRows);
      break;
    case OpKind::kGemmRs:
    case OpKind::kGemmAr:
      set(0, U128{v[0]} * v[2] * es, esAlign);
      set(1, U128{v[1]} * v[2] * es, esAlign);
      set(2, U128{d.kind == OpKind::kGemmRs ? myRows : v[0]} * v[1] * outEs, outAlign);
      scales(3, v[0]);
      break;
    case OpKind::kMoeDispatchGemm:
    case OpKind::kMoeDispatchFfnCombine: {
      const U128 local = d.nranks == 0 ? 0 : v[3] / d.nranks;
      set(0, U128{v[0]} * v[1] * es, esAlign);
      set(1, U128{v[0]} * v[4] * 4, 4);
      set(2, U128{v[0]} * v[4] * 4, 4);
      // The weights in w_dtype (flags bits 7-9: 0 the dtype, 5 e4m3 of one byte); e4m3 weights come with fp32 scales
      // per 128 x 128 block of each expert; none otherwise.
      const bool f8w = ((d.flags >> 7) & 7U) == 5U;
      const U128 wes = f8w ? 1 : es;
      if (d.kind == OpKind::kMoeDispatchGemm) {
        set(3, local * v[2] * v[1] * wes, static_cast<uint64_t>(wes));
        set(4, U128{v[5]} * v[2] * es, esAlign);
        set(5, U128{v[5]} * 16, 4);
        set(6, local * 4, 4);
        set(7, f8w ? local * blocks(v[2]) * blocks(v[1]) * 4 : 0, 4);  // w_scale [E/n, ceil(n_out/128), ...]
      } else {
        // w1_scale [E/n, ceil(2 ffn/128), ceil(hidden/128)], w2_scale [E/n, ceil(hidden/128), ceil(ffn/128)].
        set(3, local * 2 * v[2] * v[1] * wes, static_cast<uint64_t>(wes));
        set(4, local * v[1] * v[2] * wes, static_cast<uint64_t>(wes));
        set(5, U128{v[0]} * v[1] * es, esAlign);
        set(6, U128{v[5]} * 2 * v[2] * es, esAlign, true);  // saved [saved_rows, 2*ffn], optional
        set(7, f8w ? local * blocks(2 * v[2]) * blocks(v[1]) * 4 : 0, 4);
        set(8, f8w ? local * blocks(v[1]) * blocks(v[2]) * 4 : 0, 4);
      }
      break;
    }
    case OpKind::kRingAttention:
      for (int s = 0; s < 4; ++s) set(s, U128{v[0]} * v[1] * v[2] * es, esAlign);
      set(4, U128{v[1]} * v[0] * 4, 4, true);  // lse [heads, seq] fp32, optional
      break;
    case OpKind::kAllGather:
      set(0, v[0], 1);
      set(1, U128{d.nranks} * v[0], 1);
      break;
    default: break;
  }
  return x;
}

// Fixes every slot's claimed bytes to what the shape implies, so mutated shapes are sometimes accepted.
void fixBytes(OpDescriptor& d) {
  const ExpectedSlots x = independentSlots(d);
  for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
    if (x.used[s] && d.bufs[s].bufferId != 0) d.bufs[s].bytes = static_cast<uint64_t>(x.bytes[s]);
  }
}

uint64_t interesting(std::mt19937_64& rng) {
  static constexpr uint64_t kValues[] = {0, 1, 2, 3, 4, 7, 8, 64, 65, 1000, uint64_t{1} << 31, uint64_t{1} << 32,
                                         (uint64_t{1} << 32) + 1, uint64_t{1} << 40, uint64_t{1} << 63,
                                         std::numeric_limits<uint64_t>::max()};
  if (rng() % 4 == 0) return rng();
  return kValues[rng() % std::size(kValues)];
}

}  // namespace

TEST_CASE("validateDescriptor never crashes and never accepts bytes that disagree with the shape (fuzz)") {
  std::vector<OpDescriptor> pool;
  for (OpKind kind : kAllKinds)
    for (DType t : {DType::kBF16, DType::kF32})
      for (uint32_t nranks : {1u, 3u, 4u})
        for (uint32_t rank = 0; rank < nranks; ++rank) pool.push_back(good(kind, t, rank, nranks));
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {  // FP8, per tensor and block-scaled
    for (bool block : {false, true}) {
      ref::OpShape shape = smallShape(kind, DType::kF8E4M3);
      shape.blockScale = block;
      for (uint32_t rank = 0; rank < 3; ++rank) pool.push_back(withBuffers(ref::makeDescriptor(shape, rank, 3)));
    }
  }
  for (OpKind kind : {OpKind::kMoeDispatchFfnCombine, OpKind::kMoeDispatchGemm}) {  // the MoE ops with FP8 weights
    ref::OpShape shape = smallShape(kind);
    shape.weightDtype = DType::kF8E4M3;
    for (uint32_t rank = 0; rank < 4; ++rank) pool.push_back(withBuffers(ref::makeDescriptor(shape, rank, 4)));
  }

  std::mt19937_64 rng(20240607);
  int accepted = 0, mutatedAccepted = 0;
  for (int iter = 0; iter < 100000; ++iter) {
    OpDescriptor d = pool[rng() % pool.size()];
    const OpDescriptor original = d;
    const int mutations = 1 + static_cast<int>(rng() % 3);
    for (int mu = 0; mu < mutations; ++mu) {
      switch (rng() % 8) {
        case 0: {  // flip one bit anywhere in the descriptor's defined fields
          auto* bytes = reinterpret_cast<unsigned char*>(&d);
          bytes[rng() % offsetof(OpDescriptor, reserved1)] ^= static_cast<unsigned char>(1u << (rng() % 8));
          break;
        }
        case 1: {  // overwrite one byte, reserved ones included
          auto* bytes = reinterpret_cast<unsigned char*>(&d);
          bytes[rng() % (offsetof(OpDescriptor, reserved1) + sizeof(d.reserved1))] = static_cast<unsigned char>(rng());
          break;
        }
        case 2: d.dims[rng() % tandem::kMaxOpDims] = interesting(rng); break;
        case 3: {
          tandem::BufferRef& b = d.bufs[rng() % tandem::kMaxOpBuffers];
          uint64_t* field = rng() % 3 == 0 ? &b.bufferId : rng() % 2 == 0 ? &b.offset : &b.bytes;
          *field = rng() % 2 == 0 ? interesting(rng) : *field + (rng() % 2 == 0 ? 1 : -1);
          break;
        }
        case 4: d.dims[rng() % 6] = 1 + rng() % 70; break;
        case 5:
          d.rank = static_cast<uint32_t>(rng() % 70);
          d.nranks = static_cast<uint32_t>(rng() % 70);
          break;
        case 6:
          d.kind = static_cast<OpKind>(rng() % 10);
          d.dtype = static_cast<DType>(rng() % 8);
          d.flags = static_cast<uint16_t>(rng() % 3);
          break;
        default: fixBytes(d); break;  // a consistent shape change: these should often pass
      }
    }
    if (rng() % 2 == 0) fixBytes(d);

    tandem::SlotRules rules;
    try {
      rules = tandem::validateDescriptor(d);
    } catch (const tandem::Error& e) {
      REQUIRE(e.code() == tandem::ErrorCode::kInvalidArgument);
      REQUIRE(std::strlen(e.what()) > 0);
      continue;
    }
    ++accepted;
    if (std::memcmp(&d, &original, sizeof d) != 0) ++mutatedAccepted;
    // Accepted: every slot must agree with an independent reading of tandem.h.
    const ExpectedSlots x = independentSlots(d);
    for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
      const tandem::BufferRef& b = d.bufs[s];
      INFO("iteration " << iter << ", " << tandem::opKindName(d.kind) << ", slot " << s);
      if (!x.used[s]) {
        REQUIRE((b.bufferId == 0 && b.offset == 0 && b.bytes == 0));
        REQUIRE(rules[s].name.empty());
        continue;
      }
      REQUIRE(x.bytes[s] <= (U128{1} << 40));
      REQUIRE(rules[s].bytes == static_cast<uint64_t>(x.bytes[s]));
      if (b.bufferId == 0 && x.optional[s]) {
        REQUIRE((b.offset == 0 && b.bytes == 0));
        continue;
      }
      if (b.bufferId == 0) REQUIRE(x.bytes[s] == 0);
      REQUIRE(U128{b.bytes} == x.bytes[s]);
      REQUIRE(b.offset % x.align[s] == 0);
    }
  }
  MESSAGE("fuzz: " << accepted << " of 100000 accepted, " << mutatedAccepted << " of them mutated");
  CHECK(mutatedAccepted > 1000);  // the accept path was exercised, not only rejections
}

TEST_CASE("the GEMM ops' FP8 inputs: accepted with their scales, bad ones refused naming the argument") {
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    const std::string op(tandem::opKindName(kind));
    const bool ag = kind == OpKind::kAgGemm;
    const int aScale = ag ? tandem::slot::kAgAScale : tandem::slot::kReduceAScale;
    const int bScale = ag ? tandem::slot::kAgBScale : tandem::slot::kReduceBScale;
    CAPTURE(op);
    ref::OpShape shape = smallShape(kind, DType::kF8E5M2);
    shape.k = 300, shape.n = 131;
    const OpDescriptor perTensor = withBuffers(ref::makeDescriptor(shape, 1, 4));
    CHECK_NOTHROW(tandem::validateDescriptor(perTensor));
    CHECK(perTensor.bufs[static_cast<std::size_t>(aScale)].bytes == 4);
    CHECK(perTensor.bufs[tandem::slot::kC].bytes % 2 == 0);  // bf16 c by default
    shape.blockScale = true;
    shape.outDtype = DType::kF32;
    const OpDescriptor block = withBuffers(ref::makeDescriptor(shape, 1, 4));
    CHECK_NOTHROW(tandem::validateDescriptor(block));
    const uint64_t rows = ag ? tandem::rowsOf(37, 1, 4) : 37, kLocal = block.dims[tandem::dim::kK];
    CHECK(block.bufs[static_cast<std::size_t>(aScale)].bytes == (kLocal + 127) / 128 * rows * 4);
    CHECK(block.bufs[static_cast<std::size_t>(bScale)].bytes == 2 * ((kLocal + 127) / 128) * 4);

    OpDescriptor d = perTensor;
    {  // a missing scale
      d = perTensor;
      d.bufs[static_cast<std::size_t>(aScale)] = {};
      rejects(d, {op + ": buffer a_scale is absent (bufferId 0) but required", "fp32 [1] (per tensor)"});
    }
    {  // a scale of the wrong shape
      d = block;
      d.bufs[static_cast<std::size_t>(bScale)].bytes = 4;
      rejects(d, {op + ": buffer b_scale claims 4 bytes but ceil(n/128)*ceil(k/128)*4 = " +
                     std::to_string(block.bufs[static_cast<std::size_t>(bScale)].bytes)});
      d = perTensor;
      d.bufs[static_cast<std::size_t>(aScale)].bytes = 8;
      rejects(d, {op + ": buffer a_scale claims 8 bytes but 1*4 = 4"});
    }
    {  // no output dtype, or an FP8 or fp16 one
      d = perTensor;
      d.flags &= static_cast<uint16_t>(~tandem::kFlagGemmOutDtype);
      rejects(d, {op + ": out_dtype is 0 (dtype's) with fp8-e5m2 inputs; c of an FP8 GEMM is bf16 or fp32"});
      d.flags |= static_cast<uint16_t>(2U << tandem::kGemmOutDtypeShift);
      rejects(d, {"out_dtype is fp16 with fp8-e5m2 inputs"});
    }
    {  // scales, an output dtype or block scaling without FP8 inputs
      OpDescriptor bf = good(kind);
      bf.bufs[static_cast<std::size_t>(aScale)] = {7, 0, 4};
      rejects(bf, {op + ": a_scale is set but dtype is bf16; scales apply to FP8 inputs only"});
      bf = good(kind);
      bf.flags |= static_cast<uint16_t>(1U << tandem::kGemmOutDtypeShift);
      rejects(bf, {op + ": out_dtype is fp32 but dtype is bf16; only FP8 inputs take another output dtype"});
      bf = good(kind);
      bf.flags |= static_cast<uint16_t>(3U << tandem::kGemmOutDtypeShift);  // bf16 = its own dtype: fine
      CHECK_NOTHROW(tandem::validateDescriptor(bf));
      bf.flags |= tandem::kFlagFp8BlockScale;
      rejects(bf, {op + ": scaling is TANDEM_FP8_SCALE_BLOCK but dtype is bf16"});
    }
  }
  {  // an op without an FP8 path
    OpDescriptor moe = good(OpKind::kMoeDispatchFfnCombine);
    moe.dtype = DType::kF8E4M3;
    rejects(moe, {"moe-dispatch-ffn-combine: dtype fp8-e4m3 not supported; this op has no FP8 path"});
  }
}

TEST_CASE("the MoE FFN's FP8 weights: w_dtype, the block scales' shapes, and what is refused") {
  const std::string op = "moe-dispatch-ffn-combine";
  ref::OpShape shape = smallShape(OpKind::kMoeDispatchFfnCombine);
  shape.weightDtype = DType::kF8E4M3;  // hidden 23, ffn 19, 8 experts over 4 ranks
  const OpDescriptor fp8 = withBuffers(ref::makeDescriptor(shape, 1, 4));
  CHECK(tandem::moeWeightDtype(fp8.dtype, fp8.flags) == DType::kF8E4M3);
  CHECK(fp8.bufs[slot::kW1].bytes == 2 * 2 * 19 * 23);  // one byte per weight
  CHECK(fp8.bufs[slot::kW2].bytes == 2 * 23 * 19);
  CHECK(fp8.bufs[slot::kFfnW1Scale].bytes == 2 * 1 * 1 * 4);  // [E/n, ceil(2*19/128), ceil(23/128)] fp32
  CHECK(fp8.bufs[slot::kFfnW2Scale].bytes == 2 * 1 * 1 * 4);
  CHECK_NOTHROW(tandem::validateDescriptor(fp8));
  {  // the scale shapes with several blocks: 2*ffn = 260 rows of w1 make 3 row blocks, hidden = 300 makes 3
    ref::OpShape big = shape;
    big.n = 130, big.k = 300;
    const OpDescriptor d = ref::makeDescriptor(big, 0, 4);
    CHECK(d.bufs[slot::kFfnW1Scale].bytes == 2 * 3 * 3 * 4);
    CHECK(d.bufs[slot::kFfnW2Scale].bytes == 2 * 3 * 2 * 4);
  }
  {  // a missing or misshapen scale
    OpDescriptor d = fp8;
    d.bufs[slot::kFfnW1Scale].bufferId = 0, d.bufs[slot::kFfnW1Scale].offset = 0;
    rejects(d, {op + ": buffer w1_scale is absent (bufferId 0) but required; pass the tensor of fp32 [experts/nranks, "
                "ceil(2*ffn/128), ceil(hidden/128)]"});
    d = fp8;
    d.bufs[slot::kFfnW2Scale].bytes = 4;
    rejects(d, {op + ": buffer w2_scale claims 4 bytes but experts/nranks*ceil(hidden/128)*ceil(ffn/128)*4 = 8"});
  }
  {  // the weights' dtype rules
    OpDescriptor d = fp8;
    d.dtype = DType::kF16;
    rejects(d, {op + ": w_dtype fp8-e4m3 needs dtype bf16 (x and out), not fp16; pass dtype TANDEM_DTYPE_BF16 (3)"});
    d = fp8;
    d.flags = static_cast<uint16_t>(static_cast<unsigned>(DType::kF8E5M2) << tandem::kMoeWeightDtypeShift);
    rejects(d, {op + ": w_dtype is fp8-e5m2; the FFN's FP8 weights are e4m3"});
    d.flags = static_cast<uint16_t>(static_cast<unsigned>(DType::kF32) << tandem::kMoeWeightDtypeShift);
    rejects(d, {op + ": w_dtype is fp32 but dtype is bf16; w1 and w2 are in dtype (w_dtype 0) or e4m3"});
    d.flags = static_cast<uint16_t>(7U << tandem::kMoeWeightDtypeShift);
    rejects(d, {op + ": w_dtype is"});
  }
  {  // scales without FP8 weights (w_dtype 0, or dtype's own)
    OpDescriptor d = good(OpKind::kMoeDispatchFfnCombine);
    d.bufs[slot::kFfnW1Scale] = {7, 0, 4};
    rejects(d, {op + ": w1_scale is set but w_dtype is bf16; scales apply to FP8 inputs only, so pass none"});
    d = good(OpKind::kMoeDispatchFfnCombine);
    d.flags = static_cast<uint16_t>(static_cast<unsigned>(DType::kBF16) << tandem::kMoeWeightDtypeShift);
    CHECK_NOTHROW(tandem::validateDescriptor(d));
  }
  {  // ops without FP8 weights: w_dtype's flag bits are not theirs, and FP8 dtypes are refused
    OpDescriptor bwd = good(OpKind::kMoeFfnBackward);
    bwd.flags = fp8.flags;
    rejects(bwd, {"moe-ffn-backward: flags 0x280 has bits 0x280 this op does not define"});
    bwd = good(OpKind::kMoeFfnBackward);
    bwd.dtype = DType::kF8E4M3;
    rejects(bwd, {"moe-ffn-backward: dtype fp8-e4m3 not supported; this op has no FP8 path"});
    OpDescriptor gemm = good(OpKind::kMoeDispatchGemm);
    gemm.dtype = DType::kF8E4M3;
    rejects(gemm, {"moe-dispatch-gemm: dtype fp8-e4m3 not supported; this op has no FP8 path"});
  }
  {  // every rank passes the same w_dtype
    std::vector<OpDescriptor> descs = goodCollective(shape, 2);
    descs[1].flags = 0;
    descs[1].bufs[slot::kFfnW1Scale] = {}, descs[1].bufs[slot::kFfnW2Scale] = {};
    descs[1].bufs[slot::kW1].bytes *= 2, descs[1].bufs[slot::kW2].bytes *= 2;
    REQUIRE_NOTHROW(tandem::validateDescriptor(descs[1]));
    collectiveRejects(descs, {op + ": rank 1 has flags 0x0 but rank 0 has 0x280"});
  }
}

TEST_CASE("moe-dispatch-gemm's FP8 weights: w_dtype, the block scale's shape, and what is refused") {
  const std::string op = "moe-dispatch-gemm";
  ref::OpShape shape = smallShape(OpKind::kMoeDispatchGemm);
  shape.weightDtype = DType::kF8E4M3;  // hidden 23, n_out 19, 8 experts over 4 ranks
  const OpDescriptor fp8 = withBuffers(ref::makeDescriptor(shape, 1, 4));
  CHECK(tandem::moeWeightDtype(fp8.dtype, fp8.flags) == DType::kF8E4M3);
  CHECK(fp8.bufs[slot::kW].bytes == 2 * 19 * 23);  // one byte per weight
  CHECK(fp8.bufs[slot::kMoeWScale].bytes == 2 * 1 * 1 * 4);  // [E/n, ceil(19/128), ceil(23/128)] fp32
  CHECK_NOTHROW(tandem::validateDescriptor(fp8));
  {  // several blocks: n_out = 130 makes 2 row blocks, hidden = 300 makes 3
    ref::OpShape big = shape;
    big.n = 130, big.k = 300;
    CHECK(ref::makeDescriptor(big, 0, 4).bufs[slot::kMoeWScale].bytes == 2 * 2 * 3 * 4);
  }
  {  // a missing or misshapen scale
    OpDescriptor d = fp8;
    d.bufs[slot::kMoeWScale].bufferId = 0, d.bufs[slot::kMoeWScale].offset = 0;
    rejects(d, {op + ": buffer w_scale is absent (bufferId 0) but required; pass the tensor of fp32 [experts/nranks, "
                "ceil(n_out/128), ceil(hidden/128)]"});
    d = fp8;
    d.bufs[slot::kMoeWScale].bytes = 4;
    rejects(d, {op + ": buffer w_scale claims 4 bytes but"});
  }
  {  // the weights' dtype rules
    OpDescriptor d = fp8;
    d.dtype = DType::kF16;
    rejects(d, {op + ": w_dtype fp8-e4m3 needs dtype bf16 (x and out), not fp16; pass dtype TANDEM_DTYPE_BF16 (3)"});
    d = fp8;
    d.flags = static_cast<uint16_t>(static_cast<unsigned>(DType::kF8E5M2) << tandem::kMoeWeightDtypeShift);
    rejects(d, {op + ": w_dtype is fp8-e5m2; the experts' FP8 weights are e4m3"});
    d.flags = static_cast<uint16_t>(static_cast<unsigned>(DType::kF32) << tandem::kMoeWeightDtypeShift);
    rejects(d, {op + ": w_dtype is fp32 but dtype is bf16; w is in dtype (w_dtype 0) or e4m3"});
  }
  {  // a scale without FP8 weights
    OpDescriptor d = good(OpKind::kMoeDispatchGemm);
    d.bufs[slot::kMoeWScale] = {7, 0, 4};
    rejects(d, {op + ": w_scale is set but w_dtype is bf16; scales apply to FP8 inputs only, so pass none"});
  }
  {  // every rank passes the same w_dtype
    std::vector<OpDescriptor> descs = goodCollective(shape, 2);
    descs[1].flags = 0;
    descs[1].bufs[slot::kMoeWScale] = {};
    descs[1].bufs[slot::kW].bytes *= 2;
    REQUIRE_NOTHROW(tandem::validateDescriptor(descs[1]));
    collectiveRejects(descs, {op + ": rank 1 has flags 0x0 but rank 0 has 0x280"});
  }
}
