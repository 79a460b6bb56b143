#include "tandem/common/validate.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>

#include "tandem/common/error.hpp"

namespace tandem {
namespace {

// NOTE: every dim is at most 2^32 and every tensor at most 2^40 bytes (1 TiB). A slot has at most four
// factors, so the products below are computed with overflow checks, and any later sum of a few extents
// (offset + bytes, nranks * bytes) stays far from 2^64.
constexpr uint64_t kMaxDim = uint64_t{1} << 32;
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 40;

constexpr uint16_t kKnownFlags = kFlagCausal;

struct Factor {
  std::string_view label;
  uint64_t value = 0;
};

// How one slot's extent follows from the dims.
struct SlotSpec {
  std::string_view name;  // empty: unused by this kind
  DType dtype = DType::kInvalid;
  std::array<Factor, 4> factors{};
  int factorCount = 0;
  std::string_view shape;  // as tandem.h writes it, for the remedy
  bool optional = false;
  bool output = false;
  bool raw = false;  // untyped bytes (allgather): element size 1
};

struct DimSpec {
  std::string_view name;
  bool mayBeZero = false;  // a per-rank row count: a rank may own no rows
  bool global = true;      // must match on every rank
};

struct KindSpec {
  std::array<DimSpec, kMaxOpDims> dims{};
  int dimCount = 0;
  bool typed = true;  // false: carries no typed data, so any known dtype value (0 included) is accepted
  uint16_t flags = 0;
};

bool knownKind(OpKind kind) {
  const auto v = static_cast<uint16_t>(kind);
  return v >= 1 && v < kOpKindCount;
}

bool knownDtype(DType dtype) {
  const auto v = static_cast<uint16_t>(dtype);
  return v <= static_cast<uint16_t>(DType::kI32);
}

KindSpec kindSpec(OpKind kind) {
  KindSpec s;
  auto dims = [&s](std::initializer_list<DimSpec> list) {
    for (const DimSpec& d : list) s.dims[static_cast<std::size_t>(s.dimCount++)] = d;
  };
  switch (kind) {
    case OpKind::kAgGemm: dims({{"m"}, {"n"}, {"k"}}); break;
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: dims({{"m"}, {"n"}, {"k", false, false}}); break;
    case OpKind::kMoeDispatchGemm:
      // capacity is per rank: each rank sizes its own receive buffers.
      dims({{"tokens", true, false}, {"hidden"}, {"n_out"}, {"experts"}, {"topk"}, {"capacity", false, false}});
      break;
    case OpKind::kMoeDispatchFfnCombine:
      dims({{"tokens", true, false}, {"hidden"}, {"ffn"}, {"experts"}, {"topk"}});
      break;
    case OpKind::kRingAttention:
      dims({{"seq", true, false}, {"heads"}, {"head_dim"}});
      s.flags = kFlagCausal;
      break;
    case OpKind::kAllGather:
      dims({{"bytes"}});
      s.typed = false;
      break;
    case OpKind::kNop: s.typed = false; break;
    case OpKind::kInvalid: break;
  }
  return s;
}

SlotSpec spec(std::string_view name, DType dtype, std::initializer_list<Factor> factors, std::string_view shape,
              bool output = false, bool optional = false) {
  SlotSpec s;
  s.name = name;
  s.dtype = dtype;
  for (const Factor& f : factors) s.factors[static_cast<std::size_t>(s.factorCount++)] = f;
  s.shape = shape;
  s.output = output;
  s.optional = optional;
  return s;
}

// Slot layouts, straight from tandem.h. Dims are already checked (non-zero where required, <= 2^32).
std::array<SlotSpec, kMaxOpBuffers> slotSpecs(const OpDescriptor& d) {
  std::array<SlotSpec, kMaxOpBuffers> s{};
  const DType t = d.dtype;
  const auto& x = d.dims;
  switch (d.kind) {
    case OpKind::kAgGemm: {
      const uint64_t rows = rowsOf(x[dim::kM], d.rank, d.nranks);
      s[slot::kA] = spec("a", t, {{"rows", rows}, {"k", x[dim::kK]}}, "this rank's shard [rows_of(m, rank, nranks), k]");
      s[slot::kB] = spec("b", t, {{"n", x[dim::kN]}, {"k", x[dim::kK]}}, "[n, k]");
      s[slot::kC] = spec("c", t, {{"m", x[dim::kM]}, {"n", x[dim::kN]}}, "[m, n]", true);
      s[slot::kAGathered] = spec("a_gathered", t, {{"m", x[dim::kM]}, {"k", x[dim::kK]}}, "[m, k]", true, true);
      break;
    }
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: {
      s[slot::kA] = spec("a", t, {{"m", x[dim::kM]}, {"k", x[dim::kK]}}, "[m, k] (k: this rank's slice)");
      s[slot::kB] = spec("b", t, {{"n", x[dim::kN]}, {"k", x[dim::kK]}}, "[n, k] (k: this rank's slice)");
      if (d.kind == OpKind::kGemmRs) {
        const uint64_t rows = rowsOf(x[dim::kM], d.rank, d.nranks);
        s[slot::kC] = spec("c", t, {{"rows", rows}, {"n", x[dim::kN]}}, "this rank's rows [rows_of(m, rank, nranks), n]",
                           true);
      } else {
        s[slot::kC] = spec("c", t, {{"m", x[dim::kM]}, {"n", x[dim::kN]}}, "[m, n]", true);
      }
      break;
    }
    case OpKind::kMoeDispatchGemm:
    case OpKind::kMoeDispatchFfnCombine: {
      const Factor tokens{"tokens", x[dim::kTokens]};
      const Factor hidden{"hidden", x[dim::kHidden]};
      const Factor topk{"topk", x[dim::kTopk]};
      const Factor local{"experts/nranks", x[dim::kExperts] / d.nranks};
      s[slot::kX] = spec("x", t, {tokens, hidden}, "[tokens, hidden]");
      s[slot::kTopkIds] = spec("topk_ids", DType::kI32, {tokens, topk}, "[tokens, topk] int32");
      s[slot::kTopkWeights] = spec("topk_weights", DType::kF32, {tokens, topk}, "[tokens, topk] fp32");
      if (d.kind == OpKind::kMoeDispatchGemm) {
        const Factor nOut{"n_out", x[dim::kNOut]};
        const Factor capacity{"capacity", x[dim::kCapacity]};
        s[slot::kW] = spec("w", t, {local, nOut, hidden}, "[experts/nranks, n_out, hidden]");
        s[slot::kMoeOut] = spec("out", t, {capacity, nOut}, "[capacity, n_out]", true);
        s[slot::kRowInfo] = spec("row_info", DType::kI32, {capacity, {"4", 4}}, "[capacity, 4] int32", true);
        s[slot::kExpertCounts] = spec("expert_counts", DType::kI32, {local}, "[experts/nranks] int32", true);
      } else {
        const Factor ffn{"ffn", x[dim::kFfn]};
        s[slot::kW1] = spec("w1", t, {local, {"2", 2}, ffn, hidden}, "[experts/nranks, 2*ffn, hidden]");
        s[slot::kW2] = spec("w2", t, {local, hidden, ffn}, "[experts/nranks, hidden, ffn]");
        s[slot::kFfnOut] = spec("out", t, {tokens, hidden}, "[tokens, hidden]", true);
      }
      break;
    }
    case OpKind::kRingAttention: {
      const std::initializer_list<Factor> f{
          {"seq", x[dim::kSeq]}, {"heads", x[dim::kHeads]}, {"head_dim", x[dim::kHeadDim]}};
      s[slot::kQ] = spec("q", t, f, "[seq, heads, head_dim]");
      s[slot::kKey] = spec("k", t, f, "[seq, heads, head_dim]");
      s[slot::kValue] = spec("v", t, f, "[seq, heads, head_dim]");
      s[slot::kAttnOut] = spec("out", t, f, "[seq, heads, head_dim]", true);
      break;
    }
    case OpKind::kAllGather:
      s[slot::kSend] = spec("send", t, {{"bytes", x[dim::kBytes]}}, "[bytes]");
      s[slot::kRecv] = spec("recv", t, {{"nranks", d.nranks}, {"bytes", x[dim::kBytes]}}, "[nranks * bytes]", true);
      s[slot::kSend].raw = true;
      s[slot::kRecv].raw = true;
      break;
    case OpKind::kNop:
    case OpKind::kInvalid: break;
  }
  return s;
}

std::string factorExpr(const SlotSpec& s, std::size_t elementSize) {
  std::string out;
  for (int i = 0; i < s.factorCount; ++i) fmt::format_to(std::back_inserter(out), "{}*", s.factors[static_cast<std::size_t>(i)].label);
  fmt::format_to(std::back_inserter(out), "{}", elementSize);
  return out;
}

std::string factorValues(const SlotSpec& s) {
  std::string out;
  for (int i = 0; i < s.factorCount; ++i) {
    const Factor& f = s.factors[static_cast<std::size_t>(i)];
    if (f.label == "2" || f.label == "4") continue;  // literal factors
    fmt::format_to(std::back_inserter(out), "{}{}={}", out.empty() ? "" : ", ", f.label, f.value);
  }
  return out;
}

std::string_view elementText(const SlotSpec& s) { return s.raw ? std::string_view("raw bytes") : dtypeName(s.dtype); }

void checkHeader(const OpDescriptor& d, std::string_view kind, const KindSpec& ks) {
  if (!knownDtype(d.dtype)) {
    fail(ErrorCode::kInvalidArgument, "{}: dtype {} is unknown; use bf16 ({}), fp16 ({}) or fp32 ({})", kind,
         static_cast<uint16_t>(d.dtype), static_cast<uint16_t>(DType::kBF16), static_cast<uint16_t>(DType::kF16),
         static_cast<uint16_t>(DType::kF32));
  }
  if (ks.typed && d.dtype != DType::kBF16 && d.dtype != DType::kF16 && d.dtype != DType::kF32) {
    fail(ErrorCode::kInvalidArgument, "{}: dtype {} not supported; use bf16, fp16 or fp32", kind, dtypeName(d.dtype));
  }
  if ((d.flags & ~ks.flags) != 0) {
    fail(ErrorCode::kInvalidArgument,
         "{}: flags 0x{:x} has bits 0x{:x} this op does not define; ring-attention takes only kFlagCausal (0x1), "
         "other ops 0",
         kind, d.flags, d.flags & ~ks.flags);
  }
  if (d.nranks == 0 || d.nranks > kMaxRanks) {
    fail(ErrorCode::kInvalidArgument, "{}: nranks {} is out of range; a communicator has 1..{} ranks", kind, d.nranks,
         kMaxRanks);
  }
  if (d.rank >= d.nranks) {
    fail(ErrorCode::kInvalidArgument, "{}: rank {} is not below nranks {}; pass the rank tandem_comm_init gave", kind,
         d.rank, d.nranks);
  }
  if (d.kind == OpKind::kRingAttention) {
    if (!std::isfinite(d.scale)) {
      fail(ErrorCode::kInvalidArgument, "{}: scale {} is not finite; pass a finite scale or 0 for 1/sqrt(head_dim)",
           kind, d.scale);
    }
  } else if (d.scale != 0.0f || std::signbit(d.scale)) {
    fail(ErrorCode::kInvalidArgument, "{}: scale is {} but only ring-attention uses it; zero it", kind, d.scale);
  }
  if (d.reserved0 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: reserved0 is {}; zero it (reserved fields must be 0)", kind, d.reserved0);
  }
  for (std::size_t i = 0; i < d.reserved1.size(); ++i) {
    if (d.reserved1[i] != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: reserved1[{}] is {}; zero it (reserved fields must be 0)", kind, i,
           d.reserved1[i]);
    }
  }
}

void checkDims(const OpDescriptor& d, std::string_view kind, const KindSpec& ks) {
  for (std::size_t i = 0; i < kMaxOpDims; ++i) {
    const uint64_t v = d.dims[i];
    if (static_cast<int>(i) >= ks.dimCount) {
      if (v != 0) {
        fail(ErrorCode::kInvalidArgument, "{}: dims[{}] is {} but {} uses {} dims; zero it", kind, i, v, kind,
             ks.dimCount);
      }
      continue;
    }
    const std::string_view name = ks.dims[i].name;
    if (v == 0 && !ks.dims[i].mayBeZero) {
      fail(ErrorCode::kInvalidArgument, "{}: dims[{}] ({}) is 0; pass {} >= 1", kind, i, name, name);
    }
    if (v > kMaxDim) {
      fail(ErrorCode::kInvalidArgument,
           "{}: dims[{}] ({}) is {}, above 2^32; each dim is capped at 2^32 so byte counts cannot overflow", kind, i,
           name, v);
    }
  }
  if (d.kind == OpKind::kMoeDispatchGemm || d.kind == OpKind::kMoeDispatchFfnCombine) {
    const uint64_t experts = d.dims[dim::kExperts];
    const uint64_t topk = d.dims[dim::kTopk];
    if (experts % d.nranks != 0) {
      fail(ErrorCode::kInvalidArgument,
           "{}: experts {} is not divisible by nranks {}; experts are spread evenly over ranks", kind, experts,
           d.nranks);
    }
    if (topk > experts) {
      fail(ErrorCode::kInvalidArgument,
           "{}: topk {} exceeds experts {}; a token picks topk distinct experts, so pass topk <= experts", kind, topk,
           experts);
    }
  }
}

std::size_t slotElementSize(const SlotSpec& s) { return s.raw ? 1 : dtypeSize(s.dtype); }

// The rules the dims imply, with every extent checked against the 2^40-byte cap.
SlotRules computeRules(const std::array<SlotSpec, kMaxOpBuffers>& specs, std::string_view kind) {
  SlotRules rules{};
  for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
    const SlotSpec& s = specs[i];
    if (s.name.empty()) {
      rules[i] = SlotRule{{}, DType::kInvalid, 0, false, false};
      continue;
    }
    uint64_t bytes = slotElementSize(s);
    bool overflow = false;
    for (int f = 0; f < s.factorCount; ++f) {
      overflow |= __builtin_mul_overflow(bytes, s.factors[static_cast<std::size_t>(f)].value, &bytes);
    }
    if (overflow || bytes > kMaxTensorBytes) {
      fail(ErrorCode::kInvalidArgument,
           "{}: buffer {} would need {} bytes [{}], above 2^40; each tensor is capped at 2^40 bytes (1 TiB), so "
           "pass a smaller shape",
           kind, s.name, overflow ? std::string("more than 2^64") : fmt::format("{}", bytes), factorValues(s));
    }
    rules[i] = SlotRule{s.name, s.dtype, bytes, s.optional, s.output};
  }
  return rules;
}

void checkBuffers(const OpDescriptor& d, const std::array<SlotSpec, kMaxOpBuffers>& specs, const SlotRules& rules,
                  std::string_view kind) {
  for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
    const SlotSpec& s = specs[i];
    const BufferRef& b = d.bufs[i];
    if (s.name.empty()) {
      if (b.bufferId != 0 || b.offset != 0 || b.bytes != 0) {
        fail(ErrorCode::kInvalidArgument,
             "{}: buffer slot {} is unused by {} but set (bufferId {}, offset {}, bytes {}); zero it", kind, i, kind,
             b.bufferId, b.offset, b.bytes);
      }
      continue;
    }
    const uint64_t bytes = rules[i].bytes;
    const std::size_t elementSize = slotElementSize(s);
    if (b.bufferId == 0) {
      if (s.optional) {
        if (b.offset != 0 || b.bytes != 0) {
          fail(ErrorCode::kInvalidArgument,
               "{}: buffer {} is absent (bufferId 0) but has offset {} and bytes {}; zero them, or pass the tensor "
               "of {}",
               kind, s.name, b.offset, b.bytes, s.shape);
        }
        continue;
      }
      if (bytes != 0) {
        fail(ErrorCode::kInvalidArgument, "{}: buffer {} is absent (bufferId 0) but required; pass the tensor of {}",
             kind, s.name, s.shape);
      }
      // An empty extent (a rank that owns no rows) needs no memory; any bufferId, 0 included, is fine.
    }
    if (b.bytes != bytes) {
      fail(ErrorCode::kInvalidArgument, "{}: buffer {} claims {} bytes but {} = {} for {} [{}]; pass the tensor of {}",
           kind, s.name, b.bytes, factorExpr(s, elementSize), bytes, elementText(s), factorValues(s), s.shape);
    }
    if (b.offset % elementSize != 0) {
      fail(ErrorCode::kInvalidArgument,
           "{}: buffer {} offset {} is not a multiple of the {} element size {}; align the tensor to {} bytes", kind,
           s.name, b.offset, dtypeName(s.dtype), elementSize, elementSize);
    }
    if (b.offset > UINT64_MAX - b.bytes) {
      fail(ErrorCode::kInvalidArgument, "{}: buffer {} offset {} + bytes {} overflows; pass an offset inside the buffer",
           kind, s.name, b.offset, b.bytes);
    }
  }
}

// Everything but the BufferRefs: version, kind, header fields and dims.
void checkShape(const OpDescriptor& desc) {
  if (desc.version != kDescriptorVersion) {
    fail(ErrorCode::kInvalidArgument,
         "descriptor: version {} is not supported (this side speaks {}); build client and daemon from the same tandem",
         desc.version, kDescriptorVersion);
  }
  if (!knownKind(desc.kind)) {
    fail(ErrorCode::kInvalidArgument, "descriptor: op kind {} is unknown; valid kinds are 1..{} (ag-gemm..nop)",
         static_cast<uint16_t>(desc.kind), kOpKindCount - 1);
  }
  const std::string_view kind = opKindName(desc.kind);
  const KindSpec ks = kindSpec(desc.kind);
  checkHeader(desc, kind, ks);
  checkDims(desc, kind, ks);
}

}  // namespace

SlotRules expectedSlots(const OpDescriptor& desc) {
  checkShape(desc);
  return computeRules(slotSpecs(desc), opKindName(desc.kind));
}

SlotRules validateDescriptor(const OpDescriptor& desc) {
  checkShape(desc);
  const std::string_view kind = opKindName(desc.kind);
  const std::array<SlotSpec, kMaxOpBuffers> specs = slotSpecs(desc);
  const SlotRules rules = computeRules(specs, kind);
  checkBuffers(desc, specs, rules, kind);
  return rules;
}

void validateCollective(std::span<const OpDescriptor> descs) {
  if (descs.empty()) fail(ErrorCode::kInvalidArgument, "collective: no descriptors; every rank must submit the op");
  const OpDescriptor& d0 = descs[0];
  const std::string_view kind = opKindName(d0.kind);
  if (descs.size() != d0.nranks) {
    fail(ErrorCode::kInvalidArgument,
         "{}: {} descriptors for a communicator of nranks {} (rank 0's); every rank must submit exactly once", kind,
         descs.size(), d0.nranks);
  }
  const KindSpec ks = kindSpec(d0.kind);
  for (std::size_t r = 0; r < descs.size(); ++r) {
    const OpDescriptor& d = descs[r];
    if (d.rank != r) {
      fail(ErrorCode::kInvalidArgument, "{}: descriptor {} comes from rank {}; pass one descriptor per rank, in rank order",
           kind, r, d.rank);
    }
    if (d.nranks != d0.nranks) {
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} has nranks {} but rank 0 has {}; every rank must use the same communicator", kind, r, d.nranks,
           d0.nranks);
    }
    if (d.kind != d0.kind) {
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} submitted {} but rank 0 submitted {}; submit ops on a communicator in the same order on every "
           "rank",
           kind, r, opKindName(d.kind), kind);
    }
    if (d.version != d0.version) {
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} has descriptor version {} but rank 0 has {}; build every rank's client from the same tandem",
           kind, r, d.version, d0.version);
    }
    if (d.dtype != d0.dtype) {
      fail(ErrorCode::kInvalidArgument, "{}: rank {} has dtype {} but rank 0 has {}; every rank must pass the same dtype",
           kind, r, dtypeName(d.dtype), dtypeName(d0.dtype));
    }
    if (d.flags != d0.flags) {
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} has flags 0x{:x} but rank 0 has 0x{:x}; every rank must pass the same flags (causal)", kind, r,
           d.flags, d0.flags);
    }
    if (d.scale != d0.scale) {
      fail(ErrorCode::kInvalidArgument, "{}: rank {} has scale {} but rank 0 has {}; every rank must pass the same scale",
           kind, r, d.scale, d0.scale);
    }
    for (std::size_t i = 0; i < kMaxOpDims; ++i) {
      const bool global = static_cast<int>(i) >= ks.dimCount || ks.dims[i].global;
      if (!global || d.dims[i] == d0.dims[i]) continue;
      const std::string_view name = static_cast<int>(i) < ks.dimCount ? ks.dims[i].name : std::string_view("unused");
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} has dims[{}] ({}) = {} but rank 0 has {}; {} is global and must match on every rank", kind, r,
           i, name, d.dims[i], d0.dims[i], name);
    }
  }
}

}  // namespace tandem
