// Which rank's failed wait explains a failed communicator, and which ops it fails (daemon/src/cuda/comm_failure.hpp):
// every rank's op and the communicator must report the divergence or the stopped rank, not the aborts they caused,
// whichever order tandemd reads the ranks' error slots in.
#include <doctest/doctest.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cuda/comm_failure.hpp"
#include "tandem/common/descriptor.hpp"

using namespace tandem;
using namespace tandem::daemon::cuda;
namespace k = tandem::kernels;

namespace {

k::ErrorSlot failedWait(k::WaitError code, OpKind op, uint32_t rank, uint64_t expected, uint64_t observed = 0) {
  k::ErrorSlot e{};
  e.claimed = k::kErrorSlotReady;
  e.code = static_cast<uint32_t>(code);
  e.op = static_cast<uint32_t>(op);
  e.rank = rank;
  e.expected = expected;
  e.observed = observed;
  return e;
}

using Slots = std::vector<std::optional<k::ErrorSlot>>;

}  // namespace

TEST_CASE("comm failure: no slot written, no failure") {
  CHECK_FALSE(rootFailure(Slots(4)).has_value());
  CHECK_FALSE(rootFailure(Slots{}).has_value());
}

TEST_CASE("comm failure: a divergence explains the aborts it caused, whichever rank is read first") {
  // Rank 1's op entry found rank 0 on another graph (the fingerprints differ) and aborted; rank 0's later wait saw
  // the abort. Rank 0 comes first in the slots, as tandemd reads them.
  const auto diverged = failedWait(k::WaitError::kDiverged, OpKind::kAllGather, 1, 0x9e3779b97f4a7c15ull, 0x1234ull);
  const auto aborted = failedWait(k::WaitError::kAborted, OpKind::kGemmRs, 0, 7, k::kAbortValue);
  for (const Slots& slots : {Slots{aborted, diverged}, Slots{std::nullopt, diverged}, Slots{aborted, diverged, aborted}}) {
    const auto f = rootFailure(slots);
    REQUIRE(f.has_value());
    CHECK(f->rank == 1);
    CHECK(f->slot.code == static_cast<uint32_t>(k::WaitError::kDiverged));
  }
}

TEST_CASE("comm failure: a divergence fails every op not yet completed, whether it names epochs or fingerprints") {
  // The fingerprint branch of the op entry reports fingerprints (large values) where the epoch branch reports epochs:
  // neither may let a later op of either rank complete as a success.
  CHECK(firstFailedEpoch(failedWait(k::WaitError::kDiverged, OpKind::kAllGather, 0, 0x9e3779b97f4a7c15ull, 3)) == 0);
  CHECK(firstFailedEpoch(failedWait(k::WaitError::kDiverged, OpKind::kGemmAr, 0, 12, 14)) == 0);
}

TEST_CASE("comm failure: a wait names its op's epoch (AllGather's in the flag's high half)") {
  CHECK(firstFailedEpoch(failedWait(k::WaitError::kTimeout, OpKind::kGemmRs, 0, 42)) == 42);
  CHECK(firstFailedEpoch(failedWait(k::WaitError::kAborted, OpKind::kAllGather, 0, (uint64_t{9} << 32) | 5)) == 9);
}

TEST_CASE("comm failure: a timeout explains aborts; among one kind the earliest epoch, then the lowest rank") {
  const auto abortedEarly = failedWait(k::WaitError::kAborted, OpKind::kGemmRs, 0, 3);
  const auto timedOutLate = failedWait(k::WaitError::kTimeout, OpKind::kGemmRs, 1, 5);
  const auto timedOutEarly = failedWait(k::WaitError::kTimeout, OpKind::kGemmRs, 2, 4);
  Slots slots{abortedEarly, timedOutLate, timedOutEarly, timedOutEarly};
  std::vector<uint32_t> order{0, 1, 2, 3};
  // Every order of reading gives the same slot: the earlier timeout, at the lower of the two ranks that hold it.
  do {
    Slots permuted(slots.size());
    uint32_t firstEarly = ~0u;  // the lowest rank (position) holding the earlier timeout
    for (uint32_t i = 0; i < order.size(); ++i) {
      permuted[i] = slots[order[i]];
      if (order[i] >= 2 && firstEarly == ~0u) firstEarly = i;
    }
    const auto f = rootFailure(permuted);
    REQUIRE(f.has_value());
    CHECK(f->slot.code == static_cast<uint32_t>(k::WaitError::kTimeout));
    CHECK(f->slot.expected == 4);
    CHECK(f->rank == firstEarly);
  } while (std::next_permutation(order.begin(), order.end()));
}
