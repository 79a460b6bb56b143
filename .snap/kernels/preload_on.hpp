// preloadOn (host code, private to kernels/): used by each kernel family's preload function (tandem/kernels/preload.hpp says why).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace tandem::kernels {

// Loads `fns` on `device` now (cudaFuncGetAttributes loads a lazily loaded kernel); see preload.hpp.
template <class Fn, std::size_t N>
void preloadOn(int device, const Fn (&fns)[N], const char* what) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  for (Fn fn : fns) {
    cudaFuncAttributes fa{};
    const cudaError_t e = cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn));
    if (e != cudaSuccess) {
      cudaSetDevice(previous);
      throw std::runtime_error(std::string(what) + ": loading a kernel failed: " + cudaGetErrorString(e));
    }
  }
  cudaSetDevice(previous);
}

}  // namespace tandem::kernels
