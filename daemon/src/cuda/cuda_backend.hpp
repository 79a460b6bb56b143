// backend: cuda. GPU memory (cuMem, exported as POSIX fds), client registrations (legacy IPC handles and
// cuMem fds), per-communicator workspaces and control pages, and the two executors:
//   client: libtandem launches kernels into the caller's stream; the daemon validates each collective and
//           writes the verdict and `go` into every rank's control page, then learns completion from `done`;
//   daemon: gang-ready dispatch into each GPU's persistent kernel (daemon_executor.hpp); needs MPS.
// Communicators whose ranks span nodes (client executor only) run staged through host memory (cuda_multinode.hpp).
// CUDA-only: compiled when TANDEM_HAVE_CUDA.
#pragma once

#include <memory>

#include "config.hpp"
#include "engine.hpp"

namespace tandem::daemon::cuda {

// Finds the GPUs (cuda.devices restricts them), enables peer access, and resolves daemon.executor: auto is
// daemon when an MPS control daemon is reachable, else client. Throws Error(kUnavailable) with a clear message
// when no GPU is usable or executor daemon is asked for without MPS. Call before any other CUDA use.
std::unique_ptr<Backend> makeCudaBackend(const DaemonConfig& config);

// Before any CUDA call: sets CUDA_MODULE_LOADING=EAGER when the daemon executor may be chosen (its resident
// kernel must never wait for a lazily loaded module).
void prepareEnvironment(const DaemonConfig& config);

// Number of visible CUDA devices; 0 (with the reason) on any error. Does not create contexts.
int visibleDeviceCount(std::string* why);

}  // namespace tandem::daemon::cuda
