// Attention forward core on one Hopper GPU (sm_90a): out = softmax(scale * q K^T [+ causal mask]) V per head, fp32
// accumulation, bf16 or fp16 in and out, optional fp32 log-sum-exp. The KV side is a short list of segments, each
// with its own pointers, length and global start position, consumed in order (local first), so that the same kernel
// serves the steps of ring attention. See kernels/device/attention_sm90.cuh for the design.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

enum class AttentionDtype : uint8_t { kBf16 = 0, kFp16 = 1 };

/// Most KV segments one launch takes (ring attention: one per rank of a node).
inline constexpr int kMaxAttentionKvSegments = 8;

/// One run of consecutive key positions. k and v are [length, kvHeads, headDim], row-major (position, then head,
/// then dim), 16-byte aligned, in the launch's dtype; they must stay valid until the launch completes.
struct AttentionKvSegment {
  const void* k;
  const void* v;
  int64_t length;  // rows; 0 = an empty segment (skipped; k and v may be null)
  int64_t start;   // global position of row 0: causal masking lets query i see key j iff pos(j) <= pos(i)
  // KV that is put in place while the kernel runs (ring attention: a peer's copy): the kernel waits for
  // *arrival >= arrivalValue (acquire, system scope) before its first load from the segment, polling
  // AttentionParams::abortWord and the timeoutNs deadline. nullptr: already present.
  const uint64_t* arrival;
  uint64_t arrivalValue;
  int64_t arrivalRows;  // 0: one flag for the whole segment (the only granularity implemented)
  // Two runs of positions (zigzag): rows [split, length) sit at start2 + (row - split). 0: one run from start.
  int64_t split;
  int64_t start2;
  // A length that a peer publishes while the kernel runs (ring attention): each CTA waits for
  // *lengthReady >= lengthReadyValue, then takes min(*lengthWord, length) rows (length is then the capacity the
  // tensor maps cover). splitHalves: the second run starts at row rows - rows / 2 (zigzag), split is ignored.
  const uint64_t* lengthWord;
  const uint64_t* lengthReady;
  uint64_t lengthReadyValue;
  bool splitHalves;
};

/// POD; zero-initialise (AttentionParams p{}) and fill. Tuning fields left at 0 take the measured defaults.
struct AttentionParams {
  const void* q;  // [sq, heads, headDim], 16-byte aligned
  void* out;      // [sq, heads, headDim], 16-byte aligned; must not overlap q or any k / v
  float* lse;     // optional [heads, sq] fp32: ln sum_j exp(scale * s_ij); -inf for a row that sees no key
  int64_t sq;     // query rows (0: nothing is launched)
  int32_t heads;
  int32_t headDim;  // 64 or 128
  // Grouped-query attention: k and v have kvHeads heads (dividing heads); query head h reads KV head
  // h / (heads / kvHeads). 0: kvHeads = heads.
  int32_t kvHeads;
  int64_t qStart;   // global position of q row 0 (causal)
  int64_t qSplit;   // 0: one run; else rows [qSplit, sq) sit at qStart2 + (row - qSplit) (zigzag), after the first run
  int64_t qStart2;
  AttentionKvSegment kv[kMaxAttentionKvSegments];
  int32_t numKv;    // segments used, 0 .. kMaxAttentionKvSegments (0: every row sees no key)
  AttentionDtype dtype;
  bool causal;
  float scale;      // 0: 1 / sqrt(headDim); otherwise finite and > 0
  // Tuning (0 = default).
  int32_t blockN;    // keys per KV block: 128, or 176 (headDim 128, non-causal; the default there, else 128)
  int32_t numSms;    // cap on the persistent grid (CTAs); 0 = every SM
  int32_t pingPong;  // 1 (default): the two consumer warpgroups take turns issuing GEMMs, 2: free-running
  int32_t headGroup;  // causal tile order: heads per group (1 .. heads); 0 = default (every head in one group)
  int32_t tileOrder;  // 0 = default (causal: dynamic in 2-head groups from 8 MB of K/V per head when tileCounter is
                      // given, else snake; non-causal: round robin), 1 = round robin, 2 = snake (odd rounds
                      // reversed: balances causal tiles),
                      // 3 = dynamic (CTAs take tiles from tileCounter as they finish)
  int32_t rotateFrom;  // > 0: segments [rotateFrom, numKv) are walked from a CTA-dependent one on (ring attention:
                       // spreads the reads over the peers); 0 = in order
  uint32_t* tileCounter;  // tileOrder 3: a device word the launch zeroes on the stream (cudaMemsetAsync) and uses; no
                          // other launch in flight may use the same word
  // Waits on arrival flags (ring attention): what they poll and where a failed one reports. A wait that fails
  // reports there and the kernel runs on to its end (its outputs are then garbage): the caller must fail the op.
  const uint64_t* abortWord;  // non-zero aborts the waits; null = none
  ErrorSlot* errorSlot;       // null = report nowhere
  uint64_t timeoutNs;         // deadline of the waits from the kernel's start; 0 = none
  uint32_t waitOp, waitRank;  // written into the error slot (op kind, rank)
  // Device-epoch mode (ring attention in a CUDA graph, op_entry.hpp): every segment's arrivalValue and
  // lengthReadyValue are *epochWord, read as the kernel starts (it was written earlier in the stream); null: the
  // segments' own values.
  const uint64_t* epochWord;
};

/// Throws tandem::Error(kInvalidArgument) naming the broken rule ("rule head_dim: ..."), or kUnsupported for
/// arrival flags. Host only; launchAttention calls it first.
void validateAttention(const AttentionParams& params);

/// Enqueues the attention forward on `stream`. sq == 0 enqueues nothing. Throws tandem::Error: kInvalidArgument /
/// kUnsupported from validateAttention, kUnsupported on
/// a GPU that is not sm_90, kCuda when a CUDA call fails (the call and its error named). Thread-safe.
void launchAttention(const AttentionParams& params, cudaStream_t stream);

/// The configuration launchAttention resolves for these params, e.g. "bf16/hd128/bn176/full/pingpong/lane0".
const char* attentionConfigName(const AttentionParams& params);

/// Loads every attention kernel on `device` now (see tandem/kernels/preload.hpp for why). Idempotent.
void preloadAttentionKernels(int device);

}  // namespace tandem::kernels
