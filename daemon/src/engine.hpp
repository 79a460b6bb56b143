// The daemon's core, independent of the socket layer: sessions, buffers, communicators, and the
// submission pump that turns ring descriptors into executed collective ops.
//
// Threads: the control thread (Server) calls every public method except the pump's; the pump thread pops
// descriptors; worker threads execute ops. `mutex_` guards all maps; op execution runs without it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "state.hpp"
#include "tandem/common/error.hpp"

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
  };
  std::vector<Session> sessions;
  std::vector<Comm> comms;
  uint64_t totalBytes = 0;
  uint32_t totalBuffers = 0;
};

class Engine {
 public:
  using JoinDone = std::function<void(ErrorCode code, const std::string& message, uint64_t commHandle)>;

  explicit Engine(const DaemonConfig& config);
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
  std::shared_ptr<Buffer> allocate(uint64_t sessionId, uint64_t bytes);
  std::shared_ptr<Buffer> registerMemory(uint64_t sessionId, Fd fd, uint64_t offset, uint64_t bytes);
  void release(uint64_t sessionId, uint64_t bufferId, bool registered);

  // Communicators. `done` runs exactly once: when every rank has joined (on the control thread of the last
  // joiner), or from cancelJoin/closeSession.
  void join(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t nranks, uint32_t rank, JoinDone done);
  // Called when a join's timer fires; a no-op if the join already finished.
  void cancelJoin(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t rank, uint32_t timeoutMs);
  void destroyComm(uint64_t sessionId, uint64_t commHandle, bool abort);

  EngineStatus status() const;
  // Called (from the pump) when a session corrupts its ring; the Server closes it.
  void setSessionFaultHandler(std::function<void(uint64_t sessionId, std::string why)> handler) {
    onSessionFault_ = std::move(handler);
  }
  int pumpEventFd() const { return pumpEvent_.get(); }

 private:
  struct PendingJoin {
    uint64_t sessionId;
    JoinDone done;
  };
  struct CommEntry {
    Communicator comm;
    std::map<uint32_t, PendingJoin> joins;  // rank -> waiting joiner
    bool busy = false;                      // one collective at a time per communicator (stream order)
  };

  void pumpLoop();
  void workerLoop();
  bool pollSessions(const std::vector<std::shared_ptr<SessionChannel>>& channels);
  void handleDescriptor(const OpDescriptor& desc, const std::shared_ptr<SessionChannel>& channel);
  void tryDispatchLocked(const std::shared_ptr<CommEntry>& entry);
  void runCollective(const std::shared_ptr<CommEntry>& entry, std::vector<PendingOp> ops);
  void failCommLocked(CommEntry& entry, Communicator::State state, ErrorCode code, const std::string& reason);
  void leaveCommLocked(uint64_t sessionId, uint64_t handle, Communicator::State state, ErrorCode code,
                       const std::string& reason);
  void enqueueWork(std::function<void()> work);
  SessionState& sessionLocked(uint64_t sessionId);

  const DaemonConfig& config_;
  mutable std::mutex mutex_;
  std::map<uint64_t, SessionState> sessions_;
  std::map<uint64_t, std::shared_ptr<CommEntry>> comms_;          // by handle
  std::map<std::array<uint8_t, 16>, uint64_t> commByUniqueId_;
  uint64_t nextBufferId_ = 1;
  uint64_t nextCommHandle_ = 1;
  std::atomic<uint64_t> sessionsGeneration_{0};

  Fd pumpEvent_;
  std::atomic<bool> running_{false};
  std::thread pump_;
  std::vector<std::thread> workers_;
  std::mutex workMutex_;
  std::condition_variable workCv_;
  std::deque<std::function<void()>> work_;
  std::function<void(uint64_t, std::string)> onSessionFault_;
};

}  // namespace tandem::daemon
