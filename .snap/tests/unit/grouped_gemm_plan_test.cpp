// The grouped GEMM's plan rule (tandem/kernels/grouped_gemm_plan.hpp): host logic, no GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "tandem/kernels/grouped_gemm_plan.hpp"

using tandem::kernels::GroupedGemmPath;
using tandem::kernels::groupedGemmPlanFor;
using tandem::kernels::groupedGemmPlanName;

namespace {

std::string planName(int64_t mTotal, int64_t maxGroupRows, GroupedGemmPath requested = GroupedGemmPath::kAuto) {
  return groupedGemmPlanName(groupedGemmPlanFor(mTotal, maxGroupRows, requested));
}

}  // namespace

TEST_CASE("grouped gemm plan: decode routings take swap-AB, the tile as narrow as the largest group allows") {
  // DeepSeek-V3 decode at one rank: T tokens x top-8 over 32 experts; a token's 8 experts are distinct, so no expert
  // gets more than T rows.
  CHECK(planName(1 * 8, 1) == "swapab/n16");
  CHECK(planName(8 * 8, 8) == "swapab/n16");
  CHECK(planName(16 * 8, 16) == "swapab/n16");
  CHECK(planName(17 * 8, 17) == "swapab/n64");
  CHECK(planName(32 * 8, 32) == "swapab/n64");
  CHECK(planName(64 * 8, 64) == "swapab/n64");
  CHECK(planName(65 * 8, 65) == "swapab/n128");
  CHECK(planName(128 * 8, 128) == "swapab/n128");
}

TEST_CASE("grouped gemm plan: groups that may pass 128 rows take the tiled path") {
  CHECK(planName(129 * 8, 129) == "tiled");
  CHECK(planName(4096, 0) == "tiled");     // no bound given: any group may hold all 4096 rows
  CHECK(planName(8192, 2048) == "tiled");  // prefill
}

TEST_CASE("grouped gemm plan: without a bound the total rows bound every group") {
  CHECK(planName(8, 0) == "swapab/n16");
  CHECK(planName(64, 0) == "swapab/n64");
  CHECK(planName(128, 0) == "swapab/n128");
  CHECK(planName(129, 0) == "tiled");
  CHECK(planName(40, 1000) == "swapab/n64");  // a bound above mTotal is clamped to it
  CHECK(planName(0, 0) == "swapab/n16");      // nothing to compute; the launcher enqueues nothing
}

TEST_CASE("grouped gemm plan: a requested path is obeyed") {
  CHECK(planName(8, 8, GroupedGemmPath::kTiled) == "tiled");
  CHECK(planName(4096, 0, GroupedGemmPath::kSwapAB) == "swapab/n128");  // long groups take several token tiles
  CHECK(planName(64, 16, GroupedGemmPath::kSwapAB) == "swapab/n16");
  const auto plan = groupedGemmPlanFor(1024, 128, GroupedGemmPath::kAuto);
  CHECK(plan.path == GroupedGemmPath::kSwapAB);
  CHECK(plan.tileN == 128);
  CHECK(groupedGemmPlanFor(1024, 0, GroupedGemmPath::kAuto).tileN == 0);
}
