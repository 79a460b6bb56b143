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

// Rings an eventfd (adds 1); EAGAIN (counter saturated) is fine: the reader is already due to wake.
void signalEventfd(int fd) noexcept;
// Drains an eventfd's counter without blocking.
void drainEventfd(int fd) noexcept;

}  // namespace tandem
