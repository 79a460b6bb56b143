// libtandem's C++ core behind the C API: one connection to tandemd, its rings, and the op bookkeeping.
// Internal: the public surface is tandem/tandem.h (C) and tandem/tandem.hpp (C++ RAII).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/common/protocol.hpp"
#include "tandem/common/ring.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::client {

struct OpResult {
  ErrorCode code = ErrorCode::kOk;
  std::string message;
};

class Session {
 public:
  // Connects and says Hello. Throws Error(kUnavailable) with the path when no daemon answers.
  static std::unique_ptr<Session> connect(const std::string& socketPath, uint32_t protocolVersion = kProtocolVersion);
  ~Session() = default;

  // One request/response round trip. `fds` travel with the request; `fdsOut` receives expectFds fds that
  // came with the reply. Throws Error with the daemon's status code and message when it is not OK.
  v1::Response call(v1::Request& request, std::span<const int> fds = {}, std::vector<Fd>* fdsOut = nullptr,
                    std::size_t expectFds = 0, int64_t timeoutMs = 60000);

  // Assigns desc.seq, pushes it into the submission ring and wakes the pump if it sleeps. When the ring is
  // full it waits up to submitTimeoutMs (then Error(kRingFull); nothing was submitted).
  uint64_t submit(OpDescriptor desc);
  // Waits for op `seq`. timeoutMs < 0 waits until it completes or the daemon is lost.
  OpResult wait(uint64_t seq, int64_t timeoutMs);
  // kInProgress until the op completes.
  OpResult status(uint64_t seq);

  // Shuts the connection down (both directions) without closing the socket: every call and wait of this session,
  // on any thread, fails at once with kDaemonLost, and tandemd sees the session end. Safe while other threads use
  // the session; the socket is closed by the destructor.
  void hangUp();

  const std::string& backend() const { return backend_; }
  const std::string& executor() const { return executor_; }  // "host", "client" or "daemon"
  int socketFd() const { return socket_.get(); }
  uint64_t sessionId() const { return sessionId_; }
  bool lost() const { return lost_.load(std::memory_order_relaxed); }
  int64_t submitTimeoutMs = 10000;

 private:
  Session() : decoder_(1u << 20) {}
  void drainCompletionsLocked();
  bool daemonHungUp();
  [[noreturn]] void failLost(const std::string& what);

  std::mutex controlMutex_;  // one request in flight on the socket
  std::mutex ringMutex_;     // submission producer, completion consumer, results_
  Fd socket_;
  FrameDecoder decoder_;
  Mapping ringMapping_;
  SessionRings rings_;
  Fd pumpEvent_;
  Fd completionEvent_;
  uint64_t nextRequestId_ = 1;
  uint64_t nextSeq_ = 1;
  std::map<uint64_t, OpResult> results_;  // completed ops not yet pruned
  uint64_t sessionId_ = 0;
  std::string backend_;
  std::string executor_;
  std::atomic<bool> lost_{false};  // set under either mutex, read under the other
};

}  // namespace tandem::client
