#include "engine.hpp"

#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "cluster.hpp"
#include "cpu/cpu_backend.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon {
namespace {

using Clock = std::chrono::steady_clock;

std::string hexId(const std::array<uint8_t, 16>& id) {
  std::string s;
  for (int i = 0; i < 4; ++i) s += fmt::format("{:02x}", id[i]);
  return s + "…";
}

int32_t statusOf(ErrorCode code) { return static_cast<int32_t>(wireCode(code)); }

v1::PeerMessage leaveMessage(const std::array<uint8_t, 16>& uniqueId, uint32_t rank) {
  v1::PeerMessage m;
  auto* l = m.mutable_leave();
  l->set_unique_id(uniqueId.data(), uniqueId.size());
  l->set_rank(rank);
  return m;
}

// The communicator failed on this node: the others fail it too, after the collectives this node finished
// (up to completedEpoch).
v1::PeerMessage failMessage(const std::array<uint8_t, 16>& uniqueId, ErrorCode code, const std::string& reason,
                            uint64_t completedEpoch) {
  v1::PeerMessage m;
  auto* f = m.mutable_fail();
  f->set_unique_id(uniqueId.data(), uniqueId.size());
  f->set_code(static_cast<v1::StatusCode>(wireCode(code)));
  f->set_reason(reason);
  f->set_completed_epoch(completedEpoch);
  return m;
}

std::array<uint8_t, 16> uniqueIdOf(const std::string& bytes) {
  std::array<uint8_t, 16> id{};
  if (bytes.size() != id.size()) fail(ErrorCode::kProtocol, "a peer sent a communicator id of {} bytes", bytes.size());
  std::memcpy(id.data(), bytes.data(), id.size());
  return id;
}

}  // namespace



Engine::Engine(const DaemonConfig& config, std::unique_ptr<Backend> backend)
    : config_(config), backend_(backend ? std::move(backend) : makeCpuBackend(config)), pumpEvent_(Fd::eventfd()) {}

Engine::~Engine() { stop(); }

void Engine::start() {
  running_ = true;
  backend_->start();
  pump_ = std::thread([this] { pumpLoop(); });
}

void Engine::stop() {
  if (!running_.exchange(false)) return;
  signalEventfd(pumpEvent_.get());
  if (pump_.joinable()) pump_.join();
  backend_->stop();  // cpu: running ops finish first
  std::lock_guard lock(mutex_);
  for (auto& [handle, entry] : comms_) {
    failCommLocked(*entry, Communicator::State::kAborted, ErrorCode::kAborted, "tandemd is shutting down");
  }
}

// ---- sessions ----------------------------------------------------------------------------------------

std::shared_ptr<SessionChannel> Engine::openSession(uint64_t sessionId, uint32_t pid, uint32_t uid, uint32_t gid) {
  auto channel =
      std::make_shared<SessionChannel>(sessionId, config_.rings.capacity, config_.limits.maxPendingCompletions);
  std::lock_guard lock(mutex_);
  SessionState& s = sessions_[sessionId];
  s.id = sessionId;
  s.pid = pid;
  s.uid = uid;
  s.gid = gid;
  s.channel = channel;
  ++sessionsGeneration_;
  signalEventfd(pumpEvent_.get());  // a sleeping pump must start watching the new ring now, not after its timeout
  return channel;
}

SessionState& Engine::sessionLocked(uint64_t sessionId) {
  auto it = sessions_.find(sessionId);
  if (it == sessions_.end()) fail(ErrorCode::kInternal, "session {} is not open", sessionId);
  return it->second;
}

void Engine::closeSession(uint64_t sessionId, const std::string& why) {
  std::lock_guard lock(mutex_);
  auto it = sessions_.find(sessionId);
  if (it == sessions_.end()) return;
  SessionState& s = it->second;
  s.alive = false;
  const std::string reason = fmt::format("rank's session {} (pid {}) ended: {}", sessionId, s.pid, why);
  for (uint64_t handle : std::vector<uint64_t>(s.comms)) {
    leaveCommLocked(sessionId, handle, Communicator::State::kPeerLost, ErrorCode::kPeerLost, reason);
  }
  // Joins still waiting from this session.
  for (auto& [handle, entry] : comms_) {
    for (auto j = entry->joins.begin(); j != entry->joins.end();) {
      if (j->second.sessionId == sessionId) {
        entry->comm.members[j->first].reset();
        tellPeersLocked(entry->comm, leaveMessage(entry->comm.uniqueId, j->first));
        j = entry->joins.erase(j);
      } else {
        ++j;
      }
    }
  }
  backend_->sessionClosed(sessionId);
  spdlog::info("session {} closed ({}); reclaimed {} buffers, {} bytes", sessionId, why, s.buffers.size(), s.bytes);
  sessions_.erase(it);
  ++sessionsGeneration_;
}

size_t Engine::sessionCount() const {
  std::lock_guard lock(mutex_);
  return sessions_.size();
}

// ---- memory ------------------------------------------------------------------------------------------

// The session's limits, checked before the backend allocates or maps anything and again (under the lock that adds
// the buffer) after: registrations count against max_session_bytes like allocations, and every buffer holding an
// fd counts against max_fds_per_session, so one session cannot exhaust the daemon's memory or descriptors.
void Engine::checkSessionRoomLocked(const SessionState& s, std::string_view what, uint64_t bytes, bool holdsFd) const {
  const LimitsSection& l = config_.limits;
  if (s.bytes + bytes > l.maxSessionBytes) {
    fail(ErrorCode::kOutOfMemory,
         "{} {} bytes: the session already holds {} of its {} bytes (limits.max_session_bytes, allocations and "
         "registrations together); free buffers or raise the limit", what, bytes, s.bytes, l.maxSessionBytes);
  }
  const uint64_t fds = kFdsPerSession + s.bufferFds;
  if (holdsFd && fds + 1 > l.maxFdsPerSession) {
    fail(ErrorCode::kOutOfMemory,
         "{}: the session already holds {} buffers with file descriptors, {} fds with its own {}, the most "
         "limits.max_fds_per_session ({}) allows; free buffers (or allocate fewer, larger ones) or raise the limit",
         what, s.bufferFds, fds, kFdsPerSession, l.maxFdsPerSession);
  }
}

std::shared_ptr<Buffer> Engine::allocate(uint64_t sessionId, uint64_t bytes, const std::string& deviceUuid) {
  if (bytes == 0) fail(ErrorCode::kInvalidArgument, "allocate: size is 0 bytes; pass at least 1 byte");
  if (bytes > config_.limits.maxBufferBytes) {
    fail(ErrorCode::kOutOfMemory, "allocate {} bytes: over the per-buffer limit of {} bytes (limits.max_buffer_bytes)",
         bytes, config_.limits.maxBufferBytes);
  }
  {
    std::lock_guard lock(mutex_);
    checkSessionRoomLocked(sessionLocked(sessionId), "allocate", bytes, true);
  }
  return addBuffer(sessionId, backend_->allocate(bytes, deviceUuid), "allocate");
}

std::shared_ptr<Buffer> Engine::registerMemory(uint64_t sessionId, Fd fd, uint64_t offset, uint64_t bytes) {
  RegisterRequest request;
  request.fd = std::move(fd);
  request.offset = offset;
  request.bytes = bytes;
  return registerMemory(sessionId, std::move(request));
}

std::shared_ptr<Buffer> Engine::registerMemory(uint64_t sessionId, RegisterRequest request) {
  if (request.bytes == 0) fail(ErrorCode::kInvalidArgument, "register: size is 0 bytes; register at least 1 byte");
  if (request.bytes > config_.limits.maxBufferBytes) {
    fail(ErrorCode::kOutOfMemory, "register {} bytes: over the per-buffer limit of {} bytes (limits.max_buffer_bytes)",
         request.bytes, config_.limits.maxBufferBytes);
  }
  {
    std::lock_guard lock(mutex_);
    checkSessionRoomLocked(sessionLocked(sessionId), "register", request.bytes, static_cast<bool>(request.fd));
  }
  auto buffer = backend_->registerMemory(request);
  buffer->registered = true;
  return addBuffer(sessionId, std::move(buffer), "register");
}

std::shared_ptr<Buffer> Engine::addBuffer(uint64_t sessionId, std::shared_ptr<Buffer> buffer, std::string_view what) {
  std::lock_guard lock(mutex_);
  SessionState& s = sessionLocked(sessionId);  // the session may have closed meanwhile: the buffer is dropped
  const bool holdsFd = static_cast<bool>(buffer->fd);
  // Again under this lock: concurrent requests of one session must not overshoot together.
  checkSessionRoomLocked(s, what, buffer->accountedBytes, holdsFd);
  buffer->sessionId = sessionId;
  buffer->id = nextBufferId_++;
  s.buffers[buffer->id] = buffer;
  s.bytes += buffer->accountedBytes;
  s.bufferFds += holdsFd ? 1 : 0;
  return buffer;
}

void Engine::release(uint64_t sessionId, uint64_t bufferId, bool registered) {
  std::lock_guard lock(mutex_);
  SessionState& s = sessionLocked(sessionId);
  auto it = s.buffers.find(bufferId);
  if (it == s.buffers.end()) {
    fail(ErrorCode::kNotFound, "buffer {} is not a buffer of this session (never allocated here, or already freed)",
         bufferId);
  }
  if (it->second->registered != registered) {
    fail(ErrorCode::kInvalidArgument, "buffer {} was {}; release it with {}", bufferId,
         it->second->registered ? "registered" : "allocated",
         it->second->registered ? "tandem_deregister" : "tandem_free");
  }
  s.bytes -= it->second->accountedBytes;
  s.bufferFds -= it->second->fd ? 1 : 0;
  s.buffers.erase(it);  // an op in flight still holds the mapping through its shared_ptr
}

// ---- communicators -----------------------------------------------------------------------------------

void Engine::join(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t nranks, uint32_t rank,
                  const std::string& deviceUuid, JoinDone done) {
  const JoinInfo none;
  if (nranks == 0 || nranks > kMaxRanks) {
    return done(ErrorCode::kInvalidArgument, fmt::format("nranks {} is out of range; pass 1..{}", nranks, kMaxRanks), 0,
                none);
  }
  if (rank >= nranks) {
    return done(ErrorCode::kInvalidArgument, fmt::format("rank {} is out of range for nranks {}; pass 0..{}", rank,
                                                         nranks, nranks - 1), 0, none);
  }
  try {
    backend_->checkJoin(deviceUuid);
  } catch (const Error& e) {
    return done(e.code(), e.what(), 0, none);
  }
  std::unique_lock lock(mutex_);
  std::shared_ptr<CommEntry> entry = entryForLocked(uniqueId, nranks);
  Communicator& comm = entry->comm;
  if (comm.state != Communicator::State::kJoining) {
    return done(ErrorCode::kInvalidArgument,
                fmt::format("communicator {} is no longer joinable (state {}: {}); create a new id with "
                            "tandem_get_unique_id", hexId(uniqueId), commStateName(comm.state), comm.reason), 0, none);
  }
  if (comm.nranks != nranks) {
    return done(ErrorCode::kInvalidArgument,
                fmt::format("communicator {} was created with nranks {}, but this rank passed nranks {}; every rank "
                            "must pass the same nranks", hexId(uniqueId), comm.nranks, nranks), 0, none);
  }
  if (comm.members[rank]) {
    return done(ErrorCode::kInvalidArgument,
                fmt::format("rank {} of communicator {} is already taken by another session; give each process a "
                            "distinct rank", rank, hexId(uniqueId)), 0, none);
  }
  if (comm.remote[rank]) {
    return done(ErrorCode::kInvalidArgument,
                fmt::format("rank {} of communicator {} already joined on node {}; give each process of the job a "
                            "distinct rank", rank, hexId(uniqueId), *comm.remote[rank]), 0, none);
  }
  comm.members[rank] = sessionId;
  comm.devices[rank] = deviceUuid;
  entry->joins[rank] = PendingJoin{sessionId, std::move(done)};
  if (cluster_) {
    // Every node learns where every rank lives; the nodes that complete the set form the communicator.
    v1::PeerMessage m;
    auto* j = m.mutable_join();
    j->set_unique_id(uniqueId.data(), uniqueId.size());
    j->set_nranks(nranks);
    j->set_rank(rank);
    tellPeersLocked(comm, m);
  }
  if (comm.joined() < comm.nranks) return;
  completeJoin(entry, lock);
}

std::shared_ptr<Engine::CommEntry> Engine::entryForLocked(const std::array<uint8_t, 16>& uniqueId, uint32_t nranks) {
  if (auto it = commByUniqueId_.find(uniqueId); it != commByUniqueId_.end()) return comms_.at(it->second);
  auto entry = std::make_shared<CommEntry>();
  entry->comm.handle = nextCommHandle_++;
  entry->comm.uniqueId = uniqueId;
  entry->comm.nranks = nranks;
  entry->comm.members.resize(nranks);
  entry->comm.remote.resize(nranks);
  entry->comm.queues.resize(nranks);
  entry->comm.submitted.resize(nranks, 0);
  entry->comm.devices.resize(nranks);
  comms_[entry->comm.handle] = entry;
  commByUniqueId_[uniqueId] = entry->comm.handle;
  return entry;
}

void Engine::eraseEntryLocked(const Communicator& comm) {
  const uint64_t handle = comm.handle;
  if (auto it = commByUniqueId_.find(comm.uniqueId); it != commByUniqueId_.end() && it->second == handle) {
    commByUniqueId_.erase(it);
  }
  comms_.erase(handle);
}

void Engine::tellPeersLocked(const Communicator& comm, const v1::PeerMessage& message) {
  if (!cluster_) return;
  // Joins and leaves go to every node, since any node may hold ranks of the communicator; everything else to
  // the nodes its known ranks live on.
  if (message.has_join() || message.has_leave()) return cluster_->broadcast(message);
  for (uint32_t n : comm.nodes(cluster_->self())) {
    if (n != cluster_->self()) cluster_->send(n, message);
  }
}

void Engine::failJoin(const std::shared_ptr<CommEntry>& entry, ErrorCode code, const std::string& reason,
                      std::unique_lock<std::mutex>& lock) {
  Communicator& comm = entry->comm;
  auto joins = std::move(entry->joins);
  entry->joins.clear();
  comm.state = Communicator::State::kAborted;
  comm.reason = reason;
  for (auto& m : comm.members) m.reset();
  eraseEntryLocked(comm);
  lock.unlock();
  if (!joins.empty()) spdlog::warn("communicator {}: {}", hexId(comm.uniqueId), reason);
  for (auto& [r, j] : joins) j.done(code, reason, 0, JoinInfo{});
}

void Engine::completeJoin(const std::shared_ptr<CommEntry>& entry, std::unique_lock<std::mutex>& lock) {
  Communicator& comm = entry->comm;
  const std::array<uint8_t, 16> uniqueId = comm.uniqueId;
  const uint32_t nranks = comm.nranks;
  if (comm.localRanks() == 0) {
    // Every rank is on other nodes: this node only listened in.
    eraseEntryLocked(comm);
    return;
  }
  try {
    if (comm.spansNodes()) {
      // cpu: the worker runs the hierarchical exchange on host memory. cuda: the same, staged through host memory
      // (cuda/cuda_multinode.hpp), with the client executor only: the daemon executor's streams wait for a done that
      // only its persistent kernel writes.
      const std::string backend = backend_->name(), executor = backend_->executor();
      if (backend == "cuda" && executor != "client") {
        fail(ErrorCode::kUnsupported, "communicator {} spans nodes, which the cuda backend runs with daemon.executor: "
             "client only (this tandemd runs executor {}); set daemon.executor: client on every node",
             hexId(uniqueId), executor);
      }
      if (backend != "cpu" && backend != "cuda") {
        fail(ErrorCode::kUnsupported, "communicator {} spans nodes, which the {} backend does not run; run multi-node "
             "communicators on daemon.backend: cpu or cuda", hexId(uniqueId), backend);
      }
      const auto nodes = comm.nodes(cluster_->self());
      for (uint32_t n : nodes) {
        if (std::string problem = cluster_->nodeProblem(n); !problem.empty()) {
          fail(ErrorCode::kPeerLost, "communicator {} has ranks on {}", hexId(uniqueId), problem);
        }
      }
      entry->link = cluster_->createLink(nodes);
      v1::PeerMessage m;
      auto* k = m.mutable_keys();
      k->set_unique_id(uniqueId.data(), uniqueId.size());
      const auto key = cluster_->linkKey(*entry->link);
      k->set_staging_key(key.data(), key.size());
      tellPeersLocked(comm, m);
      for (auto& [node, bytes] : entry->earlyKeys) {
        cluster_->setPeerKey(*entry->link, node, std::as_bytes(std::span(bytes.data(), bytes.size())));
      }
      entry->earlyKeys.clear();
    }
    comm.resources = backend_->setupComm(comm);
  } catch (const Error& e) {
    // Every joiner gets the error; the id is spent, on every node.
    tellPeersLocked(comm, failMessage(uniqueId, e.code(), e.what(), 0));
    entry->link.reset();
    return failJoin(entry, e.code(), fmt::format("setup failed: {}", e.what()), lock);
  }
  auto joins = std::move(entry->joins);
  entry->joins.clear();
  comm.state = Communicator::State::kReady;
  const uint64_t perRank = comm.resources ? backend_->commBytesPerRank(*comm.resources) : 0;
  for (auto& [r, j] : joins) {
    SessionState& s = sessionLocked(j.sessionId);
    s.comms.push_back(comm.handle);
    if (perRank != 0) {
      s.commBytes[comm.handle] = perRank;
      s.bytes += perRank;
    }
  }
  const uint64_t handle = comm.handle;
  if (comm.spansNodes()) {
    std::string where;
    for (uint32_t n : comm.nodes(cluster_->self())) where += fmt::format("{}{}", where.empty() ? "" : ",", n);
    spdlog::info("communicator {} ready: {} ranks, {} here, on nodes {} (handle {})", hexId(uniqueId), nranks,
                 comm.localRanks(), where, handle);
  } else {
    spdlog::info("communicator {} ready: {} ranks (handle {})", hexId(uniqueId), nranks, handle);
  }
  std::vector<JoinInfo> infos(nranks);
  if (comm.resources) {
    for (uint32_t r = 0; r < nranks; ++r) infos[r] = backend_->joinInfo(*comm.resources, r);
  }
  auto keepAlive = comm.resources;  // the control fds in `infos` stay open while the replies go out
  lock.unlock();
  for (auto& [r, j] : joins) j.done(ErrorCode::kOk, "", handle, infos[r]);
}

CommMapping Engine::commMapping(uint64_t sessionId, uint64_t commHandle, uint32_t rank) {
  std::lock_guard lock(mutex_);
  SessionState& s = sessionLocked(sessionId);
  auto c = comms_.find(commHandle);
  if (c == comms_.end() || std::find(s.comms.begin(), s.comms.end(), commHandle) == s.comms.end()) {
    fail(ErrorCode::kNotFound, "communicator handle {} is not one this session joined (or it was destroyed)",
         commHandle);
  }
  const Communicator& comm = c->second->comm;
  if (rank >= comm.nranks) fail(ErrorCode::kInvalidArgument, "rank {} is out of range for nranks {}", rank, comm.nranks);
  if (!comm.resources) {
    fail(ErrorCode::kUnsupported, "communicator {} has no GPU workspaces (backend {})", commHandle, backend_->name());
  }
  return backend_->mapping(comm.resources, rank);
}

void Engine::cancelJoin(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t rank, uint32_t timeoutMs) {
  std::unique_lock lock(mutex_);
  auto it = commByUniqueId_.find(uniqueId);
  if (it == commByUniqueId_.end()) return;
  auto entry = comms_.at(it->second);
  auto j = entry->joins.find(rank);
  if (j == entry->joins.end() || j->second.sessionId != sessionId) return;
  JoinDone done = std::move(j->second.done);
  entry->joins.erase(j);
  entry->comm.members[rank].reset();
  tellPeersLocked(entry->comm, leaveMessage(uniqueId, rank));
  const uint32_t joined = entry->comm.joined();
  const uint32_t nranks = entry->comm.nranks;
  if (joined == 0) eraseEntryLocked(entry->comm);
  lock.unlock();
  done(ErrorCode::kTimeout,
       fmt::format("communicator rendezvous timed out after {} ms: {} of {} ranks had joined; start every rank with "
                   "the same id and nranks, or pass a longer timeout", timeoutMs, joined + 1, nranks), 0, JoinInfo{});
}

void Engine::destroyComm(uint64_t sessionId, uint64_t commHandle, bool abort) {
  std::lock_guard lock(mutex_);
  SessionState& s = sessionLocked(sessionId);
  if (std::find(s.comms.begin(), s.comms.end(), commHandle) == s.comms.end()) {
    fail(ErrorCode::kNotFound, "communicator handle {} is not one this session joined (or it was destroyed)", commHandle);
  }
  if (abort) {
    auto entry = comms_.at(commHandle);
    failCommLocked(*entry, Communicator::State::kAborted, ErrorCode::kAborted,
                   fmt::format("communicator aborted by the session {} (tandem_comm_abort)", sessionId));
    return;
  }
  leaveCommLocked(sessionId, commHandle, Communicator::State::kDestroyed, ErrorCode::kPeerLost,
                  fmt::format("a rank destroyed the communicator (session {})", sessionId));
}

void Engine::failCommLocked(CommEntry& entry, Communicator::State state, ErrorCode code, const std::string& reason,
                            bool tellPeers) {
  Communicator& comm = entry.comm;
  if (comm.state == Communicator::State::kReady || comm.state == Communicator::State::kJoining) {
    comm.state = state;
    comm.reason = reason;
    if (comm.resources) backend_->abortComm(*comm.resources, code, reason);
    if (entry.link) entry.link->abort(code, reason);
    if (tellPeers && comm.spansNodes()) {
      tellPeersLocked(comm, failMessage(comm.uniqueId, code, reason, entry.link ? entry.link->completedEpoch() : 0));
    }
  }
  for (auto& queue : comm.queues) {
    for (PendingOp& op : queue) {
      if (!op.local()) continue;
      --op.channel->queued;
      op.channel->complete(op.desc.seq, statusOf(code), reason);
    }
    queue.clear();
  }
}

void Engine::leaveCommLocked(uint64_t sessionId, uint64_t handle, Communicator::State state, ErrorCode code,
                             const std::string& reason) {
  auto it = comms_.find(handle);
  if (it == comms_.end()) return;
  auto entry = it->second;
  Communicator& comm = entry->comm;
  for (auto& m : comm.members) {
    if (m == sessionId) m.reset();
  }
  if (auto s = sessions_.find(sessionId); s != sessions_.end()) {
    std::erase(s->second.comms, handle);
    if (auto b = s->second.commBytes.find(handle); b != s->second.commBytes.end()) {
      s->second.bytes -= b->second;
      s->second.commBytes.erase(b);
    }
  }
  failCommLocked(*entry, state, code, reason);
  if (comm.localRanks() == 0) eraseEntryLocked(comm);
}

// ---- multi-node: messages from the other nodes' daemons ---------------------------------------------

void Engine::onPeerMessage(uint32_t from, const v1::PeerMessage& m) {
  std::unique_lock lock(mutex_);
  switch (m.body_case()) {
    case v1::PeerMessage::kJoin: {
      const auto& j = m.join();
      const auto uniqueId = uniqueIdOf(j.unique_id());
      if (j.nranks() == 0 || j.nranks() > kMaxRanks || j.rank() >= j.nranks()) {
        spdlog::warn("cluster: node {} sent a join with rank {} of {}; ignored", from, j.rank(), j.nranks());
        return;
      }
      auto entry = entryForLocked(uniqueId, j.nranks());
      Communicator& comm = entry->comm;
      if (comm.state != Communicator::State::kJoining) {
        spdlog::warn("communicator {}: node {} joined rank {} after it formed; ignored", hexId(uniqueId), from,
                      j.rank());
        return;
      }
      std::string problem;
      if (comm.nranks != j.nranks()) {
        problem = fmt::format("rank {} on node {} passed nranks {}, but ranks here passed {}; every rank must pass the "
                              "same nranks", j.rank(), from, j.nranks(), comm.nranks);
      } else if (comm.members[j.rank()] || (comm.remote[j.rank()] && *comm.remote[j.rank()] != from)) {
        problem = fmt::format("rank {} joined on node {} and on node {}; give each process of the job a distinct rank",
                              j.rank(), comm.members[j.rank()] ? cluster_->self() : *comm.remote[j.rank()], from);
      }
      if (!problem.empty()) {
        cluster_->send(from, failMessage(uniqueId, ErrorCode::kInvalidArgument, problem, 0));
        return failJoin(entry, ErrorCode::kInvalidArgument, problem, lock);
      }
      comm.remote[j.rank()] = from;
      if (comm.joined() == comm.nranks) completeJoin(entry, lock);
      return;
    }
    case v1::PeerMessage::kLeave: {
      auto it = commByUniqueId_.find(uniqueIdOf(m.leave().unique_id()));
      if (it == commByUniqueId_.end()) return;
      auto entry = comms_.at(it->second);
      Communicator& comm = entry->comm;
      if (comm.state != Communicator::State::kJoining || m.leave().rank() >= comm.nranks) return;
      if (comm.remote[m.leave().rank()] == from) comm.remote[m.leave().rank()].reset();
      if (comm.joined() == 0) eraseEntryLocked(comm);
      return;
    }
    case v1::PeerMessage::kKeys: {
      auto it = commByUniqueId_.find(uniqueIdOf(m.keys().unique_id()));
      if (it == commByUniqueId_.end()) return;
      auto entry = comms_.at(it->second);
      const std::string& key = m.keys().staging_key();
      if (!entry->link) {
        entry->earlyKeys[from] = key;  // this node has not heard every join yet
        return;
      }
      try {
        cluster_->setPeerKey(*entry->link, from, std::as_bytes(std::span(key.data(), key.size())));
      } catch (const Error& e) {
        failCommLocked(*entry, Communicator::State::kAborted, e.code(), e.what());
      }
      return;
    }
    case v1::PeerMessage::kFail: {
      auto it = commByUniqueId_.find(uniqueIdOf(m.fail().unique_id()));
      if (it == commByUniqueId_.end()) return;
      auto entry = comms_.at(it->second);
      const auto code = static_cast<ErrorCode>(m.fail().code());
      const std::string reason = fmt::format("on node {}: {}", from, m.fail().reason());
      if (entry->comm.state == Communicator::State::kJoining) return failJoin(entry, code, reason, lock);
      if (entry->comm.state != Communicator::State::kReady) return;
      // Collectives the sender finished still finish here; the communicator fails after them.
      const uint64_t after = m.fail().completed_epoch();
      if (after < entry->failAfter) {
        entry->failAfter = after;
        entry->failCode = code == ErrorCode::kAborted ? ErrorCode::kAborted : ErrorCode::kPeerLost;
        entry->failReason = reason;
      }
      if (entry->link) entry->link->abort(entry->failCode, entry->failReason, entry->failAfter);
      tryDispatchLocked(entry);
      return;
    }
    case v1::PeerMessage::kPost: {
      const auto& p = m.post();
      auto it = commByUniqueId_.find(uniqueIdOf(p.unique_id()));
      if (it == commByUniqueId_.end()) return;
      auto entry = comms_.at(it->second);
      Communicator& comm = entry->comm;
      // A node that formed the communicator first may post before the last join reaches this one (joining).
      if (comm.state != Communicator::State::kReady && comm.state != Communicator::State::kJoining) return;
      std::string problem;
      PendingOp op;
      if (p.rank() >= comm.nranks || comm.remote[p.rank()] != from) {
        problem = fmt::format("node {} posted an op for rank {}, which does not live there", from, p.rank());
      } else if (p.op_descriptor().size() != sizeof(OpDescriptor)) {
        problem = fmt::format("node {} posted a {}-byte descriptor ({} expected); run the same tandem release on every "
                              "node", from, p.op_descriptor().size(), sizeof(OpDescriptor));
      } else if (p.epoch() != comm.submitted[p.rank()] + 1) {
        problem = fmt::format("node {} posted op {} of rank {} after op {}", from, p.epoch(), p.rank(),
                              comm.submitted[p.rank()]);
      }
      if (!problem.empty()) {
        failCommLocked(*entry, Communicator::State::kAborted, ErrorCode::kProtocol, problem);
        return;
      }
      std::memcpy(&op.desc, p.op_descriptor().data(), sizeof op.desc);
      op.epoch = ++comm.submitted[p.rank()];
      op.errorCode = static_cast<int32_t>(p.error_code());
      op.error = p.error();
      comm.queues[p.rank()].push_back(std::move(op));
      tryDispatchLocked(entry);
      return;
    }
    case v1::PeerMessage::kHello:
    case v1::PeerMessage::BODY_NOT_SET: return;
  }
}

void Engine::onNodeLost(uint32_t node, const std::string& reason) {
  std::unique_lock lock(mutex_);
  std::vector<std::shared_ptr<CommEntry>> joining;
  for (auto& [handle, entry] : comms_) {
    Communicator& comm = entry->comm;
    const bool there = std::any_of(comm.remote.begin(), comm.remote.end(), [&](auto& n) { return n == node; });
    if (!there) continue;
    if (comm.state == Communicator::State::kJoining) {
      joining.push_back(entry);
    } else {
      failCommLocked(*entry, Communicator::State::kPeerLost, ErrorCode::kPeerLost,
                     fmt::format("ranks of this communicator were on {}", reason), false);
    }
  }
  for (auto& entry : joining) {
    if (!lock.owns_lock()) lock.lock();
    failJoin(entry, ErrorCode::kPeerLost, fmt::format("ranks of this communicator were on {}", reason), lock);
  }
}

// ---- the pump ----------------------------------------------------------------------------------------

void Engine::pumpLoop() {
  std::vector<std::shared_ptr<SessionChannel>> channels;
  std::vector<pollfd> waitFds;
  uint64_t generation = ~uint64_t{0};
  auto lastWork = Clock::now();
  const auto pollWindow = std::chrono::microseconds(config_.rings.pollWindowUs);
  while (running_.load(std::memory_order_relaxed)) {
    if (generation != sessionsGeneration_.load()) {
      std::lock_guard lock(mutex_);
      generation = sessionsGeneration_.load();
      channels.clear();
      for (auto& [id, s] : sessions_) channels.push_back(s.channel);
    }
    bool worked = pollSessions(channels);
    std::vector<std::pair<uint64_t, std::string>> failed;
    worked = backend_->poll(failed) || worked;
    if (!failed.empty()) {
      std::lock_guard lock(mutex_);
      for (auto& [handle, reason] : failed) {
        if (auto c = comms_.find(handle); c != comms_.end()) {
          failCommLocked(*c->second, Communicator::State::kAborted, ErrorCode::kAborted, reason);
        }
      }
    }
    if (worked) {
      lastWork = Clock::now();
      continue;
    }
    if (Clock::now() - lastWork < pollWindow) continue;
    if (backend_->busy()) {
      // GPU work in flight: its progress shows only in counters, so keep polling, politely.
      std::this_thread::yield();
      continue;
    }
    // Sleep: announce it on every ring, re-check, then block on every session's own wakeup socket and the pump's
    // eventfd (stop, new sessions). Clients ring only when they see the flag, so the busy path costs no system
    // call; each rings only its own socket, so none can steal or block another's wakeups. The timeout bounds the
    // damage a client could do by clearing its own flag: only its own ops would wait, at most this long.
    bool mayBlock = true;
    for (auto& ch : channels) mayBlock = ch->submissions().prepareToSleep() && mayBlock;
    if (mayBlock && generation == sessionsGeneration_.load()) {
      waitFds.assign(1, pollfd{pumpEvent_.get(), POLLIN, 0});
      for (auto& ch : channels) waitFds.push_back(pollfd{ch->pumpWakeFd(), POLLIN, 0});
      ::poll(waitFds.data(), waitFds.size(), 100);
      for (const pollfd& p : waitFds) {
        if ((p.revents & POLLIN) != 0) drainEventfd(p.fd);
      }
    }
    for (auto& ch : channels) ch->submissions().wokeUp();
    lastWork = Clock::now();
  }
}

bool Engine::pollSessions(const std::vector<std::shared_ptr<SessionChannel>>& channels) {
  bool any = false;
  for (const auto& ch : channels) {
    ch->flushPending();
    if (ch->faultReported.load(std::memory_order_relaxed)) continue;  // closing
    if (ch->overflowed()) {
      ch->faultReported = true;
      if (onSessionFault_) {
        onSessionFault_(ch->sessionId(), fmt::format("it left more than limits.max_pending_completions ({}) "
                                                     "completions undrained; drain the completion ring "
                                                     "(tandem_wait / tandem_op_status)",
                                                     config_.limits.maxPendingCompletions));
      }
      continue;
    }
    OpDescriptor desc;
    // Bounded per pass so one busy session cannot starve the others, and never past the session's
    // queued-op limit (back-pressure stays in the client's ring).
    for (int i = 0; i < 64 && ch->queued.load(std::memory_order_relaxed) < ch->capacity(); ++i) {
      const auto r = ch->submissions().tryPop(desc);
      if (r == SpscRing<OpDescriptor>::Pop::kEmpty) break;
      if (r == SpscRing<OpDescriptor>::Pop::kCorrupt) {
        ch->faultReported = true;
        if (onSessionFault_) onSessionFault_(ch->sessionId(), "its submission ring's head index is corrupt");
        break;
      }
      any = true;
      handleDescriptor(desc, ch);
    }
  }
  return any;
}

void Engine::handleDescriptor(const OpDescriptor& desc, const std::shared_ptr<SessionChannel>& channel) {
  std::lock_guard lock(mutex_);
  auto s = sessions_.find(channel->sessionId());
  if (s == sessions_.end()) return;
  SessionState& session = s->second;
  const std::string kind(opKindName(desc.kind));
  auto reject = [&](ErrorCode code, const std::string& message) {
    channel->complete(desc.seq, statusOf(code), message);
  };

  auto c = comms_.find(desc.commHandle);
  if (c == comms_.end() ||
      std::find(session.comms.begin(), session.comms.end(), desc.commHandle) == session.comms.end()) {
    return reject(ErrorCode::kNotFound, fmt::format("{}: communicator handle {} is not one this session joined (never "
                                                    "joined, or destroyed); call tandem_comm_init first", kind,
                                                    desc.commHandle));
  }
  auto entry = c->second;
  Communicator& comm = entry->comm;
  if (desc.rank >= comm.nranks || comm.members[desc.rank] != session.id) {
    return reject(ErrorCode::kInvalidArgument,
                  fmt::format("{}: descriptor says rank {}, but this session is not that rank of communicator {}; "
                              "submit with the rank this process joined as", kind, desc.rank, desc.commHandle));
  }
  if (comm.state == Communicator::State::kAborted) return reject(ErrorCode::kAborted, comm.reason);
  if (comm.state != Communicator::State::kReady) return reject(ErrorCode::kPeerLost, comm.reason);

  PendingOp op;
  op.desc = desc;
  op.channel = channel;
  // Every descriptor that reaches the queue takes the rank's next epoch, rejected or not: libtandem counts
  // the same way, and the epoch names the op in the stream counters and the kernel's flags.
  op.epoch = ++comm.submitted[desc.rank];
  try {
    if (desc.nranks != comm.nranks) {
      fail(ErrorCode::kInvalidArgument, "{}: nranks {} does not match the communicator's {}", kind, desc.nranks,
           comm.nranks);
    }
    const SlotRules rules = validateDescriptor(desc);
    // What the backend runs is answered here, at admission, so an op it lacks fails before any gang forms.
    if (const OpSet runs = backend_->ops(comm.resources.get()); !runs.contains(desc.kind)) {
      throw Error(ErrorCode::kUnsupported, unsupportedOpMessage(backend_->name(), runs, desc.kind));
    }
    for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
      const BufferRef& ref = desc.bufs[i];
      if (rules[i].name.empty() || ref.bufferId == 0) continue;
      auto b = session.buffers.find(ref.bufferId);
      if (b == session.buffers.end()) {
        fail(ErrorCode::kInvalidArgument, "{}: buffer {} ({}) is not a buffer of this session (unknown, freed, or "
             "another session's); pass a buffer this process allocated or registered", kind, ref.bufferId,
             rules[i].name);
      }
      if (ref.offset > b->second->bytes || ref.bytes > b->second->bytes - ref.offset) {
        fail(ErrorCode::kInvalidArgument, "{}: {} spans bytes [{}, {}) but buffer {} holds {} bytes; pass a larger "
             "buffer or a smaller offset", kind, rules[i].name, ref.offset, ref.offset + ref.bytes, ref.bufferId,
             b->second->bytes);
      }
      op.buffers[i] = b->second;
    }
  } catch (const Error& e) {
    op.error = e.what();
    op.errorCode = statusOf(e.code());
  }
  // A rejected descriptor still takes its place in the rank's sequence: the collective it belongs to fails
  // on every rank, so ranks never pair ops from different positions.
  if (comm.spansNodes()) {
    // The other nodes queue the descriptor too, so every node sees the same collective and judges it the same.
    v1::PeerMessage m;
    auto* p = m.mutable_post();
    p->set_unique_id(comm.uniqueId.data(), comm.uniqueId.size());
    p->set_rank(desc.rank);
    p->set_epoch(op.epoch);
    p->set_op_descriptor(&desc, sizeof desc);
    p->set_error_code(static_cast<v1::StatusCode>(op.errorCode));
    p->set_error(op.error);
    tellPeersLocked(comm, m);
  }
  ++channel->queued;
  comm.queues[desc.rank].push_back(std::move(op));
  tryDispatchLocked(entry);
}

void Engine::tryDispatchLocked(const std::shared_ptr<CommEntry>& entry) {
  Communicator& comm = entry->comm;
  for (;;) {
    if (entry->busy || comm.state != Communicator::State::kReady) return;
    if (entry->lastDispatched >= entry->failAfter) {
      failCommLocked(*entry, entry->failCode == ErrorCode::kAborted ? Communicator::State::kAborted
                                                                     : Communicator::State::kPeerLost,
                     entry->failCode, entry->failReason, false);
      return;
    }
    for (auto& q : comm.queues) {
      if (q.empty()) return;
    }
    Collective c;
    for (auto& q : comm.queues) {
      c.ops.push_back(std::move(q.front()));
      q.pop_front();
      if (c.ops.back().local()) --c.ops.back().channel->queued;
    }
    c.commHandle = comm.handle;
    c.epoch = c.ops[0].epoch;
    entry->lastDispatched = c.epoch;
    if (entry->link) {
      c.link = entry->link;
      for (uint32_t r = 0; r < comm.nranks; ++r) {
        c.nodeOfRank.push_back(comm.remote[r] ? *comm.remote[r] : cluster_->self());
      }
    }
    c.resources = comm.resources;
    c.owner = entry;
    c.opsCompleted = &comm.opsCompleted;
    // Gang checks: one bad rank fails the collective everywhere, and nothing is written.
    for (uint32_t r = 0; r < c.ops.size() && c.errorCode == 0; ++r) {
      if (!c.ops[r].error.empty()) {
        c.error = c.ops[r].error;
        c.errorCode = c.ops[r].errorCode;
      }
    }
    if (c.errorCode == 0) {
      std::vector<OpDescriptor> descs;
      for (auto& op : c.ops) descs.push_back(op.desc);
      try {
        validateCollective(descs);
      } catch (const Error& e) {
        c.error = e.what();
        c.errorCode = statusOf(e.code());
      }
    }
    entry->busy = true;
    std::weak_ptr<CommEntry> weak = entry;
    const bool free = backend_->execute(std::move(c), [this, weak] {
      if (auto e = weak.lock()) collectiveFinished(e);
    });
    if (!free) return;
    entry->busy = false;
  }
}

void Engine::collectiveFinished(const std::shared_ptr<CommEntry>& entry) {
  std::lock_guard lock(mutex_);
  entry->busy = false;
  tryDispatchLocked(entry);
}

EngineStatus Engine::status() const {
  std::lock_guard lock(mutex_);
  EngineStatus st;
  for (auto& [id, s] : sessions_) {
    st.sessions.push_back({id, s.pid, s.uid, static_cast<uint32_t>(s.buffers.size()), s.bytes,
                           static_cast<uint32_t>(s.comms.size()), s.channel->completed()});
    st.totalBytes += s.bytes;
    st.totalBuffers += static_cast<uint32_t>(s.buffers.size());
  }
  for (auto& [handle, e] : comms_) {
    const Communicator& c = e->comm;
    if (c.localRanks() == 0) continue;  // a multi-node communicator this node only hears about
    st.comms.push_back({handle, c.nranks, c.joined(), commStateName(c.state), c.opsCompleted, c.localRanks(),
                        c.spansNodes() ? c.nodes(cluster_->self()) : std::vector<uint32_t>{}, c.reason});
  }
  st.gpus = backend_->gpus();
  if (cluster_) cluster_->fillStatus(st.cluster.emplace());
  return st;
}

}  // namespace tandem::daemon
