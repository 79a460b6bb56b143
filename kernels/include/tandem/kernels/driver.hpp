// The CUDA driver entry points tandem calls, fetched through the CUDA runtime (cudaGetDriverEntryPointByVersion) so
// that nothing links libcuda: tandemd, libtandem and the benches start on hosts without a driver, and fail with a
// clear message only when they use a GPU.
//
// Header-only, without fmt or tandem_common, so that kernel units (nvcc) and every host library can include it
// without a link dependency.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace tandem::kernels {

/// Every driver entry point tandem uses, loaded once per process by driver().
struct DriverApi {
  CUresult (*memCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*memRelease)(CUmemGenericAllocationHandle);
  CUresult (*memExportToShareableHandle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                         unsigned long long);
  CUresult (*memImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*memGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*memAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*memAddressFree)(CUdeviceptr, size_t);
  CUresult (*memMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*memUnmap)(CUdeviceptr, size_t);
  CUresult (*memSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*memRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*memGetAllocationPropertiesFromHandle)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
  CUresult (*memGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*streamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  CUresult (*streamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  CUresult (*getErrorString)(CUresult, const char**);
  CUresult (*deviceGet)(CUdevice*, int);
  CUresult (*devicePrimaryCtxGetState)(CUdevice, unsigned int*, int*);
  CUresult (*ctxGetCurrent)(CUcontext*);
  CUresult (*deviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*memGetHandleForAddressRange)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  PFN_cuTensorMapEncodeTiled_v12000 tensorMapEncodeTiled;
};

namespace detail {
template <typename F>
void loadDriverEntryPoint(F& fn, const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || f == nullptr) {
    throw std::runtime_error(std::string("CUDA driver entry point ") + name + " is not available (" +
                             cudaGetErrorName(e) + "); install an NVIDIA driver for CUDA 12.0 or newer");
  }
  fn = reinterpret_cast<F>(f);
}
}  // namespace detail

/// Loads every entry point on the first call (thread-safe) and returns them.
/// @throws std::runtime_error naming the first missing one (no driver, or one older than CUDA 12.0).
inline const DriverApi& driver() {
  static const DriverApi api = [] {
    using detail::loadDriverEntryPoint;
    DriverApi a{};
    loadDriverEntryPoint(a.memCreate, "cuMemCreate");
    loadDriverEntryPoint(a.memRelease, "cuMemRelease");
    loadDriverEntryPoint(a.memExportToShareableHandle, "cuMemExportToShareableHandle");
    loadDriverEntryPoint(a.memImportFromShareableHandle, "cuMemImportFromShareableHandle");
    loadDriverEntryPoint(a.memGetAllocationGranularity, "cuMemGetAllocationGranularity");
    loadDriverEntryPoint(a.memAddressReserve, "cuMemAddressReserve");
    loadDriverEntryPoint(a.memAddressFree, "cuMemAddressFree");
    loadDriverEntryPoint(a.memMap, "cuMemMap");
    loadDriverEntryPoint(a.memUnmap, "cuMemUnmap");
    loadDriverEntryPoint(a.memSetAccess, "cuMemSetAccess");
    loadDriverEntryPoint(a.memRetainAllocationHandle, "cuMemRetainAllocationHandle");
    loadDriverEntryPoint(a.memGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    loadDriverEntryPoint(a.memGetAddressRange, "cuMemGetAddressRange");
    loadDriverEntryPoint(a.streamWaitValue32, "cuStreamWaitValue32");
    loadDriverEntryPoint(a.streamWriteValue32, "cuStreamWriteValue32");
    loadDriverEntryPoint(a.getErrorString, "cuGetErrorString");
    loadDriverEntryPoint(a.deviceGet, "cuDeviceGet");
    loadDriverEntryPoint(a.devicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState");
    loadDriverEntryPoint(a.ctxGetCurrent, "cuCtxGetCurrent");
    loadDriverEntryPoint(a.deviceGetAttribute, "cuDeviceGetAttribute");
    loadDriverEntryPoint(a.memGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
    loadDriverEntryPoint(a.tensorMapEncodeTiled, "cuTensorMapEncodeTiled");
    return a;
  }();
  return api;
}

/// cuTensorMapEncodeTiled (the GEMM launchers' TMA descriptors). @throws std::runtime_error as driver() does.
inline PFN_cuTensorMapEncodeTiled_v12000 tensorMapEncodeTiled() { return driver().tensorMapEncodeTiled; }

/// The driver's text for `r` ("out of memory"); a fixed text when the driver cannot say. Never throws.
inline const char* driverErrorName(CUresult r) noexcept {
  const char* s = nullptr;
  try {
    if (driver().getErrorString(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  } catch (...) {
  }
  return "unknown CUDA driver error";
}

}  // namespace tandem::kernels
