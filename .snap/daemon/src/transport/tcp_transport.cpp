#include "transport/tcp_transport.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <cstring>

#include "transport/tcp_transport_impl.hpp"

namespace tandem::daemon::transport {

// ---------------------------------------------------------------------------------------------------------
// Peer events
// ---------------------------------------------------------------------------------------------------------

std::string TcpTransport::Impl::nodeName(NodeIndex n) const {
  return n < nodes.size() ? fmt::format("{} (node {})", nodes[n].toString(), n) : fmt::format("node {}", n);
}

void TcpTransport::Impl::notifyState() {
  std::lock_guard lock(stateMutex);
  stateCv.notify_all();
}

void TcpTransport::Impl::goodbyeSent(int n) {
  std::lock_guard lock(stateMutex);
  goodbyesPending -= n;
  stateCv.notify_all();
}

void TcpTransport::Impl::pushCompletions(const std::vector<Completion>& done) {
  if (done.empty()) return;
  std::lock_guard lock(completionsMutex);
  completions.insert(completions.end(), done.begin(), done.end());
  anyCompletions.store(true, std::memory_order_release);
}

void TcpTransport::Impl::completeWritten(NodeIndex node) {
  Peer& p = *peers[node];
  std::vector<Completion> done;
  {
    std::lock_guard lock(p.completionMutex);
    p.completions.takeWritten(
        node, [&](std::size_t c) { return p.out[c]->writtenFrames.load(std::memory_order_relaxed); }, done);
  }
  pushCompletions(done);
}

void TcpTransport::Impl::expectCompletion(Peer& p, uint64_t cookie) {
  {
    std::lock_guard lock(p.completionMutex);
    p.completions.expect(cookie, p.sentFrames);
  }
  // The peer may have failed after our frames were queued and after failPeer drained the list (it sets the
  // state before draining under completionMutex, so seeing the state here covers that case).
  const PeerState s = p.life.state();
  if (s == PeerState::kFailed || s == PeerState::kClosed) {
    std::vector<Completion> failed;
    {
      std::lock_guard lock(p.completionMutex);
      p.completions.failAll(p.node, failed);
    }
    pushCompletions(failed);
    return;
  }
  completeWritten(p.node);  // a write chain that was already running may have sent every frame by now
}

std::shared_ptr<TcpTransport::Impl::Region> TcpTransport::Impl::findRegion(uint32_t id) const {
  std::shared_lock lock(regionsMutex);
  auto it = regions.find(id);
  return it == regions.end() ? nullptr : it->second;
}

TcpTransport::Impl::Peer& TcpTransport::Impl::peerRef(NodeIndex node) const {
  const uint32_t n = nodeCount.load(std::memory_order_acquire);
  if (n == 0) fail(ErrorCode::kUnavailable, "tcp transport: not connected yet (call connect first)");
  if (node >= n || node == config.self)
    fail(ErrorCode::kInvalidArgument, "tcp transport: node {} is not a peer of node {} ({} nodes)", node, config.self, n);
  return *peers[node];
}

void TcpTransport::Impl::checkConnected(Peer& p) const {
  const PeerState s = p.life.state();
  if (s == PeerState::kConnected) return;
  if (s == PeerState::kConnecting)
    fail(ErrorCode::kUnavailable, "tcp transport: {} is not connected yet", nodeName(p.node));
  std::lock_guard lock(p.mutex);
  fail(ErrorCode::kPeerLost, "tcp transport: peer {} lost: {}", nodeName(p.node), p.life.reason());
}

void TcpTransport::Impl::failPeer(NodeIndex node, PeerState newState, std::string reason, uint64_t attempt) {
  if (node >= peers.size() || !peers[node]) return;
  Peer& p = *peers[node];
  std::vector<std::shared_ptr<InConn>> in;
  std::vector<std::shared_ptr<OutConn>> out;
  tcp::PeerLifecycle::Failure f;
  {
    std::lock_guard lock(p.mutex);
    f = p.life.fail(newState, std::move(reason), attempt);
    if (f.ignored) return;
    in = p.in;
    out = p.out;
    // Nothing of this attempt may reach the next one: inbound connections still running find the attempt
    // changed and stop; pending flags and messages are dropped (a thread delivering the oldest message notices
    // the attempt change in applyPending).
    p.in.assign(p.in.size(), nullptr);
    p.arrivals.reset();
  }
  std::vector<Completion> failed;
  for (auto& c : out) c->shutdown();
  {
    std::lock_guard lock(p.completionMutex);
    p.completions.failAll(node, failed);
  }
  for (auto& c : in) {
    if (!c) continue;
    asio::post(c->strand, [c] {
      error_code ignored;
      c->socket.close(ignored);
    });
  }
  pushCompletions(failed);
  if (f.first) {
    const PeerStatus status{newState, peerStatusReason(p)};
    if (stopping.load()) {
      spdlog::debug("tcp transport: peer {} {} during shutdown: {}", nodeName(node), peerStateName(newState),
                    status.reason);
    } else if (newState == PeerState::kClosed) {
      spdlog::info("tcp transport: peer {} closed: {}", nodeName(node), status.reason);
    } else {
      spdlog::error("tcp transport: peer {} lost: {}", nodeName(node), status.reason);
    }
    notifyState();
    if (stopping.load()) return;
    std::function<void(NodeIndex, const PeerStatus&)> handler;
    {
      std::lock_guard lock(handlerMutex);
      handler = failureHandler;
    }
    if (handler) {
      try {
        handler(node, status);
      } catch (const std::exception& e) {
        spdlog::error("tcp transport: peer failure handler threw: {}", e.what());
      }
    }
  }
  startRejoin(p, f.newAttempt);
}

std::string TcpTransport::Impl::peerStatusReason(Peer& p) const {
  std::lock_guard lock(p.mutex);
  return p.life.reason();
}

void TcpTransport::Impl::startRejoin(Peer& p, uint64_t attempt) {
  if (stopping.load()) return;
  std::vector<std::shared_ptr<OutConn>> conns;
  for (uint32_t k = 0; k < config.connectionsPerPeer; ++k)
    conns.push_back(std::make_shared<OutConn>(*this, p.node, k, attempt));
  std::vector<Completion> failed;
  {
    std::scoped_lock lock(p.sendMutex, p.completionMutex, p.mutex);
    if (stopping.load() || !p.life.beginRejoin(attempt)) return;  // superseded meanwhile
    p.out = conns;
    p.sentData.assign(p.sentData.size(), 0);
    p.sentFrames.assign(p.sentFrames.size(), 0);
    p.completions.failAll(p.node, failed);
  }
  pushCompletions(failed);
  for (auto& c : conns) spawn(c->strand, dial(c, Clock::time_point::max(), true), "re-dial");
}

uint64_t TcpTransport::Impl::currentAttempt(Peer& p) const {
  std::lock_guard lock(p.mutex);
  return p.life.attempt();
}

void TcpTransport::Impl::setLastDialError(Peer& p, std::string why) {
  std::lock_guard lock(p.mutex);
  p.life.setLastDialError(std::move(why));
}

void TcpTransport::Impl::handshakeFailure(NodeIndex node, ErrorCode code, std::string message) {
  if (node >= peers.size() || !peers[node]) return;
  Peer& p = *peers[node];
  {
    std::lock_guard lock(p.mutex);
    switch (p.life.handshakeFailure(code, message)) {
      case tcp::PeerLifecycle::HandshakeVerdict::kRetryQuietly:
        spdlog::debug("{} (while rejoining)", message);
        return;
      case tcp::PeerLifecycle::HandshakeVerdict::kIgnore:
        spdlog::warn("{} (ignored: the peer is already {})", message, peerStateName(p.life.state()));
        return;
      case tcp::PeerLifecycle::HandshakeVerdict::kFail: break;
    }
  }
  failPeer(node, PeerState::kFailed, std::move(message));
}

bool TcpTransport::Impl::connectionReady(Peer& p, bool outbound, uint64_t attempt) {
  tcp::PeerLifecycle::Ready r;
  {
    std::lock_guard lock(p.mutex);
    r = p.life.connectionReady(outbound, attempt);
  }
  if (r.superseded) return false;
  if (r.connected) {
    spdlog::info("tcp transport: node {} {} {} (generation {})", config.self,
                 r.rejoined ? "reconnected to" : "connected to", nodeName(p.node), r.generation);
  }
  notifyState();
  if (r.rejoined && !stopping.load()) {
    std::function<void(NodeIndex)> handler;
    {
      std::lock_guard lock(handlerMutex);
      handler = rejoinHandler;
    }
    if (handler) {
      try {
        handler(p.node);
      } catch (const std::exception& e) {
        spdlog::error("tcp transport: peer rejoin handler threw: {}", e.what());
      }
    }
  }
  return true;
}

void TcpTransport::Impl::applyPending(Peer& p, std::unique_lock<std::mutex>& lock) {
  while (!p.delivering) {
    tcp::Arrival* a = p.arrivals.ready();
    if (a == nullptr) return;
    if (a->message) {
      p.delivering = true;
      const uint64_t attempt = p.life.attempt();
      std::vector<std::byte> payload = std::move(a->payload);
      lock.unlock();
      deliverMessage(p.node, payload);
      lock.lock();
      p.delivering = false;
      // Still the oldest, unless the peer failed meanwhile (failPeer cleared the queue; what is there now
      // belongs to the next attempt and is looked at by this loop).
      if (p.life.attempt() == attempt) p.arrivals.pop();
      continue;
    }
    if (a->device) {
      // Synchronous copies: every data copy to the device has completed before this one starts.
      config.deviceCopier->toDevice(a->target, &a->value, sizeof a->value);
    } else {
      // release: the data bytes of every counted frame were written before (by this thread, or by another
      // connection's thread that then released p.mutex, which we hold). Pairs with the consumer's
      // load-acquire of the flag (e.g. std::atomic_ref<uint64_t>(flag).load(acquire) in the tests).
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(a->target)).store(a->value, std::memory_order_release);
    }
    p.arrivals.pop();
  }
}

void TcpTransport::Impl::deliverMessage(NodeIndex from, std::span<const std::byte> payload) {
  if (stopping.load()) return;  // the owner is tearing down; the handler's state may be going away
  std::shared_ptr<const MessageHandler> handler;
  {
    std::lock_guard lock(handlerMutex);
    handler = messageHandler;
  }
  if (!handler || !*handler) {
    if (!warnedNoMessageHandler.exchange(true))
      spdlog::warn("tcp transport: dropped a {}-byte control message from {}: no message handler is set",
                   payload.size(), nodeName(from));
    return;
  }
  try {
    (*handler)(from, payload);
  } catch (const std::exception& e) {
    spdlog::error("tcp transport: message handler threw on a {}-byte message from {}: {}", payload.size(),
                  nodeName(from), e.what());
  } catch (...) {
    spdlog::error("tcp transport: message handler threw a non-std exception on a {}-byte message from {}",
                  payload.size(), nodeName(from));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Start, connect, shut down
// ---------------------------------------------------------------------------------------------------------

void TcpTransport::Impl::start() {
  const TcpConfig& c = config;
  if (c.secret.empty())
    fail(ErrorCode::kInvalidConfig, "tcp transport: cluster.secret is empty; set the same non-empty secret on every "
         "node (e.g. `openssl rand -hex 32`)");
  if (c.connectionsPerPeer == 0 || c.connectionsPerPeer > 16)
    fail(ErrorCode::kInvalidConfig, "tcp transport: cluster.connections_per_peer {} must be in [1, 16]",
         c.connectionsPerPeer);
  if (c.ioThreads == 0 || c.ioThreads > 64)
    fail(ErrorCode::kInvalidConfig, "tcp transport: {} io threads must be in [1, 64]", c.ioThreads);
  if (c.chunkBytes < 4096 || c.chunkBytes > tcp::kMaxFramePayload)
    fail(ErrorCode::kInvalidConfig, "tcp transport: chunk of {} bytes must be in [4096, {}]", c.chunkBytes,
         tcp::kMaxFramePayload);
  if (c.heartbeatIntervalMs == 0 || c.peerDeadlineMs <= c.heartbeatIntervalMs)
    fail(ErrorCode::kInvalidConfig, "tcp transport: the peer deadline {} ms (communicators.peer_lost_deadline_ms) "
         "must exceed cluster.heartbeat_interval_ms {} (> 0)", c.peerDeadlineMs, c.heartbeatIntervalMs);
  if (c.connectTimeoutMs == 0)
    fail(ErrorCode::kInvalidConfig, "tcp transport: cluster.connect_timeout_ms must be > 0");

  error_code ec;
  auto address = asio::ip::make_address(c.listenHost, ec);
  if (ec) {
    // A host name (cluster.nodes may use names): bind the first address it resolves to.
    asio::io_context resolveContext;
    asio::ip::tcp::resolver resolver(resolveContext);
    const auto results = resolver.resolve(c.listenHost, std::to_string(c.listenPort), ec);
    if (ec || results.empty())
      fail(ErrorCode::kInvalidConfig, "tcp transport: listen address '{}' is neither an IP address nor a name that "
           "resolves ({}); use this node's IP address in cluster.nodes", c.listenHost,
           ec ? ec.message() : "no addresses");
    address = results.begin()->endpoint().address();
  }
  const asio::ip::tcp::endpoint ep(address, c.listenPort);
  acceptor.open(ep.protocol(), ec);
  if (!ec) acceptor.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    fail(ErrorCode::kSystem, "tcp transport: listen on {}:{} failed: {}; pick a free port or stop whatever holds it",
         c.listenHost, c.listenPort, ec.message());
  for (uint32_t i = 0; i < c.ioThreads; ++i) {
    threads.emplace_back([this, i] {
      const std::string name = fmt::format("tcp-io-{}", i);
      pthread_setname_np(pthread_self(), name.c_str());
      for (;;) {
        try {
          io.run();
          return;
        } catch (const std::exception& e) {
          spdlog::error("tcp transport: io thread: {}", e.what());
        }
      }
    });
  }
}

void TcpTransport::Impl::connect(const std::vector<NodeAddress>& list) {
  if (connectCalled) fail(ErrorCode::kInvalidArgument, "tcp transport: connect() may be called only once");
  connectCalled = true;
  if (list.empty() || config.self >= list.size())
    fail(ErrorCode::kInvalidConfig, "tcp transport: this node is index {} but cluster.nodes lists {} nodes",
         config.self, list.size());
  if (list.size() > 65536)
    fail(ErrorCode::kInvalidConfig, "tcp transport: {} nodes exceed the 65536 the proxy FIFO can address", list.size());
  nodes = list;
  const uint32_t conns = config.connectionsPerPeer;
  peers.resize(list.size());
  for (NodeIndex i = 0; i < list.size(); ++i) {
    if (i == config.self) continue;
    auto p = std::make_unique<Peer>(conns);
    p->node = i;
    p->addr = list[i];
    for (uint32_t k = 0; k < conns; ++k) p->out.push_back(std::make_shared<OutConn>(*this, i, k, 0));
    p->in.resize(conns);
    p->sentData.assign(conns, 0);
    p->sentFrames.assign(conns, 0);
    peers[i] = std::move(p);
  }
  // release: peers and nodes are complete before any thread that sees nodeCount uses them.
  nodeCount.store(static_cast<uint32_t>(list.size()), std::memory_order_release);
  const auto deadline = Clock::now() + std::chrono::milliseconds(config.connectTimeoutMs);
  spawn(acceptStrand, acceptLoop(), "accept loop");
  spawn(timerStrand, heartbeatLoop(), "heartbeat loop");
  for (auto& p : peers) {
    if (!p) continue;
    for (auto& c : p->out) spawn(c->strand, dial(c, deadline, false), "dial");
  }

  auto settled = [&] {
    for (auto& p : peers) {
      if (!p) continue;
      if (p->life.state() == PeerState::kConnecting) return false;
    }
    return true;
  };
  {
    std::unique_lock lock(stateMutex);
    stateCv.wait_until(lock, deadline, settled);
  }
  // Report the first handshake failure (a different secret or version beats a timeout).
  for (auto& p : peers) {
    if (!p) continue;
    std::lock_guard lock(p->mutex);
    if (p->life.fatalCode() != ErrorCode::kOk) throw Error(p->life.fatalCode(), p->life.fatal());
  }
  std::string missing;
  for (auto& p : peers) {
    if (!p) continue;
    const PeerState s = p->life.state();
    if (s == PeerState::kConnected) continue;
    std::lock_guard lock(p->mutex);
    const tcp::PeerLifecycle& life = p->life;
    if (s == PeerState::kConnecting) {
      missing += fmt::format("; {}: {}/{} outgoing and {}/{} incoming connections{}", nodeName(p->node),
                             life.outReady(), conns, life.inReady(), conns,
                             life.lastDialError().empty() ? std::string() : " (last error: " + life.lastDialError() + ")");
    } else {
      missing += fmt::format("; {}: {}", nodeName(p->node), life.reason());
    }
  }
  if (missing.empty()) return;
  const std::string message =
      fmt::format("tcp transport: node {} could not connect to every peer within {} ms{}. Check that tandemd runs "
                  "on those nodes with the same cluster.nodes list, and that the ports are reachable",
                  config.self, config.connectTimeoutMs, missing);
  for (auto& p : peers) {
    if (p && p->life.state() == PeerState::kConnecting)
      failPeer(p->node, PeerState::kFailed, "not connected by the deadline");
  }
  throw Error(ErrorCode::kTimeout, message);
}

void TcpTransport::Impl::shutdown() {
  stopping.store(true);
  // Goodbye on every established connection, both directions, so peers mark us closed rather than lost.
  std::vector<std::shared_ptr<InConn>> inbound;
  int sent = 0;
  for (auto& pp : peers) {
    if (!pp || pp->life.state() != PeerState::kConnected) continue;
    std::vector<std::shared_ptr<OutConn>> out;
    {
      std::lock_guard lock(pp->mutex);
      out = pp->out;
    }
    for (auto& c : out) {
      OutFrame f;
      f.header = tcp::goodbyeHeader();
      f.goodbye = true;
      if (c->enqueue(std::move(f))) {
        ++sent;
        c->kick();
      }
    }
    std::lock_guard lock(pp->mutex);
    for (auto& c : pp->in) {
      if (c) inbound.push_back(c);
    }
  }
  {
    std::lock_guard lock(stateMutex);
    goodbyesPending += sent + static_cast<int>(inbound.size());
  }
  for (auto& c : inbound) {
    asio::post(c->strand, [this, c] {
      c->goodbye = tcp::goodbyeHeader();
      asio::async_write(c->socket, asio::buffer(&c->goodbye, sizeof c->goodbye),
                        asio::bind_executor(c->strand, [this, c](const error_code&, std::size_t) { goodbyeSent(1); }));
    });
  }
  {
    // Bounded: a dead peer must not delay shutdown.
    std::unique_lock lock(stateMutex);
    stateCv.wait_for(lock, std::chrono::milliseconds(250), [&] { return goodbyesPending <= 0; });
  }
  asio::post(acceptStrand, [this] {
    error_code ignored;
    acceptor.close(ignored);
  });
  work.reset();
  io.stop();
  for (auto& t : threads) t.join();
  threads.clear();
  // Sockets close here, while the io_context (declared first) still exists; suspended coroutines are
  // destroyed with it.
  for (auto& p : peers) {
    if (!p) continue;
    for (auto& c : p->out) {
      error_code ignored;
      c->socket.close(ignored);
    }
    for (auto& c : p->in) {
      if (!c) continue;
      error_code ignored;
      c->socket.close(ignored);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// TcpTransport
// ---------------------------------------------------------------------------------------------------------

TcpTransport::TcpTransport(TcpConfig config) : impl_(std::make_unique<Impl>(std::move(config))) { impl_->start(); }

TcpTransport::~TcpTransport() {
  try {
    impl_->shutdown();
  } catch (const std::exception& e) {
    spdlog::error("tcp transport: shutdown: {}", e.what());
  }
}

uint16_t TcpTransport::listenPort() const {
  error_code ec;
  const auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

TransportAddress TcpTransport::address() const {
  TransportAddress a;
  a.kind = TransportKind::kTcp;
  a.node = impl_->config.self;
  a.protocolVersion = impl_->config.protocolVersion;
  a.host = impl_->config.listenHost;
  a.port = listenPort();
  return a;
}

void TcpTransport::connect(const std::vector<NodeAddress>& nodes) { impl_->connect(nodes); }

NodeIndex TcpTransport::self() const { return impl_->config.self; }
uint32_t TcpTransport::nodeCount() const { return impl_->nodeCount.load(std::memory_order_acquire); }

LocalRegion TcpTransport::registerMemory(const MemoryDesc& desc) {
  if (desc.addr == nullptr || desc.bytes == 0)
    fail(ErrorCode::kInvalidArgument, "tcp transport: cannot register an empty or null range");
  if (desc.kind == MemoryKind::kDevice && impl_->config.deviceCopier == nullptr)
    fail(ErrorCode::kUnsupported, "tcp transport: registering GPU memory needs a device copier for host staging "
         "(the CUDA backend provides one)");
  std::unique_lock lock(impl_->regionsMutex);
  const uint32_t id = impl_->nextRegionId++;
  impl_->regions.emplace(id, std::make_shared<Impl::Region>(Impl::Region{desc}));
  return LocalRegion{id};
}

void TcpTransport::deregisterMemory(LocalRegion region) {
  std::unique_lock lock(impl_->regionsMutex);
  impl_->regions.erase(region.id);
}

RemoteKey TcpTransport::remoteKey(LocalRegion region) const {
  auto r = impl_->findRegion(region.id);
  if (!r) fail(ErrorCode::kNotFound, "tcp transport: unknown local region {}", region.id);
  return RemoteKey{TransportKind::kTcp, impl_->config.self, region.id, 0, 0, r->desc.bytes};
}

namespace {
void checkKey(const RemoteKey& dst, NodeIndex peer, std::string_view op) {
  if (dst.transport != TransportKind::kTcp || dst.owner != peer)
    fail(ErrorCode::kInvalidArgument, "tcp transport: {} to node {} with a {} key of node {}", op, peer,
         transportKindName(dst.transport), dst.owner);
}
}  // namespace

void TcpTransport::write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
                         uint64_t bytes, uint64_t cookie, bool signal) {
  Impl& im = *impl_;
  Impl::Peer& p = im.peerRef(peer);
  im.checkConnected(p);
  checkKey(dst, peer, "write");
  if (bytes == 0) fail(ErrorCode::kInvalidArgument, "tcp transport: write of 0 bytes");
  if (!detail::inBounds(dstOffset, bytes, dst.bytes))
    fail(ErrorCode::kInvalidArgument, "tcp transport: write to [{}, +{}) of node {}'s region {} which has {} bytes",
         dstOffset, bytes, peer, dst.regionId, dst.bytes);
  auto region = im.findRegion(src.id);
  if (!region) fail(ErrorCode::kInvalidArgument, "tcp transport: unknown local region {}", src.id);
  if (!detail::inBounds(srcOffset, bytes, region->desc.bytes))
    fail(ErrorCode::kInvalidArgument, "tcp transport: write reads [{}, +{}) of local region {} which has {} bytes",
         srcOffset, bytes, src.id, region->desc.bytes);
  const auto* base = static_cast<const std::byte*>(region->desc.addr) + srcOffset;
  const bool device = region->desc.kind == MemoryKind::kDevice;
  std::lock_guard lock(p.sendMutex);
  im.checkConnected(p);  // again, under sendMutex: p.out is this incarnation's (a rejoin swaps it under sendMutex)
  const auto conns = static_cast<uint32_t>(p.out.size());
  for (uint64_t done = 0; done < bytes;) {
    // Striped by destination chunk, so writes to the same bytes keep their order (tcp::nextChunk).
    const tcp::Chunk chunk = tcp::nextChunk(dst.regionId, dstOffset + done, bytes - done, im.config.chunkBytes, conns);
    const uint64_t n = chunk.bytes;
    const uint32_t c = chunk.connection;
    Impl::OutFrame f;
    f.header = tcp::dataHeader(dst.regionId, chunk.offset, n);
    if (device) {
      f.owned.resize(n);  // host staging: the GPU source is copied now, so it may change after write returns
      im.config.deviceCopier->toHost(f.owned.data(), base + done, n);
      f.payload = f.owned.data();
    } else {
      f.payload = base + done;  // zero copy: the caller keeps the source unchanged until completion
    }
    f.payloadBytes = n;
    f.counted = true;
    done += n;
    if (!p.out[c]->enqueue(std::move(f))) im.checkConnected(p);  // throws kPeerLost with the reason
    p.sentData[c] += 1;
    p.sentFrames[c] += 1;
  }
  if (signal) im.expectCompletion(p, cookie);
}

void TcpTransport::writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                             bool signal) {
  Impl& im = *impl_;
  Impl::Peer& p = im.peerRef(peer);
  im.checkConnected(p);
  checkKey(dst, peer, "flag");
  if (dstOffset % 8 != 0 || !detail::inBounds(dstOffset, 8, dst.bytes))
    fail(ErrorCode::kInvalidArgument, "tcp transport: flag at offset {} of node {}'s region {} ({} bytes) is "
         "misaligned or out of bounds", dstOffset, peer, dst.regionId, dst.bytes);
  std::lock_guard lock(p.sendMutex);
  im.checkConnected(p);
  Impl::OutFrame f;
  f.header = tcp::flagHeader(dst.regionId, dstOffset, value, static_cast<uint32_t>(p.sentData.size()));
  f.owned = tcp::countsPayload(p.sentData);
  f.payload = f.owned.data();
  f.payloadBytes = f.owned.size();
  f.counted = true;
  if (!p.out[0]->enqueue(std::move(f))) im.checkConnected(p);
  p.sentFrames[0] += 1;
  if (signal) im.expectCompletion(p, cookie);
}

void TcpTransport::submit() {
  Impl& im = *impl_;
  if (im.nodeCount.load(std::memory_order_acquire) == 0) return;
  for (auto& p : im.peers) {
    if (!p || p->life.state() != PeerState::kConnected) continue;
    std::lock_guard lock(p->sendMutex);
    for (auto& c : p->out) c->kick();
  }
}

std::size_t TcpTransport::poll(std::span<Completion> out) {
  Impl& im = *impl_;
  if (!im.anyCompletions.load(std::memory_order_acquire)) return 0;
  std::lock_guard lock(im.completionsMutex);
  const std::size_t n = std::min(out.size(), im.completions.size());
  std::copy_n(im.completions.begin(), n, out.begin());
  im.completions.erase(im.completions.begin(), im.completions.begin() + static_cast<std::ptrdiff_t>(n));
  im.anyCompletions.store(!im.completions.empty(), std::memory_order_release);
  return n;
}

PeerStatus TcpTransport::peerStatus(NodeIndex peer) const {
  if (peer == impl_->config.self) return PeerStatus{PeerState::kConnected, {}};
  Impl::Peer& p = impl_->peerRef(peer);
  std::lock_guard lock(p.mutex);
  return PeerStatus{p.life.state(), p.life.reason()};
}

void TcpTransport::setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) {
  std::lock_guard lock(impl_->handlerMutex);
  impl_->failureHandler = std::move(handler);
}

void TcpTransport::setMessageHandler(MessageHandler handler) {
  auto h = handler ? std::make_shared<const MessageHandler>(std::move(handler)) : nullptr;
  std::lock_guard lock(impl_->handlerMutex);
  impl_->messageHandler = std::move(h);
}

void TcpTransport::sendMessage(NodeIndex peer, std::span<const std::byte> payload) {
  Impl& im = *impl_;
  if (payload.size() > kMaxMessageBytes)
    fail(ErrorCode::kInvalidArgument, "tcp transport: control message of {} bytes to node {} exceeds the {}-byte "
         "limit (TcpTransport::kMaxMessageBytes); send large data with write()", payload.size(), peer,
         kMaxMessageBytes);
  Impl::Peer& p = im.peerRef(peer);
  im.checkConnected(p);
  {
    std::lock_guard lock(p.sendMutex);
    im.checkConnected(p);
    Impl::OutFrame f;
    f.header = tcp::messageHeader(payload.size(), static_cast<uint32_t>(p.sentData.size()));
    // The data frames queued before it, per connection, exactly as a flag carries them, then the message.
    f.owned = tcp::countsPayload(p.sentData, payload);
    f.payload = f.owned.data();
    f.payloadBytes = f.owned.size();
    // Not counted: a message is no signalled op, and the caller's bytes were copied, so no completion waits on it.
    if (!p.out[0]->enqueue(std::move(f))) im.checkConnected(p);  // throws kPeerLost with the reason
    // Start it now, and the writes queued before it, which it waits for on the receiver.
    for (auto& c : p.out) c->kick();
  }
}

uint64_t TcpTransport::peerGeneration(NodeIndex peer) const {
  if (peer == impl_->config.self) return 0;
  return impl_->peerRef(peer).life.generation();
}

void TcpTransport::setPeerRejoinHandler(std::function<void(NodeIndex)> handler) {
  std::lock_guard lock(impl_->handlerMutex);
  impl_->rejoinHandler = std::move(handler);
}

}  // namespace tandem::daemon::transport
