// tandemctl advise / tune: the shapes to measure (advise_layers.hpp).
#include "advise_layers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "ctl.hpp"
#include "tandem/common/plan_key.hpp"

namespace tandem::ctl::advise {
namespace {

using json = nlohmann::json;

std::optional<DType> dtypeNamed(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kF16;
  if (s == "fp32") return DType::kF32;
  return std::nullopt;
}

std::string shapeText(const Layer& l) { return fmt::format("{}x{}x{}", l.m, l.n, l.k); }

uint64_t parseDim(const std::string& text, const std::string& what) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v == 0) {
    throw UsageError(fmt::format("{}: '{}' is not a positive number", what, text));
  }
  return v;
}

}  // namespace

std::string misfitOf(const Layer& l, uint32_t ranks) {
  if (l.dtype != DType::kBF16 && l.dtype != DType::kF16) return "the GPU kernels take bf16 or fp16 only";
  if (l.n % 8 != 0) return fmt::format("n = {} is not a multiple of 8 (pad n)", l.n);
  if (l.op == OpKind::kAgGemm) {
    if (l.k % 8 != 0) return fmt::format("k = {} is not a multiple of 8 (pad k)", l.k);
    if (l.m < ranks) return fmt::format("m = {} has fewer rows than ranks", l.m);
  } else if (l.k % (8 * ranks) != 0) {
    return fmt::format("K = {} does not split into {} slices that are multiples of 8 (pad K to a multiple of {})", l.k,
                       ranks, 8 * ranks);
  }
  return {};
}

std::vector<Layer> layersOf(const Options& o) {
  std::vector<Layer> layers;
  const auto opOf = [](const std::string& name) {
    const OpSpec* spec = findOp(name);
    if (spec == nullptr || !plannedOp(spec->kind)) {
      throw UsageError(fmt::format("'{}' is not an op with plans; give ag-gemm, gemm-rs or gemm-ar", name));
    }
    return spec->kind;
  };
  const auto dt = dtypeNamed(o.dtype);
  if (!dt) throw UsageError(fmt::format("--dtype '{}' is not bf16, fp16 or fp32", o.dtype));
  if (!o.fromJson.empty()) {
    std::ifstream in(o.fromJson);
    if (!in) throw UsageError(fmt::format("--from-json: cannot read {}", o.fromJson));
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw UsageError(fmt::format("--from-json {}: not JSON ({})", o.fromJson, e.what()));
    }
    const json& list = j.is_object() && j.contains("layers") ? j["layers"] : j;
    if (!list.is_array() || list.empty()) {
      throw UsageError(fmt::format("--from-json {}: expected a list of layers, or {{\"layers\": [...]}}, each like "
                                   "{{\"name\": \"mlp.down\", \"op\": \"gemm-rs\", \"m\": 8192, \"n\": 8192, \"k\": 28672}}",
                                   o.fromJson));
    }
    std::size_t i = 0;
    for (const json& e : list) {
      const std::string where = fmt::format("--from-json {}: layer {}", o.fromJson, i++);
      if (!e.is_object() || !e.contains("op") || !e["op"].is_string()) throw UsageError(where + ": \"op\" is missing");
      Layer l;
      l.op = opOf(e["op"].get<std::string>());
      for (const char* key : {"m", "n", "k"}) {
        if (!e.contains(key) || !e[key].is_number_unsigned() || e[key].get<uint64_t>() == 0) {
          throw UsageError(fmt::format("{}: \"{}\" is missing or not a positive integer", where, key));
        }
      }
      l.m = e["m"].get<uint64_t>();
      l.n = e["n"].get<uint64_t>();
      l.k = e["k"].get<uint64_t>();
      const auto ldt = dtypeNamed(e.value("dtype", o.dtype));
      if (!ldt) throw UsageError(where + ": dtype is not bf16, fp16 or fp32");
      l.dtype = *ldt;
      l.name = e.value("name", fmt::format("{} {}", opKindName(l.op), shapeText(l)));
      layers.push_back(l);
    }
    return layers;
  }
  if (o.shapes.empty()) {
    throw UsageError("give the shapes to measure: --shape MxNxK (repeatable, e.g. --shape 8192x8192x8192) or "
                     "--from-json layers.json");
  }
  std::vector<OpKind> ops;
  for (const auto& item : o.ops) {
    std::size_t pos = 0;
    while (pos <= item.size()) {
      const std::size_t comma = std::min(item.find(',', pos), item.size());
      ops.push_back(opOf(item.substr(pos, comma - pos)));
      pos = comma + 1;
    }
  }
  if (ops.empty()) ops = {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr};
  for (OpKind op : ops) {
    for (const auto& s : o.shapes) {
      const auto x1 = s.find('x'), x2 = s.find('x', x1 == std::string::npos ? x1 : x1 + 1);
      if (x1 == std::string::npos || x2 == std::string::npos) {
        throw UsageError(fmt::format("--shape '{}' is not MxNxK (e.g. 8192x8192x8192)", s));
      }
      Layer l;
      l.op = op;
      l.m = parseDim(s.substr(0, x1), "--shape M");
      l.n = parseDim(s.substr(x1 + 1, x2 - x1 - 1), "--shape N");
      l.k = parseDim(s.substr(x2 + 1), "--shape K");
      l.dtype = *dt;
      l.name = fmt::format("{} {}", opKindName(op), shapeText(l));
      layers.push_back(l);
    }
  }
  return layers;
}

}  // namespace tandem::ctl::advise
