#include "session.hpp"

#include <grp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

namespace tandem::client {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxKeptResults = 1 << 16;
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// The group of the socket, or of the closest directory above it this user can inspect: its name ("<group>" when
// unknown) and "group tandem (gid 990, of /run/tandem)".
std::pair<std::string, std::string> socketGroup(const std::string& path) {
  std::string p = path;
  struct stat st{};
  while (!p.empty() && ::stat(p.c_str(), &st) != 0) {
    const auto slash = p.find_last_of('/');
    p = slash == std::string::npos || slash == 0 ? std::string() : p.substr(0, slash);
  }
  if (p.empty()) return {"<group>", "its group"};
  const group* g = ::getgrgid(st.st_gid);
  if (g == nullptr) return {std::to_string(st.st_gid), fmt::format("gid {} (of {})", st.st_gid, p)};
  return {g->gr_name, fmt::format("group {} (gid {}, of {})", g->gr_name, st.st_gid, p)};
}

Fd connectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    fail(ErrorCode::kInvalidArgument, "socket path '{}' is longer than {} bytes", path, sizeof addr.sun_path - 1);
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  checkErrno(fd.get(), "socket(AF_UNIX)");
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      // The daemon runs; this user may not open its socket (socket mode 0660, /run/tandem 0750): a matter of groups.
      const auto [name, text] = socketGroup(path);
      fail(ErrorCode::kUnavailable, "cannot open tandemd's socket {}: {} [connect -> {}]. It is open to the daemon's "
           "user and {}: join that group (sudo usermod -aG {} $USER, then log in again) or ask for your uid in "
           "access.allowed_uids", path, std::strerror(err), err == EACCES ? "EACCES" : "EPERM", text, name);
    }
    fail(ErrorCode::kUnavailable, "cannot reach tandemd at {}: {}. Start it (tandemd, or systemctl start tandemd), or "
         "point TANDEM_SOCKET at its socket", path, std::strerror(err));
  }
  return fd;
}

}  // namespace

std::unique_ptr<Session> Session::connect(const std::string& socketPath, uint32_t protocolVersion) {
  std::unique_ptr<Session> s(new Session());
  s->socket_ = connectUnix(socketPath);
  v1::Request request;
  auto* hello = request.mutable_hello();
  hello->set_protocol_version(protocolVersion);
  hello->set_client_version(TANDEM_VERSION_STRING);
  hello->set_pid(static_cast<uint32_t>(::getpid()));
  std::vector<Fd> fds;
  const v1::Response response = s->call(request, {}, &fds, 3);
  const auto& reply = response.hello();
  s->sessionId_ = reply.session_id();
  s->backend_ = reply.backend();
  s->executor_ = reply.executor();
  s->ringMapping_ = Mapping::shared(fds[0].get(), reply.ring_bytes());
  s->rings_ = SessionRings::attach(s->ringMapping_.data(), s->ringMapping_.size());
  s->pumpEvent_ = std::move(fds[1]);
  s->completionEvent_ = std::move(fds[2]);
  if (const char* env = std::getenv("TANDEM_SUBMIT_TIMEOUT_MS"); env != nullptr && *env != '\0') {
    s->submitTimeoutMs = std::strtoll(env, nullptr, 10);
  }
  return s;
}

void Session::failLost(const std::string& what) {
  lost_ = true;
  fail(ErrorCode::kDaemonLost, "{}: the connection to tandemd is gone (it exited or was killed); reconnect once it "
       "is back (systemctl status tandemd)", what);
}

void Session::hangUp() {
  lost_ = true;
  ::shutdown(socket_.get(), SHUT_RDWR);  // wakes every poll and recv on the socket with a hang-up
}

v1::Response Session::call(v1::Request& request, std::span<const int> fds, std::vector<Fd>* fdsOut,
                           std::size_t expectFds, int64_t timeoutMs) {
  std::lock_guard lock(controlMutex_);
  if (lost_) failLost("request");
  request.set_request_id(nextRequestId_++);
  std::string frame;
  try {
    sendFrame(socket_.get(), request.SerializeAsString(), fds, 1u << 20);
    frame = recvFrame(socket_.get(), decoder_, timeoutMs);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnavailable) failLost(e.what());
    throw;
  }
  v1::Response response;
  if (!response.ParseFromString(frame)) fail(ErrorCode::kProtocol, "tandemd sent a reply that is not a Response");
  if (response.request_id() != request.request_id() && response.request_id() != 0) {
    fail(ErrorCode::kProtocol, "reply to request {} arrived for request {}", response.request_id(),
         request.request_id());
  }
  if (response.status().code() != v1::STATUS_CODE_OK) {
    // Drop fds that may have come along; the message is the daemon's own.
    while (decoder_.pendingFds() > 0) decoder_.takeFd();
    throw Error(static_cast<ErrorCode>(response.status().code()), response.status().message());
  }
  for (std::size_t i = 0; i < expectFds; ++i) {
    Fd fd = decoder_.takeFd();
    if (fdsOut != nullptr) fdsOut->push_back(std::move(fd));
  }
  return response;
}

bool Session::daemonHungUp() {
  pollfd p{socket_.get(), POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char c;
  // The daemon never sends unsolicited data, so a readable socket outside a call means EOF.
  return ::recv(socket_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

uint64_t Session::submit(OpDescriptor desc) {
  std::unique_lock lock(ringMutex_);
  if (lost_ || daemonHungUp()) failLost("submit");
  // Stream-ordered ops are often never waited on (the stream orders them): collect their completions here, so that
  // the daemon never sees this session as one that leaves completions undrained (limits.max_pending_completions).
  drainCompletionsLocked();
  desc.seq = nextSeq_;
  const auto deadline = Clock::now() + std::chrono::milliseconds(submitTimeoutMs);
  for (;;) {
    bool wake = false;
    if (rings_.submission.tryPush(desc, wake)) {
      if (wake) signalEventfd(pumpEvent_.get());
      return nextSeq_++;
    }
    // Full: back-pressure. Drain our completions so the daemon can keep posting, then retry.
    drainCompletionsLocked();
    if (daemonHungUp()) failLost("submit");
    if (Clock::now() > deadline) {
      fail(ErrorCode::kRingFull, "submission ring stayed full ({} ops) for {} ms: tandemd is not draining it; "
           "nothing was submitted. Wait on earlier ops, or check tandemd's health", rings_.submission.capacity(),
           submitTimeoutMs);
    }
    signalEventfd(pumpEvent_.get());
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
}

void Session::drainCompletionsLocked() {
  Completion c;
  for (;;) {
    const auto r = rings_.completion.tryPop(c);
    if (r == SpscRing<Completion>::Pop::kEmpty) break;
    if (r == SpscRing<Completion>::Pop::kCorrupt) fail(ErrorCode::kProtocol, "completion ring is corrupt");
    const auto len = std::min<std::size_t>(c.messageLen, sizeof c.message);
    if (c.status == kCompletionContinues) {  // the rest of the message of the record before it (same seq)
      if (const auto it = results_.find(c.seq); it != results_.end()) it->second.message.append(c.message, len);
      continue;
    }
    results_[c.seq] = OpResult{static_cast<ErrorCode>(c.status), std::string(c.message, len)};
  }
  while (results_.size() > kMaxKeptResults) results_.erase(results_.begin());
}

OpResult Session::status(uint64_t seq) {
  std::lock_guard lock(ringMutex_);
  drainCompletionsLocked();
  if (auto it = results_.find(seq); it != results_.end()) return it->second;
  if (seq == 0 || seq >= nextSeq_) return {ErrorCode::kNotFound, fmt::format("op {} was never submitted", seq)};
  if (!results_.empty() && seq < results_.begin()->first) {
    return {ErrorCode::kNotFound, fmt::format("op {} completed long ago; its status is no longer kept", seq)};
  }
  if (lost_ || daemonHungUp()) {
    lost_ = true;
    return {ErrorCode::kDaemonLost, "tandemd is gone; the op will never complete"};
  }
  return {ErrorCode::kInProgress, ""};
}

OpResult Session::wait(uint64_t seq, int64_t timeoutMs) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeoutMs < 0 ? 0 : timeoutMs);
  for (;;) {
    OpResult r = status(seq);
    if (r.code != ErrorCode::kInProgress) return r;
    const auto now = Clock::now();
    if (timeoutMs >= 0 && now >= deadline) {
      return {ErrorCode::kTimeout, fmt::format("op {} did not complete within {} ms; it is still pending (wait again, "
                                               "or abort the communicator)", seq, timeoutMs)};
    }
    if (now - start < kSpinBeforeSleep) continue;
    // Sleep on the completion eventfd and the socket (a daemon that dies hangs it up).
    {
      std::lock_guard lock(ringMutex_);
      if (!rings_.completion.prepareToSleep()) continue;
    }
    int waitMs = 1000;
    if (timeoutMs >= 0) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      waitMs = static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
    }
    pollfd p[2] = {{completionEvent_.get(), POLLIN, 0}, {socket_.get(), POLLRDHUP, 0}};
    ::poll(p, 2, waitMs);
    drainEventfd(completionEvent_.get());
    std::lock_guard lock(ringMutex_);
    rings_.completion.wokeUp();
  }
}

}  // namespace tandem::client
