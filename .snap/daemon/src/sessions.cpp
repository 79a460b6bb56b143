// Engine, sessions: opening and closing them, their buffers, and the limits one session may hold.
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
  pump_.sessionsChanged();  // a sleeping pump must start watching the new ring now, not after its timeout
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
  pump_.sessionsChanged();
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

}  // namespace tandem::daemon
