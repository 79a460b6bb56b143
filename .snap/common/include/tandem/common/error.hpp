// One error policy: tandem::Error (an exception) inside, a status code plus message at the edges.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

// Values equal tandem_status_t (tandem/tandem.h) and tandem.v1.StatusCode.
enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,
  kProtocol = 2,
  kVersionMismatch = 3,
  kPermissionDenied = 4,
  kNotFound = 5,
  kOutOfMemory = 6,
  kTimeout = 7,
  kPeerLost = 8,
  kDaemonLost = 9,
  kAborted = 10,
  kUnsupported = 11,
  kUnavailable = 12,
  kInternal = 13,
  kRingFull = 14,
  kInProgress = 15,
  // Daemon-internal codes; they map to kInternal/kInvalidArgument on the wire.
  kInvalidConfig = 100,
  kSystem = 101,
  kCuda = 102,
  kRdma = 103,
};

std::string_view errorCodeName(ErrorCode code);
// The code as it travels to clients (internal codes folded into wire codes).
ErrorCode wireCode(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

template <typename... Args>
[[noreturn]] void fail(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

// Throws Error(kSystem) "<what>: <strerror> [errno N]" (kOutOfMemory for ENOMEM) when result < 0; returns
// result otherwise. `what` names the operation and its object, so no source location is needed.
long checkErrno(long result, std::string_view what);

}  // namespace tandem
