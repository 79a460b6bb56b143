// The boundary between the engine and a backend (cpu, cuda): what a backend is asked to do, and the plain data
// that crosses it. The engine owns sessions, buffers, communicators and the pump; a backend allocates and
// registers memory, resolves buffers into its executor's address space, and executes collectives.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "state.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem::daemon {

// A device became unusable (a sticky CUDA error, a poisoned MPS server). A backend's poll() throws it; the daemon
// then fails every session, logs the reason, and exits non-zero so that systemd restarts it. Nothing below the
// top of the daemon decides to exit.
class FatalBackendError : public Error {
 public:
  explicit FatalBackendError(std::string message) : Error(ErrorCode::kInternal, std::move(message)) {}
};

class Cluster;
class CommLink;
class PlanTable;
namespace transport {
class DeviceCopier;
}

struct GpuPeerInfo {
  std::string uuid;
  uint32_t nvlinks = 0;  // active NVLink links to this peer (0 when NVML is unavailable or the link is PCIe)
  bool p2p = false;      // peer access enabled
};
struct GpuInfo {
  int ordinal = -1;  // the daemon's own ordinal: never sent to clients as an identity
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
  std::string name;
  std::string pciBusId;
  uint32_t sms = 0;
  uint64_t memoryBytes = 0;
  uint32_t ccMajor = 0, ccMinor = 0;
  bool mps = false;  // contexts on this GPU are shared through MPS
  std::vector<GpuPeerInfo> peers;
};

// tandem_register's memory, as the request describes it.
struct RegisterRequest {
  enum class Kind { kMemfd = 0, kCudaIpc = 1, kCudaFd = 2 };
  Kind kind = Kind::kMemfd;
  Fd fd;                   // kMemfd, kCudaFd
  uint64_t offset = 0;     // byte offset of the range in the file (kMemfd), IPC allocation or cuMem allocation
  uint64_t bytes = 0;
  std::string ipcHandle;   // kCudaIpc: the 64 bytes of a cudaIpcMemHandle_t
  std::string deviceUuid;  // cuda kinds: the GPU holding the memory
};

// What a joining rank learns besides the communicator handle (cuda backend; empty on cpu).
struct JoinInfo {
  std::string executor;       // "client" or "daemon"
  int controlFd = -1;         // the rank's control page (memfd); valid while the callback runs
  uint64_t controlBytes = 0;
  uint64_t workspaceBytes = 0;
  uint32_t commCtas = 0;      // cuda.comm_sms (0 = the kernels' default)
};
// One rank's workspace, for the client to map (GetCommMapping).
struct CommMapping {
  int fd = -1;  // valid while the caller holds `keepAlive`
  uint64_t bytes = 0;
  std::string deviceUuid;
  std::shared_ptr<CommResources> keepAlive;
};

// One collective: an op from every rank (ops[r] is rank r), checked together. `errorCode` != 0: rejected;
// every rank completes with `error` and nothing runs.
struct Collective {
  std::vector<PendingOp> ops;               // every rank's; remote ranks' ops carry only their descriptor
  uint64_t commHandle = 0;
  std::shared_ptr<CommResources> resources;
  std::shared_ptr<void> owner;              // keeps the communicator (and opsCompleted) alive
  std::atomic<uint64_t>* opsCompleted = nullptr;
  int32_t errorCode = 0;
  std::string error;
  std::shared_ptr<CommLink> link;           // multi-node communicators: staging and executor thread
  std::vector<uint32_t> nodeOfRank;         // multi-node: node index of every rank
  uint64_t epoch = 0;                       // the collective's position on the communicator (1, 2, ...)
};

// Where ops run. The engine owns sessions, buffers, communicators and the pump; a backend allocates and
// registers memory, resolves buffers into its executor's address space, and executes collectives.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;      // "cpu", "cuda": for messages and status, never to branch on
  virtual const char* executor() const = 0;  // "host", "client", "daemon"
  // The ops this backend runs on a communicator (null: before one exists, for the join check). The engine refuses
  // any other op when its descriptor is admitted, with unsupportedOpMessage(name(), ops(comm), kind).
  virtual OpSet ops(const CommResources* comm) const = 0;
  // True when the backend's buffers are host memory the daemon maps (cpu): tandem_register then takes a memfd.
  virtual bool hostMemory() const { return false; }
  virtual std::vector<GpuInfo> gpus() const { return {}; }
  // How the cluster's transport copies between this backend's GPU memory and the host (tcp stages kDevice regions
  // through it); null for a backend without GPU memory. The cluster keeps it as long as its transport.
  virtual std::shared_ptr<transport::DeviceCopier> deviceCopier() { return nullptr; }
  virtual void start() {}
  virtual void stop() {}
  // The plan table (plan_table.hpp), before start(): a backend that runs plans looks every fused op up in it.
  virtual void attachPlans(std::shared_ptr<PlanTable> /*plans*/) {}

  // Memory. The engine charges buffer->accountedBytes to the session and enforces the limits.
  virtual std::shared_ptr<Buffer> allocate(uint64_t bytes, const std::string& deviceUuid) = 0;
  virtual std::shared_ptr<Buffer> registerMemory(RegisterRequest& request) = 0;
  // The first byte of `buffer` + offset in the executor's address space.
  virtual std::byte* resolve(const Buffer& buffer, uint64_t offset) const = 0;

  // Communicators. checkJoin throws for a rank the backend cannot serve; setupComm runs when the last rank
  // joins (engine lock held) and may throw, failing every joiner.
  virtual void checkJoin(const std::string& /*deviceUuid*/) {}
  virtual std::shared_ptr<CommResources> setupComm(const Communicator&) { return nullptr; }
  virtual uint64_t commBytesPerRank(const CommResources&) const { return 0; }
  virtual JoinInfo joinInfo(const CommResources&, uint32_t /*rank*/) const { return {}; }
  virtual CommMapping mapping(const std::shared_ptr<CommResources>&, uint32_t /*rank*/) const { return {}; }
  // The communicator failed or ended: release every rank's waits (engine lock held).
  virtual void abortComm(CommResources&, ErrorCode /*code*/, const std::string& /*reason*/) {}
  // Local rank `rank` left a communicator with nothing of it queued in the engine (engine lock held). A backend
  // that can tell the rank finished its part of every op in flight lets those ops finish on the other ranks;
  // otherwise (and by default) it aborts as abortComm does. Every later op fails either way.
  virtual void leaveComm(CommResources& res, uint32_t /*rank*/, ErrorCode code, const std::string& reason) {
    abortComm(res, code, reason);
  }
  virtual void sessionClosed(uint64_t /*sessionId*/) {}

  // Executes (or rejects) a collective; must not block. Completes every rank exactly once, now or later.
  // Returns true when the communicator may dispatch its next collective at once; false means the backend
  // calls `finished` (without the engine lock) when it may.
  virtual bool execute(Collective collective, std::function<void()> finished) = 0;
  // Pump hook: progresses in-flight work. Appends (comm handle, reason) for communicators that must fail.
  virtual bool poll(std::vector<std::pair<uint64_t, std::string>>& /*failed*/) { return false; }
  virtual bool busy() const { return false; }  // the pump must keep polling
};

}  // namespace tandem::daemon
