// Ring attention's backward on the cuda backend (tandem_ring_attention_backward), built on the attention backward core
// (attention_bwd.hpp), for both single-node executors.
//
// A rank's rows are one run (contiguous layout: global position chunkStart(r)) or two (zigzag: the first ceil(seq/2)
// rows at chunk r, the rest at chunk 2n-1-r), with the forward's positions (chunk << 32; ring_attention.hpp). Rank r
// writes only its own gradients:
//   dq_r       = sum over every rank j and KV run of j of core(q run of r, KV run of j).dq
//   dk_r, dv_r = sum over every rank i and q run of i of core(q run of i, KV run of r).dk / .dv
// skipping pairs wholly in the causal future. Each core call writes its partial gradients in the op's dtype; they are
// summed in fp32 in a fixed order (other rank o = 0..n-1, runs in order) and rounded once, so the op is bitwise
// repeatable (the core runs in its deterministic dq mode). A pair of r's own runs serves dq and dk/dv with one call.
// Scratch (the fp32 sums, one pair's partials, a run's lse repacked to [heads, run rows], the core's workspace) is one
// stream-ordered allocation (cudaMallocAsync / cudaFreeAsync on the launch stream).
//
// Every core call needs both runs' row counts on the host (grid sizes, offsets), so every rank's seq:
// - Executor daemon (launchRingAttentionBackwardMapped): tandemd holds every rank's descriptor and maps every rank's
//   q, k, v, o, dout and lse; it runs the op once every rank's stream reached it, reading the inputs where they are.
// - Executor client (launchRingAttentionBackward): libtandem sees only its own descriptor, so tandemd publishes every
//   rank's seq on each rank's control page when it decides the op (GpuOp::needsRankRows), and libtandem's host waits
//   for them before launching. Peers cannot map the caller's buffers, so per rank and op (epoch e, stream order):
//     1. the rank copies its q, k, v, o, dout and lse into its workspace's data region (ringBackwardStaging);
//     2. the staged barrier (the forward's finish kernel over RingBackwardFlags::staged): each peer's word for this
//        rank = e, after a system fence over the copies; then every peer's word here >= e;
//     3. the same core calls and sums as the daemon executor's, in the same order, reading the peers' inputs from
//        their workspaces (the rank's own from its tensors): the gradients are bit for bit the daemon executor's;
//     4. the forward's end-of-op handshake (RingAttentionFlags::done): no peer still reads this rank's workspace when
//        the op completes, so the next op may overwrite it.
//   In device-epoch mode (op_entry.hpp) the barriers take the op entry's epoch, as the forward's do. A CUDA graph
//   replays it with the rows of the capturing rank's warm-up (its last eager call of the same shape; GpuOp::
//   needsRankRows): a replay has no tandemd step to learn them from.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/ring_attention.hpp"

namespace tandem::kernels {

/// Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run the backward `d` on the
/// cuda backend: the dtype, head_dim, alignment, rank count or row count.
void checkRingAttentionBackward(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env);

/// Executor client: ring attention backward's words in every rank's workspace, after the forward's (the same unused
/// tail of the AllGather header, zeroed with the workspace, never reset). Written by the peers (step 2).
inline constexpr uint64_t kRingBwdFlagsOffset = kRingFlagsOffset + 1024;
struct alignas(128) RingBackwardFlags {
  uint64_t staged[kMaxLocalRanks];  // [q] = epoch: rank q's inputs of that op are in q's workspace (step 2)
};
static_assert(kRingFlagsOffset + sizeof(RingAttentionFlags) <= kRingBwdFlagsOffset);
static_assert(kRingBwdFlagsOffset + sizeof(RingBackwardFlags) <= kWorkspaceHeaderBytes);

/// Where executor client stages one rank's inputs in its workspace's data region (offsets from its start), from the
/// rank's seq and the op's global dims: the same on every rank, so peers find each other's tensors.
struct RingBackwardStaging {
  uint64_t q, k, v, o, dout, lse, bytes;
};
inline RingBackwardStaging ringBackwardStaging(const OpDescriptor& d, uint64_t seq) {
  const uint64_t heads = d.dims[dim::kHeads], hd = d.dims[dim::kHeadDim];
  const uint64_t kvHeads = d.dims[dim::kKvHeads] == 0 ? heads : d.dims[dim::kKvHeads];
  const uint64_t qBytes = seq * heads * hd * 2, kvBytes = seq * kvHeads * hd * 2, lseBytes = heads * seq * 4;
  RingBackwardStaging s{};
  uint64_t off = 0;
  const auto take = [&off](uint64_t bytes) { const uint64_t at = off; off += (bytes + 255) / 256 * 256; return at; };
  s.q = take(qBytes);
  s.k = take(kvBytes);
  s.v = take(kvBytes);
  s.o = take(qBytes);
  s.dout = take(qBytes);
  s.lse = take(lseBytes);
  s.bytes = off;
  return s;
}

/// Executor client: throws Error(kInvalidArgument) naming the workspace_bytes to declare when this rank's inputs do not
/// fit its workspace's data region (step 1). Like the forward's, it depends on this rank's seq only.
void checkRingAttentionBackwardStaging(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env);

/// Executor client: enqueues op `epoch` (checked) of rank env.rank on `stream` (steps 1-4; at one rank the core calls
/// alone). rankRows[q] is rank q's seq as tandemd published it (rankRows[env.rank] == d's). Returns what ran, for the
/// log. Throws Error(kCuda, kInvalidArgument).
std::string launchRingAttentionBackward(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch,
                                        const FusedEnv& env, std::span<const uint64_t> rankRows, cudaStream_t stream);

/// Executor daemon: enqueues rank `rank`'s gradients on `stream`, reading every rank's inputs where tandemd maps them
/// (descs[q], ptrs[q]: rank q's). The caller must not let any rank's stream go on before every rank's launch has
/// finished (each reads the others' inputs). Returns what ran, for the log. Throws Error(kCuda, kInvalidArgument).
std::string launchRingAttentionBackwardMapped(std::span<const OpDescriptor> descs,
                                              std::span<const DevicePointers> ptrs, uint32_t rank,
                                              cudaStream_t stream);

/// Loads the backward's kernels (the core's and the sums') on `device` (preload.hpp says why).
void preloadRingAttentionBackwardKernels(int device);

// ---- ring_attention_bwd.cu (nvcc) ---------------------------------------------------------------------------------
/// One elementwise pass over `count` values: acc[i] += float(part[i]) (accumulate) or out[i] = round(acc[i]) (round).
struct GradSumParams {
  float* acc;
  const void* part;  // accumulate: the core's partial, bf16 or fp16
  void* out;         // round: the rank's gradient, bf16 or fp16
  int64_t count;
  bool bf16;  // else fp16
};
void launchGradAccumulate(const GradSumParams& p, cudaStream_t stream);
void launchGradRound(const GradSumParams& p, cudaStream_t stream);
void preloadGradSumKernels(int device);

}  // namespace tandem::kernels
