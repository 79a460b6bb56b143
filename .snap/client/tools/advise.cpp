// tandemctl advise / tune (advise.hpp): the command line and the order of the steps. The parts: the shapes to
// measure (advise_layers), the measurements (advise_measure), the four questions answered (advise_answers), the table,
// plot and text (advise_print), and the winners saved into the plan table (advise_plans).
#include "advise.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <vector>

#include "advise_answers.hpp"
#include "advise_layers.hpp"
#include "advise_measure.hpp"
#include "advise_plans.hpp"
#include "advise_print.hpp"
#include "ctl.hpp"

namespace tandem::ctl {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using advise::Options;

Options gAdvise, gTune;
CLI::App* gAdviseCmd = nullptr;
CLI::App* gTuneCmd = nullptr;

int runAdvise(const std::string& socket, const Options& o, bool tune) {
  std::vector<advise::Layer> layers = advise::layersOf(o);
  for (auto& l : layers) l.misfit = advise::misfitOf(l, o.ranks);
  if (o.iters == 0) throw UsageError("--iters must be at least 1");
  const auto t0 = Clock::now();
  json report = advise::measureAll(socket, o, layers, !o.json || tune);
  report["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  report["ranks"] = o.ranks;
  const auto entries = advise::winners(report, tune ? "tune" : "advise");
  if (tune || o.save) {
    advise::saveWinners(socket, entries);
    report["saved"] = entries.size();
  }
  if (tune) {
    if (o.json) {
      std::cout << report.dump(2) << std::endl;
    } else {
      advise::printTable(report);
      std::printf("tune: %zu plan%s saved into tandemd's plan table in %.1f s (tandemctl status shows it)\n",
                  entries.size(), entries.size() == 1 ? "" : "s", report["seconds"].get<double>());
    }
    return 0;
  }
  report["answers"] = advise::answers(report, o.ranks);
  const std::string svgPath = o.svg.empty() ? std::string("tandem-advise.svg") : o.svg;
  {
    std::ofstream out(svgPath);
    out << advise::svgPlot(report);
    if (!out) throw std::runtime_error(fmt::format("writing the plot to {} failed; pass --svg PATH", svgPath));
  }
  report["svg"] = svgPath;
  if (!o.jsonFile.empty()) {
    std::ofstream out(o.jsonFile);
    out << report.dump(2) << "\n";
    if (!out) throw std::runtime_error(fmt::format("writing the report to {} failed; pass another --json-file", o.jsonFile));
  }
  if (o.json) {
    std::cout << report.dump(2) << std::endl;
    return 0;
  }
  advise::printAdvice(report);
  return 0;
}

void addOptions(CLI::App* cmd, Options& o, bool tune) {
  cmd->add_option("ops", o.ops, "ag-gemm, gemm-rs, gemm-ar (comma-separated or repeated; default all three)");
  cmd->add_option("--shape", o.shapes, "MxNxK, global sizes as `tandemctl run` takes them (repeatable)");
  cmd->add_option("--from-json", o.fromJson,
                  "a model's layers: [{\"name\": ..., \"op\": \"gemm-rs\", \"m\": ..., \"n\": ..., \"k\": ..., "
                  "\"dtype\": \"bf16\"}, ...] (or {\"layers\": [...]})");
  cmd->add_option("--dtype", o.dtype, "bf16 | fp16 | fp32 (for --shape)");
  cmd->add_option("-r,--ranks", o.ranks, "ranks of the measuring communicator, one process and GPU each")
      ->check(CLI::Range(1, 8));
  cmd->add_option("--sms", o.sms, "communication SM counts of the fused sweep (default 8 16 32)");
  cmd->add_option("--iters", o.iters, "timed ops per plan")->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", o.warmup, "untimed ops per plan first")->check(CLI::Range(0, 1000));
  cmd->add_option("--timeout-ms", o.timeoutMs, "per-op and rendezvous timeout");
  cmd->add_flag("--json", o.json, "print the measurements (and the answers) as JSON");
  if (!tune) {
    cmd->add_flag("--save", o.save, "write the winners into tandemd's plan table");
    cmd->add_option("--svg", o.svg, "where to write the plot (default tandem-advise.svg)");
    cmd->add_option("--json-file", o.jsonFile, "also write the JSON report (--json's) to this file");
  }
}

}  // namespace

void addPlanCommands(CLI::App& app) {
  gAdviseCmd = app.add_subcommand(
      "advise",
      "measure, on this node, how your shapes run: unfused, decomposed, fused at several SM splits, the GEMM alone\n"
      "(the overlap limit) and the link bandwidth; answers whether they overlap, what bottlenecks, whether SMs for\n"
      "communication help and whether your layers fit the fused ops; a table, an SVG plot, --json, --save. E.g.\n"
      "  tandemctl advise gemm-rs --shape 8192x8192x8192 --shape 16384x8192x14336\n"
      "  tandemctl advise --from-json layers.json --ranks 2 --save");
  addOptions(gAdviseCmd, gAdvise, false);
  gTuneCmd = app.add_subcommand("tune", "measure every plan of the given shapes and save the fastest into tandemd's "
                                        "plan table (advise without the advice)");
  addOptions(gTuneCmd, gTune, true);
}

std::optional<int> runPlanCommands(const std::string& socket) {
  const bool adviseGiven = gAdviseCmd != nullptr && gAdviseCmd->parsed();
  const bool tuneGiven = gTuneCmd != nullptr && gTuneCmd->parsed();
  if (!adviseGiven && !tuneGiven) return std::nullopt;
  const char* name = adviseGiven ? "advise" : "tune";
  try {
    return runAdvise(socket, adviseGiven ? gAdvise : gTune, tuneGiven);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tandemctl %s: %s\nRun with --help for more information.\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandemctl %s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace tandem::ctl
