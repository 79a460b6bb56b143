// The cuda backend's entry for each op of the table (op_spec.hpp): what the executors check, launch and preload. Both
// executors, the client gate and executorOps look an op up here and call its entry; none of them switches on the op
// kind. An op of the table without an entry is one neither executor runs; cuda_host_test fails, naming it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/kernels/fused_ops.hpp"

namespace tandem::kernels {

/// One launch of an op on one rank, as an executor asks for it.
struct GpuLaunch {
  const OpDescriptor& desc;
  const DevicePointers& ptrs;  // this rank's slots, in the launcher's context
  uint64_t epoch;
  const FusedEnv& env;         // this rank's communicator as the launcher maps it
  cudaStream_t stream;
  const PlanChoice& plan;      // the fused GEMMs' plan (kAuto: the kernels' own rules); ignored by the others
  bool readVerdict;            // executor client: the kernels read tandemd's verdict and skip a rejected op
  bool replayed = false;       // captured into a CUDA graph: no tandemd completion (MoE reports into the replay fault)
  /// Executor client, an op whose entry sets needsRankRows: every rank's rows of this op (rankRows[r]: rank r's), as
  /// tandemd published them on the control page. Empty otherwise.
  std::span<const uint64_t> rankRows = {};
};

/// How tandemd's daemon executor runs an op once every rank released it.
enum class DaemonRun : uint8_t {
  kWorkItem,     // an item for the persistent kernel (allgather's is built there; a barrier's is empty)
  kLaunch,       // `launch` on each rank's GPU executor stream, rank by rank (fused GEMMs, MoE)
  kLaunchMapped, // `launchMapped` over every rank's mapped tensors at once (ring attention)
};

/// What the executors need of one op.
struct GpuOp {
  /// Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run the op: the kernels'
  /// dtype, shape, alignment and workspace rules. Null: the table's validation is all.
  void (*check)(const OpDescriptor&, const DevicePointers&, const FusedEnv&, const PlanChoice&) = nullptr;
  /// Enqueues the op's kernels on the stream; returns the plan it ran, for the log ("" when there is nothing to
  /// say). Null: the op has no kernel (barrier). @throws Error(kCuda) or std::runtime_error if CUDA refused.
  std::string (*launch)(const GpuLaunch&) = nullptr;
  /// Executor daemon, DaemonRun::kLaunchMapped: enqueues rank `rank`'s kernel where tandemd maps every rank's tensors
  /// (descs[q], ptrs[q]: rank q's). Returns what ran, for the log.
  std::string (*launchMapped)(std::span<const OpDescriptor> descs, std::span<const DevicePointers> ptrs, uint32_t rank,
                              cudaStream_t stream) = nullptr;
  /// Loads the op's kernels on a device, before any stream waits on tandemd (preload.hpp says why).
  void (*preload)(int device) = nullptr;
  /// Its kernel waits for tandemd's go itself (AllGather's opGate): the client's stream need not wait for it.
  bool kernelWaitsForGo = false;
  /// A fused GEMM: plans (the plan table, autotune) apply, and at one rank under the daemon executor the caller's
  /// stream runs it.
  bool fusedGemm = false;
  DaemonRun daemonRun = DaemonRun::kWorkItem;
  /// Executor client: why it does not run this op yet (null: it does). executorOps(kClient) leaves the op out and
  /// executorRefusal quotes this; the daemon executor still runs it through its entry.
  const char* clientPending = nullptr;
  /// Executor client: its launch needs every rank's row count (dims[kSeq]) on the host, which libtandem learns only from
  /// tandemd: tandemd publishes them on each rank's control page when it decides the op (ControlPage::rankRows), and
  /// libtandem waits for them between submitting the op and launching it (GpuLaunch::rankRows). A replay has no
  /// tandemd step: a capture takes them from the rank's last eager call of the same shape (its warm-up), and the op
  /// entry's fingerprint carries them (collectiveFingerprint with rows), so ranks that assumed other rows diverge.
  bool needsRankRows = false;
  /// Executor client: rules its launch adds to `check` (ring attention's backward stages its inputs in the workspace).
  /// Null: none.
  void (*checkClient)(const OpDescriptor&, const DevicePointers&, const FusedEnv&) = nullptr;
};

/// Loads every entry's kernels on `device` (each preload once), as an executor must before any op.
void preloadGpuOps(int device);

/// The entry of `kind`, or null where the cuda backend has none.
const GpuOp* findGpuOp(OpKind kind);
/// The entry of `kind`; throws Error(kInternal) naming the op where there is none.
const GpuOp& gpuOp(OpKind kind);

}  // namespace tandem::kernels
