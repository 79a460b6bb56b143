#include "transport/tcp_transport.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "transport/tcp_handshake.hpp"

namespace tandem::daemon::transport {

// ---------------------------------------------------------------------------------------------------------
// Wire formats
// ---------------------------------------------------------------------------------------------------------
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using Strand = asio::strand<asio::io_context::executor_type>;

static_assert(std::endian::native == std::endian::little,
              "the tcp frame header is sent as a little-endian struct; add byte swaps for big-endian hosts");

enum class FrameType : uint8_t { kData = 1, kFlag = 2, kHeartbeat = 3, kGoodbye = 4, kMessage = 5 };

struct FrameHeader {
  uint8_t type;
  uint8_t reserved[3];
  uint32_t regionId;  // the key: the receiver's LocalRegion id
  uint64_t offset;
  uint64_t length;    // payload bytes that follow
  uint64_t value;     // flag value; message: message payload bytes (length - data counts)
};
static_assert(sizeof(FrameHeader) == 32 && std::is_trivially_copyable_v<FrameHeader>);

constexpr uint64_t kHandshakeMagic = 0x3150435444464e54ull;  // "TNFDTCP1"
constexpr std::size_t kHelloBytes = 48;
constexpr std::size_t kReplyPrefixBytes = 40;  // reply fields covered by the MACs (everything but the MAC)
constexpr std::size_t kReplyBytes = kReplyPrefixBytes + 32;
constexpr std::size_t kAuthBytes = 32;
constexpr std::size_t kResultBytes = 8;
constexpr uint64_t kMaxFramePayload = uint64_t{64} << 20;  // receivers refuse larger data frames
constexpr std::size_t kMaxBatchFrames = 256;                // frames per async_write (keeps heartbeats timely)
constexpr uint64_t kMaxBatchBytes = uint64_t{8} << 20;
constexpr NodeIndex kNoNode = UINT32_MAX;

enum class HandshakeStatus : uint32_t {
  kOk = 0,
  kVersionMismatch = 1,
  kWrongNode = 2,     // Hello.to is not the acceptor's index
  kBadNode = 3,       // Hello.from is out of range or the acceptor itself
  kConnMismatch = 4,  // different connection count, or index out of range
  kBadSecret = 5,
  kDuplicate = 6,     // that connection index is already established
};

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::span<const std::byte> bytesOf(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// MAC over a role label, the Hello and the reply fields: binds both nonces, both node indices, the versions.
detail::Sha256Digest handshakeMac(std::string_view secret, std::string_view role, std::span<const std::byte> hello,
                                  std::span<const std::byte> replyPrefix) {
  std::vector<std::byte> msg;
  msg.reserve(32 + hello.size() + replyPrefix.size());
  const std::string label = fmt::format("tandem-tcp {}", role);
  msg.insert(msg.end(), bytesOf(label).begin(), bytesOf(label).end());
  msg.insert(msg.end(), hello.begin(), hello.end());
  msg.insert(msg.end(), replyPrefix.begin(), replyPrefix.end());
  return detail::hmacSha256(bytesOf(secret), msg);
}

std::string describe(const error_code& ec) {
  if (ec == asio::error::eof) return "connection closed (EOF)";
  if (ec == asio::error::connection_reset) return "connection reset by peer";
  return ec.message();
}

template <typename Fn>
auto logExceptions(std::string what, Fn onDone) {
  return [what = std::move(what), onDone](std::exception_ptr e) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        spdlog::error("tcp transport: {} failed: {}", what, ex.what());
      }
    }
    onDone();
  };
}

constexpr auto kIgnore = [] {};

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Impl
// ---------------------------------------------------------------------------------------------------------

struct TcpTransport::Impl {
  struct Region {
    MemoryDesc desc;
  };

  struct OutFrame {
    FrameHeader header{};
    const std::byte* payload = nullptr;
    uint64_t payloadBytes = 0;
    std::vector<std::byte> owned;  // staged device data or flag counts; payload points into it
    bool counted = false;          // a data or flag frame: counts towards signalled completions
    bool goodbye = false;
  };

  struct OutConn : std::enable_shared_from_this<OutConn> {
    OutConn(Impl& i, NodeIndex p, uint32_t idx, uint64_t att)
        : impl(i), peer(p), index(idx), attempt(att), strand(asio::make_strand(i.io)), socket(strand) {}
    Impl& impl;
    const NodeIndex peer;
    const uint32_t index;
    const uint64_t attempt;  // the peer's connection attempt this connection belongs to (Peer::attempt)
    Strand strand;
    tcp::socket socket;  // strand only
    std::mutex mutex;    // guards queue, writing, closed
    std::deque<OutFrame> queue;
    bool writing = false;
    bool closed = false;
    std::vector<OutFrame> inflight;             // strand only
    std::vector<asio::const_buffer> buffers;    // strand only
    std::atomic<int64_t> lastTxNs{0};
    std::atomic<bool> ready{false};
    std::atomic<uint64_t> writtenFrames{0};  // counted frames handed to the kernel, in queue order

    // False once the connection is closed (the peer failed); the frame is dropped.
    bool enqueue(OutFrame&& frame) {
      std::lock_guard lock(mutex);
      if (closed) return false;
      queue.push_back(std::move(frame));
      return true;
    }
    void kick() {
      {
        std::lock_guard lock(mutex);
        if (writing || closed || queue.empty() || !ready.load(std::memory_order_acquire)) return;
        writing = true;
      }
      asio::post(strand, [self = shared_from_this()] { self->startWrite(); });
    }
    void startWrite() {
      inflight.clear();
      {
        std::lock_guard lock(mutex);
        uint64_t bytes = 0;
        while (!queue.empty() && inflight.size() < kMaxBatchFrames && bytes < kMaxBatchBytes) {
          bytes += sizeof(FrameHeader) + queue.front().payloadBytes;
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
    void onWritten(const error_code& ec) {
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
        impl.failPeer(peer, PeerState::kFailed,
                      fmt::format("write on connection {} failed: {}", index, describe(ec)), attempt);
        return;
      }
      lastTxNs.store(nowNs(), std::memory_order_relaxed);
      startWrite();
    }
    // Marks the connection closed, drops queued frames, closes the socket on its strand.
    void shutdown() {
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
  };

  struct InConn : std::enable_shared_from_this<InConn> {
    explicit InConn(Impl& i) : impl(i), strand(asio::make_strand(i.io)), socket(strand) {}
    Impl& impl;
    Strand strand;
    tcp::socket socket;
    NodeIndex peer = kNoNode;  // set by the handshake
    uint32_t index = 0;
    uint64_t attempt = 0;      // set by the handshake: the peer's Peer::attempt it was accepted into
    std::atomic<int64_t> lastRxNs{0};
    std::atomic<bool> ready{false};
    std::vector<std::byte> staging;  // device-region payloads
    FrameHeader goodbye{};
  };

  // An arrived flag or message, applied (handled) in arrival order once its data counts are reached.
  struct PendingItem {
    std::vector<uint64_t> counts;  // data frames per connection that must have landed first
    bool message = false;
    std::shared_ptr<Region> region;  // flag: where to store `value`
    uint64_t offset = 0;
    uint64_t value = 0;
    std::vector<std::byte> payload;  // message
  };

  struct Peer {
    NodeIndex node = 0;
    NodeAddress addr;
    std::atomic<PeerState> state{PeerState::kConnecting};
    mutable std::mutex mutex;  // guards everything below except the send side
    std::string reason;
    ErrorCode fatalCode = ErrorCode::kOk;  // handshake failure that connect() reports
    std::string fatal;
    std::string lastDialError;
    // The current attempt's connections. `out` is replaced (a new attempt) only with sendMutex, completionMutex and
    // mutex all held, so any one of them makes it safe to read.
    std::vector<std::shared_ptr<OutConn>> out;
    std::vector<std::shared_ptr<InConn>> in;    // slots filled by handshakes
    // Connection attempt: 0 for connect(), +1 each time the peer fails (or a rejoin attempt breaks). Connections
    // carry the attempt they belong to; anything a connection of an older attempt reports is ignored.
    uint64_t attempt = 0;
    bool rejoining = false;                 // a failed/closed peer: handshakes from it are accepted again
    std::atomic<uint64_t> generation{0};    // incarnations: +1 each time the peer becomes connected
    uint32_t outReady = 0, inReady = 0;
    std::vector<uint64_t> recvData;             // per inbound connection: data frames fully written
    std::deque<PendingItem> pending;            // flags and messages in arrival order
    bool delivering = false;                    // a thread runs the message handler for pending.front()
    // Send side: serialises striping and the per-connection counts flags carry.
    std::mutex sendMutex;
    std::vector<uint64_t> sentData;    // per connection: data frames queued (what flags carry)
    std::vector<uint64_t> sentFrames;  // per connection: data + flag frames queued
    // Signalled ops in issue order, each with the sentFrames it needs written (guarded by completionMutex;
    // pushed while sendMutex is held, so the order is the issue order).
    struct PendingCompletion {
      uint64_t cookie;
      std::vector<uint64_t> required;
    };
    std::mutex completionMutex;
    std::deque<PendingCompletion> pendingCompletions;
  };

  explicit Impl(TcpConfig c)
      : config(std::move(c)),
        work(asio::make_work_guard(io)),
        acceptor(io),
        acceptStrand(asio::make_strand(io)),
        timerStrand(asio::make_strand(io)) {}

  // ---- members (io first: destroyed last, after every socket) ----
  TcpConfig config;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  tcp::acceptor acceptor;
  Strand acceptStrand;
  Strand timerStrand;
  std::vector<std::thread> threads;

  std::vector<NodeAddress> nodes;             // fixed once connect() publishes nodeCount
  std::vector<std::unique_ptr<Peer>> peers;   // index = node; null for self
  std::atomic<uint32_t> nodeCount{0};
  bool connectCalled = false;

  mutable std::shared_mutex regionsMutex;
  std::unordered_map<uint32_t, std::shared_ptr<Region>> regions;
  uint32_t nextRegionId = 1;

  std::mutex completionsMutex;
  std::deque<Completion> completions;
  std::atomic<bool> anyCompletions{false};

  std::mutex stateMutex;  // with stateCv: connect() and shutdown wait for peer/goodbye changes
  std::condition_variable stateCv;
  int goodbyesPending = 0;  // guarded by stateMutex

  std::mutex handlerMutex;
  std::function<void(NodeIndex, const PeerStatus&)> failureHandler;
  std::function<void(NodeIndex)> rejoinHandler;
  using MessageHandler = std::function<void(NodeIndex, std::span<const std::byte>)>;
  std::shared_ptr<const MessageHandler> messageHandler;  // guarded by handlerMutex; copied per delivery
  std::atomic<bool> warnedNoMessageHandler{false};
  std::atomic<bool> stopping{false};

  // ---- helpers ----
  std::string nodeName(NodeIndex n) const {
    return n < nodes.size() ? fmt::format("{} (node {})", nodes[n].toString(), n) : fmt::format("node {}", n);
  }

  void notifyState() {
    std::lock_guard lock(stateMutex);
    stateCv.notify_all();
  }

  void goodbyeSent(int n) {
    std::lock_guard lock(stateMutex);
    goodbyesPending -= n;
    stateCv.notify_all();
  }

  void pushCompletions(const std::vector<Completion>& done) {
    if (done.empty()) return;
    std::lock_guard lock(completionsMutex);
    completions.insert(completions.end(), done.begin(), done.end());
    anyCompletions.store(true, std::memory_order_release);
  }

  // A connection of `node` wrote more frames: reports the signalled ops whose frames (and every frame queued
  // to that peer before them, on every connection) have all been handed to the kernel.
  void completeWritten(NodeIndex node) {
    Peer& p = *peers[node];
    std::vector<Completion> done;
    {
      std::lock_guard lock(p.completionMutex);
      while (!p.pendingCompletions.empty()) {
        const auto& pc = p.pendingCompletions.front();
        bool written = true;
        for (std::size_t c = 0; c < pc.required.size() && written; ++c)
          written = p.out[c]->writtenFrames.load(std::memory_order_relaxed) >= pc.required[c];
        if (!written) break;
        done.push_back(Completion{pc.cookie, node, ErrorCode::kOk});
        p.pendingCompletions.pop_front();
      }
    }
    pushCompletions(done);
  }

  // Records a signalled op after its frames were queued. p.sendMutex held.
  void expectCompletion(Peer& p, uint64_t cookie) {
    {
      std::lock_guard lock(p.completionMutex);
      p.pendingCompletions.push_back(Peer::PendingCompletion{cookie, p.sentFrames});
    }
    // The peer may have failed after our frames were queued and after failPeer drained the list (it sets the
    // state before draining under completionMutex, so seeing the state here covers that case).
    const PeerState s = p.state.load(std::memory_order_acquire);
    if (s == PeerState::kFailed || s == PeerState::kClosed) {
      std::vector<Completion> failed;
      {
        std::lock_guard lock(p.completionMutex);
        for (const auto& pc : p.pendingCompletions) failed.push_back(Completion{pc.cookie, p.node, ErrorCode::kPeerLost});
        p.pendingCompletions.clear();
      }
      pushCompletions(failed);
      return;
    }
    completeWritten(p.node);  // a write chain that was already running may have sent every frame by now
  }

  std::shared_ptr<Region> findRegion(uint32_t id) const {
    std::shared_lock lock(regionsMutex);
    auto it = regions.find(id);
    return it == regions.end() ? nullptr : it->second;
  }

  Peer& peerRef(NodeIndex node) const {
    const uint32_t n = nodeCount.load(std::memory_order_acquire);
    if (n == 0) fail(ErrorCode::kUnavailable, "tcp transport: not connected yet (call connect first)");
    if (node >= n || node == config.self)
      fail(ErrorCode::kInvalidArgument, "tcp transport: node {} is not a peer of node {} ({} nodes)", node, config.self, n);
    return *peers[node];
  }

  // Throws unless the peer is connected: kPeerLost (with its reason) once failed or closed.
  void checkConnected(Peer& p) const {
    const PeerState s = p.state.load(std::memory_order_acquire);
    if (s == PeerState::kConnected) return;
    if (s == PeerState::kConnecting)
      fail(ErrorCode::kUnavailable, "tcp transport: {} is not connected yet", nodeName(p.node));
    std::lock_guard lock(p.mutex);
    fail(ErrorCode::kPeerLost, "tcp transport: peer {} lost: {}", nodeName(p.node), p.reason);
  }

  static constexpr uint64_t kAnyAttempt = ~uint64_t{0};

  // Marks a peer failed (or closed), once per incarnation: closes its connections, fails its queued signalled ops,
  // drops its pending flags and messages, wakes connect(), calls the failure handler, then starts re-dialing it
  // (a new attempt) so that it can rejoin. `attempt` is the attempt of the connection that saw the problem:
  // reports from an older attempt are ignored, and a report from the current attempt of a peer that is already
  // failed (a half-built rejoin broke) quietly starts another attempt.
  void failPeer(NodeIndex node, PeerState newState, std::string reason, uint64_t attempt = kAnyAttempt) {
    if (node >= peers.size() || !peers[node]) return;
    Peer& p = *peers[node];
    std::vector<std::shared_ptr<InConn>> in;
    std::vector<std::shared_ptr<OutConn>> out;
    bool firstFailure = true;
    uint64_t newAttempt = 0;
    {
      std::lock_guard lock(p.mutex);
      if (attempt != kAnyAttempt && attempt != p.attempt) return;  // a connection of an older attempt
      const PeerState cur = p.state.load(std::memory_order_acquire);
      if (cur == PeerState::kFailed || cur == PeerState::kClosed) {
        if (attempt == kAnyAttempt || !p.rejoining) return;
        firstFailure = false;  // a connection of the rejoin attempt broke: start over
        p.lastDialError = std::move(reason);
      } else {
        p.reason = std::move(reason);
        p.state.store(newState, std::memory_order_release);
      }
      in = p.in;
      out = p.out;
      // Nothing of this attempt may reach the next one: inbound connections still running find the attempt
      // changed and stop; pending flags and messages are dropped.
      p.attempt += 1;
      newAttempt = p.attempt;
      p.rejoining = false;
      p.in.assign(p.in.size(), nullptr);
      p.outReady = 0;
      p.inReady = 0;
      p.recvData.assign(p.recvData.size(), 0);
      p.pending.clear();  // a thread delivering the front message notices the attempt change (applyPending)
    }
    std::vector<Completion> failed;
    for (auto& c : out) c->shutdown();
    {
      std::lock_guard lock(p.completionMutex);
      for (const auto& pc : p.pendingCompletions) failed.push_back(Completion{pc.cookie, node, ErrorCode::kPeerLost});
      p.pendingCompletions.clear();
    }
    for (auto& c : in) {
      if (!c) continue;
      asio::post(c->strand, [c] {
        error_code ignored;
        c->socket.close(ignored);
      });
    }
    pushCompletions(failed);
    if (firstFailure) {
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
    startRejoin(p, newAttempt);
  }

  std::string peerStatusReason(Peer& p) const {
    std::lock_guard lock(p.mutex);
    return p.reason;
  }

  // Installs fresh outbound connections for `attempt` and dials them until they connect or the attempt is
  // superseded; inbound handshakes from the peer are accepted again. Quiet: the reason of each try is kept in
  // lastDialError only.
  void startRejoin(Peer& p, uint64_t attempt) {
    if (stopping.load()) return;
    std::vector<std::shared_ptr<OutConn>> conns;
    for (uint32_t k = 0; k < config.connectionsPerPeer; ++k)
      conns.push_back(std::make_shared<OutConn>(*this, p.node, k, attempt));
    std::vector<Completion> failed;
    {
      std::scoped_lock lock(p.sendMutex, p.completionMutex, p.mutex);
      if (p.attempt != attempt || stopping.load()) return;  // superseded meanwhile
      p.out = conns;
      p.sentData.assign(p.sentData.size(), 0);
      p.sentFrames.assign(p.sentFrames.size(), 0);
      for (const auto& pc : p.pendingCompletions) failed.push_back(Completion{pc.cookie, p.node, ErrorCode::kPeerLost});
      p.pendingCompletions.clear();
      p.rejoining = true;
    }
    pushCompletions(failed);
    for (auto& c : conns) asio::co_spawn(c->strand, dial(c, Clock::time_point::max(), true), logExceptions("re-dial", kIgnore));
  }

  uint64_t currentAttempt(Peer& p) const {
    std::lock_guard lock(p.mutex);
    return p.attempt;
  }

  // A handshake problem that connect() must report. Ignored once the peer is connected: a stranger that
  // claims to be node N must not be able to take down the live node N.
  void handshakeFailure(NodeIndex node, ErrorCode code, std::string message) {
    if (node >= peers.size() || !peers[node]) return;
    Peer& p = *peers[node];
    {
      std::lock_guard lock(p.mutex);
      if (p.state.load() != PeerState::kConnecting) {
        if (p.rejoining) {  // a re-dial or a rejoin handshake: retried quietly
          spdlog::debug("{} (while rejoining)", message);
          p.lastDialError = std::move(message);
        } else {
          spdlog::warn("{} (ignored: the peer is already {})", message, peerStateName(p.state.load()));
        }
        return;
      }
      if (p.fatalCode == ErrorCode::kOk) {
        p.fatalCode = code;
        p.fatal = message;
      }
    }
    failPeer(node, PeerState::kFailed, std::move(message));
  }

  // A connection of `attempt` finished its handshake. False when the attempt was superseded (the caller closes it).
  // The last one of an attempt makes the peer connected: a new incarnation (generation + 1); when the peer had
  // failed before, the rejoin handler is called.
  bool connectionReady(Peer& p, bool outbound, uint64_t attempt) {
    bool connected = false, rejoined = false;
    uint64_t generation = 0;
    {
      std::lock_guard lock(p.mutex);
      if (attempt != p.attempt) return false;
      (outbound ? p.outReady : p.inReady) += 1;
      const PeerState s = p.state.load();
      const bool eligible = s == PeerState::kConnecting ||
                            (p.rejoining && (s == PeerState::kFailed || s == PeerState::kClosed));
      if (p.outReady == config.connectionsPerPeer && p.inReady == config.connectionsPerPeer && eligible) {
        rejoined = s != PeerState::kConnecting;
        if (rejoined) {
          p.reason.clear();
          p.fatalCode = ErrorCode::kOk;
          p.fatal.clear();
          p.lastDialError.clear();
          p.rejoining = false;
        }
        generation = p.generation.fetch_add(1) + 1;
        p.state.store(PeerState::kConnected, std::memory_order_release);
        connected = true;
      }
    }
    if (connected) {
      spdlog::info("tcp transport: node {} {} {} (generation {})", config.self, rejoined ? "reconnected to" : "connected to",
                   nodeName(p.node), generation);
    }
    notifyState();
    if (rejoined && !stopping.load()) {
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

  // Applies arrived flags and hands arrived messages to the handler, strictly in arrival order, while their
  // per-connection data counts are met. `lock` holds p.mutex; it is released while the message handler runs, and
  // one thread at a time runs it (p.delivering): a thread that finds it running leaves the rest to that thread,
  // which looks at the queue again when the handler returns.
  void applyPending(Peer& p, std::unique_lock<std::mutex>& lock) {
    while (!p.pending.empty() && !p.delivering) {
      PendingItem& f = p.pending.front();
      for (std::size_t c = 0; c < f.counts.size(); ++c) {
        if (p.recvData[c] < f.counts[c]) return;
      }
      if (f.message) {
        p.delivering = true;
        const uint64_t attempt = p.attempt;
        std::vector<std::byte> payload = std::move(f.payload);
        lock.unlock();
        deliverMessage(p.node, payload);
        lock.lock();
        p.delivering = false;
        // Still the front, unless the peer failed meanwhile (failPeer cleared the queue; what is there now
        // belongs to the next attempt and is looked at by this loop).
        if (p.attempt == attempt) p.pending.pop_front();
        continue;
      }
      std::byte* target = static_cast<std::byte*>(f.region->desc.addr) + f.offset;
      if (f.region->desc.kind == MemoryKind::kDevice) {
        // Synchronous copies: every data copy to the device has completed before this one starts.
        config.deviceCopier->toDevice(target, &f.value, sizeof f.value);
      } else {
        // release: the data bytes of every counted frame were written before (by this thread, or by another
        // connection's thread that then released p.mutex, which we hold). Pairs with the consumer's
        // load-acquire of the flag (e.g. std::atomic_ref<uint64_t>(flag).load(acquire) in the tests).
        std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(target)).store(f.value, std::memory_order_release);
      }
      p.pending.pop_front();
    }
  }

  // Calls the message handler (no transport lock held). The data the message waited for was written by threads
  // that released p.mutex before the caller acquired it, so the handler sees it.
  void deliverMessage(NodeIndex from, std::span<const std::byte> payload) {
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

  // ---- coroutines ----
  asio::awaitable<void> acceptLoop();
  asio::awaitable<void> serveInbound(std::shared_ptr<InConn> c);
  asio::awaitable<void> inboundLoop(std::shared_ptr<InConn> c);
  asio::awaitable<void> dial(std::shared_ptr<OutConn> c, Clock::time_point deadline, bool rejoin);
  enum class DialOutcome { kOk, kRetry, kFatal };
  asio::awaitable<DialOutcome> dialHandshake(std::shared_ptr<OutConn> c, bool rejoin);
  asio::awaitable<void> outboundReadLoop(std::shared_ptr<OutConn> c);
  asio::awaitable<void> heartbeatLoop();

  void start();
  void connect(const std::vector<NodeAddress>& list);
  void shutdown();
};


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
    asio::co_spawn(conn->strand, serveInbound(conn), logExceptions("inbound connection", kIgnore));
  }
}

asio::awaitable<void> TcpTransport::Impl::serveInbound(std::shared_ptr<InConn> c) {
  error_code ec;
  c->socket.set_option(tcp::no_delay(true), ec);
  const auto remoteEp = c->socket.remote_endpoint(ec);
  const std::string remote = ec ? std::string("unknown") : fmt::format("{}:{}", remoteEp.address().to_string(), remoteEp.port());
  // A connection that does not finish the handshake in time is closed (strangers, stuck dialers).
  asio::steady_timer watchdog(c->strand, std::chrono::milliseconds(config.connectTimeoutMs));
  watchdog.async_wait([c](const error_code& e) {
    if (!e) {
      error_code ignored;
      c->socket.close(ignored);
    }
  });

  std::array<std::byte, kHelloBytes> hello{};
  co_await asio::async_read(c->socket, asio::buffer(hello), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    spdlog::debug("tcp transport: connection from {} ended before its handshake: {}", remote, describe(ec));
    co_return;
  }
  detail::WireReader r(hello, "tcp hello");
  if (r.get<uint64_t>() != kHandshakeMagic) {
    spdlog::warn("tcp transport: rejected a connection from {}: not a tandem transport handshake", remote);
    co_return;
  }
  const auto version = r.get<uint32_t>();
  const auto from = r.get<uint32_t>();
  const auto to = r.get<uint32_t>();
  const auto connIndex = r.get<uint32_t>();
  const auto connCount = r.get<uint32_t>();
  const uint32_t n = nodeCount.load(std::memory_order_acquire);
  const bool fromValid = from < n && from != config.self;

  HandshakeStatus status = HandshakeStatus::kOk;
  if (version != config.protocolVersion) {
    status = HandshakeStatus::kVersionMismatch;
  } else if (to != config.self) {
    status = HandshakeStatus::kWrongNode;
  } else if (!fromValid) {
    status = HandshakeStatus::kBadNode;
  } else if (connCount != config.connectionsPerPeer || connIndex >= connCount) {
    status = HandshakeStatus::kConnMismatch;
  }
  std::vector<std::byte> reply;
  detail::WireWriter w(reply);
  w.put<uint64_t>(kHandshakeMagic);
  w.put<uint32_t>(config.protocolVersion);
  w.put<uint32_t>(static_cast<uint32_t>(status));
  w.put<uint32_t>(config.self);
  w.put<uint32_t>(config.connectionsPerPeer);
  w.putBytes(detail::randomNonce());
  const auto macA = handshakeMac(config.secret, "acceptor", hello, reply);
  w.putBytes(std::as_bytes(std::span(macA)));
  co_await asio::async_write(c->socket, asio::buffer(reply), asio::redirect_error(asio::use_awaitable, ec));

  const std::string who = fromValid ? nodeName(from) : fmt::format("{} (claims node {})", remote, from);
  switch (status) {
    case HandshakeStatus::kOk: break;
    case HandshakeStatus::kVersionMismatch:
      handshakeFailure(from, ErrorCode::kVersionMismatch,
                       fmt::format("tcp transport: peer {} speaks protocol version {}, this node speaks {}; run the "
                                   "same tandem release on every node", who, version, config.protocolVersion));
      if (!fromValid)
        spdlog::warn("tcp transport: rejected {}: protocol version {} (this node speaks {})", who, version,
                     config.protocolVersion);
      co_return;
    case HandshakeStatus::kConnMismatch:
      handshakeFailure(from, ErrorCode::kInvalidConfig,
                       fmt::format("tcp transport: peer {} uses {} connections per peer, this node {}; set "
                                   "cluster.connections_per_peer identically on every node", who, connCount,
                                   config.connectionsPerPeer));
      co_return;
    default:
      spdlog::warn("tcp transport: rejected {}: it addressed node {} but this is node {} of {}; cluster.nodes must "
                   "list the same nodes in the same order everywhere", who, to, config.self, n);
      co_return;
  }
  if (ec) co_return;

  std::array<std::byte, kAuthBytes> auth{};
  co_await asio::async_read(c->socket, asio::buffer(auth), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    spdlog::debug("tcp transport: {} hung up during the handshake: {}", who, describe(ec));
    co_return;
  }
  const auto expected = handshakeMac(config.secret, "dialer", hello, std::span(reply).first(kReplyPrefixBytes));
  HandshakeStatus result = HandshakeStatus::kOk;
  if (!detail::macEqual(auth, std::as_bytes(std::span(expected)))) {
    result = HandshakeStatus::kBadSecret;
  } else {
    Peer& p = *peers[from];
    std::lock_guard lock(p.mutex);
    const PeerState s = p.state.load();
    // Accepted while connect() runs, and again once the peer failed or closed (it restarted and rejoins).
    const bool open = s == PeerState::kConnecting ||
                      (p.rejoining && (s == PeerState::kFailed || s == PeerState::kClosed));
    if (p.in[connIndex] || !open) {
      result = HandshakeStatus::kDuplicate;
    } else {
      c->peer = from;
      c->index = connIndex;
      c->attempt = p.attempt;
      c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
      p.in[connIndex] = c;
    }
  }
  std::vector<std::byte> res;
  detail::WireWriter rw(res);
  rw.put<uint32_t>(static_cast<uint32_t>(result));
  rw.put<uint32_t>(0);
  co_await asio::async_write(c->socket, asio::buffer(res), asio::redirect_error(asio::use_awaitable, ec));
  if (result == HandshakeStatus::kBadSecret) {
    handshakeFailure(from, ErrorCode::kPermissionDenied,
                     fmt::format("tcp transport: peer {} presented a different cluster secret; set cluster.secret "
                                 "identically on every node", who));
    co_return;
  }
  if (result == HandshakeStatus::kDuplicate) {
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
    failPeer(from, PeerState::kFailed, fmt::format("handshake on inbound connection {} failed: {}", connIndex, describe(ec)),
             c->attempt);
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
  FrameHeader h{};
  std::vector<uint64_t> counts(conns);
  for (;;) {
    co_await asio::async_read(c->socket, asio::buffer(&h, sizeof h), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;
    c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
    if (h.reserved[0] != 0 || h.reserved[1] != 0 || h.reserved[2] != 0) co_return protocolError("reserved header bytes set");
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kHeartbeat:
        if (h.length != 0) co_return protocolError("heartbeat with a payload");
        break;
      case FrameType::kGoodbye:
        failPeer(c->peer, PeerState::kClosed, fmt::format("{} shut its transport down", nodeName(c->peer)), c->attempt);
        co_return;
      case FrameType::kData: {
        if (h.length == 0 || h.length > kMaxFramePayload)
          co_return protocolError(fmt::format("data frame of {} bytes (limit {})", h.length, kMaxFramePayload));
        std::shared_ptr<Region> region = findRegion(h.regionId);
        if (!region) co_return protocolError(fmt::format("write to region {} which this node has not registered", h.regionId));
        if (!detail::inBounds(h.offset, h.length, region->desc.bytes))
          co_return protocolError(fmt::format("write to [{}, +{}) of region {} which has {} bytes", h.offset, h.length,
                                              h.regionId, region->desc.bytes));
        std::byte* target = static_cast<std::byte*>(region->desc.addr) + h.offset;
        const bool device = region->desc.kind == MemoryKind::kDevice;
        if (device) c->staging.resize(h.length);
        std::byte* landing = device ? c->staging.data() : target;
        co_await asio::async_read(c->socket, asio::buffer(landing, h.length), asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        if (device) config.deviceCopier->toDevice(target, landing, h.length);
        c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
        std::unique_lock lock(p.mutex);
        if (p.attempt != c->attempt) co_return;  // the peer failed meanwhile: nothing of it reaches the next attempt
        p.recvData[c->index] += 1;
        applyPending(p, lock);
        break;
      }
      case FrameType::kFlag: {
        if (h.length != conns * sizeof(uint64_t))
          co_return protocolError(fmt::format("flag carries {} bytes of counts, expected {}", h.length, conns * 8));
        co_await asio::async_read(c->socket, asio::buffer(counts), asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        std::shared_ptr<Region> region = findRegion(h.regionId);
        if (!region) co_return protocolError(fmt::format("flag in region {} which this node has not registered", h.regionId));
        const auto addr = reinterpret_cast<uintptr_t>(region->desc.addr) + h.offset;
        if (h.offset % 8 != 0 || addr % 8 != 0 || !detail::inBounds(h.offset, 8, region->desc.bytes))
          co_return protocolError(fmt::format("flag at offset {} of region {} ({} bytes) is misaligned or out of bounds",
                                              h.offset, h.regionId, region->desc.bytes));
        std::unique_lock lock(p.mutex);
        if (p.attempt != c->attempt) co_return;
        PendingItem item;
        item.counts = counts;
        item.region = std::move(region);
        item.offset = h.offset;
        item.value = h.value;
        p.pending.push_back(std::move(item));
        applyPending(p, lock);
        break;
      }
      case FrameType::kMessage: {
        // value: the message's bytes, checked against the limit before anything is allocated; length: the data
        // counts (as a flag carries them) plus those bytes.
        if (c->index != 0) co_return protocolError(fmt::format("control message on connection {} (not 0)", c->index));
        if (h.regionId != 0 || h.offset != 0) co_return protocolError("control message with a region or offset");
        if (h.value > TcpTransport::kMaxMessageBytes)
          co_return protocolError(fmt::format("control message of {} bytes (limit {})", h.value,
                                              TcpTransport::kMaxMessageBytes));
        if (h.length != conns * sizeof(uint64_t) + h.value)
          co_return protocolError(fmt::format("control message frame of {} bytes carries {} message bytes and {} "
                                              "connections' counts", h.length, h.value, conns));
        PendingItem item;
        item.message = true;
        item.counts.resize(conns);
        item.payload.resize(h.value);
        const std::array<asio::mutable_buffer, 2> bufs{asio::buffer(item.counts), asio::buffer(item.payload)};
        co_await asio::async_read(c->socket, bufs, asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        c->lastRxNs.store(nowNs(), std::memory_order_relaxed);
        std::unique_lock lock(p.mutex);
        if (p.attempt != c->attempt) co_return;
        p.pending.push_back(std::move(item));
        applyPending(p, lock);
        break;
      }
      default: co_return protocolError(fmt::format("unknown frame type {}", h.type));
    }
  }
  if (!stopping.load())
    failPeer(c->peer, PeerState::kFailed, fmt::format("inbound connection {}: {}", c->index, describe(ec)), c->attempt);
}

asio::awaitable<TcpTransport::Impl::DialOutcome> TcpTransport::Impl::dialHandshake(std::shared_ptr<OutConn> c, bool rejoin) {
  const NodeIndex peer = c->peer;
  Peer& p = *peers[peer];
  error_code ec;
  std::vector<std::byte> hello;
  detail::WireWriter w(hello);
  w.put<uint64_t>(kHandshakeMagic);
  w.put<uint32_t>(config.protocolVersion);
  w.put<uint32_t>(config.self);
  w.put<uint32_t>(peer);
  w.put<uint32_t>(c->index);
  w.put<uint32_t>(config.connectionsPerPeer);
  w.put<uint32_t>(0);
  w.putBytes(detail::randomNonce());
  auto retry = [&](std::string why) {
    std::lock_guard lock(p.mutex);
    p.lastDialError = std::move(why);
    return DialOutcome::kRetry;
  };
  co_await asio::async_write(c->socket, asio::buffer(hello), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return retry(fmt::format("sending the handshake: {}", describe(ec)));
  std::array<std::byte, kReplyBytes> reply{};
  co_await asio::async_read(c->socket, asio::buffer(reply), asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return retry(fmt::format("waiting for the handshake reply: {}", describe(ec)));
  detail::WireReader r(reply, "tcp hello reply");
  const std::string who = nodeName(peer);
  if (r.get<uint64_t>() != kHandshakeMagic) {
    handshakeFailure(peer, ErrorCode::kProtocol,
                     fmt::format("tcp transport: {} answered with something other than a tandem transport handshake; "
                                 "check cluster.nodes[{}]", who, peer));
    co_return DialOutcome::kFatal;
  }
  const auto version = r.get<uint32_t>();
  const auto status = static_cast<HandshakeStatus>(r.get<uint32_t>());
  const auto theirNode = r.get<uint32_t>();
  const auto theirConns = r.get<uint32_t>();
  if (version != config.protocolVersion) {
    handshakeFailure(peer, ErrorCode::kVersionMismatch,
                     fmt::format("tcp transport: peer {} speaks protocol version {}, this node speaks {}; run the same "
                                 "tandem release on every node", who, version, config.protocolVersion));
    co_return DialOutcome::kFatal;
  }
  switch (status) {
    case HandshakeStatus::kOk: break;
    case HandshakeStatus::kConnMismatch:
      handshakeFailure(peer, ErrorCode::kInvalidConfig,
                       fmt::format("tcp transport: peer {} uses {} connections per peer, this node {}; set "
                                   "cluster.connections_per_peer identically on every node", who, theirConns,
                                   config.connectionsPerPeer));
      co_return DialOutcome::kFatal;
    default:
      handshakeFailure(peer, ErrorCode::kInvalidConfig,
                       fmt::format("tcp transport: {} (which says it is node {}) refused node {} (status {}); "
                                   "cluster.nodes must list the same nodes in the same order everywhere", who,
                                   theirNode, config.self, static_cast<uint32_t>(status)));
      co_return DialOutcome::kFatal;
  }
  const auto replyPrefix = std::span<const std::byte>(reply).first(kReplyPrefixBytes);
  const auto expected = handshakeMac(config.secret, "acceptor", hello, replyPrefix);
  const bool secretMatches =
      detail::macEqual(std::span<const std::byte>(reply).subspan(kReplyPrefixBytes), std::as_bytes(std::span(expected)));
  // Sent even when the acceptor's MAC did not verify, so the acceptor detects the mismatch and reports it too.
  const auto macD = handshakeMac(config.secret, "dialer", hello, replyPrefix);
  co_await asio::async_write(c->socket, asio::buffer(macD), asio::redirect_error(asio::use_awaitable, ec));
  std::array<std::byte, kResultBytes> result{};
  if (!ec) co_await asio::async_read(c->socket, asio::buffer(result), asio::redirect_error(asio::use_awaitable, ec));
  detail::WireReader rr(result, "tcp handshake result");
  const auto resultStatus = static_cast<HandshakeStatus>(rr.get<uint32_t>());
  if (!secretMatches || (!ec && resultStatus == HandshakeStatus::kBadSecret)) {
    handshakeFailure(peer, ErrorCode::kPermissionDenied,
                     fmt::format("tcp transport: peer {} presented a different cluster secret; set cluster.secret "
                                 "identically on every node", who));
    co_return DialOutcome::kFatal;
  }
  if (ec) co_return retry(fmt::format("waiting for the handshake result: {}", describe(ec)));
  if (resultStatus == HandshakeStatus::kDuplicate && rejoin) {
    // The peer has not seen this node's previous connections end yet (or is another daemon with our index).
    co_return retry(fmt::format("{} still has connection {} from node {}", who, c->index, config.self));
  }
  if (resultStatus == HandshakeStatus::kDuplicate) {
    handshakeFailure(peer, ErrorCode::kInvalidConfig,
                     fmt::format("tcp transport: {} already has connection {} from node {}; is another daemon "
                                 "configured as node {}?", who, c->index, config.self, config.self));
    co_return DialOutcome::kFatal;
  }
  if (resultStatus != HandshakeStatus::kOk)
    co_return retry(fmt::format("handshake result {}", static_cast<uint32_t>(resultStatus)));
  co_return DialOutcome::kOk;
}

// `rejoin`: a re-dial of a failed peer, until it connects or the attempt is superseded; fatal handshake
// outcomes are retried too (less often), since the peer may be restarted with a fixed configuration.
asio::awaitable<void> TcpTransport::Impl::dial(std::shared_ptr<OutConn> c, Clock::time_point deadline, bool rejoin) {
  Peer& p = *peers[c->peer];
  const NodeAddress addr = p.addr;
  tcp::resolver resolver(c->strand);
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
      std::lock_guard lock(p.mutex);
      p.lastDialError = fmt::format("connecting to {}: {}", addr.toString(), describe(ec));
    } else {
      c->socket.set_option(tcp::no_delay(true), ec);
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
      asio::co_spawn(c->strand, outboundReadLoop(c), logExceptions("outbound connection", kIgnore));
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
  FrameHeader h{};
  error_code ec;
  co_await asio::async_read(c->socket, asio::buffer(&h, sizeof h), asio::redirect_error(asio::use_awaitable, ec));
  if (stopping.load()) co_return;
  if (!ec && static_cast<FrameType>(h.type) == FrameType::kGoodbye) {
    failPeer(c->peer, PeerState::kClosed, fmt::format("{} shut its transport down", nodeName(c->peer)), c->attempt);
  } else if (!ec) {
    failPeer(c->peer, PeerState::kFailed,
             fmt::format("sent an unexpected frame (type {}) on outbound connection {}", h.type, c->index), c->attempt);
  } else {
    failPeer(c->peer, PeerState::kFailed, fmt::format("outbound connection {}: {}", c->index, describe(ec)), c->attempt);
  }
}

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
        f.header.type = static_cast<uint8_t>(FrameType::kHeartbeat);
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
  if (c.chunkBytes < 4096 || c.chunkBytes > kMaxFramePayload)
    fail(ErrorCode::kInvalidConfig, "tcp transport: chunk of {} bytes must be in [4096, {}]", c.chunkBytes, kMaxFramePayload);
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
    tcp::resolver resolver(resolveContext);
    const auto results = resolver.resolve(c.listenHost, std::to_string(c.listenPort), ec);
    if (ec || results.empty())
      fail(ErrorCode::kInvalidConfig, "tcp transport: listen address '{}' is neither an IP address nor a name that "
           "resolves ({}); use this node's IP address in cluster.nodes", c.listenHost,
           ec ? ec.message() : "no addresses");
    address = results.begin()->endpoint().address();
  }
  const tcp::endpoint ep(address, c.listenPort);
  acceptor.open(ep.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
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
    auto p = std::make_unique<Peer>();
    p->node = i;
    p->addr = list[i];
    for (uint32_t k = 0; k < conns; ++k) p->out.push_back(std::make_shared<OutConn>(*this, i, k, 0));
    p->in.resize(conns);
    p->recvData.assign(conns, 0);
    p->sentData.assign(conns, 0);
    p->sentFrames.assign(conns, 0);
    peers[i] = std::move(p);
  }
  // release: peers and nodes are complete before any thread that sees nodeCount uses them.
  nodeCount.store(static_cast<uint32_t>(list.size()), std::memory_order_release);
  const auto deadline = Clock::now() + std::chrono::milliseconds(config.connectTimeoutMs);
  asio::co_spawn(acceptStrand, acceptLoop(), logExceptions("accept loop", kIgnore));
  asio::co_spawn(timerStrand, heartbeatLoop(), logExceptions("heartbeat loop", kIgnore));
  for (auto& p : peers) {
    if (!p) continue;
    for (auto& c : p->out) asio::co_spawn(c->strand, dial(c, deadline, false), logExceptions("dial", kIgnore));
  }

  auto settled = [&] {
    for (auto& p : peers) {
      if (!p) continue;
      const PeerState s = p->state.load();
      if (s == PeerState::kConnecting) return false;
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
    if (p->fatalCode != ErrorCode::kOk) throw Error(p->fatalCode, p->fatal);
  }
  std::string missing;
  for (auto& p : peers) {
    if (!p) continue;
    const PeerState s = p->state.load();
    if (s == PeerState::kConnected) continue;
    std::lock_guard lock(p->mutex);
    if (s == PeerState::kConnecting) {
      missing += fmt::format("; {}: {}/{} outgoing and {}/{} incoming connections{}", nodeName(p->node), p->outReady,
                             conns, p->inReady, conns,
                             p->lastDialError.empty() ? std::string() : " (last error: " + p->lastDialError + ")");
    } else {
      missing += fmt::format("; {}: {}", nodeName(p->node), p->reason);
    }
  }
  if (missing.empty()) return;
  const std::string message =
      fmt::format("tcp transport: node {} could not connect to every peer within {} ms{}. Check that tandemd runs "
                  "on those nodes with the same cluster.nodes list, and that the ports are reachable",
                  config.self, config.connectTimeoutMs, missing);
  for (auto& p : peers) {
    if (p && p->state.load() == PeerState::kConnecting) failPeer(p->node, PeerState::kFailed, "not connected by the deadline");
  }
  throw Error(ErrorCode::kTimeout, message);
}

void TcpTransport::Impl::shutdown() {
  stopping.store(true);
  // Goodbye on every established connection, both directions, so peers mark us closed rather than lost.
  std::vector<std::shared_ptr<InConn>> inbound;
  int sent = 0;
  for (auto& pp : peers) {
    if (!pp || pp->state.load() != PeerState::kConnected) continue;
    std::vector<std::shared_ptr<OutConn>> out;
    {
      std::lock_guard lock(pp->mutex);
      out = pp->out;
    }
    for (auto& c : out) {
      OutFrame f;
      f.header.type = static_cast<uint8_t>(FrameType::kGoodbye);
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
      c->goodbye.type = static_cast<uint8_t>(FrameType::kGoodbye);
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
  const uint64_t conns = p.out.size();
  const uint64_t chunk = im.config.chunkBytes;
  for (uint64_t done = 0; done < bytes;) {
    // Chunks are cut at multiples of chunkBytes in the destination region, and each destination chunk always
    // travels on the same connection: two writes to the same bytes then land in the order they were issued
    // (as on one RC QP), while large writes still spread over every connection.
    const uint64_t at = dstOffset + done;
    const uint64_t n = std::min(chunk - at % chunk, bytes - done);
    const auto c = static_cast<uint32_t>((dst.regionId + at / chunk) % conns);
    Impl::OutFrame f;
    f.header.type = static_cast<uint8_t>(FrameType::kData);
    f.header.regionId = dst.regionId;
    f.header.offset = at;
    f.header.length = n;
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
  f.header.type = static_cast<uint8_t>(FrameType::kFlag);
  f.header.regionId = dst.regionId;
  f.header.offset = dstOffset;
  f.header.value = value;
  f.owned.resize(p.sentData.size() * sizeof(uint64_t));
  std::memcpy(f.owned.data(), p.sentData.data(), f.owned.size());  // little-endian (static_assert above)
  f.payload = f.owned.data();
  f.payloadBytes = f.owned.size();
  f.header.length = f.payloadBytes;
  f.counted = true;
  if (!p.out[0]->enqueue(std::move(f))) im.checkConnected(p);
  p.sentFrames[0] += 1;
  if (signal) im.expectCompletion(p, cookie);
}

void TcpTransport::submit() {
  Impl& im = *impl_;
  if (im.nodeCount.load(std::memory_order_acquire) == 0) return;
  for (auto& p : im.peers) {
    if (!p || p->state.load(std::memory_order_relaxed) != PeerState::kConnected) continue;
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
  return PeerStatus{p.state.load(), p.reason};
}

void TcpTransport::setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) {
  std::lock_guard lock(impl_->handlerMutex);
  impl_->failureHandler = std::move(handler);
}

void TcpTransport::setMessageHandler(MessageHandler handler) {
  auto h = handler ? std::make_shared<const Impl::MessageHandler>(std::move(handler)) : nullptr;
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
    f.header.type = static_cast<uint8_t>(FrameType::kMessage);
    const std::size_t countBytes = p.sentData.size() * sizeof(uint64_t);
    f.owned.resize(countBytes + payload.size());
    // The data frames queued before it, per connection, exactly as a flag carries them (little-endian).
    std::memcpy(f.owned.data(), p.sentData.data(), countBytes);
    if (!payload.empty()) std::memcpy(f.owned.data() + countBytes, payload.data(), payload.size());
    f.payload = f.owned.data();
    f.payloadBytes = f.owned.size();
    f.header.length = f.payloadBytes;
    f.header.value = payload.size();
    // Not counted: a message is no signalled op, and the caller's bytes were copied, so no completion waits on it.
    if (!p.out[0]->enqueue(std::move(f))) im.checkConnected(p);  // throws kPeerLost with the reason
    // Start it now, and the writes queued before it, which it waits for on the receiver.
    for (auto& c : p.out) c->kick();
  }
}

uint64_t TcpTransport::peerGeneration(NodeIndex peer) const {
  if (peer == impl_->config.self) return 0;
  return impl_->peerRef(peer).generation.load(std::memory_order_acquire);
}

void TcpTransport::setPeerRejoinHandler(std::function<void(NodeIndex)> handler) {
  std::lock_guard lock(impl_->handlerMutex);
  impl_->rejoinHandler = std::move(handler);
}

}  // namespace tandem::daemon::transport
