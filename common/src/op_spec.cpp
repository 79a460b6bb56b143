// The op table. Adding an op starts here: one entry (and its OpKind value in descriptor.hpp); validation, naming,
// `tandemctl run`, the reference's and the backends' dispatch, the unsupported-op messages, the Python bindings and
// the cross-node payload follow from it.
#include "tandem/common/op_spec.hpp"

#include <fmt/format.h>

#include <array>
#include <nlohmann/json.hpp>

#include "tandem/common/error.hpp"

namespace tandem {
namespace {

using T = ExtentTerm;
constexpr T dimT(int d) { return {T::Kind::kDim, static_cast<uint8_t>(d), 1}; }
constexpr T shardT(int d) { return {T::Kind::kShard, static_cast<uint8_t>(d), 1}; }
constexpr T perRankT(int d) { return {T::Kind::kPerRank, static_cast<uint8_t>(d), 1}; }
constexpr T nranksT() { return {T::Kind::kNranks, 0, 1}; }
constexpr T constT(uint32_t v) { return {T::Kind::kConst, 0, v}; }
constexpr T blocksT(int d, uint32_t block = static_cast<uint32_t>(kFp8ScaleBlock)) {
  return {T::Kind::kBlocks, static_cast<uint8_t>(d), block};
}

constexpr std::string_view kOutDtypeValues =
    "0 (dtype's), TANDEM_DTYPE_FP32 (1), TANDEM_DTYPE_FP16 (2) or TANDEM_DTYPE_BF16 (3)";

struct Builder {
  OpSpec s;
  Builder(OpKind kind, std::string_view name, std::string_view cFunction, std::string_view summary) {
    s.kind = kind;
    s.name = name;
    s.cFunction = cFunction;
    s.summary = summary;
  }
  Builder& dim(std::string_view name, std::string_view cli, DimSplit split = DimSplit::kGlobal, bool mayBeZero = false) {
    DimSpec& ds = s.dims[s.dimCount++];
    ds.name = name;
    ds.cli = cli;
    ds.split = split;
    ds.mayBeZero = mayBeZero;
    return *this;
  }
  // The last dim, when a C caller passes 0 (or predates it), is dim `other`'s value.
  Builder& zeroMeans(int other) {
    s.dims[s.dimCount - 1U].zeroMeans = static_cast<int8_t>(other);
    return *this;
  }
  Builder& slot(std::string_view name, ElementType type, std::initializer_list<T> terms, std::string_view shape,
                bool output = false, bool optional = false) {
    SlotSpec& sl = s.slots[s.slotCount++];
    sl.name = name;
    sl.type = type;
    for (const T& t : terms) sl.terms[sl.termCount++] = t;
    sl.shape = shape;
    sl.output = output;
    sl.optional = optional;
    return *this;
  }
  Builder& untyped() {
    s.typed = false;
    return *this;
  }
  Builder& scale() {
    s.scale = true;
    return *this;
  }
  Builder& crossNode(CrossNode c, int slot = -1) {
    s.crossNode = c;
    s.crossSlot = static_cast<int8_t>(slot);
    return *this;
  }
  Builder& check(void (*f)(const OpDescriptor&)) {
    s.checkDims = f;
    return *this;
  }
  Builder& checkSlots(void (*f)(const OpDescriptor&)) {
    s.checkSlots = f;
    return *this;
  }
  // The last slot's axes, as Python shapes it (SlotSpec::axes).
  Builder& axes(std::array<uint8_t, 4> a) {
    s.slots[s.slotCount - 1U].axes = a;
    return *this;
  }
  // The last slot is a GEMM operand the layout flag may transpose (SlotSpec::operand).
  Builder& operand(SlotSpec::Operand o, std::string_view shapeTransposed) {
    SlotSpec& sl = s.slots[s.slotCount - 1U];
    sl.operand = o;
    sl.shapeTransposed = shapeTransposed;
    return *this;
  }
  // A flag field of the C struct: `name` fills flag bits [bit, bit + bits). An enum (values non-empty) takes
  // 0..maxValue, named by `values` in messages; otherwise a boolean int sets the one bit.
  Builder& flagField(std::string_view name, uint8_t bit, uint8_t bits = 1, uint8_t maxValue = 1,
                     std::string_view values = {}) {
    flagFields_[flagFieldCount_++] = CField{CField::Kind::kFlag, bit, name, !values.empty(), bits, maxValue, values};
    for (uint8_t b = 0; b < bits; ++b) s.flags = static_cast<uint16_t>(s.flags | (1U << (bit + b)));
    return *this;
  }
  // The last slot is an FP8 scale (SlotSpec::fp8Scale).
  Builder& fp8Scale() {
    s.slots[s.slotCount - 1U].fp8Scale = true;
    return *this;
  }
  // The op takes FP8 inputs: its out_dtype and scaling fields (flags bits 4-5 and 6).
  Builder& fp8() {
    s.fp8 = true;
    return flagField("out_dtype", kGemmOutDtypeShift, 2, 3, kOutDtypeValues)
        .flagField("scaling", 6, 1, 1, "TANDEM_FP8_SCALE_TENSOR (0) or TANDEM_FP8_SCALE_BLOCK (1)");
  }
  // The op's weights may be e4m3 (OpSpec::fp8Weights): its w_dtype field (flags bits 7-9, a tandem_dtype_t; the values
  // other than 0, dtype and e4m3 are refused by the op's check with the reason).
  Builder& fp8Weights() {
    s.fp8Weights = true;
    return flagField("w_dtype", kMoeWeightDtypeShift, 3, 7, "0 (dtype's) or TANDEM_DTYPE_FP8_E4M3 (5)");
  }
  Builder& readsVerdict() {
    s.readsVerdict = true;
    return *this;
  }
  Builder& deviceError(ErrorCode e) {
    s.deviceError = e;
    return *this;
  }
  // The cuda backend does not run the op yet: `why` says what its GPU implementation needs (OpSpec::cudaPending).
  Builder& cudaPending(std::string_view why) {
    s.cudaPending = why;
    return *this;
  }
  // The C argument struct and the Python method; `fields` names the struct's fields after struct_size in tandem.h's
  // order, each resolved against the entry: "dtype", "cuda_stream", "scale", a flag's field ("causal", "layout"), a
  // dim or a slot. Call it after the dims and slots.
  Builder& c(std::string_view cStruct, std::string_view pyName, std::string_view fields,
             std::string_view cArgsFunction = {}) {
    s.cStruct = cStruct;
    s.cArgsFunction = cArgsFunction.empty() ? s.cFunction : cArgsFunction;
    s.pyName = pyName;
    while (!fields.empty()) {
      const std::size_t space = fields.find(' ');
      const std::string_view f = fields.substr(0, space);
      fields = space == std::string_view::npos ? std::string_view{} : fields.substr(space + 1);
      s.cFields[s.cFieldCount++] = resolve(f);
    }
    return *this;
  }

 private:
  CField resolve(std::string_view f) const {
    using K = CField::Kind;
    const auto plain = [f](K kind, uint8_t index) {
      CField c;
      c.kind = kind;
      c.index = index;
      c.name = f;
      return c;
    };
    if (f == "dtype") return plain(K::kDtype, 0);
    if (f == "cuda_stream") return plain(K::kStream, 0);
    if (f == "scale") return plain(K::kScale, 0);
    for (uint8_t i = 0; i < flagFieldCount_; ++i) {
      if (flagFields_[i].name == f) return flagFields_[i];
    }
    for (uint8_t i = 0; i < s.dimCount; ++i) {
      if (s.dims[i].name == f) return plain(K::kDim, i);
    }
    for (uint8_t i = 0; i < s.slotCount; ++i) {
      if (s.slots[i].name == f) return plain(K::kTensor, i);
    }
    fail(ErrorCode::kInternal, "op table: {}'s C field {} is no dim, slot or known field", s.name, f);
  }
  std::array<CField, 4> flagFields_{};
  uint8_t flagFieldCount_ = 0;
};

// tandem_gemm_layout_t, in flags bits 2-3 (descriptor.hpp's GemmOperands).
constexpr std::string_view kGemmLayoutValues = "TANDEM_GEMM_NT (0), TANDEM_GEMM_NN (1) or TANDEM_GEMM_TN (2)";

void checkAttention(const OpDescriptor& d) {
  const uint64_t heads = d.dims[dim::kHeads], kvHeads = d.dims[dim::kKvHeads];
  if (heads % kvHeads != 0) {
    fail(ErrorCode::kInvalidArgument,
         "{}: kv_heads {} does not divide heads {}; pass a kv_heads that divides heads (grouped-query attention: each "
         "KV head serves heads / kv_heads query heads), or kv_heads = heads",
         opKindName(d.kind), kvHeads, heads);
  }
}

void checkMoe(const OpDescriptor& d) {
  const std::string_view kind = opKindName(d.kind);
  const uint64_t experts = d.dims[dim::kExperts], topk = d.dims[dim::kTopk];
  if (experts % d.nranks != 0) {
    fail(ErrorCode::kInvalidArgument,
         "{}: experts {} is not divisible by nranks {}; experts are spread evenly over ranks", kind, experts, d.nranks);
  }
  if (topk > experts) {
    fail(ErrorCode::kInvalidArgument,
         "{}: topk {} exceeds experts {}; a token picks topk distinct experts, so pass topk <= experts", kind, topk,
         experts);
  }
}

// The MoE FFN ops' saved gate|up: an optional slot whose presence must agree with saved_rows (which sizes it), so a
// tensor passed with saved_rows 0 is not silently ignored, nor saved_rows given without the tensor.
void checkMoeSaved(const OpDescriptor& d) {
  const std::string_view kind = opKindName(d.kind);
  const int saved = d.kind == OpKind::kMoeFfnBackward ? slot::kMoeBwdSaved : slot::kFfnSaved;
  const bool given = d.bufs[static_cast<std::size_t>(saved)].bufferId != 0;
  if (d.dims[dim::kSavedRows] == 0 && given) {
    fail(ErrorCode::kInvalidArgument,
         "{}: saved is given but saved_rows is 0; pass saved_rows = the rows saved holds (this rank's routed rows, at "
         "most nranks * tokens * topk), or no saved tensor to recompute gate|up in the backward",
         kind);
  }
  if (d.dims[dim::kSavedRows] != 0 && !given) {
    fail(ErrorCode::kInvalidArgument,
         "{}: saved_rows is {} but saved is absent; pass saved [saved_rows, 2*ffn] ({}), or saved_rows 0", kind,
         d.dims[dim::kSavedRows],
         d.kind == OpKind::kMoeFfnBackward ? "the tensor the forward filled" : "the forward writes it");
  }
}

// The MoE ops with FP8 weights (moe-dispatch-gemm, moe-dispatch-ffn-combine): checkMoe, and the weights' dtype
// (w_dtype): e4m3 weights need bf16 x and out; the FFN's also no saved activations (FP8 weights have no backward).
void checkMoeFp8Weights(const OpDescriptor& d) {
  checkMoe(d);
  const std::string_view kind = opKindName(d.kind);
  const bool ffn = d.kind == OpKind::kMoeDispatchFfnCombine;
  const DType w = moeWeightDtype(d.dtype, d.flags);
  if (w == d.dtype) return;
  if (w == DType::kF8E5M2) {
    fail(ErrorCode::kInvalidArgument,
         "{}: w_dtype is fp8-e5m2; {} FP8 weights are e4m3 (e5m2 is for gradients), so pass w_dtype "
         "TANDEM_DTYPE_FP8_E4M3 (5)", kind, ffn ? "the FFN's" : "the experts'");
  }
  if (w != DType::kF8E4M3) {
    fail(ErrorCode::kInvalidArgument,
         "{}: w_dtype is {} but dtype is {}; {} in dtype (w_dtype 0) or e4m3 with block scales (w_dtype "
         "TANDEM_DTYPE_FP8_E4M3, 5)", kind, dtypeName(w), dtypeName(d.dtype), ffn ? "w1 and w2 are" : "w is");
  }
  if (d.dtype != DType::kBF16) {
    fail(ErrorCode::kInvalidArgument,
         "{}: w_dtype fp8-e4m3 needs dtype bf16 (x and out), not {}; pass dtype TANDEM_DTYPE_BF16 (3)", kind,
         dtypeName(d.dtype));
  }
  if (ffn && d.dims[dim::kSavedRows] != 0) {
    fail(ErrorCode::kInvalidArgument,
         "{}: saved activations are for the backward, which FP8 weights do not have; pass saved_rows 0 (no saved) "
         "with w_dtype fp8-e4m3, or bf16 weights to train",
         kind);
  }
}

constexpr auto D = ElementType::kOpDtype;
constexpr auto I32 = ElementType::kI32;
constexpr auto F32 = ElementType::kF32;
constexpr auto Raw = ElementType::kRaw;
constexpr auto Out = ElementType::kOutDtype;
constexpr auto W = ElementType::kWeightDtype;

std::array<OpSpec, kOpKindCount - 1> buildTable() {
  using enum DimSplit;
  namespace d = dim;
  std::array<OpSpec, kOpKindCount - 1> t{};
  auto put = [&t](const Builder& b) { t[static_cast<std::size_t>(b.s.kind) - 1] = b.s; };

  using Op = SlotSpec::Operand;
  put(Builder(OpKind::kAgGemm, "ag-gemm", "tandem_ag_gemm",
              "AllGather + GEMM: A sharded by rows, C = gather(A) * B^T (or * B, A^T * B by layout)")
          .dim("m", "m").dim("n", "n").dim("k", "k")
          .slot("a", D, {shardT(d::kM), dimT(d::kK)}, "this rank's shard [rows_of(m, rank, nranks), k]")
          .operand(Op::kA, "this rank's shard [k, rows_of(m, rank, nranks)] (layout TN)")
          .slot("b", D, {dimT(d::kN), dimT(d::kK)}, "[n, k]")
          .operand(Op::kB, "[k, n] (layout NN or TN)")
          .slot("c", Out, {dimT(d::kM), dimT(d::kN)}, "[m, n]", true)
          .slot("a_gathered", D, {dimT(d::kM), dimT(d::kK)}, "[m, k] (layout TN: the shards [k, rows] in rank order)",
                true, true)
          .slot("a_scale", F32, {blocksT(d::kK), shardT(d::kM)},
                "fp32 [1] (per tensor) or [ceil(k/128), rows_of(m, rank, nranks)] (block)")
          .fp8Scale()
          .slot("b_scale", F32, {blocksT(d::kN), blocksT(d::kK)}, "fp32 [1] (per tensor) or [ceil(n/128), ceil(k/128)] "
                "(block)")
          .fp8Scale()
          .flagField("layout", kGemmLayoutShift, 2, 2, kGemmLayoutValues)
          .fp8()
          .crossNode(CrossNode::kGather, slot::kA)
          .deviceError(ErrorCode::kTimeout)
          // layout comes after cuda_stream: it was appended to the struct after 0.2.x; the FP8 fields after it later.
          .c("tandem_ag_gemm_args_t", "ag_gemm",
             "dtype m n k a b c a_gathered cuda_stream layout out_dtype scaling a_scale b_scale"));
  for (const bool ar : {false, true}) {
    Builder b(ar ? OpKind::kGemmAr : OpKind::kGemmRs, ar ? "gemm-ar" : "gemm-rs",
              ar ? "tandem_gemm_ar" : "tandem_gemm_rs",
              ar ? "GEMM + AllReduce: K split over ranks, every rank gets the sum"
                 : "GEMM + ReduceScatter: K split over ranks, rank r gets its rows of the sum");
    b.dim("m", "m").dim("n", "n").dim("k", "k", kSplit)
        .slot("a", D, {dimT(d::kM), dimT(d::kK)}, "[m, k] (k: this rank's slice)")
        .operand(Op::kA, "[k, m] (layout TN; k: this rank's slice)")
        .slot("b", D, {dimT(d::kN), dimT(d::kK)}, "[n, k] (k: this rank's slice)")
        .operand(Op::kB, "[k, n] (layout NN or TN; k: this rank's slice)")
        .flagField("layout", kGemmLayoutShift, 2, 2, kGemmLayoutValues);
    if (ar) {
      b.slot("c", Out, {dimT(d::kM), dimT(d::kN)}, "[m, n]", true).crossNode(CrossNode::kAllReduce, slot::kC);
    } else {
      b.slot("c", Out, {shardT(d::kM), dimT(d::kN)}, "this rank's rows [rows_of(m, rank, nranks), n]", true)
          .crossNode(CrossNode::kReduceScatter, slot::kC);
    }
    b.slot("a_scale", F32, {blocksT(d::kK), dimT(d::kM)}, "fp32 [1] (per tensor) or [ceil(k/128), m] (block; k: this "
           "rank's slice)")
        .fp8Scale()
        .slot("b_scale", F32, {blocksT(d::kN), blocksT(d::kK)}, "fp32 [1] (per tensor) or [ceil(n/128), ceil(k/128)] "
              "(block; k: this rank's slice)")
        .fp8Scale()
        .fp8()
        .deviceError(ErrorCode::kTimeout)
        .c(ar ? "tandem_gemm_ar_args_t" : "tandem_gemm_rs_args_t", ar ? "gemm_ar" : "gemm_rs",
           "dtype m n k a b c cuda_stream layout out_dtype scaling a_scale b_scale");
    put(b);
  }
  // MoE: tandemctl's --m is tokens per rank, --k the hidden size and --n the output (or ffn) width.
  put(Builder(OpKind::kMoeDispatchGemm, "moe-dispatch-gemm", "tandem_moe_dispatch_gemm",
              "MoE dispatch + grouped GEMM: tokens routed top-k to the experts' ranks and multiplied there")
          .dim("tokens", "m", kPerRank, true).dim("hidden", "k").dim("n_out", "n").dim("experts", "experts")
          .dim("topk", "topk").dim("capacity", "", kCapacity)
          .slot("x", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]")
          .slot("topk_ids", I32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] int32")
          .slot("topk_weights", F32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] fp32")
          .slot("w", W, {perRankT(d::kExperts), dimT(d::kNOut), dimT(d::kHidden)},
                "[experts/nranks, n_out, hidden] (w_dtype)")
          .slot("out", D, {dimT(d::kCapacity), dimT(d::kNOut)}, "[capacity, n_out]", true)
          .slot("row_info", I32, {dimT(d::kCapacity), constT(4)}, "[capacity, 4] int32", true)
          .slot("expert_counts", I32, {perRankT(d::kExperts)}, "[experts/nranks] int32", true)
          // FP8 weights' block scales (slot::kMoeWScale), after the other slots.
          .slot("w_scale", F32, {perRankT(d::kExperts), blocksT(d::kNOut), blocksT(d::kHidden)},
                "fp32 [experts/nranks, ceil(n_out/128), ceil(hidden/128)] (FP8 w_dtype only)")
          .fp8Scale()
          .fp8Weights()
          .crossNode(CrossNode::kReplicate)
          .check(checkMoeFp8Weights)
          .readsVerdict()
          .deviceError(ErrorCode::kTimeout)
          // w_dtype and w_scale come after cuda_stream: they were appended to the struct after 0.2.x.
          .c("tandem_moe_dispatch_gemm_args_t", "moe_dispatch_gemm",
             "dtype tokens hidden n_out experts topk capacity x topk_ids topk_weights w out row_info expert_counts "
             "cuda_stream w_dtype w_scale"));
  put(Builder(OpKind::kMoeDispatchFfnCombine, "moe-dispatch-ffn-combine", "tandem_moe_dispatch_ffn_combine",
              "MoE layer: dispatch, SwiGLU FFN on the experts' ranks, weighted combine back in token order")
          .dim("tokens", "m", kPerRank, true).dim("hidden", "k").dim("ffn", "n").dim("experts", "experts")
          .dim("topk", "topk").dim("saved_rows", "saved-rows", kPerRank, true)
          .slot("x", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]")
          .slot("topk_ids", I32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] int32")
          .slot("topk_weights", F32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] fp32")
          .slot("w1", W, {perRankT(d::kExperts), constT(2), dimT(d::kFfn), dimT(d::kHidden)},
                "[experts/nranks, 2*ffn, hidden] (w_dtype)")
          .axes({1, 2, 1, 0})
          .slot("w2", W, {perRankT(d::kExperts), dimT(d::kHidden), dimT(d::kFfn)},
                "[experts/nranks, hidden, ffn] (w_dtype)")
          .slot("out", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]", true)
          .slot("saved", D, {dimT(d::kSavedRows), constT(2), dimT(d::kFfn)}, "[saved_rows, 2*ffn]", true, true)
          .axes({1, 2, 0, 0})
          // FP8 weights' block scales (slot::kFfnW1Scale, kFfnW2Scale): ceil(2*ffn/128) is ceil(ffn/64).
          .slot("w1_scale", F32, {perRankT(d::kExperts), blocksT(d::kFfn, 64), blocksT(d::kHidden)},
                "fp32 [experts/nranks, ceil(2*ffn/128), ceil(hidden/128)] (FP8 w_dtype only)")
          .fp8Scale()
          .slot("w2_scale", F32, {perRankT(d::kExperts), blocksT(d::kHidden), blocksT(d::kFfn)},
                "fp32 [experts/nranks, ceil(hidden/128), ceil(ffn/128)] (FP8 w_dtype only)")
          .fp8Scale()
          .fp8Weights()
          .crossNode(CrossNode::kReplicate)
          .check(checkMoeFp8Weights)
          .checkSlots(checkMoeSaved)
          .readsVerdict()
          .deviceError(ErrorCode::kTimeout)
          // saved_rows and saved, then w_dtype and the scales, come after cuda_stream: they were appended to the
          // struct after 0.2.x, in that order.
          .c("tandem_moe_ffn_args_t", "moe_ffn",
             "dtype tokens hidden ffn experts topk x topk_ids topk_weights w1 w2 out cuda_stream saved_rows saved "
             "w_dtype w1_scale w2_scale"));
  {
    const std::initializer_list<T> qkv{dimT(d::kSeq), dimT(d::kHeads), dimT(d::kHeadDim)};
    const std::initializer_list<T> kv{dimT(d::kSeq), dimT(d::kKvHeads), dimT(d::kHeadDim)};
    put(Builder(OpKind::kRingAttention, "ring-attention", "tandem_ring_attention",
                "Ring attention: the sequence sharded in rank order, softmax(q K^T * scale) V over all of it")
            .dim("seq", "seq", kSplit, true).dim("heads", "heads").dim("head_dim", "head-dim")
            .dim("kv_heads", "kv-heads").zeroMeans(d::kHeads)
            .slot("q", D, qkv, "[seq, heads, head_dim]")
            .slot("k", D, kv, "[seq, kv_heads, head_dim]")
            .slot("v", D, kv, "[seq, kv_heads, head_dim]")
            .slot("out", D, qkv, "[seq, heads, head_dim]", true)
            .slot("lse", F32, {dimT(d::kHeads), dimT(d::kSeq)}, "[heads, seq] fp32", true, true)
            .flagField("causal", 0)
            .flagField("layout", 1, 1, 1, "TANDEM_ATTENTION_CONTIGUOUS (0) or TANDEM_ATTENTION_ZIGZAG (1)")
            .scale()
            .crossNode(CrossNode::kReplicate)
            .deviceError(ErrorCode::kTimeout)
            .check(checkAttention)
            // lse and layout come after cuda_stream: they were appended to the struct in tandem 0.2.x; kv_heads
            // after 0.2.x.
            .c("tandem_ring_attention_args_t", "ring_attention",
               "dtype seq heads head_dim causal scale q k v out cuda_stream lse layout kv_heads"));
  }
  {
    const std::initializer_list<T> qkv{dimT(d::kSeq), dimT(d::kHeads), dimT(d::kHeadDim)};
    const std::initializer_list<T> kv{dimT(d::kSeq), dimT(d::kKvHeads), dimT(d::kHeadDim)};
    put(Builder(OpKind::kRingAttentionBackward, "ring-attention-backward", "tandem_ring_attention_backward",
                "Ring attention's backward: dq, dk and dv of the ring attention forward, from its out and lse")
            .dim("seq", "seq", kSplit, true).dim("heads", "heads").dim("head_dim", "head-dim")
            .dim("kv_heads", "kv-heads").zeroMeans(d::kHeads)
            .slot("q", D, qkv, "[seq, heads, head_dim]")
            .slot("k", D, kv, "[seq, kv_heads, head_dim]")
            .slot("v", D, kv, "[seq, kv_heads, head_dim]")
            .slot("o", D, qkv, "the forward's out [seq, heads, head_dim]")
            .slot("dout", D, qkv, "the gradient of out [seq, heads, head_dim]")
            .slot("lse", F32, {dimT(d::kHeads), dimT(d::kSeq)}, "the forward's lse [heads, seq] fp32")
            .slot("dq", D, qkv, "[seq, heads, head_dim]", true)
            .slot("dk", D, kv, "[seq, kv_heads, head_dim]", true)
            .slot("dv", D, kv, "[seq, kv_heads, head_dim]", true)
            .flagField("causal", 0)
            .flagField("layout", 1, 1, 1, "TANDEM_ATTENTION_CONTIGUOUS (0) or TANDEM_ATTENTION_ZIGZAG (1)")
            .scale()
            .crossNode(CrossNode::kReplicate)
            .check(checkAttention)
            .deviceError(ErrorCode::kTimeout)
            .c("tandem_ring_attention_backward_args_t", "ring_attention_backward",
               "dtype seq heads head_dim kv_heads causal layout scale q k v o dout lse dq dk dv cuda_stream"));
  }
  put(Builder(OpKind::kMoeFfnBackward, "moe-ffn-backward", "tandem_moe_dispatch_ffn_combine_backward",
              "MoE layer's backward: dx, dtopk_weights, dw1 and dw2 of moe-dispatch-ffn-combine, the experts' "
              "gate|up saved by the forward or recomputed")
          .dim("tokens", "m", kPerRank, true).dim("hidden", "k").dim("ffn", "n").dim("experts", "experts")
          .dim("topk", "topk").dim("saved_rows", "saved-rows", kPerRank, true)
          .slot("x", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]")
          .slot("topk_ids", I32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] int32")
          .slot("topk_weights", F32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] fp32")
          .slot("w1", D, {perRankT(d::kExperts), constT(2), dimT(d::kFfn), dimT(d::kHidden)},
                "[experts/nranks, 2*ffn, hidden]")
          .axes({1, 2, 1, 0})
          .slot("w2", D, {perRankT(d::kExperts), dimT(d::kHidden), dimT(d::kFfn)}, "[experts/nranks, hidden, ffn]")
          .slot("dout", D, {dimT(d::kTokens), dimT(d::kHidden)}, "the gradient of out [tokens, hidden]")
          .slot("dx", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]", true)
          .slot("dtopk_weights", F32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] fp32", true)
          .slot("dw1", D, {perRankT(d::kExperts), constT(2), dimT(d::kFfn), dimT(d::kHidden)},
                "[experts/nranks, 2*ffn, hidden]", true)
          .axes({1, 2, 1, 0})
          .slot("dw2", D, {perRankT(d::kExperts), dimT(d::kHidden), dimT(d::kFfn)}, "[experts/nranks, hidden, ffn]",
                true)
          .slot("saved", D, {dimT(d::kSavedRows), constT(2), dimT(d::kFfn)},
                "the forward's saved gate|up [saved_rows, 2*ffn]", false, true)
          .axes({1, 2, 0, 0})
          .crossNode(CrossNode::kReplicate)
          .check(checkMoe)
          .checkSlots(checkMoeSaved)
          .readsVerdict()
          .deviceError(ErrorCode::kTimeout)
          // saved_rows and saved come after cuda_stream: they were appended to the struct after 0.2.x.
          .c("tandem_moe_ffn_backward_args_t", "moe_ffn_backward",
             "dtype tokens hidden ffn experts topk x topk_ids topk_weights w1 w2 dout dx dtopk_weights dw1 dw2 "
             "cuda_stream saved_rows saved"));
  put(Builder(OpKind::kAllGather, "allgather", "tandem_allgather", "AllGather of raw bytes, in rank order")
          .dim("bytes", "bytes")
          .slot("send", Raw, {dimT(d::kBytes)}, "[bytes]")
          .slot("recv", Raw, {nranksT(), dimT(d::kBytes)}, "[nranks * bytes]", true)
          .untyped()
          .crossNode(CrossNode::kGather, slot::kSend)
          .readsVerdict()
          .deviceError(ErrorCode::kTimeout)
          .c("tandem_allgather_args_t", "allgather", "send recv bytes cuda_stream"));
  // tandem_barrier(comm, op) takes no argument struct; tandem_barrier_stream is its form with one.
  put(Builder(OpKind::kNop, "barrier", "tandem_barrier", "Barrier: completes once every rank has submitted it")
          .untyped()
          .c("tandem_barrier_args_t", "barrier", "cuda_stream", "tandem_barrier_stream"));
  return t;
}

const std::array<OpSpec, kOpKindCount - 1>& table() {
  static const std::array<OpSpec, kOpKindCount - 1> t = buildTable();
  return t;
}

}  // namespace

std::span<const OpSpec> ops() { return table(); }

bool knownOp(OpKind kind) {
  const auto v = static_cast<uint16_t>(kind);
  return v >= 1 && v < kOpKindCount;
}

const OpSpec& opSpec(OpKind kind) {
  if (!knownOp(kind)) {
    fail(ErrorCode::kInvalidArgument, "descriptor: op kind {} is unknown; valid kinds are 1..{} ({}..{})",
         static_cast<uint16_t>(kind), kOpKindCount - 1, table().front().name, table().back().name);
  }
  return table()[static_cast<std::size_t>(kind) - 1];
}

const OpSpec* findOp(std::string_view name) {
  for (const OpSpec& s : table()) {
    if (s.name == name) return &s;
  }
  return name == "nop" ? &table()[static_cast<std::size_t>(OpKind::kNop) - 1] : nullptr;
}

Fp8ScaleShape fp8ScaleShape(const OpSpec& spec, const OpDescriptor& d) {
  if (spec.fp8Weights) return isFp8(moeWeightDtype(d.dtype, d.flags)) ? Fp8ScaleShape::kBlock : Fp8ScaleShape::kNone;
  if (!spec.fp8 || !isFp8(d.dtype)) return Fp8ScaleShape::kNone;
  return (d.flags & kFlagFp8BlockScale) != 0 ? Fp8ScaleShape::kBlock : Fp8ScaleShape::kTensor;
}

bool slotTransposed(const SlotSpec& s, uint16_t flags) {
  switch (s.operand) {
    case SlotSpec::Operand::kA: return aTransposed(gemmOperandsOf(flags));
    case SlotSpec::Operand::kB: return !bKMajor(gemmOperandsOf(flags));
    case SlotSpec::Operand::kNone: return false;
  }
  return false;
}

DType slotDtype(const SlotSpec& s, const OpDescriptor& d) {
  switch (s.type) {
    case ElementType::kOpDtype: return d.dtype;
    case ElementType::kOutDtype: return gemmOutDtype(d.dtype, d.flags);
    case ElementType::kWeightDtype: return moeWeightDtype(d.dtype, d.flags);
    case ElementType::kI32: return DType::kI32;
    case ElementType::kF32: return DType::kF32;
    case ElementType::kRaw: break;
  }
  return DType::kInvalid;
}

std::size_t slotElementSize(const SlotSpec& s, const OpDescriptor& d) {
  return s.type == ElementType::kRaw ? 1 : dtypeSize(slotDtype(s, d));
}

std::size_t elementSize(ElementType type, DType dtype) {
  switch (type) {
    case ElementType::kOpDtype:
    case ElementType::kOutDtype:
    case ElementType::kWeightDtype: return dtypeSize(dtype);
    case ElementType::kI32:
    case ElementType::kF32: return 4;
    case ElementType::kRaw: return 1;
  }
  return 0;
}

uint64_t slotElements(const OpSpec& spec, int s, const OpDescriptor& d, bool* overflow) {
  const SlotSpec& sl = spec.slots[static_cast<std::size_t>(s)];
  if (overflow != nullptr) *overflow = false;
  if (sl.fp8Scale && fp8ScaleShape(spec, d) != Fp8ScaleShape::kBlock) {
    return fp8ScaleShape(spec, d) == Fp8ScaleShape::kTensor ? 1 : 0;
  }
  uint64_t n = 1;
  bool over = false;
  for (int i = 0; i < sl.termCount; ++i) {
    const ExtentTerm& t = sl.terms[static_cast<std::size_t>(i)];
    uint64_t v = 0;
    switch (t.kind) {
      case ExtentTerm::Kind::kDim: v = d.dims[t.dim]; break;
      case ExtentTerm::Kind::kShard: v = d.nranks == 0 ? 0 : rowsOf(d.dims[t.dim], d.rank, d.nranks); break;
      case ExtentTerm::Kind::kPerRank: v = d.nranks == 0 ? 0 : d.dims[t.dim] / d.nranks; break;
      case ExtentTerm::Kind::kNranks: v = d.nranks; break;
      case ExtentTerm::Kind::kConst: v = t.value; break;
      case ExtentTerm::Kind::kBlocks: v = (d.dims[t.dim] + t.value - 1) / t.value; break;
    }
    over |= __builtin_mul_overflow(n, v, &n);
  }
  if (overflow != nullptr) *overflow = over;
  return n;
}

OpSet OpSet::all() {
  OpSet s;
  for (const OpSpec& o : table()) s.add(o.kind);
  return s;
}

std::size_t cFieldBytes(CField::Kind kind) {
  switch (kind) {
    case CField::Kind::kDtype:
    case CField::Kind::kFlag:
    case CField::Kind::kScale: return 4;
    case CField::Kind::kDim:
    case CField::Kind::kStream: return 8;  // uint64_t dims and pointers
    case CField::Kind::kTensor: return 16;  // tandem_tensor_t: a pointer-aligned handle and offset
  }
  return 8;
}

CArgsLayout cArgsLayout(const OpSpec& spec) {
  CArgsLayout l;
  std::size_t at = sizeof(uint64_t);  // size_t struct_size
  std::size_t align = alignof(uint64_t);
  for (int i = 0; i < spec.cFieldCount; ++i) {
    const std::size_t size = cFieldBytes(spec.cFields[static_cast<std::size_t>(i)].kind);
    const std::size_t fieldAlign = size == 4 ? 4 : 8;
    at = (at + fieldAlign - 1) / fieldAlign * fieldAlign;
    l.offsets[static_cast<std::size_t>(i)] = static_cast<uint16_t>(at);
    at += size;
  }
  l.size = static_cast<uint16_t>((at + align - 1) / align * align);
  return l;
}

std::string opTableJson() {
  using nlohmann::json;
  static constexpr std::array<const char*, 6> kFieldKinds{"dtype", "dim", "flag", "scale", "tensor", "stream"};
  static constexpr std::array<const char*, 6> kElementTypes{"op_dtype", "i32", "f32", "raw", "out_dtype", "w_dtype"};
  static constexpr std::array<const char*, 6> kTermKinds{"dim", "shard", "per_rank", "nranks", "const", "blocks"};
  static constexpr std::array<const char*, 4> kSplits{"global", "split", "per_rank", "capacity"};
  static constexpr std::array<const char*, 5> kCross{"none", "gather", "reduce_scatter", "all_reduce", "replicate"};
  json ops = json::array();
  for (const OpSpec& op : table()) {
    json dims = json::array();
    for (int d = 0; d < op.dimCount; ++d) {
      const DimSpec& ds = op.dims[static_cast<std::size_t>(d)];
      dims.push_back({{"name", ds.name}, {"cli", ds.cli}, {"split", kSplits[static_cast<std::size_t>(ds.split)]},
                      {"may_be_zero", ds.mayBeZero}, {"zero_means", ds.zeroMeans}});
    }
    json slots = json::array();
    for (int s = 0; s < op.slotCount; ++s) {
      const SlotSpec& sl = op.slots[static_cast<std::size_t>(s)];
      json terms = json::array();
      for (int t = 0; t < sl.termCount; ++t) {
        const ExtentTerm& term = sl.terms[static_cast<std::size_t>(t)];
        terms.push_back({{"kind", kTermKinds[static_cast<std::size_t>(term.kind)]}, {"dim", term.dim},
                         {"value", term.value}});
      }
      json axes = json::array();
      for (uint8_t a : sl.axes) {
        if (a != 0) axes.push_back(a);
      }
      if (axes.empty()) axes = json(std::vector<int>(sl.termCount, 1));
      slots.push_back({{"name", sl.name}, {"type", kElementTypes[static_cast<std::size_t>(sl.type)]},
                       {"terms", terms}, {"axes", axes}, {"shape", sl.shape}, {"output", sl.output},
                       {"optional", sl.optional},
                       {"operand", sl.operand == SlotSpec::Operand::kA   ? "a"
                                   : sl.operand == SlotSpec::Operand::kB ? "b"
                                                                         : ""},
                       {"shape_transposed", sl.shapeTransposed}, {"fp8_scale", sl.fp8Scale}});
    }
    const CArgsLayout layout = cArgsLayout(op);
    json fields = json::array();
    for (int f = 0; f < op.cFieldCount; ++f) {
      const CField& cf = op.cFields[static_cast<std::size_t>(f)];
      fields.push_back({{"name", cf.name}, {"kind", kFieldKinds[static_cast<std::size_t>(cf.kind)]},
                        {"index", cf.index}, {"offset", layout.offsets[static_cast<std::size_t>(f)]},
                        {"enum", cf.isEnum}, {"bits", cf.bits}, {"max", cf.maxValue}, {"values", cf.values}});
    }
    ops.push_back({{"kind", static_cast<int>(op.kind)}, {"name", op.name}, {"py_name", op.pyName},
                   {"c_function", op.cArgsFunction}, {"c_struct", op.cStruct}, {"struct_size", layout.size},
                   {"summary", op.summary}, {"typed", op.typed}, {"fp8", op.fp8}, {"fp8_weights", op.fp8Weights},
                   {"flags", op.flags},
                   {"scale", op.scale},
                   {"cross_node", kCross[static_cast<std::size_t>(op.crossNode)]}, {"cross_slot", op.crossSlot},
                   {"reads_verdict", op.readsVerdict}, {"device_error", static_cast<int>(op.deviceError)},
                   {"cuda_pending", op.cudaPending},
                   {"dims", dims}, {"slots", slots}, {"fields", fields}});
  }
  return json{{"version", 1}, {"ops", ops}}.dump();
}

uint64_t slotBytes(const OpSpec& spec, int s, const OpDescriptor& d) {
  return slotElements(spec, s, d, nullptr) * slotElementSize(spec.slots[static_cast<std::size_t>(s)], d);
}

uint64_t crossNodeBytes(std::span<const OpDescriptor* const> ranks, std::span<const uint32_t> nodeOf, uint32_t from,
                        uint32_t to) {
  const OpSpec& op = opSpec(ranks[0]->kind);
  // fp32 partial sums of the cross slot, as rank d.rank owns them.
  auto floats = [&](const OpDescriptor& d) { return slotElements(op, op.crossSlot, d, nullptr) * sizeof(float); };
  uint64_t bytes = 0;
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    OpDescriptor d = *ranks[r];
    d.rank = r;  // rank r's share, whatever its copy of the descriptor says
    d.nranks = static_cast<uint32_t>(ranks.size());
    switch (op.crossNode) {
      case CrossNode::kReplicate:  // every input of `from`'s ranks
        if (nodeOf[r] != from) break;
        for (int s = 0; s < op.slotCount; ++s) {
          if (!op.slots[static_cast<std::size_t>(s)].output) bytes += d.bufs[static_cast<std::size_t>(s)].bytes;
        }
        break;
      case CrossNode::kGather:  // `from`'s ranks' shares, with FP8 inputs each share's A scales too
        if (nodeOf[r] == from) {
          bytes += slotBytes(op, op.crossSlot, d);
          if (op.fp8 && isFp8(d.dtype)) bytes += slotBytes(op, gemmScaleSlot(d.kind, false), d);
        }
        break;
      case CrossNode::kReduceScatter:  // the partials of the rows `to`'s ranks own
        if (nodeOf[r] == to) bytes += floats(d);
        break;
      case CrossNode::kAllReduce:  // one partial of the whole output
        if (nodeOf[r] == from) return floats(d);
        break;
      case CrossNode::kNone: return 0;
    }
  }
  return bytes;
}

std::string unsupportedOpMessage(std::string_view backend, const OpSet& runs, OpKind kind) {
  std::string list;
  for (const OpSpec& o : table()) {
    if (runs.contains(o.kind)) list += fmt::format("{}{}", list.empty() ? "" : ", ", o.name);
  }
  const std::string_view pending = knownOp(kind) ? opSpec(kind).cudaPending : std::string_view{};
  return fmt::format("{}: the {} backend does not run this op (it runs {}){}; run it on the cpu backend "
                     "(daemon.backend: cpu), which runs every op",
                     opKindName(kind), backend, list.empty() ? std::string("none") : list,
                     pending.empty() ? std::string() : fmt::format(" and has no GPU implementation yet: {}", pending));
}

}  // namespace tandem
