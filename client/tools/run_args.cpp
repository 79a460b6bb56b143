// `tandemctl run`'s arguments: ids, rank lists, and every check that can be made before a rank process starts,
// derived from the op table (so a new op's dims, options and rules are checked without touching this file).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "ctl.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::ctl {

const std::vector<ShapeOption>& shapeOptions() {
  static const std::vector<ShapeOption> options = {
      {"m", "GEMM rows M (ag-gemm, gemm-rs, gemm-ar); tokens per rank (moe-*)"},
      {"n", "GEMM N; n_out (moe-dispatch-gemm); ffn size (moe-dispatch-ffn-combine)"},
      {"k", "GEMM K (total, split over ranks for gemm-rs/gemm-ar); hidden size (moe-*)"},
      {"experts", "MoE experts in total (a multiple of --ranks)"},
      {"topk", "MoE experts per token (at most --experts)"},
      {"saved-rows", "moe-dispatch-ffn-combine, moe-ffn-backward: rows of the saved gate|up per rank (at least the "
                     "rows routed to the rank, at most --ranks x --m x --topk); 0 (default): none, the backward "
                     "recomputes it"},
      {"seq", "ring attention: total sequence length, split over ranks"},
      {"heads", "ring attention: heads"},
      {"head-dim", "ring attention: head dimension"},
      {"kv-heads", "ring attention: KV heads, dividing --heads (grouped-query attention; default: --heads)"},
      {"bytes", "allgather: bytes per rank"},
  };
  return options;
}

std::string toHex(const tandem_unique_id_t& id) {
  std::string s;
  for (uint8_t b : id.bytes) s += fmt::format("{:02x}", b);
  return s;
}

tandem_unique_id_t fromHex(const std::string& hex) {
  const auto bad = std::find_if_not(hex.begin(), hex.end(), [](unsigned char c) { return std::isxdigit(c) != 0; });
  if (hex.size() != 32 || bad != hex.end()) {
    throw UsageError(fmt::format(
        "--id '{}' is not a communicator id: it must be exactly 32 hex digits ({}); make one with `tandemctl new-id` "
        "and pass the same id to every node's tandemctl run",
        hex, bad != hex.end() ? fmt::format("'{}' is not a hex digit", *bad) : fmt::format("got {}", hex.size())));
  }
  tandem_unique_id_t id{};
  for (int i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return id;
}

std::vector<uint32_t> parseRankList(const std::string& spec, uint32_t nranks) {
  auto fail = [&](const std::string& why) -> void {
    throw UsageError(fmt::format("--local-ranks '{}': {}; write ranks and ranges such as 0,1 or 2-3 or 0,2-3, each "
                                 "below --ranks {}", spec, why, nranks));
  };
  auto trim = [](std::string t) {
    const auto b = t.find_first_not_of(" \t"), e = t.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
  };
  auto number = [&](const std::string& t, const std::string& token) -> uint32_t {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size()) {
      fail(fmt::format("'{}' is not a rank or a range", token));
    }
    if (v >= nranks) fail(fmt::format("rank {} is out of range (the communicator has ranks 0..{})", v, nranks - 1));
    return v;
  };
  if (trim(spec).empty()) fail("the list is empty");
  std::vector<bool> seen(nranks, false);
  std::vector<uint32_t> ranks;
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string token = trim(spec.substr(pos, comma - pos));
    pos = comma + 1;
    if (token.empty()) fail("it has an empty entry (two commas in a row, or one at an end)");
    const std::size_t dash = token.find('-', 1);
    const uint32_t lo = number(trim(token.substr(0, dash)), token);
    const uint32_t hi = dash == std::string::npos ? lo : number(trim(token.substr(dash + 1)), token);
    if (hi < lo) fail(fmt::format("the range {} runs backwards (write {}-{})", token, hi, lo));
    for (uint32_t r = lo; r <= hi; ++r) {
      if (seen[r]) fail(fmt::format("rank {} is listed twice", r));
      seen[r] = true;
      ranks.push_back(r);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

std::string formatRankList(const std::vector<uint32_t>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ',';
    if (j - i >= 2) {
      s += fmt::format("{}-{}", ranks[i], ranks[j]);
    } else {
      for (std::size_t k = i; k <= j; ++k) s += fmt::format("{}{}", k > i ? "," : "", ranks[k]);
    }
    i = j + 1;
  }
  return s;
}

const std::vector<DType>& runDtypes() {
  static const std::vector<DType> dtypes = {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kF8E5M2};
  return dtypes;
}

namespace {

// The DType of runDtypes() named `name`, or kInvalid.
DType runDtype(const std::string& name) {
  for (const DType t : runDtypes()) {
    if (dtypeName(t) == name) return t;
  }
  return DType::kInvalid;
}

}  // namespace

void applyDtypes(RunOptions& o) {
  o.shape.dtype = runDtype(o.dtype);
  // makeDescriptor reads outDtype and blockScale only for FP8 inputs, weightDtype only for ops with FP8 weights.
  o.shape.outDtype = isFp8(o.shape.dtype) ? runDtype(o.outDtype) : DType::kInvalid;
  o.shape.blockScale = isFp8(o.shape.dtype) && o.scaling == "block";
  o.shape.weightDtype = o.wDtype.empty() ? DType::kInvalid : runDtype(o.wDtype);
}

std::string placement(const RunOptions& o) {
  return fmt::format("{} rank{}, {} here ({})", o.ranks, o.ranks == 1 ? "" : "s", o.localRanks.size(),
                     formatRankList(o.localRanks));
}

namespace {

// The options (without --) that apply to `op`: its dims' options, plus --dtype for typed ops and its flags.
std::vector<std::string> optionsOf(const OpSpec& op) {
  std::vector<std::string> out;
  for (int i = 0; i < op.dimCount; ++i) {
    const std::string_view cli = op.dims[static_cast<std::size_t>(i)].cli;
    if (!cli.empty() && std::find(out.begin(), out.end(), cli) == out.end()) out.emplace_back(cli);
  }
  if (op.typed) out.emplace_back("dtype");
  if ((op.flags & kFlagCausal) != 0) out.emplace_back("causal");
  if ((op.flags & kFlagZigzag) != 0) out.emplace_back("zigzag");
  if ((op.flags & kFlagGemmLayout) != 0) out.emplace_back("layout");
  if (op.fp8) out.insert(out.end(), {"scaling", "out-dtype"});
  if (op.fp8Weights) out.emplace_back("w-dtype");
  return out;
}

// "ag-gemm, gemm-rs, gemm-ar": the ops of the table with `what` (OpSpec::fp8 or OpSpec::fp8Weights).
std::string opsWith(bool OpSpec::*what) {
  std::string s;
  for (const OpSpec& op : ops()) {
    if (op.*what) s += fmt::format("{}{}", s.empty() ? "" : ", ", op.name);
  }
  return s;
}

// FP8 options against the op and each other (the descriptor's own check would name C fields, not flags).
void checkFp8Options(const RunOptions& o) {
  const OpSpec& op = *o.op;
  const bool fp8 = isFp8(o.shape.dtype);
  if (fp8 && !op.fp8) {
    throw UsageError(fmt::format(
        "--dtype {}: {} takes no FP8 inputs; the ops that do are {}{}, so pass --dtype bf16, fp16 or fp32", o.dtype,
        op.name, opsWith(&OpSpec::fp8),
        op.fp8Weights ? fmt::format(" ({} takes FP8 expert weights: --w-dtype fp8-e4m3 with --dtype bf16)", op.name)
                      : std::string()));
  }
  for (const char* name : {"scaling", "out-dtype"}) {
    if (o.given.count(name) != 0 && !fp8) {
      throw UsageError(fmt::format("--{} applies to FP8 inputs only, but --dtype is {}; pass --dtype fp8-e4m3 or "
                                   "fp8-e5m2 with it, or drop --{}",
                                   name, o.dtype, name));
    }
  }
  if (o.given.count("w-dtype") == 0 || o.shape.weightDtype == o.shape.dtype) return;
  if (o.shape.weightDtype != DType::kF8E4M3) {
    throw UsageError(fmt::format("--w-dtype {}: {}'s expert weights are in --dtype ({}) or fp8-e4m3; pass --w-dtype "
                                 "fp8-e4m3 or drop it",
                                 o.wDtype, op.name, o.dtype));
  }
  if (o.shape.dtype != DType::kBF16) {
    throw UsageError(fmt::format("--w-dtype fp8-e4m3 needs --dtype bf16 (x and the outputs stay bf16), not {}; pass "
                                 "--dtype bf16",
                                 o.dtype));
  }
  if (o.shape.savedRows != 0) {
    throw UsageError(fmt::format("--saved-rows {} with --w-dtype fp8-e4m3: saved activations are for the backward, "
                                 "which FP8 weights do not have; pass --saved-rows 0, or drop --w-dtype",
                                 o.shape.savedRows));
  }
}

std::string listOptions(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += fmt::format("{}--{}", s.empty() ? "" : " ", n);
  return s.empty() ? std::string("no shape options") : s;
}

bool isWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

// Whether `word` occurs in `text` as a whole word.
bool mentions(const std::string& text, std::string_view word) {
  for (std::size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool startOk = at == 0 || !isWordChar(text[at - 1]);
    const std::size_t end = at + word.size();
    const bool endOk = end >= text.size() || !isWordChar(text[end]);
    if (startOk && endOk) return true;
  }
  return false;
}

// " (set by --experts and --ranks)" for a validation message that names those dims.
std::string flagsNamedIn(const std::string& message, const OpSpec& op) {
  std::vector<std::string> flags;
  for (int i = 0; i < op.dimCount; ++i) {
    const DimSpec& d = op.dims[static_cast<std::size_t>(i)];
    if (d.cli.empty() || !mentions(message, d.name)) continue;
    const std::string flag = fmt::format("--{}", d.cli);
    if (std::find(flags.begin(), flags.end(), flag) == flags.end()) flags.push_back(flag);
  }
  if (mentions(message, "nranks")) flags.emplace_back("--ranks");
  if (flags.empty()) return "";
  std::string s = " (set by ";
  for (std::size_t i = 0; i < flags.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == flags.size() ? " and " : ", ") + flags[i];
  }
  return s + ")";
}

}  // namespace

void checkRunOptions(const RunOptions& o) {
  const OpSpec& op = *o.op;
  const std::vector<std::string> applies = optionsOf(op);
  for (const std::string& g : o.given) {
    if (std::find(applies.begin(), applies.end(), g) == applies.end()) {
      throw UsageError(fmt::format("--{} does not apply to {}; it takes {}", g, op.name, listOptions(applies)));
    }
  }
  checkFp8Options(o);
  for (int i = 0; i < op.dimCount; ++i) {
    const DimSpec& d = op.dims[static_cast<std::size_t>(i)];
    if (d.cli.empty()) continue;
    const uint64_t v = o.shape.value(d.cli);
    if (v == 0 && !d.mayBeZero) {
      throw UsageError(fmt::format("--{} 0: {} needs {} >= 1", d.cli, op.name, d.name));
    }
    if (d.split == DimSplit::kSplit && !d.mayBeZero && v < o.ranks) {
      throw UsageError(fmt::format("--{} {} is smaller than --ranks {}: {} splits {} over the ranks and every rank "
                                   "needs at least 1; pass --{} >= {} or fewer --ranks",
                                   d.cli, v, o.ranks, op.name, d.name, d.cli, o.ranks));
    }
  }
  // The descriptor every rank will submit, checked exactly as libtandem and tandemd will check it.
  for (uint32_t r = 0; r < o.ranks; ++r) {
    OpDescriptor d = reference::makeDescriptor(o.shape, r, o.ranks);
    for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
      if (d.bufs[s].bytes != 0) d.bufs[s].bufferId = s + 1;
    }
    try {
      validateDescriptor(d);
    } catch (const Error& e) {
      const std::string what = e.what();
      throw UsageError(what + flagsNamedIn(what, op));
    }
  }
}

std::vector<std::string> rankArgs(const RunOptions& o) {
  const OpSpec& op = *o.op;
  std::vector<std::string> a = {"--ranks", std::to_string(o.ranks)};
  for (int i = 0; i < op.dimCount; ++i) {
    const std::string_view cli = op.dims[static_cast<std::size_t>(i)].cli;
    if (cli.empty()) continue;
    a.push_back(fmt::format("--{}", cli));
    a.push_back(std::to_string(o.shape.value(cli)));
  }
  if (op.typed) a.insert(a.end(), {"--dtype", o.dtype});
  if ((op.flags & kFlagCausal) != 0) a.emplace_back(o.shape.causal ? "--causal" : "--no-causal");
  if ((op.flags & kFlagZigzag) != 0) a.emplace_back(o.shape.zigzag ? "--zigzag" : "--contiguous");
  if ((op.flags & kFlagGemmLayout) != 0) a.insert(a.end(), {"--layout", std::string(gemmLayoutName(o.shape.layout))});
  if (op.fp8 && isFp8(o.shape.dtype)) a.insert(a.end(), {"--scaling", o.scaling, "--out-dtype", o.outDtype});
  if (op.fp8Weights && !o.wDtype.empty()) a.insert(a.end(), {"--w-dtype", o.wDtype});
  a.insert(a.end(), {"--iters", std::to_string(o.iters), "--warmup", std::to_string(o.warmup), "--seed",
                     std::to_string(o.seed), "--timeout-ms", std::to_string(o.timeoutMs), "--id", o.idHex});
  if (o.check) a.emplace_back("--check");
  if (o.compare) a.emplace_back("--compare");
  return a;
}

std::string socketFor(const std::string& flag) { return flag.empty() ? clientSocketPath() : flag; }

}  // namespace tandem::ctl
