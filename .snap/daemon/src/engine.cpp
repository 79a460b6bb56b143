// The engine: construction, start and stop, status. Its jobs live beside it: sessions.cpp (sessions, their
// memory and limits), rendezvous.cpp (joining and ending communicators), cluster_sync.cpp (what other nodes tell
// us) and pump.cpp (admission and dispatch of descriptors; the pump thread itself is pump.hpp).
#include "engine.hpp"

#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "cluster.hpp"
#include "cpu/cpu_backend.hpp"
#include "engine_detail.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon {

using namespace detail;

Engine::Engine(const DaemonConfig& config, std::unique_ptr<Backend> backend)
    : config_(config),
      backend_(backend ? std::move(backend) : makeCpuBackend(config)),
      pump_(config, Pump::Hooks{
                        .channels = [this] { return sessionChannels(); },
                        .admit = [this](const OpDescriptor& d, const std::shared_ptr<SessionChannel>& ch) {
                          handleDescriptor(d, ch);
                        },
                        .progress = [this] { return progressBackend(); },
                        .busy = [this] { return backend_->busy(); },
                        .fault = [this](uint64_t id, std::string why) {
                          if (onSessionFault_) onSessionFault_(id, std::move(why));
                        },
                        .fatal = [this](std::string why) { backendFailed(std::move(why)); },
                    }) {}

Engine::~Engine() { stop(); }

void Engine::start() {
  running_ = true;
  backend_->start();
  pump_.start();
}

void Engine::stop() {
  if (!running_.exchange(false)) return;
  pump_.stop();
  backend_->stop();  // cpu: running ops finish first
  std::lock_guard lock(mutex_);
  for (auto& [handle, entry] : comms_) {
    failCommLocked(*entry, Communicator::State::kAborted, ErrorCode::kAborted, "tandemd is shutting down");
  }
}

std::vector<std::shared_ptr<SessionChannel>> Engine::sessionChannels() const {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<SessionChannel>> out;
  for (auto& [id, s] : sessions_) out.push_back(s.channel);
  return out;
}

bool Engine::progressBackend() {
  std::vector<std::pair<uint64_t, std::string>> failed;
  const bool worked = backend_->poll(failed);
  if (!failed.empty()) {
    std::lock_guard lock(mutex_);
    for (auto& [handle, reason] : failed) {
      if (auto c = comms_.find(handle); c != comms_.end()) {
        failCommLocked(*c->second, Communicator::State::kAborted, ErrorCode::kAborted, reason);
      }
    }
  }
  return worked;
}

// A device is unusable: nothing on it can be trusted to finish. Every communicator fails with the reason (so every
// client's wait ends with it), and the owner of the process is told, which exits non-zero so that systemd restarts
// the daemon on a fresh context.
void Engine::backendFailed(std::string why) {
  spdlog::critical("the {} backend failed: {}; failing every communicator, and tandemd exits", backend_->name(), why);
  {
    std::lock_guard lock(mutex_);
    for (auto& [handle, entry] : comms_) {
      failCommLocked(*entry, Communicator::State::kAborted, ErrorCode::kAborted,
                     fmt::format("tandemd's {} backend failed ({}); tandemd restarts, reconnect", backend_->name(), why));
    }
  }
  if (onFatal_) onFatal_(why);
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
    EngineStatus::Comm& out =
        st.comms.emplace_back(EngineStatus::Comm{handle, c.nranks, c.joined(), commStateName(c.state), c.opsCompleted,
                                                 c.localRanks(),
                                                 c.spansNodes() ? c.nodes(cluster_->self()) : std::vector<uint32_t>{},
                                                 c.reason, {}, {}});
    for (const auto& member : c.members) {
      if (!member) continue;
      out.memberSessions.push_back(*member);
      if (auto s = sessions_.find(*member); s != sessions_.end()) out.memberUids.push_back(s->second.uid);
    }
  }
  st.gpus = backend_->gpus();
  if (cluster_) cluster_->fillStatus(st.cluster.emplace());
  return st;
}

void Engine::checkMember(uint64_t sessionId, uint32_t uid, uint64_t commHandle) const {
  std::lock_guard lock(mutex_);
  if (const auto c = comms_.find(commHandle); c != comms_.end()) {
    for (const auto& member : c->second->comm.members) {
      if (!member) continue;
      const auto s = sessions_.find(*member);
      if (*member == sessionId || (s != sessions_.end() && s->second.uid == uid)) return;
    }
  }
  fail(ErrorCode::kNotFound, "communicator handle {} has no rank of this session or of its user (or it was destroyed)",
       commHandle);
}

}  // namespace tandem::daemon
