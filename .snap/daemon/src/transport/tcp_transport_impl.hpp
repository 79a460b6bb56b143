// TcpTransport's private state, shared by its two source files (included by nothing else):
//   tcp_transport.cpp     the Transport and ControlChannel methods, start/connect/shutdown, and the peer events
//                         (failure, rejoin, readiness, in-order delivery of flags and messages, completions)
//   tcp_connections.cpp   the connections' I/O on Boost.Asio: accepting and dialling with the handshake, re-dialling,
//                         reading frames, writing batches, heartbeats
// The pure logic they drive is in tcp_handshake.hpp, tcp_wire.hpp and tcp_peer.hpp.
#pragma once

// First: Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

#include <atomic>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/tcp_peer.hpp"
#include "transport/tcp_transport.hpp"
#include "transport/tcp_wire.hpp"

namespace tandem::daemon::transport {

namespace asio = boost::asio;
using Socket = asio::ip::tcp::socket;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using Strand = asio::strand<asio::io_context::executor_type>;

inline constexpr NodeIndex kNoNode = UINT32_MAX;

int64_t nowNs();
/// Text for a socket error: EOF and resets in words, else the system's message.
std::string describe(const error_code& ec);

struct TcpTransport::Impl {
  struct Region {
    MemoryDesc desc;
  };

  struct OutFrame {
    tcp::FrameHeader header{};
    const std::byte* payload = nullptr;
    uint64_t payloadBytes = 0;
    std::vector<std::byte> owned;  // staged device data or flag counts; payload points into it
    bool counted = false;          // a data or flag frame: counts towards signalled completions
    bool goodbye = false;
  };

  // A dialled connection: carries this node's frames to the peer; the peer sends back only a Goodbye.
  struct OutConn : std::enable_shared_from_this<OutConn> {
    OutConn(Impl& i, NodeIndex p, uint32_t idx, uint64_t att)
        : impl(i), peer(p), index(idx), attempt(att), strand(asio::make_strand(i.io)), socket(strand) {}
    Impl& impl;
    const NodeIndex peer;
    const uint32_t index;
    const uint64_t attempt;  // the peer's connection attempt this connection belongs to (PeerLifecycle::attempt)
    Strand strand;
    Socket socket;     // strand only
    std::mutex mutex;  // guards queue, writing, closed
    std::deque<OutFrame> queue;
    bool writing = false;
    bool closed = false;
    std::vector<OutFrame> inflight;             // strand only
    std::vector<asio::const_buffer> buffers;    // strand only
    std::atomic<int64_t> lastTxNs{0};
    std::atomic<bool> ready{false};
    std::atomic<uint64_t> writtenFrames{0};  // counted frames handed to the kernel, in queue order

    // False once the connection is closed (the peer failed); the frame is dropped.
    bool enqueue(OutFrame&& frame);
    // Starts a write chain on the strand unless one runs, the queue is empty or the handshake is not done.
    void kick();
    void startWrite();
    void onWritten(const error_code& ec);
    // Marks the connection closed, drops queued frames, closes the socket on its strand.
    void shutdown();
  };

  // An accepted connection: carries the peer's frames to this node.
  struct InConn : std::enable_shared_from_this<InConn> {
    explicit InConn(Impl& i) : impl(i), strand(asio::make_strand(i.io)), socket(strand) {}
    Impl& impl;
    Strand strand;
    Socket socket;
    NodeIndex peer = kNoNode;  // set by the handshake
    uint32_t index = 0;
    uint64_t attempt = 0;      // set by the handshake: the peer's attempt it was accepted into
    std::atomic<int64_t> lastRxNs{0};
    std::atomic<bool> ready{false};
    std::vector<std::byte> staging;  // device-region payloads
    tcp::FrameHeader goodbye{};
  };

  struct Peer {
    explicit Peer(uint32_t conns) : life(conns), arrivals(conns) {}
    NodeIndex node = 0;
    NodeAddress addr;
    mutable std::mutex mutex;  // guards life, in, arrivals, delivering (and out, see below)
    tcp::PeerLifecycle life;
    // The current attempt's connections. `out` is replaced (a new attempt) only with sendMutex, completionMutex and
    // mutex all held, so any one of them makes it safe to read.
    std::vector<std::shared_ptr<OutConn>> out;
    std::vector<std::shared_ptr<InConn>> in;  // slots filled by handshakes
    tcp::ArrivalOrder arrivals;               // flags and messages in arrival order, data landed per connection
    bool delivering = false;                  // a thread runs the message handler for the oldest arrival
    // Send side: serialises striping and the per-connection counts flags carry.
    std::mutex sendMutex;
    std::vector<uint64_t> sentData;    // per connection: data frames queued (what flags carry)
    std::vector<uint64_t> sentFrames;  // per connection: data + flag frames queued
    // Signalled ops in issue order (pushed while sendMutex is held, so the order is the issue order).
    std::mutex completionMutex;
    tcp::CompletionTracker completions;
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
  asio::ip::tcp::acceptor acceptor;
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
  std::shared_ptr<const MessageHandler> messageHandler;  // guarded by handlerMutex; copied per delivery
  std::atomic<bool> warnedNoMessageHandler{false};
  std::atomic<bool> stopping{false};

  // ---- helpers and peer events (tcp_transport.cpp) ----
  std::string nodeName(NodeIndex n) const;
  void notifyState();
  void goodbyeSent(int n);
  void pushCompletions(const std::vector<Completion>& done);
  // A connection of `node` wrote more frames: reports the signalled ops whose frames (and every frame queued
  // to that peer before them, on every connection) have all been handed to the kernel.
  void completeWritten(NodeIndex node);
  // Records a signalled op after its frames were queued. p.sendMutex held.
  void expectCompletion(Peer& p, uint64_t cookie);
  std::shared_ptr<Region> findRegion(uint32_t id) const;
  Peer& peerRef(NodeIndex node) const;
  // Throws unless the peer is connected: kPeerLost (with its reason) once failed or closed.
  void checkConnected(Peer& p) const;
  // Marks a peer failed (or closed), once per incarnation: closes its connections, fails its queued signalled ops,
  // drops its pending flags and messages, wakes connect(), calls the failure handler, then starts re-dialing it
  // (a new attempt) so that it can rejoin. `attempt` is the attempt of the connection that saw the problem:
  // reports from an older attempt are ignored, and a report from the current attempt of a peer that is already
  // failed (a half-built rejoin broke) quietly starts another attempt.
  void failPeer(NodeIndex node, PeerState newState, std::string reason, uint64_t attempt = tcp::kAnyAttempt);
  std::string peerStatusReason(Peer& p) const;
  // Installs fresh outbound connections for `attempt` and dials them until they connect or the attempt is
  // superseded; inbound handshakes from the peer are accepted again. Quiet: the reason of each try is kept in
  // lastDialError only.
  void startRejoin(Peer& p, uint64_t attempt);
  uint64_t currentAttempt(Peer& p) const;
  void setLastDialError(Peer& p, std::string why);
  // A handshake problem that connect() must report. Ignored once the peer is connected: a stranger that
  // claims to be node N must not be able to take down the live node N.
  void handshakeFailure(NodeIndex node, ErrorCode code, std::string message);
  // A connection of `attempt` finished its handshake. False when the attempt was superseded (the caller closes it).
  // The last one of an attempt makes the peer connected: a new incarnation (generation + 1); when the peer had
  // failed before, the rejoin handler is called.
  bool connectionReady(Peer& p, bool outbound, uint64_t attempt);
  // Applies arrived flags and hands arrived messages to the handler, strictly in arrival order, while their
  // per-connection data counts are met. `lock` holds p.mutex; it is released while the message handler runs, and
  // one thread at a time runs it (p.delivering): a thread that finds it running leaves the rest to that thread,
  // which looks at the queue again when the handler returns.
  void applyPending(Peer& p, std::unique_lock<std::mutex>& lock);
  // Calls the message handler (no transport lock held). The data the message waited for was written by threads
  // that released p.mutex before the caller acquired it, so the handler sees it.
  void deliverMessage(NodeIndex from, std::span<const std::byte> payload);

  // ---- coroutines (tcp_connections.cpp) ----
  asio::awaitable<void> acceptLoop();
  asio::awaitable<void> serveInbound(std::shared_ptr<InConn> c);
  asio::awaitable<void> inboundLoop(std::shared_ptr<InConn> c);
  // `rejoin`: a re-dial of a failed peer, until it connects or the attempt is superseded; fatal handshake
  // outcomes are retried too (less often), since the peer may be restarted with a fixed configuration.
  asio::awaitable<void> dial(std::shared_ptr<OutConn> c, Clock::time_point deadline, bool rejoin);
  enum class DialOutcome { kOk, kRetry, kFatal };
  asio::awaitable<DialOutcome> dialHandshake(std::shared_ptr<OutConn> c, bool rejoin);
  asio::awaitable<void> outboundReadLoop(std::shared_ptr<OutConn> c);
  asio::awaitable<void> heartbeatLoop();
  // Spawns `coroutine` on `strand`, logging an exception it ends with.
  void spawn(Strand& strand, asio::awaitable<void> coroutine, std::string what);

  void start();
  void connect(const std::vector<NodeAddress>& list);
  void shutdown();
};

}  // namespace tandem::daemon::transport
