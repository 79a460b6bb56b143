#include "cuda/node_comm.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/moe.hpp"
#include "tandem/kernels/moe_ops.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;

const char* roleName(uint32_t role) {
  switch (static_cast<k::Role>(role)) {
    case k::Role::kCompute: return "compute";
    case k::Role::kIntraComm: return "communication";
    case k::Role::kInterSend: return "inter-node send";
    case k::Role::kInterReduce: return "inter-node reduce";
    case k::Role::kReduce: return "reduce";
  }
  return "unknown";
}

}  // namespace

void completeRank(Gang& g, uint32_t r, int32_t status, const std::string& message) {
  if (g.completed[r]) return;
  g.completed[r] = true;
  const PendingOp& op = g.c.ops[r];
  op.channel->complete(op.desc.seq, status, message);
  if (--g.remaining == 0 && status == 0 && g.c.opsCompleted != nullptr) ++*g.c.opsCompleted;
}

void failGang(Gang& g, ErrorCode code, const std::string& reason) {
  for (uint32_t r = 0; r < g.c.ops.size(); ++r) completeRank(g, r, statusOf(code), reason);
}

void OpTrace::record(const Gang& g, kernels::Executor executor) {
  const Clock::time_point now = Clock::now();
  release_.push_back(std::chrono::duration<double, std::micro>(g.released - g.arrived).count());
  gpu_.push_back(std::chrono::duration<double, std::micro>(now - g.released).count());
  if (release_.size() < 1000) return;
  const auto pct = [](std::vector<double>& v, double p) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
  };
  spdlog::info("trace: last {} ops (executor {}): arrival -> release p50 {:.2f} us p99 {:.2f} us; release -> done "
               "seen p50 {:.2f} us p99 {:.2f} us", release_.size(), kernels::executorName(executor),
               pct(release_, 0.5), pct(release_, 0.99), pct(gpu_, 0.5), pct(gpu_, 0.99));
  release_.clear();
  gpu_.clear();
}

NodeComm::NodeComm(uint64_t handle, std::vector<Rank> ranks, std::vector<kernels::ControlPage> pages,
                   CommContext& ctx)
    : CudaComm(handle, std::move(pages)), ranks_(std::move(ranks)), state_(ranks_.size()), ctx_(ctx) {}

uint64_t NodeComm::bytesPerRank() const {
  return ranks_.empty() ? 0 : ranks_[0].workspace->size + k::kControlBytes;
}

uint64_t NodeComm::workspaceBytes(uint32_t rank) const { return ranks_[rank].workspace->size; }

CommMapping NodeComm::mapping(const std::shared_ptr<CommResources>& self, uint32_t rank) const {
  CommMapping m;
  m.fd = ranks_[rank].workspaceFd.get();
  m.bytes = ranks_[rank].workspace->size;
  m.deviceUuid = ranks_[rank].uuid;
  m.keepAlive = self;
  return m;
}

bool NodeComm::execute(Collective c, std::function<void()> /*finished*/) {
  auto g = std::make_shared<Gang>();
  g->arrived = Clock::now();
  g->epoch = c.ops[0].epoch;
  g->kind = c.ops[0].desc.kind;
  g->remaining = static_cast<uint32_t>(c.ops.size());
  g->completed.assign(c.ops.size(), false);
  for (auto& op : c.ops) {
    if (op.epoch != g->epoch && c.errorCode == 0) {
      c.errorCode = statusOf(ErrorCode::kInternal);
      c.error = fmt::format("ranks paired ops of different epochs ({} and {}): the communicator is out of step",
                            g->epoch, op.epoch);
    }
  }
  if (closed_ && !failed()) abort(closed_->first, closed_->second);  // a rank has left: no gang can form
  if (c.errorCode == 0 && !failed()) admit(c);
  g->c = std::move(c);
  if (failed()) {
    failGang(*g, failCode(), reason());
    return true;
  }
  if (g->c.errorCode != 0) {
    g->rejected = true;
    for (uint32_t r = 0; r < g->c.ops.size(); ++r) {
      const PendingOp& op = g->c.ops[r];
      completeRank(*g, r, g->c.errorCode,
                   op.error.empty() ? fmt::format("another rank's descriptor was rejected: {}", g->c.error) : op.error);
    }
  }
  pending_.push_back(g);
  releasePending();
  return true;
}

void NodeComm::abort(ErrorCode code, const std::string& reason) {
  if (!markFailed(code, reason)) return;
  releaseStreams();  // before the gangs are failed: their epochs count for the lead
  for (auto& g : pending_) failGang(*g, code, reason);
  pending_.clear();
  for (uint32_t r = 0; r < nranks(); ++r) {
    for (auto& g : state_[r].inflight) completeRank(*g, r, statusOf(code), reason);
    state_[r].inflight.clear();
  }
}

void NodeComm::leave(uint32_t rank, ErrorCode code, const std::string& reason) {
  RankState& rs = state_[rank];
  collectDone(rank);
  // With its stream past every op it was in and no gang forming, the leaver owes its peers nothing more: its
  // sends are done, and ops that read peers' memory end with a handshake, so the ops they still run finish (a rank
  // that finished first and destroyed its communicator must not fail its peers' last op). Otherwise some stream
  // waits for it: abort, which releases every wait. A communicator whose ranks captured ops into CUDA graphs may have
  // replays in flight that tandemd never sees (op_entry.hpp): abort it too.
  bool replays = false;
  for (uint32_t r = 0; r < nranks(); ++r) replays = replays || page(r).deviceEpochs();
  if (!pending_.empty() || !rs.inflight.empty() || replays) return abort(code, reason);
  closed_.emplace(code, reason);
}

uint64_t NodeComm::lastEpoch(uint32_t rank) const {
  uint64_t last = state_[rank].decided;
  for (const auto& g : pending_) last = std::max(last, g->epoch);
  return last;
}

bool NodeComm::progress(std::vector<std::pair<uint64_t, std::string>>& failed) {
  bool worked = false;
  // Every rank's failure is read before any op completes: a peer's report fails this rank's later ops too, whichever
  // rank's stream finished first.
  if (!failureReported()) {
    if (const auto f = failure()) reportFailure(failed, errorText(f->rank, f->slot));
  }
  for (uint32_t r = 0; r < nranks(); ++r) worked = collectDone(r) || worked;
  if (!pending_.empty()) worked = releasePending() || worked;
  return worked;
}

bool NodeComm::collectDone(uint32_t r) {
  RankState& rs = state_[r];
  rs.doneEpoch = page(r).doneEpoch(rs.doneEpoch);
  bool any = false;
  while (!rs.inflight.empty() && rs.inflight.front()->epoch <= rs.doneEpoch) {
    auto g = rs.inflight.front();
    rs.inflight.pop_front();
    if (ctx_.trace.enabled() && r == 0) ctx_.trace.record(*g, executor());
    completeFromKernel(*g, r);
    any = true;
  }
  return any;
}

bool NodeComm::hasWork() const {
  if (!pending_.empty()) return true;
  for (const auto& rs : state_) {
    if (!rs.inflight.empty()) return true;
  }
  return false;
}

bool NodeComm::releasePending() {
  bool any = false;
  while (!pending_.empty()) {
    auto g = pending_.front();
    // Keep every rank's decided-but-unfinished ops within half the verdict ring.
    for (uint32_t r = 0; r < nranks(); ++r) {
      RankState& rs = state_[r];
      rs.doneEpoch = page(r).doneEpoch(rs.doneEpoch);
      if (g->epoch > rs.doneEpoch + k::kVerdictRing / 2) return any;
    }
    if (!g->rejected && needsReady(*g)) {
      for (uint32_t r = 0; r < nranks(); ++r) {
        if (!page(r).readyReached(g->epoch)) return any;  // gang-ready: every stream got here
      }
    }
    switch (release(g)) {
      case Release::kReleased: break;
      case Release::kWait: return any;
      case Release::kAborted: return true;  // pending is cleared (g with it)
    }
    g->released = Clock::now();
    for (uint32_t r = 0; r < nranks(); ++r) {
      state_[r].decided = g->epoch;
      if (!g->rejected) state_[r].inflight.push_back(g);
    }
    pending_.pop_front();
    any = true;
  }
  return any;
}

namespace {

}  // namespace

// The MoE kernels' data errors (moe_ops.hpp moeFaultText, which libtandem uses for a replay's).
std::string opFaultText(const k::OpFault& f, const OpDescriptor& d) { return k::moeFaultText(f, d); }

std::string NodeComm::errorText(uint32_t r, const k::ErrorSlot& e) const {
  const bool timedOut = e.code == static_cast<uint32_t>(k::WaitError::kTimeout);
  const auto kind = static_cast<OpKind>(e.op);
  if (e.code == static_cast<uint32_t>(k::WaitError::kDiverged)) {
    return fmt::format("{} on rank {} (GPU {}): rank {} entered this op (device epoch, CUDA graphs) as another op "
                       "or at another epoch (its {:#x}, this rank's {:#x}): the ranks replayed different graphs or ran "
                       "different sequences of ops on the communicator; every rank must capture, replay and enqueue "
                       "the same ops in the same order", opKindName(kind), e.rank, ranks_[r].uuid, e.chunk, e.observed,
                       e.expected);
  }
  // AllGather's flags count chunks; the fused GEMMs' name a flag (chunk or half tile) waited on by one role.
  const std::string where = kind == OpKind::kAllGather ? fmt::format("chunk {}", e.chunk)
                                                       : fmt::format("{} role, flag {}", roleName(e.role), e.chunk);
  return fmt::format("{} on rank {} (GPU {}) {}: op epoch {}, {}: waited for flag >= {:#x}, saw {:#x}{}",
                     opKindName(kind), e.rank, ranks_[r].uuid, timedOut ? "timed out" : "was aborted", firstFailedEpoch(e),
                     where, e.expected, e.observed,
                     timedOut ? fmt::format(" (deadline {} ms; TANDEM_OP_TIMEOUT_MS)", ctx_.timeoutNs / 1'000'000)
                              : std::string());
}

std::optional<RankFailure> NodeComm::failure() const {
  std::vector<std::optional<k::ErrorSlot>> slots(nranks());
  for (uint32_t r = 0; r < nranks(); ++r) slots[r] = page(r).failure();
  return rootFailure(slots);
}

void NodeComm::completeFromKernel(Gang& g, uint32_t r) {
  // Any rank's failure, not only this rank's: a rank whose own waits all passed may still have run an op its peers
  // did not (a divergence its peer found), or past a peer that stopped.
  if (const auto f = failure(); f && firstFailedEpoch(f->slot) <= g.epoch) {
    const ErrorCode code =
        f->slot.code == static_cast<uint32_t>(k::WaitError::kTimeout) ? ErrorCode::kTimeout : ErrorCode::kAborted;
    return completeRank(g, r, statusOf(code), errorText(f->rank, f->slot));
  }
  // A data error fails this op alone (its kernels wrote nothing, alike on every rank); the communicator runs on.
  if (const auto f = page(r).fault(g.epoch)) {
    return completeRank(g, r, statusOf(ErrorCode::kInvalidArgument), opFaultText(*f, g.c.ops[r].desc));
  }
  completeRank(g, r, 0, "");
}

}  // namespace tandem::daemon::cuda
