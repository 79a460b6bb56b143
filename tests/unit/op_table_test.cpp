// The op table is the one place an op is described: every entry must have a C entry point, a cpu implementation, a
// reference and a `tandemctl run` path, and the backends' unsupported-op messages must follow from their op sets.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/common/validate.hpp"
#include "tandem/tandem.h"

namespace {

// The dynamic symbols libtandem.so exports (nm -D), read without loading it: this test binary links the client's
// static core, and a second copy of its protobuf descriptors in one process aborts.
std::set<std::string> exportedSymbols(const char* library) {
  std::set<std::string> out;
  const std::string cmd = std::string("nm -D --defined-only ") + library;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char line[512];
  while (std::fgets(line, sizeof line, p) != nullptr) {
    std::string l(line);
    while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
    if (const auto space = l.rfind(' '); space != std::string::npos) out.insert(l.substr(space + 1));
  }
  ::pclose(p);
  return out;
}

using tandem::OpKind;
using tandem::OpSet;
using tandem::OpSpec;

TEST_CASE("every op of the table has a C entry point, a cpu implementation, a reference and a tandemctl shape") {
  const std::set<std::string> symbols = exportedSymbols(TANDEM_LIBRARY_PATH);
  REQUIRE_MESSAGE(symbols.count("tandem_connect") == 1, "nm -D found no C API in ", TANDEM_LIBRARY_PATH);
  std::set<std::string> names;
  for (const OpSpec& op : tandem::ops()) {
    CAPTURE(op.name);
    CHECK(names.insert(std::string(op.name)).second);  // unique names
    CHECK(tandem::findOp(op.name) == &op);
    CHECK(tandem::opKindName(op.kind) == op.name);
    CHECK_MESSAGE(symbols.count(std::string(op.cFunction)) == 1, "libtandem exports no ", op.cFunction);
    CHECK(tandem::daemon::cpuRuns(op.kind));
    CHECK(tandem::reference::hasReference(op.kind));
    // tandemctl run derives each rank's descriptor from the table alone: every dim it needs has an option (or is
    // derived), and the descriptor it builds passes the daemon's validation at 1 and 3 ranks.
    for (int d = 0; d < op.dimCount; ++d) {
      const auto& dim = op.dims[static_cast<std::size_t>(d)];
      if (dim.split != tandem::DimSplit::kCapacity) CHECK_NOTHROW((void)tandem::reference::OpShape{}.value(dim.cli));
    }
    tandem::reference::OpShape shape;
    shape.kind = op.kind;
    shape.experts = 6;
    for (uint32_t nranks : {1u, 3u}) {
      for (uint32_t r = 0; r < nranks; ++r) {
        tandem::OpDescriptor desc = tandem::reference::makeDescriptor(shape, r, nranks);
        for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
          if (desc.bufs[s].bytes != 0) desc.bufs[s].bufferId = 1 + s;
        }
        CHECK_NOTHROW(tandem::validateDescriptor(desc));
      }
    }
  }
  CHECK(names.size() == tandem::kOpKindCount - 1);
}

TEST_CASE("a backend's unsupported-op message names exactly the ops it runs") {
  const OpSet cudaOps{OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr, OpKind::kAllGather, OpKind::kNop};
  const std::string m = tandem::unsupportedOpMessage("cuda", cudaOps, OpKind::kRingAttention);
  CHECK(m.find("ring-attention: the cuda backend does not run this op") == 0);
  CHECK(m.find("(it runs ag-gemm, gemm-rs, gemm-ar, allgather, barrier)") != std::string::npos);
  CHECK(m.find("daemon.backend: cpu") != std::string::npos);
  for (const OpSpec& op : tandem::ops()) {
    const std::string listed = tandem::unsupportedOpMessage("x", OpSet{op.kind}, OpKind::kInvalid);
    CHECK(listed.find(fmt::format("(it runs {})", op.name)) != std::string::npos);
  }
  // An op the cuda backend does not run yet says why (the table's cudaPending); the others say nothing of it.
  for (const OpSpec& op : tandem::ops()) {
    const std::string refused = tandem::unsupportedOpMessage("cuda", cudaOps, op.kind);
    CAPTURE(refused);
    CHECK((refused.find("has no GPU implementation yet") != std::string::npos) == !op.cudaPending.empty());
    if (!op.cudaPending.empty()) CHECK(refused.find(std::string(op.cudaPending)) != std::string::npos);
  }
  CHECK(tandem::opSpec(OpKind::kMoeFfnBackward).cudaPending.empty());  // the cuda backend runs it
  // The cpu backend runs every op of the table.
  tandem::daemon::DaemonConfig config;
  CHECK(tandem::daemon::makeCpuBackend(config)->ops(nullptr) == OpSet::all());
  for (const OpSpec& op : tandem::ops()) CHECK(OpSet::all().contains(op.kind));
  CHECK_FALSE(OpSet::all().contains(OpKind::kInvalid));
}

// What the compiler says of each argument struct in tandem.h: its size and every field's offset. The op table's field
// lists (which Python packs its calls from) must agree with it.
struct CStructFacts {
  std::size_t size;
  std::vector<std::pair<std::string, std::size_t>> fields;  // after struct_size, in order
};
#define TANDEM_FIELD(T, f) {#f, offsetof(T, f)}
const std::map<std::string, CStructFacts>& cStructs() {
  static const std::map<std::string, CStructFacts> m = [] {
    std::map<std::string, CStructFacts> out;
    {
      using T = tandem_ag_gemm_args_t;
      out["tandem_ag_gemm_args_t"] = {sizeof(T), {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, m), TANDEM_FIELD(T, n),
                                                  TANDEM_FIELD(T, k), TANDEM_FIELD(T, a), TANDEM_FIELD(T, b),
                                                  TANDEM_FIELD(T, c), TANDEM_FIELD(T, a_gathered),
                                                  TANDEM_FIELD(T, cuda_stream), TANDEM_FIELD(T, layout),
                                                  TANDEM_FIELD(T, out_dtype), TANDEM_FIELD(T, scaling),
                                                  TANDEM_FIELD(T, a_scale), TANDEM_FIELD(T, b_scale)}};
    }
    {
      using T = tandem_gemm_rs_args_t;
      out["tandem_gemm_rs_args_t"] = {sizeof(T), {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, m), TANDEM_FIELD(T, n),
                                                  TANDEM_FIELD(T, k), TANDEM_FIELD(T, a), TANDEM_FIELD(T, b),
                                                  TANDEM_FIELD(T, c), TANDEM_FIELD(T, cuda_stream),
                                                  TANDEM_FIELD(T, layout), TANDEM_FIELD(T, out_dtype),
                                                  TANDEM_FIELD(T, scaling), TANDEM_FIELD(T, a_scale),
                                                  TANDEM_FIELD(T, b_scale)}};
    }
    {
      using T = tandem_gemm_ar_args_t;
      out["tandem_gemm_ar_args_t"] = {sizeof(T), {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, m), TANDEM_FIELD(T, n),
                                                  TANDEM_FIELD(T, k), TANDEM_FIELD(T, a), TANDEM_FIELD(T, b),
                                                  TANDEM_FIELD(T, c), TANDEM_FIELD(T, cuda_stream),
                                                  TANDEM_FIELD(T, layout), TANDEM_FIELD(T, out_dtype),
                                                  TANDEM_FIELD(T, scaling), TANDEM_FIELD(T, a_scale),
                                                  TANDEM_FIELD(T, b_scale)}};
    }
    {
      using T = tandem_moe_dispatch_gemm_args_t;
      out["tandem_moe_dispatch_gemm_args_t"] = {
          sizeof(T),
          {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, tokens), TANDEM_FIELD(T, hidden), TANDEM_FIELD(T, n_out),
           TANDEM_FIELD(T, experts), TANDEM_FIELD(T, topk), TANDEM_FIELD(T, capacity), TANDEM_FIELD(T, x),
           TANDEM_FIELD(T, topk_ids), TANDEM_FIELD(T, topk_weights), TANDEM_FIELD(T, w), TANDEM_FIELD(T, out),
           TANDEM_FIELD(T, row_info), TANDEM_FIELD(T, expert_counts), TANDEM_FIELD(T, cuda_stream),
           TANDEM_FIELD(T, w_dtype), TANDEM_FIELD(T, w_scale)}};
    }
    {
      using T = tandem_moe_ffn_args_t;
      out["tandem_moe_ffn_args_t"] = {
          sizeof(T),
          {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, tokens), TANDEM_FIELD(T, hidden), TANDEM_FIELD(T, ffn),
           TANDEM_FIELD(T, experts), TANDEM_FIELD(T, topk), TANDEM_FIELD(T, x), TANDEM_FIELD(T, topk_ids),
           TANDEM_FIELD(T, topk_weights), TANDEM_FIELD(T, w1), TANDEM_FIELD(T, w2), TANDEM_FIELD(T, out),
           TANDEM_FIELD(T, cuda_stream), TANDEM_FIELD(T, saved_rows), TANDEM_FIELD(T, saved),
           TANDEM_FIELD(T, w_dtype), TANDEM_FIELD(T, w1_scale), TANDEM_FIELD(T, w2_scale)}};
    }
    {
      using T = tandem_ring_attention_args_t;
      out["tandem_ring_attention_args_t"] = {
          sizeof(T),
          {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, seq), TANDEM_FIELD(T, heads), TANDEM_FIELD(T, head_dim),
           TANDEM_FIELD(T, causal), TANDEM_FIELD(T, scale), TANDEM_FIELD(T, q), TANDEM_FIELD(T, k),
           TANDEM_FIELD(T, v), TANDEM_FIELD(T, out), TANDEM_FIELD(T, cuda_stream), TANDEM_FIELD(T, lse),
           TANDEM_FIELD(T, layout), TANDEM_FIELD(T, kv_heads)}};
    }
    {
      using T = tandem_ring_attention_backward_args_t;
      out["tandem_ring_attention_backward_args_t"] = {
          sizeof(T),
          {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, seq), TANDEM_FIELD(T, heads), TANDEM_FIELD(T, head_dim),
           TANDEM_FIELD(T, kv_heads), TANDEM_FIELD(T, causal), TANDEM_FIELD(T, layout), TANDEM_FIELD(T, scale),
           TANDEM_FIELD(T, q), TANDEM_FIELD(T, k), TANDEM_FIELD(T, v), TANDEM_FIELD(T, o), TANDEM_FIELD(T, dout),
           TANDEM_FIELD(T, lse), TANDEM_FIELD(T, dq), TANDEM_FIELD(T, dk), TANDEM_FIELD(T, dv),
           TANDEM_FIELD(T, cuda_stream)}};
    }
    {
      using T = tandem_moe_ffn_backward_args_t;
      out["tandem_moe_ffn_backward_args_t"] = {
          sizeof(T),
          {TANDEM_FIELD(T, dtype), TANDEM_FIELD(T, tokens), TANDEM_FIELD(T, hidden), TANDEM_FIELD(T, ffn),
           TANDEM_FIELD(T, experts), TANDEM_FIELD(T, topk), TANDEM_FIELD(T, x), TANDEM_FIELD(T, topk_ids),
           TANDEM_FIELD(T, topk_weights), TANDEM_FIELD(T, w1), TANDEM_FIELD(T, w2), TANDEM_FIELD(T, dout),
           TANDEM_FIELD(T, dx), TANDEM_FIELD(T, dtopk_weights), TANDEM_FIELD(T, dw1), TANDEM_FIELD(T, dw2),
           TANDEM_FIELD(T, cuda_stream), TANDEM_FIELD(T, saved_rows), TANDEM_FIELD(T, saved)}};
    }
    {
      using T = tandem_allgather_args_t;
      out["tandem_allgather_args_t"] = {sizeof(T), {TANDEM_FIELD(T, send), TANDEM_FIELD(T, recv),
                                                    TANDEM_FIELD(T, bytes), TANDEM_FIELD(T, cuda_stream)}};
    }
    {
      using T = tandem_barrier_args_t;
      out["tandem_barrier_args_t"] = {sizeof(T), {TANDEM_FIELD(T, cuda_stream)}};
    }
    return out;
  }();
  return m;
}
#undef TANDEM_FIELD

TEST_CASE("every op's C struct fields in the table are tandem.h's, at the compiler's offsets") {
  const std::set<std::string> symbols = exportedSymbols(TANDEM_LIBRARY_PATH);
  for (const OpSpec& op : tandem::ops()) {
    CAPTURE(op.name);
    const auto it = cStructs().find(std::string(op.cStruct));
    REQUIRE_MESSAGE(it != cStructs().end(), "op_table_test's cStructs() has no entry for ", op.cStruct,
                    ": add its sizeof and offsetof of each field");
    const tandem::CArgsLayout layout = tandem::cArgsLayout(op);
    CHECK(layout.size == it->second.size);
    REQUIRE(op.cFieldCount == it->second.fields.size());
    for (int f = 0; f < op.cFieldCount; ++f) {
      const auto i = static_cast<std::size_t>(f);
      CHECK(op.cFields[i].name == it->second.fields[i].first);
      CHECK(layout.offsets[i] == it->second.fields[i].second);
    }
    CHECK_MESSAGE(symbols.count(std::string(op.cArgsFunction)) == 1, "libtandem exports no ", op.cArgsFunction);
    // Every dim and slot is one field, and a typed op passes its dtype.
    std::set<std::pair<int, int>> seen;
    for (int f = 0; f < op.cFieldCount; ++f) {
      const tandem::CField& cf = op.cFields[static_cast<std::size_t>(f)];
      CHECK(seen.insert({static_cast<int>(cf.kind), cf.index}).second);
    }
    for (int d = 0; d < op.dimCount; ++d) CHECK(seen.count({static_cast<int>(tandem::CField::Kind::kDim), d}) == 1);
    for (int s = 0; s < op.slotCount; ++s) {
      CHECK(seen.count({static_cast<int>(tandem::CField::Kind::kTensor), s}) == 1);
    }
    CHECK(seen.count({static_cast<int>(tandem::CField::Kind::kDtype), 0}) == (op.typed ? 1u : 0u));
    CHECK(seen.count({static_cast<int>(tandem::CField::Kind::kScale), 0}) == (op.scale ? 1u : 0u));
    CHECK_FALSE(op.pyName.empty());
  }
}

TEST_CASE("tandem_op_table describes every op of the table") {
  const nlohmann::json t = nlohmann::json::parse(tandem_op_table());
  REQUIRE(t.at("ops").size() == tandem::ops().size());
  for (const OpSpec& op : tandem::ops()) {
    CAPTURE(op.name);
    const nlohmann::json& j = t.at("ops").at(static_cast<std::size_t>(op.kind) - 1);
    CHECK(j.at("name") == op.name);
    CHECK(j.at("py_name") == op.pyName);
    CHECK(j.at("struct_size") == tandem::cArgsLayout(op).size);
    CHECK(j.at("slots").size() == op.slotCount);
    CHECK(j.at("fields").size() == op.cFieldCount);
  }
}

}  // namespace
