// The cuda backend's entry for each op it runs (gpu_ops.hpp). Adding an op to the cuda backend: its kernels and
// launcher in their own files, and an entry here; executorOps (executor.hpp) follows.
#include "tandem/kernels/gpu_ops.hpp"

#include <algorithm>
#include <array>

#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/moe.hpp"
#include "tandem/kernels/moe_ops.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/ring_attention.hpp"
#include "tandem/kernels/ring_attention_bwd.hpp"

namespace tandem::kernels {
namespace {

std::string launchFused(const GpuLaunch& l) {
  return launchFusedGemm(l.desc, l.ptrs, l.epoch, l.env, l.stream, l.plan);
}

void checkFused(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env, const PlanChoice& plan) {
  checkFusedGemm(d, ptrs, env, plan);
}

std::string launchMoe(const GpuLaunch& l) {
  return launchMoeOp(l.desc, l.ptrs, l.epoch, l.env, l.stream, l.readVerdict, l.replayed);
}

void checkMoe(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env, const PlanChoice&) {
  checkMoeOp(d, ptrs, env);
}

std::string launchRing(const GpuLaunch& l) { return launchRingAttention(l.desc, l.ptrs, l.epoch, l.env, l.stream); }

void checkRing(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env, const PlanChoice&) {
  checkRingAttention(d, ptrs, env);
}

void checkRingBackward(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env, const PlanChoice&) {
  checkRingAttentionBackward(d, ptrs, env);
}

// Executor client: every rank's seq comes with the launch (GpuOp::needsRankRows; tandemd published them).
std::string launchRingBackward(const GpuLaunch& l) {
  return launchRingAttentionBackward(l.desc, l.ptrs, l.epoch, l.env, l.rankRows, l.stream);
}

// AllGather's kernel between the client's stream words (the daemon executor runs it as a persistent-kernel item).
std::string launchAllGatherOp(const GpuLaunch& l) {
  AllGatherParams p{};
  p.send = l.ptrs[slot::kSend];
  p.recv = l.ptrs[slot::kRecv];
  p.bytes = l.desc.dims[dim::kBytes];
  p.epoch = l.epoch;
  p.epochWord = l.env.epochWord;
  p.timeoutNs = l.env.timeoutNs;
  for (uint32_t r = 0; r < l.env.nranks; ++r) p.workspaces[r] = l.env.workspaces[r];
  p.ctl = l.env.ctl;
  p.rank = l.env.rank;
  p.nranks = l.env.nranks;
  const AgTuning t = allgatherTuning(p.bytes, l.env.commSms);
  p.chunkBytes = t.chunkBytes;
  p.numCtas = t.numCtas;
  p.mode = t.mode;
  p.checkVerdict = l.readVerdict ? 1 : 0;  // a rejected op is skipped inside the kernel
  launchAllGather(p, l.stream);
  return {};
}

std::array<GpuOp, kOpKindCount> buildEntries() {
  std::array<GpuOp, kOpKindCount> e{};
  const GpuOp fused{checkFused, launchFused, nullptr, preloadFusedGemmKernels, false, true, DaemonRun::kLaunch};
  e[static_cast<std::size_t>(OpKind::kAgGemm)] = fused;
  e[static_cast<std::size_t>(OpKind::kGemmRs)] = fused;
  e[static_cast<std::size_t>(OpKind::kGemmAr)] = fused;
  const GpuOp moe{checkMoe, launchMoe, nullptr, preloadMoeKernels, false, false, DaemonRun::kLaunch};
  e[static_cast<std::size_t>(OpKind::kMoeDispatchGemm)] = moe;
  e[static_cast<std::size_t>(OpKind::kMoeDispatchFfnCombine)] = moe;
  e[static_cast<std::size_t>(OpKind::kMoeFfnBackward)] = moe;
  e[static_cast<std::size_t>(OpKind::kRingAttention)] =
      GpuOp{checkRing, launchRing, launchRingAttentionMapped, preloadRingAttentionKernels, false, false,
            DaemonRun::kLaunchMapped};
  // Each core call needs every rank's seq on the host: the client executor waits for tandemd to publish them.
  GpuOp ringBwd{checkRingBackward, launchRingBackward, launchRingAttentionBackwardMapped,
                preloadRingAttentionBackwardKernels, false, false, DaemonRun::kLaunchMapped};
  ringBwd.needsRankRows = true;
  ringBwd.checkClient = checkRingAttentionBackwardStaging;
  e[static_cast<std::size_t>(OpKind::kRingAttentionBackward)] = ringBwd;
  e[static_cast<std::size_t>(OpKind::kAllGather)] =
      GpuOp{nullptr, launchAllGatherOp, nullptr, preloadAllGatherKernels, true, false, DaemonRun::kWorkItem};
  e[static_cast<std::size_t>(OpKind::kNop)] = GpuOp{};  // no kernel: tandemd gates it
  return e;
}

const std::array<GpuOp, kOpKindCount>& entries() {
  static const std::array<GpuOp, kOpKindCount> e = buildEntries();
  return e;
}

}  // namespace

void preloadGpuOps(int device) {
  std::array<void (*)(int), kOpKindCount> done{};
  std::size_t n = 0;
  for (const GpuOp& op : entries()) {
    if (op.preload == nullptr || std::find(done.begin(), done.begin() + n, op.preload) != done.begin() + n) continue;
    op.preload(device);
    done[n++] = op.preload;
  }
}

const GpuOp* findGpuOp(OpKind kind) {
  if (!knownOp(kind)) return nullptr;
  const std::size_t i = static_cast<std::size_t>(kind);
  // The barrier's entry is all defaults; every other entry has a launch.
  return kind == OpKind::kNop || entries()[i].launch != nullptr ? &entries()[i] : nullptr;
}

const GpuOp& gpuOp(OpKind kind) {
  const GpuOp* op = findGpuOp(kind);
  if (op == nullptr) fail(ErrorCode::kInternal, "{} has no entry in the cuda backend's op table (gpu_ops.cpp)",
                          opKindName(kind));
  return *op;
}

}  // namespace tandem::kernels
