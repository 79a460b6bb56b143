#include "server.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <vector>

#include "plan_table.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/protocol.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::daemon {
namespace asio = boost::asio;
using asio::local::stream_protocol;
using Clock = std::chrono::steady_clock;
namespace pb = tandem::v1;

namespace {

// One recvmsg reads at most this much, so a client streaming a large frame yields the control thread to the
// others every 64 KiB.
constexpr std::size_t kReadChunkBytes = 64 * 1024;
// accept() failing (EMFILE, ENFILE, ENOBUFS) is retried after 10 ms, doubling up to 1 s: the waiting connection
// stays queued, so retrying at once would spin.
constexpr auto kAcceptBackoffMin = std::chrono::milliseconds(10);
constexpr auto kAcceptBackoffMax = std::chrono::milliseconds(1000);
// While accept() fails for want of fds, each retry answers up to this many queued connections with an error.
constexpr int kRefusalsPerRetry = 64;
// A connection refused for a cap is answered and then kept (write side shut) until the client hangs up, at most this
// long, so that its Hello, sent before it reads, never meets a closed socket; at most kMaxLingering at once.
constexpr auto kRefusalLinger = std::chrono::milliseconds(1000);
constexpr std::size_t kMaxLingering = 64;
// Out of fds, connections that have been silent (no Hello) this long are dropped to make room: an honest client
// says Hello within microseconds of connecting.
constexpr auto kPreHelloEvictAge = std::chrono::milliseconds(100);
// Client warnings: at most this many lines of one kind per window, then one line with the count left out.
constexpr auto kWarnWindow = std::chrono::seconds(10);
constexpr uint32_t kWarnsPerWindow = 10;

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

uint32_t readLength(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

// The fds a request of this kind carries (SCM_RIGHTS): a memfd or cuda-fd registration takes one, nothing else any.
std::size_t fdsTaken(const pb::Request& request) {
  if (request.body_case() != pb::Request::kRegisterBuffer) return 0;
  const auto kind = request.register_buffer().kind();
  return kind == pb::REGISTER_KIND_MEMFD || kind == pb::REGISTER_KIND_CUDA_FD ? 1 : 0;
}

pb::Response errorResponse(uint64_t requestId, ErrorCode code, const std::string& message) {
  pb::Response response;
  response.set_request_id(requestId);
  response.mutable_status()->set_code(static_cast<pb::StatusCode>(wireCode(code)));
  response.mutable_status()->set_message(message);
  return response;
}

// One received frame and the fds that came with it.
struct InFrame {
  std::string bytes;
  std::vector<Fd> fds;
  bool fdOverflow = false;  // more fds arrived for it than one frame may carry; the extras are already closed
};

// Splits the byte stream of one connection into frames and ties each received fd to its frame. A sender attaches
// a frame's fds to the frame's first byte, and the kernel ends a read at the data that carried fds, so the fds of
// one read belong to the last frame that starts within that read (or to the frame in progress when none starts).
// Holds at most one partial frame (limits.max_frame_bytes) and kMaxFdsPerFrame fds.
class FrameReader {
 public:
  explicit FrameReader(std::size_t maxFrameBytes) : maxFrameBytes_(maxFrameBytes) {}

  // Adds one read and returns the frames it completed. A frame announcing more than limits.max_frame_bytes ends the
  // parse: the frames before it are returned, and checkStream() throws for it.
  std::vector<InFrame> add(std::span<const char> bytes, std::vector<Fd> fds, bool fdsTruncated) {
    const std::size_t base = buffer_.size();
    buffer_.append(bytes.data(), bytes.size());
    // Frame boundaries in the buffer: starts[i] begins frame i; complete frames end where the next starts.
    std::vector<std::size_t> starts{0};
    std::size_t pos = 0;
    std::size_t complete = 0;
    while (buffer_.size() - pos >= kFrameHeaderBytes) {
      const uint32_t length = readLength(buffer_.data() + pos);
      if (length > maxFrameBytes_) {
        oversized_ = length;
        break;
      }
      if (buffer_.size() - pos - kFrameHeaderBytes < length) break;
      pos += kFrameHeaderBytes + length;
      ++complete;
      if (pos < buffer_.size()) starts.push_back(pos);
    }
    std::size_t owner = 0;  // index into starts of the frame this read's fds belong to
    for (std::size_t i = starts.size(); i-- > 0;) {
      if (starts[i] >= base) {
        owner = i;
        break;
      }
    }
    std::vector<InFrame> frames(complete);
    InFrame partial;
    const auto frameAt = [&](std::size_t i) -> InFrame& { return i < complete ? frames[i] : partial; };
    frameAt(0).fds = std::move(partialFds_);
    frameAt(0).fdOverflow = partialOverflow_;
    InFrame& target = frameAt(owner);
    for (Fd& fd : fds) {
      if (target.fds.size() < kMaxFdsPerFrame) {
        target.fds.push_back(std::move(fd));
      } else {
        target.fdOverflow = true;  // the Fd is closed when `fds` goes
      }
    }
    if (fdsTruncated) target.fdOverflow = true;
    for (std::size_t i = 0; i < complete; ++i) {
      const std::size_t begin = starts[i] + kFrameHeaderBytes;
      const std::size_t end = i + 1 < starts.size() ? starts[i + 1] : pos;
      frames[i].bytes.assign(buffer_, begin, end - begin);
    }
    buffer_.erase(0, pos);
    partialFds_ = std::move(partial.fds);
    partialOverflow_ = partial.fdOverflow;
    // A dropped partial frame may have grown the buffer to a whole max_frame_bytes: give that memory back.
    if (buffer_.empty() && buffer_.capacity() > kReadChunkBytes) std::string().swap(buffer_);
    return frames;
  }

  bool midFrame() const { return !buffer_.empty(); }

  // Throws Error(kProtocol) once a frame announced more than limits.max_frame_bytes; the stream is unusable then.
  void checkStream() const {
    if (oversized_ != 0) {
      fail(ErrorCode::kProtocol, "incoming frame announces {} bytes, over the limit of {} bytes "
           "(limits.max_frame_bytes)", oversized_, maxFrameBytes_);
    }
  }

 private:
  std::size_t maxFrameBytes_;
  uint32_t oversized_ = 0;  // the length of an oversized frame that stopped the parse
  std::string buffer_;  // the bytes of the frame in progress (nothing after it)
  std::vector<Fd> partialFds_;
  bool partialOverflow_ = false;
};

}  // namespace

// ---- one connection ----------------------------------------------------------------------------------

class ControlSession : public std::enable_shared_from_this<ControlSession> {
 public:
  ControlSession(Server& server, stream_protocol::socket socket, uint64_t id, ucred cred)
      : server_(server),
        socket_(std::move(socket)),
        id_(id),
        reader_(server.config_.limits.maxFrameBytes),
        pid_(static_cast<uint32_t>(cred.pid)),
        uid_(cred.uid),
        gid_(cred.gid) {}

  void start() {
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

  void close(const std::string& why) {
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

  uint64_t id() const { return id_; }
  uint32_t uid() const { return uid_; }
  // Its close is posted (closeLater): it no longer counts against the connection caps.
  bool closing() const { return closing_; }
  // Connected this long ago without saying Hello (nullopt once it has).
  std::optional<Clock::duration> silentFor() const {
    if (helloDone_) return std::nullopt;
    return Clock::now() - acceptedAt_;
  }
  void evict(const std::string& reason) { drop(Server::WarnKind::kAccept, reason); }

 private:
  // An outgoing frame; its fds (duplicates, owned here) travel with its first byte.
  struct OutFrame {
    std::string bytes;
    std::vector<Fd> fds;
    std::size_t sent = 0;
  };

  std::string who() const { return fmt::format("connection {} (pid {}, uid {})", id_, pid_, uid_); }

  // Closes this connection because of what the client did, with the reason in the log.
  void drop(Server::WarnKind kind, const std::string& reason) {
    if (closed_ || closing_) return;
    server_.warnLimited(kind, fmt::format("{}: disconnected: it {}", who(), reason));
    closeLater(reason);
  }

  // Every close that starts inside this session (a reply that overflowed the backlog, a failed send, a bad frame,
  // a hang-up) takes effect after the current handler returns: the handler may be running inside an engine call
  // that is answering it (a join's reply), and closing the session goes back into the engine. From now on nothing
  // more is read or sent.
  void closeLater(const std::string& why) {
    if (closed_ || closing_) return;
    closing_ = true;
    asio::post(socket_.get_executor(), [self = shared_from_this(), why] { self->server_.closeSession(self->id_, why); });
  }

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
                              self->closeLater(fmt::format("process {} exited (its connection was still open, held by "
                                                           "another process)", self->pid_));
                            });
  }

  void waitRead() {
    socket_.async_wait(stream_protocol::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_ || self->closing_) return;
      self->onReadable();
    });
  }

  // One recvmsg per wakeup, so that every connection gets its turn on the control thread.
  void onReadable() {
    std::vector<char> data(kReadChunkBytes);
    iovec iov{data.data(), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    // Fixed size: however many fds a client sends, one read takes at most kMaxFdsPerFrame; the kernel closes the
    // rest (MSG_CTRUNC), so they cannot pile up here.
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
      n = ::recvmsg(socket_.native_handle(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return waitRead();
    std::vector<Fd> fds;
    if (n >= 0) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          fds.emplace_back(fd);
        }
      }
    }
    if (n <= 0) {
      const std::string why = n < 0 ? fmt::format("connection error: {}", std::strerror(errno))
                              : reader_.midFrame() ? "client disconnected in the middle of a frame"
                                                   : "client disconnected";
      return closeLater(why);
    }
    bool framesCompleted = false;
    try {
      std::vector<InFrame> frames = reader_.add({data.data(), static_cast<std::size_t>(n)}, std::move(fds),
                                                (msg.msg_flags & MSG_CTRUNC) != 0);
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
  void updateFrameDeadline(bool framesCompleted) {
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
  void send(const pb::Response& response, std::span<const int> fds = {}) {
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
  std::optional<std::size_t> sendSome(std::string_view bytes, std::span<const int> fds) {
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

  void waitWrite() {
    if (writeWaiting_ || closed_) return;
    writeWaiting_ = true;
    socket_.async_wait(stream_protocol::socket::wait_write, [self = shared_from_this()](boost::system::error_code ec) {
      self->writeWaiting_ = false;
      if (ec || self->closed_ || self->closing_) return;
      self->flush();
    });
  }

  void flush() {
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

  void sendError(uint64_t requestId, ErrorCode code, const std::string& message) {
    send(errorResponse(requestId, code, message));
  }

  void handleFrame(InFrame& frame) {
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
  Fd takeFd() {
    if (frameFds_ == nullptr || frameFds_->empty()) {
      fail(ErrorCode::kProtocol, "message needs a file descriptor, but none arrived with it (SCM_RIGHTS)");
    }
    Fd fd = std::move(frameFds_->front());
    frameFds_->erase(frameFds_->begin());
    return fd;
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

  // Root and the daemon's own user administer it; every other caller sees only its own session.
  bool privileged() const { return uid_ == 0 || uid_ == ::geteuid(); }

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
  void setPlan(const pb::SetPlan& req) {
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

  void join(uint64_t rid, const pb::JoinCommunicator& join) {
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

  Server& server_;
  stream_protocol::socket socket_;
  asio::posix::stream_descriptor processExit_{socket_.get_executor()};
  asio::steady_timer helloTimer_{socket_.get_executor()};
  asio::steady_timer frameTimer_{socket_.get_executor()};
  uint64_t id_;
  Clock::time_point acceptedAt_ = Clock::now();
  FrameReader reader_;
  std::vector<Fd>* frameFds_ = nullptr;  // the fds of the request being dispatched
  uint64_t frameGeneration_ = 0;         // names the frame deadline in force; older timers do nothing
  bool frameDeadlineArmed_ = false;
  std::deque<OutFrame> out_;
  std::size_t outBytes_ = 0;
  bool writeWaiting_ = false;
  uint32_t pid_ = 0, uid_ = ~0u, gid_ = ~0u;
  bool helloDone_ = false;
  bool closing_ = false;  // closeLater() posted the close; the session ignores its client from then on
  bool closed_ = false;
  std::shared_ptr<SessionChannel> channel_;
  std::map<uint64_t, std::shared_ptr<asio::steady_timer>> joinTimers_;  // pending joins, by nextJoinSeq_
  uint64_t nextJoinSeq_ = 0;
};

// ---- a connection refused for a cap --------------------------------------------------------------------

// Holds one error frame's worth of a connection: the answer is written at once, and the socket stays open (its write
// side shut) until the client hangs up or kRefusalLinger passes, so the client reads the answer instead of a reset.
class RefusedConnection : public std::enable_shared_from_this<RefusedConnection> {
 public:
  RefusedConnection(Server& server, stream_protocol::socket socket, uint64_t id)
      : server_(server), socket_(std::move(socket)), id_(id), linger_(socket_.get_executor()) {}

  void start(const std::string& frame) {
    boost::system::error_code ec;
    socket_.non_blocking(true, ec);
    // Far below the socket buffer: sent whole or the client is gone.
    [[maybe_unused]] const ssize_t n =
        ::send(socket_.native_handle(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(socket_.native_handle(), SHUT_WR);
    linger_.expires_after(kRefusalLinger);
    linger_.async_wait([self = shared_from_this()](boost::system::error_code e) {
      if (!e) self->finish();
    });
    waitRead();
  }

  void finish() {
    boost::system::error_code ec;
    linger_.cancel();
    socket_.close(ec);
    server_.lingering_.erase(id_);
  }

 private:
  // Reads and drops what the client sends (its Hello) until it hangs up.
  void waitRead() {
    socket_.async_wait(stream_protocol::socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || !self->socket_.is_open()) return;
      char sink[4096];
      const ssize_t n = ::recv(self->socket_.native_handle(), sink, sizeof sink, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return self->finish();
      self->waitRead();
    });
  }

  Server& server_;
  stream_protocol::socket socket_;
  uint64_t id_;
  asio::steady_timer linger_;
};

// ---- the listener ------------------------------------------------------------------------------------

Server::Server(const DaemonConfig& config, Engine& engine, std::string backendName)
    : config_(config), engine_(engine), backend_(std::move(backendName)), acceptor_(io_) {
  // Before the socket listens, so that the daemon's idle fds are fixed once a client can connect.
  raiseOpenFileLimit();
  reserveFd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (int fd = inheritedSocket(); fd >= 0) {
    acceptor_.assign(stream_protocol(), fd);
    ownsSocketFile_ = false;
    socketPath_ = acceptor_.local_endpoint().path();
    spdlog::info("serving the systemd-activated socket {}", socketPath_);
  } else {
    socketPath_ = config.daemon.socket.empty() ? defaultSocketPath(false) : config.daemon.socket;
    // The default path comes from $XDG_RUNTIME_DIR, which the config check never saw.
    if (socketPath_.size() >= sizeof(sockaddr_un{}.sun_path)) {
      fail(ErrorCode::kInvalidConfig, "socket path {} is {} bytes, but a Unix socket address holds at most {} "
           "(sun_path). Set daemon.socket (or --socket) to a shorter path", socketPath_, socketPath_.size(),
           sizeof(sockaddr_un{}.sun_path) - 1);
    }
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
  boost::system::error_code ec;
  acceptor_.non_blocking(true, ec);  // the refusal path below calls accept4 on it directly
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

// Every session may hold limits.max_fds_per_session fds. systemd's LimitNOFILE sets the soft and hard limits; run
// by hand, the soft limit is often 1024 while the hard one is far higher, and epoll-based code may raise it.
void Server::raiseOpenFileLimit() {
  const auto& l = config_.limits;
  const uint64_t needed = uint64_t{l.maxSessions} * l.maxFdsPerSession;
  const uint64_t wanted = 2 * needed;  // as much again for connections before Hello, communicators, the backend
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  if (limit.rlim_cur < wanted && limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = std::min<rlim_t>(wanted, limit.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur < needed) {
    spdlog::warn("the open-file limit is {} but limits.max_sessions x limits.max_fds_per_session = {} x {} = {}: "
                 "sessions will be refused for want of fds before that. Set LimitNOFILE={} in tandemd.service (or "
                 "ulimit -n), or lower those keys", limit.rlim_cur, l.maxSessions, l.maxFdsPerSession, needed, wanted);
  }
}

void Server::run() {
  accept();
  io_.run();
}

void Server::every(std::chrono::microseconds period, std::function<void()> tick) {
  tickers_.push_back(std::make_unique<Ticker>(io_, period, std::move(tick)));
  tickers_.back()->arm();
}

void Server::Ticker::arm() {
  timer.expires_after(period);
  timer.async_wait([this](boost::system::error_code ec) {
    if (ec) return;  // cancelled by stop()
    tick();
    arm();
  });
}

void Server::stop() {
  asio::post(io_, [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
    acceptRetry_.cancel();
    for (auto& t : tickers_) t->timer.cancel();
    for (auto& [id, s] : std::map(sessions_)) s->close("tandemd is shutting down");
    sessions_.clear();
    for (auto& [id, r] : std::map(lingering_)) r->finish();
    io_.stop();
  });
}

void Server::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream_protocol::socket socket) {
    if (!acceptor_.is_open() || ec == asio::error::operation_aborted) return;
    if (ec) return onAcceptError(ec);
    acceptBackoff_ = std::chrono::milliseconds(0);
    try {
      onAccepted(std::move(socket));
    } catch (const std::exception& e) {
      // Out of memory or fds while setting a connection up: that connection goes, the listener stays.
      warnLimited(WarnKind::kAccept, fmt::format("setting up a new connection failed: {}", e.what()));
    }
    accept();
  });
}

void Server::onAccepted(stream_protocol::socket socket) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    cred.uid = ~0u;
    cred.gid = ~0u;
  }
  // Connections count from accept, before Hello: silent ones hold fds and memory as sessions do.
  const auto& l = config_.limits;
  uint32_t ofUid = 0, open = 0;
  for (const auto& [id, s] : sessions_) {
    if (s->closing()) continue;
    ++open;
    ofUid += s->uid() == cred.uid ? 1 : 0;
  }
  std::string refusal;
  if (open >= l.maxSessions) {
    refusal = fmt::format("tandemd already serves {} connections (limits.max_sessions); close idle clients, retry "
                          "later, or raise limits.max_sessions in tandemd.yaml", open);
  } else if (ofUid >= l.maxSessionsPerUid) {
    refusal = fmt::format("uid {} already has {} connections to tandemd (limits.max_sessions_per_uid); close some of "
                          "them, or raise limits.max_sessions_per_uid in tandemd.yaml", cred.uid, ofUid);
  }
  if (!refusal.empty()) {
    warnLimited(WarnKind::kRefused, fmt::format("refused a connection from pid {} uid {}: {}", cred.pid, cred.uid,
                                                refusal));
    if (lingering_.size() >= kMaxLingering) return refuse(socket.release(), ErrorCode::kUnavailable, refusal);
    const uint64_t id = nextSessionId_++;
    auto refused = std::make_shared<RefusedConnection>(*this, std::move(socket), id);
    lingering_[id] = refused;
    return refused->start(
        encodeFrame(errorResponse(0, ErrorCode::kUnavailable, refusal).SerializeAsString(), config_.limits.maxFrameBytes));
  }
  const uint64_t id = nextSessionId_++;
  auto session = std::make_shared<ControlSession>(*this, std::move(socket), id, cred);
  sessions_[id] = session;
  session->start();
}

void Server::refuse(int fd, ErrorCode code, const std::string& message) {
  const Fd socket(fd);
  // Take what the client already sent (its Hello): closing with unread data would reset the connection before the
  // client reads the answer. Bounded, and never blocking.
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  const std::string frame = encodeFrame(errorResponse(0, code, message).SerializeAsString(), config_.limits.maxFrameBytes);
  [[maybe_unused]] const ssize_t n = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Server::onAcceptError(const boost::system::error_code& ec) {
  const int err = ec.category() == boost::system::system_category() ? ec.value() : 0;
  const bool outOfFds = err == EMFILE || err == ENFILE;
  acceptBackoff_ = acceptBackoff_.count() == 0 ? kAcceptBackoffMin : std::min(acceptBackoff_ * 2, kAcceptBackoffMax);
  // Silent connections are the likely cause, and dropping them lets honest clients in rather than refusing them.
  std::size_t evicted = 0, silentYoung = 0;
  if (outOfFds) {
    for (auto& [id, s] : std::map(sessions_)) {
      const auto silent = s->silentFor();
      if (!silent) continue;
      if (*silent < kPreHelloEvictAge) {
        ++silentYoung;
        continue;
      }
      s->evict(fmt::format("was dropped without having said Hello for {} ms: tandemd ran out of file descriptors",
                           std::chrono::duration_cast<std::chrono::milliseconds>(*silent).count()));
      ++evicted;
    }
    // Retry soon: either room was made, or it will be once the young silent ones are old enough to drop.
    if (evicted > 0 || silentYoung > 0) acceptBackoff_ = kAcceptBackoffMin;
  }
  if (outOfFds && evicted == 0 && silentYoung == 0) {
    warnLimited(WarnKind::kAccept,
                fmt::format("accept failed: {} [accept -> {}] with {} connections open; waiting connections are told "
                            "so, and accepting resumes in {} ms. Raise LimitNOFILE in tandemd.service (or ulimit -n), "
                            "or lower limits.max_sessions or limits.max_fds_per_session",
                            ec.message(), err == EMFILE ? "EMFILE" : "ENFILE", sessions_.size(), acceptBackoff_.count()));
    // Free the reserve fd to take queued connections one by one and tell each why, rather than leave them hanging.
    const std::string message = fmt::format(
        "tandemd cannot take this connection: it has run out of file descriptors ({}). Retry later; its "
        "administrator can raise LimitNOFILE in tandemd.service or lower limits.max_sessions or "
        "limits.max_fds_per_session", ec.message());
    reserveFd_.reset();
    for (int i = 0; i < kRefusalsPerRetry; ++i) {
      const int fd = ::accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      refuse(fd, ErrorCode::kUnavailable, message);
    }
    reserveFd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  } else if (outOfFds) {
    warnLimited(WarnKind::kAccept, fmt::format("accept failed: {}: dropped {} connections that had not said Hello "
                                               "(and {} more will go unless they do); retrying in {} ms. Raise "
                                               "LimitNOFILE in tandemd.service if honest load needs more fds",
                                               ec.message(), evicted, silentYoung, acceptBackoff_.count()));
  } else {
    warnLimited(WarnKind::kAccept, fmt::format("accept failed: {}; retrying in {} ms", ec.message(),
                                               acceptBackoff_.count()));
  }
  acceptRetry_.expires_after(acceptBackoff_);
  acceptRetry_.async_wait([this](boost::system::error_code timerError) {
    if (timerError || !acceptor_.is_open()) return;
    accept();
  });
}

void Server::warnLimited(WarnKind kind, const std::string& message) {
  WarnWindow& w = warnWindows_[static_cast<std::size_t>(kind)];
  const auto now = Clock::now();
  if (now - w.start >= kWarnWindow) {
    if (w.suppressed > 0) {
      spdlog::warn("({} more warnings like the following were left out in the last {} s)", w.suppressed,
                   std::chrono::duration_cast<std::chrono::seconds>(kWarnWindow).count());
    }
    w = WarnWindow{now, 0, 0};
  }
  if (w.logged < kWarnsPerWindow) {
    ++w.logged;
    spdlog::warn("{}", message);
  } else {
    ++w.suppressed;
  }
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
