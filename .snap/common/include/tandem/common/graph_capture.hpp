// Which ops a CUDA graph may hold (the capture policy of the cuda backend's client side), and the fingerprint that
// lets the ranks of a replayed op check that they are on the same op. Host-only and CUDA-free: libtandem applies it,
// and CI tests it without a GPU. The device side: kernels/include/tandem/kernels/op_entry.hpp.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem {

/// The ops of a multi-rank communicator that replay from a CUDA graph with the client executor: their kernels take
/// their flags' epoch from device memory (AllGather; ag-gemm, gemm-rs, gemm-ar on every plan; ring attention, whose
/// KV publication is a kernel then; the two MoE ops, whose data errors a replay leaves in the control page for the
/// next eager op to report; the barrier, which is the op entry alone).
OpSet graphReplayableOps();

/// Why op `d` (of `d.nranks` ranks) may not be captured into a CUDA graph on a communicator run by `executor` ("client",
/// "daemon", "host"), or "" when it may. One rank is always allowed (nothing to meet). The text names the op, the
/// reason and what to do instead.
std::string captureRefusal(std::string_view executor, const OpDescriptor& d);

/// A fingerprint of what every rank of collective `d` passes alike (kind, version, dtype, flags, scale, nranks and the
/// global dims: what validateCollective compares), never 0. Two ranks replaying different ops of one communicator
/// (another kind or shape at the same place in their sequences) differ in it.
uint64_t collectiveFingerprint(const OpDescriptor& d);
/// The same, with every rank's rows mixed in, for an op whose launch needs them (ring attention's backward): ranks
/// that launched it with different views of the peers' rows differ in it, so their op entry fails them (ranks
/// diverged) instead of letting them read each other's staging with the wrong sizes.
uint64_t collectiveFingerprint(const OpDescriptor& d, std::span<const uint64_t> rankRows);

}  // namespace tandem
