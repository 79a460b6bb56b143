// What a test or the soak reads about a running tandemd from /proc (fds, threads, RSS, CPU time), and the raw
// protocol a hostile client speaks (connect, frames, fds by SCM_RIGHTS, waiting for a hang-up). No test framework:
// failures throw std::runtime_error, so the doctest suites and the soak (a plain program) share one copy.
#pragma once

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/tandem.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::testing {

// The targets of a process's fds, one per line (for failure messages).
inline std::string fdList(pid_t pid) {
  std::string out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec)) {
    std::error_code linkEc;
    out += fmt::format("{} -> {}\n", entry.path().filename().string(),
                       std::filesystem::read_symlink(entry, linkEc).string());
  }
  return out;
}

// Open fds of a process, -1 when it is gone.
inline int fdCount(pid_t pid) {
  std::error_code ec;
  std::filesystem::directory_iterator it(fmt::format("/proc/{}/fd", pid), ec);
  if (ec) return -1;
  int n = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    ++n;
  }
  return n;
}

// A numeric field of /proc/PID/status ("VmRSS", "Threads"), 0 when unreadable.
inline long procStatusField(pid_t pid, std::string_view field) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size()));
  }
  return 0;
}

// Resident set in KiB (VmRSS), 0 when unreadable.
inline long rssKiB(pid_t pid) { return procStatusField(pid, "VmRSS"); }

// Threads of the process, 0 when unreadable.
inline long threadCount(pid_t pid) { return procStatusField(pid, "Threads"); }

// CPU time the process has used (user + system), in seconds.
inline double cpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), {});
  if (text.rfind(')') == std::string::npos) return 0;
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
  if (fd.get() < 0) throw std::runtime_error(fmt::format("socket(AF_UNIX) failed: {}", std::strerror(errno)));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error(fmt::format("connect({}) failed: {}", path, std::strerror(errno)));
  }
  return fd;
}

inline std::string frameOf(const v1::Request& request) {
  return ::tandem::encodeFrame(request.SerializeAsString(), 1u << 20);
}

inline std::string helloFrame() {
  v1::Request r;
  r.set_request_id(1);
  r.mutable_hello()->set_protocol_version(TANDEM_PROTOCOL_VERSION);
  return frameOf(r);
}

inline std::string queryStatusFrame(uint64_t id) {
  v1::Request r;
  r.set_request_id(id);
  r.mutable_query_status();
  return frameOf(r);
}

// Sends every byte; throws when the daemon hung up first.
inline void sendAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) throw std::runtime_error(fmt::format("send to tandemd failed: {}", std::strerror(errno)));
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

// Reads one response frame within timeoutMs (fds that come with it are closed). Throws ::tandem::Error saying why
// there is none: the connection closed, the time passed, or the frame is not a Response.
inline v1::Response recvResponse(int fd, int timeoutMs) {
  ::tandem::FrameDecoder decoder(1u << 20);
  const std::string frame = ::tandem::recvFrame(fd, decoder, timeoutMs);
  v1::Response response;
  if (!response.ParseFromString(frame)) ::tandem::fail(::tandem::ErrorCode::kProtocol, "the reply is not a Response");
  return response;
}

// recvResponse, with nullopt for no response.
inline std::optional<v1::Response> readResponse(int fd, int timeoutMs) {
  try {
    return recvResponse(fd, timeoutMs);
  } catch (const ::tandem::Error&) {
    return std::nullopt;
  }
}

// Whether the daemon closes `fd` within timeoutMs (whatever it sends before is read and dropped).
inline bool daemonHangsUp(int fd, int timeoutMs) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
  char buf[65536];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (::poll(&p, 1, static_cast<int>(std::max<long>(1, left))) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// How many of `fds` the daemon closes within one shared deadline of timeoutMs.
inline std::size_t hungUpCount(const std::vector<::tandem::Fd>& fds, int timeoutMs) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
  std::size_t count = 0;
  for (const auto& fd : fds) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    count += daemonHangsUp(fd.get(), static_cast<int>(std::max<long>(1, left))) ? 1 : 0;
  }
  return count;
}

}  // namespace tandem::testing
