// Fused AllGather + GEMM over NVLink. n ranks, one GPU each. Rank r holds the row shard
// A[rowOffset(m, r, n) .. + rowsOf(m, r, n)) as [rows, k]; every rank has its own B [n_cols, k]; every rank gets
// C = gather(A) · Bᵀ, [m, n_cols], and the gathered A [m, k] in its gathered buffer (workspace and output). The
// backward's layouts (AgGemmParams::layout): NN, B [k, n_cols] and C = gather(A) · B, fused alike (the weight loaded
// MN-major); TN, the all-gather and then the GEMM.
//
// Transport: PUSH. Each rank's communication CTAs read its own shard (local HBM) and write it, chunk by chunk, into
// every peer's gathered buffer over NVLink (and once into its own), then publish a per-chunk epoch flag in the
// destination's flag array (stReleaseSys after the data). The destination's compute CTAs start on tiles whose rows lie
// wholly in the local shard (read straight from the shard, no wait), then take the peers' rows in arrival order, each
// tile waiting on the chunk flags of its rows (waitGeq: abort word + deadline), then fence.proxy.async, then TMA.
// Before pushing into a peer, a rank waits for that peer's "arrived at epoch e" flag, which the peer writes into every
// rank's flag array when its kernel for epoch e starts: its previous op's reads of its gathered buffer are then over.
//
// Host-only header (g++ and nvcc). The launcher takes plain pointers, so either executor can call it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/gemm.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts_plan.hpp"  // GemmLayout
#include "tandem/kernels/signals.hpp"

#if defined(__CUDACC__)
#define TANDEM_AG_HD __host__ __device__
#else
#define TANDEM_AG_HD
#endif

namespace tandem::kernels {

inline constexpr int kAgGemmMaxRanks = 8;
// Rows of one pushed chunk (one flag each): 128, halved down to 16 while a shard has fewer than 2 chunks per pushing
// CTA (each chunk is pushed by one CTA, at ~20 GB/s per SM over NVLink: small shards need more, smaller chunks).
inline constexpr int64_t kAgGemmMaxChunkRows = 128;
inline constexpr int64_t kAgGemmMinChunkRows = 16;
constexpr int64_t agGemmChunkRows(int64_t m, int nranks, int pushCtas) {
  const int64_t rows = m / nranks + (m % nranks != 0 ? 1 : 0);
  int64_t c = kAgGemmMaxChunkRows;
  while (c > kAgGemmMinChunkRows && (rows + c - 1) / c < 2 * static_cast<int64_t>(pushCtas)) c /= 2;
  return c;
}

// The balanced row split of tandem.h: rank r of n owns m/n + (r < m%n) rows starting at r*(m/n) + min(r, m%n).
constexpr int64_t agRowsOf(int64_t m, int r, int n) { return m / n + (r < m % n ? 1 : 0); }
constexpr int64_t agRowOffset(int64_t m, int r, int n) { return r * (m / n) + (r < m % n ? r : m % n); }

// Flag array of one rank (uint64 words, zeroed ONCE at allocation, never reset; values are epochs):
//   [0, kAgGemmMaxRanks)                       arrive[src]: rank src's op of epoch e has started (src writes it here)
//   [kAgGemmMaxRanks + src * maxChunks + c]    chunk c of src's shard has landed in this rank's gathered buffer
constexpr int64_t agGemmMaxChunks(int64_t m, int nranks) {
  return (agRowsOf(m, 0, nranks) + kAgGemmMinChunkRows - 1) / kAgGemmMinChunkRows;
}
constexpr int64_t agGemmFlagWords(int64_t m, int nranks) {
  return kAgGemmMaxRanks + static_cast<int64_t>(nranks) * agGemmMaxChunks(m, nranks);
}

// ---- FP8 operands (AgGemmParams::fp8). The decomposed plan: the all-gather kernel moves the fp8 rows (k bytes each,
// half the bytes of bf16), then moves every rank's A scales the same way, and the FP8 core (gemm_fp8.hpp) runs on the
// gathered A. The scales cross as each rank's whole scale tensor, padded to 16-byte words (the all-gather kernel's
// unit), agGemmFp8ScaleWords(...) words per rank; block scales are then copied into one [ceil(k / 128), ldsa] M-major
// tensor for the core (a strided copy per rank), per-tensor scales stay one per rank and the core runs once per rank's
// rows with that rank's scale (each rank's A keeps its own scale, as the op table defines it). Layout of the gathered
// buffer (every rank's alike):
//   [0, m k)        gathered A, fp8
//   scales          nranks x agGemmFp8ScaleWords 16-byte words: rank q's scales at word q * agGemmFp8ScaleWords
//   stage           this rank's scales padded to whole words (the all-gather kernel's source)
//   block scales    kBlock: [ceil(k / 128), gemmFp8ScaleALd(m)] fp32, this rank's only
// Each region starts on a 256-byte boundary. The flag array holds A's flags (agGemmFlagWords(m, nranks)), then the
// scales' (agGemmFlagWords(nranks * scaleWords, nranks)).
constexpr int64_t agGemmFp8Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }
constexpr int64_t agGemmFp8ScaleWords(int64_t m, int64_t k, int nranks, Fp8Scaling s) {
  const int64_t kBlocks = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const int64_t floats = s == Fp8Scaling::kBlock ? kBlocks * agRowsOf(m, 0, nranks) : 1;
  return floats > 0 ? (floats + 3) / 4 : 1;
}
struct AgGemmFp8Layout {
  int64_t scalesOff, stageOff, blockOff, bytes;  // bytes of the whole gathered buffer
  int64_t scaleWords;                            // 16-byte words of one rank's scales
};
constexpr AgGemmFp8Layout agGemmFp8Layout(int64_t m, int64_t k, int nranks, Fp8Scaling s) {
  AgGemmFp8Layout l{};
  l.scaleWords = agGemmFp8ScaleWords(m, k, nranks, s);
  l.scalesOff = agGemmFp8Align(m * k);
  l.stageOff = l.scalesOff + agGemmFp8Align(nranks * l.scaleWords * 16);
  l.blockOff = l.stageOff + agGemmFp8Align(l.scaleWords * 16);
  const int64_t kBlocks = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  l.bytes = l.blockOff + (s == Fp8Scaling::kBlock ? agGemmFp8Align(kBlocks * gemmFp8ScaleALd(m) * 4) : 0);
  return l;
}
constexpr int64_t agGemmFp8FlagWords(int64_t m, int64_t k, int nranks, Fp8Scaling s) {
  return agGemmFlagWords(m, nranks) + agGemmFlagWords(nranks * agGemmFp8ScaleWords(m, k, nranks, s), nranks);
}

// ---- role table of the fused kernel: CTAs [0, commCtas) communicate, the rest compute (one CTA per SM).
struct AgGemmRoleLayout {
  int32_t commCtas;
  int32_t computeCtas;
  TANDEM_AG_HD constexpr int32_t total() const { return commCtas + computeCtas; }
  TANDEM_AG_HD constexpr Role roleOf(int32_t cta) const { return cta < commCtas ? Role::kIntraComm : Role::kCompute; }
  TANDEM_AG_HD constexpr int32_t indexInRole(int32_t cta) const { return cta < commCtas ? cta : cta - commCtas; }
};
// numSms SMs, commSms of them communicating (clamped to [1, numSms - 1]).
constexpr AgGemmRoleLayout agGemmRoleLayout(int numSms, int commSms) {
  const int c = commSms < 1 ? 1 : (commSms > numSms - 1 ? numSms - 1 : commSms);
  return {c, numSms - c};
}

// ---- plan choice
enum class AgGemmPlan : uint8_t {
  kFused = 0,       // one persistent kernel: comm CTAs push chunks while compute CTAs run the GEMM
  kDecomposed = 1,  // SM-driven all-gather kernel (push + flags, waits for all incoming chunks), then the GEMM core
  kLocal = 2,       // nranks == 1: the GEMM on the shard (plus a copy into the gathered buffer if one is given)
};
struct AgGemmPlanChoice {
  AgGemmPlan plan;
  int32_t commSms;    // fused: communication CTAs; decomposed: CTAs of the all-gather kernel
  int32_t commMode;   // 1: LSU copy loop (all threads), 2: TMA bulk copies (one thread, smem staging)
  int32_t tailTiles;  // fused (as launched): tiles the comm CTAs compute after pushing
};
constexpr const char* agGemmPlanName(AgGemmPlan p) {
  return p == AgGemmPlan::kFused ? "fused" : (p == AgGemmPlan::kDecomposed ? "decomposed" : "local");
}

// Cost model, fitted to measurements on nvidia-h200-x2 (bench/ag_gemm_bench.cu; bench/RESULTS.md "Fused
// AllGather+GEMM"): the GEMM core runs ~700 TF/s per GPU at the 700 W cap; one comm CTA pushes ~20 GB/s over NVLink
// (LSU loop and TMA bulk copies alike; the per-SM rate, not NVLink, is the limit). The compute CTAs spend the first
// 1/nranks of the GEMM on the local shard, then take peer rows one raster group (8 tile rows) at a time. The fused
// plan with c comm SMs hides the transfer when (a) the first peer group has landed by the end of the local part and
// (b) the whole transfer fits in 90% of the GEMM. The fewest comm SMs that satisfy both are taken: 4 leave 128 compute
// CTAs, a whole number of 128x256-tile waves for N = 8192 and M = 1024 .. 16384 (and the comm CTAs compute the tail
// where the 132-CTA GEMM needs fewer waves, see launchAgGemm). Measured: fused beat decomposed at every benchmark
// shape (M 1024 .. 16384); decomposed is kept for shapes where even 16 comm SMs cannot keep ahead of the GEMM.
constexpr AgGemmPlanChoice chooseAgGemmPlan(int64_t m, int64_t n, int64_t k, int nranks) {
  if (nranks <= 1) return {AgGemmPlan::kLocal, 0, 0, 0};
  const double rows = static_cast<double>(agRowsOf(m, 0, nranks));
  const double gemmUs = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / 700e6;
  const double localUs = gemmUs / nranks;
  const double peerBytes = rows * static_cast<double>(k) * 2.0 * (nranks - 1);
  const double groupBytes = (rows < 1024.0 ? rows : 1024.0) * static_cast<double>(k) * 2.0;
  constexpr double kPushBytesPerUsPerSm = 20e3;  // 20 GB/s
  for (int c = 4; c <= 16; c *= 2) {
    const double rate = c * kPushBytesPerUsPerSm;
    if (rate * localUs >= groupBytes && rate * gemmUs * 0.9 >= peerBytes) return {AgGemmPlan::kFused, c, 1, 0};
  }
  return {AgGemmPlan::kDecomposed, 132, 1, 0};
}

// ---- parameters (POD; zero-initialise and fill)
struct AgGemmParams {
  int32_t rank, nranks;
  int64_t m, n, k;  // global m (gathered rows), n = columns of C, k
  GemmDtype dtype;
  const void* a;    // this rank's shard [agRowsOf(m, rank, nranks), k], packed; 16-byte aligned
  const void* b;    // [n, k], packed (layout kAB, kAtB: [k, n])
  void* c;          // [m, n], packed; n % 8 == 0
  void* aGathered;  // [m, k] this rank's gathered buffer: required for nranks > 1 (peers push into it); nranks == 1:
                    // optional (null, or == a, skips the copy)
  void* peerGathered[kAgGemmMaxRanks];  // rank q's aGathered, mapped into this process (entry [rank] unused)
  uint64_t* flags;                      // this rank's flag array (>= agGemmFlagWords(m, nranks) words)
  uint64_t* peerFlags[kAgGemmMaxRanks];  // rank q's flag array, mapped here (entry [rank] unused)
  int64_t flagWords;                     // capacity of every rank's flag array, in words (checked)
  uint64_t epoch;              // the same on every rank for one op; larger than every epoch used before on these flags
  const uint64_t* epochWord;   // device-epoch mode (op_entry.hpp): the kernels' epoch is *epochWord; null: epoch
  const uint64_t* abortWord;   // optional; non-zero aborts every wait
  ErrorSlot* errorSlot;        // optional, host-mapped: the first failed wait reports here
  uint64_t timeoutNs;          // per-wait deadline from the kernel's start; 0 = 10 s
  // Plan: 0 = chooseAgGemmPlan, 1 = fused, 2 = decomposed. commSms 0 = the chooser's value for that plan.
  int32_t plan;
  int32_t commSms;
  int32_t groupM;    // raster group height in tiles (0 = 8 fused, 16 decomposed)
  int32_t commMode;  // fused: 0 = the chooser's, 1 = LSU copy loop, 2 = TMA bulk copies
  int32_t commTail;  // fused: 0 = auto (see launchAgGemm), < 0 = none, > 0 = that many tiles for the comm CTAs
  // Operand layout (gemm_layouts_plan.hpp), C = op(A) op(B) with C [m, n] row-major:
  //   kABt: shard [rows, k], B [n, k] (the fields above); kAB: shard [rows, k], B [k, n] (the dgrad's weight);
  //   kAtB: shard [k, rows] (rows % 8 == 0 on every rank), B [k, n]; the gathered buffer then holds the shards one
  //   after another in rank order as stored (rank r's [k, rows_r] block at element offset agRowOffset(m, r) * k).
  GemmLayout layout;
  // The fused plan takes kABt and kAB (its core loads the weight [k, n] MN-major); kAtB runs the decomposed plan.
  // 1: the GEMM runs on the layouts core (gemm_layouts.hpp: swap-AB small-M path, deterministic split-K) after the
  // whole gather (the decomposed plan at nranks > 1; plan must be 0 or 2). The decomposed and local plans of kAB and
  // kAtB always do (the forward core's own GEMM multiplies in kABt only).
  int32_t layoutsCore;
  // The layouts core's split-K scratch (GemmLayoutParams::workspace: zeroed once, left zeroed by every launch; this
  // rank's stream only). Null: no K splits.
  void* splitK;
  size_t splitKBytes;
  // FP8 operands (gemm_fp8.hpp; dtype is then unused): layout kABt, k % 16 == 0, the decomposed plan (plan 0 or 2, not
  // layoutsCore); for nranks > 1 every rank's gathered buffer holds agGemmFp8Layout(...).bytes and every flag array
  // agGemmFp8FlagWords(...) words. c is [m, n] of fp8.out. At one rank, block scaling needs rows % 4 == 0 and a
  // 16-byte aligned aScale (the core reads it in place, gemm_fp8.hpp's ldsa).
  Fp8Operands fp8;
};

// Enqueues the op on `stream` (the current device must own stream and every local pointer). Throws
// std::runtime_error with the reason on bad arguments or a CUDA failure. Every rank must call it with the same
// m, n, k, nranks, epoch and tuning fields (plan, commSms, commMode, commTail, groupM). Returns the plan enqueued.
// The fused kernel launches one CTA per SM and its CTAs wait on each other and on the peers' kernels: nothing else may
// hold SMs of this GPU for the duration (no concurrent persistent kernels; under MPS the whole GPU must be provisioned).
// A process that drives several GPUs from one thread must not let a lazily loaded kernel block it between the ranks'
// launches: launchAgGemm loads its own kernels on its first call per device; set CUDA_MODULE_LOADING=EAGER for others.
// On a failed wait (abort word set, or no progress within timeoutNs) the kernels unwind without trapping, C is
// garbage and errorSlot says which flag and which role.
AgGemmPlanChoice launchAgGemm(const AgGemmParams& params, cudaStream_t stream);

// Whether launchAgGemm's decomposed and local plans run the GEMM on the layouts core for these params.
constexpr bool agGemmOnLayoutsCore(const AgGemmParams& p) {
  return p.fp8.enabled == 0 && (p.layout != GemmLayout::kABt || p.layoutsCore != 0);
}

// Whether the fused plan takes these params: its producer loads the gathered A [m, k] K-major, and B either way
// (kABt's [n, k], kAB's [k, n] MN-major). kAtB's shards are [k, rows]: the decomposed plan.
constexpr bool agGemmFusedTakes(const AgGemmParams& p) {
  return p.fp8.enabled == 0 && p.layout != GemmLayout::kAtB && p.layoutsCore == 0;
}

// What launchAgGemm would run for these params (resolving plan 0 and commSms 0), without launching.
AgGemmPlanChoice resolveAgGemmPlan(const AgGemmParams& params);

}  // namespace tandem::kernels
