// Engine, rendezvous: ranks joining a communicator (locally and across nodes), its setup by the backend, and its
// end (destroy, abort, a lost rank).
#include "engine.hpp"

#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "cluster.hpp"
#include "engine_detail.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon {

using namespace detail;

// ---- communicators -----------------------------------------------------------------------------------

void Engine::join(uint64_t sessionId, const std::array<uint8_t, 16>& uniqueId, uint32_t nranks, uint32_t rank,
                  const std::string& deviceUuid, JoinDone done, uint64_t workspaceBytes) {
  const JoinInfo none;
  if (nranks == 0 || nranks > kMaxRanks) {
    return answerJoin(done, ErrorCode::kInvalidArgument,
                      fmt::format("nranks {} is out of range; pass 1..{}", nranks, kMaxRanks), 0, none);
  }
  if (rank >= nranks) {
    return answerJoin(done, ErrorCode::kInvalidArgument,
                      fmt::format("rank {} is out of range for nranks {}; pass 0..{}", rank, nranks, nranks - 1), 0,
                      none);
  }
  try {
    backend_->checkJoin(deviceUuid);
  } catch (const Error& e) {
    return answerJoin(done, e.code(), e.what(), 0, none);
  }
  std::unique_lock lock(mutex_);
  // A refusal is decided under the lock and delivered after it: `done` writes to the client's connection, which
  // may close the session and come back into the engine (docs/ARCHITECTURE.md, "Locks and callbacks").
  auto refuse = [&](ErrorCode code, std::string message) {
    lock.unlock();
    answerJoin(done, code, message, 0, none);
  };
  // Half-joined communicators cost memory until they form or time out: one session may hold only so many.
  uint32_t joining = 0;
  for (const auto& [handle, e] : comms_) {
    for (const auto& [r, j] : e->joins) joining += j.sessionId == sessionId ? 1 : 0;
  }
  if (joining >= config_.limits.maxJoiningCommsPerSession) {
    return refuse(ErrorCode::kOutOfMemory,
                  fmt::format("join: this session already waits in {} communicators that have not formed, the most "
                              "limits.max_joining_comms_per_session allows; let them form (start the other ranks) or "
                              "time out, or raise the limit", joining));
  }
  std::shared_ptr<CommEntry> entry = entryForLocked(uniqueId, nranks);
  Communicator& comm = entry->comm;
  if (comm.state != Communicator::State::kJoining) {
    return refuse(ErrorCode::kInvalidArgument,
                  fmt::format("communicator {} is no longer joinable (state {}: {}); create a new id with "
                              "tandem_get_unique_id", hexId(uniqueId), commStateName(comm.state), comm.reason));
  }
  if (comm.nranks != nranks) {
    return refuse(ErrorCode::kInvalidArgument,
                  fmt::format("communicator {} was created with nranks {}, but this rank passed nranks {}; every rank "
                              "must pass the same nranks", hexId(uniqueId), comm.nranks, nranks));
  }
  if (comm.members[rank]) {
    return refuse(ErrorCode::kInvalidArgument,
                  fmt::format("rank {} of communicator {} is already taken by another session; give each process a "
                              "distinct rank", rank, hexId(uniqueId)));
  }
  if (comm.remote[rank]) {
    return refuse(ErrorCode::kInvalidArgument,
                  fmt::format("rank {} of communicator {} already joined on node {}; give each process of the job a "
                              "distinct rank", rank, hexId(uniqueId), *comm.remote[rank]));
  }
  comm.members[rank] = sessionId;
  comm.devices[rank] = deviceUuid;
  comm.workspaceBytes = std::max(comm.workspaceBytes, workspaceBytes);
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

void Engine::answerJoin(JoinDone& done, ErrorCode code, const std::string& message, uint64_t commHandle,
                        const JoinInfo& info) const {
  mutex_.assertNotHeld("a join's reply");
  done(code, message, commHandle, info);
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
                      std::unique_lock<RankedMutex>& lock) {
  Communicator& comm = entry->comm;
  auto joins = std::move(entry->joins);
  entry->joins.clear();
  comm.state = Communicator::State::kAborted;
  comm.reason = reason;
  for (auto& m : comm.members) m.reset();
  eraseEntryLocked(comm);
  lock.unlock();
  if (!joins.empty()) spdlog::warn("communicator {}: {}", hexId(comm.uniqueId), reason);
  for (auto& [r, j] : joins) answerJoin(j.done, code, reason, 0, JoinInfo{});
}

void Engine::completeJoin(const std::shared_ptr<CommEntry>& entry, std::unique_lock<RankedMutex>& lock) {
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
      // cpu: the worker runs the hierarchical exchange on host memory. cuda, with either executor: tandemd runs the op
      // itself (cuda/cuda_multinode.hpp: the exchange staged through host memory, the GEMMs on the GPUs in tandemd's
      // context); the ranks' streams only write ready and wait for the done tandemd writes.
      const std::string backend = backend_->name();
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
    // A workspace asked for at the join is checked against the quota before the backend allocates it.
    for (auto& [r, j] : entry->joins) {
      checkSessionRoomLocked(sessionLocked(j.sessionId), fmt::format("communicator {}: rank {}'s workspace of",
                                                                     hexId(uniqueId), r), comm.workspaceBytes, false);
    }
    comm.resources = backend_->setupComm(comm);
  } catch (const Error& e) {
    // Every joiner gets the error; the id is spent, on every node.
    tellPeersLocked(comm, failMessage(uniqueId, e.code(), e.what(), 0));
    entry->link.reset();
    return failJoin(entry, e.code(), fmt::format("setup failed: {}", e.what()), lock);
  }
  const uint64_t perRank = comm.resources ? backend_->commBytesPerRank(*comm.resources) : 0;
  // Each rank's workspace counts against its session's limits.max_session_bytes: over it, every joiner gets the error
  // naming the key and the bytes, and the workspace goes with the communicator.
  try {
    for (auto& [r, j] : entry->joins) {
      checkSessionRoomLocked(sessionLocked(j.sessionId), fmt::format("communicator {}: rank {}'s workspace of",
                                                                     hexId(uniqueId), r), perRank, false);
    }
  } catch (const Error& e) {
    if (comm.spansNodes()) tellPeersLocked(comm, failMessage(uniqueId, e.code(), e.what(), 0));
    entry->link.reset();
    return failJoin(entry, e.code(), e.what(), lock);
  }
  auto joins = std::move(entry->joins);
  entry->joins.clear();
  comm.state = Communicator::State::kReady;
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
  for (auto& [r, j] : joins) answerJoin(j.done, ErrorCode::kOk, "", handle, infos[r]);
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
  answerJoin(done, ErrorCode::kTimeout,
             fmt::format("communicator rendezvous timed out after {} ms: {} of {} ranks had joined; start every rank "
                         "with the same id and nranks, or pass a longer timeout", timeoutMs, joined + 1, nranks),
             0, JoinInfo{});
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
  uint32_t leaverRank = 0, leaverRanks = 0;
  for (uint32_t r = 0; r < comm.members.size(); ++r) {
    if (comm.members[r] == sessionId) {
      comm.members[r].reset();
      leaverRank = r;
      ++leaverRanks;
    }
  }
  if (auto s = sessions_.find(sessionId); s != sessions_.end()) {
    std::erase(s->second.comms, handle);
    if (auto b = s->second.commBytes.find(handle); b != s->second.commBytes.end()) {
      s->second.bytes -= b->second;
      s->second.commBytes.erase(b);
    }
  }
  // One rank leaving a ready one-node communicator with none of its ops queued here: the backend may let the ops in
  // flight on the other ranks finish (Backend::leaveComm); later ops fail with the reason either way.
  const bool queued = std::any_of(comm.queues.begin(), comm.queues.end(), [](const auto& q) { return !q.empty(); });
  if (leaverRanks == 1 && !queued && !comm.spansNodes() && comm.resources &&
      comm.state == Communicator::State::kReady) {
    comm.state = state;
    comm.reason = reason;
    backend_->leaveComm(*comm.resources, leaverRank, code, reason);
  } else {
    failCommLocked(*entry, state, code, reason);
  }
  if (comm.localRanks() == 0) eraseEntryLocked(comm);
}

}  // namespace tandem::daemon
