#include "server.hpp"

#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <filesystem>

#include "tandem/common/framing.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/tandem.h"
#include "tandem/v1/control.pb.h"

namespace tandem::daemon {
namespace asio = boost::asio;
using asio::local::stream_protocol;
namespace pb = tandem::v1;

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

// systemd socket activation: LISTEN_PID/LISTEN_FDS name inherited listening sockets starting at fd 3.
int inheritedSocket() {
  const char* pid = std::getenv("LISTEN_PID");
  const char* fds = std::getenv("LISTEN_FDS");
  if (pid == nullptr || fds == nullptr || std::atol(pid) != ::getpid() || std::atoi(fds) < 1) return -1;
  return 3;
}

}  // namespace

// ---- one connection ----------------------------------------------------------------------------------

class ControlSession : public std::enable_shared_from_this<ControlSession> {
 public:
  ControlSession(Server& server, stream_protocol::socket socket, uint64_t id)
      : server_(server), socket_(std::move(socket)), id_(id), decoder_(server.config_.limits.maxFrameBytes) {}

  void start() {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      pid_ = static_cast<uint32_t>(cred.pid);
      uid_ = cred.uid;
      gid_ = cred.gid;
    }
    spdlog::debug("connection {} from pid {} uid {}", id_, pid_, uid_);
    watchProcess();
    waitRead();
  }

  void close(const std::string& why) {
    if (closed_) return;
    closed_ = true;
    for (auto& t : joinTimers_) t->cancel();
    boost::system::error_code ec;
    socket_.close(ec);
    processExit_.close(ec);
    if (helloDone_) server_.engine_.closeSession(id_, why);
  }

  uint64_t id() const { return id_; }

 private:
  // A process that dies while another process still holds its connection (a child that inherited the fd
  // through fork) never hangs the socket up. Its pidfd becomes readable when it exits, so its ranks are
  // reported lost at once instead of never.
  void watchProcess() {
    const int fd = pid_ != 0 ? static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)) : -1;
    if (fd < 0) {
      spdlog::debug("connection {}: no pidfd for pid {} ({}); relying on the socket alone", id_, pid_,
                    std::strerror(errno));
      return;
    }
    processExit_.assign(fd);
    processExit_.async_wait(asio::posix::stream_descriptor::wait_read,
                            [self = shared_from_this()](boost::system::error_code ec) {
                              if (ec || self->closed_) return;
                              self->server_.closeSession(
                                  self->id_, fmt::format("process {} exited (its connection was still open, held by "
                                                         "another process)", self->pid_));
                            });
  }

  void waitRead() {
    socket_.async_wait(stream_protocol::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_) return;
      self->onReadable();
    });
  }

  void onReadable() {
    try {
      const ReadResult r = readInto(socket_.native_handle(), decoder_);
      if (r == ReadResult::kClosed) {
        return server_.closeSession(id_, decoder_.midFrame() ? "client disconnected in the middle of a frame"
                                                              : "client disconnected");
      }
      while (auto frame = decoder_.next()) {
        handleFrame(*frame);
        if (closed_) return;
      }
    } catch (const Error& e) {
      // Framing errors leave the stream unusable: answer once, then close.
      sendError(0, e.code(), e.what());
      return server_.closeSession(id_, e.what());
    }
    waitRead();
  }

  void send(const pb::Response& response, std::span<const int> fds = {}) {
    if (closed_) return;
    try {
      sendFrame(socket_.native_handle(), response.SerializeAsString(), fds, server_.config_.limits.maxFrameBytes);
    } catch (const Error& e) {
      spdlog::debug("session {}: reply not delivered: {}", id_, e.what());
    }
  }

  void sendError(uint64_t requestId, ErrorCode code, const std::string& message) {
    pb::Response response;
    response.set_request_id(requestId);
    response.mutable_status()->set_code(static_cast<pb::StatusCode>(wireCode(code)));
    response.mutable_status()->set_message(message);
    send(response);
  }

  void handleFrame(const std::string& frame) {
    pb::Request request;
    if (!request.ParseFromString(frame)) {
      fail(ErrorCode::kProtocol, "malformed request frame ({} bytes that are not a tandem.v1.Request); use libtandem "
           "or tandemctl of the same release", frame.size());
    }
    const uint64_t rid = request.request_id();
    try {
      dispatch(request);
    } catch (const Error& e) {
      sendError(rid, e.code(), e.what());
      // A peer that fails Hello (wrong version, not allowed, or something else first) gets no session.
      if (!helloDone_ || e.code() == ErrorCode::kVersionMismatch || e.code() == ErrorCode::kPermissionDenied) {
        server_.closeSession(id_, e.what());
      }
    } catch (const std::exception& e) {
      sendError(rid, ErrorCode::kInternal, e.what());
    }
  }

  void reply(uint64_t rid, pb::Response& response, std::span<const int> fds = {}) {
    response.set_request_id(rid);
    response.mutable_status()->set_code(pb::STATUS_CODE_OK);
    send(response, fds);
  }

  bool allowed() const {
    const auto& access = server_.config_.access;
    return uid_ == 0 || uid_ == ::geteuid() ||
           std::find(access.allowedUids.begin(), access.allowedUids.end(), uid_) != access.allowedUids.end() ||
           std::find(access.allowedGids.begin(), access.allowedGids.end(), gid_) != access.allowedGids.end();
  }

  void dispatch(const pb::Request& request) {
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
        if (hello.protocol_version() != TANDEM_PROTOCOL_VERSION) {
          fail(ErrorCode::kVersionMismatch, "protocol version mismatch: client speaks version {}, tandemd {} speaks "
               "version {}; use a libtandem from the same release as tandemd", hello.protocol_version(),
               TANDEM_VERSION_STRING, TANDEM_PROTOCOL_VERSION);
        }
        if (!allowed()) {
          fail(ErrorCode::kPermissionDenied, "uid {} (gid {}) may not use this tandemd; add the uid to "
               "access.allowed_uids or its group to access.allowed_gids in tandemd.yaml", uid_, gid_);
        }
        if (engine.sessionCount() >= server_.config_.limits.maxSessions) {
          fail(ErrorCode::kUnavailable, "tandemd already serves {} sessions (limits.max_sessions); close idle "
               "clients or raise the limit", server_.config_.limits.maxSessions);
        }
        channel_ = engine.openSession(id_, pid_, uid_, gid_);
        helloDone_ = true;
        auto* r = response.mutable_hello();
        r->set_protocol_version(TANDEM_PROTOCOL_VERSION);
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
        if (r.kind != RegisterRequest::Kind::kCudaIpc) r.fd = decoder_.takeFd();
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
             "version {}", rid, TANDEM_PROTOCOL_VERSION);
    }
  }

  void join(uint64_t rid, const pb::JoinCommunicator& join) {
    const auto uniqueId = toUniqueId(join.unique_id());
    const uint32_t timeoutMs =
        join.timeout_ms() != 0 ? join.timeout_ms() : server_.config_.communicators.joinTimeoutMs;
    auto timer = std::make_shared<asio::steady_timer>(server_.io_, std::chrono::milliseconds(timeoutMs));
    joinTimers_.push_back(timer);
    std::weak_ptr<ControlSession> weak = weak_from_this();
    server_.engine_.join(id_, uniqueId, join.nranks(), join.rank(), join.device_uuid(),
                         [weak, rid, timer](ErrorCode code, const std::string& message, uint64_t handle,
                                            const JoinInfo& info) {
                           timer->cancel();
                           auto self = weak.lock();
                           if (!self) return;
                           // Called on this thread: the last joiner's or a timer's handler.
                           if (code != ErrorCode::kOk) return self->sendError(rid, code, message);
                           pb::Response response;
                           auto* r = response.mutable_join_comm();
                           r->set_comm_handle(handle);
                           r->set_executor(info.executor);
                           r->set_control_bytes(info.controlBytes);
                           r->set_workspace_bytes(info.workspaceBytes);
                           r->set_comm_ctas(info.commCtas);
                           if (info.controlFd >= 0) {
                             const int fds[] = {info.controlFd};
                             return self->reply(rid, response, fds);
                           }
                           self->reply(rid, response);
                         });
    timer->async_wait([weak, uniqueId, rank = join.rank(), timeoutMs](boost::system::error_code ec) {
      auto self = weak.lock();
      if (ec || !self) return;
      self->server_.engine_.cancelJoin(self->id_, uniqueId, rank, timeoutMs);
    });
  }

  pb::Response& statusReply(pb::Response& response) {
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
    for (const auto& s : st.sessions) {
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
    return response;
  }

  Server& server_;
  stream_protocol::socket socket_;
  asio::posix::stream_descriptor processExit_{socket_.get_executor()};
  uint64_t id_;
  FrameDecoder decoder_;
  uint32_t pid_ = 0, uid_ = ~0u, gid_ = ~0u;
  bool helloDone_ = false;
  bool closed_ = false;
  std::shared_ptr<SessionChannel> channel_;
  std::vector<std::shared_ptr<asio::steady_timer>> joinTimers_;
};

// ---- the listener ------------------------------------------------------------------------------------

Server::Server(const DaemonConfig& config, Engine& engine, std::string backendName)
    : config_(config), engine_(engine), backend_(std::move(backendName)), acceptor_(io_) {
  if (int fd = inheritedSocket(); fd >= 0) {
    acceptor_.assign(stream_protocol(), fd);
    ownsSocketFile_ = false;
    socketPath_ = acceptor_.local_endpoint().path();
    spdlog::info("serving the systemd-activated socket {}", socketPath_);
  } else {
    socketPath_ = config.daemon.socket.empty() ? defaultSocketPath(false) : config.daemon.socket;
    namespace fs = std::filesystem;
    const fs::path path(socketPath_);
    std::error_code ec;
    if (!fs::exists(path.parent_path())) {
      fs::create_directories(path.parent_path(), ec);
      if (ec) fail(ErrorCode::kSystem, "create socket directory {}: {}", path.parent_path().string(), ec.message());
      ::chmod(path.parent_path().c_str(), 0750);
    }
    if (fs::exists(path)) {
      // A live daemon answers a connect; a stale file from a crashed one does not.
      stream_protocol::socket probe(io_);
      boost::system::error_code connectError;
      probe.connect(stream_protocol::endpoint(socketPath_), connectError);
      if (!connectError) {
        fail(ErrorCode::kSystem, "another tandemd already serves {}; stop it first or pass another --socket",
             socketPath_);
      }
      fs::remove(path, ec);
    }
    boost::system::error_code bindError;
    acceptor_.open(stream_protocol(), bindError);
    if (!bindError) acceptor_.bind(stream_protocol::endpoint(socketPath_), bindError);
    if (!bindError) acceptor_.listen(asio::socket_base::max_listen_connections, bindError);
    if (bindError) {
      fail(ErrorCode::kSystem, "bind control socket {}: {}. Check that the directory is writable, or pass --socket",
           socketPath_, bindError.message());
    }
    if (::chmod(socketPath_.c_str(), config.access.socketMode) != 0) {
      checkErrno(-1, fmt::format("chmod {:o} {}", config.access.socketMode, socketPath_));
    }
  }
  engine_.setSessionFaultHandler([this](uint64_t id, std::string why) {
    asio::post(io_, [this, id, why = std::move(why)] {
      spdlog::warn("closing session {}: {}", id, why);
      closeSession(id, why);
    });
  });
}

Server::~Server() {
  engine_.setSessionFaultHandler(nullptr);
  if (ownsSocketFile_ && !socketPath_.empty()) ::unlink(socketPath_.c_str());
}

void Server::run() {
  accept();
  io_.run();
}

void Server::stop() {
  asio::post(io_, [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
    for (auto& [id, s] : std::map(sessions_)) s->close("tandemd is shutting down");
    sessions_.clear();
    io_.stop();
  });
}

void Server::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream_protocol::socket socket) {
    if (ec) {
      if (ec != asio::error::operation_aborted) spdlog::warn("accept failed: {}", ec.message());
      if (!acceptor_.is_open()) return;
    } else {
      const uint64_t id = nextSessionId_++;
      auto session = std::make_shared<ControlSession>(*this, std::move(socket), id);
      sessions_[id] = session;
      session->start();
    }
    accept();
  });
}

void Server::closeSession(uint64_t id, const std::string& why) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  auto session = it->second;
  sessions_.erase(it);
  spdlog::debug("connection {} closed: {}", id, why);
  session->close(why);
}

}  // namespace tandem::daemon
