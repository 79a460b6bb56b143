// Multi-node communicators on the cuda backend, staged through host memory: see cuda_multinode.hpp.
#include "cuda/cuda_multinode.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>

#include "cluster.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon::cuda {
namespace {

void completeLocal(const Collective& c, int32_t code, const std::string& message) {
  for (const PendingOp& op : c.ops) {
    if (op.local()) op.channel->complete(op.desc.seq, code, message);
  }
}

}  // namespace

HostStaging::HostStaging(std::vector<LocalRank> local) : local_(std::move(local)) {
  for (const LocalRank& l : local_) {
    if (!streams_.contains(l.device)) streams_[l.device] = kernels::CudaStream::create(l.device, "staging");
  }
}

uint64_t HostStaging::lastEpoch() const {
  std::lock_guard lock(mutex_);
  return lastEpoch_;
}

bool HostStaging::waiting() const {
  std::lock_guard lock(mutex_);
  return waiting_.has_value();
}

void HostStaging::storeDoneLocked(uint64_t epoch) {
  if (failed_) return;  // the abort's lead stays
  for (const LocalRank& l : local_) l.page->publishDone(epoch);
}

bool HostStaging::execute(Collective c, std::function<void()> finished) {
  std::unique_lock lock(mutex_);
  lastEpoch_ = std::max(lastEpoch_, c.epoch);
  if (failed_) {
    const int32_t code = statusOf(failCode_);
    const std::string reason = reason_;
    lock.unlock();
    completeLocal(c, code, reason);
    return true;
  }
  if (c.errorCode != 0) {
    // Every node judged the same descriptors the same: nothing moves anywhere, and the streams go on. The engine
    // dispatches one collective of a multi-node communicator at a time, so done still rises in epoch order.
    storeDoneLocked(c.epoch);
    lock.unlock();
    for (const PendingOp& op : c.ops) {
      if (!op.local()) continue;
      op.channel->complete(op.desc.seq, c.errorCode,
                           op.error.empty() ? fmt::format("another rank's descriptor was rejected: {}", c.error)
                                            : op.error);
    }
    return true;
  }
  waiting_.emplace(Waiting{std::move(c), std::move(finished)});
  return false;
}

bool HostStaging::poll(uint64_t handle, std::vector<std::pair<uint64_t, std::string>>& failed) {
  std::lock_guard lock(mutex_);
  bool worked = false;
  if (!copyFailure_.empty() && !copyFailureReported_) {
    copyFailureReported_ = true;
    failed.emplace_back(handle, copyFailure_);
    worked = true;
  }
  if (!waiting_ || failed_) return worked;
  const uint64_t epoch = waiting_->c.epoch;
  for (const LocalRank& l : local_) {
    if (!l.page->readyReached(epoch)) return worked;  // that rank's stream is not there yet
  }
  Waiting w = std::move(*waiting_);
  waiting_.reset();
  auto link = w.c.link;
  // The collective holds the communicator's resources (and so this object) until the work is done.
  link->post([this, w = std::move(w)]() mutable {
    run(w.c);
    w.finished();
  });
  return true;
}

void HostStaging::abort(ErrorCode code, const std::string& reason) {
  std::optional<Waiting> w;
  {
    std::lock_guard lock(mutex_);
    if (failed_) return;
    failed_ = true;
    failCode_ = code;
    reason_ = reason;
    w = std::move(waiting_);
    waiting_.reset();
  }
  // Not handed to the link thread yet: it never runs (the engine dispatches nothing more on a failed communicator).
  if (w) completeLocal(w->c, statusOf(code), reason);
}

void HostStaging::copy(int device, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what) {
  if (bytes == 0) return;
  kernels::CudaDeviceGuard guard(device);
  cudaStream_t s = streams_.at(device).get();
  kernels::checkCuda(cudaMemcpyAsync(dst, src, bytes, kind, s), "{}", what);
  kernels::checkCuda(cudaStreamSynchronize(s), "{}", what);
}

void HostStaging::run(Collective& c) {
  int32_t code = 0;
  std::string message;
  try {
    const std::size_t n = c.ops.size();
    std::vector<RankOp> ranks(n);
    std::vector<std::array<std::vector<std::byte>, kMaxOpBuffers>> host(n);
    struct Slot {
      int device;
      std::byte* gpu;
      std::byte* host;
      uint64_t bytes;
    };
    std::vector<Slot> outputs;
    for (std::size_t r = 0; r < n; ++r) {
      const PendingOp& op = c.ops[r];
      ranks[r].desc = op.desc;
      if (!op.local()) continue;
      const SlotRules rules = expectedSlots(op.desc);
      for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
        if (!op.buffers[i] || !op.buffers[i]->device) continue;
        const uint64_t bytes = op.desc.bufs[i].bytes;
        host[r][i].resize(std::max<uint64_t>(bytes, 1));  // never null: a null slot means "absent" to the cpu ops
        ranks[r].data[i] = host[r][i].data();
        const DeviceMemory& mem = *op.buffers[i]->device;
        Slot s{mem.device, reinterpret_cast<std::byte*>(mem.address + op.desc.bufs[i].offset), host[r][i].data(),
               bytes};
        if (rules[i].output) {
          outputs.push_back(s);
        } else {
          copy(s.device, s.host, s.gpu, s.bytes, cudaMemcpyDeviceToHost, "cudaMemcpyAsync(input to host)");
        }
      }
    }
    runCpuOpAcrossNodes(ranks, c.nodeOfRank, *c.link, c.epoch);
    for (const Slot& s : outputs) {
      copy(s.device, s.gpu, s.host, s.bytes, cudaMemcpyHostToDevice, "cudaMemcpyAsync(output to GPU)");
    }
  } catch (const Error& e) {
    code = statusOf(e.code());
    message = e.what();
    if (e.code() == ErrorCode::kCuda) {
      // This node may have left the exchange (or is out of step with its streams): fail the communicator, so the
      // other nodes hear it instead of waiting for our payload until their deadline.
      message = fmt::format("{} across nodes: staging through host memory failed: {}", opKindName(c.ops[0].desc.kind),
                            e.what());
      std::lock_guard lock(mutex_);
      if (copyFailure_.empty()) copyFailure_ = message;
    }
  } catch (const std::exception& e) {
    code = statusOf(ErrorCode::kInternal);
    message = fmt::format("{} failed inside tandemd: {}", opKindName(c.ops[0].desc.kind), e.what());
  }
  finish(c, code, std::move(message));
}

void HostStaging::finish(Collective& c, int32_t code, std::string message) {
  {
    std::lock_guard lock(mutex_);
    if (failed_) {
      // The abort released the streams before this op's outputs were surely in place.
      if (code == 0) {
        code = statusOf(failCode_);
        message = reason_;
      }
    } else {
      storeDoneLocked(c.epoch);
    }
  }
  completeLocal(c, code, message);
  if (code == 0 && c.opsCompleted != nullptr) ++*c.opsCompleted;
}

// ---- HostStagedComm ------------------------------------------------------------------------------------------------

HostStagedComm::HostStagedComm(uint64_t handle, std::vector<kernels::ControlPage> pages,
                               const std::vector<int>& devices)
    : CudaComm(handle, std::move(pages)), staging_(localRanks(devices)) {}

std::vector<HostStaging::LocalRank> HostStagedComm::localRanks(const std::vector<int>& devices) {
  std::vector<HostStaging::LocalRank> local;
  for (uint32_t r = 0; r < nranks(); ++r) {
    if (page(r)) local.push_back({r, devices[r], &page(r)});
  }
  return local;
}

CommMapping HostStagedComm::mapping(const std::shared_ptr<CommResources>& /*self*/, uint32_t /*rank*/) const {
  fail(ErrorCode::kUnsupported, "communicator {} spans nodes: tandemd stages its ops through host memory, and its "
       "ranks have no GPU workspaces to map", handle());
}

bool HostStagedComm::execute(Collective c, std::function<void()> finished) {
  return staging_.execute(std::move(c), std::move(finished));
}

void HostStagedComm::abort(ErrorCode code, const std::string& reason) {
  if (!markFailed(code, reason)) return;
  staging_.abort(code, reason);  // first: it writes done no more
  releaseStreams();
}

bool HostStagedComm::progress(std::vector<std::pair<uint64_t, std::string>>& failed) {
  return staging_.poll(handle(), failed);
}

}  // namespace tandem::daemon::cuda
