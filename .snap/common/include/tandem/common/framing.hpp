// The one frame codec both sides use: a 4-byte little-endian length, then that many bytes of message.
// File descriptors travel beside the bytes (SCM_RIGHTS); the message type says how many it consumes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/common/fd.hpp"

namespace tandem {

inline constexpr std::size_t kFrameHeaderBytes = 4;
inline constexpr std::size_t kMaxFdsPerFrame = 8;

// Prefixes payload with its length. Throws Error(kProtocol) if the payload exceeds maxFrameBytes.
std::string encodeFrame(std::string_view payload, std::size_t maxFrameBytes);

// Incremental decoder: feed it bytes as they arrive, take whole frames out. A length over the limit
// throws Error(kProtocol) naming both numbers; the stream is unusable after that.
class FrameDecoder {
 public:
  explicit FrameDecoder(std::size_t maxFrameBytes) : maxFrameBytes_(maxFrameBytes) {}
  void append(std::span<const std::byte> bytes);
  void appendFd(Fd fd) { fds_.push_back(std::move(fd)); }
  std::optional<std::string> next();
  // Takes the oldest received fd; throws Error(kProtocol) if the peer sent fewer than the message needs.
  Fd takeFd();
  std::size_t pendingFds() const { return fds_.size(); }
  // True when a frame has started but not finished (a peer that hangs up now did so mid-frame).
  bool midFrame() const { return !buffer_.empty(); }

 private:
  std::size_t maxFrameBytes_;
  std::string buffer_;
  std::deque<Fd> fds_;
};

// ---- blocking and non-blocking socket I/O on a Unix stream socket ----

// Sends a whole frame, with fds attached to its first byte. Blocks (poll) until written; throws
// Error(kDaemonLost-like kSystem) on a broken connection: EPIPE is reported as Error(kUnavailable).
void sendFrame(int socketFd, std::string_view payload, std::span<const int> fds, std::size_t maxFrameBytes);

// What one recvmsg brought: `n` as recvmsg returns it (bytes read, 0 at end of stream, -1 with errno set), the fds
// attached to those bytes (taken only when n >= 0), and whether the peer attached more than kMaxFdsPerFrame (the
// kernel closed the rest: MSG_CTRUNC).
struct Received {
  long n = 0;
  std::vector<Fd> fds;
  bool truncated = false;
};
// One recvmsg into `data` with MSG_DONTWAIT and MSG_CMSG_CLOEXEC, retried on EINTR; each caller decides what a
// truncated fd list and an error mean for its connection.
Received recvWithFds(int socketFd, std::span<std::byte> data);

enum class ReadResult { kData, kWouldBlock, kClosed };
// One recvmsg into the decoder (bytes and any fds). Never blocks when the socket is non-blocking.
ReadResult readInto(int socketFd, FrameDecoder& decoder);

// Blocks until one whole frame arrives or timeoutMs passes (<0 = forever). Throws Error(kUnavailable)
// when the peer hangs up, Error(kTimeout) on timeout.
std::string recvFrame(int socketFd, FrameDecoder& decoder, int64_t timeoutMs);

}  // namespace tandem
