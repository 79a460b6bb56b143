// Loading a Hopper kernel family once per device: the sm_90 check, the dynamic shared-memory limit and the SM count,
// shared by the launchers that keep a kernel per variant (the grouped GEMM's tiled and swap-AB paths, its wgrad).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace tandem::kernels {

/// Once per (family, device, variant): checks that `device` is sm_90 (the family's kernels use wgmma and TMA), runs
/// `load` (raise the kernel's dynamic shared-memory limit, which also loads it) and returns the device's SM count;
/// later calls return the cached count. Thread-safe. `family` names the kernels in errors ("grouped gemm").
/// @throws tandem::Error kCuda (not an sm_90 device, or a CUDA call failed).
int prepareOnce(const char* family, int device, uint32_t variant, const std::function<cudaError_t()>& load);

}  // namespace tandem::kernels
