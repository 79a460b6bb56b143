// Host support shared by the launchers of the grouped GEMM's kernels (tiled, swap-AB, wgrad, FP8): CUDA errors named
// for the kernel family, cached tensor maps, loading a kernel once per device, and the pointer checks of their rules.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "tandem/kernels/tensor_map_cache.hpp"

namespace tandem::kernels {

/// @throws tandem::Error kCuda "{family}: {what} failed [-> name: text]" when e is not cudaSuccess.
void checkCudaFor(const char* family, cudaError_t e, const char* what);

/// The tensor map of `k` from a process-wide cache (tensor_map_cache.hpp), encoded on first use.
/// @throws tandem::Error kCuda naming the family, `what` (the operand) and the map's shape when encoding fails.
CUtensorMap cachedTensorMap(const char* family, const TensorMapKey& k, const char* what = "a tensor");

/// Once per (family, device, variant): checks that `device` is sm_90 (the family's kernels use wgmma and TMA), runs
/// `load` (raise the kernel's dynamic shared-memory limit, which also loads it) and returns the device's SM count;
/// later calls return the cached count. Thread-safe. `family` names the kernels in errors ("grouped gemm").
/// @throws tandem::Error kCuda (not an sm_90 device, or a CUDA call failed).
int prepareOnce(const char* family, int device, uint32_t variant, const std::function<cudaError_t()>& load);

/// Whether `p` is a multiple of `a` bytes.
inline bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

/// Whether the byte ranges [a, a + na) and [b, b + nb) intersect (a null or empty range intersects nothing).
inline bool overlaps(const void* a, uint64_t na, const void* b, uint64_t nb) {
  if (a == nullptr || b == nullptr || na == 0 || nb == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + nb && pb < pa + na;
}

}  // namespace tandem::kernels
