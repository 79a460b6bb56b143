#include "cuda_client.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "tandem/common/error.hpp"
#include "tandem/common/gpu_uuid.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/gemm_ar.hpp"
#include "tandem/kernels/gemm_rs.hpp"

namespace tandem::client::gpu {
namespace {

namespace k = tandem::kernels;

void checkRt(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  fail(ErrorCode::kCuda, "{}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e));
}
void checkDrv(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  fail(ErrorCode::kCuda, "{}: {}", what, k::driverErrorName(r));
}

// Runs a scope on `device`, restoring the caller's current device afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    checkRt(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) checkRt(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

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
  const std::string shape = fmt::format("{} {} m={} n={} k={} on {} ranks", opKindName(d.kind), dtypeName(d.dtype),
                                        d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK], d.nranks);
  std::lock_guard lock(mu);
  if (seen.insert(shape).second) std::fprintf(stderr, "tandem: rank %u: %s: plan %s\n", d.rank, shape.c_str(), plan.c_str());
}

}  // namespace

int currentDevice() {
  int d = 0;
  checkRt(cudaGetDevice(&d), "cudaGetDevice (is a CUDA device visible to this process?)");
  return d;
}

std::string deviceUuid(int ordinal) {
  cudaDeviceProp prop{};
  checkRt(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  return formatGpuUuid(prop.uuid.bytes);
}

// ---- cuMem import -----------------------------------------------------------------------------------------

std::unique_ptr<DeviceMapping> DeviceMapping::import(const Fd& fd, uint64_t bytes, int accessDevice) {
  const auto& d = k::driver();
  DeviceScope scope(accessDevice);
  checkRt(cudaFree(nullptr), "CUDA context initialisation");
  CUmemGenericAllocationHandle h = 0;
  checkDrv(d.memImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
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
  checkDrv(r, "cuMemMap (tandemd's allocation)");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = accessDevice;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.memSetAccess(va, bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.memUnmap(va, bytes);
    d.memAddressFree(va, bytes);
    checkDrv(r, "cuMemSetAccess (is peer access possible between this GPU and the memory's?)");
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

RegisterDescription describeForRegister(void* ptr, uint64_t bytes, int fd, uint64_t fdOffset) {
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
  checkDrv(k::driver().memGetAddressRange(&base, &size, devptr(ptr)), "cuMemGetAddressRange");
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

// ---- communicators ----------------------------------------------------------------------------------------

CommGpu::Mode CommGpu::modeOf(const std::string& executor) {
  if (executor == "client") return Mode::kClient;
  if (executor == "daemon") return Mode::kDaemon;
  if (executor == "host") return Mode::kHost;
  fail(ErrorCode::kProtocol, "tandemd answered the join with executor '{}', which this libtandem does not know "
       "(client, daemon, host); use the libtandem of tandemd's release", executor);
}

CommGpu::CommGpu(int device, Mode mode, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control,
                 uint64_t controlBytes, std::vector<std::unique_ptr<DeviceMapping>> workspaces)
    : device_(device), mode_(mode), rank_(rank), nranks_(nranks), maxCtas_(maxCtas), controlFd_(std::move(control)),
      controlBytes_(controlBytes), workspaces_(std::move(workspaces)) {
  env_.rank = rank_;
  env_.nranks = nranks_;
  env_.timeoutNs = opTimeoutNs();
  env_.commSms = maxCtas_;
  env_.workspaceBytes = workspaces_.empty() ? 0 : workspaces_[0]->size();
  for (uint32_t r = 0; r < workspaces_.size() && r < env_.workspaces.size(); ++r) {
    env_.workspaces[r] = static_cast<char*>(workspaces_[r]->ptr());
    env_.workspaceBytes = std::min(env_.workspaceBytes, workspaces_[r]->size());
  }
  if (mode_ != Mode::kHost) env_.layout = k::WorkspaceLayout::fit(env_.workspaceBytes, nranks_);
  if (controlBytes_ < sizeof(k::CommControl)) {
    fail(ErrorCode::kProtocol, "tandemd sent a {}-byte control page; this libtandem needs {}", controlBytes_,
         sizeof(k::CommControl));
  }
  controlMap_ = ::mmap(nullptr, controlBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, controlFd_.get(), 0);
  if (controlMap_ == MAP_FAILED) {
    controlMap_ = nullptr;
    checkErrno(-1, "mmap(control page)");
  }
  ctl_ = static_cast<k::CommControl*>(controlMap_);
  DeviceScope scope(device_);
  // Before any op: a kernel loaded lazily behind one of our own stream waits would hang (preload.hpp). Only the
  // client executor launches kernels from libtandem.
  try {
    if (mode_ == Mode::kClient) {
      k::preloadRuntimeKernels(device_);
      k::preloadFusedGemmKernels(device_);
    }
  } catch (const std::exception& e) {
    fail(ErrorCode::kCuda, "communicator init on device {}: {}", device_, e.what());
  }
  checkRt(cudaHostRegister(controlMap_, controlBytes_, cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister(control page)");
  registered_ = true;
  void* dev = nullptr;
  checkRt(cudaHostGetDevicePointer(&dev, controlMap_, 0), "cudaHostGetDevicePointer(control page)");
  ctlDev_ = static_cast<k::CommControl*>(dev);
  env_.ctl = ctlDev_;
}

CommGpu::~CommGpu() {
  if (registered_) {
    cudaHostUnregister(controlMap_);
    cudaGetLastError();
  }
  if (controlMap_ != nullptr) ::munmap(controlMap_, controlBytes_);
}

void CommGpu::check(const OpDescriptor& d, const DevicePointers& ptrs) const {
  const std::string_view op = opKindName(d.kind);
  if (mode_ == Mode::kHost) {
    // tandemd stages the op through host memory and runs it with the cpu backend's code: any dtype, any alignment,
    // no workspace.
    switch (d.kind) {
      case OpKind::kNop:
      case OpKind::kAllGather:
      case OpKind::kAgGemm:
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: return;
      default:
        fail(ErrorCode::kUnsupported, "{}: this communicator's ranks live on several nodes, and across nodes tandem "
             "runs ag-gemm, gemm-rs, gemm-ar, allgather and barriers only; run {} on a communicator whose ranks are all "
             "on one node", op, op);
    }
  }
  switch (d.kind) {
    case OpKind::kNop:
    case OpKind::kAllGather: return;
    case OpKind::kAgGemm:
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: break;
    default:
      fail(ErrorCode::kUnsupported, "{}: the cuda backend does not run this op yet (it runs ag-gemm, gemm-rs, gemm-ar, "
           "allgather and barriers); run it on a tandemd with daemon.backend: cpu", op);
  }
  k::checkFusedGemm(d, ptrs, env_);
}

void CommGpu::enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  const auto& drv = k::driver();
  const auto s = static_cast<CUstream>(stream);
  const auto e32 = static_cast<uint32_t>(e);
  DeviceScope scope(device_);
  const auto write = [&](k::StreamWord& w, const char* what) {
    checkDrv(drv.streamWriteValue32(s, devptr(&w.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT), what);
  };
  const auto waitFor = [&](k::StreamWord& w, const char* what) {
    checkDrv(drv.streamWaitValue32(s, devptr(&w.value), e32, CU_STREAM_WAIT_VALUE_GEQ), what);
  };
  if (mode_ != Mode::kClient) {
    // kDaemon: tandemd runs the op once every rank's stream got here (gang-ready), then done is written (by its
    // persistent kernel, or by its own stream after the fused GEMM's kernels). kHost: tandemd runs the op once every
    // local rank's stream got here (the inputs are final), staged through host memory, then writes done.
    write(ctlDev_->ready, "cuStreamWriteValue32(ready)");
    waitFor(ctlDev_->done, "cuStreamWaitValue32(done)");
    return;
  }
  // Client executor: the daemon opens go once every rank submitted the op (for a gang, once every rank's stream
  // reached it and wrote ready); the kernels run; done tells the daemon the op finished on this rank.
  if (d.kind == OpKind::kNop && nranks_ == 1) {
    // Nothing to meet: the stream need not wait for the daemon's go (the daemon still validates and completes it).
    write(ctlDev_->done, "cuStreamWriteValue32(done)");
    return;
  }
  if (k::needsGang(d)) write(ctlDev_->ready, "cuStreamWriteValue32(ready)");
  // AllGather's kernel waits for the daemon's verdict itself (allgather.cu, opGate): one stream memop less per op.
  if (d.kind != OpKind::kAllGather) waitFor(ctlDev_->go, "cuStreamWaitValue32(go)");
  try {
    switch (d.kind) {
      case OpKind::kNop: break;
      case OpKind::kAllGather: launchAllGather(d, ptrs, e, stream); break;
      case OpKind::kAgGemm:
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: logPlanOnce(d, k::launchFusedGemm(d, ptrs, e, env_, static_cast<cudaStream_t>(stream))); break;
      default: fail(ErrorCode::kInternal, "{} reached the cuda enqueue unchecked", opKindName(d.kind));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& ex) {  // the launchers throw std::runtime_error
    fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
  }
  write(ctlDev_->done, "cuStreamWriteValue32(done)");
}

void CommGpu::launchAllGather(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  k::AllGatherParams p{};
  p.send = ptrs[slot::kSend];
  p.recv = ptrs[slot::kRecv];
  p.bytes = d.dims[dim::kBytes];
  p.epoch = e;
  p.timeoutNs = env_.timeoutNs;
  for (uint32_t r = 0; r < nranks_; ++r) p.workspaces[r] = workspaces_[r]->ptr();
  p.ctl = ctlDev_;
  p.rank = rank_;
  p.nranks = nranks_;
  const k::AgTuning t = k::allgatherTuning(p.bytes, maxCtas_);
  p.chunkBytes = t.chunkBytes;
  p.numCtas = t.numCtas;
  p.mode = t.mode;
  p.checkVerdict = 1;  // a rejected op is skipped inside the kernel
  k::launchAllGather(p, static_cast<cudaStream_t>(stream));
}

void CommGpu::abortLocal() {
  // Kernels poll the abort word; stream waits compare cyclically, so go and done jump far past every epoch.
  std::atomic_ref<uint64_t>(ctl_->abort).store(k::kAbortValue, std::memory_order_release);
  const auto lead = static_cast<uint32_t>(epoch + k::kStreamAbortLead);
  std::atomic_ref<uint32_t>(ctl_->go.value).store(lead, std::memory_order_release);
  std::atomic_ref<uint32_t>(ctl_->done.value).store(lead, std::memory_order_release);
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
  if (lost_) comm->abortLocal();
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
  for (auto& w : comms_) {
    if (auto c = w.lock()) {
      std::lock_guard cl(c->mutex);
      c->abortLocal();
    }
  }
}

}  // namespace tandem::client::gpu
