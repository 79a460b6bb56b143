// Engine, cluster sync: what the other nodes' daemons tell this one about shared communicators (joins, leaves,
// descriptors, failures), and a lost node.
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
      // A collective dispatched here (this thread, not the pump) may wait for the local streams' ready words, which
      // only the pump polls; it may be asleep (cuda, spanning communicators: each op paid its 100 ms timeout, 102 ms
      // per op in span_bench on one H200).
      pump_.wake();
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

}  // namespace tandem::daemon
