// The op table: everything tandem knows about an op apart from its implementations. Each entry names the op, its
// dims, its tensor slots and their extents as functions of the dims, which dims are per rank, its dtype rules and
// what it sends between nodes. Descriptor naming, validation (validate.hpp), `tandemctl run`, the reference's
// dispatch and every "this backend does not run X" message are derived from it. Backends say which ops they run
// as an OpSet; the daemon refuses the rest when a descriptor is admitted.
#pragma once

#include <bitset>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "tandem/common/descriptor.hpp"

namespace tandem {

// A set of op kinds (a backend's or an executor's capabilities).
class OpSet {
 public:
  OpSet() = default;
  OpSet(std::initializer_list<OpKind> kinds) {
    for (OpKind k : kinds) add(k);
  }
  static OpSet all();  // every kind in the op table
  OpSet& add(OpKind k) {
    bits_.set(static_cast<std::size_t>(k));
    return *this;
  }
  bool contains(OpKind k) const {
    const auto i = static_cast<std::size_t>(k);
    return i < kOpKindCount && bits_.test(i);
  }
  bool operator==(const OpSet&) const = default;

 private:
  std::bitset<kOpKindCount> bits_;
};

// "the cuda backend (executor client) does not run moe-dispatch-gemm; it runs ag-gemm, ...; the cpu backend runs
// every op (daemon.backend: cpu)". Lists exactly the ops `runs` has and names the fix.
std::string unsupportedOpMessage(std::string_view backend, const OpSet& runs, OpKind kind);

}  // namespace tandem
