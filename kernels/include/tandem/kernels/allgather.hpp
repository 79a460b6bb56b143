// The AllGather kernel family and the runtime pieces every GPU op shares: the per-rank control page that
// orders a client's stream against the daemon, the per-communicator workspace layout, the daemon executor's
// device work queue, and the CUDA driver entry points (fetched through cudart, never linked).
//
// Plain data and host launchers only: includable from g++ code (daemon, libtandem) and from nvcc.
//
// Stream order (ARCHITECTURE.md decision 4), per communicator rank, with epoch e = the rank's n-th op on the
// communicator (1, 2, ...; equal on every rank for the same collective):
//   client executor: stream: [WriteValue32(ready, e) (gangs only)] WaitValue32(go >= e) kernel WriteValue32(done, e);
//                    AllGather without the WaitValue32(go): its kernel polls verdict[e] until the daemon decided e;
//   daemon executor: stream: WriteValue32(ready, e) WaitValue32(done >= e); the daemon's persistent kernel writes done
//                    (or, for a fused GEMM, tandemd's own stream after the op's kernels).
// Stream words are 32-bit and compared cyclically by the hardware ((int32_t)(x - e) >= 0), so an abort writes
// e_last + kStreamAbortLead, which is "greater" than every pending epoch; kernels check the 64-bit abort word.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

inline constexpr uint32_t kMaxLocalRanks = 8;      // GPUs of one node in one communicator
inline constexpr uint32_t kAgSlots = 128;          // chunk slots per producer region (a multiple of every CTA count)
inline constexpr uint32_t kAgMaxCtas = 64;         // power of two dividing kAgSlots
inline constexpr uint32_t kAgChunkMax = 128u << 10;  // bytes per slot
inline constexpr uint32_t kAgThreads = 512;
inline constexpr uint32_t kVerdictRing = 4096;     // verdict entries per rank (power of two)
inline constexpr uint64_t kVerdictRejected = uint64_t{1} << 62;  // verdict = e | kVerdictRejected: skip op e
inline constexpr uint32_t kStreamAbortLead = 1u << 30;

// ---- the control page: one per communicator rank, host memory (memfd) shared by daemon and client ----------
struct alignas(128) StreamWord {
  uint32_t value;
  uint8_t pad[124];
};
struct alignas(128) CommControl {
  StreamWord go;      // daemon -> client stream (client executor): ops <= go are decided
  StreamWord ready;   // client stream -> daemon: the stream reached op `ready`
  StreamWord done;    // client stream (client executor) or the daemon's kernel -> daemon: op `done` finished
  uint64_t abort;     // daemon (peer lost) or libtandem (daemon lost) -> kernels: non-zero aborts every wait
  uint8_t pad0[120];
  ErrorSlot error;    // mirrored by a kernel whose wait failed (claimed last, with release)
  uint8_t pad1[64];
  uint64_t verdict[kVerdictRing];  // [e % kVerdictRing] = e (run) or e | kVerdictRejected (skip)
};
static_assert(sizeof(CommControl) == 640 + 8 * kVerdictRing);
inline constexpr uint64_t kControlBytes = (sizeof(CommControl) + 4095) & ~uint64_t{4095};

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
// (allgather.cu says how); chunkBytes is unused then (but valid). kPull and kPush: the chunked protocol.
enum class AgMode : uint32_t { kPull = 0, kPush = 1, kLL = 2 };

// ---- one AllGather, resolved into the executing address space ---------------------------------------------
struct AllGatherParams {
  const void* send;   // [bytes]
  void* recv;         // [nranks * bytes]
  uint64_t bytes;     // per rank
  uint64_t epoch;     // e (>= 1)
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
//   larger: kPush (chunked), numCtas and chunkBytes as measured (allgather.cu).
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

// ---- the daemon executor's device work queue (host-mapped, written by the daemon's host thread) -----------
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
struct PersistentDeviceState {  // device memory, zeroed before every launch
  uint64_t goIndex;     // CTA 0 publishes item n + 1 when the whole grid may run item n
  uint64_t ctaDone;     // CTAs finished, summed over items
  uint64_t exitAll;     // CTA 0 tells the others to leave (the grid shrinks to CTA 0)
  uint64_t item[sizeof(WorkItem) / 8];  // the item goIndex names, copied here by CTA 0 (host memory is read once)
};
struct PersistentParams {
  WorkQueue* queue;              // host-mapped
  PersistentDeviceState* state;  // device
  uint64_t generation;
  uint64_t idleShrinkNs;         // grid -> 1 CTA after idling this long
  uint64_t lingerNs;             // the lone CTA exits after idling this long
};
// Enqueues the persistent kernel (numCtas CTAs of kAgThreads) on `stream` after zeroing `state`.
void launchPersistent(const PersistentParams& params, uint32_t numCtas, cudaStream_t stream);

// ---- CUDA driver entry points (cudaGetDriverEntryPointByVersion; libcuda is never linked) ------------------
struct DriverApi {
  CUresult (*memCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*memRelease)(CUmemGenericAllocationHandle);
  CUresult (*memExportToShareableHandle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                         unsigned long long);
  CUresult (*memImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*memGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*memAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*memAddressFree)(CUdeviceptr, size_t);
  CUresult (*memMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*memUnmap)(CUdeviceptr, size_t);
  CUresult (*memSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*memRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*memGetAllocationPropertiesFromHandle)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
  CUresult (*memGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*streamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  CUresult (*streamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  CUresult (*getErrorString)(CUresult, const char**);
};
// Loads every entry point once. Throws std::runtime_error naming the missing one.
const DriverApi& driver();
// "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
const char* driverErrorName(CUresult r);

}  // namespace tandem::kernels
