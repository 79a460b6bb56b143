// The control plane: a Boost.Asio Unix-socket server on one thread. One ControlSession per connection;
// it authenticates the peer (SO_PEERCRED), speaks framed protobuf (proto/tandem/v1/control.proto), and
// turns requests into Engine calls. Everything a session creates is released when its connection ends,
// for whatever reason.
#pragma once

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without including it

#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "config.hpp"
#include "engine.hpp"

namespace tandem::daemon {

class ControlSession;

class Server {
 public:
  // Binds the socket (or adopts a systemd-activated one). Throws Error(kSystem) naming the path on failure.
  Server(const DaemonConfig& config, Engine& engine, std::string backendName);
  ~Server();

  void run();   // serves until stop(); returns after every session is closed
  void stop();  // thread-safe
  // Runs `work` on the control thread (where every Engine call is made). Thread-safe.
  void post(std::function<void()> work) { boost::asio::post(io_, std::move(work)); }
  const std::string& socketPath() const { return socketPath_; }

 private:
  friend class ControlSession;
  void accept();
  void closeSession(uint64_t id, const std::string& why);

  const DaemonConfig& config_;
  Engine& engine_;
  std::string backend_;
  std::string socketPath_;
  bool ownsSocketFile_ = true;
  boost::asio::io_context io_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  std::map<uint64_t, std::shared_ptr<ControlSession>> sessions_;
  uint64_t nextSessionId_ = 1;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

}  // namespace tandem::daemon
