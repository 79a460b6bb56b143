// A thin C++ RAII layer over tandem/tandem.h. Failures throw tandem::Exception carrying the status and the
// library's message. Objects are move-only and release what they own in their destructors.
// A Buffer or Communicator may outlive its Session: closing the session releases what they hold, and their
// destructors then only free the handle (tandem.h, "Lifetimes"); their other calls fail with the reason.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "tandem/tandem.h"

namespace tandem {

class Exception : public std::runtime_error {
 public:
  Exception(tandem_status_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
  tandem_status_t status() const noexcept { return status_; }

 private:
  tandem_status_t status_;
};

inline void check(tandem_status_t status) {
  if (status != TANDEM_SUCCESS) {
    const char* message = tandem_last_error();
    throw Exception(status, std::string(tandem_strerror(status)) + ": " + (*message ? message : "(no detail)"));
  }
}

// One connection to tandemd. Closing it (the destructor, or close()) releases every buffer and communicator it
// still holds; their objects stay safe to destroy.
class Session {
 public:
  explicit Session(const char* socketPath = nullptr) { check(tandem_connect(socketPath, &handle_)); }
  Session(Session&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Session& operator=(Session&& o) noexcept {
    std::swap(handle_, o.handle_);
    return *this;
  }
  ~Session() { close(); }
  // Disconnects now (tandem_disconnect); a second close() does nothing.
  void close() noexcept {
    if (handle_ != nullptr) tandem_disconnect(std::exchange(handle_, nullptr));
  }
  tandem_session_t get() const noexcept { return handle_; }
  std::string backend() const { return tandem_session_backend(handle_); }

 private:
  tandem_session_t handle_ = nullptr;
};

// Daemon-allocated shared memory, mapped into this process.
class Buffer {
 public:
  Buffer(Session& session, uint64_t bytes) { check(tandem_alloc(session.get(), bytes, &handle_)); }
  Buffer(Buffer&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(handle_, o.handle_);
    return *this;
  }
  ~Buffer() {
    if (handle_ != nullptr) tandem_free(handle_);
  }
  tandem_buffer_t get() const noexcept { return handle_; }
  void* data() const noexcept { return tandem_buffer_ptr(handle_); }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(data());
  }
  uint64_t size() const noexcept { return tandem_buffer_size(handle_); }
  tandem_tensor_t tensor(uint64_t offset = 0) const noexcept { return {handle_, offset}; }

 private:
  tandem_buffer_t handle_ = nullptr;
};

// The library's version as TANDEM_VERSION_CODE orders it (major * 10000 + minor * 100 + patch).
inline int libraryVersionCode() noexcept { return tandem_get_version(nullptr, nullptr, nullptr); }

inline tandem_unique_id_t uniqueId() {
  tandem_unique_id_t id;
  check(tandem_get_unique_id(&id));
  return id;
}

// One rank of a communicator. The constructor blocks until every rank has joined.
class Communicator {
 public:
  Communicator(Session& session, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank, uint32_t timeoutMs = 0) {
    check(tandem_comm_init(session.get(), &id, nranks, rank, timeoutMs, &handle_));
  }
  Communicator(Communicator&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Communicator& operator=(Communicator&& o) noexcept {
    std::swap(handle_, o.handle_);
    return *this;
  }
  ~Communicator() {
    if (handle_ != nullptr) tandem_comm_destroy(handle_);
  }
  tandem_comm_t get() const noexcept { return handle_; }
  uint32_t rank() const noexcept { return tandem_comm_rank(handle_); }
  uint32_t nranks() const noexcept { return tandem_comm_nranks(handle_); }
  void abort() { check(tandem_comm_abort(handle_)); }

 private:
  tandem_comm_t handle_ = nullptr;
};

// Waits for an op; throws on failure or timeout.
inline void wait(tandem_op_t op, int64_t timeoutMs = -1) { check(tandem_wait(op, timeoutMs)); }

}  // namespace tandem
