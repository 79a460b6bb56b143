// The MoE ops (moe-dispatch-gemm, moe-dispatch-ffn-combine, moe-ffn-backward) of one communicator rank, from an op descriptor to kernels
// on a stream, for both launchers: libtandem (executor client, the caller's stream) and tandemd (executor daemon, its
// own stream between persistent kernels), as fused_ops.hpp does for the fused GEMMs. Host code; throws tandem::Error
// with the remedy.
//
// Where the op keeps its state in every rank's workspace (WorkspaceLayout): its flags and routing table in the moe
// region (no other op writes there), its receive rows at the start of the data region and this rank's private scratch
// at its end. Peers write a rank's receive rows only once that rank has started the op (their dispatch follows every
// rank's plan), and its y rows stay until every rank has combined (the combine's last barrier), so the data region is
// shared with the fused GEMMs as they share it with each other.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "tandem/common/descriptor.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

bool isMoeOp(OpKind kind);

/// Throws Error (kUnsupported, kInvalidArgument) with the remedy when `env`'s rank cannot run the MoE op `d` (already
/// checked by validateDescriptor): the dtype, the kernels' shape and alignment rules, or the workspace.
void checkMoeOp(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env);

/// Enqueues op `epoch` (checked) on `stream`; `readVerdict`: the kernels read tandemd's verdict for the epoch from the
/// control page and do nothing for a rejected op (executor client, where the stream runs them regardless);
/// `replayed`: the op is captured into a CUDA graph, so a data error goes to the control page's replay fault (no
/// tandemd completion reads the epoch's entry). With env.epochWord set the flags take the op entry's epoch. Returns
/// the plan it ran, for the log. @throws Error(kCuda) if CUDA refused part of it.
std::string launchMoeOp(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, const FusedEnv& env,
                        cudaStream_t stream, bool readVerdict, bool replayed = false);

/// The message of an MoE op's data error `f` (a bad expert id, or more rows than a rank holds) for the rank whose
/// descriptor is `d`: the op, the rank, and the token, slot and id, or the rows and what to change.
std::string moeFaultText(const OpFault& f, const OpDescriptor& d);

}  // namespace tandem::kernels
