// The verbs transport (verbs_transport.hpp): opening the device, memory registration, the data path (writes, flags,
// selective signalling, completions), the GPUDirect flush and the control messages on QP 0. The QPs' set-up and the
// bootstrap are in verbs_bootstrap.cpp, the handles and device list in verbs_device.cpp.
#include "transport/verbs_transport.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "transport/tcp_transport.hpp"

namespace tandem::daemon::transport {

using verbs::checkVerbs;

VerbsTransport::VerbsTransport(VerbsConfig config) : config_(std::move(config)) {
  if (config_.nodeCount == 0 || config_.self >= config_.nodeCount)
    fail(ErrorCode::kInvalidArgument, "verbs transport: node {} of {} nodes", config_.self, config_.nodeCount);
  if (config_.qpsPerPeer == 0 || config_.qpsPerPeer > 16)
    fail(ErrorCode::kInvalidConfig, "verbs transport: qps_per_peer {} must be in [1, 16]", config_.qpsPerPeer);
  // Validates signalEvery against the depth before any hardware is touched.
  (void)verbs::SendQueueTracker(config_.sendQueueDepth, config_.signalEvery);

  verbs::DeviceList devices = verbs::getDeviceList();
  if (devices.count == 0)
    fail(ErrorCode::kUnavailable, "verbs transport: no RDMA device (ibv_get_device_list returned 0 devices{}); run "
         "on a host with an RDMA NIC, load rdma_rxe, or set cluster.transport: tcp",
         devices.savedErrno ? fmt::format(", errno {}", std::strerror(devices.savedErrno)) : std::string());
  ibv_device* chosen = nullptr;
  std::string tried;
  for (int i = 0; i < devices.count && chosen == nullptr; ++i) {
    ibv_device* dev = devices.list.get()[i];
    const std::string name = ibv_get_device_name(dev);
    if (!config_.device.empty() && name != config_.device) continue;
    verbs::IbvContext ctx(ibv_open_device(dev));
    if (!ctx) {
      tried += fmt::format(" {} (open: {})", name, std::strerror(errno));
      continue;
    }
    ibv_port_attr attr{};
    if (const int rc = ibv_query_port(ctx.get(), config_.path.port, &attr); rc != 0) {
      tried += fmt::format(" {} (port {}: {})", name, config_.path.port, std::strerror(rc));
      continue;
    }
    if (attr.state != IBV_PORT_ACTIVE) {
      tried += fmt::format(" {} (port {} {})", name, config_.path.port, ibv_port_state_str(attr.state));
      continue;
    }
    chosen = dev;
    deviceName_ = name;
    portAttr_ = attr;
    ctx_ = std::move(ctx);
  }
  if (chosen == nullptr)
    fail(ErrorCode::kUnavailable, "verbs transport: no usable RDMA device{}: tried{}; check `ibv_devinfo` and "
         "transport.verbs.device/port", config_.device.empty() ? "" : " named " + config_.device,
         tried.empty() ? " none" : tried);
  config_.path.activeMtu = static_cast<uint8_t>(portAttr_.active_mtu);

  ibv_device_attr devAttr{};
  checkVerbs(ibv_query_device(ctx_.get(), &devAttr), fmt::format("query {}", deviceName_), "ibv_query_device");
  if (config_.sendQueueDepth > static_cast<uint32_t>(devAttr.max_qp_wr))
    fail(ErrorCode::kInvalidConfig, "verbs transport: send queue depth {} exceeds {}'s max_qp_wr {}; lower "
         "transport.verbs.send_queue_depth", config_.sendQueueDepth, deviceName_, devAttr.max_qp_wr);
  config_.path.maxRdAtomic = static_cast<uint8_t>(
      std::clamp<int>(config_.path.maxRdAtomic, 1, std::max(1, devAttr.max_qp_init_rd_atom)));
  config_.path.maxDestRdAtomic =
      static_cast<uint8_t>(std::clamp<int>(config_.path.maxDestRdAtomic, 1, std::max(1, devAttr.max_qp_rd_atom)));
  config_.maxMessageBytes = std::min<uint64_t>(config_.maxMessageBytes, portAttr_.max_msg_sz);

  checkVerbs(ibv_query_gid(ctx_.get(), config_.path.port, config_.path.gidIndex, &gid_),
             fmt::format("read GID {} of {} port {}; set transport.verbs.gid_index to a populated entry (show_gids)",
                         config_.path.gidIndex, deviceName_, config_.path.port),
             "ibv_query_gid");

  pd_.reset(ibv_alloc_pd(ctx_.get()));
  if (!pd_) checkVerbs(-1, fmt::format("allocate a protection domain on {}", deviceName_), "ibv_alloc_pd");

  flushLandingMr_.reset(ibv_reg_mr(pd_.get(), &flushLanding_, sizeof flushLanding_, IBV_ACCESS_LOCAL_WRITE));
  if (!flushLandingMr_)
    checkVerbs(-1, fmt::format("register the flush landing word on {}; set LimitMEMLOCK=infinity in the unit",
                               deviceName_), "ibv_reg_mr");

  cq_.reset(ibv_create_cq(ctx_.get(), static_cast<int>(config_.cqDepth), nullptr, nullptr, 0));
  if (!cq_) checkVerbs(-1, fmt::format("create a {}-entry CQ on {}", config_.cqDepth, deviceName_), "ibv_create_cq");
  flushCq_.reset(ibv_create_cq(ctx_.get(), 16, nullptr, nullptr, 0));
  if (!flushCq_) checkVerbs(-1, fmt::format("create the flush CQ on {}", deviceName_), "ibv_create_cq");

  if (config_.recvSlots == 0 || config_.recvSlots > static_cast<uint32_t>(devAttr.max_qp_wr))
    fail(ErrorCode::kInvalidConfig, "verbs transport: {} receive slots per peer must be in [1, {}'s max_qp_wr {}]",
         config_.recvSlots, deviceName_, devAttr.max_qp_wr);
  if (config_.recvSlotBytes <= verbs::kFragmentHeaderBytes || config_.recvSlotBytes > portAttr_.max_msg_sz)
    fail(ErrorCode::kInvalidConfig, "verbs transport: receive slots of {} bytes must hold more than the {}-byte "
         "fragment header and at most {}'s max_msg_sz", config_.recvSlotBytes, verbs::kFragmentHeaderBytes,
         deviceName_);
  const int recvDepth = static_cast<int>(std::min<uint64_t>(uint64_t{config_.recvSlots} * config_.nodeCount + 16,
                                                            static_cast<uint64_t>(devAttr.max_cqe)));
  recvCq_.reset(ibv_create_cq(ctx_.get(), recvDepth, nullptr, nullptr, 0));
  if (!recvCq_)
    checkVerbs(-1, fmt::format("create the {}-entry receive CQ on {}", recvDepth, deviceName_), "ibv_create_cq");

  peers_.reserve(config_.nodeCount);
  for (uint32_t i = 0; i < config_.nodeCount; ++i) peers_.push_back(std::make_unique<Peer>());
  if (config_.bootstrap.enabled) {
    TcpConfig tc;
    tc.self = config_.self;
    tc.listenHost = config_.bootstrap.listenHost;
    tc.listenPort = config_.bootstrap.listenPort;
    tc.secret = config_.bootstrap.secret;
    tc.connectionsPerPeer = 1;  // control only: the data goes over the QPs
    tc.ioThreads = 1;
    tc.connectTimeoutMs = config_.bootstrap.connectTimeoutMs;
    tc.heartbeatIntervalMs = config_.bootstrap.heartbeatIntervalMs;
    tc.peerDeadlineMs = config_.bootstrap.peerDeadlineMs;
    bootstrap_ = std::make_unique<TcpTransport>(std::move(tc));
    // The bootstrap's callbacks only queue: its failure handler runs under its locks, and every reaction (verbs
    // calls, messages back) belongs on the control thread.
    bootstrap_->setMessageHandler([this](NodeIndex from, std::span<const std::byte> bytes) {
      postEvent(Event{Event::Kind::kBootstrapMessage, from, {bytes.begin(), bytes.end()}, {}, 0});
    });
    bootstrap_->setPeerFailureHandler([this](NodeIndex node, const PeerStatus& st) {
      postEvent(Event{Event::Kind::kBootstrapFailed, node, {}, st, 0});
    });
    bootstrap_->setPeerRejoinHandler(
        [this](NodeIndex node) { postEvent(Event{Event::Kind::kBootstrapRejoined, node, {}, {}, 0}); });
  }
  controlThread_ = std::thread([this] { controlLoop(); });
  spdlog::info("verbs transport: node {} on {} port {} ({}, MTU {}, GID index {})", config_.self, deviceName_,
               config_.path.port, portAttr_.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand",
               verbs::mtuBytes(config_.path.activeMtu), config_.path.gidIndex);
}

VerbsTransport::~VerbsTransport() {
  stopping_.store(true);  // from here the bootstrap's callbacks queue nothing
  eventCv_.notify_all();
  if (controlThread_.joinable()) controlThread_.join();
  bootstrap_.reset();  // says goodbye to the peers, after the thread that sends through it has stopped
  // Members go in reverse declaration order: flush QP, peers' QPs, CQs, MRs, PD, context.
  flushQp_.reset();
  peers_.clear();
}

VerbsTransport::Peer& VerbsTransport::peerRef(NodeIndex peer) const {
  if (peer >= peers_.size() || peer == config_.self)
    fail(ErrorCode::kInvalidArgument, "verbs transport: node {} is not a peer of node {} ({} nodes)", peer,
         config_.self, config_.nodeCount);
  return *peers_[peer];
}

LocalRegion VerbsTransport::registerMemory(const MemoryDesc& desc) {
  if (desc.addr == nullptr || desc.bytes == 0)
    fail(ErrorCode::kInvalidArgument, "verbs transport: cannot register an empty or null range");
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (config_.relaxedOrdering) access |= IBV_ACCESS_RELAXED_ORDERING;
  const double mib = static_cast<double>(desc.bytes) / (1024.0 * 1024.0);
  verbs::IbvMr mr;
  bool dmabuf = false;
  if (desc.kind == MemoryKind::kDevice && desc.dmabufFd >= 0) {
    // iova = the device pointer, so RemoteKey::addr + offset addresses the same bytes as on the GPU.
    mr.reset(ibv_reg_dmabuf_mr(pd_.get(), desc.dmabufOffset, desc.bytes, reinterpret_cast<uint64_t>(desc.addr),
                               desc.dmabufFd, access));
    dmabuf = static_cast<bool>(mr);
    if (!mr)
      spdlog::warn("verbs transport: ibv_reg_dmabuf_mr of {:.1f} MiB on {} failed ({}); falling back to ibv_reg_mr, "
                   "which needs nvidia-peermem", mib, deviceName_, std::strerror(errno));
  }
  if (!mr) {
    mr.reset(ibv_reg_mr(pd_.get(), desc.addr, desc.bytes, access));
    if (!mr) {
      const int err = errno;
      fail(err == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kRdma,
           "register {:.1f} MiB of {} memory on {} failed: ibv_reg_mr -> {}. {}", mib,
           desc.kind == MemoryKind::kDevice ? "GPU" : "host", deviceName_, std::strerror(err),
           desc.kind == MemoryKind::kDevice
               ? "Pass a dma-buf fd (cuMemGetHandleForAddressRange, CUDA >= 11.7, kernel >= 5.12) or load nvidia-peermem."
               : "Set LimitMEMLOCK=infinity in the unit (ulimit -l).");
    }
  }
  std::lock_guard lock(regionsMutex_);
  const uint32_t id = nextRegionId_++;
  Region r{std::move(mr), desc, dmabuf};
  r.desc.dmabufFd = -1;
  regions_.emplace(id, std::move(r));
  return LocalRegion{id};
}

std::string VerbsTransport::registration(LocalRegion region) const {
  std::lock_guard lock(regionsMutex_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) return {};
  return it->second.dmabuf ? "dma-buf" : "ibv_reg_mr";
}

void VerbsTransport::deregisterMemory(LocalRegion region) {
  std::lock_guard lock(regionsMutex_);
  regions_.erase(region.id);
}

std::optional<VerbsTransport::RegionView> VerbsTransport::regionView(LocalRegion region) const {
  std::lock_guard lock(regionsMutex_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) return std::nullopt;
  return RegionView{reinterpret_cast<uint64_t>(it->second.desc.addr), it->second.desc.bytes, it->second.mr->lkey,
                    it->second.mr->rkey};
}

RemoteKey VerbsTransport::remoteKey(LocalRegion region) const {
  const auto r = regionView(region);
  if (!r) fail(ErrorCode::kNotFound, "verbs transport: unknown local region {}", region.id);
  return RemoteKey{TransportKind::kVerbs, config_.self, region.id, r->rkey, r->addr, r->bytes};
}

void VerbsTransport::checkAlive(const Peer& p, NodeIndex peer) const {
  if (p.status.state == PeerState::kFailed || p.status.state == PeerState::kClosed)
    fail(ErrorCode::kPeerLost, "verbs transport: node {} lost: {}", peer, p.status.reason);
  if (p.qps.empty() || p.status.state != PeerState::kConnected)
    fail(ErrorCode::kUnavailable, "verbs transport: node {} is not connected yet (bootstrap incomplete)", peer);
}

void VerbsTransport::write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst,
                           uint64_t dstOffset, uint64_t bytes, uint64_t cookie, bool signal) {
  if (dst.transport != TransportKind::kVerbs || dst.owner != peer)
    fail(ErrorCode::kInvalidArgument, "verbs transport: key of node {} ({}) used for a write to node {}", dst.owner,
         transportKindName(dst.transport), peer);
  const auto local = regionView(src);
  if (!local) fail(ErrorCode::kInvalidArgument, "verbs transport: unknown local region {}", src.id);
  const uint64_t stripe = std::min(config_.stripeBytes, config_.maxMessageBytes);
  std::vector<verbs::WorkRequestPlan> plans;
  verbs::planWrite(local->addr, local->bytes, local->lkey, srcOffset, dst, dstOffset, bytes, stripe, signal, cookie,
                   plans);
  Peer& p = peerRef(peer);
  std::lock_guard lock(p.mutex);
  checkAlive(p, peer);
  // Destination stripe i of region r always goes on QP (r + i) % qps: writes to the same bytes share a QP and
  // land in issue order; large writes still spread over all QPs.
  for (const auto& plan : plans) {
    const uint64_t stripeIndex = (plan.remoteAddr - dst.addr) / stripe;
    Qp& q = *p.qps[(dst.regionId + stripeIndex) % p.qps.size()];
    q.pending.push_back(plan);
    q.enqueued += 1;
  }
  if (!signal) return;
  if (p.deferred.empty()) {
    p.completions.push_back(PendingCompletion{cookie, coverAllLocked(p)});
  } else {
    // Flags issued earlier are held back; this completion must cover them, so it waits behind them.
    Deferred d;
    d.isFlag = false;
    d.signal = true;
    d.cookie = cookie;
    p.deferred.push_back(std::move(d));
  }
}

std::vector<uint64_t> VerbsTransport::coverAllLocked(Peer& p) {
  std::vector<uint64_t> required(p.qps.size(), 0);
  for (std::size_t i = 0; i < p.qps.size(); ++i) {
    Qp& q = *p.qps[i];
    if (q.enqueued == q.tracker.retired()) continue;
    const bool lastSignalled =
        q.pending.empty() ? !q.tracker.hasUnsignaledTail()
                          : (q.pending.back().userSignal || q.pending.back().kind == verbs::WrKind::kMarker);
    if (!lastSignalled) {
      verbs::WorkRequestPlan marker;
      marker.kind = verbs::WrKind::kMarker;
      q.pending.push_back(marker);
      q.enqueued += 1;
    }
    required[i] = q.enqueued;
  }
  return required;
}

std::vector<uint64_t> VerbsTransport::markOtherQpsLocked(Peer& p) {
  // QP 0 carries flags and messages, so RC order covers QP 0's writes. Other QPs get a signalled marker after their
  // last queued WR; what goes on QP 0 waits until each has retired everything up to and including that marker.
  std::vector<uint64_t> required(p.qps.size(), 0);
  for (std::size_t i = 1; i < p.qps.size(); ++i) {
    Qp& q = *p.qps[i];
    if (q.enqueued == q.tracker.retired()) continue;  // nothing outstanding there
    verbs::WorkRequestPlan marker;
    marker.kind = verbs::WrKind::kMarker;
    q.pending.push_back(marker);
    q.enqueued += 1;
    required[i] = q.enqueued;
  }
  return required;
}

void VerbsTransport::collectCompletions(Peer& p, NodeIndex peer, std::vector<Completion>& out) {
  while (!p.completions.empty()) {
    const PendingCompletion& c = p.completions.front();
    for (std::size_t i = 0; i < p.qps.size(); ++i) {
      if (p.qps[i]->tracker.retired() < c.required[i]) return;
    }
    out.push_back(Completion{c.cookie, peer, ErrorCode::kOk});
    p.completions.pop_front();
  }
}

void VerbsTransport::writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value,
                               uint64_t cookie, bool signal) {
  if (dst.transport != TransportKind::kVerbs || dst.owner != peer)
    fail(ErrorCode::kInvalidArgument, "verbs transport: key of node {} ({}) used for a flag to node {}", dst.owner,
         transportKindName(dst.transport), peer);
  const verbs::WorkRequestPlan plan = verbs::planFlag(dst, dstOffset, value, signal, cookie);
  Peer& p = peerRef(peer);
  std::lock_guard lock(p.mutex);
  checkAlive(p, peer);
  Deferred f;
  f.plans.push_back(plan);
  f.required = markOtherQpsLocked(p);
  f.signal = signal;
  f.cookie = cookie;
  p.deferred.push_back(std::move(f));
}

void VerbsTransport::postPending(Peer& p, NodeIndex peer, std::vector<Completion>& failedOut) {
  if (p.status.state != PeerState::kConnected) return;
  // Release deferred entries, in order: flags whose other-QP requirements are met go to QP 0; a signalled
  // completion waiting behind them gets its requirements now.
  while (!p.deferred.empty()) {
    const Deferred& f = p.deferred.front();
    if (f.isFlag) {
      bool ready = true;
      for (std::size_t i = 1; i < p.qps.size(); ++i) ready = ready && p.qps[i]->tracker.retired() >= f.required[i];
      if (!ready) break;
      for (const auto& plan : f.plans) {
        p.qps[0]->pending.push_back(plan);
        p.qps[0]->enqueued += 1;
      }
      if (f.isMessage) {
        for (OutMessage& m : p.outMessages) {
          if (m.releaseAt == 0) {
            m.releaseAt = p.qps[0]->enqueued;
            break;
          }
        }
      }
    }
    if (f.signal) p.completions.push_back(PendingCompletion{f.cookie, coverAllLocked(p)});
    p.deferred.pop_front();
  }
  std::vector<verbs::PlannedWr> batch;
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  for (auto& qptr : p.qps) {
    Qp& q = *qptr;
    while (!q.pending.empty() && q.tracker.room() > 0) {
      const std::size_t n = verbs::takeBatch(q.pending, q.tracker, config_.maxWrPerPost, batch);
      wrs.assign(n, ibv_send_wr{});
      sges.assign(n, ibv_sge{});
      for (std::size_t i = 0; i < n; ++i) {
        verbs::encodeWorkRequest(batch[i].plan, wrTag(p) | batch[i].seq, batch[i].signaled, wrs[i], sges[i]);
        if (i > 0) wrs[i - 1].next = &wrs[i];
      }
      ibv_send_wr* bad = nullptr;
      if (const int rc = ibv_post_send(q.qp.get(), wrs.data(), &bad); rc != 0) {
        failPeerLocked(p, peer,
                       fmt::format("ibv_post_send on QP {:#x} -> {} (the QP is in an error state)", q.local.qpn,
                                   std::strerror(rc)),
                       failedOut);
        return;
      }
    }
  }
  // A message's buffer goes once QP 0 has retired its last fragment (that fragment is signalled).
  while (!p.outMessages.empty() && p.outMessages.front().releaseAt != 0 &&
         p.qps[0]->tracker.retired() >= p.outMessages.front().releaseAt)
    p.outMessages.pop_front();
}

void VerbsTransport::submit() {
  std::vector<Completion> failed;
  for (NodeIndex i = 0; i < peers_.size(); ++i) {
    if (i == config_.self) continue;
    Peer& p = *peers_[i];
    std::lock_guard lock(p.mutex);
    postPending(p, i, failed);
  }
  addExtraCompletions(failed);
}

void VerbsTransport::addExtraCompletions(std::vector<Completion>& failed) {
  if (failed.empty()) return;
  std::lock_guard lock(completionsMutex_);
  extraCompletions_.insert(extraCompletions_.end(), failed.begin(), failed.end());
  failed.clear();
}

void VerbsTransport::failPeerLocked(Peer& p, NodeIndex peer, std::string reason, std::vector<Completion>& failedOut,
                                    PeerState state) {
  if (p.status.state == PeerState::kFailed || p.status.state == PeerState::kClosed) return;
  p.status = PeerStatus{state, std::move(reason)};
  p.setup = Setup::kNone;
  spdlog::error("verbs transport: node {} lost: {}", peer, p.status.reason);
  // Every signalled op that has not completed fails: tracked ones (their CQEs come back flushed and are
  // dropped in poll) and ones still held back.
  for (const auto& c : p.completions) failedOut.push_back(Completion{c.cookie, peer, ErrorCode::kPeerLost});
  p.completions.clear();
  for (const auto& f : p.deferred) {
    if (f.signal) failedOut.push_back(Completion{f.cookie, peer, ErrorCode::kPeerLost});
  }
  p.deferred.clear();
  for (auto& q : p.qps) q->pending.clear();
  // The handler runs on the control thread: a caller of write or sendMessage may hold locks the handler takes.
  postEvent(Event{Event::Kind::kLocalFailure, peer, {}, p.status, p.round});
}

std::size_t VerbsTransport::poll(std::span<Completion> out) {
  std::size_t n = 0;
  {
    std::lock_guard lock(completionsMutex_);
    while (n < out.size() && !extraCompletions_.empty()) {
      out[n++] = extraCompletions_.front();
      extraCompletions_.pop_front();
    }
  }
  std::array<ibv_wc, 32> wcs;
  std::vector<Completion> ready;  // successes and failures, in CQ order
  // Into `out` while it has room, the rest kept for the next poll.
  const auto deliver = [&] {
    for (const Completion& c : ready) {
      if (n < out.size()) {
        out[n++] = c;
      } else {
        std::lock_guard lock(completionsMutex_);
        extraCompletions_.push_back(c);
      }
    }
    ready.clear();
  };
  while (n < out.size()) {
    const int got = ibv_poll_cq(cq_.get(), static_cast<int>(wcs.size()), wcs.data());
    if (got < 0) fail(ErrorCode::kRdma, "verbs transport: ibv_poll_cq on {} failed ({})", deviceName_, got);
    if (got == 0) break;
    for (int i = 0; i < got; ++i) {
      const ibv_wc& wc = wcs[static_cast<std::size_t>(i)];
      std::pair<NodeIndex, uint32_t> owner;
      {
        std::lock_guard lock(qpMapMutex_);
        auto it = qpOwner_.find(wc.qp_num);
        if (it == qpOwner_.end()) continue;  // a QP destroyed since; nothing to report
        owner = it->second;
      }
      Peer& p = *peers_[owner.first];
      std::lock_guard lock(p.mutex);
      // A completion of an earlier round's QP (destroyed since; its number may be reused) is not ours.
      if ((wc.wr_id & ~((uint64_t{1} << 40) - 1)) != wrTag(p) || owner.second >= p.qps.size()) continue;
      Qp& q = *p.qps[owner.second];
      if (wc.status != IBV_WC_SUCCESS) {
        // The first error moves the QP to the error state; the rest come back IBV_WC_WR_FLUSH_ERR and are
        // ignored because the peer is already failed.
        failPeerLocked(p, owner.first,
                       fmt::format("work request {} on QP {:#x} failed: {} (vendor error {:#x}); check the link "
                                   "(ibv_devinfo) and node {}'s daemon",
                                   wc.wr_id & ((uint64_t{1} << 40) - 1), q.local.qpn,
                                   ibv_wc_status_str(wc.status), wc.vendor_err, owner.first),
                       ready);
        continue;
      }
      q.tracker.complete(wc.wr_id & ((uint64_t{1} << 40) - 1));
      collectCompletions(p, owner.first, ready);
    }
    deliver();
  }
  // Completions freed send-queue room and may have released deferred entries; those may complete at once.
  for (NodeIndex i = 0; i < peers_.size(); ++i) {
    if (i == config_.self) continue;
    Peer& p = *peers_[i];
    std::lock_guard lock(p.mutex);
    postPending(p, i, ready);
    collectCompletions(p, i, ready);
  }
  deliver();
  return n;
}

PeerStatus VerbsTransport::peerStatus(NodeIndex peer) const {
  Peer& p = peerRef(peer);
  std::lock_guard lock(p.mutex);
  return p.status;
}

void VerbsTransport::setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) {
  std::lock_guard lock(handlerMutex_);
  failureHandler_ = std::move(handler);
}

void VerbsTransport::flush(LocalRegion region, std::chrono::milliseconds timeout) {
  const auto target = regionView(region);
  if (!target) fail(ErrorCode::kNotFound, "verbs transport: flush of unknown region {}", region.id);
  std::lock_guard lock(flushMutex_);
  if (!flushQp_) {
    // A loopback RC QP connected to itself: the READ it issues travels NIC -> PCIe -> GPU memory and back.
    verbs::IbvQp qp = createQp(flushCq_.get(), flushCq_.get(), 4, 1);
    const verbs::QpInfo self = describeQp(qp.get());
    auto rtr = verbs::buildRtrAttr(config_.path, self, self);
    checkVerbs(ibv_modify_qp(qp.get(), &rtr.attr, rtr.mask), "connect the flush QP to itself (RTR)", "ibv_modify_qp");
    auto rts = verbs::buildRtsAttr(config_.path, self.psn);
    checkVerbs(ibv_modify_qp(qp.get(), &rts.attr, rts.mask), "start the flush QP (RTS)", "ibv_modify_qp");
    flushQp_ = std::move(qp);
  }
  verbs::WorkRequestPlan plan;
  plan.kind = verbs::WrKind::kFlushRead;
  plan.localAddr = reinterpret_cast<uint64_t>(&flushLanding_);
  plan.lkey = flushLandingMr_->lkey;
  plan.length = static_cast<uint32_t>(std::min<uint64_t>(target->bytes, sizeof flushLanding_));
  plan.remoteAddr = target->addr;
  plan.rkey = target->rkey;
  ibv_send_wr wr{};
  ibv_sge sge{};
  verbs::encodeWorkRequest(plan, 0, true, wr, sge);
  ibv_send_wr* bad = nullptr;
  checkVerbs(ibv_post_send(flushQp_.get(), &wr, &bad), "post the GPUDirect flush READ", "ibv_post_send");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ibv_wc wc{};
  for (;;) {
    const int got = ibv_poll_cq(flushCq_.get(), 1, &wc);
    if (got < 0) fail(ErrorCode::kRdma, "verbs transport: ibv_poll_cq on the flush CQ failed ({})", got);
    if (got == 1) break;
    if (std::chrono::steady_clock::now() > deadline)
      fail(ErrorCode::kTimeout, "verbs transport: GPUDirect flush of region {} on {} did not complete within {} ms",
           region.id, deviceName_, timeout.count());
    std::this_thread::yield();
  }
  if (wc.status != IBV_WC_SUCCESS)
    fail(ErrorCode::kRdma, "verbs transport: GPUDirect flush of region {} failed: {} (vendor error {:#x})", region.id,
         ibv_wc_status_str(wc.status), wc.vendor_err);
}

void VerbsTransport::sendMessage(NodeIndex peer, std::span<const std::byte> payload) {
  if (payload.size() > kMaxMessageBytes)
    fail(ErrorCode::kInvalidArgument, "verbs transport: a control message of {} bytes exceeds {}", payload.size(),
         kMaxMessageBytes);
  Peer& p = peerRef(peer);
  OutMessage m;
  std::vector<uint32_t> lengths;
  m.bytes = verbs::fragmentMessage(payload, config_.recvSlotBytes, lengths);
  m.mr.reset(ibv_reg_mr(pd_.get(), m.bytes.data(), m.bytes.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!m.mr)
    checkVerbs(-1, fmt::format("register a {}-byte control message on {}", m.bytes.size(), deviceName_), "ibv_reg_mr");
  std::vector<Completion> failed;
  {
    std::lock_guard lock(p.mutex);
    checkAlive(p, peer);
    Deferred d;
    d.isMessage = true;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      verbs::WorkRequestPlan plan;
      plan.kind = verbs::WrKind::kSend;
      plan.localAddr = reinterpret_cast<uint64_t>(m.bytes.data()) + i * config_.recvSlotBytes;
      plan.lkey = m.mr->lkey;
      plan.length = lengths[i];
      plan.userSignal = i + 1 == lengths.size();  // signalled, so the buffer is known free once it completes
      d.plans.push_back(plan);
    }
    d.required = markOtherQpsLocked(p);  // as a flag: on QP 0, after the other QPs' earlier WRs
    p.outMessages.push_back(std::move(m));
    p.deferred.push_back(std::move(d));
    postPending(p, peer, failed);  // starts at once: no submit() needed
  }
  addExtraCompletions(failed);
}

bool VerbsTransport::pollRecv() {
  std::array<ibv_wc, 16> wcs;
  const int got = ibv_poll_cq(recvCq_.get(), static_cast<int>(wcs.size()), wcs.data());
  if (got < 0)
    fail(ErrorCode::kRdma, "verbs transport: ibv_poll_cq on the receive CQ of {} failed ({})", deviceName_, got);
  for (int i = 0; i < got; ++i) {
    const ibv_wc& wc = wcs[static_cast<std::size_t>(i)];
    std::pair<NodeIndex, uint32_t> owner;
    {
      std::lock_guard lock(qpMapMutex_);
      auto it = qpOwner_.find(wc.qp_num);
      if (it == qpOwner_.end()) continue;  // a QP of an earlier round
      owner = it->second;
    }
    const NodeIndex peer = owner.first;
    Peer& p = *peers_[peer];
    std::optional<std::vector<std::byte>> message;
    std::vector<Completion> failed;
    {
      std::lock_guard lock(p.mutex);
      if ((wc.wr_id & ~uint64_t{0xffffffff}) != wrTag(p) || p.qps.empty() || owner.second != 0 || !p.recv) continue;
      if (wc.status != IBV_WC_SUCCESS) {
        if (wc.status != IBV_WC_WR_FLUSH_ERR) {
          failPeerLocked(p, peer, fmt::format("a control-message receive on QP {:#x} failed: {} (vendor error {:#x})",
                                              p.qps[0]->local.qpn, ibv_wc_status_str(wc.status), wc.vendor_err),
                         failed);
        }
      } else {
        const auto slot = static_cast<uint32_t>(wc.wr_id & 0xffffffff);
        const std::span<const std::byte> fragment(p.recv->bytes.data() + uint64_t{slot} * config_.recvSlotBytes,
                                                  std::min<uint32_t>(wc.byte_len, config_.recvSlotBytes));
        try {
          if (verbs::appendFragment(fragment, p.assembling, kMaxMessageBytes)) {
            message = std::move(p.assembling);
            p.assembling.clear();
          }
          postRecvLocked(p, slot);
        } catch (const Error& e) {
          failPeerLocked(p, peer, fmt::format("control message from node {}: {}", peer, e.what()), failed);
        }
      }
    }
    addExtraCompletions(failed);
    if (message) {
      MessageHandler handler;
      {
        std::lock_guard lock(channelMutex_);
        handler = messageHandler_;
      }
      if (!handler) {
        spdlog::warn("verbs transport: a control message from node {} dropped: no message handler", peer);
        continue;
      }
      try {
        handler(peer, *message);
      } catch (const std::exception& e) {
        spdlog::error("verbs transport: the handler of a control message from node {} failed: {}", peer, e.what());
      }
    }
  }
  return got > 0;
}

}  // namespace tandem::daemon::transport
