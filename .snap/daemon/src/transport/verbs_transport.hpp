// The `verbs` transport: RC queue pairs on one RDMA NIC (libibverbs), behind the Transport interface.
//
// Set-up by hand (the bootstrap below runs the same steps; rdma-core's rc_pingpong order):
//   VerbsTransport t(config);                  device, port, PD, CQ
//   auto mine = t.localQpInfo(peer);           QPs for `peer`, moved to INIT; send `mine` to the peer
//   t.connectPeer(peer, theirs);               INIT -> RTR -> RTS with the peer's QpInfo
// Memory: host memory with ibv_reg_mr; GPU memory with ibv_reg_dmabuf_mr on a dma-buf fd
// (cuMemGetHandleForAddressRange), falling back to ibv_reg_mr on the device pointer (nvidia-peermem).
//
// Data path: `write` is RDMA WRITEs cut at multiples of `stripeBytes` of the destination region; destination
// stripe i of region r always goes on QP (r + i) % qpsPerPeer, so writes to the same bytes stay in issue order
// and large writes use every QP. `writeFlag` is an 8-byte inline RDMA WRITE. A flag after earlier writes:
//   - on one QP, RC executes WRITEs in order and the responder places them in order, so the flag (posted
//     after the data on QP 0) lands after the data;
//   - with several QPs per peer, the flag is held back until every other QP has retired the WRs posted before
//     it (a signalled zero-length marker WR is appended there), then posted on QP 0.
// Selective signalling (verbs::SendQueueTracker): every `signalEvery`-th WR and every WR the caller asks to be
// signalled; the send queue never holds more than `sendQueueDepth` unretired WRs. A signalled op completes
// when every QP of the peer has retired all WRs queued up to it (markers make that visible), so its
// completion covers every earlier op to that peer, as on one RC QP.
//
// GPUDirect ordering: when data and its flag both land in GPU memory, the NIC's PCIe writes arrive in order as
// long as the MR is registered without IBV_ACCESS_RELAXED_ORDERING (the default here), so a GPU that polls
// the flag sees the data. When the receiver learns of arrival some other way (a CQE or a flag in host memory)
// or relaxed ordering is on, it must call `flush(region)` before letting a GPU consume the data: an RDMA READ
// through a loopback QP, which completes only after the NIC's earlier writes into that GPU memory are visible
// (NCCL's gpuFlush, net_ib.cc).
//
// Control channel (ControlChannel, with a bootstrap): the daemons' messages travel as SENDs on QP 0, so they are
// ordered after the data exactly as flags are (RC executes QP 0's WRITEs and SENDs in order and a receive completion
// is written after the data of every earlier packet; other QPs get markers first, as for a flag). A message is cut
// into fragments of at most recvSlotBytes - 4 (a 4-byte header: more follow / last); the receiver keeps recvSlots
// receive buffers posted on QP 0 of each peer and reposts each once its fragment is copied out; a sender that
// outruns them waits on RNR NAKs (rnr_retry 7 = forever), never loses a message. Each message is one registered
// buffer, released when QP 0 has retired its last fragment. A "verbs control" thread polls the receive CQ and hands
// messages to the handler in order, one at a time per peer, with no transport lock held.
//
// Bootstrap (VerbsConfig::bootstrap): queue pairs need each other's QpInfo before they can carry anything, and RDMA
// has no way to tell a silent peer from a slow one quickly, so the transport owns a TcpTransport (one connection
// per peer, no data) for three jobs it already does well: the authenticated handshake with the cluster secret
// (HMAC-SHA256), heartbeats and the peer deadline, and re-dialling a lost peer as a new incarnation. Over its
// messages the pair runs a three-way QP set-up, led by the lower node index:
//   leader:   new QPs (INIT), receives posted      -> Offer{round, QpInfos}
//   follower: new QPs, INIT -> RTR -> RTS           -> Answer{round, QpInfos}
//   leader:   RTR -> RTS, peer connected            -> Ready{round}; follower: peer connected
// A round replaces the QPs of the one before, so stale packets and completions of an old incarnation meet
// destroyed QPs (and round tags in wr_id), never the new ones. A QP error on either side fails the peer there
// (completions kPeerLost, the failure handler) and sends Down{round, reason}, which fails it on the other side;
// the leader then offers a new round while the bootstrap link is up, and when it comes back after a loss. Each
// connected round is an incarnation: peerGeneration() counts them and the rejoin handler runs for all but the first.
// A peer's failure handler runs on the verbs control thread (never inside a caller's write or sendMessage).
// Without a bootstrap (tests, tools) localQpInfo/connectPeer set up the QPs by hand and messages work the same.
//
// Thread-safety: as Transport. Internally one mutex per peer (QP queues), one for the registry, one for flush.
//
// Files: verbs_device.cpp (the RAII handles, the device list, NIC discovery), verbs_bootstrap.cpp (QP creation and
// connection, the bootstrap's rounds and the verbs control thread), verbs_transport.cpp (opening the device, memory
// registration, the data path, completions, flush and control messages); the pure logic is in verbs_logic.hpp.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <thread>
#include <utility>
#include <vector>

#include "transport/transport.hpp"
#include "transport/verbs_logic.hpp"

namespace tandem::daemon::transport {

/// The bootstrap link a VerbsTransport owns when it runs a cluster (see the file comment).
struct VerbsBootstrap {
  bool enabled = false;
  std::string listenHost = "127.0.0.1";  ///< this node's entry of cluster.nodes
  uint16_t listenPort = 0;
  std::string secret;                    ///< cluster.secret
  uint32_t connectTimeoutMs = 10000;
  uint32_t heartbeatIntervalMs = 100;
  uint32_t peerDeadlineMs = 2000;
};

struct VerbsConfig {
  NodeIndex self = 0;
  uint32_t nodeCount = 1;
  std::string device;            ///< "mlx5_0"; empty: the first device whose port is active
  verbs::PathConfig path;        ///< port, GID index, timeouts; activeMtu is read from the port
  uint32_t qpsPerPeer = 1;       ///< 1..16
  uint32_t sendQueueDepth = 512; ///< WRs per QP send queue (≤ the device's max_qp_wr)
  uint32_t signalEvery = 32;     ///< selective signalling period (≤ sendQueueDepth)
  uint32_t maxWrPerPost = 32;    ///< WRs chained into one ibv_post_send (one doorbell)
  uint32_t cqDepth = 8192;       ///< completion queue entries shared by all QPs
  uint64_t maxMessageBytes = uint64_t{1} << 30;  ///< no WR larger (≤ the port's max_msg_sz)
  uint64_t stripeBytes = uint64_t{1} << 20;      ///< destination stripe pinned to one QP (see the file comment)
  uint32_t maxInlineBytes = 64;  ///< requested inline size; flags need 8
  bool relaxedOrdering = false;  ///< IBV_ACCESS_RELAXED_ORDERING on MRs: faster on some hosts, needs flush()
  uint32_t recvSlots = 16;         ///< receive buffers posted on QP 0 per peer, for control messages
  uint32_t recvSlotBytes = 16384;  ///< bytes of each; a message fragment carries at most this minus 4
  VerbsBootstrap bootstrap;        ///< disabled: QPs are connected by hand (localQpInfo/connectPeer)
};

namespace verbs {
// RAII for every native handle, one alias each; deleters log (never throw) a failed destroy.
struct DeviceListDeleter { void operator()(ibv_device** list) const noexcept; };
struct ContextDeleter { void operator()(ibv_context* ctx) const noexcept; };
struct PdDeleter { void operator()(ibv_pd* pd) const noexcept; };
struct MrDeleter { void operator()(ibv_mr* mr) const noexcept; };
struct CqDeleter { void operator()(ibv_cq* cq) const noexcept; };
struct QpDeleter { void operator()(ibv_qp* qp) const noexcept; };
using IbvDeviceList = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using IbvContext = std::unique_ptr<ibv_context, ContextDeleter>;
using IbvPd = std::unique_ptr<ibv_pd, PdDeleter>;
using IbvMr = std::unique_ptr<ibv_mr, MrDeleter>;
using IbvCq = std::unique_ptr<ibv_cq, CqDeleter>;
using IbvQp = std::unique_ptr<ibv_qp, QpDeleter>;

/// The device list; count 0 (and savedErrno, e.g. ENOSYS without kernel support) when there is none.
struct DeviceList {
  IbvDeviceList list;
  int count = 0;
  int savedErrno = 0;
};
DeviceList getDeviceList();

/// Every RDMA device with its PCI path, NUMA node and port-1 state, for chooseRailNics. Empty without NICs.
std::vector<NicDesc> discoverNics();

/// Throws Error(kRdma) "<what>: <strerror> [<call> -> errno N]" when rc != 0 (verbs calls return an errno value).
void checkVerbs(int rc, std::string_view what, std::string_view call);
}  // namespace verbs

class TcpTransport;

class VerbsTransport final : public Transport, public ControlChannel {
 public:
  /// Opens the device and port and creates the PD and CQs, and (with a bootstrap) binds its listen address.
  /// Throws Error(kUnavailable) when there is no device or the port is not active, Error(kRdma) when a verbs call
  /// fails, what TcpTransport's constructor throws for the bootstrap.
  explicit VerbsTransport(VerbsConfig config);
  ~VerbsTransport() override;
  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;

  const std::string& deviceName() const { return deviceName_; }
  /// The bootstrap's bound port (the chosen one when bootstrap.listenPort was 0); 0 without a bootstrap.
  uint16_t bootstrapPort() const;

  /// Without a bootstrap: creates (once) this node's QPs for `peer` in INIT, with QP 0's receives posted, and
  /// returns their addresses for the peer.
  /// `control` is the region whose rkey/addr go into each QpInfo (the flags area); optional.
  std::vector<verbs::QpInfo> localQpInfo(NodeIndex peer, LocalRegion control = {});
  /// Moves the QPs for `peer` to RTR and RTS against the peer's QpInfos (one per QP, same order).
  /// Throws Error(kProtocol) on a count mismatch, Error(kRdma) when ibv_modify_qp fails.
  void connectPeer(NodeIndex peer, std::span<const verbs::QpInfo> remote);
  /// GPUDirect flush of `region` (see the file comment). Throws Error(kTimeout) past `timeout`.
  void flush(LocalRegion region, std::chrono::milliseconds timeout);

  TransportKind kind() const override { return TransportKind::kVerbs; }
  NodeIndex self() const override { return config_.self; }
  uint32_t nodeCount() const override { return config_.nodeCount; }
  LocalRegion registerMemory(const MemoryDesc& desc) override;
  void deregisterMemory(LocalRegion region) override;
  RemoteKey remoteKey(LocalRegion region) const override;
  std::string registration(LocalRegion region) const override;
  void write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
             uint64_t bytes, uint64_t cookie, bool signal) override;
  void writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                 bool signal) override;
  void submit() override;
  std::size_t poll(std::span<Completion> out) override;
  PeerStatus peerStatus(NodeIndex peer) const override;
  void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) override;
  /// This transport itself, when it has a bootstrap or its QPs are connected by hand; see the file comment.
  ControlChannel* controlChannel() override { return this; }

  // ---- ControlChannel ----
  /// Connects the bootstrap to every node, then sets up the QPs of every peer it reached; blocks until all are
  /// connected or bootstrap.connectTimeoutMs passes. Throws what TcpTransport::connect throws, Error(kTimeout)
  /// naming peers whose QPs did not come up, Error(kUnavailable) without a bootstrap.
  void connect(const std::vector<NodeAddress>& nodes) override;
  /// A SEND (in fragments) on QP 0, after every earlier write and flag to `peer`; see the file comment.
  void sendMessage(NodeIndex peer, std::span<const std::byte> payload) override;
  void setMessageHandler(MessageHandler handler) override;
  void setPeerRejoinHandler(std::function<void(NodeIndex)> handler) override;
  uint64_t peerGeneration(NodeIndex peer) const override;

 private:
  struct Region {
    verbs::IbvMr mr;
    MemoryDesc desc;  // dmabufFd: not kept (the caller may close it)
    bool dmabuf = false;  // registered with ibv_reg_dmabuf_mr
  };
  struct Qp {
    verbs::IbvQp qp;
    verbs::QpInfo local;
    verbs::SendQueueTracker tracker;
    std::deque<verbs::WorkRequestPlan> pending;         // queued, not yet posted
    uint64_t enqueued = 0;                              // WRs ever queued (= seq of the next one)
  };
  // Held back until every QP has retired what was queued before it: a flag (then posted on QP 0), or the
  // completion bookkeeping of a signalled write issued while flags were held back.
  struct Deferred {
    bool isFlag = true;              // flag or message: WRs for QP 0, held until the other QPs caught up
    bool isMessage = false;          // the WRs are a message's fragments (its buffer is Peer::outMessages' next)
    std::vector<verbs::WorkRequestPlan> plans;  // the flag, or the fragments (isFlag)
    std::vector<uint64_t> required;  // per QP: tracker.retired() must reach this (flags)
    bool signal = false;
    uint64_t cookie = 0;
  };
  struct PendingCompletion {
    uint64_t cookie;
    std::vector<uint64_t> required;  // per QP: tracker.retired() must reach this
  };
  // A control message's registered buffer, kept until QP 0 has retired its last fragment.
  struct OutMessage {
    std::vector<std::byte> bytes;
    verbs::IbvMr mr;
    uint64_t releaseAt = 0;  // QP 0's WR count after its last fragment; 0 while held back
  };
  // QP 0's receive buffers.
  struct RecvPool {
    std::vector<std::byte> bytes;
    verbs::IbvMr mr;
  };
  enum class Setup : uint8_t { kNone, kOffered, kAnswered, kUp };
  struct Peer {
    mutable std::mutex mutex;        // guards everything below but generation
    // Declared before qps, so the QPs are destroyed before the memory their work requests name.
    std::unique_ptr<RecvPool> recv;
    std::deque<OutMessage> outMessages;
    std::vector<std::unique_ptr<Qp>> qps;
    std::deque<Deferred> deferred;
    std::deque<PendingCompletion> completions;  // issue order
    PeerStatus status;
    uint64_t round = 0;              // which set of QPs (bootstrap round); tags wr_ids so stale CQEs are ignored
    Setup setup = Setup::kNone;
    std::vector<std::byte> assembling;  // fragments of the message arriving (verbs control thread)
    std::atomic<uint64_t> generation{0};
  };
  // Work for the verbs control thread, in arrival order.
  struct Event {
    enum class Kind : uint8_t { kBootstrapMessage, kBootstrapFailed, kBootstrapRejoined, kLocalFailure, kStartRound };
    Kind kind;
    NodeIndex peer = 0;
    std::vector<std::byte> payload;
    PeerStatus status;
    uint64_t round = 0;
  };

  // A registered region's address, size and keys, read under regionsMutex_; nullopt for an unknown id.
  struct RegionView {
    uint64_t addr = 0, bytes = 0;
    uint32_t lkey = 0, rkey = 0;
  };
  std::optional<RegionView> regionView(LocalRegion region) const;
  Peer& peerRef(NodeIndex peer) const;
  void checkAlive(const Peer& p, NodeIndex peer) const;  // throws kPeerLost; p.mutex held
  // Marks the peer failed (or closed), fails its signalled ops into failedOut and tells the control thread, which
  // runs the failure handler and the bootstrap's Down. p.mutex held.
  void failPeerLocked(Peer& p, NodeIndex peer, std::string reason, std::vector<Completion>& failedOut,
                      PeerState state = PeerState::kFailed);
  void postPending(Peer& p, NodeIndex peer, std::vector<Completion>& failedOut);  // p.mutex held
  // Snapshot of every QP's queued WRs, appending a signalled marker where the last one would not complete
  // visibly: the completion it builds covers everything queued to the peer so far. p.mutex held.
  std::vector<uint64_t> coverAllLocked(Peer& p);
  // Appends a signalled marker to every QP but QP 0 that has WRs outstanding, for a flag or message that goes on
  // QP 0 after them: per QP, the count tracker.retired() must reach first (0: none). p.mutex held.
  std::vector<uint64_t> markOtherQpsLocked(Peer& p);
  void collectCompletions(Peer& p, NodeIndex peer, std::vector<Completion>& out);  // p.mutex held
  verbs::IbvQp createQp(ibv_cq* sendCq, ibv_cq* recvCq, uint32_t sendDepth, uint32_t recvDepth);
  // QPs of a new round (INIT, receives posted), replacing the old ones. p.mutex held.
  void createQpsLocked(Peer& p, NodeIndex peer);
  void teardownQpsLocked(Peer& p);
  // INIT -> RTR -> RTS against the peer's QpInfos. p.mutex held. Throws as connectPeer.
  void connectQpsLocked(Peer& p, NodeIndex peer, std::span<const verbs::QpInfo> remote);
  void postRecvLocked(Peer& p, uint32_t slot);
  uint64_t wrTag(const Peer& p) const { return (p.round & 0xffffff) << 40; }
  void addExtraCompletions(std::vector<Completion>& failed);
  // The verbs control thread and its events.
  void postEvent(Event e);
  void controlLoop();
  void handleEvent(Event& e);
  bool pollRecv();
  void startRound(NodeIndex peer);
  void onBootstrapMessage(NodeIndex peer, std::span<const std::byte> bytes);
  void sendBootstrap(NodeIndex peer, uint8_t type, uint64_t round, std::span<const std::byte> body);
  void peerConnected(NodeIndex peer);
  bool leads(NodeIndex peer) const { return config_.self < peer; }
  verbs::QpInfo describeQp(const ibv_qp* qp) const;

  VerbsConfig config_;
  std::string deviceName_;
  ibv_port_attr portAttr_{};
  ibv_gid gid_{};
  // Creation order (destruction runs in reverse): context, PD, MRs, CQs, QPs (rdma-core rc_pingpong).
  verbs::IbvContext ctx_;
  verbs::IbvPd pd_;
  uint64_t flushLanding_ = 0;        // the flush READ's destination (host memory)
  verbs::IbvMr flushLandingMr_;
  mutable std::mutex regionsMutex_;  // guards regions_, nextRegionId_
  std::unordered_map<uint32_t, Region> regions_;
  uint32_t nextRegionId_ = 1;
  verbs::IbvCq cq_;
  verbs::IbvCq flushCq_;
  std::vector<std::unique_ptr<Peer>> peers_;   // index = node; QPs live inside
  std::mutex qpMapMutex_;                      // guards qpOwner_
  std::unordered_map<uint32_t, std::pair<NodeIndex, uint32_t>> qpOwner_;  // qp_num -> (peer, qp index)
  std::mutex flushMutex_;                      // serialises flush(); guards flushQp_
  verbs::IbvQp flushQp_;                       // loopback QP, connected to itself
  std::mutex handlerMutex_;
  std::function<void(NodeIndex, const PeerStatus&)> failureHandler_;
  std::mutex completionsMutex_;                // completions produced outside poll() (failures)
  std::deque<Completion> extraCompletions_;
  verbs::IbvCq recvCq_;                        // QP 0's receive completions, polled by the control thread

  std::mutex channelMutex_;                    // guards the handlers below and connectReturned_
  MessageHandler messageHandler_;
  std::function<void(NodeIndex)> rejoinHandler_;
  bool connectReturned_ = false;
  std::condition_variable connectCv_;
  uint64_t nextRound_ = 0;                     // control thread only

  std::mutex eventMutex_;
  std::condition_variable eventCv_;
  std::deque<Event> events_;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<TcpTransport> bootstrap_;    // after the events it posts to, before the thread that reads them
  std::thread controlThread_;
};

}  // namespace tandem::daemon::transport
