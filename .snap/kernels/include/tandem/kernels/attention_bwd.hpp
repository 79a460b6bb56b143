// Attention backward core on one Hopper GPU: dq, dk, dv of out = softmax(scale * q K^T [+ causal mask]) V per head,
// recomputing P from the forward's log-sum-exp, fp32 accumulation, bf16 or fp16 in and out. dk / dv and dq on wgmma
// and TMA (FlashAttention-3's design) or on the earlier mma.sync core (AttentionBwdCore).
// Grouped-query attention (k / v with fewer heads than q) and separate query and key lengths with global positions, so
// that ring attention can run it on one query chunk against one KV chunk. See kernels/device/attention_bwd_sm90.cuh,
// kernels/device/attention_bwd_wgmma_sm90.cuh and kernels/device/attention_bwd_wgmma_dq_sm90.cuh for the design.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/attention.hpp"  // AttentionDtype

namespace tandem::kernels {

/// How dq is accumulated over the KV blocks.
enum class AttentionBwdDq : uint8_t {
  /// Bitwise repeatable (the default): a second kernel, parallel over query blocks, recomputes P and dS and sums
  /// dS K over the KV blocks in order (on the core params.core selects). 1.4x the matrix work of kAtomic, no dq
  /// workspace; on the mma.sync core measured 1.04-1.17x its time (H100, 16 heads, seq 4K-16K, head_dim 64 and 128).
  kDeterministic = 0,
  /// The dk/dv kernel adds each KV block's dS K into an fp32 workspace with atomic adds (order varies from run to run,
  /// so dq varies in its last bits); a last pass rounds it into dq.
  kAtomic = 1,
};

/// Which implementation runs the dk / dv pass, the atomic mode's dq and the deterministic mode's dq pass.
enum class AttentionBwdCore : uint8_t {
  /// kWgmma, unless the environment variable TANDEM_ATTENTION_BWD_CORE is "mma_sync" (A/B runs of a whole program).
  kAuto = 0,
  /// wgmma and TMA, warp-specialised (FlashAttention-3's backward design): device/attention_bwd_wgmma_sm90.cuh (dk /
  /// dv, atomic dq) and device/attention_bwd_wgmma_dq_sm90.cuh (deterministic dq; the environment variable
  /// TANDEM_ATTENTION_BWD_DQ_BLOCK_KV = 64 or 128 overrides its keys per step for A/B runs, read once per process).
  kWgmma = 1,
  /// mma.sync and cp.async (FlashAttention-2 style): device/attention_bwd_sm90.cuh. Kept for A/B comparison.
  kMmaSync = 2,
};

/// POD; zero-initialise (AttentionBwdParams p{}) and fill.
///
/// Masking with positions: query row i sits at global position qStart + i, key row j at kStart + j; with causal set,
/// row i sees key j iff kStart + j <= qStart + i. For ring attention, pass the global positions of the query chunk and
/// of the KV chunk: a chunk pair wholly in the past is unmasked work, one wholly in the future costs nothing (dk / dv
/// come out 0 for its keys, and nothing is added to dq). Without causal, positions are ignored.
///
/// Chunk sums: dq, dk and dv are written (not accumulated). A caller that runs several chunk pairs sums the outputs
/// itself; lse must then be the log-sum-exp over every key the query sees (all chunks), as the forward over all
/// chunks returns it, and o / dout the full forward's output and its gradient.
struct AttentionBwdParams {
  const void* q;     // [sq, heads, headDim], 16-byte aligned
  const void* k;     // [sk, kvHeads, headDim], 16-byte aligned
  const void* v;     // [sk, kvHeads, headDim], 16-byte aligned
  const void* o;     // forward output [sq, heads, headDim]
  const void* dout;  // gradient of the output [sq, heads, headDim]
  const float* lse;  // [heads, sq] fp32 natural-log LSE of scale * s over the keys each row sees (-inf: none)
  void* dq;          // [sq, heads, headDim] out
  void* dk;          // [sk, kvHeads, headDim] out: summed over the query heads of each KV head's group
  void* dv;          // [sk, kvHeads, headDim] out
  void* workspace;   // device memory of at least attentionBwdWorkspaceBytes(*this) bytes, 16-byte aligned; the
                     // launch's own until it completes (no other launch in flight may use it)
  size_t workspaceBytes;
  int64_t sq;        // query rows (0: dk, dv are zeroed, nothing else runs)
  int64_t sk;        // key rows (0: dq is zeroed, nothing else runs)
  int32_t heads;     // query heads
  int32_t kvHeads;   // key / value heads; divides heads (query head h reads KV head h / (heads / kvHeads)); 0 = heads
  int32_t headDim;   // 64 or 128
  AttentionDtype dtype;
  bool causal;
  AttentionBwdDq dqMode;
  float scale;       // 0: 1 / sqrt(headDim); otherwise finite and > 0; must be the forward's
  int64_t qStart;    // global position of q row 0 (causal)
  int64_t kStart;    // global position of k row 0 (causal)
  AttentionBwdCore core;  // kAuto (0) unless a comparison needs one core; both give the same results within rounding
};

/// Bytes of workspace the launch needs for these params (sizes, heads and dqMode matter; pointers do not). Host only.
size_t attentionBwdWorkspaceBytes(const AttentionBwdParams& params);

/// Throws tandem::Error(kInvalidArgument) naming the broken rule ("rule kv_heads: ..."). Host only;
/// launchAttentionBwd calls it first.
void validateAttentionBwd(const AttentionBwdParams& params);

/// Enqueues the attention backward on `stream` (3 kernels: per-row dot(dout, o) and lse in log2 units; dk / dv (and
/// dq in kAtomic mode) on the core params.core selects; dq (kDeterministic, on the same core) or its rounding
/// (kAtomic)). Throws tandem::Error: kInvalidArgument from
/// validateAttentionBwd, kUnsupported on a GPU that is not sm_90, kCuda when a CUDA call fails. Thread-safe.
void launchAttentionBwd(const AttentionBwdParams& params, cudaStream_t stream);

/// Loads every attention backward kernel on `device` now (tandem/kernels/preload.hpp says why). Throws
/// std::runtime_error when one cannot be loaded.
void preloadAttentionBwdKernels(int device);

}  // namespace tandem::kernels
