// tandemctl advise / tune: the report in words: the table, the SVG plot and advise's full text.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tandem::ctl::advise {

// One row per layer: unfused, the GEMM alone, decomposed, the best fused split and the winner, then its failures.
void printTable(const nlohmann::json& report);
// Time against communication SMs, one panel per layer: the fused sweep (line), the GEMM alone (dashed, the overlap
// limit), the unfused baseline (dotted) and the decomposed plan (a square at x = 0).
std::string svgPlot(const nlohmann::json& report);
// advise's answer: a heading, the table, the link, the four questions' answers and where the plot went. Reads
// "ranks", "seconds", "answers", "svg" and "saved" (present when the winners were saved) from the report.
void printAdvice(const nlohmann::json& report);

}  // namespace tandem::ctl::advise
