// libtandem's side of tandemd's backend, one strategy per backend, chosen once when the session connects
// (makeClientBackend), as tandemd's Backend is (daemon/src/backend.hpp): where a buffer's memory lives in this process,
// how memory is described for registration, and what a communicator rank does around each submission. c_api.cpp
// calls these and never asks which backend it is talking to.
//
//   cpu      client_backend.cpp: buffers are the daemon's memfds mapped here; ops are submitted, nothing more.
//   cuda     cuda_client.cpp: buffers are the daemon's cuMem allocations imported here; each communicator rank checks
//            an op against its GPU and enqueues its stream work (cuda_client.hpp, CommGpu); a watch thread releases
//            every stream's waits when tandemd dies.
//   no-cuda  client_backend.cpp: tandemd runs the cuda backend but this libtandem was built without CUDA; every call
//            that would need CUDA fails with the remedy.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "session.hpp"
#include "tandem/common/descriptor.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/plan_key.hpp"

namespace tandem::client {

/// A buffer tandemd allocated, mapped in this process; unmapped when destroyed.
class BufferMemory {
 public:
  virtual ~BufferMemory() = default;
  virtual void* ptr() const = 0;
};

/// Each slot's address in this process (buffer mapping + offset), in descriptor slot order; null = absent.
using TensorPointers = std::array<void*, kMaxOpBuffers>;

/// One communicator rank's side of the backend (made by ClientBackend::attach). Called under the session's `life`
/// lock; thread-safe where the communicator may be used from several threads (submit, setPlan).
class CommExecutor {
 public:
  virtual ~CommExecutor() = default;
  /// Runs `submitToDaemon` (which sets the op's session and sequence number) for `desc`, validated, with what this
  /// rank checks before (a refused op changes nothing) and enqueues after on `stream` (a cudaStream_t; null = the
  /// legacy default stream). When the op is submitted but this rank cannot run its part, calls `abortComm` (so the
  /// peers need not wait for it until their deadline) and rethrows the cause. @throws Error
  virtual void submit(const OpDescriptor& desc, const TensorPointers& ptrs, void* stream,
                      const std::function<void()>& submitToDaemon, const std::function<void()>& abortComm) = 0;
  /// The fused ops this rank launches itself run `key` with `plan` (tandemctl tune and advise); a no-op where this
  /// rank launches nothing.
  virtual void setPlan(const PlanKey& key, const PlanChoice& plan) = 0;
  /// Where replays of ops captured into CUDA graphs can fail without failing the communicator (MoE data errors): a
  /// probe that returns the message of such a failure since it was last called ("" if none), for tandem_wait and
  /// tandem_op_status to report with the next eager op of the communicator; empty where no replay can. The probe may
  /// outlive this executor (it then returns ""). Thread-safe.
  virtual std::function<std::string()> replayFaultProbe() const { return {}; }
};

/// The session's strategy. Lives as long as the session's core; used under its `life` lock.
class ClientBackend {
 public:
  virtual ~ClientBackend() = default;

  /// tandem_alloc: completes `request` (the GPU to allocate on) and returns what mapAllocation takes back (the
  /// device; -1 where none). @throws Error
  virtual int prepareAllocate(v1::AllocateBuffer& request) const = 0;
  /// Maps the allocation tandemd sent (`fd`, `reply`) in this process. @throws Error
  virtual std::unique_ptr<BufferMemory> mapAllocation(const Fd& fd, const v1::AllocateBufferReply& reply,
                                                      int device) const = 0;

  /// Whether registrations of the same range share one buffer handle (and so one registration in tandemd).
  virtual bool sharesRegistrations() const = 0;
  /// tandem_register: describes [ptr, ptr + bytes), backed by `fd` at `fdOffset` (tandem.h says when each is
  /// needed), in `request`. @throws Error(kInvalidArgument) with what to pass instead
  virtual void describeRegistration(v1::RegisterBuffer& request, void* ptr, uint64_t bytes, int fd,
                                    uint64_t fdOffset) const = 0;

  /// tandem_comm_init: completes `join` (this rank's GPU) and returns what attach takes back (the device; -1 where
  /// none). @throws Error
  virtual int prepareJoin(v1::JoinCommunicator& join) const = 0;
  /// The fds tandemd's JoinCommunicatorReply carries on this backend.
  virtual std::size_t joinFds() const = 0;
  /// Sets up this rank's side of the communicator `handle` that `reply` (with `fds`) joined; may ask tandemd more
  /// through `session`. On a throw the caller destroys the communicator. @throws Error
  virtual std::unique_ptr<CommExecutor> attach(Session& session, uint64_t handle, uint32_t rank, uint32_t nranks,
                                               const v1::JoinCommunicatorReply& reply, std::vector<Fd>& fds,
                                               int device) = 0;
  /// tandemd's name for the communicator's executor (JoinCommunicatorReply.executor), as tandemctl prints it.
  virtual std::string executorName(const v1::JoinCommunicatorReply& reply) const = 0;

  /// tandem_disconnect, before the session's socket closes: stops watching it. Idempotent.
  virtual void close() = 0;
};

/// The strategy for the backend `session` runs (Session::backend()), made once at connect.
std::unique_ptr<ClientBackend> makeClientBackend(const Session& session);

}  // namespace tandem::client
