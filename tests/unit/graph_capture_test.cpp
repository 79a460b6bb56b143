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

const std::vector<OpKind> kReplayable{OpKind::kAllGather,       OpKind::kAgGemm,          OpKind::kGemmRs,
                                      OpKind::kGemmAr,          OpKind::kRingAttention,   OpKind::kMoeDispatchGemm,
                                      OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward, OpKind::kNop};

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

TEST_CASE("capture: the client executor replays allgather, the fused GEMMs, ring attention, the MoE ops and barriers "
          "at every rank count") {
  for (OpKind kind : kReplayable) {
    CHECK(tandem::graphReplayableOps().contains(kind));
    for (uint32_t n : {1u, 2u, 4u, 8u}) {
      const OpDescriptor d = descriptorOf(kind, 0, n);
      INFO(tandem::opKindName(kind), " at ", n, " ranks");
      CHECK(tandem::captureRefusal("client", d).empty());
    }
  }
}

TEST_CASE("capture: the ops without a device-epoch path are refused at 2+ ranks, naming why") {
  const std::vector<OpKind> refused = refusedOps();
  // Ring attention's backward: each launch needs every rank's seq from tandemd's per-op step (OpSpec::replayPending).
  CHECK(refused == std::vector<OpKind>{OpKind::kRingAttentionBackward});
  for (OpKind kind : refused) {
    CHECK_FALSE(tandem::graphReplayableOps().contains(kind));
    CHECK(tandem::captureRefusal("client", descriptorOf(kind, 0, 1)).empty());  // one rank: nothing to meet
    const std::string why = tandem::captureRefusal("client", descriptorOf(kind, 1, 2));
    INFO(why);
    CHECK(why.find(std::string(tandem::opKindName(kind))) == 0);
    CHECK(why.find("CUDA graph") != std::string::npos);
    CHECK(why.find("cannot replay") != std::string::npos);
    CHECK(why.find("outside the graph") != std::string::npos);
    const std::string_view pending = tandem::opSpec(kind).cudaPending;
    const std::string_view replayPending = tandem::opSpec(kind).replayPending;
    if (!replayPending.empty()) {
      CHECK(why.find(std::string(replayPending)) != std::string::npos);  // the op's own reason
    } else if (pending.empty()) {
      CHECK(why.find("no device-epoch path") != std::string::npos);
    } else {
      CHECK(why.find("no GPU implementation") != std::string::npos);
      CHECK(why.find(std::string(pending)) != std::string::npos);
    }
    // The stale reasons of ops that replay now are gone.
    CHECK(why.find("stream memory operations") == std::string::npos);
    CHECK(why.find("completion") == std::string::npos);
  }
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
