// The grouped GEMM's plan rule (grouped_gemm_plan.hpp): host logic with no CUDA dependency, compiled into
// tandem_grouped_gemm and into the CPU unit tests.
#include "tandem/kernels/grouped_gemm_plan.hpp"

#include <algorithm>

namespace tandem::kernels {

// Why the cut at 128 rows: the tiled path pads every group to 128-row tiles and multiplies 128 x 256 tiles, so at a
// few rows per expert it spends its time on padding (moe_ffn at 8-128 tokens x top-8 over 32 experts took 914-1053 us
// on an H100 against about 420 us to read the routed experts' weights once). The swap-AB path streams each routed
// expert's weight once per token tile, the layouts core's small-M form (gemm_layouts_plan.cpp: 85-98% of copy
// bandwidth at M <= 256). Tile widths follow that rule's M buckets (16, 64, 128). Not yet measured on the grouped
// shapes: grouped_gemm_bench --decode prints both paths.
GroupedGemmPlan groupedGemmPlanFor(int64_t mTotal, int64_t maxGroupRows, GroupedGemmPath requested) {
  const int64_t m = std::max<int64_t>(mTotal, 0);
  const int64_t bound = maxGroupRows > 0 ? std::min(maxGroupRows, m) : m;
  GroupedGemmPlan plan;
  const bool swap = requested == GroupedGemmPath::kSwapAB ||
                    (requested != GroupedGemmPath::kTiled && bound <= kGroupedSwapMaxRows);
  if (!swap) return plan;
  plan.path = GroupedGemmPath::kSwapAB;
  plan.tileN = bound <= 16 ? 16 : bound <= 64 ? 64 : 128;
  return plan;
}

std::string groupedGemmPlanName(const GroupedGemmPlan& plan) {
  if (plan.path == GroupedGemmPath::kSwapAB) return "swapab/n" + std::to_string(plan.tileN);
  return "tiled";
}

}  // namespace tandem::kernels
