// Attention core, host side that needs no CUDA compiler: the shape rules (validateAttention), the configuration name,
// and the tandem::Error throwers attention.cu calls (fmt, which error.hpp uses, does not compile under nvcc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "tandem/common/error.hpp"
#include "tandem/kernels/attention.hpp"

namespace tandem::kernels {
namespace attn_detail {

// Called from attention.cu.
[[noreturn]] void failCuda(const std::string& what) { throw Error(ErrorCode::kCuda, "attention: " + what); }
[[noreturn]] void failUnsupported(const std::string& what) {
  throw Error(ErrorCode::kUnsupported, "attention: " + what);
}

// Resolved tuning (defaults filled in); attention.cu uses the same function so that name and launch agree.
struct Resolved {
  int blockN;
  bool pingPong;
  int headGroup;
  bool snake;
  bool dynamic;
};
// Defaults measured on an H200 (bench/RESULTS.md, "Attention core"): 176-key blocks beat 128 by 2-5% without causal
// masking at head_dim 128 (seq 4K-32K); ping-pong beats free-running consumers by 10-20% everywhere.
// Causal tile order by default. Measured on an H200 (bench/RESULTS.md, "Ring attention", 16 heads, head_dim 128, vs
// cuDNN in the same call): every head in one group in snake rounds 1.169 / 1.040 / 0.963 / 0.916 at 4K / 8K / 16K /
// 32K (round robin, the order before: 0.955 / 0.929 / 0.808 / 0.824); the dynamic order in groups of 2 heads 0.967 /
// 1.047 / 0.972 / 0.954. So: dynamic with 2-head groups once a head's K and V reach 8 MB (16K keys at head_dim 128:
// 16 heads of them outgrow L2), where the caller gave a tile counter; snake rounds over every head otherwise.
constexpr int64_t kDynamicFromKvBytesPerHead = 8ll << 20;

// The consumer warps' loop control is lane0 (loop bounds from the KV walk in shared memory read by lane 0 and
// broadcast: ptxas sees a warp-uniform loop), the only one built. Measured on an H200 (2026-12-02, commit bb837e7: 16
// heads, head_dim 128, bf16, the two alternating twice on the same inputs, one device call): lane0 / table 1.028 /
// 1.009 / 1.033 / 0.995 non-causal and 1.054 / 1.067 / 1.027 / 1.049 causal at 4K / 8K / 16K / 32K; the one loss is
// inside the spread of lane0's own two rounds there (586.6 and 605.1 TFLOP/s). Neither table nor hoist (lane0 with
// the wgmma descriptors built once per kernel; per-KV-block loop 812 SASS instructions instead of 860 at bf16 hd128
// bn176) is built: hoist / lane0 measured 0.947-0.994 at 6 of 8 shapes and 1.006 / 1.010 at the other two, inside the
// noise (bench/RESULTS.md), so a second kernel set would cost compile time and code for nothing.

Resolved resolveAttention(const AttentionParams& p) {
  const int blockN = p.blockN != 0 ? p.blockN : (p.headDim == 128 && !p.causal ? 176 : 128);
  int group = p.headGroup <= 0 || p.headGroup > p.heads ? p.heads : p.headGroup;
  bool snake = p.tileOrder == 2, dynamic = p.tileOrder == 3;
  if (p.tileOrder == 0 && p.causal) {
    int64_t keys = 0;
    for (int i = 0; i < p.numKv && i < kMaxAttentionKvSegments; ++i) keys += p.kv[i].length;
    if (p.tileCounter != nullptr && keys * p.headDim * 4 >= kDynamicFromKvBytesPerHead) {
      dynamic = true;
      if (p.headGroup <= 0) group = std::min(2, p.heads);
    } else {
      snake = true;
    }
  }
  return {blockN, p.pingPong != 2, group, snake, dynamic};
}

}  // namespace attn_detail

namespace {

template <typename... Args>
[[noreturn]] void rule(std::string_view name, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("attention: rule {}: {}", name, fmt::format(format, std::forward<Args>(args)...)));
}

constexpr int64_t kMaxRows = 0x7fffffff;          // TMA coordinates and the kernel's row indices are int32
constexpr int64_t kMaxPosition = int64_t{1} << 62;  // global positions plus lengths must not overflow int64

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct Range {
  uintptr_t lo, hi;  // [lo, hi)
};
bool overlaps(Range a, Range b) { return a.lo < b.hi && b.lo < a.hi; }

}  // namespace

void validateAttention(const AttentionParams& p) {
  if (p.dtype != AttentionDtype::kBf16 && p.dtype != AttentionDtype::kFp16) {
    rule("dtype", "dtype must be AttentionDtype::kBf16 or kFp16, got {}", static_cast<int>(p.dtype));
  }
  if (p.headDim != 64 && p.headDim != 128) {
    rule("head_dim", "headDim must be 64 or 128, got {}; pad the head dimension to one of them", p.headDim);
  }
  if (p.heads < 1 || p.heads > (1 << 20)) rule("heads", "heads must be in [1, 2^20], got {}", p.heads);
  if (p.kvHeads < 0 || (p.kvHeads > 0 && p.heads % p.kvHeads != 0)) {
    rule("kv_heads", "kvHeads must divide heads = {} (grouped-query attention) or be 0 (= heads), got {}", p.heads,
         p.kvHeads);
  }
  if (p.sq < 0 || p.sq > kMaxRows) rule("sq", "sq must be in [0, 2^31 - 1], got {}; split the queries", p.sq);
  if (p.qStart < -kMaxPosition || p.qStart > kMaxPosition) {
    rule("q_start", "qStart must be within +-2^62, got {}", p.qStart);
  }
  if (p.qSplit < 0 || p.qSplit > p.sq) rule("q_split", "qSplit must be in [0, sq = {}], got {}", p.sq, p.qSplit);
  if (p.qSplit > 0 && p.qSplit < p.sq && (p.qStart2 > kMaxPosition || p.qStart2 < p.qStart + p.qSplit)) {
    rule("q_split", "the second run of queries must lie after the first: qStart2 = {} < qStart + qSplit = {}",
         p.qStart2, p.qStart + p.qSplit);
  }
  if (p.numKv < 0 || p.numKv > kMaxAttentionKvSegments) {
    rule("num_kv", "numKv must be in [0, {}], got {}; merge segments or launch per group of segments",
         kMaxAttentionKvSegments, p.numKv);
  }
  if (!std::isfinite(p.scale) || p.scale < 0.0f) {
    rule("scale", "scale must be finite and >= 0 (0 means 1/sqrt(headDim)), got {}", p.scale);
  }
  if (p.blockN != 0 && p.blockN != 128 && p.blockN != 176) {
    rule("block_n", "blockN must be 0 (default), 128 or 176, got {}", p.blockN);
  }
  if (p.blockN == 176 && (p.headDim != 128 || p.causal)) {
    rule("block_n", "blockN 176 exists for headDim 128 without causal masking only; leave blockN at 0");
  }
  if (p.numSms < 0) rule("num_sms", "numSms must be >= 0 (0: every SM), got {}", p.numSms);
  if (p.rotateFrom < 0 || p.rotateFrom > kMaxAttentionKvSegments) {
    rule("rotate_from", "rotateFrom must be in [0, {}], got {}", kMaxAttentionKvSegments, p.rotateFrom);
  }
  if (p.headGroup < 0) rule("head_group", "headGroup must be >= 0 (0: chosen per shape), got {}", p.headGroup);
  if (p.tileOrder < 0 || p.tileOrder > 3) {
    rule("tile_order", "tileOrder must be 0 (default), 1 (round robin), 2 (snake) or 3 (dynamic), got {}",
         p.tileOrder);
  }
  if (p.tileOrder == 3 && (p.tileCounter == nullptr || reinterpret_cast<uintptr_t>(p.tileCounter) % 4 != 0)) {
    rule("tile_counter", "tileOrder 3 (dynamic) needs tileCounter: a 4-byte aligned device word for this launch");
  }
  if (p.pingPong < 0 || p.pingPong > 2) {
    rule("ping_pong", "pingPong must be 0 (default), 1 (on) or 2 (off), got {}", p.pingPong);
  }

  const uint64_t rowBytes = static_cast<uint64_t>(p.heads) * static_cast<uint64_t>(p.headDim) * 2;
  const uint64_t kvRowBytes =
      static_cast<uint64_t>(p.kvHeads > 0 ? p.kvHeads : p.heads) * static_cast<uint64_t>(p.headDim) * 2;
  const auto span = [&](const void* base, int64_t rows) {
    const auto lo = reinterpret_cast<uintptr_t>(base);
    return Range{lo, lo + static_cast<uintptr_t>(rows) * rowBytes};
  };
  const auto kvSpan = [&](const void* base, int64_t rows) {
    const auto lo = reinterpret_cast<uintptr_t>(base);
    return Range{lo, lo + static_cast<uintptr_t>(rows) * kvRowBytes};
  };
  if (p.sq > 0) {
    if (p.q == nullptr || p.out == nullptr) rule("pointers", "q and out must be non-null when sq > 0");
    if (!aligned16(p.q) || !aligned16(p.out)) rule("alignment", "q and out must be 16-byte aligned (TMA)");
    if (p.lse != nullptr && reinterpret_cast<uintptr_t>(p.lse) % 4 != 0) {
      rule("alignment", "lse must be 4-byte aligned");
    }
    if (overlaps(span(p.out, p.sq), span(p.q, p.sq))) rule("aliasing", "out must not overlap q");
    if (p.lse != nullptr) {
      const auto lo = reinterpret_cast<uintptr_t>(p.lse);
      const Range lse{lo, lo + static_cast<uintptr_t>(p.sq) * static_cast<uintptr_t>(p.heads) * 4};
      if (overlaps(lse, span(p.out, p.sq))) rule("aliasing", "lse must not overlap out");
    }
  }
  for (int i = 0; i < p.numKv && i < kMaxAttentionKvSegments; ++i) {
    const AttentionKvSegment& s = p.kv[i];
    if (s.length < 0 || s.length > kMaxRows) {
      rule("kv_length", "kv[{}].length must be in [0, 2^31 - 1], got {}; split the segment", i, s.length);
    }
    if (s.start < -kMaxPosition || s.start > kMaxPosition) {
      rule("kv_start", "kv[{}].start must be within +-2^62, got {}", i, s.start);
    }
    if (s.arrival != nullptr && s.arrivalRows != 0 && s.arrivalRows < s.length) {
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("attention: kv[{}].arrivalRows = {}: one arrival flag per block of rows is not "
                              "implemented; pass arrivalRows = 0 (one flag for the whole segment)",
                              i, s.arrivalRows));
    }
    if ((s.lengthWord == nullptr) != (s.lengthReady == nullptr)) {
      rule("kv_length_word", "kv[{}].lengthWord and .lengthReady go together (both null, or both set)", i);
    }
    if (s.split < 0 || s.split > s.length) {
      rule("kv_split", "kv[{}].split must be in [0, length = {}], got {}", i, s.length, s.split);
    }
    if (s.start2 < -kMaxPosition || s.start2 > kMaxPosition) {
      rule("kv_start", "kv[{}].start2 must be within +-2^62, got {}", i, s.start2);
    }
    if (s.length == 0) continue;
    if (s.k == nullptr || s.v == nullptr) rule("pointers", "kv[{}].k and .v must be non-null when length > 0", i);
    if (!aligned16(s.k) || !aligned16(s.v)) rule("alignment", "kv[{}].k and .v must be 16-byte aligned (TMA)", i);
    if (p.sq > 0 && (overlaps(span(p.out, p.sq), kvSpan(s.k, s.length)) ||
                     overlaps(span(p.out, p.sq), kvSpan(s.v, s.length)))) {
      rule("aliasing", "out must not overlap kv[{}].k or .v", i);
    }
  }
}

const char* attentionConfigName(const AttentionParams& p) {
  const attn_detail::Resolved r = attn_detail::resolveAttention(p);
  thread_local std::string name;
  // Ends in the loop control, lane0 (the only one built), as it did when there were several.
  name = fmt::format("{}/hd{}/bn{}/{}/{}{}/lane0", p.dtype == AttentionDtype::kBf16 ? "bf16" : "fp16", p.headDim,
                     r.blockN, p.causal ? fmt::format("causal/g{}", r.headGroup) : "full",
                     r.pingPong ? "pingpong" : "free", r.snake ? "/snake" : r.dynamic ? "/dynamic" : "");
  return name.c_str();
}

}  // namespace tandem::kernels
