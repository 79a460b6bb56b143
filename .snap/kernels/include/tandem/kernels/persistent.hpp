// The daemon executor's persistent kernel (persistent.cu): one grid per GPU in tandemd's context that pops the work
// queue (work_queue.hpp), runs each item, and completes it, until the queue's stop word is set or it idles out. The
// grid shrinks to one CTA after idleShrinkNs without work and exits after lingerNs more; the host relaunches it when
// it pushes an item the running kernel will not take.
//
// Plain data and the host launcher: includable from g++ code (tandemd) and from nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/work_queue.hpp"

namespace tandem::kernels {

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
// Enqueues the persistent kernel (numCtas CTAs of kAgThreads) on `stream` after zeroing `state`. Throws
// std::runtime_error on a bad CTA count or a launch failure.
void launchPersistent(const PersistentParams& params, uint32_t numCtas, cudaStream_t stream);

}  // namespace tandem::kernels
