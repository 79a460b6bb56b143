// RAII for file descriptors and memory mappings, and the memfd helpers every shared region uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace tandem {

// Move-only owner of one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept;
  Fd dup() const;  // throws Error(kSystem)

  // memfd of `bytes` bytes, CLOEXEC, sealable against shrinking.
  static Fd memfd(const std::string& name, uint64_t bytes);
  static Fd eventfd();  // non-blocking, CLOEXEC

 private:
  int fd_ = -1;
};

// Move-only owner of one mmap'ed range.
class Mapping {
 public:
  Mapping() = default;
  Mapping(Mapping&& other) noexcept
      : addr_(std::exchange(other.addr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      reset();
      addr_ = std::exchange(other.addr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  // MAP_SHARED read-write mapping of [offset, offset+bytes) of fd. bytes 0 gives an empty mapping.
  static Mapping shared(int fd, uint64_t bytes, uint64_t offset = 0);

  std::byte* data() const noexcept { return static_cast<std::byte*>(addr_); }
  uint64_t size() const noexcept { return bytes_; }
  void reset() noexcept;

 private:
  void* addr_ = nullptr;
  uint64_t bytes_ = 0;
};

// Size of the file behind fd (fstat).
uint64_t fileSize(int fd);

// A wakeup channel between the daemon and one client: a connected pair of AF_UNIX datagram sockets, both ends
// non-blocking and CLOEXEC. Each side holds its own end, so each end's file status flags are its holder's alone:
// a client that clears O_NONBLOCK on its end, or fills the channel, can never make the daemon's side block
// (which an eventfd shared by fd cannot promise: both holders share one open file description).
struct WakeupPair {
  Fd daemonEnd;
  Fd clientEnd;
  static WakeupPair create();
};

// Rings a wakeup: a datagram on a WakeupPair end (MSG_DONTWAIT, whatever the fd's flags), or 1 added to an
// eventfd. A full channel (EAGAIN) is fine: the reader is already due to wake. Never blocks on a socket.
void signalEventfd(int fd) noexcept;
// Drains every pending wakeup of a WakeupPair end or an eventfd, without blocking (the fd must be non-blocking or a
// socket: sockets are read with MSG_DONTWAIT).
void drainEventfd(int fd) noexcept;

}  // namespace tandem
