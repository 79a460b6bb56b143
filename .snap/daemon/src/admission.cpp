// Engine, admission and dispatch: the pump thread (pump.hpp) hands each descriptor here; it is validated, checked
// against what the backend runs, resolved against the session's buffers, queued per rank, and dispatched once
// every rank has submitted.
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

}  // namespace tandem::daemon
