// libtandem's GPU side (backend cuda): importing the daemon's cuMem allocations, describing client memory
// for registration, each communicator rank's control page and workspaces, the stream-ordered enqueue of ops,
// and the watcher that unblocks every stream when tandemd dies. Compiled only with TANDEM_HAVE_CUDA.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/fd.hpp"

namespace tandem::kernels {
struct CommControl;
}

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
using DevicePointers = std::array<void*, kMaxOpBuffers>;

// Where the ops keep, in every rank's workspace, what peers write or read. The same on every rank and fixed for the
// communicator's life: tandemd zeroes the workspace once and flags are never reset, so no op's data may ever land
// where another op keeps flags. Computed from the workspace size (tandemd's per-rank byte budget).
//   [0, allgather)  AllGather: header and chunk slots (kernels::workspaceBytes)
//   ag-gemm flags   arrive and chunk flags (agFlagWords uint64)
//   gemm-rs/ar      the kernels' fixed layout (gemmRsFixedWorkspaceBytes): flags, then inbox and outbox, each
//                   double-buffered by epoch parity, matrices of rsMatBytes
//   data            2 * rsMatBytes: ag-gemm's gathered A, or gemm-rs/ar's output staging
// The gemm-rs/ar inbox receives peers' partials of op e + 1 while this rank may still run op e, so it shares no byte
// with the other ops. Gathered A and the output staging share: peers write them only once this rank has started the
// op (ag-gemm pushes after the destination's arrive flag; a reduced tile needs the destination's own partial first).
struct WorkspaceLayout {
  uint64_t agFlagsOff = 0, agFlagWords = 0;
  uint64_t rsOff = 0, rsMatBytes = 0;
  uint64_t dataOff = 0, dataBytes = 0;
  // The largest layout that fits `bytes` per rank.
  static WorkspaceLayout fit(uint64_t bytes, uint32_t nranks);
  // Workspace bytes per rank whose layout holds `matBytes` matrices (rounded up to tandemd's 2 MiB granularity).
  static uint64_t bytesFor(uint64_t matBytes, uint32_t nranks);
};

// One communicator rank's GPU state. `mutex` serialises submission, so epochs follow ring order.
class CommGpu {
 public:
  // Where the op runs (tandemd's JoinInfo.executor):
  //   kClient  libtandem launches the kernels into the caller's stream (gated by go, reporting done);
  //   kDaemon  tandemd's persistent kernel runs it (the stream writes ready, waits for done); MPS;
  //   kHost    the communicator spans nodes: tandemd runs the op itself, staged through host memory (the stream
  //            writes ready, waits for done, exactly as kDaemon); no workspaces.
  enum class Mode { kClient, kDaemon, kHost };
  // JoinInfo.executor ("client", "daemon", "host") as a Mode; throws Error(kProtocol) for anything else.
  static Mode modeOf(const std::string& executor);

  // `workspaces`: every rank's, in rank order (none in kHost mode).
  CommGpu(int device, Mode mode, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control, uint64_t controlBytes,
          std::vector<std::unique_ptr<DeviceMapping>> workspaces);
  ~CommGpu();
  CommGpu(const CommGpu&) = delete;
  CommGpu& operator=(const CommGpu&) = delete;

  int device() const { return device_; }
  Mode mode() const { return mode_; }
  // Throws Error (kUnsupported, kInvalidArgument) with the remedy when this rank cannot run `desc` (already checked by
  // validateDescriptor) here: the kind, dtype or executor, the kernels' shape and alignment rules, or the workspace.
  // Called before the op is submitted, so a refused op changes nothing. Depends only on what every rank checks alike
  // (global dims, the workspace size), except this rank's own k slice and pointers.
  void check(const OpDescriptor& desc, const DevicePointers& ptrs) const;
  // Enqueues the stream work of op `epoch` (checked and submitted) on `stream` (a cudaStream_t; null = the legacy
  // default stream). Throws Error(kCuda) if CUDA refused part of it; the stream is then out of step with the peers.
  void enqueue(const OpDescriptor& desc, const DevicePointers& ptrs, uint64_t epoch, void* stream);
  // tandemd is gone: releases every wait of this rank's streams and kernels.
  void abortLocal();

  std::mutex mutex;
  uint64_t epoch = 0;  // ops submitted on this communicator by this rank

 private:
  // Rank r's workspace, `offset` bytes in, as mapped here.
  char* workspace(uint32_t r, uint64_t offset) const;
  // Bytes the layout's matrices must hold for `desc` (0: the op needs no workspace).
  uint64_t matBytesNeeded(const OpDescriptor& desc) const;
  // The op's kernels (and copies) on `stream`, between the stream words that order it; each returns the plan it ran.
  void launchAllGather(const OpDescriptor& desc, const DevicePointers& ptrs, uint64_t epoch, void* stream);
  std::string launchAgGemm(const OpDescriptor& desc, const DevicePointers& ptrs, uint64_t epoch, void* stream);
  std::string launchGemmReduce(const OpDescriptor& desc, const DevicePointers& ptrs, uint64_t epoch, void* stream);

  int device_;
  Mode mode_;
  uint32_t rank_, nranks_, maxCtas_;
  Fd controlFd_;
  void* controlMap_ = nullptr;
  uint64_t controlBytes_ = 0;
  kernels::CommControl* ctl_ = nullptr;      // host view
  kernels::CommControl* ctlDev_ = nullptr;   // device view of the same pages
  bool registered_ = false;
  std::vector<std::unique_ptr<DeviceMapping>> workspaces_;
  uint64_t workspaceBytes_ = 0;  // the smallest rank's workspace: the layout must be the same on every rank
  WorkspaceLayout layout_;
  uint64_t timeoutNs_;
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

}  // namespace tandem::client::gpu
