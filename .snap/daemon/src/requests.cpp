// The request side of ControlSession (control_session.hpp): who may connect, and each request of the control
// protocol (proto/tandem/v1/control.proto) turned into Engine calls and answered.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "control_session.hpp"
#include "plan_table.hpp"
#include "tandem/common/protocol.hpp"

namespace tandem::daemon {
namespace {

std::array<uint8_t, 16> toUniqueId(const std::string& bytes) {
  std::array<uint8_t, 16> id{};
  if (bytes.size() != id.size()) {
    fail(ErrorCode::kInvalidArgument, "communicator id is {} bytes; it must be the 16 bytes from tandem_get_unique_id",
         bytes.size());
  }
  std::copy(bytes.begin(), bytes.end(), id.begin());
  return id;
}

}  // namespace

bool ControlSession::allowed() const {
  const auto& access = server_.config_.access;
  return uid_ == 0 || uid_ == ::geteuid() ||
         std::find(access.allowedUids.begin(), access.allowedUids.end(), uid_) != access.allowedUids.end() ||
         std::find(access.allowedGids.begin(), access.allowedGids.end(), gid_) != access.allowedGids.end();
}

void ControlSession::dispatch(const pb::Request& request) {
  const uint64_t rid = request.request_id();
  if (!helloDone_ && request.body_case() != pb::Request::kHello) {
    fail(ErrorCode::kProtocol, "the first message on a connection must be Hello");
  }
  Engine& engine = server_.engine_;
  pb::Response response;
  switch (request.body_case()) {
    case pb::Request::kHello: {
      if (helloDone_) fail(ErrorCode::kProtocol, "Hello sent twice on one connection");
      const auto& hello = request.hello();
      if (hello.protocol_version() != tandem::kProtocolVersion) {
        fail(ErrorCode::kVersionMismatch, "protocol version mismatch: client speaks version {}, tandemd {} speaks "
             "version {}; use a libtandem from the same release as tandemd", hello.protocol_version(),
             TANDEM_VERSION_STRING, tandem::kProtocolVersion);
      }
      if (!allowed()) {
        fail(ErrorCode::kPermissionDenied, "uid {} (gid {}) may not use this tandemd; add the uid to "
             "access.allowed_uids or its group to access.allowed_gids in tandemd.yaml", uid_, gid_);
      }
      if (engine.sessionCount() >= server_.config_.limits.maxSessions) {
        fail(ErrorCode::kUnavailable, "tandemd already serves {} sessions (limits.max_sessions); close idle "
             "clients or raise the limit", server_.config_.limits.maxSessions);
      }
      try {
        channel_ = engine.openSession(id_, pid_, uid_, gid_);
      } catch (const Error& e) {
        // The session's ring and wakeups need fds: say whose limit ran out and what raises it.
        const std::string what = e.what();
        if (what.find(std::strerror(EMFILE)) == std::string::npos &&
            what.find(std::strerror(ENFILE)) == std::string::npos) {
          throw;
        }
        fail(ErrorCode::kUnavailable, "tandemd cannot open a session: it has run out of file descriptors ({}). "
             "Retry later; its administrator can raise LimitNOFILE in tandemd.service or lower limits.max_sessions "
             "or limits.max_fds_per_session", what);
      }
      helloDone_ = true;
      helloTimer_.cancel();
      auto* r = response.mutable_hello();
      r->set_protocol_version(tandem::kProtocolVersion);
      r->set_daemon_version(TANDEM_VERSION_STRING);
      r->add_capabilities(server_.backend_);
      r->set_session_id(id_);
      r->set_backend(server_.backend_);
      r->set_ring_capacity(server_.config_.rings.capacity);
      r->set_ring_bytes(channel_->ringBytes());
      r->set_descriptor_version(kDescriptorVersion);
      r->set_executor(engine.backend().executor());
      const int fds[] = {channel_->ringFd(), channel_->submitEventFd(), channel_->completionEventFd()};
      reply(rid, response, fds);  // sent, or queued with copies of the fds
      channel_->releaseClientFds();
      return;
    }
    case pb::Request::kAllocate: {
      auto buffer = engine.allocate(id_, request.allocate().bytes(), request.allocate().device_uuid());
      auto* r = response.mutable_allocate();
      r->set_buffer_id(buffer->id);
      r->set_bytes(buffer->bytes);
      r->set_mapped_bytes(buffer->mappedBytes);
      r->set_device_uuid(buffer->deviceUuid);
      const int fds[] = {buffer->fd.get()};
      return reply(rid, response, fds);
    }
    case pb::Request::kRegisterBuffer: {
      const auto& reg = request.register_buffer();
      RegisterRequest r;
      switch (reg.kind()) {
        case pb::REGISTER_KIND_MEMFD: r.kind = RegisterRequest::Kind::kMemfd; break;
        case pb::REGISTER_KIND_CUDA_IPC: r.kind = RegisterRequest::Kind::kCudaIpc; break;
        case pb::REGISTER_KIND_CUDA_FD: r.kind = RegisterRequest::Kind::kCudaFd; break;
        default:
          fail(ErrorCode::kInvalidArgument, "register: unknown memory kind {}; this tandemd knows memfd, cuda-ipc "
               "and cuda-fd", static_cast<int>(reg.kind()));
      }
      if (r.kind != RegisterRequest::Kind::kCudaIpc) r.fd = takeFd();
      r.offset = reg.offset();
      r.bytes = reg.bytes();
      r.ipcHandle = reg.ipc_handle();
      r.deviceUuid = reg.device_uuid();
      auto buffer = engine.registerMemory(id_, std::move(r));
      response.mutable_register_buffer()->set_buffer_id(buffer->id);
      return reply(rid, response);
    }
    case pb::Request::kFree:
      engine.release(id_, request.free().buffer_id(), false);
      return reply(rid, response);
    case pb::Request::kDeregister:
      engine.release(id_, request.deregister().buffer_id(), true);
      return reply(rid, response);
    case pb::Request::kCreateComm:
      // Communicators come into being with their first join; this is accepted for symmetry.
      return reply(rid, response);
    case pb::Request::kJoinComm: return join(rid, request.join_comm());
    case pb::Request::kDestroyComm:
      engine.destroyComm(id_, request.destroy_comm().comm_handle(), request.destroy_comm().abort());
      return reply(rid, response);
    case pb::Request::kCommMapping: {
      const CommMapping m = engine.commMapping(id_, request.comm_mapping().comm_handle(),
                                               request.comm_mapping().rank());
      auto* r = response.mutable_comm_mapping();
      r->set_rank(request.comm_mapping().rank());
      r->set_bytes(m.bytes);
      r->set_device_uuid(m.deviceUuid);
      const int fds[] = {m.fd};
      return reply(rid, response, fds);
    }
    case pb::Request::kQueryStatus: return reply(rid, statusReply(response));
    case pb::Request::kSetPlan:
      setPlan(request.set_plan());
      return reply(rid, response);
    case pb::Request::kShutdown:
      if (uid_ != 0 && uid_ != ::geteuid()) {
        fail(ErrorCode::kPermissionDenied, "only root or tandemd's own user may shut it down; use systemctl stop "
             "tandemd");
      }
      spdlog::info("shutdown requested by pid {}", pid_);
      reply(rid, response);
      return server_.stop();
    case pb::Request::BODY_NOT_SET:
      fail(ErrorCode::kProtocol, "request {} has an unknown or empty message type; this tandemd speaks protocol "
           "version {}", rid, tandem::kProtocolVersion);
  }
}

// Trial plans for a communicator of this session, or entries of the plan table (plan_table.hpp).
void ControlSession::setPlan(const pb::SetPlan& req) {
  PlanTable* table = server_.engine_.plans();
  if (table == nullptr) fail(ErrorCode::kUnsupported, "this tandemd has no plan table");
  std::vector<PlanRecord> records;
  for (const auto& e : req.entries()) records.push_back(planRecordFromProto(e));
  if (req.comm_handle() != 0) {
    server_.engine_.checkMember(id_, uid_, req.comm_handle());
    if (req.clear_trials()) table->clearTrials(req.comm_handle());
    for (const auto& r : records) table->setTrial(req.comm_handle(), r.key, r.plan);
  }
  if (!req.save() && !req.erase()) return;
  // The table steers every tenant's ops: only root and tandemd's own user change it.
  if (!privileged()) {
    fail(ErrorCode::kPermissionDenied, "only root or tandemd's own user may change the plan table; run tandemctl "
         "tune (or advise --save) as that user");
  }
  for (auto& r : records) {
    if (req.erase()) {
      table->erase(r.key);
    } else {
      spdlog::info("plan table: {}: {} ({})", planKeyText(r.key), planChoiceText(r.plan), r.source);
      table->put(std::move(r));
    }
  }
  table->save();
}

void ControlSession::join(uint64_t rid, const pb::JoinCommunicator& join) {
  const auto uniqueId = toUniqueId(join.unique_id());
  const auto& communicators = server_.config_.communicators;
  // A join holds a half-formed communicator until its timeout: a client may not choose to hold one for days.
  if (join.timeout_ms() > communicators.maxJoinTimeoutMs) {
    fail(ErrorCode::kInvalidArgument, "join timeout {} ms is above communicators.max_join_timeout_ms ({} ms). Pass "
         "a shorter timeout to tandem_comm_init (0 takes communicators.join_timeout_ms, {} ms), or raise "
         "communicators.max_join_timeout_ms in tandemd.yaml", join.timeout_ms(), communicators.maxJoinTimeoutMs,
         communicators.joinTimeoutMs);
  }
  const uint32_t timeoutMs = join.timeout_ms() != 0 ? join.timeout_ms() : communicators.joinTimeoutMs;
  auto timer = std::make_shared<asio::steady_timer>(server_.io_, std::chrono::milliseconds(timeoutMs));
  const uint64_t seq = nextJoinSeq_++;
  joinTimers_.emplace(seq, timer);
  std::weak_ptr<ControlSession> weak = weak_from_this();
  server_.engine_.join(id_, uniqueId, join.nranks(), join.rank(), join.device_uuid(),
                       [weak, rid, timer, seq, nranks = join.nranks()](ErrorCode code, const std::string& message,
                                                                       uint64_t handle, const JoinInfo& info) {
                         timer->cancel();
                         auto self = weak.lock();
                         if (!self) return;
                         self->joinTimers_.erase(seq);
                         // Called on this thread: the last joiner's or a timer's handler.
                         if (code != ErrorCode::kOk) return self->sendError(rid, code, message);
                         pb::Response response;
                         auto* r = response.mutable_join_comm();
                         r->set_comm_handle(handle);
                         r->set_executor(info.executor);
                         r->set_control_bytes(info.controlBytes);
                         r->set_workspace_bytes(info.workspaceBytes);
                         r->set_comm_ctas(info.commCtas);
                         // The client executor launches the fused ops itself: it gets this many ranks' entries.
                         if (const PlanTable* t = self->server_.engine_.plans(); t && info.executor == "client") {
                           for (const auto& rec : t->records()) {
                             if (rec.key.ranks == nranks && rec.key.executor == info.executor) {
                               planRecordToProto(rec, r->add_plans());
                             }
                           }
                         }
                         if (info.controlFd >= 0) {
                           const int fds[] = {info.controlFd};
                           return self->reply(rid, response, fds);
                         }
                         self->reply(rid, response);
                       },
                       join.workspace_bytes());
  timer->async_wait([weak, uniqueId, rank = join.rank(), timeoutMs, seq](boost::system::error_code ec) {
    auto self = weak.lock();
    if (ec || !self) return;
    self->joinTimers_.erase(seq);
    self->server_.engine_.cancelJoin(self->id_, uniqueId, rank, timeoutMs);
  });
}

pb::Response& ControlSession::statusReply(pb::Response& response) {
  const EngineStatus st = server_.engine_.status();
  auto* r = response.mutable_status_reply();
  r->set_daemon_version(TANDEM_VERSION_STRING);
  r->set_backend(server_.backend_);
  r->set_executor(server_.engine_.backend().executor());
  r->set_uptime_ms(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::steady_clock::now() - server_.started_)
                                             .count()));
  r->set_total_bytes(st.totalBytes);
  r->set_total_buffers(st.totalBuffers);
  r->set_socket_path(server_.socketPath_);
  // Other tenants' pids, uids and sizes are theirs: only root and tandemd's own user see every session; the
  // totals above stay daemon-wide.
  const bool everyone = privileged();
  for (const auto& s : st.sessions) {
    if (!everyone && s.id != id_) continue;
    auto* si = r->add_sessions();
    si->set_session_id(s.id);
    si->set_pid(s.pid);
    si->set_uid(s.uid);
    si->set_buffers(s.buffers);
    si->set_bytes(s.bytes);
    si->set_communicators(s.comms);
    si->set_ops_completed(s.opsCompleted);
  }
  for (const auto& g : st.gpus) {
    auto* gi = r->add_gpus();
    gi->set_uuid(g.uuid);
    gi->set_name(g.name);
    gi->set_sms(g.sms);
    gi->set_memory_bytes(g.memoryBytes);
    gi->set_pci_bus_id(g.pciBusId);
    gi->set_compute_capability(fmt::format("{}.{}", g.ccMajor, g.ccMinor));
    gi->set_mps(g.mps);
    for (const auto& p : g.peers) {
      auto* pi = gi->add_peers();
      pi->set_uuid(p.uuid);
      pi->set_nvlinks(p.nvlinks);
      pi->set_p2p(p.p2p);
    }
  }
  for (const auto& c : st.comms) {
    // A communicator is seen by its members and by other sessions of their users (a job's ranks run as one
    // uid); its handle, size and state say what another tenant runs.
    if (!everyone && std::find(c.memberSessions.begin(), c.memberSessions.end(), id_) == c.memberSessions.end() &&
        std::find(c.memberUids.begin(), c.memberUids.end(), uid_) == c.memberUids.end()) {
      continue;
    }
    auto* ci = r->add_communicators();
    ci->set_comm_handle(c.handle);
    ci->set_nranks(c.nranks);
    ci->set_joined(c.joined);
    ci->set_state(c.state);
    ci->set_ops_completed(c.opsCompleted);
    ci->set_local_ranks(c.localRanks);
    for (uint32_t n : c.nodes) ci->add_nodes(n);
    ci->set_reason(c.reason);
  }
  if (st.cluster) *r->mutable_cluster() = *st.cluster;
  if (const PlanTable* t = server_.engine_.plans()) {
    fillPlanTableInfo(*t, planAutotuneName(server_.config_.plans.autotune), planGpuModel(server_.backend_, st.gpus),
                      r->mutable_plans());
  }
  return response;
}

}  // namespace tandem::daemon
