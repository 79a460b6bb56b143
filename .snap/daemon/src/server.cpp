// The listener: the Unix socket, accepting (caps, refusals, fd exhaustion), the control thread's loop and its
// tickers. Each connection is a ControlSession (control_session.hpp).
#include "server.hpp"

#include "control_session.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <vector>

#include "plan_table.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/protocol.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::daemon {
namespace asio = boost::asio;
using asio::local::stream_protocol;
using Clock = std::chrono::steady_clock;
namespace pb = tandem::v1;

namespace {

// accept() failing (EMFILE, ENFILE, ENOBUFS) is retried after 10 ms, doubling up to 1 s: the waiting connection
// stays queued, so retrying at once would spin.
constexpr auto kAcceptBackoffMin = std::chrono::milliseconds(10);
constexpr auto kAcceptBackoffMax = std::chrono::milliseconds(1000);
// While accept() fails for want of fds, each retry answers up to this many queued connections with an error.
constexpr int kRefusalsPerRetry = 64;
// A connection refused for a cap is answered and then kept (write side shut) until the client hangs up, at most this
// long, so that its Hello, sent before it reads, never meets a closed socket; at most kMaxLingering at once.
constexpr auto kRefusalLinger = std::chrono::milliseconds(1000);
constexpr std::size_t kMaxLingering = 64;
// Out of fds, connections that have been silent (no Hello) this long are dropped to make room: an honest client
// says Hello within microseconds of connecting.
constexpr auto kPreHelloEvictAge = std::chrono::milliseconds(100);
// Client warnings: at most this many lines of one kind per window, then one line with the count left out.
constexpr auto kWarnWindow = std::chrono::seconds(10);
constexpr uint32_t kWarnsPerWindow = 10;

// systemd socket activation: LISTEN_PID/LISTEN_FDS name inherited listening sockets starting at fd 3.
int inheritedSocket() {
  const char* pid = std::getenv("LISTEN_PID");
  const char* fds = std::getenv("LISTEN_FDS");
  if (pid == nullptr || fds == nullptr || std::atol(pid) != ::getpid() || std::atoi(fds) < 1) return -1;
  return 3;
}

}  // namespace

// ---- a connection refused for a cap --------------------------------------------------------------------

// Holds one error frame's worth of a connection: the answer is written at once, and the socket stays open (its write
// side shut) until the client hangs up or kRefusalLinger passes, so the client reads the answer instead of a reset.
class RefusedConnection : public std::enable_shared_from_this<RefusedConnection> {
 public:
  RefusedConnection(Server& server, stream_protocol::socket socket, uint64_t id)
      : server_(server), socket_(std::move(socket)), id_(id), linger_(socket_.get_executor()) {}

  void start(const std::string& frame) {
    boost::system::error_code ec;
    socket_.non_blocking(true, ec);
    // Far below the socket buffer: sent whole or the client is gone.
    [[maybe_unused]] const ssize_t n =
        ::send(socket_.native_handle(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(socket_.native_handle(), SHUT_WR);
    linger_.expires_after(kRefusalLinger);
    linger_.async_wait([self = shared_from_this()](boost::system::error_code e) {
      if (!e) self->finish();
    });
    waitRead();
  }

  void finish() {
    boost::system::error_code ec;
    linger_.cancel();
    socket_.close(ec);
    server_.lingering_.erase(id_);
  }

 private:
  // Reads and drops what the client sends (its Hello) until it hangs up.
  void waitRead() {
    socket_.async_wait(stream_protocol::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || !self->socket_.is_open()) return;
      char sink[4096];
      const ssize_t n = ::recv(self->socket_.native_handle(), sink, sizeof sink, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return self->finish();
      self->waitRead();
    });
  }

  Server& server_;
  stream_protocol::socket socket_;
  uint64_t id_;
  asio::steady_timer linger_;
};

// ---- the listener ------------------------------------------------------------------------------------

Server::Server(const DaemonConfig& config, Engine& engine, std::string backendName)
    : config_(config), engine_(engine), backend_(std::move(backendName)), acceptor_(io_) {
  // Before the socket listens, so that the daemon's idle fds are fixed once a client can connect.
  raiseOpenFileLimit();
  reserveFd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (int fd = inheritedSocket(); fd >= 0) {
    acceptor_.assign(stream_protocol(), fd);
    ownsSocketFile_ = false;
    socketPath_ = acceptor_.local_endpoint().path();
    spdlog::info("serving the systemd-activated socket {}", socketPath_);
  } else {
    socketPath_ = config.daemon.socket.empty() ? defaultSocketPath(false) : config.daemon.socket;
    // The default path comes from $XDG_RUNTIME_DIR, which the config check never saw.
    if (socketPath_.size() >= sizeof(sockaddr_un{}.sun_path)) {
      fail(ErrorCode::kInvalidConfig, "socket path {} is {} bytes, but a Unix socket address holds at most {} "
           "(sun_path). Set daemon.socket (or --socket) to a shorter path", socketPath_, socketPath_.size(),
           sizeof(sockaddr_un{}.sun_path) - 1);
    }
    namespace fs = std::filesystem;
    const fs::path path(socketPath_);
    std::error_code ec;
    if (!fs::exists(path.parent_path())) {
      fs::create_directories(path.parent_path(), ec);
      if (ec) fail(ErrorCode::kSystem, "create socket directory {}: {}", path.parent_path().string(), ec.message());
      ::chmod(path.parent_path().c_str(), 0750);
    }
    if (fs::exists(path)) {
      // A live daemon answers a connect; a stale file from a crashed one does not.
      stream_protocol::socket probe(io_);
      boost::system::error_code connectError;
      probe.connect(stream_protocol::endpoint(socketPath_), connectError);
      if (!connectError) {
        fail(ErrorCode::kSystem, "another tandemd already serves {}; stop it first or pass another --socket",
             socketPath_);
      }
      fs::remove(path, ec);
    }
    boost::system::error_code bindError;
    acceptor_.open(stream_protocol(), bindError);
    if (!bindError) acceptor_.bind(stream_protocol::endpoint(socketPath_), bindError);
    if (!bindError) acceptor_.listen(asio::socket_base::max_listen_connections, bindError);
    if (bindError) {
      fail(ErrorCode::kSystem, "bind control socket {}: {}. Check that the directory is writable, or pass --socket",
           socketPath_, bindError.message());
    }
    if (::chmod(socketPath_.c_str(), config.access.socketMode) != 0) {
      checkErrno(-1, fmt::format("chmod {:o} {}", config.access.socketMode, socketPath_));
    }
  }
  boost::system::error_code ec;
  acceptor_.non_blocking(true, ec);  // the refusal path below calls accept4 on it directly
  engine_.setSessionFaultHandler([this](uint64_t id, std::string why) {
    asio::post(io_, [this, id, why = std::move(why)] {
      spdlog::warn("closing session {}: {}", id, why);
      closeSession(id, why);
    });
  });
}

Server::~Server() {
  engine_.setSessionFaultHandler(nullptr);
  if (ownsSocketFile_ && !socketPath_.empty()) ::unlink(socketPath_.c_str());
}

// Every session may hold limits.max_fds_per_session fds. systemd's LimitNOFILE sets the soft and hard limits; run
// by hand, the soft limit is often 1024 while the hard one is far higher, and epoll-based code may raise it.
void Server::raiseOpenFileLimit() {
  const auto& l = config_.limits;
  const uint64_t needed = uint64_t{l.maxSessions} * l.maxFdsPerSession;
  const uint64_t wanted = 2 * needed;  // as much again for connections before Hello, communicators, the backend
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  if (limit.rlim_cur < wanted && limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = std::min<rlim_t>(wanted, limit.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur < needed) {
    spdlog::warn("the open-file limit is {} but limits.max_sessions x limits.max_fds_per_session = {} x {} = {}: "
                 "sessions will be refused for want of fds before that. Set LimitNOFILE={} in tandemd.service (or "
                 "ulimit -n), or lower those keys", limit.rlim_cur, l.maxSessions, l.maxFdsPerSession, needed, wanted);
  }
}

void Server::run() {
  accept();
  io_.run();
}

void Server::every(std::chrono::microseconds period, std::function<void()> tick) {
  tickers_.push_back(std::make_unique<Ticker>(io_, period, std::move(tick)));
  tickers_.back()->arm();
}

void Server::Ticker::arm() {
  timer.expires_after(period);
  timer.async_wait([this](boost::system::error_code ec) {
    if (ec) return;  // cancelled by stop()
    tick();
    arm();
  });
}

void Server::stop() {
  asio::post(io_, [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
    acceptRetry_.cancel();
    for (auto& t : tickers_) t->timer.cancel();
    for (auto& [id, s] : std::map(sessions_)) s->close("tandemd is shutting down");
    sessions_.clear();
    for (auto& [id, r] : std::map(lingering_)) r->finish();
    io_.stop();
  });
}

void Server::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream_protocol::socket socket) {
    if (!acceptor_.is_open() || ec == asio::error::operation_aborted) return;
    if (ec) return onAcceptError(ec);
    acceptBackoff_ = std::chrono::milliseconds(0);
    try {
      onAccepted(std::move(socket));
    } catch (const std::exception& e) {
      // Out of memory or fds while setting a connection up: that connection goes, the listener stays.
      warnLimited(WarnKind::kAccept, fmt::format("setting up a new connection failed: {}", e.what()));
    }
    accept();
  });
}

void Server::onAccepted(stream_protocol::socket socket) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    cred.uid = ~0u;
    cred.gid = ~0u;
  }
  // Connections count from accept, before Hello: silent ones hold fds and memory as sessions do.
  const auto& l = config_.limits;
  uint32_t ofUid = 0, open = 0;
  for (const auto& [id, s] : sessions_) {
    if (s->closing()) continue;
    ++open;
    ofUid += s->uid() == cred.uid ? 1 : 0;
  }
  std::string refusal;
  if (open >= l.maxSessions) {
    refusal = fmt::format("tandemd already serves {} connections (limits.max_sessions); close idle clients, retry "
                          "later, or raise limits.max_sessions in tandemd.yaml", open);
  } else if (ofUid >= l.maxSessionsPerUid) {
    refusal = fmt::format("uid {} already has {} connections to tandemd (limits.max_sessions_per_uid); close some of "
                          "them, or raise limits.max_sessions_per_uid in tandemd.yaml", cred.uid, ofUid);
  }
  if (!refusal.empty()) {
    warnLimited(WarnKind::kRefused, fmt::format("refused a connection from pid {} uid {}: {}", cred.pid, cred.uid,
                                                refusal));
    if (lingering_.size() >= kMaxLingering) return refuse(socket.release(), ErrorCode::kUnavailable, refusal);
    const uint64_t id = nextSessionId_++;
    auto refused = std::make_shared<RefusedConnection>(*this, std::move(socket), id);
    lingering_[id] = refused;
    return refused->start(
        encodeFrame(errorResponse(0, ErrorCode::kUnavailable, refusal).SerializeAsString(), config_.limits.maxFrameBytes));
  }
  const uint64_t id = nextSessionId_++;
  auto session = std::make_shared<ControlSession>(*this, std::move(socket), id, cred);
  sessions_[id] = session;
  session->start();
}

void Server::refuse(int fd, ErrorCode code, const std::string& message) {
  const Fd socket(fd);
  // Take what the client already sent (its Hello): closing with unread data would reset the connection before the
  // client reads the answer. Bounded, and never blocking.
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  const std::string frame = encodeFrame(errorResponse(0, code, message).SerializeAsString(), config_.limits.maxFrameBytes);
  [[maybe_unused]] const ssize_t n = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Server::onAcceptError(const boost::system::error_code& ec) {
  const int err = ec.category() == boost::system::system_category() ? ec.value() : 0;
  const bool outOfFds = err == EMFILE || err == ENFILE;
  acceptBackoff_ = acceptBackoff_.count() == 0 ? kAcceptBackoffMin : std::min(acceptBackoff_ * 2, kAcceptBackoffMax);
  // Silent connections are the likely cause, and dropping them lets honest clients in rather than refusing them.
  std::size_t evicted = 0, silentYoung = 0;
  if (outOfFds) {
    for (auto& [id, s] : std::map(sessions_)) {
      const auto silent = s->silentFor();
      if (!silent) continue;
      if (*silent < kPreHelloEvictAge) {
        ++silentYoung;
        continue;
      }
      s->evict(fmt::format("was dropped without having said Hello for {} ms: tandemd ran out of file descriptors",
                           std::chrono::duration_cast<std::chrono::milliseconds>(*silent).count()));
      ++evicted;
    }
    // Retry soon: either room was made, or it will be once the young silent ones are old enough to drop.
    if (evicted > 0 || silentYoung > 0) acceptBackoff_ = kAcceptBackoffMin;
  }
  if (outOfFds && evicted == 0 && silentYoung == 0) {
    warnLimited(WarnKind::kAccept,
                fmt::format("accept failed: {} [accept -> {}] with {} connections open; waiting connections are told "
                            "so, and accepting resumes in {} ms. Raise LimitNOFILE in tandemd.service (or ulimit -n), "
                            "or lower limits.max_sessions or limits.max_fds_per_session",
                            ec.message(), err == EMFILE ? "EMFILE" : "ENFILE", sessions_.size(), acceptBackoff_.count()));
    // Free the reserve fd to take queued connections one by one and tell each why, rather than leave them hanging.
    const std::string message = fmt::format(
        "tandemd cannot take this connection: it has run out of file descriptors ({}). Retry later; its "
        "administrator can raise LimitNOFILE in tandemd.service or lower limits.max_sessions or "
        "limits.max_fds_per_session", ec.message());
    reserveFd_.reset();
    for (int i = 0; i < kRefusalsPerRetry; ++i) {
      const int fd = ::accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      refuse(fd, ErrorCode::kUnavailable, message);
    }
    reserveFd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  } else if (outOfFds) {
    warnLimited(WarnKind::kAccept, fmt::format("accept failed: {}: dropped {} connections that had not said Hello "
                                               "(and {} more will go unless they do); retrying in {} ms. Raise "
                                               "LimitNOFILE in tandemd.service if honest load needs more fds",
                                               ec.message(), evicted, silentYoung, acceptBackoff_.count()));
  } else {
    warnLimited(WarnKind::kAccept, fmt::format("accept failed: {}; retrying in {} ms", ec.message(),
                                               acceptBackoff_.count()));
  }
  acceptRetry_.expires_after(acceptBackoff_);
  acceptRetry_.async_wait([this](boost::system::error_code timerError) {
    if (timerError || !acceptor_.is_open()) return;
    accept();
  });
}

void Server::warnLimited(WarnKind kind, const std::string& message) {
  WarnWindow& w = warnWindows_[static_cast<std::size_t>(kind)];
  const auto now = Clock::now();
  if (now - w.start >= kWarnWindow) {
    if (w.suppressed > 0) {
      spdlog::warn("({} more warnings like the following were left out in the last {} s)", w.suppressed,
                   std::chrono::duration_cast<std::chrono::seconds>(kWarnWindow).count());
    }
    w = WarnWindow{now, 0, 0};
  }
  if (w.logged < kWarnsPerWindow) {
    ++w.logged;
    spdlog::warn("{}", message);
  } else {
    ++w.suppressed;
  }
}

void Server::closeSession(uint64_t id, const std::string& why) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  auto session = it->second;
  sessions_.erase(it);
  spdlog::debug("connection {} closed: {}", id, why);
  session->close(why);
}

}  // namespace tandem::daemon
