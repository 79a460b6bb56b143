#include "cuda/cuda_comm.hpp"

#include "tandem/common/error.hpp"

namespace tandem::daemon::cuda {

std::byte* resolveDevice(const Buffer& buffer, uint64_t offset) {
  if (!buffer.device) fail(ErrorCode::kInternal, "buffer {} has no GPU memory", buffer.id);
  return reinterpret_cast<std::byte*>(buffer.device->address + offset);
}

CudaComm::CudaComm(uint64_t handle, std::vector<kernels::ControlPage> pages)
    : handle_(handle), pages_(std::move(pages)) {}

CudaComm::~CudaComm() = default;

JoinInfo CudaComm::joinInfo(uint32_t rank, uint32_t commCtas) const {
  JoinInfo info;
  info.executor = kernels::executorName(executor());
  info.controlFd = pages_[rank].fd();
  info.controlBytes = kernels::kControlBytes;
  info.workspaceBytes = workspaceBytes(rank);
  info.commCtas = commCtas;
  return info;
}

bool CudaComm::poll(std::vector<std::pair<uint64_t, std::string>>& failed) {
  if (!failureToReport_.empty() && !failureReported_) {
    // The strategy aborted the communicator itself: the engine marks it aborted too.
    reportFailure(failed, failureToReport_);
  }
  if (failed_) {
    // A kernel or stream that finished just after the abort may have written an older done: keep the lead.
    for (uint32_t r = 0; r < nranks() && r < leads_.size(); ++r) {
      if (pages_[r]) pages_[r].holdLead(leads_[r]);  // no page: a rank on another node
    }
    return false;
  }
  return progress(failed);
}

void CudaComm::abortKernels() {
  for (auto& p : pages_) {
    if (p) p.abortKernels();
  }
}

bool CudaComm::markFailed(ErrorCode code, const std::string& reason) {
  if (failed_) return false;
  failed_ = true;
  failCode_ = code;
  reason_ = reason;
  return true;
}

void CudaComm::releaseStreams() {
  for (uint32_t r = 0; r < nranks(); ++r) {
    leads_.push_back(pages_[r] ? pages_[r].abort(lastEpoch(r)) : 0);
  }
}

void CudaComm::abortFromBackend(ErrorCode code, const std::string& reason) {
  abort(code, reason);
  failureToReport_ = reason;
}

void CudaComm::reportFailure(std::vector<std::pair<uint64_t, std::string>>& failed, std::string message) {
  if (failureReported_) return;
  failureReported_ = true;
  failed.emplace_back(handle_, std::move(message));
}

}  // namespace tandem::daemon::cuda
