#include "tandem/common/graph_capture.hpp"

#include <cstring>

#include <fmt/format.h>

namespace tandem {

OpSet graphReplayableOps() {
  return OpSet{OpKind::kAllGather,       OpKind::kAgGemm,          OpKind::kGemmRs,
               OpKind::kGemmAr,          OpKind::kRingAttention,   OpKind::kRingAttentionBackward,
               OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward,
               OpKind::kNop};
}

namespace {

// Why an op outside graphReplayableOps cannot replay yet, for the refusal.
std::string whyNotReplayable(OpKind kind) {
  // An op the cuda backend does not run at all (OpSpec::cudaPending) has no kernels to replay; the strategy's check
  // would refuse it anyway, but the capture refusal comes first and should say the real reason.
  if (knownOp(kind) && !opSpec(kind).cudaPending.empty()) {
    return fmt::format("the cuda backend has no GPU implementation of it ({})", opSpec(kind).cudaPending);
  }
  return "its kernels take their epoch from the host (no device-epoch path yet)";
}

}  // namespace

std::string captureRefusal(std::string_view executor, const OpDescriptor& d) {
  if (d.nranks <= 1) return {};
  const std::string_view op = opKindName(d.kind);
  if (executor == "daemon") {
    return fmt::format("{}: the stream is being captured into a CUDA graph, and with executor daemon tandemd runs each "
                       "op of a {}-rank communicator from a work queue it fills on the host once every rank's stream "
                       "reached the op, which a replay would skip; capture on a communicator of a tandemd with "
                       "daemon.executor: client, or enqueue this op outside the graph",
                       op, d.nranks);
  }
  if (executor == "host") {
    return fmt::format("{}: the stream is being captured into a CUDA graph, and this communicator's ranks live on "
                       "several nodes, where tandemd runs each op on the host between the stream's words, which a "
                       "replay would skip; enqueue ops of multi-node communicators outside the graph",
                       op);
  }
  if (graphReplayableOps().contains(d.kind)) return {};
  return fmt::format("{}: the stream is being captured into a CUDA graph, and {} cannot replay on a {}-rank "
                     "communicator yet: {}; enqueue it outside the graph (between replays), or capture it on a "
                     "one-rank communicator",
                     op, op, d.nranks, whyNotReplayable(d.kind));
}

namespace {

// FNV-1a, 64-bit, one value's bytes.
void mixInto(uint64_t& h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ull;
  }
}

}  // namespace

uint64_t collectiveFingerprint(const OpDescriptor& d) {
  // FNV-1a over the fields in a fixed order (not the struct's bytes: padding and per-rank fields differ).
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](uint64_t v) { mixInto(h, v); };
  mix(static_cast<uint64_t>(d.kind));
  mix(d.version);
  mix(static_cast<uint64_t>(d.dtype));
  mix(d.flags);
  mix(d.nranks);
  uint32_t scaleBits = 0;
  std::memcpy(&scaleBits, &d.scale, sizeof scaleBits);
  mix(scaleBits);
  const OpSpec& spec = opSpec(d.kind);
  for (std::size_t i = 0; i < kMaxOpDims; ++i) {
    const bool global = i >= spec.dimCount || !spec.dims[i].perRank();
    mix(global ? d.dims[i] : 0);
  }
  return h == 0 ? 1 : h;
}

uint64_t collectiveFingerprint(const OpDescriptor& d, std::span<const uint64_t> rankRows) {
  uint64_t h = collectiveFingerprint(d);
  for (const uint64_t rows : rankRows) mixInto(h, rows);
  return h == 0 ? 1 : h;
}

}  // namespace tandem
