// The submission pump: one thread that pops every session's submission ring, hands each descriptor to admission
// (Engine, admission.cpp), progresses the backend, and, when there is nothing to do, sleeps on the sessions' own
// wakeup sockets. It holds no engine state of its own: what it needs from the engine comes through Hooks, so that
// its loop and its sleep protocol can be read (and changed) in one place.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "state.hpp"
#include "tandem/common/fd.hpp"

namespace tandem::daemon {

class Pump {
 public:
  struct Hooks {
    std::function<std::vector<std::shared_ptr<SessionChannel>>()> channels;  // the open sessions (takes the lock)
    std::function<void(const OpDescriptor&, const std::shared_ptr<SessionChannel>&)> admit;
    std::function<bool()> progress;  // backend work; true when something happened. May throw FatalBackendError
    std::function<bool()> busy;      // the backend has work in flight: keep polling instead of sleeping
    std::function<void(uint64_t sessionId, std::string why)> fault;  // a session broke its side of the protocol
    std::function<void(std::string why)> fatal;  // progress threw FatalBackendError; the pump has stopped
  };

  Pump(const DaemonConfig& config, Hooks hooks);
  ~Pump();
  Pump(const Pump&) = delete;
  Pump& operator=(const Pump&) = delete;

  void start();
  void stop();  // joins the thread
  // The set of sessions changed: a sleeping pump rebuilds its list now instead of after its timeout.
  void sessionsChanged();
  // Work for the pump came from another thread (a peer node's descriptor completed a collective whose streams the
  // pump must now watch): end its sleep now instead of at its 100 ms timeout.
  void wake();

 private:
  void loop();
  bool pollSessions(const std::vector<std::shared_ptr<SessionChannel>>& channels);

  const DaemonConfig& config_;
  Hooks hooks_;
  Fd wake_;  // the pump's own wakeups (stop, sessions changed); never shared with a client
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> running_{false};
  std::thread thread_;
};

}  // namespace tandem::daemon
