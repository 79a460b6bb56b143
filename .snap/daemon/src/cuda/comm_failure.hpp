// Which rank's failed wait explains a communicator's failure, and which of its ops it fails. Host logic over the
// ranks' error slots (kernels::ErrorSlot), kept apart from NodeComm so that CPU tests cover it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "tandem/kernels/signals.hpp"

namespace tandem::daemon::cuda {

struct RankFailure {
  uint32_t rank = 0;
  kernels::ErrorSlot slot{};
};

/// The first epoch whose ops a rank's failure fails. A wait that timed out or was aborted names its op's epoch
/// (AllGather's flags carry it in their high half). A divergence fails every op not yet completed: the op entry that
/// found it reports either epochs or the ops' fingerprints, and whichever op the peers disagreed on, nothing after it
/// ran right on any rank.
uint64_t firstFailedEpoch(const kernels::ErrorSlot& e);

/// The failure that explains the others, given each rank's slot (nullopt: no failure). A divergence is the cause of
/// the waits it aborted and of the peers' timeouts; a timeout names the rank that stopped; an abort alone is a
/// consequence. Among failures of one kind, the one of the earliest epoch, then the lowest rank, so every rank's op
/// and the communicator report the same failure whatever order tandemd read the slots in.
std::optional<RankFailure> rootFailure(std::span<const std::optional<kernels::ErrorSlot>> slots);

}  // namespace tandem::daemon::cuda
