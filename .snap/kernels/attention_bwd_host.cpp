// Attention backward core, host side that needs no CUDA compiler: the shape rules (validateAttentionBwd), the
// workspace layout and size, and the tandem::Error throwers attention_bwd.cu calls (fmt does not compile under nvcc).
#include <cmath>
#include <cstdint>
#include <string>

#include "tandem/common/error.hpp"
#include "tandem/kernels/attention_bwd.hpp"

namespace tandem::kernels {
namespace attn_bwd_detail {

[[noreturn]] void failCuda(const std::string& what) { throw Error(ErrorCode::kCuda, "attention backward: " + what); }
[[noreturn]] void failUnsupported(const std::string& what) {
  throw Error(ErrorCode::kUnsupported, "attention backward: " + what);
}
[[noreturn]] void failInvalidConfig(const std::string& what) {
  throw Error(ErrorCode::kInvalidConfig, "attention backward: " + what);
}

// Byte offsets into the workspace; attention_bwd.cu uses the same function. Rows per head are padded to 128
// (attn_bwd::kRowPad) so that the kernels read whole blocks of D and lse without bounds checks.
struct WorkspaceLayout {
  size_t rowLse2, rowDot, dqAccum, total;
  int64_t sqPad;
};
constexpr int64_t kRowPad = 128;
constexpr size_t kAlign = 256;
size_t alignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

WorkspaceLayout workspaceLayout(const AttentionBwdParams& p) {
  WorkspaceLayout w{};
  w.sqPad = (p.sq + kRowPad - 1) / kRowPad * kRowPad;
  const size_t rows = static_cast<size_t>(p.heads) * static_cast<size_t>(w.sqPad) * sizeof(float);
  w.rowLse2 = 0;
  w.rowDot = alignUp(rows);
  w.dqAccum = w.rowDot + alignUp(rows);
  w.total = w.dqAccum;
  if (p.dqMode == AttentionBwdDq::kAtomic) {
    w.total += static_cast<size_t>(p.sq) * static_cast<size_t>(p.heads) * static_cast<size_t>(p.headDim) *
               sizeof(float);
  }
  return w;
}

}  // namespace attn_bwd_detail

namespace {

template <typename... Args>
[[noreturn]] void rule(std::string_view name, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("attention backward: rule {}: {}", name, fmt::format(format, std::forward<Args>(args)...)));
}

constexpr int64_t kMaxRows = 0x7fffffff - 128;        // row indices (padded to 128) are int32 in the kernels
constexpr int64_t kMaxPosition = int64_t{1} << 62;  // positions plus lengths must not overflow int64
constexpr int32_t kMaxHeads = 65535;                // grid y

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct Range {
  uintptr_t lo, hi;  // [lo, hi)
};
bool overlaps(Range a, Range b) { return a.lo < b.hi && b.lo < a.hi; }

}  // namespace

size_t attentionBwdWorkspaceBytes(const AttentionBwdParams& params) {
  return attn_bwd_detail::workspaceLayout(params).total;
}

void validateAttentionBwd(const AttentionBwdParams& p) {
  if (p.dtype != AttentionDtype::kBf16 && p.dtype != AttentionDtype::kFp16) {
    rule("dtype", "dtype must be AttentionDtype::kBf16 or kFp16, got {}", static_cast<int>(p.dtype));
  }
  if (p.dqMode != AttentionBwdDq::kDeterministic && p.dqMode != AttentionBwdDq::kAtomic) {
    rule("dq_mode", "dqMode must be AttentionBwdDq::kDeterministic or kAtomic, got {}", static_cast<int>(p.dqMode));
  }
  if (p.core != AttentionBwdCore::kAuto && p.core != AttentionBwdCore::kWgmma && p.core != AttentionBwdCore::kMmaSync) {
    rule("core", "core must be AttentionBwdCore::kAuto, kWgmma or kMmaSync, got {}", static_cast<int>(p.core));
  }
  if (p.headDim != 64 && p.headDim != 128) {
    rule("head_dim", "headDim must be 64 or 128, got {}; pad the head dimension to one of them", p.headDim);
  }
  if (p.heads < 1 || p.heads > kMaxHeads) rule("heads", "heads must be in [1, {}], got {}", kMaxHeads, p.heads);
  const int32_t kvHeads = p.kvHeads == 0 ? p.heads : p.kvHeads;
  if (kvHeads < 1 || kvHeads > p.heads || p.heads % kvHeads != 0) {
    rule("kv_heads", "kvHeads must divide heads = {} (0 means heads), got {}", p.heads, p.kvHeads);
  }
  if (p.sq < 0 || p.sq > kMaxRows) rule("sq", "sq must be in [0, {}], got {}; split the queries", kMaxRows, p.sq);
  if (p.sk < 0 || p.sk > kMaxRows) rule("sk", "sk must be in [0, {}], got {}; split the keys", kMaxRows, p.sk);
  if (p.qStart < -kMaxPosition || p.qStart > kMaxPosition) {
    rule("q_start", "qStart must be within +-2^62, got {}", p.qStart);
  }
  if (p.kStart < -kMaxPosition || p.kStart > kMaxPosition) {
    rule("k_start", "kStart must be within +-2^62, got {}", p.kStart);
  }
  if (!std::isfinite(p.scale) || p.scale < 0.0f) {
    rule("scale", "scale must be finite and >= 0 (0 means 1/sqrt(headDim)), got {}", p.scale);
  }
  if (p.sq == 0 && p.sk == 0) return;

  const uint64_t elem = 2;
  const auto span = [&](const void* base, int64_t rows, int32_t h) {
    const auto lo = reinterpret_cast<uintptr_t>(base);
    return Range{lo, lo + static_cast<uintptr_t>(rows) * static_cast<uintptr_t>(h) *
                              static_cast<uintptr_t>(p.headDim) * elem};
  };
  if (p.sq > 0 && p.dq == nullptr) rule("pointers", "dq must be non-null when sq > 0");
  if (p.sk > 0 && (p.dk == nullptr || p.dv == nullptr)) rule("pointers", "dk and dv must be non-null when sk > 0");
  if (p.sq == 0 || p.sk == 0) return;  // only zeroing: nothing else is read

  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.dout == nullptr || p.lse == nullptr) {
    rule("pointers", "q, k, v, o, dout and lse must be non-null");
  }
  for (const void* t : {p.q, p.k, p.v, p.o, p.dout, static_cast<const void*>(p.dq), static_cast<const void*>(p.dk),
                        static_cast<const void*>(p.dv)}) {
    if (!aligned16(t)) rule("alignment", "q, k, v, o, dout, dq, dk and dv must be 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(p.lse) % 4 != 0) rule("alignment", "lse must be 4-byte aligned");
  const size_t need = attentionBwdWorkspaceBytes(p);
  if (p.workspace == nullptr || p.workspaceBytes < need || !aligned16(p.workspace)) {
    rule("workspace", "workspace must be a 16-byte aligned device buffer of at least {} bytes "
                      "(attentionBwdWorkspaceBytes), got {} bytes at {}",
         need, p.workspaceBytes, p.workspace);
  }
  // Outputs must not overlap any input or each other (the kernels read inputs while other CTAs write outputs).
  const Range ws{reinterpret_cast<uintptr_t>(p.workspace), reinterpret_cast<uintptr_t>(p.workspace) + need};
  const Range lse{reinterpret_cast<uintptr_t>(p.lse),
                  reinterpret_cast<uintptr_t>(p.lse) + static_cast<uintptr_t>(p.sq) * p.heads * 4};
  const Range ins[] = {span(p.q, p.sq, p.heads), span(p.k, p.sk, kvHeads), span(p.v, p.sk, kvHeads),
                       span(p.o, p.sq, p.heads), span(p.dout, p.sq, p.heads), lse, ws};
  const Range outs[] = {span(p.dq, p.sq, p.heads), span(p.dk, p.sk, kvHeads), span(p.dv, p.sk, kvHeads)};
  const char* const outNames[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    for (const Range& r : ins) {
      if (overlaps(outs[i], r)) rule("aliasing", "{} must not overlap an input or the workspace", outNames[i]);
    }
    for (int j = i + 1; j < 3; ++j) {
      if (overlaps(outs[i], outs[j])) rule("aliasing", "{} must not overlap {}", outNames[i], outNames[j]);
    }
  }
}

}  // namespace tandem::kernels
