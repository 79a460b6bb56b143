// The CPU reference backend's op implementations: every fused op, run on host memory that the daemon
// has mapped for each rank. It is the numerical reference for the GPU kernels, never presented as fast:
// fp32 accumulation, outputs rounded once to the output dtype.
#pragma once

#include <array>
#include <cstddef>
#include <span>

#include "tandem/common/descriptor.hpp"

namespace tandem::daemon {

// One rank's part of a collective op, every slot resolved to memory the daemon has mapped.
struct RankOp {
  OpDescriptor desc;                                // already passed validateDescriptor
  std::array<std::byte*, kMaxOpBuffers> data{};     // nullptr for absent optional slots
};

// Runs one collective op. ranks[r] is rank r; validateCollective has passed. Data-dependent problems
// (an expert id out of range, moe capacity too small) throw Error(kInvalidArgument) before any output is
// written. Safe to call from several threads on different ops.
void runCpuOp(std::span<const RankOp> ranks);

}  // namespace tandem::daemon
