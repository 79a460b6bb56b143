// The op catalogue used by `tandemctl run` and the tests: shapes, deterministic random inputs, and an
// independent, straightforward double-precision reference of every op's semantics (tandem/tandem.h).
// The reference shares no code with the CPU backend (daemon/src/cpu_ops.cpp) on purpose.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/common/descriptor.hpp"

namespace tandem::reference {

// What a user asks `tandemctl run` for. Global sizes; makeDescriptor derives each rank's share.
struct OpShape {
  OpKind kind = OpKind::kAgGemm;
  DType dtype = DType::kBF16;
  uint64_t m = 256;        // ag-gemm/gemm-*: M rows; moe-*: tokens per rank
  uint64_t n = 256;        // gemm N; moe-dispatch-gemm: n_out; moe-ffn: ffn
  uint64_t k = 256;        // gemm K (gemm-rs/ar: total K, split with rowsOf); moe-*: hidden
  uint64_t experts = 8;
  uint64_t topk = 2;
  uint64_t savedRows = 0;  // moe-dispatch-ffn-combine, moe-ffn-backward: rows of saved (0: none, gate|up recomputed)
  uint64_t seq = 256;      // ring attention: total sequence, split with rowsOf
  uint64_t heads = 4;
  uint64_t headDim = 64;
  uint64_t kvHeads = 0;    // ring attention: KV heads (grouped-query attention); 0 = heads
  bool causal = true;
  bool zigzag = false;      // ring attention: zigzag layout (kFlagZigzag)
  GemmOperands layout = GemmOperands::kNT;  // ag-gemm, gemm-rs, gemm-ar: how A and B are stored (kFlagGemmLayout)
  DType outDtype = DType::kInvalid;  // the GEMM ops with FP8 inputs: c's dtype (kInvalid: bf16)
  bool blockScale = false;           // the GEMM ops with FP8 inputs: block scales (kFlagFp8BlockScale), else per tensor
  DType weightDtype = DType::kInvalid;  // the MoE ops: the expert weights' dtype (kFlagMoeWeightDtype; kInvalid: dtype)
  uint64_t bytes = 1 << 20;  // allgather: bytes per rank

  // The size a `tandemctl run --<option>` sets, by the option's name ("m", "head-dim"; OpSpec's DimSpec::cli).
  uint64_t value(std::string_view option) const;
};

// Rank r's descriptor for `shape`, derived from the op table: kind, dtype, flags, rank, nranks, dims (each split as
// its DimSpec says), and every slot's `bytes` (bufferId and offset left 0 for the caller to fill; optional slots
// such as a_gathered are requested). For moe-dispatch-gemm the capacity is the worst case, nranks * tokens * topk.
OpDescriptor makeDescriptor(const OpShape& shape, uint32_t rank, uint32_t nranks);

// Fills rank r's input slots with values drawn from (seed, rank, slot): uniform in [-1, 1] for floats,
// valid distinct expert ids for topk_ids and positive weights summing to 1 for topk_weights.
// Output slots are poisoned with NaN (or -1 for int32), so an op that skips writing is caught.
void fillInputs(const OpDescriptor& desc, std::span<std::byte* const> slots, uint64_t seed);

// Expected outputs computed in double. Element [r][slot] holds rank r's expected output slot as doubles
// (row_info/expert_counts as exact integers), empty for input or absent slots. For moe-dispatch-gemm only
// the first sum(expert_counts) rows of out/row_info are defined.
using Expected = std::vector<std::array<std::vector<double>, kMaxOpBuffers>>;
Expected compute(std::span<const OpDescriptor> descs, std::span<const std::array<const std::byte*, kMaxOpBuffers>> inputs);
// Rank `rank`'s expected outputs alone, from every rank's inputs (only their input slots are read; output slots may be
// null). What one rank needs to check itself: the other ranks' outputs are neither computed nor stored, so the time and
// memory of a check do not grow with the square of the ranks.
std::array<std::vector<double>, kMaxOpBuffers> computeRank(
    std::span<const OpDescriptor> descs, std::span<const std::array<const std::byte*, kMaxOpBuffers>> inputs,
    uint32_t rank);

// True when `kind` has a reference implementation (every op of the table must).
bool hasReference(OpKind kind);

struct Comparison {
  bool ok = false;
  double relError = 0;   // ||out - ref|| / ||ref|| over the compared slots; NaN never passes
  double tolerance = 0;
  std::string detail;    // which slot failed and why, when !ok
};
// Relative tolerance per dtype: bf16 1e-2, fp16 2e-3, fp32 1e-5.
double tolerance(DType dtype);
// Compares rank r's outputs with expected[r]. Integer slots must match exactly. The tolerance is the output dtype's;
// the MoE FFN with FP8 weights takes 3e-2 (its h is quantised to e4m3 after sums that differ between backends).

Comparison compareRank(const OpDescriptor& desc, std::span<const std::byte* const> slots,
                       const std::array<std::vector<double>, kMaxOpBuffers>& expected);

}  // namespace tandem::reference
