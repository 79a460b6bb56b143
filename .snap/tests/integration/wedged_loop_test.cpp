// A control loop that stops answering, as a bug could wedge it: the systemd watchdog stops being fed (so systemd
// would restart tandemd), and SIGTERM still ends the process within daemon.stop_grace_ms, with the reason logged.
// TANDEM_TEST_STALL_CONTROL_LOOP_MS makes tandemd's control loop block for good after that many ms; the test is
// the systemd notify socket (NOTIFY_SOCKET, WATCHDOG_USEC), so it sees every READY=1 and WATCHDOG=1.
#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <string>

#include "harness.hpp"
#include "tandem/common/fd.hpp"

using namespace tandem::testing;

namespace {

// A datagram socket standing in for systemd's notify socket.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = tandem::Fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    if (fd_.get() < 0 || ::bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      throw std::runtime_error("cannot bind the notify socket " + path);
    }
  }
  // The messages that arrive within timeoutMs.
  std::vector<std::string> receive(int timeoutMs) {
    std::vector<std::string> out;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return out;
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) out.emplace_back(buf, static_cast<std::size_t>(n));
    }
  }

 private:
  std::string path_;
  tandem::Fd fd_;
};

std::size_t countWith(const std::vector<std::string>& messages, const std::string& what) {
  std::size_t n = 0;
  for (const auto& m : messages) n += m.find(what) != std::string::npos ? 1 : 0;
  return n;
}

// Sets environment variables for the tandemd the case starts (it inherits them), and unsets them after.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<std::string, std::string>> vars) {
    for (const auto& [k, v] : vars) {
      ::setenv(k.c_str(), v.c_str(), 1);
      names_.push_back(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& k : names_) ::unsetenv(k.c_str());
  }

 private:
  std::vector<std::string> names_;
};

}  // namespace

// Built with libsystemd only: without it tandemd sends no notifications, and CTest reports this suite Skipped
// (tests/integration/CMakeLists.txt).
#if TANDEM_TEST_HAVE_SYSTEMD
TEST_SUITE("the systemd watchdog") {
  TEST_CASE("the watchdog is fed from the control loop, stops when it wedges, and SIGTERM still ends tandemd") {
    TempDir dir;
    NotifySocket notify((dir.path() / "notify").string());
    constexpr int kStallAfterMs = 1500;
    constexpr int kGraceMs = 1000;
    std::unique_ptr<Daemon> d;
    {
      const ScopedEnv env{{"NOTIFY_SOCKET", (dir.path() / "notify").string()},
                          {"WATCHDOG_USEC", "200000"},  // a ping every 100 ms
                          {"TANDEM_TEST_STALL_CONTROL_LOOP_MS", std::to_string(kStallAfterMs)}};
      d = std::make_unique<Daemon>(fmt::format("daemon:\n  stop_grace_ms: {}\n", kGraceMs));
    }
    const auto started = Clock::now();
    // While the loop turns: READY=1, then a WATCHDOG=1 about every 100 ms.
    const auto early = notify.receive(1000);
    CHECK(countWith(early, "READY=1") == 1);
    const std::size_t pings = countWith(early, "WATCHDOG=1");
    MESSAGE("watchdog pings in the first second: " << pings);
    CHECK(pings >= 5);
    // Once the loop is wedged, no more pings: systemd's WatchdogSec= would kill and restart tandemd.
    const auto stallAt = started + std::chrono::milliseconds(kStallAfterMs + 300);
    notify.receive(static_cast<int>(
        std::max<long>(1, std::chrono::duration_cast<std::chrono::milliseconds>(stallAt - Clock::now()).count())));
    const auto late = notify.receive(1000);
    CHECK(countWith(late, "WATCHDOG=1") == 0);
    CHECK(!d->exited());
    // SIGTERM: the drain cannot happen (the loop never runs it), so tandemd exits on its own after the grace.
    const auto t0 = Clock::now();
    d->signal(SIGTERM);
    const int code = d->waitExit(kGraceMs + 3000);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    MESSAGE("wedged tandemd exited " << ms << " ms after SIGTERM with status " << code);
    CHECK(code == 1);
    CHECK(ms >= kGraceMs - 50);
    CHECK(d->log().find("daemon.stop_grace_ms") != std::string::npos);
  }
}
#endif

TEST_SUITE("a wedged control loop") {
  TEST_CASE("without a watchdog or a stall, SIGTERM drains and exits 0 well within the grace period") {
    Daemon d("daemon:\n  stop_grace_ms: 5000\n");
    REQUIRE(eventually([&] { return socketAccepts(d.socket()); }, 2000));
    const auto t0 = Clock::now();
    d.signal(SIGTERM);
    CHECK(d.waitExit(5000) == 0);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    CHECK(ms < 2000);
    CHECK(d.log().find("systemd watchdog") == std::string::npos);
  }
}
