#include "cuda/cuda_backend.hpp"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include "cuda/client_gate.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_multinode.hpp"
#include "cuda/daemon_executor.hpp"
#include "cuda/gpu.hpp"
#include "cuda/node_comm.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/ranked_mutex.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/executor.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;
using k::Executor;

uint64_t opTimeoutNs() {
  const char* v = std::getenv("TANDEM_OP_TIMEOUT_MS");
  const uint64_t ms = (v != nullptr && *v != '\0') ? std::strtoull(v, nullptr, 10) : 60000;
  return (ms == 0 ? 60000 : ms) * 1'000'000ull;
}

class CudaBackend final : public Backend {
 public:
  // `executor`: the strategy of every communicator whose ranks are all on this node (kClient or kDaemon).
  CudaBackend(const DaemonConfig& config, std::vector<GpuInfo> gpus, Executor executor)
      : config_(config), gpus_(std::move(gpus)), executor_(executor),
        workspaceBytes_(config.cuda.workspaceBytes) {
    ctx_.timeoutNs = opTimeoutNs();
    ctx_.commSms = config_.cuda.commSms;
    for (const auto& g : gpus_) setupStreams_[g.ordinal] = k::CudaStream::create(g.ordinal, "communicator setup");
    if (executor_ == Executor::kDaemon) {
      executors_ = std::make_unique<DaemonExecutor>(gpus_, config_.cuda.commSms,
                                                    uint64_t{config_.cuda.daemonLingerMs} * 1'000'000ull);
    }
  }

  ~CudaBackend() override { stop(); }

  const char* name() const override { return "cuda"; }
  const char* executor() const override { return k::executorName(executor_); }
  OpSet ops(const CommResources* comm) const override {
    return comm != nullptr ? static_cast<const CudaComm*>(comm)->ops() : k::executorOps(executor_);
  }
  std::vector<GpuInfo> gpus() const override { return gpus_; }
  std::shared_ptr<transport::DeviceCopier> deviceCopier() override { return copiers_; }
  void attachPlans(std::shared_ptr<PlanTable> plans) override {
    ctx_.plans = std::move(plans);
    ctx_.gpuModel = planGpuModel(name(), gpus_);
    ctx_.autotune = config_.plans.autotune == PlanAutotune::kOnFirstUse;
    ctx_.autotuneRuns = config_.plans.autotuneRuns;
  }

  void stop() override {
    {
      // Kernels still waiting on a peer leave at once instead of at their deadline.
      std::lock_guard lock(mutex_);
      for (auto& w : comms_) {
        if (auto cc = w.lock()) cc->abortKernels();
      }
    }
    if (executors_) executors_->stop();
    hub_->shutdown();  // the GPU proxies stop posting before the cluster's transport goes (main stops it next)
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

  std::byte* resolve(const Buffer& buffer, uint64_t offset) const override { return resolveDevice(buffer, offset); }

  // ---- communicators ----

  void checkJoin(const std::string& deviceUuid) override {
    if (deviceUuid.empty()) {
      fail(ErrorCode::kInvalidArgument, "tandemd runs the cuda backend and needs each rank's GPU: call cudaSetDevice "
           "before tandem_comm_init (libtandem sends the current device's UUID); a libtandem built without CUDA "
           "cannot join");
    }
    gpu(deviceUuid, "join");
  }

  // The communicator's strategy is chosen here, once: host-staged when its ranks span nodes, else the backend's.
  std::shared_ptr<CommResources> setupComm(const Communicator& comm) override {
    std::shared_ptr<CudaComm> cc = comm.spansNodes() ? setupStaged(comm) : setupNode(comm);
    std::lock_guard lock(mutex_);
    comms_.push_back(cc);
    return cc;
  }

  uint64_t commBytesPerRank(const CommResources& res) const override {
    return static_cast<const CudaComm&>(res).bytesPerRank();
  }

  JoinInfo joinInfo(const CommResources& res, uint32_t rank) const override {
    return static_cast<const CudaComm&>(res).joinInfo(rank, config_.cuda.commSms);
  }

  CommMapping mapping(const std::shared_ptr<CommResources>& res, uint32_t rank) const override {
    return static_cast<const CudaComm&>(*res).mapping(res, rank);
  }

  void abortComm(CommResources& res, ErrorCode code, const std::string& reason) override {
    std::lock_guard lock(mutex_);
    static_cast<CudaComm&>(res).abort(code, reason);
  }

  void leaveComm(CommResources& res, uint32_t rank, ErrorCode code, const std::string& reason) override {
    std::lock_guard lock(mutex_);
    static_cast<CudaComm&>(res).leave(rank, code, reason);
  }

  // ---- execution ----

  bool execute(Collective c, std::function<void()> finished) override {
    std::lock_guard lock(mutex_);
    auto cc = std::static_pointer_cast<CudaComm>(c.resources);
    if (!cc) {
      for (const PendingOp& op : c.ops) {
        if (op.channel) {
          op.channel->complete(op.desc.seq, statusOf(ErrorCode::kAborted), "communicator has no GPU resources");
        }
      }
      return true;
    }
    return cc->execute(std::move(c), std::move(finished));
  }

  // Throws FatalBackendError when a GPU's context died (executor daemon: its persistent kernel failed).
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
      worked = cc->poll(failed) || worked;
    }
    if (executors_) executors_->poll();
    return worked;
  }

  bool busy() const override {
    std::lock_guard lock(mutex_);
    for (const auto& w : comms_) {
      if (auto cc = w.lock(); cc && cc->busy()) return true;
    }
    return false;
  }

 private:
  // A communicator whose ranks are all on this node: every rank's workspace (zeroed) and control page, run by the
  // backend's strategy.
  std::shared_ptr<CudaComm> setupNode(const Communicator& comm) {
    if (comm.nranks > k::kMaxLocalRanks) {
      fail(ErrorCode::kUnsupported, "the cuda backend runs communicators of up to {} GPUs of one node ({} ranks asked); "
           "use fewer ranks", k::kMaxLocalRanks, comm.nranks);
    }
    std::vector<NodeComm::Rank> ranks(comm.nranks);
    for (uint32_t r = 0; r < comm.nranks; ++r) {
      const GpuInfo& g = gpu(comm.devices[r], "join");
      ranks[r].device = g.ordinal;
      ranks[r].uuid = g.uuid;
    }
    if (executor_ == Executor::kDaemon) PersistentComm::checkPlacement(ranks);
    // cuda.workspace_bytes is the starting size: a rank that declared more at its join (tandem_comm_config_t) gets it
    // for every rank (the quota was checked at the join). AllGather's region at least, whatever the budget (the fused
    // GEMMs then refuse every shape, saying why).
    const uint64_t wsBytes = std::max({workspaceBytes_, comm.workspaceBytes, k::workspaceBytes(comm.nranks)});
    std::vector<k::ControlPage> pages;
    for (auto& rr : ranks) {
      rr.workspace = createExportable(rr.device, wsBytes, accessFor(rr.device), &rr.workspaceFd);
      // Every flag starts at 0 and is never reset. The ops' flag arrays sit where libtandem's layout puts them, so
      // zero all of it, once (about 0.2 ms per 512 MiB).
      k::CudaDeviceGuard guard(rr.device);
      cudaStream_t s = setupStreams_.at(rr.device).get();
      k::checkCuda(cudaMemsetAsync(reinterpret_cast<void*>(rr.workspace->va), 0, rr.workspace->size, s),
                   "cudaMemsetAsync(workspace) on GPU {}", rr.uuid);
      k::checkCuda(cudaStreamSynchronize(s), "cudaStreamSynchronize(workspace) on GPU {}", rr.uuid);
      pages.push_back(k::ControlPage::create(fmt::format("tandem-ctl-c{}", comm.handle)));
    }
    if (executor_ == Executor::kDaemon) {
      return std::make_shared<PersistentComm>(comm.handle, std::move(ranks), std::move(pages), ctx_, *executors_);
    }
    return std::make_shared<ClientGateComm>(comm.handle, std::move(ranks), std::move(pages), ctx_);
  }

  // A communicator with ranks on other nodes (cuda_multinode.hpp): a control page and a tandemd-private workspace of
  // cuda.workspace_bytes per local rank; tandemd runs the ops, with either executor.
  std::shared_ptr<CudaComm> setupStaged(const Communicator& comm) {
    std::vector<k::ControlPage> pages(comm.nranks);
    std::vector<int> devices(comm.nranks, -1);
    for (uint32_t r = 0; r < comm.nranks; ++r) {
      if (!comm.members[r]) continue;  // on another node
      devices[r] = gpu(comm.devices[r], "join").ordinal;
      pages[r] = k::ControlPage::create(fmt::format("tandem-ctl-c{}", comm.handle));
    }
    return std::make_shared<HostStagedComm>(comm.handle, std::move(pages), devices, workspaceBytes_, hub_);
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

  const DaemonConfig& config_;
  std::vector<GpuInfo> gpus_;
  Executor executor_;
  // Per-rank workspace of a communicator (cuda.workspace_bytes): AllGather's slots, and the fused GEMMs' flags, staging
  // and gathered rows (libtandem lays them out the same: kernels::WorkspaceLayout). An op whose shape needs more fails
  // in the client with the bytes it needs.
  uint64_t workspaceBytes_;
  CommContext ctx_;
  // Declared in creation order (destroyed in reverse): a constructor that throws part way releases what it made.
  std::map<int, k::CudaStream> setupStreams_;
  std::unique_ptr<DaemonExecutor> executors_;  // executor daemon only: a persistent kernel per GPU
  // The GPU-issued exchange of communicators that span nodes (gpu_exchange.hpp): the tcp transport's copier between
  // GPU and host memory (the cluster keeps it as long as its transport), and the per-GPU proxies, made at first use.
  std::shared_ptr<GpuCopiers> copiers_ = std::make_shared<GpuCopiers>();
  std::shared_ptr<GpuExchangeHub> hub_ = std::make_shared<GpuExchangeHub>(copiers_);
  mutable RankedMutex mutex_{LockRank::kBackend, "CudaBackend"};
  std::vector<std::weak_ptr<CudaComm>> comms_;
};

}  // namespace

void prepareEnvironment(const DaemonConfig& config) {
  // The GPU exchange too: its kernels spin on a peer's flags while tandemd launches the GEMMs and sums of the same op,
  // and a module loaded lazily then would wait for them (preload.hpp).
  const bool gpuExchange = isMultiNode(config.cluster) && config.cluster.gpuExchange == GpuExchange::kOn;
  if (gpuExchange || config.daemon.executor == ExecutorKind::kDaemon ||
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
  // CUDA handles released in destructors report failures here rather than throwing.
  k::setCudaReleaseLog([](const std::string& message) { spdlog::warn("{}", message); });
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
  return std::make_unique<CudaBackend>(config, std::move(gpus),
                                       executor == ExecutorKind::kDaemon ? Executor::kDaemon : Executor::kClient);
}

}  // namespace tandem::daemon::cuda
