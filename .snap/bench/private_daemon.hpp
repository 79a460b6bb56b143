// A tandemd of the benchmark's own: started on a socket in a fresh temporary directory with the given config,
// waited for until it serves, stopped (SIGTERM) and cleaned up when the object goes away. Benchmarks that are
// given --socket use that daemon instead and never construct one of these (useDaemon). Also the rank processes of
// the multi-process benchmarks and the pipes they pass ids and results through.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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

// One forked process per rank, each with a pipe to the parent (`up`) and one from it (`down`), and the parent's side of
// them: relaying ids from rank 0 to every rank, and waiting for every rank without hanging on one that died.
class RankProcesses {
 public:
  // rankMain(rank, up, down) is the child's whole life; its return value is its exit code (0 ok, 1 a check failed).
  RankProcesses(uint32_t n, const std::function<int(uint32_t, int, int)>& rankMain) {
    for (uint32_t r = 0; r < n; ++r) {
      int up[2], down[2];
      if (::pipe(up) != 0 || ::pipe(down) != 0) return;
      const pid_t pid = ::fork();
      if (pid < 0) return;
      if (pid == 0) {
        ::close(up[0]);
        ::close(down[1]);
        const int code = rankMain(r, up[1], down[0]);
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(code);
      }
      ::close(up[1]);
      ::close(down[0]);
      pids_.push_back(pid);
      ups_.push_back(up[0]);
      downs_.push_back(down[1]);
    }
    alive_ = pids_;
    started_ = true;
  }
  bool started() const { return started_; }

  // Reads `bytes` (an id) from rank 0 and writes them to every rank, watching for ranks that die meanwhile. False (the
  // ranks still running killed) if one died or rank 0 hung up first.
  bool relay(size_t bytes) {
    std::vector<char> buf(bytes);
    size_t got = 0;
    while (got < bytes) {
      pollfd pfd{ups_[0], POLLIN, 0};
      if (::poll(&pfd, 1, 100) <= 0) {
        reapExited();
        if (rc_ == 2) return false;
        continue;
      }
      const ssize_t n = ::read(ups_[0], buf.data() + got, bytes - got);
      if (n <= 0) {
        stopAll();
        return false;
      }
      got += static_cast<size_t>(n);
    }
    for (int fd : downs_) writeAll(fd, buf.data(), bytes);
    return true;
  }

  // Waits for every rank: 0 if all exited 0, 1 if a check failed (a rank exited 1; the others finish), 2 otherwise (a
  // rank that exits with anything else stops the ranks still running, which would wait in NCCL, which has no
  // deadline, or in a fused kernel). Only the rank pids are waited for (a private tandemd is reaped by its object).
  int wait() {
    if (!started_) {
      stopAll();
      return 2;
    }
    while (!alive_.empty()) {
      reapExited();
      if (!alive_.empty()) ::usleep(20000);
    }
    return rc_;
  }

 private:
  void stopAll() {
    for (pid_t q : alive_) ::kill(q, SIGKILL);
    rc_ = 2;
  }
  void reapExited() {
    for (size_t i = 0; i < alive_.size();) {
      int status = 0;
      const pid_t w = ::waitpid(alive_[i], &status, WNOHANG);
      if (w == 0) {
        ++i;
        continue;
      }
      const pid_t p = alive_[i];
      alive_.erase(alive_.begin() + static_cast<std::ptrdiff_t>(i));
      const int code = w < 0 ? 2 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code == 0) continue;
      rc_ = std::max(rc_, code == 1 ? 1 : 2);
      if (code != 1) {
        std::fprintf(stderr, "rank process %d exited with %d; stopping the other ranks\n", static_cast<int>(p), code);
        for (pid_t q : alive_) ::kill(q, SIGKILL);
      }
    }
  }

  std::vector<pid_t> pids_, alive_;
  std::vector<int> ups_, downs_;
  bool started_ = false;
  int rc_ = 0;
};

}  // namespace tandem::bench
