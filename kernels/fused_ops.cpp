#include "tandem/kernels/fused_ops.hpp"

#include <algorithm>

#include "tandem/common/error.hpp"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/gemm_ar.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/gemm_rs.hpp"
#include "tandem/kernels/moe.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/ring_attention_bwd.hpp"

namespace tandem::kernels {
namespace {

uint64_t roundUp(uint64_t x, uint64_t unit) { return (x + unit - 1) / unit * unit; }

constexpr uint64_t kMatUnit = 64u << 10;     // the gemm-rs/ar fixed layout takes matrices in whole 64 KiB
constexpr uint64_t kGranularity = 2u << 20;  // tandemd rounds each workspace up to the cuMem granularity (2 MiB here)

// ag-gemm flag words of a layout whose matrices hold matBytes: 1/512 of them (1.6% more bytes), enough for the chunk
// flags of any gathered A that fills the two data matrices with k >= 32.
uint64_t agFlagWordsFor(uint64_t matBytes) { return matBytes / 512; }

// Bytes after the AllGather region of a layout whose matrices hold matBytes.
uint64_t gemmAreaBytes(uint64_t matBytes, uint32_t nranks) {
  return roundUp(agFlagWordsFor(matBytes) * 8, kMatUnit) +
         gemmRsFixedWorkspaceBytes(static_cast<int64_t>(matBytes), static_cast<int>(nranks)) + 2 * matBytes;
}

GemmDtype gemmDtype(DType t) { return t == DType::kF16 ? GemmDtype::kFp16 : GemmDtype::kBf16; }

Fp8Scaling fp8ScalingOf(const OpDescriptor& d) {
  return (d.flags & kFlagFp8BlockScale) != 0 ? Fp8Scaling::kBlock : Fp8Scaling::kPerTensor;
}
// Bytes of one element of C (FP8 inputs: out_dtype's).
uint64_t outBytesOf(const OpDescriptor& d) { return dtypeSize(gemmOutDtype(d.dtype, d.flags)); }

// The FP8 operands of `d` for the kernels (disabled unless its dtype is FP8).
Fp8Operands fp8OperandsOf(const OpDescriptor& d, const DevicePointers& ptrs) {
  Fp8Operands f{};
  if (!isFp8(d.dtype)) return f;
  const auto format = [](DType t) { return t == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; };
  f.enabled = 1;
  f.aFormat = format(d.dtype);
  f.bFormat = format(d.dtype);
  f.scaling = fp8ScalingOf(d);
  f.out = gemmOutDtype(d.dtype, d.flags) == DType::kF32 ? Fp8Out::kFp32 : Fp8Out::kBf16;
  f.aScale = static_cast<const float*>(ptrs[static_cast<std::size_t>(gemmScaleSlot(d.kind, false))]);
  f.bScale = static_cast<const float*>(ptrs[static_cast<std::size_t>(gemmScaleSlot(d.kind, true))]);
  return f;
}

// An explicit plan (PlanChoice, from the plan table) as the gemm-rs/ar kernels take it. Fused: partials in the input
// dtype, own rows reduced in the epilogue, copied by the compute CTAs' producer warps (commSms 0: the measured best,
// fusedCopyPlan in gemm_rs_launch.cuh) or by commSms send CTAs. Decomposed: the GEMM, then commSms reduction CTAs.
GemmRsPlan explicitReducePlan(const PlanChoice& c) {
  GemmRsPlan p{};
  if (c.kind == PlanKind::kDecomposed) {
    p.kind = GemmRsPlanKind::kDecomposed;
    p.numReduce = static_cast<int16_t>(c.commSms);  // 0: every SM
    return p;
  }
  p.kind = GemmRsPlanKind::kFused;
  p.partial = GemmRsPartial::kInput;
  p.epiReduce = 1;
  p.transport = c.commSms == 0 ? GemmRsTransport::kCopy : GemmRsTransport::kSend;
  p.numSend = static_cast<int16_t>(c.commSms);
  return p;
}

GemmLayout coreLayoutOf(GemmOperands o) {
  return o == GemmOperands::kNN ? GemmLayout::kAB : (o == GemmOperands::kTN ? GemmLayout::kAtB : GemmLayout::kABt);
}

// The plan gemm-rs/ar runs for this shape: chosen once per op, used both to size the workspace and to launch. On the
// layouts core: the decomposed plan (its GEMM, then the reduction CTAs; commSms of them if the plan table says so).
GemmRsPlan gemmReducePlan(const OpDescriptor& d, const PlanChoice& choice) {
  if (isFp8(d.dtype) || fusedGemmOnLayoutsCore(d, choice)) {  // FP8: the FP8 core, then the reduction CTAs
    GemmRsPlan p{};
    p.kind = GemmRsPlanKind::kDecomposed;
    if (choice.kind == PlanKind::kDecomposed) p.numReduce = static_cast<int16_t>(choice.commSms);
    return p;
  }
  if (choice.kind != PlanKind::kAuto) return explicitReducePlan(choice);
  const auto m = static_cast<int64_t>(d.dims[dim::kM]), n = static_cast<int64_t>(d.dims[dim::kN]);
  const auto k = static_cast<int64_t>(d.dims[dim::kK]);
  const int ranks = static_cast<int>(d.nranks);
  return d.kind == OpKind::kGemmAr ? chooseGemmArPlan(m, n, k, ranks, gemmDtype(d.dtype))
                                   : chooseGemmRsPlan(m, n, k, ranks, gemmDtype(d.dtype));
}

// Bytes the layout's matrices must hold for `d` (0: the op needs no workspace).
uint64_t matBytesNeeded(const OpDescriptor& d, uint32_t nranks, const PlanChoice& choice) {
  if (nranks == 1) return 0;  // one rank exchanges nothing: its kernels touch no workspace
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], kk = d.dims[dim::kK];
  const auto mi = static_cast<int64_t>(m), ki = static_cast<int64_t>(kk);
  const auto ranks = static_cast<int>(nranks);
  if (d.kind == OpKind::kAgGemm && isFp8(d.dtype)) {
    // The gathered fp8 A, every rank's scales and the core's block scales (ag_gemm.hpp's FP8 layout) in the two data
    // matrices; A's and the scales' chunk flags in the flag words.
    const Fp8Scaling s = fp8ScalingOf(d);
    const auto bytes = static_cast<uint64_t>(agGemmFp8Layout(mi, ki, ranks, s).bytes);
    return std::max((bytes + 1) / 2, 512 * static_cast<uint64_t>(agGemmFp8FlagWords(mi, ki, ranks, s)));
  }
  if (d.kind == OpKind::kAgGemm) {
    // Gathered A [m, k] in the two data matrices; its chunk flags in the flag words (1/512 of a matrix).
    const auto words = static_cast<uint64_t>(agGemmFlagWords(mi, ranks));
    return std::max(m * kk, 512 * words);
  }
  const bool allReduce = d.kind == OpKind::kGemmAr;
  uint64_t need = static_cast<uint64_t>(
      gemmRsMatBytesNeeded(mi, static_cast<int64_t>(n), gemmReducePlan(d, choice), isFp8(d.dtype)));
  if (gemmRsWritesPeerOutputs(mi, ranks, allReduce)) {
    // The output [rows, n] in the two data matrices; rank 0's rows, the most, so that every rank decides alike.
    need = std::max(need, ((allReduce ? m : rowsOf(m, 0, nranks)) * n * outBytesOf(d) + 1) / 2);
  }
  return need;
}

char* workspaceAt(const FusedEnv& env, uint32_t r, uint64_t offset) { return env.workspaces[r] + offset; }

// The fields AgGemmParams and GemmRsParams share: this rank, the shape, the dtype and the operands.
template <class Params>
void fillGemmCommon(Params& p, const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, const FusedEnv& env) {
  p.rank = static_cast<int32_t>(env.rank);
  p.nranks = static_cast<int32_t>(env.nranks);
  p.m = static_cast<int64_t>(d.dims[dim::kM]);
  p.n = static_cast<int64_t>(d.dims[dim::kN]);
  p.k = static_cast<int64_t>(d.dims[dim::kK]);
  p.dtype = gemmDtype(d.dtype);
  p.a = ptrs[slot::kA];
  p.b = ptrs[slot::kB];
  p.layout = coreLayoutOf(gemmOperandsOf(d.flags));
  p.fp8 = fp8OperandsOf(d, ptrs);
  if (env.layout.splitKBytes > 0) {  // this rank's split-K scratch (WorkspaceLayout)
    p.splitK = env.workspaces[env.rank] + env.layout.splitKOff;
    p.splitKBytes = env.layout.splitKBytes;
  }
  // The fused GEMMs cannot skip an op the daemon rejected (nothing in them reads the verdict): the daemon aborts the
  // communicator instead, so they find the abort word set and unwind. Every wait reports into this rank's control
  // page and polls its abort word, as AllGather's do.
  p.epoch = epoch;
  p.epochWord = env.epochWord;
  p.abortWord = &env.ctl->abort;
  p.errorSlot = &env.ctl->error;
  p.timeoutNs = env.timeoutNs;
}

std::string launchAgGemm(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, const FusedEnv& env,
                         cudaStream_t s, const PlanChoice& choice) {
  AgGemmParams p{};
  fillGemmCommon(p, d, ptrs, e, env);
  p.c = ptrs[slot::kC];
  p.commSms = static_cast<int32_t>(env.commSms);  // 0: the launcher chooses per shape
  p.layoutsCore = fusedGemmOnLayoutsCore(d, choice) ? 1 : 0;
  if (p.fp8.enabled != 0) {
    // The whole gather (fp8 rows, then the scales), then the FP8 core; commSms as the layouts core's path takes it.
    if (choice.kind == PlanKind::kDecomposed && choice.commSms > 0) p.commSms = static_cast<int32_t>(choice.commSms);
  } else if (p.layoutsCore != 0) {
    // The whole gather (commSms CTAs: the plan table's, else cuda.comm_sms, else every SM), then the layouts core.
    if (choice.kind == PlanKind::kDecomposed && choice.commSms > 0) p.commSms = static_cast<int32_t>(choice.commSms);
  } else if (choice.kind != PlanKind::kAuto && env.nranks > 1) {  // one rank gathers nothing: its local plan stays
    p.plan = choice.kind == PlanKind::kFused ? 1 : 2;
    p.commSms = static_cast<int32_t>(choice.commSms);
  }
  void* const userGathered = ptrs[slot::kAGathered];
  if (env.nranks == 1) {
    p.aGathered = userGathered;  // the local plan copies the shard there (or skips it when absent)
  } else {
    // Peers push their shards into our gathered buffer, so it lives in the workspace (the caller's buffers are
    // mapped in the launching process only).
    p.aGathered = workspaceAt(env, env.rank, env.layout.dataOff);
    p.flags = reinterpret_cast<uint64_t*>(workspaceAt(env, env.rank, env.layout.agFlagsOff));
    p.flagWords = static_cast<int64_t>(env.layout.agFlagWords);
    for (uint32_t q = 0; q < env.nranks; ++q) {
      p.peerGathered[q] = workspaceAt(env, q, env.layout.dataOff);
      p.peerFlags[q] = reinterpret_cast<uint64_t*>(workspaceAt(env, q, env.layout.agFlagsOff));
    }
  }
  const AgGemmPlanChoice plan = kernels::launchAgGemm(p, s);  // plan 0: the launcher chooses
  std::string name = agGemmPlanName(plan.plan);
  if (plan.plan != AgGemmPlan::kFused && agGemmOnLayoutsCore(p)) {
    name += fmt::format(" ({} on the layouts core)", gemmLayoutName(gemmOperandsOf(d.flags)));
  }
  if (p.fp8.enabled != 0) {
    name += plan.plan == AgGemmPlan::kDecomposed
                ? fmt::format(" ({} all-gather CTAs for the fp8 rows and their scales, then the FP8 core)", plan.commSms)
                : std::string(" (the FP8 core)");
  } else if (plan.plan == AgGemmPlan::kFused) {
    name += fmt::format(" ({}{} comm SMs, {} copies, {} tail tiles)",
                        p.layout == GemmLayout::kAB ? "NN: the weight loaded MN-major; " : "", plan.commSms,
                        plan.commMode == 2 ? "TMA" : "LSU", plan.tailTiles);
  } else if (plan.plan == AgGemmPlan::kDecomposed) {
    name += fmt::format(" ({} all-gather CTAs, then the GEMM)", plan.commSms);
  }
  if (env.nranks > 1 && userGathered != nullptr) {
    // Cost: m * k elements read and written once more, after the GEMM (the gathered A exists only in the workspace).
    checkCuda(cudaMemcpyAsync(userGathered, p.aGathered, static_cast<size_t>(p.m * p.k) * dtypeSize(d.dtype),
                              cudaMemcpyDeviceToDevice, s),
              "cudaMemcpyAsync(gathered A into a_gathered)");
    name += ", a_gathered copied out of the workspace";
  }
  return name;
}

std::string launchGemmReduce(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, const FusedEnv& env,
                             cudaStream_t s, const PlanChoice& choice) {
  const bool allReduce = d.kind == OpKind::kGemmAr;
  GemmRsParams p{};
  fillGemmCommon(p, d, ptrs, e, env);
  p.layoutsCore = p.fp8.enabled == 0 && fusedGemmOnLayoutsCore(d, choice) ? 1 : 0;
  p.lda = p.layout == GemmLayout::kAtB ? p.m : p.k;  // A [k, m] or [m, k]
  p.ldb = p.layout == GemmLayout::kABt ? p.k : p.n;  // B [n, k] or [k, n]
  p.ldOut = p.n;
  // Reduced rows that go into another rank's output must land in memory mapped here. With every rank's output mapped
  // (env.outputs, executor daemon) they go straight there. Otherwise (executor client: only this rank's own tensors are
  // mapped in its process) they are staged in the destination's workspace. Cost of staging (gemm-ar on 2+ ranks,
  // gemm-rs where a tile row spans two ranks): this rank's output is read and written once more after the kernel,
  // rows * n * 2 bytes (about 0.1 ms for 8192 x 8192 bf16 at ~3 TB/s, next to a ~1 ms op). Either way each rank's
  // kernel waits for the rows others write into its output before it ends.
  const bool peerWrites = gemmRsWritesPeerOutputs(p.m, p.nranks, allReduce);
  bool direct = peerWrites;  // and every output mapped (a rank that owns no rows may have none: stage then)
  for (uint32_t q = 0; q < env.nranks; ++q) direct = direct && env.outputs[q] != nullptr;
  const bool staged = peerWrites && !direct;
  void* const userOut = ptrs[slot::kC];
  p.out = staged ? workspaceAt(env, env.rank, env.layout.dataOff) : userOut;
  for (uint32_t q = 0; q < env.nranks; ++q) {
    p.workspace[q] = workspaceAt(env, q, env.layout.rsOff);
    if (q != env.rank) p.peerOut[q] = direct ? env.outputs[q] : workspaceAt(env, q, env.layout.dataOff);
  }
  p.wsMatBytes = static_cast<int64_t>(env.layout.rsMatBytes);
  // Read only when wsMatBytes is 0 (a workspace too small for any exchange), which checkFusedGemm allows for one rank
  // alone, whose kernel stages nothing.
  p.wsMaxM = p.m;
  p.wsMaxN = p.n;
  p.plan = gemmReducePlan(d, choice);  // the plan checkFusedGemm sized the workspace for
  const GemmRsPlan ran = allReduce ? launchGemmAr(p, s) : launchGemmRs(p, s);
  std::string name = env.nranks == 1 && ran.kind == GemmRsPlanKind::kDecomposed
                         ? std::string("the GEMM alone (one rank: nothing to reduce)")
                         : std::string(gemmRsPlanName(ran, allReduce));
  if (ran.kind == GemmRsPlanKind::kDecomposed && gemmRsOnLayoutsCore(p)) {
    name += fmt::format(" ({} on the layouts core)", gemmLayoutName(gemmOperandsOf(d.flags)));
  } else if (p.fp8.enabled != 0) {
    name += " (the FP8 core, fp32 partials)";
  } else if (p.layout == GemmLayout::kAB) {
    name += " (NN: the weight loaded MN-major)";
  }
  if (staged) {
    const uint64_t rows = allReduce ? d.dims[dim::kM] : rowsOf(d.dims[dim::kM], env.rank, env.nranks);
    if (rows > 0) {
      checkCuda(cudaMemcpyAsync(userOut, p.out, rows * d.dims[dim::kN] * outBytesOf(d), cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync(output out of the workspace)");
    }
    name += ", output staged in the workspace and copied out";
  }
  return name;
}

}  // namespace

std::string workspaceRemedy(uint64_t bytes) {
  return fmt::format("create the communicator with tandem_comm_config_t.workspace_bytes >= {} ({} MiB; "
                     "tandem_comm_init_config, within tandemd's limits.max_session_bytes)",
                     bytes, (bytes + (1u << 20) - 1) >> 20);
}

uint64_t workspaceBytesFor(const OpDescriptor& d, uint32_t nranks, uint64_t moeRows) {
  const auto dimOf = [&](int i) { return static_cast<int64_t>(d.dims[i]); };
  if (isFusedGemm(d.kind)) return WorkspaceLayout::bytesFor(roundUp(matBytesNeeded(d, nranks, {}), kMatUnit), nranks);
  if (d.kind == OpKind::kRingAttention) {
    // k and v rows of this rank's sequence, the v half on a 256-byte boundary (ring_attention.cpp kvCapacityRows).
    const uint64_t kv = d.dims[dim::kSeq] * d.dims[dim::kKvHeads] * d.dims[dim::kHeadDim] * 2 + 256;
    return WorkspaceLayout::bytesFor(nranks > 1 ? kv : 0, nranks);
  }
  if (d.kind == OpKind::kRingAttentionBackward) {
    // Executor client: this rank's six inputs staged in the data region (two matrices; ring_attention_bwd.hpp).
    const uint64_t staged = ringBackwardStaging(d, d.dims[dim::kSeq]).bytes;
    return WorkspaceLayout::bytesFor(nranks > 1 ? (staged + 1) / 2 : 0, nranks);
  }
  if (d.kind == OpKind::kMoeDispatchGemm || d.kind == OpKind::kMoeDispatchFfnCombine ||
      d.kind == OpKind::kMoeFfnBackward) {
    // This rank's scratch at the end of the data region, on a 256-byte boundary (moe_ops.cpp commOf).
    const uint64_t scratch = moeScratchBytes(dimOf(dim::kTokens), dimOf(dim::kTopk), dimOf(dim::kExperts)) + 256;
    if (d.kind == OpKind::kMoeDispatchGemm) {
      // The receive rows (FP8 weights: e4m3 x with its scales, moe.hpp) and the scratch share the data region, two
      // matrices long.
      const bool fp8 = isFp8(moeWeightDtype(d.dtype, d.flags));
      const uint64_t recv = moeRecvBytes(dimOf(dim::kCapacity), dimOf(dim::kHidden), 0, false, fp8);
      return WorkspaceLayout::bytesFor((recv + scratch + 1) / 2, nranks);
    }
    // The FFN's receive rows (x, h and y; the backward's also dout, gate|up and g) fill the span before the scratch.
    const int64_t rows = static_cast<int64_t>(moeRows != 0 ? moeRows : d.dims[dim::kTokens] * d.dims[dim::kTopk]);
    const bool backward = d.kind == OpKind::kMoeFfnBackward;
    const bool fp8 = !backward && isFp8(moeWeightDtype(d.dtype, d.flags));  // e4m3 x and h rows (moe.hpp)
    return WorkspaceLayout::bytesForSpan(
        moeRecvBytes(rows, dimOf(dim::kHidden), dimOf(dim::kFfn), backward, fp8) + scratch, scratch, nranks);
  }
  return WorkspaceLayout::bytesFor(0, nranks);
}

WorkspaceLayout WorkspaceLayout::fit(uint64_t bytes, uint32_t nranks) {
  const uint64_t base = workspaceBytes(nranks);
  // The split-K scratch comes before any matrix: a budget too small for it holds no matrices either (so a larger
  // budget never holds less).
  const uint64_t fixed = base + kMoeControlBytes + kFusedSplitKBytes;
  const uint64_t room = bytes > fixed ? bytes - fixed : 0;
  // The largest matrix size whose area fits; the area grows with it, so bisect over 64 KiB units (lo fits, hi not).
  uint64_t lo = 0, hi = room / 2 / kMatUnit + 1;
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    (gemmAreaBytes(mid * kMatUnit, nranks) <= room ? lo : hi) = mid;
  }
  WorkspaceLayout l;
  l.rsMatBytes = lo * kMatUnit;
  l.agFlagsOff = base;
  l.agFlagWords = agFlagWordsFor(l.rsMatBytes);
  l.rsOff = base + roundUp(l.agFlagWords * 8, kMatUnit);
  l.dataOff = l.rsOff + gemmRsFixedWorkspaceBytes(static_cast<int64_t>(l.rsMatBytes), static_cast<int>(nranks));
  l.dataBytes = 2 * l.rsMatBytes;
  l.spanOff = l.rsOff + gemmRsFixedFlagsBytes(static_cast<int64_t>(l.rsMatBytes), static_cast<int>(nranks));
  l.moeOff = l.dataOff + l.dataBytes;
  l.spanBytes = l.moeOff - l.spanOff;
  l.splitKOff = l.moeOff + kMoeControlBytes;
  l.splitKBytes = l.splitKOff + kFusedSplitKBytes <= bytes ? kFusedSplitKBytes : 0;
  return l;
}

uint64_t WorkspaceLayout::bytesFor(uint64_t matBytes, uint32_t nranks) {
  return roundUp(workspaceBytes(nranks) + gemmAreaBytes(roundUp(matBytes, kMatUnit), nranks) + kMoeControlBytes +
                     kFusedSplitKBytes,
                 kGranularity);
}

uint64_t WorkspaceLayout::bytesForSpan(uint64_t spanBytes, uint64_t dataBytes, uint32_t nranks) {
  // The span is the 2 nranks + 2 staging matrices (gemm_rs.hpp: inbox and outbox by parity) and the 2 of data.
  const uint64_t perMat = 2 * uint64_t{nranks} + 4;
  return bytesFor(std::max((spanBytes + perMat - 1) / perMat, (dataBytes + 1) / 2), nranks);
}

void preloadFusedGemmKernels(int device) {
  preloadGemmKernels(device);
  preloadAgGemmKernels(device);
  preloadGemmRsKernels(device);
  preloadGemmArKernels(device);
  preloadGemmLayoutKernels(device);
  preloadGemmFp8Kernels(device);
}

bool isFusedGemm(OpKind kind) { return kind == OpKind::kAgGemm || kind == OpKind::kGemmRs || kind == OpKind::kGemmAr; }

// Small M (decode): the fused kernels' 128 x 256 tiles leave most SMs idle (M <= 128 is one tile row: N / 256 tiles,
// 32 at N = 8192 on 132 SMs) and measured 0.6x of cuBLASLt + NCCL; the layouts core's swap-AB tiles put the weight's N
// on the 128-row side and split K to fill the SMs, so its GEMM then the collective (a few microseconds of data at
// these sizes) is taken. A plan table entry that names the fused plan keeps it (tandemctl tune measured it faster).
// TN (wgrad) always runs there, since the fused kernels load A K-major only (ag-gemm's shards are then [k, rows]).
// NN (dgrad): gemm-rs and gemm-ar fuse it like NT (their fused kernel loads the weight [k, n] MN-major); ag-gemm's
// fused kernel takes it too, but runs it only where the plan table names the fused plan (`tandemctl tune` times both),
// its default staying the gather, then the layouts core, until the two are measured against each other.
bool fusedGemmOnLayoutsCore(const OpDescriptor& d, const PlanChoice& plan) {
  if (isFp8(d.dtype)) return false;  // FP8 operands run on the FP8 core (NT only)
  const GemmOperands layout = gemmOperandsOf(d.flags);
  if (layout == GemmOperands::kTN) return true;
  if (layout == GemmOperands::kNN && d.kind == OpKind::kAgGemm && plan.kind != PlanKind::kFused) return true;
  return d.dims[dim::kM] <= kFusedSmallM && plan.kind != PlanKind::kFused;
}

namespace {

// FP8 inputs on one node (across nodes tandemd applies its own rules: gpu_exchange_plan.hpp): the FP8 core's rules,
// beyond the shared ones below. Its wgmma reads K-major operands only, so NT alone; rows of k fp8 bytes move as 16-byte
// words.
void checkFp8Gemm(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env) {
  const std::string_view op = opKindName(d.kind);
  const GemmOperands layout = gemmOperandsOf(d.flags);
  if (layout != GemmOperands::kNT) {
    fail(ErrorCode::kUnsupported, "{}: layout {} with {} inputs: the cuda backend's FP8 core reads both operands "
         "K-major (fp8 wgmma has no transpose), so it takes layout nt only. Transpose in the kernel that writes the "
         "fp8 tensors (quantize into a [rows, k] a and an [n, k] b) and pass layout nt, or run it on a tandemd with "
         "daemon.backend: cpu", op, gemmLayoutName(layout), dtypeName(d.dtype));
  }
  const uint64_t m = d.dims[dim::kM], kk = d.dims[dim::kK];
  if (kk % 16 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: {} = {} is not a multiple of 16; the cuda backend's FP8 core moves whole "
         "16-byte rows of fp8, so pad K with zeros{}", op, d.kind == OpKind::kAgGemm ? "k" : "this rank's k slice", kk,
         d.kind == OpKind::kAgGemm ? "" : " (and split it so that every rank's slice is a multiple of 16)");
  }
  const void* const aScale = ptrs[static_cast<std::size_t>(gemmScaleSlot(d.kind, false))];
  const void* const bScale = ptrs[static_cast<std::size_t>(gemmScaleSlot(d.kind, true))];
  if (aScale == nullptr || bScale == nullptr) {
    fail(ErrorCode::kInvalidArgument, "{}: {} inputs need a_scale and b_scale (fp32)", op, dtypeName(d.dtype));
  }
  for (const void* sp : {aScale, bScale}) {
    if (reinterpret_cast<uintptr_t>(sp) % 4 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: a scale tensor starts at {}, which is not 4-byte aligned (fp32)", op, sp);
    }
  }
  // Block scales are read in place where no gather copies them (gemm-rs/ar, ag-gemm at one rank): the core's TMA copies
  // a_scale [k/128, m] 16 bytes at a time.
  const bool inPlace = d.kind != OpKind::kAgGemm || env.nranks == 1;
  if ((d.flags & kFlagFp8BlockScale) != 0 && inPlace &&
      (m % 4 != 0 || reinterpret_cast<uintptr_t>(aScale) % 16 != 0)) {
    fail(ErrorCode::kInvalidArgument, "{}: block-scaled {} inputs on the cuda backend need m a multiple of 4 (m = {}) "
         "and a_scale 16-byte aligned ({}): the FP8 core copies a_scale [ceil(k/128), m] 16 bytes at a time. Pad m "
         "with zero rows to a multiple of 4, and use an a_scale offset that is a multiple of 16", op,
         dtypeName(d.dtype), m, aScale);
  }
}

}  // namespace

bool needsGang(const OpDescriptor& d) {
  return (d.kind == OpKind::kNop && d.nranks > 1) ||
         (d.kind == OpKind::kGemmRs &&
          !gemmRsRanksInStep(static_cast<int64_t>(d.dims[dim::kM]), static_cast<int>(d.nranks), false));
}

void checkFusedGemm(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env, const PlanChoice& plan) {
  const std::string_view op = opKindName(d.kind);
  if (!isFusedGemm(d.kind)) fail(ErrorCode::kInternal, "{} is not a fused GEMM", op);
  if (isFp8(d.dtype)) checkFp8Gemm(d, ptrs, env);
  if (!isFp8(d.dtype) && d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    fail(ErrorCode::kUnsupported, "{}: the cuda backend's GEMM kernels take bf16 or fp16, not {}; convert the "
         "tensors, or run {} on a tandemd with daemon.backend: cpu", op, dtypeName(d.dtype), dtypeName(d.dtype));
  }
  const GemmOperands layout = gemmOperandsOf(d.flags);
  if (layout != GemmOperands::kNT && layout != GemmOperands::kNN && layout != GemmOperands::kTN) {
    fail(ErrorCode::kInvalidArgument, "{}: operand layout {} (descriptor flags bits 2-3) is none of nt, nn, tn", op,
         static_cast<int>(layout));
  }
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], kk = d.dims[dim::kK];
  if (aTransposed(layout)) {
    // A is stored [k, rows]: its rows of k are rows long, and TMA moves whole 16-byte rows.
    if (d.kind == OpKind::kAgGemm) {
      for (uint32_t r = 0; r < env.nranks; ++r) {
        if (rowsOf(m, r, env.nranks) % 8 != 0) {
          fail(ErrorCode::kInvalidArgument, "{}: layout tn stores each rank's shard of a as [k, rows]; rank {} has "
               "rows = {} (m = {} over {} ranks), not a multiple of 8, and the cuda backend's kernels move whole "
               "16-byte rows: make m a multiple of 8 x {} = {} (pad a with zero rows), or use layout nt or nn", op, r,
               rowsOf(m, r, env.nranks), m, env.nranks, env.nranks, 8 * env.nranks);
        }
      }
    } else if (m % 8 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: layout tn stores a as [k, m] and m = {} is not a multiple of 8; the cuda "
           "backend's kernels move whole 16-byte rows, so pad m to a multiple of 8 (zero columns of a), or use layout "
           "nt or nn", op, m);
    }
  }
  if (n % 8 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: n = {} is not a multiple of 8; the cuda backend's kernels move whole "
         "16-byte rows (tensor memory accelerator), so pad n to a multiple of 8", op, n);
  }
  if (kk % 8 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: {} = {} is not a multiple of 8; the cuda backend's kernels move whole "
         "16-byte rows, so pad K with zeros{}", op, d.kind == OpKind::kAgGemm ? "k" : "this rank's k slice", kk,
         d.kind == OpKind::kAgGemm ? "" : " (and split it so that every rank's slice is a multiple of 8)");
  }
  constexpr uint64_t kMaxDim = uint64_t{1} << 31;  // the kernels index rows and columns with int32
  if (m >= kMaxDim || n >= kMaxDim || kk >= kMaxDim) {
    fail(ErrorCode::kInvalidArgument, "{}: m = {}, n = {} and k = {} must each be below 2^31 on the cuda backend", op, m,
         n, kk);
  }
  static constexpr const char* kSlotNames[] = {"a", "b", "c", "a_gathered"};
  // Slot 3 is gemm-rs/ar's a_scale (FP8 only; checkFp8Gemm checks the scales).
  const std::size_t slots = d.kind == OpKind::kAgGemm ? std::size(kSlotNames) : 3;
  for (std::size_t s = 0; s < slots; ++s) {
    if (ptrs[s] != nullptr && reinterpret_cast<uintptr_t>(ptrs[s]) % 16 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: tensor {} starts at {}, which is not 16-byte aligned; the cuda backend's "
           "kernels read and write 16 bytes at a time: use an offset that is a multiple of 16", op, kSlotNames[s],
           ptrs[s]);
    }
  }
  const uint64_t need = roundUp(matBytesNeeded(d, env.nranks, plan), kMatUnit);
  if (need > env.layout.rsMatBytes) {
    const uint64_t bytes = WorkspaceLayout::bytesFor(need, env.nranks);
    fail(ErrorCode::kInvalidArgument, "{}: m = {}, n = {}, k = {} on {} ranks needs a workspace of {} bytes ({} MiB) "
         "per rank, but this communicator's is {} bytes; {}, or split the op", op, m, n, kk,
         env.nranks, bytes, (bytes + (1u << 20) - 1) >> 20, env.workspaceBytes, workspaceRemedy(bytes));
  }
}

std::string launchFusedGemm(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch, const FusedEnv& env,
                            cudaStream_t stream, const PlanChoice& plan) {
  try {
    if (d.kind == OpKind::kAgGemm) return launchAgGemm(d, ptrs, epoch, env, stream, plan);
    if (d.kind == OpKind::kGemmRs || d.kind == OpKind::kGemmAr) {
      return launchGemmReduce(d, ptrs, epoch, env, stream, plan);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& ex) {  // the kernel launchers throw std::runtime_error
    fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
  }
  fail(ErrorCode::kInternal, "{} is not a fused GEMM", opKindName(d.kind));
}

}  // namespace tandem::kernels
