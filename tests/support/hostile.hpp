// What the hostile-client tests share: the daemon's fds, RSS and CPU time from /proc, raw protocol frames, an
// honest client in its own process, and the check that follows every attack (an honest gemm-ar in normal time,
// fds and RSS back near their baseline, SIGTERM obeyed).
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/tandem.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::testing {
namespace hostile_detail {
namespace pb = tandem::v1;


// Short deadlines, so that the attacks end within the test's few seconds.
inline constexpr const char* kFastLimits =
    "limits:\n"
    "  hello_timeout_ms: 300\n"
    "  frame_timeout_ms: 300\n";

// The targets of a process's fds, one per line (for failure messages).
inline std::string fdList(pid_t pid) {
  std::string out;
  for (const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code ec;
    out += fmt::format("{} -> {}\n", entry.path().filename().string(), std::filesystem::read_symlink(entry, ec).string());
  }
  return out;
}

inline int fdCount(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) ++n;
  return n;
}

// Resident set in KiB (VmRSS), 0 when unreadable.
inline long rssKiB(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

// CPU time the process has used (user + system), in seconds.
inline double cpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), {});
  std::istringstream fields(text.substr(text.rfind(')') + 2));  // after "pid (comm) "
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

inline ::tandem::Fd rawConnect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  ::tandem::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd.get() >= 0);
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

inline std::string frameOf(const pb::Request& request) {
  return ::tandem::encodeFrame(request.SerializeAsString(), 1u << 20);
}

inline std::string helloFrame() {
  pb::Request r;
  r.set_request_id(1);
  r.mutable_hello()->set_protocol_version(TANDEM_PROTOCOL_VERSION);
  return frameOf(r);
}

inline std::string queryStatusFrame(uint64_t id) {
  pb::Request r;
  r.set_request_id(id);
  r.mutable_query_status();
  return frameOf(r);
}

inline void sendAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    REQUIRE(n > 0);
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Sends a frame with fds attached (SCM_RIGHTS). Returns false when the daemon has hung up.
inline bool sendWithFds(int socket, const std::string& frame, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(frame.data()), frame.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  return ::sendmsg(socket, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(frame.size());
}

// Reads one response frame within timeoutMs (fds that come with it are closed). nullopt: EOF or timeout.
inline std::optional<pb::Response> readResponse(int fd, int timeoutMs) {
  ::tandem::FrameDecoder decoder(1u << 20);
  try {
    const std::string frame = ::tandem::recvFrame(fd, decoder, timeoutMs);
    pb::Response response;
    if (!response.ParseFromString(frame)) return std::nullopt;
    return response;
  } catch (const ::tandem::Error&) {
    return std::nullopt;
  }
}

// Whether the daemon closes `fd` within timeoutMs (whatever it sends before is read and dropped).
inline bool daemonHangsUp(int fd, int timeoutMs) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  char buf[65536];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (::poll(&p, 1, static_cast<int>(std::max<long>(1, left))) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// How many of `fds` the daemon closes within one shared deadline of timeoutMs.
inline std::size_t hungUpCount(const std::vector<::tandem::Fd>& fds, int timeoutMs) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  std::size_t count = 0;
  for (const auto& fd : fds) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    count += daemonHangsUp(fd.get(), static_cast<int>(std::max<long>(1, left))) ? 1 : 0;
  }
  return count;
}

// An honest client, in its own process so that a wedged daemon cannot hang the test: two sessions (one per rank,
// on two threads) run a 2-rank fp32 gemm-ar and check it. Returns the milliseconds it took from connect to the
// checked result, or -1 (with `error` set) when it failed or did not finish within timeoutMs.
inline long honestGemmAr(const std::string& socket, std::string* error = nullptr, int timeoutMs = 10000) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    const auto t0 = Clock::now();
    const tandem_unique_id_t id = ::tandem::uniqueId();
    std::string results[2];
    auto rank = [&](uint32_t r) {
      try {
        const uint64_t m = 8, n = 8, k = 16;
        ::tandem::Session s(socket.c_str());
        ::tandem::Communicator comm(s, id, 2, r, 5000);
        ::tandem::Buffer a(s, m * k * 4), b(s, n * k * 4), c(s, m * n * 4);
        for (uint64_t i = 0; i < m * k; ++i) a.as<float>()[i] = 1.0f;
        for (uint64_t i = 0; i < n * k; ++i) b.as<float>()[i] = static_cast<float>(r + 1);
        tandem_gemm_ar_args_t args{sizeof args, TANDEM_DTYPE_FP32, m, n, k, a.tensor(), b.tensor(), c.tensor(), nullptr};
        tandem_op_t op;
        ::tandem::check(tandem_gemm_ar(comm.get(), &args, &op));
        ::tandem::wait(op, 5000);
        // C = sum over ranks of k * (r + 1) = 16 * 1 + 16 * 2.
        for (uint64_t i = 0; i < m * n; ++i) {
          if (c.as<float>()[i] != 48.0f) {
            results[r] = fmt::format("wrong result {} at {}", c.as<float>()[i], i);
            return;
          }
        }
        results[r] = "ok";
      } catch (const std::exception& e) {
        results[r] = e.what();
      }
    };
    std::thread t1(rank, 1);
    rank(0);
    t1.join();
    const long ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    const std::string out = results[0] == "ok" && results[1] == "ok"
                                ? fmt::format("ok {}\n", ms)
                                : fmt::format("fail rank0: {} / rank1: {}\n", results[0], results[1]);
    [[maybe_unused]] ssize_t w = ::write(p[1], out.data(), out.size());
    std::_Exit(0);
  }
  ::close(p[1]);
  std::string out;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  while (Clock::now() < deadline && out.find('\n') == std::string::npos) {
    pollfd pf{p[0], POLLIN, 0};
    if (::poll(&pf, 1, 20) <= 0) continue;
    char buf[512];
    const ssize_t n = ::read(p[0], buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(p[0]);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  if (out.rfind("ok ", 0) == 0) return std::stol(out.substr(3));
  if (error != nullptr) *error = out.empty() ? fmt::format("no result within {} ms (hung)", timeoutMs) : out;
  return -1;
}

// The daemon's state before an attack.
struct Baseline {
  int fds;
  long rssKiB;
  long honestMs;
};

inline Baseline baseline(Daemon& d) {
  // A first op warms up whatever the daemon opens once (worker threads, lazily loaded state); the second is timed.
  REQUIRE(honestGemmAr(d.socket()) >= 0);
  // The daemon is idle once the warm-up's sessions are gone: poll until the count stops falling.
  int idleFds = fdCount(d.pid());
  while (eventually([&] { return fdCount(d.pid()) < idleFds; }, 100)) idleFds = fdCount(d.pid());
  const std::string idleList = fdList(d.pid());
  std::string error;
  const long ms = honestGemmAr(d.socket(), &error);
  INFO(error);
  REQUIRE(ms >= 0);
  // The honest client's sessions close asynchronously: count once their fds are gone.
  INFO("idle fds:\n" << idleList);
  CHECK_MESSAGE(eventually([&] { return fdCount(d.pid()) <= idleFds; }, 3000), "now:\n" << fdList(d.pid()));
  return {fdCount(d.pid()), rssKiB(d.pid()), ms};
}

// After an attack: an honest gemm-ar in normal time, fds and RSS back near the baseline, SIGTERM obeyed.
inline void checkRecovered(Daemon& d, const Baseline& b, const std::string& attack) {
  std::string error;
  const long ms = honestGemmAr(d.socket(), &error);
  INFO("attack: " << attack << "; honest gemm-ar: " << error);
  CHECK(ms >= 0);
  CHECK(ms < 2000);
  // The honest session leaves too; allow a couple of fds for lazily opened things (the journal, /proc reads).
  CHECK(eventually([&] { return fdCount(d.pid()) <= b.fds + 2; }, 3000));
  const long rss = rssKiB(d.pid());
  CHECK(rss <= b.rssKiB + 16 * 1024);
  MESSAGE(attack << ": honest gemm-ar " << b.honestMs << " ms before, " << ms << " ms after; daemon fds "
                 << b.fds << " -> " << fdCount(d.pid()) << ", RSS " << b.rssKiB << " -> " << rss << " KiB");
  CHECK(!d.exited());
  d.signal(SIGTERM);
  CHECK(d.waitExit(5000) == 0);
}

}  // namespace hostile_detail
using namespace hostile_detail;
}  // namespace tandem::testing
