#include "tandem/common/descriptor.hpp"

#include <fmt/format.h>

#include "tandem/common/op_spec.hpp"

namespace tandem {

std::string_view opKindName(OpKind kind) { return knownOp(kind) ? opSpec(kind).name : "invalid"; }

std::string planShapeName(const OpDescriptor& d) {
  const bool gemm = d.kind == OpKind::kAgGemm || d.kind == OpKind::kGemmRs || d.kind == OpKind::kGemmAr;
  const GemmOperands layout = gemmOperandsOf(d.flags);
  return fmt::format("{} {} m={} n={} k={}{}{} on {} ranks", opKindName(d.kind), dtypeName(d.dtype), d.dims[dim::kM],
                     d.dims[dim::kN], d.dims[dim::kK], gemm && layout != GemmOperands::kNT ? " " : "",
                     gemm && layout != GemmOperands::kNT ? gemmLayoutName(layout) : "", d.nranks);
}

std::string_view gemmLayoutName(GemmOperands layout) {
  switch (layout) {
    case GemmOperands::kNT: return "nt";
    case GemmOperands::kNN: return "nn";
    case GemmOperands::kTN: return "tn";
  }
  return "invalid";
}

std::string_view dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "int32";
    case DType::kF8E4M3: return "fp8-e4m3";
    case DType::kF8E5M2: return "fp8-e5m2";
    case DType::kInvalid: break;
  }
  return "invalid";
}

std::size_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return 1;
    case DType::kInvalid: break;
  }
  return 0;
}

}  // namespace tandem
