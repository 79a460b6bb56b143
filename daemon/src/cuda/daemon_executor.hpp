// executor: daemon. One persistent kernel per GPU in tandemd's context polls a host-mapped work queue
// (kernels/allgather.cu: persistentKernel). The grid shrinks to one CTA after a short idle spell and exits
// after cuda.daemon_linger_ms; a push finds it in one of those states and relaunches a full grid when the item
// needs one. Requires MPS (otherwise the resident kernel time-slices with every client).
// Kernels that need every SM (the fused GEMMs) run on the same stream between persistent kernels: a yield item makes
// the resident kernel leave, the op's kernels follow in stream order, and the next push launches a fresh grid.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <utility>

#include "tandem/kernels/allgather.hpp"

namespace tandem::daemon::cuda {

class GpuExecutor {
 public:
  GpuExecutor(int device, uint32_t numCtas, uint64_t lingerNs);
  ~GpuExecutor();
  GpuExecutor(const GpuExecutor&) = delete;
  GpuExecutor& operator=(const GpuExecutor&) = delete;

  int device() const { return device_; }
  uint32_t numCtas() const { return numCtas_; }
  uint32_t freeSlots() const;
  // Pushes one item (caller checked freeSlots). `keepAlive` holds the memory the item touches until the
  // kernel reports it finished.
  void push(const kernels::WorkItem& item, std::shared_ptr<void> keepAlive);
  // Enqueues `enqueue(stream)` on the executor's stream once the resident kernel has left (caller checked freeSlots
  // for the yield item); `keepAlive` holds the memory it touches until the stream passes it.
  void runExclusive(const std::function<void(cudaStream_t)>& enqueue, std::shared_ptr<void> keepAlive);
  void poll();  // releases the memory of finished items and exclusive runs
  // False (with the reason) once the kernel died with an error: the context is unusable.
  bool healthy(std::string* why) const;
  void stop();  // asks the kernel to exit and waits for it

 private:
  void launch();

  int device_;
  uint32_t numCtas_;
  uint64_t lingerNs_;
  cudaStream_t stream_ = nullptr;
  kernels::WorkQueue* queue_ = nullptr;               // host-mapped
  kernels::PersistentDeviceState* state_ = nullptr;   // device
  uint64_t tail_ = 0;
  uint64_t generation_ = 0;
  bool stopped_ = false;
  bool relaunch_ = false;  // the resident kernel was told to leave: the next push launches a fresh one
  std::deque<std::pair<uint64_t, std::shared_ptr<void>>> live_;
  std::deque<std::pair<cudaEvent_t, std::shared_ptr<void>>> exclusive_;  // event recorded after each exclusive run
};

}  // namespace tandem::daemon::cuda
