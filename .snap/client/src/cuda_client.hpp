// libtandem's GPU side (backend cuda): importing the daemon's cuMem allocations, describing client memory
// for registration, each communicator rank's control page and workspaces, the stream-ordered enqueue of ops,
// and the watcher that unblocks every stream when tandemd dies. Compiled only with TANDEM_HAVE_CUDA.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client_backend.hpp"
#include "tandem/common/descriptor.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/executor.hpp"
#include "tandem/kernels/fused_ops.hpp"

namespace tandem::client::gpu {

// The calling thread's current device, and its UUID ("GPU-...").
int currentDevice();
std::string deviceUuid(int ordinal);

// A cuMem allocation imported from its POSIX fd and mapped with read-write access for `accessDevice`.
class DeviceMapping {
 public:
  static std::unique_ptr<DeviceMapping> import(const Fd& fd, uint64_t bytes, int accessDevice);
  ~DeviceMapping();
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;
  void* ptr() const { return reinterpret_cast<void*>(va_); }
  uint64_t size() const { return size_; }

 private:
  DeviceMapping() = default;
  unsigned long long va_ = 0;
  uint64_t size_ = 0;
};

// How tandem_register describes `ptr` to the daemon.
struct RegisterDescription {
  int kind = 0;            // tandem.v1.RegisterKind: 1 CUDA_IPC, 2 CUDA_FD
  std::string ipcHandle;   // CUDA_IPC
  uint64_t offset = 0;     // of ptr from the allocation's base (IPC) or fd_offset (CUDA_FD)
  std::string deviceUuid;  // the GPU holding the memory
};
// fd >= 0: a cuMem allocation's POSIX fd, ptr at fdOffset in it. fd < 0: cudaMalloc memory (legacy IPC handle).
// Throws Error(kInvalidArgument) with what to do for host memory, VMM memory without an fd, or a bad range.
RegisterDescription describeForRegister(void* ptr, uint64_t bytes, int fd, uint64_t fdOffset);

// Each slot's device address in this process (buffer mapping + offset), in descriptor slot order; null = absent.
using DevicePointers = kernels::DevicePointers;

// libtandem's side of one communicator's executor strategy (tandem/kernels/executor.hpp): what this rank checks
// before it submits an op, and what it enqueues on the caller's stream. One implementation per strategy, in
// cuda_client.cpp.
class CommStrategy;

// One communicator rank's GPU state: its control page (mapped and registered for the GPU), and the strategy tandemd
// chose for the communicator. `mutex` serialises submission, so epochs follow ring order.
class CommGpu {
 public:
  // Where the op runs, as tandemd's JoinInfo.executor names it:
  //   kClient  libtandem launches the kernels into the caller's stream (gated by go, reporting done);
  //   kDaemon  tandemd runs it (the stream writes ready, waits for done): its persistent kernel, or the fused GEMMs'
  //            kernels on its own stream; MPS;
  //   kHost    the communicator spans nodes: tandemd runs the op itself, staged through host memory (the stream
  //            writes ready, waits for done, exactly as kDaemon); no workspaces.
  using Mode = kernels::Executor;
  // JoinInfo.executor ("client", "daemon", "host") as a Mode; throws Error(kProtocol) for anything else.
  static Mode modeOf(const std::string& executor);

  // `workspaces`: every rank's, in rank order (none in kHost mode). Throws Error (kProtocol, kSystem, kCuda).
  CommGpu(int device, Mode mode, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control, uint64_t controlBytes,
          std::vector<std::unique_ptr<DeviceMapping>> workspaces);
  ~CommGpu();
  CommGpu(const CommGpu&) = delete;
  CommGpu& operator=(const CommGpu&) = delete;

  int device() const { return device_; }
  // Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run `desc` (already checked by
  // validateDescriptor) here: the kind, dtype or executor, the kernels' shape and alignment rules, or the workspace.
  // Called before the op is submitted, so a refused op changes nothing. Depends only on what every rank checks alike
  // (global dims, the workspace size), except this rank's own k slice and pointers. With more than one rank and a
  // `stream` that is being captured into a CUDA graph, it refuses what cannot replay (captureRefusal,
  // common/graph_capture.hpp: the daemon and host executors, the ops without a device-epoch path) and returns true: the
  // op is then enqueued with enqueueCaptured, not submitted to tandemd.
  bool check(const OpDescriptor& desc, const DevicePointers& ptrs, void* stream) const;
  // Enqueues the stream work of op `epoch` (checked and submitted) on `stream` (a cudaStream_t; null = the legacy
  // default stream). Throws Error(kCuda) if CUDA refused part of it; the stream is then out of step with the peers.
  void enqueue(const OpDescriptor& desc, const DevicePointers& ptrs, uint64_t epoch, void* stream);
  // Enqueues a multi-rank op that `check` found captured (executor client): its entry and kernels in device-epoch mode
  // (kernels/include/tandem/kernels/op_entry.hpp), with no word tandemd reads or writes, so every replay runs it with
  // a fresh epoch from device memory. From here on this communicator's eager ops use device epochs too. Under `mutex`.
  // Throws Error(kCuda); the capture is then broken, the communicator unchanged.
  void enqueueCaptured(const OpDescriptor& desc, const DevicePointers& ptrs, void* stream);
  // The data error a replayed MoE op left in the control page since the last call (a bad expert id, too many rows),
  // as a message that names the op, the rank and the id or rows, and how many more replays failed after it; "" if
  // none. Taking it empties the slot. Under `mutex`.
  std::string takeReplayFault();
  // Whether an MoE op was captured (only their replays report data errors). Under `mutex`.
  bool capturedMoe() const { return !capturedMoe_.empty(); }
  // tandemd is gone: releases every wait of this rank's streams and kernels.
  void abortLocal();
  // tandemd is gone: set by the session's watcher before it takes `mutex` for abortLocal, so that a host wait under
  // `mutex` (waitRankRows) ends instead of holding the watcher off.
  std::atomic<bool> daemonGone{false};
  // The fused ops this rank launches itself run `key` with `plan`: executor client, the plan table's entry tandemd
  // sent with the join or a trial plan of tandemctl tune/advise; executor daemon, a trial plan for a one-rank
  // communicator's fused GEMMs (tandemd applies its table to what it runs). Under `mutex`.
  void setPlan(const PlanKey& key, const PlanChoice& plan);

  std::mutex mutex;
  uint64_t epoch = 0;  // ops submitted on this communicator by this rank (captured ops are not submitted)

 private:
  // Executor client, an op whose launch needs every rank's rows (GpuOp::needsRankRows): waits until tandemd published
  // them for op `epoch` (once every rank submitted it). nullopt when the communicator was aborted meanwhile or tandemd
  // is gone (the op's status says why; its kernels are skipped). Throws Error(kTimeout) past TANDEM_OP_TIMEOUT_MS.
  std::optional<std::array<uint64_t, kernels::kPageRanks>> waitRankRows(const OpDescriptor& d, uint64_t epoch) const;

  int device_;
  Mode mode_;
  // Declared in creation order, so destroyed in reverse: the strategy, then the registration, then the mapping.
  kernels::ControlPage page_;
  kernels::HostRegistration registration_;  // the page as this rank's streams and kernels address it
  std::unique_ptr<CommStrategy> strategy_;
  // Replays' data errors: the last captured descriptor of each MoE op (a fault's rows remedy needs its dims), and
  // how many dropped faults were already reported.
  std::map<OpKind, OpDescriptor> capturedMoe_;
  uint64_t replayFaultsDroppedSeen_ = 0;
};

// Watches the session's socket: when tandemd hangs up, aborts every communicator's streams.
class SessionWatch {
 public:
  explicit SessionWatch(int socketFd);
  ~SessionWatch();
  void add(const std::shared_ptr<CommGpu>& comm);

 private:
  void run();
  int socketFd_;
  Fd stop_;
  std::mutex mutex_;
  std::vector<std::weak_ptr<CommGpu>> comms_;
  bool lost_ = false;
  std::thread thread_;
};

// The cuda backend's client strategy (client_backend.hpp) for the session connected on `socketFd`: cuMem imports,
// registration by IPC handle or fd, a CommGpu per communicator rank, and a SessionWatch on the socket.
std::unique_ptr<ClientBackend> makeCudaBackend(int socketFd);

}  // namespace tandem::client::gpu
