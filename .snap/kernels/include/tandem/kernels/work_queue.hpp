// The daemon executor's device work queue: host-mapped memory written by tandemd's host thread (GpuExecutor,
// daemon/src/cuda/daemon_executor.hpp) and read by the persistent kernel (persistent.hpp). Plain data, g++ and nvcc.
//
// Ring: the host writes item n into items[n % capacity], then publishes tail = n + 1 (release, seq_cst on the host);
// the kernel takes items in order, advancing consumed (a new kernel starts there) and finished (the host releases an
// item's memory after it). The host never has more than capacity items between consumed and tail.
#pragma once

#include <cstdint>

#include "tandem/kernels/allgather.hpp"

namespace tandem::kernels {

// kYield: the kernel leaves (every CTA, after the items before it), so that the daemon can run a kernel that needs
// every SM (a fused GEMM) next on the same stream; the daemon launches a fresh persistent kernel after it.
enum class WorkKind : uint32_t { kNop = 0, kAllGather = 1, kYield = 2 };
struct alignas(64) WorkItem {
  WorkKind kind;
  uint32_t needsGrid;   // 1: a lone lingering CTA must not run it (the host launches a full grid)
  uint32_t* doneWord;   // &CommControl::done of the rank, host-mapped in the daemon
  uint64_t epoch;
  AllGatherParams ag;
};
inline constexpr uint32_t kWorkQueueCapacity = 1024;

// Phase word: (generation << 8) | state. The host writes kLaunching with a new generation before each launch.
enum class KernelState : uint32_t { kLaunching = 0, kFull = 1, kShrinking = 2, kSolo = 3, kExiting = 4, kExited = 5 };
__host__ __device__ inline constexpr uint64_t phaseWord(uint64_t generation, KernelState s) {
  return (generation << 8) | static_cast<uint64_t>(s);
}
__host__ __device__ inline constexpr uint64_t phaseGeneration(uint64_t phase) { return phase >> 8; }
__host__ __device__ inline constexpr KernelState phaseState(uint64_t phase) {
  return static_cast<KernelState>(phase & 0xff);
}

struct alignas(128) WorkQueue {
  uint64_t tail;          // host: items [0, tail) were pushed (release)
  uint8_t pad0[120];
  uint64_t consumed;      // kernel: items [0, consumed) were taken (a new kernel starts here)
  uint8_t pad1[120];
  uint64_t finished;      // kernel: items [0, finished) completed (their memory may be released)
  uint8_t pad4[120];
  uint64_t phase;         // kernel (and the host before a launch)
  uint8_t pad2[120];
  uint64_t stop;          // host: non-zero = exit now
  uint8_t pad3[120];
  WorkItem items[kWorkQueueCapacity];
};

}  // namespace tandem::kernels
