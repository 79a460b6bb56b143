// The C entry points read their argument structs through the op table (client/src/c_args.hpp). For every op of the
// table: a struct filled with distinct values unpacks to exactly what a hand-written copy of each field gives.
#include <doctest/doctest.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "c_args.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"

namespace {

using tandem::OpKind;
using tandem::client::CArgs;

// A fake buffer handle: unpacking only copies it.
tandem_tensor_t tensor(int i) {
  return {reinterpret_cast<tandem_buffer_t>(static_cast<uintptr_t>(0x1000 + 0x100 * i)), uint64_t(7000 + i)};
}
void* stream() { return reinterpret_cast<void*>(uintptr_t{0xabcd00}); }

// The field-by-field copy, written out per op: what the C entry points did by hand.
CArgs expected(OpKind kind, tandem_dtype_t dtype, std::vector<uint64_t> dims, std::vector<tandem_tensor_t> tensors,
               void* cudaStream, uint16_t flags = 0, float scale = 0) {
  CArgs c;
  c.desc.kind = kind;
  c.desc.dtype = static_cast<tandem::DType>(dtype);
  for (std::size_t i = 0; i < dims.size(); ++i) c.desc.dims[i] = dims[i];
  for (std::size_t i = 0; i < tensors.size(); ++i) c.tensors[i] = tensors[i];
  c.tensorCount = static_cast<uint8_t>(tensors.size());
  c.desc.flags = flags;
  c.desc.scale = scale;
  c.stream = cudaStream;
  return c;
}

struct Case {
  std::function<CArgs()> unpack;  // fills the struct with distinct values and unpacks it
  CArgs want;
};

template <typename T>
T sized() {
  T t{};
  t.struct_size = sizeof t;
  return t;
}

std::map<std::string, Case> cases() {
  std::map<std::string, Case> m;
  const auto unpack = [](OpKind k, const auto& a) { return tandem::client::unpackArgs(tandem::opSpec(k), &a); };
  {
    auto a = sized<tandem_ag_gemm_args_t>();
    a.dtype = TANDEM_DTYPE_BF16, a.m = 11, a.n = 12, a.k = 13;
    a.a = tensor(0), a.b = tensor(1), a.c = tensor(2), a.a_gathered = tensor(3), a.cuda_stream = stream();
    a.layout = TANDEM_GEMM_TN;
    m["tandem_ag_gemm_args_t"] = {
        [=] { return unpack(OpKind::kAgGemm, a); },
        expected(OpKind::kAgGemm, a.dtype, {a.m, a.n, a.k}, {a.a, a.b, a.c, a.a_gathered, {}, {}}, a.cuda_stream,
                 tandem::gemmLayoutFlags(tandem::GemmOperands::kTN))};
  }
  {  // FP8 inputs: the output dtype and the scaling mode go into the flags, the scales into slots 4 and 5
    auto a = sized<tandem_ag_gemm_args_t>();
    a.dtype = TANDEM_DTYPE_FP8_E4M3, a.m = 14, a.n = 15, a.k = 16;
    a.a = tensor(40), a.b = tensor(41), a.c = tensor(42), a.a_gathered = tensor(43), a.cuda_stream = stream();
    a.layout = TANDEM_GEMM_NN, a.out_dtype = TANDEM_DTYPE_FP32, a.scaling = TANDEM_FP8_SCALE_BLOCK;
    a.a_scale = tensor(44), a.b_scale = tensor(45);
    m["tandem_ag_gemm_args_t fp8"] = {
        [=] { return unpack(OpKind::kAgGemm, a); },
        expected(OpKind::kAgGemm, a.dtype, {a.m, a.n, a.k}, {a.a, a.b, a.c, a.a_gathered, a.a_scale, a.b_scale},
                 a.cuda_stream,
                 tandem::gemmLayoutFlags(tandem::GemmOperands::kNN) | (1U << tandem::kGemmOutDtypeShift) |
                     tandem::kFlagFp8BlockScale)};
  }
  {
    auto a = sized<tandem_gemm_rs_args_t>();
    a.dtype = TANDEM_DTYPE_FP16, a.m = 21, a.n = 22, a.k = 23;
    a.a = tensor(4), a.b = tensor(5), a.c = tensor(6), a.cuda_stream = stream(), a.layout = TANDEM_GEMM_NN;
    a.out_dtype = TANDEM_DTYPE_FP16, a.a_scale = tensor(46), a.b_scale = tensor(47);
    m["tandem_gemm_rs_args_t"] = {
        [=] { return unpack(OpKind::kGemmRs, a); },
        expected(OpKind::kGemmRs, a.dtype, {a.m, a.n, a.k}, {a.a, a.b, a.c, a.a_scale, a.b_scale}, a.cuda_stream,
                 tandem::gemmLayoutFlags(tandem::GemmOperands::kNN) | (2U << tandem::kGemmOutDtypeShift))};
  }
  {
    auto a = sized<tandem_gemm_ar_args_t>();
    a.dtype = TANDEM_DTYPE_FP32, a.m = 31, a.n = 32, a.k = 33;
    a.a = tensor(7), a.b = tensor(8), a.c = tensor(9), a.cuda_stream = stream(), a.layout = TANDEM_GEMM_TN;
    a.dtype = TANDEM_DTYPE_FP8_E5M2, a.out_dtype = TANDEM_DTYPE_BF16, a.scaling = TANDEM_FP8_SCALE_TENSOR;
    a.a_scale = tensor(48), a.b_scale = tensor(49);
    m["tandem_gemm_ar_args_t"] = {
        [=] { return unpack(OpKind::kGemmAr, a); },
        expected(OpKind::kGemmAr, a.dtype, {a.m, a.n, a.k}, {a.a, a.b, a.c, a.a_scale, a.b_scale}, a.cuda_stream,
                 tandem::gemmLayoutFlags(tandem::GemmOperands::kTN) | (3U << tandem::kGemmOutDtypeShift))};
  }
  {
    auto a = sized<tandem_ring_attention_backward_args_t>();
    a.dtype = TANDEM_DTYPE_FP16, a.seq = 71, a.heads = 72, a.head_dim = 73, a.kv_heads = 0, a.causal = 1;
    a.layout = TANDEM_ATTENTION_ZIGZAG, a.scale = 0.25F;
    a.q = tensor(30), a.k = tensor(31), a.v = tensor(32), a.o = tensor(33), a.dout = tensor(34);
    a.lse = tensor(35), a.dq = tensor(36), a.dk = tensor(37), a.dv = tensor(38), a.cuda_stream = stream();
    m["tandem_ring_attention_backward_args_t"] = {
        [=] { return unpack(OpKind::kRingAttentionBackward, a); },
        expected(OpKind::kRingAttentionBackward, a.dtype, {a.seq, a.heads, a.head_dim, a.heads},  // kv_heads 0: heads
                 {a.q, a.k, a.v, a.o, a.dout, a.lse, a.dq, a.dk, a.dv}, a.cuda_stream,
                 tandem::kFlagCausal | tandem::kFlagZigzag, a.scale)};
  }
  {
    auto a = sized<tandem_moe_dispatch_gemm_args_t>();
    a.dtype = TANDEM_DTYPE_BF16, a.tokens = 41, a.hidden = 42, a.n_out = 43, a.experts = 44, a.topk = 45,
    a.capacity = 46;
    a.x = tensor(10), a.topk_ids = tensor(11), a.topk_weights = tensor(12), a.w = tensor(13), a.out = tensor(14),
    a.row_info = tensor(15), a.expert_counts = tensor(16), a.cuda_stream = stream();
    m["tandem_moe_dispatch_gemm_args_t"] = {
        [=] { return unpack(OpKind::kMoeDispatchGemm, a); },
        expected(OpKind::kMoeDispatchGemm, a.dtype, {a.tokens, a.hidden, a.n_out, a.experts, a.topk, a.capacity},
                 {a.x, a.topk_ids, a.topk_weights, a.w, a.out, a.row_info, a.expert_counts, {}}, a.cuda_stream)};
    // With FP8 weights: w_dtype in flags bits 7-9, the block scales in slot 7.
    auto f = a;
    f.w_dtype = TANDEM_DTYPE_FP8_E4M3, f.w_scale = tensor(17);
    m["tandem_moe_dispatch_gemm_args_t fp8"] = {
        [=] { return unpack(OpKind::kMoeDispatchGemm, f); },
        expected(OpKind::kMoeDispatchGemm, f.dtype, {f.tokens, f.hidden, f.n_out, f.experts, f.topk, f.capacity},
                 {f.x, f.topk_ids, f.topk_weights, f.w, f.out, f.row_info, f.expert_counts, f.w_scale}, f.cuda_stream,
                 static_cast<uint16_t>(TANDEM_DTYPE_FP8_E4M3 << tandem::kMoeWeightDtypeShift))};
  }
  {
    auto a = sized<tandem_moe_ffn_args_t>();
    a.dtype = TANDEM_DTYPE_FP16, a.tokens = 51, a.hidden = 52, a.ffn = 53, a.experts = 54, a.topk = 55;
    a.x = tensor(17), a.topk_ids = tensor(18), a.topk_weights = tensor(19), a.w1 = tensor(20), a.w2 = tensor(21),
    a.out = tensor(22), a.cuda_stream = stream(), a.saved_rows = 56, a.saved = tensor(90);
    m["tandem_moe_ffn_args_t"] = {
        [=] { return unpack(OpKind::kMoeDispatchFfnCombine, a); },
        expected(OpKind::kMoeDispatchFfnCombine, a.dtype, {a.tokens, a.hidden, a.ffn, a.experts, a.topk, a.saved_rows},
                 {a.x, a.topk_ids, a.topk_weights, a.w1, a.w2, a.out, a.saved, {}, {}}, a.cuda_stream)};
    // With FP8 weights: w_dtype in flags bits 7-9, the block scales in their slots.
    auto f = a;
    f.w_dtype = TANDEM_DTYPE_FP8_E4M3, f.w1_scale = tensor(23), f.w2_scale = tensor(24);
    m["tandem_moe_ffn_args_t fp8"] = {
        [=] { return unpack(OpKind::kMoeDispatchFfnCombine, f); },
        expected(OpKind::kMoeDispatchFfnCombine, f.dtype, {f.tokens, f.hidden, f.ffn, f.experts, f.topk, f.saved_rows},
                 {f.x, f.topk_ids, f.topk_weights, f.w1, f.w2, f.out, f.saved, f.w1_scale, f.w2_scale}, f.cuda_stream,
                 static_cast<uint16_t>(TANDEM_DTYPE_FP8_E4M3 << tandem::kMoeWeightDtypeShift))};
  }
  {
    auto a = sized<tandem_moe_ffn_backward_args_t>();
    a.dtype = TANDEM_DTYPE_BF16, a.tokens = 81, a.hidden = 82, a.ffn = 83, a.experts = 84, a.topk = 85;
    a.x = tensor(40), a.topk_ids = tensor(41), a.topk_weights = tensor(42), a.w1 = tensor(43), a.w2 = tensor(44);
    a.dout = tensor(45), a.dx = tensor(46), a.dtopk_weights = tensor(47), a.dw1 = tensor(48), a.dw2 = tensor(49);
    a.cuda_stream = stream(), a.saved_rows = 86, a.saved = tensor(91);
    m["tandem_moe_ffn_backward_args_t"] = {
        [=] { return unpack(OpKind::kMoeFfnBackward, a); },
        expected(OpKind::kMoeFfnBackward, a.dtype, {a.tokens, a.hidden, a.ffn, a.experts, a.topk, a.saved_rows},
                 {a.x, a.topk_ids, a.topk_weights, a.w1, a.w2, a.dout, a.dx, a.dtopk_weights, a.dw1, a.dw2, a.saved},
                 a.cuda_stream)};
  }
  {
    auto a = sized<tandem_ring_attention_args_t>();
    a.dtype = TANDEM_DTYPE_BF16, a.seq = 61, a.heads = 62, a.head_dim = 63, a.causal = 5, a.scale = 0.375F;
    a.q = tensor(23), a.k = tensor(24), a.v = tensor(25), a.out = tensor(26), a.cuda_stream = stream();
    a.lse = tensor(27), a.layout = TANDEM_ATTENTION_ZIGZAG, a.kv_heads = 31;
    m["tandem_ring_attention_args_t"] = {
        [=] { return unpack(OpKind::kRingAttention, a); },
        expected(OpKind::kRingAttention, a.dtype, {a.seq, a.heads, a.head_dim, a.kv_heads}, {a.q, a.k, a.v, a.out, a.lse},
                 a.cuda_stream, tandem::kFlagCausal | tandem::kFlagZigzag, a.scale)};
  }
  {
    auto a = sized<tandem_allgather_args_t>();
    a.send = tensor(28), a.recv = tensor(29), a.bytes = 71, a.cuda_stream = stream();
    m["tandem_allgather_args_t"] = {
        [=] { return unpack(OpKind::kAllGather, a); },
        expected(OpKind::kAllGather, TANDEM_DTYPE_INVALID, {a.bytes}, {a.send, a.recv}, a.cuda_stream)};
  }
  {
    auto a = sized<tandem_barrier_args_t>();
    a.cuda_stream = stream();
    m["tandem_barrier_args_t"] = {[=] { return unpack(OpKind::kNop, a); },
                                  expected(OpKind::kNop, TANDEM_DTYPE_INVALID, {}, {}, a.cuda_stream)};
  }
  return m;
}

void checkSame(const CArgs& got, const CArgs& want) {
  CHECK(got.desc.kind == want.desc.kind);
  CHECK(got.desc.dtype == want.desc.dtype);
  CHECK(got.desc.flags == want.desc.flags);
  CHECK(got.desc.scale == want.desc.scale);
  CHECK(got.desc.dims == want.desc.dims);
  CHECK(got.stream == want.stream);
  REQUIRE(got.tensorCount == want.tensorCount);
  for (std::size_t i = 0; i < got.tensors.size(); ++i) {
    CAPTURE(i);
    CHECK(got.tensors[i].buffer == want.tensors[i].buffer);
    CHECK(got.tensors[i].offset == want.tensors[i].offset);
  }
}

std::string messageOf(const std::function<CArgs()>& f) {
  try {
    f();
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("no error");
  return {};
}

TEST_CASE("capi args: the C argument structs unpack through the op table as the field-by-field copy does") {
  const auto all = cases();
  for (const tandem::OpSpec& op : tandem::ops()) {
    CAPTURE(op.name);
    const auto it = all.find(std::string(op.cStruct));
    REQUIRE_MESSAGE(it != all.end(), "c_args_test's cases() has no entry for ", op.cStruct,
                    ": fill its struct and write its field-by-field copy");
    checkSame(it->second.unpack(), it->second.want);
  }
}

TEST_CASE("capi args: the GEMM structs' FP8 fields (out_dtype, scaling, a_scale, b_scale)") {
  const auto all = cases();
  const auto it = all.find("tandem_ag_gemm_args_t fp8");
  REQUIRE(it != all.end());
  checkSame(it->second.unpack(), it->second.want);

  // A caller built before the FP8 fields (its struct ends after layout): no output dtype, per tensor, no scales.
  const tandem::OpSpec& rs = tandem::opSpec(OpKind::kGemmRs);
  auto g = sized<tandem_gemm_rs_args_t>();
  g.layout = TANDEM_GEMM_NN, g.out_dtype = TANDEM_DTYPE_FP32, g.scaling = TANDEM_FP8_SCALE_BLOCK;
  g.a_scale = tensor(1), g.b_scale = tensor(2);
  g.struct_size = offsetof(tandem_gemm_rs_args_t, out_dtype);
  const CArgs old = tandem::client::unpackArgs(rs, &g);
  CHECK(old.desc.flags == tandem::gemmLayoutFlags(tandem::GemmOperands::kNN));
  CHECK(old.tensors[tandem::slot::kReduceAScale].buffer == nullptr);
  CHECK(old.tensors[tandem::slot::kReduceBScale].buffer == nullptr);
  g.struct_size = sizeof g;
  g.out_dtype = TANDEM_DTYPE_INT32;
  CHECK(messageOf([&] { return tandem::client::unpackArgs(rs, &g); }) ==
        "tandem_gemm_rs: out_dtype 4 is unknown; pass 0 (dtype's), TANDEM_DTYPE_FP32 (1), TANDEM_DTYPE_FP16 (2) or "
        "TANDEM_DTYPE_BF16 (3)");
  g.out_dtype = TANDEM_DTYPE_BF16, g.scaling = static_cast<tandem_fp8_scaling_t>(2);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(rs, &g); }) ==
        "tandem_gemm_rs: scaling 2 is unknown; pass TANDEM_FP8_SCALE_TENSOR (0) or TANDEM_FP8_SCALE_BLOCK (1)");
}

TEST_CASE("capi args: the MoE FFN's FP8 weight fields (w_dtype, w1_scale, w2_scale)") {
  const auto all = cases();
  const auto it = all.find("tandem_moe_ffn_args_t fp8");
  REQUIRE(it != all.end());
  checkSame(it->second.unpack(), it->second.want);

  // A caller built before the FP8 fields (its struct ends after cuda_stream): weights in dtype, no scales.
  const tandem::OpSpec& ffn = tandem::opSpec(OpKind::kMoeDispatchFfnCombine);
  auto a = sized<tandem_moe_ffn_args_t>();
  a.dtype = TANDEM_DTYPE_BF16, a.w_dtype = TANDEM_DTYPE_FP8_E4M3, a.w1_scale = tensor(1), a.w2_scale = tensor(2);
  a.struct_size = offsetof(tandem_moe_ffn_args_t, w_dtype);
  const CArgs old = tandem::client::unpackArgs(ffn, &a);
  CHECK(old.desc.flags == 0);
  CHECK(old.tensors[tandem::slot::kFfnW1Scale].buffer == nullptr);
  CHECK(old.tensors[tandem::slot::kFfnW2Scale].buffer == nullptr);
  a.struct_size = sizeof a;
  a.w_dtype = static_cast<tandem_dtype_t>(9);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ffn, &a); }) ==
        "tandem_moe_dispatch_ffn_combine: w_dtype 9 is unknown; pass 0 (dtype's) or TANDEM_DTYPE_FP8_E4M3 (5)");
}

TEST_CASE("capi args: moe-dispatch-gemm's FP8 weight fields (w_dtype, w_scale)") {
  const auto all = cases();
  const auto it = all.find("tandem_moe_dispatch_gemm_args_t fp8");
  REQUIRE(it != all.end());
  checkSame(it->second.unpack(), it->second.want);

  // A caller built before the FP8 fields (its struct ends after cuda_stream): weights in dtype, no scale.
  const tandem::OpSpec& dg = tandem::opSpec(OpKind::kMoeDispatchGemm);
  auto a = sized<tandem_moe_dispatch_gemm_args_t>();
  a.dtype = TANDEM_DTYPE_BF16, a.w_dtype = TANDEM_DTYPE_FP8_E4M3, a.w_scale = tensor(1);
  a.struct_size = offsetof(tandem_moe_dispatch_gemm_args_t, w_dtype);
  const CArgs old = tandem::client::unpackArgs(dg, &a);
  CHECK(old.desc.flags == 0);
  CHECK(old.tensors[tandem::slot::kMoeWScale].buffer == nullptr);
  a.struct_size = sizeof a;
  a.w_dtype = static_cast<tandem_dtype_t>(9);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(dg, &a); }) ==
        "tandem_moe_dispatch_gemm: w_dtype 9 is unknown; pass 0 (dtype's) or TANDEM_DTYPE_FP8_E4M3 (5)");
}

TEST_CASE("capi args: struct_size, NULL and enum rules") {
  const tandem::OpSpec& ag = tandem::opSpec(OpKind::kAgGemm);
  const tandem::OpSpec& ra = tandem::opSpec(OpKind::kRingAttention);
  const tandem::OpSpec& ar = tandem::opSpec(OpKind::kGemmAr);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ag, nullptr); }) ==
        "args is NULL or args->struct_size is smaller than the 0.2 tandem_ag_gemm_args_t; set struct_size = "
        "sizeof(tandem_ag_gemm_args_t)");
  // A caller built against the GEMM structs that ended at cuda_stream: the NT layout, whatever lies beyond.
  auto g = sized<tandem_ag_gemm_args_t>();
  g.layout = TANDEM_GEMM_NN;
  g.struct_size = offsetof(tandem_ag_gemm_args_t, layout);
  CHECK(tandem::client::unpackArgs(ag, &g).desc.flags == 0);
  g.struct_size = sizeof g;
  CHECK(tandem::client::unpackArgs(ag, &g).desc.flags == tandem::gemmLayoutFlags(tandem::GemmOperands::kNN));
  g.struct_size = offsetof(tandem_ag_gemm_args_t, cuda_stream);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ag, &g); }) ==
        "args is NULL or args->struct_size is smaller than the 0.2 tandem_ag_gemm_args_t; set struct_size = "
        "sizeof(tandem_ag_gemm_args_t)");
  auto r = sized<tandem_gemm_ar_args_t>();
  r.layout = static_cast<tandem_gemm_layout_t>(3);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ar, &r); }) ==
        "tandem_gemm_ar: layout 3 is unknown; pass TANDEM_GEMM_NT (0), TANDEM_GEMM_NN (1) or TANDEM_GEMM_TN (2)");

  // A caller built against the struct that ended at cuda_stream: no lse, contiguous, whatever lies beyond.
  auto a = sized<tandem_ring_attention_args_t>();
  a.dtype = TANDEM_DTYPE_BF16, a.seq = 8, a.heads = 2, a.head_dim = 16, a.causal = 1;
  a.q = tensor(1), a.lse = tensor(5), a.layout = TANDEM_ATTENTION_ZIGZAG, a.cuda_stream = stream();
  a.struct_size = offsetof(tandem_ring_attention_args_t, cuda_stream) + sizeof(void*);
  const CArgs old = tandem::client::unpackArgs(ra, &a);
  CHECK(old.desc.flags == tandem::kFlagCausal);
  CHECK(old.tensors[4].buffer == nullptr);
  CHECK(old.tensors[4].offset == 0);
  CHECK(old.stream == stream());
  // lse covered, layout not.
  a.struct_size = offsetof(tandem_ring_attention_args_t, layout);
  const CArgs mid = tandem::client::unpackArgs(ra, &a);
  CHECK(mid.tensors[4].buffer == a.lse.buffer);
  CHECK(mid.desc.dims[tandem::dim::kKvHeads] == a.heads);  // predates kv_heads: one KV head per query head
  a.struct_size = sizeof a;
  a.kv_heads = 0;  // a zero-initialised struct: the same
  CHECK(tandem::client::unpackArgs(ra, &a).desc.dims[tandem::dim::kKvHeads] == a.heads);
  a.kv_heads = 1;
  CHECK(tandem::client::unpackArgs(ra, &a).desc.dims[tandem::dim::kKvHeads] == 1);
  a.struct_size = offsetof(tandem_ring_attention_args_t, layout);
  CHECK(mid.desc.flags == tandem::kFlagCausal);
  a.struct_size -= sizeof(tandem_tensor_t) + sizeof(void*);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ra, &a); }) ==
        "args is NULL or args->struct_size is smaller than the 0.2 tandem_ring_attention_args_t; set struct_size = "
        "sizeof(tandem_ring_attention_args_t)");
  a.struct_size = sizeof a;
  a.layout = static_cast<tandem_attention_layout_t>(7);
  CHECK(messageOf([&] { return tandem::client::unpackArgs(ra, &a); }) ==
        "tandem_ring_attention: layout 7 is unknown; pass TANDEM_ATTENTION_CONTIGUOUS (0) or TANDEM_ATTENTION_ZIGZAG "
        "(1)");
}

TEST_CASE("capi args: an MoE FFN struct that ends at cuda_stream saves nothing, whatever lies beyond") {
  const tandem::OpSpec& fwd = tandem::opSpec(OpKind::kMoeDispatchFfnCombine);
  auto a = sized<tandem_moe_ffn_args_t>();
  a.dtype = TANDEM_DTYPE_BF16, a.tokens = 4, a.hidden = 8, a.ffn = 8, a.experts = 2, a.topk = 1;
  a.cuda_stream = stream(), a.saved_rows = 9, a.saved = tensor(3);
  a.struct_size = offsetof(tandem_moe_ffn_args_t, saved_rows);
  const CArgs old = tandem::client::unpackArgs(fwd, &a);
  CHECK(old.desc.dims[tandem::dim::kSavedRows] == 0);
  CHECK(old.tensors[tandem::slot::kFfnSaved].buffer == nullptr);
  a.struct_size = sizeof a;
  const CArgs now = tandem::client::unpackArgs(fwd, &a);
  CHECK(now.desc.dims[tandem::dim::kSavedRows] == 9);
  CHECK(now.tensors[tandem::slot::kFfnSaved].buffer == a.saved.buffer);
  const tandem::OpSpec& bwd = tandem::opSpec(OpKind::kMoeFfnBackward);
  auto b = sized<tandem_moe_ffn_backward_args_t>();
  b.saved_rows = 9, b.saved = tensor(4);
  b.struct_size = offsetof(tandem_moe_ffn_backward_args_t, saved_rows);
  const CArgs oldB = tandem::client::unpackArgs(bwd, &b);
  CHECK(oldB.desc.dims[tandem::dim::kSavedRows] == 0);
  CHECK(oldB.tensors[tandem::slot::kMoeBwdSaved].buffer == nullptr);
}

}  // namespace
