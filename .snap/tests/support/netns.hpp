// Test support: simulated nodes for multi-daemon tests, one tandemd per node talking TCP to the others.
//
// Where the test may create network namespaces (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN, with `ip netns` working), every
// node gets its own namespace with an `eth0` on a private /24, linked by a veth pair to a bridge in a hub namespace:
//
//     node i (tnd-<pid>-<seq>-<i>): lo, eth0 10.231.X.(i+1)/24  <-veth->  hub (tnd-<pid>-<seq>-hub): n<i> in br0
//
// so a test can cut one node's link (cutLink) and restore it. Nothing is routed to or from the host: the nodes reach
// only each other. Unix sockets live on the file system, which is not namespaced, so clients (tandemctl, the C API)
// run outside and reach a daemon started with `prefix(i)` through its socket as usual.
//
// Otherwise the nodes fall back to distinct loopback addresses 127.0.0.1, 127.0.0.2, ... on the host (every 127/8
// address is local on Linux), and reason() says why. There, links cannot be cut; ports must be ephemeral or chosen
// per test process, since other test processes share the host's loopback.
//
// TANDEM_TEST_NETNS=off forces the loopback fallback; TANDEM_TEST_NETNS=require makes create() throw instead of
// falling back (for CI hosts where namespaces must work).
//
// Usage (declare the nodes before the daemons, so the daemons die before their namespaces are deleted):
//
//     auto nodes = SimulatedNodes::create(2);
//     if (!nodes.namespaces()) MESSAGE("loopback fallback: " << nodes.reason());
//     Daemon a(configFor(nodes.address(0)), {}, "cpu", nodes.prefix(0));
//     Daemon b(configFor(nodes.address(1)), {}, "cpu", nodes.prefix(1));
//     if (nodes.namespaces()) nodes.cutLink(1);  // b's peers see silence, then PEER_LOST
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <utility>

#include "harness.hpp"

namespace tandem::testing {

// The absolute path of a tool (runCommand and Daemon exec without a PATH search); empty when it is nowhere.
inline std::string findTool(const std::string& name) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    for (std::string d; std::getline(ss, d, ':');) {
      if (!d.empty()) dirs.push_back(d);
    }
  }
  for (const char* d : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) dirs.emplace_back(d);
  for (const auto& d : dirs) {
    const std::string candidate = d + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

class SimulatedNodes {
 public:
  enum class Mode {
    Auto,        // namespaces where they work, else loopback (TANDEM_TEST_NETNS may force either)
    Namespaces,  // namespaces or throw std::runtime_error with the reason
    Loopback,    // loopback addresses, no namespaces
  };

  // Creates n nodes (1..200). Removes stale namespaces left by dead test processes first.
  static SimulatedNodes create(int n, Mode mode = Mode::Auto) {
    if (n < 1 || n > 200) throw std::invalid_argument("SimulatedNodes::create: n must be 1..200");
    std::string why = "SimulatedNodes::create was asked for loopback addresses";
    if (mode == Mode::Auto) {
      const char* env = std::getenv("TANDEM_TEST_NETNS");
      const std::string e = env != nullptr ? env : "";
      if (e == "off" || e == "0") {
        mode = Mode::Loopback;
        why = "TANDEM_TEST_NETNS=" + e + " in the environment";
      }
      if (e == "require" || e == "on" || e == "1") mode = Mode::Namespaces;
    }
    SimulatedNodes nodes(n);
    if (mode == Mode::Loopback) {
      nodes.reason_ = why;
      return nodes;
    }
    try {
      nodes.setUp();
      return nodes;
    } catch (const std::exception& e) {
      nodes.tearDown();
      if (mode == Mode::Namespaces) {
        throw std::runtime_error(std::string("SimulatedNodes: network namespaces are required but unavailable: ") +
                                 e.what());
      }
      nodes.reason_ = e.what();
      nodes.namespaces_ = false;
      return nodes;
    }
  }

  SimulatedNodes(SimulatedNodes&& other) noexcept { *this = std::move(other); }
  SimulatedNodes& operator=(SimulatedNodes&& other) noexcept {
    if (this != &other) {
      tearDown();
      n_ = other.n_;
      namespaces_ = other.namespaces_;
      reason_ = std::move(other.reason_);
      ip_ = std::move(other.ip_);
      base_ = std::move(other.base_);
      subnet_ = other.subnet_;
      created_ = std::move(other.created_);
      other.created_.clear();
      other.namespaces_ = false;
    }
    return *this;
  }
  SimulatedNodes(const SimulatedNodes&) = delete;
  SimulatedNodes& operator=(const SimulatedNodes&) = delete;
  ~SimulatedNodes() { tearDown(); }

  int size() const { return n_; }
  // true: real namespaces and veth links; false: the loopback fallback.
  bool namespaces() const { return namespaces_; }
  // Why namespaces are not used (empty when they are).
  const std::string& reason() const { return reason_; }

  // The IPv4 literal node's daemon binds: "10.231.X.(node+1)" in a namespace, "127.0.0.(node+1)" on loopback.
  std::string address(int node) const {
    checkNode(node);
    return namespaces_ ? "10.231." + std::to_string(subnet_) + "." + std::to_string(node + 1)
                       : "127.0.0." + std::to_string(node + 1);
  }
  // The namespace's name ("tnd-<pid>-<seq>-<node>"), empty on loopback.
  std::string name(int node) const {
    checkNode(node);
    return namespaces_ ? base_ + "-" + std::to_string(node) : std::string();
  }
  std::string hubName() const { return namespaces_ ? base_ + "-hub" : std::string(); }
  // Every namespace this object created (nodes and hub); the destructor deletes them.
  const std::vector<std::string>& namespaceNames() const { return created_; }

  // argv prefix that runs a command inside node's namespace: {"/usr/sbin/ip", "netns", "exec", name} (absolute, for
  // execv), or {} on loopback. `ip netns exec` execs the command in place, so its pid is the command's pid.
  std::vector<std::string> prefix(int node) const {
    checkNode(node);
    if (!namespaces_) return {};
    return {ip_, "netns", "exec", name(node)};
  }

  // Takes node's link down on both ends (hub port n<node> and the node's eth0): its packets go nowhere, established
  // connections see silence. Throws std::logic_error on loopback.
  void cutLink(int node) { setLink(node, "down"); }
  void restoreLink(int node) { setLink(node, "up"); }

  // Runs fn in a forked child that has entered node's namespace (setns; on loopback it just forks) and returns fn's
  // result as an exit status (0..255), 125 if the namespace could not be entered, -1 if the child did not finish
  // within timeoutMs (it is killed). The child runs after fork(): keep fn to system calls if the test has threads.
  int runIn(int node, const std::function<int()>& fn, int timeoutMs = 5000) const {
    checkNode(node);
    const std::string path = namespaces_ ? netnsPath(name(node)) : std::string();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      if (!path.empty()) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) std::_Exit(125);
        ::close(fd);
      }
      std::_Exit(fn() & 0xff);
    }
    return reap(pid, timeoutMs);
  }

  // Whether a TCP connection from inside node `from` to a fresh listener at address(to) (inside node `to`, ephemeral
  // port) completes within timeoutMs. detail (optional) says what happened: "connected in N ms", "refused",
  // "timed out after N ms", or the error.
  bool canConnect(int from, int to, int timeoutMs = 2000, std::string* detail = nullptr) const {
    checkNode(from);
    checkNode(to);
    std::string dummy;
    std::string& why = detail != nullptr ? *detail : dummy;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    if (::inet_pton(AF_INET, address(to).c_str(), &addr.sin_addr) != 1) throw std::logic_error("bad address");

    // The listener: binds address(to):0 inside `to`, reports {port, errno} and holds the socket until `hold` closes.
    int report[2], hold[2];
    if (::pipe2(report, O_CLOEXEC) != 0 || ::pipe2(hold, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    const std::string toPath = namespaces_ ? netnsPath(name(to)) : std::string();
    const pid_t listener = ::fork();
    if (listener < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (listener == 0) {
      ::close(report[0]);
      ::close(hold[1]);
      int32_t msg[2] = {0, 0};
      int fd = -1;
      if (!toPath.empty()) {
        const int ns = ::open(toPath.c_str(), O_RDONLY | O_CLOEXEC);
        if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) msg[1] = errno;
      }
      sockaddr_in bound = addr;
      socklen_t len = sizeof bound;
      if (msg[1] == 0) {
        fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0 ||
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
          msg[1] = errno;
        } else {
          msg[0] = ntohs(bound.sin_port);
        }
      }
      (void)!::write(report[1], msg, sizeof msg);
      char c;
      (void)!::read(hold[0], &c, 1);  // returns when the parent closes its end (or dies)
      std::_Exit(0);
    }
    ::close(report[1]);
    ::close(hold[0]);
    auto finish = [&](bool ok, const std::string& what) {
      ::close(report[0]);
      ::close(hold[1]);
      reap(listener, 2000);  // its read of `hold` returns now
      why = what;
      return ok;
    };
    int32_t msg[2] = {0, 0};
    pollfd pfd{report[0], POLLIN, 0};
    if (::poll(&pfd, 1, 5000) != 1 || ::read(report[0], msg, sizeof msg) != static_cast<ssize_t>(sizeof msg)) {
      return finish(false, "the listener in node " + std::to_string(to) + " did not report within 5 s");
    }
    if (msg[1] != 0) {
      return finish(false, "listening on " + address(to) + " in node " + std::to_string(to) +
                               " failed: " + std::strerror(msg[1]));
    }
    addr.sin_port = htons(static_cast<uint16_t>(msg[0]));

    // The connector: a non-blocking connect inside `from`; exits 0, the errno, or kTimedOut.
    constexpr int kTimedOut = 254;
    const auto t0 = Clock::now();
    const int rc = runIn(
        from,
        [&] {
          const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
          if (fd < 0) return errno;
          if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) return 0;
          if (errno != EINPROGRESS) return errno;
          pollfd p{fd, POLLOUT, 0};
          const int ready = ::poll(&p, 1, timeoutMs);
          if (ready == 0) return kTimedOut;
          if (ready < 0) return errno;
          int err = 0;
          socklen_t len = sizeof err;
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          return err;
        },
        timeoutMs + 3000);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    const std::string target = "node " + std::to_string(from) + " -> " + address(to) + ":" +
                               std::to_string(msg[0]) + " (node " + std::to_string(to) + ")";
    if (rc == 0) return finish(true, target + ": connected in " + std::to_string(ms) + " ms");
    if (rc == kTimedOut || rc < 0) return finish(false, target + ": timed out after " + std::to_string(ms) + " ms");
    if (rc == 125) return finish(false, target + ": could not enter node " + std::to_string(from) + "'s namespace");
    if (rc == ECONNREFUSED) return finish(false, target + ": refused");
    return finish(false, target + ": " + std::strerror(rc));
  }

  // Runs `ip ARGS...`; throws with the command and its stderr when it fails.
  void ip(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {ip_};
    argv.insert(argv.end(), args.begin(), args.end());
    const CommandResult r = runCommand(argv, 10000);
    if (r.exitCode != 0) {
      std::string cmd = "ip";
      for (const auto& a : args) cmd += " " + a;
      std::string err = r.err.empty() ? r.out : r.err;
      while (!err.empty() && err.back() == '\n') err.pop_back();
      throw std::runtime_error("`" + cmd + "` failed (exit " + std::to_string(r.exitCode) + "): " + err);
    }
  }

  // The namespaces `ip netns list` shows.
  static std::vector<std::string> listNamespaces(const std::string& ipPath) {
    std::vector<std::string> names;
    if (ipPath.empty()) return names;
    const CommandResult r = runCommand({ipPath, "netns", "list"}, 10000);
    std::stringstream ss(r.out);
    for (std::string line; std::getline(ss, line);) {
      const std::string name = line.substr(0, line.find(' '));  // "NAME (id: 3)"
      if (!name.empty()) names.push_back(name);
    }
    return names;
  }

  static constexpr const char* kPrefix = "tnd-";

 private:
  explicit SimulatedNodes(int n) : n_(n) {
    static std::atomic<int> sequence{0};
    const int seq = sequence++;
    base_ = kPrefix + std::to_string(::getpid()) + "-" + std::to_string(seq);
    subnet_ = 1 + static_cast<int>((static_cast<unsigned>(::getpid()) * 7u + static_cast<unsigned>(seq)) % 254u);
  }

  static std::string netnsPath(const std::string& name) { return "/var/run/netns/" + name; }

  void checkNode(int node) const {
    if (node < 0 || node >= n_) {
      throw std::out_of_range("SimulatedNodes: node " + std::to_string(node) + " is not in 0.." +
                              std::to_string(n_ - 1));
    }
  }

  // Deletes "tnd-<pid>-..." namespaces whose test process is gone (a crashed or killed test leaves them behind).
  void removeStale() const {
    for (const auto& name : listNamespaces(ip_)) {
      if (name.rfind(kPrefix, 0) != 0) continue;
      const std::size_t start = std::strlen(kPrefix), dash = name.find('-', start);
      if (dash == std::string::npos || dash == start) continue;
      const std::string digits = name.substr(start, dash - start);
      if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
      const pid_t pid = static_cast<pid_t>(std::stol(digits));
      if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (EPERM: alive, someone else's)
      runCommand({ip_, "netns", "delete", name}, 10000);
    }
  }

  void addNamespace(const std::string& name) {
    ip({"netns", "add", name});
    created_.push_back(name);
  }

  void setUp() {
    ip_ = findTool("ip");
    if (ip_.empty()) throw std::runtime_error("the ip tool (iproute2) is not in PATH, /usr/sbin or /sbin");
    removeStale();
    namespaces_ = true;  // so name() and address() give the namespace values while building
    try {
      addNamespace(hubName());
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string(e.what()) +
                               " (creating network namespaces needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN)");
    }
    const std::string hub = hubName();
    ip({"-n", hub, "link", "add", "br0", "type", "bridge"});
    ip({"-n", hub, "link", "set", "br0", "up"});
    for (int i = 0; i < n_; ++i) {
      const std::string node = name(i), port = "n" + std::to_string(i);
      addNamespace(node);
      ip({"-n", node, "link", "set", "lo", "up"});
      ip({"-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node});
      ip({"-n", hub, "link", "set", port, "master", "br0", "up"});
      ip({"-n", node, "addr", "add", address(i) + "/24", "dev", "eth0"});
      ip({"-n", node, "link", "set", "eth0", "up"});
    }
    // The bridge forwards: node 0 reaches every other node (and, on one node, itself through lo).
    for (int i = n_ > 1 ? 1 : 0; i < n_; ++i) {
      std::string detail;
      if (!canConnect(0, i, 2000, &detail)) {
        throw std::runtime_error("namespaces were created but node 0 cannot reach node " + std::to_string(i) +
                                 " over the veth bridge: " + detail);
      }
    }
  }

  void setLink(int node, const std::string& state) {
    checkNode(node);
    if (!namespaces_) {
      throw std::logic_error("SimulatedNodes: links can be cut only between network namespaces, which are "
                             "unavailable here: " + reason_);
    }
    ip({"-n", hubName(), "link", "set", "n" + std::to_string(node), state});
    ip({"-n", name(node), "link", "set", "eth0", state});
  }

  // Never throws; says on stderr what it could not delete.
  void tearDown() noexcept {
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
      try {
        const CommandResult r = runCommand({ip_, "netns", "delete", *it}, 10000);
        if (r.exitCode != 0) std::cerr << "SimulatedNodes: could not delete namespace " << *it << ": " << r.err;
      } catch (const std::exception& e) {
        std::cerr << "SimulatedNodes: could not delete namespace " << *it << ": " << e.what() << "\n";
      }
    }
    created_.clear();
  }

  // Waits for pid up to timeoutMs: its exit status, or -1 (killed at the deadline, or died by a signal).
  static int reap(pid_t pid, int timeoutMs) {
    int status = 0;
    const bool done = eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeoutMs);
    if (!done) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  int n_ = 0;
  bool namespaces_ = false;
  std::string reason_;
  std::string ip_;
  std::string base_;
  int subnet_ = 1;
  std::vector<std::string> created_;
};

}  // namespace tandem::testing
