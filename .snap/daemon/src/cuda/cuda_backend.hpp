// backend: cuda. GPU memory (cuMem, exported as POSIX fds), client registrations (legacy IPC handles and
// cuMem fds), and communicators, each run by one executor strategy chosen when it is set up (cuda_comm.hpp):
//   client (client_gate.hpp): libtandem launches kernels into the caller's stream; tandemd validates each collective
//           and writes the verdict and `go` into every rank's control page, then learns completion from `done`;
//   daemon (daemon_executor.hpp): gang-ready dispatch into each GPU's persistent kernel; needs MPS;
//   host (cuda_multinode.hpp): communicators whose ranks span nodes (either executor): the exchange staged through
//           host memory, the GEMMs on the GPUs.
// CUDA-only: compiled when TANDEM_HAVE_CUDA.
#pragma once

#include <memory>

#include "backend.hpp"
#include "config.hpp"

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
