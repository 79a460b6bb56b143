// The daemon's core, independent of the socket layer: sessions, buffers, communicators, and the
// submission pump that turns ring descriptors into executed collective ops.
//
// Threads: the control thread (Server) calls every public method except the pump's; the pump thread pops
// descriptors and polls the backend; the backend executes ops (cpu: worker threads; cuda: GPUs). `mutex_`
// guards all maps; op execution runs without it. `mutex_` is the outermost of the daemon's ranked locks, and nothing
// calls back into a session or the server while it is held (docs/ARCHITECTURE.md, "Locks and callbacks").
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "pump.hpp"
#include "state.hpp"
#include "tandem/v1/cluster.pb.h"
#include "tandem/common/error.hpp"
#include "tandem/common/ranked_mutex.hpp"

namespace tandem::daemon {

struct EngineStatus {
  struct Session {
    uint64_t id;
    uint32_t pid, uid;
    uint32_t buffers;
    uint64_t bytes;
    uint32_t comms;
    uint64_t opsCompleted;
  };
  struct Comm {
    uint64_t handle;
    uint32_t nranks, joined;
    std::string state;
    uint64_t opsCompleted;
    uint32_t localRanks;
    std::vector<uint32_t> nodes;  // multi-node only
    std::string reason;
    // The sessions of its local ranks and their uids: who may see it in another tenant's status.
    std::vector<uint64_t> memberSessions;
    std::vector<uint32_t> memberUids;
  };
  std::vector<Session> sessions;
  std::vector<Comm> comms;
  std::vector<GpuInfo> gpus;
  std::optional<v1::ClusterInfo> cluster;  // multi-node daemons only
  uint64_t totalBytes = 0;
  uint32_t totalBuffers = 0;
};

class Engine {
 public:
  using JoinDone =
      std::function<void(ErrorCode code, const std::string& message, uint64_t commHandle, const JoinInfo& info)>;

  // backend null: the cpu backend.
  explicit Engine(const DaemonConfig& config, std::unique_ptr<Backend> backend = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void start();  // pump and worker threads
  void stop();   // joins them; pending ops complete with kAborted

  // Sessions. closeSession reclaims every buffer and ends the session's communicators: surviving ranks'
  // queued and future ops fail with kPeerLost.
  std::shared_ptr<SessionChannel> openSession(uint64_t sessionId, uint32_t pid, uint32_t uid, uint32_t gid);
  void closeSession(uint64_t sessionId, const std::string& why);
  size_t sessionCount() const;

  // Memory. Returns the buffer (its fd is what the client maps).
  std::shared_ptr<Buffer> allocate(uint64_t sessionId, uint64_t bytes, const std::string& deviceUuid = {});
  std::shared_ptr<Buffer> registerMemory(uint64_t sessionId, RegisterRequest request);
  std::shared_ptr<Buffer> registerMemory(uint64_t sessionId, Fd fd, uint64_t offset, uint64_t bytes);
  void release(uint64_t sessionId, uint64_t bufferId, bool registered);
  Backend& backend() { return *backend_; }

  // Communicators. `done` runs exactly once: when every rank has joined (on the control thread of the last
  // joiner), or from cancelJoin/closeSession.
  // `workspaceBytes`: the workspace per rank the joiner asks for (0: none; the communicator gets the largest asked).
  void join(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t nranks, uint32_t rank,
            const std::string& deviceUuid, JoinDone done, uint64_t workspaceBytes = 0);
  // One rank's workspace of a communicator this session joined (cuda backend).
  CommMapping commMapping(uint64_t sessionId, uint64_t commHandle, uint32_t rank);
  // Called when a join's timer fires; a no-op if the join already finished.
  void cancelJoin(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t rank, uint32_t timeoutMs);
  void destroyComm(uint64_t sessionId, uint64_t commHandle, bool abort);

  EngineStatus status() const;

  // Multi-node (cluster.nodes). Set before start(); the cluster must outlive the engine's communicators.
  // The two handlers run on the control thread, like every public method.
  void attachCluster(Cluster* cluster) { cluster_ = cluster; }
  // The plan table, shared with the backend (plan_table.hpp). Set before start(); null: none (tests).
  void attachPlans(std::shared_ptr<PlanTable> plans) {
    plans_ = plans;
    backend_->attachPlans(std::move(plans));
  }
  PlanTable* plans() const { return plans_.get(); }
  // Throws Error(kNotFound) unless communicator `commHandle` has a rank in session `sessionId` or in another session of
  // user `uid` (a job's tools, such as tandemctl advise, talk to tandemd on a connection of their own).
  void checkMember(uint64_t sessionId, uint32_t uid, uint64_t commHandle) const;
  void onPeerMessage(uint32_t from, const v1::PeerMessage& message);
  void onNodeLost(uint32_t node, const std::string& reason);
  // Called (from the pump) when a session corrupts its ring; the Server closes it.
  void setSessionFaultHandler(std::function<void(uint64_t sessionId, std::string why)> handler) {
    onSessionFault_ = std::move(handler);
  }
  // Called (from the pump) when the backend failed beyond repair (FatalBackendError): every communicator has
  // failed; the handler makes the daemon exit non-zero. Without one, the daemon keeps serving refusals.
  void setFatalHandler(std::function<void(std::string why)> handler) { onFatal_ = std::move(handler); }

 private:
  struct PendingJoin {
    uint64_t sessionId;
    JoinDone done;
  };
  struct CommEntry {
    Communicator comm;
    std::map<uint32_t, PendingJoin> joins;  // rank -> waiting joiner
    bool busy = false;                      // one collective at a time per communicator (stream order)
    std::shared_ptr<CommLink> link;         // multi-node, once every rank is known
    std::map<uint32_t, std::string> earlyKeys;  // peers' staging keys that came before the link existed
    uint64_t lastDispatched = 0;            // epoch of the last collective handed to the backend
    // Multi-node: another node failed the communicator after finishing collectives up to failAfter; those
    // still finish here (their data is on its way), then it fails with failCode/failReason.
    uint64_t failAfter = ~uint64_t{0};
    ErrorCode failCode = ErrorCode::kOk;
    std::string failReason;
  };

  std::vector<std::shared_ptr<SessionChannel>> sessionChannels() const;
  // Every join's reply goes through here, never under mutex_: the reply may close its session, which comes back
  // into the engine.
  void answerJoin(JoinDone& done, ErrorCode code, const std::string& message, uint64_t commHandle,
                  const JoinInfo& info) const;
  bool progressBackend();
  void backendFailed(std::string why);
  void handleDescriptor(const OpDescriptor& desc, const std::shared_ptr<SessionChannel>& channel);
  void tryDispatchLocked(const std::shared_ptr<CommEntry>& entry);
  std::shared_ptr<CommEntry> entryForLocked(const std::array<uint8_t, 16>& uniqueId, uint32_t nranks);
  // Every rank is known: set the communicator up and answer the local joiners. Unlocks `lock`.
  void completeJoin(const std::shared_ptr<CommEntry>& entry, std::unique_lock<RankedMutex>& lock);
  // A joining communicator cannot form: every local joiner gets the error and the id is spent. Unlocks.
  void failJoin(const std::shared_ptr<CommEntry>& entry, ErrorCode code, const std::string& reason,
                std::unique_lock<RankedMutex>& lock);
  void eraseEntryLocked(const Communicator& comm);
  // Multi-node: tell the communicator's other nodes (all of them while it is joining).
  void tellPeersLocked(const Communicator& comm, const v1::PeerMessage& message);
  void collectiveFinished(const std::shared_ptr<CommEntry>& entry);
  // `tellPeers`: the failure started on this node, so the communicator's other nodes are told (CommFail).
  void failCommLocked(CommEntry& entry, Communicator::State state, ErrorCode code, const std::string& reason,
                      bool tellPeers = true);
  void leaveCommLocked(uint64_t sessionId, uint64_t handle, Communicator::State state, ErrorCode code,
                       const std::string& reason);
  SessionState& sessionLocked(uint64_t sessionId);
  std::shared_ptr<Buffer> addBuffer(uint64_t sessionId, std::shared_ptr<Buffer> buffer, std::string_view what);
  void checkSessionRoomLocked(const SessionState& s, std::string_view what, uint64_t bytes, bool holdsFd) const;

  const DaemonConfig& config_;
  std::unique_ptr<Backend> backend_;
  mutable RankedMutex mutex_{LockRank::kEngine, "Engine"};
  std::map<uint64_t, SessionState> sessions_;
  std::map<uint64_t, std::shared_ptr<CommEntry>> comms_;          // by handle
  std::map<std::array<uint8_t, 16>, uint64_t> commByUniqueId_;
  uint64_t nextBufferId_ = 1;
  uint64_t nextCommHandle_ = 1;

  std::atomic<bool> running_{false};
  std::function<void(uint64_t, std::string)> onSessionFault_;
  std::function<void(std::string)> onFatal_;
  Pump pump_;  // last: its thread stops before the state above goes
  Cluster* cluster_ = nullptr;
  std::shared_ptr<PlanTable> plans_;
};

}  // namespace tandem::daemon
