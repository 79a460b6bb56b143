// tandemctl advise / tune: the report in words (advise_print.hpp).
#include "advise_print.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "advise_answers.hpp"

namespace tandem::ctl::advise {

using json = nlohmann::json;

void printTable(const json& report) {
  std::printf("%-28s %-22s %11s %11s %11s %11s  %s\n", "layer", "bucket", "unfused", "GEMM alone", "decomposed",
              "best fused", "winner");
  for (const json& l : report["layers"]) {
    if (l.contains("misfit")) {
      std::printf("%-28s does not fit the fused kernels: %s\n", l["name"].get<std::string>().c_str(),
                  l["misfit"].get<std::string>().c_str());
      continue;
    }
    const auto fused = bestFused(l);
    std::string winner = "-";
    if (l.contains("best")) {
      const json& b = l["best"];
      const uint32_t sms = b["comm_sms"].get<uint32_t>();
      winner = b["kind"] != "fused" ? std::string("decomposed")
               : sms == 0           ? std::string("fused, no comm SMs")
                                    : fmt::format("fused, {} comm SMs", sms);
      if (auto base = num(l, "baseline_us")) winner += fmt::format(" ({:.2f}x unfused)", *base / b["us"].get<double>());
    }
    std::printf("%-28s %-22s %11s %11s %11s %11s  %s\n", l["name"].get<std::string>().c_str(),
                l.value("bucket", std::string()).c_str(), us(num(l, "baseline_us")).c_str(),
                us(num(l, "gemm_alone_us")).c_str(), us(num(l, "decomposed_us")).c_str(),
                fused ? fmt::format("{:.1f}@{}", fused->second, fused->first).c_str() : "-", winner.c_str());
    for (const json& e : l.value("errors", json::array())) {
      std::printf("    %s failed: %s\n", e["plan"].get<std::string>().c_str(), e["error"].get<std::string>().c_str());
    }
  }
}

std::string svgPlot(const json& report) {
  const auto& layers = report["layers"];
  const int cols = 3, panelW = 320, panelH = 220;
  const int n = static_cast<int>(layers.size());
  const int rows = std::max(1, (n + cols - 1) / cols);
  std::string s = fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
                              "font-family=\"sans-serif\" font-size=\"11\">\n", cols * panelW, rows * panelH + 30);
  s += fmt::format("<text x=\"10\" y=\"18\" font-size=\"14\">tandemctl advise: time per op (us) against communication "
                   "SMs on {} ({} executor)</text>\n", report.value("gpu", std::string()),
                   report.value("executor", std::string()));
  for (int i = 0; i < n; ++i) {
    const json& l = layers[i];
    const int x0 = (i % cols) * panelW + 50, y0 = (i / cols) * panelH + 40, w = panelW - 70, h = panelH - 60;
    std::vector<std::pair<double, double>> pts;
    for (const json& p : l.value("fused", json::array())) {
      if (p["us"].is_number()) pts.emplace_back(p["comm_sms"].get<double>(), p["us"].get<double>());
    }
    std::vector<double> ys;
    for (auto& [x, y] : pts) ys.push_back(y);
    for (const char* key : {"gemm_alone_us", "baseline_us", "decomposed_us"}) {
      if (auto v = num(l, key)) ys.push_back(*v);
    }
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0, y0 - 6, l["name"].get<std::string>());
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>\n", x0, y0, w, h);
    if (ys.empty()) {
      s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0 + 10, y0 + h / 2, l.contains("misfit") ? "does not fit" : "no data");
      continue;
    }
    double xmax = 32;
    for (auto& [x, y] : pts) xmax = std::max(xmax, x);
    const double ymin = 0, ymax = *std::max_element(ys.begin(), ys.end()) * 1.1;
    const auto X = [&](double x) { return x0 + x / xmax * w; };
    const auto Y = [&](double y) { return y0 + h - (y - ymin) / (ymax - ymin) * h; };
    for (int t = 0; t <= 4; ++t) {
      const double v = ymax * t / 4;
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0f}</text>\n", x0 - 4, Y(v) + 4, v);
      const double xs = xmax * t / 4;
      s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", X(xs), y0 + h + 14, xs);
    }
    const auto hline = [&](std::optional<double> v, const char* dash, const char* color, const char* label) {
      if (!v) return;
      s += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-dasharray=\"{}\"/>\n",
                       x0, x0 + w, Y(*v), Y(*v), color, dash);
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"{}\" text-anchor=\"end\">{}</text>\n", x0 + w - 2, Y(*v) - 3,
                       color, label);
    };
    hline(num(l, "gemm_alone_us"), "6,3", "#2a7", "GEMM alone");
    hline(num(l, "baseline_us"), "2,3", "#c33", "unfused");
    if (auto d = num(l, "decomposed_us")) {
      s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"6\" height=\"6\" fill=\"#e90\"><title>decomposed {:.1f} "
                       "us</title></rect>\n", X(0) - 3, Y(*d) - 3, *d);
    }
    if (!pts.empty()) {
      std::string poly;
      for (auto& [x, y] : pts) poly += fmt::format("{:.1f},{:.1f} ", X(x), Y(y));
      s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"#36c\" stroke-width=\"2\"/>\n", poly);
      for (auto& [x, y] : pts) {
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#36c\"><title>fused, {:.0f} comm SMs: "
                         "{:.1f} us</title></circle>\n", X(x), Y(y), x, y);
      }
    }
  }
  s += "</svg>\n";
  return s;
}

void printAdvice(const json& report) {
  const auto ranks = report["ranks"].get<uint32_t>();
  const std::size_t layers = report["layers"].size();
  std::printf("tandemctl advise: %s, executor %s, %u rank%s, %zu layer%s measured in %.1f s (times in us per op)\n\n",
              report["gpu"].get<std::string>().c_str(), report["executor"].get<std::string>().c_str(), ranks,
              ranks == 1 ? "" : "s", layers, layers == 1 ? "" : "s", report["seconds"].get<double>());
  printTable(report);
  const json& link = report["link"];
  if (link.contains("gb_per_s")) {
    std::printf("\nlink: an all-gather of %.0f MiB per rank took %.1f us: %.1f GB/s received per rank\n",
                link["bytes_per_rank"].get<double>() / (1 << 20), link["us"].get<double>(),
                link["gb_per_s"].get<double>());
  }
  const json& a = report["answers"];
  const auto section = [&](const char* question, const char* key) {
    std::printf("\n%s\n", question);
    for (const auto& line : a[key]) std::printf("  - %s\n", line.get<std::string>().c_str());
  };
  section("Can my shapes overlap at tile granularity?", "overlap");
  section("Do NVLink and the network both bottleneck?", "bottleneck");
  section("Does giving SMs to communication shorten the pipeline?", "comm_sms");
  section("Do my model's patterns match the fused ops?", "patterns");
  const std::size_t saved = report.value("saved", std::size_t{0});
  std::printf("\nplot: %s (time against communication SMs)%s\n", report["svg"].get<std::string>().c_str(),
              report.contains("saved")
                  ? fmt::format("; {} winner{} saved into the plan table", saved, saved == 1 ? "" : "s").c_str()
                  : "; --save writes the winners into the plan table");
}

}  // namespace tandem::ctl::advise
