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
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda/node_comm.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/gpu_ops.hpp"
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
  // for the yield item); `keepAlive` holds the memory it touches until the stream passes it. `comm`: the communicator
  // it is for; `ahead`: it begins with stream waits on its gang's ready words (launched before every rank got there).
  void runExclusive(const std::function<void(cudaStream_t)>& enqueue, std::shared_ptr<void> keepAlive,
                    uint64_t comm = 0, bool ahead = false);
  // Whether another communicator's op launched ahead waits on this stream: work of `comm` queued behind it now could
  // wait for it, and it for a stream that waits for that work (two communicators, one process order), so it must not.
  bool othersAhead(uint64_t comm) const;
  // Whether everything unfinished on this GPU is `comm`'s (no work item, no other communicator's run): only then may
  // `comm` launch an op ahead of its gang, since ops of one communicator are ordered the same on every stream.
  bool onlyMine(uint64_t comm) const;
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
  struct Exclusive {
    kernels::CudaEvent after;  // recorded after the run
    std::shared_ptr<void> keepAlive;
    uint64_t comm = 0;
    bool ahead = false;
  };
  std::deque<Exclusive> exclusive_;
};

// plans.autotune: on-first-use. The first ops of a fused GEMM key with no plan table entry each run one candidate plan
// (autotune_runs ops per candidate, in turn), timed with CUDA events around rank 0's kernels on its executor stream;
// once every candidate ran, the fastest (median) goes into the plan table, which is saved, and later ops use it. Every
// candidate computes the op, so the results stay correct; only the first few ops of a shape run slower plans.
class PlanTuner {
 public:
  // The candidate for the next op of `key` (and whether to time it), or nullopt once every candidate was issued.
  std::optional<PlanChoice> next(const PlanKey& key, uint32_t runs);
  // Rank 0's kernels of an op of `key` that ran `plan` lie between `start` and `end` on its executor stream.
  void record(const PlanKey& key, const PlanChoice& plan, kernels::CudaEvent start, kernels::CudaEvent end);
  // Folds in finished timings; a key whose every candidate finished gets its winner put into `table` and saved.
  void poll(PlanTable& table);

 private:
  struct State {
    std::vector<PlanChoice> candidates;
    uint32_t runs = 1;
    uint32_t issued = 0;
    std::vector<std::vector<float>> ms;  // per candidate
    uint32_t pending = 0;                // timed ops not finished yet
    bool saved = false;
  };
  struct Pending {
    PlanKey key;
    PlanChoice plan;
    kernels::CudaEvent start, end;
  };
  std::map<PlanKey, State> states_;
  std::deque<Pending> pending_;
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
  PlanTuner& tuner() { return tuner_; }

 private:
  std::map<int, std::unique_ptr<GpuExecutor>> gpus_;
  uint32_t ctas_ = 32;
  Clock::time_point lastHealthCheck_ = Clock::now();
  std::set<std::string> plansLogged_;
  PlanTuner tuner_;
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
  // A fused GEMM of a one-rank communicator is the GEMM core alone: libtandem runs it in the caller's stream and writes
  // ready after it (its PersistentStrategy applies the same rule), and tandemd only completes it.
  bool runsInCallerStream(OpKind kind) const;
  // The kernels run in tandemd's context: a fused GEMM libtandem should have refused must not write past a workspace.
  void admit(Collective& c) override;
  // The streams wait for done, written on the GPU: tandemd releases an op once every rank's stream reached it (ready),
  // except a fused GEMM launched ahead (launchAhead), whose executor streams wait for the ready words themselves.
  bool needsReady(const Gang& g) const override { return !launchAhead(g); }
  // TANDEM_LAUNCH_AHEAD=1: a fused GEMM goes to its GPUs as soon as its gang formed, behind stream waits on every
  // rank's ready word, so neither tandemd's poll of ready nor its kernel launch sits between the streams reaching the
  // op and the op starting. Only while the communicator has its GPUs' executors to itself (GpuExecutor::onlyMine).
  bool launchAhead(const Gang& g) const;
  Release release(const std::shared_ptr<Gang>& g) override;

  kernels::CommControl* ctlDevice(uint32_t r) const { return static_cast<kernels::CommControl*>(ctl_[r].devicePtr()); }
  kernels::DevicePointers devicePointers(const PendingOp& op) const;
  kernels::FusedEnv fusedEnv(uint32_t r) const;
  // The plan table's plan for a fused GEMM (this communicator's trial plan first), looked up with rank 0's
  // descriptor so that every rank runs the same plan; kind kAuto when there is no entry.
  PlanChoice planOf(const OpDescriptor& rank0) const;
  // The plan a fused GEMM gang runs, decided once when it is admitted (the table's, or an autotune candidate) and used
  // by both the workspace check and the launch.
  PlanChoice decidePlan(const OpDescriptor& rank0, uint64_t epoch);
  bool progress(std::vector<std::pair<uint64_t, std::string>>& failed) override;
  bool launchFused(const std::shared_ptr<Gang>& g, const kernels::GpuOp& gpu);
  bool launchMapped(const std::shared_ptr<Gang>& g, const kernels::GpuOp& gpu);
  void pushItem(Gang& g, uint32_t r, const std::shared_ptr<Gang>& keepAlive);
  void logPlanOnce(const OpDescriptor& d, const std::string& plan);

  DaemonExecutor& executors_;
  std::vector<kernels::HostRegistration> ctl_;  // every rank's control page, registered for tandemd's kernels
  uint64_t workspaceBytes_ = 0;                 // the smallest rank's workspace
  kernels::WorkspaceLayout layout_;             // the fused GEMMs' regions in it (libtandem computes the same)
  struct Decided {
    PlanChoice plan;
    bool timed = false;  // an autotune candidate: rank 0's kernels are timed
  };
  std::map<uint64_t, Decided> decided_;  // by epoch, from admit() to the launch
};

}  // namespace tandem::daemon::cuda
