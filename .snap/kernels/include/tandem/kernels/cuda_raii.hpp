// One error check and one owner per CUDA handle, for tandemd and libtandem alike (host code, g++): streams, events,
// host registrations, device and pinned host allocations, and a guard that sets and restores the current device.
//
// Acquire through the throwing factories (CudaStream::create, ...); each type owns one handle, so a constructor that
// throws part way leaks nothing. Destructors never throw: a failed release is reported through the release log
// (setCudaReleaseLog) and otherwise ignored. Not thread-safe per object; distinct objects may be used from any thread.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "tandem/common/error.hpp"

namespace tandem::kernels {

namespace detail {
[[noreturn]] void throwCuda(cudaError_t e, const std::string& what);
[[noreturn]] void throwCuda(CUresult r, const std::string& what);
}  // namespace detail

/// Throws Error(kCuda) "<what>: <cudaErrorName> (<description>)" unless `e` is cudaSuccess. Clears the runtime's last
/// error first: API errors are not sticky, and this one must not surface again at the next launch check.
template <typename... Args>
inline void checkCuda(cudaError_t e, fmt::format_string<Args...> what, Args&&... args) {
  if (e == cudaSuccess) [[likely]] return;
  detail::throwCuda(e, fmt::format(what, std::forward<Args>(args)...));
}
/// Throws Error(kCuda) "<what>: <driver's text> (CUresult <n>)" unless `r` is CUDA_SUCCESS.
template <typename... Args>
inline void checkCuda(CUresult r, fmt::format_string<Args...> what, Args&&... args) {
  if (r == CUDA_SUCCESS) [[likely]] return;
  detail::throwCuda(r, fmt::format(what, std::forward<Args>(args)...));
}

/// Where destructors report a release that failed. The default writes to stderr only when TANDEM_LOG=debug (libtandem
/// must not write to an application's stderr otherwise); tandemd routes it to its log. Thread-safe.
using CudaReleaseLog = void (*)(const std::string& message);
void setCudaReleaseLog(CudaReleaseLog log) noexcept;
/// Reports "<what> failed: <name> (<text>)" through the release log unless `e` is cudaSuccess, and clears the runtime's
/// last error. For destructors and other paths that must not throw.
void reportRelease(cudaError_t e, const char* what) noexcept;

/// Makes `device` (and its primary context) current on the calling thread for a scope, and restores the previous
/// device at its end, unless that device's primary context is not active: restoring it would only create a context
/// (cudaSetDevice initialises one since CUDA 12) on a GPU the process never used, such as GPU 0 in a tandemd
/// restricted to other GPUs.
class CudaDeviceGuard {
 public:
  /// @throws Error(kCuda) when the device cannot be made current.
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};

namespace detail {
struct StreamDeleter {
  int device = -1;
  void operator()(CUstream_st* s) const noexcept;
};
struct EventDeleter {
  int device = -1;
  void operator()(CUevent_st* e) const noexcept;
};
}  // namespace detail

/// A stream owned by one object; destroyed with its device current.
class CudaStream {
 public:
  CudaStream() = default;
  /// A stream on `device` with cudaStreamNonBlocking (tandem's streams never synchronise with the legacy stream).
  /// @throws Error(kCuda) naming `what`.
  static CudaStream create(int device, const char* what);
  cudaStream_t get() const noexcept { return s_.get(); }
  explicit operator bool() const noexcept { return s_ != nullptr; }

 private:
  std::unique_ptr<CUstream_st, detail::StreamDeleter> s_;
};

/// An event owned by one object (timing disabled: tandem only orders and queries with them).
class CudaEvent {
 public:
  CudaEvent() = default;
  /// @throws Error(kCuda) naming `what`.
  static CudaEvent create(int device, const char* what);
  /// An event that records time (cudaEventElapsedTime), for measurements; create()'s do not, and cost less to record.
  /// @throws Error(kCuda) naming `what`.
  static CudaEvent createTimed(int device, const char* what);
  cudaEvent_t get() const noexcept { return e_.get(); }
  explicit operator bool() const noexcept { return e_ != nullptr; }

 private:
  std::unique_ptr<CUevent_st, detail::EventDeleter> e_;
};

/// Host memory registered with cudaHostRegister (portable, mapped) for the lifetime of the object, and its device
/// address. The memory itself belongs to the caller and must outlive the registration.
class HostRegistration {
 public:
  HostRegistration() = default;
  /// @throws Error(kCuda) naming `what`.
  static HostRegistration create(void* host, uint64_t bytes, const char* what);
  HostRegistration(HostRegistration&& o) noexcept : host_(std::exchange(o.host_, nullptr)), device_(o.device_) {}
  HostRegistration& operator=(HostRegistration&& o) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() { reset(); }

  /// The registered memory as kernels and stream memory operations address it (UVA: the same on every device).
  void* devicePtr() const noexcept { return device_; }
  void reset() noexcept;

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
};

/// cudaMalloc memory on one device, freed with that device current.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// @throws Error(kCuda) naming `what` (kOutOfMemory is not singled out: these are small, fixed allocations).
  static DeviceBuffer allocate(int device, std::size_t bytes, const char* what);
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), device_(o.device_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* get() const noexcept { return ptr_; }
  void reset() noexcept;

 private:
  void* ptr_ = nullptr;
  int device_ = -1;
};

/// cudaHostAlloc memory (portable, mapped: kernels reach it over PCIe), zeroed, freed by the object.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  /// @throws Error(kCuda) naming `what`.
  static PinnedHostBuffer allocate(std::size_t bytes, const char* what);
  PinnedHostBuffer(PinnedHostBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& o) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  ~PinnedHostBuffer() { reset(); }

  void* get() const noexcept { return ptr_; }
  /// The same memory as kernels address it. @throws Error(kCuda).
  void* devicePtr() const;
  void reset() noexcept;

 private:
  void* ptr_ = nullptr;
};

}  // namespace tandem::kernels
