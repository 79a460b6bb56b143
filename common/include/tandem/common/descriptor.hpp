// Fixed-size, versioned op descriptors and completions: the records that travel through a session's
// submission and completion rings (common/ring.hpp). Plain data shared by client, daemon and kernels.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem {

inline constexpr uint16_t kDescriptorVersion = 2;  // 2: eleven buffer slots (reserved1 gave 72 bytes)
inline constexpr std::size_t kMaxOpBuffers = 11;
inline constexpr std::size_t kMaxOpDims = 8;
inline constexpr uint32_t kMaxRanks = 64;

enum class OpKind : uint16_t {
  kInvalid = 0,
  kAgGemm = 1,
  kGemmRs = 2,
  kGemmAr = 3,
  kMoeDispatchGemm = 4,
  kMoeDispatchFfnCombine = 5,
  kRingAttention = 6,
  kAllGather = 7,
  kNop = 8,  // completes once every rank submitted it; measures the submission path
  kRingAttentionBackward = 9,
  kMoeFfnBackward = 10,
};
inline constexpr uint16_t kOpKindCount = 11;

// Values equal tandem_dtype_t.
// kF8E4M3 and kF8E5M2 (OCP FP8, one byte) are inputs of the GEMM ops (OpSpec::fp8; their C is bf16 or fp32) and, e4m3
// only, the MoE FFN's weights (OpSpec::fp8Weights, kFlagMoeWeightDtype).
enum class DType : uint16_t { kInvalid = 0, kF32 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kF8E4M3 = 5, kF8E5M2 = 6 };
inline constexpr bool isFp8(DType d) { return d == DType::kF8E4M3 || d == DType::kF8E5M2; }

std::string_view opKindName(OpKind kind);  // "ag-gemm", ...; "invalid" for unknown values
std::string_view dtypeName(DType dtype);
std::size_t dtypeSize(DType dtype);        // 0 for invalid

// A reference to bytes in a session-scoped buffer. Never a raw pointer across the trust boundary.
struct BufferRef {
  uint64_t bufferId;  // 0 = absent (only where the op says a tensor is optional)
  uint64_t offset;    // bytes
  uint64_t bytes;     // extent the client claims; the daemon recomputes it from the shape and compares
};
static_assert(sizeof(BufferRef) == 24);

// Dims and buffer slots per kind (everything else must be zero):
//   kAgGemm:       dims {m, n, k}, flags kFlagGemmLayout | kFlagGemmOutDtype | kFlagFp8BlockScale
//                                                     bufs {a, b, c, a_gathered?, a_scale, b_scale}
//   kGemmRs/Ar:    dims {m, n, k_local}, flags as kAgGemm  bufs {a, b, c, a_scale, b_scale}
//                  a_scale and b_scale (fp32) have extent 0 unless dtype is FP8 (kFlagFp8BlockScale says their shape)
//   kMoeDispatchGemm: dims {tokens, hidden, n_out, experts, topk, capacity}
//                                                     bufs {x, topk_ids, topk_weights, w, out, row_info, expert_counts,
//                                                           w_scale}
//                  FP8 weights: flags kFlagMoeWeightDtype, buf w_scale (kMoeWScale)
//   kMoeDispatchFfnCombine: dims {tokens, hidden, ffn, experts, topk, saved_rows}
//                                                     bufs {x, topk_ids, topk_weights, w1, w2, out, saved, w1_scale,
//                                                           w2_scale}
//                  saved [saved_rows, 2, ffn] (dtype) receives this rank's routed rows' gate|up; saved_rows 0: none
//                  FP8 weights: flags kFlagMoeWeightDtype, bufs w1_scale, w2_scale (kFfnW1Scale, kFfnW2Scale)
//   kRingAttention: dims {seq, heads, head_dim, kv_heads}, flags kFlagCausal | kFlagZigzag, scale
//                                                     bufs {q, k, v, out, lse?}
//                  k and v have kv_heads heads (kv_heads divides heads: grouped-query attention; query head h
//                  reads KV head h / (heads / kv_heads))
//   kRingAttentionBackward: dims and flags as kRingAttention
//                                                     bufs {q, k, v, o, dout, lse, dq, dk, dv}
//   kMoeFfnBackward: dims as kMoeDispatchFfnCombine   bufs {x, topk_ids, topk_weights, w1, w2, dout, dx,
//                                                           dtopk_weights, dw1, dw2, saved}
//                  saved: the forward's (an input); saved_rows 0: gate|up is recomputed
//   kAllGather:    dims {bytes}                        bufs {send, recv}
//   kNop:          no dims, no bufs
// Rules (validate.hpp enforces them; the messages name the field):
//   - Every dim is >= 1 except the per-rank row counts, which may be 0 on a rank: tokens and saved_rows (MoE) and
//     seq (attention); ag-gemm's shard rows_of(m, rank, nranks) is 0 when m < nranks. k_local of gemm-rs/ar is >= 1.
//   - Every dim is <= 2^32 and every tensor <= 2^40 bytes, so no byte count can overflow.
//   - A slot whose extent is 0 needs no memory: its bytes must be 0 and any bufferId (0 included) is accepted.
//   - Per-rank dims (may differ between ranks): k_local, tokens, capacity, saved_rows, seq. All other dims are global.
//   - allgather and nop carry no typed data: dtype may be any known value (the client sends kInvalid);
//     allgather offsets need no alignment. Other kinds take kBF16, kF16 or kF32; topk_ids, row_info and
//     expert_counts are int32 and topk_weights fp32 whatever the op's dtype.
//   - flags, scale, reserved0 and reserved1 are 0 unless the kind uses them (scale must then be finite).
namespace dim {
inline constexpr int kM = 0, kN = 1, kK = 2;
inline constexpr int kTokens = 0, kHidden = 1, kNOut = 2, kFfn = 2, kExperts = 3, kTopk = 4, kCapacity = 5;
inline constexpr int kSavedRows = 5;  // the MoE FFN ops' (forward and backward): rows of `saved`
inline constexpr int kSeq = 0, kHeads = 1, kHeadDim = 2, kKvHeads = 3;
inline constexpr int kBytes = 0;
}  // namespace dim
namespace slot {
inline constexpr int kA = 0, kB = 1, kC = 2, kAGathered = 3;
inline constexpr int kX = 0, kTopkIds = 1, kTopkWeights = 2, kW = 3, kW1 = 3, kW2 = 4, kMoeOut = 4, kFfnOut = 5,
                     kRowInfo = 5, kExpertCounts = 6;
inline constexpr int kQ = 0, kKey = 1, kValue = 2, kAttnOut = 3, kAttnLse = 4;
inline constexpr int kDout = 4, kBwdLse = 5, kDq = 6, kDk = 7, kDv = 8;  // ring attention backward
inline constexpr int kMoeDout = 5, kMoeDx = 6, kMoeDtopkWeights = 7, kMoeDw1 = 8, kMoeDw2 = 9;  // MoE FFN backward
inline constexpr int kFfnSaved = 6, kMoeBwdSaved = 10;  // the saved gate|up: the forward's output, the backward's input
inline constexpr int kSend = 0, kRecv = 1;
inline constexpr int kAgAScale = 4, kAgBScale = 5;            // ag-gemm's FP8 scales
inline constexpr int kReduceAScale = 3, kReduceBScale = 4;    // gemm-rs's and gemm-ar's
// moe-dispatch-ffn-combine's FP8 weights' block scales, after its other slots (saved among them).
inline constexpr int kFfnW1Scale = 7, kFfnW2Scale = 8;
inline constexpr int kMoeWScale = 7;  // moe-dispatch-gemm's, after expert_counts
}  // namespace slot

// The slot of a GEMM op's a_scale, or its b_scale when `b`.
inline constexpr int gemmScaleSlot(OpKind kind, bool b) {
  if (kind == OpKind::kAgGemm) return b ? slot::kAgBScale : slot::kAgAScale;
  return b ? slot::kReduceBScale : slot::kReduceAScale;
}

inline constexpr uint16_t kFlagCausal = 1u << 0;
// Ring attention, zigzag layout: the sequence is cut into 2 * nranks chunks and rank r holds chunks r and
// 2 * nranks - 1 - r (its first ceil(seq / 2) rows, then the rest), so causal work is balanced over ranks.
inline constexpr uint16_t kFlagZigzag = 1u << 1;

// ag-gemm, gemm-rs, gemm-ar: how A and B are stored (tandem_gemm_layout_t), in flags bits 2-3. C[m, n] = op(A) op(B)
// is row-major in every layout; the layout changes only how the operands lie in memory:
//   kNT (0): A [m, k], B [n, k] (C = A B^T, the forward: both K-major)
//   kNN (1): A [m, k], B [k, n] (C = A B, the dgrad dX = dY W)
//   kTN (2): A [k, m], B [k, n] (C = A^T B, the wgrad dW = dY^T X)
// ag-gemm gathers along m: rank r's shard is A's rows_of(m, r, n) rows of op(A), stored as the layout says
// ([rows, k], or [k, rows] in kTN), and a_gathered holds the shards one after another in rank order (in kTN, blocks
// [k, rows_r]; in the others that is [m, k]). The value 3 is refused.
enum class GemmOperands : uint8_t { kNT = 0, kNN = 1, kTN = 2 };
inline constexpr int kGemmLayoutShift = 2;
inline constexpr uint16_t kFlagGemmLayout = 0x3u << kGemmLayoutShift;
inline constexpr GemmOperands gemmOperandsOf(uint16_t flags) {
  return static_cast<GemmOperands>((flags & kFlagGemmLayout) >> kGemmLayoutShift);
}
inline constexpr uint16_t gemmLayoutFlags(GemmOperands layout) {
  return static_cast<uint16_t>(static_cast<unsigned>(layout) << kGemmLayoutShift);
}
std::string_view gemmLayoutName(GemmOperands layout);  // "nt", "nn", "tn"; "invalid" otherwise
// The GEMM ops' C dtype (tandem_dtype_t), in flags bits 4-5: 0 = the descriptor's dtype, else kF32, kF16 or kBF16.
// FP8 inputs need kF32 or kBF16 (validate.cpp); other inputs 0 or their own dtype.
inline constexpr int kGemmOutDtypeShift = 4;
inline constexpr uint16_t kFlagGemmOutDtype = 0x3u << kGemmOutDtypeShift;
inline constexpr DType gemmOutDtype(DType dtype, uint16_t flags) {
  const auto v = static_cast<uint16_t>((flags & kFlagGemmOutDtype) >> kGemmOutDtypeShift);
  return v == 0 ? dtype : static_cast<DType>(v);
}
// FP8 scaling (tandem_fp8_scaling_t), flags bit 6, as the FP8 GEMM core (kernels/gemm_fp8.hpp) takes it. The scales
// are fp32 and apply to the logical operands op(A) [rows, k] and op(B) [n, k] in every layout:
//   clear (per tensor): a_scale and b_scale hold one value each; op(A) = a * a_scale, op(B) = b * b_scale.
//   set (block, 128): a_scale is [ceil(k / 128), rows] (M-major: k-block kb's scales of all rows are contiguous),
//     op(A)[i][p] = a[i][p] * a_scale[p / 128][i]; b_scale is [ceil(n / 128), ceil(k / 128)],
//     op(B)[j][p] = b[j][p] * b_scale[j / 128][p / 128]. rows: ag-gemm's shard rows, m for gemm-rs/ar; k: the
//     rank's own k (gemm-rs/ar's slice), so blocks start at the rank's first k.
inline constexpr uint16_t kFlagFp8BlockScale = 1u << 6;
inline constexpr uint64_t kFp8ScaleBlock = 128;
// moe-dispatch-ffn-combine and moe-dispatch-gemm: the dtype of the expert weights (tandem_dtype_t w_dtype), in flags
// bits 7-9: 0 = the descriptor's dtype, or kF8E4M3 (with a bf16 dtype): e4m3 weights with fp32 scales per 128 x 128
// block of each expert, the FFN's w1_scale [E/n, ceil(2 ffn / 128), ceil(hidden / 128)] and w2_scale
// [E/n, ceil(hidden / 128), ceil(ffn / 128)], dispatch+GEMM's w_scale [E/n, ceil(n_out / 128), ceil(hidden / 128)];
// x (and the FFN's h) are then quantised to e4m3 per 1 x 128 block on the way (tandem.h). validate.cpp refuses the
// other values.
inline constexpr int kMoeWeightDtypeShift = 7;
inline constexpr uint16_t kFlagMoeWeightDtype = 0x7u << kMoeWeightDtypeShift;
inline constexpr DType moeWeightDtype(DType dtype, uint16_t flags) {
  const auto v = static_cast<uint16_t>((flags & kFlagMoeWeightDtype) >> kMoeWeightDtypeShift);
  return v == 0 ? dtype : static_cast<DType>(v);
}

inline constexpr bool aTransposed(GemmOperands l) { return l == GemmOperands::kTN; }  // A stored [k, m]
inline constexpr bool bKMajor(GemmOperands l) { return l == GemmOperands::kNT; }      // B stored [n, k]

// One submission. 64-byte aligned and a whole number of cache lines, so ring slots never share a line.
struct alignas(64) OpDescriptor {
  uint16_t version;     // kDescriptorVersion
  OpKind kind;
  DType dtype;
  uint16_t flags;       // kFlag*
  uint32_t rank;        // the submitting rank, checked against the communicator
  uint32_t nranks;      // checked against the communicator
  uint64_t seq;         // per-session, monotonic, starting at 1; names the op in the completion ring
  uint64_t commHandle;  // from JoinCommunicatorReply
  float scale;          // ring attention; 0 = 1/sqrt(head_dim)
  uint32_t reserved0;
  std::array<uint64_t, kMaxOpDims> dims;
  std::array<BufferRef, kMaxOpBuffers> bufs;
  std::array<uint8_t, 16> reserved1;  // named padding: room to grow without changing the ring layout
};
static_assert(sizeof(OpDescriptor) == 384, "OpDescriptor is part of the ring ABI; bump kDescriptorVersion");
static_assert(alignof(OpDescriptor) == 64);

// One completion, written by the daemon. A message longer than one record's `message` continues in the records right
// after it: same seq, status kCompletionContinues, each with its next bytes (messageLen: the bytes in that record).
// The first record's messageLen is then the whole length, at most kMaxCompletionMessage (longer text is cut there).
struct alignas(64) Completion {
  uint64_t seq;         // the OpDescriptor::seq it completes
  int32_t status;       // tandem_status_t, or kCompletionContinues
  uint32_t messageLen;  // bytes of message text (see above; not NUL-terminated)
  char message[176];    // error text; empty on success
};
static_assert(sizeof(Completion) == 192, "Completion is part of the ring ABI");
inline constexpr int32_t kCompletionContinues = -0x7fffffff - 1;
inline constexpr uint32_t kMaxCompletionMessage = 4 * sizeof(Completion::message);

// The balanced row split used by every sharded op: rank r of n owns rowsOf(total, r, n) rows starting
// at rowOffset(total, r, n).
constexpr uint64_t rowsOf(uint64_t total, uint32_t rank, uint32_t nranks) {
  return total / nranks + (rank < total % nranks ? 1 : 0);
}
constexpr uint64_t rowOffset(uint64_t total, uint32_t rank, uint32_t nranks) {
  const uint64_t rem = total % nranks;
  return rank * (total / nranks) + (rank < rem ? rank : rem);
}

// "gemm-rs bf16 m=1536 n=1024 k=512 nn on 2 ranks": an op's kind, dtype, dims and (GEMM ops in NN or TN) layout, the
// key under which the executors log the plan a shape ran once.
std::string planShapeName(const OpDescriptor& d);

}  // namespace tandem
