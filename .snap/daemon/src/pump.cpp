#include "pump.hpp"

#include <poll.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "backend.hpp"

namespace tandem::daemon {

using Clock = std::chrono::steady_clock;

Pump::Pump(const DaemonConfig& config, Hooks hooks) : config_(config), hooks_(std::move(hooks)), wake_(Fd::eventfd()) {}

Pump::~Pump() { stop(); }

void Pump::start() {
  running_ = true;
  thread_ = std::thread([this] { loop(); });
}

void Pump::stop() {
  if (!running_.exchange(false) && !thread_.joinable()) return;
  signalEventfd(wake_.get());
  if (thread_.joinable()) thread_.join();
}

void Pump::wake() { signalEventfd(wake_.get()); }

void Pump::sessionsChanged() {
  ++generation_;
  signalEventfd(wake_.get());
}

void Pump::loop() {
  std::vector<std::shared_ptr<SessionChannel>> channels;
  std::vector<pollfd> waitFds;
  uint64_t generation = ~uint64_t{0};
  auto lastWork = Clock::now();
  const auto pollWindow = std::chrono::microseconds(config_.rings.pollWindowUs);
  while (running_.load(std::memory_order_relaxed)) {
    if (generation != generation_.load()) {
      generation = generation_.load();
      channels = hooks_.channels();
    }
    bool worked = pollSessions(channels);
    try {
      worked = hooks_.progress() || worked;
    } catch (const FatalBackendError& e) {
      running_ = false;
      hooks_.fatal(e.what());
      return;
    }
    if (worked) {
      lastWork = Clock::now();
      continue;
    }
    if (Clock::now() - lastWork < pollWindow) continue;
    if (hooks_.busy()) {
      // GPU work in flight: its progress shows only in counters, so keep polling, politely.
      std::this_thread::yield();
      continue;
    }
    // Sleep: announce it on every ring, re-check, then block on every session's own wakeup socket and the pump's
    // eventfd (stop, sessions changed). Clients ring only when they see the flag, so the busy path costs no system
    // call; each rings only its own socket, so none can steal or block another's wakeups. The timeout bounds the
    // damage a client could do by clearing its own flag: only its own ops would wait, at most this long.
    bool mayBlock = true;
    for (auto& ch : channels) mayBlock = ch->submissions().prepareToSleep() && mayBlock;
    if (mayBlock && generation == generation_.load()) {
      waitFds.assign(1, pollfd{wake_.get(), POLLIN, 0});
      for (auto& ch : channels) waitFds.push_back(pollfd{ch->pumpWakeFd(), POLLIN, 0});
      ::poll(waitFds.data(), waitFds.size(), 100);
      for (const pollfd& p : waitFds) {
        if ((p.revents & POLLIN) != 0) drainEventfd(p.fd);
      }
    }
    for (auto& ch : channels) ch->submissions().wokeUp();
    lastWork = Clock::now();
  }
}

bool Pump::pollSessions(const std::vector<std::shared_ptr<SessionChannel>>& channels) {
  bool any = false;
  for (const auto& ch : channels) {
    ch->flushPending();
    if (ch->faultReported.load(std::memory_order_relaxed)) continue;  // being closed
    if (ch->overflowed()) {
      ch->faultReported = true;
      hooks_.fault(ch->sessionId(), fmt::format("it left more than limits.max_pending_completions ({}) completions "
                                                "undrained; drain the completion ring (tandem_wait / tandem_op_status)",
                                                config_.limits.maxPendingCompletions));
      continue;
    }
    OpDescriptor desc;
    // Bounded per pass so one busy session cannot starve the others, and never past the session's
    // queued-op limit (back-pressure stays in the client's ring).
    for (int i = 0; i < 64 && ch->queued.load(std::memory_order_relaxed) < ch->capacity(); ++i) {
      const auto r = ch->submissions().tryPop(desc);
      if (r == SpscRing<OpDescriptor>::Pop::kEmpty) break;
      if (r == SpscRing<OpDescriptor>::Pop::kCorrupt) {
        ch->faultReported = true;
        hooks_.fault(ch->sessionId(), "its submission ring's head index is corrupt");
        break;
      }
      any = true;
      hooks_.admit(desc, ch);
    }
  }
  return any;
}

}  // namespace tandem::daemon
