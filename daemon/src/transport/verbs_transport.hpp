// The `verbs` transport: RC queue pairs on one RDMA NIC (libibverbs), behind the Transport interface.
//
// Set-up (driven by the bootstrap exchange the daemons run; rdma-core's rc_pingpong order):
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
// Control channel: none yet (controlChannel() is null). The QPs carry RDMA WRITEs only; the daemons' messages
// would need SEND/RECV on QP 0 with posted receive buffers, ordered after the WRITEs posted before them, and the
// QpInfo exchange above must run over some other channel first. So tandemd refuses cluster.transport: verbs.
//
// Thread-safety: as Transport. Internally one mutex per peer (QP queues), one for the registry, one for flush.
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/transport.hpp"
#include "transport/verbs_logic.hpp"

namespace tandem::daemon::transport {

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

class VerbsTransport final : public Transport {
 public:
  /// Opens the device and port and creates the PD and CQ. Throws Error(kUnavailable) when there is no
  /// device or the port is not active, Error(kRdma) when a verbs call fails.
  explicit VerbsTransport(VerbsConfig config);
  ~VerbsTransport() override;
  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;

  const std::string& deviceName() const { return deviceName_; }

  /// Creates (once) this node's QPs for `peer` in INIT and returns their addresses for the bootstrap.
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
  void write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
             uint64_t bytes, uint64_t cookie, bool signal) override;
  void writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                 bool signal) override;
  void submit() override;
  std::size_t poll(std::span<Completion> out) override;
  PeerStatus peerStatus(NodeIndex peer) const override;
  void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) override;

 private:
  struct Region {
    verbs::IbvMr mr;
    MemoryDesc desc;
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
    bool isFlag = true;
    verbs::WorkRequestPlan plan;     // the flag (isFlag)
    std::vector<uint64_t> required;  // per QP: tracker.retired() must reach this (flags)
    bool signal = false;
    uint64_t cookie = 0;
  };
  struct PendingCompletion {
    uint64_t cookie;
    std::vector<uint64_t> required;  // per QP: tracker.retired() must reach this
  };
  struct Peer {
    mutable std::mutex mutex;        // guards everything below
    std::vector<std::unique_ptr<Qp>> qps;
    std::deque<Deferred> deferred;
    std::deque<PendingCompletion> completions;  // issue order
    PeerStatus status;
  };

  Peer& peerRef(NodeIndex peer) const;
  void checkAlive(const Peer& p, NodeIndex peer) const;  // throws kPeerLost; p.mutex held
  void failPeerLocked(Peer& p, NodeIndex peer, std::string reason, std::vector<Completion>& failedOut);
  void postPending(Peer& p, NodeIndex peer, std::vector<Completion>& failedOut);  // p.mutex held
  // Snapshot of every QP's queued WRs, appending a signalled marker where the last one would not complete
  // visibly: the completion it builds covers everything queued to the peer so far. p.mutex held.
  std::vector<uint64_t> coverAllLocked(Peer& p);
  void collectCompletions(Peer& p, NodeIndex peer, std::vector<Completion>& out);  // p.mutex held
  verbs::IbvQp createQp(ibv_cq* cq, uint32_t sendDepth);
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
};

}  // namespace tandem::daemon::transport
