#include "tandem/kernels/moe_ops.hpp"

#include <algorithm>

#include "tandem/common/error.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/moe.hpp"

namespace tandem::kernels {
namespace {

constexpr uint64_t kAlign = 256;

GemmDtype gemmDtype(DType t) { return t == DType::kF16 ? GemmDtype::kFp16 : GemmDtype::kBf16; }

MoeParams paramsOf(const OpDescriptor& d, const DevicePointers& ptrs) {
  MoeParams p;
  p.dtype = gemmDtype(d.dtype);
  p.ffn = d.kind == OpKind::kMoeDispatchFfnCombine || d.kind == OpKind::kMoeFfnBackward;
  p.backward = d.kind == OpKind::kMoeFfnBackward;
  p.tokens = static_cast<int64_t>(d.dims[dim::kTokens]);
  p.hidden = static_cast<int64_t>(d.dims[dim::kHidden]);
  p.experts = static_cast<int64_t>(d.dims[dim::kExperts]);
  p.topk = static_cast<int64_t>(d.dims[dim::kTopk]);
  p.x = ptrs[slot::kX];
  p.topkIds = static_cast<const int32_t*>(ptrs[slot::kTopkIds]);
  p.topkWeights = static_cast<const float*>(ptrs[slot::kTopkWeights]);
  if (p.ffn) {
    p.ffnDim = static_cast<int64_t>(d.dims[dim::kFfn]);
    p.w1 = ptrs[slot::kW1];
    p.w2 = ptrs[slot::kW2];
    if (p.backward) {
      p.dout = ptrs[slot::kMoeDout];
      p.dx = ptrs[slot::kMoeDx];
      p.dtopkWeights = static_cast<float*>(ptrs[slot::kMoeDtopkWeights]);
      p.dw1 = ptrs[slot::kMoeDw1];
      p.dw2 = ptrs[slot::kMoeDw2];
    } else {
      p.out = ptrs[slot::kFfnOut];
      p.fp8 = isFp8(moeWeightDtype(d.dtype, d.flags));
      if (p.fp8) {
        p.w1Scale = static_cast<const float*>(ptrs[slot::kFfnW1Scale]);
        p.w2Scale = static_cast<const float*>(ptrs[slot::kFfnW2Scale]);
      }
    }
    p.savedRows = static_cast<int64_t>(d.dims[dim::kSavedRows]);
    p.saved = p.savedRows > 0 ? ptrs[p.backward ? slot::kMoeBwdSaved : slot::kFfnSaved] : nullptr;
  } else {
    p.nOut = static_cast<int64_t>(d.dims[dim::kNOut]);
    p.capacity = static_cast<int64_t>(std::min<uint64_t>(d.dims[dim::kCapacity], uint64_t{1} << 40));
    p.w = ptrs[slot::kW];
    p.out = ptrs[slot::kMoeOut];
    p.rowInfo = static_cast<int32_t*>(ptrs[slot::kRowInfo]);
    p.expertCounts = static_cast<int32_t*>(ptrs[slot::kExpertCounts]);
    p.fp8 = isFp8(moeWeightDtype(d.dtype, d.flags));
    if (p.fp8) p.wScale = static_cast<const float*>(ptrs[slot::kMoeWScale]);
  }
  return p;
}

// Every rank's control and receive areas and this rank's scratch, in `env`'s workspaces: the receive rows at the
// start of each rank's data region, the scratch at the end of this rank's.
MoeComm commOf(const MoeParams& p, const FusedEnv& env) {
  MoeComm c;
  c.rank = env.rank;
  c.nranks = env.nranks;
  const WorkspaceLayout& l = env.layout;
  // The scratch at the end of the data region (written before the plan kernel's wait for every rank, so outside the
  // gemm-rs/ar staging); the receive rows before it, from the data region's start or, for the FFN, the span's
  // (fused_ops.hpp says why the FFN may share the staging matrices).
  const uint64_t scratch = moeScratchBytes(p.tokens, p.topk, p.experts);
  const uint64_t scratchOff =
      l.dataBytes >= scratch ? l.dataOff + (l.dataBytes - scratch) / kAlign * kAlign : l.dataOff;
  const uint64_t recvOff = p.ffn ? l.spanOff : l.dataOff;
  for (uint32_t q = 0; q < env.nranks; ++q) {
    c.control[q] = env.workspaces[q] + l.moeOff;
    c.recv[q] = env.workspaces[q] + recvOff;
  }
  c.scratch = env.workspaces[env.rank] + scratchOff;
  c.scratchBytes = l.dataOff + l.dataBytes - scratchOff;
  c.recvBytes = scratchOff - recvOff;
  c.abortWord = env.ctl != nullptr ? &env.ctl->abort : nullptr;
  c.errorSlot = env.ctl != nullptr ? &env.ctl->error : nullptr;
  c.timeoutNs = env.timeoutNs;
  return c;
}

}  // namespace

bool isMoeOp(OpKind kind) {
  return kind == OpKind::kMoeDispatchGemm || kind == OpKind::kMoeDispatchFfnCombine || kind == OpKind::kMoeFfnBackward;
}

void checkMoeOp(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env) {
  const std::string_view op = opKindName(d.kind);
  if (!isMoeOp(d.kind)) fail(ErrorCode::kInternal, "{} is not an MoE op", op);
  if (d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    fail(ErrorCode::kUnsupported,
         "{}: the cuda backend's MoE kernels take bf16 or fp16, not {}; convert the tensors, "
         "or run {} on a tandemd with daemon.backend: cpu",
         op, dtypeName(d.dtype), op);
  }
  if (env.workspaceBytes < env.layout.moeOff + kMoeControlBytes) {
    fail(ErrorCode::kInvalidArgument,
         "{}: the communicator's workspace ({} bytes per rank) has no room for the MoE "
         "ops' control area ({} bytes); {}",
         op, env.workspaceBytes, kMoeControlBytes,
         workspaceRemedy(WorkspaceLayout::bytesFor(0, env.nranks)));
  }
  const MoeParams p = paramsOf(d, ptrs);
  if (d.dims[dim::kCapacity] >= (uint64_t{1} << 31) && !p.ffn) {
    fail(ErrorCode::kInvalidArgument, "{}: capacity = {} must be below 2^31 on the cuda backend", op,
         d.dims[dim::kCapacity]);
  }
  const MoeComm c = commOf(p, env);
  // validateMoe names the workspace when the receive rows do not fit; give the size that would.
  try {
    validateMoe(p, c);
  } catch (const Error& e) {
    const uint64_t recv = moeRecvBytes(p.capacity, p.hidden, 0, false, p.fp8);
    if (p.ffn || recv <= c.recvBytes) throw;
    const uint64_t need = recv + moeScratchBytes(p.tokens, p.topk, p.experts) + kAlign;
    const uint64_t bytes = workspaceBytesFor(d, env.nranks);
    fail(ErrorCode::kInvalidArgument,
         "{}: capacity = {} rows of hidden = {} need {} bytes of receive rows on this "
         "rank, but the communicator's workspace leaves {}; {}, or lower capacity",
         op, p.capacity, p.hidden, need, c.recvBytes, workspaceRemedy(bytes));
  }
}

std::string launchMoeOp(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, const FusedEnv& env,
                        cudaStream_t stream, bool readVerdict, bool replayed) {
  const MoeParams p = paramsOf(d, ptrs);
  MoeComm c = commOf(p, env);
  c.epoch = epoch;
  c.epochWord = env.epochWord;
  // A data error fails this op only: it goes to the epoch's entry of the fault ring, which tandemd reads at completion,
  // or for a replay (no completion) to the replay fault, which libtandem reports at the next eager op.
  if (env.ctl != nullptr && replayed) {
    c.fault = &env.ctl->replayFault;
    c.faultsDropped = &env.ctl->replayFaultsDropped;
  } else if (env.ctl != nullptr) {
    c.fault = &env.ctl->faults[epoch % kVerdictRing];
  }
  if (readVerdict && env.ctl != nullptr) {
    c.verdictSlot = &env.ctl->verdict[epoch % kVerdictRing];
    c.verdictRejected = epoch | kVerdictRejected;
  }
  try {
    return launchMoe(p, c, stream);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& ex) {  // the grouped GEMM's launcher may throw std::runtime_error
    fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
  }
}

// The plan kernel finds these in the routing table, alike on every rank (moe.cu); tandemd reports an eager op's,
// libtandem a replayed op's.
std::string moeFaultText(const OpFault& f, const OpDescriptor& d) {
  const auto kind = static_cast<OpKind>(f.op);
  if (f.code == static_cast<uint32_t>(WaitError::kMoeRouting)) {
    const auto slotIndex = static_cast<uint32_t>((f.observed >> 32) & 0x3fffffffu);
    const auto value = static_cast<int32_t>(static_cast<uint32_t>(f.observed));
    if ((f.observed >> 62) & 1u) {
      return fmt::format("{}: rank {} token {} names expert {} twice (topk_ids[{}][{}]); a token's top-k experts must "
                         "be distinct", opKindName(kind), f.atFault, f.chunk, value, f.chunk, slotIndex);
    }
    return fmt::format("{}: rank {} topk_ids[{}][{}] = {} is out of range [0, experts); pass expert ids in [0, "
                       "experts)", opKindName(kind), f.atFault, f.chunk, slotIndex, value);
  }
  if ((kind == OpKind::kMoeDispatchFfnCombine || kind == OpKind::kMoeFfnBackward) && (f.observed >> 63) != 0) {
    // The rank's saved gate|up was the limit (moe.cu's plan kernel marks it so).
    const uint64_t rows = f.observed & ~(uint64_t{1} << 63);
    return fmt::format("{}: rank {} receives {} rows but its saved tensor holds saved_rows = {}; nothing was written "
                       "and the communicator is still usable: pass saved_rows >= {} with saved [saved_rows, 2*ffn] "
                       "(at most nranks * tokens * topk rows), or split the batch", opKindName(kind), f.atFault,
                       rows, f.chunk, rows);
  }
  if (kind == OpKind::kMoeDispatchFfnCombine || kind == OpKind::kMoeFfnBackward) {
    // The workspace that holds those rows.
    return fmt::format("{}: rank {} receives {} rows but its workspace holds {} receive rows; nothing was written and "
                       "the communicator is still usable: split the batch, or {}", opKindName(kind), f.atFault,
                       f.observed, f.chunk, workspaceRemedy(workspaceBytesFor(d, d.nranks, f.observed)));
  }
  return fmt::format("{}: rank {} receives {} rows but capacity is {}; pass capacity >= {}", opKindName(kind),
                     f.atFault, f.observed, f.chunk, f.observed);
}

}  // namespace tandem::kernels
