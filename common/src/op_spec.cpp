// The op table. Adding an op starts here: one entry (and its OpKind value in descriptor.hpp); validation, naming,
// `tandemctl run`, the reference's and the backends' dispatch and the unsupported-op messages follow from it.
#include "tandem/common/op_spec.hpp"

#include <fmt/format.h>

#include <array>

#include "tandem/common/error.hpp"

namespace tandem {
namespace {

using T = ExtentTerm;
constexpr T dimT(int d) { return {T::Kind::kDim, static_cast<uint8_t>(d), 1}; }
constexpr T shardT(int d) { return {T::Kind::kShard, static_cast<uint8_t>(d), 1}; }
constexpr T perRankT(int d) { return {T::Kind::kPerRank, static_cast<uint8_t>(d), 1}; }
constexpr T nranksT() { return {T::Kind::kNranks, 0, 1}; }
constexpr T constT(uint32_t v) { return {T::Kind::kConst, 0, v}; }

struct Builder {
  OpSpec s;
  Builder(OpKind kind, std::string_view name, std::string_view cFunction, std::string_view summary) {
    s.kind = kind;
    s.name = name;
    s.cFunction = cFunction;
    s.summary = summary;
  }
  Builder& dim(std::string_view name, std::string_view cli, DimSplit split = DimSplit::kGlobal, bool mayBeZero = false) {
    s.dims[s.dimCount++] = DimSpec{name, cli, split, mayBeZero};
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
  Builder& flags(uint16_t f) {
    s.flags = f;
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
};

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

constexpr auto D = ElementType::kOpDtype;
constexpr auto I32 = ElementType::kI32;
constexpr auto F32 = ElementType::kF32;
constexpr auto Raw = ElementType::kRaw;

std::array<OpSpec, kOpKindCount - 1> buildTable() {
  using enum DimSplit;
  namespace d = dim;
  std::array<OpSpec, kOpKindCount - 1> t{};
  auto put = [&t](const Builder& b) { t[static_cast<std::size_t>(b.s.kind) - 1] = b.s; };

  put(Builder(OpKind::kAgGemm, "ag-gemm", "tandem_ag_gemm", "AllGather + GEMM: A sharded by rows, C = gather(A) * B^T")
          .dim("m", "m").dim("n", "n").dim("k", "k")
          .slot("a", D, {shardT(d::kM), dimT(d::kK)}, "this rank's shard [rows_of(m, rank, nranks), k]")
          .slot("b", D, {dimT(d::kN), dimT(d::kK)}, "[n, k]")
          .slot("c", D, {dimT(d::kM), dimT(d::kN)}, "[m, n]", true)
          .slot("a_gathered", D, {dimT(d::kM), dimT(d::kK)}, "[m, k]", true, true)
          .crossNode(CrossNode::kGather, slot::kA));
  for (const bool ar : {false, true}) {
    Builder b(ar ? OpKind::kGemmAr : OpKind::kGemmRs, ar ? "gemm-ar" : "gemm-rs",
              ar ? "tandem_gemm_ar" : "tandem_gemm_rs",
              ar ? "GEMM + AllReduce: K split over ranks, every rank gets the sum"
                 : "GEMM + ReduceScatter: K split over ranks, rank r gets its rows of the sum");
    b.dim("m", "m").dim("n", "n").dim("k", "k", kSplit)
        .slot("a", D, {dimT(d::kM), dimT(d::kK)}, "[m, k] (k: this rank's slice)")
        .slot("b", D, {dimT(d::kN), dimT(d::kK)}, "[n, k] (k: this rank's slice)");
    if (ar) {
      b.slot("c", D, {dimT(d::kM), dimT(d::kN)}, "[m, n]", true).crossNode(CrossNode::kAllReduce, slot::kC);
    } else {
      b.slot("c", D, {shardT(d::kM), dimT(d::kN)}, "this rank's rows [rows_of(m, rank, nranks), n]", true)
          .crossNode(CrossNode::kReduceScatter, slot::kC);
    }
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
          .slot("w", D, {perRankT(d::kExperts), dimT(d::kNOut), dimT(d::kHidden)}, "[experts/nranks, n_out, hidden]")
          .slot("out", D, {dimT(d::kCapacity), dimT(d::kNOut)}, "[capacity, n_out]", true)
          .slot("row_info", I32, {dimT(d::kCapacity), constT(4)}, "[capacity, 4] int32", true)
          .slot("expert_counts", I32, {perRankT(d::kExperts)}, "[experts/nranks] int32", true)
          .crossNode(CrossNode::kReplicate)
          .check(checkMoe));
  put(Builder(OpKind::kMoeDispatchFfnCombine, "moe-dispatch-ffn-combine", "tandem_moe_dispatch_ffn_combine",
              "MoE layer: dispatch, SwiGLU FFN on the experts' ranks, weighted combine back in token order")
          .dim("tokens", "m", kPerRank, true).dim("hidden", "k").dim("ffn", "n").dim("experts", "experts")
          .dim("topk", "topk")
          .slot("x", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]")
          .slot("topk_ids", I32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] int32")
          .slot("topk_weights", F32, {dimT(d::kTokens), dimT(d::kTopk)}, "[tokens, topk] fp32")
          .slot("w1", D, {perRankT(d::kExperts), constT(2), dimT(d::kFfn), dimT(d::kHidden)},
                "[experts/nranks, 2*ffn, hidden]")
          .slot("w2", D, {perRankT(d::kExperts), dimT(d::kHidden), dimT(d::kFfn)}, "[experts/nranks, hidden, ffn]")
          .slot("out", D, {dimT(d::kTokens), dimT(d::kHidden)}, "[tokens, hidden]", true)
          .crossNode(CrossNode::kReplicate)
          .check(checkMoe));
  {
    const std::initializer_list<T> qkv{dimT(d::kSeq), dimT(d::kHeads), dimT(d::kHeadDim)};
    put(Builder(OpKind::kRingAttention, "ring-attention", "tandem_ring_attention",
                "Ring attention: the sequence sharded in rank order, softmax(q K^T * scale) V over all of it")
            .dim("seq", "seq", kSplit, true).dim("heads", "heads").dim("head_dim", "head-dim")
            .slot("q", D, qkv, "[seq, heads, head_dim]")
            .slot("k", D, qkv, "[seq, heads, head_dim]")
            .slot("v", D, qkv, "[seq, heads, head_dim]")
            .slot("out", D, qkv, "[seq, heads, head_dim]", true)
            .slot("lse", F32, {dimT(d::kHeads), dimT(d::kSeq)}, "[heads, seq] fp32", true, true)
            .flags(kFlagCausal | kFlagZigzag)
            .scale()
            .crossNode(CrossNode::kReplicate));
  }
  put(Builder(OpKind::kAllGather, "allgather", "tandem_allgather", "AllGather of raw bytes, in rank order")
          .dim("bytes", "bytes")
          .slot("send", Raw, {dimT(d::kBytes)}, "[bytes]")
          .slot("recv", Raw, {nranksT(), dimT(d::kBytes)}, "[nranks * bytes]", true)
          .untyped()
          .crossNode(CrossNode::kGather, slot::kSend));
  put(Builder(OpKind::kNop, "barrier", "tandem_barrier", "Barrier: completes once every rank has submitted it")
          .untyped());
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

std::size_t elementSize(ElementType type, DType dtype) {
  switch (type) {
    case ElementType::kOpDtype: return dtypeSize(dtype);
    case ElementType::kI32:
    case ElementType::kF32: return 4;
    case ElementType::kRaw: return 1;
  }
  return 0;
}

uint64_t slotElements(const OpSpec& spec, int s, const OpDescriptor& d, bool* overflow) {
  const SlotSpec& sl = spec.slots[static_cast<std::size_t>(s)];
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

std::string unsupportedOpMessage(std::string_view backend, const OpSet& runs, OpKind kind) {
  std::string list;
  for (const OpSpec& o : table()) {
    if (runs.contains(o.kind)) list += fmt::format("{}{}", list.empty() ? "" : ", ", o.name);
  }
  return fmt::format("{}: the {} backend does not run this op (it runs {}); run it on the cpu backend "
                     "(daemon.backend: cpu), which runs every op",
                     opKindName(kind), backend, list.empty() ? std::string("none") : list);
}

}  // namespace tandem
