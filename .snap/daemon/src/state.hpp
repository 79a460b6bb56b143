// The daemon's shared state: sessions, their buffers, and communicators. The control thread (Server)
// creates and destroys these; the Engine's pump resolves descriptors against them. One mutex guards the
// maps; the memory itself is reference-counted so an op in flight keeps a freed buffer's mapping alive.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "tandem/common/ranked_mutex.hpp"
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"
#include "tandem/common/descriptor.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/ring.hpp"

namespace tandem::daemon {

// Memory a backend owns behind a Buffer or a communicator (cuda: a cuMem allocation, or a client's memory
// imported into the daemon). Destroying it unmaps and releases; whoever still holds the shared_ptr (an op in
// flight) keeps it alive.
struct DeviceMemory {
  virtual ~DeviceMemory() = default;
  uint64_t address = 0;  // the buffer's first byte in the daemon's (executor's) address space
  int device = -1;       // the daemon's device ordinal
};

// Memory the daemon has mapped: an allocation it made (memfd or GPU memory) or a client registration.
struct Buffer {
  uint64_t id = 0;
  uint64_t sessionId = 0;
  uint64_t bytes = 0;
  bool registered = false;  // tandem_register (client-owned memory) rather than tandem_alloc
  Fd fd;                    // cpu: the memfd; cuda allocations: the cuMem POSIX fd exported to the client
  Mapping mapping;          // cpu only
  std::shared_ptr<DeviceMemory> device;  // cuda only
  uint64_t accountedBytes = 0;  // charged to the session: bytes rounded up to the allocation granularity
  uint64_t mappedBytes = 0;     // cuda allocations: the size the client maps (granularity-aligned)
  std::string deviceUuid;       // cuda: the GPU holding the memory
};

// Per-communicator state a backend attaches once every rank has joined (cuda: workspaces, control pages).
struct CommResources {
  virtual ~CommResources() = default;
};

// A session's ring region, the producer side of its completion ring, and its two wakeup channels (WakeupPair):
// completions (the daemon rings the client) and submissions (the client rings the pump). Each session has its own
// pair of each, so no client can steal, block or delay another's wakeups.
class SessionChannel {
 public:
  // maxPending: completions queued beyond the ring (limits.max_pending_completions); past it the session is
  // marked overflowed and the pump closes it.
  SessionChannel(uint64_t sessionId, uint32_t capacity, uint32_t maxPending);
  uint64_t sessionId() const { return sessionId_; }
  int ringFd() const { return ringFd_.get(); }
  // The client's ends, sent to it in the session's first reply.
  int completionEventFd() const { return completionWake_.clientEnd.get(); }
  int submitEventFd() const { return submitWake_.clientEnd.get(); }
  // Once the client has them (the reply that carried them is sent or holds copies), the daemon keeps only its own
  // ends and the ring's mapping: three fds fewer per session.
  void releaseClientFds() {
    ringFd_.reset();
    completionWake_.clientEnd.reset();
    submitWake_.clientEnd.reset();
  }
  // The pump's end of the submission wakeups.
  int pumpWakeFd() const { return submitWake_.daemonEnd.get(); }
  uint64_t ringBytes() const { return mapping_.size(); }
  SpscRing<OpDescriptor>& submissions() { return rings_.submission; }

  // Posts a completion; never blocks. When the ring is full (the client is not draining), it queues and
  // flushPending() retries; past maxPending queued completions it drops the new one and marks the session
  // overflowed (the pump then closes it: a client that never drains cannot grow the daemon). Thread-safe.
  void complete(uint64_t seq, int32_t status, std::string_view message);
  void flushPending();
  bool overflowed() const { return overflowed_.load(std::memory_order_relaxed); }
  uint64_t completed() const { return completed_; }

  // Descriptors popped from the ring that wait for other ranks. The pump stops popping this session's ring
  // at the ring's capacity, so a rank that races ahead fills its own ring (back-pressure) instead of the
  // daemon's memory.
  std::atomic<uint32_t> queued{0};
  // Set by the pump when it reports the session's fault (overflow, corrupt ring) so it reports it once.
  std::atomic<bool> faultReported{false};
  uint32_t capacity() const { return static_cast<uint32_t>(rings_.submission.capacity()); }

 private:
  bool tryPostLocked(const Completion& c);
  uint64_t sessionId_;
  uint32_t maxPending_;
  Fd ringFd_;
  Mapping mapping_;
  SessionRings rings_;
  WakeupPair completionWake_;
  WakeupPair submitWake_;
  RankedMutex mutex_{LockRank::kChannel, "SessionChannel"};  // one producer at a time on the completion ring
  std::deque<Completion> overflow_;
  std::atomic<bool> overflowed_{false};
  uint64_t completed_ = 0;
};

// Descriptors the daemon holds for every session besides its buffers': the control socket and its ends of the two
// wakeup socket pairs (the ring memfd and the client's ends are closed once sent: SessionChannel::releaseClientFds).
inline constexpr uint64_t kFdsPerSession = 3;

struct SessionState {
  uint64_t id = 0;
  uint32_t pid = 0, uid = 0, gid = 0;
  std::map<uint64_t, std::shared_ptr<Buffer>> buffers;
  uint64_t bytes = 0;      // allocations and registrations, against limits.max_session_bytes
  uint32_t bufferFds = 0;  // buffers that hold an fd, against limits.max_fds_per_session
  std::shared_ptr<SessionChannel> channel;
  std::vector<uint64_t> comms;  // handles joined
  std::map<uint64_t, uint64_t> commBytes;  // per communicator handle: workspace bytes charged to this session
  bool alive = true;
};

// One op submitted by one rank, resolved: buffers pinned by shared_ptr so a concurrent free cannot unmap
// them under the executor. A rank on another node (multi-node communicator) is represented by its
// descriptor alone: no buffers and no channel; its own node completes it.
struct PendingOp {
  OpDescriptor desc{};
  std::array<std::shared_ptr<Buffer>, kMaxOpBuffers> buffers{};
  std::shared_ptr<SessionChannel> channel;  // null for a remote rank
  bool local() const { return channel != nullptr; }
  std::string error;        // non-empty: this rank's descriptor was rejected (the whole collective fails)
  int32_t errorCode = 0;
  uint64_t epoch = 0;       // the rank's n-th descriptor on the communicator (1, 2, ...); equal across a gang
};

struct Communicator {
  enum class State { kJoining, kReady, kAborted, kPeerLost, kDestroyed };
  uint64_t handle = 0;
  std::array<uint8_t, 16> uniqueId{};
  uint32_t nranks = 0;
  std::vector<std::optional<uint64_t>> members;  // session id per rank on this node
  std::vector<std::optional<uint32_t>> remote;   // node index per rank on another node (multi-node)
  State state = State::kJoining;
  std::string reason;  // why it is no longer ready
  std::vector<std::deque<PendingOp>> queues;  // per rank, in submission order
  std::vector<uint64_t> submitted;            // per rank: descriptors accepted into the queue (the last epoch)
  std::vector<std::string> devices;           // per rank: GPU UUID it joined with (cuda backend)
  uint64_t workspaceBytes = 0;  // the largest workspace per rank a joiner asked for (0: the backend's default)
  std::shared_ptr<CommResources> resources;   // backend state, set when the communicator becomes ready
  std::atomic<uint64_t> opsCompleted{0};
  uint32_t joined() const;       // ranks known, local and remote
  uint32_t localRanks() const;   // ranks whose sessions are on this node
  bool spansNodes() const;       // some rank lives on another node
  std::vector<uint32_t> nodes(uint32_t self) const;  // ascending node indices of every rank (self included)
};
const char* commStateName(Communicator::State state);

}  // namespace tandem::daemon
