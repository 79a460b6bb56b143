#include "inputs.hpp"

#include <array>
#include <cstring>
#include <vector>

#include "tandem/common/numeric.hpp"
#include "tandem/common/reference.hpp"

namespace tandem::ctl {

void fillHostSlot(const OpDescriptor& desc, int s, std::byte* p, uint64_t seed) {
  const OpSpec& op = opSpec(desc.kind);
  const SlotSpec& sl = op.slots[static_cast<std::size_t>(s)];
  const uint64_t bytes = desc.bufs[static_cast<std::size_t>(s)].bytes;
  if (p == nullptr || bytes == 0) return;
  if (sl.output) {
    std::memset(p, 0xFF, bytes);
    return;
  }
  if (!hashFilled(op, s)) {
    std::array<std::byte*, kMaxOpBuffers> only{};
    only[static_cast<std::size_t>(s)] = p;
    reference::fillInputs(desc, only, seed);
    return;
  }
  const uint64_t key = slotKey(seed, desc.rank, static_cast<uint32_t>(s));
  if (sl.type == ElementType::kRaw) {
    for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(byteAt(key, i));
    return;
  }
  // The slot's own dtype: the MoE ops' weights may be e4m3 while the op's dtype is bf16.
  const DType t = slotDtype(sl, desc);
  const std::size_t es = dtypeSize(t);
  const uint64_t count = bytes / es;
  std::vector<float> chunk(1 << 14);
  for (uint64_t first = 0; first < count; first += chunk.size()) {
    const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(chunk.size(), count - first));
    for (std::size_t i = 0; i < n; ++i) chunk[i] = uniformAt(key, first + i);
    storeElements(p + first * es, t, n, chunk.data());
  }
}

void fillHost(const OpDescriptor& desc, std::span<std::byte* const> slots, uint64_t seed) {
  const OpSpec& op = opSpec(desc.kind);
  for (int s = 0; s < op.slotCount && static_cast<std::size_t>(s) < slots.size(); ++s) {
    fillHostSlot(desc, s, slots[static_cast<std::size_t>(s)], seed);
  }
}

}  // namespace tandem::ctl
