// executor: daemon (persistent). One persistent kernel per GPU in tandemd's context polls a host-mapped work queue
// (kernels/persistent.cu: persistentKernel). The grid shrinks to one CTA after a short idle spell and exits
// after cuda.daemon_linger_ms; a push finds it in one of those states and relaunches a full grid when the item
// needs one. Requires MPS (otherwise the resident kernel time-slices with every client).
// Kernels that need every SM (the fused GEMMs) run on the same stream between persistent kernels: a yield item makes
// the resident kernel leave, the op's kernels follow in stream order, and the next push launches a fresh grid.
//
// PersistentComm is the strategy of a communicator on this executor: its ranks' streams write ready and wait for done;
// once every rank's stream reached an op, tandemd pushes it to each rank's GPU (or launches its fused GEMM there), and
// the GPU writes done.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda/node_comm.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/persistent.hpp"

namespace tandem::daemon::cuda {

// One GPU's persistent kernel and its work queue.
class GpuExecutor {
 public:
  // Loads every kernel tandemd launches on `device`, creates the stream, the queue and the kernel's state.
  // @throws Error(kCuda).
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
  void stop() noexcept;  // asks the kernel to exit and waits for it

 private:
  void launch();

  int device_;
  uint32_t numCtas_;
  uint64_t lingerNs_;
  // Declared in creation order: destroyed in reverse, after stop() waited for the kernel.
  kernels::CudaStream stream_;
  kernels::PinnedHostBuffer queueMemory_;   // the WorkQueue, host-mapped
  kernels::WorkQueue* queue_ = nullptr;     // queueMemory_ as the host addresses it
  kernels::DeviceBuffer state_;             // PersistentDeviceState
  uint64_t tail_ = 0;
  uint64_t generation_ = 0;
  bool stopped_ = false;
  bool relaunch_ = false;  // the resident kernel was told to leave: the next push launches a fresh one
  std::deque<std::pair<uint64_t, std::shared_ptr<void>>> live_;
  std::deque<std::pair<kernels::CudaEvent, std::shared_ptr<void>>> exclusive_;  // event recorded after each run
};

// The daemon executor: a GpuExecutor on every GPU of the backend, shared by every PersistentComm. Owned by CudaBackend
// (when daemon.executor resolves to daemon); used under its mutex.
class DaemonExecutor {
 public:
  // cuda.comm_sms caps the persistent kernel's grid (a power of two, 32 by default). @throws Error(kCuda).
  DaemonExecutor(const std::vector<GpuInfo>& gpus, uint32_t commSms, uint64_t lingerNs);

  GpuExecutor& gpu(int device) { return *gpus_.at(device); }
  uint32_t ctas() const { return ctas_; }
  // Releases finished work's memory on every GPU; every 50 ms, checks that every persistent kernel is alive.
  // @throws FatalBackendError when one died: its context is unusable.
  void poll();
  void stop() noexcept;
  // Whether the plan of this shape was not logged yet (then it is now marked as logged).
  bool firstPlan(const std::string& shape) { return plansLogged_.insert(shape).second; }

 private:
  std::map<int, std::unique_ptr<GpuExecutor>> gpus_;
  uint32_t ctas_ = 32;
  Clock::time_point lastHealthCheck_ = Clock::now();
  std::set<std::string> plansLogged_;
};

class PersistentComm final : public NodeComm {
 public:
  // Throws Error(kUnsupported) when two ranks share a GPU: one persistent kernel per GPU runs ops in order.
  static void checkPlacement(const std::vector<Rank>& ranks);
  // Registers every rank's control page for tandemd's kernels. @throws Error(kCuda).
  PersistentComm(uint64_t handle, std::vector<Rank> ranks, std::vector<kernels::ControlPage> pages, CommContext& ctx,
                 DaemonExecutor& executors);
  kernels::Executor executor() const override { return kernels::Executor::kDaemon; }

 private:
  // The kernels run in tandemd's context: a fused GEMM libtandem should have refused must not write past a workspace.
  void admit(Collective& c) override;
  bool needsReady(const Gang& /*g*/) const override { return true; }  // the streams wait for done, written by the GPU
  Release release(const std::shared_ptr<Gang>& g) override;

  kernels::CommControl* ctlDevice(uint32_t r) const { return static_cast<kernels::CommControl*>(ctl_[r].devicePtr()); }
  kernels::DevicePointers devicePointers(const PendingOp& op) const;
  kernels::FusedEnv fusedEnv(uint32_t r) const;
  bool launchFused(const std::shared_ptr<Gang>& g);
  bool launchRingAttention(const std::shared_ptr<Gang>& g);
  void pushItem(Gang& g, uint32_t r, const std::shared_ptr<Gang>& keepAlive);
  void logPlanOnce(const OpDescriptor& d, const std::string& plan);

  DaemonExecutor& executors_;
  std::vector<kernels::HostRegistration> ctl_;  // every rank's control page, registered for tandemd's kernels
  uint64_t workspaceBytes_ = 0;                 // the smallest rank's workspace
  kernels::WorkspaceLayout layout_;             // the fused GEMMs' regions in it (libtandem computes the same)
};

}  // namespace tandem::daemon::cuda
