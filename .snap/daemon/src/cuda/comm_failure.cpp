#include "cuda/comm_failure.hpp"

#include "tandem/common/descriptor.hpp"

namespace tandem::daemon::cuda {
namespace k = tandem::kernels;

namespace {

bool is(const k::ErrorSlot& e, k::WaitError w) { return e.code == static_cast<uint32_t>(w); }

// Lower explains more: a divergence, then a timeout, then anything else (an abort).
int precedence(const k::ErrorSlot& e) {
  if (is(e, k::WaitError::kDiverged)) return 0;
  if (is(e, k::WaitError::kTimeout)) return 1;
  return 2;
}

}  // namespace

uint64_t firstFailedEpoch(const k::ErrorSlot& e) {
  if (is(e, k::WaitError::kDiverged)) return 0;
  return static_cast<OpKind>(e.op) == OpKind::kAllGather ? e.expected >> 32 : e.expected;
}

std::optional<RankFailure> rootFailure(std::span<const std::optional<k::ErrorSlot>> slots) {
  std::optional<RankFailure> best;
  for (uint32_t r = 0; r < slots.size(); ++r) {
    if (!slots[r]) continue;
    const k::ErrorSlot& e = *slots[r];
    if (best) {
      const int pe = precedence(e), pb = precedence(best->slot);
      if (pe > pb || (pe == pb && firstFailedEpoch(e) >= firstFailedEpoch(best->slot))) continue;
    }
    best = RankFailure{r, e};
  }
  return best;
}

}  // namespace tandem::daemon::cuda
