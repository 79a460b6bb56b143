// The daemon's core, independent of the socket layer: sessions, buffers, communicators, and the
// submission pump that turns ring descriptors into executed collective ops.
//
// Threads: the control thread (Server) calls every public method except the pump's; the pump thread pops
// descriptors and polls the backend; the backend executes ops (cpu: worker threads; cuda: GPUs). `mutex_`
// guards all maps; op execution runs without it. Lock order: Engine::mutex_ before any backend lock.
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

#include "config.hpp"
#include "state.hpp"
#include "tandem/v1/cluster.pb.h"
#include "tandem/common/error.hpp"

namespace tandem::daemon {

class Cluster;
class CommLink;

struct GpuPeerInfo {
  std::string uuid;
  uint32_t nvlinks = 0;  // active NVLink links to this peer (0 when NVML is unavailable or the link is PCIe)
  bool p2p = false;      // peer access enabled
};
struct GpuInfo {
  int ordinal = -1;  // the daemon's own ordinal: never sent to clients as an identity
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
  std::string name;
  std::string pciBusId;
  uint32_t sms = 0;
  uint64_t memoryBytes = 0;
  uint32_t ccMajor = 0, ccMinor = 0;
  bool mps = false;  // contexts on this GPU are shared through MPS
  std::vector<GpuPeerInfo> peers;
};

// tandem_register's memory, as the request describes it.
struct RegisterRequest {
  enum class Kind { kMemfd = 0, kCudaIpc = 1, kCudaFd = 2 };
  Kind kind = Kind::kMemfd;
  Fd fd;                   // kMemfd, kCudaFd
  uint64_t offset = 0;     // byte offset of the range in the file (kMemfd), IPC allocation or cuMem allocation
  uint64_t bytes = 0;
  std::string ipcHandle;   // kCudaIpc: the 64 bytes of a cudaIpcMemHandle_t
  std::string deviceUuid;  // cuda kinds: the GPU holding the memory
};

// What a joining rank learns besides the communicator handle (cuda backend; empty on cpu).
struct JoinInfo {
  std::string executor;       // "client" or "daemon"
  int controlFd = -1;         // the rank's control page (memfd); valid while the callback runs
  uint64_t controlBytes = 0;
  uint64_t workspaceBytes = 0;
  uint32_t commCtas = 0;      // cuda.comm_sms (0 = the kernels' default)
};
// One rank's workspace, for the client to map (GetCommMapping).
struct CommMapping {
  int fd = -1;  // valid while the caller holds `keepAlive`
  uint64_t bytes = 0;
  std::string deviceUuid;
  std::shared_ptr<CommResources> keepAlive;
};

// One collective: an op from every rank (ops[r] is rank r), checked together. `errorCode` != 0: rejected;
// every rank completes with `error` and nothing runs.
struct Collective {
  std::vector<PendingOp> ops;               // every rank's; remote ranks' ops carry only their descriptor
  uint64_t commHandle = 0;
  std::shared_ptr<CommResources> resources;
  std::shared_ptr<void> owner;              // keeps the communicator (and opsCompleted) alive
  std::atomic<uint64_t>* opsCompleted = nullptr;
  int32_t errorCode = 0;
  std::string error;
  std::shared_ptr<CommLink> link;           // multi-node communicators: staging and executor thread
  std::vector<uint32_t> nodeOfRank;         // multi-node: node index of every rank
  uint64_t epoch = 0;                       // the collective's position on the communicator (1, 2, ...)
};

// Where ops run. The engine owns sessions, buffers, communicators and the pump; a backend allocates and
// registers memory, resolves buffers into its executor's address space, and executes collectives.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;      // "cpu", "cuda"
  virtual const char* executor() const = 0;  // "host", "client", "daemon"
  virtual std::vector<GpuInfo> gpus() const { return {}; }
  virtual void start() {}
  virtual void stop() {}

  // Memory. The engine charges buffer->accountedBytes to the session and enforces the limits.
  virtual std::shared_ptr<Buffer> allocate(uint64_t bytes, const std::string& deviceUuid) = 0;
  virtual std::shared_ptr<Buffer> registerMemory(RegisterRequest& request) = 0;
  // The first byte of `buffer` + offset in the executor's address space.
  virtual std::byte* resolve(const Buffer& buffer, uint64_t offset) const = 0;

  // Communicators. checkJoin throws for a rank the backend cannot serve; setupComm runs when the last rank
  // joins (engine lock held) and may throw, failing every joiner.
  virtual void checkJoin(const std::string& /*deviceUuid*/) {}
  virtual std::shared_ptr<CommResources> setupComm(const Communicator&) { return nullptr; }
  virtual uint64_t commBytesPerRank(const CommResources&) const { return 0; }
  virtual JoinInfo joinInfo(const CommResources&, uint32_t /*rank*/) const { return {}; }
  virtual CommMapping mapping(const std::shared_ptr<CommResources>&, uint32_t /*rank*/) const { return {}; }
  // The communicator failed or ended: release every rank's waits (engine lock held).
  virtual void abortComm(CommResources&, ErrorCode /*code*/, const std::string& /*reason*/) {}
  virtual void sessionClosed(uint64_t /*sessionId*/) {}

  // Executes (or rejects) a collective; must not block. Completes every rank exactly once, now or later.
  // Returns true when the communicator may dispatch its next collective at once; false means the backend
  // calls `finished` (without the engine lock) when it may.
  virtual bool execute(Collective collective, std::function<void()> finished) = 0;
  // Pump hook: progresses in-flight work. Appends (comm handle, reason) for communicators that must fail.
  virtual bool poll(std::vector<std::pair<uint64_t, std::string>>& /*failed*/) { return false; }
  virtual bool busy() const { return false; }  // the pump must keep polling
};

std::unique_ptr<Backend> makeCpuBackend(const DaemonConfig& config);

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
  void join(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t nranks, uint32_t rank,
            const std::string& deviceUuid, JoinDone done);
  // One rank's workspace of a communicator this session joined (cuda backend).
  CommMapping commMapping(uint64_t sessionId, uint64_t commHandle, uint32_t rank);
  // Called when a join's timer fires; a no-op if the join already finished.
  void cancelJoin(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t rank, uint32_t timeoutMs);
  void destroyComm(uint64_t sessionId, uint64_t commHandle, bool abort);

  EngineStatus status() const;

  // Multi-node (cluster.nodes). Set before start(); the cluster must outlive the engine's communicators.
  // The two handlers run on the control thread, like every public method.
  void attachCluster(Cluster* cluster) { cluster_ = cluster; }
  void onPeerMessage(uint32_t from, const v1::PeerMessage& message);
  void onNodeLost(uint32_t node, const std::string& reason);
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
    std::shared_ptr<CommLink> link;         // multi-node, once every rank is known
    std::map<uint32_t, std::string> earlyKeys;  // peers' staging keys that came before the link existed
    uint64_t lastDispatched = 0;            // epoch of the last collective handed to the backend
    // Multi-node: another node failed the communicator after finishing collectives up to failAfter; those
    // still finish here (their data is on its way), then it fails with failCode/failReason.
    uint64_t failAfter = ~uint64_t{0};
    ErrorCode failCode = ErrorCode::kOk;
    std::string failReason;
  };

  void pumpLoop();
  bool pollSessions(const std::vector<std::shared_ptr<SessionChannel>>& channels);
  void handleDescriptor(const OpDescriptor& desc, const std::shared_ptr<SessionChannel>& channel);
  void tryDispatchLocked(const std::shared_ptr<CommEntry>& entry);
  std::shared_ptr<CommEntry> entryForLocked(const std::array<uint8_t, 16>& uniqueId, uint32_t nranks);
  // Every rank is known: set the communicator up and answer the local joiners. Unlocks `lock`.
  void completeJoin(const std::shared_ptr<CommEntry>& entry, std::unique_lock<std::mutex>& lock);
  // A joining communicator cannot form: every local joiner gets the error and the id is spent. Unlocks.
  void failJoin(const std::shared_ptr<CommEntry>& entry, ErrorCode code, const std::string& reason,
                std::unique_lock<std::mutex>& lock);
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
  std::shared_ptr<Buffer> addBuffer(uint64_t sessionId, std::shared_ptr<Buffer> buffer);

  const DaemonConfig& config_;
  std::unique_ptr<Backend> backend_;
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
  std::function<void(uint64_t, std::string)> onSessionFault_;
  Cluster* cluster_ = nullptr;
};

}  // namespace tandem::daemon
