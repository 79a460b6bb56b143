#include "tandem/common/framing.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "tandem/common/error.hpp"

namespace tandem {
namespace {

uint32_t readLength(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

}  // namespace

std::string encodeFrame(std::string_view payload, std::size_t maxFrameBytes) {
  if (payload.size() > maxFrameBytes) {
    fail(ErrorCode::kProtocol, "frame of {} bytes exceeds the limit of {} bytes (limits.max_frame_bytes)",
         payload.size(), maxFrameBytes);
  }
  std::string out(kFrameHeaderBytes, '\0');
  const auto n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.append(payload);
  return out;
}

void FrameDecoder::append(std::span<const std::byte> bytes) {
  buffer_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::optional<std::string> FrameDecoder::next() {
  if (buffer_.size() < kFrameHeaderBytes) return std::nullopt;
  const uint32_t length = readLength(buffer_.data());
  if (length > maxFrameBytes_) {
    fail(ErrorCode::kProtocol, "incoming frame announces {} bytes, over the limit of {} bytes (limits.max_frame_bytes)",
         length, maxFrameBytes_);
  }
  if (buffer_.size() < kFrameHeaderBytes + length) return std::nullopt;
  std::string frame = buffer_.substr(kFrameHeaderBytes, length);
  buffer_.erase(0, kFrameHeaderBytes + length);
  return frame;
}

Fd FrameDecoder::takeFd() {
  if (fds_.empty()) fail(ErrorCode::kProtocol, "message needs a file descriptor, but none arrived with it (SCM_RIGHTS)");
  Fd fd = std::move(fds_.front());
  fds_.pop_front();
  return fd;
}

void sendFrame(int socketFd, std::string_view payload, std::span<const int> fds, std::size_t maxFrameBytes) {
  const std::string frame = encodeFrame(payload, maxFrameBytes);
  if (fds.size() > kMaxFdsPerFrame) fail(ErrorCode::kInternal, "{} fds in one frame (max {})", fds.size(), kMaxFdsPerFrame);
  std::size_t sent = 0;
  while (sent < frame.size()) {
    iovec iov{const_cast<char*>(frame.data() + sent), frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    if (sent == 0 && !fds.empty()) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = ::sendmsg(socketFd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd p{socketFd, POLLOUT, 0};
        ::poll(&p, 1, 1000);
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET) fail(ErrorCode::kUnavailable, "connection closed by peer while sending");
      checkErrno(-1, "sendmsg");
    }
    sent += static_cast<std::size_t>(n);
  }
}

Received recvWithFds(int socketFd, std::span<std::byte> data) {
  iovec iov{data.data(), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Fixed size: however many fds a peer sends, one read takes at most kMaxFdsPerFrame; the kernel closes the rest
  // (MSG_CTRUNC), so they cannot pile up here.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  Received r;
  do {
    r.n = ::recvmsg(socketFd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (r.n < 0 && errno == EINTR);
  if (r.n < 0) return r;  // errno as recvmsg left it
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      r.fds.emplace_back(fd);
    }
  }
  r.truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  return r;
}

ReadResult readInto(int socketFd, FrameDecoder& decoder) {
  std::byte data[16384];
  Received r = recvWithFds(socketFd, data);
  if (r.n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadResult::kWouldBlock;
    if (errno == ECONNRESET) return ReadResult::kClosed;
    checkErrno(-1, "recvmsg");
  }
  for (Fd& fd : r.fds) decoder.appendFd(std::move(fd));
  if (r.truncated) fail(ErrorCode::kProtocol, "peer sent more than {} file descriptors at once", kMaxFdsPerFrame);
  if (r.n == 0) return ReadResult::kClosed;
  decoder.append({data, static_cast<std::size_t>(r.n)});
  return ReadResult::kData;
}

std::string recvFrame(int socketFd, FrameDecoder& decoder, int64_t timeoutMs) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs < 0 ? 0 : timeoutMs);
  for (;;) {
    if (auto frame = decoder.next()) return std::move(*frame);
    int waitMs = -1;
    if (timeoutMs >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) fail(ErrorCode::kTimeout, "no reply from tandemd within {} ms", timeoutMs);
      waitMs = static_cast<int>(left.count());
    }
    pollfd p{socketFd, POLLIN, 0};
    const int r = ::poll(&p, 1, waitMs);
    if (r < 0 && errno == EINTR) continue;
    checkErrno(r, "poll control socket");
    if (r == 0) continue;
    if (readInto(socketFd, decoder) == ReadResult::kClosed) {
      fail(ErrorCode::kUnavailable, "tandemd closed the connection{}", decoder.midFrame() ? " in the middle of a frame" : "");
    }
  }
}

}  // namespace tandem
