// The graph replay test's device check (graph_replay_compare.hpp). Two kernels per replay: the compare, over many
// blocks, leaves the replay's first difference in ReplayMismatches::pending (an atomicMin, so the lowest slot and byte
// win); then one thread records it. The kernel boundary between them orders the compare's writes before the record
// reads them, with no fence or last-block counter.
#include <cstdint>

#include "graph_replay_compare.hpp"

namespace tandem::gputest {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 512;  // enough to stream a few MiB of outputs; the ranks share the GPU with the replays
constexpr int kSlotShift = 48;   // pending = (slot << 48) | byte: outputs are far below 2^48 bytes
static_assert(kMaxCompareSlots < (1 << (64 - kSlotShift)));

// The first byte (in memory order: little-endian) where two different words differ.
__device__ uint32_t firstByteOf(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>(__ffs(static_cast<int>(a ^ b)) - 1) / 8;
}

__device__ uint64_t firstDifference(uint4 a, uint4 b) {
  if (a.x != b.x) return firstByteOf(a.x, b.x);
  if (a.y != b.y) return 4 + firstByteOf(a.y, b.y);
  if (a.z != b.z) return 8 + firstByteOf(a.z, b.z);
  if (a.w != b.w) return 12 + firstByteOf(a.w, b.w);
  return kNoDifference;
}
__device__ uint64_t firstDifference(uint32_t a, uint32_t b) { return a != b ? firstByteOf(a, b) : kNoDifference; }
__device__ uint64_t firstDifference(unsigned char a, unsigned char b) { return a != b ? 0 : kNoDifference; }

// This thread's first differing byte among words [begin, end) of the Word arrays (grid-stride), or kNoDifference.
// Its words come in ascending order, so the first one found is its lowest.
template <typename Word>
__device__ uint64_t scan(const void* got, const void* want, uint64_t begin, uint64_t end) {
  const auto* g = static_cast<const Word*>(got);
  const auto* w = static_cast<const Word*>(want);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = begin + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += stride) {
    const uint64_t at = firstDifference(g[i], w[i]);
    if (at != kNoDifference) return i * sizeof(Word) + at;
  }
  return kNoDifference;
}

// One slot, in the widest words both pointers' alignment allows (16 or 4 bytes), its tail in bytes.
__device__ uint64_t firstDifference(const CompareSlot& s) {
  const auto align = reinterpret_cast<uintptr_t>(s.got) | reinterpret_cast<uintptr_t>(s.want);
  uint64_t head = 0;  // bytes compared in words
  uint64_t at = kNoDifference;
  if (align % 16 == 0) {
    head = s.bytes / 16 * 16;
    at = scan<uint4>(s.got, s.want, 0, head / 16);
  } else if (align % 4 == 0) {
    head = s.bytes / 4 * 4;
    at = scan<uint32_t>(s.got, s.want, 0, head / 4);
  }
  if (at != kNoDifference) return at;
  // A difference in the words comes before any in the tail: a thread that found none there looks at the tail.
  return scan<unsigned char>(s.got, s.want, head, s.bytes);
}

__global__ void __launch_bounds__(kThreads) compareReplay(const __grid_constant__ ReplayCompare c) {
  uint64_t first = kNoDifference;  // this thread's lowest (slot << 48) | byte
  for (uint32_t s = 0; s < c.count && first == kNoDifference; ++s) {
    const uint64_t at = firstDifference(c.slots[s]);
    if (at != kNoDifference) first = (static_cast<uint64_t>(s) << kSlotShift) | at;
  }
  for (int lane = 16; lane > 0; lane /= 2) {
    const uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, first, lane);
    first = other < first ? other : first;
  }
  if (threadIdx.x % 32 == 0 && first != kNoDifference) {
    atomicMin(reinterpret_cast<unsigned long long*>(&c.record->pending), static_cast<unsigned long long>(first));
  }
}

// One thread, after compareReplay on the same stream.
__global__ void recordReplay(ReplayMismatches* m, uint32_t replay) {
  const uint64_t pending = m->pending;
  if (pending == kNoDifference) return;
  m->pending = kNoDifference;
  m->replays += 1;
  if (atomicMin(&m->firstReplay, replay) > replay) {
    m->firstSlot = static_cast<uint32_t>(pending >> kSlotShift);
    m->firstByte = pending & ((uint64_t{1} << kSlotShift) - 1);
  }
}

__global__ void resetMismatches(ReplayMismatches* m) {
  *m = ReplayMismatches{0, kNoReplay, 0, 0, 0, kNoDifference};
}

__global__ void flipByte(unsigned char* p, uint64_t byte) { p[byte] ^= 1u; }

}  // namespace

cudaError_t preloadReplayCompareKernels() {
  cudaFuncAttributes a;
  for (const void* k : {reinterpret_cast<const void*>(compareReplay), reinterpret_cast<const void*>(recordReplay),
                        reinterpret_cast<const void*>(resetMismatches), reinterpret_cast<const void*>(flipByte)}) {
    if (const cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t resetReplayMismatches(ReplayMismatches* m, cudaStream_t stream) {
  resetMismatches<<<1, 1, 0, stream>>>(m);
  return cudaGetLastError();
}

cudaError_t launchReplayCompare(const ReplayCompare& c, cudaStream_t stream) {
  if (c.count > static_cast<uint32_t>(kMaxCompareSlots) || c.record == nullptr) return cudaErrorInvalidValue;
  uint64_t bytes = 0;
  for (uint32_t s = 0; s < c.count; ++s) bytes += c.slots[s].bytes;
  const uint64_t blocks = (bytes / 16 + kThreads - 1) / kThreads;  // about one 16-byte word a thread
  const auto grid = static_cast<unsigned>(blocks < 1 ? 1 : blocks > kMaxBlocks ? kMaxBlocks : blocks);
  compareReplay<<<grid, kThreads, 0, stream>>>(c);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  recordReplay<<<1, 1, 0, stream>>>(c.record, c.replay);
  return cudaGetLastError();
}

cudaError_t launchFlipByte(void* p, uint64_t byte, cudaStream_t stream) {
  flipByte<<<1, 1, 0, stream>>>(static_cast<unsigned char*>(p), byte);
  return cudaGetLastError();
}

}  // namespace tandem::gputest
