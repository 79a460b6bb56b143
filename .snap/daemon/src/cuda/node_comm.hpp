// A communicator whose ranks all live on this node: every rank has a workspace on its GPU (mapped by every rank) and
// a control page, and ops run as gangs, one collective at a time per epoch, released in epoch order. The two
// single-node strategies (ClientGateComm, PersistentComm) share this machinery and differ only in when a gang may be
// released and what releasing it does (NodeComm::release).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/comm_failure.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/gpu.hpp"
#include "plan_table.hpp"
#include "tandem/common/fd.hpp"

namespace tandem::daemon::cuda {

using Clock = std::chrono::steady_clock;

// One collective on its way through a single-node communicator.
struct Gang {
  Collective c;
  Clock::time_point arrived, released;  // the collective reached the backend; released to the GPUs (go or pushed)
  uint64_t epoch = 0;
  OpKind kind = OpKind::kInvalid;
  bool rejected = false;
  uint32_t remaining = 0;  // ranks not completed yet
  std::vector<bool> completed;
};

// TANDEM_TRACE_OPS=1: where an op's time goes between its arrival and its rank 0's done, logged every 1000 ops (p50
// and p99): waiting for release (client executor: every rank's submission, gangs: every rank's stream at ready; daemon
// executor: every rank's stream at ready, then a free queue slot), then the GPU until done was seen here.
class OpTrace {
 public:
  bool enabled() const { return enabled_; }
  void record(const Gang& g, kernels::Executor executor);

 private:
  const bool enabled_ = [] {
    const char* v = std::getenv("TANDEM_TRACE_OPS");
    return v != nullptr && *v == '1';
  }();
  std::vector<double> release_, gpu_;
};

// What every single-node communicator of one backend shares. Owned by CudaBackend; used under its mutex.
struct CommContext {
  uint64_t timeoutNs = 0;  // every kernel wait's deadline (TANDEM_OP_TIMEOUT_MS)
  uint32_t commSms = 0;    // cuda.comm_sms
  OpTrace trace;
  std::shared_ptr<PlanTable> plans;  // the plan table (null: the kernels' own rules for every op)
  std::string gpuModel;              // the GPU model plan keys name (planGpuModel)
  bool autotune = false;             // plans.autotune: on-first-use (executor daemon: PlanTuner)
  uint32_t autotuneRuns = 3;         // plans.autotune_runs
};

class NodeComm : public CudaComm {
 public:
  struct Rank {
    int device = -1;
    std::string uuid;
    std::shared_ptr<CuMemAllocation> workspace;
    Fd workspaceFd;
  };
  NodeComm(uint64_t handle, std::vector<Rank> ranks, std::vector<kernels::ControlPage> pages, CommContext& ctx);

  uint64_t bytesPerRank() const override;
  CommMapping mapping(const std::shared_ptr<CommResources>& self, uint32_t rank) const override;
  bool execute(Collective c, std::function<void()> finished) override;
  void abort(ErrorCode code, const std::string& reason) override;
  void leave(uint32_t rank, ErrorCode code, const std::string& reason) override;

 protected:
  enum class Release {
    kReleased,  // the gang went to the GPUs
    kWait,      // not yet: the head of the queue stays, and so does everything behind it
    kAborted,   // the strategy aborted the communicator instead (abortFromBackend; pending is cleared)
  };
  // Checks a collective the strategy runs in tandemd's own context before it is admitted; sets c.errorCode/error.
  virtual void admit(Collective& /*c*/) {}
  // Whether `g` (accepted) is released only once every rank's stream reached it (wrote ready >= its epoch).
  virtual bool needsReady(const Gang& g) const = 0;
  // Releases the head gang `g` to every rank (its verdict, or its work), once the queue's conditions hold.
  virtual Release release(const std::shared_ptr<Gang>& g) = 0;

  bool progress(std::vector<std::pair<uint64_t, std::string>>& failed) override;
  bool hasWork() const override;
  uint64_t lastEpoch(uint32_t rank) const override;
  uint64_t workspaceBytes(uint32_t rank) const override;

  const Rank& rank(uint32_t r) const { return ranks_[r]; }
  CommContext& ctx() const { return ctx_; }

 private:
  struct RankState {
    uint64_t doneEpoch = 0;  // the highest epoch `done` has shown
    uint64_t decided = 0;    // the highest epoch released to this rank
    std::deque<std::shared_ptr<Gang>> inflight;  // accepted and released, waiting for done
  };
  bool releasePending();  // releases pending gangs in epoch order while their conditions hold
  // The failure that explains the communicator's (comm_failure.hpp), over every rank's error slot; nullopt: none.
  std::optional<RankFailure> failure() const;
  void completeFromKernel(Gang& g, uint32_t r);
  bool collectDone(uint32_t r);  // completes rank r's in-flight ops its stream has finished; whether there were any
  std::string errorText(uint32_t r, const kernels::ErrorSlot& e) const;

  std::vector<Rank> ranks_;
  std::vector<RankState> state_;
  std::deque<std::shared_ptr<Gang>> pending_;  // in epoch order; the head waits for its release condition
  // A rank left gracefully (leave): the ops in flight finish, and any later gang aborts the communicator.
  std::optional<std::pair<ErrorCode, std::string>> closed_;
  CommContext& ctx_;
};

// Completes rank r's op of `g` once (status 0: success).
void completeRank(Gang& g, uint32_t r, int32_t status, const std::string& message);
void failGang(Gang& g, ErrorCode code, const std::string& reason);
// The message of an op's data error (kernels::OpFault) for the rank whose descriptor is `d`.
std::string opFaultText(const kernels::OpFault& f, const OpDescriptor& d);

}  // namespace tandem::daemon::cuda
