// Multi-node communicators on the cuda backend, the dispatch: the collective's wait for the local streams, the choice
// of path (GPU-issued exchange, staged exchange, host reference fallback) and the op's end. The paths are in
// multinode_gpu_exchange.cpp, multinode_staged.cpp and the GPU work they share in multinode_compute.cpp; see
// cuda_multinode.hpp.
#include "cuda/cuda_multinode.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cluster.hpp"
#include "cuda/multinode_common.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;
using namespace multinode;

void completeLocal(const Collective& c, int32_t code, const std::string& message) {
  for (const PendingOp& op : c.ops) {
    if (op.local()) op.channel->complete(op.desc.seq, code, message);
  }
}

// What the GPU exchange's rules and commands read: every rank's descriptor, its node, the communicator's nodes.
ExchangeOp exchangeOpOf(const Collective& c) {
  ExchangeOp x;
  for (const PendingOp& op : c.ops) x.descs.push_back(op.desc);
  x.nodeOfRank = c.nodeOfRank;
  x.nodes = c.link->nodes();
  return x;
}

}  // namespace

const HostStaging::OpPaths* HostStaging::pathsOf(OpKind kind) {
  // gemm-rs and gemm-ar differ only in the rows each node receives (ownedRows; the staged exchange's rowsFor).
  static constexpr OpPaths kPaths[] = {
      {OpKind::kAgGemm, "GEMM", true, &HostStaging::agGemmStaged, &HostStaging::agGemmGpu},
      {OpKind::kAllGather, "copies", false, &HostStaging::allGatherStaged, &HostStaging::allGatherGpu},
      {OpKind::kGemmRs, "GEMM", true, &HostStaging::gemmReduceStaged, &HostStaging::gemmReduceGpu},
      {OpKind::kGemmAr, "GEMM", true, &HostStaging::gemmReduceStaged, &HostStaging::gemmReduceGpu},
  };
  for (const OpPaths& p : kPaths) {
    if (p.kind == kind) return &p;
  }
  return nullptr;
}

HostStaging::HostStaging(uint64_t handle, std::vector<LocalRank> local, uint64_t workspaceBytes,
                         std::shared_ptr<GpuExchangeHub> hub)
    : handle_(handle), local_(std::move(local)), workspaceBytes_(workspaceBytes), hub_(std::move(hub)) {
  // TANDEM_SPAN_WAIT=kernel: the GPU exchange waits in a one-warp kernel (abort word, %globaltimer deadline) instead
  // of stream waits. Node-local (the protocol is the same either way): for comparing the two on one GPU.
  const char* w = std::getenv("TANDEM_SPAN_WAIT");
  streamWaits_ = w == nullptr || std::string_view(w) != "kernel";
  for (const LocalRank& l : local_) {
    if (!gpus_.contains(l.device)) {
      Gpu g;
      g.compute = k::CudaStream::create(l.device, "span compute");
      g.copy = k::CudaStream::create(l.device, "span copies");
      g.exchange = k::CudaStream::create(l.device, "span exchange");
      g.event = k::CudaEvent::create(l.device, "span ordering");
      gpus_.emplace(l.device, std::move(g));
    }
    workspaces_.emplace(l.rank, k::DeviceBuffer::allocate(l.device, workspaceBytes_, "span workspace"));
  }
}

std::byte* HostStaging::workspace(uint32_t rank) const {
  return static_cast<std::byte*>(workspaces_.at(rank).get());
}

int HostStaging::deviceOf(uint32_t rank) const {
  for (const LocalRank& l : local_) {
    if (l.rank == rank) return l.device;
  }
  fail(ErrorCode::kInternal, "rank {} is not on this node", rank);
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
    if (region_) region_->abort();  // the kernels of a running op stop waiting for the peers
  }
  // Not handed to the link thread yet: it never runs (the engine dispatches nothing more on a failed communicator).
  if (w) completeLocal(w->c, statusOf(code), reason);
}

void HostStaging::run(Collective& c) {
  int32_t code = 0;
  std::string message;
  bool leftExchange = false;  // this node failed outside the exchange: its peers must hear of it
  try {
    const OpKind kind = c.ops[0].desc.kind;
    const ExchangeOp xop = exchangeOpOf(c);
    // The exchange's path, alike on every node (gpu_exchange_plan.hpp); then the compute's, which may differ.
    const std::string off = c.link->cluster().gpuExchangeOff();
    const std::string notGpu = off.empty() ? gpuExchangeRefusal(xop, c.link->cluster().config().cluster) : off;
    const std::string why = notGpu.empty() ? std::string() : fallbackReason(c);
    const OpPaths* paths = pathsOf(kind);  // set wherever why is empty: fallbackReason refuses the other ops
    if (notGpu.empty()) {
      try {
        if (paths == nullptr) fail(ErrorCode::kInternal, "GPU exchange: no GPU path for {}", opKindName(kind));
        checkWorkspaces(c);
        const int leadDev = deviceOf(localRanksOf(c).front());
        const GpuRegion& region = gpuRegion(c);
        logPlanOnce(c, fmt::format("GPU-issued exchange (proxy gpu{} {}, {}) + GPU {}", leadDev,
                                   clusterTransportName(c.link->cluster().config().cluster.transport),
                                   region.describe(), paths->compute));
        runGpuExchange(c, xop, *paths);
      } catch (const Error& e) {
        // The peers wait for this node's flags: unless the communicator failed already, it must fail now.
        leftExchange = e.code() != ErrorCode::kPeerLost && e.code() != ErrorCode::kAborted;
        throw;
      } catch (const std::exception&) {
        leftExchange = true;
        throw;
      }
    } else if (why.empty()) {
      checkStaging(c);  // alike on every node: the op fails everywhere, the communicator lives on
      try {
        checkWorkspaces(c);
      } catch (const Error&) {
        leftExchange = true;
        throw;
      }
      logPlanOnce(c, fmt::format("staged exchange + GPU {}; not GPU-issued: {}", paths->compute, notGpu));
      runStaged(c, *paths);
    } else {
      logPlanOnce(c, fmt::format("host reference fallback ({})", why));
      runHostReference(c);
    }
  } catch (const Error& e) {
    code = statusOf(e.code());
    message = e.what();
    if (e.code() == ErrorCode::kCuda || leftExchange) {
      // This node may have left the exchange (or is out of step with its streams): fail the communicator, so the
      // other nodes hear it instead of waiting for our payload until their deadline.
      message = e.code() == ErrorCode::kCuda
                    ? fmt::format("{} across nodes: the GPU work or its staging through host memory failed: {}",
                                  opKindName(c.ops[0].desc.kind), e.what())
                    : e.what();
      std::lock_guard lock(mutex_);
      if (copyFailure_.empty()) copyFailure_ = message;
    }
  } catch (const std::exception& e) {
    code = statusOf(ErrorCode::kInternal);
    message = fmt::format("{} failed inside tandemd: {}", opKindName(c.ops[0].desc.kind), e.what());
    if (leftExchange) {
      std::lock_guard lock(mutex_);
      if (copyFailure_.empty()) copyFailure_ = message;
    }
  }
  finish(c, code, std::move(message));
}

std::string HostStaging::fallbackReason(const Collective& c) const {
  const OpDescriptor& d = c.ops[0].desc;
  if (d.kind == OpKind::kNop) return "a barrier moves no data";
  const OpPaths* paths = pathsOf(d.kind);
  if (paths == nullptr) return "no GPU path for this op";
  if (!paths->gemm) return "";
  std::vector<OpDescriptor> descs;
  for (const PendingOp& op : c.ops) descs.push_back(op.desc);
  const std::vector<uint32_t> mine = localRanksOf(c);
  if (std::string why = gemmCoreRefusal(descs, mine); !why.empty()) return why;
  std::vector<std::pair<int, const char*>> tensors = {
      {slot::kA, "a"}, {slot::kB, "b"}, {slot::kC, "c"}, {slot::kAGathered, "a_gathered"}};
  if (isFp8(d.dtype)) {
    tensors.emplace_back(gemmScaleSlot(d.kind, false), "a_scale");
    tensors.emplace_back(gemmScaleSlot(d.kind, true), "b_scale");
  }
  for (uint32_t r : mine) {
    for (auto [s, name] : tensors) {
      const std::byte* p = slotPtr(c.ops[r], s);
      if (p != nullptr && !aligned16(p)) return fmt::format("rank {}'s tensor {} is not 16-byte aligned", r, name);
    }
  }
  return "";
}

void HostStaging::checkWorkspaces(const Collective& c) const {
  const OpDescriptor& d = c.ops[0].desc;
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], es = dtypeSize(d.dtype);
  const uint64_t pes = isFp8(d.dtype) ? sizeof(float) : es, ces = dtypeSize(gemmOutDtype(d.dtype, d.flags));
  auto need = [&](uint32_t r) -> uint64_t {
    switch (d.kind) {
      case OpKind::kAgGemm: {
        // A gathered A slot that is not 16-byte aligned is built in the workspace (GPU exchange) and copied there;
        // FP8 inputs' scales region follows (agGemmTensors).
        const std::byte* g = slotPtr(c.ops[r], slot::kAGathered);
        const uint64_t gathered = g != nullptr && aligned16(g) ? 0 : alignUp(m * d.dims[dim::kK] * es, kAlign);
        return gathered + (isFp8(d.dtype) ? agScaleOffsets(d, static_cast<uint32_t>(c.ops.size())).back() : 0);
      }
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: {
        const uint64_t partial = alignUp(m * alignUp(n, 8) * pes, kAlign);
        if (r != mine.front()) return partial;
        const uint64_t f32 = alignUp(m * n * sizeof(float), kAlign);
        uint64_t others = 0;
        for (uint32_t q : mine) others += deviceOf(q) != deviceOf(r) ? 1 : 0;
        // partial, node sum, running sum over nodes, receive slot, other GPUs' partials, their outputs' staging
        return partial + 3 * f32 + others * partial + (others != 0 ? alignUp(m * n * ces, kAlign) : 0);
      }
      default: return 0;
    }
  };
  for (uint32_t r : mine) {
    if (const uint64_t bytes = need(r); bytes > workspaceBytes_) {
      fail(ErrorCode::kInvalidArgument, "{} {} m={} n={} k={} across nodes needs {} bytes of GPU workspace on rank {} "
           "(gathered A, partial products, node sums), but cuda.workspace_bytes gives each rank {}; raise "
           "cuda.workspace_bytes in tandemd's config on every node (to at least {}) and restart them, or split the op",
           opKindName(d.kind), dtypeName(d.dtype), m, n, d.dims[dim::kK], bytes, r, workspaceBytes_,
           alignUp(bytes, uint64_t{2} << 20));
    }
  }
}

void HostStaging::logPlanOnce(const Collective& c, const std::string& plan) {
  const OpDescriptor& d = c.ops[0].desc;
  const std::string shape =
      d.kind == OpKind::kAllGather
          ? fmt::format("{} {} bytes", opKindName(d.kind), d.dims[dim::kBytes])
          : d.kind == OpKind::kNop
                ? std::string(opKindName(d.kind))
                : fmt::format("{} {} m={} n={} k={}{}", opKindName(d.kind), dtypeName(d.dtype), d.dims[dim::kM],
                              d.dims[dim::kN], d.dims[dim::kK], layoutSuffix(gemmOperandsOf(d.flags)));
  if (!logged_.insert(shape + "|" + plan).second) return;
  spdlog::info("communicator {:#x}: {} on {} ranks across {} nodes ({} here): plan {}", handle_, shape, c.ops.size(),
               c.link->nodes().size(), localRanksOf(c).size(), plan);
}

void HostStaging::drain() noexcept {
  for (auto& [device, g] : gpus_) {
    try {
      k::CudaDeviceGuard guard(device);
      k::reportRelease(cudaStreamSynchronize(g.compute.get()), "cudaStreamSynchronize(span compute)");
      k::reportRelease(cudaStreamSynchronize(g.copy.get()), "cudaStreamSynchronize(span copies)");
      k::reportRelease(cudaStreamSynchronize(g.exchange.get()), "cudaStreamSynchronize(span exchange)");
    } catch (const std::exception& e) {
      spdlog::warn("communicator {:#x}: draining GPU {} after a failed op: {}", handle_, device, e.what());
    }
  }
}

bool HostStaging::failedNow() const {
  std::lock_guard lock(mutex_);
  return failed_;
}

void HostStaging::order(int fromDev, cudaStream_t from, cudaStream_t to) {
  if (from == to) return;
  Gpu& g = gpu(fromDev);
  k::CudaDeviceGuard guard(fromDev);
  k::checkCuda(cudaEventRecord(g.event.get(), from), "cudaEventRecord(span exchange order)");
  k::checkCuda(cudaStreamWaitEvent(to, g.event.get()), "cudaStreamWaitEvent(span exchange order)");
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
                               const std::vector<int>& devices, uint64_t workspaceBytes,
                               std::shared_ptr<GpuExchangeHub> hub)
    : CudaComm(handle, std::move(pages)), workspaceBytes_(workspaceBytes),
      staging_(handle, localRanks(devices), workspaceBytes, std::move(hub)) {}

std::vector<HostStaging::LocalRank> HostStagedComm::localRanks(const std::vector<int>& devices) {
  std::vector<HostStaging::LocalRank> local;
  for (uint32_t r = 0; r < nranks(); ++r) {
    if (page(r)) local.push_back({r, devices[r], &page(r)});
  }
  return local;
}

CommMapping HostStagedComm::mapping(const std::shared_ptr<CommResources>& /*self*/, uint32_t /*rank*/) const {
  fail(ErrorCode::kUnsupported, "communicator {} spans nodes: tandemd runs its ops itself, and its ranks have no GPU "
       "workspaces to map", handle());
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
