#include "transport/tcp_peer.hpp"

#include <algorithm>

namespace tandem::daemon::transport::tcp {

namespace {
bool down(PeerState s) { return s == PeerState::kFailed || s == PeerState::kClosed; }
}  // namespace

bool PeerLifecycle::acceptsHandshakes() const {
  const PeerState s = state();
  return s == PeerState::kConnecting || (rejoining_ && down(s));
}

PeerLifecycle::Failure PeerLifecycle::fail(PeerState newState, std::string reason, uint64_t attempt) {
  Failure f;
  if (attempt != kAnyAttempt && attempt != attempt_) return f;  // a connection of an older attempt
  if (down(state())) {
    if (attempt == kAnyAttempt || !rejoining_) return f;
    lastDialError_ = std::move(reason);  // a connection of the rejoin attempt broke: start over
  } else {
    reason_ = std::move(reason);
    state_.store(newState, std::memory_order_release);
    f.first = true;
  }
  f.ignored = false;
  attempt_ += 1;
  f.newAttempt = attempt_;
  rejoining_ = false;
  outReady_ = 0;
  inReady_ = 0;
  return f;
}

bool PeerLifecycle::beginRejoin(uint64_t attempt) {
  if (attempt != attempt_) return false;
  rejoining_ = true;
  return true;
}

PeerLifecycle::Ready PeerLifecycle::connectionReady(bool outbound, uint64_t attempt) {
  Ready r;
  if (attempt != attempt_) {
    r.superseded = true;
    return r;
  }
  (outbound ? outReady_ : inReady_) += 1;
  const PeerState s = state();
  const bool eligible = s == PeerState::kConnecting || (rejoining_ && down(s));
  if (outReady_ == connectionsPerPeer_ && inReady_ == connectionsPerPeer_ && eligible) {
    r.rejoined = s != PeerState::kConnecting;
    if (r.rejoined) {
      reason_.clear();
      fatalCode_ = ErrorCode::kOk;
      fatal_.clear();
      lastDialError_.clear();
      rejoining_ = false;
    }
    r.generation = generation_.fetch_add(1) + 1;
    state_.store(PeerState::kConnected, std::memory_order_release);
    r.connected = true;
  }
  return r;
}

PeerLifecycle::HandshakeVerdict PeerLifecycle::handshakeFailure(ErrorCode code, const std::string& message) {
  if (state() != PeerState::kConnecting) {
    if (!rejoining_) return HandshakeVerdict::kIgnore;
    lastDialError_ = message;
    return HandshakeVerdict::kRetryQuietly;
  }
  if (fatalCode_ == ErrorCode::kOk) {
    fatalCode_ = code;
    fatal_ = message;
  }
  return HandshakeVerdict::kFail;
}

Arrival* ArrivalOrder::ready() {
  if (pending_.empty()) return nullptr;
  Arrival& a = pending_.front();
  for (std::size_t c = 0; c < a.counts.size(); ++c) {
    if (landed_[c] < a.counts[c]) return nullptr;
  }
  return &a;
}

void ArrivalOrder::reset() {
  std::fill(landed_.begin(), landed_.end(), 0);
  pending_.clear();
}

void CompletionTracker::failAll(NodeIndex peer, std::vector<Completion>& out) {
  for (const Pending& p : pending_) out.push_back(Completion{p.cookie, peer, ErrorCode::kPeerLost});
  pending_.clear();
}

}  // namespace tandem::daemon::transport::tcp
