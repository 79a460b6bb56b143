// The plan of a layout GEMM (gemm_layouts.hpp): which path, tile width and K splits. Host logic only, no CUDA
// header, so that the rule builds and is tested without the CUDA toolkit (kernels/gemm_layouts_plan.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace tandem::kernels {

/// Which operand is K-major; see the table in gemm_layouts.hpp.
enum class GemmLayout : uint8_t {
  kABt = 0,  ///< C = A * B^T; A [M, K], B [N, K]: both K-major (the forward GEMM, gemm.hpp's layout)
  kAB = 1,   ///< C = A * B;   A [M, K] K-major, B [K, N] N-major (dgrad)
  kAtB = 2,  ///< C = A^T * B; A [K, M] M-major, B [K, N] N-major (wgrad)
};

/// How a GEMM is tiled.
enum class GemmPath : uint8_t {
  kTiled = 0,   ///< 128 x 256 tiles of C, persistent grid; any layout
  kSwapAB = 1,  ///< small M: C^T = B' * A' with the weight's N as wgmma M (128-row tiles, no padding rows) and the M
                ///< token rows as wgmma N (tileN = 16, 64, 128 or 256); layouts kABt and kAB only
};

/// A plan: the path, its tile width along the wgmma N direction, and the K splits per tile. splits > 1 needs a
/// workspace (gemmLayoutWorkspaceBytes); the partial tiles are summed in split order, so results are bitwise
/// repeatable.
struct GemmLayoutPlan {
  GemmPath path = GemmPath::kTiled;
  int32_t tileN = 256;  ///< kTiled: 256; kSwapAB: 16, 64, 128 or 256 (>= M is one column of tiles)
  /// 1..kGemmLayoutMaxSplits K splits per tile; clamped so that every split gets at least one k-block, and to 1 past
  /// kGemmLayoutMaxSplitTiles tiles.
  int32_t splits = 1;
};

/// Geometry the rule works in: 128-row tiles along the wgmma M direction, k-blocks of 64.
inline constexpr int64_t kGemmLayoutBlockRows = 128;
inline constexpr int64_t kGemmLayoutBlockK = 64;
inline constexpr int32_t kGemmLayoutMaxSplits = 64;
/// Split-K takes at most this many tiles (one arrival counter each, in a fixed area at the start of the workspace);
/// a GEMM with more tiles fills any GPU many times over without splitting.
inline constexpr int64_t kGemmLayoutMaxSplitTiles = 8192;

/// The rule (measured on an H100; see gemm_layouts_plan.cpp): kSwapAB for M <= 256 in layouts kABt and kAB with
/// tileN 16 for M <= 16, 64 for M <= 64, 128 for M <= 256 (two column tiles past 128); else kTiled. Then K splits,
/// only while there are fewer tiles than the SMs to fill: the fewest that fill them to within 90% of whole waves of
/// work units, keeping at least 4 k-blocks (of 64) per split. The SMs to fill are all `numSms` for the 16-wide
/// swap-AB tiles and kTiled, half of them for the 64- and 128-wide swap-AB tiles. numSms: the device's
/// multiprocessor count (132 on H100/H200).
GemmLayoutPlan gemmPlanFor(GemmLayout layout, int64_t m, int64_t n, int64_t k, int numSms);

/// "swapab/n16/split2", "tiled/n256/split1".
std::string gemmPlanName(const GemmLayoutPlan& plan);

}  // namespace tandem::kernels
