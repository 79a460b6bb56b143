// The control plane: a Boost.Asio Unix-socket server on one thread. One ControlSession per connection;
// it authenticates the peer (SO_PEERCRED), speaks framed protobuf (proto/tandem/v1/control.proto), and
// turns requests into Engine calls. Everything a session creates is released when its connection ends,
// for whatever reason.
//
// Many processes of several users share one daemon, so no client may stall it for the others: replies are
// written without blocking and a client that does not read them is dropped past limits.max_reply_backlog_bytes;
// a connection must say Hello within limits.hello_timeout_ms and finish each frame within limits.frame_timeout_ms;
// connections are capped per uid and in all; fds received beyond what a request takes are closed; accept()
// failures back off instead of spinning.
#pragma once

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without including it

#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "config.hpp"
#include "engine.hpp"
#include "tandem/common/fd.hpp"

namespace tandem::daemon {

class ControlSession;
class RefusedConnection;

class Server {
 public:
  // Binds the socket (or adopts a systemd-activated one). Throws Error(kSystem) naming the path on failure, and
  // Error(kInvalidConfig) for a socket path too long for a Unix socket address.
  Server(const DaemonConfig& config, Engine& engine, std::string backendName);
  ~Server();

  void run();   // serves until stop(); returns after every session is closed
  void stop();  // thread-safe
  // Runs `work` on the control thread (where every Engine call is made). Thread-safe.
  void post(std::function<void()> work) { boost::asio::post(io_, std::move(work)); }
  // Runs `tick` on the control thread every `period` while serving (the systemd watchdog: it proves the loop
  // turns, not merely that the process lives). Call before run().
  void every(std::chrono::microseconds period, std::function<void()> tick);
  const std::string& socketPath() const { return socketPath_; }

 private:
  friend class ControlSession;
  friend class RefusedConnection;

  // Warnings about clients (drops, refusals, accept failures) are rate-limited per kind: a hostile client must
  // not be able to flood the journal either.
  enum class WarnKind { kAccept, kDeadline, kBacklog, kRefused, kFds, kCount };
  struct WarnWindow {
    std::chrono::steady_clock::time_point start{};
    uint32_t logged = 0;
    uint64_t suppressed = 0;
  };

  void accept();
  void onAccepted(boost::asio::local::stream_protocol::socket socket);
  void onAcceptError(const boost::system::error_code& ec);
  // Answers a connection tandemd will not serve with one error frame and closes it at once (when fds are short, or
  // too many refused connections linger).
  void refuse(int fd, ErrorCode code, const std::string& message);
  void closeSession(uint64_t id, const std::string& why);
  void warnLimited(WarnKind kind, const std::string& message);
  void raiseOpenFileLimit();

  const DaemonConfig& config_;
  Engine& engine_;
  std::string backend_;
  std::string socketPath_;
  bool ownsSocketFile_ = true;
  boost::asio::io_context io_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer acceptRetry_{io_};
  struct Ticker {
    Ticker(boost::asio::io_context& io, std::chrono::microseconds p, std::function<void()> t)
        : timer(io), period(p), tick(std::move(t)) {}
    void arm();
    boost::asio::steady_timer timer;
    std::chrono::microseconds period;
    std::function<void()> tick;
  };
  std::vector<std::unique_ptr<Ticker>> tickers_;
  std::chrono::milliseconds acceptBackoff_{0};
  // Held open so that, when accept() fails for want of fds, one can be freed to take the waiting connections and
  // tell them why instead of leaving them hanging.
  Fd reserveFd_;
  std::map<uint64_t, std::shared_ptr<ControlSession>> sessions_;
  std::map<uint64_t, std::shared_ptr<RefusedConnection>> lingering_;  // refused, until their clients hang up
  uint64_t nextSessionId_ = 1;
  std::array<WarnWindow, static_cast<std::size_t>(WarnKind::kCount)> warnWindows_{};
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

}  // namespace tandem::daemon
