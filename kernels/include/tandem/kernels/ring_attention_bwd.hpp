// Ring attention's backward on the cuda backend (tandem_ring_attention_backward), built on the attention backward core
// (attention_bwd.hpp), for the daemon executor: tandemd maps every rank's tensors and runs the op only once every
// rank's stream has reached it, so rank r's launch reads its peers' q, k, v, o, dout and lse where they are.
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
// The client executor does not run it (GpuOp::clientPending says why): its core calls need every rank's rows on the
// host, which libtandem learns only from its own descriptor.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/kernels/fused_ops.hpp"

namespace tandem::kernels {

/// Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run the backward `d` on the
/// cuda backend: the dtype, head_dim, alignment, rank count or row count.
void checkRingAttentionBackward(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env);

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
