// The tcp transport over real sockets on 127.0.0.x with ports chosen by the kernel: several transports in
// one process, and nodes in separate processes (fork). Data + flag ordering, many writes over several
// connections, all-to-all among three nodes, a wrong secret or protocol version refused on both sides, a
// SIGKILLed or frozen peer reported lost within its deadline, a clean shutdown seen as closed, and a connect
// deadline. Every wait has a deadline and says what it waited for.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "transport/tcp_transport.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::string hostOf(NodeIndex node) { return fmt::format("127.0.0.{}", node + 1); }

TcpConfig config(NodeIndex self, std::string secret = "test-secret", uint32_t conns = 1) {
  TcpConfig c;
  c.self = self;
  c.listenHost = hostOf(self);
  c.listenPort = 0;
  c.secret = std::move(secret);
  c.connectionsPerPeer = conns;
  c.connectTimeoutMs = 5000;
  c.heartbeatIntervalMs = 50;
  c.peerDeadlineMs = 1000;
  return c;
}

// Polls `pred` until it holds or `timeout` passes; returns whether it held.
bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

uint64_t loadAcquire(const uint64_t& word) {
  // acquire: pairs with the transport's release store of the flag (TcpTransport applyFlags).
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(word)).load(std::memory_order_acquire);
}

// Connects every transport to all others, each connect() in its own thread (they block until all are up).
// Returns the exception each one threw (empty when it connected).
std::vector<std::optional<Error>> connectAll(std::vector<std::unique_ptr<TcpTransport>>& ts) {
  std::vector<NodeAddress> nodes;
  for (std::size_t i = 0; i < ts.size(); ++i) nodes.push_back({hostOf(static_cast<NodeIndex>(i)), ts[i]->listenPort()});
  std::vector<std::optional<Error>> errors(ts.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        ts[i]->connect(nodes);
      } catch (const Error& e) {
        errors[i] = e;
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::unique_ptr<TcpTransport>> makeCluster(std::vector<TcpConfig> configs) {
  std::vector<std::unique_ptr<TcpTransport>> ts;
  for (auto& c : configs) ts.push_back(std::make_unique<TcpTransport>(std::move(c)));
  return ts;
}

void requireConnected(std::vector<std::unique_ptr<TcpTransport>>& ts) {
  const auto errors = connectAll(ts);
  for (std::size_t i = 0; i < errors.size(); ++i) {
    if (errors[i]) FAIL("node ", i, " failed to connect: ", errors[i]->what());
  }
}

// The bootstrap exchange, reduced to its essence: keys travel as bytes.
RemoteKey viaWire(const RemoteKey& key) { return RemoteKey::decode(key.encode()); }

std::size_t drainCompletions(Transport& t, std::vector<Completion>& into) {
  std::array<Completion, 64> buf{};
  const std::size_t n = t.poll(buf);
  into.insert(into.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

// ---- pipes between a test and its forked child; every read has a deadline ----
struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() { REQUIRE(::pipe(fd) == 0); }
  ~Pipe() { closeBoth(); }
  void closeBoth() {
    for (int& f : fd) {
      if (f >= 0) ::close(f);
      f = -1;
    }
  }
};

bool writeAll(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool readExact(int fd, void* data, std::size_t n, std::chrono::milliseconds timeout) {
  auto* p = static_cast<char*>(data);
  const auto deadline = Clock::now() + timeout;
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

template <typename T>
void send(int fd, const T& v) {
  if (!writeAll(fd, &v, sizeof v)) throw Error(ErrorCode::kSystem, "pipe write failed");
}
template <typename T>
T receive(int fd, std::chrono::milliseconds timeout, const char* what) {
  T v{};
  if (!readExact(fd, &v, sizeof v, timeout)) throw Error(ErrorCode::kTimeout, fmt::format("no {} from the other process within {} ms", what, timeout.count()));
  return v;
}
using KeyBytes = std::array<std::byte, RemoteKey::kWireBytes>;
KeyBytes keyBytes(const RemoteKey& k) {
  KeyBytes b{};
  const auto v = k.encode();
  std::copy(v.begin(), v.end(), b.begin());
  return b;
}

// A forked node. The body runs in the child and returns its exit status; the child never returns into doctest.
struct Child {
  pid_t pid = -1;
  template <typename Body>
  explicit Child(Body body) {
    std::fflush(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int status = 1;
      try {
        status = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child node: %s\n", e.what());
        status = 2;
      }
      std::fflush(nullptr);
      ::_exit(status);
    }
  }
  // Waits for the child to exit; SIGKILLs it at the deadline. Returns the exit status, or -signal.
  int wait(std::chrono::milliseconds timeout) {
    if (pid < 0) return 0;
    const auto deadline = Clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) break;
      if (Clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        pid = -1;
        FAIL("child node did not exit within ", timeout.count(), " ms; killed it");
        return -SIGKILL;
      }
      std::this_thread::sleep_for(1ms);
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

}  // namespace

TEST_CASE("a flag written after data is observed only with all the data, over one or three connections") {
  const uint32_t conns = GENERATE_CONNS_PLACEHOLDER;
}
