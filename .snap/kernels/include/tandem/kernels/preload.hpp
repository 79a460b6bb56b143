// Loading tandem's kernels up front (host-only header).
//
// Under CUDA's lazy module loading (the default since CUDA 12.2) a kernel is loaded at its first launch, and loading
// may wait for the whole context to go idle. A stream of that context blocked on one of tandem's waits (a peer's flag,
// the daemon's done counter, a fused kernel spinning on a peer) then never goes idle, and the launch hangs forever.
// So every process that launches tandem kernels loads all of them on each device it uses before its first op:
// communicator setup calls these. They are idempotent and cheap after the first call per device.
#pragma once

namespace tandem::kernels {

// The runtime's kernels, in tandem_runtime_kernels: AllGather's (allgather.cu) and the daemon executor's persistent
// kernel (persistent.cu), and the op entry of device-epoch mode (op_entry.cu, op_entry.hpp).
void preloadAllGatherKernels(int device);
void preloadPersistentKernels(int device);
void preloadOpEntryKernel(int device);
inline void preloadRuntimeKernels(int device) {
  preloadAllGatherKernels(device);
  preloadPersistentKernels(device);
  preloadOpEntryKernel(device);
}
// Each fused GEMM family: in tandem_kernels.
void preloadGemmKernels(int device);
void preloadAgGemmKernels(int device);
void preloadGemmRsKernels(int device);
void preloadGemmArKernels(int device);

}  // namespace tandem::kernels
