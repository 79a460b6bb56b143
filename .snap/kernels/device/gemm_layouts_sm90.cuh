// Hopper (sm_90a) GEMM core in every operand layout a training step needs, and its small-M (decode) form: the device
// building blocks of kernels/gemm_layouts.cu. No __global__ here.
//
// The kernel computes an accumulator tile D[rows, cols] = X[rows, K] * Y[cols, K]^T, where the wgmma "A" operand X
// gives the rows (wgmma M) and the "B" operand Y the columns (wgmma N). Either operand may be stored K-major (each of
// its rows holds K contiguous elements) or MN-major (each row of the stored matrix holds one k for many rows/columns).
// The operand's major-ness is the shared-memory layout TMA writes and the transpose bit of the wgmma instruction:
//   K-major:  TMA box {64 k, R rows} -> R rows of 128 bytes, 128-byte swizzle (8-row atoms of 1024 bytes); descriptor
//             stride byte offset (SBO) 1024 = next 8 rows; one k-step of 16 advances the start address by 32 bytes.
//   MN-major: TMA boxes {64 rows, 64 k} -> for each group of 64 rows, 64 k-rows of 128 bytes (8 KiB), 128-byte swizzle;
//             descriptor leading byte offset (LBO) 8 KiB = next 64 rows, SBO 1024 = next 8 k; one k-step of 16
//             advances the start address by 16 x 128 = 2048 bytes; wgmma's imm-trans bit = 1.
// The three public layouts map onto this (kernels/gemm_layouts.cu):
//   C = A * B^T (A [M,K], B [N,K]):  X = A (K-major), Y = B (K-major), D = C.
//   C = A * B   (A [M,K], B [K,N]):  X = A (K-major), Y = B (MN-major), D = C.
//   C = A^T * B (A [K,M], B [K,N]):  X = A (MN-major), Y = B (MN-major), D = C.
// Swapped (small M): X is the weight (the GEMM's N gives wgmma M, in 128-row tiles without padding) and Y the few
// token rows (wgmma N = 16, 64, 128 or 256), D = C^T; the epilogue stores D transposed.
//
// Block: warpgroup 0 is the TMA producer (one elected thread), warpgroups 1 and 2 consume, each owning 64 rows of the
// 128-row tile. Persistent: a CTA walks work units (tile, K split). Split-K partial tiles go to a global workspace in
// fragment order; the last CTA to finish a tile (a per-tile counter) sums all splits in split order 0, 1, ..., so the
// result does not depend on which CTA finishes last: bitwise repeatable.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/gemm_sm90.cuh"  // PTX wrappers (mbarrier, TMA, wgmma fences), PipeState, GroupedRaster
#include "device/ordering.cuh"

namespace tandem::kernels::gemm_layouts {

using gemm::GroupedRaster;
using gemm::PipeState;
using gemm::TileCoord;

enum class Major : uint8_t { kK = 0, kMN = 1 };

// ---------------------------------------------------------------------------------------------------------------
// Geometry (the host launcher in gemm_layouts.cu reads these).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kBlockRows = 128;  // wgmma M per CTA: two consumer warpgroups of 64 rows
inline constexpr int kBlockK = 64;      // 64 16-bit elements = 128 bytes = one swizzle row
inline constexpr int kMmaK = 16;
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kRowsPerConsumer = 64;
inline constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
inline constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
inline constexpr uint32_t kChunkBytes = 64 * 128;  // one {64, 64} 16-bit box: 64 rows of 128 bytes
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
inline constexpr uint32_t kABytes = kBlockRows * kBlockK * 2;
inline constexpr size_t kSmemLimit = 227 * 1024;  // H100/H200 opt-in shared memory per block

// Stages per tile width: as many as fit (more bytes in flight for the weight-streaming small-M tiles), at most 12.
template <int BN, bool EpiSmem>
struct Geometry {
  static constexpr uint32_t kBBytes = static_cast<uint32_t>(BN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr size_t kEpiBytes = EpiSmem ? kConsumerWarpgroups * 2 * kChunkBytes : 0;
  static constexpr size_t kBudget = kSmemLimit - 1024 /*alignment slack*/ - 1024 /*barriers, flags*/ - kEpiBytes;
  static constexpr int kStages = static_cast<int>(kBudget / kStageBytes) < 12 ? static_cast<int>(kBudget / kStageBytes)
                                                                              : 12;
  static_assert(kStages >= 3, "tile too large for a 3-stage pipeline");
};

template <int BN, bool EpiSmem>
struct SharedStorage {
  using G = Geometry<BN, EpiSmem>;
  alignas(1024) uint16_t a[G::kStages][kBlockRows * kBlockK];
  alignas(1024) uint16_t b[G::kStages][BN * kBlockK];
  alignas(1024) uint16_t c[EpiSmem ? kConsumerWarpgroups : 1][2][EpiSmem ? kChunkBytes / 2 : 8];
  alignas(8) uint64_t full[G::kStages];  // TMA bytes landed (1 arrival: the producer's expect_tx)
  uint64_t empty[G::kStages];            // both consumer warpgroups done with the stage
  uint32_t lastFlag;                     // split-K: this CTA finishes the tile (written by one consumer thread)
};
template <int BN, bool EpiSmem>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<BN, EpiSmem>) + 1024;

// ---------------------------------------------------------------------------------------------------------------
// Kernel parameters (POD, passed as const __grid_constant__ so the tensor maps live in param space).
// ---------------------------------------------------------------------------------------------------------------
struct KernelParams {
  CUtensorMap tmX;  // wgmma A operand: K-major {k, rows} box {64, 128}; MN-major {rows, k} box {64, 64}
  CUtensorMap tmY;  // wgmma B operand: K-major {k, cols} box {64, BN}; MN-major {cols, k} box {64, 64}
  CUtensorMap tmC;  // output (TMA-store epilogue): {n, m} box {128 bytes of elements, 64}
  void* c;          // output base (transposed direct epilogue)
  float* partials;  // split-K: [tile][split][fragment-ordered 128 x BN fp32], after the counter area
  uint64_t* counters;  // split-K: one per tile at the workspace's start, zero between launches (the finishing CTA
                       // resets it); no plan's partial tiles overlap this area
  int64_t ldc;         // elements
  int32_t rows, cols;  // D extents: wgmma M and N directions
  int32_t numKBlocks;
  int32_t splits;           // K splits per tile (1: no workspace)
  int32_t kBlocksPerSplit;  // every split has at least one k-block
  int32_t tilesRows, tilesCols, groupRows;
  int32_t outF32;  // transposed epilogue only: 1 stores fp32, 0 the input type
  int32_t pad0;
};
static_assert(sizeof(KernelParams) % 64 == 0);

// Named barriers (bar.sync ids); 0 is __syncthreads.
enum class Barrier : uint32_t { kCta = 0, kEpilogue0 = 1, kEpilogue1 = 2, kConsumers = 3 };
__device__ __forceinline__ void barSync(Barrier id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptors (128-byte swizzle). Addresses and offsets in 16-byte units.
// ---------------------------------------------------------------------------------------------------------------
template <Major M>
__device__ __forceinline__ uint64_t makeDesc(uint32_t addr) {
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  if constexpr (M == Major::kK) {
    d |= static_cast<uint64_t>(1) << 16;  // LBO: unused for swizzled K-major (must be 1)
  } else {
    d |= static_cast<uint64_t>(kChunkBytes >> 4) << 16;  // LBO: next 64 rows of the MN dimension (next TMA box)
  }
  d |= static_cast<uint64_t>(1024 >> 4) << 32;  // SBO: next 8 rows (K-major) / next 8 k (MN-major)
  d |= static_cast<uint64_t>(1) << 62;          // 128-byte swizzle
  return d;
}
// Descriptor address advance for one wgmma k-step of 16 elements.
template <Major M>
inline constexpr uint64_t kDescKStep = M == Major::kK ? (kMmaK * 2) >> 4 : (kMmaK * 128) >> 4;

// ---------------------------------------------------------------------------------------------------------------
// wgmma m64nNk16, both operands from shared memory, fp32 accumulators; TransA / TransB: 1 when that operand is
// MN-major. scaleD == 0 overwrites D.
// ---------------------------------------------------------------------------------------------------------------
#define TANDEM_WGMMA_N16(TY)                                                          \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7"                                                      \
      "}, %8, %9, p, 1, 1, %11, %12;\n}\n"                                    \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])  \
      : "l"(descA), "l"(descB), "r"(scaleD), "n"(TransA), "n"(TransB))

#define TANDEM_WGMMA_N64(TY)                                                          \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                                                      \
      "}, %32, %33, p, 1, 1, %35, %36;\n}\n"                                    \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
      : "l"(descA), "l"(descB), "r"(scaleD), "n"(TransA), "n"(TransB))

#define TANDEM_WGMMA_N128(TY)                                                          \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                                      \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                                                      \
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                                    \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
      : "l"(descA), "l"(descB), "r"(scaleD), "n"(TransA), "n"(TransB))

#define TANDEM_WGMMA_N256(TY)                                                          \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                     \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                                      \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                                      \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                                      \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                                      \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                                      \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                                                      \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"                                                      \
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"                                    \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
      : "l"(descA), "l"(descB), "r"(scaleD), "n"(TransA), "n"(TransB))

template <class T, int N>
struct Wgmma;

#define TANDEM_WGMMA_SPECIALISE(N)                                                                           \
  template <>                                                                                              \
  struct Wgmma<__nv_bfloat16, N> {                                                                         \
    template <int TransA, int TransB>                                                                      \
    __device__ __forceinline__ static void run(float (&d)[N / 2], uint64_t descA, uint64_t descB,          \
                                               uint32_t scaleD) {                                          \
      TANDEM_WGMMA_N##N("bf16");                                                                           \
    }                                                                                                      \
  };                                                                                                       \
  template <>                                                                                              \
  struct Wgmma<__half, N> {                                                                                \
    template <int TransA, int TransB>                                                                      \
    __device__ __forceinline__ static void run(float (&d)[N / 2], uint64_t descA, uint64_t descB,          \
                                               uint32_t scaleD) {                                          \
      TANDEM_WGMMA_N##N("f16");                                                                            \
    }                                                                                                      \
  };
TANDEM_WGMMA_SPECIALISE(16)
TANDEM_WGMMA_SPECIALISE(64)
TANDEM_WGMMA_SPECIALISE(128)
TANDEM_WGMMA_SPECIALISE(256)
#undef TANDEM_WGMMA_SPECIALISE
#undef TANDEM_WGMMA_N16
#undef TANDEM_WGMMA_N64
#undef TANDEM_WGMMA_N128
#undef TANDEM_WGMMA_N256

template <class T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ void stShared64(uint32_t addr, float lo, float hi) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
}

// Writes accumulator columns [c * kCols, (c + 1) * kCols) of this thread's fragment rows r and r + 8 (byte offsets
// rowOff0 / rowOff1 in the chunk at `base`) into a 128-byte-swizzled staging chunk, the layout a TMA store map with
// 128-byte swizzle reads: 16-bit outputs as packed pairs, fp32 as 8-byte pairs. phase = r & 7, q = lane & 3.
template <class Out, class T, int kCols, int N>
__device__ __forceinline__ void stageSwizzledChunk(uint32_t base, uint32_t rowOff0, uint32_t rowOff1, uint32_t phase,
                                                   uint32_t q, const float (&acc)[N], int c) {
#pragma unroll
  for (int jj = 0; jj < kCols / 8; ++jj) {
    const int j = c * (kCols / 8) + jj;
    if constexpr (sizeof(Out) == 2) {
      // 128B swizzle: 16-byte chunk index XOR (row & 7), as the TMA store map expects.
      const uint32_t col = ((static_cast<uint32_t>(jj) ^ phase) << 4) + q * 4;
      gemm::stShared32(base + rowOff0 + col, gemm::packPair<T>(acc[4 * j + 0], acc[4 * j + 1]));
      gemm::stShared32(base + rowOff1 + col, gemm::packPair<T>(acc[4 * j + 2], acc[4 * j + 3]));
    } else {
      const uint32_t chunk = static_cast<uint32_t>(2 * jj) + (q >> 1);
      const uint32_t col = ((chunk ^ phase) << 4) + (q & 1) * 8;
      stShared64(base + rowOff0 + col, acc[4 * j + 0], acc[4 * j + 1]);
      stShared64(base + rowOff1 + col, acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// wgmma m64nN fp32 accumulator fragment (PTX ISA, "wgmma D matrix fragments"): thread t (0..127) of a warpgroup holds
// D[fragRow(t, h), fragCol(t, j, e)] of the warpgroup's 64 x N block in acc[4j + 2h + e], j < N / 8, h, e in {0, 1}.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int fragRow(int t, int h) { return (t / 32) * 16 + (t % 32) / 4 + 8 * h; }
__device__ __forceinline__ int fragCol(int t, int j, int e) { return 8 * j + 2 * (t % 4) + e; }

// Calls emit(row, col, value) for every accumulator of thread t, rows and columns as fragRow / fragCol.
template <int BN, class Emit>
__device__ __forceinline__ void forEachFragment(const float (&acc)[BN / 2], int t, Emit&& emit) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) emit(fragRow(t, h), fragCol(t, j, e), acc[4 * j + 2 * h + e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The mainloop of one work unit, for consumer warpgroup thread t: k-blocks [kb0, kb1) of the stage ring into acc
// (overwritten by the first), X rows from xOffset bytes into each X stage. One k-block's wgmmas stay in flight while
// the next is issued; a stage goes back to the producer once this warpgroup's wgmmas have read it (the empty barrier
// counts one arrival per consumer warpgroup). Leaves acc complete and every stage it took handed back.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int BN, Major MX, Major MY, class Storage, int Stages>
__device__ __forceinline__ void mmaKBlocks(Storage& s, PipeState<Stages>& ps, float (&acc)[BN / 2], int32_t kb0,
                                           int32_t kb1, uint32_t xOffset, int t) {
  constexpr int kTransX = MX == Major::kMN ? 1 : 0;
  constexpr int kTransY = MY == Major::kMN ? 1 : 0;
  int prevStage = 0;
  for (int32_t kb = kb0; kb < kb1; ++kb) {
    gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage landed
    const uint64_t descX = makeDesc<MX>(gemm::smemAddr(s.a[ps.stage]) + xOffset);
    const uint64_t descY = makeDesc<MY>(gemm::smemAddr(s.b[ps.stage]));
    gemm::fenceAccumulators(acc);
    gemm::wgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
      Wgmma<T, BN>::template run<kTransX, kTransY>(acc, descX + kk * kDescKStep<MX>, descY + kk * kDescKStep<MY>,
                                                   (kb > kb0 || kk > 0) ? 1u : 0u);
    }
    gemm::wgmmaCommit();
    gemm::fenceAccumulators(acc);
    gemm::wgmmaWait<1>();  // the previous k-block's wgmmas are done: its stage can be refilled
    // Pairs with the producer's mbarWait(empty): both warpgroups' wgmma reads of that stage are complete.
    if (kb > kb0 && t == 0) gemm::mbarArrive(&s.empty[prevStage]);
    prevStage = ps.stage;
    ps.advance();
  }
  gemm::wgmmaWait<0>();
  gemm::fenceAccumulators(acc);
  if (kb1 > kb0 && t == 0) gemm::mbarArrive(&s.empty[prevStage]);
}

// ---------------------------------------------------------------------------------------------------------------
// Work units: unit w is split (w % splits) of tile (w / splits); tiles in the grouped raster order, so the splits of
// one tile run side by side and finish at about the same time.
// ---------------------------------------------------------------------------------------------------------------
struct Work {
  int32_t tile, split;
  int32_t row0, col0;  // first D row / column of the tile
  int32_t kb0, kb1;    // k-blocks [kb0, kb1) of this split
};

template <int BN>
__device__ __forceinline__ Work decodeWork(const KernelParams& p, const GroupedRaster& order, int32_t w) {
  Work wk;
  wk.tile = w / p.splits;
  wk.split = w - wk.tile * p.splits;
  const TileCoord tc = order(wk.tile);
  wk.row0 = tc.unitM * kBlockRows;
  wk.col0 = tc.tileN * BN;
  wk.kb0 = wk.split * p.kBlocksPerSplit;
  wk.kb1 = min(p.numKBlocks, wk.kb0 + p.kBlocksPerSplit);
  return wk;
}

__device__ __forceinline__ GroupedRaster rasterOf(const KernelParams& p) {
  return GroupedRaster{p.tilesRows, p.tilesCols, p.groupRows};
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread. Streams the k-blocks of each work unit into the stage ring. An MN-major box wholly past the
// matrix edge is neither loaded nor expected: the stale shared memory it leaves feeds only D rows / columns that lie
// past the edge, which the epilogue never stores.
// ---------------------------------------------------------------------------------------------------------------
template <int BN, bool EpiSmem, Major MX, Major MY>
__device__ __forceinline__ void runProducer(const KernelParams& p, SharedStorage<BN, EpiSmem>& s, int32_t firstWork,
                                            int32_t workStride) {
  using G = Geometry<BN, EpiSmem>;
  constexpr int kChunkElems = kChunkBytes / 2;
  PipeState<G::kStages> ps;
  const GroupedRaster order = rasterOf(p);
  const int32_t numWork = order.numWork() * p.splits;
  for (int32_t w = firstWork; w < numWork; w += workStride) {
    const Work wk = decodeWork<BN>(p, order, w);
    uint32_t bytes = 0;
    if constexpr (MX == Major::kK) {
      bytes += kABytes;
    } else {
#pragma unroll
      for (int j = 0; j < kBlockRows / 64; ++j) bytes += wk.row0 + 64 * j < p.rows ? kChunkBytes : 0;
    }
    if constexpr (MY == Major::kK) {
      bytes += G::kBBytes;
    } else {
#pragma unroll
      for (int j = 0; j < BN / 64; ++j) bytes += wk.col0 + 64 * j < p.cols ? kChunkBytes : 0;
    }
    for (int32_t kb = wk.kb0; kb < wk.kb1; ++kb) {
      // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
      gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
      gemm::mbarArriveExpectTx(&s.full[ps.stage], bytes);
      const int32_t k0 = kb * kBlockK;
      if constexpr (MX == Major::kK) {
        gemm::tmaLoad2d(&p.tmX, s.a[ps.stage], &s.full[ps.stage], k0, wk.row0);
      } else {
#pragma unroll
        for (int j = 0; j < kBlockRows / 64; ++j) {
          if (wk.row0 + 64 * j < p.rows) {
            gemm::tmaLoad2d(&p.tmX, s.a[ps.stage] + j * kChunkElems, &s.full[ps.stage], wk.row0 + 64 * j, k0);
          }
        }
      }
      if constexpr (MY == Major::kK) {
        gemm::tmaLoad2d(&p.tmY, s.b[ps.stage], &s.full[ps.stage], k0, wk.col0);
      } else {
#pragma unroll
        for (int j = 0; j < BN / 64; ++j) {
          if (wk.col0 + 64 * j < p.cols) {
            gemm::tmaLoad2d(&p.tmY, s.b[ps.stage] + j * kChunkElems, &s.full[ps.stage], wk.col0 + 64 * j, k0);
          }
        }
      }
      ps.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Split-K: publish this split's partial tile; the CTA that completes the tile's count sums every split in split
// order into acc and returns true (it stores the tile); the others return false. Called by all 256 consumer threads
// (ct = 0..255) together.
// ---------------------------------------------------------------------------------------------------------------
template <int R, class Storage>
__device__ __forceinline__ bool finishSplit(const KernelParams& p, Storage& s, const Work& wk, float (&acc)[R],
                                            int ct) {
  constexpr size_t kTileFloats = static_cast<size_t>(kConsumerThreads) * R;
  float* const tileBase = p.partials + static_cast<size_t>(wk.tile) * p.splits * kTileFloats;
  float4* const mine = reinterpret_cast<float4*>(tileBase + static_cast<size_t>(wk.split) * kTileFloats);
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    mine[i * kConsumerThreads + ct] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  }
  // Every consumer thread's partial is written before thread 0's release below (the barrier orders them; the
  // release is cumulative).
  barSync(Barrier::kConsumers, kConsumerThreads);
  if (ct == 0) {
    // acq_rel: publishes this CTA's partial; pairs with the same fetch-add of the CTA that finishes the tile, whose
    // acquire makes every earlier split's partial visible to it.
    const uint64_t before = fetchAddAcqRelGpu(&p.counters[wk.tile], 1);
    const bool last = before == static_cast<uint64_t>(p.splits - 1);
    // Every split has arrived: nothing else touches this counter in this launch; the next launch finds it zero.
    if (last) p.counters[wk.tile] = 0;
    s.lastFlag = last ? 1u : 0u;
  }
  barSync(Barrier::kConsumers, kConsumerThreads);  // publishes lastFlag; orders the loads below after the acquire
  if (s.lastFlag == 0) return false;
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int32_t sp = 0; sp < p.splits; ++sp) {  // fixed order: the same sum whichever CTA finishes
      float4 v;
      if (sp == wk.split) {
        v = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
      } else {
        // .cg: L2, never a stale L1 line
        v = __ldcg(reinterpret_cast<const float4*>(tileBase + static_cast<size_t>(sp) * kTileFloats) +
                   i * kConsumerThreads + ct);
      }
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    acc[4 * i] = sum.x;
    acc[4 * i + 1] = sum.y;
    acc[4 * i + 2] = sum.z;
    acc[4 * i + 3] = sum.w;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): D rows [64 wg, 64 wg + 64) of each tile; t = thread index within the warpgroup.
// Swapped: D = C^T, stored transposed with direct masked stores (C is a few token rows); else D = C through the
// TMA-store epilogue (64 x 128-byte chunks, double-buffered per warpgroup; TMA clips the edges).
// ---------------------------------------------------------------------------------------------------------------
template <class T, class Out, int BN, bool Swapped, Major MX, Major MY>
__device__ __forceinline__ void runConsumer(const KernelParams& p, SharedStorage<BN, !Swapped>& s, int32_t firstWork,
                                            int32_t workStride, int wg, int t) {
  using G = Geometry<BN, !Swapped>;
  constexpr int R = BN / 2;  // fp32 accumulators per thread (wgmma m64nBN)
  float acc[R];
  PipeState<G::kStages> ps;
  uint32_t epiChunks = 0;  // TMA-store chunks committed by this warpgroup (thread 0 tracks the bulk groups)
  const uint32_t xOffset = static_cast<uint32_t>(wg) * kChunkBytes;  // 64 rows: 64 x 128 B (K) or one box (MN)
  const Barrier epiBar = wg == 0 ? Barrier::kEpilogue0 : Barrier::kEpilogue1;
  const GroupedRaster order = rasterOf(p);
  const int32_t numWork = order.numWork() * p.splits;

  for (int32_t w = firstWork; w < numWork; w += workStride) {
    const Work wk = decodeWork<BN>(p, order, w);
    if (wk.kb0 >= wk.kb1) {  // the host never plans an empty split; zeros keep the sum right if one comes
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.f;
    }
    mmaKBlocks<T, BN, MX, MY>(s, ps, acc, wk.kb0, wk.kb1, xOffset, t);

    if (p.splits > 1 && !finishSplit<R>(p, s, wk, acc, wg * 128 + t)) continue;

    const int32_t rowBase = wk.row0 + wg * kRowsPerConsumer;
    if (rowBase >= p.rows) continue;  // warpgroup-uniform: nothing of ours lies inside D
    if constexpr (Swapped) {
      forEachFragment<BN>(acc, t, [&](int r, int cc, float v) {
        const int32_t row = rowBase + r;     // a column of C
        const int32_t col = wk.col0 + cc;    // a row of C
        if (row < p.rows && col < p.cols) {
          const int64_t idx = static_cast<int64_t>(col) * p.ldc + row;
          if (p.outF32 != 0) {
            static_cast<float*>(p.c)[idx] = v;
          } else {
            static_cast<T*>(p.c)[idx] = fromFloat<T>(v);
          }
        }
      });
    } else {
      constexpr int kCols = 128 / static_cast<int>(sizeof(Out));  // output columns per 128-byte chunk row
      const int lane = t % 32;
      const int r = fragRow(t, 0);  // accumulator rows r and r + 8 (same swizzle phase r & 7)
      const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
      const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
      const uint32_t phase = static_cast<uint32_t>(r & 7);
      const uint32_t q = static_cast<uint32_t>(lane & 3);
#pragma unroll
      for (int c = 0; c < BN / kCols; ++c) {
        if (wk.col0 + c * kCols >= p.cols) break;  // uniform: the rest of the tile lies past the edge
        const uint32_t buf = epiChunks & 1;
        if (epiChunks >= 2) {
          // The store issued from this buffer two chunks ago must have finished reading it.
          if (t == 0) gemm::bulkWaitRead<1>();
          barSync(epiBar, 128);
        }
        const uint32_t base = gemm::smemAddr(s.c[wg][buf]);
        stageSwizzledChunk<Out, T, kCols>(base, rowOff0, rowOff1, phase, q, acc, c);
        gemm::fenceProxyAsyncShared();  // our st.shared -> visible to the TMA engine
        barSync(epiBar, 128);           // publishes the whole chunk to thread 0
        if (t == 0) {
          gemm::tmaStore2d(&p.tmC, base, wk.col0 + c * kCols, rowBase);
          gemm::bulkCommit();
        }
        ++epiChunks;
      }
    }
  }
  if constexpr (!Swapped) {
    if (t == 0) gemm::bulkWait<0>();  // smem must outlive the last stores' reads
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads, kSmemBytes<BN, !Swapped>
// of dynamic shared memory. Worker `cta` of `numCtas` takes work units cta, cta + numCtas, ...
// ---------------------------------------------------------------------------------------------------------------
template <class T, class Out, int BN, bool Swapped, Major MX, Major MY>
__device__ __forceinline__ void runCta(const KernelParams& p, uint8_t* smemRaw, int32_t cta, int32_t numCtas) {
  using Storage = SharedStorage<BN, !Swapped>;
  using G = Geometry<BN, !Swapped>;
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
    gemm::prefetchTensorMap(&p.tmX);
    gemm::prefetchTensorMap(&p.tmY);
    if constexpr (!Swapped) gemm::prefetchTensorMap(&p.tmC);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (gemm::roleOf(wg)) {
    case gemm::Role::kProducer:
      gemm::setMaxNRegDec<kProducerRegs>();
      if (t == 0) runProducer<BN, !Swapped, MX, MY>(p, s, cta, numCtas);
      break;
    case gemm::Role::kConsumer:
      gemm::setMaxNRegInc<kConsumerRegs>();
      runConsumer<T, Out, BN, Swapped, MX, MY>(p, s, cta, numCtas, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::gemm_layouts
