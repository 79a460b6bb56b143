#include "cuda_client.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <thread>

#include "tandem/common/error.hpp"
#include "tandem/common/gpu_uuid.hpp"
#include "tandem/common/graph_capture.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gpu_ops.hpp"
#include "tandem/kernels/moe_ops.hpp"
#include "tandem/kernels/op_entry.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::client::gpu {
namespace {

namespace k = tandem::kernels;
using k::checkCuda;

uint64_t opTimeoutNs() {
  const char* v = std::getenv("TANDEM_OP_TIMEOUT_MS");
  const uint64_t ms = (v != nullptr && *v != '\0') ? std::strtoull(v, nullptr, 10) : 60000;
  return (ms == 0 ? 60000 : ms) * 1'000'000ull;
}

CUdeviceptr devptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

// Which plan ran, once per (op, shape) and process, on stderr when TANDEM_LOG=debug (libtandem has no logger and must
// not write to an application's stderr otherwise).
void logPlanOnce(const OpDescriptor& d, const std::string& plan) {
  static const bool enabled = [] {
    const char* v = std::getenv("TANDEM_LOG");
    return v != nullptr && std::strcmp(v, "debug") == 0;
  }();
  if (!enabled) return;
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::string shape = planShapeName(d);
  std::lock_guard lock(mu);
  if (seen.insert(shape).second) std::fprintf(stderr, "tandem: rank %u: %s: plan %s\n", d.rank, shape.c_str(), plan.c_str());
}

}  // namespace

int currentDevice() {
  int d = 0;
  checkCuda(cudaGetDevice(&d), "cudaGetDevice (is a CUDA device visible to this process?)");
  return d;
}

std::string deviceUuid(int ordinal) {
  cudaDeviceProp prop{};
  checkCuda(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties({})", ordinal);
  return formatGpuUuid(prop.uuid.bytes);
}

// ---- cuMem import -----------------------------------------------------------------------------------------

std::unique_ptr<DeviceMapping> DeviceMapping::import(const Fd& fd, uint64_t bytes, int accessDevice) {
  const auto& d = k::driver();
  k::CudaDeviceGuard guard(accessDevice);
  checkCuda(cudaFree(nullptr), "CUDA context initialisation");
  CUmemGenericAllocationHandle h = 0;
  checkCuda(d.memImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle (tandemd's allocation)");
  std::unique_ptr<DeviceMapping> m(new DeviceMapping());
  m->size_ = bytes;
  CUdeviceptr va = 0;
  CUresult r = d.memAddressReserve(&va, bytes, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = d.memMap(va, bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) d.memAddressFree(va, bytes);
  }
  d.memRelease(h);  // the mapping holds the allocation from here on
  checkCuda(r, "cuMemMap (tandemd's allocation)");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = accessDevice;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.memSetAccess(va, bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.memUnmap(va, bytes);
    d.memAddressFree(va, bytes);
    checkCuda(r, "cuMemSetAccess (is peer access possible between this GPU and the memory's?)");
  }
  m->va_ = va;
  return m;
}

DeviceMapping::~DeviceMapping() {
  if (va_ == 0) return;
  const auto& d = k::driver();
  d.memUnmap(va_, size_);
  d.memAddressFree(va_, size_);
}

// ---- registration -----------------------------------------------------------------------------------------

namespace {

// Registration may run while a CUDA graph is being captured: an output allocated inside the capture (the graph's
// private pool, as torch.compile's CUDA graphs and make_graphed_callables allocate) is registered then. Its queries and
// the IPC handle record nothing on any stream, but a global-mode capture (PyTorch's default) forbids "potentially
// unsafe" calls on every thread. So this thread asks for the relaxed mode for those calls and gives the caller's back.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;  // the caller's mode while this lives
};

}  // namespace

RegisterDescription describeForRegister(void* ptr, uint64_t bytes, int fd, uint64_t fdOffset) {
  const RelaxedCaptureMode relaxed;
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    fail(ErrorCode::kInvalidArgument, "tandem_register: {} is not GPU memory (tandemd runs the cuda backend); pass "
         "memory from cudaMalloc, or from cuMemCreate with its POSIX fd", ptr);
  }
  RegisterDescription out;
  out.deviceUuid = deviceUuid(attr.device);
  if (fd >= 0) {
    out.kind = 2;
    out.offset = fdOffset;
    return out;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  checkCuda(k::driver().memGetAddressRange(&base, &size, devptr(ptr)), "cuMemGetAddressRange");
  const uint64_t offset = devptr(ptr) - base;
  if (bytes > size - offset) {
    fail(ErrorCode::kInvalidArgument, "tandem_register: [{}, +{}) runs past the end of its {}-byte allocation", ptr,
         bytes, size);
  }
  cudaIpcMemHandle_t h;
  const cudaError_t ie = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (ie != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorCode::kInvalidArgument, "tandem_register: no CUDA IPC handle for {} ({}). cuMem (VMM) memory has none: "
         "create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and pass that fd and the offset of ptr in it",
         ptr, cudaGetErrorString(ie));
  }
  out.kind = 1;
  out.ipcHandle.assign(reinterpret_cast<const char*>(&h), sizeof h);
  out.offset = offset;
  return out;
}

// ---- communicators: one strategy per executor -----------------------------------------------------------------

namespace {

// The ops a strategy runs, for a message: "ag-gemm, gemm-rs, gemm-ar, allgather and barriers".
std::string opList(const OpSet& ops) {
  std::vector<std::string> names;
  for (uint16_t i = 1; i < kOpKindCount; ++i) {
    const auto kind = static_cast<OpKind>(i);
    if (ops.contains(kind)) names.emplace_back(kind == OpKind::kNop ? "barriers" : std::string(opKindName(kind)));
  }
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return out.empty() ? "nothing" : out;
}

// The fused GEMMs' view of this rank's communicator, as this process maps it.
k::FusedEnv fusedEnvOf(uint32_t rank, uint32_t nranks, uint32_t commSms,
                       const std::vector<std::unique_ptr<DeviceMapping>>& workspaces, k::CommControl* ctlDevice) {
  k::FusedEnv env;
  env.rank = rank;
  env.nranks = nranks;
  env.timeoutNs = opTimeoutNs();
  env.commSms = commSms;
  env.workspaceBytes = workspaces.empty() ? 0 : workspaces[0]->size();
  for (uint32_t r = 0; r < workspaces.size() && r < env.workspaces.size(); ++r) {
    env.workspaces[r] = static_cast<char*>(workspaces[r]->ptr());
    env.workspaceBytes = std::min(env.workspaceBytes, workspaces[r]->size());
  }
  env.layout = k::WorkspaceLayout::fit(env.workspaceBytes, nranks);
  env.ctl = ctlDevice;
  return env;
}

void writeWord(CUstream s, k::StreamWord& w, uint64_t epoch, const char* what) {
  checkCuda(k::driver().streamWriteValue32(s, devptr(&w.value), static_cast<uint32_t>(epoch),
                                           CU_STREAM_WRITE_VALUE_DEFAULT),
            "{}", what);
}
void waitWord(CUstream s, k::StreamWord& w, uint64_t epoch, const char* what) {
  checkCuda(k::driver().streamWaitValue32(s, devptr(&w.value), static_cast<uint32_t>(epoch), CU_STREAM_WAIT_VALUE_GEQ),
            "{}", what);
}

// tandemd runs the op once this rank's stream got here (ready), then writes done: the stream waits for it.
void enqueueReadyThenWaitDone(k::CommControl* ctlDev, uint64_t e, CUstream s) {
  writeWord(s, ctlDev->ready, e, "cuStreamWriteValue32(ready)");
  waitWord(s, ctlDev->done, e, "cuStreamWaitValue32(done)");
}

}  // namespace

class CommStrategy {
 public:
  virtual ~CommStrategy() = default;
  virtual void check(const OpDescriptor& d, const DevicePointers& ptrs) const = 0;
  // On the communicator's device (current already).
  // rankRows: every rank's rows of the op where its entry needs them (GpuOp::needsRankRows, executor client; empty
  // when the communicator was aborted before tandemd published them), else empty.
  virtual void enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, CUstream s,
                       std::span<const uint64_t> rankRows) = 0;
  // A multi-rank op captured into a CUDA graph, after `epoch` eager ops (CommGpu::enqueueCaptured). Only the client
  // executor gets here: captureRefusal refuses the others before.
  virtual void enqueueCaptured(const OpDescriptor& d, const DevicePointers& /*ptrs*/, uint64_t /*epoch*/,
                               CUstream /*s*/) {
    fail(ErrorCode::kInternal, "{}: this executor cannot replay ops from a CUDA graph", opKindName(d.kind));
  }

  // A plan for the fused ops this rank launches itself: the plan table's (executor client, from the join) or a
  // trial plan of tandemctl tune / advise; kAuto drops it.
  void setPlan(const PlanKey& key, const PlanChoice& plan) {
    if (plan.kind == PlanKind::kAuto) {
      plans_.erase(key);
    } else {
      plans_[key] = plan;
    }
  }

 protected:
  // `device`'s model, as plan keys name it (tandemd's GPU discovery reads the same name).
  static std::string gpuModelOf(int device) {
    cudaDeviceProp prop{};
    checkCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties({})", device);
    return prop.name;
  }
  // The plan for `d` (the same on every rank: each got the same entries, and every rank's key is alike).
  PlanChoice planOf(const OpDescriptor& d, const std::string& gpuModel, const char* executor) const {
    if (plans_.empty() || !plannedOp(d.kind)) return {};
    const auto it = plans_.find(planKeyOf(d, gpuModel, executor));
    return it == plans_.end() ? PlanChoice{} : it->second;
  }

 private:
  std::map<PlanKey, PlanChoice> plans_;
};

namespace {

// Refuses what neither single-node strategy runs, then checks the op's kernels' shape, alignment and workspace rules
// (its entry in gpu_ops.hpp).
void checkOnNode(k::Executor executor, const OpDescriptor& d, const DevicePointers& ptrs, const k::FusedEnv& env,
                 const PlanChoice& plan = {}) {
  const OpSet ops = k::executorOps(executor);
  if (!ops.contains(d.kind)) fail(ErrorCode::kUnsupported, "{}", k::executorRefusal(executor, d.kind));
  if (const auto check = k::gpuOp(d.kind).check) check(d, ptrs, env, plan);
}

// executor client: the kernels go into the caller's stream, behind tandemd's gate.
class ClientGateStrategy final : public CommStrategy {
 public:
  ClientGateStrategy(int device, uint32_t rank, uint32_t nranks, uint32_t maxCtas,
                     std::vector<std::unique_ptr<DeviceMapping>> workspaces, k::CommControl* ctlDev)
      : nranks_(nranks), workspaces_(std::move(workspaces)), ctlDev_(ctlDev),
        env_(fusedEnvOf(rank, nranks, maxCtas, workspaces_, ctlDev)), gpuModel_(gpuModelOf(device)) {
    // Before any op: a kernel loaded lazily behind one of our own stream waits would hang (preload.hpp). Only this
    // strategy launches kernels from libtandem.
    try {
      k::preloadRuntimeKernels(device);
      k::preloadGpuOps(device);
    } catch (const std::exception& e) {
      fail(ErrorCode::kCuda, "communicator init on device {}: {}", device, e.what());
    }
  }

  void check(const OpDescriptor& d, const DevicePointers& ptrs) const override {
    checkOnNode(k::Executor::kClient, d, ptrs, env_, planOf(d, gpuModel_, "client"));
    if (const auto checkClient = k::gpuOp(d.kind).checkClient) checkClient(d, ptrs, env_);
  }

  // tandemd opens go once every rank submitted the op (for a gang, once every rank's stream reached it and wrote
  // ready); the kernels run; done tells tandemd the op finished on this rank.
  void enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, CUstream s,
               std::span<const uint64_t> rankRows) override {
    const k::GpuOp& op = k::gpuOp(d.kind);
    // The communicator was aborted before tandemd published the rows (a rejected op, a lost peer): the op's status
    // says why, the stream passes its words (they jumped ahead), and no kernel runs.
    const bool skipKernels = op.needsRankRows && nranks_ > 1 && rankRows.empty();
    if (op.launch == nullptr && nranks_ == 1) {
      // No kernel and nothing to meet (a lone barrier): the stream need not wait for tandemd's go (tandemd still
      // validates and completes it).
      writeWord(s, ctlDev_->done, e, "cuStreamWriteValue32(done)");
      return;
    }
    if (k::needsGang(d)) writeWord(s, ctlDev_->ready, e, "cuStreamWriteValue32(ready)");
    // AllGather's kernel waits for tandemd's verdict itself (device/allgather.cuh, opGate): one stream memop less.
    if (!op.kernelWaitsForGo) waitWord(s, ctlDev_->go, e, "cuStreamWaitValue32(go)");
    const auto stream = reinterpret_cast<cudaStream_t>(s);
    try {
      // Device-epoch mode (a graph was captured): the op takes its flags' epoch from device memory, as a replayed op
      // does, so the two stay in step. Its fingerprint is compared too: a peer replaying a graph where this rank runs
      // an eager op would otherwise meet it there (and a collective tandemd rejects now fails the communicator).
      if (env_.epochWord != nullptr && op.launch != nullptr && !skipKernels) {
        enterOp(d, e, collectiveFingerprint(d, rankRows), stream);
      }
      if (!rankRows.empty()) warmRows_[collectiveFingerprint(d)].assign(rankRows.begin(), rankRows.end());
      if (op.launch != nullptr && !skipKernels) {
        // The kernels read tandemd's verdict where they can (AllGather, MoE: a rejected op does nothing); the fused
        // GEMMs and ring attention cannot, so tandemd aborts the communicator instead (client_gate.cpp).
        const PlanChoice plan = op.fusedGemm ? planOf(d, gpuModel_, "client") : PlanChoice{};
        k::GpuLaunch launch{d, ptrs, e, env_, stream, plan, true};
        launch.rankRows = rankRows;
        const std::string ran = op.launch(launch);
        if (!ran.empty()) logPlanOnce(d, ran);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& ex) {  // the launchers throw std::runtime_error
      fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
    }
    writeWord(s, ctlDev_->done, e, "cuStreamWriteValue32(done)");
  }

  // No stream word: a replay has no tandemd step (go, verdict, done). The op's entry takes a fresh epoch from device
  // memory at every replay and meets the peers there; the kernels read it (env_.epochWord). The kernels' own epoch
  // (the host's, fixed at capture) only picks gemm-rs/ar's staging parity, which the entry's barrier makes moot.
  void enqueueCaptured(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, CUstream s) override {
    const k::GpuOp& op = k::gpuOp(d.kind);
    const auto stream = reinterpret_cast<cudaStream_t>(s);
    // Before anything changes: a refusal here breaks only the capture.
    const std::span<const uint64_t> rankRows = op.needsRankRows ? warmRowsOf(d) : std::span<const uint64_t>();
    if (env_.epochWord == nullptr) {
      // From this op on, eager ops enter too (enqueue): every rank switches at the same op, since every rank
      // captures at the same place in its sequence. The words are zero until then; the floor lifts the first device
      // epoch past every host epoch used before.
      env_.epochWord = &k::opEntryWords(env_.workspaces[env_.rank])->epoch;
    }
    try {
      enterOp(d, epoch + 1, collectiveFingerprint(d, rankRows), stream);
      if (op.launch != nullptr) {
        const PlanChoice plan = op.fusedGemm ? planOf(d, gpuModel_, "client") : PlanChoice{};
        k::GpuLaunch launch{d, ptrs, epoch + 1, env_, stream, plan, false, true};
        launch.rankRows = rankRows;
        const std::string ran = op.launch(launch);
        if (!ran.empty()) logPlanOnce(d, ran + " (captured into a CUDA graph)");
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& ex) {
      fail(ErrorCode::kCuda, "{} (captured into a CUDA graph): {}", opKindName(d.kind), ex.what());
    }
  }

 private:
  // The op's entry (op_entry.hpp): epoch from device memory, at least `floor`; a barrier over the ranks that checks
  // `fingerprint`.
  void enterOp(const OpDescriptor& d, uint64_t floor, uint64_t fingerprint, cudaStream_t stream) const {
    k::OpEntryParams p{};
    for (uint32_t r = 0; r < env_.nranks; ++r) p.words[r] = k::opEntryWords(env_.workspaces[r]);
    p.floor = floor;
    p.fingerprint = fingerprint;
    p.timeoutNs = env_.timeoutNs;
    p.abortWord = &ctlDev_->abort;
    p.errorSlot = &ctlDev_->error;
    p.rank = env_.rank;
    p.nranks = env_.nranks;
    p.op = static_cast<uint32_t>(d.kind);
    k::launchOpEntry(p, stream);
  }

  // A captured op whose launch needs every rank's rows (GpuOp::needsRankRows): a replay has no tandemd step to learn
  // them from, so the capture uses those of this rank's last eager call of the same shape (the warm-up), and the op
  // entry's fingerprint carries them, so that ranks whose warm-ups saw other rows fail as diverged at the first replay
  // instead of reading each other's staging with the wrong sizes.
  std::span<const uint64_t> warmRowsOf(const OpDescriptor& d) const {
    const uint64_t seq = d.dims[dim::kSeq];
    const auto it = warmRows_.find(collectiveFingerprint(d));
    if (it == warmRows_.end()) {
      fail(ErrorCode::kUnsupported, "{}: the stream is being captured into a CUDA graph on {} ranks, and each rank's "
           "launch needs every rank's seq, which this rank learns only from an eager call of the op: run {} once "
           "outside the graph with the shapes you capture (the usual warm-up), then capture",
           opKindName(d.kind), nranks_, opKindName(d.kind));
    }
    if (it->second[env_.rank] != seq) {
      fail(ErrorCode::kUnsupported, "{}: the stream is being captured into a CUDA graph with seq {} on this rank, but "
           "its last eager call of this shape (the warm-up the capture takes every rank's seq from) had seq {}: warm up "
           "with the seq you capture", opKindName(d.kind), seq, it->second[env_.rank]);
    }
    return it->second;
  }

  uint32_t nranks_;
  std::vector<std::unique_ptr<DeviceMapping>> workspaces_;
  k::CommControl* ctlDev_;
  std::map<uint64_t, std::vector<uint64_t>> warmRows_;  // collectiveFingerprint -> every rank's rows, last eager call
  k::FusedEnv env_;  // workspaces, their layout, the control page, the deadline, the CTA budget: every launch
  std::string gpuModel_;
};

// executor daemon: tandemd runs the op (its persistent kernel, or the fused GEMMs' kernels on its own stream) once
// every rank's stream got here (gang-ready), then done is written. The workspaces are mapped for the fused GEMMs'
// checks, which need their layout.
//
// One exception, the same rule on both sides (PersistentComm::runsInCallerStream): a fused GEMM of a one-rank
// communicator has nothing to exchange, so it is the GEMM core alone (plainGemmPlan), and running it in tandemd's
// context would only add the round trip (ready seen, launch, done: about 20 us at M = 1024 on one H200). It runs here,
// in the caller's stream; the ready written after it tells tandemd the op is done (tandemd writes done on the host, as
// for a barrier), and the stream does not wait. It touches only this process's own mappings.
class PersistentStrategy final : public CommStrategy {
 public:
  PersistentStrategy(int device, uint32_t rank, uint32_t nranks, uint32_t maxCtas,
                     std::vector<std::unique_ptr<DeviceMapping>> workspaces, k::CommControl* ctlDev)
      : nranks_(nranks), workspaces_(std::move(workspaces)), ctlDev_(ctlDev),
        env_(fusedEnvOf(rank, nranks, maxCtas, workspaces_, ctlDev)) {
    if (nranks_ != 1) return;
    gpuModel_ = gpuModelOf(device);
    try {
      k::preloadFusedGemmKernels(device);  // before any op, as ClientGateStrategy does (preload.hpp)
    } catch (const std::exception& e) {
      fail(ErrorCode::kCuda, "communicator init on device {}: {}", device, e.what());
    }
  }

  void check(const OpDescriptor& d, const DevicePointers& ptrs) const override {
    checkOnNode(k::Executor::kDaemon, d, ptrs, env_, nranks_ == 1 ? planOf(d, gpuModel_, "daemon") : PlanChoice{});
  }
  void enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, CUstream s,
               std::span<const uint64_t> /*rankRows*/) override {
    const k::GpuOp& op = k::gpuOp(d.kind);
    if (nranks_ != 1 || !op.fusedGemm) {
      enqueueReadyThenWaitDone(ctlDev_, e, s);
      return;
    }
    try {
      // Only a trial plan (tandemctl tune / advise forcing the fused kernel) changes the GEMM core's plan here.
      logPlanOnce(d, op.launch({d, ptrs, e, env_, reinterpret_cast<cudaStream_t>(s), planOf(d, gpuModel_, "daemon"),
                                false}));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& ex) {
      fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
    }
    writeWord(s, ctlDev_->ready, e, "cuStreamWriteValue32(ready)");
  }

 private:
  uint32_t nranks_;
  std::string gpuModel_;  // one rank only
  std::vector<std::unique_ptr<DeviceMapping>> workspaces_;
  k::CommControl* ctlDev_;
  k::FusedEnv env_;
};

// The communicator spans nodes: tandemd runs the op once every local rank's stream got here (the inputs are final),
// staged through host memory, then writes done. No workspaces.
class HostStagedStrategy final : public CommStrategy {
 public:
  explicit HostStagedStrategy(k::CommControl* ctlDev) : ctlDev_(ctlDev) {}

  // tandemd stages the op through host memory and runs it with the cpu backend's code: any dtype, any alignment, no
  // workspace.
  void check(const OpDescriptor& d, const DevicePointers& /*ptrs*/) const override {
    const OpSet ops = k::executorOps(k::Executor::kHost);
    if (ops.contains(d.kind)) return;
    const std::string_view op = opKindName(d.kind);
    fail(ErrorCode::kUnsupported, "{}: this communicator's ranks live on several nodes, and across nodes tandem runs "
         "{} only; run {} on a communicator whose ranks are all on one node", op, opList(ops), op);
  }
  void enqueue(const OpDescriptor& /*d*/, const DevicePointers& /*ptrs*/, uint64_t e, CUstream s,
               std::span<const uint64_t> /*rankRows*/) override {
    enqueueReadyThenWaitDone(ctlDev_, e, s);
  }

 private:
  k::CommControl* ctlDev_;
};

}  // namespace

CommGpu::Mode CommGpu::modeOf(const std::string& executor) {
  if (const auto e = k::executorFromName(executor)) return *e;
  fail(ErrorCode::kProtocol, "tandemd answered the join with executor '{}', which this libtandem does not know "
       "(client, daemon, host); use the libtandem of tandemd's release", executor);
}

CommGpu::CommGpu(int device, Mode mode, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control,
                 uint64_t controlBytes, std::vector<std::unique_ptr<DeviceMapping>> workspaces)
    : device_(device), mode_(mode), page_(k::ControlPage::open(std::move(control), controlBytes)) {
  k::CudaDeviceGuard guard(device_);
  registration_ = k::HostRegistration::create(page_.memory(), page_.bytes(), "control page");
  auto* ctlDev = static_cast<k::CommControl*>(registration_.devicePtr());
  switch (mode) {
    case Mode::kClient:
      strategy_ = std::make_unique<ClientGateStrategy>(device_, rank, nranks, maxCtas, std::move(workspaces), ctlDev);
      break;
    case Mode::kDaemon:
      strategy_ = std::make_unique<PersistentStrategy>(device_, rank, nranks, maxCtas, std::move(workspaces), ctlDev);
      break;
    case Mode::kHost: strategy_ = std::make_unique<HostStagedStrategy>(ctlDev); break;
  }
}

CommGpu::~CommGpu() = default;

bool CommGpu::check(const OpDescriptor& d, const DevicePointers& ptrs, void* stream) const {
  bool captured = false;
  if (d.nranks > 1) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t queried = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
    // A legacy-stream query while another thread captures globally fails; that error is ours, not the caller's.
    if (queried != cudaSuccess) (void)cudaGetLastError();
    captured = queried == cudaSuccess && capture != cudaStreamCaptureStatusNone;
    if (captured) {
      if (const std::string why = captureRefusal(k::executorName(mode_), d); !why.empty()) {
        fail(ErrorCode::kUnsupported, "{}", why);
      }
    }
  }
  strategy_->check(d, ptrs);
  return captured;
}

namespace {
// Whether an enqueue must make the communicator's device current (and restore the caller's after). The caller's stream
// is on it nearly always, so the common case costs two lookups; but a thread that has made no CUDA runtime call yet
// (PyTorch's autograd threads run the backward's ops, for instance) has no context current while cudaGetDevice answers
// 0, and the stream memops (driver calls) would then fail with CUDA_ERROR_INVALID_CONTEXT on device 0.
bool mustSwitchTo(int device) {
  int current = -1;
  checkCuda(cudaGetDevice(&current), "cudaGetDevice");
  CUcontext ctx = nullptr;
  checkCuda(k::driver().ctxGetCurrent(&ctx), "cuCtxGetCurrent");
  return current != device || ctx == nullptr;
}
}  // namespace

void CommGpu::enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  std::optional<k::CudaDeviceGuard> guard;
  if (mustSwitchTo(device_)) guard.emplace(device_);
  std::optional<std::array<uint64_t, k::kPageRanks>> rows;
  if (mode_ == Mode::kClient && d.nranks > 1 && k::gpuOp(d.kind).needsRankRows) rows = waitRankRows(d, e);
  const std::span<const uint64_t> rankRows = rows ? std::span<const uint64_t>(rows->data(), d.nranks)
                                                  : std::span<const uint64_t>();
  strategy_->enqueue(d, ptrs, e, static_cast<CUstream>(stream), rankRows);
}

std::optional<std::array<uint64_t, k::kPageRanks>> CommGpu::waitRankRows(const OpDescriptor& d, uint64_t e) const {
  // tandemd publishes them once every rank submitted the op: a peer's host is usually within microseconds of this
  // one, so spin briefly, then sleep in short steps (this thread holds `mutex`; the watcher does not need it first).
  using Clock = std::chrono::steady_clock;
  const uint64_t timeoutNs = opTimeoutNs();
  const auto deadline = Clock::now() + std::chrono::nanoseconds(timeoutNs);
  for (uint32_t polls = 0;; ++polls) {
    if (auto rows = page_.rankRows(e)) return rows;
    if (page_.aborted() || daemonGone.load(std::memory_order_acquire)) return std::nullopt;
    if (Clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "{} (op epoch {}): tandemd did not publish every rank's seq within {} ms; it does once "
           "every rank of the communicator submitted the op: submit it on every rank, or raise TANDEM_OP_TIMEOUT_MS",
           opKindName(d.kind), e, timeoutNs / 1'000'000);
    }
    if (polls >= 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CommGpu::enqueueCaptured(const OpDescriptor& d, const DevicePointers& ptrs, void* stream) {
  std::optional<k::CudaDeviceGuard> guard;
  if (mustSwitchTo(device_)) guard.emplace(device_);
  page_.markDeviceEpochs();  // tandemd: a rank that leaves now aborts the others (their replays may wait for it)
  strategy_->enqueueCaptured(d, ptrs, epoch, static_cast<CUstream>(stream));
  if (k::isMoeOp(d.kind)) capturedMoe_[d.kind] = d;
}

std::string CommGpu::takeReplayFault() {
  const std::optional<k::OpFault> f = page_.takeReplayFault();
  const uint64_t dropped = page_.replayFaultsDropped();
  const uint64_t more = dropped - replayFaultsDroppedSeen_;
  replayFaultsDroppedSeen_ = dropped;
  if (!f && more == 0) return {};
  const std::string also = more == 0 ? std::string()
                                     : fmt::format(" ({} more replayed MoE op{} failed after it)", more,
                                                   more == 1 ? "" : "s");
  if (!f) {
    // The fault they were dropped for was taken before they were counted.
    return fmt::format("{} replayed MoE op{} failed with a bad expert id or too many rows after the error reported "
                       "last", more, more == 1 ? "" : "s");
  }
  const auto kind = static_cast<OpKind>(f->op);
  const auto it = capturedMoe_.find(kind);
  OpDescriptor d{};
  if (it != capturedMoe_.end()) {
    d = it->second;
  } else {
    d.kind = kind;
  }
  return fmt::format("a replay of {} from a CUDA graph failed: {}{}", opKindName(kind), k::moeFaultText(*f, d), also);
}

void CommGpu::setPlan(const PlanKey& key, const PlanChoice& plan) { strategy_->setPlan(key, plan); }

void CommGpu::abortLocal() {
  // Kernels poll the abort word; stream waits compare cyclically, so go and done jump far past every epoch.
  page_.abort(epoch);
}

// ---- the daemon watcher -----------------------------------------------------------------------------------

SessionWatch::SessionWatch(int socketFd) : socketFd_(socketFd), stop_(Fd::eventfd()) {
  thread_ = std::thread([this] { run(); });
}

SessionWatch::~SessionWatch() {
  signalEventfd(stop_.get());
  if (thread_.joinable()) thread_.join();
}

void SessionWatch::add(const std::shared_ptr<CommGpu>& comm) {
  std::lock_guard lock(mutex_);
  std::erase_if(comms_, [](const std::weak_ptr<CommGpu>& w) { return w.expired(); });
  comms_.push_back(comm);
  if (lost_) {
    comm->daemonGone.store(true, std::memory_order_release);
    comm->abortLocal();
  }
}

void SessionWatch::run() {
  for (;;) {
    // POLLRDHUP only: replies (POLLIN) belong to Session::call; a hang-up or error is reported regardless.
    pollfd p[2] = {{socketFd_, POLLRDHUP, 0}, {stop_.get(), POLLIN, 0}};
    const int n = ::poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (p[1].revents != 0) return;
    if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) break;
  }
  std::lock_guard lock(mutex_);
  lost_ = true;
  // First without the communicators' locks: a submitter that waits under one for tandemd (waitRankRows) stops.
  for (auto& w : comms_) {
    if (auto c = w.lock()) c->daemonGone.store(true, std::memory_order_release);
  }
  for (auto& w : comms_) {
    if (auto c = w.lock()) {
      std::lock_guard cl(c->mutex);
      c->abortLocal();
    }
  }
}

// ---- the cuda backend's client strategy ----------------------------------------------------------------------------

namespace {

class DeviceMemory final : public BufferMemory {
 public:
  explicit DeviceMemory(std::unique_ptr<DeviceMapping> mapping) : mapping_(std::move(mapping)) {}
  void* ptr() const override { return mapping_->ptr(); }

 private:
  std::unique_ptr<DeviceMapping> mapping_;
};

class CudaCommExecutor final : public CommExecutor {
 public:
  explicit CudaCommExecutor(std::shared_ptr<CommGpu> gpu) : gpu_(std::move(gpu)) {}
  void submit(const OpDescriptor& desc, const TensorPointers& ptrs, void* stream,
              const std::function<void()>& submitToDaemon, const std::function<void()>& abortComm) override {
    const bool captured = gpu_->check(desc, ptrs, stream);
    // Ring order = epoch order = stream order: one submitter at a time on this communicator.
    std::lock_guard lock(gpu_->mutex);
    if (captured) {
      // Not submitted: tandemd never sees a replay, and the graph holds no word it would read (op_entry.hpp). A
      // failure here breaks only the capture (CUDA invalidates it); the communicator and its peers are untouched.
      gpu_->enqueueCaptured(desc, ptrs, stream);
      return;
    }
    submitToDaemon();
    const uint64_t epoch = ++gpu_->epoch;
    try {
      gpu_->enqueue(desc, ptrs, epoch, stream);
    } catch (...) {
      // The op is submitted but this rank's stream will not run it: abort the communicator, or the peers' kernels
      // would wait for ours until their deadline. The CUDA error is what the caller needs to see.
      abortComm();
      throw;
    }
  }
  void setPlan(const PlanKey& key, const PlanChoice& plan) override {
    std::lock_guard lock(gpu_->mutex);
    gpu_->setPlan(key, plan);
  }
  // Only once the communicator captured an MoE op (the only ops whose replays report data errors). Weak: the probe
  // may outlive the communicator, and must not keep its mappings.
  std::function<std::string()> replayFaultProbe() const override {
    std::lock_guard lock(gpu_->mutex);
    if (!gpu_->capturedMoe()) return {};
    return [weak = std::weak_ptr<CommGpu>(gpu_)]() -> std::string {
      const std::shared_ptr<CommGpu> gpu = weak.lock();
      if (gpu == nullptr) return {};
      std::lock_guard held(gpu->mutex);
      return gpu->takeReplayFault();
    };
  }

 private:
  std::shared_ptr<CommGpu> gpu_;  // shared with the session's watch (a weak reference there)
};

class CudaBackend final : public ClientBackend {
 public:
  explicit CudaBackend(int socketFd) : watch_(std::make_unique<SessionWatch>(socketFd)) {}

  int prepareAllocate(v1::AllocateBuffer& request) const override {
    const int device = currentDevice();
    request.set_device_uuid(deviceUuid(device));
    return device;
  }
  std::unique_ptr<BufferMemory> mapAllocation(const Fd& fd, const v1::AllocateBufferReply& reply,
                                              int device) const override {
    return std::make_unique<DeviceMemory>(DeviceMapping::import(fd, reply.mapped_bytes(), device));
  }
  bool sharesRegistrations() const override { return true; }
  void describeRegistration(v1::RegisterBuffer& request, void* ptr, uint64_t bytes, int fd,
                            uint64_t fdOffset) const override {
    const RegisterDescription d = describeForRegister(ptr, bytes, fd, fdOffset);
    request.set_offset(d.offset);
    request.set_bytes(bytes);
    request.set_kind(static_cast<v1::RegisterKind>(d.kind));
    request.set_ipc_handle(d.ipcHandle);
    request.set_device_uuid(d.deviceUuid);
  }
  int prepareJoin(v1::JoinCommunicator& join) const override {
    const int device = currentDevice();
    join.set_device_uuid(deviceUuid(device));
    return device;
  }
  std::size_t joinFds() const override { return 1; }  // this rank's control page
  std::unique_ptr<CommExecutor> attach(Session& session, uint64_t handle, uint32_t rank, uint32_t nranks,
                                       const v1::JoinCommunicatorReply& j, std::vector<Fd>& fds,
                                       int device) override {
    const CommGpu::Mode mode = CommGpu::modeOf(j.executor());
    // Map every rank's workspace (ours included) with access for our GPU; a communicator that spans nodes (host
    // mode) has none.
    std::vector<std::unique_ptr<DeviceMapping>> workspaces;
    for (uint32_t r = 0; mode != CommGpu::Mode::kHost && r < nranks; ++r) {
      v1::Request m;
      m.mutable_comm_mapping()->set_comm_handle(handle);
      m.mutable_comm_mapping()->set_rank(r);
      std::vector<Fd> wsFd;
      const auto reply = session.call(m, {}, &wsFd, 1);
      workspaces.push_back(DeviceMapping::import(wsFd[0], reply.comm_mapping().bytes(), device));
    }
    auto gpu = std::make_shared<CommGpu>(device, mode, rank, nranks, j.comm_ctas(), std::move(fds[0]),
                                         j.control_bytes(), std::move(workspaces));
    // executor client: the plan table's entries for this communicator, applied to the ops this rank launches.
    for (const auto& e : j.plans()) {
      if (auto p = planFromNames(e.op(), e.dtype(), e.ranks(), e.bucket(), e.gpu(), e.executor(), e.kind(),
                                 e.comm_sms(), e.chunk_bytes())) {
        gpu->setPlan(p->first, p->second);
      }
    }
    watch_->add(gpu);
    return std::make_unique<CudaCommExecutor>(std::move(gpu));
  }
  std::string executorName(const v1::JoinCommunicatorReply& reply) const override { return reply.executor(); }
  void close() override { watch_.reset(); }  // joins its thread before the socket it polls is closed

 private:
  std::unique_ptr<SessionWatch> watch_;  // aborts every stream's waits when tandemd dies
};

}  // namespace

std::unique_ptr<ClientBackend> makeCudaBackend(int socketFd) { return std::make_unique<CudaBackend>(socketFd); }

}  // namespace tandem::client::gpu
