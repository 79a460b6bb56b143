// tandemctl advise and tandemctl tune: measure, on this node and through tandemd's own ops, how the user's shapes run
// unfused, decomposed, fused at several SM splits and as the GEMM alone (the overlap limit), and the link bandwidth;
// advise answers in words, with a table, an SVG plot and --json; tune (and advise --save) writes the winners into
// tandemd's plan table. Also the plan table's part of `tandemctl status`.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tandem/v1/control.pb.h"

namespace tandem::ctl {

// Adds the `advise` and `tune` subcommands to `app` (their options live in advise.cpp).
void addPlanCommands(CLI::App& app);
// After parsing: runs whichever of them was given and returns its exit code; nullopt when neither was.
std::optional<int> runPlanCommands(const std::string& socket);

// The plan table in `tandemctl status` (text) and `status --json` ("plans").
void printPlanStatus(const v1::StatusReply& status);
nlohmann::json planStatusJson(const v1::StatusReply& status);

}  // namespace tandem::ctl
