#include "tandem/common/error.hpp"

#include <cerrno>
#include <cstring>

namespace tandem {

std::string_view errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kProtocol: return "protocol error";
    case ErrorCode::kVersionMismatch: return "version mismatch";
    case ErrorCode::kPermissionDenied: return "permission denied";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kOutOfMemory: return "out of memory";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kPeerLost: return "peer lost";
    case ErrorCode::kDaemonLost: return "daemon lost";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kInternal: return "internal error";
    case ErrorCode::kRingFull: return "ring full";
    case ErrorCode::kInProgress: return "in progress";
    case ErrorCode::kInvalidConfig: return "invalid config";
    case ErrorCode::kSystem: return "system error";
    case ErrorCode::kCuda: return "CUDA error";
    case ErrorCode::kRdma: return "RDMA error";
  }
  return "unknown error";
}

ErrorCode wireCode(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidConfig: return ErrorCode::kInvalidArgument;
    case ErrorCode::kSystem:
    case ErrorCode::kCuda:
    case ErrorCode::kRdma: return ErrorCode::kInternal;
    default: return code;
  }
}

long checkErrno(long result, std::string_view what) {
  if (result >= 0) return result;
  const int err = errno;
  throw Error(err == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kSystem,
              fmt::format("{}: {} [errno {}]", what, std::strerror(err), err));
}

}  // namespace tandem
