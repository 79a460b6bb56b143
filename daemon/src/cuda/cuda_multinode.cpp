// Multi-node communicators on the cuda backend: the exchange through the host, the compute on the GPUs (or, for what
// they do not take, the host reference): see cuda_multinode.hpp.
#include "cuda/cuda_multinode.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <chrono>
#include <exception>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "cluster.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/validate.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/span_exchange.hpp"
#include "tandem/kernels/span_reduce.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;

constexpr uint32_t kExchangeTimeoutMs = 60000;  // as the cpu backend's: a peer daemon alive but sending nothing
constexpr uint64_t kAlign = 256;                // workspace sub-buffers start on 256 bytes
constexpr uint64_t kPinStep = uint64_t{2} << 20;  // slot registrations grow in 2 MiB steps

uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void completeLocal(const Collective& c, int32_t code, const std::string& message) {
  for (const PendingOp& op : c.ops) {
    if (op.local()) op.channel->complete(op.desc.seq, code, message);
  }
}

std::vector<uint32_t> ranksOn(const Collective& c, uint32_t node) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < c.ops.size(); ++r) {
    if (c.nodeOfRank[r] == node) out.push_back(r);
  }
  return out;
}

std::vector<uint32_t> localRanksOf(const Collective& c) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < c.ops.size(); ++r) {
    if (c.ops[r].local()) out.push_back(r);
  }
  return out;
}

// What the GPU exchange's rules and commands read: every rank's descriptor, its node, the communicator's nodes.
ExchangeOp exchangeOpOf(const Collective& c) {
  ExchangeOp x;
  for (const PendingOp& op : c.ops) x.descs.push_back(op.desc);
  x.nodeOfRank = c.nodeOfRank;
  x.nodes = c.link->nodes();
  return x;
}

// Slot `s` of local rank op `op` in tandemd's address space; null when absent.
std::byte* slotPtr(const PendingOp& op, int s) {
  const auto i = static_cast<std::size_t>(s);
  if (!op.buffers[i] || op.desc.bufs[i].bytes == 0) return nullptr;
  return resolveDevice(*op.buffers[i], op.desc.bufs[i].offset);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

k::SpanElem spanElem(DType d) {
  switch (d) {
    case DType::kBF16: return k::SpanElem::kBf16;
    case DType::kF16: return k::SpanElem::kFp16;
    default: return k::SpanElem::kF32;
  }
}

void copyAsync(void* dst, const void* src, uint64_t bytes, cudaStream_t s, const char* what) {
  if (bytes == 0) return;
  k::checkCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync({})", what);
}

void syncStream(int device, cudaStream_t s, const char* what) {
  k::CudaDeviceGuard guard(device);
  k::checkCuda(cudaStreamSynchronize(s), "cudaStreamSynchronize({})", what);
}

void sum(const k::SpanSum& p, cudaStream_t s, const char* what) {
  k::checkCuda(k::launchSpanSum(p, s), "span sum ({})", what);
}

// The GEMM core on `stream` (its device current); its std::runtime_error becomes Error(kCuda): past the checks of
// fallbackReason only CUDA itself refuses a launch, and the node must then leave the communicator.
void gemm(const k::GemmParams& p, cudaStream_t stream, const char* what) {
  try {
    k::launchGemm(p, stream);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ErrorCode::kCuda, "GEMM core ({}): {}", what, e.what());
  }
}

// Contiguous row runs [first, first + rows) of the ranks that are (local) or are not (!local) on this node.
std::vector<std::pair<uint64_t, uint64_t>> rowRuns(const Collective& c, uint64_t m, bool local) {
  const auto n = static_cast<uint32_t>(c.ops.size());
  std::vector<uint32_t> ranks;
  for (uint32_t r = 0; r < n; ++r) {
    if (c.ops[r].local() == local) ranks.push_back(r);
  }
  return rowRunsOf(m, n, ranks);
}

// As runCpuOpAcrossNodes: the bytes node `from` sends node `to`, the same on every node and in either path, so all
// nodes agree whether the op fits the staging before any of them starts.
void checkStaging(const Collective& c) {
  const OpDescriptor& d = c.ops[0].desc;
  std::vector<const OpDescriptor*> descs;
  for (const auto& op : c.ops) descs.push_back(&op.desc);
  auto payload = [&](uint32_t from, uint32_t to) { return crossNodeBytes(descs, c.nodeOfRank, from, to); };
  for (uint32_t from : c.link->nodes()) {
    for (uint32_t to : c.link->nodes()) {
      if (from == to) continue;
      if (const uint64_t need = payload(from, to); need > c.link->maxPayload()) {
        fail(ErrorCode::kInvalidArgument, "{} across nodes needs {} bytes of staging from node {} to node {}, but "
             "cluster.staging_bytes allows {} per peer node; raise cluster.staging_bytes on every node (to at least "
             "{}) or split the op", opKindName(d.kind), need, from, to, c.link->maxPayload(),
             need + CommLink::kPayloadHeaderBytes);
      }
    }
  }
}

}  // namespace

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

void HostStaging::copy(int device, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what) {
  if (bytes == 0) return;
  kernels::CudaDeviceGuard guard(device);
  cudaStream_t s = gpus_.at(device).copy.get();
  kernels::checkCuda(cudaMemcpyAsync(dst, src, bytes, kind, s), "{}", what);
  kernels::checkCuda(cudaStreamSynchronize(s), "{}", what);
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
    if (notGpu.empty()) {
      try {
        checkWorkspaces(c);
        const int leadDev = deviceOf(localRanksOf(c).front());
        const GpuRegion& region = gpuRegion(c);
        logPlanOnce(c, fmt::format("GPU-issued exchange (proxy gpu{} {}, {}) + GPU {}", leadDev,
                                   clusterTransportName(c.link->cluster().config().cluster.transport),
                                   region.describe(), kind == OpKind::kAllGather ? "copies" : "GEMM"));
        runGpuExchange(c, xop);
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
      logPlanOnce(c, fmt::format("{}; not GPU-issued: {}",
                                 kind == OpKind::kAllGather ? "staged exchange + GPU copies" : "staged exchange + GPU GEMM",
                                 notGpu));
      runOnGpus(c);
    } else {
      logPlanOnce(c, fmt::format("host reference fallback ({})", why));
      runStaged(c);
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

// The host reference fallback: every input to the host, the cpu backend's exchange and compute, the outputs back.
void HostStaging::runStaged(Collective& c) {
  {
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
  }
}

// ---- the GPU path --------------------------------------------------------------------------------------------------

std::string HostStaging::fallbackReason(const Collective& c) const {
  const OpDescriptor& d = c.ops[0].desc;
  if (d.kind == OpKind::kNop) return "a barrier moves no data";
  if (d.kind == OpKind::kAllGather) return "";
  if (d.kind != OpKind::kAgGemm && d.kind != OpKind::kGemmRs && d.kind != OpKind::kGemmAr) {
    return "no GPU path for this op";
  }
  if (d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    return fmt::format("{}: the GEMM core takes bf16 and fp16", dtypeName(d.dtype));
  }
  constexpr uint64_t kMaxDim = std::numeric_limits<int32_t>::max();
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN];
  if (m > kMaxDim || n > kMaxDim) return "a dimension past 2^31 - 1";
  const bool ag = d.kind == OpKind::kAgGemm;
  if (ag && n % 8 != 0) return fmt::format("n = {} is not a multiple of 8 (the GEMM core's 16-byte rows of C)", n);
  for (uint32_t r : localRanksOf(c)) {
    const PendingOp& op = c.ops[r];
    const uint64_t kk = op.desc.dims[dim::kK];
    if (kk > kMaxDim) return "a dimension past 2^31 - 1";
    if (kk % 8 != 0) {
      return fmt::format("{} = {} on rank {} is not a multiple of 8 (the GEMM core's 16-byte rows)", ag ? "k" : "k slice",
                         kk, r);
    }
    static constexpr const char* kNames[] = {"a", "b", "c", "a_gathered"};
    for (int s : {slot::kA, slot::kB, slot::kC, slot::kAGathered}) {
      const std::byte* p = slotPtr(op, s);
      if (p != nullptr && !aligned16(p)) {
        return fmt::format("rank {}'s tensor {} is not 16-byte aligned", r, kNames[static_cast<std::size_t>(s)]);
      }
    }
  }
  return "";
}

void HostStaging::checkWorkspaces(const Collective& c) const {
  const OpDescriptor& d = c.ops[0].desc;
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], es = dtypeSize(d.dtype);
  auto need = [&](uint32_t r) -> uint64_t {
    switch (d.kind) {
      case OpKind::kAgGemm:
        // A gathered A slot that is not 16-byte aligned is built in the workspace (GPU exchange) and copied there.
        return slotPtr(c.ops[r], slot::kAGathered) != nullptr && aligned16(slotPtr(c.ops[r], slot::kAGathered))
                   ? 0
                   : alignUp(m * d.dims[dim::kK] * es, kAlign);
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: {
        const uint64_t partial = alignUp(m * alignUp(n, 8) * es, kAlign);
        if (r != mine.front()) return partial;
        const uint64_t f32 = alignUp(m * n * sizeof(float), kAlign);
        uint64_t others = 0;
        for (uint32_t q : mine) others += deviceOf(q) != deviceOf(r) ? 1 : 0;
        // partial, node sum, running sum over nodes, receive slot, other GPUs' partials, their outputs' staging
        return partial + 3 * f32 + others * partial + (others != 0 ? alignUp(m * n * es, kAlign) : 0);
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
                : fmt::format("{} {} m={} n={} k={}", opKindName(d.kind), dtypeName(d.dtype), d.dims[dim::kM],
                              d.dims[dim::kN], d.dims[dim::kK]);
  if (!logged_.insert(shape + "|" + plan).second) return;
  spdlog::info("communicator {:#x}: {} on {} ranks across {} nodes ({} here): plan {}", handle_, shape, c.ops.size(),
               c.link->nodes().size(), localRanksOf(c).size(), plan);
}

void HostStaging::pin(const Collective& c, const std::byte* p, uint64_t bytes) {
  if (bytes == 0) return;
  const uint64_t slotBytes = c.link->maxPayload() + CommLink::kPayloadHeaderBytes;
  if (slotBytes % 4096 != 0) return;  // slots share pages: registering one would overlap the next
  const std::byte* slot = p - CommLink::kPayloadHeaderBytes;  // the payload follows the slot's {epoch, bytes}
  const uint64_t want = std::min(slotBytes, alignUp(CommLink::kPayloadHeaderBytes + bytes, kPinStep));
  Pin& pin = pins_[slot];
  if (pin.failed || pin.bytes >= want) return;
  if (!link_) link_ = c.link;  // its memory must outlive the registrations
  pin.reg.reset();
  pin.bytes = 0;
  try {
    pin.reg = k::HostRegistration::create(const_cast<std::byte*>(slot), want, "cudaHostRegister(CommLink slot)");
    pin.bytes = want;
  } catch (const Error& e) {
    pin.failed = true;
    spdlog::warn("communicator {:#x}: the staging slot stays pageable (slower copies): {}", handle_, e.what());
  }
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

// The node's partials (each local rank's, in its workspace, row stride ldp, of the op's dtype `elem`) summed in rank
// order in fp32 into nodeSum [m, cols] on the lead's GPU, on leadStream (already ordered after every GPU's partial),
// rows [firstRow, firstRow + rows) of them. Partials on other GPUs are first copied (those rows) to `next` on the
// lead's GPU, partialBytes apart; returns the next free byte (the same for every row range).
// Shared by the staged and the GPU-issued exchange, so the two sum alike, bit for bit.
std::byte* HostStaging::sumNodePartials(const std::vector<uint32_t>& mine, int leadDev, cudaStream_t leadStream,
                                        std::byte* next, uint64_t partialBytes, uint64_t firstRow, uint64_t rows,
                                        uint64_t cols, uint64_t ldp, uint64_t es, k::SpanElem elem, float* nodeSum) {
  const uint64_t skip = firstRow * ldp * es;  // bytes into each partial
  std::vector<const std::byte*> partials;
    for (uint32_t r : mine) {
      if (deviceOf(r) == leadDev) {
        partials.push_back(workspace(r) + skip);
      } else {
        copyAsync(next + skip, workspace(r) + skip, rows * ldp * es, leadStream, "partial to the lead GPU");
        partials.push_back(next + skip);
        next += partialBytes;
      }
    }
    for (std::size_t i = 0; i < partials.size(); i += k::kSpanMaxSources) {
      k::SpanSum s{};
      s.count = static_cast<int32_t>(std::min<std::size_t>(k::kSpanMaxSources, partials.size() - i));
      for (int j = 0; j < s.count; ++j) s.src[j] = partials[i + static_cast<std::size_t>(j)];
      s.srcType = elem;
      s.dst = nodeSum + firstRow * cols;
      s.dstType = k::SpanElem::kF32;
      s.accumulate = i != 0;
      s.rows = static_cast<int64_t>(rows);
      s.cols = static_cast<int64_t>(cols);
      s.srcLd = static_cast<int64_t>(ldp);
      s.dstLd = static_cast<int64_t>(cols);
      sum(s, leadStream, "node sum");
    }
  return next;
}

// The sum over nodes (`total`, fp32 [m, cols]) rounded once into every local rank's C on leadStream: gemm-rs its own
// rows, gemm-ar all of them; a rank on another GPU through `outStaging` on the lead's GPU (stream order on
// the lead keeps the staging's next writer behind each copy). Shared by the staged and the GPU-issued exchange.
void HostStaging::roundOutputs(const Collective& c, const std::vector<uint32_t>& mine, int leadDev,
                               cudaStream_t leadStream, const float* total, std::byte* outStaging) {
  const OpDescriptor& d = c.ops[0].desc;
  const bool allReduce = d.kind == OpKind::kGemmAr;
  const k::SpanElem elem = spanElem(d.dtype);
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = d.dims[dim::kM], cols = d.dims[dim::kN], es = dtypeSize(d.dtype);
  k::CudaDeviceGuard guard(leadDev);
  for (uint32_t r : mine) {
    const uint64_t first = allReduce ? 0 : rowOffset(m, r, n), rows = allReduce ? m : rowsOf(m, r, n);
    if (rows == 0) continue;
    std::byte* cr = slotPtr(c.ops[r], slot::kC);
    const bool here = deviceOf(r) == leadDev;
    k::SpanSum s{};
    s.count = 1;
    s.src[0] = total + first * cols;
    s.srcType = k::SpanElem::kF32;
    s.dst = here ? cr : outStaging;
    s.dstType = elem;
    s.rows = static_cast<int64_t>(rows);
    s.cols = static_cast<int64_t>(cols);
    s.srcLd = s.dstLd = static_cast<int64_t>(cols);
    sum(s, leadStream, "output");
    if (!here) copyAsync(cr, outStaging, rows * cols * es, leadStream, "output to its GPU");
  }
}

void HostStaging::runOnGpus(Collective& c) {
  try {
    switch (c.ops[0].desc.kind) {
      case OpKind::kAgGemm: return agGemm(c);
      case OpKind::kAllGather: return allGather(c);
      default: return gemmReduce(c);
    }
  } catch (...) {
    drain();  // nothing of ours may still write into the ranks' buffers once the op completes
    throw;
  }
}

// Each local rank's gathered A: the local shards GPU to GPU, then that rank's GEMM over the local rows while the
// exchange runs; the remote shards land in the first local rank's gathered A from the inbox and go GPU to GPU to the
// other local ranks; then the GEMM over the remote rows.
void HostStaging::agGemm(Collective& c) {
  const OpDescriptor& d = c.ops[0].desc;
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = d.dims[dim::kM], cols = d.dims[dim::kN], kk = d.dims[dim::kK], es = dtypeSize(d.dtype);
  const uint64_t rowBytes = kk * es;
  auto shardBytes = [&](uint32_t r) { return rowsOf(m, r, n) * rowBytes; };
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint32_t lead = mine.front();
  std::vector<std::byte*> gathered(n, nullptr), a(n, nullptr);
  std::set<int> devices;
  for (uint32_t r : mine) {
    std::byte* g = slotPtr(c.ops[r], slot::kAGathered);
    gathered[r] = g != nullptr ? g : workspace(r);
    a[r] = slotPtr(c.ops[r], slot::kA);  // null for a rank without rows
    devices.insert(deviceOf(r));
  }
  // Copies on each device's copy stream, then the compute stream waits for them.
  auto copiesThenCompute = [&] {
    for (int dev : devices) {
      k::CudaDeviceGuard guard(dev);
      Gpu& g = gpu(dev);
      k::checkCuda(cudaEventRecord(g.event.get(), g.copy.get()), "cudaEventRecord(span copies)");
      k::checkCuda(cudaStreamWaitEvent(g.compute.get(), g.event.get()), "cudaStreamWaitEvent(span copies)");
    }
  };
  auto gemmRows = [&](const std::vector<std::pair<uint64_t, uint64_t>>& runs) {
    for (uint32_t r : mine) {
      const int dev = deviceOf(r);
      k::CudaDeviceGuard guard(dev);
      for (auto [first, rows] : runs) {
        k::GemmParams p{};
        p.a = gathered[r] + first * rowBytes;
        p.b = slotPtr(c.ops[r], slot::kB);
        p.c = slotPtr(c.ops[r], slot::kC) + first * cols * es;
        p.m = static_cast<int64_t>(rows);
        p.n = static_cast<int64_t>(cols);
        p.k = static_cast<int64_t>(kk);
        p.lda = p.ldb = static_cast<int64_t>(kk);
        p.ldc = static_cast<int64_t>(cols);
        p.dtype = d.dtype == DType::kBF16 ? k::GemmDtype::kBf16 : k::GemmDtype::kFp16;
        gemm(p, gpu(dev).compute.get(), "ag-gemm");
      }
    }
  };
  // 1. This node's shards into every local rank's gathered A, and the GEMM of those rows.
  for (uint32_t r : mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : mine) {
      if (shardBytes(q) == 0 || gathered[r] + rowOffset(m, q, n) * rowBytes == a[q]) continue;
      copyAsync(gathered[r] + rowOffset(m, q, n) * rowBytes, a[q], shardBytes(q), gpu(deviceOf(r)).copy.get(),
                "local shard to gathered A");
    }
  }
  copiesThenCompute();
  gemmRows(rowRuns(c, m, true));
  // 2. The exchange: our shards from the GPUs straight into each outbox; the peers' from the inbox to the lead's A.
  const int leadDev = deviceOf(lead);
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        uint64_t off = 0;
        for (uint32_t q : mine) off += shardBytes(q);
        pin(c, out.data(), off);
        off = 0;
        for (uint32_t q : mine) {
          k::CudaDeviceGuard guard(deviceOf(q));
          copyAsync(out.data() + off, a[q], shardBytes(q), gpu(deviceOf(q)).copy.get(), "shard to the outbox");
          off += shardBytes(q);
        }
        for (int dev : devices) syncStream(dev, gpu(dev).copy.get(), "shards to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const std::vector<uint32_t> from = ranksOn(c, node);
        uint64_t expected = 0;
        for (uint32_t q : from) expected += shardBytes(q);
        if (in.size() != expected) {
          fail(ErrorCode::kProtocol, "ag-gemm: node {} sent {} bytes of A shards, expected {}", node, in.size(),
               expected);
        }
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        uint64_t off = 0;
        for (uint32_t q : from) {
          copyAsync(gathered[lead] + rowOffset(m, q, n) * rowBytes, in.data() + off, shardBytes(q),
                    gpu(leadDev).copy.get(), "inbox to gathered A");
          off += shardBytes(q);
        }
        syncStream(leadDev, gpu(leadDev).copy.get(), "inbox to gathered A");  // the inbox is free once we return
      },
      kExchangeTimeoutMs);
  // 3. The remote rows to the other local ranks' gathered A, and the GEMM of the remote rows.
  const auto remote = rowRuns(c, m, false);
  for (uint32_t r : mine) {
    if (r == lead) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    for (auto [first, rows] : remote) {
      copyAsync(gathered[r] + first * rowBytes, gathered[lead] + first * rowBytes, rows * rowBytes,
                gpu(deviceOf(r)).copy.get(), "remote shards to gathered A");
    }
  }
  copiesThenCompute();
  gemmRows(remote);
  for (int dev : devices) syncStream(dev, gpu(dev).compute.get(), "ag-gemm");
}

void HostStaging::allGather(Collective& c) {
  const uint64_t bytes = c.ops[0].desc.dims[dim::kBytes];
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint32_t lead = mine.front();
  const int leadDev = deviceOf(lead);
  std::set<int> devices;
  for (uint32_t r : mine) devices.insert(deviceOf(r));
  auto recv = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kRecv); };
  auto send = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kSend); };
  for (uint32_t r : mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : mine) copyAsync(recv(r) + q * bytes, send(q), bytes, gpu(deviceOf(r)).copy.get(), "local send");
  }
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        pin(c, out.data(), mine.size() * bytes);
        uint64_t off = 0;
        for (uint32_t q : mine) {
          k::CudaDeviceGuard guard(deviceOf(q));
          copyAsync(out.data() + off, send(q), bytes, gpu(deviceOf(q)).copy.get(), "send to the outbox");
          off += bytes;
        }
        for (int dev : devices) syncStream(dev, gpu(dev).copy.get(), "sends to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const std::vector<uint32_t> from = ranksOn(c, node);
        if (in.size() != from.size() * bytes) fail(ErrorCode::kProtocol, "allgather: node {} sent a short payload", node);
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        for (std::size_t i = 0; i < from.size(); ++i) {
          copyAsync(recv(lead) + from[i] * bytes, in.data() + i * bytes, bytes, gpu(leadDev).copy.get(), "inbox");
        }
        syncStream(leadDev, gpu(leadDev).copy.get(), "inbox to recv");
      },
      kExchangeTimeoutMs);
  for (uint32_t r : mine) {
    if (r == lead) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q = 0; q < c.ops.size(); ++q) {
      if (c.ops[q].local()) continue;
      copyAsync(recv(r) + q * bytes, recv(lead) + q * bytes, bytes, gpu(deviceOf(r)).copy.get(), "remote shards");
    }
  }
  for (int dev : devices) syncStream(dev, gpu(dev).copy.get(), "allgather");
}

// Each local rank's partial with the GEMM core on its GPU; the node sum (rank order, fp32) on the lead's GPU; the
// rows each peer owns to it as fp32; the sum over nodes (node order, fp32) and one rounding into every local C.
void HostStaging::gemmReduce(Collective& c) {
  const OpDescriptor& d = c.ops[0].desc;
  const bool allReduce = d.kind == OpKind::kGemmAr;
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = d.dims[dim::kM], cols = d.dims[dim::kN], es = dtypeSize(d.dtype), ldp = alignUp(cols, 8);
  const k::SpanElem elem = spanElem(d.dtype);
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint32_t lead = mine.front();
  const int leadDev = deviceOf(lead);
  const uint64_t partialBytes = alignUp(m * ldp * es, kAlign), f32Bytes = alignUp(m * cols * sizeof(float), kAlign);
  // The lead's workspace (checkWorkspaces sized it): its partial, the node sum, the running sum over nodes, the
  // receive slot, then the other GPUs' partials and the staging of their outputs.
  std::byte* ws = workspace(lead);
  auto* nodeSum = reinterpret_cast<float*>(ws + partialBytes);
  auto* total = reinterpret_cast<float*>(ws + partialBytes + f32Bytes);
  auto* recvSlot = reinterpret_cast<float*>(ws + partialBytes + 2 * f32Bytes);
  std::byte* next = ws + partialBytes + 3 * f32Bytes;
  cudaStream_t leadStream = gpu(leadDev).compute.get();

  // 1. The partials, each on its rank's GPU.
  std::set<int> devices;
  for (uint32_t r : mine) {
    const int dev = deviceOf(r);
    devices.insert(dev);
    k::CudaDeviceGuard guard(dev);
    k::GemmParams p{};
    p.a = slotPtr(c.ops[r], slot::kA);
    p.b = slotPtr(c.ops[r], slot::kB);
    p.c = workspace(r);
    p.m = static_cast<int64_t>(m);
    p.n = static_cast<int64_t>(cols);
    p.k = static_cast<int64_t>(c.ops[r].desc.dims[dim::kK]);
    p.lda = p.ldb = p.k;
    p.ldc = static_cast<int64_t>(ldp);
    p.dtype = d.dtype == DType::kBF16 ? k::GemmDtype::kBf16 : k::GemmDtype::kFp16;
    if (p.k == 0) {  // a rank without a k slice: its partial is zero (the GEMM core would need A and B)
      k::checkCuda(cudaMemsetAsync(workspace(r), 0, m * ldp * es, gpu(dev).compute.get()), "cudaMemsetAsync(partial)");
      continue;
    }
    gemm(p, gpu(dev).compute.get(), opKindName(d.kind).data());
  }
  // 2. The node sum in rank order on the lead's GPU; the other GPUs' partials come over first.
  {
    k::CudaDeviceGuard guard(leadDev);
    for (int dev : devices) {
      if (dev != leadDev) order(dev, gpu(dev).compute.get(), leadStream);
    }
    next = sumNodePartials(mine, leadDev, leadStream, next, partialBytes, 0, m, cols, ldp, es, elem, nodeSum);
  }
  syncStream(leadDev, leadStream, "node sum");

  // The rows a node's ranks own, in rank order: (first row, rows).
  auto rowsFor = [&](uint32_t node) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    if (allReduce) {
      out.emplace_back(0, m);
    } else {
      for (uint32_t r : ranksOn(c, node)) out.emplace_back(rowOffset(m, r, n), rowsOf(m, r, n));
    }
    return out;
  };
  const auto myRows = rowsFor(c.link->self());
  uint64_t myFloats = 0;
  for (auto [first, rows] : myRows) myFloats += rows * cols;
  bool started = false, ownAdded = false;
  auto addToTotal = [&](const float* src, bool atOwnRows) {
    addRowsToTotal(leadDev, leadStream, myRows, cols, src, atOwnRows, started, total);
    started = true;
  };
  auto addOwnBefore = [&](uint32_t node) {
    if (!ownAdded && c.link->self() < node) {
      addToTotal(nodeSum, true);
      ownAdded = true;
    }
  };
  // 3. The exchange.
  c.link->exchange(
      c.epoch,
      [&](uint32_t node, std::span<std::byte> out) {
        const auto rows = rowsFor(node);
        uint64_t bytes = 0;
        for (auto [first, count] : rows) bytes += count * cols * sizeof(float);
        pin(c, out.data(), bytes);
        k::CudaDeviceGuard guard(leadDev);
        uint64_t off = 0;
        for (auto [first, count] : rows) {
          copyAsync(out.data() + off, nodeSum + first * cols, count * cols * sizeof(float), leadStream,
                    "node partial to the outbox");
          off += count * cols * sizeof(float);
        }
        syncStream(leadDev, leadStream, "node partial to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        if (in.size() != myFloats * sizeof(float)) {
          fail(ErrorCode::kProtocol, "{}: node {} sent a payload of {} bytes, expected {}", opKindName(d.kind), node,
               in.size(), myFloats * sizeof(float));
        }
        addOwnBefore(node);
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        // On the compute stream: after the previous node's add has read the receive slot.
        copyAsync(recvSlot, in.data(), in.size(), leadStream, "inbox to the receive slot");
        syncStream(leadDev, leadStream, "inbox to the receive slot");  // the inbox is free once we return
        addToTotal(recvSlot, false);
      },
      kExchangeTimeoutMs);
  if (!ownAdded) addToTotal(nodeSum, true);
  // 4. One rounding into every local rank's C (gemm-rs: its own rows; gemm-ar: all of them).
  roundOutputs(c, mine, leadDev, leadStream, total, next);
  syncStream(leadDev, leadStream, opKindName(d.kind).data());
}

void HostStaging::addRowsToTotal(int leadDev, cudaStream_t s, const std::vector<std::pair<uint64_t, uint64_t>>& rows,
                                 uint64_t cols, const float* src, bool atOwnRows, bool accumulate, float* total) {
  k::CudaDeviceGuard guard(leadDev);
  uint64_t off = 0;
  for (auto [first, count] : rows) {
    k::SpanSum sm{};
    sm.count = 1;
    sm.src[0] = src + (atOwnRows ? first * cols : off);
    sm.srcType = k::SpanElem::kF32;
    sm.dst = total + first * cols;
    sm.dstType = k::SpanElem::kF32;
    sm.accumulate = accumulate;
    sm.rows = static_cast<int64_t>(count);
    sm.cols = static_cast<int64_t>(cols);
    sm.srcLd = sm.dstLd = static_cast<int64_t>(cols);
    sum(sm, s, "sum over nodes");
    off += count * cols;
  }
}

// ---- the GPU-issued exchange -----------------------------------------------------------------------------------------

namespace {

constexpr uint64_t kExchangeTimeoutNs = uint64_t{kExchangeTimeoutMs} * 1'000'000;

// Tensors the GEMM core cannot take in place (not 16-byte aligned) on the GPU exchange, where a node-local fact must
// not change the path: an input is copied aside before the GEMM reads it, an output is computed aside and copied back
// after. Stream-ordered memory on the stream of the GEMM that uses it (no device-wide synchronisation, which a spinning
// exchange kernel of another communicator could hold up), freed on that stream.
class Aside {
 public:
  Aside() = default;
  Aside(const Aside&) = delete;
  Aside& operator=(const Aside&) = delete;
  ~Aside() {
    for (const Block& b : blocks_) {
      k::CudaDeviceGuard guard(b.dev);
      k::reportRelease(cudaFreeAsync(b.mem, b.stream), "cudaFreeAsync(aligned copy)");
    }
  }
  const std::byte* input(int dev, cudaStream_t s, const std::byte* p, uint64_t bytes) {
    if (p == nullptr || aligned16(p)) return p;
    std::byte* q = allocate(dev, s, bytes, nullptr);
    copyAsync(q, p, bytes, s, "input to an aligned copy");
    return q;
  }
  std::byte* output(int dev, cudaStream_t s, std::byte* p, uint64_t bytes) {
    if (p == nullptr || aligned16(p)) return p;
    return allocate(dev, s, bytes, p);
  }
  // The outputs' copies back, each on its stream after what was queued there before.
  void flush() {
    for (const Block& b : blocks_) {
      if (b.back == nullptr) continue;
      k::CudaDeviceGuard guard(b.dev);
      copyAsync(b.back, b.mem, b.bytes, b.stream, "aligned copy to the output");
    }
  }

 private:
  struct Block {
    int dev;
    cudaStream_t stream;
    std::byte* mem;
    std::byte* back;  // an output's home; null for an input
    uint64_t bytes;
  };
  std::byte* allocate(int dev, cudaStream_t s, uint64_t bytes, std::byte* back) {
    k::CudaDeviceGuard guard(dev);
    void* mem = nullptr;
    k::checkCuda(cudaMallocAsync(&mem, std::max<uint64_t>(bytes, 16), s), "cudaMallocAsync({} bytes, aligned copy)",
                 bytes);
    blocks_.push_back({dev, s, static_cast<std::byte*>(mem), back, bytes});
    return static_cast<std::byte*>(mem);
  }
  std::vector<Block> blocks_;
};

}  // namespace

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

GpuRegion& HostStaging::gpuRegion(Collective& c) {
  if (region_) return *region_;
  if (!hub_) fail(ErrorCode::kInternal, "GPU exchange: the backend gave no GPU proxies");
  const int leadDev = deviceOf(localRanksOf(c).front());
  // Never loaded lazily behind a spinning exchange kernel (tandem/kernels/preload.hpp).
  for (auto& [device, g] : gpus_) {
    k::preloadSpanExchangeKernels(device);
    k::preloadGemmKernels(device);
  }
  Cluster& cluster = c.link->cluster();
  const DaemonConfig& config = cluster.config();
  const auto grace = std::chrono::milliseconds(std::max<uint32_t>(10000, 3 * config.communicators.peerLostDeadlineMs));
  auto region = std::make_unique<GpuRegion>(
      hub_->proxy(leadDev, cluster.transport()),
      GpuRegionLayout::make(c.link->nodes(), c.link->self(), config.cluster.stagingBytes), c.link, grace);
  // The keys through the host staging, once per communicator, at the first op every node sends through the GPUs.
  const std::vector<std::byte> mine = region->key().encode();
  std::map<transport::NodeIndex, transport::RemoteKey> keys;
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        if (out.size() < mine.size()) fail(ErrorCode::kInternal, "GPU exchange: no room for the region key");
        std::memcpy(out.data(), mine.data(), mine.size());
        return static_cast<uint64_t>(mine.size());
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const transport::RemoteKey key = transport::RemoteKey::decode(in);
        if (key.owner != node || key.bytes != region->layout().bytes()) {
          fail(ErrorCode::kProtocol, "GPU exchange: node {} sent a region key of node {} with {} bytes (expected {})",
               node, key.owner, key.bytes, region->layout().bytes());
        }
        keys[node] = key;
      },
      kExchangeTimeoutMs);
  region->setPeerKeys(keys);
  std::lock_guard lock(mutex_);
  region_ = std::move(region);
  if (failed_) region_->abort();
  return *region_;
}

// Stream waits (the GPU's front end polls the word; no SM, no time slice held). 32-bit, wrap-aware (>=): the low half
// of the 64-bit epochs, which stay far below 2^31 apart.
void HostStaging::streamWait(cudaStream_t s, const uint64_t* word, uint64_t value, const char* what, bool flush) {
  const unsigned flags = static_cast<unsigned>(CU_STREAM_WAIT_VALUE_GEQ) |
                         (flush ? static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH) : 0u);
  const CUresult r = k::driver().streamWaitValue32(s, reinterpret_cast<CUdeviceptr>(word),
                                                   static_cast<cuuint32_t>(value), flags);
  k::checkCuda(r, "cuStreamWaitValue32({})", what);
}

void HostStaging::waitSendAreaFree(int leadDev, cudaStream_t s) {
  GpuRegion& region = *region_;
  const k::SpanExchangePlan& plan = *region.plan();
  if (plan.prevEpoch == 0) return;
  k::CudaDeviceGuard guard(leadDev);
  if (!streamWaits_) {
    k::checkCuda(k::launchSpanFree(region.planDevice(), s), "span exchange free");
    return;
  }
  for (uint32_t i = 0; i < plan.peers; ++i) streamWait(s, plan.consumed[i], plan.prevEpoch, "consumed");
}

void HostStaging::push(int leadDev, cudaStream_t exch, uint32_t pass) {
  k::CudaDeviceGuard guard(leadDev);
  k::checkCuda(k::launchSpanPush(region_->planDevice(pass), exch), "span exchange push");
}

void HostStaging::pushThenWait(int leadDev, cudaStream_t exch) {
  push(leadDev, exch, 0);
  waitArrived(leadDev, exch);
}

void HostStaging::waitArrived(int leadDev, cudaStream_t exch) {
  GpuRegion& region = *region_;
  const k::SpanExchangePlan& plan = *region.plan();
  k::CudaDeviceGuard guard(leadDev);
  if (!streamWaits_) k::checkCuda(k::launchSpanWait(region.planDevice(), exch), "span exchange wait");
  // Where GPUDirect writes need a flush before this GPU reads them (gpu_exchange_plan.hpp, chooseRegionMemory), a
  // stream wait does it, also after the wait kernel (then already satisfied).
  if (!streamWaits_ && !region.flushOnArrival()) return;
  for (uint32_t i = 0; i < plan.peers; ++i) {
    streamWait(exch, plan.arrived[i], plan.epoch, "arrived", region.flushOnArrival());
  }
}

void HostStaging::waitGpuWork(Collective& c) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2 * kExchangeTimeoutMs);
  // Stream waits have no deadline of their own: past the kernels' timeout the host releases them (and fails the op).
  const auto waitDeadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kExchangeTimeoutMs);
  bool aborted = false, timedOut = false;
  for (uint32_t spins = 0;; ++spins) {
    bool busy = false;
    for (auto& [device, g] : gpus_) {
      k::CudaDeviceGuard guard(device);
      for (cudaStream_t s : {g.exchange.get(), g.compute.get(), g.copy.get()}) {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaErrorNotReady) {
          busy = true;
          break;
        }
        k::checkCuda(e, "the GPU work of {} across nodes", opKindName(c.ops[0].desc.kind));
      }
      if (busy) break;
    }
    if (!busy) break;
    if (!aborted && (c.link->abortedFor(c.epoch) || failedNow())) {
      aborted = true;
      if (region_) {
        region_->abort();                   // the kernels' waits end; the rest of the op drains
        region_->releaseWaits(c.epoch);     // and the stream waits
      }
    }
    if (!aborted && !timedOut && streamWaits_ && spins % 256 == 255 && std::chrono::steady_clock::now() > waitDeadline) {
      timedOut = true;
      if (region_) {
        region_->abort();
        region_->releaseWaits(c.epoch);
      }
    }
    if (spins % 256 == 255 && std::chrono::steady_clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "{} across nodes: the GPU work did not finish within {} ms",
           opKindName(c.ops[0].desc.kind), 2 * kExchangeTimeoutMs);
    }
    if (spins < 2048) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  if (aborted) {
    c.link->throwIfAborted(c.epoch);
    std::lock_guard lock(mutex_);
    fail(failCode_, "{}", reason_);
  }
  if (timedOut) {
    fail(ErrorCode::kTimeout, "{} across nodes: the peers' data or consumed flags did not come within {} ms (the peer "
         "daemon is alive but silent; check its log)", opKindName(c.ops[0].desc.kind), kExchangeTimeoutMs);
  }
}

void HostStaging::finishGpuExchange(Collective& c) {
  GpuRegion& region = *region_;
  if (const std::string why = region.failure(); !why.empty()) {
    c.link->throwIfAborted(c.epoch);
    if (failedNow()) {
      std::lock_guard lock(mutex_);
      fail(failCode_, "{}", reason_);
    }
    fail(ErrorCode::kTimeout, "{} across nodes: {}; the peer daemon is alive but its data never came (check its log)",
         opKindName(c.ops[0].desc.kind), why);
  }
  const uint64_t last = region.lastTicket();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kExchangeTimeoutMs);
  for (uint32_t spins = 0; region.proxy().completed() < last; ++spins) {
    c.link->throwIfAborted(c.epoch);
    if (spins % 256 == 255 && std::chrono::steady_clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "{} across nodes: the GPU's proxy did not post this node's transfers within {} ms",
           opKindName(c.ops[0].desc.kind), kExchangeTimeoutMs);
    }
    if (spins < 2048) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  prevGpuEpoch_ = c.epoch;
  // A rank may destroy the communicator as soon as this op completes; the CommFail that sends must tell the peers
  // that this node's part of it is done (they still finish it), as the host exchange's completion does.
  c.link->markCompleted(c.epoch);
}

void HostStaging::runGpuExchange(Collective& c, const ExchangeOp& op) {
  GpuRegion& region = gpuRegion(c);
  // gemm-rs/ar push pass by pass (gemmReduceGpu), the plans cut alike.
  region.preparePlan(op, c.epoch, prevGpuEpoch_, kExchangeTimeoutNs, exchangePassCuts(op));
  try {
    switch (c.ops[0].desc.kind) {
      case OpKind::kAgGemm: agGemmGpu(c, op); break;
      case OpKind::kAllGather: allGatherGpu(c, op); break;
      default: gemmReduceGpu(c, op); break;
    }
    waitGpuWork(c);
  } catch (...) {
    // Nothing of ours may still wait or write once the op completes; the communicator fails either way.
    region.abort();
    region.releaseWaits(c.epoch);
    drain();
    throw;
  }
  finishGpuExchange(c);
}

// As agGemm, with the exchange on the lead GPU's exchange stream: the local shards into the send area and the local
// rows' GEMM, the push; then the wait, the remote shards from the inboxes into every gathered A, the remote rows' GEMM.
void HostStaging::agGemmGpu(Collective& c, const ExchangeOp& op) {
  const OpDescriptor& d = c.ops[0].desc;
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = d.dims[dim::kM], cols = d.dims[dim::kN], kk = d.dims[dim::kK], es = dtypeSize(d.dtype);
  const uint64_t rowBytes = kk * es;
  auto shardBytes = [&](uint32_t r) { return rowsOf(m, r, n) * rowBytes; };
  const std::vector<uint32_t> mine = localRanksOf(c);
  const int leadDev = deviceOf(mine.front());
  GpuRegion& region = *region_;
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  Aside aside;
  std::vector<std::byte*> gathered(n, nullptr), home(n, nullptr), cOut(n, nullptr);
  std::vector<const std::byte*> a(n, nullptr), b(n, nullptr);
  std::set<int> devices;
  for (uint32_t r : mine) {
    const int dev = deviceOf(r);
    devices.insert(dev);
    cudaStream_t cs = gpu(dev).compute.get();
    std::byte* g = slotPtr(c.ops[r], slot::kAGathered);
    home[r] = g != nullptr && !aligned16(g) ? g : nullptr;  // a misaligned gathered A: built in the workspace
    gathered[r] = g != nullptr && aligned16(g) ? g : workspace(r);
    a[r] = slotPtr(c.ops[r], slot::kA);
    b[r] = aside.input(dev, cs, slotPtr(c.ops[r], slot::kB), cols * kk * es);
    cOut[r] = aside.output(dev, cs, slotPtr(c.ops[r], slot::kC), m * cols * es);
  }
  auto copiesThenCompute = [&] {
    for (int dev : devices) order(dev, gpu(dev).copy.get(), gpu(dev).compute.get());
  };
  auto gemmRows = [&](const std::vector<std::pair<uint64_t, uint64_t>>& runs) {
    for (uint32_t r : mine) {
      const int dev = deviceOf(r);
      k::CudaDeviceGuard guard(dev);
      for (auto [first, rows] : runs) {
        k::GemmParams p{};
        p.a = gathered[r] + first * rowBytes;
        p.b = b[r];
        p.c = cOut[r] + first * cols * es;
        p.m = static_cast<int64_t>(rows);
        p.n = static_cast<int64_t>(cols);
        p.k = static_cast<int64_t>(kk);
        p.lda = p.ldb = static_cast<int64_t>(kk);
        p.ldc = static_cast<int64_t>(cols);
        p.dtype = d.dtype == DType::kBF16 ? k::GemmDtype::kBf16 : k::GemmDtype::kFp16;
        gemm(p, gpu(dev).compute.get(), "ag-gemm");
      }
    }
  };
  // 1. This node's shards into the send area (packed in rank order, once it is free) and into every local rank's
  //    gathered A.
  waitSendAreaFree(leadDev, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    uint64_t off = 0;
    for (uint32_t q : mine) {
      copyAsync(region.sendArea() + off, a[q], shardBytes(q), lead.copy.get(), "shard to the send area");
      off += shardBytes(q);
    }
  }
  for (uint32_t r : mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : mine) {
      if (shardBytes(q) == 0 || gathered[r] + rowOffset(m, q, n) * rowBytes == a[q]) continue;
      copyAsync(gathered[r] + rowOffset(m, q, n) * rowBytes, a[q], shardBytes(q), gpu(deviceOf(r)).copy.get(),
                "local shard to gathered A");
    }
  }
  // 2. The push once the send area is filled, then the wait; meanwhile the local rows' GEMMs.
  order(leadDev, lead.copy.get(), exch);
  pushThenWait(leadDev, exch);
  copiesThenCompute();
  gemmRows(rowRuns(c, m, true));
  // 3. The peers' shards from the inboxes into every local rank's gathered A, once they arrived: on the lead's copy
  //    stream, whatever GPU the destination is on (only the region's GPU reads its inboxes: chooseRegionMemory).
  order(leadDev, exch, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (uint32_t p : region.layout().peers()) {
      uint64_t off = 0;
      for (uint32_t q : ranksOnNode(op, p)) {
        for (uint32_t r : mine) {
          copyAsync(gathered[r] + rowOffset(m, q, n) * rowBytes, region.inbox(p) + off, shardBytes(q), lead.copy.get(),
                    "inbox to gathered A");
        }
        off += shardBytes(q);
      }
    }
  }
  // 4. The inboxes are read once those copies are done: tell the peers; the remote rows' GEMMs meanwhile.
  order(leadDev, lead.copy.get(), exch);
  {
    k::CudaDeviceGuard guard(leadDev);
    k::checkCuda(k::launchSpanConsumed(region.planDevice(), exch), "span exchange consumed");
  }
  for (int dev : devices) order(leadDev, lead.copy.get(), gpu(dev).compute.get());
  gemmRows(rowRuns(c, m, false));
  // 5. Outputs computed aside go home (on the compute streams, after the GEMMs).
  aside.flush();
  for (uint32_t r : mine) {
    if (home[r] == nullptr) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    copyAsync(home[r], gathered[r], m * rowBytes, gpu(deviceOf(r)).compute.get(), "gathered A to its tensor");
  }
}

// As allGather, with the exchange on the lead GPU's exchange stream.
void HostStaging::allGatherGpu(Collective& c, const ExchangeOp& op) {
  const uint64_t bytes = c.ops[0].desc.dims[dim::kBytes];
  const std::vector<uint32_t> mine = localRanksOf(c);
  const int leadDev = deviceOf(mine.front());
  GpuRegion& region = *region_;
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  std::set<int> devices;
  for (uint32_t r : mine) devices.insert(deviceOf(r));
  auto recv = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kRecv); };
  auto send = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kSend); };
  waitSendAreaFree(leadDev, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      copyAsync(region.sendArea() + i * bytes, send(mine[i]), bytes, lead.copy.get(), "send to the send area");
    }
  }
  order(leadDev, lead.copy.get(), exch);
  pushThenWait(leadDev, exch);
  for (uint32_t r : mine) {
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q : mine) copyAsync(recv(r) + q * bytes, send(q), bytes, gpu(deviceOf(r)).copy.get(), "local send");
  }
  // The inboxes into every local rank's recv on the lead's copy stream (only the region's GPU reads its inboxes).
  order(leadDev, exch, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (uint32_t p : region.layout().peers()) {
      const std::vector<uint32_t> from = ranksOnNode(op, p);
      for (std::size_t i = 0; i < from.size(); ++i) {
        for (uint32_t r : mine) {
          copyAsync(recv(r) + from[i] * bytes, region.inbox(p) + i * bytes, bytes, lead.copy.get(), "inbox to recv");
        }
      }
    }
  }
  for (int dev : devices) order(dev, gpu(dev).copy.get(), exch);
  k::CudaDeviceGuard guard(leadDev);
  k::checkCuda(k::launchSpanConsumed(region.planDevice(), exch), "span exchange consumed");
}

// As gemmReduce, over the GPU region: the node sum goes into the send area (written there in place when the region is
// GPU memory; computed in the workspace and the rows the peers get copied there by DMA when it is host memory, so
// that the SMs never write or read it over PCIe), the push reads each peer's rows from it in place, and the sum over
// nodes adds our node sum and each inbox (copied into the receive slot first when host memory) in node order: the
// same fp32 adds in the same order as gemmReduce, bitwise the same results.
void HostStaging::gemmReduceGpu(Collective& c, const ExchangeOp& op) {
  const OpDescriptor& d = c.ops[0].desc;
  const uint64_t m = d.dims[dim::kM], cols = d.dims[dim::kN], es = dtypeSize(d.dtype), ldp = alignUp(cols, 8);
  const k::SpanElem elem = spanElem(d.dtype);
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint32_t leadRank = mine.front();
  const int leadDev = deviceOf(leadRank);
  GpuRegion& region = *region_;
  const bool host = region.hostResident();
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  cudaStream_t leadStream = lead.compute.get();
  const uint64_t partialBytes = alignUp(m * ldp * es, kAlign), f32Bytes = alignUp(m * cols * sizeof(float), kAlign);
  // The lead's workspace, as gemmReduce lays it out: its partial, the node sum (unused when the send area holds it),
  // the sum over nodes, the receive slot, then the other GPUs' partials and their outputs' staging.
  std::byte* ws = workspace(leadRank);
  auto* sendSum = reinterpret_cast<float*>(region.sendArea());
  auto* nodeSum = host ? reinterpret_cast<float*>(ws + partialBytes) : sendSum;
  auto* total = reinterpret_cast<float*>(ws + partialBytes + f32Bytes);
  auto* recvSlot = reinterpret_cast<float*>(ws + partialBytes + 2 * f32Bytes);
  std::byte* next = ws + partialBytes + 3 * f32Bytes;
  Aside aside;

  // The inputs, once (copied aside where misaligned).
  std::set<int> devices;
  std::map<uint32_t, std::pair<const std::byte*, const std::byte*>> ab;  // rank -> (A, B)
  for (uint32_t r : mine) {
    const int dev = deviceOf(r);
    devices.insert(dev);
    const uint64_t kr = c.ops[r].desc.dims[dim::kK];
    if (kr == 0) continue;
    k::CudaDeviceGuard guard(dev);
    cudaStream_t cs = gpu(dev).compute.get();
    ab[r] = {aside.input(dev, cs, slotPtr(c.ops[r], slot::kA), m * kr * es),
             aside.input(dev, cs, slotPtr(c.ops[r], slot::kB), cols * kr * es)};
  }
  const uint32_t self = region.layout().self;
  const bool allReduce = d.kind == OpKind::kGemmAr;
  // The rows the peers get (all of them for gemm-ar, each peer's own for gemm-rs).
  std::vector<std::pair<uint64_t, uint64_t>> sent;
  if (allReduce) {
    sent.emplace_back(0, m);
  } else {
    for (uint32_t p : region.layout().peers()) {
      for (auto run : ownedRows(op, p)) sent.push_back(run);
    }
  }
  // Pass by pass over row blocks (the region's plans cut the writes alike: runGpuExchange), so that a block's rows
  // go to the peers while the next block's GEMMs run: 1. each local rank's partial rows on its GPU; 2. their node sum
  // in rank order on the lead's GPU (into the send area in place, or in the workspace and the sent rows copied to
  // the send area by DMA); 3. the push of that pass's writes. The GEMM core computes each output element alike
  // whatever the rows around it, so the results stay bitwise those of one pass (and of the staged path).
  const std::vector<uint64_t> starts = passRowStarts(m);
  for (uint32_t q = 0; q < starts.size(); ++q) {
    const uint64_t r0 = starts[q], r1 = q + 1 < starts.size() ? starts[q + 1] : m;
    for (uint32_t r : mine) {
      const int dev = deviceOf(r);
      k::CudaDeviceGuard guard(dev);
      cudaStream_t cs = gpu(dev).compute.get();
      const uint64_t kr = c.ops[r].desc.dims[dim::kK];
      if (kr == 0) {  // a rank without a k slice: its partial is zero
        k::checkCuda(cudaMemsetAsync(workspace(r) + r0 * ldp * es, 0, (r1 - r0) * ldp * es, cs),
                     "cudaMemsetAsync(partial)");
        continue;
      }
      k::GemmParams p{};
      p.a = ab[r].first + r0 * kr * es;
      p.b = ab[r].second;
      p.c = workspace(r) + r0 * ldp * es;
      p.m = static_cast<int64_t>(r1 - r0);
      p.n = static_cast<int64_t>(cols);
      p.k = static_cast<int64_t>(kr);
      p.lda = p.ldb = p.k;
      p.ldc = static_cast<int64_t>(ldp);
      p.dtype = d.dtype == DType::kBF16 ? k::GemmDtype::kBf16 : k::GemmDtype::kFp16;
      gemm(p, cs, opKindName(d.kind).data());
    }
    {
      k::CudaDeviceGuard guard(leadDev);
      for (int dev : devices) {
        if (dev != leadDev) order(dev, gpu(dev).compute.get(), leadStream);
      }
      if (q == 0 && !host) waitSendAreaFree(leadDev, leadStream);  // the node sum goes into the send area itself
      sumNodePartials(mine, leadDev, leadStream, next, partialBytes, r0, r1 - r0, cols, ldp, es, elem, nodeSum);
      if (host) {
        if (q == 0) waitSendAreaFree(leadDev, leadStream);
        for (auto [first, rows] : sent) {
          const uint64_t lo = std::max(first, r0), hi = std::min(first + rows, r1);
          if (lo >= hi) continue;
          copyAsync(sendSum + lo * cols, nodeSum + lo * cols, (hi - lo) * cols * sizeof(float), leadStream,
                    "node sum to the send area");
        }
      }
    }
    order(leadDev, leadStream, exch);
    push(leadDev, exch, q);
  }
  next += partialBytes * static_cast<uint64_t>(std::count_if(mine.begin(), mine.end(), [&](uint32_t r) {
            return deviceOf(r) != leadDev;
          }));  // past the other GPUs' partials, as sumNodePartials returns
  // The wait for the peers' payloads, then the sum over nodes.
  waitArrived(leadDev, exch);
  order(leadDev, exch, leadStream);
  // 4. The sum over nodes in node order: our node sum at our rows, each peer's inbox packed.
  const auto myRows = ownedRows(op, self);
  uint64_t myFloats = 0;
  for (auto [first, rows] : myRows) myFloats += rows * cols;
  bool started = false;
  for (uint32_t node : region.layout().nodes) {
    const float* src = node == self ? nodeSum : reinterpret_cast<const float*>(region.inbox(node));
    if (node != self && host) {
      k::CudaDeviceGuard guard(leadDev);
      copyAsync(recvSlot, src, myFloats * sizeof(float), leadStream, "inbox to the receive slot");
      src = recvSlot;
    }
    addRowsToTotal(leadDev, leadStream, myRows, cols, src, node == self, started, total);
    started = true;
  }
  // The inboxes are read: tell the peers, while the outputs are rounded.
  order(leadDev, leadStream, exch);
  {
    k::CudaDeviceGuard guard(leadDev);
    k::checkCuda(k::launchSpanConsumed(region.planDevice(), exch), "span exchange consumed");
  }
  // 5. One rounding into every local rank's C (gemm-rs: its own rows; gemm-ar: all of them), as gemmReduce.
  roundOutputs(c, mine, leadDev, leadStream, total, next);
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
