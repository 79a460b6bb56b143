// Test support: temporary directories, child processes with deadlines, and a real tandemd per test.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tandem::testing {

using Clock = std::chrono::steady_clock;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tandem-test-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exitCode = -1;  // -1: killed at the deadline
  std::string out;
  std::string err;
};

// Runs argv to completion (or kills it at the deadline), capturing stdout and stderr.
inline CommandResult runCommand(const std::vector<std::string>& argv, int timeoutMs = 60000) {
  int outPipe[2], errPipe[2];
  if (::pipe2(outPipe, O_CLOEXEC) != 0 || ::pipe2(errPipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(outPipe[1], 1);
    ::dup2(errPipe[1], 2);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  ::close(outPipe[1]);
  ::close(errPipe[1]);
  CommandResult r;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  pollfd fds[2] = {{outPipe[0], POLLIN, 0}, {errPipe[0], POLLIN, 0}};
  int open = 2;
  while (open > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    ::poll(fds, 2, static_cast<int>(left));
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
      } else {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      }
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Polls `pred` until it holds or the deadline passes. Returns whether it held.
inline bool eventually(const std::function<bool()>& pred, int timeoutMs = 5000) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

inline bool socketAccepts(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

// A real tandemd in the foreground on a private socket; its stderr goes to a log file in the temp dir.
class Daemon {
 public:
  // backend: passed as --backend (the CPU backend by default, so these tests run the same on any host); empty
  // leaves the choice to the config (the GPU tests set daemon.backend: cuda there).
  // prefix: an argv that runs tandemd, e.g. SimulatedNodes::prefix(i) = {"/usr/sbin/ip", "netns", "exec", NAME} to
  // run it inside a network namespace (the prefix must exec in place, so that pid() stays tandemd's pid).
  explicit Daemon(const std::string& configYaml = "", std::vector<std::string> extraArgs = {},
                  const std::string& backend = "cpu", std::vector<std::string> prefix = {}) {
    socket_ = (dir_.path() / "tandemd.sock").string();
    log_ = (dir_.path() / "tandemd.log").string();
    std::vector<std::string> argv = {TANDEMD_PATH, "--foreground", "--socket", socket_};
    if (!backend.empty()) argv.insert(argv.end(), {"--backend", backend});
    if (!configYaml.empty()) {
      const std::string config = (dir_.path() / "tandemd.yaml").string();
      std::ofstream(config) << configYaml;
      argv.insert(argv.end(), {"--config", config});
    }
    argv.insert(argv.end(), extraArgs.begin(), extraArgs.end());
    argv.insert(argv.begin(), prefix.begin(), prefix.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 2);
      ::dup2(fd, 1);
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());  // the same as execv for an absolute path; a prefix may name a tool by name
      std::_Exit(127);
    }
    if (!eventually([&] { return socketAccepts(socket_) || exited(); }, 10000) || exited()) {
      throw std::runtime_error("tandemd did not start serving within 10 s; its log:\n" + log());
    }
  }
  ~Daemon() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }
  const std::filesystem::path& dir() const { return dir_.path(); }
  std::string log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void signal(int sig) { ::kill(pid_, sig); }
  bool exited() {
    if (reaped_) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      exitCode_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    }
    return reaped_;
  }
  // Exit code (negative signal number if killed), or nullopt-like INT_MIN if it did not exit in time.
  int waitExit(int timeoutMs) {
    if (!eventually([&] { return exited(); }, timeoutMs)) return -1000;
    return exitCode_;
  }
  std::string ctl(std::vector<std::string> args, int* exitCode = nullptr, int timeoutMs = 60000) const {
    std::vector<std::string> argv = {TANDEMCTL_PATH, "--socket", socket_};
    argv.insert(argv.end(), args.begin(), args.end());
    const CommandResult r = runCommand(argv, timeoutMs);
    if (exitCode != nullptr) *exitCode = r.exitCode;
    return r.out + r.err;
  }

 private:
  TempDir dir_;
  std::string socket_, log_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exitCode_ = 0;
};

// `tandemctl status --json` against the daemon, parsed.
inline nlohmann::json daemonStatus(const Daemon& d) {
  int code = 0;
  const std::string out = d.ctl({"status", "--json"}, &code);
  if (code != 0) throw std::runtime_error("tandemctl status failed: " + out);
  return nlohmann::json::parse(out);
}

// Multi-node: whether, within timeoutMs, every daemon sees every other node in `state` ("connected", "failed").
inline bool clusterNodesIn(const std::vector<std::unique_ptr<Daemon>>& daemons, const std::string& state,
                           int timeoutMs) {
  return eventually(
      [&] {
        for (const auto& d : daemons) {
          const auto st = daemonStatus(*d);
          if (!st.contains("cluster")) return false;
          for (const auto& node : st["cluster"]["nodes"]) {
            if (node["state"] != "self" && node["state"] != state) return false;
          }
        }
        return true;
      },
      timeoutMs);
}

// Every daemon's log, headed by its node index.
inline std::string clusterLogs(const std::vector<std::unique_ptr<Daemon>>& daemons) {
  std::string out;
  for (size_t i = 0; i < daemons.size(); ++i) out += fmt::format("---- node {} log:\n{}\n", i, daemons[i]->log());
  return out;
}

}  // namespace tandem::testing
