#include "tandem/common/validate.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem {
namespace {

// NOTE: every dim is at most 2^32 and every tensor at most 2^40 bytes (1 TiB). A slot has at most four
// factors, so the products below are computed with overflow checks, and any later sum of a few extents
// (offset + bytes, nranks * bytes) stays far from 2^64.
constexpr uint64_t kMaxDim = uint64_t{1} << 32;
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 40;

bool knownDtype(DType dtype) { return static_cast<uint16_t>(dtype) <= static_cast<uint16_t>(DType::kF8E5M2); }

// A slot's terms as the error messages name them, with their values for this descriptor.
struct Factor {
  std::string label;
  uint64_t value = 0;
  bool literal = false;  // a constant factor ("4" in [capacity, 4]): not worth listing as name=value
};

std::vector<Factor> factorsOf(const OpSpec& op, const SlotSpec& s, const OpDescriptor& d) {
  std::vector<Factor> out;
  const Fp8ScaleShape scales = fp8ScaleShape(op, d);
  if (s.fp8Scale && scales != Fp8ScaleShape::kBlock) {  // per tensor (or none: not FP8)
    const bool one = scales == Fp8ScaleShape::kTensor;
    out.push_back({one ? "1" : "0", one ? 1U : 0U, true});
    return out;
  }
  for (int i = 0; i < s.termCount; ++i) {
    const ExtentTerm& t = s.terms[static_cast<std::size_t>(i)];
    const std::string_view dimName = op.dims[t.dim].name;
    switch (t.kind) {
      case ExtentTerm::Kind::kDim: out.push_back({std::string(dimName), d.dims[t.dim]}); break;
      case ExtentTerm::Kind::kShard: out.push_back({"rows", rowsOf(d.dims[t.dim], d.rank, d.nranks)}); break;
      case ExtentTerm::Kind::kPerRank: out.push_back({fmt::format("{}/nranks", dimName), d.dims[t.dim] / d.nranks}); break;
      case ExtentTerm::Kind::kNranks: out.push_back({"nranks", d.nranks}); break;
      case ExtentTerm::Kind::kConst: out.push_back({fmt::format("{}", t.value), t.value, true}); break;
      case ExtentTerm::Kind::kBlocks:
        out.push_back({fmt::format("ceil({}/{})", dimName, t.value), (d.dims[t.dim] + t.value - 1) / t.value});
        break;
    }
  }
  return out;
}

std::string factorExpr(const std::vector<Factor>& factors, std::size_t elementBytes) {
  std::string out;
  for (const Factor& f : factors) fmt::format_to(std::back_inserter(out), "{}*", f.label);
  fmt::format_to(std::back_inserter(out), "{}", elementBytes);
  return out;
}

std::string factorValues(const std::vector<Factor>& factors) {
  std::string out;
  for (const Factor& f : factors) {
    if (f.literal) continue;
    fmt::format_to(std::back_inserter(out), "{}{}={}", out.empty() ? "" : ", ", f.label, f.value);
  }
  return out;
}

std::string_view elementText(const SlotSpec& s, const OpDescriptor& d) {
  return s.type == ElementType::kRaw ? std::string_view("raw bytes") : dtypeName(slotDtype(s, d));
}

// FP8 inputs (OpSpec::fp8): the output dtype, the scaling flag and the layouts they allow.
void checkFp8(const OpDescriptor& d, std::string_view kind) {
  const auto outBits = static_cast<uint16_t>((d.flags & kFlagGemmOutDtype) >> kGemmOutDtypeShift);
  const DType out = gemmOutDtype(d.dtype, d.flags);
  if (!isFp8(d.dtype)) {
    if (outBits != 0 && out != d.dtype) {
      fail(ErrorCode::kInvalidArgument,
           "{}: out_dtype is {} but dtype is {}; only FP8 inputs take another output dtype, so pass out_dtype 0 (or "
           "dtype)", kind, dtypeName(out), dtypeName(d.dtype));
    }
    if ((d.flags & kFlagFp8BlockScale) != 0) {
      fail(ErrorCode::kInvalidArgument,
           "{}: scaling is TANDEM_FP8_SCALE_BLOCK but dtype is {}; scales apply to FP8 inputs only, so pass scaling 0",
           kind, dtypeName(d.dtype));
    }
    return;
  }
  if (out != DType::kBF16 && out != DType::kF32) {
    fail(ErrorCode::kInvalidArgument,
         "{}: out_dtype is {} with {} inputs; c of an FP8 GEMM is bf16 or fp32, so pass out_dtype "
         "TANDEM_DTYPE_BF16 (3) or TANDEM_DTYPE_FP32 (1)",
         kind, outBits == 0 ? std::string("0 (dtype's)") : std::string(dtypeName(out)), dtypeName(d.dtype));
  }
}

void checkHeader(const OpDescriptor& d, std::string_view kind, const OpSpec& ks) {
  if (!knownDtype(d.dtype)) {
    fail(ErrorCode::kInvalidArgument, "{}: dtype {} is unknown; use bf16 ({}), fp16 ({}) or fp32 ({})", kind,
         static_cast<uint16_t>(d.dtype), static_cast<uint16_t>(DType::kBF16), static_cast<uint16_t>(DType::kF16),
         static_cast<uint16_t>(DType::kF32));
  }
  if (ks.typed && isFp8(d.dtype) && !ks.fp8) {
    fail(ErrorCode::kInvalidArgument,
         "{}: dtype {} not supported; this op has no FP8 path (ag-gemm, gemm-rs and gemm-ar take FP8 inputs, "
         "moe-dispatch-gemm and moe-dispatch-ffn-combine FP8 weights through w_dtype), so use bf16, fp16 or fp32", kind, dtypeName(d.dtype));
  }
  if (ks.typed && !isFp8(d.dtype) && d.dtype != DType::kBF16 && d.dtype != DType::kF16 && d.dtype != DType::kF32) {
    fail(ErrorCode::kInvalidArgument, "{}: dtype {} not supported; use bf16, fp16 or fp32{}", kind, dtypeName(d.dtype),
         ks.fp8 ? " (or fp8-e4m3, fp8-e5m2)" : "");
  }
  if ((d.flags & ~ks.flags) != 0) {
    fail(ErrorCode::kInvalidArgument,
         "{}: flags 0x{:x} has bits 0x{:x} this op does not define; it takes 0x{:x} (ring-attention kFlagCausal "
         "and kFlagZigzag; the GEMM ops their layout, kFlagGemmLayout; other ops none)",
         kind, d.flags, d.flags & ~ks.flags, ks.flags);
  }
  // Enum flag fields take only their named values (the C entry points check the same before packing).
  for (int f = 0; f < ks.cFieldCount; ++f) {
    const CField& cf = ks.cFields[static_cast<std::size_t>(f)];
    if (cf.kind != CField::Kind::kFlag || !cf.isEnum) continue;
    const unsigned v = (d.flags >> cf.index) & ((1U << cf.bits) - 1U);
    if (v > cf.maxValue) {
      fail(ErrorCode::kInvalidArgument, "{}: {} {} (flags 0x{:x}) is unknown; pass {}", kind, cf.name, v, d.flags,
           cf.values);
    }
  }
  if (d.nranks == 0 || d.nranks > kMaxRanks) {
    fail(ErrorCode::kInvalidArgument, "{}: nranks {} is out of range; a communicator has 1..{} ranks", kind, d.nranks,
         kMaxRanks);
  }
  if (d.rank >= d.nranks) {
    fail(ErrorCode::kInvalidArgument, "{}: rank {} is not below nranks {}; pass the rank tandem_comm_init gave", kind,
         d.rank, d.nranks);
  }
  if (ks.fp8) checkFp8(d, kind);
  if (ks.scale) {
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

void checkDims(const OpDescriptor& d, std::string_view kind, const OpSpec& ks) {
  for (std::size_t i = 0; i < kMaxOpDims; ++i) {
    const uint64_t v = d.dims[i];
    if (i >= ks.dimCount) {
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
  if (ks.checkDims != nullptr) ks.checkDims(d);
}

// The rules the dims imply, with every extent checked against the 2^40-byte cap.
SlotRules computeRules(const OpSpec& op, const OpDescriptor& d) {
  SlotRules rules{};
  for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
    if (i >= op.slotCount) {
      rules[i] = SlotRule{{}, DType::kInvalid, 0, false, false};
      continue;
    }
    const SlotSpec& s = op.slots[i];
    bool overflow = false;
    const uint64_t elements = slotElements(op, static_cast<int>(i), d, &overflow);
    uint64_t bytes = 0;
    overflow |= __builtin_mul_overflow(elements, slotElementSize(s, d), &bytes);
    if (overflow || bytes > kMaxTensorBytes) {
      fail(ErrorCode::kInvalidArgument,
           "{}: buffer {} would need {} bytes [{}], above 2^40; each tensor is capped at 2^40 bytes (1 TiB), so "
           "pass a smaller shape",
           op.name, s.name, overflow ? std::string("more than 2^64") : fmt::format("{}", bytes),
           factorValues(factorsOf(op, s, d)));
    }
    rules[i] = SlotRule{s.name, slotDtype(s, d), bytes, s.optional, s.output};
  }
  return rules;
}

void checkBuffers(const OpDescriptor& d, const OpSpec& op, const SlotRules& rules) {
  const std::string_view kind = op.name;
  for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
    const BufferRef& b = d.bufs[i];
    if (i >= op.slotCount) {
      if (b.bufferId != 0 || b.offset != 0 || b.bytes != 0) {
        fail(ErrorCode::kInvalidArgument,
             "{}: buffer slot {} is unused by {} but set (bufferId {}, offset {}, bytes {}); zero it", kind, i, kind,
             b.bufferId, b.offset, b.bytes);
      }
      continue;
    }
    const SlotSpec& s = op.slots[i];
    const std::string_view shape = slotTransposed(s, d.flags) ? s.shapeTransposed : s.shape;
    const uint64_t bytes = rules[i].bytes;
    const std::size_t elementBytes = slotElementSize(s, d);
    if (s.fp8Scale && fp8ScaleShape(op, d) == Fp8ScaleShape::kNone && (b.bufferId != 0 || b.bytes != 0)) {
      fail(ErrorCode::kInvalidArgument, "{}: {} is set but {} is {}; scales apply to FP8 inputs only, so pass none",
           kind, s.name, op.fp8Weights ? "w_dtype" : "dtype",
           dtypeName(op.fp8Weights ? moeWeightDtype(d.dtype, d.flags) : d.dtype));
    }
    if (b.bufferId == 0) {
      if (s.optional) {
        if (b.offset != 0 || b.bytes != 0) {
          fail(ErrorCode::kInvalidArgument,
               "{}: buffer {} is absent (bufferId 0) but has offset {} and bytes {}; zero them, or pass the tensor "
               "of {}",
               kind, s.name, b.offset, b.bytes, shape);
        }
        continue;
      }
      if (bytes != 0) {
        fail(ErrorCode::kInvalidArgument, "{}: buffer {} is absent (bufferId 0) but required; pass the tensor of {}",
             kind, s.name, shape);
      }
      // An empty extent (a rank that owns no rows) needs no memory; any bufferId, 0 included, is fine.
    }
    if (b.bytes != bytes) {
      const std::vector<Factor> factors = factorsOf(op, s, d);
      fail(ErrorCode::kInvalidArgument, "{}: buffer {} claims {} bytes but {} = {} for {} [{}]; pass the tensor of {}",
           kind, s.name, b.bytes, factorExpr(factors, elementBytes), bytes, elementText(s, d),
           factorValues(factors), shape);
    }
    if (b.offset % elementBytes != 0) {
      fail(ErrorCode::kInvalidArgument,
           "{}: buffer {} offset {} is not a multiple of the {} element size {}; align the tensor to {} bytes", kind,
           s.name, b.offset, dtypeName(slotDtype(s, d)), elementBytes, elementBytes);
    }
    if (b.offset > UINT64_MAX - b.bytes) {
      fail(ErrorCode::kInvalidArgument, "{}: buffer {} offset {} + bytes {} overflows; pass an offset inside the buffer",
           kind, s.name, b.offset, b.bytes);
    }
  }
}

// Everything but the BufferRefs: version, kind, header fields and dims. Returns the op's table entry.
const OpSpec& checkShape(const OpDescriptor& desc) {
  if (desc.version != kDescriptorVersion) {
    fail(ErrorCode::kInvalidArgument,
         "descriptor: version {} is not supported (this side speaks {}); build client and daemon from the same tandem",
         desc.version, kDescriptorVersion);
  }
  const OpSpec& op = opSpec(desc.kind);  // throws for an unknown kind
  checkHeader(desc, op.name, op);
  checkDims(desc, op.name, op);
  return op;
}

}  // namespace

SlotRules expectedSlots(const OpDescriptor& desc) { return computeRules(checkShape(desc), desc); }

SlotRules validateDescriptor(const OpDescriptor& desc) {
  const OpSpec& op = checkShape(desc);
  const SlotRules rules = computeRules(op, desc);
  checkBuffers(desc, op, rules);
  if (op.checkSlots != nullptr) op.checkSlots(desc);
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
  const OpSpec& ks = opSpec(d0.kind);
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
      const bool global = i >= ks.dimCount || !ks.dims[i].perRank();
      if (!global || d.dims[i] == d0.dims[i]) continue;
      const std::string_view name = i < ks.dimCount ? ks.dims[i].name : std::string_view("unused");
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} has dims[{}] ({}) = {} but rank 0 has {}; {} is global and must match on every rank", kind, r,
           i, name, d.dims[i], d0.dims[i], name);
    }
  }
}

}  // namespace tandem
