// tandemctl advise: reading the measurements (advise_measure.hpp's report) and answering, in plain words, the four
// questions: do the shapes overlap at tile granularity, what bottlenecks, do SMs for communication help, do the
// layers fit the fused ops.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

namespace tandem::ctl::advise {

// A number of the report (a layer's "baseline_us", ...); nullopt where it failed or was not measured.
std::optional<double> num(const nlohmann::json& j, const char* key);
// Microseconds as the table prints them: "12.3", or "-" for none.
std::string us(std::optional<double> v);
// The fastest point of a layer's fused sweep: (comm SMs, us); nullopt where none measured.
std::optional<std::pair<uint32_t, double>> bestFused(const nlohmann::json& layer);

// {"overlap", "bottleneck", "comm_sms", "patterns"}: each a list of sentences.
nlohmann::json answers(const nlohmann::json& report, uint32_t ranks);

}  // namespace tandem::ctl::advise
