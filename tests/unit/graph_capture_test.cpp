// The capture policy of the cuda backend's client side (common/graph_capture.hpp): which multi-rank ops a CUDA graph
// may hold under which executor, the refusals' reasons, and the fingerprint that the op entry compares between ranks.
#include "tandem/common/graph_capture.hpp"

#include <doctest/doctest.h>

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

const std::vector<OpKind> kReplayable{OpKind::kAllGather, OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr,
                                      OpKind::kNop};
const std::vector<OpKind> kHostEpochOps{OpKind::kRingAttention, OpKind::kRingAttentionBackward,
                                        OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine};

}  // namespace

TEST_CASE("capture: the client executor replays allgather, the fused GEMMs and barriers at every rank count") {
  for (OpKind kind : kReplayable) {
    CHECK(tandem::graphReplayableOps().contains(kind));
    for (uint32_t n : {1u, 2u, 4u, 8u}) {
      const OpDescriptor d = descriptorOf(kind, 0, n);
      INFO(tandem::opKindName(kind), " at ", n, " ranks");
      CHECK(tandem::captureRefusal("client", d).empty());
    }
  }
}

TEST_CASE("capture: ops whose kernels take the host's epoch are refused at 2+ ranks, naming why") {
  for (OpKind kind : kHostEpochOps) {
    CHECK_FALSE(tandem::graphReplayableOps().contains(kind));
    CHECK(tandem::captureRefusal("client", descriptorOf(kind, 0, 1)).empty());  // one rank: nothing to meet
    const std::string why = tandem::captureRefusal("client", descriptorOf(kind, 1, 2));
    INFO(why);
    CHECK(why.find(std::string(tandem::opKindName(kind))) == 0);
    CHECK(why.find("CUDA graph") != std::string::npos);
    CHECK(why.find("cannot replay") != std::string::npos);
    CHECK(why.find("outside the graph") != std::string::npos);
  }
  CHECK(tandem::captureRefusal("client", descriptorOf(OpKind::kRingAttention, 0, 2)).find("stream memory operations") !=
        std::string::npos);
  CHECK(tandem::captureRefusal("client", descriptorOf(OpKind::kMoeDispatchGemm, 0, 2)).find("completion") !=
        std::string::npos);
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
  for (OpKind kind : {OpKind::kAllGather, OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr, OpKind::kRingAttention,
                      OpKind::kMoeDispatchGemm}) {
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
