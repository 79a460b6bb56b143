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

// Never called: executorOps(kClient) leaves out an op with clientPending, so libtandem refuses it before any launch.
std::string launchRingBackwardClient(const GpuLaunch& l) {
  fail(ErrorCode::kInternal, "{}: the client executor does not run it", opKindName(l.desc.kind));
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
  // The client executor would need every rank's rows on the host before its core calls (libtandem sees only its own
  // descriptor): staging every rank's six inputs in the workspaces plus device-side lengths in the core, or equal seq
  // on every rank checked on the device. Until one is built, only the daemon executor runs it.
  GpuOp ringBwd{checkRingBackward, launchRingBackwardClient, launchRingAttentionBackwardMapped,
                preloadRingAttentionBackwardKernels, false, false, DaemonRun::kLaunchMapped};
  ringBwd.clientPending = "its client executor is not built yet (each rank's launch needs every rank's rows on the "
                          "host, and libtandem sees only its own descriptor); the daemon executor runs it "
                          "(daemon.executor: daemon, under MPS)";
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
