// The tcp transport's per-peer state, as pure logic (no sockets, no locks; unit-tested in tcp_logic_test.cpp):
//  - PeerLifecycle: connecting -> connected -> failed/closed -> (re-dial) -> connected again as a new incarnation;
//    connection attempts, readiness counts, generations, and the reasons connect() and peerStatus() report.
//  - ArrivalOrder: the receive side's rule that a flag or message is applied only after every data frame the
//    sender had queued before it has landed, and strictly in arrival order.
//  - CompletionTracker: the send side's rule that a signalled op completes once every frame queued to the peer up
//    to it has been written, on every connection.
// See tcp_transport.hpp ("Flag ordering", "Completions", "Liveness", "Rejoin") for why; the transport
// (tcp_transport.cpp, tcp_connections.cpp) holds the peer's locks around every call and does the I/O.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "tandem/common/error.hpp"
#include "transport/transport.hpp"

namespace tandem::daemon::transport::tcp {

/// A failure report not tied to one connection attempt.
inline constexpr uint64_t kAnyAttempt = ~uint64_t{0};

/// One peer's life cycle. Not thread-safe: every call but state() and generation() needs the peer's mutex. Those
/// two are atomics, for the fast paths that check a peer without the mutex.
class PeerLifecycle {
 public:
  explicit PeerLifecycle(uint32_t connectionsPerPeer) : connectionsPerPeer_(connectionsPerPeer) {}

  PeerState state() const { return state_.load(std::memory_order_acquire); }
  /// Incarnations: +1 each time the peer becomes connected.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  /// The current connection attempt: 0 for connect(), +1 each time the peer fails (or a rejoin attempt breaks).
  /// Connections carry the attempt they belong to; anything a connection of an older attempt reports is ignored.
  uint64_t attempt() const { return attempt_; }
  /// A failed or closed peer whose re-dial runs: handshakes from it are accepted again.
  bool rejoining() const { return rejoining_; }
  const std::string& reason() const { return reason_; }          ///< why it failed or closed
  ErrorCode fatalCode() const { return fatalCode_; }              ///< a handshake failure connect() reports
  const std::string& fatal() const { return fatal_; }
  const std::string& lastDialError() const { return lastDialError_; }  ///< the last quiet retry's reason
  void setLastDialError(std::string why) { lastDialError_ = std::move(why); }
  uint32_t outReady() const { return outReady_; }  ///< connections of this attempt that finished the handshake
  uint32_t inReady() const { return inReady_; }

  /// Whether a handshake from the peer may take a connection slot: while connect() runs, and again once the peer
  /// failed or closed and its rejoin started.
  bool acceptsHandshakes() const;

  struct Failure {
    bool ignored = true;  ///< a report of an older attempt, or of a peer already failed that is not rejoining
    bool first = false;   ///< this incarnation's failure (report it); else a rejoin attempt broke (retry quietly)
    uint64_t newAttempt = 0;
  };
  /// The peer failed or closed (newState), seen by a connection of `attempt` (or kAnyAttempt). Unless ignored, the
  /// attempt moves on (the caller drops the old attempt's connections, arrivals and completions) and readiness
  /// starts over. A first failure records the state and reason; a broken rejoin only records lastDialError.
  Failure fail(PeerState newState, std::string reason, uint64_t attempt);

  /// The re-dial of `attempt` starts: false when a newer attempt superseded it.
  bool beginRejoin(uint64_t attempt);

  struct Ready {
    bool superseded = false;  ///< the connection belongs to an older attempt: close it
    bool connected = false;   ///< this was the last connection: the peer is connected (a new incarnation)
    bool rejoined = false;    ///< ... and it had failed or closed before
    uint64_t generation = 0;
  };
  /// A connection of `attempt` finished its handshake (outbound: dialled by this node).
  Ready connectionReady(bool outbound, uint64_t attempt);

  enum class HandshakeVerdict {
    kFail,          ///< connect() runs: recorded as the fatal error; fail the peer with it
    kRetryQuietly,  ///< a re-dial or a rejoin handshake: recorded as lastDialError only
    kIgnore,        ///< the peer is connected: a stranger claiming its index must not take it down
  };
  HandshakeVerdict handshakeFailure(ErrorCode code, const std::string& message);

 private:
  uint32_t connectionsPerPeer_;
  std::atomic<PeerState> state_{PeerState::kConnecting};
  std::atomic<uint64_t> generation_{0};
  uint64_t attempt_ = 0;
  bool rejoining_ = false;
  std::string reason_;
  ErrorCode fatalCode_ = ErrorCode::kOk;
  std::string fatal_;
  std::string lastDialError_;
  uint32_t outReady_ = 0;
  uint32_t inReady_ = 0;
};

/// An arrived flag or message, waiting for the data frames that were queued before it.
struct Arrival {
  std::vector<uint64_t> counts;  ///< data frames per connection that must have landed first
  bool message = false;
  std::byte* target = nullptr;   ///< flag: where to store `value` (8-byte aligned, checked on arrival)
  bool device = false;           ///< flag: target is GPU memory (stored through the DeviceCopier)
  uint64_t value = 0;
  std::vector<std::byte> payload;  ///< message
};

/// One peer's arrivals in order, and the data frames landed per connection. Not thread-safe (the peer's mutex).
class ArrivalOrder {
 public:
  explicit ArrivalOrder(uint32_t connections) : landed_(connections, 0) {}
  /// A data frame's bytes are fully written on `connection`.
  void dataLanded(uint32_t connection) { landed_[connection] += 1; }
  void push(Arrival arrival) { pending_.push_back(std::move(arrival)); }
  /// The oldest arrival once every count it carries has been reached, else null (also when none is queued).
  Arrival* ready();
  /// Drops the oldest arrival (after applying or handling it).
  void pop() { pending_.pop_front(); }
  /// A new attempt: nothing of the old one reaches it.
  void reset();
  std::size_t pending() const { return pending_.size(); }

 private:
  std::vector<uint64_t> landed_;
  std::deque<Arrival> pending_;
};

/// One peer's signalled ops in issue order, each with the frames per connection that must have been written.
/// Not thread-safe (the peer's completion mutex).
class CompletionTracker {
 public:
  /// A signalled op, after its frames were queued; `required`: frames queued per connection so far.
  void expect(uint64_t cookie, std::vector<uint64_t> required) { pending_.push_back({cookie, std::move(required)}); }
  /// Moves the ops whose frames have all been written (written(c): frames written on connection c) to `out`, in
  /// order, stopping at the first that is not.
  template <typename Written>
  void takeWritten(NodeIndex peer, Written&& written, std::vector<Completion>& out) {
    while (!pending_.empty()) {
      const Pending& p = pending_.front();
      for (std::size_t c = 0; c < p.required.size(); ++c) {
        if (written(c) < p.required[c]) return;
      }
      out.push_back(Completion{p.cookie, peer, ErrorCode::kOk});
      pending_.pop_front();
    }
  }
  /// The peer failed: every op still waiting completes with kPeerLost.
  void failAll(NodeIndex peer, std::vector<Completion>& out);
  std::size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    uint64_t cookie;
    std::vector<uint64_t> required;
  };
  std::deque<Pending> pending_;
};

}  // namespace tandem::daemon::transport::tcp
