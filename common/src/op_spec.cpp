#include "tandem/common/op_spec.hpp"

#include <fmt/format.h>

namespace tandem {

OpSet OpSet::all() {
  OpSet s;
  for (uint16_t k = 1; k < kOpKindCount; ++k) s.add(static_cast<OpKind>(k));
  return s;
}

std::string unsupportedOpMessage(std::string_view backend, const OpSet& runs, OpKind kind) {
  std::string list;
  for (uint16_t k = 1; k < kOpKindCount; ++k) {
    if (!runs.contains(static_cast<OpKind>(k))) continue;
    const auto name = static_cast<OpKind>(k) == OpKind::kNop ? std::string_view("barrier") : opKindName(static_cast<OpKind>(k));
    list += fmt::format("{}{}", list.empty() ? "" : ", ", name);
  }
  return fmt::format("{}: the {} backend does not run this op (it runs {}); run it on the cpu backend "
                     "(daemon.backend: cpu), which runs every op",
                     opKindName(kind), backend, list.empty() ? std::string("none") : list);
}

}  // namespace tandem
