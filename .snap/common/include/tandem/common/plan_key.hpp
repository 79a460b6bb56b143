// What a plan is, and what it is chosen for: the key and the value of tandemd's plan table (daemon/src/plan_table.hpp),
// shared with libtandem (the client executor applies the entries tandemd sends with a join) and tandemctl (tune,
// advise). Header-only, plain data.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem {

// How a fused op runs. kAuto: the kernels' built-in rules (kernels/gemm_rs.cu chooseGemmRsPlan and friends).
enum class PlanKind : uint8_t { kAuto = 0, kFused = 1, kDecomposed = 2 };

constexpr std::string_view planKindName(PlanKind k) {
  return k == PlanKind::kFused ? "fused" : (k == PlanKind::kDecomposed ? "decomposed" : "auto");
}
constexpr std::optional<PlanKind> planKindFromName(std::string_view s) {
  if (s == "fused") return PlanKind::kFused;
  if (s == "decomposed") return PlanKind::kDecomposed;
  if (s == "auto") return PlanKind::kAuto;
  return std::nullopt;
}

// The plan of one op. commSms and chunkBytes 0: the kernels' own choice for that kind.
//   ag-gemm    fused: communication CTAs beside the GEMM; decomposed: CTAs of the all-gather kernel before it.
//   gemm-rs/ar fused: send CTAs that copy partials while the rest compute (0: every SM computes and the compute CTAs'
//              idle producer warps copy); decomposed: CTAs of the reduction kernel after the GEMM.
//   chunkBytes: recorded for the ops whose kernels take a chunk size (allgather); the fused GEMMs derive theirs.
struct PlanChoice {
  PlanKind kind = PlanKind::kAuto;
  uint32_t commSms = 0;
  uint64_t chunkBytes = 0;
  bool operator==(const PlanChoice&) const = default;
};

// Shapes share a plan when each of m, n and k rounds up to the same power of two: plans change with the shape's
// order of magnitude (the SM split that hides a transfer scales with the GEMM's length), not with its last digits.
constexpr uint64_t bucketDim(uint64_t x) {
  uint64_t p = 1;
  while (p < x && p < (uint64_t{1} << 62)) p <<= 1;
  return p;
}

// "m1024.n8192.k8192". k is the descriptor's: the per-rank K slice for gemm-rs and gemm-ar (equal on every rank of a
// valid op, since every slice is a multiple of 8 and the split is balanced), the whole K for ag-gemm. The backward's
// layouts add ".nn" or ".tn": their kernels differ from the forward's (NN loads the weight MN-major, TN runs on the
// layouts core), so a plan measured on one layout says nothing of another. nt adds nothing, so tables written before
// layouts existed keep their meaning.
inline std::string shapeBucket(uint64_t m, uint64_t n, uint64_t k, GemmOperands layout = GemmOperands::kNT) {
  const char* suffix = layout == GemmOperands::kNN ? ".nn" : layout == GemmOperands::kTN ? ".tn" : "";
  return "m" + std::to_string(bucketDim(m)) + ".n" + std::to_string(bucketDim(n)) + ".k" + std::to_string(bucketDim(k)) +
         suffix;
}

// What a plan is chosen for. gpu: the GPU model as the driver names it ("NVIDIA H200"; "cpu" on the cpu backend);
// executor: "client", "daemon" or "host".
struct PlanKey {
  OpKind op = OpKind::kInvalid;
  DType dtype = DType::kInvalid;
  uint32_t ranks = 0;
  std::string bucket;
  std::string gpu;
  std::string executor;
  auto operator<=>(const PlanKey&) const = default;
};

inline PlanKey planKeyOf(const OpDescriptor& d, std::string gpu, std::string executor) {
  return PlanKey{d.kind, d.dtype, d.nranks,
                 shapeBucket(d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK], gemmOperandsOf(d.flags)), std::move(gpu),
                 std::move(executor)};
}

// The ops whose plan the table holds: the fused GEMMs.
constexpr bool plannedOp(OpKind k) { return k == OpKind::kAgGemm || k == OpKind::kGemmRs || k == OpKind::kGemmAr; }

// A key and plan from their names, as the protocol carries them (control.proto PlanEntry); nullopt when a name is not
// one tandem knows (an entry from a newer tandemd: skipped, never misread).
inline std::optional<std::pair<PlanKey, PlanChoice>> planFromNames(std::string_view op, std::string_view dtype,
                                                                    uint32_t ranks, std::string bucket, std::string gpu,
                                                                    std::string executor, std::string_view kind,
                                                                    uint32_t commSms, uint64_t chunkBytes) {
  const OpSpec* spec = findOp(op);
  const auto k = planKindFromName(kind);
  DType dt = DType::kInvalid;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    if (dtypeName(t) == dtype) dt = t;
  }
  if (spec == nullptr || !plannedOp(spec->kind) || !k || dt == DType::kInvalid || ranks == 0) return std::nullopt;
  return std::make_pair(PlanKey{spec->kind, dt, ranks, std::move(bucket), std::move(gpu), std::move(executor)},
                        PlanChoice{*k, commSms, chunkBytes});
}

}  // namespace tandem
