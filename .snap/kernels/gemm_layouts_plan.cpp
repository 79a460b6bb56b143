// The layout GEMM's plan rule (gemm_layouts_plan.hpp): host logic with no CUDA dependency, compiled into
// tandem_gemm_layouts and into the CPU unit tests.
#include "tandem/kernels/gemm_layouts_plan.hpp"

#include <algorithm>

namespace tandem::kernels {
namespace {

constexpr int64_t kMinKBlocksPerSplit = 4;  // below this the fixed cost of a split (fill, partial round trip) dominates
constexpr int64_t kSwapMaxM = 256;          // the largest wgmma N

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The fewest K splits that fill `sms` SMs to within 90% of whole waves, when the tiles fill less than 80% of them. A
// split's fixed cost (partials out and back, the finishing CTA's sum) is more than the last fifth of the SMs gains:
// 14336 x 4096 at M <= 16 (112 tiles on 132 SMs) took 0.0373 ms unsplit, 0.0425 in 2 splits and 0.0577 in 7 (H200).
int32_t chooseSplits(int64_t tiles, int64_t numKBlocks, int64_t sms) {
  if (tiles * 5 >= sms * 4 || tiles > kGemmLayoutMaxSplitTiles) return 1;
  int32_t best = 1;
  double bestEff = 0.0;
  for (int32_t s = 1; s <= kGemmLayoutMaxSplits; ++s) {
    if (s > 1 && numKBlocks < kMinKBlocksPerSplit * s) break;
    const int64_t units = tiles * s;
    const int64_t waves = ceilDiv(units, sms);
    const double eff = static_cast<double>(units) / static_cast<double>(waves * sms);
    if (eff > bestEff + 1e-9) {
      best = s;
      bestEff = eff;
    }
    if (eff >= 0.9) break;
  }
  return best;
}

}  // namespace

// Tile widths and split targets from the swap-AB plan sweep of gemm_layouts_bench at N = K = 8192 on an H100 (132
// SMs, bf16; ms per GEMM for C = A*B^T / C = A*B):
//   M = 1:    n16 split2 0.0549 / 0.0526, n16 split1 0.0579 / 0.0549, n64 split1 0.0590 / 0.0586
//   M = 16:   n16 split2 0.0537 / 0.0526, n16 split1 0.0558 / 0.0553, n64 split1 0.0550 / 0.0573
//   M = 64:   n64 split1 0.0555 / 0.0568, n64 split2 0.0588 / 0.0575, n128 split2 0.0649 / 0.0638
//   M = 128:  n128 split1 0.0583 / 0.0542, n128 split2 0.0662 / 0.0650, n64 split1 0.0628 / 0.0647
//   M = 256:  n128 split1 0.0703 / 0.0714, n256 split2 0.0872 / 0.0839, n256 split1 0.0897 / 0.0887
// 16-wide tiles split to fill every SM. A 64- or 128-wide tile streams its weight band fast enough that 64 tiles
// (half the SMs) beat splitting them in two, so those widths split only to fill half the SMs.
GemmLayoutPlan gemmPlanFor(GemmLayout layout, int64_t m, int64_t n, int64_t k, int numSms) {
  GemmLayoutPlan plan;
  int64_t sms = std::max(1, numSms);
  if (layout != GemmLayout::kAtB && m <= kSwapMaxM) {
    plan.path = GemmPath::kSwapAB;
    plan.tileN = m <= 16 ? 16 : m <= 64 ? 64 : 128;
    if (plan.tileN > 16) sms = std::max<int64_t>(1, sms / 2);
  }
  const bool swap = plan.path == GemmPath::kSwapAB;
  const int64_t tiles = ceilDiv(std::max<int64_t>(1, swap ? n : m), kGemmLayoutBlockRows) *
                        ceilDiv(std::max<int64_t>(1, swap ? m : n), plan.tileN);
  plan.splits = chooseSplits(tiles, std::max<int64_t>(1, ceilDiv(k, kGemmLayoutBlockK)), sms);
  return plan;
}

std::string gemmPlanName(const GemmLayoutPlan& plan) {
  return std::string(plan.path == GemmPath::kSwapAB ? "swapab" : "tiled") + "/n" + std::to_string(plan.tileN) +
         "/split" + std::to_string(plan.splits);
}

}  // namespace tandem::kernels
