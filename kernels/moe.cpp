// MoE host launcher: the shape rules, the parameter block, and the sequence of kernels on the stream (route, plan,
// dispatch, arrive, the grouped GEMMs, combine). The kernels are in moe.cu (nvcc cannot compile fmt, which
// tandem::Error's helpers use, so the host side lives here).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "moe_desc.hpp"
#include "tandem/common/descriptor.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/grouped_gemm.hpp"
#include "tandem/kernels/grouped_gemm_fp8.hpp"
#include "tandem/kernels/grouped_gemm_wgrad.hpp"
#include "tandem/kernels/moe.hpp"

namespace tandem::kernels {
namespace {

using namespace moe;

constexpr int64_t kMax32 = 0x7fffffff;
constexpr int64_t kMaxTopk = 32;  // the combine keeps a token's slot rows in shared memory (moe.cu kMaxSlots)

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fail(ErrorCode::kCuda, "moe: {} failed [-> {}: {}]", what, cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char* opName(const MoeParams& p) {
  return p.backward ? "moe-ffn-backward" : p.ffn ? "moe-dispatch-ffn-combine" : "moe-dispatch-gemm";
}

// Receive rows of this rank: dispatch+GEMM its capacity, FFN whatever the receive area holds (capped for int32).
int64_t recvRowsOf(const MoeParams& p, const MoeComm& c) {
  if (!p.ffn) return p.capacity;
  return std::min<int64_t>(moeRecvRows(c.recvBytes, p.hidden, p.ffnDim, p.backward, p.fp8), kMax32 / 2);
}

int smCount() {
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  checkCuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

// The backward on the owner, after the dispatch's rows arrived (moe.hpp). Every GEMM reads the plan kernel's group
// offsets (zero when the op failed: no rows, nothing computed). Each step's inputs are no longer needed once the
// steps that read them ran: dx takes the place of dout (after dw2 read it), d(gate|up) that of gate|up (in place).
std::string launchBackward(const MoeParams& g, const MoeComm& c, const MoeKernelParams& p, const RecvLayout& rl,
                           int64_t rows, int combineCtas, cudaStream_t stream) {
  const int64_t L = g.experts / c.nranks;
  char* const recv = p.recv[c.rank];
  const int64_t f = g.ffnDim;
  const auto grouped = [&](const void* x, int64_t k, const void* w, int64_t n, void* out, GemmLayout layout) {
    GroupedGemmParams gp{};
    gp.dtype = g.dtype;
    gp.groupOffsets = p.groupOffsets;
    gp.numExperts = L;
    gp.mTotal = rows;
    gp.x = x;
    gp.k = k;
    gp.w = w;
    gp.n = n;
    gp.out = out;
    gp.epilogue = GroupedGemmEpilogue::kStore;
    gp.layout = layout;
    gp.skipIdleHalves = g.gemmSkipIdleHalves;
    gp.maxGroupRows = g.tokens * static_cast<int64_t>(c.nranks);  // moe.cpp launchMoe says why
    launchGroupedGemm(gp, stream, g.gemmSms);
  };
  // gate|up = x · w1ᵀ (kept apart, unlike the forward's fused SwiGLU: the backward needs a and b), unless the forward
  // saved it (the act kernel then reads a and b there); g = dout · w2.
  const bool saved = p.saved != nullptr;
  if (!saved) grouped(recv + rl.xOff, g.hidden, g.w1, 2 * f, recv + rl.guOff, GemmLayout::kABt);
  grouped(recv + rl.yOff, g.hidden, g.w2, f, recv + rl.gOff, GemmLayout::kAB);
  const int sms = smCount();
  const int actCtas = static_cast<int>(std::clamp<int64_t>(rows, 1, int64_t{sms} * 4));
  checkCuda(launchBackwardAct(p, actCtas, stream), "launching the backward's act kernel");
  const auto wgrad = [&](const void* a, int64_t m, const void* b, int64_t n, void* out) {
    GroupedWgradParams wp{};
    wp.a = a;
    wp.b = b;
    wp.out = out;
    wp.groupOffsets = p.groupOffsets;
    wp.mTotal = rows;
    wp.m = m;
    wp.n = n;
    wp.numExperts = L;
    wp.dtype = g.dtype;
    wp.outDtype = GemmOut::kInput;
    wp.runIf = &p.status->state;  // a failed or rejected op leaves dw1 and dw2 as they were
    wp.runValue = kRun;
    launchGroupedWgrad(wp, stream, g.gemmSms);
  };
  wgrad(recv + rl.yOff, g.hidden, recv + rl.hOff, f, g.dw2);       // dw2_e = dout_eᵀ · (weight * h)_e
  wgrad(recv + rl.guOff, 2 * f, recv + rl.xOff, g.hidden, g.dw1);  // dw1_e = d(gate|up)_eᵀ · x_e
  // dx = d(gate|up) · w1 (w1 [E, 2 ffn, hidden] read as [k = 2 ffn, n = hidden]) into the y rows.
  grouped(recv + rl.guOff, 2 * f, g.w1, g.hidden, recv + rl.yOff, GemmLayout::kAB);
  if (c.nranks > 1) checkCuda(launchArrive(p, 1, stream), "launching the dx exchange");
  checkCuda(launchCombine(p, combineCtas, stream), "launching the combine kernel");
  return fmt::format("{} over up to {} receive rows ({} SMs), act {} CTAs, dw2 and dw1 (grouped wgrad), dx, "
                     "combine {} CTAs (dx summed in slot order, dtopk_weights)",
                     saved ? "dout·w2 (gate|up saved by the forward)" : "gate|up and dout·w2", rows,
                     g.gemmSms > 0 ? std::min(g.gemmSms, sms) : sms, actCtas, combineCtas);
}

// The FP8 grouped GEMM over this rank's received rows with FP8 weights: the quantised x rows and their scales (as the
// quantising dispatch wrote them) times w with its 128 x 128 block scales, over the plan kernel's group offsets (zero
// when the op failed: nothing computed), into bf16 `out` [rows, n] (kStore; the FFN's gemm1 changes the epilogue).
GroupedGemmFp8Params fp8GemmOfRecv(const MoeParams& g, const MoeComm& c, const MoeKernelParams& p,
                                   const RecvLayout& rl, int64_t rows, const void* w, const float* wScale, int64_t n,
                                   void* out) {
  char* const recv = p.recv[c.rank];
  GroupedGemmFp8Params gp{};
  gp.x = recv + rl.xOff;
  gp.xScale = reinterpret_cast<const float*>(recv + rl.xScaleOff);
  gp.ldxScale = static_cast<int64_t>(rl.scaleLd);
  gp.w = w;
  gp.wScale = wScale;
  gp.wScaling = GroupedFp8WeightScaling::kBlock;
  gp.out = out;
  gp.groupOffsets = p.groupOffsets;
  gp.mTotal = rows;
  gp.n = n;
  gp.k = g.hidden;
  gp.numExperts = g.experts / c.nranks;
  gp.epilogue = GroupedGemmEpilogue::kStore;
  if (g.gemmDynamicTiles) gp.tileCounter = &p.status->gemmTiles[0];  // zeroed with the status
  return gp;
}

// The FFN forward with FP8 weights on the owner, after the quantised rows arrived (moe.hpp): gemm1 with the SwiGLU
// epilogue writes h in e4m3 with its 1 x 128 scales, gemm2 y in bf16, both on the FP8 grouped GEMM over the plan
// kernel's group offsets (zero when the op failed: nothing computed); then the y exchange and the combine, as bf16's.
// The routing weight stays with the combine (as bf16's), so y is the same unweighted row on both paths.
std::string launchFfnFp8(const MoeParams& g, const MoeComm& c, const MoeKernelParams& p, const RecvLayout& rl,
                         int64_t rows, int combineCtas, cudaStream_t stream) {
  char* const recv = p.recv[c.rank];
  GroupedGemmFp8Params g1 = fp8GemmOfRecv(g, c, p, rl, rows, g.w1, g.w1Scale, 2 * g.ffnDim, recv + rl.hOff);
  g1.outScale = reinterpret_cast<float*>(recv + rl.hScaleOff);
  g1.ldOutScale = static_cast<int64_t>(rl.scaleLd);
  g1.epilogue = GroupedGemmEpilogue::kSwiGlu;
  GroupedGemmFp8Params g2 = g1;
  g2.x = g1.out;
  g2.xScale = g1.outScale;
  g2.w = g.w2;
  g2.wScale = g.w2Scale;
  g2.out = recv + rl.yOff;
  g2.outScale = nullptr;
  g2.ldOutScale = 0;
  g2.n = g.hidden;
  g2.k = g.ffnDim;
  g2.epilogue = GroupedGemmEpilogue::kStore;
  if (g.gemmDynamicTiles) g2.tileCounter = &p.status->gemmTiles[1];
  launchGroupedGemmFp8(g1, stream, g.gemmSms);
  launchGroupedGemmFp8(g2, stream, g.gemmSms);
  if (c.nranks > 1) checkCuda(launchArrive(p, 1, stream), "launching the y exchange");
  checkCuda(launchCombine(p, combineCtas, stream), "launching the combine kernel");
  const int sms = smCount();
  return fmt::format("FP8 gemm1+SwiGLU (h in e4m3) and gemm2 over up to {} receive rows ({} SMs), combine {} CTAs "
                     "(a warp per token, pulled in slot order)",
                     rows, g.gemmSms > 0 ? std::min(g.gemmSms, sms) : sms, combineCtas);
}

}  // namespace

uint64_t moeRecvBytes(int64_t rows, int64_t hidden, int64_t ffn, bool backward, bool fp8) {
  return recvLayout(rows, hidden, ffn, backward, fp8).bytes;
}

int64_t moeRecvRows(uint64_t bytes, int64_t hidden, int64_t ffn, bool backward, bool fp8) {
  if (hidden <= 0) return 0;
  // Per row: x and (FFN) y of hidden, h of ffn, 16 bytes of row info; the backward's weight and dtopk (8 bytes),
  // gate|up and g (3 ffn). FP8: x and h of one byte each and their scales (4 bytes per 128 columns), the FFN's y of two.
  const auto f = static_cast<uint64_t>(std::max<int64_t>(ffn, 0));
  const auto h = static_cast<uint64_t>(hidden);
  const bool fp8Rows = fp8 && !backward;
  const uint64_t perRow = fp8Rows ? h + (ffn > 0 ? 2 * h : 0) + f + 4 * (h / 128 + f / 128) + 16
                                  : h * 2 * (ffn > 0 ? 2 : 1) + f * 2 + 16 + (backward && ffn > 0 ? 8 + f * 3 * 2 : 0);
  int64_t rows = static_cast<int64_t>(bytes / perRow);
  while (rows > 0 && moeRecvBytes(rows, hidden, ffn, backward, fp8) > bytes) --rows;  // the alignment slack
  return rows;
}

uint64_t moeScratchBytes(int64_t tokens, int64_t topk, int64_t experts) {
  return scratchLayout(tokens, topk, experts).bytes;
}

void validateMoe(const MoeParams& p, const MoeComm& c) {
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  const char* op = opName(p);
  if (p.dtype != GemmDtype::kBf16 && p.dtype != GemmDtype::kFp16) {
    fail(kBad, "{}: dtype must be bf16 or fp16, got {}", op, static_cast<int>(p.dtype));
  }
  if (c.nranks < 1 || c.nranks > kMoeMaxRanks || c.rank >= c.nranks) {
    fail(kBad, "{}: rank {} of {} ranks: the GPU kernels run 1 to {} ranks of one node", op, c.rank, c.nranks,
         kMoeMaxRanks);
  }
  if (p.experts < 1 || p.experts > kMoeMaxExperts) {
    fail(kBad,
         "{}: experts = {}: the cuda backend's routing table holds 1 to {} experts; use fewer experts or run "
         "the op on a tandemd with daemon.backend: cpu",
         op, p.experts, kMoeMaxExperts);
  }
  if (p.experts % c.nranks != 0) {
    fail(kBad, "{}: experts {} is not divisible by nranks {}; experts are spread evenly over ranks", op, p.experts,
         c.nranks);
  }
  if (p.topk < 1 || p.topk > std::min<int64_t>(p.experts, kMaxTopk)) {
    fail(kBad, "{}: topk = {}: the cuda backend takes 1 <= topk <= min(experts, {}) = {}", op, p.topk, kMaxTopk,
         std::min<int64_t>(p.experts, kMaxTopk));
  }
  if (p.tokens < 0 || p.tokens * p.topk > kMax32) {
    fail(kBad, "{}: tokens x topk = {} x {} must be below 2^31 on the cuda backend; split the batch", op, p.tokens,
         p.topk);
  }
  if (p.hidden <= 0 || p.hidden % 8 != 0 || p.hidden > kMax32) {
    fail(kBad,
         "{}: hidden = {} must be a positive multiple of 8 (the kernels move 16-byte rows); pad hidden with "
         "zeros",
         op, p.hidden);
  }
  if (!p.ffn && (p.nOut <= 0 || p.nOut % 8 != 0 || p.nOut > kMax32)) {
    fail(kBad, "{}: n_out = {} must be a positive multiple of 8 (16-byte rows of out); pad w with zero rows", op,
         p.nOut);
  }
  if (p.ffn && p.tokens * (p.hidden / 1024 + 1) > kMax32) {  // the combine's work items: tokens x row parts
    fail(kBad, "{}: tokens x hidden = {} x {} is too large for the cuda backend's combine; split the batch", op,
         p.tokens, p.hidden);
  }
  if (p.ffn && (p.ffnDim <= 0 || p.ffnDim % 8 != 0 || p.ffnDim > kMax32 / 2)) {
    fail(kBad, "{}: ffn = {} must be a positive multiple of 8 (16-byte rows of h); pad w1 and w2 with zeros", op,
         p.ffnDim);
  }
  if (p.fp8) {
    if (p.backward) {
      fail(kBad, "{}: FP8 weights (w_dtype) are the forward ops' only; pass bf16 or fp16 weights", op);
    }
    if (p.dtype != GemmDtype::kBf16) fail(kBad, "{}: FP8 weights (w_dtype) need dtype bf16 (x and out)", op);
    if (p.savedRows != 0) {
      fail(kBad, "{}: saved_rows = {}: saved activations are for the backward, which FP8 weights do not have", op,
           p.savedRows);
    }
    // The FP8 grouped GEMM's rules (grouped_gemm_fp8.hpp): its k (hidden) and the quantising dispatch's 16-column
    // pieces; the FFN's SwiGLU epilogue's h tiles, each in one 128-row scale block of w1.
    if (p.hidden % 16 != 0) {
      fail(kBad,
           "{}: hidden = {} must be a multiple of 16 with FP8 weights (the FP8 grouped GEMM reads 16-byte rows of "
           "e4m3 x); pad hidden with zeros",
           op, p.hidden);
    }
    if (p.ffn && p.ffnDim % 128 != 0) {
      fail(kBad,
           "{}: ffn = {} must be a multiple of 128 with FP8 weights (the FP8 grouped GEMM's SwiGLU tiles each take "
           "one 128-row block of w1's scales, and h is quantised per 128 columns); pad w1 and w2 with zeros",
           op, p.ffnDim);
    }
  }
  if (!p.ffn && (p.capacity < 0 || p.capacity > kMax32)) {
    fail(kBad, "{}: capacity = {} must be in [0, 2^31)", op, p.capacity);
  }
  if (p.savedRows < 0 || (!p.ffn && p.savedRows != 0)) {
    fail(kBad, "{}: saved_rows = {}: only the FFN ops save gate|up, with saved_rows >= 0", op, p.savedRows);
  }
  for (uint32_t q = 0; q < c.nranks; ++q) {
    if (c.control[q] == nullptr || !aligned(c.control[q], 128) || c.recv[q] == nullptr || !aligned(c.recv[q], kAlign)) {
      fail(ErrorCode::kInternal, "{}: rank {}'s control area ({}) or receive area ({}) is missing or misaligned", op, q,
           c.control[q], c.recv[q]);
    }
  }
  if (c.scratch == nullptr || !aligned(c.scratch, kAlign)) {
    fail(ErrorCode::kInternal, "{}: the private scratch ({}) is missing or not 256-byte aligned", op, c.scratch);
  }
  const uint64_t scratch = moeScratchBytes(p.tokens, p.topk, p.experts);
  const int64_t rows = recvRowsOf(p, c);
  const uint64_t recv = moeRecvBytes(p.ffn ? 1 : rows, p.hidden, p.ffn ? p.ffnDim : 0, p.backward, p.fp8);
  if (scratch > c.scratchBytes || recv > c.recvBytes) {
    fail(kBad,
         "{}: tokens = {}, hidden = {}, {} = {} need {} bytes of receive rows and {} of scratch on this rank, "
         "but the communicator's workspace leaves {} and {}; ask for a larger workspace when the communicator is "
         "created (tandem_comm_config_t.workspace_bytes), or split the op",
         op, p.tokens, p.hidden, p.ffn ? "ffn" : "capacity", p.ffn ? p.ffnDim : p.capacity, recv, scratch, c.recvBytes,
         c.scratchBytes);
  }
  const auto need16 = [&](const void* ptr, const char* name, bool required) {
    if (ptr == nullptr) {
      if (required) fail(kBad, "{}: tensor {} is missing", op, name);
      return;
    }
    if (!aligned(ptr, 16)) {
      fail(kBad,
           "{}: tensor {} starts at {}, which is not 16-byte aligned; the cuda backend's kernels read and write "
           "16 bytes at a time: use an offset that is a multiple of 16",
           op, name, ptr);
    }
  };
  const auto need4 = [&](const void* ptr, const char* name, bool required) {
    if (ptr == nullptr) {
      if (required) fail(kBad, "{}: tensor {} is missing", op, name);
      return;
    }
    if (!aligned(ptr, 4)) fail(kBad, "{}: tensor {} starts at {}, which is not 4-byte aligned", op, name, ptr);
  };
  const bool any = p.tokens > 0;
  need16(p.x, "x", any);
  need4(p.topkIds, "topk_ids", any);
  if (p.backward && !p.ffn) fail(ErrorCode::kInternal, "{}: the backward is the FFN's", op);
  // The saved gate|up holds rows from every rank, so it is needed whatever this rank's own tokens.
  if (p.ffn) need16(p.saved, "saved", p.savedRows > 0);
  if (p.backward) {
    need4(p.topkWeights, "topk_weights", any);
    need16(p.w1, "w1", true);
    need16(p.w2, "w2", true);
    need16(p.dout, "dout", any);
    need16(p.dx, "dx", any);
    need4(p.dtopkWeights, "dtopk_weights", any);
    need16(p.dw1, "dw1", true);
    need16(p.dw2, "dw2", true);
  } else if (p.ffn) {
    need4(p.topkWeights, "topk_weights", any);
    need16(p.w1, "w1", true);
    need16(p.w2, "w2", true);
    need16(p.out, "out", any);
    if (p.fp8) {
      need4(p.w1Scale, "w1_scale", true);
      need4(p.w2Scale, "w2_scale", true);
    }
  } else {
    need16(p.w, "w", true);
    need16(p.out, "out", p.capacity > 0);
    need4(p.rowInfo, "row_info", p.capacity > 0);
    need4(p.expertCounts, "expert_counts", true);
    if (p.fp8) need4(p.wScale, "w_scale", true);
  }
}

std::string launchMoe(const MoeParams& g, const MoeComm& c, cudaStream_t stream) {
  validateMoe(g, c);
  const int64_t L = g.experts / c.nranks;
  const int64_t rows = recvRowsOf(g, c);
  const int64_t ffn = g.ffn ? g.ffnDim : 0;
  const ScratchLayout sl = scratchLayout(g.tokens, g.topk, g.experts);
  const RecvLayout rl = recvLayout(rows, g.hidden, ffn, g.backward, g.fp8);
  auto* scratch = static_cast<char*>(c.scratch);

  MoeKernelParams p;
  std::memset(&p, 0, sizeof p);
  p.x = g.x;
  p.ids = g.topkIds;
  p.weights = g.topkWeights;
  p.out = g.ffn ? (g.backward ? g.dx : g.out) : nullptr;
  p.rowInfo = g.ffn ? nullptr : g.rowInfo;
  p.expertCounts = g.ffn ? nullptr : g.expertCounts;
  for (uint32_t q = 0; q < c.nranks; ++q) {
    p.ctl[q] = static_cast<MoeControl*>(c.control[q]);
    p.recv[q] = static_cast<char*>(c.recv[q]);
  }
  p.status = reinterpret_cast<MoeStatus*>(scratch + sl.statusOff);
  p.localIdx = reinterpret_cast<int32_t*>(scratch + sl.localIdxOff);
  p.chunkBase = reinterpret_cast<int32_t*>(scratch + sl.chunkBaseOff);
  p.localCounts = reinterpret_cast<int32_t*>(scratch + sl.localCountsOff);
  p.srcOffset = reinterpret_cast<int32_t*>(scratch + sl.srcOffsetOff);
  p.groupOffsets = reinterpret_cast<int32_t*>(scratch + sl.groupOffsetsOff);
  p.verdictSlot = c.verdictSlot;
  p.verdictRejected = c.verdictRejected;
  p.abortWord = c.abortWord;
  p.errorSlot = c.errorSlot;
  p.fault = c.fault;
  p.faultsDropped = c.faultsDropped;
  p.epochWord = c.epochWord;
  p.timeoutNs = c.timeoutNs;
  p.epoch = c.epoch;
  p.rank = static_cast<int32_t>(c.rank);
  p.nranks = static_cast<int32_t>(c.nranks);
  p.tokens = static_cast<int32_t>(g.tokens);
  p.hidden = static_cast<int32_t>(g.hidden);
  p.experts = static_cast<int32_t>(g.experts);
  p.topk = static_cast<int32_t>(g.topk);
  p.localExperts = static_cast<int32_t>(L);
  p.capacity = static_cast<int32_t>(rows);
  p.ffn = static_cast<int32_t>(ffn);
  p.op = static_cast<int32_t>(g.backward ? OpKind::kMoeFfnBackward
                              : g.ffn    ? OpKind::kMoeDispatchFfnCombine
                                         : OpKind::kMoeDispatchGemm);
  p.dtype = static_cast<int32_t>(g.dtype);
  p.backward = g.backward ? 1 : 0;
  p.dout = g.dout;
  p.dtopkOut = g.dtopkWeights;
  // Rows past 2^31 never arrive (the receive rows are capped below that), so a larger saved_rows limits nothing more.
  p.saved = g.savedRows > 0 ? g.saved : nullptr;
  p.savedRows = static_cast<int32_t>(std::min<int64_t>(g.savedRows, kMax32));
  p.fp8 = g.fp8 ? 1 : 0;

  const int sms = smCount();
  const int64_t pairs = g.tokens * g.topk;
  const int routeCtas = static_cast<int>(ceilDiv(g.experts, kRouteWarps));
  const int chunks = static_cast<int>(std::max<int64_t>(routeChunks(g.tokens), 1));  // one chunk of none: counts 0
  const int copyCtas = static_cast<int>(std::clamp<int64_t>(ceilDiv(pairs, kCopyWarps), 1, int64_t{sms} * 8));
  // A warp sums up to 128 16-byte pieces of a token's row (4 per lane): 7 warps per 7168-wide bf16 row, so a few
  // thousand tokens give every SM dozens of warps' loads in flight.
  const int64_t parts = std::max<int64_t>(1, ceilDiv(g.hidden / 8, 128));
  p.combineParts = static_cast<int32_t>(parts);
  const int combineCtas =
      static_cast<int>(std::clamp<int64_t>(ceilDiv(g.tokens * parts, kCopyWarps), 1, int64_t{sms} * 8));

  // Reset the per-op status (state, bad pair, CTA counters); the rest of the scratch is written before it is read.
  checkCuda(cudaMemsetAsync(p.status, 0, sizeof(MoeStatus), stream), "cudaMemsetAsync(status)");
  checkCuda(launchRoute(p, routeCtas, chunks, stream), "launching the route kernel");
  checkCuda(launchPlan(p, stream), "launching the plan kernel");
  // FP8: a warp per (token, kQuantCols columns) quantises and writes to all of the token's experts.
  const int quantCtas = static_cast<int>(
      std::clamp<int64_t>(ceilDiv(g.tokens * ceilDiv(g.hidden, kQuantCols), kCopyWarps), 1, int64_t{sms} * 8));
  if (g.fp8) {
    checkCuda(launchDispatchFp8(p, quantCtas, stream), "launching the quantising dispatch kernel");
  } else {
    checkCuda(launchDispatch(p, copyCtas, stream), "launching the dispatch kernel");
  }
  // One rank waits for no peer: its FFN needs neither exchange (stream order suffices); its dispatch+GEMM still copies
  // the row info out here.
  const bool alone = c.nranks == 1;
  if (!(alone && g.ffn)) checkCuda(launchArrive(p, 0, stream), "launching the arrive kernel");

  if (g.backward) {
    return fmt::format("route {}x{} CTAs, plan, dispatch {} CTAs (x and dout rows), {}", routeCtas, chunks, copyCtas,
                       launchBackward(g, c, p, rl, rows, combineCtas, stream));
  }
  if (g.fp8 && g.ffn) {
    return fmt::format("route {}x{} CTAs, plan, quantising dispatch {} CTAs (a warp per token and {} columns), {}",
                       routeCtas, chunks, quantCtas, kQuantCols,
                       launchFfnFp8(g, c, p, rl, rows, combineCtas, stream));
  }
  if (g.fp8) {  // dispatch+GEMM: the FP8 grouped GEMM from the quantised rows into out (bf16)
    launchGroupedGemmFp8(fp8GemmOfRecv(g, c, p, rl, rows, g.w, g.wScale, g.nOut, g.out), stream, g.gemmSms);
    return fmt::format("route {}x{} CTAs, plan, quantising dispatch {} CTAs (a warp per token and {} columns), FP8 "
                       "grouped GEMM over {} receive rows ({} SMs)",
                       routeCtas, chunks, quantCtas, kQuantCols, rows,
                       g.gemmSms > 0 ? std::min(g.gemmSms, sms) : sms);
  }
  GroupedGemmParams gg{};
  gg.dtype = g.dtype;
  gg.groupOffsets = p.groupOffsets;
  gg.numExperts = L;
  gg.mTotal = rows;
  gg.x = p.recv[c.rank] + rl.xOff;
  gg.k = g.hidden;
  gg.skipIdleHalves = g.gemmSkipIdleHalves;
  if (g.gemmDynamicTiles) gg.tileCounter = &p.status->gemmTiles[0];  // zeroed with the status above
  // A token's top-k experts are distinct, so a local expert receives at most one row per token of every rank: at
  // decode sizes this picks the swap-AB path. A tuning bound only (ranks with more tokens cost time, not results).
  const int64_t maxGroupRows = g.tokens * static_cast<int64_t>(c.nranks);
  gg.maxGroupRows = maxGroupRows;
  if (!g.ffn) {
    gg.w = g.w;
    gg.out = g.out;
    gg.n = g.nOut;
    gg.epilogue = GroupedGemmEpilogue::kStore;
    launchGroupedGemm(gg, stream, g.gemmSms);
    return fmt::format(
        "route {}x{} CTAs, plan, dispatch {} CTAs (a warp per row), grouped GEMM over {} receive rows "
        "({} SMs)",
        routeCtas, chunks, copyCtas, rows, g.gemmSms > 0 ? std::min(g.gemmSms, sms) : sms);
  }
  gg.w = g.w1;
  gg.n = 2 * g.ffnDim;
  const bool saves = p.saved != nullptr;
  if (saves) {
    // gate|up into the caller's saved rows (the backward reads them), then h from them. The plan let the op run only
    // if this rank's rows fit saved, so its GEMM spans at most savedRows rows.
    gg.out = p.saved;
    gg.mTotal = std::min<int64_t>(rows, p.savedRows);
    gg.epilogue = GroupedGemmEpilogue::kStore;
    launchGroupedGemm(gg, stream, g.gemmSms);
    const int swigluCtas =
        static_cast<int>(std::clamp<int64_t>(ceilDiv(gg.mTotal * (g.ffnDim / 8), kActThreads), 1, int64_t{sms} * 8));
    checkCuda(launchSwiGlu(p, swigluCtas, stream), "launching the SwiGLU kernel");
  } else {
    gg.out = p.recv[c.rank] + rl.hOff;
    gg.epilogue = GroupedGemmEpilogue::kSwiGlu;
    launchGroupedGemm(gg, stream, g.gemmSms);
  }
  GroupedGemmParams g2{};
  g2.dtype = g.dtype;
  g2.groupOffsets = p.groupOffsets;
  g2.numExperts = L;
  g2.mTotal = rows;
  g2.x = p.recv[c.rank] + rl.hOff;
  g2.w = g.w2;
  g2.out = p.recv[c.rank] + rl.yOff;
  g2.n = g.hidden;
  g2.k = g.ffnDim;
  g2.epilogue = GroupedGemmEpilogue::kStore;
  g2.skipIdleHalves = g.gemmSkipIdleHalves;
  g2.maxGroupRows = maxGroupRows;
  if (g.gemmDynamicTiles) g2.tileCounter = &p.status->gemmTiles[1];
  launchGroupedGemm(g2, stream, g.gemmSms);
  if (!alone) checkCuda(launchArrive(p, 1, stream), "launching the y exchange");
  checkCuda(launchCombine(p, combineCtas, stream), "launching the combine kernel");
  return fmt::format(
      "route {}x{} CTAs, plan, dispatch {} CTAs (a warp per row), {} and gemm2 over up to {} "
      "receive rows ({} SMs), combine {} CTAs (a warp per token, pulled in slot order)",
      routeCtas, chunks, copyCtas, saves ? "gemm1 into saved, SwiGLU" : "gemm1+SwiGLU", rows,
      g.gemmSms > 0 ? std::min(g.gemmSms, sms) : sms, combineCtas);
}

void preloadMoeKernels(int device) {
  int previous = 0;
  checkCuda(cudaGetDevice(&previous), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  cudaError_t e = prepareMoeKernels();
  if (e == cudaSuccess) e = prepareMoeFp8Kernels();
  cudaSetDevice(previous);
  checkCuda(e, "loading the MoE kernels");
  preloadGroupedGemmKernels(device);
  preloadGroupedGemmFp8Kernels(device);
  preloadGroupedWgradKernels(device);
}

}  // namespace tandem::kernels
