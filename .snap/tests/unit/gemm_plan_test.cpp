// The layout GEMM's plan rule (tandem/kernels/gemm_layouts_plan.hpp): host logic, no GPU. The expectations at
// N = K = 8192 are the measured best plans of gemm_layouts_plan.cpp's table.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "tandem/kernels/gemm_layouts_plan.hpp"

using tandem::kernels::GemmLayout;
using tandem::kernels::GemmLayoutPlan;
using tandem::kernels::GemmPath;
using tandem::kernels::gemmPlanFor;
using tandem::kernels::gemmPlanName;

namespace {

std::string planName(GemmLayout l, int64_t m, int64_t n, int64_t k, int sms = 132) {
  return gemmPlanName(gemmPlanFor(l, m, n, k, sms));
}

}  // namespace

TEST_CASE("gemm plan rule: swap-AB tile widths per M bucket at the decode shapes") {
  for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB}) {
    CAPTURE(static_cast<int>(l));
    CHECK(planName(l, 1, 8192, 8192) == "swapab/n16/split2");    // 64 tiles x 2 = 128 of 132 SMs
    CHECK(planName(l, 16, 8192, 8192) == "swapab/n16/split2");
    CHECK(planName(l, 17, 8192, 8192) == "swapab/n64/split1");   // 64-wide: 64 tiles fill half the SMs
    CHECK(planName(l, 64, 8192, 8192) == "swapab/n64/split1");
    CHECK(planName(l, 65, 8192, 8192) == "swapab/n128/split1");
    CHECK(planName(l, 128, 8192, 8192) == "swapab/n128/split1");
    CHECK(planName(l, 256, 8192, 8192) == "swapab/n128/split1");  // two column tiles: 128 tiles
    CHECK(planName(l, 257, 8192, 8192) == "tiled/n256/split4");   // 96 tiles: 4 splits fill 97%
  }
}

TEST_CASE("gemm plan rule: K splits fill the SMs, wide swap-AB tiles half of them") {
  CHECK(planName(GemmLayout::kABt, 16, 28672, 8192) == "swapab/n16/split1");  // 224 tiles: no split
  CHECK(planName(GemmLayout::kABt, 16, 8192, 128) == "swapab/n16/split1");    // 2 k-blocks: too few to split
  CHECK(planName(GemmLayout::kABt, 16, 8192, 512) == "swapab/n16/split2");    // 8 k-blocks: 4 per split
  CHECK(planName(GemmLayout::kABt, 16, 14336, 4096) == "swapab/n16/split1");  // 112 tiles: 85% of the SMs, no split
  CHECK(planName(GemmLayout::kABt, 16, 12288, 4096) == "swapab/n16/split4");  // 96 tiles (73%): 384 of 396 slots
  CHECK(planName(GemmLayout::kABt, 16, 4096, 4096) == "swapab/n16/split4");   // 32 tiles x 4 = 128 of 132
  CHECK(planName(GemmLayout::kAB, 64, 4096, 4096) == "swapab/n64/split2");    // 32 tiles x 2 = 64 of 66
  CHECK(planName(GemmLayout::kAB, 128, 2048, 8192) == "swapab/n128/split4");  // 16 tiles x 4 = 64 of 66
  CHECK(planName(GemmLayout::kAB, 64, 4096, 4096, 1) == "swapab/n64/split1"); // one SM: nothing to fill
}

TEST_CASE("gemm plan rule: wgrad and large M take the tiled path") {
  CHECK(planName(GemmLayout::kAtB, 1, 8192, 8192) == "tiled/n256/split4");  // wgrad never swaps; 1 x 32 tiles
  CHECK(planName(GemmLayout::kAtB, 256, 256, 8192) == "tiled/n256/split32");  // 2 tiles: 32 splits of 4 k-blocks
  CHECK(planName(GemmLayout::kABt, 8192, 8192, 8192) == "tiled/n256/split1");
  CHECK(planName(GemmLayout::kAtB, 8192, 8192, 16384) == "tiled/n256/split1");
}

TEST_CASE("gemm plan rule: every plan it makes is one the launcher takes") {
  for (GemmLayout l : {GemmLayout::kABt, GemmLayout::kAB, GemmLayout::kAtB}) {
    for (int64_t m : {1, 7, 16, 33, 64, 100, 128, 200, 256, 300, 4096}) {
      for (int64_t n : {1, 136, 1000, 8192, 28672}) {
        for (int64_t k : {1, 40, 520, 8192}) {
          const GemmLayoutPlan p = gemmPlanFor(l, m, n, k, 132);
          CAPTURE(gemmPlanName(p));
          CHECK(p.splits >= 1);
          CHECK(p.splits <= tandem::kernels::kGemmLayoutMaxSplits);
          if (p.path == GemmPath::kSwapAB) {
            CHECK(l != GemmLayout::kAtB);
            CHECK(m <= 256);
            CHECK((p.tileN == 16 || p.tileN == 64 || p.tileN == 128));
          } else {
            CHECK(p.tileN == 256);
          }
          // A split needs at least 4 k-blocks of 64 each.
          if (p.splits > 1) CHECK((k + 63) / 64 >= 4 * int64_t(p.splits));
        }
      }
    }
  }
}
