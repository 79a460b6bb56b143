// The op entry of device-epoch mode (design: tandem/kernels/op_entry.hpp): one CTA, thread 0 takes the epoch and
// publishes it, one thread per peer waits for that peer and compares.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "device/ordering.cuh"
#include "device/wait.cuh"
#include "preload_on.hpp"
#include "tandem/kernels/op_entry.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace {

constexpr uint32_t kEntryThreads = 32;  // >= kMaxLocalRanks: thread q waits for peer q

// Stops this rank's op: its kernels poll the abort word and unwind at their first wait. tandemd reads the error slot
// (reported before) and fails the communicator on every rank.
__device__ void abortRank(uint64_t* abortWord) {
  if (abortWord != nullptr) stReleaseSys(abortWord, kAbortValue);  // release: after the report; kernels poll it relaxed
}

__global__ void __launch_bounds__(kEntryThreads) opEntryKernel(const __grid_constant__ OpEntryParams p) {
  __shared__ uint64_t sEpoch;
  const uint32_t tid = threadIdx.x;
  WaitCtx ctx{p.abortWord, p.errorSlot, p.timeoutNs != 0 ? globaltimerNs() + p.timeoutNs : 0, p.op,
              static_cast<uint32_t>(Role::kIntraComm), p.rank};
  OpEntryWords* mine = p.words[p.rank];
  if (tid == 0) {
    // Written by this rank's previous entry (a kernel boundary orders it); only this rank writes it.
    const uint64_t last = mine->epoch;
    const uint64_t f = last + 1 > p.floor ? last + 1 : p.floor;
    mine->epoch = f;  // the op's kernels read it after this kernel (stream order)
    // release: this rank's previous op (kernels and copies before this one on its stream) happened before the peers
    // see seq = f; pairs with their waitGeq on seq[me].
    fenceAcqRelSys();
    for (uint32_t q = 0; q < p.nranks; ++q) {
      if (q == p.rank) continue;
      stRelaxedSys(&p.words[q]->print[f & 1][p.rank], p.fingerprint);
      stReleaseSys(&p.words[q]->seq[p.rank], f);  // release: after print; pairs with the peer's waitGeq below
    }
    sEpoch = f;
  }
  __syncthreads();
  const uint64_t f = sEpoch;
  bool ok = true;
  if (tid < p.nranks && tid != p.rank) {
    ok = waitGeq(&mine->seq[tid], f, ctx, tid);  // acquire: pairs with peer tid's release of seq[tid]
    if (ok) {
      // A peer that passed this entry (it needed us at f) is at f + 1 at most: further means its epochs differ from
      // ours (another count of ops before the first capture), whatever its fingerprints say.
      const uint64_t seen = ldAcquireSys(&mine->seq[tid]);
      // The peer's fingerprint of op f, even if it already entered f + 1 (the other parity's word; op_entry.hpp).
      const uint64_t print = ldRelaxedSys(&mine->print[f & 1][tid]);
      if (seen > f + 1) {
        reportWaitError(ctx, WaitError::kDiverged, tid, f, seen);
        ok = false;
      } else if (p.fingerprint != 0 && print != 0 && print != p.fingerprint) {
        reportWaitError(ctx, WaitError::kDiverged, tid, p.fingerprint, print);
        ok = false;
      }
    }
  }
  // A peer behind by whole ops never reaches f: the wait above times out (kTimeout). Every failure stops this rank's
  // op.
  if (__syncthreads_or(ok ? 0 : 1) != 0 && tid == 0) abortRank(p.abortWord);
}

std::string cudaFailure(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

}  // namespace

void preloadOpEntryKernel(int device) {
  const void* fns[] = {reinterpret_cast<const void*>(&opEntryKernel)};
  preloadOn(device, fns, "op entry kernel");
}

void launchOpEntry(const OpEntryParams& p, cudaStream_t stream) {
  if (p.nranks < 2 || p.nranks > kMaxLocalRanks || p.rank >= p.nranks || p.abortWord == nullptr ||
      p.errorSlot == nullptr) {
    throw std::runtime_error("launchOpEntry: rank " + std::to_string(p.rank) + " of " + std::to_string(p.nranks) +
                             " (2.." + std::to_string(kMaxLocalRanks) + " ranks) or its control page is out of range");
  }
  for (uint32_t r = 0; r < p.nranks; ++r) {
    if (p.words[r] == nullptr) throw std::runtime_error("launchOpEntry: workspace of a rank is not mapped");
  }
  opEntryKernel<<<1, kEntryThreads, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaFailure("op entry kernel launch", e));
}

}  // namespace tandem::kernels
