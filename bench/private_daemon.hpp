// A tandemd of the benchmark's own: started on a socket in a fresh temporary directory with the given config,
// waited for until it serves, stopped (SIGTERM) and cleaned up when the object goes away. Benchmarks that are
// given --socket use that daemon instead and never construct one of these (useDaemon). Also the pipe helpers the
// multi-process benchmarks pass ids and results through.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

namespace tandem::bench {

class PrivateDaemon {
 public:
  // Throws std::runtime_error with the daemon's log when it does not serve within 30 s.
  PrivateDaemon(const std::string& tandemd, const std::string& configYaml) {
    char tmpl[] = "/tmp/tandem-bench-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    socket_ = (dir_ / "tandemd.sock").string();
    const std::string config = (dir_ / "tandemd.yaml").string();
    std::ofstream(config) << configYaml;
    pid_ = ::fork();
    if (pid_ == 0) {
      const int log = ::open((dir_ / "tandemd.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(log, 2);
      ::dup2(log, 1);
      ::execl(tandemd.c_str(), tandemd.c_str(), "--foreground", "--socket", socket_.c_str(), "--config", config.c_str(),
              nullptr);
      std::_Exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!accepts()) {
      int status = 0;
      const bool exited = ::waitpid(pid_, &status, WNOHANG) == pid_;
      if (exited || std::chrono::steady_clock::now() > deadline) {
        const std::string message = "tandemd did not start:\n" + log();
        if (!exited) {  // still starting past the deadline
          ::kill(pid_, SIGKILL);
          ::waitpid(pid_, nullptr, 0);
        }
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);  // a throwing constructor runs no destructor
        throw std::runtime_error(message);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~PrivateDaemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  PrivateDaemon(const PrivateDaemon&) = delete;
  PrivateDaemon& operator=(const PrivateDaemon&) = delete;

  const std::string& socket() const { return socket_; }
  std::string log() const {
    std::ifstream in(dir_ / "tandemd.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  bool accepts() const {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_.c_str(), sizeof addr.sun_path - 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    return ok;
  }

  std::filesystem::path dir_;
  std::string socket_;
  pid_t pid_ = -1;
};

// The socket the benchmark talks to: `socket` when given (--socket), else that of a private tandemd started with
// `configYaml` and kept in `holder`. Empty, with the reason printed, when the daemon does not start.
inline std::string useDaemon(const std::string& socket, const std::string& tandemd, const std::string& configYaml,
                             std::unique_ptr<PrivateDaemon>& holder) {
  if (!socket.empty()) return socket;
  try {
    holder = std::make_unique<PrivateDaemon>(tandemd, configYaml);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return {};
  }
  return holder->socket();
}

// Whole-buffer pipe transfers between the parent and its rank processes; a broken pipe ends the process (exit 3).
inline void writeAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w <= 0) std::exit(3);
    c += w, n -= static_cast<size_t>(w);
  }
}
inline void readAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::read(fd, c, n);
    if (r <= 0) std::exit(3);
    c += r, n -= static_cast<size_t>(r);
  }
}

}  // namespace tandem::bench
