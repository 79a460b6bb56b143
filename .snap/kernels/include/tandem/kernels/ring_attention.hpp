// Ring attention on the cuda backend, from an op descriptor to work on a stream, for both executors (libtandem into
// the caller's stream, tandemd into its own). One launch of the attention core per op and rank: it computes with the
// rank's own KV first and reads every peer's KV straight from the peer's workspace (TMA over NVLink, all peers at
// once), waiting per KV tensor on the flag the peer's stream writes once its KV is in place, never per ring step.
//
// Per rank and op (epoch e, stream order):
//   1. stream writes: flags.kvLength = seq, then flags.started = e (peers learn how many rows to read);
//   2. the rank's k and v are copied into its workspace (peers cannot map the caller's buffers), then
//      flags.kvReady = e;
//   3. the attention core over [local KV, then the peers' KV from a CTA-dependent peer on (rank - 1 - b, ...), so
//      that the CTAs in flight read every peer at once];
//   4. a one-CTA finish kernel: tells every peer it has finished reading its KV (peer.done[rank] = e) and waits until
//      every peer has said the same to it, so that no peer still reads this rank's workspace when the op completes
//      (the next op may overwrite it).
// In device-epoch mode (op_entry.hpp: a graph was captured on the communicator) the epoch of steps 1, 2 and 4 and of
// step 3's waits is the op entry's (FusedEnv::epochWord), not the host's: steps 1 and 2's words are written by a
// one-thread kernel (launchRingPublish) instead of stream memory operations, whose values a graph would fix at
// capture. The flags then hold F (64 bits), which the entry's floor lifts past every host epoch they held before.
// Global positions are (chunk << 32) + offset, chunk = rank (contiguous) or r and 2n-1-r (zigzag): causal masking
// needs only their order, so no rank needs the others' lengths to place its own rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/fused_ops.hpp"

namespace tandem::kernels {

/// Ring attention's words in every rank's workspace: in the unused tail of the AllGather header (which no other op
/// writes), zeroed with the workspace and never reset. Each word holds the low 32 bits of an epoch or a row count
/// (the stream writes 32-bit values; the high half stays 0).
inline constexpr uint64_t kRingFlagsOffset = 60u << 10;
struct alignas(128) RingAttentionFlags {
  uint64_t kvLength;  // this rank's rows in the current op; written by its stream before `started`
  uint64_t started;   // epoch: this rank's stream reached the op (kvLength valid)
  uint64_t pad0[14];
  uint64_t kvReady;   // epoch: this rank's k and v are in its workspace's data region
  uint64_t pad1[15];
  uint64_t done[kMaxLocalRanks];  // [q] = epoch: rank q has finished reading this rank's KV
};
static_assert(sizeof(WorkspaceHeader) <= kRingFlagsOffset, "ring attention's flags overlap the AllGather header");
static_assert(kRingFlagsOffset + sizeof(RingAttentionFlags) <= kWorkspaceHeaderBytes);

/// Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run ring attention `d`
/// (already checked by validateDescriptor): the dtype, head_dim, alignment, or a workspace too small for its KV.
void checkRingAttention(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env);

/// Enqueues ring attention op `epoch` (checked) on `stream`. Returns what ran, for the log. Throws Error(kCuda).
std::string launchRingAttention(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch,
                                const FusedEnv& env, cudaStream_t stream);

/// Executor daemon: tandemd maps every rank's tensors, and it runs the op only once every rank's stream has reached it
/// (the inputs are final), so rank `rank`'s kernel reads its peers' k and v where they are: no copy, no flags, no
/// handshake. descs[q] and ptrs[q] are rank q's descriptor and slots in tandemd's context. The caller must not let
/// any rank's stream go on (done) before every rank's kernel has finished, since each reads the others' k and v.
std::string launchRingAttentionMapped(std::span<const OpDescriptor> descs, std::span<const DevicePointers> ptrs,
                                      uint32_t rank, cudaStream_t stream);

/// Loads ring attention's kernels (the attention core and the finish kernel) on `device` (preload.hpp says why).
void preloadRingAttentionKernels(int device);

// ---- ring_attention.cu (nvcc) -------------------------------------------------------------------------------------
// Step 4's handshake, also the barrier ring attention's backward runs after staging its inputs (with its own words):
// each peer q's word for this rank is set to the epoch (after a system fence over the stream's earlier work), then
// this rank waits until every peer has set its word here.
struct RingFinishParams {
  uint64_t* peerDone[kMaxLocalRanks];       // [q]: &flags(q).done[rank] in this address space (q != rank)
  const uint64_t* myDone[kMaxLocalRanks];   // [q]: &flags(rank).done[q]
  const uint64_t* abortWord;
  ErrorSlot* errorSlot;
  uint64_t value;  // the op's epoch, low 32 bits
  const uint64_t* epochWord;  // device-epoch mode: the epoch is *epochWord (wait.cuh opEpoch); null: value
  uint64_t timeoutNs;
  uint32_t rank, nranks, op;
};
void launchRingFinish(const RingFinishParams& p, cudaStream_t stream);

// Device-epoch mode's steps 1 and 2 (the words a peer waits on), in place of the stream memory operations.
struct RingPublishParams {
  RingAttentionFlags* mine;   // this rank's flags
  const uint64_t* epochWord;  // the op entry's epoch for this op (FusedEnv::epochWord); not null
  uint64_t kvLength;          // this rank's rows (step 1)
  uint32_t kvReady;           // 0: step 1 (kvLength, then started = F); 1: step 2 (kvReady = F, after the KV copies)
};
void launchRingPublish(const RingPublishParams& p, cudaStream_t stream);
/// Loads the finish and publish kernels on `device`.
void preloadRingFinishKernel(int device);

}  // namespace tandem::kernels
