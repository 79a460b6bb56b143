#include "cuda/cuda_backend.hpp"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "cuda/cuda_multinode.hpp"
#include "cuda/daemon_executor.hpp"
#include "cuda/gpu.hpp"
#include "lifecycle.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/fused_ops.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;
using Clock = std::chrono::steady_clock;

int32_t statusOf(ErrorCode code) { return static_cast<int32_t>(wireCode(code)); }

// Host-side access to words the GPU or another process also touches.
uint32_t load32(const uint32_t& w) { return std::atomic_ref<const uint32_t>(w).load(std::memory_order_acquire); }
void store32(uint32_t& w, uint32_t v) { std::atomic_ref<uint32_t>(w).store(v, std::memory_order_release); }
void store64(uint64_t& w, uint64_t v) { std::atomic_ref<uint64_t>(w).store(v, std::memory_order_release); }
// Stream words compare cyclically, as cuStreamWaitValue32(GEQ) does.
bool cyclicGeq(uint32_t value, uint64_t epoch) {
  return static_cast<int32_t>(value - static_cast<uint32_t>(epoch)) >= 0;
}

uint64_t opTimeoutNs() {
  const char* v = std::getenv("TANDEM_OP_TIMEOUT_MS");
  const uint64_t ms = (v != nullptr && *v != '\0') ? std::strtoull(v, nullptr, 10) : 60000;
  return (ms == 0 ? 60000 : ms) * 1'000'000ull;
}

uint32_t pow2Floor(uint32_t x) {
  uint32_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}


using k::isFusedGemm;
// Client executor: ops released only once every rank's stream reached them (k::needsGang, shared with libtandem).
// Measured on nvidia-h200-x2 (bench/RESULTS.md): a GPU-to-GPU barrier kernel over the workspaces was slower than
// this host gate at 2 ranks (16.6 vs 13.4 us p50 round trip), so barriers stay gated by the daemon.
using k::needsGang;

// The epoch of the op whose wait failed: AllGather's flags carry it in the high half, the fused GEMMs' are epochs.
uint64_t failedEpoch(const kernels::ErrorSlot& e) {
  return static_cast<OpKind>(e.op) == OpKind::kAllGather ? e.expected >> 32 : e.expected;
}

const char* roleName(uint32_t role) {
  switch (static_cast<kernels::Role>(role)) {
    case kernels::Role::kCompute: return "compute";
    case kernels::Role::kIntraComm: return "communication";
    case kernels::Role::kInterSend: return "inter-node send";
    case kernels::Role::kInterReduce: return "inter-node reduce";
    case kernels::Role::kReduce: return "reduce";
  }
  return "unknown";
}

struct Gang {
  Collective c;
  Clock::time_point arrived, released;  // the collective reached the backend; released to the GPUs (go or pushed)
  uint64_t epoch = 0;
  OpKind kind = OpKind::kInvalid;
  bool rejected = false;
  uint32_t remaining = 0;  // ranks not completed yet
  std::vector<bool> completed;
};

struct RankRes {
  int device = -1;
  std::string uuid;
  std::shared_ptr<CuMemAllocation> workspace;
  Fd workspaceFd;
  Fd controlFd;
  Mapping control;
  k::CommControl* ctl = nullptr;
  k::CommControl* ctlDevice = nullptr;  // daemon executor: the same page as the GPU addresses it
  bool hostRegistered = false;
  uint64_t doneEpoch = 0;  // the highest epoch `done` has shown
  uint64_t decided = 0;    // the highest epoch released to this rank
  std::deque<std::shared_ptr<Gang>> inflight;  // accepted and released, waiting for done
};

struct CudaComm final : CommResources {
  uint64_t handle = 0;
  uint32_t nranks = 0;
  std::vector<RankRes> ranks;
  uint64_t workspaceBytes = 0;      // the smallest rank's workspace
  k::WorkspaceLayout layout;        // the fused GEMMs' regions in it (libtandem computes the same from the same size)
  std::deque<std::shared_ptr<Gang>> pending;  // in epoch order; the head waits for its release condition
  bool failed = false;
  bool failureReported = false;
  std::string failureToReport;  // set when the backend itself aborted the communicator; poll() tells the engine
  std::vector<uint32_t> lead;  // after an abort: the go/done value every rank's streams must keep seeing
  ErrorCode failCode = ErrorCode::kAborted;
  std::string reason;
  // Multi-node (cuda_multinode.hpp): ops staged through host memory. Only local ranks have a control page (ctl);
  // nobody has a workspace. Declared last: destroyed before the control pages it points into.
  std::unique_ptr<HostStaging> staging;
  ~CudaComm() override {
    for (auto& r : ranks) {
      if (r.hostRegistered) {
        cudaHostUnregister(r.ctl);
        cudaGetLastError();
      }
    }
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const DaemonConfig& config, std::vector<GpuInfo> gpus, bool daemonExecutor)
      : config_(config), gpus_(std::move(gpus)), daemonExecutor_(daemonExecutor), timeoutNs_(opTimeoutNs()),
        workspaceBytes_(config.cuda.workspaceBytes) {
    for (const auto& g : gpus_) {
      useDevice(g.ordinal);
      cudaStream_t s = nullptr;
      checkRuntime(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      setupStreams_[g.ordinal] = s;
    }
    if (daemonExecutor_) {
      uint32_t ctas = config_.cuda.commSms != 0 ? config_.cuda.commSms : 32;
      ctas = pow2Floor(std::clamp<uint32_t>(ctas, 1, k::kAgMaxCtas));
      for (const auto& g : gpus_) {
        executors_[g.ordinal] = std::make_unique<GpuExecutor>(
            g.ordinal, ctas, uint64_t{config_.cuda.daemonLingerMs} * 1'000'000ull);
      }
      executorCtas_ = ctas;
    }
  }

  ~CudaBackend() override {
    stop();
    for (auto& [dev, s] : setupStreams_) cudaStreamDestroy(s);
    cudaGetLastError();
  }

  const char* name() const override { return "cuda"; }
  const char* executor() const override { return daemonExecutor_ ? "daemon" : "client"; }
  OpSet ops(const CommResources* /*comm*/) const override {
    return {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr, OpKind::kAllGather, OpKind::kNop};
  }
  std::vector<GpuInfo> gpus() const override { return gpus_; }

  void stop() override {
    {
      // Kernels still waiting on a peer leave at once instead of at their deadline.
      std::lock_guard lock(mutex_);
      for (auto& w : comms_) {
        if (auto cc = w.lock()) {
          for (auto& rr : cc->ranks) {
            if (rr.ctl != nullptr) store64(rr.ctl->abort, k::kAbortValue);
          }
        }
      }
    }
    for (auto& [dev, e] : executors_) e->stop();
  }

  // ---- memory ----

  std::shared_ptr<Buffer> allocate(uint64_t bytes, const std::string& deviceUuid) override {
    const GpuInfo& g = deviceUuid.empty() ? gpus_.front() : gpu(deviceUuid, "allocate");
    auto buffer = std::make_shared<Buffer>();
    auto alloc = createExportable(g.ordinal, bytes, accessFor(g.ordinal), &buffer->fd);
    buffer->bytes = bytes;
    buffer->accountedBytes = alloc->size;
    buffer->mappedBytes = alloc->size;
    buffer->deviceUuid = g.uuid;
    buffer->device = std::move(alloc);
    return buffer;
  }

  std::shared_ptr<Buffer> registerMemory(RegisterRequest& request) override {
    auto buffer = std::make_shared<Buffer>();
    buffer->bytes = request.bytes;
    buffer->accountedBytes = request.bytes;
    switch (request.kind) {
      case RegisterRequest::Kind::kMemfd:
        fail(ErrorCode::kUnsupported, "register: this tandemd runs the cuda backend, which registers GPU memory "
             "(cudaMalloc or cuMem); host memfd memory needs daemon.backend: cpu");
      case RegisterRequest::Kind::kCudaIpc: {
        const GpuInfo& g = gpu(request.deviceUuid, "register");
        buffer->device = openIpc(request.ipcHandle, g.ordinal, request.offset, request.bytes);
        buffer->deviceUuid = g.uuid;
        break;
      }
      case RegisterRequest::Kind::kCudaFd: {
        if (!request.fd) fail(ErrorCode::kProtocol, "register: the cuMem fd did not arrive with the request");
        if (request.offset > (uint64_t{1} << 40)) {
          fail(ErrorCode::kInvalidArgument, "register: offset {} is out of range", request.offset);
        }
        auto alloc = importFd(request.fd, request.offset + request.bytes, allDevices());
        alloc->address = alloc->va + request.offset;
        for (const auto& g : gpus_) {
          if (g.ordinal == alloc->device) buffer->deviceUuid = g.uuid;
        }
        if (buffer->deviceUuid.empty()) {
          fail(ErrorCode::kInvalidArgument, "register: the memory lives on a GPU tandemd does not own (cuda.devices)");
        }
        buffer->device = std::move(alloc);
        break;
      }
    }
    return buffer;
  }

  std::byte* resolve(const Buffer& buffer, uint64_t offset) const override {
    if (!buffer.device) fail(ErrorCode::kInternal, "buffer {} has no GPU memory", buffer.id);
    return reinterpret_cast<std::byte*>(buffer.device->address + offset);
  }

  // ---- communicators ----

  void checkJoin(const std::string& deviceUuid) override {
    if (deviceUuid.empty()) {
      fail(ErrorCode::kInvalidArgument, "tandemd runs the cuda backend and needs each rank's GPU: call cudaSetDevice "
           "before tandem_comm_init (libtandem sends the current device's UUID); a libtandem built without CUDA "
           "cannot join");
    }
    gpu(deviceUuid, "join");
  }

  std::shared_ptr<CommResources> setupComm(const Communicator& comm) override {
    if (comm.spansNodes()) return setupStaged(comm);
    if (comm.nranks > k::kMaxLocalRanks) {
      fail(ErrorCode::kUnsupported, "the cuda backend runs communicators of up to {} GPUs of one node ({} ranks asked); "
           "use fewer ranks", k::kMaxLocalRanks, comm.nranks);
    }
    auto cc = std::make_shared<CudaComm>();
    cc->handle = comm.handle;
    cc->nranks = comm.nranks;
    cc->ranks.resize(comm.nranks);
    for (uint32_t r = 0; r < comm.nranks; ++r) {
      const GpuInfo& g = gpu(comm.devices[r], "join");
      cc->ranks[r].device = g.ordinal;
      cc->ranks[r].uuid = g.uuid;
      if (daemonExecutor_) {
        for (uint32_t q = 0; q < r; ++q) {
          if (cc->ranks[q].device == g.ordinal) {
            fail(ErrorCode::kUnsupported, "ranks {} and {} both joined on GPU {}: executor daemon runs one rank per GPU "
                 "(one persistent kernel per GPU runs ops in order); give each rank its own GPU or use executor client",
                 q, r, g.uuid);
          }
        }
      }
    }
    // AllGather's region at least, whatever the budget (the fused GEMMs then refuse every shape, saying why).
    const uint64_t wsBytes = std::max(workspaceBytes_, k::workspaceBytes(comm.nranks));
    for (auto& rr : cc->ranks) {
      rr.workspace = createExportable(rr.device, wsBytes, accessFor(rr.device), &rr.workspaceFd);
      // Every flag starts at 0 and is never reset. The ops' flag arrays sit where libtandem's layout puts them, so
      // zero all of it, once (about 0.2 ms per 512 MiB).
      useDevice(rr.device);
      cudaStream_t s = setupStreams_.at(rr.device);
      checkRuntime(cudaMemsetAsync(reinterpret_cast<void*>(rr.workspace->va), 0, rr.workspace->size, s),
                   "cudaMemsetAsync(workspace)");
      checkRuntime(cudaStreamSynchronize(s), "cudaStreamSynchronize(workspace)");
      rr.controlFd = Fd::memfd(fmt::format("tandem-ctl-c{}", comm.handle), k::kControlBytes);
      rr.control = Mapping::shared(rr.controlFd.get(), k::kControlBytes);
      rr.ctl = reinterpret_cast<k::CommControl*>(rr.control.data());
      if (daemonExecutor_) {
        checkRuntime(cudaHostRegister(rr.ctl, k::kControlBytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
                     "cudaHostRegister(control page)");
        rr.hostRegistered = true;
        void* dev = nullptr;
        checkRuntime(cudaHostGetDevicePointer(&dev, rr.ctl, 0), "cudaHostGetDevicePointer(control page)");
        rr.ctlDevice = static_cast<k::CommControl*>(dev);
      }
    }
    cc->workspaceBytes = cc->ranks[0].workspace->size;
    for (const auto& rr : cc->ranks) cc->workspaceBytes = std::min<uint64_t>(cc->workspaceBytes, rr.workspace->size);
    cc->layout = k::WorkspaceLayout::fit(cc->workspaceBytes, cc->nranks);
    std::lock_guard lock(mutex_);
    comms_.push_back(cc);
    return cc;
  }

  uint64_t commBytesPerRank(const CommResources& res) const override {
    const auto& cc = static_cast<const CudaComm&>(res);
    if (cc.staging) return k::kControlBytes;
    return cc.ranks.empty() ? 0 : cc.ranks[0].workspace->size + k::kControlBytes;
  }

  JoinInfo joinInfo(const CommResources& res, uint32_t rank) const override {
    const auto& cc = static_cast<const CudaComm&>(res);
    JoinInfo info;
    info.executor = cc.staging ? "host" : executor();  // host: the stream writes ready and waits for done
    info.controlFd = cc.ranks[rank].controlFd.get();
    info.controlBytes = k::kControlBytes;
    info.workspaceBytes = cc.staging ? 0 : cc.ranks[rank].workspace->size;
    info.commCtas = config_.cuda.commSms;
    return info;
  }

  CommMapping mapping(const std::shared_ptr<CommResources>& res, uint32_t rank) const override {
    const auto& cc = static_cast<const CudaComm&>(*res);
    if (cc.staging) {
      fail(ErrorCode::kUnsupported, "communicator {} spans nodes: tandemd stages its ops through host memory, and its "
           "ranks have no GPU workspaces to map", cc.handle);
    }
    CommMapping m;
    m.fd = cc.ranks[rank].workspaceFd.get();
    m.bytes = cc.ranks[rank].workspace->size;
    m.deviceUuid = cc.ranks[rank].uuid;
    m.keepAlive = res;
    return m;
  }

  void abortComm(CommResources& res, ErrorCode code, const std::string& reason) override {
    std::lock_guard lock(mutex_);
    abortLocked(static_cast<CudaComm&>(res), code, reason);
  }

  // ---- execution ----

  bool execute(Collective c, std::function<void()> finished) override {
    std::lock_guard lock(mutex_);
    auto cc = std::static_pointer_cast<CudaComm>(c.resources);
    if (cc && cc->staging) return cc->staging->execute(std::move(c), std::move(finished));  // across nodes
    auto g = std::make_shared<Gang>();
    g->arrived = Clock::now();
    g->epoch = c.ops[0].epoch;
    g->kind = c.ops[0].desc.kind;
    g->remaining = static_cast<uint32_t>(c.ops.size());
    g->completed.assign(c.ops.size(), false);
    for (auto& op : c.ops) {
      if (op.epoch != g->epoch && c.errorCode == 0) {
        c.errorCode = statusOf(ErrorCode::kInternal);
        c.error = fmt::format("ranks paired ops of different epochs ({} and {}): the communicator is out of step",
                              g->epoch, op.epoch);
      }
    }
    if (c.errorCode == 0 && daemonExecutor_ && isFusedGemm(g->kind) && cc && !cc->failed) {
      // libtandem checked the same before submitting; the kernels run in tandemd's context here, so a client that did
      // not must not get them to write past a workspace.
      for (uint32_t r = 0; r < c.ops.size() && c.errorCode == 0; ++r) {
        try {
          k::checkFusedGemm(c.ops[r].desc, devicePointers(c.ops[r]), fusedEnv(*cc, r));
        } catch (const Error& e) {
          c.errorCode = statusOf(e.code());
          c.error = fmt::format("rank {}: {}", r, e.what());
        }
      }
    }
    if (c.errorCode == 0 && g->kind != OpKind::kAllGather && g->kind != OpKind::kNop && !isFusedGemm(g->kind)) {
      c.errorCode = statusOf(ErrorCode::kUnsupported);
      c.error = fmt::format("{}: the cuda backend does not run this op yet (it runs ag-gemm, gemm-rs, gemm-ar, allgather "
                            "and barriers); run it on the cpu backend (daemon.backend: cpu)", opKindName(g->kind));
    }
    g->c = std::move(c);
    if (!cc || cc->failed) {
      failGang(*g, cc ? cc->failCode : ErrorCode::kAborted, cc ? cc->reason : "communicator has no GPU resources");
      return true;
    }
    if (g->c.errorCode != 0) {
      g->rejected = true;
      for (uint32_t r = 0; r < g->c.ops.size(); ++r) {
        const PendingOp& op = g->c.ops[r];
        completeRank(*g, r, g->c.errorCode,
                     op.error.empty() ? fmt::format("another rank's descriptor was rejected: {}", g->c.error) : op.error);
      }
    }
    cc->pending.push_back(g);
    release(*cc);
    return true;
  }

  bool poll(std::vector<std::pair<uint64_t, std::string>>& failed) override {
    std::lock_guard lock(mutex_);
    bool worked = false;
    for (auto it = comms_.begin(); it != comms_.end();) {
      auto cc = it->lock();
      if (!cc) {
        it = comms_.erase(it);
        continue;
      }
      ++it;
      if (!cc->failureToReport.empty() && !cc->failureReported) {
        // The backend aborted the communicator itself (release): the engine marks it aborted too.
        cc->failureReported = true;
        failed.emplace_back(cc->handle, cc->failureToReport);
      }
      if (cc->failed) {
        // A kernel or stream that finished just after the abort may have written an older done: keep the lead.
        for (uint32_t r = 0; r < cc->nranks && r < cc->lead.size(); ++r) {
          if (cc->ranks[r].ctl == nullptr) continue;  // a rank on another node
          if (load32(cc->ranks[r].ctl->done.value) != cc->lead[r]) store32(cc->ranks[r].ctl->done.value, cc->lead[r]);
        }
        continue;
      }
      if (cc->staging) {
        worked = cc->staging->poll(cc->handle, failed) || worked;
        continue;
      }
      for (uint32_t r = 0; r < cc->nranks; ++r) {
        RankRes& rr = cc->ranks[r];
        const uint32_t done = load32(rr.ctl->done.value);
        const auto ahead = static_cast<int32_t>(done - static_cast<uint32_t>(rr.doneEpoch));
        if (ahead > 0) rr.doneEpoch += static_cast<uint64_t>(ahead);
        while (!rr.inflight.empty() && rr.inflight.front()->epoch <= rr.doneEpoch) {
          auto g = rr.inflight.front();
          rr.inflight.pop_front();
          if (trace_ && r == 0) trace(*g);
          completeFromKernel(*cc, *g, r);
          worked = true;
        }
        const k::ErrorSlot& e = rr.ctl->error;
        if (!cc->failureReported && load32(e.claimed) == k::kErrorSlotReady) {
          cc->failureReported = true;
          failed.emplace_back(cc->handle, errorText(*cc, r));
        }
      }
      if (!cc->pending.empty()) worked = release(*cc) || worked;
    }
    for (auto& [dev, e] : executors_) e->poll();
    if (daemonExecutor_ && Clock::now() - lastHealthCheck_ > std::chrono::milliseconds(50)) {
      lastHealthCheck_ = Clock::now();
      for (auto& [dev, e] : executors_) {
        std::string why;
        if (!e->healthy(&why)) {
          // ARCHITECTURE.md failure model: a poisoned context (e.g. an MPS client killed mid-kernel) cannot be
          // recovered in-process. Exit non-zero; clients see the socket close and abort their streams.
          spdlog::critical("{}; every session on this GPU is lost. Exiting so that systemd restarts tandemd", why);
          std::_Exit(kExitFailure);
        }
      }
    }
    return worked;
  }

  bool busy() const override {
    std::lock_guard lock(mutex_);
    for (const auto& w : comms_) {
      auto cc = w.lock();
      if (!cc || cc->failed) continue;
      if (cc->staging && cc->staging->waiting()) return true;  // polling the local streams' ready words
      if (!cc->pending.empty()) return true;
      for (const auto& rr : cc->ranks) {
        if (!rr.inflight.empty()) return true;
      }
    }
    return false;
  }

 private:
  // A communicator with ranks on other nodes (cuda_multinode.hpp): a control page per local rank, no workspaces; the
  // ops are staged through host memory. The engine admits it with the client executor only.
  std::shared_ptr<CommResources> setupStaged(const Communicator& comm) {
    auto cc = std::make_shared<CudaComm>();
    cc->handle = comm.handle;
    cc->nranks = comm.nranks;
    cc->ranks.resize(comm.nranks);
    std::vector<HostStaging::LocalRank> local;
    for (uint32_t r = 0; r < comm.nranks; ++r) {
      if (!comm.members[r]) continue;  // on another node
      const GpuInfo& g = gpu(comm.devices[r], "join");
      RankRes& rr = cc->ranks[r];
      rr.device = g.ordinal;
      rr.uuid = g.uuid;
      rr.controlFd = Fd::memfd(fmt::format("tandem-ctl-c{}", comm.handle), k::kControlBytes);
      rr.control = Mapping::shared(rr.controlFd.get(), k::kControlBytes);
      rr.ctl = reinterpret_cast<k::CommControl*>(rr.control.data());
      local.push_back({r, g.ordinal, rr.ctl});
    }
    cc->staging = std::make_unique<HostStaging>(std::move(local));
    std::lock_guard lock(mutex_);
    comms_.push_back(cc);
    return cc;
  }

  // Fails every pending and in-flight op of the communicator and releases every wait of its ranks' streams and
  // kernels, for good (mutex_ held).
  void abortLocked(CudaComm& cc, ErrorCode code, const std::string& reason) {
    if (cc.failed) return;
    cc.failed = true;
    cc.failCode = code;
    cc.reason = reason;
    if (cc.staging) cc.staging->abort(code, reason);  // first: it writes done no more
    for (auto& rr : cc.ranks) {
      if (rr.ctl == nullptr) {  // a rank on another node
        cc.lead.push_back(0);
        continue;
      }
      // Kernels: every wait polls the abort word. Streams: go and done jump far ahead (cyclically) of every
      // epoch this rank can have enqueued, so each WaitValue passes; the kernels behind them skip.
      store64(rr.ctl->abort, k::kAbortValue);
      uint64_t last = rr.decided;
      if (cc.staging) last = std::max(last, cc.staging->lastEpoch());
      for (auto& g : cc.pending) last = std::max(last, g->epoch);
      const auto lead = static_cast<uint32_t>(last + k::kStreamAbortLead);
      store32(rr.ctl->go.value, lead);
      store32(rr.ctl->done.value, lead);
      cc.lead.push_back(lead);
    }
    for (auto& g : cc.pending) failGang(*g, code, reason);
    cc.pending.clear();
    for (uint32_t r = 0; r < cc.nranks; ++r) {
      for (auto& g : cc.ranks[r].inflight) completeRank(*g, r, statusOf(code), reason);
      cc.ranks[r].inflight.clear();
    }
  }

  const GpuInfo& gpu(const std::string& uuid, const char* what) const {
    for (const auto& g : gpus_) {
      if (sameUuid(g.uuid, uuid)) return g;
    }
    std::string list;
    for (const auto& g : gpus_) list += (list.empty() ? "" : ", ") + g.uuid;
    fail(ErrorCode::kInvalidArgument, "{}: GPU '{}' is not one of tandemd's GPUs ({}); run the rank on one of those, "
         "or add it to cuda.devices", what, uuid, list);
  }

  // The GPU holding the memory and every GPU with peer access to it.
  std::vector<int> accessFor(int device) const {
    std::vector<int> out{device};
    for (const auto& g : gpus_) {
      if (g.ordinal != device) continue;
      for (const auto& p : g.peers) {
        if (!p.p2p) continue;
        for (const auto& o : gpus_) {
          if (o.uuid == p.uuid) out.push_back(o.ordinal);
        }
      }
    }
    return out;
  }
  std::vector<int> allDevices() const {
    std::vector<int> out;
    for (const auto& g : gpus_) out.push_back(g.ordinal);
    return out;
  }

  void completeRank(Gang& g, uint32_t r, int32_t status, const std::string& message) {
    if (g.completed[r]) return;
    g.completed[r] = true;
    const PendingOp& op = g.c.ops[r];
    op.channel->complete(op.desc.seq, status, message);
    if (--g.remaining == 0 && status == 0 && g.c.opsCompleted != nullptr) ++*g.c.opsCompleted;
  }

  void failGang(Gang& g, ErrorCode code, const std::string& reason) {
    for (uint32_t r = 0; r < g.c.ops.size(); ++r) completeRank(g, r, statusOf(code), reason);
  }

  std::string errorText(const CudaComm& cc, uint32_t r) const {
    const k::ErrorSlot& e = cc.ranks[r].ctl->error;
    const bool timedOut = e.code == static_cast<uint32_t>(k::WaitError::kTimeout);
    const auto kind = static_cast<OpKind>(e.op);
    // AllGather's flags count chunks; the fused GEMMs' name a flag (chunk or half tile) waited on by one role.
    const std::string where = kind == OpKind::kAllGather
                                  ? fmt::format("chunk {}", e.chunk)
                                  : fmt::format("{} role, flag {}", roleName(e.role), e.chunk);
    return fmt::format("{} on rank {} (GPU {}) {}: op epoch {}, {}: waited for flag >= {:#x}, saw {:#x}{}",
                       opKindName(kind), e.rank, cc.ranks[r].uuid, timedOut ? "timed out" : "was aborted",
                       failedEpoch(e), where, e.expected, e.observed,
                       timedOut ? fmt::format(" (deadline {} ms; TANDEM_OP_TIMEOUT_MS)", timeoutNs_ / 1'000'000)
                                : std::string());
  }

  void completeFromKernel(const CudaComm& cc, Gang& g, uint32_t r) {
    const k::ErrorSlot& e = cc.ranks[r].ctl->error;
    if (load32(e.claimed) == k::kErrorSlotReady && failedEpoch(e) <= g.epoch) {
      const ErrorCode code =
          e.code == static_cast<uint32_t>(k::WaitError::kTimeout) ? ErrorCode::kTimeout : ErrorCode::kAborted;
      return completeRank(g, r, statusOf(code), errorText(cc, r));
    }
    completeRank(g, r, 0, "");
  }

  // Releases pending gangs in epoch order while their conditions hold. Returns whether any was released.
  bool release(CudaComm& cc) {
    bool any = false;
    while (!cc.pending.empty()) {
      auto g = cc.pending.front();
      // Keep every rank's decided-but-unfinished ops within half the verdict ring.
      for (auto& rr : cc.ranks) {
        const uint32_t done = load32(rr.ctl->done.value);
        const auto ahead = static_cast<int32_t>(done - static_cast<uint32_t>(rr.doneEpoch));
        if (ahead > 0) rr.doneEpoch += static_cast<uint64_t>(ahead);
        if (g->epoch > rr.doneEpoch + k::kVerdictRing / 2) return any;
      }
      const bool needReady = !g->rejected && (daemonExecutor_ || needsGang(g->c.ops[0].desc));
      if (needReady) {
        for (auto& rr : cc.ranks) {
          if (!cyclicGeq(load32(rr.ctl->ready.value), g->epoch)) return any;  // gang-ready: every stream got here
        }
      }
      if (!daemonExecutor_ && g->rejected && isFusedGemm(g->kind)) {
        // Unlike AllGather's kernel, the fused GEMMs read no verdict: once go opens they run, and ranks that disagree
        // on the shape would wait on each other's flags until their deadline. Abort the communicator before go opens
        // (the abort word set first, so the kernels unwind at once); every rank already has the rejection's error.
        const std::string reason = fmt::format("{} (op epoch {}) was rejected: {}; a fused GEMM cannot be skipped once "
                                               "its stream reaches it, so the communicator was aborted",
                                               opKindName(g->kind), g->epoch, g->c.error);
        abortLocked(cc, ErrorCode::kAborted, reason);  // clears pending (g with it)
        cc.failureToReport = reason;
        return true;
      }
      if (!daemonExecutor_) {
        const uint64_t verdict = g->rejected ? (g->epoch | k::kVerdictRejected) : g->epoch;
        for (auto& rr : cc.ranks) {
          // release: the verdict before go; the kernel reads it after the stream's WaitValue(go) passed.
          store64(rr.ctl->verdict[g->epoch % k::kVerdictRing], verdict);
          store32(rr.ctl->go.value, static_cast<uint32_t>(g->epoch));
        }
      } else {
        // The streams wait for done, which only the GPU's stream writes (in order): a rejected op goes in as a nop.
        for (auto& rr : cc.ranks) {
          if (executors_.at(rr.device)->freeSlots() == 0) return any;
        }
        if (isFusedGemm(g->kind) && !g->rejected) {
          if (!launchFused(cc, g)) return true;  // the communicator was aborted (pending cleared)
        } else {
          for (uint32_t r = 0; r < cc.nranks; ++r) pushItem(cc, *g, r, g);
        }
      }
      g->released = Clock::now();
      for (uint32_t r = 0; r < cc.nranks; ++r) {
        cc.ranks[r].decided = g->epoch;
        if (!g->rejected) cc.ranks[r].inflight.push_back(g);
      }
      cc.pending.pop_front();
      any = true;
    }
    return any;
  }

  // TANDEM_TRACE_OPS=1: where an op's time goes between its arrival and its rank 0's done, logged every 1000 ops
  // (p50 and p99): waiting for release (client executor: every rank's submission, gangs: every rank's stream at ready;
  // daemon executor: every rank's stream at ready, then a free queue slot), then the GPU until done was seen here.
  void trace(const Gang& g) {
    const Clock::time_point now = Clock::now();
    traceRelease_.push_back(std::chrono::duration<double, std::micro>(g.released - g.arrived).count());
    traceGpu_.push_back(std::chrono::duration<double, std::micro>(now - g.released).count());
    if (traceRelease_.size() < 1000) return;
    const auto pct = [](std::vector<double>& v, double p) {
      std::sort(v.begin(), v.end());
      return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
    };
    spdlog::info("trace: last {} ops (executor {}): arrival -> release p50 {:.2f} us p99 {:.2f} us; release -> done "
                 "seen p50 {:.2f} us p99 {:.2f} us", traceRelease_.size(), executor(), pct(traceRelease_, 0.5),
                 pct(traceRelease_, 0.99), pct(traceGpu_, 0.5), pct(traceGpu_, 0.99));
    traceRelease_.clear();
    traceGpu_.clear();
  }

  // Each slot's address in tandemd's context.
  k::DevicePointers devicePointers(const PendingOp& op) const {
    k::DevicePointers ptrs{};
    for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
      if (op.buffers[s]) ptrs[s] = resolve(*op.buffers[s], op.desc.bufs[s].offset);
    }
    return ptrs;
  }

  // Rank r's communicator as the daemon executor's kernels see it: tandemd's own mappings.
  k::FusedEnv fusedEnv(const CudaComm& cc, uint32_t r) const {
    k::FusedEnv env;
    env.rank = r;
    env.nranks = cc.nranks;
    env.timeoutNs = timeoutNs_;
    env.commSms = config_.cuda.commSms;
    env.ctl = cc.ranks[r].ctlDevice;
    env.workspaceBytes = cc.workspaceBytes;
    env.layout = cc.layout;
    for (uint32_t q = 0; q < cc.nranks; ++q) env.workspaces[q] = reinterpret_cast<char*>(cc.ranks[q].workspace->va);
    return env;
  }

  // Executor daemon, a fused GEMM released to every rank: on each rank's GPU the persistent kernel yields, the op's
  // kernels follow on the executor's stream, then the stream writes done. The ranks' kernels wait on each other's
  // flags, so every rank's launch goes in here, in one pass, in the same order on every GPU as every other item.
  // False if CUDA refused a launch: the communicator is aborted (its streams released) and the error reported.
  bool launchFused(CudaComm& cc, const std::shared_ptr<Gang>& g) {
    uint32_t r = 0;
    try {
      std::vector<k::DevicePointers> ptrs;
      for (const PendingOp& op : g->c.ops) ptrs.push_back(devicePointers(op));
      for (; r < cc.nranks; ++r) {
        RankRes& rr = cc.ranks[r];
        const OpDescriptor& desc = g->c.ops[r].desc;
        k::FusedEnv env = fusedEnv(cc, r);
        // Every rank's C is mapped here: the reductions write peers' rows straight into them.
        for (uint32_t q = 0; q < cc.nranks; ++q) env.outputs[q] = ptrs[q][slot::kC];
        std::string plan;
        executors_.at(rr.device)->runExclusive(
            [&](cudaStream_t s) {
              plan = k::launchFusedGemm(desc, ptrs[r], g->epoch, env, s);
              const CUresult w = k::driver().streamWriteValue32(
                  s, reinterpret_cast<CUdeviceptr>(&rr.ctlDevice->done.value), static_cast<uint32_t>(g->epoch),
                  CU_STREAM_WRITE_VALUE_DEFAULT);
              if (w != CUDA_SUCCESS) fail(ErrorCode::kCuda, "cuStreamWriteValue32(done): {}", k::driverErrorName(w));
            },
            g);
        logPlanOnce(desc, plan);
      }
    } catch (const std::exception& e) {
      const std::string reason = fmt::format("{} (op epoch {}) could not be launched on rank {} (GPU {}): {}",
                                             opKindName(g->kind), g->epoch, r, cc.ranks[r].uuid, e.what());
      spdlog::error("communicator {:#x}: {}", cc.handle, reason);
      abortLocked(cc, ErrorCode::kCuda, reason);
      cc.failureToReport = reason;
      return false;
    }
    return true;
  }

  // Which plan a fused GEMM ran, once per (op, shape), at debug level.
  void logPlanOnce(const OpDescriptor& d, const std::string& plan) {
    if (!spdlog::should_log(spdlog::level::debug)) return;  // no formatting on every op otherwise
    const std::string shape = fmt::format("{} {} m={} n={} k={} on {} ranks", opKindName(d.kind), dtypeName(d.dtype),
                                          d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK], d.nranks);
    if (plansLogged_.insert(shape).second) spdlog::debug("rank {}: {}: plan {}", d.rank, shape, plan);
  }

  void pushItem(CudaComm& cc, Gang& g, uint32_t r, const std::shared_ptr<Gang>& keepAlive) {
    RankRes& rr = cc.ranks[r];
    k::WorkItem item{};
    item.epoch = g.epoch;
    item.doneWord = &rr.ctlDevice->done.value;
    item.ag.ctl = rr.ctlDevice;  // the kernel skips the done write once the communicator was aborted
    if (g.kind == OpKind::kAllGather && !g.rejected) {
      const PendingOp& op = g.c.ops[r];
      item.kind = k::WorkKind::kAllGather;
      k::AllGatherParams& p = item.ag;
      p.bytes = op.desc.dims[dim::kBytes];
      p.send = resolve(*op.buffers[slot::kSend], op.desc.bufs[slot::kSend].offset);
      p.recv = resolve(*op.buffers[slot::kRecv], op.desc.bufs[slot::kRecv].offset);
      p.epoch = g.epoch;
      p.timeoutNs = timeoutNs_;
      for (uint32_t q = 0; q < cc.nranks; ++q) p.workspaces[q] = reinterpret_cast<void*>(cc.ranks[q].workspace->va);
      p.ctl = rr.ctlDevice;
      p.rank = r;
      p.nranks = cc.nranks;
      const k::AgTuning t = k::allgatherTuning(p.bytes, executorCtas_);
      p.chunkBytes = t.chunkBytes;
      p.numCtas = executorCtas_;
      p.mode = t.mode;
      p.checkVerdict = 0;
      // A lingering lone CTA runs only small items: measured, one CTA took 92 us for a 512 KiB LL AllGather against
      // 18 us for 32, while a relaunch costs a few us.
      item.needsGrid = p.bytes > (64u << 10) ? 1 : 0;
    } else {
      item.kind = k::WorkKind::kNop;
    }
    executors_.at(rr.device)->push(item, keepAlive);
  }

  const DaemonConfig& config_;
  std::vector<GpuInfo> gpus_;
  bool daemonExecutor_;
  uint64_t timeoutNs_;
  // Per-rank workspace of a communicator (cuda.workspace_bytes): AllGather's slots, and the fused GEMMs' flags, staging
  // and gathered rows (libtandem lays them out, client/src/cuda_client.hpp: WorkspaceLayout). An op whose shape needs
  // more fails in the client with the bytes it needs.
  uint64_t workspaceBytes_;
  uint32_t executorCtas_ = 32;
  std::map<int, cudaStream_t> setupStreams_;
  std::map<int, std::unique_ptr<GpuExecutor>> executors_;
  mutable std::mutex mutex_;
  std::vector<std::weak_ptr<CudaComm>> comms_;
  Clock::time_point lastHealthCheck_ = Clock::now();
  std::set<std::string> plansLogged_;
  const bool trace_ = std::getenv("TANDEM_TRACE_OPS") != nullptr && *std::getenv("TANDEM_TRACE_OPS") == '1';
  std::vector<double> traceRelease_, traceGpu_;
};

}  // namespace

void prepareEnvironment(const DaemonConfig& config) {
  if (config.daemon.executor == ExecutorKind::kDaemon ||
      (config.daemon.executor == ExecutorKind::kAuto && mpsControlReachable())) {
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  }
}

int visibleDeviceCount(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why != nullptr) *why = fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
    cudaGetLastError();
    return 0;
  }
  if (n == 0 && why != nullptr) *why = "no CUDA device is visible";
  return n;
}

std::unique_ptr<Backend> makeCudaBackend(const DaemonConfig& config) {
  std::string pipeDir;
  const bool mpsPipe = mpsControlReachable(&pipeDir);
  ExecutorKind executor = config.daemon.executor;
  if (executor == ExecutorKind::kAuto) executor = mpsPipe ? ExecutorKind::kDaemon : ExecutorKind::kClient;
  prepareEnvironment(config);  // no-op if main already did it before touching CUDA
  std::vector<GpuInfo> gpus = discoverGpus(config.cuda.devices);
  if (executor == ExecutorKind::kDaemon) {
    std::string without;
    for (const auto& g : gpus) {
      if (!g.mps) without += (without.empty() ? "" : ", ") + g.uuid;
    }
    if (!without.empty()) {
      const std::string how = fmt::format(
          "start MPS before tandemd and its clients, as the same user: export CUDA_MPS_PIPE_DIRECTORY={} "
          "CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; nvidia-cuda-mps-control -d (stop it with: echo quit | "
          "nvidia-cuda-mps-control)", pipeDir);
      if (config.daemon.executor == ExecutorKind::kDaemon) {
        fail(ErrorCode::kUnavailable, "daemon.executor is daemon, which needs CUDA MPS, but {} {} not served by MPS{}. "
             "To fix: {}; or set daemon.executor: client", without, gpus.size() > 1 ? "are" : "is",
             mpsPipe ? fmt::format(" (an MPS pipe exists in {}, but this process is not its client)", pipeDir) : "",
             how);
      }
      spdlog::warn("daemon.executor is auto and an MPS pipe exists in {}, but {} not served by MPS: using the client "
                   "executor", pipeDir, without);
      executor = ExecutorKind::kClient;
    }
  }
  for (const auto& g : gpus) {
    std::string peers;
    for (const auto& p : g.peers) {
      peers += fmt::format("{}{} ({} NVLink, p2p {})", peers.empty() ? "" : ", ", p.uuid, p.nvlinks, p.p2p ? "on" : "off");
    }
    spdlog::info("GPU {} {}: {} SMs, {:.1f} GiB, cc {}.{}, MPS {}; peers: {}", g.uuid, g.name, g.sms,
                 static_cast<double>(g.memoryBytes) / (1u << 30), g.ccMajor, g.ccMinor, g.mps ? "yes" : "no",
                 peers.empty() ? "none" : peers);
  }
  return std::make_unique<CudaBackend>(config, std::move(gpus), executor == ExecutorKind::kDaemon);
}

}  // namespace tandem::daemon::cuda
