// Driver API entry points the kernel launchers need, fetched through the CUDA runtime
// (cudaGetDriverEntryPointByVersion) so that nothing links libcuda: binaries start on hosts without a driver.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace tandem::kernels {

// cuTensorMapEncodeTiled, looked up once per process. Throws std::runtime_error when the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensorMapEncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || f == nullptr) {
      throw std::runtime_error(std::string("tandem: cuTensorMapEncodeTiled is not available from the driver (") +
                               cudaGetErrorName(e) + "); install an NVIDIA driver for CUDA 12 or later");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace tandem::kernels
