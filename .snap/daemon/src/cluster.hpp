// Multi-node: this daemon's links to the other nodes' daemons (ARCHITECTURE.md decision 6).
//
// Control. The daemons of a cluster (cluster.nodes, the same list on every node) connect through the transport's
// control channel (transport::ControlChannel; tcp, and verbs through its bootstrap link, authenticate both ends with
// the cluster secret and report a different secret or protocol version on both sides; verbs carries the messages
// as SENDs on its queue pairs). Control messages
// (proto/tandem/v1/cluster.proto) ride it in order per peer, each after the data sent to that peer before it. The first message each way is a NodeHello; a node whose hello does not match (cluster
// protocol, backend, staging size) is marked incompatible on both sides, and the reason is in the log and
// in `tandemctl status`. Messages sent before a node is connected wait in a queue and go out after its hello.
//
// Data. Bulk bytes never travel as control messages. Each multi-node communicator has a CommLink: one
// staging region on every node, registered with the transport, with an inbox and an outbox per peer node.
// An executor thread pushes transfer commands (write outbox -> peer's inbox, then a flag) into the proxy
// FIFO; the proxy thread validates, batches and posts them through the transport; the peer's executor
// polls the arrival flag (load-acquire) and, once it has read its inbox, writes a "consumed" flag back, so
// a sender reuses its outbox and the peer's inbox only after the peer is done with them.
//
// Staging layout of a link's region (identical on every node; slots are indexed by node index):
//   [0, 4096)                  header: arrived[n] at 8n   the epoch whose data node n put in my inbox[n]
//                                      consumed[n] at 2048 + 8n   the epoch whose data from me node n has read
//   inbox[n]  at 4096 + 2n * S        S = cluster.staging_bytes: {epoch, bytes} (16 B), then the payload
//   outbox[n] at 4096 + (2n + 1) * S
// The memfd is sparse: only pages an op touches cost memory.
//
// Failure. A peer node that dies, hangs up, misses heartbeats for communicators.peer_lost_deadline_ms or
// sends garbage is lost: every communicator with a rank there fails on this node (the engine does that from
// the NodeLost callback), and waits in exchange() end at once with that reason.
//
// Rejoin. The transport keeps re-dialing a lost node and accepts its fresh handshakes; a restarted daemon
// therefore rejoins by itself. When the transport reports the node connected again (a new incarnation), its
// state goes back to connected, this node sends it our NodeHello first (it sends its own), and messages flow
// again. Communicators that failed with it stay failed; new ones across it work. Messages sent to a lost node
// are dropped (not queued): they belonged to its previous run.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "tandem/common/ranked_mutex.hpp"
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/v1/cluster.pb.h"
#include "transport/proxy_fifo.hpp"
#include "transport/transport.hpp"

namespace tandem::daemon {

struct GpuInfo;
using transport::NodeIndex;

/// Bump on any change in the meaning of cluster.proto messages or the staging layout.
/// 2: NodeHello.gpu_exchange; a cuda communicator's first GPU-exchange op sends the GPU region's key through the
/// staging (cuda/gpu_exchange.hpp).
inline constexpr uint32_t kClusterProtocolVersion = 2;

class Cluster;

/// One multi-node communicator's staging on this node. Created by Cluster::createLink when the
/// communicator has every rank; the executor thread of that communicator is its only user of exchange().
class CommLink {
 public:
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kPayloadHeaderBytes = 16;  // {epoch, bytes} before every payload
  static constexpr uint64_t arrivedOffset(NodeIndex n) { return 8 * uint64_t{n}; }
  static constexpr uint64_t consumedOffset(NodeIndex n) { return 2048 + 8 * uint64_t{n}; }
  uint64_t inboxOffset(NodeIndex n) const { return kHeaderBytes + 2 * uint64_t{n} * slotBytes_; }
  uint64_t outboxOffset(NodeIndex n) const { return kHeaderBytes + (2 * uint64_t{n} + 1) * slotBytes_; }
  /// Largest payload one exchange may send to one peer.
  uint64_t maxPayload() const { return slotBytes_ - kPayloadHeaderBytes; }

  ~CommLink();
  CommLink(const CommLink&) = delete;
  CommLink& operator=(const CommLink&) = delete;

  const std::vector<NodeIndex>& nodes() const { return nodes_; }  // ascending, this node included
  NodeIndex self() const { return self_; }
  /// The cluster this link belongs to (its transport carries a backend's own regions, e.g. the GPU exchange's).
  Cluster& cluster() const { return cluster_; }

  /// Whether the communicator failed for `epoch` (abort() with afterEpoch < epoch). Thread-safe.
  bool abortedFor(uint64_t epoch) const { return epoch > abortAfter_.load(std::memory_order_acquire); }
  /// Throws the abort's Error (code and reason) when abortedFor(epoch). Thread-safe.
  void throwIfAborted(uint64_t epoch);

  /// One step of a collective across nodes. For every peer node p (ascending): `fill(p, outbox)` writes the
  /// payload for p into its outbox and returns its size (at most maxPayload(); it may be 0); the bytes go to
  /// p's inbox, then a flag. Then, for every peer p in ascending order, waits for p's payload of the same
  /// epoch and calls `receive(p, payload)`. Every node of the communicator must call it once per collective,
  /// with increasing epochs. Throws Error(kPeerLost)/Error(kAborted) with the reason when the communicator
  /// fails meanwhile, Error(kTimeout) when a peer sends nothing for `timeoutMs`.
  void exchange(uint64_t epoch, const std::function<uint64_t(NodeIndex, std::span<std::byte>)>& fill,
                const std::function<void(NodeIndex, std::span<const std::byte>)>& receive, uint32_t timeoutMs);

  /// The communicator failed: exchanges of epochs after `afterEpoch` end with this error (all of them for 0).
  void abort(ErrorCode code, const std::string& reason, uint64_t afterEpoch = 0);
  /// The last epoch whose exchange finished here (its transfers are posted). Thread-safe.
  uint64_t completedEpoch() const { return completedEpoch_.load(std::memory_order_acquire); }
  /// The exchange of `epoch` finished here by other means (the cuda backend's GPU-issued exchange, whose transfers
  /// its GPU's proxy posted): a CommFail this node sends then tells the peers to finish that op. Executor thread only.
  void markCompleted(uint64_t epoch) { completedEpoch_.store(epoch, std::memory_order_release); }

  /// Runs `work` on the communicator's own executor thread, in order. One thread per multi-node
  /// communicator: its collectives block on peers, and sharing a pool between communicators could deadlock
  /// two nodes that run two communicators' ops in opposite orders.
  void post(std::function<void()> work);

 private:
  friend class Cluster;
  CommLink(Cluster& cluster, std::vector<NodeIndex> nodes, uint64_t slotBytes, uint32_t bufferId);
  uint64_t* word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(mapping_.data() + offset); }
  // Waits until the word at `offset` is >= value (or throws as exchange does). `what` names the wait.
  void waitWord(uint64_t offset, uint64_t value, uint32_t timeoutMs, const std::string& what);
  void waitFor(const std::function<bool()>& done, uint32_t timeoutMs, const std::string& what);
  void waitKeys(uint32_t timeoutMs);

  Cluster& cluster_;
  NodeIndex self_;
  std::vector<NodeIndex> nodes_;
  uint64_t slotBytes_;
  uint32_t bufferId_;  // in the proxy's buffer table (local region and, per peer, the peer's region)
  Fd fd_;
  Mapping mapping_;
  transport::LocalRegion region_;
  transport::ProxyFifoView fifo_;
  std::unique_ptr<transport::ProxyFifoProducer> producer_;
  uint64_t lastEpoch_ = 0;  // the epoch of the previous exchange (0: none yet)

  RankedMutex mutex_{LockRank::kLink, "CommLink"};  // guards peerKeys_, abortCode_, abortReason_
  std::condition_variable_any keysCv_;
  std::map<NodeIndex, transport::RemoteKey> peerKeys_;
  std::atomic<uint64_t> abortAfter_{~uint64_t{0}};
  std::atomic<uint64_t> completedEpoch_{0};
  uint64_t currentEpoch_ = 0;  // the exchange in progress (executor thread only)
  ErrorCode abortCode_ = ErrorCode::kOk;
  std::string abortReason_;
  uint32_t keysPublished_ = 0;  // peers whose key the proxy's table holds

  // The executor thread's queue lives apart from the link: the thread shares it, so when a job drops the last
  // reference to the link (its destructor then runs on this thread), the thread still has a queue to look at.
  struct WorkQueue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
  };
  std::shared_ptr<WorkQueue> queue_ = std::make_shared<WorkQueue>();
  std::thread worker_;
};

/// This daemon's membership in a multi-node cluster. Exists only when cluster.nodes has two or more entries.
class Cluster {
 public:
  using MessageHandler = std::function<void(NodeIndex from, const v1::PeerMessage& message)>;
  using NodeLostHandler = std::function<void(NodeIndex node, const std::string& reason)>;

  /// Validates the cluster section, reads the secret, binds the listen address. Throws Error(kInvalidConfig)
  /// or Error(kSystem) (address in use, ...) naming the fix. `deviceCopier` (the backend's, Backend::deviceCopier;
  /// may be null): lets the tcp transport carry GPU memory regions (kDevice); kept until the transport is gone.
  Cluster(const DaemonConfig& config, std::string backend, std::vector<GpuInfo> gpus,
          std::shared_ptr<transport::DeviceCopier> deviceCopier = nullptr);
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  /// Starts connecting to the other nodes in the background (up to cluster.connect_timeout_ms) and the proxy
  /// thread. Handlers run on transport threads; they must not block.
  void start(MessageHandler onMessage, NodeLostHandler onNodeLost);
  void stop();

  NodeIndex self() const { return self_; }
  std::string nodeName(NodeIndex node) const;  // "node 1 (10.0.0.2:7100)"

  /// Sends to one node (queued until its link is up). A lost node drops the message: its loss is reported
  /// through NodeLost. Never throws for a lost peer; throws Error(kInvalidArgument) for a bad index.
  void send(NodeIndex node, const v1::PeerMessage& message);
  void broadcast(const v1::PeerMessage& message);  // to every other node
  /// Empty when `node` is usable; else why not (lost, incompatible).
  std::string nodeProblem(NodeIndex node) const;

  /// A communicator's staging on this node, spanning `nodes` (ascending, self included). Its key goes to the
  /// peers in a CommKeys message; their keys come back through CommLink::setPeerKey.
  std::shared_ptr<CommLink> createLink(std::vector<NodeIndex> nodes);
  std::vector<std::byte> linkKey(const CommLink& link) const;
  /// A peer's CommKeys for `link`. Throws Error(kProtocol) for a malformed key.
  void setPeerKey(CommLink& link, NodeIndex peer, std::span<const std::byte> key);

  void fillStatus(v1::ClusterInfo& out) const;

  /// The transport, for a backend's own regions and proxies (the cuda backend's GPU exchange: cuda/gpu_exchange.hpp).
  /// Valid until stop(); whoever posts through it stops doing so before the engine's communicators are gone.
  transport::Transport& transport() const { return *transport_; }
  const DaemonConfig& config() const { return config_; }
  /// Empty when this node runs the cuda backend's GPU-issued exchange; else why not (cluster.gpu_exchange off, or its
  /// GPUs under MPS, where the GPU exchange stalled on the H200 and is not run until that is found). NodeHello carries
  /// it, and nodes that differ are incompatible: every op's path depends on it.
  const std::string& gpuExchangeOff() const { return gpuExchangeOff_; }

 private:
  friend class CommLink;
  enum class NodeState { kSelf, kConnecting, kConnected, kFailed, kClosed, kIncompatible };
  struct Node {
    std::string address;  // host:port as configured
    NodeState state = NodeState::kConnecting;
    std::string reason;
    std::string hostname, daemonVersion;
    bool helloReceived = false;
  };

  void connectThread();
  std::string helloBytes() const;      // this node's NodeHello, serialised
  void nodeRejoined(NodeIndex node);  // the transport reconnected a lost node (a new incarnation of it)
  void onMessage(NodeIndex from, std::span<const std::byte> bytes);
  void handleHello(NodeIndex from, const v1::NodeHello& hello);
  void nodeLost(NodeIndex node, NodeState state, const std::string& reason);
  void sendNow(NodeIndex node, const std::string& bytes);  // mutex_ not held
  // The link to `node` carries messages again: hello, then what waited in queued_. sendMutex_ held.
  void linkUpLocked(NodeIndex node, const std::string& hello);
  void releaseLink(CommLink& link);                        // from ~CommLink
  void publishTableLocked();
  void retireExpiredLocked();  // deregisters retired regions whose grace has passed

  const DaemonConfig& config_;
  std::string backend_;
  std::vector<GpuInfo> gpus_;
  std::shared_ptr<transport::DeviceCopier> deviceCopier_;  // before transport_: outlives it (its io threads copy)
  std::string gpuExchangeOff_;
  NodeIndex self_;
  std::vector<transport::NodeAddress> addresses_;
  std::unique_ptr<transport::Transport> transport_;
  transport::ControlChannel* control_ = nullptr;  // transport_'s control channel (owned by it)
  MessageHandler onMessage_;
  NodeLostHandler onNodeLost_;
  std::thread connector_;
  std::atomic<bool> stopping_{false};

  // Engine callbacks run on this thread, in arrival order: transport threads may hold transport locks
  // while they report, and the engine calls back into the transport (send) under its own lock.
  void postEvent(std::function<void()> event);
  void eventLoop();
  RankedMutex eventMutex_{LockRank::kClusterEvents, "Cluster events"};
  std::condition_variable_any eventCv_;
  std::deque<std::function<void()>> events_;
  bool eventsStopped_ = false;
  std::thread eventThread_;

  // Orders sends per node: queued messages, then direct ones once the link is up (hello first).
  RankedMutex sendMutex_{LockRank::kClusterSend, "Cluster send"};
  std::vector<bool> linkUp_;                     // guarded by sendMutex_
  std::vector<std::vector<std::string>> queued_;  // guarded by sendMutex_

  // The proxy FIFO (a memfd; the cuda backend maps the same region into GPU address space later) and thread.
  Fd fifoFd_;
  Mapping fifoMapping_;
  transport::ProxyFifoView fifo_;
  std::unique_ptr<transport::Proxy> proxy_;

  mutable RankedMutex mutex_{LockRank::kCluster, "Cluster"};  // guards nodes_, links_, retired_, freeIds_
  std::vector<Node> nodes_;
  struct LinkEntry {
    CommLink* link;
    transport::LocalRegion region;
    uint64_t bytes;
  };
  std::map<uint32_t, LinkEntry> links_;  // by buffer id
  // Regions of destroyed links stay registered a while: a peer may still be writing into them (its side of
  // the communicator fails a moment later), and a write into an unregistered region breaks the whole link.
  struct Retired {
    transport::LocalRegion region;
    uint32_t bufferId;
    Fd fd;
    Mapping mapping;
    std::chrono::steady_clock::time_point until;
  };
  std::vector<Retired> retired_;
  uint32_t nextBufferId_ = 1;
  std::vector<uint32_t> freeIds_;
};

}  // namespace tandem::daemon
