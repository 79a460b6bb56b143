// The connection side of ControlSession (control_session.hpp): reading frames and their fds, the Hello and frame
// deadlines, replies written without blocking (a client that does not read them is dropped past
// limits.max_reply_backlog_bytes), and closes that always take effect after the current handler.
#include "control_session.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

namespace tandem::daemon {
namespace {

// The fds a request of this kind carries (SCM_RIGHTS): a memfd or cuda-fd registration takes one, nothing else any.
std::size_t fdsTaken(const pb::Request& request) {
  if (request.body_case() != pb::Request::kRegisterBuffer) return 0;
  const auto kind = request.register_buffer().kind();
  return kind == pb::REGISTER_KIND_MEMFD || kind == pb::REGISTER_KIND_CUDA_FD ? 1 : 0;
}

}  // namespace

pb::Response errorResponse(uint64_t requestId, ErrorCode code, const std::string& message) {
  pb::Response response;
  response.set_request_id(requestId);
  response.mutable_status()->set_code(static_cast<pb::StatusCode>(wireCode(code)));
  response.mutable_status()->set_message(message);
  return response;
}

void ControlSession::start() {
  spdlog::debug("connection {} from pid {} uid {}", id_, pid_, uid_);
  boost::system::error_code nbError;
  socket_.non_blocking(true, nbError);
  watchProcess();
  helloTimer_.expires_after(std::chrono::milliseconds(server_.config_.limits.helloTimeoutMs));
  helloTimer_.async_wait([weak = weak_from_this()](boost::system::error_code ec) {
    auto self = weak.lock();
    if (ec || !self || self->closed_ || self->helloDone_) return;
    self->drop(Server::WarnKind::kDeadline,
               fmt::format("sent no Hello within {} ms (limits.hello_timeout_ms)",
                           self->server_.config_.limits.helloTimeoutMs));
  });
  waitRead();
}

void ControlSession::close(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  for (auto& [seq, t] : joinTimers_) t->cancel();
  joinTimers_.clear();
  helloTimer_.cancel();
  frameTimer_.cancel();
  out_.clear();  // closes the fds queued with unsent replies
  boost::system::error_code ec;
  socket_.close(ec);
  processExit_.close(ec);
  if (helloDone_) server_.engine_.closeSession(id_, why);
}

// Connected this long ago without saying Hello (nullopt once it has).
std::optional<Clock::duration> ControlSession::silentFor() const {
  if (helloDone_) return std::nullopt;
  return Clock::now() - acceptedAt_;
}

// Closes this connection because of what the client did, with the reason in the log.
void ControlSession::drop(Server::WarnKind kind, const std::string& reason) {
  if (closed_ || closing_) return;
  server_.warnLimited(kind, fmt::format("{}: disconnected: it {}", who(), reason));
  closeLater(reason);
}

// Every close that starts inside this session (a reply that overflowed the backlog, a failed send, a bad frame,
// a hang-up) takes effect after the current handler returns: the handler may be running inside an engine call
// that is answering it (a join's reply), and closing the session goes back into the engine. From now on nothing
// more is read or sent.
void ControlSession::closeLater(const std::string& why) {
  if (closed_ || closing_) return;
  closing_ = true;
  asio::post(socket_.get_executor(), [self = shared_from_this(), why] { self->server_.closeSession(self->id_, why); });
}

// A process that dies while another process still holds its connection (a child that inherited the fd
// through fork) never hangs the socket up. Its pidfd becomes readable when it exits, so its ranks are
// reported lost at once instead of never.
void ControlSession::watchProcess() {
  const int fd = pid_ != 0 ? static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)) : -1;
  if (fd < 0) {
    spdlog::debug("connection {}: no pidfd for pid {} ({}); relying on the socket alone", id_, pid_,
                  std::strerror(errno));
    return;
  }
  processExit_.assign(fd);
  waitProcessExit();
}

void ControlSession::waitProcessExit() {
  processExit_.async_wait(asio::posix::stream_descriptor::wait_read,
                          [self = shared_from_this()](boost::system::error_code ec) {
                            if (ec || self->closed_ || self->closing_) return;
                            // The reactor can report a descriptor ready when it is not (a readiness queued for an
                            // fd number that was closed and reused in between): the pidfd itself says whether the
                            // process has exited. Closing a live client's session on a false alarm would fail its
                            // Hello or its ops.
                            pollfd p{self->processExit_.native_handle(), POLLIN, 0};
                            if (::poll(&p, 1, 0) <= 0) {
                              spdlog::debug("connection {}: pidfd woke, but pid {} is alive", self->id_, self->pid_);
                              return self->waitProcessExit();
                            }
                            self->closeLater(fmt::format("process {} exited (its connection was still open, held by "
                                                         "another process)", self->pid_));
                          });
}

void ControlSession::waitRead() {
  socket_.async_wait(stream_protocol::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
    if (ec || self->closed_ || self->closing_) return;
    self->onReadable();
  });
}

// One recvmsg per wakeup, so that every connection gets its turn on the control thread.
void ControlSession::onReadable() {
  std::vector<char> data(kReadChunkBytes);
  // At most kMaxFdsPerFrame fds per read (the kernel closes the rest); the reader marks the frame they belong to.
  Received r = recvWithFds(socket_.native_handle(), std::as_writable_bytes(std::span(data)));
  const long n = r.n;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return waitRead();
  if (n <= 0) {
    const std::string why = n < 0 ? fmt::format("connection error: {}", std::strerror(errno))
                            : reader_.midFrame() ? "client disconnected in the middle of a frame"
                                                 : "client disconnected";
    return closeLater(why);
  }
  bool framesCompleted = false;
  try {
    std::vector<InFrame> frames = reader_.add({data.data(), static_cast<std::size_t>(n)}, std::move(r.fds),
                                              r.truncated);
    framesCompleted = !frames.empty();
    for (InFrame& frame : frames) {
      handleFrame(frame);
      if (closed_ || closing_) return;
    }
    reader_.checkStream();
  } catch (const Error& e) {
    // Framing errors (and frames that are not a Request) leave the stream unusable: answer once, then close.
    sendError(0, e.code(), e.what());
    return drop(Server::WarnKind::kRefused, fmt::format("sent a bad frame: {}", e.what()));
  }
  updateFrameDeadline(framesCompleted);
  waitRead();
}

// A frame in progress must be whole within limits.frame_timeout_ms of its first byte.
void ControlSession::updateFrameDeadline(bool framesCompleted) {
  if (!reader_.midFrame()) {
    if (frameDeadlineArmed_) {
      frameDeadlineArmed_ = false;
      ++frameGeneration_;
      frameTimer_.cancel();
    }
    return;
  }
  if (frameDeadlineArmed_ && !framesCompleted) return;  // the same frame is still arriving
  frameDeadlineArmed_ = true;
  const uint64_t generation = ++frameGeneration_;
  frameTimer_.expires_after(std::chrono::milliseconds(server_.config_.limits.frameTimeoutMs));
  frameTimer_.async_wait([weak = weak_from_this(), generation](boost::system::error_code ec) {
    auto self = weak.lock();
    if (ec || !self || self->closed_ || generation != self->frameGeneration_) return;
    self->drop(Server::WarnKind::kDeadline,
               fmt::format("left a frame unfinished for {} ms (limits.frame_timeout_ms)",
                           self->server_.config_.limits.frameTimeoutMs));
  });
}

// Replies go out without blocking: what the socket does not take now waits here, and a client that lets more
// than limits.max_reply_backlog_bytes wait is disconnected instead of holding the control thread.
void ControlSession::send(const pb::Response& response, std::span<const int> fds) {
  if (closed_ || closing_) return;
  std::string frame;
  try {
    frame = encodeFrame(response.SerializeAsString(), server_.config_.limits.maxFrameBytes);
  } catch (const Error& e) {
    spdlog::warn("{}: reply to request {} not sent: {}", who(), response.request_id(), e.what());
    return send(errorResponse(response.request_id(), ErrorCode::kInternal,
                              fmt::format("the reply is larger than limits.max_frame_bytes ({} bytes); raise it in "
                                          "tandemd.yaml", server_.config_.limits.maxFrameBytes)));
  }
  OutFrame out{std::move(frame), {}, 0};
  if (out_.empty()) {
    const std::optional<std::size_t> sent = sendSome(out.bytes, fds);
    if (!sent) return;  // the peer is gone; closed
    out.sent = *sent;
    if (out.sent == out.bytes.size()) return;
  }
  if (out.sent == 0) {
    // The fds must outlive the objects they belong to (a buffer freed by a later request): keep duplicates.
    for (const int fd : fds) {
      const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) {
        return drop(Server::WarnKind::kBacklog,
                    fmt::format("could not be sent a reply with fds while its replies wait: fcntl(F_DUPFD) -> {}",
                                std::strerror(errno)));
      }
      out.fds.emplace_back(copy);
    }
  }
  outBytes_ += out.bytes.size() - out.sent;
  out_.push_back(std::move(out));
  if (outBytes_ > server_.config_.limits.maxReplyBacklogBytes) {
    return drop(Server::WarnKind::kBacklog,
                fmt::format("did not read its replies: {} bytes waited, over limits.max_reply_backlog_bytes ({})",
                            outBytes_, server_.config_.limits.maxReplyBacklogBytes));
  }
  waitWrite();
}

// Writes what the socket takes now. Returns the bytes written, or nullopt when the connection is broken (it is
// then closed).
std::optional<std::size_t> ControlSession::sendSome(std::string_view bytes, std::span<const int> fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket_.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n >= 0) return static_cast<std::size_t>(n);
  if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
  const int err = errno;
  closeLater(fmt::format("sending a reply failed: {}", std::strerror(err)));
  return std::nullopt;
}

void ControlSession::waitWrite() {
  if (writeWaiting_ || closed_) return;
  writeWaiting_ = true;
  socket_.async_wait(stream_protocol::socket::wait_write, [self = shared_from_this()](boost::system::error_code ec) {
    self->writeWaiting_ = false;
    if (ec || self->closed_ || self->closing_) return;
    self->flush();
  });
}

void ControlSession::flush() {
  while (!out_.empty()) {
    OutFrame& front = out_.front();
    std::vector<int> fds;
    if (front.sent == 0) {
      for (const Fd& fd : front.fds) fds.push_back(fd.get());
    }
    const std::optional<std::size_t> sent = sendSome(std::string_view(front.bytes).substr(front.sent), fds);
    if (!sent) return;
    if (*sent == 0) return waitWrite();
    front.sent += *sent;
    outBytes_ -= *sent;
    if (front.sent == front.bytes.size()) out_.pop_front();  // and its duplicated fds close
  }
}

void ControlSession::sendError(uint64_t requestId, ErrorCode code, const std::string& message) {
  send(errorResponse(requestId, code, message));
}

void ControlSession::handleFrame(InFrame& frame) {
  pb::Request request;
  if (!request.ParseFromString(frame.bytes)) {
    fail(ErrorCode::kProtocol, "malformed request frame ({} bytes that are not a tandem.v1.Request); use libtandem "
         "or tandemctl of the same release", frame.bytes.size());
  }
  const uint64_t rid = request.request_id();
  // fds beyond what the request takes are closed now (with `frame`) and the request is refused, so that no
  // client can park descriptors in the daemon.
  const std::size_t taken = fdsTaken(request);
  if (frame.fdOverflow || frame.fds.size() > taken) {
    const std::string message = fmt::format(
        "request {} carried {}{} file descriptors, but this kind of request takes {}; they were closed and the "
        "request refused. Send fds only with tandem_register (one memfd or cuda fd)",
        rid, frame.fdOverflow ? "more than " : "", frame.fdOverflow ? kMaxFdsPerFrame : frame.fds.size(), taken);
    server_.warnLimited(Server::WarnKind::kFds, fmt::format("{}: {}", who(), message));
    frame.fds.clear();  // closed before the answer, so a client that sees it sees them gone
    sendError(rid, ErrorCode::kInvalidArgument, message);
    if (!helloDone_) closeLater(message);
    return;
  }
  frameFds_ = &frame.fds;
  try {
    dispatch(request);
  } catch (const Error& e) {
    sendError(rid, e.code(), e.what());
    // A peer that fails Hello (wrong version, not allowed, or something else first) gets no session.
    if (!helloDone_ || e.code() == ErrorCode::kVersionMismatch || e.code() == ErrorCode::kPermissionDenied) {
      closeLater(e.what());
    }
  } catch (const std::exception& e) {
    sendError(rid, ErrorCode::kInternal, e.what());
  }
  frameFds_ = nullptr;
}

// The next fd that came with the request being handled.
Fd ControlSession::takeFd() {
  if (frameFds_ == nullptr || frameFds_->empty()) {
    fail(ErrorCode::kProtocol, "message needs a file descriptor, but none arrived with it (SCM_RIGHTS)");
  }
  Fd fd = std::move(frameFds_->front());
  frameFds_->erase(frameFds_->begin());
  return fd;
}

void ControlSession::reply(uint64_t rid, pb::Response& response, std::span<const int> fds) {
  response.set_request_id(rid);
  response.mutable_status()->set_code(pb::STATUS_CODE_OK);
  send(response, fds);
}

}  // namespace tandem::daemon
