#include "tandem/common/fd.hpp"

#include <fcntl.h>
#include <cerrno>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tandem/common/error.hpp"

namespace tandem {

void Fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Fd Fd::dup() const { return Fd(static_cast<int>(checkErrno(::fcntl(fd_, F_DUPFD_CLOEXEC, 0), "dup fd"))); }

Fd Fd::memfd(const std::string& name, uint64_t bytes) {
  Fd fd(static_cast<int>(checkErrno(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING), "memfd_create")));
  checkErrno(::ftruncate(fd.get(), static_cast<off_t>(bytes)), fmt::format("size memfd '{}' to {} bytes", name, bytes));
  // A peer holding the fd must not be able to shrink it under our mapping (SIGBUS).
  checkErrno(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), "seal memfd");
  return fd;
}

Fd Fd::eventfd() { return Fd(static_cast<int>(checkErrno(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), "eventfd"))); }

Mapping Mapping::shared(int fd, uint64_t bytes, uint64_t offset) {
  Mapping m;
  if (bytes == 0) return m;
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (addr == MAP_FAILED) checkErrno(-1, fmt::format("mmap {} bytes at offset {}", bytes, offset));
  m.addr_ = addr;
  m.bytes_ = bytes;
  return m;
}

void Mapping::reset() noexcept {
  if (addr_ != nullptr) ::munmap(addr_, bytes_);
  addr_ = nullptr;
  bytes_ = 0;
}

uint64_t fileSize(int fd) {
  struct stat st {};
  checkErrno(::fstat(fd, &st), "fstat");
  return static_cast<uint64_t>(st.st_size);
}

WakeupPair WakeupPair::create() {
  int fds[2];
  checkErrno(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), "socketpair (wakeup channel)");
  return {Fd(fds[0]), Fd(fds[1])};
}

void signalEventfd(int fd) noexcept {
  const uint64_t one = 1;
  if (::send(fd, &one, sizeof one, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0 || errno != ENOTSOCK) return;
  [[maybe_unused]] ssize_t n = ::write(fd, &one, sizeof one);  // an eventfd
}

void drainEventfd(int fd) noexcept {
  uint64_t value = 0;
  // A socket queues one datagram per signal; an eventfd reads 0 (EAGAIN) once drained. Bounded, so a peer that
  // signals as fast as we read cannot keep us here.
  for (int i = 0; i < 1024; ++i) {
    ssize_t n = ::recv(fd, &value, sizeof value, MSG_DONTWAIT);
    if (n < 0 && errno == ENOTSOCK) n = ::read(fd, &value, sizeof value);
    if (n <= 0) return;
  }
}

}  // namespace tandem
