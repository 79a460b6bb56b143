// tandemctl advise / tune: the measurements. Every number comes from tandemd's own ops on this node: each candidate
// plan is a trial plan that only the measuring communicator sees (tandemd's SetPlan for the daemon executor,
// libtandem's own copy for the client executor), so other tenants' ops keep their plans while it runs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "advise_layers.hpp"

namespace tandem::ctl::advise {

// Runs every layer on every rank (ranks r > 0 in forked children, each its own session and GPU) and returns rank 0's
// report: {"gpu", "executor", "layers": [per layer: the built-in rules, decomposed, the fused sweep, the GEMM alone,
// the unfused baseline, "best", "errors"; or "misfit" where the cuda kernels cannot take it], "link"}.
// showProgress: rank 0 prints each measurement to stderr.
nlohmann::json measureAll(const std::string& socket, const Options& o, const std::vector<Layer>& layers,
                          bool showProgress);

}  // namespace tandem::ctl::advise
