// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) with FP8 inputs on the cuda backend end to end: real rank processes run
// them through libtandem (layout nt, the FP8 core) and check every output against the fp64 reference of the
// dequantized inputs (common/reference.hpp: the tolerance of the output dtype), e4m3 and e5m2, per-tensor and block
// scales, bf16 and fp32 c, at shapes off the 128 x 256 x 128 tiles and at small m, at 1, 2 and 4 ranks sharing the
// GPUs, each op run 5 times and every run bitwise identical to the first; the layouts the FP8 core cannot read
// refused naming the layout; and the daemon executor (MPS).
#include <string>
#include <vector>

#include "fused_gemm_cases.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::GemmOperands;
using tandem::OpKind;

namespace {

constexpr int kRepeats = 5;

// Every op in both formats, both scalings and both output dtypes at a shape off every tile (k = 17 x 16 per rank: a
// last k-block of 16; n = 264: a last column tile of 8; m = 300: 75 rows a rank at 4 ranks), then a shape of many
// tiles, a row count that splits unevenly (ag-gemm at 2 and 4 ranks), and small m.
std::vector<GemmCase> fp8Cases(uint32_t nranks) {
  std::vector<GemmCase> v;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    const bool ag = kind == OpKind::kAgGemm;
    const uint64_t kUnit = ag ? 16 : 16 * nranks;  // every rank's k slice a multiple of 16
    for (DType fmt : {DType::kF8E4M3, DType::kF8E5M2}) {
      for (bool block : {false, true}) {
        for (DType out : {DType::kBF16, DType::kF32}) {
          v.push_back({kind, GemmOperands::kNT, fmt, 300, 264, kUnit * 17, out, block});
        }
      }
    }
    v.push_back({kind, GemmOperands::kNT, DType::kF8E4M3, 1536, 1024, kUnit * 64, DType::kBF16, true});
    v.push_back({kind, GemmOperands::kNT, DType::kF8E4M3, 1536, 1024, kUnit * 64, DType::kF32, false});
    // 302 rows: ranks own 151 or 76 / 75 rows, and block scales of widths that are no multiple of 4 cross the wire
    // (one rank reads a_scale in place and needs m % 4 == 0: per tensor there).
    if (ag) v.push_back({kind, GemmOperands::kNT, DType::kF8E5M2, 302, 520, kUnit * 9, DType::kBF16, nranks > 1});
    v.push_back({kind, GemmOperands::kNT, DType::kF8E4M3, 4, 1024, kUnit * 32, DType::kBF16, true});
    v.push_back({kind, GemmOperands::kNT, DType::kF8E4M3, 1, 520, kUnit * 8, DType::kF32, false});
  }
  for (GemmCase& c : v) c.tolerance = fp8CoreTolerance(c.outDtype, c.blockScale);
  return v;
}

// NN and TN with FP8 inputs: refused at submission with the layout named and the remedy (transpose in the producer),
// nothing written.
std::string refusedLayoutRank(const std::string& socket, const tandem_unique_id_t& id) {
  Joined j(socket, id, 1, 0);
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    for (GemmOperands layout : {GemmOperands::kNN, GemmOperands::kTN}) {
      const GemmCase c{kind, layout, DType::kF8E4M3, 64, 64, 128, DType::kBF16, false};
      RankBuffers b(j.s, descriptorsOf(c, 1), 0, 7, false);
      b.poison(j.stream);
      tandem_op_t op;
      std::string why;
      if (submitGemm(b, j.comm, j.stream, &op) == TANDEM_SUCCESS) {  // refused at submission or when waited on
        why = finishOp(j.stream, op);
        if (why.empty()) return fmt::format("FAIL {}: ran; the FP8 core reads K-major operands only", describe(c));
      } else {
        why = tandem_last_error();
      }
      const std::string named = fmt::format("layout {}", tandem::gemmLayoutName(layout));
      if (why.find(named) == std::string::npos || why.find("layout nt") == std::string::npos ||
          why.find("ranspose") == std::string::npos) {
        return fmt::format("FAIL {}: the refusal must name '{}' and the remedy (transpose, layout nt): {}", describe(c),
                           named, why);
      }
      CK(cudaStreamSynchronize(j.stream));
      b.download();
      if (std::string e = b.untouched(); !e.empty()) return fmt::format("FAIL {}: refused but {}", describe(c), e);
    }
  }
  return "OK";
}

}  // namespace

TEST_CASE("fused GEMMs with FP8 inputs, client executor: match the dequantized fp64 reference at 1, 2 and 4 ranks, "
          "5 runs bitwise identical") {
  Daemon d(config("client"), {}, "");
  for (uint32_t n : {1u, 2u, 4u}) runGemmCases(d, n, fp8Cases(n), kRepeats);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("fused GEMMs with FP8 inputs in layouts nn and tn: refused naming the layout and the fix") {
  Daemon d(config("client"), {}, "");
  runRankProcesses(d, 1, 120000,
                   [&](const tandem_unique_id_t& id, uint32_t) { return refusedLayoutRank(d.socket(), id); });
}

TEST_CASE("fused GEMMs with FP8 inputs, daemon executor (MPS): match the reference at 1 rank, repeat bitwise" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  runGemmCases(d, 1, fp8Cases(1), kRepeats);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("fused GEMMs with FP8 inputs, daemon executor (MPS): match the reference at 2 ranks, repeat bitwise" *
          doctest::test_suite(kNeedsMpsTwoGpus)) {
  if (skipWithoutMps()) return;
  if (ranksFor("daemon", 2) < 2) return skipCase("the daemon executor runs one rank per GPU: this case needs 2 GPUs");
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  runGemmCases(d, 2, fp8Cases(2), kRepeats);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}
