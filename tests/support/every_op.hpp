// The "every op" tests take their list of ops from the op table. Each layer's test says what it runs an op with; an op
// of the table it has nothing for fails the test, naming the layer and the op, so a new op cannot miss a layer
// silently.
#pragma once

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/common/op_spec.hpp"

namespace tandem::testing {

/// `tandemctl run` argument lists, one per op of the table, in table order: the op's name, then args[name].
inline std::vector<std::vector<std::string>> everyOp(const std::map<std::string, std::vector<std::string>>& args,
                                                     std::string_view layer) {
  std::vector<std::vector<std::string>> out;
  for (const OpSpec& op : ops()) {
    const auto it = args.find(std::string(op.name));
    if (it == args.end()) {
      FAIL_CHECK(layer << " has no arguments for " << op.name << ": add them there, so the op runs at this layer");
      continue;
    }
    std::vector<std::string> a{std::string(op.name)};
    a.insert(a.end(), it->second.begin(), it->second.end());
    out.push_back(std::move(a));
  }
  for (const auto& [name, unused] : args) {
    CHECK_MESSAGE(findOp(name) != nullptr, layer << " lists " << name << ", which is no op of the table");
  }
  return out;
}

}  // namespace tandem::testing
