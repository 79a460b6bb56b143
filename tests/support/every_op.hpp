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

/// Every op at six ranks with odd shapes, for the cross-node tests (three nodes, each transport): one argument list
/// serves them all, so the transports are checked on the same work.
inline std::vector<std::vector<std::string>> everyOpAcrossNodes(std::string_view layer) {
  return everyOp(
      {
          {"ag-gemm", {"--ranks", "6", "--m", "37", "--n", "19", "--k", "24"}},
          {"gemm-rs", {"--ranks", "6", "--m", "37", "--n", "19", "--k", "48"}},
          {"gemm-ar", {"--ranks", "6", "--m", "29", "--n", "16", "--k", "48", "--dtype", "fp16"}},
          {"allgather", {"--ranks", "6", "--bytes", "1001"}},
          {"barrier", {"--ranks", "6"}},
          {"moe-dispatch-gemm",
           {"--ranks", "6", "--m", "5", "--k", "16", "--n", "12", "--experts", "12", "--topk", "2"}},
          {"moe-dispatch-ffn-combine",
           {"--ranks", "6", "--m", "4", "--k", "16", "--n", "24", "--experts", "6", "--topk", "2"}},
          {"moe-ffn-backward",
           {"--ranks", "6", "--m", "3", "--k", "16", "--n", "8", "--experts", "12", "--topk", "3"}},
          {"ring-attention", {"--ranks", "6", "--seq", "29", "--heads", "2", "--head-dim", "8"}},
          {"ring-attention-backward",
           {"--ranks", "6", "--seq", "29", "--heads", "2", "--head-dim", "8", "--kv-heads", "1", "--zigzag"}},
      },
      layer);
}

/// The GEMM ops across nodes in the other operand layouts (nn: the input gradient, tn: the weight gradient) and with
/// FP8 inputs (each rank's scales; ag-gemm's travel with its shards), with odd shapes: the cross-node path must read
/// each rank's operands as stored and dequantize them with their own scales.
inline std::vector<std::vector<std::string>> gemmVariantsAcrossNodes() {
  return {
      {"ag-gemm", "--ranks", "6", "--m", "37", "--n", "19", "--k", "24", "--layout", "tn"},
      {"ag-gemm", "--ranks", "6", "--m", "37", "--n", "19", "--k", "24", "--layout", "nn", "--dtype", "fp16"},
      {"gemm-rs", "--ranks", "6", "--m", "37", "--n", "19", "--k", "48", "--layout", "nn"},
      {"gemm-ar", "--ranks", "6", "--m", "29", "--n", "16", "--k", "48", "--layout", "tn"},
      {"ag-gemm", "--ranks", "6", "--m", "37", "--n", "19", "--k", "200", "--dtype", "fp8-e4m3", "--scaling", "block"},
      {"ag-gemm", "--ranks", "6", "--m", "37", "--n", "19", "--k", "24", "--dtype", "fp8-e5m2", "--layout", "tn"},
      {"gemm-rs", "--ranks", "6", "--m", "37", "--n", "19", "--k", "1560", "--dtype", "fp8-e4m3", "--scaling", "block",
       "--out-dtype", "fp32"},
      {"gemm-ar", "--ranks", "6", "--m", "29", "--n", "16", "--k", "48", "--dtype", "fp8-e5m2", "--layout", "nn"},
  };
}

}  // namespace tandem::testing
