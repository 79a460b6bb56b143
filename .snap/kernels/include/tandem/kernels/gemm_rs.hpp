// Fused GEMM + ReduceScatter over NVLink. n ranks, one GPU each. K is split across ranks: rank r holds
// A_r [m, k_r] and B_r [n, k_r] (both K-major); C = Σ_r A_r · B_rᵀ (fp32 accumulation, rounded once to the output
// dtype). ReduceScatter: rank r receives C[rows_of(m, r, nranks)] as [rows, n]. GEMM + AllReduce (gemm_ar.hpp) shares
// the parameters, the workspace and most of the device code.
//
// Design (kernels/device/gemm_rs_sm90.cuh has the details):
// - One persistent kernel whose CTAs take roles from one role table (GemmRsRoleLayout): reduce, send, compute.
// - Compute CTAs run the GEMM core (gemm_sm90.cuh) with a tile order that visits, on rank r, the tile rows reduced by
//   rank r+1 first, then r+2, ..., and its own rows last, so every partial a peer needs is finished early.
// - A tile row (128 rows) is reduced by the owner of its first row (for the benchmark shapes that is the owner of all
//   its rows; otherwise the reducer writes the rows it does not own into their owner's output and flags them).
// - A finished partial half tile (64 x 256, one consumer warpgroup's share) travels to its reducer one of four ways
//   (GemmRsTransport): the epilogue stores it straight into the reducer's inbox over NVLink (push), or writes it
//   locally and send CTAs copy it over (send), or writes it locally and the reducer's reduce CTAs read it over NVLink
//   (pull), or writes it locally and the compute CTA's idle producer warps copy it over during the next mainloop
//   (copy: the measured winner; push stalls the tensor cores while 132 SMs burst into one link). Each half tile has an
//   epoch flag (monotonic, never reset) released after its data.
// - The reducer sums the partials in rank order (0, 1, ..., n-1) in fp32, whatever order they arrived in, so repeated
//   runs are bitwise identical. Either the compute CTAs do it in the epilogue of their own tiles (epiReduce: their own
//   partial never leaves the registers) or reduce CTAs do it as the flags arrive.
// - Partials travel in fp32 or in the input dtype (GemmRsPartial); the plan says which.
// - Staging (inbox/outbox) is double-buffered by epoch parity: a rank can be at most one op ahead of any peer, since
//   every op waits for data that every peer produces in that same op.
//
// Host-only header (g++ and nvcc). The launchers take plain pointers (peer pointers mapped into this process), so the
// daemon and the client executor can both call them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts_plan.hpp"  // GemmLayout
#include "tandem/kernels/signals.hpp"

#if defined(__CUDACC__)
#define TANDEM_RS_HD __host__ __device__
#else
#define TANDEM_RS_HD
#endif

namespace tandem::kernels {

inline constexpr int kGemmRsMaxRanks = 8;
inline constexpr int64_t kGemmRsTileM = 128, kGemmRsTileN = 256;  // the GEMM core's output tile

// The balanced row split of tandem.h: rank r of n owns m/n + (r < m%n) rows starting at r*(m/n) + min(r, m%n).
constexpr int64_t rsRowsOf(int64_t m, int r, int n) { return m / n + (r < m % n ? 1 : 0); }
constexpr int64_t rsRowOffset(int64_t m, int r, int n) { return r * (m / n) + (r < m % n ? r : m % n); }

// ---- plans
enum class GemmRsPlanKind : uint8_t {
  kAuto = 0,        // chooseGemmRsPlan / chooseGemmArPlan
  kFused = 1,       // one persistent kernel (roles: compute, send, reduce)
  kDecomposed = 2,  // the GEMM core into a local bf16 partial, then our own SM reduction kernel (no NCCL)
};
enum class GemmRsTransport : uint8_t {
  kPush = 0,  // compute epilogue stores partials straight into the reducer's inbox (peer stores)
  kSend = 1,  // compute epilogue writes partials locally; send CTAs copy them into the reducer's inbox
  kPull = 2,  // compute epilogue writes partials locally; the reducer's reduce CTAs read them over NVLink
  kCopy = 3,  // compute epilogue writes partials locally; the compute CTA's idle producer warps (3 warps beside the
              // TMA thread) copy them into the reducer's inbox while the tensor cores run the next tile; for the
              // all-reduce they also broadcast the reduced rows. Needs epiReduce.
};
enum class GemmRsPartial : uint8_t { kFp32 = 0, kInput = 1 };  // the dtype partials travel in

struct GemmRsPlan {
  GemmRsPlanKind kind;
  GemmRsTransport transport;
  GemmRsPartial partial;
  uint8_t epiReduce;  // fused: compute CTAs reduce their own rows in the epilogue (then numReduce may be 0)
  uint8_t oneShot;    // all-reduce only: every rank reduces every tile, pulling every peer's partial
  uint8_t pad0;
  int16_t numSend;    // fused: send CTAs (transport kSend)
  int16_t numReduce;  // fused: reduce CTAs; decomposed: CTAs of the reduction kernel
  int16_t numCompute;  // fused: compute CTAs; 0 = every SM left over
};
static_assert(sizeof(GemmRsPlan) == 12);

// Human-readable, e.g. "fused/push/bf16/epi/c132" or "decomposed/r64".
const char* gemmRsPlanName(const GemmRsPlan& plan, bool allReduce = false);

// ---- role table of the fused kernel: CTAs [0, reduce) reduce, [reduce, reduce + send) send, the rest compute.
struct GemmRsRoleLayout {
  int32_t reduce, send, compute;
  TANDEM_RS_HD constexpr int32_t total() const { return reduce + send + compute; }
  TANDEM_RS_HD constexpr Role roleOf(int32_t cta) const {
    return cta < reduce ? Role::kReduce : (cta < reduce + send ? Role::kIntraComm : Role::kCompute);
  }
  TANDEM_RS_HD constexpr int32_t indexInRole(int32_t cta) const {
    return cta < reduce ? cta : (cta < reduce + send ? cta - reduce : cta - reduce - send);
  }
};

// ---- workspace: one allocation per rank, the same size on every rank, zeroed ONCE (the flags), never reset.
// Layout (bytes): [flags][inbox parity 0: nranks matrices][inbox parity 1][outbox parity 0][outbox parity 1], each
// staging matrix ceil(maxM / 128) * 128 rows x ceil(maxN / 256) * 256 columns of fp32 (bf16 partials use half).
size_t gemmRsWorkspaceBytes(int64_t maxM, int64_t maxN, int nranks);

// The same layout with a fixed matrix size (GemmRsParams::wsMatBytes, a multiple of 64 KiB) instead of a maximum
// shape: for a runtime that runs ops of many shapes on one workspace. The flags then never move, which matters because
// they are never reset: a layout that moved with the shape could put a flag on bytes that held an earlier op's data.
size_t gemmRsFixedWorkspaceBytes(int64_t matBytes, int nranks);
// Where that layout's staging matrices begin: the bytes of its flags (a multiple of 64 KiB).
size_t gemmRsFixedFlagsBytes(int64_t matBytes, int nranks);
// Bytes of one partial element: fp32 for fused plans with fp32 partials and for FP8 operands (GemmRsParams::fp8: the
// FP8 core writes fp32 partials, summed in fp32 and rounded once to the output dtype), else the 16-bit input dtype.
constexpr int64_t gemmRsPartialBytes(const GemmRsPlan& plan, bool fp8) {
  return fp8 || (plan.kind != GemmRsPlanKind::kDecomposed && plan.partial == GemmRsPartial::kFp32) ? 4 : 2;
}
// Bytes of one staging matrix that an op of this shape and plan needs under the fixed layout (its partials padded to
// whole 128 x 256 tiles, gemmRsPartialBytes each).
constexpr int64_t gemmRsMatBytesNeeded(int64_t m, int64_t n, const GemmRsPlan& plan, bool fp8 = false) {
  const int64_t psize = gemmRsPartialBytes(plan, fp8);
  return (m + kGemmRsTileM - 1) / kGemmRsTileM * kGemmRsTileM * ((n + kGemmRsTileN - 1) / kGemmRsTileN * kGemmRsTileN) *
         psize;
}

// Whether the kernels write reduced rows into other ranks' outputs (GemmRsParams::peerOut), which must then be mapped
// here: always for an all-reduce of 2+ ranks; for a reduce-scatter only where a tile row spans two ranks' rows (its
// reducer, the owner of its first row, writes the rest into their owner's output), i.e. unless every rank's first
// row starts a tile row.
constexpr bool gemmRsWritesPeerOutputs(int64_t m, int nranks, bool allReduce) {
  if (nranks <= 1) return false;
  if (allReduce) return true;
  for (int r = 1; r < nranks; ++r) {
    if (rsRowOffset(m, r, nranks) % kGemmRsTileM != 0) return true;
  }
  return false;
}

// Whether every rank's kernel waits, within one op, for data that every other rank produces in that op. The staging is
// double-buffered by epoch parity on that assumption: no rank gets more than one op ahead of a peer. It fails for a
// reduce-scatter in which some rank owns no rows (m < nranks): that rank only sends and may run ahead, so a runtime
// must keep such ops in step across ranks by other means (e.g. start op e only once every rank finished op e - 1).
constexpr bool gemmRsRanksInStep(int64_t m, int nranks, bool allReduce) { return allReduce || m >= nranks; }

// Test knob of the fused kernels (GemmRsParams::epilogue): which own-tile epilogue they run, so that one benchmark run
// can time the variants side by side (bench/gemm_rs_one_rank_bench.cu). Everything but benchmarks leaves it kDefault.
enum class GemmRsEpilogue : int32_t {
  kDefault = 0,  // own tiles leave through the GEMM core's TMA-store epilogue where they can: at one rank (nothing to
                 // add), and at two ranks for a reduce-scatter with 16-bit partials copied by the copier warps (the
                 // peer's partial TMA-loaded into smem and added there first); the rest take the reducing path
  kGeneric = 1,  // own tiles always take the reducing path (fp32 smem round trip, then 8-byte stores from registers)
  kTmaPeer = 2,  // kDefault, and the two-rank path with the peer's partial for the all-reduce too (its copier warps then
                 // broadcast the TMA-stored rows)
  kTmaPeerEarly = 3,  // kTmaPeer, with the copier warps issuing the first two chunks' TMA loads during the mainloop
};

// ---- parameters (POD; zero-initialise and fill). Shared with launchGemmAr (gemm_ar.hpp).
struct GemmRsParams {
  int32_t rank, nranks;
  int64_t m, n, k;  // k: this rank's K slice (ranks may differ); k % 8 == 0; n % 8 == 0
  GemmDtype dtype;
  const void* a;  // [m, k], row stride lda elements
  const void* b;  // [n, k], row stride ldb elements
  int64_t lda, ldb;
  void* out;      // RS: [rsRowsOf(m, rank, nranks), n]; AR: [m, n]; row stride ldOut (% 8 == 0, >= n)
  int64_t ldOut;
  void* peerOut[kGemmRsMaxRanks];    // every rank's out, mapped here ([rank] may be null: out is used)
  void* workspace[kGemmRsMaxRanks];  // every rank's workspace, mapped here ([rank] is this rank's)
  int64_t wsMaxM, wsMaxN;            // the shape the workspaces were sized for (m <= wsMaxM, n <= wsMaxN)
  uint64_t epoch;              // the same on every rank for one op; larger than every epoch used on this workspace
  const uint64_t* epochWord;   // device-epoch mode (op_entry.hpp): the kernels' epoch is *epochWord; null: epoch
  const uint64_t* abortWord;   // optional; non-zero aborts every wait
  ErrorSlot* errorSlot;        // optional, host-mapped: the first failed wait reports here
  uint64_t timeoutNs;          // per-wait deadline from the kernel's start; 0 = 10 s
  GemmRsPlan plan;             // kind kAuto: the chooser's plan
  int32_t groupM;              // raster group height in tiles inside a phase (0 = 16)
  // Profiling (fused plans; null = off): per compute CTA and consumer warpgroup, %globaltimer at kernel start, then
  // per tile {epilogue entry, after the wait for peers, epilogue exit, kind (0 partial sent, 1 reduced here)}:
  // trace[((cta * 2 + wg) * (traceTiles + 1) + 1 + j) * 4 + f], header trace[((cta * 2 + wg) * (traceTiles + 1)) * 4].
  uint64_t* trace;
  int32_t traceTiles;
  // Workspace layout: 0 = sized for wsMaxM x wsMaxN (gemmRsWorkspaceBytes); > 0 = the fixed layout of
  // gemmRsFixedWorkspaceBytes(wsMatBytes, nranks), wsMaxM and wsMaxN unused. The same on every rank.
  int64_t wsMatBytes;
  GemmRsEpilogue epilogue;  // test knob (see GemmRsEpilogue); kDefault outside benchmarks
  // Operand layout (gemm_layouts_plan.hpp), C = sum_r op(A_r) op(B_r): kABt as above (a [m, k], b [n, k]); kAB: a
  // [m, k], b [k, n]; kAtB: a [k, m], b [k, n]; lda and ldb are the stored row strides (>= that row's length).
  GemmLayout layout;
  // 1: the GEMM runs on the layouts core (gemm_layouts.hpp: swap-AB small-M path, deterministic split-K) in the
  // decomposed plan (the only plan it takes; kAuto then means decomposed). kAtB always does (the fused kernel loads A
  // K-major only); kAB takes the fused plans too (its weight is loaded MN-major) and the layouts core when decomposed.
  int32_t layoutsCore;
  // The layouts core's split-K scratch (GemmLayoutParams::workspace: zeroed once, left zeroed by every launch; this
  // rank's stream only). Null: no K splits.
  void* splitK;
  size_t splitKBytes;
  // FP8 operands (gemm_fp8.hpp; dtype is then unused: leave it kBf16): layout kABt,
  // k % 16 == 0, the decomposed plan (kAuto means it). The FP8 core writes this rank's partial in fp32 into its
  // outbox, and the reduction kernel sums the ranks' partials in rank order in fp32 and rounds once to fp8.out (out's
  // dtype, ldOut in its elements): partials rounded to bf16 first would add a rounding per rank that the cpu backend
  // and the reference do not have. One rank: the core writes out directly. Block scaling reads aScale
  // [ceil(k / 128), m] in place: m % 4 == 0 and aScale 16-byte aligned.
  Fp8Operands fp8;
};

// Whether the decomposed plan runs its GEMM on the layouts core for these params (the forward core's own GEMM
// multiplies in kABt only).
constexpr bool gemmRsOnLayoutsCore(const GemmRsParams& p) {
  return p.fp8.enabled == 0 && (p.layout != GemmLayout::kABt || p.layoutsCore != 0);
}

// Whether the fused plans take these params: the fused kernel's core loads A [m, k] K-major and B either way (kABt's
// [n, k], kAB's [k, n]).
constexpr bool gemmRsFusedTakes(const GemmRsParams& p) {
  return p.fp8.enabled == 0 && p.layout != GemmLayout::kAtB && p.layoutsCore == 0;
}

// The plan tandem runs for this shape (measured on nvidia-h200-x2, bench/gemm_rs_bench.cu, bench/RESULTS.md).
GemmRsPlan chooseGemmRsPlan(int64_t m, int64_t n, int64_t k, int nranks, GemmDtype dtype);

// Enqueues GEMM + ReduceScatter on `stream` (the current device owns stream and every local pointer). Every rank must
// call it with the same m, n, nranks, plan and epoch. Throws std::runtime_error with the reason on bad arguments or a
// CUDA failure. Returns the plan that was enqueued.
GemmRsPlan launchGemmRs(const GemmRsParams& params, cudaStream_t stream);

}  // namespace tandem::kernels
