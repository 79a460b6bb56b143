#include "state.hpp"

#include <algorithm>
#include <array>
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
  // The first record, then (for a message longer than one record) its continuations (descriptor.hpp, Completion).
  message = message.substr(0, kMaxCompletionMessage);
  constexpr std::size_t kPart = sizeof Completion::message;
  const std::size_t records = message.size() <= kPart ? 1 : (message.size() + kPart - 1) / kPart;
  std::array<Completion, (kMaxCompletionMessage + kPart - 1) / kPart> parts{};
  for (std::size_t i = 0; i < records; ++i) {
    Completion& c = parts[i];
    c.seq = seq;
    c.status = i == 0 ? status : kCompletionContinues;
    const std::string_view text = message.substr(i * kPart, kPart);
    c.messageLen = static_cast<uint32_t>(i == 0 ? message.size() : text.size());
    std::memcpy(c.message, text.data(), text.size());
  }
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < records; ++i) {
    // Keep completion order: nothing may overtake what is already queued.
    if (overflow_.empty() && tryPostLocked(parts[i])) continue;
    if (overflow_.size() >= maxPending_) {
      overflowed_.store(true, std::memory_order_relaxed);
      return;
    }
    overflow_.push_back(parts[i]);
  }
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
