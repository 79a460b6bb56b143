// Device-resident epochs: how an op runs with no host step, so that a CUDA graph that holds it can be replayed.
//
// An op's flags carry its epoch, and every wait is `flag >= epoch`: an op replayed with the epoch it was captured with
// would meet its peers on the flags of the previous replay. So on a communicator in device-epoch mode each op of two or
// more ranks starts with one small kernel, the op's entry (launchOpEntry), that takes the epoch from device memory:
//   1. F = max(epoch + 1, floor), where `epoch` is this rank's OpEntryWords::epoch in its own workspace and `floor` a
//      launch parameter (the host's epoch of the op, or the next one for a captured op), then epoch = F;
//   2. it writes print[F % 2][me] = the op's fingerprint, then seq[me] = F (release), into every peer's OpEntryWords;
//   3. it waits until every peer's seq reached F, and checks that the peer entered this op with the same fingerprint:
//      a rank whose sequence of ops differs gets kDiverged (its abort word is set, so the op's kernels unwind) instead
//      of meeting its peers on another op's flags. The fingerprints alternate by F's parity: a peer that passed F may
//      write F + 1's while this rank still reads F's, never F + 2's (that entry needs this rank at F + 1).
// The op's kernels then read F from OpEntryWords::epoch (their params' epochWord) instead of their params' epoch.
// Every rank runs the same sequence of ops, so every rank computes the same F for the same op, eager or replayed.
//
// The entry is a barrier over the ranks: no rank starts op F before every rank finished op F - 1 on its stream. That
// is what lets a replayed op ignore the host's epoch parity (gemm-rs/ar double-buffer their staging by the parity of
// the host epoch, which a graph fixes at capture): with the barrier no two ops' staging is ever in use at once.
// The deadline of its waits counts from the kernel's start (a replay's waits are as long as an eager op's), and they
// poll the rank's abort word, so a peer that dies mid-replay releases the others (tandemd sets their abort words).
//
// Plain data and a host launcher only: includable from g++ code (libtandem) and nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/allgather.hpp"

namespace tandem::kernels {

/// The device-epoch words, in every rank's workspace at kOpEntryOffset: in the AllGather header's unused tail, before
/// ring attention's flags. Zeroed with the workspace and never reset; epoch 0 = the communicator never ran an op in
/// device-epoch mode.
inline constexpr uint64_t kOpEntryOffset = 56u << 10;
struct alignas(128) OpEntryWords {
  uint64_t epoch;                  // this rank's own: F of the op its stream entered last (the op's kernels read it)
  uint64_t pad0[15];
  uint64_t seq[kMaxLocalRanks];    // [q] = F of the op rank q entered last; written by q with release, after print
  uint64_t pad1[16 - kMaxLocalRanks];
  uint64_t print[2][kMaxLocalRanks];  // [F % 2][q] = the fingerprint of rank q's op F (0: do not compare)
};
static_assert(sizeof(WorkspaceHeader) <= kOpEntryOffset, "the op entry words overlap the AllGather header");
static_assert(kOpEntryOffset + sizeof(OpEntryWords) <= (60u << 10), "the op entry words overlap ring attention's flags");

/// One op's entry on one rank, resolved into the launching process.
struct OpEntryParams {
  OpEntryWords* words[kMaxLocalRanks];  // every rank's OpEntryWords (its workspace + kOpEntryOffset)
  uint64_t floor;        // F >= floor: the host's epoch for this op, so that F passes every epoch an eager op used
  uint64_t fingerprint;  // the op's shape as every rank sees it alike (collectiveFingerprint; 0: do not compare)
  uint64_t timeoutNs;    // the waits' deadline from the kernel's start; 0 = none
  uint64_t* abortWord;   // this rank's control page (host-mapped): polled, and set when the ranks diverged
  ErrorSlot* errorSlot;  // this rank's control page (host-mapped)
  uint32_t rank, nranks;
  uint32_t op;           // OpKind, for the error report
};

/// Where rank `r`'s op entry words lie in its workspace `ws`.
inline OpEntryWords* opEntryWords(void* ws) {
  return reinterpret_cast<OpEntryWords*>(static_cast<char*>(ws) + kOpEntryOffset);
}

/// Enqueues the op's entry on `stream` (one CTA). Throws std::runtime_error on bad params or launch failure.
void launchOpEntry(const OpEntryParams& params, cudaStream_t stream);

/// Loads the entry kernel on `device` (preload.hpp says why).
void preloadOpEntryKernel(int device);

}  // namespace tandem::kernels
