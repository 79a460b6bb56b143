// The plan of a grouped GEMM (grouped_gemm.hpp): the 128-row tiled path or the swap-AB small-rows path, and the
// latter's token tile width. Host logic only, no CUDA header, so that the rule builds and is tested without the CUDA
// toolkit (kernels/grouped_gemm_plan.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace tandem::kernels {

/// How a grouped GEMM is tiled.
enum class GroupedGemmPath : uint8_t {
  kAuto = 0,    ///< groupedGemmPlanFor's rule picks
  kTiled = 1,   ///< 128 x 256 tiles over each group's rows (x rows are wgmma M): for groups of hundreds of rows
  kSwapAB = 2,  ///< small groups: the weight's rows are wgmma M in 128-row tiles and a group's rows are wgmma N in
                ///< tiles of 16, 64 or 128, so a group of a few rows costs one pass over its expert's weight
};

/// A plan: the path and, for kSwapAB, the token tile width (16, 64 or 128; 0 for kTiled).
struct GroupedGemmPlan {
  GroupedGemmPath path = GroupedGemmPath::kTiled;
  int32_t tileN = 0;
};

/// kSwapAB serves groups of up to this many rows in one token tile (the widest swap-AB tile).
inline constexpr int64_t kGroupedSwapMaxRows = 128;

/// The rule. bound = the largest rows any group can have: maxGroupRows when > 0 (the caller's bound, e.g. the tokens
/// per rank of a top-k routing, which sends a token to k distinct experts), else mTotal; never more than mTotal.
/// kAuto takes kSwapAB when bound <= kGroupedSwapMaxRows, else kTiled. kSwapAB's tile width is the narrowest of 16,
/// 64, 128 that holds bound rows (128 when bound is larger). `requested` kTiled or kSwapAB is obeyed. Either path is
/// correct for any grouping: a group longer than the tile takes further token tiles (each one more pass over its
/// expert's weight), so a wrong bound costs time, never correctness.
GroupedGemmPlan groupedGemmPlanFor(int64_t mTotal, int64_t maxGroupRows, GroupedGemmPath requested);

/// "swapab/n16", "tiled".
std::string groupedGemmPlanName(const GroupedGemmPlan& plan);

}  // namespace tandem::kernels
