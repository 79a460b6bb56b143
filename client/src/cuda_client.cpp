#include "cuda_client.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "tandem/common/error.hpp"
#include "tandem/kernels/allgather.hpp"

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

}  // namespace

int currentDevice() {
  int d = 0;
  checkRt(cudaGetDevice(&d), "cudaGetDevice (is a CUDA device visible to this process?)");
  return d;
}

std::string deviceUuid(int ordinal) {
  cudaDeviceProp prop{};
  checkRt(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                     b[15]);
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

CommGpu::CommGpu(int device, bool daemonExecutor, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control,
                 uint64_t controlBytes, std::vector<std::unique_ptr<DeviceMapping>> workspaces)
    : device_(device), daemonExecutor_(daemonExecutor), rank_(rank), nranks_(nranks), maxCtas_(maxCtas),
      controlFd_(std::move(control)), controlBytes_(controlBytes), workspaces_(std::move(workspaces)),
      timeoutNs_(opTimeoutNs()) {
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
  checkRt(cudaHostRegister(controlMap_, controlBytes_, cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister(control page)");
  registered_ = true;
  void* dev = nullptr;
  checkRt(cudaHostGetDevicePointer(&dev, controlMap_, 0), "cudaHostGetDevicePointer(control page)");
  ctlDev_ = static_cast<k::CommControl*>(dev);
}

CommGpu::~CommGpu() {
  if (registered_) {
    cudaHostUnregister(controlMap_);
    cudaGetLastError();
  }
  if (controlMap_ != nullptr) ::munmap(controlMap_, controlBytes_);
}

void CommGpu::enqueueAllGather(uint64_t e, const void* send, void* recv, uint64_t bytes, void* stream) {
  const auto& d = k::driver();
  auto s = static_cast<CUstream>(stream);
  const auto e32 = static_cast<uint32_t>(e);
  if (daemonExecutor_) {
    // The daemon's kernel runs the op once every rank's stream got here (gang-ready), then writes done.
    checkDrv(d.streamWriteValue32(s, devptr(&ctlDev_->ready.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT),
             "cuStreamWriteValue32(ready)");
    checkDrv(d.streamWaitValue32(s, devptr(&ctlDev_->done.value), e32, CU_STREAM_WAIT_VALUE_GEQ),
             "cuStreamWaitValue32(done)");
    return;
  }
  DeviceScope scope(device_);
  checkDrv(d.streamWaitValue32(s, devptr(&ctlDev_->go.value), e32, CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32(go)");
  k::AllGatherParams p{};
  p.send = send;
  p.recv = recv;
  p.bytes = bytes;
  p.epoch = e;
  p.timeoutNs = timeoutNs_;
  for (uint32_t r = 0; r < nranks_; ++r) p.workspaces[r] = workspaces_[r]->ptr();
  p.ctl = ctlDev_;
  p.rank = rank_;
  p.nranks = nranks_;
  const k::AgTuning t = k::allgatherTuning(bytes, maxCtas_);
  p.chunkBytes = t.chunkBytes;
  p.numCtas = t.numCtas;
  p.mode = t.mode;
  p.checkVerdict = 1;
  try {
    k::launchAllGather(p, static_cast<cudaStream_t>(stream));
  } catch (const std::exception& ex) {
    fail(ErrorCode::kCuda, "tandem_allgather: {}", ex.what());
  }
  checkDrv(d.streamWriteValue32(s, devptr(&ctlDev_->done.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32(done)");
}

void CommGpu::enqueueBarrier(uint64_t e, void* stream) {
  const auto& d = k::driver();
  auto s = static_cast<CUstream>(stream);
  const auto e32 = static_cast<uint32_t>(e);
  checkDrv(d.streamWriteValue32(s, devptr(&ctlDev_->ready.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32(ready)");
  if (daemonExecutor_) {
    checkDrv(d.streamWaitValue32(s, devptr(&ctlDev_->done.value), e32, CU_STREAM_WAIT_VALUE_GEQ),
             "cuStreamWaitValue32(done)");
    return;
  }
  checkDrv(d.streamWaitValue32(s, devptr(&ctlDev_->go.value), e32, CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32(go)");
  checkDrv(d.streamWriteValue32(s, devptr(&ctlDev_->done.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32(done)");
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
