// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) of one communicator rank, from an op descriptor to kernels on a
// stream: the workspace layout every rank shares, the shape and alignment rules, the plan, and the launch. One copy
// for both launchers: libtandem (executor client, the caller's stream) and tandemd (executor daemon, its own stream
// between persistent kernels). Host code; throws tandem::Error with the remedy.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/kernels/allgather.hpp"

namespace tandem::kernels {

// Each slot's device address in the launching process (buffer mapping + offset), in descriptor slot order; null =
// absent.
using DevicePointers = std::array<void*, kMaxOpBuffers>;

// Where the ops keep, in every rank's workspace, what peers write or read. The same on every rank and fixed for the
// communicator's life: tandemd zeroes the workspace once and flags are never reset, so no op's data may ever land
// where another op keeps flags. Computed from the workspace size (tandemd's per-rank byte budget).
//   [0, allgather)  AllGather: header and chunk slots (kernels::workspaceBytes)
//   ag-gemm flags   arrive and chunk flags (agFlagWords uint64)
//   gemm-rs/ar      the kernels' fixed layout (gemmRsFixedWorkspaceBytes): flags, then inbox and outbox, each
//                   double-buffered by epoch parity, matrices of rsMatBytes
//   data            2 * rsMatBytes: ag-gemm's gathered A, or gemm-rs/ar's output staging, or the MoE ops' receive
//                   rows and scratch (moe_ops.hpp)
//   moe             kMoeControlBytes: the MoE ops' flags and routing table (moe.hpp), written by no other op
//   split-K         kFusedSplitKBytes: the layouts core's split-K scratch (gemm_layouts.hpp) for the fused GEMMs that
//                   run on it; its counters are zero between launches (zeroed once, left zeroed by every launch), and
//                   only this rank's stream uses it. Absent (splitKBytes 0) in a workspace too small for it.
// The gemm-rs/ar inbox receives peers' partials of op e + 1 while this rank may still run op e, and a peer may still
// read this rank's outbox of op e - 1 once this rank has moved on, so the staging matrices are shared only with an op
// that no rank enters before every rank has left op e - 1 and no rank leaves before every rank is done with them.
// Gathered A and the output staging share: peers write them only once this rank has started the op (ag-gemm pushes
// after the destination's arrive flag; a reduced tile needs the destination's own partial first).
// The span, from the gemm-rs/ar staging matrices to the end of data ((2 nranks + 4) x rsMatBytes), holds the MoE FFN's
// receive rows: its rows, h and y are written only after its plan kernel saw every rank's counts of this op (every rank
// left its previous op), and its combine ends with a barrier over every rank after the last read of y. The FFN's
// scratch, written before that plan, stays at the end of data. Without the span its receive rows would be sized into
// 2 x rsMatBytes and the workspace would be nranks + 2 times as large as they are.
struct WorkspaceLayout {
  uint64_t agFlagsOff = 0, agFlagWords = 0;
  uint64_t rsOff = 0, rsMatBytes = 0;
  uint64_t dataOff = 0, dataBytes = 0;
  uint64_t spanOff = 0, spanBytes = 0;  // the gemm-rs/ar staging matrices through the end of data
  uint64_t moeOff = 0;                  // kMoeControlBytes from here
  uint64_t splitKOff = 0, splitKBytes = 0;
  // The largest layout that fits `bytes` per rank.
  static WorkspaceLayout fit(uint64_t bytes, uint32_t nranks);
  // Workspace bytes per rank whose layout holds `matBytes` matrices (rounded up to tandemd's 2 MiB granularity).
  static uint64_t bytesFor(uint64_t matBytes, uint32_t nranks);
  // Workspace bytes per rank whose span holds `spanBytes` and whose data region holds `dataBytes` (at its end).
  static uint64_t bytesForSpan(uint64_t spanBytes, uint64_t dataBytes, uint32_t nranks);
};

// What an op refused for lack of workspace tells its caller to do: ask for `bytes` per rank when the communicator is
// created (tandem_comm_config_t.workspace_bytes), which each rank's limits.max_session_bytes bounds.
std::string workspaceRemedy(uint64_t bytes);

// The workspace per rank (tandem_comm_config_t.workspace_bytes) that op `d` of `nranks` ranks needs: what a rank
// declares for its largest op. The MoE FFN's receive rows depend on the routing: `moeRows` is the most a rank is
// expected to receive (0: tokens x topk, a balanced routing).
uint64_t workspaceBytesFor(const OpDescriptor& d, uint32_t nranks, uint64_t moeRows = 0);

// One rank's view of its communicator, as mapped in the process that launches the kernels.
struct FusedEnv {
  uint32_t rank = 0, nranks = 0;
  std::array<char*, kMaxLocalRanks> workspaces{};  // every rank's workspace base
  uint64_t workspaceBytes = 0;                     // the smallest rank's: the layout is the same on every rank
  WorkspaceLayout layout;                          // WorkspaceLayout::fit(workspaceBytes, nranks)
  CommControl* ctl = nullptr;                      // this rank's control page (abort word, error slot), device view
  uint64_t timeoutNs = 0;                          // every kernel wait's deadline
  // Device-epoch mode (op_entry.hpp; libtandem, executor client, once the communicator captured an op into a CUDA
  // graph): this rank's OpEntryWords::epoch, which AllGather, the fused GEMMs, ring attention and the MoE kernels take
  // their flags' epoch from. Null: the launch's epoch (tandemd's count), as ever.
  const uint64_t* epochWord = nullptr;
  uint32_t commSms = 0;  // cuda.comm_sms: ag-gemm's communication SMs (0: chosen per shape); gemm-rs/ar choose their own
  // Every rank's output C, mapped here, when the launcher has them all (tandemd, executor daemon): gemm-rs/ar then write
  // reduced rows straight into the peers' outputs instead of staging them in the workspace and copying them out.
  std::array<void*, kMaxLocalRanks> outputs{};
};

bool isFusedGemm(OpKind kind);

// The split-K scratch each rank's workspace keeps for the fused GEMMs on the layouts core (WorkspaceLayout).
inline constexpr uint64_t kFusedSplitKBytes = 4u << 20;

// The largest M (rows of C) at which the fused GEMMs run NT and NN operands on the layouts core's small-M path (swap-AB
// tiles, split-K) followed by the collective, instead of the 128-row tiles of the fused kernels: gemm_layouts_plan.hpp's
// swap-AB limit.
inline constexpr uint64_t kFusedSmallM = 256;

// Whether fused GEMM `d` runs on the layouts core (its GEMM, then the collective) rather than the fused kernels:
// layout TN always; NT and NN at m <= kFusedSmallM unless `plan` forces the fused kernels.
bool fusedGemmOnLayoutsCore(const OpDescriptor& d, const PlanChoice& plan = {});

// Loads every fused GEMM kernel on `device` (preload.hpp says why); cheap after the first call per device.
void preloadFusedGemmKernels(int device);

// Ops whose release waits until every rank's stream reached them (the stream writes ready first): barriers of two or
// more ranks, and reduce-scatters whose kernels alone do not keep the ranks in step (some rank owns no rows;
// gemm_rs.hpp, gemmRsRanksInStep). tandemd and libtandem both apply it.
bool needsGang(const OpDescriptor& d);

// `plan` (from tandemd's plan table, common/plan_key.hpp): kind kAuto keeps the kernels' own rules; otherwise the op
// runs that plan, at one rank too (the forced fused plan of a one-rank gemm-rs or gemm-ar measures its epilogue). Every
// rank must pass the same plan, to both calls below: the workspace check depends on it. ag-gemm at one rank always runs
// its local plan (there is nothing to gather).

// Throws Error (kUnsupported, kInvalidArgument) with the remedy when `env`'s rank cannot run the fused GEMM `d`
// (already checked by validateDescriptor): the dtype, the kernels' shape and alignment rules, or the workspace.
// Depends only on what every rank checks alike (global dims, the workspace size), except this rank's own k slice and
// pointers.
void checkFusedGemm(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env,
                    const PlanChoice& plan = {});

// Enqueues op `epoch` (checked) on `stream`: the kernels, and the copy out of the workspace where the output or the
// gathered A is staged there. Returns the plan it ran, for the log. Throws Error(kCuda) if CUDA refused part of it.
std::string launchFusedGemm(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, const FusedEnv& env,
                            cudaStream_t stream, const PlanChoice& plan = {});

}  // namespace tandem::kernels
