// One client connection of the control plane (Server, server.hpp, owns them). Its two jobs live in two files:
// control_session.cpp is the connection (framing, fds, deadlines, replies that never block, deferred closes), and
// requests.cpp turns each request into Engine calls and answers it.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::daemon {
namespace asio = boost::asio;
using asio::local::stream_protocol;
using Clock = std::chrono::steady_clock;
namespace pb = tandem::v1;

// One recvmsg reads at most this much, so a client streaming a large frame yields the control thread to the
// others every 64 KiB.
inline constexpr std::size_t kReadChunkBytes = 64 * 1024;

// The little-endian length that heads every frame.
inline uint32_t frameLength(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

// A response carrying only an error status.
pb::Response errorResponse(uint64_t requestId, ErrorCode code, const std::string& message);

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
      const uint32_t length = frameLength(buffer_.data() + pos);
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

  // ---- the connection (control_session.cpp) ----
  void start();
  void close(const std::string& why);

  uint64_t id() const { return id_; }
  uint32_t uid() const { return uid_; }
  // Its close is posted (closeLater): it no longer counts against the connection caps.
  bool closing() const { return closing_; }
  // Connected this long ago without saying Hello (nullopt once it has).
  std::optional<Clock::duration> silentFor() const;
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
  void drop(Server::WarnKind kind, const std::string& reason);

  // Every close that starts inside this session (a reply that overflowed the backlog, a failed send, a bad frame,
  // a hang-up) takes effect after the current handler returns: the handler may be running inside an engine call
  // that is answering it (a join's reply), and closing the session goes back into the engine. From now on nothing
  // more is read or sent.
  void closeLater(const std::string& why);

  // A process that dies while another process still holds its connection (a child that inherited the fd
  // through fork) never hangs the socket up. Its pidfd becomes readable when it exits, so its ranks are
  // reported lost at once instead of never.
  void watchProcess();
  void waitProcessExit();
  void waitRead();

  // One recvmsg per wakeup, so that every connection gets its turn on the control thread.
  void onReadable();

  // A frame in progress must be whole within limits.frame_timeout_ms of its first byte.
  void updateFrameDeadline(bool framesCompleted);

  // Replies go out without blocking: what the socket does not take now waits here, and a client that lets more
  // than limits.max_reply_backlog_bytes wait is disconnected instead of holding the control thread.
  void send(const pb::Response& response, std::span<const int> fds = {});

  // Writes what the socket takes now. Returns the bytes written, or nullopt when the connection is broken (it is
  // then closed).
  std::optional<std::size_t> sendSome(std::string_view bytes, std::span<const int> fds);
  void waitWrite();
  void flush();
  void sendError(uint64_t requestId, ErrorCode code, const std::string& message);
  void handleFrame(InFrame& frame);

  // The next fd that came with the request being handled.
  Fd takeFd();
  void reply(uint64_t rid, pb::Response& response, std::span<const int> fds = {});
  // ---- the requests (requests.cpp) ----
  bool allowed() const;

  // Root and the daemon's own user administer it; every other caller sees only its own session.
  bool privileged() const { return uid_ == 0 || uid_ == ::geteuid(); }

  void dispatch(const pb::Request& request);

  // Trial plans for a communicator of this session, or entries of the plan table (plan_table.hpp).
  void setPlan(const pb::SetPlan& req);
  void join(uint64_t rid, const pb::JoinCommunicator& join);
  pb::Response& statusReply(pb::Response& response);

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

}  // namespace tandem::daemon
