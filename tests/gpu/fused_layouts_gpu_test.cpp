// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) in every operand layout (NT, NN, TN) on the cuda backend end to end:
// real rank processes run them through libtandem and check every output against the fp64 reference
// (common/reference.hpp), in bf16 and fp16, at shapes off the tiles, at 1, 2 and 4 ranks sharing the GPUs. Then small M
// (the decode path: M = 1 .. 256 on the layouts core's swap-AB tiles with split-K), each op run 20 times and every run
// bitwise identical to the first; and NN / TN with the daemon executor (MPS).
#include <vector>

#include "fused_gemm_cases.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::GemmOperands;
using tandem::OpKind;

namespace {

using LayoutCase = GemmCase;

// Every op in every layout, bf16 and fp16, at shapes off the 128 x 256 x 64 tiles (TN: m a multiple of 8 x nranks,
// as every rank's [k, rows] shard of ag-gemm needs; the others any m), one shape of many tiles, and one row.
std::vector<LayoutCase> layoutCases(uint32_t nranks) {
  std::vector<LayoutCase> v;
  const uint64_t tnUnit = 8 * nranks;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    const uint64_t kUnit = kind == OpKind::kAgGemm ? 8 : 8 * nranks;  // every rank's k slice a multiple of 8
    for (GemmOperands l : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
      const bool tn = l == GemmOperands::kTN;
      v.push_back({kind, l, DType::kBF16, tn ? tnUnit * 38 : 300, 264, kUnit * 9});
      v.push_back({kind, l, DType::kF16, tn ? tnUnit * 97 : 777, 520, kUnit * 17});
      v.push_back({kind, l, DType::kBF16, 1536, 1024, 512});
      v.push_back({kind, l, DType::kBF16, tn ? tnUnit : 1, 8, kUnit});
    }
  }
  return v;
}

// Small M: the decode sizes, N x K large enough that the layouts core splits K (N = 1024 gives 8 swap-AB row tiles on
// 132 SMs), every layout, bf16 and fp16 alternately.
std::vector<LayoutCase> smallMCases(uint32_t nranks, const std::vector<OpKind>& kinds) {
  std::vector<LayoutCase> v;
  int i = 0;
  for (OpKind kind : kinds) {
    for (uint64_t m : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
      for (GemmOperands l : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
        // TN stores A [k, m] (ag-gemm: each rank's [k, rows]): m a multiple of 8 x nranks, the rest skip it.
        if (l == GemmOperands::kTN && m % (kind == OpKind::kAgGemm ? 8 * nranks : 8) != 0) continue;
        v.push_back({kind, l, (i++ % 2 == 0) ? DType::kBF16 : DType::kF16, m, 1024, 2048});
      }
    }
  }
  return v;
}

const std::vector<OpKind> kAllKinds = {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr};

}  // namespace

TEST_CASE("fused GEMMs in every layout, client executor: match the fp64 reference at 1, 2 and 4 ranks") {
  Daemon d(config("client"), {}, "");
  for (uint32_t n : {1u, 2u, 4u}) runGemmCases(d, n, layoutCases(n), 1);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("fused GEMMs at small M (1 .. 256), client executor: match the reference, 20 runs bitwise identical") {
  Daemon d(config("client"), {}, "");
  runGemmCases(d, 1, smallMCases(1, kAllKinds), 20);
  runGemmCases(d, 2, smallMCases(2, kAllKinds), 20);
  runGemmCases(d, 4, smallMCases(4, {OpKind::kGemmAr}), 5);  // four ranks time-slice one GPU: fewer runs
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

namespace {
// The daemon executor runs one rank per GPU under MPS: 1 rank, or 2 ranks on two GPUs.
void runDaemonExecutor(uint32_t n) {
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  std::vector<LayoutCase> cases = layoutCases(n);
  const std::vector<LayoutCase> small = smallMCases(n, kAllKinds);
  for (std::size_t i = 0; i < small.size(); i += 4) cases.push_back(small[i]);
  runGemmCases(d, n, cases, 5);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}
}  // namespace

TEST_CASE("fused GEMMs in every layout, daemon executor (MPS): match the reference at 1 rank, repeat bitwise" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  runDaemonExecutor(1);
}

TEST_CASE("fused GEMMs in every layout, daemon executor (MPS): match the reference at 2 ranks, repeat bitwise" *
          doctest::test_suite(kNeedsMpsTwoGpus)) {
  if (skipWithoutMps()) return;
  if (ranksFor("daemon", 2) < 2) return skipCase("the daemon executor runs one rank per GPU: this case needs 2 GPUs");
  runDaemonExecutor(2);
}
