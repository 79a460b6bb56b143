// tandemctl advise: the four questions answered from the measurements (advise_answers.hpp).
#include "advise_answers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace tandem::ctl::advise {

using json = nlohmann::json;

std::optional<double> num(const json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_number()) return std::nullopt;
  return j[key].get<double>();
}

std::string us(std::optional<double> v) { return v ? fmt::format("{:.1f}", *v) : std::string("-"); }

std::optional<std::pair<uint32_t, double>> bestFused(const json& layer) {
  std::optional<std::pair<uint32_t, double>> best;
  for (const json& f : layer["fused"]) {
    if (f["us"].is_number() && (!best || f["us"].get<double>() < best->second)) {
      best = std::make_pair(f["comm_sms"].get<uint32_t>(), f["us"].get<double>());
    }
  }
  return best;
}

json answers(const json& report, uint32_t ranks) {
  std::vector<std::string> overlap, bottleneck, sms, patterns;
  const json& link = report["link"];
  int fit = 0, total = 0, fusedWins = 0;
  for (const json& l : report["layers"]) {
    ++total;
    const std::string name = l["name"].get<std::string>();
    if (l.contains("misfit")) {
      patterns.push_back(fmt::format("{}: does not fit the fused kernels: {}.", name, l["misfit"].get<std::string>()));
      continue;
    }
    ++fit;
    const auto alone = num(l, "gemm_alone_us"), base = num(l, "baseline_us");
    const json best = l.contains("best") ? l["best"] : json();
    std::optional<double> bestUs;
    if (best.is_object()) bestUs = best["us"].get<double>();
    const uint64_t tiles = ((l["m"].get<uint64_t>() + 127) / 128) * ((l["n"].get<uint64_t>() + 255) / 256);
    const auto fastest = bestFused(l);
    if (ranks == 1) {
      overlap.push_back(fmt::format("{}: one rank has nothing to overlap; the op is the GEMM ({} us){}.", name,
                                    us(alone), fastest && alone
                                                   ? fmt::format(", the fused kernel forced on it {:.2f}x of that",
                                                                 fastest->second / *alone)
                                                   : std::string()));
    } else if (alone && base && bestUs) {
      const double hidden = *base > *alone ? (*base - *bestUs) / (*base - *alone) : 0.0;
      overlap.push_back(fmt::format(
          "{}: {} output tile{}; the best plan ({}) takes {:.1f} us against {:.1f} us unfused and {:.1f} us for the "
          "GEMM alone, so it hides {:.0f}% of the communication{}.",
          name, tiles, tiles == 1 ? "" : "s", best["kind"].get<std::string>() == "fused"
                           ? fmt::format("fused, {} comm SMs", best["comm_sms"].get<uint32_t>())
                           : std::string("decomposed"),
          *bestUs, *base, *alone, std::clamp(hidden, 0.0, 1.0) * 100,
          tiles < 264 ? " (fewer than two waves of tiles on 132 SMs: little room to overlap at tile granularity)"
                      : ""));
    }
    if (best.is_object() && best["kind"] == "fused") ++fusedWins;
    // SMs for communication: the sweep's fastest split against the one with none (or the smallest).
    std::optional<std::pair<uint32_t, double>> fewest;
    for (const json& p : l["fused"]) {
      if (!p["us"].is_number()) continue;
      const auto cand = std::make_pair(p["comm_sms"].get<uint32_t>(), p["us"].get<double>());
      if (!fewest || cand.first < fewest->first) fewest = cand;
    }
    if (fastest && fewest && fastest->first != fewest->first) {
      sms.push_back(fmt::format("{}: yes, {} comm SMs ran {:.1f} us against {:.1f} us with {} ({:.1f}% shorter).", name,
                                fastest->first, fastest->second, fewest->second, fewest->first,
                                (1 - fastest->second / fewest->second) * 100));
    } else if (fastest) {
      sms.push_back(fmt::format("{}: no, the fewest comm SMs measured ({}) were the fastest ({:.1f} us); more SMs for "
                                "communication only take them from the GEMM.", name, fastest->first, fastest->second));
    }
    // Bottleneck: the bytes this op moves per rank at the measured link bandwidth, against the GEMM alone.
    if (ranks > 1 && link.contains("gb_per_s") && alone) {
      const double m = l["m"].get<double>(), n = l["n"].get<double>(), k = l["k"].get<double>();
      const double bytes = l["op"] == "ag-gemm" ? m * k * 2 * (ranks - 1) / ranks
                                                : m * n * 2 * (ranks - 1) / ranks * (l["op"] == "gemm-ar" ? 2 : 1);
      const double commUs = bytes / (link["gb_per_s"].get<double>() * 1e3);
      bottleneck.push_back(fmt::format("{}: it moves {:.1f} MiB per rank, {:.1f} us at the measured {:.1f} GB/s, against "
                                       "{:.1f} us of GEMM: {}.", name, bytes / (1 << 20), commUs,
                                       link["gb_per_s"].get<double>(), *alone,
                                       commUs > *alone ? "the link is the bottleneck (communication-bound)"
                                                       : "compute-bound; the link keeps up"));
    }
  }
  if (ranks == 1) {
    bottleneck.push_back("One rank: no link is used. Run with --ranks N (one GPU each) to measure NVLink; a node's "
                         "network enters only for communicators across nodes, which tandem stages through host memory.");
  } else {
    bottleneck.push_back("The network: this communicator is on one node, so only NVLink (or PCIe) carries it.");
  }
  if (report.value("gpu", std::string()) == "cpu") {
    sms.insert(sms.begin(), "This tandemd runs the cpu backend, where plans do not change how an op runs: these "
                            "differences are noise. Run advise against a cuda tandemd for the GPUs' answer.");
  }
  patterns.insert(patterns.begin(),
                  fmt::format("{} of {} layers fit the fused ops; the fused plan won for {} of them{}.", fit, total,
                              fusedWins, fit > fusedWins ? " (the others run best decomposed or as the GEMM alone: "
                                                           "with --save the plan table runs them that way)"
                                                         : ""));
  return {{"overlap", overlap}, {"bottleneck", bottleneck}, {"comm_sms", sms}, {"patterns", patterns}};
}

}  // namespace tandem::ctl::advise
