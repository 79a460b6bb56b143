#include "cpu/cpu_backend.hpp"

#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "cluster.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/ranked_mutex.hpp"

namespace tandem::daemon {
namespace {

int32_t statusOf(ErrorCode code) { return static_cast<int32_t>(wireCode(code)); }

// A registered memfd that its owner could shrink would SIGBUS the daemon on its next access: accept only memfds
// sealed against shrinking (and refuse regular files, pipes and sockets, which carry no seals at all).
void requireShrinkSeal(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    fail(ErrorCode::kInvalidArgument, "register: the fd passed is not a memfd (F_GET_SEALS -> {}); the cpu backend "
         "registers only memory of a memfd_create(..., MFD_ALLOW_SEALING) file sealed with "
         "fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", std::strerror(errno));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    fail(ErrorCode::kInvalidArgument, "register: the memfd is not sealed against shrinking, so its owner could "
         "truncate it under tandemd; create it with MFD_ALLOW_SEALING, size it, then call "
         "fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) before tandem_register");
  }
}


class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const DaemonConfig& config) : config_(config) {}
  ~CpuBackend() override { stop(); }
  const char* name() const override { return "cpu"; }
  const char* executor() const override { return "host"; }
  OpSet ops(const CommResources* /*comm*/) const override { return OpSet::all(); }
  bool hostMemory() const override { return true; }

  void start() override {
    running_ = true;
    unsigned threads = config_.daemon.workerThreads;
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    const uint32_t share = config_.limits.maxCpuWorkersPerSession;
    maxPerSession_ = share != 0 ? share : std::max(1u, threads / 2);
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { workerLoop(); });
  }
  void stop() override {
    {
      std::lock_guard lock(workMutex_);
      running_ = false;
    }
    workCv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::shared_ptr<Buffer> allocate(uint64_t bytes, const std::string& /*deviceUuid*/) override {
    auto buffer = std::make_shared<Buffer>();
    buffer->bytes = bytes;
    buffer->accountedBytes = bytes;
    buffer->fd = Fd::memfd("tandem-buf", bytes);
    buffer->mapping = Mapping::shared(buffer->fd.get(), bytes);
    return buffer;
  }

  std::shared_ptr<Buffer> registerMemory(RegisterRequest& request) override {
    if (request.kind != RegisterRequest::Kind::kMemfd) {
      fail(ErrorCode::kUnsupported, "register: this tandemd runs the cpu backend, which registers host memory (a "
           "memfd) only; GPU memory needs daemon.backend: cuda");
    }
    if (!request.fd) fail(ErrorCode::kProtocol, "register: the memfd did not arrive with the request");
    requireShrinkSeal(request.fd.get());
    const uint64_t fileBytes = fileSize(request.fd.get());
    if (request.offset > fileBytes || request.bytes > fileBytes - request.offset) {
      fail(ErrorCode::kInvalidArgument, "register: range [{}, {}) lies outside the {}-byte file passed with it; pass "
           "the memfd that backs the memory and the offset of the memory in it", request.offset,
           request.offset + request.bytes, fileBytes);
    }
    if (request.offset % 4096 != 0) {
      fail(ErrorCode::kInvalidArgument, "register: fd offset {} is not a multiple of the 4096-byte page size",
           request.offset);
    }
    auto buffer = std::make_shared<Buffer>();
    buffer->bytes = request.bytes;
    buffer->accountedBytes = request.bytes;
    buffer->registered = true;
    buffer->mapping = Mapping::shared(request.fd.get(), request.bytes, request.offset);
    buffer->fd = std::move(request.fd);
    return buffer;
  }

  std::byte* resolve(const Buffer& buffer, uint64_t offset) const override { return buffer.mapping.data() + offset; }

  bool execute(Collective c, std::function<void()> finished) override {
    if (c.errorCode != 0) {
      for (auto& op : c.ops) {
        if (!op.local()) continue;
        op.channel->complete(op.desc.seq, c.errorCode,
                             op.error.empty() ? fmt::format("another rank's descriptor was rejected: {}", c.error)
                                              : op.error);
      }
      return true;
    }
    if (c.link) {
      // Across nodes: on the communicator's own thread, which blocks on its peers.
      auto link = c.link;
      link->post([this, c = std::move(c), finished = std::move(finished)]() mutable {
        run(c);
        finished();
      });
      return false;
    }
    if (c.ops[0].desc.kind == OpKind::kNop) {
      // Nothing to execute: complete on the pump thread instead of paying a worker hand-off.
      for (auto& op : c.ops) op.channel->complete(op.desc.seq, 0, "");
      ++*c.opsCompleted;
      return true;
    }
    if (const std::string refusal = scratchRefusal(c); !refusal.empty()) {
      for (auto& op : c.ops) op.channel->complete(op.desc.seq, statusOf(ErrorCode::kInvalidArgument), refusal);
      return true;
    }
    const uint64_t session = c.ops[0].channel->sessionId();
    enqueueWork(session, std::move(c), std::move(finished));
    return false;
  }

  void sessionClosed(uint64_t sessionId) override {
    // Ops of a session that is gone are cancelled where they have not started: a worker completes them with the
    // reason instead of running them (the other ranks learn it too, and the communicator has failed already).
    std::lock_guard lock(workMutex_);
    for (Work& w : work_) {
      for (const PendingOp& op : w.c.ops) {
        if (op.local() && op.channel->sessionId() == sessionId) w.cancelled = true;
      }
    }
  }

 private:
  void run(Collective& c) {
    int32_t code = 0;
    std::string message;
    try {
      std::vector<RankOp> ranks(c.ops.size());
      for (std::size_t r = 0; r < c.ops.size(); ++r) {
        ranks[r].desc = c.ops[r].desc;
        for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
          if (c.ops[r].buffers[i]) ranks[r].data[i] = resolve(*c.ops[r].buffers[i], c.ops[r].desc.bufs[i].offset);
        }
      }
      if (c.link) {
        runCpuOpAcrossNodes(ranks, c.nodeOfRank, *c.link, c.epoch);
      } else {
        runCpuOp(ranks);
      }
    } catch (const Error& e) {
      code = statusOf(e.code());
      message = e.what();
    } catch (const std::exception& e) {
      code = statusOf(ErrorCode::kInternal);
      message = fmt::format("{} failed inside tandemd: {}", opKindName(c.ops[0].desc.kind), e.what());
    }
    for (auto& op : c.ops) {
      if (op.local()) op.channel->complete(op.desc.seq, code, message);
    }
    ++*c.opsCompleted;
  }

  // The host scratch an op would allocate, against limits.max_scratch_bytes: checked before anything is allocated,
  // so a descriptor of tiny tensors cannot make the daemon allocate gigabytes (attention with head_dim 2^26).
  std::string scratchRefusal(const Collective& c) const {
    std::vector<OpDescriptor> descs;
    for (const PendingOp& op : c.ops) descs.push_back(op.desc);
    const uint64_t need = cpuScratchBytes(descs);
    const uint64_t cap = config_.limits.maxScratchBytes;
    if (need <= cap) return {};
    return fmt::format("{}: the cpu backend would need {} bytes of host scratch for this shape, above "
                       "limits.max_scratch_bytes ({}); pass a smaller shape or raise the limit",
                       opKindName(c.ops[0].desc.kind), need, cap);
  }

  // One queue, but a session may hold at most maxPerSession_ workers: one tenant's large ops leave the others
  // workers for theirs.
  struct Work {
    uint64_t session = 0;  // rank 0's, for the worker share
    Collective c;
    std::function<void()> finished;
    bool cancelled = false;  // a session of the op closed before it started
  };

  void enqueueWork(uint64_t session, Collective c, std::function<void()> finished) {
    {
      std::lock_guard lock(workMutex_);
      work_.push_back({session, std::move(c), std::move(finished), false});
    }
    workCv_.notify_all();
  }

  void cancel(Work& w) {
    for (auto& op : w.c.ops) {
      if (op.local()) {
        op.channel->complete(op.desc.seq, statusOf(ErrorCode::kPeerLost),
                             fmt::format("{}: cancelled before it started: a rank's session ended",
                                         opKindName(op.desc.kind)));
      }
    }
    ++*w.c.opsCompleted;
  }

  // The first queued work whose session is under its share, or end().
  std::deque<Work>::iterator nextRunnableLocked() {
    return std::find_if(work_.begin(), work_.end(), [&](const Work& w) { return running(w.session) < maxPerSession_; });
  }
  uint32_t running(uint64_t session) const {
    auto it = active_.find(session);
    return it == active_.end() ? 0 : it->second;
  }

  void workerLoop() {
    for (;;) {
      Work work;
      {
        std::unique_lock lock(workMutex_);
        workCv_.wait(lock, [this] { return nextRunnableLocked() != work_.end() || !running_; });
        auto it = nextRunnableLocked();
        if (it == work_.end()) return;  // stopping
        work = std::move(*it);
        work_.erase(it);
        ++active_[work.session];
      }
      if (work.cancelled) {
        cancel(work);
      } else {
        run(work.c);
      }
      work.finished();
      {
        std::lock_guard lock(workMutex_);
        if (--active_[work.session] == 0) active_.erase(work.session);
      }
      workCv_.notify_all();
    }
  }

  const DaemonConfig& config_;
  bool running_ = false;
  std::vector<std::thread> workers_;
  RankedMutex workMutex_{LockRank::kBackend, "CpuBackend"};
  std::condition_variable_any workCv_;
  std::deque<Work> work_;
  std::map<uint64_t, uint32_t> active_;  // session -> workers running its ops
  uint32_t maxPerSession_ = 1;
};

}  // namespace

std::unique_ptr<Backend> makeCpuBackend(const DaemonConfig& config) { return std::make_unique<CpuBackend>(config); }

}  // namespace tandem::daemon
