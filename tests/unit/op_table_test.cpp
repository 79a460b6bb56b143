// The op table is the one place an op is described: every entry must have a C entry point, a cpu implementation, a
// reference and a `tandemctl run` path, and the backends' unsupported-op messages must follow from their op sets.
#include <doctest/doctest.h>

#include <cstdio>
#include <set>
#include <string>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/common/validate.hpp"

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
  // The cpu backend runs every op of the table.
  tandem::daemon::DaemonConfig config;
  CHECK(tandem::daemon::makeCpuBackend(config)->ops(nullptr) == OpSet::all());
  for (const OpSpec& op : tandem::ops()) CHECK(OpSet::all().contains(op.kind));
  CHECK_FALSE(OpSet::all().contains(OpKind::kInvalid));
}

}  // namespace
