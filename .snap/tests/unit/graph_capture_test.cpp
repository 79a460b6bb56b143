// The capture policy of the cuda backend's client side (common/graph_capture.hpp): which multi-rank ops a CUDA graph
// may hold under which executor, the refusals' reasons, and the fingerprint that the op entry compares between ranks.
#include "tandem/common/graph_capture.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tandem/common/reference.hpp"

namespace {

using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace ref = tandem::reference;

OpDescriptor descriptorOf(OpKind kind, uint32_t rank, uint32_t nranks) {
  ref::OpShape shape;
  shape.kind = kind;
  return ref::makeDescriptor(shape, rank, nranks);
}

const std::vector<OpKind> kReplayable{OpKind::kAllGather,       OpKind::kAgGemm,
                                      OpKind::kGemmRs,          OpKind::kGemmAr,
                                      OpKind::kRingAttention,   OpKind::kRingAttentionBackward,
                                      OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine,
                                      OpKind::kMoeFfnBackward,  OpKind::kNop};

// Every op of the table outside kReplayable: what still refuses capture at 2+ ranks (read from the table, so that an
// op added to it is refused, or listed above, never silently neither).
std::vector<OpKind> refusedOps() {
  std::vector<OpKind> v;
  for (uint16_t i = 1; i < tandem::kOpKindCount; ++i) {
    const auto kind = static_cast<OpKind>(i);
    if (tandem::knownOp(kind) && std::find(kReplayable.begin(), kReplayable.end(), kind) == kReplayable.end()) {
      v.push_back(kind);
    }
  }
  return v;
}

}  // namespace

TEST_CASE("capture: the client executor replays allgather, the fused GEMMs, ring attention and its backward, the MoE "
          "ops and barriers at every rank count") {
  for (OpKind kind : kReplayable) {
    CHECK(tandem::graphReplayableOps().contains(kind));
    for (uint32_t n : {1u, 2u, 4u, 8u}) {
      const OpDescriptor d = descriptorOf(kind, 0, n);
      INFO(tandem::opKindName(kind), " at ", n, " ranks");
      CHECK(tandem::captureRefusal("client", d).empty());
    }
  }
}

TEST_CASE("capture: every op of the table replays in the client executor") {
  // An op added to the table without a device-epoch path must be refused by graphReplayableOps (whyNotReplayable says
  // why) and listed here once it replays; none is today.
  CHECK(refusedOps().empty());
}

TEST_CASE("capture: the daemon and host executors refuse every multi-rank op, naming the executor") {
  for (OpKind kind : kReplayable) {
    CHECK(tandem::captureRefusal("daemon", descriptorOf(kind, 0, 1)).empty());
    const std::string daemon = tandem::captureRefusal("daemon", descriptorOf(kind, 0, 2));
    CHECK(daemon.find("executor daemon") != std::string::npos);
    CHECK(daemon.find("work queue") != std::string::npos);
    const std::string host = tandem::captureRefusal("host", descriptorOf(kind, 0, 4));
    CHECK(host.find("several nodes") != std::string::npos);
  }
}

TEST_CASE("capture: the fingerprint is alike on every rank of one collective and differs between ops") {
  for (OpKind kind : kReplayable) {
    for (uint32_t n : {2u, 3u, 4u}) {
      const uint64_t p0 = tandem::collectiveFingerprint(descriptorOf(kind, 0, n));
      CHECK(p0 != 0);
      for (uint32_t r = 1; r < n; ++r) {
        INFO(tandem::opKindName(kind), " rank ", r, " of ", n);
        CHECK(tandem::collectiveFingerprint(descriptorOf(kind, r, n)) == p0);  // per-rank dims (k slices) left out
      }
    }
  }
  const OpDescriptor base = descriptorOf(OpKind::kGemmAr, 0, 2);
  const uint64_t p = tandem::collectiveFingerprint(base);
  OpDescriptor other = base;
  other.dims[dim::kN] += 8;
  CHECK(tandem::collectiveFingerprint(other) != p);
  other = base;
  other.kind = OpKind::kGemmRs;
  CHECK(tandem::collectiveFingerprint(other) != p);
  other = base;
  other.dtype = tandem::DType::kF16;
  CHECK(tandem::collectiveFingerprint(other) != p);
  other = base;
  other.flags ^= 1u << 2;  // the GEMM layout bits
  CHECK(tandem::collectiveFingerprint(other) != p);
  other = base;
  other.nranks = 4;
  CHECK(tandem::collectiveFingerprint(other) != p);
  OpDescriptor ag = descriptorOf(OpKind::kAllGather, 0, 2);
  const uint64_t a = tandem::collectiveFingerprint(ag);
  ag.dims[dim::kBytes] *= 2;
  CHECK(tandem::collectiveFingerprint(ag) != a);
}

TEST_CASE("capture: every rank's rows mixed into the fingerprint tell apart ranks that assumed other rows") {
  // Ring attention's backward launches with every rank's seq (a capture takes them from the warm-up): ranks that
  // assumed different seqs must not meet at the op entry.
  const OpDescriptor d = descriptorOf(OpKind::kRingAttentionBackward, 0, 3);
  const uint64_t plain = tandem::collectiveFingerprint(d);
  CHECK(tandem::collectiveFingerprint(d, {}) == plain);
  const std::vector<uint64_t> rows{128, 96, 0};
  const uint64_t withRows = tandem::collectiveFingerprint(d, rows);
  CHECK(withRows != plain);
  CHECK(tandem::collectiveFingerprint(descriptorOf(OpKind::kRingAttentionBackward, 2, 3), rows) == withRows);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::vector<uint64_t> other = rows;
    other[r] += 64;
    CHECK(tandem::collectiveFingerprint(d, other) != withRows);
  }
  CHECK(tandem::collectiveFingerprint(d, std::vector<uint64_t>{96, 128, 0}) != withRows);  // order matters
}

TEST_CASE("capture: ring attention's and the MoE ops' fingerprints see what every rank must pass alike") {
  // Ring attention: seq is per rank (left out), the head shape, causal/zigzag flags and the scale are global.
  const OpDescriptor ring = descriptorOf(OpKind::kRingAttention, 0, 2);
  const uint64_t r = tandem::collectiveFingerprint(ring);
  OpDescriptor other = ring;
  other.dims[dim::kSeq] += 64;
  CHECK(tandem::collectiveFingerprint(other) == r);
  other = ring;
  other.dims[dim::kHeads] *= 2;
  CHECK(tandem::collectiveFingerprint(other) != r);
  other = ring;
  other.flags ^= tandem::kFlagZigzag;
  CHECK(tandem::collectiveFingerprint(other) != r);
  other = ring;
  other.scale = 0.5f;
  CHECK(tandem::collectiveFingerprint(other) != r);
  // MoE: tokens are per rank (left out); hidden, experts and topk are global; the two MoE ops differ.
  for (OpKind kind : {OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine}) {
    INFO(tandem::opKindName(kind));
    const OpDescriptor moe = descriptorOf(kind, 0, 2);
    const uint64_t m = tandem::collectiveFingerprint(moe);
    other = moe;
    other.dims[dim::kTokens] += 8;
    CHECK(tandem::collectiveFingerprint(other) == m);
    other = moe;
    other.dims[dim::kExperts] *= 2;
    CHECK(tandem::collectiveFingerprint(other) != m);
    other = moe;
    other.dims[dim::kTopk] += 1;
    CHECK(tandem::collectiveFingerprint(other) != m);
    other = moe;
    other.dims[dim::kHidden] += 8;
    CHECK(tandem::collectiveFingerprint(other) != m);
  }
  CHECK(tandem::collectiveFingerprint(descriptorOf(OpKind::kMoeDispatchGemm, 0, 2)) !=
        tandem::collectiveFingerprint(descriptorOf(OpKind::kMoeDispatchFfnCombine, 0, 2)));
}
