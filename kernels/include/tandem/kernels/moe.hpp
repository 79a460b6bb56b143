// MoE expert layer on the GPU: routing metadata, dispatch, grouped GEMMs (tandem/kernels/grouped_gemm.hpp) and the
// combine, for one rank of a communicator whose ranks share memory (one node). Semantics are tandem.h's:
// tandem_moe_dispatch_gemm and tandem_moe_dispatch_ffn_combine, with the cpu backend's exact row order (per expert:
// source rank, then token, then slot).
//
// How one op runs on rank r (every step stream-ordered; nothing goes through the host):
//   route     count this rank's (token, slot) pairs per expert and give each pair its place among its expert's pairs
//             of this rank (token order), with a warp per expert; check the ids (range, distinct per token).
//   plan      publish the counts (and this rank's row capacity and verdict on its ids) into every rank's control area,
//             release a flag; wait for every rank's; then every rank derives the same decision from the same table:
//             the op runs, or fails naming the rank whose ids are bad or the rows a rank needs past its capacity. On
//             success: this rank's group offsets and expert_counts, and its write offset in every expert's rows.
//   dispatch  a warp per (token, slot) copies the token's row into the expert owner's receive rows (peer memory) and
//             writes its row info; the last CTA releases a flag on every rank.
//   arrive    wait for every source's flag, then copy the row info out (dispatch+GEMM).
//   GEMMs     dispatch+GEMM: one grouped GEMM into out. FFN: gemm1 with the SwiGLU epilogue into h, gemm2 into y, in
//             the owner's receive area.
//   combine   (FFN) release a flag that y is written, wait for every rank's, then a warp per token pulls its slots'
//             rows of y from the owners and sums weight * y in fp32 in slot order (bitwise repeatable); a last
//             barrier keeps every rank's y until every rank has read it.
// The FFN's backward (MoeParams::backward) routes and plans alike, dispatches x and dout rows (and the row's weight),
// recomputes gate|up = x·w1ᵀ on the owner (or reads it from the forward's saved rows, MoeParams::saved), dout·w2, then
// one kernel per row gives d(gate|up), weight * h and
// dtopk_weight = <dout·w2, h>; the owner computes dw2 and dw1 of its experts with the grouped wgrad GEMM and
// dx = d(gate|up)·w1 into its y rows, and the combine pulls dx (summed in slot order) and dtopk_weights back.
// Errors found on the GPU (bad ids, capacity) go into the rank's error slot with WaitError::kMoeRouting /
// kMoeCapacity; every rank finds the same one and writes nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>

#include "tandem/kernels/gemm.hpp"     // GemmDtype
#include "tandem/kernels/signals.hpp"  // ErrorSlot

namespace tandem::kernels {

inline constexpr uint32_t kMoeMaxRanks = 8;              // kMaxLocalRanks
inline constexpr int32_t kMoeMaxExperts = 1024;          // global experts (the control area's table width)
inline constexpr uint64_t kMoeControlBytes = 64u << 10;  // one rank's control area (MoeControl fits with room)

/// Every rank's MoE control area and receive area, as mapped in the launching process, plus this rank's scratch.
struct MoeComm {
  uint32_t rank = 0, nranks = 1;
  std::array<void*, kMoeMaxRanks> control{};  ///< kMoeControlBytes each, zeroed once, never written by other ops
  std::array<void*, kMoeMaxRanks> recv{};     ///< each rank's receive area (256-byte aligned), laid out by moeRecvBytes
  void* scratch = nullptr;                    ///< this rank's private scratch (256-byte aligned)
  uint64_t scratchBytes = 0;                  ///< at least moeScratchBytes(tokens, topk, experts)
  uint64_t recvBytes = 0;                     ///< bytes of this rank's receive area
  const uint64_t* abortWord = nullptr;        ///< optional: non-zero ends every wait
  ErrorSlot* errorSlot = nullptr;             ///< optional: the first failed wait is reported here
  OpFault* fault = nullptr;                   ///< optional: this op's data error (bad id, capacity) is reported here
  uint64_t* faultsDropped = nullptr;          ///< replayed op: `fault` keeps the first error until the host takes it,
                                              ///< and later ones while it is full only count here
  const uint64_t* epochWord = nullptr;        ///< device-epoch mode (op_entry.hpp): the flags' epoch is *epochWord
  const uint64_t* verdictSlot = nullptr;      ///< optional (client executor): this epoch's verdict entry; the op
                                              ///< does nothing when it reads verdictRejected there
  uint64_t verdictRejected = 0;
  uint64_t timeoutNs = 0;  ///< per wait; 0 = none
  uint64_t epoch = 1;      ///< this op's number on the communicator (>= 1, rising per op)
};

/// One MoE op on one rank. Zero-initialise and fill.
struct MoeParams {
  GemmDtype dtype = GemmDtype::kBf16;
  bool ffn = false;    ///< false: dispatch + grouped GEMM; true: dispatch + SwiGLU FFN + combine
  bool backward = false;  ///< with ffn: the FFN's backward (tandem_moe_dispatch_ffn_combine_backward)
  int64_t tokens = 0;  ///< this rank's
  int64_t hidden = 0, nOut = 0, ffnDim = 0, experts = 0, topk = 0;
  int64_t capacity = 0;     ///< dispatch+GEMM: rows of out (this rank's)
  const void* x = nullptr;  ///< [tokens, hidden]
  const int32_t* topkIds = nullptr;
  const float* topkWeights = nullptr;
  const void* w = nullptr;          ///< dispatch+GEMM: [E/n, nOut, hidden]
  const void* w1 = nullptr;         ///< FFN: [E/n, 2 ffn, hidden]
  const void* w2 = nullptr;         ///< FFN: [E/n, hidden, ffn]
  void* out = nullptr;              ///< dispatch+GEMM: [capacity, nOut]; FFN: [tokens, hidden]
  int32_t* rowInfo = nullptr;       ///< dispatch+GEMM: [capacity, 4]
  int32_t* expertCounts = nullptr;  ///< dispatch+GEMM: [E/n]
  const void* dout = nullptr;       ///< backward: [tokens, hidden], the gradient of the forward's out
  void* dx = nullptr;               ///< backward: [tokens, hidden]
  float* dtopkWeights = nullptr;    ///< backward: [tokens, topk] fp32
  void* dw1 = nullptr;              ///< backward: [E/n, 2 ffn, hidden]
  void* dw2 = nullptr;              ///< backward: [E/n, hidden, ffn]
  /// FFN and its backward: this rank's saved gate|up [savedRows, 2 ffn] (tandem.h). The forward writes the received
  /// rows' rounded gate|up there (gemm1 stores it, a separate pass gives h), the backward reads a and b from it instead
  /// of recomputing them. Null (savedRows 0): the forward fuses SwiGLU into gemm1, the backward recomputes gate|up.
  void* saved = nullptr;
  int64_t savedRows = 0;            ///< rows of saved: the plan fails the op when more rows arrive
  int gemmSms = 0;                  ///< cap on the grouped GEMMs' grid (0: every SM)
  int gemmSkipIdleHalves = 0;       ///< GroupedGemmParams::skipIdleHalves for the grouped GEMMs
  bool gemmDynamicTiles = false;    ///< the grouped GEMMs' dynamic tile order (GroupedGemmParams::tileCounter)
  /// FP8 weights (tandem.h, w_dtype; the FFN forward or dispatch+GEMM): the weights are e4m3 with 128 x 128 block
  /// scales, x (bf16) is quantised to e4m3 per 1 x 128 block at its source and dispatched so, and the experts run the
  /// FP8 grouped GEMM (grouped_gemm_fp8.hpp): the FFN's gemm1 with the SwiGLU epilogue quantising h and gemm2 to bf16
  /// y; dispatch+GEMM's one GEMM to bf16 out. dtype must be bf16.
  bool fp8 = false;
  const float* w1Scale = nullptr;  ///< FFN fp8: [E/n, 2 ffn / 128, ceil(hidden / 128)] fp32
  const float* w2Scale = nullptr;  ///< FFN fp8: [E/n, ceil(hidden / 128), ffn / 128] fp32
  const float* wScale = nullptr;   ///< dispatch+GEMM fp8: [E/n, ceil(nOut / 128), ceil(hidden / 128)] fp32
};

/// Bytes of a receive area holding `rows` rows (x rows, row info; with ffn > 0 also h and y; the backward's also dout,
/// the row's weight and dtopk_weight, gate|up and dout·w2: 4 hidden + 8 ffn + 24 bytes a row). `fp8` (a forward op
/// with FP8 weights): x and h in e4m3 with their 1 x 128 scales, y in bf16: about 3 hidden + ffn + (hidden + ffn) / 32
/// + 16 bytes a row for the FFN, hidden + hidden / 32 + 16 for dispatch+GEMM (ffn 0).
uint64_t moeRecvBytes(int64_t rows, int64_t hidden, int64_t ffn, bool backward = false, bool fp8 = false);
/// The most rows a receive area of `bytes` holds.
int64_t moeRecvRows(uint64_t bytes, int64_t hidden, int64_t ffn, bool backward = false, bool fp8 = false);
/// Bytes of a rank's private scratch for `tokens` x `topk` pairs and `experts` experts.
uint64_t moeScratchBytes(int64_t tokens, int64_t topk, int64_t experts);

/// Checks the shape rules the kernels need (dtype, multiples of 8, alignment, experts, sizes), without the GPU.
/// @throws tandem::Error (kInvalidArgument) naming the rule and the remedy.
void validateMoe(const MoeParams& params, const MoeComm& comm);

/// Enqueues the whole op on `stream`. Returns the plan it ran ("route 4 CTAs, dispatch ..."), for the log.
/// @throws tandem::Error (kInvalidArgument: validateMoe; kCuda: a launch failed).
std::string launchMoe(const MoeParams& params, const MoeComm& comm, cudaStream_t stream);

/// Loads the MoE kernels and the grouped GEMM's on `device` (preload.hpp says why). @throws tandem::Error (kCuda).
void preloadMoeKernels(int device);

}  // namespace tandem::kernels
