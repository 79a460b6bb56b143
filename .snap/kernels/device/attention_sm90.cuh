// Hopper (sm_90a) attention forward building blocks: shared-memory layout, tile order, the KV block walk over
// segments, the wgmma shapes attention needs, online softmax in registers, and the producer / consumer bodies of a
// warp-specialised persistent kernel. No __global__ here: attention.cu wires these into kernels.
//
// out[i] = softmax(scale * q[i] K^T [+ causal mask]) V per head, fp32 accumulation. Layout as tandem stores it:
// q / out [sq, heads, headDim], each KV segment's k / v [len, heads, headDim], all row-major.
//
// CTA: 3 warpgroups. Warpgroup 0 produces (one thread issues every TMA load); warpgroups 1 and 2 consume, each
// owning 64 of the tile's 128 query rows. Per KV block of BN keys a consumer warpgroup runs
//   S = Q K^T      wgmma m64nBNk16, A = Q and B = K from shared memory (both K-major, 128-byte swizzle)
//   P = softmax(S) online, in registers (row max across the 4 threads of a quad, exp2 with the scale folded in)
//   O += P V       wgmma m64nHDk16, A = P from registers (the S accumulator layout is the A fragment layout once
//                  packed to 16 bits), B = V from shared memory read N-major (transposed), no copy of V.
// Inside a warpgroup the next block's QK^T is issued before this block's softmax (so the tensor cores have work
// while the warpgroup does exp2), and across the two warpgroups a pair of named barriers makes them take turns
// issuing (ping-pong): one warpgroup's softmax runs under the other's GEMMs.
// NOTE: in the SASS, ptxas moves the wait for O += P V above the softmax (packing the new P overwrites the registers
// that the PV in flight still reads), so inside a warpgroup the softmax does not overlap its own PV; the overlap comes
// from ping-pong. Two P register buffers would restore it (at 128-key blocks: +32 registers per thread).
// Causal: KV blocks wholly in a tile's future are never loaded; masking runs only on blocks that straddle the
// diagonal or end a segment. Rows that see no key come out as 0 with lse -inf.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemm_sm90.cuh"  // mbarrier, TMA, wgmma fence/commit/wait, setmaxnreg, packPair, PipeState
#include "ordering.cuh"
#include "tandem/kernels/signals.hpp"
#include "wait.cuh"

namespace tandem::kernels::attn {

// ---------------------------------------------------------------------------------------------------------------
// Geometry (shared with the host launcher in attention.cu).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kBlockM = 128;  // query rows per CTA tile
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;  // 64 = wgmma M
inline constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
// KV tensors (tensor maps) and runs of consecutive key positions in them: ring attention has one tensor per rank
// and, in the zigzag layout, two runs per tensor.
inline constexpr int kMaxKvMaps = 8;
inline constexpr int kMaxSegments = 16;
inline constexpr int kStages = 2;  // K and V rings, each this deep
inline constexpr int kSwizzleCols = 64;  // 64 x 16-bit = 128 bytes: one 128B-swizzle row; wider heads come in halves
// setmaxnreg moves registers inside a per-CTA pool: the CTA's launch allocation, 168 per thread under
// __launch_bounds__(384, 1) (64K / 384, rounded down to 8), not the whole 64K register file. Asking for more than the
// pool holds makes setmaxnreg.inc wait forever (seen: 32 + 2 x 240 hung every launch).
// 40 + 2 x 232, not FA3's 24 + 2 x 240: the producer walks the KV runs from shared memory (built as each CTA starts,
// since ring attention learns its peers' lengths only then), and at 24 or 32 registers ptxas spilled that walk (220
// and 120 bytes); 40 leaves it none, and the consumers none at 232 (ptxas -v, every variant).
inline constexpr uint32_t kLaunchRegs = 168;
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= kLaunchRegs * (1 + kConsumerWarpgroups),
              "setmaxnreg pool: the CTA's launch allocation");

enum class Role : uint8_t { kProducer = 0, kConsumer = 1 };
__host__ __device__ constexpr Role roleOf(int wg) { return wg == 0 ? Role::kProducer : Role::kConsumer; }

// Named barriers (bar.sync ids). 0 is __syncthreads. kSchedule0/1: consumer warpgroup 0/1 may issue its GEMMs.
enum class Barrier : uint32_t { kCta = 0, kSchedule0 = 1, kSchedule1 = 2 };

// ---------------------------------------------------------------------------------------------------------------
// Kernel parameters (POD, passed as const __grid_constant__ so the tensor maps live in param space).
// ---------------------------------------------------------------------------------------------------------------
// Keys [row0, row0 + len) of tensor map `map` sit at global positions start, start + 1, ...
struct AttnKvRun {
  int64_t start;
  int32_t map;
  int32_t row0;
  int32_t len;  // > 0 (empty runs are left out)
  int32_t pad0;
};
static_assert(sizeof(AttnKvRun) == 24);

// One KV tensor (its k and v maps) and where its rows sit. Its length is known at launch, or (ring attention) read
// by each CTA as it starts from a word a peer publishes: once *lengthReady >= lengthReadyValue (acquire), the rows
// are *lengthWord, clamped to `length` (then the tensor maps' row capacity).
struct AttnKvMap {
  int64_t start;                // position of row 0
  int64_t start2;               // position of row `split` (zigzag's second chunk)
  const uint64_t* ready;        // null, or the producer waits for *ready >= readyValue before its first load from it
  uint64_t readyValue;
  const uint64_t* lengthWord;   // null: `length` rows
  const uint64_t* lengthReady;
  uint64_t lengthReadyValue;
  int32_t length;
  int32_t split;                // rows [split, length) sit at start2; >= length: one run; -1: rows - rows / 2
};

struct AttnKernelParams {
  CUtensorMap tmQ;              // q [sq, heads * hd]: dims {heads * hd, sq}, box {64, kBlockM}, 128B swizzle
  CUtensorMap tmK[kMaxKvMaps];  // KV tensor m's k [rows, kvHeads * hd]: box {64, BN}
  CUtensorMap tmV[kMaxKvMaps];  // its v, same
  AttnKvMap maps[kMaxKvMaps];   // the walk, in order (local tensors first)
  const uint64_t* abortWord;    // polled by the waits; null = none
  ErrorSlot* errorSlot;         // where a failed wait reports; null = nowhere
  uint64_t timeoutNs;           // the waits' deadline from the kernel's start; 0 = none
  const uint64_t* epochWord;    // non-null: every map's readyValue and lengthReadyValue are *epochWord (device epoch)
  void* out;                    // [sq, heads, hd]
  float* lse;                   // [heads, sq] or null
  int64_t qStart;               // global position of q row 0
  int64_t qStart2;              // rows >= qSplit sit at qStart2 + (row - qSplit) (zigzag's second chunk)
  int32_t qSplit;               // sq when q is one run
  int32_t numMaps;
  int32_t sq;
  int32_t heads;
  int32_t kvGroup;    // query heads per KV head (grouped-query attention; 1: one KV head per query head)
  int32_t numQTiles;  // ceil(sq / kBlockM)
  int32_t numWork;    // numQTiles * heads
  float scaleLog2;    // scale * log2(e): softmax runs in exp2
  int32_t pingPong;   // 1: consumer warpgroups take turns issuing GEMMs
  uint32_t waitOp;    // what a failed wait reports: op kind and rank
  uint32_t waitRank;
  int32_t headGroup;  // causal tile order: heads interleaved per group (1 .. heads)
  int32_t snake;      // 1: CTAs take the work of odd rounds in reverse order (workOf)
  uint32_t* tileCounter;  // non-null: dynamic order, the producers take work indices from it (zeroed before launch)
  int32_t rotateFrom;     // > 0: maps [rotateFrom, numMaps) are walked from a CTA-dependent one on (mapAt)
};
static_assert(sizeof(AttnKernelParams) % 64 == 0);
static_assert(sizeof(AttnKernelParams) <= 4096, "kernel parameter space");

// ---------------------------------------------------------------------------------------------------------------
// Shared memory. Tiles are stored in 64-column halves ([rows][128 bytes] each, 128B swizzled as TMA writes them);
// every half starts on 1024 bytes (the swizzle atom is 8 rows x 128 bytes).
// ---------------------------------------------------------------------------------------------------------------
// The walk of KV runs, built by thread 0 as the CTA starts (ring attention: peers' lengths are known only then).
struct AttnRunTable {
  AttnKvRun run[kMaxSegments];
  int32_t count;
};

template <int HD, int BN>
struct SharedStorage {
  alignas(1024) uint16_t q[kBlockM * HD];
  alignas(1024) uint16_t k[kStages][BN * HD];
  alignas(1024) uint16_t v[kStages][BN * HD];
  alignas(8) uint64_t fullQ;   // Q bytes landed (producer's expect_tx)
  uint64_t emptyQ;             // both consumer warpgroups finished their last QK^T of the tile
  uint64_t fullK[kStages];
  uint64_t emptyK[kStages];
  uint64_t fullV[kStages];
  uint64_t emptyV[kStages];
  uint64_t kvReady[kMaxKvMaps];  // the KV waiter: peer tensor m's KV is in place (one phase per launch)
  uint64_t tileFull[2];          // dynamic order: the producer wrote tileWork[i]
  uint64_t tileEmpty[2];         // every consumer thread read it
  int32_t tileWork[2];
  AttnRunTable runs;
};
template <int HD, int BN>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<HD, BN>) + 1024;  // + slack to align the base to 1024
static_assert(kSmemBytes<128, 176> <= 227 * 1024, "H100/H200 opt-in shared memory per block");
static_assert((128 * 176 * 2) % 1024 == 0 && (176 * 128) % 1024 == 0, "halves stay 1024-aligned");

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers attention needs beyond gemm_sm90.cuh.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void namedBarSync(Barrier id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}
__device__ __forceinline__ void namedBarArrive(Barrier id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}
__device__ __forceinline__ float exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2Approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <int R>
__device__ __forceinline__ void fenceRegs(uint32_t (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// wgmma descriptor of an N-major (transposed) B operand, 128-byte swizzle: 64-element chunks along N lie
// `chunkStrideBytes` apart (LBO), 8-row groups along K 1024 bytes apart (SBO). That is a V tile as TMA writes it
// ([keys][64 dims] halves), read as B[K = keys, N = dims] for O += P V.
__device__ __forceinline__ uint64_t makeSmemDescNMajor(uint32_t addr, uint32_t chunkStrideBytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((chunkStrideBytes >> 4) & 0x3FFF) << 16;  // leading byte offset
  d |= static_cast<uint64_t>(1024 >> 4) << 32;                          // stride byte offset
  d |= static_cast<uint64_t>(1) << 62;                                  // 128-byte swizzle
  return d;
}

// S GEMM: D[64 x N] (+)= A[64 x 16] B[N x 16]^T, both K-major in shared memory. PV GEMM: D[64 x N] (+)= A[64 x 16]
// (registers, 4 x 32 bits per thread) B[16 x N] (N-major in shared memory, imm-trans-b = 1).
// scaleD == 0 overwrites D.
// clang-format off
#define TANDEM_ATTN_WGMMA_RS_N64(TY)                                                                  \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(descB), "r"(scaleD))

#define TANDEM_ATTN_WGMMA_SS_N128(TY)                                                                  \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
      : "l"(descA), "l"(descB), "r"(scaleD))

#define TANDEM_ATTN_WGMMA_RS_N128(TY)                                                                  \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(descB), "r"(scaleD))

#define TANDEM_ATTN_WGMMA_SS_N176(TY)                                                                  \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n176k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n" \
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
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])  \
      : "l"(descA), "l"(descB), "r"(scaleD))
// clang-format on

template <class T, int N>
struct WgmmaSS;
template <class T, int N>
struct WgmmaRS;

#define TANDEM_ATTN_DEFINE(KIND, N, T, TY, ...)                                                              \
  template <>                                                                                               \
  struct Wgmma##KIND<T, N> {                                                                                \
    __device__ __forceinline__ static void run(float (&d)[N / 2], __VA_ARGS__, uint32_t scaleD) {           \
      TANDEM_ATTN_WGMMA_##KIND##_N##N(TY);                                                                  \
    }                                                                                                       \
  };
TANDEM_ATTN_DEFINE(SS, 128, __nv_bfloat16, "bf16", uint64_t descA, uint64_t descB)
TANDEM_ATTN_DEFINE(SS, 128, __half, "f16", uint64_t descA, uint64_t descB)
TANDEM_ATTN_DEFINE(SS, 176, __nv_bfloat16, "bf16", uint64_t descA, uint64_t descB)
TANDEM_ATTN_DEFINE(SS, 176, __half, "f16", uint64_t descA, uint64_t descB)
TANDEM_ATTN_DEFINE(RS, 64, __nv_bfloat16, "bf16", uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t descB)
TANDEM_ATTN_DEFINE(RS, 64, __half, "f16", uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t descB)
TANDEM_ATTN_DEFINE(RS, 128, __nv_bfloat16, "bf16", uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t descB)
TANDEM_ATTN_DEFINE(RS, 128, __half, "f16", uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t descB)
#undef TANDEM_ATTN_DEFINE
#undef TANDEM_ATTN_WGMMA_SS_N128
#undef TANDEM_ATTN_WGMMA_SS_N176
#undef TANDEM_ATTN_WGMMA_RS_N64
#undef TANDEM_ATTN_WGMMA_RS_N128

// ---------------------------------------------------------------------------------------------------------------
// Tile order and the KV block walk. Producer and consumers walk the same sequence, so their ring positions agree.
// ---------------------------------------------------------------------------------------------------------------
struct TileCoord {
  int32_t qTile;
  int32_t head;
};

// Each CTA takes work indices blockIdx.x, + gridDim.x, ... Non-causal: a head's query tiles are adjacent, so the
// CTAs running at once read the same K/V (L2 hits). Causal: heads go in groups of headGroup; inside a group the
// longest tiles (last query rows) come first, heads fastest, so short tiles fill in the tail. With every head in one
// group the CTAs in flight stream every head's K/V at once, which outgrows L2 at long sequences (16 heads x 16 MB at
// 32K); smaller groups keep the K/V in flight to a few heads'.
template <bool Causal>
__device__ __forceinline__ TileCoord tileOf(const AttnKernelParams& p, int32_t w) {
  if constexpr (Causal) {
    const int32_t per = p.numQTiles * p.headGroup;  // work items of a full group
    const int32_t g = w / per;
    const int32_t i = w - g * per;
    const int32_t h0 = g * p.headGroup;
    const int32_t size = min(p.headGroup, p.heads - h0);  // the last group may be smaller
    return {p.numQTiles - 1 - i / size, h0 + i % size};
  } else {
    return {w % p.numQTiles, w / p.numQTiles};
  }
}

// KV blocks of segment s that a tile whose last query sits at global position maxQPos must see.
template <int BN, bool Causal>
__device__ __forceinline__ int32_t blocksIn(const AttnRunTable& rt, int s, int64_t maxQPos) {
  int64_t visible = rt.run[s].len;
  if constexpr (Causal) {
    const int64_t upTo = maxQPos - rt.run[s].start + 1;  // keys at positions <= maxQPos
    visible = upTo < 0 ? 0 : (upTo < visible ? upTo : visible);
  }
  return static_cast<int32_t>((visible + BN - 1) / BN);
}

template <int BN, bool Causal>
__device__ __forceinline__ int32_t countBlocks(const AttnRunTable& rt, int64_t maxQPos) {
  int32_t n = 0;
  for (int s = 0; s < rt.count; ++s) n += blocksIn<BN, Causal>(rt, s, maxQPos);
  return n;
}

// Position in the walk: block `blk` of segment `seg` (local segments come first in the params, so first here).
struct BlockCursor {
  int32_t seg;
  int32_t blk;
  int32_t nblk;
};

template <int BN, bool Causal>
__device__ __forceinline__ void seekBlock(const AttnRunTable& rt, BlockCursor& c, int64_t maxQPos) {
  while (c.blk >= c.nblk && c.seg + 1 < rt.count) {
    ++c.seg;
    c.blk = 0;
    c.nblk = blocksIn<BN, Causal>(rt, c.seg, maxQPos);
  }
}
template <int BN, bool Causal>
__device__ __forceinline__ BlockCursor firstBlock(const AttnRunTable& rt, int64_t maxQPos) {
  BlockCursor c{-1, 0, 0};
  seekBlock<BN, Causal>(rt, c, maxQPos);
  return c;
}
template <int BN, bool Causal>
__device__ __forceinline__ void nextBlock(const AttnRunTable& rt, BlockCursor& c, int64_t maxQPos) {
  ++c.blk;
  seekBlock<BN, Causal>(rt, c, maxQPos);
}

// The work index a CTA takes in its round k: blockIdx.x + k gridDim.x, or (snake) the CTAs' order reversed in every
// odd round, so that with the longest tiles first each CTA's sum of tile lengths comes out nearly the same. Producer
// and consumers walk the same sequence. Increasing in k, so the first index past numWork ends the walk.
__device__ __forceinline__ int32_t workOf(const AttnKernelParams& p, int32_t k) {
  const int32_t g = static_cast<int32_t>(gridDim.x), b = static_cast<int32_t>(blockIdx.x);
  return k * g + (p.snake != 0 && (k & 1) != 0 ? g - 1 - b : b);
}

// Global position of query row `row`: increasing in row (zigzag's second chunk lies after its first).
__device__ __forceinline__ int64_t qPosOf(const AttnKernelParams& p, int32_t row) {
  return row < p.qSplit ? p.qStart + row : p.qStart2 + (row - p.qSplit);
}

// Global position of the last query row of the tile (rows past sq do not widen the causal window).
__device__ __forceinline__ int64_t tileMaxQPos(const AttnKernelParams& p, int32_t q0) {
  const int32_t last = (q0 + kBlockM < p.sq ? q0 + kBlockM : p.sq) - 1;
  return qPosOf(p, last);
}

// Called once by thread 0 before the roles start (the CTA syncs afterwards): the walk, local tensors first. A length
// that a peer publishes is waited for here; a wait that fails (reported) leaves that tensor out.
// The i-th KV tensor of this CTA's walk. With rotateFrom > 0 (ring attention: the peers' tensors) CTA b starts the
// rotated part at its (b mod count)-th tensor, so that the CTAs in flight read from every peer at once instead of all
// from one. Each CTA's order is fixed, so results stay bitwise repeatable with a static tile order.
__device__ __forceinline__ int mapAt(const AttnKernelParams& p, int i) {
  const int count = p.numMaps - p.rotateFrom;
  if (p.rotateFrom <= 0 || i < p.rotateFrom || count <= 1) return i;
  return p.rotateFrom + (i - p.rotateFrom + static_cast<int>(blockIdx.x % static_cast<uint32_t>(count))) % count;
}

// The value a peer's ready or length word must reach: the map's own, or in device-epoch mode the op entry's epoch,
// written earlier in this stream (a kernel boundary orders it; L2, not L1).
__device__ __forceinline__ uint64_t readyValueOf(const AttnKernelParams& p, uint64_t own) {
  return p.epochWord != nullptr ? __ldcg(p.epochWord) : own;
}

__device__ __forceinline__ void buildRuns(const AttnKernelParams& p, AttnRunTable& rt) {
  WaitCtx ctx{p.abortWord, p.errorSlot, p.timeoutNs != 0 ? globaltimerNs() + p.timeoutNs : 0, p.waitOp,
              static_cast<uint32_t>(tandem::kernels::Role::kCompute), p.waitRank};
  int32_t n = 0;
  for (int i = 0; i < p.numMaps; ++i) {
    const int m = mapAt(p, i);
    const AttnKvMap& mp = p.maps[m];
    int32_t len = mp.length;
    if (mp.lengthWord != nullptr) {
      // acquire: the peer's length word; pairs with its stream's write of lengthReady after it (stream memops, or in
      // device-epoch mode ringPublishKernel's release).
      const bool ok = waitGeq(mp.lengthReady, readyValueOf(p, mp.lengthReadyValue), ctx, static_cast<uint32_t>(m));
      const uint64_t rows = ok ? ldRelaxedSys(mp.lengthWord) : 0;
      len = rows < static_cast<uint64_t>(mp.length) ? static_cast<int32_t>(rows) : mp.length;
    }
    const int32_t split = mp.split < 0 ? len - len / 2 : (mp.split < len ? mp.split : len);
    if (split > 0) rt.run[n++] = AttnKvRun{mp.start, m, 0, split, 0};
    if (len > split) rt.run[n++] = AttnKvRun{mp.start2, m, split, len - split, 0};
  }
  rt.count = n;
}

// Called once by thread 0 before the roles start; the CTA must sync afterwards.
template <int HD, int BN>
__device__ __forceinline__ void initBarriers(SharedStorage<HD, BN>& s) {
  gemm::mbarInit(&s.fullQ, 1);
#pragma unroll
  for (int m = 0; m < kMaxKvMaps; ++m) gemm::mbarInit(&s.kvReady[m], 1);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    gemm::mbarInit(&s.tileFull[i], 1);
    gemm::mbarInit(&s.tileEmpty[i], kConsumerWarpgroups * 128);
  }
  gemm::mbarInit(&s.emptyQ, kConsumerWarpgroups);
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    gemm::mbarInit(&s.fullK[i], 1);
    gemm::mbarInit(&s.emptyK[i], kConsumerWarpgroups);
    gemm::mbarInit(&s.fullV[i], 1);
    gemm::mbarInit(&s.emptyV[i], kConsumerWarpgroups);
  }
  gemm::fenceBarrierInit();
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread. Per tile: Q once, then K_0, (K_j, V_{j-1}) for j = 1..n-1, V_{n-1}: the order in which the
// consumers use them, so neither side can wait on a load the other has not issued.
// ---------------------------------------------------------------------------------------------------------------
template <int HD, int BN>
__device__ __forceinline__ void loadKvTile(const CUtensorMap* map, uint16_t (&dst)[kStages][BN * HD], uint64_t* full,
                                           uint64_t* empty, gemm::PipeState<kStages>& ps, int32_t col, int32_t row) {
  // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete. Pairs with the
  // consumers' release (mbarArrive on empty after their wgmma reading this stage completed).
  gemm::mbarWait(&empty[ps.stage], ps.phase ^ 1);
  gemm::mbarArriveExpectTx(&full[ps.stage], BN * HD * 2);  // full boxes: TMA counts zero-filled rows too
#pragma unroll
  for (int h = 0; h < HD / kSwizzleCols; ++h) {
    gemm::tmaLoad2d(map, dst[ps.stage] + h * BN * kSwizzleCols, &full[ps.stage], col + h * kSwizzleCols, row);
  }
  ps.advance();
}

// Producer warpgroup, thread 32 (the KV waiter): waits for each peer tensor's ready flag, in walk order, and tells
// the producer through kvReady[m]. A thread of its own because the producer's loop has no registers to spare for a
// wait (ptxas spilled it). A wait that fails (abort or deadline) has reported into the error slot; the waiter then
// stops waiting and lets the producer run on, so that the CTA ends and the host sees the op failed.
template <int HD, int BN>
__device__ __forceinline__ void runKvWaiter(const AttnKernelParams& p, SharedStorage<HD, BN>& s) {
  WaitCtx ctx{p.abortWord, p.errorSlot, p.timeoutNs != 0 ? globaltimerNs() + p.timeoutNs : 0, p.waitOp,
              static_cast<uint32_t>(tandem::kernels::Role::kCompute), p.waitRank};
  bool failed = false;
  for (int i = 0; i < p.numMaps; ++i) {
    const int m = mapAt(p, i);  // in walk order
    if (p.maps[m].ready == nullptr) continue;
    // acquire: the peer's KV; pairs with the write of its ready word, which its stream makes after copying its KV
    // in (a stream memory operation: a system-wide fence, then the write; in device-epoch mode ringPublishKernel's
    // fence and release).
    if (!failed) {
      failed = !waitGeq(p.maps[m].ready, readyValueOf(p, p.maps[m].readyValue), ctx, static_cast<uint32_t>(m));
    }
    gemm::mbarArrive(&s.kvReady[m]);  // release (CTA): pairs with the producer's mbarWait in awaitKvMap
  }
}

// Before the producer's first load from KV map `m`.
template <int HD, int BN>
__device__ __forceinline__ void awaitKvMap(const AttnKernelParams& p, SharedStorage<HD, BN>& s, int m,
                                           uint32_t& readyMaps) {
  if (((readyMaps >> m) & 1u) != 0) return;
  if (p.maps[m].ready != nullptr) {
    gemm::mbarWait(&s.kvReady[m], 0);  // acquire: the waiter saw the peer's KV in place
    // The KV was written through the generic proxy; the TMA loads that follow read it through the async proxy.
    fenceProxyAsyncGlobal();
  }
  readyMaps |= 1u << m;
}

// The producer's next work index: its round's (static orders), or the next of the shared counter (dynamic), which it
// hands to the consumers through tileWork (a two-slot ring). The index past numWork is handed on too: it ends the
// consumers' walk.
template <int HD, int BN>
__device__ __forceinline__ int32_t produceWork(const AttnKernelParams& p, SharedStorage<HD, BN>& s, int32_t k,
                                               gemm::PipeState<2>& ts) {
  if (p.tileCounter == nullptr) return workOf(p, k);
  const auto w = static_cast<int32_t>(atomicAdd(p.tileCounter, 1u));
  gemm::mbarWait(&s.tileEmpty[ts.stage], ts.phase ^ 1);  // pairs with every consumer thread's arrive after reading
  s.tileWork[ts.stage] = w;
  gemm::mbarArrive(&s.tileFull[ts.stage]);  // release (CTA): publishes tileWork; pairs with consumeWork's wait
  ts.advance();
  return w;
}
template <int HD, int BN>
__device__ __forceinline__ int32_t consumeWork(const AttnKernelParams& p, SharedStorage<HD, BN>& s, int32_t k,
                                               gemm::PipeState<2>& ts) {
  if (p.tileCounter == nullptr) return workOf(p, k);
  gemm::mbarWait(&s.tileFull[ts.stage], ts.phase);  // acquire: tileWork written
  const int32_t w = s.tileWork[ts.stage];
  gemm::mbarArrive(&s.tileEmpty[ts.stage]);  // this thread has read the slot
  ts.advance();
  return w;
}

template <int HD, int BN, bool Causal>
__device__ __forceinline__ void runProducer(const AttnKernelParams& p, SharedStorage<HD, BN>& s) {
  gemm::PipeState<kStages> ks, vs;
  gemm::PipeState<2> ts;
  uint32_t qPhase = 0;
  uint32_t readyMaps = 0;
  for (int32_t k = 0, w = produceWork(p, s, 0, ts); w < p.numWork; w = produceWork(p, s, ++k, ts)) {
    const TileCoord tc = tileOf<Causal>(p, w);
    const int32_t q0 = tc.qTile * kBlockM;
    const int64_t maxQ = tileMaxQPos(p, q0);
    const int32_t n = countBlocks<BN, Causal>(s.runs, maxQ);
    if (n == 0) continue;  // the consumers write zeros without waiting on anything
    const int32_t col = tc.head * HD;
    const int32_t kvCol = (tc.head / p.kvGroup) * HD;  // the KV head this query head reads
    gemm::mbarWait(&s.emptyQ, qPhase ^ 1);  // pairs with the consumers' arrive after their last QK^T
    gemm::mbarArriveExpectTx(&s.fullQ, kBlockM * HD * 2);
#pragma unroll
    for (int h = 0; h < HD / kSwizzleCols; ++h) {
      gemm::tmaLoad2d(&p.tmQ, s.q + h * kBlockM * kSwizzleCols, &s.fullQ, col + h * kSwizzleCols, q0);
    }
    qPhase ^= 1;
    // One cursor: V of a block goes out one step after its K, from the map and row its K came from.
    BlockCursor c = firstBlock<BN, Causal>(s.runs, maxQ);
    struct At {
      int32_t map, row;
    };
    const auto loadK = [&] {
      const AttnKvRun& run = s.runs.run[c.seg];
      const int32_t row = run.row0 + c.blk * BN;
      awaitKvMap(p, s, run.map, readyMaps);
      loadKvTile<HD, BN>(&p.tmK[run.map], s.k, s.fullK, s.emptyK, ks, kvCol, row);
      nextBlock<BN, Causal>(s.runs, c, maxQ);
      return At{run.map, row};
    };
    At prev = loadK();
    for (int32_t i = 1; i < n; ++i) {
      const At cur = loadK();
      loadKvTile<HD, BN>(&p.tmV[prev.map], s.v, s.fullV, s.emptyV, vs, kvCol, prev.row);
      prev = cur;
    }
    loadKvTile<HD, BN>(&p.tmV[prev.map], s.v, s.fullV, s.emptyV, vs, kvCol, prev.row);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer pieces. Thread t of a warpgroup (warp t / 32, lane t % 32) holds, of every 64 x N accumulator, rows
// r = 16 (t / 32) + (t % 32) / 4 and r + 8, columns 8 j + 2 (t % 4) + {0, 1}: acc[4 j + {0, 1}] is row r,
// acc[4 j + {2, 3}] row r + 8.
// ---------------------------------------------------------------------------------------------------------------
// S = Q K^T. Each descriptor is built from its address per wgmma. (Building Q's, K's and V's once per kernel and
// adding offset / 16 per stage and k-step, loop control "hoist", cut the per-KV-block loop from 860 to 812 SASS
// instructions but measured 0.95-1.01x lane0 on the H200, so it is no longer built: attention_host.cpp.)
template <class T, int HD, int BN>
__device__ __forceinline__ void issueS(float (&sacc)[BN / 2], uint32_t qAddr, uint32_t kAddr) {
  gemm::wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    // k-step kk: half kk / 4 of the head dim, 32 bytes further into the 128-byte row per step inside a half.
    const uint32_t off = static_cast<uint32_t>(kk % 4) * 32;
    const uint32_t offQ = (kk / 4) * (kBlockM * 128) + off, offK = (kk / 4) * (BN * 128) + off;
    const uint64_t descA = gemm::makeSmemDesc(qAddr + offQ);
    const uint64_t descB = gemm::makeSmemDesc(kAddr + offK);
    WgmmaSS<T, BN>::run(sacc, descA, descB, kk > 0 ? 1u : 0u);
  }
  gemm::wgmmaCommit();
}

// O += P V. Always accumulates (O starts at zero): a run-time scale-d predicate on the first wgmma lets ptxas hoist
// the following wgmma.wait_group above the softmax (it protects the predicate register), which was seen in SASS.
template <class T, int HD, int BN>
__device__ __forceinline__ void issuePV(float (&oacc)[HD / 2], const uint32_t (&pfrag)[BN / 4], uint32_t vAddr) {
  gemm::wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    // Keys 16 kk .. 16 kk + 15: two 8-row swizzle groups, 2048 bytes into each half.
    const uint32_t off = static_cast<uint32_t>(kk) * 2048;
    const uint64_t descB = makeSmemDescNMajor(vAddr + off, BN * 128);
    WgmmaRS<T, HD>::run(oacc, pfrag[4 * kk], pfrag[4 * kk + 1], pfrag[4 * kk + 2], pfrag[4 * kk + 3], descB, 1u);
  }
  gemm::wgmmaCommit();
}

// Masks keys this thread's two rows must not see: past the segment's end (validCols) and, causal, in the row's
// future. lim[h] = columns [0, lim) stay.
template <int BN>
__device__ __forceinline__ void applyMask(float (&sacc)[BN / 2], const int32_t (&lim)[2], int lane) {
  const int c0 = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (8 * j + c0 + (e & 1) >= lim[e >> 1]) sacc[4 * j + e] = -INFINITY;
    }
  }
}

// Online softmax over one block. rowMax is in scaled log2 units (max(s) * scale * log2 e); rowSum holds this
// thread's partial row sums (the quad adds them up once, at the end). alpha: what the previous O and sums scale by.
// A row with no visible key so far keeps rowMax = -inf; the guard keeps exp2 away from (-inf) - (-inf).
template <int BN>
__device__ __forceinline__ void onlineSoftmax(float (&sacc)[BN / 2], float (&rowMax)[2], float (&rowSum)[2],
                                              float (&alpha)[2], float scaleLog2) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(sacc[4 * j + 0], sacc[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(sacc[4 * j + 2], sacc[4 * j + 3]));
  }
  float mUse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float mNew = fmaxf(rowMax[h], mx[h] * scaleLog2);
    mUse[h] = mNew == -INFINITY ? 0.0f : mNew;
    alpha[h] = exp2Approx(rowMax[h] - mUse[h]);
    rowMax[h] = mNew;
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = exp2Approx(fmaf(sacc[4 * j + e], scaleLog2, -mUse[e >> 1]));
      sacc[4 * j + e] = v;
      sum[e >> 1] += v;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) rowSum[h] = rowSum[h] * alpha[h] + sum[h];
}

template <int HD>
__device__ __forceinline__ void rescaleO(float (&oacc)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) oacc[4 * j + e] *= alpha[e >> 1];
  }
}

// P (fp32, S accumulator layout) -> A fragments for O += P V: k-step kk is accumulator columns 16 kk .. 16 kk + 15.
template <class T, int BN>
__device__ __forceinline__ void packP(uint32_t (&pfrag)[BN / 4], const float (&sacc)[BN / 2]) {
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) pfrag[i] = gemm::packPair<T>(sacc[2 * i], sacc[2 * i + 1]);
}

// Rows [rowBase, rowBase + 64) of head `head`: out = O / l, lse = ln(sum exp(scale s)). Rows past sq are dropped.
template <class T, int HD>
__device__ __forceinline__ void storeRows(const AttnKernelParams& p, const float (&oacc)[HD / 2],
                                          const float (&rowMax)[2], float (&rowSum)[2], int32_t rowBase,
                                          int32_t head, int t) {
  const int lane = t % 32;
  const int32_t r0 = rowBase + (t / 32) * 16 + lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rowSum[h] += __shfl_xor_sync(0xffffffffu, rowSum[h], 1);
    rowSum[h] += __shfl_xor_sync(0xffffffffu, rowSum[h], 2);
  }
  T* const out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t row = r0 + 8 * h;
    if (row >= p.sq) continue;
    const float l = rowSum[h];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // no visible key: l == 0, out 0
    uint32_t* const dst = reinterpret_cast<uint32_t*>(out + (static_cast<int64_t>(row) * p.heads + head) * HD +
                                                      2 * (lane & 3));
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      dst[4 * j] = gemm::packPair<T>(oacc[4 * j + 2 * h] * inv, oacc[4 * j + 2 * h + 1] * inv);
    }
    if (p.lse != nullptr && (lane & 3) == 0) {
      p.lse[static_cast<int64_t>(head) * p.sq + row] =
          l > 0.0f ? (rowMax[h] + log2Approx(l)) * 0.69314718055994531f : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): rows [64 wg, 64 wg + 64) of each tile; t = thread index within the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
// The values that steer the consumer's loops and branches and come from shared memory (the block count of a tile
// from the walk table, a dynamic order's work index) are lane 0's, broadcast with a shuffle. Every thread reads the
// same value either way, but ptxas cannot know that of a shared-memory load: it takes the tile and block loops for
// divergent and keeps their counters (the K/V ring stage and phase) in per-thread registers, which costs a WARPSYNC
// and a register-to-uniform move per wgmma descriptor before every QK^T batch. A shuffle from a constant lane is
// warp-uniform to ptxas, so the loop state and the descriptors stay uniform. (Loop control "lane0"; "table", every
// thread using its own read, lost to lane0 at 7 of 8 shapes on the H200 and is no longer built: attention_host.cpp.)
__device__ __forceinline__ int32_t warpUniform(int32_t v) { return __shfl_sync(0xffffffffu, v, 0); }

template <class T, int HD, int BN, bool Causal>
__device__ __forceinline__ void runConsumer(const AttnKernelParams& p, SharedStorage<HD, BN>& s, int wg, int t) {
  float sacc[BN / 2];
  float oacc[HD / 2];
  uint32_t pfrag[BN / 4];
  float rowMax[2], rowSum[2], alpha[2];
  gemm::PipeState<kStages> ks, vs;
  uint32_t qPhase = 0;
  const int lane = t % 32;
  const int32_t rowInWg = (t / 32) * 16 + lane / 4;
  const bool pingPong = p.pingPong != 0;
  const Barrier myTurn = wg == 0 ? Barrier::kSchedule0 : Barrier::kSchedule1;
  const Barrier otherTurn = wg == 0 ? Barrier::kSchedule1 : Barrier::kSchedule0;
  // Both warpgroups issue the same number of GEMM batches per tile (n + 1), so the turns stay paired across tiles.
  // Warpgroup 0 goes first; the last arrive of the kernel is left unmatched, which is harmless at exit.
  const auto waitTurn = [&] {
    if (pingPong) namedBarSync(myTurn, 2 * 128);
  };
  const auto passTurn = [&] {
    if (pingPong) namedBarArrive(otherTurn, 2 * 128);
  };
  if (pingPong && wg == 1) namedBarArrive(Barrier::kSchedule0, 2 * 128);
  const uint32_t qAddr = gemm::smemAddr(s.q) + static_cast<uint32_t>(wg) * kRowsPerConsumer * 128;
  const uint32_t k0 = gemm::smemAddr(s.k[0]), v0 = gemm::smemAddr(s.v[0]);
  constexpr uint32_t kStageBytes = BN * HD * 2;  // s.k[i + 1] - s.k[i], and the same for v
  const auto issueSAt = [&](int stage) { issueS<T, HD, BN>(sacc, qAddr, k0 + stage * kStageBytes); };
  const auto issuePVAt = [&](int stage) { issuePV<T, HD, BN>(oacc, pfrag, v0 + stage * kStageBytes); };

  gemm::PipeState<2> ts;
  for (int32_t k = 0, w = warpUniform(consumeWork(p, s, 0, ts)); w < p.numWork;
       w = warpUniform(consumeWork(p, s, ++k, ts))) {
    const TileCoord tc = tileOf<Causal>(p, w);
    const int32_t q0 = tc.qTile * kBlockM;
    const int64_t maxQ = tileMaxQPos(p, q0);
    const int32_t n = warpUniform(countBlocks<BN, Causal>(s.runs, maxQ));
    const int32_t rowBase = q0 + wg * kRowsPerConsumer;
    rowMax[0] = rowMax[1] = -INFINITY;
    rowSum[0] = rowSum[1] = 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) oacc[i] = 0.0f;
    if (n == 0) {  // no key visible to the whole tile: zeros and lse -inf, nothing loaded
      storeRows<T, HD>(p, oacc, rowMax, rowSum, rowBase, tc.head, t);
      continue;
    }
    // Masking, when the block needs it: columns [0, lim[h]) of row h stay.
    const auto maskBlock = [&](const BlockCursor& c) {
      const int32_t validCols = min(BN, s.runs.run[c.seg].len - c.blk * BN);
      const int64_t kvBase = s.runs.run[c.seg].start + static_cast<int64_t>(c.blk) * BN;
      // Positions increase with the row: the warpgroup's first row is its earliest. Computed here, not kept live
      // across the loop (the consumers have no registers to spare).
      const bool diagonal = Causal && kvBase + BN - 1 > qPosOf(p, rowBase);
      if (validCols >= BN && !diagonal) return;  // warpgroup-uniform
      int32_t lim[2] = {validCols, validCols};
      if constexpr (Causal) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t upTo = qPosOf(p, rowBase + rowInWg + 8 * h) - kvBase + 1;  // keys kvBase .. qPos visible
          const int32_t u = upTo < 0 ? 0 : (upTo > BN ? BN : static_cast<int32_t>(upTo));
          lim[h] = min(lim[h], u);
        }
      }
      applyMask<BN>(sacc, lim, lane);
    };

    gemm::mbarWait(&s.fullQ, qPhase);  // acquire: Q landed
    qPhase ^= 1;
    BlockCursor c = firstBlock<BN, Causal>(s.runs, maxQ);

    // Block 0: S_0 and its softmax.
    gemm::mbarWait(&s.fullK[ks.stage], ks.phase);
    waitTurn();
    issueSAt(ks.stage);
    passTurn();
    gemm::wgmmaWait<0>();
    gemm::fenceAccumulators(sacc);
    // release: K stage read by this warpgroup's wgmma (completed above); pairs with the producer's empty wait.
    if (t == 0) gemm::mbarArrive(&s.emptyK[ks.stage]);
    ks.advance();
    if (n == 1 && t == 0) gemm::mbarArrive(&s.emptyQ);  // last read of Q in this tile done
    maskBlock(c);
    onlineSoftmax<BN>(sacc, rowMax, rowSum, alpha, p.scaleLog2);
    packP<T, BN>(pfrag, sacc);
    nextBlock<BN, Causal>(s.runs, c, maxQ);

    // Blocks 1 .. n-1: S_i is issued, then O += P_{i-1} V_{i-1}; the softmax of S_i runs while PV is in flight.
    for (int32_t i = 1; i < n; ++i) {
      gemm::mbarWait(&s.fullK[ks.stage], ks.phase);
      waitTurn();
      issueSAt(ks.stage);
      rescaleO<HD>(oacc, alpha);  // O so far was relative to the max before block i-1 (alpha is finite, in [0, 1])
      gemm::mbarWait(&s.fullV[vs.stage], vs.phase);
      issuePVAt(vs.stage);
      passTurn();
      gemm::wgmmaWait<1>();  // S_i done (groups complete in order)
      gemm::fenceAccumulators(sacc);
      if (t == 0) gemm::mbarArrive(&s.emptyK[ks.stage]);  // release: K stage (pairs with producer's empty wait)
      ks.advance();
      if (i == n - 1 && t == 0) gemm::mbarArrive(&s.emptyQ);
      maskBlock(c);
      onlineSoftmax<BN>(sacc, rowMax, rowSum, alpha, p.scaleLog2);
      // Pin the softmax above the wait: left alone, the compiler sinks it below wgmma.wait_group 0 (seen in SASS),
      // and the exp2 work no longer overlaps PV_{i-1}.
      gemm::fenceAccumulators(sacc);
      gemm::fenceAccumulators(rowSum);
      gemm::fenceAccumulators(alpha);
      gemm::wgmmaWait<0>();  // PV_{i-1} done: O final for now, P registers free, V stage read
      gemm::fenceAccumulators(oacc);
      fenceRegs(pfrag);
      if (t == 0) gemm::mbarArrive(&s.emptyV[vs.stage]);  // release: V stage
      vs.advance();
      packP<T, BN>(pfrag, sacc);
      nextBlock<BN, Causal>(s.runs, c, maxQ);
    }

    // Last PV.
    rescaleO<HD>(oacc, alpha);
    gemm::mbarWait(&s.fullV[vs.stage], vs.phase);
    waitTurn();
    issuePVAt(vs.stage);
    passTurn();
    gemm::wgmmaWait<0>();
    gemm::fenceAccumulators(oacc);
    if (t == 0) gemm::mbarArrive(&s.emptyV[vs.stage]);
    vs.advance();
    storeRows<T, HD>(p, oacc, rowMax, rowSum, rowBase, tc.head, t);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole attention CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads and
// kSmemBytes<HD, BN> of dynamic shared memory.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD, int BN, bool Causal>
__device__ __forceinline__ void runAttentionCta(const AttnKernelParams& p, uint8_t* smemRaw) {
  static_assert(HD == 64 || HD == 128, "head dim");
  static_assert(BN % 16 == 0 && BN <= 256, "KV block: wgmma N and k-steps");
  auto& s = *reinterpret_cast<SharedStorage<HD, BN>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                       ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
    buildRuns(p, s.runs);
    initBarriers<HD, BN>(s);
    gemm::prefetchTensorMap(&p.tmQ);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (roleOf(wg)) {
    case Role::kProducer:
      gemm::setMaxNRegDec<kProducerRegs>();
      if (t == 0) runProducer<HD, BN, Causal>(p, s);
      if (t == 32) runKvWaiter<HD, BN>(p, s);
      break;
    case Role::kConsumer:
      gemm::setMaxNRegInc<kConsumerRegs>();
      runConsumer<T, HD, BN, Causal>(p, s, wg - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::attn
