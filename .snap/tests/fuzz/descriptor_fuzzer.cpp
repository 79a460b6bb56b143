// libFuzzer target: validateDescriptor on arbitrary bytes must never crash, must reject only with
// Error(kInvalidArgument), and must never accept a descriptor that breaks the invariants the executors rely on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tandem/common/error.hpp"
#include "tandem/common/validate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::OpDescriptor d{};
  std::memcpy(&d, data, std::min(size, sizeof d));
  try {
    const tandem::SlotRules rules = tandem::validateDescriptor(d);
    if (d.version != tandem::kDescriptorVersion) std::abort();
    if (d.nranks == 0 || d.nranks > tandem::kMaxRanks || d.rank >= d.nranks) std::abort();
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      const auto& ref = d.bufs[i];
      const auto& rule = rules[i];
      if (rule.name.empty()) {
        if (ref.bufferId != 0 || ref.offset != 0 || ref.bytes != 0) std::abort();  // unused slots are zero
        continue;
      }
      if (ref.bytes != rule.bytes && !(ref.bufferId == 0 && ref.bytes == 0)) std::abort();
      if (ref.offset + ref.bytes < ref.offset) std::abort();  // no wrap-around
      const std::size_t elem = tandem::dtypeSize(rule.dtype);
      if (elem > 1 && ref.bufferId != 0 && ref.offset % elem != 0) std::abort();
      if (ref.bufferId == 0 && ref.bytes != 0 && !rule.optional) std::abort();
    }
  } catch (const tandem::Error& e) {
    if (e.code() != tandem::ErrorCode::kInvalidArgument) std::abort();
  }
  return 0;
}
