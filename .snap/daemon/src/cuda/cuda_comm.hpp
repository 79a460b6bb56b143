// One communicator of the cuda backend, and the interface of its executor strategy. CudaBackend picks the strategy
// once, when the communicator is set up, and from then on asks it everything about the communicator's ops:
//   ClientGateComm (client_gate.hpp)      executor client: libtandem launches into the caller's stream; tandemd gates
//                                         each op through the control page (verdict, go) and learns done from it;
//   PersistentComm (daemon_executor.hpp)  executor daemon: tandemd's persistent kernel per GPU (or its own stream, for
//                                         the fused GEMMs) runs each op once every rank's stream reached it;
//   HostStagedComm (cuda_multinode.hpp)   ranks on several nodes: tandemd runs each op itself (the exchange staged
//                                         through host memory, the GEMMs on the GPUs), between the local streams'
//                                         ready and done.
// Each holds only its own state. What they share lives here: every local rank's control page, and what a failed
// communicator must keep doing (report its failure once, keep its streams released).
//
// Thread-safety: the backend calls every method with its mutex held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/executor.hpp"

namespace tandem::daemon::cuda {

inline int32_t statusOf(ErrorCode code) { return static_cast<int32_t>(wireCode(code)); }

// The first byte of `buffer` + offset as tandemd's context addresses it.
std::byte* resolveDevice(const Buffer& buffer, uint64_t offset);

class CudaComm : public CommResources {
 public:
  // `pages`: one per rank, in rank order; empty for a rank on another node.
  CudaComm(uint64_t handle, std::vector<kernels::ControlPage> pages);
  ~CudaComm() override;
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  uint64_t handle() const { return handle_; }
  uint32_t nranks() const { return static_cast<uint32_t>(pages_.size()); }

  // ---- the strategy ----
  virtual kernels::Executor executor() const = 0;
  // The ops this strategy runs (the engine refuses the others when their descriptors are admitted).
  OpSet ops() const { return kernels::executorOps(executor()); }
  virtual uint64_t bytesPerRank() const = 0;
  // The join reply of local rank `rank` (its control page; its workspace's size, if any). `commCtas`: cuda.comm_sms.
  JoinInfo joinInfo(uint32_t rank, uint32_t commCtas) const;
  // Rank `rank`'s workspace for its client to map. @throws Error(kUnsupported) when the strategy has none.
  virtual CommMapping mapping(const std::shared_ptr<CommResources>& self, uint32_t rank) const = 0;

  // ---- execution (Backend::execute, poll, busy, abortComm) ----
  virtual bool execute(Collective c, std::function<void()> finished) = 0;
  // Reports (once) a failure the strategy raised itself; keeps a failed communicator's streams released; otherwise
  // progresses its ops. Returns whether it did work.
  bool poll(std::vector<std::pair<uint64_t, std::string>>& failed);
  bool busy() const { return !failed_ && hasWork(); }
  // Fails every pending and running op and releases every wait of the local ranks' streams and kernels, for good.
  virtual void abort(ErrorCode code, const std::string& reason) = 0;
  // Local rank `rank` left (Backend::leaveComm): by default an abort.
  virtual void leave(uint32_t /*rank*/, ErrorCode code, const std::string& reason) { abort(code, reason); }
  // tandemd is stopping: every kernel wait of every local rank leaves now (not at its deadline).
  void abortKernels();

 protected:
  virtual uint64_t workspaceBytes(uint32_t rank) const = 0;  // 0: none
  virtual bool progress(std::vector<std::pair<uint64_t, std::string>>& failed) = 0;
  virtual bool hasWork() const = 0;
  // The highest epoch local rank `rank`'s stream may have enqueued: the abort's lead goes past it.
  virtual uint64_t lastEpoch(uint32_t rank) const = 0;

  // abort()'s shared steps: marks the communicator failed (false if it already was), then releases every local rank's
  // streams through its control page (ControlPage::abort) and remembers the leads that poll() keeps in place.
  bool markFailed(ErrorCode code, const std::string& reason);
  void releaseStreams();
  // The strategy aborts the communicator itself (an op it cannot run or launch): poll() reports `reason` to the engine.
  void abortFromBackend(ErrorCode code, const std::string& reason);
  // The engine hears of one failure per communicator (it then fails the communicator): the first one reported wins.
  bool failureReported() const { return failureReported_; }
  void reportFailure(std::vector<std::pair<uint64_t, std::string>>& failed, std::string message);

  kernels::ControlPage& page(uint32_t rank) { return pages_[rank]; }
  const kernels::ControlPage& page(uint32_t rank) const { return pages_[rank]; }
  bool failed() const { return failed_; }
  ErrorCode failCode() const { return failCode_; }
  const std::string& reason() const { return reason_; }

 private:
  uint64_t handle_;
  std::vector<kernels::ControlPage> pages_;
  bool failed_ = false;
  ErrorCode failCode_ = ErrorCode::kAborted;
  std::string reason_;
  std::string failureToReport_;  // set by abortFromBackend; poll() tells the engine
  bool failureReported_ = false;
  std::vector<uint32_t> leads_;  // after an abort: the go/done value each local rank's streams must keep seeing
};

}  // namespace tandem::daemon::cuda
