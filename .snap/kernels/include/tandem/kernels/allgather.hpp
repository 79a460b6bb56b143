// The AllGather kernel family: the per-communicator workspace layout every GPU op shares, AllGather's parameters and
// tuning, and its launcher for the client executor. The control page it reports through is in control_page.hpp; the
// daemon executor runs the same device code from its work queue (work_queue.hpp, persistent.hpp).
//
// Plain data and host launchers only: includable from g++ code (daemon, libtandem) and from nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

inline constexpr uint32_t kMaxLocalRanks = 8;      // GPUs of one node in one communicator
inline constexpr uint32_t kAgSlots = 128;          // chunk slots per producer region (a multiple of every CTA count)
inline constexpr uint32_t kAgMaxCtas = 64;         // power of two dividing kAgSlots
inline constexpr uint32_t kAgChunkMax = 128u << 10;  // bytes per slot
inline constexpr uint32_t kAgThreads = 512;

// ---- the workspace: one per communicator rank, on that rank's GPU, mapped by every local rank -------------
// [0, kWorkspaceHeaderBytes)   header: flags (written remotely over NVLink) and this rank's own bookkeeping
// then nranks producer regions of kAgSlots chunks of kAgChunkMax (the chunked protocol):
//   pull mode: producer q fills region q of its own workspace; consumers read it remotely;
//   push mode: producer q writes region q of each consumer's workspace; consumers copy it locally;
// then, at agLLOffset(nranks), the LL region (AgMode::kLL): for each source rank q, two parity buffers of
//   kAgLLBufBytes, q-major: buffer [q][k % 2] receives q's lines of the communicator's LL op number k (k = LL ops
//   run before it, counted in llCount; the same on every rank).
// Everything else in the workspace (the fused ops' layout) starts at workspaceBytes(nranks).
struct WorkspaceHeader {
  uint64_t filled[kMaxLocalRanks][kAgSlots];  // [producer][slot], written by the producer: (e << 32) | (use + 1)
  uint64_t acked[kMaxLocalRanks][kAgSlots];   // [consumer][slot], written by the consumer after reading the slot
  uint64_t lastFill[kAgSlots];                // this rank's own: value it last published per slot (next op's base)
  ErrorSlot errorClaim;                       // device-memory claim for waitGeq (mirrored into CommControl::error)
  // This rank's own: LL ops it ran (accepted, nranks > 1), the parity of the next one's buffers. One copy per CTA
  // index: CTA c of an op reads llCount[c] and writes llCount[j] for every j = c (mod ncta), so no CTA writes a word
  // another CTA of the same op reads, and every word holds the same count between ops.
  uint32_t llCount[kAgMaxCtas];
  // This rank's own: CTA 0 of op e publishes (e << 2) | outcome (0 aborted, 1 rejected, 2 run) to the op's other
  // CTAs, so that only one thread per op reads the host-mapped abort word and verdict at its start (opGate).
  uint64_t gate;
};
inline constexpr uint64_t kWorkspaceHeaderBytes = 64u << 10;
static_assert(sizeof(WorkspaceHeader) <= kWorkspaceHeaderBytes);
// LL ("low latency") lines: 16 bytes {data0, flag, data1, flag} (uint32 each) carry 8 payload bytes; flag = (uint32_t)e.
inline constexpr uint64_t kAgLLMaxBytes = 512u << 10;   // largest shard the LL path carries (its buffers' capacity)
inline constexpr uint64_t kAgLLBufBytes = kAgLLMaxBytes * 2;  // one parity buffer: kAgLLMaxBytes / 8 lines of 16 bytes
// Host and device: the kernels address the LL region with it too.
__host__ __device__ inline constexpr uint64_t agLLOffset(uint32_t nranks) {
  return kWorkspaceHeaderBytes + uint64_t{nranks} * kAgSlots * kAgChunkMax;
}
inline constexpr uint64_t workspaceBytes(uint32_t nranks) {
  return agLLOffset(nranks) + uint64_t{nranks} * 2 * kAgLLBufBytes;
}

// kLL: every rank writes its shard as LL lines into every peer's LL region and reads its peers' lines from its own
// (device/allgather.cuh says how); chunkBytes is unused then (but valid). kPull and kPush: the chunked protocol.
enum class AgMode : uint32_t { kPull = 0, kPush = 1, kLL = 2 };

// ---- one AllGather, resolved into the executing address space ---------------------------------------------
struct AllGatherParams {
  const void* send;   // [bytes]
  void* recv;         // [nranks * bytes]
  uint64_t bytes;     // per rank
  uint64_t epoch;     // e (>= 1): tandemd's verdict for it (checkVerdict), and its flags unless epochWord is set
  // Device-epoch mode (op_entry.hpp): the flags' epoch is *epochWord, which the op's entry wrote on the stream; null:
  // p.epoch. A replayed graph keeps p.epoch as captured, so only epochWord changes from one replay to the next.
  const uint64_t* epochWord;
  uint64_t timeoutNs; // every wait's deadline, from the kernel's start
  void* workspaces[kMaxLocalRanks];  // every rank's workspace in this address space
  CommControl* ctl;   // this rank's control page (host-mapped)
  uint32_t rank, nranks;
  uint32_t chunkBytes;  // <= kAgChunkMax, a multiple of 16 (kPull, kPush)
  uint32_t numCtas;     // power of two <= kAgMaxCtas
  AgMode mode;
  uint32_t checkVerdict;  // client executor: read verdict[e] and skip unless it says run
};

// Tuning as a pure function of the shard size, so every rank (and the daemon) picks the same:
//   bytes <= TANDEM_AG_LL_MAX (default and ceiling kAgLLMaxBytes = 512 KiB; 0 disables LL): kLL, with
//     numCtas = the power of two >= lines / kAgThreads (lines = bytes / 8 rounded up), in 4..32 (or the cap);
//   larger: kPush (chunked), numCtas and chunkBytes as measured (allgather_tuning.cpp).
// The daemon executor's persistent kernel runs any mode with its own CTA count. Overrides for benchmarks (must match
// on every rank): TANDEM_AG_LL_MAX=bytes, TANDEM_AG_MODE=push|pull (chunked ops only), TANDEM_AG_CTAS=N (every mode),
// TANDEM_AG_CHUNK=bytes.
struct AgTuning {
  AgMode mode;
  uint32_t numCtas;
  uint32_t chunkBytes;
};
AgTuning allgatherTuning(uint64_t bytes, uint32_t maxCtas /*0 = default*/);

// Client executor: enqueues the kernel on `stream`. Throws std::runtime_error on bad params or launch failure.
void launchAllGather(const AllGatherParams& params, cudaStream_t stream);

}  // namespace tandem::kernels
