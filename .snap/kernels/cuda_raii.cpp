#include "tandem/kernels/cuda_raii.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tandem/kernels/driver.hpp"

namespace tandem::kernels {
namespace {

void stderrWhenDebug(const std::string& message) {
  static const bool enabled = [] {
    const char* v = std::getenv("TANDEM_LOG");
    return v != nullptr && std::strcmp(v, "debug") == 0;
  }();
  if (enabled) std::fprintf(stderr, "tandem: %s\n", message.c_str());
}

std::atomic<CudaReleaseLog> releaseLog{&stderrWhenDebug};

}  // namespace

namespace detail {

void throwCuda(cudaError_t e, const std::string& what) {
  cudaGetLastError();
  throw Error(ErrorCode::kCuda, fmt::format("{}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

void throwCuda(CUresult r, const std::string& what) {
  throw Error(ErrorCode::kCuda, fmt::format("{}: {} (CUresult {})", what, driverErrorName(r), static_cast<int>(r)));
}

void StreamDeleter::operator()(CUstream_st* s) const noexcept {
  try {
    CudaDeviceGuard guard(device);
    reportRelease(cudaStreamDestroy(s), "cudaStreamDestroy");
  } catch (const std::exception& e) {
    releaseLog.load()(std::string("cudaStreamDestroy: ") + e.what());
  }
}

void EventDeleter::operator()(CUevent_st* e) const noexcept {
  try {
    CudaDeviceGuard guard(device);
    reportRelease(cudaEventDestroy(e), "cudaEventDestroy");
  } catch (const std::exception& ex) {
    releaseLog.load()(std::string("cudaEventDestroy: ") + ex.what());
  }
}

}  // namespace detail

void setCudaReleaseLog(CudaReleaseLog log) noexcept { releaseLog.store(log != nullptr ? log : &stderrWhenDebug); }

void reportRelease(cudaError_t e, const char* what) noexcept {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  // At process exit the runtime may be gone before a static owner's destructor: nothing was leaked then.
  if (e == cudaErrorCudartUnloading) return;
  try {
    releaseLog.load()(fmt::format("{} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
  } catch (...) {
  }
}

// ---- CudaDeviceGuard ---------------------------------------------------------------------------------------------

CudaDeviceGuard::CudaDeviceGuard(int device) {
  int current = 0;
  checkCuda(cudaGetDevice(&current), "cudaGetDevice");
  // Even when it is already the current device: cudaSetDevice also makes its primary context current (creating it
  // first), which the driver calls that follow (cuMem*, stream memory operations) need.
  checkCuda(cudaSetDevice(device), "cudaSetDevice({})", device);
  if (current != device) previous_ = current;
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (previous_ < 0) return;
  try {
    const DriverApi& d = driver();
    CUdevice dev = 0;
    unsigned int flags = 0;
    int active = 0;
    if (d.deviceGet(&dev, previous_) != CUDA_SUCCESS ||
        d.devicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active == 0) {
      return;
    }
    reportRelease(cudaSetDevice(previous_), "cudaSetDevice (restoring the previous device)");
  } catch (const std::exception& e) {
    releaseLog.load()(std::string("restoring the previous device: ") + e.what());
  }
}

// ---- streams and events --------------------------------------------------------------------------------------------

CudaStream CudaStream::create(int device, const char* what) {
  CudaDeviceGuard guard(device);
  cudaStream_t s = nullptr;
  checkCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags({}) on GPU {}", what,
            device);
  CudaStream out;
  out.s_ = std::unique_ptr<CUstream_st, detail::StreamDeleter>(s, detail::StreamDeleter{device});
  return out;
}

CudaEvent CudaEvent::createTimed(int device, const char* what) {
  CudaDeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  checkCuda(cudaEventCreate(&e), "cudaEventCreate({}) on GPU {}", what, device);
  CudaEvent out;
  out.e_ = std::unique_ptr<CUevent_st, detail::EventDeleter>(e, detail::EventDeleter{device});
  return out;
}

CudaEvent CudaEvent::create(int device, const char* what) {
  CudaDeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  checkCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags({}) on GPU {}", what,
            device);
  CudaEvent out;
  out.e_ = std::unique_ptr<CUevent_st, detail::EventDeleter>(e, detail::EventDeleter{device});
  return out;
}

// ---- host registrations ------------------------------------------------------------------------------------------

HostRegistration HostRegistration::create(void* host, uint64_t bytes, const char* what) {
  checkCuda(cudaHostRegister(host, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped), "cudaHostRegister({})",
            what);
  HostRegistration r;
  r.host_ = host;  // owned from here: a failure below unregisters
  checkCuda(cudaHostGetDevicePointer(&r.device_, host, 0), "cudaHostGetDevicePointer({})", what);
  return r;
}

HostRegistration& HostRegistration::operator=(HostRegistration&& o) noexcept {
  if (this != &o) {
    reset();
    host_ = std::exchange(o.host_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

void HostRegistration::reset() noexcept {
  if (host_ != nullptr) reportRelease(cudaHostUnregister(host_), "cudaHostUnregister");
  host_ = nullptr;
  device_ = nullptr;
}

// ---- allocations ---------------------------------------------------------------------------------------------------

DeviceBuffer DeviceBuffer::allocate(int device, std::size_t bytes, const char* what) {
  CudaDeviceGuard guard(device);
  DeviceBuffer b;
  checkCuda(cudaMalloc(&b.ptr_, bytes), "cudaMalloc({}, {} bytes) on GPU {}", what, bytes, device);
  b.device_ = device;
  return b;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (ptr_ == nullptr) return;
  try {
    CudaDeviceGuard guard(device_);
    reportRelease(cudaFree(ptr_), "cudaFree");
  } catch (const std::exception& e) {
    releaseLog.load()(std::string("cudaFree: ") + e.what());
  }
  ptr_ = nullptr;
}

PinnedHostBuffer PinnedHostBuffer::allocate(std::size_t bytes, const char* what) {
  PinnedHostBuffer b;
  checkCuda(cudaHostAlloc(&b.ptr_, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc({}, {} bytes)",
            what, bytes);
  std::memset(b.ptr_, 0, bytes);
  return b;
}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
  }
  return *this;
}

void* PinnedHostBuffer::devicePtr() const {
  void* d = nullptr;
  checkCuda(cudaHostGetDevicePointer(&d, ptr_, 0), "cudaHostGetDevicePointer(pinned host memory)");
  return d;
}

void PinnedHostBuffer::reset() noexcept {
  if (ptr_ != nullptr) reportRelease(cudaFreeHost(ptr_), "cudaFreeHost");
  ptr_ = nullptr;
}

}  // namespace tandem::kernels
