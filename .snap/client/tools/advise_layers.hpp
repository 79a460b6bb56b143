// tandemctl advise / tune: the command's options and the shapes it measures, from --shape or a model's --from-json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/common/op_spec.hpp"

namespace tandem::ctl::advise {

// The options of `advise` and `tune` (advise.cpp adds them to the command line).
struct Options {
  std::vector<std::string> ops;     // "ag-gemm", "gemm-rs,gemm-ar", ...
  std::vector<std::string> shapes;  // "MxNxK"
  std::string fromJson;
  std::string dtype = "bf16";
  uint32_t ranks = 1;
  std::vector<uint32_t> sms = {8, 16, 32};  // the SM splits of the fused sweep (besides the kernels' own)
  uint32_t iters = 20;  // the median of these (Rank::time)
  uint32_t warmup = 2;
  bool json = false;
  bool save = false;
  std::string svg;
  std::string jsonFile;  // also write the JSON report here
  uint32_t timeoutMs = 120000;
};

// One shape of the user's model to measure.
struct Layer {
  std::string name;  // from --from-json, else "OP MxNxK"
  OpKind op = OpKind::kInvalid;
  uint64_t m = 0, n = 0, k = 0;  // k: the whole K (gemm-rs/ar split it over the ranks)
  DType dtype = DType::kBF16;
  std::string misfit;  // why the cuda kernels cannot take it ("" when they can)
};

// The layers the options name: --from-json's, else every op (default ag-gemm, gemm-rs, gemm-ar) at every --shape.
// Throws UsageError (ctl.hpp) naming the option.
std::vector<Layer> layersOf(const Options& o);

// What keeps the cuda backend's fused kernels from taking the shape, in words ("" when nothing).
std::string misfitOf(const Layer& l, uint32_t ranks);

}  // namespace tandem::ctl::advise
