// Multi-node communicators on the cuda backend (the host-staged executor strategy), staged through host memory.
// Simple and correct, not fast.
//
// A communicator whose ranks live on several nodes gets no GPU workspaces and runs no tandem kernel: libtandem's
// "host" mode (JoinInfo.executor) only orders each op in the rank's stream, WriteValue32(ready, e) then
// WaitValue32(done >= e) on the rank's control page, and tandemd runs the op itself:
//   1. the accepted collective waits (polled by the pump) until every local rank's stream wrote ready >= e: the
//      inputs are final and nothing in those streams touches the op's buffers until done;
//   2. on the communicator's own thread (CommLink::post): every local rank's input slots are copied GPU -> host,
//      runCpuOpAcrossNodes (cpu_multinode.cpp) exchanges one payload per node pair through the proxy FIFO and the
//      transport and computes the outputs on the host (fp32 accumulation, the CPU reference's numerics), and the
//      outputs are copied host -> GPU;
//   3. done = e on every local rank's control page (release), then the ops complete.
// Cost: every input and output crosses PCIe twice (pageable copies), and the GEMMs run on one host core; the
// hierarchical exchange moves one aggregated payload per node pair, as on the cpu backend. A GPU-resident path
// (fused kernels within the node, a GPU-driven proxy FIFO between nodes) is the fast one to come.
//
// Failures. An op whose descriptors were rejected fails on every node alike and writes done at once. A failed
// communicator (peer lost, a rank's session gone, abort) fails the collective waiting for ready at once, and the one
// running on the link thread when it ends (its exchange ends with the reason); the backend's abort releases the
// streams (go/done jump ahead). A CUDA error in the copies fails the op and then the communicator, so the other
// nodes learn of it through CommFail instead of waiting for this node's payload.
//
// HostStagedComm is the strategy (cuda_comm.hpp); HostStaging is its part that the communicator's link thread shares.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "cuda/cuda_comm.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/cuda_raii.hpp"

namespace tandem::daemon::cuda {

class HostStaging {
 public:
  struct LocalRank {
    uint32_t rank;
    int device;                  // the rank's GPU (daemon ordinal)
    kernels::ControlPage* page;  // the rank's control page (owned by the communicator, which outlives this)
  };
  // Creates a copy stream per GPU of the local ranks. Throws Error(kCuda).
  explicit HostStaging(std::vector<LocalRank> local);
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Backend::execute for a collective of this communicator (c.link set). Completes a rejected collective (and writes
  // done) at once and returns true; otherwise keeps it until every local stream reached it and returns false: the
  // link thread calls `finished` once it completed.
  bool execute(Collective c, std::function<void()> finished);
  // Pump: hands the waiting collective to the communicator's thread once every local rank's ready >= its epoch.
  // Appends (handle, reason) once to `failed` after a CUDA error in the staging copies. Returns whether it did work.
  bool poll(uint64_t handle, std::vector<std::pair<uint64_t, std::string>>& failed);
  bool waiting() const;
  // The communicator failed: the waiting collective completes with the error now, a running one when it ends, and
  // done is never written again (the caller then releases the streams). Call before releasing them.
  void abort(ErrorCode code, const std::string& reason);
  // The highest epoch handed to execute (for the abort's stream lead).
  uint64_t lastEpoch() const;

 private:
  struct Waiting {
    Collective c;
    std::function<void()> finished;
  };
  void run(Collective& c);  // the link thread
  void finish(Collective& c, int32_t code, std::string message);
  void copy(int device, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what);
  void storeDoneLocked(uint64_t epoch);

  std::vector<LocalRank> local_;
  std::map<int, kernels::CudaStream> streams_;  // by device; used by the link thread only (after construction)
  mutable std::mutex mutex_;             // guards everything below
  std::optional<Waiting> waiting_;
  uint64_t lastEpoch_ = 0;
  bool failed_ = false;
  ErrorCode failCode_ = ErrorCode::kAborted;
  std::string reason_;
  std::string copyFailure_;  // a CUDA error in the copies, for poll() to report
  bool copyFailureReported_ = false;
};

// A communicator with ranks on other nodes: a control page per local rank, no workspaces; the ops are staged through
// host memory (HostStaging). The engine admits it with the client executor only.
class HostStagedComm final : public CudaComm {
 public:
  // `pages`: one per rank, empty for the ranks on other nodes; `devices`: each rank's GPU (-1 on other nodes).
  // @throws Error(kCuda) when a copy stream cannot be created.
  HostStagedComm(uint64_t handle, std::vector<kernels::ControlPage> pages, const std::vector<int>& devices);
  kernels::Executor executor() const override { return kernels::Executor::kHost; }
  uint64_t bytesPerRank() const override { return kernels::kControlBytes; }
  CommMapping mapping(const std::shared_ptr<CommResources>& self, uint32_t rank) const override;
  bool execute(Collective c, std::function<void()> finished) override;
  void abort(ErrorCode code, const std::string& reason) override;

 private:
  uint64_t workspaceBytes(uint32_t /*rank*/) const override { return 0; }
  bool progress(std::vector<std::pair<uint64_t, std::string>>& failed) override;
  bool hasWork() const override { return staging_.waiting(); }  // polling the local streams' ready words
  uint64_t lastEpoch(uint32_t /*rank*/) const override { return staging_.lastEpoch(); }

  // The local ranks, pointing into the base's control pages (built before staging_, destroyed after it).
  std::vector<HostStaging::LocalRank> localRanks(const std::vector<int>& devices);

  HostStaging staging_;
};

}  // namespace tandem::daemon::cuda
