#include "state.hpp"

#include <algorithm>
#include <cstring>

#include "tandem/common/error.hpp"

namespace tandem::daemon {

SessionChannel::SessionChannel(uint64_t sessionId, uint32_t capacity, uint32_t maxPending)
    : sessionId_(sessionId), maxPending_(maxPending) {
  const auto layout = RingRegionLayout::forCapacity(capacity);
  ringFd_ = Fd::memfd(fmt::format("tandem-rings-{}", sessionId), layout.totalBytes);
  mapping_ = Mapping::shared(ringFd_.get(), layout.totalBytes);
  rings_ = SessionRings::format(mapping_.data(), mapping_.size(), capacity);
  completionWake_ = WakeupPair::create();
  submitWake_ = WakeupPair::create();
}

bool SessionChannel::tryPostLocked(const Completion& c) {
  bool wake = false;
  if (!rings_.completion.tryPush(c, wake)) return false;
  ++completed_;
  if (wake) signalEventfd(completionWake_.daemonEnd.get());
  return true;
}

void SessionChannel::complete(uint64_t seq, int32_t status, std::string_view message) {
  Completion c{};
  c.seq = seq;
  c.status = status;
  c.messageLen = static_cast<uint32_t>(std::min(message.size(), sizeof c.message));
  std::memcpy(c.message, message.data(), c.messageLen);
  std::lock_guard lock(mutex_);
  // Keep completion order: nothing may overtake what is already queued.
  if (overflow_.empty() && tryPostLocked(c)) return;
  if (overflow_.size() >= maxPending_) {
    overflowed_.store(true, std::memory_order_relaxed);
    return;
  }
  overflow_.push_back(c);
}

void SessionChannel::flushPending() {
  std::lock_guard lock(mutex_);
  while (!overflow_.empty() && tryPostLocked(overflow_.front())) overflow_.pop_front();
}

uint32_t Communicator::joined() const {
  uint32_t n = 0;
  for (uint32_t r = 0; r < nranks; ++r) n += (members[r] || remote[r]) ? 1 : 0;
  return n;
}

uint32_t Communicator::localRanks() const {
  return static_cast<uint32_t>(std::count_if(members.begin(), members.end(), [](auto& m) { return m.has_value(); }));
}

bool Communicator::spansNodes() const {
  return std::any_of(remote.begin(), remote.end(), [](auto& n) { return n.has_value(); });
}

std::vector<uint32_t> Communicator::nodes(uint32_t self) const {
  std::vector<uint32_t> out{self};
  for (auto& n : remote) {
    if (n && std::find(out.begin(), out.end(), *n) == out.end()) out.push_back(*n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

const char* commStateName(Communicator::State state) {
  switch (state) {
    case Communicator::State::kJoining: return "joining";
    case Communicator::State::kReady: return "ready";
    case Communicator::State::kAborted: return "aborted";
    case Communicator::State::kPeerLost: return "peer-lost";
    case Communicator::State::kDestroyed: return "destroyed";
  }
  return "unknown";
}

}  // namespace tandem::daemon
