// tandemctl advise --save / tune: the measured winners as tandemd's plan table entries, and saving them there.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tandem/v1/control.pb.h"

namespace tandem::ctl::advise {

// The winners of a report (advise_measure.hpp) as plan table entries, on this node's GPU model and executor: one per
// plan key (op, dtype, ranks, bucket), the layer measured fastest for it winning. `source`: "advise" or "tune".
std::vector<v1::PlanEntry> winners(const nlohmann::json& report, const std::string& source);
// Writes the entries into tandemd's plan table and has it saved to its file (SetPlan with save). None: nothing sent.
void saveWinners(const std::string& socket, const std::vector<v1::PlanEntry>& entries);

}  // namespace tandem::ctl::advise
