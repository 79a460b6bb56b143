// The cuda backend's view of the node's GPUs, and its GPU memory: discovery by UUID, peer access, MPS,
// and cuMem allocations exported as POSIX fds or imported from clients. CUDA-only (TANDEM_HAVE_CUDA).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/gpu_uuid.hpp"

namespace tandem::daemon::cuda {

// Case-insensitive, with or without the "GPU-" prefix.
bool sameUuid(const std::string& a, const std::string& b);

// The visible GPUs, restricted to `only` (UUIDs) when it is not empty; enables peer access between them and
// reads NVLink counts through NVML when the driver has it. Throws Error(kUnavailable) with the reason when no
// GPU is usable (no driver, no device, or `only` names one that is not visible).
std::vector<GpuInfo> discoverGpus(const std::vector<std::string>& only);

// Whether an MPS control daemon's pipe is there ($CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps).
bool mpsControlReachable(std::string* pipeDir = nullptr);

// A cuMem allocation on one GPU, mapped into the daemon with access for `access` devices.
struct CuMemAllocation final : DeviceMemory {
  CUmemGenericAllocationHandle handle = 0;
  uint64_t size = 0;     // mapped bytes (granularity-aligned)
  CUdeviceptr va = 0;
  ~CuMemAllocation() override;
};

// Creates `bytes` (rounded up to the recommended granularity) on `device`, exportable as a POSIX fd, maps it
// for every device in `access`, and returns the allocation and its exported fd.
std::shared_ptr<CuMemAllocation> createExportable(int device, uint64_t bytes, const std::vector<int>& access,
                                                  Fd* exported);
// Imports a client's cuMem allocation from its POSIX fd and maps the first `bytes` (granularity-rounded).
std::shared_ptr<CuMemAllocation> importFd(const Fd& fd, uint64_t bytes, const std::vector<int>& access);

// A client's cudaMalloc memory opened with cudaIpcOpenMemHandle; one per distinct handle in the daemon
// (a handle may be opened only once per process), shared by every registration of it.
struct IpcMapping;
struct IpcImport final : DeviceMemory {
  std::shared_ptr<IpcMapping> mapping;
};
std::shared_ptr<IpcImport> openIpc(const std::string& handleBytes, int device, uint64_t offset, uint64_t bytes);

}  // namespace tandem::daemon::cuda
