#include "transport/verbs_transport.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "transport/tcp_transport.hpp"

namespace tandem::daemon::transport {

namespace verbs {

void DeviceListDeleter::operator()(ibv_device** list) const noexcept { ibv_free_device_list(list); }
void ContextDeleter::operator()(ibv_context* ctx) const noexcept {
  if (int rc = ibv_close_device(ctx); rc != 0) spdlog::error("verbs: ibv_close_device -> {}", std::strerror(rc));
}
void PdDeleter::operator()(ibv_pd* pd) const noexcept {
  if (int rc = ibv_dealloc_pd(pd); rc != 0)
    spdlog::error("verbs: ibv_dealloc_pd -> {} (an MR or QP still uses it)", std::strerror(rc));
}
void MrDeleter::operator()(ibv_mr* mr) const noexcept {
  if (int rc = ibv_dereg_mr(mr); rc != 0) spdlog::error("verbs: ibv_dereg_mr -> {}", std::strerror(rc));
}
void CqDeleter::operator()(ibv_cq* cq) const noexcept {
  if (int rc = ibv_destroy_cq(cq); rc != 0)
    spdlog::error("verbs: ibv_destroy_cq -> {} (a QP still uses it)", std::strerror(rc));
}
void QpDeleter::operator()(ibv_qp* qp) const noexcept {
  if (int rc = ibv_destroy_qp(qp); rc != 0) spdlog::error("verbs: ibv_destroy_qp -> {}", std::strerror(rc));
}

void checkVerbs(int rc, std::string_view what, std::string_view call) {
  if (rc == 0) return;
  // Most verbs calls return an errno value; a few return -1 and set errno.
  const int err = rc < 0 ? errno : rc;
  fail(err == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kRdma, "{}: {} [{} -> errno {}]", what,
       std::strerror(err), call, err);
}

DeviceList getDeviceList() {
  DeviceList d;
  errno = 0;
  int n = 0;
  d.list.reset(ibv_get_device_list(&n));
  d.savedErrno = errno;
  d.count = d.list ? n : 0;
  return d;
}

namespace {
std::string realPath(const std::string& path) {
  std::array<char, PATH_MAX> buf{};
  if (::realpath(path.c_str(), buf.data()) == nullptr) return {};
  return std::string(buf.data());
}
int readNumaNode(const std::string& devicePath) {
  std::ifstream in(devicePath + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
}
}  // namespace

std::vector<NicDesc> discoverNics() {
  std::vector<NicDesc> nics;
  DeviceList devices = getDeviceList();
  for (int i = 0; i < devices.count; ++i) {
    ibv_device* dev = devices.list.get()[i];
    NicDesc nic;
    nic.pci.name = ibv_get_device_name(dev);
    const std::string sysfs = "/sys/class/infiniband/" + nic.pci.name + "/device";
    nic.pci.pciPath = realPath(sysfs);
    nic.pci.numaNode = readNumaNode(sysfs);
    nic.active = false;
    IbvContext ctx(ibv_open_device(dev));
    if (ctx) {
      ibv_port_attr attr{};
      nic.active = ibv_query_port(ctx.get(), nic.port, &attr) == 0 && attr.state == IBV_PORT_ACTIVE;
    }
    nics.push_back(std::move(nic));
  }
  return nics;
}

}  // namespace verbs

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

verbs::IbvQp VerbsTransport::createQp(ibv_cq* sendCq, ibv_cq* recvCq, uint32_t sendDepth, uint32_t recvDepth) {
  ibv_qp_init_attr init{};
  init.send_cq = sendCq;
  init.recv_cq = recvCq;
  init.cap.max_send_wr = sendDepth;
  // QP 0 receives control messages; the others none, but some providers reject 0.
  init.cap.max_recv_wr = std::max<uint32_t>(recvDepth, 1);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = config_.maxInlineBytes;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signalling: only WRs with IBV_SEND_SIGNALED complete visibly
  verbs::IbvQp qp(ibv_create_qp(pd_.get(), &init));
  if (!qp) checkVerbs(-1, fmt::format("create an RC QP ({} send WRs) on {}", sendDepth, deviceName_), "ibv_create_qp");
  if (init.cap.max_inline_data < sizeof(uint64_t))
    fail(ErrorCode::kRdma, "verbs transport: {} gives QPs {} bytes of inline data; flags need 8", deviceName_,
         init.cap.max_inline_data);
  const auto t = verbs::buildInitAttr(config_.path, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                                        IBV_ACCESS_REMOTE_READ);
  auto attr = t.attr;
  checkVerbs(ibv_modify_qp(qp.get(), &attr, t.mask), "move QP to INIT", "ibv_modify_qp");
  return qp;
}

verbs::QpInfo VerbsTransport::describeQp(const ibv_qp* qp) const {
  verbs::QpInfo info;
  info.lid = portAttr_.lid;
  info.port = config_.path.port;
  info.mtu = config_.path.activeMtu;
  info.linkLayer = portAttr_.link_layer;
  info.qpn = qp->qp_num;
  info.psn = verbs::randomPsn();
  std::copy(std::begin(gid_.raw), std::end(gid_.raw), info.gid.begin());
  return info;
}

VerbsTransport::Peer& VerbsTransport::peerRef(NodeIndex peer) const {
  if (peer >= peers_.size() || peer == config_.self)
    fail(ErrorCode::kInvalidArgument, "verbs transport: node {} is not a peer of node {} ({} nodes)", peer,
         config_.self, config_.nodeCount);
  return *peers_[peer];
}

void VerbsTransport::createQpsLocked(Peer& p, NodeIndex peer) {
  teardownQpsLocked(p);
  auto pool = std::make_unique<RecvPool>();
  pool->bytes.resize(std::size_t{config_.recvSlots} * config_.recvSlotBytes);
  pool->mr.reset(ibv_reg_mr(pd_.get(), pool->bytes.data(), pool->bytes.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!pool->mr)
    checkVerbs(-1, fmt::format("register {} receive buffers for node {} on {}; set LimitMEMLOCK=infinity in the unit",
                               config_.recvSlots, peer, deviceName_), "ibv_reg_mr");
  p.recv = std::move(pool);
  for (uint32_t i = 0; i < config_.qpsPerPeer; ++i) {
    auto q = std::make_unique<Qp>(Qp{createQp(cq_.get(), recvCq_.get(), config_.sendQueueDepth,
                                              i == 0 ? config_.recvSlots : 1),
                                     {}, verbs::SendQueueTracker(config_.sendQueueDepth, config_.signalEvery), {}, 0});
    q->local = describeQp(q->qp.get());
    {
      std::lock_guard mapLock(qpMapMutex_);
      qpOwner_[q->qp->qp_num] = {peer, i};
    }
    p.qps.push_back(std::move(q));
  }
  // Receives go up in INIT, before the peer can send anything (a SEND that finds none waits on RNR NAKs).
  for (uint32_t slot = 0; slot < config_.recvSlots; ++slot) postRecvLocked(p, slot);
}

void VerbsTransport::teardownQpsLocked(Peer& p) {
  {
    std::lock_guard mapLock(qpMapMutex_);
    for (const auto& q : p.qps) qpOwner_.erase(q->qp->qp_num);
  }
  p.qps.clear();  // destroys the QPs first: their work requests name the buffers below
  p.outMessages.clear();
  p.recv.reset();
  p.deferred.clear();
  p.completions.clear();
  p.assembling.clear();
  p.setup = Setup::kNone;
}

void VerbsTransport::postRecvLocked(Peer& p, uint32_t slot) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(p.recv->bytes.data()) + uint64_t{slot} * config_.recvSlotBytes;
  sge.length = config_.recvSlotBytes;
  sge.lkey = p.recv->mr->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = wrTag(p) | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  checkVerbs(ibv_post_recv(p.qps[0]->qp.get(), &wr, &bad), "post a control-message receive", "ibv_post_recv");
}

void VerbsTransport::connectQpsLocked(Peer& p, NodeIndex peer, std::span<const verbs::QpInfo> remote) {
  if (p.qps.empty())
    fail(ErrorCode::kInvalidArgument, "verbs transport: connectPeer({}) before localQpInfo({})", peer, peer);
  if (remote.size() != p.qps.size())
    fail(ErrorCode::kInvalidConfig, "verbs transport: node {} sent {} QPs, this node has {}; set "
         "cluster.connections_per_peer identically on every node", peer, remote.size(), p.qps.size());
  for (std::size_t i = 0; i < remote.size(); ++i) {
    Qp& q = *p.qps[i];
    auto rtr = verbs::buildRtrAttr(config_.path, q.local, remote[i]);
    checkVerbs(ibv_modify_qp(q.qp.get(), &rtr.attr, rtr.mask),
               fmt::format("connect QP {:#x} to node {} QP {:#x} (RTR)", q.local.qpn, peer, remote[i].qpn),
               "ibv_modify_qp");
    auto rts = verbs::buildRtsAttr(config_.path, q.local.psn);
    checkVerbs(ibv_modify_qp(q.qp.get(), &rts.attr, rts.mask),
               fmt::format("start QP {:#x} to node {} (RTS)", q.local.qpn, peer), "ibv_modify_qp");
  }
}

std::vector<verbs::QpInfo> VerbsTransport::localQpInfo(NodeIndex peer, LocalRegion control) {
  RemoteKey controlKey;
  if (control) controlKey = remoteKey(control);
  Peer& p = peerRef(peer);
  std::lock_guard lock(p.mutex);
  if (p.qps.empty()) createQpsLocked(p, peer);
  std::vector<verbs::QpInfo> infos;
  for (const auto& q : p.qps) {
    verbs::QpInfo info = q->local;
    info.rkey = controlKey.rkey;
    info.addr = controlKey.addr;
    infos.push_back(info);
  }
  return infos;
}

void VerbsTransport::connectPeer(NodeIndex peer, std::span<const verbs::QpInfo> remote) {
  Peer& p = peerRef(peer);
  {
    std::lock_guard lock(p.mutex);
    connectQpsLocked(p, peer, remote);
    p.status = PeerStatus{PeerState::kConnected, {}};
    p.setup = Setup::kUp;
    p.generation.fetch_add(1);
  }
  { std::lock_guard lock(channelMutex_); }  // a connect() waiter between its check and its wait gets the notify
  connectCv_.notify_all();
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

RemoteKey VerbsTransport::remoteKey(LocalRegion region) const {
  std::lock_guard lock(regionsMutex_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) fail(ErrorCode::kNotFound, "verbs transport: unknown local region {}", region.id);
  return RemoteKey{TransportKind::kVerbs, config_.self, region.id, it->second.mr->rkey,
                   reinterpret_cast<uint64_t>(it->second.desc.addr), it->second.desc.bytes};
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
  uint64_t localBase = 0, localBytes = 0;
  uint32_t lkey = 0;
  {
    std::lock_guard lock(regionsMutex_);
    auto it = regions_.find(src.id);
    if (it == regions_.end()) fail(ErrorCode::kInvalidArgument, "verbs transport: unknown local region {}", src.id);
    localBase = reinterpret_cast<uint64_t>(it->second.desc.addr);
    localBytes = it->second.desc.bytes;
    lkey = it->second.mr->lkey;
  }
  const uint64_t stripe = std::min(config_.stripeBytes, config_.maxMessageBytes);
  std::vector<verbs::WorkRequestPlan> plans;
  verbs::planWrite(localBase, localBytes, lkey, srcOffset, dst, dstOffset, bytes, stripe, signal, cookie, plans);
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
  f.required.assign(p.qps.size(), 0);
  f.signal = signal;
  f.cookie = cookie;
  // QP 0 carries every flag, so RC order covers QP 0's writes. Other QPs get a signalled marker after their
  // last queued WR; the flag waits until each has retired everything up to and including that marker.
  for (std::size_t i = 1; i < p.qps.size(); ++i) {
    Qp& q = *p.qps[i];
    if (q.enqueued == q.tracker.retired()) continue;  // nothing outstanding there
    verbs::WorkRequestPlan marker;
    marker.kind = verbs::WrKind::kMarker;
    q.pending.push_back(marker);
    q.enqueued += 1;
    f.required[i] = q.enqueued;
  }
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
    for (const Completion& c : ready) {
      if (n < out.size()) {
        out[n++] = c;
      } else {
        std::lock_guard lock(completionsMutex_);
        extraCompletions_.push_back(c);
      }
    }
    ready.clear();
  }
  // Completions freed send-queue room and may have released deferred entries; those may complete at once.
  for (NodeIndex i = 0; i < peers_.size(); ++i) {
    if (i == config_.self) continue;
    Peer& p = *peers_[i];
    std::lock_guard lock(p.mutex);
    postPending(p, i, ready);
    collectCompletions(p, i, ready);
  }
  for (const Completion& c : ready) {
    if (n < out.size()) {
      out[n++] = c;
    } else {
      std::lock_guard lock(completionsMutex_);
      extraCompletions_.push_back(c);
    }
  }
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
  uint64_t addr = 0, bytes = 0;
  uint32_t rkey = 0;
  {
    std::lock_guard lock(regionsMutex_);
    auto it = regions_.find(region.id);
    if (it == regions_.end()) fail(ErrorCode::kNotFound, "verbs transport: flush of unknown region {}", region.id);
    addr = reinterpret_cast<uint64_t>(it->second.desc.addr);
    bytes = it->second.desc.bytes;
    rkey = it->second.mr->rkey;
  }
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
  plan.length = static_cast<uint32_t>(std::min<uint64_t>(bytes, sizeof flushLanding_));
  plan.remoteAddr = addr;
  plan.rkey = rkey;
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

// ---- control channel ---------------------------------------------------------------------------------

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
    // As a flag: on QP 0, after markers on the other QPs have retired what was queued there before it.
    d.required.assign(p.qps.size(), 0);
    for (std::size_t i = 1; i < p.qps.size(); ++i) {
      Qp& q = *p.qps[i];
      if (q.enqueued == q.tracker.retired()) continue;
      verbs::WorkRequestPlan marker;
      marker.kind = verbs::WrKind::kMarker;
      q.pending.push_back(marker);
      q.enqueued += 1;
      d.required[i] = q.enqueued;
    }
    p.outMessages.push_back(std::move(m));
    p.deferred.push_back(std::move(d));
    postPending(p, peer, failed);  // starts at once: no submit() needed
  }
  addExtraCompletions(failed);
}

uint16_t VerbsTransport::bootstrapPort() const { return bootstrap_ ? bootstrap_->listenPort() : 0; }

void VerbsTransport::setMessageHandler(MessageHandler handler) {
  std::lock_guard lock(channelMutex_);
  messageHandler_ = std::move(handler);
}

void VerbsTransport::setPeerRejoinHandler(std::function<void(NodeIndex)> handler) {
  std::lock_guard lock(channelMutex_);
  rejoinHandler_ = std::move(handler);
}

uint64_t VerbsTransport::peerGeneration(NodeIndex peer) const {
  if (peer == config_.self || peer >= peers_.size()) return 0;
  return peers_[peer]->generation.load();
}

void VerbsTransport::connect(const std::vector<NodeAddress>& nodes) {
  if (!bootstrap_)
    fail(ErrorCode::kUnavailable, "verbs transport: connect() needs a bootstrap (VerbsConfig::bootstrap); without "
         "one, connect peers with localQpInfo and connectPeer");
  if (nodes.size() != config_.nodeCount)
    fail(ErrorCode::kInvalidArgument, "verbs transport: {} node addresses for {} nodes", nodes.size(),
         config_.nodeCount);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.bootstrap.connectTimeoutMs);
  std::optional<Error> bootstrapError;
  try {
    bootstrap_->connect(nodes);
  } catch (const Error& e) {
    bootstrapError = e;  // peers it reached still get their QPs; those it did not join later, as rejoins
  }
  std::vector<NodeIndex> reached;
  for (NodeIndex n = 0; n < config_.nodeCount; ++n) {
    if (n == config_.self || bootstrap_->peerStatus(n).state != PeerState::kConnected) continue;
    reached.push_back(n);
    if (leads(n)) postEvent(Event{Event::Kind::kStartRound, n, {}, {}, 0});
  }
  std::unique_lock lock(channelMutex_);
  connectCv_.wait_until(lock, deadline, [&] {
    return std::all_of(reached.begin(), reached.end(),
                       [&](NodeIndex n) { return peerStatus(n).state == PeerState::kConnected; });
  });
  connectReturned_ = true;
  lock.unlock();
  if (bootstrapError) throw *bootstrapError;
  std::string missing;
  for (NodeIndex n : reached) {
    if (peerStatus(n).state != PeerState::kConnected)
      missing += fmt::format("{}node {}", missing.empty() ? "" : ", ", n);
  }
  if (!missing.empty())
    fail(ErrorCode::kTimeout, "verbs transport: the queue pairs to {} did not come up within {} ms (cluster."
         "connect_timeout_ms); they join when they do. Check those daemons' logs", missing,
         config_.bootstrap.connectTimeoutMs);
}

void VerbsTransport::postEvent(Event e) {
  if (stopping_.load()) return;
  {
    std::lock_guard lock(eventMutex_);
    events_.push_back(std::move(e));
  }
  eventCv_.notify_one();
}

void VerbsTransport::controlLoop() {
  pthread_setname_np(pthread_self(), "verbs control");
  auto idleWait = std::chrono::microseconds(20);
  while (!stopping_.load()) {
    std::deque<Event> batch;
    {
      std::lock_guard lock(eventMutex_);
      batch.swap(events_);
    }
    for (Event& e : batch) {
      try {
        handleEvent(e);
      } catch (const std::exception& ex) {
        spdlog::error("verbs transport: handling a bootstrap event for node {} failed: {}", e.peer, ex.what());
      }
    }
    bool received = false;
    try {
      received = pollRecv();
    } catch (const std::exception& ex) {
      spdlog::error("verbs transport: {}", ex.what());
    }
    if (!batch.empty() || received) {
      idleWait = std::chrono::microseconds(20);
      continue;
    }
    // Receive completions have no event here (no completion channel), so the wait for one backs off to 1 ms.
    std::unique_lock lock(eventMutex_);
    eventCv_.wait_for(lock, idleWait, [this] { return stopping_.load() || !events_.empty(); });
    idleWait = std::min<std::chrono::microseconds>(idleWait * 2, std::chrono::milliseconds(1));
  }
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

namespace {
// The bootstrap's messages: u32 magic "TVB1" | u8 type | u64 round | body.
constexpr uint32_t kBootstrapMagic = 0x31425654;
enum BootstrapType : uint8_t { kOffer = 1, kAnswer = 2, kReady = 3, kDown = 4 };
}  // namespace

void VerbsTransport::sendBootstrap(NodeIndex peer, uint8_t type, uint64_t round, std::span<const std::byte> body) {
  std::vector<std::byte> out;
  detail::WireWriter w(out);
  w.put<uint32_t>(kBootstrapMagic);
  w.put<uint8_t>(type);
  w.put<uint64_t>(round);
  w.putBytes(body);
  try {
    bootstrap_->sendMessage(peer, out);
  } catch (const Error& e) {
    // The bootstrap lost the peer: its failure event follows, and the next round starts when it is back.
    spdlog::debug("verbs transport: bootstrap message to node {} dropped: {}", peer, e.what());
  }
}

void VerbsTransport::handleEvent(Event& e) {
  using Kind = Event::Kind;
  switch (e.kind) {
    case Kind::kBootstrapMessage: return onBootstrapMessage(e.peer, e.payload);
    case Kind::kStartRound: return startRound(e.peer);
    case Kind::kBootstrapRejoined:
      if (leads(e.peer)) startRound(e.peer);
      return;
    case Kind::kBootstrapFailed: {
      Peer& p = peerRef(e.peer);
      std::vector<Completion> failed;
      {
        std::lock_guard lock(p.mutex);
        failPeerLocked(p, e.peer, e.status.reason, failed,
                       e.status.state == PeerState::kClosed ? PeerState::kClosed : PeerState::kFailed);
        p.setup = Setup::kNone;
      }
      addExtraCompletions(failed);
      return;
    }
    case Kind::kLocalFailure: {
      std::function<void(NodeIndex, const PeerStatus&)> handler;
      {
        std::lock_guard lock(handlerMutex_);
        handler = failureHandler_;
      }
      if (handler) handler(e.peer, e.status);
      if (!bootstrap_ || stopping_.load()) return;
      if (bootstrap_->peerStatus(e.peer).state != PeerState::kConnected) return;  // it rejoins through the bootstrap
      std::vector<std::byte> reason;
      detail::WireWriter w(reason);
      w.putBytes(std::as_bytes(std::span(e.status.reason.data(), std::min<std::size_t>(e.status.reason.size(), 4096))));
      sendBootstrap(e.peer, kDown, e.round, reason);
      if (leads(e.peer)) {
        Peer& p = peerRef(e.peer);
        bool current;
        {
          std::lock_guard lock(p.mutex);
          current = p.round == e.round;  // a newer round already replaced the failed one
        }
        if (current) startRound(e.peer);
      }
      return;
    }
  }
}

void VerbsTransport::startRound(NodeIndex peer) {
  if (!bootstrap_ || stopping_.load() || bootstrap_->peerStatus(peer).state != PeerState::kConnected) return;
  Peer& p = peerRef(peer);
  std::vector<Completion> failed;
  std::vector<verbs::QpInfo> infos;
  const uint64_t round = ++nextRound_;
  {
    std::lock_guard lock(p.mutex);
    if (p.status.state == PeerState::kConnected)
      failPeerLocked(p, peer, "this node set up new queue pairs for it", failed);
    p.round = round;
    createQpsLocked(p, peer);
    p.setup = Setup::kOffered;
    for (const auto& q : p.qps) infos.push_back(q->local);
  }
  addExtraCompletions(failed);
  sendBootstrap(peer, kOffer, round, verbs::encodeQpInfoList(infos));
}

void VerbsTransport::onBootstrapMessage(NodeIndex peer, std::span<const std::byte> bytes) {
  detail::WireReader r(bytes, "verbs bootstrap message");
  if (r.get<uint32_t>() != kBootstrapMagic)
    fail(ErrorCode::kProtocol, "verbs bootstrap message from node {}: bad magic (is it running the tcp transport? "
         "set cluster.transport identically on every node)", peer);
  const auto type = r.get<uint8_t>();
  const auto round = r.get<uint64_t>();
  const auto body = r.getBytes(r.remaining());
  Peer& p = peerRef(peer);
  std::vector<Completion> failed;
  bool connected = false;
  std::vector<verbs::QpInfo> answer;
  {
    std::lock_guard lock(p.mutex);
    switch (type) {
      case kOffer: {
        if (leads(peer)) fail(ErrorCode::kProtocol, "node {} offered queue pairs but this node leads the pair", peer);
        const auto remote = verbs::decodeQpInfoList(body);
        if (p.status.state == PeerState::kConnected)
          failPeerLocked(p, peer, fmt::format("node {} set up new queue pairs (its side of the old ones failed)", peer),
                         failed);
        p.round = round;
        createQpsLocked(p, peer);
        try {
          connectQpsLocked(p, peer, remote);
        } catch (const Error& e) {
          teardownQpsLocked(p);
          failPeerLocked(p, peer, e.what(), failed);
          break;
        }
        p.setup = Setup::kAnswered;
        for (const auto& q : p.qps) answer.push_back(q->local);
        break;
      }
      case kAnswer: {
        if (round != p.round || p.setup != Setup::kOffered) break;  // answers an offer this node replaced
        const auto remote = verbs::decodeQpInfoList(body);
        try {
          connectQpsLocked(p, peer, remote);
        } catch (const Error& e) {
          teardownQpsLocked(p);
          p.status = PeerStatus{PeerState::kFailed, e.what()};
          spdlog::error("verbs transport: node {}: {}", peer, e.what());
          break;
        }
        p.setup = Setup::kUp;
        p.status = PeerStatus{PeerState::kConnected, {}};
        p.generation.fetch_add(1);
        connected = true;
        break;
      }
      case kReady:
        if (round != p.round || p.setup != Setup::kAnswered) break;
        p.setup = Setup::kUp;
        p.status = PeerStatus{PeerState::kConnected, {}};
        p.generation.fetch_add(1);
        connected = true;
        break;
      case kDown: {
        if (round != p.round) break;  // about queue pairs already replaced
        std::string why = fmt::format("node {} lost its queue pairs to this node: {}", peer,
                                      std::string(reinterpret_cast<const char*>(body.data()), body.size()));
        if (p.status.state == PeerState::kConnected) {
          failPeerLocked(p, peer, std::move(why), failed);
        } else {
          p.status.reason = std::move(why);  // a round that never came up: keep why, for peerStatus and the log
          spdlog::error("verbs transport: {}", p.status.reason);
        }
        break;
      }
      default:
        fail(ErrorCode::kProtocol, "verbs bootstrap message from node {}: unknown type {}", peer, type);
    }
  }
  addExtraCompletions(failed);
  if (!answer.empty()) sendBootstrap(peer, kAnswer, round, verbs::encodeQpInfoList(answer));
  if (connected && type == kAnswer) sendBootstrap(peer, kReady, round, {});
  if (connected) peerConnected(peer);
}

void VerbsTransport::peerConnected(NodeIndex peer) {
  spdlog::info("verbs transport: node {} connected on {} (queue pairs of incarnation {})", peer, deviceName_,
               peerGeneration(peer));
  std::function<void(NodeIndex)> rejoin;
  {
    std::lock_guard lock(channelMutex_);
    if (connectReturned_) rejoin = rejoinHandler_;
  }
  connectCv_.notify_all();
  if (rejoin) rejoin(peer);
}

}  // namespace tandem::daemon::transport
