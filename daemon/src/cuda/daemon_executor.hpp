// executor: daemon. One persistent kernel per GPU in tandemd's context polls a host-mapped work queue
// (kernels/allgather.cu: persistentKernel). The grid shrinks to one CTA after a short idle spell and exits
// after cuda.daemon_linger_ms; a push finds it in one of those states and relaunches a full grid when the item
// needs one. Requires MPS (otherwise the resident kernel time-slices with every client).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
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
  void poll();  // releases the memory of finished items
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
  std::deque<std::pair<uint64_t, std::shared_ptr<void>>> live_;
};

}  // namespace tandem::daemon::cuda
