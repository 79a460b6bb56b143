// Hopper (sm_90a) FP8 GEMM core: the device building blocks of kernels/gemm_fp8.cu (public API
// tandem/kernels/gemm_fp8.hpp). No __global__ here.
//
// D [M, N] = A [M, K] * B [N, K]^T, both operands K-major fp8 (wgmma reads 8-bit operands K-major only). The pipeline
// is the GEMM layouts core's (device/gemm_layouts_sm90.cuh): warpgroup 0 is the TMA producer (one elected thread),
// warpgroups 1 and 2 consume, each owning 64 rows of the 128 x 256 tile; persistent over the tiles in a grouped raster
// order; no split-K, so every output element sums its k-blocks in one fixed order (bitwise repeatable).
//
// Shared memory per stage: one k-block of 128 fp8 = 128 bytes = one 128-byte swizzle row, so the tiles, descriptors
// and k-step advance are the 16-bit core's K-major ones (one wgmma k-step of 32 fp8 = 32 bytes):
//   A: TMA box {128 k, 128 rows} = 16 KiB;  B: TMA box {128 k, 256 rows} = 32 KiB;
//   block scaling adds A's 128 row scales of the k-block (TMA box {128 rows, 1 k-block} of fp32 = 512 bytes).
//
// Per-tensor scaling: wgmma m64n256k32 accumulates the whole K into one fp32 accumulator; the epilogue multiplies by
// sa * sb.
// Block scaling (DeepSeek-V3): for each k-block (exactly one scale block of 128 k), wgmma accumulates into a fresh fp32
// accumulator, which is then scaled by sa[row] * sb[column block] and added to the main fp32 accumulator in registers.
// Promotion every 128 k is needed twice over: the scales change every 128 k, and the tensor cores' fp8 accumulation
// keeps only about 14 bits of mantissa (DeepSeek-V3 technical report, section 3.3.2: a K = 4096 product lost ~2%
// relative accuracy without promotion); adding each 128-k partial in true fp32 on the CUDA cores bounds that loss to
// one block's worth. Registers decide the shape of that loop: the main accumulator of 64 x 256 is 128 floats per
// thread, so the fresh one covers half the columns (m64n128, 64 floats): each k-block runs two halves, and each half's
// columns [128 h, 128 h + 128) lie in exactly one of B's 128-wide scale blocks when the tile starts on a multiple of
// 256. A half waits for its own wgmmas before promoting (wgmma.wait_group 0); the other consumer warpgroup's wgmmas
// keep the tensor cores busy meanwhile.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/gemm_layouts_sm90.cuh"  // K-major 128-byte-swizzle descriptors, named barriers, st.shared helpers
#include "device/gemm_sm90.cuh"          // PTX wrappers (mbarrier, TMA, wgmma fences), PipeState, GroupedRaster

namespace tandem::kernels::gemm_fp8 {

using gemm::GroupedRaster;
using gemm::PipeState;
using gemm::TileCoord;
using gemm_layouts::Barrier;
using gemm_layouts::barSync;
using gemm_layouts::Major;

enum class Scaling : uint8_t { kPerTensor = 0, kBlock = 1 };

// fp8 operand types (tags for the wgmma instruction's .atype / .btype).
struct E4M3 {};
struct E5M2 {};

// ---------------------------------------------------------------------------------------------------------------
// Geometry (the host launcher in gemm_fp8.cu reads these).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kBlockRows = 128;  // two consumer warpgroups of 64 rows
inline constexpr int kBlockCols = 256;
inline constexpr int kBlockK = 128;     // 128 fp8 = 128 bytes = one swizzle row; also the scale block's k extent
inline constexpr int kMmaK = 32;
inline constexpr int kHalfCols = 128;   // block scaling: columns per fresh accumulator (one B scale block)
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kRowsPerConsumer = 64;
inline constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
inline constexpr uint32_t kChunkBytes = 64 * 128;  // epilogue chunk: 64 rows of 128 bytes
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
inline constexpr uint32_t kABytes = kBlockRows * kBlockK;
inline constexpr uint32_t kBBytes = kBlockCols * kBlockK;
// A's row scales of one stage: a box of the tile's 128 rows plus 4. A box's first element must be 16-byte aligned in
// global memory (TMA raises an illegal instruction otherwise), so a tile whose first row is not a multiple of 4 (the
// FP8 grouped GEMM's tiles start at their group's first row) loads from the multiple of 4 at or below it and reads its
// scales at that shift; the core's tiles start at multiples of 128 (shift 0). Each stage's box lands 128-byte aligned
// in shared memory (TMA's destination rule), so the stages lie kScaleAStride floats apart.
inline constexpr int kScaleABoxRows = kBlockRows + 4;
inline constexpr int kScaleAStride = kBlockRows + 32;
static_assert(kScaleAStride >= kScaleABoxRows && kScaleAStride * sizeof(float) % 128 == 0);
inline constexpr uint32_t kScaleABytes = kScaleABoxRows * sizeof(float);
inline constexpr size_t kSmemLimit = 227 * 1024;  // H100/H200 opt-in shared memory per block
static_assert(kBlockK == 128, "one k-block must be exactly one scale block");

// Four stages in both modes. The per-tensor epilogue double-buffers its TMA-store chunks per warpgroup; block scaling
// adds 512 bytes a stage, and four stages with double buffers would pass the limit by 64 bytes, so its epilogue uses
// one buffer per warpgroup (it then waits for each chunk's store to finish reading, once per tile).
template <Scaling S>
struct Geometry {
  static constexpr int kStages = 4;
  static constexpr int kEpiBufs = S == Scaling::kBlock ? 1 : 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes + (S == Scaling::kBlock ? kScaleABytes : 0);
};

template <Scaling S>
struct SharedStorage {
  using G = Geometry<S>;
  alignas(1024) uint8_t a[G::kStages][kABytes];
  alignas(1024) uint8_t b[G::kStages][kBBytes];
  alignas(1024) uint8_t c[kConsumerWarpgroups][G::kEpiBufs][kChunkBytes];
  alignas(128) float sfa[S == Scaling::kBlock ? G::kStages : 1][kScaleAStride];  // block: A's row scales per stage
  alignas(8) uint64_t full[G::kStages];  // TMA bytes landed (1 arrival: the producer's expect_tx)
  uint64_t empty[G::kStages];            // both consumer warpgroups done with the stage
};
template <Scaling S>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<S>) + 1024;  // + alignment slack
static_assert(kSmemBytes<Scaling::kPerTensor> <= kSmemLimit && kSmemBytes<Scaling::kBlock> <= kSmemLimit,
              "shared memory over the H100/H200 opt-in limit");

// ---------------------------------------------------------------------------------------------------------------
// Kernel parameters (POD, passed as const __grid_constant__ so the tensor maps live in param space).
// ---------------------------------------------------------------------------------------------------------------
struct KernelParams {
  CUtensorMap tmA;    // A [m, k] fp8: {k, m}, box {128, 128}, 128-byte swizzle
  CUtensorMap tmB;    // B [n, k] fp8: {k, n}, box {128, 256}, 128-byte swizzle
  CUtensorMap tmC;    // C [m, n]: {n, m}, box {128 bytes of elements, 64}, 128-byte swizzle
  CUtensorMap tmSfa;  // block: A's scales [k-blocks, ldsa] fp32: {m, k-blocks}, box {132, 1}; unused per tensor
  const float* scaleA;  // per tensor: one fp32
  const float* scaleB;  // per tensor: one fp32; block: [ceil(n / 128), numKBlocks]
  void* c;              // C's base and row stride (elements), for the direct stores of a ragged last chunk
  int64_t ldc;
  int32_t rows, cols;   // m, n
  int32_t numKBlocks;
  int32_t tilesRows, tilesCols, groupRows;
  int32_t pad0[2];
};
static_assert(sizeof(KernelParams) % 64 == 0);

// ---------------------------------------------------------------------------------------------------------------
// wgmma m64nNk32, both operands K-major from shared memory, fp32 accumulators. scaleD == 0 overwrites D.
// ---------------------------------------------------------------------------------------------------------------
#define TANDEM_FP8_WGMMA_N128(TA, TB)                                                                           \
  asm volatile(                                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                              \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." TA "." TB " "                                              \
      "{"                                                                                                       \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                          \
      "}, %64, %65, p, 1, 1;\n}\n"                                                                              \
      :                                                                                                         \
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
      : "l"(descA), "l"(descB), "r"(scaleD))

#define TANDEM_FP8_WGMMA_N256(TA, TB)                                                                                   \
  asm volatile(                                                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                     \
      "wgmma.mma_async.sync.aligned.m64n256k32.f32." TA "." TB " "                                                      \
      "{"                                                                                                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                    \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"                  \
      "}, %128, %129, p, 1, 1;\n}\n"                                                                                    \
      :                                                                                                                 \
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),         \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),         \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),         \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),         \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),         \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),     \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
      : "l"(descA), "l"(descB), "r"(scaleD))

template <class TA, class TB, int N>
struct Wgmma;

#define TANDEM_FP8_WGMMA_SPECIALISE(TA, TB, SA, SB)                                                            \
  template <>                                                                                                  \
  struct Wgmma<TA, TB, 128> {                                                                                  \
    __device__ __forceinline__ static void run(float (&d)[64], uint64_t descA, uint64_t descB, uint32_t scaleD) { \
      TANDEM_FP8_WGMMA_N128(SA, SB);                                                                           \
    }                                                                                                          \
  };                                                                                                           \
  template <>                                                                                                  \
  struct Wgmma<TA, TB, 256> {                                                                                  \
    __device__ __forceinline__ static void run(float (&d)[128], uint64_t descA, uint64_t descB, uint32_t scaleD) { \
      TANDEM_FP8_WGMMA_N256(SA, SB);                                                                           \
    }                                                                                                          \
  };
TANDEM_FP8_WGMMA_SPECIALISE(E4M3, E4M3, "e4m3", "e4m3")
TANDEM_FP8_WGMMA_SPECIALISE(E4M3, E5M2, "e4m3", "e5m2")
TANDEM_FP8_WGMMA_SPECIALISE(E5M2, E4M3, "e5m2", "e4m3")
TANDEM_FP8_WGMMA_SPECIALISE(E5M2, E5M2, "e5m2", "e5m2")
#undef TANDEM_FP8_WGMMA_SPECIALISE
#undef TANDEM_FP8_WGMMA_N128
#undef TANDEM_FP8_WGMMA_N256

// K-major, 128-byte swizzle: the 16-bit core's descriptor; one k-step of 32 fp8 is 32 bytes, as one of 16 halves.
__device__ __forceinline__ uint64_t makeDesc(uint32_t addr) { return gemm_layouts::makeDesc<Major::kK>(addr); }
inline constexpr uint64_t kDescKStep = (kMmaK * 1) >> 4;
static_assert(kDescKStep == gemm_layouts::kDescKStep<Major::kK>);
inline constexpr uint64_t kDescHalfCols = (kHalfCols * 128) >> 4;  // B rows [128, 256) of the stage: 16 KiB on

__device__ __forceinline__ GroupedRaster rasterOf(const KernelParams& p) {
  return GroupedRaster{p.tilesRows, p.tilesCols, p.groupRows};
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread. Streams every k-block of each tile into the stage ring. TMA zero-fills what lies past M, N or
// K (and counts those bytes toward the barrier's transaction), so edge tiles need no special case: zero products past
// K, and rows / columns past M / N that the epilogue never stores.
// ---------------------------------------------------------------------------------------------------------------
template <Scaling S>
__device__ __forceinline__ void runProducer(const KernelParams& p, SharedStorage<S>& s, int32_t firstTile,
                                            int32_t tileStride) {
  using G = Geometry<S>;
  PipeState<G::kStages> ps;
  const GroupedRaster order = rasterOf(p);
  const int32_t numTiles = order.numWork();
  for (int32_t w = firstTile; w < numTiles; w += tileStride) {
    const TileCoord tc = order(w);
    const int32_t row0 = tc.unitM * kBlockRows;
    const int32_t col0 = tc.tileN * kBlockCols;
    for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
      // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
      gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
      gemm::mbarArriveExpectTx(&s.full[ps.stage], G::kStageBytes);
      gemm::tmaLoad2d(&p.tmA, s.a[ps.stage], &s.full[ps.stage], kb * kBlockK, row0);
      gemm::tmaLoad2d(&p.tmB, s.b[ps.stage], &s.full[ps.stage], kb * kBlockK, col0);
      if constexpr (S == Scaling::kBlock) gemm::tmaLoad2d(&p.tmSfa, s.sfa[ps.stage], &s.full[ps.stage], row0, kb);
      ps.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogue: one consumer warpgroup's 64 x 256 fp32 accumulators (wgmma m64n256 layout) to C rows
// [rowBase, rowBase + 64) from column col0, through 64 x 128-byte swizzled chunks and TMA stores (which clip at C's
// last row). Bufs chunk buffers per warpgroup, used round robin; epiChunks counts this warpgroup's committed chunks.
// NOTE: a TMA store clips columns only to 16-byte granules (seen on an H100: with n = 257 a bf16 store wrote columns
// up to 263 of a padded C), so the chunk that holds C's last column, when n * sizeof(Out) is not a multiple of 16,
// goes out through masked direct stores instead, leaving C's padding columns untouched.
// ---------------------------------------------------------------------------------------------------------------
template <class Out>
__device__ __forceinline__ void storeChunkDirect(const KernelParams& p, const float (&acc)[128], int c, int32_t rowBase,
                                                 int32_t col0, int r, uint32_t q) {
  constexpr int kCols = 128 / static_cast<int>(sizeof(Out));
  Out* const out = static_cast<Out*>(p.c);
  // j runs over the whole tile so that acc is indexed by constants only (a run-time index would put it in local
  // memory); the columns before chunk c are skipped, those past n masked.
#pragma unroll
  for (int j = 0; j < kBlockCols / 8; ++j) {
    if (j * 8 < c * kCols) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int32_t row = rowBase + r + 8 * h;
        const int32_t col = col0 + j * 8 + static_cast<int32_t>(q) * 2 + e;
        if (row < p.rows && col < p.cols) {
          const float v = acc[4 * j + 2 * h + e];
          if constexpr (sizeof(Out) == 2) {
            out[static_cast<int64_t>(row) * p.ldc + col] = __float2bfloat16_rn(v);
          } else {
            out[static_cast<int64_t>(row) * p.ldc + col] = v;
          }
        }
      }
    }
  }
}

template <class Out, int Bufs>
__device__ __forceinline__ void storeTile(const KernelParams& p, uint8_t (&cbuf)[Bufs][kChunkBytes],
                                          const float (&acc)[128], int32_t rowBase, int32_t col0, int t,
                                          Barrier epiBar, uint32_t& epiChunks) {
  constexpr int kCols = 128 / static_cast<int>(sizeof(Out));  // output columns per 128-byte chunk row
  const int warp = t / 32;
  const int lane = t % 32;
  const int r = warp * 16 + lane / 4;  // accumulator rows r and r + 8 (same swizzle phase r & 7)
  const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
  const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
  const uint32_t phase = static_cast<uint32_t>(r & 7);
  const uint32_t q = static_cast<uint32_t>(lane & 3);
  const bool ragged = p.cols % (16 / static_cast<int>(sizeof(Out))) != 0;
#pragma unroll
  for (int c = 0; c < kBlockCols / kCols; ++c) {
    if (col0 + c * kCols >= p.cols) break;  // uniform: the rest of the tile lies past the edge
    if (ragged && col0 + (c + 1) * kCols > p.cols) {  // uniform: the chunk of C's last column (see the NOTE above)
      storeChunkDirect<Out>(p, acc, c, rowBase, col0, r, q);
      break;
    }
    const uint32_t buf = epiChunks % Bufs;
    if (epiChunks >= static_cast<uint32_t>(Bufs)) {
      // The store issued from this buffer Bufs chunks ago must have finished reading it.
      if (t == 0) gemm::bulkWaitRead<Bufs - 1>();
      barSync(epiBar, 128);
    }
    const uint32_t base = gemm::smemAddr(cbuf[buf]);
    gemm_layouts::stageSwizzledChunk<Out, __nv_bfloat16, kCols>(base, rowOff0, rowOff1, phase, q, acc, c);
    gemm::fenceProxyAsyncShared();  // our st.shared -> visible to the TMA engine
    barSync(epiBar, 128);           // publishes the whole chunk to thread 0
    if (t == 0) {
      gemm::tmaStore2d(&p.tmC, base, col0 + c * kCols, rowBase);
      gemm::bulkCommit();
    }
    ++epiChunks;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Main loops of one consumer warpgroup over one tile (all k-blocks); ps is the warpgroup's ring position.
// ---------------------------------------------------------------------------------------------------------------

// Per tensor: the whole K into acc; k-block kb's wgmmas overlap kb + 1's wait (wait_group 1 releases the stage of kb - 1).
template <class TA, class TB, int Stages>
__device__ __forceinline__ void mainLoopPerTensor(const KernelParams& p, SharedStorage<Scaling::kPerTensor>& s,
                                                  PipeState<Stages>& ps, float (&acc)[128], uint32_t aOffset, int t) {
  int prevStage = 0;
  for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
    gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage landed
    const uint64_t descA = makeDesc(gemm::smemAddr(s.a[ps.stage]) + aOffset);
    const uint64_t descB = makeDesc(gemm::smemAddr(s.b[ps.stage]));
    gemm::fenceAccumulators(acc);
    gemm::wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
      Wgmma<TA, TB, 256>::run(acc, descA + kk * kDescKStep, descB + kk * kDescKStep, (kb > 0 || kk > 0) ? 1u : 0u);
    }
    gemm::wgmmaCommit();
    gemm::fenceAccumulators(acc);
    gemm::wgmmaWait<1>();  // the previous k-block's wgmmas are done: its stage can be refilled
    // Pairs with the producer's mbarWait(empty): this warpgroup's wgmma reads of that stage are complete.
    if (kb > 0 && t == 0) gemm::mbarArrive(&s.empty[prevStage]);
    prevStage = ps.stage;
    ps.advance();
  }
  gemm::wgmmaWait<0>();
  gemm::fenceAccumulators(acc);
  if (t == 0) gemm::mbarArrive(&s.empty[prevStage]);
  const float scale = __ldg(p.scaleA) * __ldg(p.scaleB);
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] *= scale;
}

// B's scales as mainLoopBlock reads them: half h (columns [128 h, 128 h + 128) of the tile) takes
// half[h][kb * kbStep] for k-block kb; a half that is not live (wholly past N) is skipped, its pointer unread. The
// core passes one 128 x 128 block per half (kbStep 1); the FP8 grouped GEMM also passes its SwiGLU tile's gate and up
// blocks, or one scale per expert (kbStep 0).
struct BlockScalesB {
  const float* half[2];
  int32_t kbStep;
  bool secondHalf;
};

// The core's B scales for the tile at col0: scaleB [ceil(n / 128), numKBlocks], row-major.
__device__ __forceinline__ BlockScalesB blockScalesB(const KernelParams& p, int32_t col0) {
  const int32_t nb0 = col0 / kHalfCols;
  const bool secondHalf = col0 + kHalfCols < p.cols;
  const float* const sb0 = p.scaleB + static_cast<int64_t>(nb0) * p.numKBlocks;
  return BlockScalesB{{sb0, sb0 + (secondHalf ? p.numKBlocks : 0)}, 1, secondHalf};
}

// Block scaled: per k-block and column half, a fresh m64n128 accumulator, promoted into acc with its two scales (see
// the file comment for why every 128 k). wg: this warpgroup's index (0, 1). Reads the stage ring of s (A, B and A's
// row scales of each k-block, the tile's first row at index sfaShift of the box: see kScaleABoxRows) and no kernel
// parameters, so other kernels on this storage (the FP8 grouped GEMM) run it too. numKBlocks by reference: callers pass
// their parameter-space field, read where the loop needs it.
template <class TA, class TB, int Stages>
__device__ __forceinline__ void mainLoopBlock(SharedStorage<Scaling::kBlock>& s, PipeState<Stages>& ps,
                                              float (&acc)[128], const int32_t& numKBlocks, const BlockScalesB& sb,
                                              int sfaShift, int wg, int t) {
  float part[64];
  // This thread's accumulator rows r and r + 8 of the warpgroup's 64, and r's index in the stage's scale box.
  const int r = (t / 32) * 16 + (t % 32) / 4;
  const int sr = sfaShift + wg * kRowsPerConsumer + r;
  const uint32_t aOffset = static_cast<uint32_t>(wg) * kChunkBytes;
  const bool secondHalf = sb.secondHalf;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  for (int32_t kb = 0; kb < numKBlocks; ++kb) {
    // B's scales come from global memory (L1/L2-resident, uniform over the warpgroup), loaded before the wait so
    // that their latency hides behind it.
    const float sbh[2] = {__ldg(sb.half[0] + kb * sb.kbStep), __ldg(sb.half[1] + kb * sb.kbStep)};
    gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage (and its A scales) landed
    const float sa0 = s.sfa[ps.stage][sr];
    const float sa1 = s.sfa[ps.stage][sr + 8];
    const uint64_t descA = makeDesc(gemm::smemAddr(s.a[ps.stage]) + aOffset);
    const uint64_t descB = makeDesc(gemm::smemAddr(s.b[ps.stage]));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool live = h == 0 || secondHalf;  // warpgroup-uniform
      if (live) {
        gemm::fenceAccumulators(part);
        gemm::wgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
          Wgmma<TA, TB, 128>::run(part, descA + kk * kDescKStep, descB + h * kDescHalfCols + kk * kDescKStep,
                                  kk > 0 ? 1u : 0u);
        }
        gemm::wgmmaCommit();
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(part);
      }
      // Pairs with the producer's mbarWait(empty): this warpgroup's wgmma reads of the stage (and its reads of the
      // A scales above) are complete.
      if (h == 1 && t == 0) gemm::mbarArrive(&s.empty[ps.stage]);
      if (live) {
        const float s0 = sa0 * sbh[h];
        const float s1 = sa1 * sbh[h];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[h * 64 + 4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[h * 64 + 4 * j + 0]);
          acc[h * 64 + 4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[h * 64 + 4 * j + 1]);
          acc[h * 64 + 4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[h * 64 + 4 * j + 2]);
          acc[h * 64 + 4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[h * 64 + 4 * j + 3]);
        }
      }
    }
    ps.advance();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): rows [64 wg, 64 wg + 64) of each tile; t = thread index within the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class TA, class TB, class Out, Scaling S>
__device__ __forceinline__ void runConsumer(const KernelParams& p, SharedStorage<S>& s, int32_t firstTile,
                                            int32_t tileStride, int wg, int t) {
  using G = Geometry<S>;
  float acc[128];
  PipeState<G::kStages> ps;
  uint32_t epiChunks = 0;  // TMA-store chunks committed by this warpgroup (thread 0 tracks the bulk groups)
  const Barrier epiBar = wg == 0 ? Barrier::kEpilogue0 : Barrier::kEpilogue1;
  const GroupedRaster order = rasterOf(p);
  const int32_t numTiles = order.numWork();
  for (int32_t w = firstTile; w < numTiles; w += tileStride) {
    const TileCoord tc = order(w);
    const int32_t row0 = tc.unitM * kBlockRows;
    const int32_t col0 = tc.tileN * kBlockCols;
    if constexpr (S == Scaling::kBlock) {
      mainLoopBlock<TA, TB>(s, ps, acc, p.numKBlocks, blockScalesB(p, col0), 0, wg, t);
    } else {
      mainLoopPerTensor<TA, TB>(p, s, ps, acc, static_cast<uint32_t>(wg) * kChunkBytes, t);
    }
    const int32_t rowBase = row0 + wg * kRowsPerConsumer;
    if (rowBase >= p.rows) continue;  // warpgroup-uniform: nothing of ours lies inside C
    storeTile<Out, G::kEpiBufs>(p, s.c[wg], acc, rowBase, col0, t, epiBar, epiChunks);
  }
  if (t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads, kSmemBytes<S> of dynamic
// shared memory. Worker `cta` of `numCtas` takes tiles cta, cta + numCtas, ...
// ---------------------------------------------------------------------------------------------------------------
template <class TA, class TB, class Out, Scaling S>
__device__ __forceinline__ void runCta(const KernelParams& p, uint8_t* smemRaw, int32_t cta, int32_t numCtas) {
  using Storage = SharedStorage<S>;
  using G = Geometry<S>;
  auto& s = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) & ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
#pragma unroll
    for (int i = 0; i < G::kStages; ++i) {
      gemm::mbarInit(&s.full[i], 1);
      gemm::mbarInit(&s.empty[i], kConsumerWarpgroups);
    }
    gemm::fenceBarrierInit();
    gemm::prefetchTensorMap(&p.tmA);
    gemm::prefetchTensorMap(&p.tmB);
    gemm::prefetchTensorMap(&p.tmC);
    if constexpr (S == Scaling::kBlock) gemm::prefetchTensorMap(&p.tmSfa);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<kProducerRegs>();
      if (t == 0) runProducer<S>(p, s, cta, numCtas);
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<kConsumerRegs>();
      runConsumer<TA, TB, Out, S>(p, s, cta, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::gemm_fp8
