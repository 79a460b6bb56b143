// The verbs transport's connection set-up (verbs_transport.hpp, "Bootstrap"): QPs created, moved INIT -> RTR -> RTS
// by hand (localQpInfo/connectPeer) or in the bootstrap's three-way rounds over a TcpTransport, and the verbs control
// thread that runs the rounds and the peers' failure and rejoin handlers. The data path is in verbs_transport.cpp.
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>

#include "transport/tcp_transport.hpp"
#include "transport/verbs_transport.hpp"

namespace tandem::daemon::transport {

using verbs::checkVerbs;

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
  const auto markUp = [&] {  // this round's QPs carry traffic: a new incarnation of the peer. p.mutex held.
    p.setup = Setup::kUp;
    p.status = PeerStatus{PeerState::kConnected, {}};
    p.generation.fetch_add(1);
    connected = true;
  };
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
        markUp();
        break;
      }
      case kReady:
        if (round != p.round || p.setup != Setup::kAnswered) break;
        markUp();
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
