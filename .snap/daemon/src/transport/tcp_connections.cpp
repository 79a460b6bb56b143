// The tcp transport's connections on Boost.Asio: accepting (the acceptor's side of the handshake, then reading
// frames), dialling and re-dialling (the dialer's side), writing queued frames in batches, and heartbeats. The
// handshake's messages and checks are in tcp_handshake.cpp, the frames' in tcp_wire.cpp, the peer's state in
// tcp_peer.cpp; what a peer event does (failure, readiness, delivery) is in tcp_transport.cpp.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <optional>

#include "transport/tcp_handshake.hpp"
#include "transport/tcp_transport_impl.hpp"

namespace tandem::daemon::transport {

using NoDelay = asio::ip::tcp::no_delay;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::string describe(const error_code& ec) {
  if (ec == asio::error::eof) return "connection closed (EOF)";
  if (ec == asio::error::connection_reset) return "connection reset by peer";
  return ec.message();
}

void TcpTransport::Impl::spawn(Strand& strand, asio::awaitable<void> coroutine, std::string what) {
  asio::co_spawn(strand, std::move(coroutine), [what = std::move(what)](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      spdlog::error("tcp transport: {} failed: {}", what, ex.what());
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// Writing: each dialled connection drains its queue in batches, one write chain at a time, on its strand
// ---------------------------------------------------------------------------------------------------------

bool TcpTransport::Impl::OutConn::enqueue(OutFrame&& frame) {
  std::lock_guard lock(mutex);
  if (closed) return false;
  queue.push_back(std::move(frame));
  return true;
}

void TcpTransport::Impl::OutConn::kick() {
  {
    std::lock_guard lock(mutex);
    if (writing || closed || queue.empty() || !ready.load(std::memory_order_acquire)) return;
    writing = true;
  }
  asio::post(strand, [self = shared_from_this()] { self->startWrite(); });
}

void TcpTransport::Impl::OutConn::startWrite() {
  inflight.clear();
  {
    std::lock_guard lock(mutex);
    uint64_t bytes = 0;
    while (!queue.empty() && inflight.size() < tcp::kMaxBatchFrames && bytes < tcp::kMaxBatchBytes) {
      bytes += sizeof(tcp::FrameHeader) + queue.front().payloadBytes;
      inflight.push_back(std::move(queue.front()));
      queue.pop_front();
    }
    if (inflight.empty() || closed) {
      writing = false;
      return;
    }
  }
  buffers.clear();
  for (const OutFrame& f : inflight) {
    buffers.emplace_back(&f.header, sizeof f.header);
    if (f.payloadBytes > 0) buffers.emplace_back(f.payload, f.payloadBytes);
  }
  asio::async_write(socket, buffers,
                    asio::bind_executor(strand, [self = shared_from_this()](const error_code& ec, std::size_t) {
                      self->onWritten(ec);
                    }));
}

void TcpTransport::Impl::OutConn::onWritten(const error_code& ec) {
  uint64_t counted = 0;
  int goodbyes = 0;
  for (const OutFrame& f : inflight) {
    counted += f.counted ? 1 : 0;
    goodbyes += f.goodbye ? 1 : 0;
  }
  inflight.clear();
  if (goodbyes > 0) impl.goodbyeSent(goodbyes);
  if (!ec && counted > 0) {
    writtenFrames.fetch_add(counted, std::memory_order_relaxed);  // published by the peer's completion mutex
    impl.completeWritten(peer);
  }
  if (ec) {
    {
      std::lock_guard lock(mutex);
      writing = false;
    }
    impl.failPeer(peer, PeerState::kFailed, fmt::format("write on connection {} failed: {}", index, describe(ec)),
                  attempt);
    return;
  }
  lastTxNs.store(nowNs(), std::memory_order_relaxed);
  startWrite();
}

void TcpTransport::Impl::OutConn::shutdown() {
  int goodbyes = 0;
  {
    std::lock_guard lock(mutex);
    closed = true;
    for (const OutFrame& f : queue) goodbyes += f.goodbye ? 1 : 0;
    queue.clear();
  }
  if (goodbyes > 0) impl.goodbyeSent(goodbyes);
  asio::post(strand, [self = shared_from_this()] {
    error_code ignored;
    self->socket.close(ignored);
  });
}

// ---------------------------------------------------------------------------------------------------------
// Accepting: the acceptor's side of the handshake, then the peer's frames
// ---------------------------------------------------------------------------------------------------------

asio::awaitable<void> TcpTransport::Impl::acceptLoop() {
  for (;;) {
    auto conn = std::make_shared<InConn>(*this);
    error_code ec;
    co_await acceptor.async_accept(conn->socket, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (ec == asio::error::operation_aborted || stopping.load() || !acceptor.is_open()) co_return;
      spdlog::warn("tcp transport: accept failed: {}", ec.message());
      asio::steady_timer pause(acceptStrand, std::chrono::milliseconds(50));  // e.g. EMFILE: do not spin
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    spawn(conn->strand, serveInbound(conn), "inbound connection");
  }
}

asio::awaitable<void> TcpTransport::Impl::serveInbound(std::shared_ptr<InConn> c) {
  error_code ec;
  c->socket.set_option(NoDelay(true), ec);
  const auto remoteEp = c->socket.remote_endpoint(ec);
  const std::string remote =
      ec ? std::string("unknown") : fmt::format("{}:{}", remoteEp.address().to_string(), remoteEp.port());
  // A connection that does not finish the handshake in time is closed (strangers, stuck dialers).
  asio::steady_timer watchdog(c->strand, std::chrono::milliseconds(config.connectTimeoutMs));
  watchdog.async_wait([c](const error_code& e) {
    if (!e) {
      error_code ignored;
      c->socket.close(ignored);
    }
  });

  tcp::HelloBytes helloBytes{};
  co_await asio::async_read(c->socket, asio::buffer(helloBytes), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    spdlog::debug("tcp transport: connection from {} ended before its handshake: {}", remote, describe(ec));
    co_return;
  }
  const std::optional<tcp::Hello> hello = tcp::decodeHello(helloBytes);
  if (!hello) {
    spdlog::warn("tcp transport: rejected a connection from {}: not a tandem transport handshake", remote);
    co_return;
  }
  const NodeIndex from = hello->from;
  const tcp::AcceptorIdentity me{config.self, nodeCount.load(std::memory_order_acquire), config.protocolVersion,
                                 config.connectionsPerPeer};
  const bool fromValid = tcp::helloFromValid(*hello, me);
  const tcp::HandshakeStatus status = tcp::checkHello(*hello, me);
  const tcp::ReplyBytes reply = tcp::encodeReply(
      tcp::Reply{config.protocolVersion, status, config.self, config.connectionsPerPeer, tcp::randomNonce()},
      config.secret, helloBytes);
  co_await asio::async_write(c->socket, asio::buffer(reply), asio::redirect_error(asio::use_awaitable, ec));

  const std::string who = fromValid ? nodeName(from) : fmt::format("{} (claims node {})", remote, from);
  switch (status) {
    case tcp::HandshakeStatus::kOk: break;
    case tcp::HandshakeStatus::kVersionMismatch:
      handshakeFailure(from, ErrorCode::kVersionMismatch,
                       tcp::versionMismatchMessage(who, hello->version, config.protocolVersion));
      if (!fromValid)
        spdlog::warn("tcp transport: rejected {}: protocol version {} (this node speaks {})", who, hello->version,
                     config.protocolVersion);
      co_return;
    case tcp::HandshakeStatus::kConnMismatch:
      handshakeFailure(from, ErrorCode::kInvalidConfig,
                       tcp::connectionCountMismatchMessage(who, hello->connCount, config.connectionsPerPeer));
      co_return;
    default:
      spdlog::warn("tcp transport: rejected {}: it addressed node {} but this is node {} of {}; cluster.nodes must "
                   "list the same nodes in the same order everywhere", who, hello->to, config.self, me.nodeCount);
      co_return;
  }
  if (ec) co_return;

  tcp::AuthBytes auth{};
  co_await asio::async_read(c->socket, asio::buffer(auth), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    spdlog::debug("tcp transport: {} hung up during the handshake: {}", who, describe(ec));
    co_return;
  }
  const uint32_t connIndex = hello->connIndex;
  tcp::HandshakeStatus result = tcp::HandshakeStatus::kOk;
  if (!tcp::dialerAuthValid(config.secret, helloBytes, reply, auth)) {
    result = tcp::HandshakeStatus::kBadSecret;
  } else {
    Peer& p = *peers[from];
    std::lock_guard lock(p.mutex);
    // Accepted while connect() runs, and again once the peer failed or closed (it restarted and rejoins).
    if (p.in[connIndex] || !p.life.acceptsHandshakes()) {
      result = tcp::HandshakeStatus::kDuplicate;
    } else {
      c->peer = from;
      c->index = connIndex;
      c->attempt = p.life.attempt();
      c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
      p.in[connIndex] = c;
    }
  }
  const tcp::ResultBytes res = tcp::encodeResult(result);
  co_await asio::async_write(c->socket, asio::buffer(res), asio::redirect_error(asio::use_awaitable, ec));
  if (result == tcp::HandshakeStatus::kBadSecret) {
    handshakeFailure(from, ErrorCode::kPermissionDenied, tcp::secretMismatchMessage(who));
    co_return;
  }
  if (result == tcp::HandshakeStatus::kDuplicate) {
    spdlog::warn("tcp transport: rejected {}: connection {} from it already exists (two daemons configured as node "
                 "{}, or a restarted node whose previous run this node has not seen end yet?)", who, connIndex, from);
    co_return;
  }
  watchdog.cancel();
  c->ready.store(true, std::memory_order_release);
  if (!connectionReady(*peers[from], /*outbound=*/false, c->attempt)) {
    error_code ignored;
    c->socket.close(ignored);
    co_return;
  }
  if (ec) {
    failPeer(from, PeerState::kFailed,
             fmt::format("handshake on inbound connection {} failed: {}", connIndex, describe(ec)), c->attempt);
    co_return;
  }
  co_await inboundLoop(c);
}

asio::awaitable<void> TcpTransport::Impl::inboundLoop(std::shared_ptr<InConn> c) {
  Peer& p = *peers[c->peer];
  const uint32_t conns = config.connectionsPerPeer;
  auto protocolError = [&](std::string what) {
    failPeer(c->peer, PeerState::kFailed, fmt::format("sent a malformed frame on connection {}: {}", c->index, what),
             c->attempt);
  };
  error_code ec;
  tcp::FrameHeader h{};
  std::vector<uint64_t> counts(conns);
  for (;;) {
    co_await asio::async_read(c->socket, asio::buffer(&h, sizeof h), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;
    c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
    if (std::string bad = tcp::checkHeader(h, c->index, conns); !bad.empty()) co_return protocolError(std::move(bad));
    switch (static_cast<tcp::FrameType>(h.type)) {
      case tcp::FrameType::kHeartbeat: break;
      case tcp::FrameType::kGoodbye:
        failPeer(c->peer, PeerState::kClosed, fmt::format("{} shut its transport down", nodeName(c->peer)), c->attempt);
        co_return;
      case tcp::FrameType::kData: {
        std::shared_ptr<Region> region = findRegion(h.regionId);
        if (std::string bad = tcp::checkDataTarget(h, region != nullptr, region ? region->desc.bytes : 0); !bad.empty())
          co_return protocolError(std::move(bad));
        std::byte* target = static_cast<std::byte*>(region->desc.addr) + h.offset;
        const bool device = region->desc.kind == MemoryKind::kDevice;
        if (device) c->staging.resize(h.length);
        std::byte* landing = device ? c->staging.data() : target;
        co_await asio::async_read(c->socket, asio::buffer(landing, h.length),
                                  asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        if (device) config.deviceCopier->toDevice(target, landing, h.length);
        c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
        std::unique_lock lock(p.mutex);
        if (p.life.attempt() != c->attempt) co_return;  // the peer failed meanwhile: nothing of it reaches the next
        p.arrivals.dataLanded(c->index);
        applyPending(p, lock);
        break;
      }
      case tcp::FrameType::kFlag: {
        co_await asio::async_read(c->socket, asio::buffer(counts), asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        std::shared_ptr<Region> region = findRegion(h.regionId);
        if (std::string bad = tcp::checkFlagTarget(h, region != nullptr, region ? region->desc.bytes : 0,
                                                   region ? reinterpret_cast<uintptr_t>(region->desc.addr) : 0);
            !bad.empty())
          co_return protocolError(std::move(bad));
        std::unique_lock lock(p.mutex);
        if (p.life.attempt() != c->attempt) co_return;
        tcp::Arrival item;
        item.counts = counts;
        item.target = static_cast<std::byte*>(region->desc.addr) + h.offset;
        item.device = region->desc.kind == MemoryKind::kDevice;
        item.value = h.value;
        p.arrivals.push(std::move(item));
        applyPending(p, lock);
        break;
      }
      case tcp::FrameType::kMessage: {
        tcp::Arrival item;
        item.message = true;
        item.counts.resize(conns);
        item.payload.resize(h.value);
        const std::array<asio::mutable_buffer, 2> bufs{asio::buffer(item.counts), asio::buffer(item.payload)};
        co_await asio::async_read(c->socket, bufs, asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
        std::unique_lock lock(p.mutex);
        if (p.life.attempt() != c->attempt) co_return;
        p.arrivals.push(std::move(item));
        applyPending(p, lock);
        break;
      }
    }
    if (ec) break;
  }
  if (!stopping.load())
    failPeer(c->peer, PeerState::kFailed, fmt::format("inbound connection {}: {}", c->index, describe(ec)), c->attempt);
}

// ---------------------------------------------------------------------------------------------------------
// Dialling: the dialer's side of the handshake, with retry and back-off, for connect() and for rejoins
// ---------------------------------------------------------------------------------------------------------

asio::awaitable<TcpTransport::Impl::DialOutcome> TcpTransport::Impl::dialHandshake(std::shared_ptr<OutConn> c,
                                                                                   bool rejoin) {
  const NodeIndex peer = c->peer;
  Peer& p = *peers[peer];
  error_code ec;
  const tcp::HelloBytes hello = tcp::encodeHello(
      tcp::Hello{config.protocolVersion, config.self, peer, c->index, config.connectionsPerPeer, tcp::randomNonce()});
  auto retry = [&](std::string why) {
    setLastDialError(p, std::move(why));
    return DialOutcome::kRetry;
  };
  co_await asio::async_write(c->socket, asio::buffer(hello), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return retry(fmt::format("sending the handshake: {}", describe(ec)));
  tcp::ReplyBytes replyBytes{};
  co_await asio::async_read(c->socket, asio::buffer(replyBytes), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return retry(fmt::format("waiting for the handshake reply: {}", describe(ec)));
  const std::string who = nodeName(peer);
  const std::optional<tcp::Reply> reply = tcp::decodeReply(replyBytes);
  if (!reply) {
    handshakeFailure(peer, ErrorCode::kProtocol,
                     fmt::format("tcp transport: {} answered with something other than a tandem transport handshake; "
                                 "check cluster.nodes[{}]", who, peer));
    co_return DialOutcome::kFatal;
  }
  if (reply->version != config.protocolVersion) {
    handshakeFailure(peer, ErrorCode::kVersionMismatch,
                     tcp::versionMismatchMessage(who, reply->version, config.protocolVersion));
    co_return DialOutcome::kFatal;
  }
  switch (reply->status) {
    case tcp::HandshakeStatus::kOk: break;
    case tcp::HandshakeStatus::kConnMismatch:
      handshakeFailure(peer, ErrorCode::kInvalidConfig,
                       tcp::connectionCountMismatchMessage(who, reply->connCount, config.connectionsPerPeer));
      co_return DialOutcome::kFatal;
    default:
      handshakeFailure(peer, ErrorCode::kInvalidConfig,
                       fmt::format("tcp transport: {} (which says it is node {}) refused node {} (status {}); "
                                   "cluster.nodes must list the same nodes in the same order everywhere", who,
                                   reply->node, config.self, static_cast<uint32_t>(reply->status)));
      co_return DialOutcome::kFatal;
  }
  const bool secretMatches = tcp::acceptorMacValid(config.secret, hello, replyBytes);
  // Sent even when the acceptor's MAC did not verify, so the acceptor detects the mismatch and reports it too.
  const tcp::AuthBytes auth = tcp::dialerAuth(config.secret, hello, replyBytes);
  co_await asio::async_write(c->socket, asio::buffer(auth), asio::redirect_error(asio::use_awaitable, ec));
  tcp::ResultBytes result{};
  if (!ec) co_await asio::async_read(c->socket, asio::buffer(result), asio::redirect_error(asio::use_awaitable, ec));
  const tcp::HandshakeStatus resultStatus = tcp::decodeResult(result);
  if (!secretMatches || (!ec && resultStatus == tcp::HandshakeStatus::kBadSecret)) {
    handshakeFailure(peer, ErrorCode::kPermissionDenied, tcp::secretMismatchMessage(who));
    co_return DialOutcome::kFatal;
  }
  if (ec) co_return retry(fmt::format("waiting for the handshake result: {}", describe(ec)));
  if (resultStatus == tcp::HandshakeStatus::kDuplicate && rejoin) {
    // The peer has not seen this node's previous connections end yet (or is another daemon with our index).
    co_return retry(fmt::format("{} still has connection {} from node {}", who, c->index, config.self));
  }
  if (resultStatus == tcp::HandshakeStatus::kDuplicate) {
    handshakeFailure(peer, ErrorCode::kInvalidConfig,
                     fmt::format("tcp transport: {} already has connection {} from node {}; is another daemon "
                                 "configured as node {}?", who, c->index, config.self, config.self));
    co_return DialOutcome::kFatal;
  }
  if (resultStatus != tcp::HandshakeStatus::kOk)
    co_return retry(fmt::format("handshake result {}", static_cast<uint32_t>(resultStatus)));
  co_return DialOutcome::kOk;
}

asio::awaitable<void> TcpTransport::Impl::dial(std::shared_ptr<OutConn> c, Clock::time_point deadline, bool rejoin) {
  Peer& p = *peers[c->peer];
  const NodeAddress addr = p.addr;
  asio::ip::tcp::resolver resolver(c->strand);
  auto backoff = std::chrono::milliseconds(20);
  constexpr auto kMaxBackoff = std::chrono::milliseconds(500);
  for (;;) {
    if (stopping.load() || Clock::now() >= deadline) co_return;
    if (currentAttempt(p) != c->attempt) co_return;  // failed elsewhere (fatal handshake, timeout), or superseded
    // One try (connect + handshake) never outlasts connectTimeoutMs: a frozen peer must not stall a re-dial.
    const auto tryDeadline = Clock::now() + std::chrono::milliseconds(config.connectTimeoutMs);
    asio::steady_timer watchdog(c->strand, std::min(deadline, tryDeadline));
    watchdog.async_wait([c](const error_code& e) {
      if (!e) {
        error_code ignored;
        c->socket.close(ignored);
      }
    });
    error_code ec;
    auto endpoints = co_await resolver.async_resolve(addr.host, std::to_string(addr.port),
                                                     asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) co_await asio::async_connect(c->socket, endpoints, asio::redirect_error(asio::use_awaitable, ec));
    DialOutcome outcome = DialOutcome::kRetry;
    if (ec) {
      setLastDialError(p, fmt::format("connecting to {}: {}", addr.toString(), describe(ec)));
    } else {
      c->socket.set_option(NoDelay(true), ec);
      outcome = co_await dialHandshake(c, rejoin);
    }
    watchdog.cancel();
    if (outcome == DialOutcome::kOk) {
      c->lastTxNs.store(nowNs(), std::memory_order_relaxed);
      c->ready.store(true, std::memory_order_release);
      if (!connectionReady(p, /*outbound=*/true, c->attempt)) {
        error_code ignored;
        c->socket.close(ignored);
        co_return;
      }
      spawn(c->strand, outboundReadLoop(c), "outbound connection");
      c->kick();  // heartbeats may have queued meanwhile
      co_return;
    }
    if (outcome == DialOutcome::kFatal && !rejoin) co_return;
    error_code ignored;
    c->socket.close(ignored);
    const auto wait = outcome == DialOutcome::kFatal ? 10 * kMaxBackoff : backoff;
    asio::steady_timer pause(c->strand, wait);
    co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

asio::awaitable<void> TcpTransport::Impl::outboundReadLoop(std::shared_ptr<OutConn> c) {
  // The acceptor sends nothing after the handshake except a Goodbye; reading detects EOF/reset at once.
  tcp::FrameHeader h{};
  error_code ec;
  co_await asio::async_read(c->socket, asio::buffer(&h, sizeof h), asio::redirect_error(asio::use_awaitable, ec));
  if (stopping.load()) co_return;
  if (!ec && static_cast<tcp::FrameType>(h.type) == tcp::FrameType::kGoodbye) {
    failPeer(c->peer, PeerState::kClosed, fmt::format("{} shut its transport down", nodeName(c->peer)), c->attempt);
  } else if (!ec) {
    failPeer(c->peer, PeerState::kFailed,
             fmt::format("sent an unexpected frame (type {}) on outbound connection {}", h.type, c->index), c->attempt);
  } else {
    failPeer(c->peer, PeerState::kFailed, fmt::format("outbound connection {}: {}", c->index, describe(ec)), c->attempt);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Heartbeats: idle dialled connections send one; a silent accepted connection past the deadline fails the peer
// ---------------------------------------------------------------------------------------------------------

asio::awaitable<void> TcpTransport::Impl::heartbeatLoop() {
  const auto interval = std::chrono::milliseconds(config.heartbeatIntervalMs);
  const int64_t intervalNs = std::chrono::duration_cast<std::chrono::nanoseconds>(interval).count();
  const int64_t deadlineNs = int64_t{config.peerDeadlineMs} * 1'000'000;
  asio::steady_timer timer(timerStrand);
  for (;;) {
    timer.expires_after(interval);
    error_code ec;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (ec || stopping.load()) co_return;
    const int64_t now = nowNs();
    for (auto& pp : peers) {
      if (!pp) continue;
      Peer& p = *pp;
      // The current attempt's connections, also while a failed peer rejoins (its side may already count on them).
      std::vector<std::shared_ptr<OutConn>> out;
      std::vector<std::shared_ptr<InConn>> in;
      {
        std::lock_guard lock(p.mutex);
        out = p.out;
        in = p.in;
      }
      for (auto& c : out) {
        if (!c->ready.load(std::memory_order_acquire)) continue;
        if (now - c->lastTxNs.load(std::memory_order_relaxed) < intervalNs) continue;
        OutFrame f;
        f.header = tcp::heartbeatHeader();
        if (c->enqueue(std::move(f))) c->kick();
      }
      for (auto& c : in) {
        if (!c || !c->ready.load(std::memory_order_acquire)) continue;
        const int64_t silentNs = now - c->lastRxNs.load(std::memory_order_relaxed);
        if (silentNs > deadlineNs) {
          failPeer(p.node, PeerState::kFailed,
                   fmt::format("no frame or heartbeat on connection {} for {} ms (deadline {} ms: "
                               "communicators.peer_lost_deadline_ms)", c->index, silentNs / 1'000'000,
                               config.peerDeadlineMs), c->attempt);
          break;
        }
      }
    }
  }
}

}  // namespace tandem::daemon::transport
