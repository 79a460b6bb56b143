// The graph replay test's check of a replay on the device (graph_replay_compare.cu): each replay's outputs compared
// byte for byte with a device copy of the eager run's on the same stream, behind the replay, so that the test
// synchronises only every few dozen replays instead of downloading every replay's outputs. Plain host API: the test
// itself is host C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::gputest {

/// ReplayMismatches::firstReplay when no replay differed; ReplayMismatches::pending when the replay in flight does
/// not differ.
inline constexpr uint32_t kNoReplay = 0xFFFFFFFFu;
inline constexpr uint64_t kNoDifference = ~uint64_t{0};

/// What the device checks found since resetReplayMismatches, in device memory; read it after the stream finished.
struct ReplayMismatches {
  uint32_t replays;      // how many replays differed
  uint32_t firstReplay;  // the lowest replay index that differed, kNoReplay when none
  uint32_t firstSlot;    // in that replay, the first slot that differed (an index into ReplayCompare::slots)
  uint32_t reserved;
  uint64_t firstByte;  // that slot's first differing byte
  uint64_t pending;    // the replay being compared: its first difference as (slot << 48) | byte, or kNoDifference
};

/// More than any op has outputs (tandem::kMaxOpBuffers; the test checks).
inline constexpr int kMaxCompareSlots = 16;

/// One output: `bytes` at `got` (the replay's) against `want` (the eager run's), both device memory.
struct CompareSlot {
  const void* got;
  const void* want;
  uint64_t bytes;
};

/// One replay's comparison: its first `count` slots, recorded as replay `replay` into `record`.
struct ReplayCompare {
  CompareSlot slots[kMaxCompareSlots];
  uint32_t count;
  uint32_t replay;
  ReplayMismatches* record;
};

/// Loads the kernels below on the current device. Under lazy module loading a kernel's first launch may wait for the
/// context to go idle, and the compare is launched behind a replay that waits on its peers (see
/// tandem/kernels/preload.hpp): call it once per process, before the first replay.
cudaError_t preloadReplayCompareKernels();

/// Enqueues `*m` = nothing found (no replays, firstReplay kNoReplay, pending kNoDifference).
cudaError_t resetReplayMismatches(ReplayMismatches* m, cudaStream_t stream);

/// Enqueues the comparison of `c.slots` and its record into `*c.record`: when any byte differs, replays + 1, and the
/// replay index, slot and first byte if it is the lowest index recorded so far.
cudaError_t launchReplayCompare(const ReplayCompare& c, cudaStream_t stream);

/// Enqueues the flip of the lowest bit of byte `byte` at `p` (device memory): a replay made to differ, so that the
/// test can show its check fails.
cudaError_t launchFlipByte(void* p, uint64_t byte, cudaStream_t stream);

}  // namespace tandem::gputest
