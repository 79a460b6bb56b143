// The MoE kernels' plain data, shared by the host launcher (moe.cpp, g++) and the kernels (moe.cu, nvcc): the control
// area every rank keeps, the receive-area layout, the private scratch, the kernel parameters and the raw launchers.
// Private to the kernels library; the public API is tandem/kernels/moe.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/moe.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels::moe {

// Extra words after a table row's kMoeMaxExperts counts.
inline constexpr int32_t kRowCapacity = 0;  // the rank's receive rows (dispatch+GEMM: its capacity)
inline constexpr int32_t kRowBad = 1;       // 0: ids fine; else 1 + the first bad pair index (token * topk + slot)
inline constexpr int32_t kRowBadValue = 2;  // the id found there
inline constexpr int32_t kRowSavedRows = 3; // FFN: the rows of the rank's saved gate|up (0: it saves none, no limit)
inline constexpr int32_t kRowExtras = 8;
inline constexpr int32_t kRowWords = kMoeMaxExperts + kRowExtras;

// One rank's control area. Written only by the MoE kernels (peers write their own table row and their own flags),
// zeroed once when the communicator forms. Flags are epochs and only rise.
struct alignas(128) MoeControl {
  uint64_t countsFlag[kMoeMaxRanks];       // [s]: source s's table row for this epoch is written (release by s)
  uint64_t dispatchFlag[kMoeMaxRanks];     // [s]: source s's rows for this rank are written
  uint64_t yFlag[kMoeMaxRanks];            // [d]: owner d's y rows are written (FFN)
  uint64_t finFlag[kMoeMaxRanks];          // [s]: source s read every owner's y (FFN)
  int32_t table[kMoeMaxRanks][kRowWords];  // [s]: source s's counts per global expert, then the extras
};
static_assert(sizeof(MoeControl) <= kMoeControlBytes);

// Per-op private scratch (this rank only), reset at the start of every op.
struct alignas(16) MoeStatus {
  int32_t state;  // kSkip / kRun / kFailed, written by the plan kernel
  int32_t bad;    // max of (INT32_MAX - pair index) over bad pairs; 0 = none
  uint32_t dispatchCtasDone;
  uint32_t combineCtasDone;
  uint32_t gemmTiles[2];           // the grouped GEMMs' dynamic tile counters (gemm1, gemm2)
  int32_t capacity[kMoeMaxRanks];  // every rank's receive rows, copied from the table by the plan kernel
};
inline constexpr int32_t kSkip = 0;  // verdict: rejected (or a wait failed): touch nothing, publish nothing
inline constexpr int32_t kRun = 1;
inline constexpr int32_t kFailed = 2;  // an error every rank found alike: write nothing, keep the flag protocol

inline constexpr uint64_t kAlign = 256;
__host__ __device__ constexpr uint64_t alignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// A receive area of `rows` rows: x rows [rows, hidden], row info [rows] x int4, then (FFN) h [rows, ffn] and
// y [rows, hidden]; the backward (dout in y, later dx; h holds weight * h) adds the row's weight and dtopk_weight
// [rows] fp32, gate|up [rows, 2 ffn] (later its gradient) and g = dout·w2 [rows, ffn]. 2-byte elements.
// With FP8 weights (`fp8`, the forward ops): x and h are e4m3 (one byte), each followed by its 1 x 128 scales in the
// FP8 grouped GEMM's M-major layout, [ceil(cols / 128), scaleLd] fp32 (xScaleOff, hScaleOff); y stays bf16.
// Dispatch+GEMM (ffn 0) has x, its scales and the row info only.
struct RecvLayout {
  uint64_t xOff, infoOff, hOff, yOff, weightOff, dtopkOff, guOff, gOff, bytes;
  uint64_t xScaleOff, hScaleOff, scaleLd;  // fp8 only: scaleLd = rows rounded up to 4 (gemmFp8ScaleALd)
};
__host__ __device__ constexpr RecvLayout recvLayoutFp8(int64_t rows, int64_t hidden, int64_t ffn) {
  RecvLayout l{};
  const auto r = static_cast<uint64_t>(rows);
  const auto h = static_cast<uint64_t>(hidden);
  const auto f = static_cast<uint64_t>(ffn);
  l.scaleLd = (r + 3) / 4 * 4;
  l.xOff = 0;
  l.xScaleOff = alignUp(r * h);
  l.infoOff = alignUp(l.xScaleOff + (h + 127) / 128 * l.scaleLd * 4);
  l.hOff = alignUp(l.infoOff + r * 16);
  l.hScaleOff = alignUp(l.hOff + r * f);
  l.yOff = alignUp(l.hScaleOff + (f + 127) / 128 * l.scaleLd * 4);
  l.bytes = ffn > 0 ? alignUp(l.yOff + r * h * 2) : l.yOff;
  l.weightOff = l.dtopkOff = l.guOff = l.gOff = l.bytes;
  return l;
}
__host__ __device__ constexpr RecvLayout recvLayout(int64_t rows, int64_t hidden, int64_t ffn, bool backward = false,
                                                    bool fp8 = false) {
  if (fp8 && !backward) return recvLayoutFp8(rows, hidden, ffn);
  RecvLayout l{};
  const auto r = static_cast<uint64_t>(rows);
  const auto f = static_cast<uint64_t>(ffn);
  l.xOff = 0;
  l.infoOff = alignUp(r * static_cast<uint64_t>(hidden) * 2);
  l.hOff = alignUp(l.infoOff + r * 16);
  l.yOff = ffn > 0 ? alignUp(l.hOff + r * f * 2) : l.hOff;
  l.bytes = ffn > 0 ? alignUp(l.yOff + r * static_cast<uint64_t>(hidden) * 2) : l.hOff;
  l.weightOff = l.dtopkOff = l.guOff = l.gOff = l.bytes;
  if (backward && ffn > 0) {
    l.dtopkOff = alignUp(l.weightOff + r * 4);
    l.guOff = alignUp(l.dtopkOff + r * 4);
    l.gOff = alignUp(l.guOff + r * 2 * f * 2);
    l.bytes = alignUp(l.gOff + r * f * 2);
  }
  return l;
}

// The route kernel splits a rank's tokens into chunks of kRouteChunk: a warp counts one expert's pairs in one chunk.
inline constexpr int32_t kRouteChunk = 512;
__host__ __device__ constexpr int64_t routeChunks(int64_t tokens) { return (tokens + kRouteChunk - 1) / kRouteChunk; }

// Private scratch: status, then localIdx [tokens * topk] (a pair's index among its expert's pairs of its chunk),
// chunkBase [chunks, E] (an expert's pairs in earlier chunks: counts, then scanned in place by the plan kernel),
// localCounts [E], srcOffset [E], groupOffsets [E/n + 1].
struct ScratchLayout {
  uint64_t statusOff, localIdxOff, chunkBaseOff, localCountsOff, srcOffsetOff, groupOffsetsOff, bytes;
};
__host__ __device__ constexpr ScratchLayout scratchLayout(int64_t tokens, int64_t topk, int64_t experts) {
  ScratchLayout l{};
  const auto pairs = static_cast<uint64_t>(tokens * topk);
  const auto e = static_cast<uint64_t>(experts);
  l.statusOff = 0;
  l.localIdxOff = alignUp(sizeof(MoeStatus));
  l.chunkBaseOff = alignUp(l.localIdxOff + pairs * 4);
  const auto chunks = static_cast<uint64_t>(routeChunks(tokens) > 0 ? routeChunks(tokens) : 1);
  l.localCountsOff = alignUp(l.chunkBaseOff + chunks * e * 4);
  l.srcOffsetOff = alignUp(l.localCountsOff + e * 4);
  l.groupOffsetsOff = alignUp(l.srcOffsetOff + e * 4);
  l.bytes = alignUp(l.groupOffsetsOff + (e + 1) * 4);
  return l;
}

// POD, passed as const __grid_constant__.
struct MoeKernelParams {
  const void* x;
  const int32_t* ids;
  const float* weights;
  void* out;              // FFN: the combine's output [tokens, hidden]
  int32_t* rowInfo;       // dispatch+GEMM: [capacity, 4]
  int32_t* expertCounts;  // dispatch+GEMM: [E/n]
  MoeControl* ctl[kMoeMaxRanks];
  char* recv[kMoeMaxRanks];
  MoeStatus* status;
  int32_t* localIdx;
  int32_t* chunkBase;
  int32_t* localCounts;
  int32_t* srcOffset;
  int32_t* groupOffsets;
  const uint64_t* verdictSlot;  // optional: this epoch's entry of the control page's verdict ring
  uint64_t verdictRejected;     // the value that entry holds when tandemd rejected the op
  const uint64_t* abortWord;
  ErrorSlot* errorSlot;  // a failed wait (fails the communicator)
  OpFault* fault;        // optional: this op's data error (fails the op only)
  uint64_t* faultsDropped;    // replayed op: `fault` is the replay fault, kept while full; this counts the rest
  const uint64_t* epochWord;  // device-epoch mode (op_entry.hpp): the flags' epoch is *epochWord (opEpoch); null: epoch
  uint64_t timeoutNs;
  uint64_t epoch;
  int32_t rank, nranks;
  int32_t tokens, hidden, experts, topk, localExperts;
  int32_t capacity;      // this rank's receive rows
  int32_t ffn;           // 0: dispatch+GEMM
  int32_t op;            // OpKind, for the error slot
  int32_t dtype;         // GemmDtype
  int32_t combineParts;  // a token's row is summed by this many warps (1..)
  int32_t backward;      // the FFN's backward: dispatch also dout and the weight; combine dx (weight 1) and dtopk
  int32_t savedRows;     // FFN: rows of `saved` (0: none); the plan fails the op when more rows arrive
  const void* dout;      // backward: [tokens, hidden]
  float* dtopkOut;       // backward: [tokens, topk] fp32
  void* saved;           // FFN: this rank's saved gate|up [savedRows, 2 ffn] (MoeParams::saved); null: none
  // FP8 weights (the FFN forward or dispatch+GEMM): the dispatch quantises x to e4m3 per 1 x 128 block (moe_fp8.cu)
  // and the receive areas take recvLayoutFp8.
  int32_t fp8;
  int32_t pad1;
};

inline constexpr int kRouteWarps = 8;  // experts per route CTA
inline constexpr int kCopyWarps = 8;   // rows per dispatch / combine CTA pass
inline constexpr int kPlanThreads = 1024;

cudaError_t launchRoute(const MoeKernelParams& p, int expertCtas, int chunks, cudaStream_t s);
cudaError_t launchPlan(const MoeKernelParams& p, cudaStream_t s);
cudaError_t launchDispatch(const MoeKernelParams& p, int ctas, cudaStream_t s);
// waitY 0: wait for every source's rows, then copy the row info out; 1: publish y, wait for every owner's.
cudaError_t launchArrive(const MoeKernelParams& p, int waitY, cudaStream_t s);
cudaError_t launchCombine(const MoeKernelParams& p, int ctas, cudaStream_t s);
// The backward's per-row step on the owner, over its received rows (gate|up and g written by the GEMMs before it):
// h = silu(a) * b rounded; dtopk = <g, h> (fp32); dh = weight * g; gate|up becomes (da, db) in place and h becomes
// weight * h (dw2's operand).
// With p.saved the backward reads a and b from the saved rows instead (and writes da, db into its gate|up rows).
inline constexpr int kActThreads = 256;
cudaError_t launchBackwardAct(const MoeKernelParams& p, int ctas, cudaStream_t s);
// The forward with p.saved: h = silu(a) * b rounded, from the saved (rounded) gate|up rows gemm1 stored, into the h
// rows.
cudaError_t launchSwiGlu(const MoeKernelParams& p, int ctas, cudaStream_t s);
// FP8 weights (the FFN forward or dispatch+GEMM): replaces launchDispatch. A warp per (token, 512 columns) quantises that part of the token's
// x row once (1 x 128 blocks: a = max(amax, 1e-30), e4m3(x * 448 / a), scale a / 448) and writes the e4m3 bytes and
// the scales into each of its top-k experts' receive rows, with the row info; then the dispatch's flag release.
inline constexpr int32_t kQuantCols = 512;
cudaError_t launchDispatchFp8(const MoeKernelParams& p, int ctas, cudaStream_t s);
cudaError_t prepareMoeFp8Kernels();
// The end of every dispatch: this CTA's writes are counted, and the last CTA releases this rank's dispatch flag on
// every owner (moe.cu). Device code in moe_dispatch.cuh.
cudaError_t prepareMoeKernels();

}  // namespace tandem::kernels::moe
