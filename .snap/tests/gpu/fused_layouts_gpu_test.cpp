// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) in every operand layout (NT, NN, TN) on the cuda backend end to end:
// real rank processes run them through libtandem and check every output against the fp64 reference
// (common/reference.hpp), in bf16 and fp16, at shapes off the tiles, at 1, 2 and 4 ranks sharing the GPUs. Then small M
// (the decode path: M = 1 .. 256 on the layouts core's swap-AB tiles with split-K), each op run 20 times and every run
// bitwise identical to the first; NN / TN with the daemon executor (MPS); and ag-gemm NN forced onto its fused kernel
// through the plan table, the plan each rank ran read back from the plan lines (TANDEM_LOG=debug).
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "fused_gemm_cases.hpp"
#include "tandem/common/plan_key.hpp"

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

namespace {

// ag-gemm NN, the dgrad of a row-parallel layer (dX_r = gather(dY_shard) · W_r), bf16 and fp16, at shapes off the
// 128 x 256 x 64 tiles (and under the {64 n, 64 k} boxes of the MN-major weight: n = k = 8), and one of many tiles. The
// built-in rules take the decomposed plan at all of them (M <= 256: the layouts core's small-M path; larger: 16 comm
// SMs cannot keep ahead of GEMMs this short), so only the plan table can make them run the fused kernel.
std::vector<LayoutCase> agNnCases() {
  return {{OpKind::kAgGemm, GemmOperands::kNN, DType::kBF16, 300, 264, 72},
          {OpKind::kAgGemm, GemmOperands::kNN, DType::kF16, 777, 520, 136},
          {OpKind::kAgGemm, GemmOperands::kNN, DType::kF16, 130, 8, 8},
          {OpKind::kAgGemm, GemmOperands::kNN, DType::kBF16, 1536, 1024, 512}};
}

// Any fingerprint will do as long as the daemon's (TANDEM_PLAN_FINGERPRINT) and the file's agree.
constexpr const char* kTestFingerprint = "gpu=fused-layouts-test;driver=fused-layouts-test;tandem=fused-layouts-test";

// <dir>/plans.json naming the fused plan (the kernels' own SM split) for every case at every rank count, for `gpu` (the
// GPU model the daemon's keys name) and `executor`. Returns the number of entries.
std::size_t writeFusedPlans(const std::filesystem::path& dir, const std::string& gpu, const std::string& executor,
                            const std::vector<uint32_t>& rankCounts, const std::vector<LayoutCase>& cases) {
  json entries = json::array();
  for (uint32_t n : rankCounts) {
    for (const LayoutCase& c : cases) {
      entries.push_back({{"op", std::string(tandem::opKindName(c.kind))},
                         {"dtype", std::string(tandem::dtypeName(c.dtype))},
                         {"ranks", n},
                         {"bucket", tandem::shapeBucket(c.m, c.n, c.k, c.layout)},
                         {"gpu", gpu},
                         {"executor", executor},
                         {"plan", {{"kind", "fused"}, {"comm_sms", 0}, {"chunk_bytes", 0}}},
                         {"source", "fused_layouts_gpu_test"}});
    }
  }
  const json table = {{"format", "tandem-plan-table"},
                      {"version", 1},
                      {"fingerprint",
                       {{"gpu", "fused-layouts-test"}, {"driver", "fused-layouts-test"}, {"tandem", "fused-layouts-test"}}},
                      {"entries", entries}};
  std::ofstream(dir / "plans.json") << table.dump(2) << "\n";
  return entries.size();
}

// The GPU model the daemon's plan keys name on this node (a daemon started on an empty plan directory tells).
std::string nodeGpuModel(const std::string& executor, const std::filesystem::path& emptyDir) {
  const Daemon probe(config(executor, emptyDir.string()), {}, "");
  return status(probe)["plans"]["gpu"].get<std::string>();
}

// The plan line of rank `r` for case `c` on n ranks: "<shape>: plan <what ran>" (libtandem's on the rank's stderr,
// tandemd's in its log, both under TANDEM_LOG=debug / log level debug). At one rank ag-gemm gathers nothing, so any
// plan is the local GEMM (NN on the layouts core); at more, the fused kernel with the weight loaded MN-major.
std::string expectedPlanLine(const LayoutCase& c, uint32_t n, uint32_t r) {
  const std::string shape = tandem::planShapeName(descriptorsOf(c, n)[r]);
  return n == 1 ? shape + ": plan local (nn on the layouts core)"
                : shape + ": plan fused (NN: the weight loaded MN-major; ";
}

}  // namespace

TEST_CASE("ag-gemm NN forced onto the fused kernel by the plan table, client executor: matches the reference at 1, 2 "
          "and 4 ranks, and the plan lines show the fused kernel ran") {
  const TempDir planDir;
  const ScopedEnv fingerprint("TANDEM_PLAN_FINGERPRINT", kTestFingerprint);
  const std::vector<uint32_t> rankCounts = {1, 2, 4};
  const std::vector<LayoutCase> cases = agNnCases();
  const std::size_t entries =
      writeFusedPlans(planDir.path(), nodeGpuModel("client", planDir.path()), "client", rankCounts, cases);
  Daemon d(config("client", planDir.path().string()), {}, "");
  REQUIRE(status(d)["plans"]["state"] == fmt::format("loaded {} entries", entries));
  const ScopedEnv debug("TANDEM_LOG", "debug");  // libtandem names the plan each (op, shape) ran, on stderr
  for (uint32_t n : rankCounts) {
    const auto logOf = [&](uint32_t r) { return planDir.path() / fmt::format("rank{}of{}.log", r, n); };
    MESSAGE("ag-gemm NN, fused plan forced, " << n << " rank(s)");
    runRankProcesses(d, n, 600000, [&](const tandem_unique_id_t& id, uint32_t r) {
      // This rank's stderr into a file of the test's, where its plan lines are read back.
      const int fd = ::open(logOf(r).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0 || ::dup2(fd, 2) < 0) return "FAIL cannot send stderr to " + logOf(r).string();
      ::close(fd);
      return gemmCasesRank(d.socket(), id, n, r, cases, 2);
    });
    for (uint32_t r = 0; r < n; ++r) {
      std::ifstream in(logOf(r));
      const std::string log((std::istreambuf_iterator<char>(in)), {});
      INFO("rank " << r << " of " << n << " stderr:\n" << log);
      for (const LayoutCase& c : cases) {
        CHECK(log.find(fmt::format("tandem: rank {}: {}", r, expectedPlanLine(c, n, r))) != std::string::npos);
      }
    }
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("ag-gemm NN forced onto the fused kernel by the plan table, daemon executor (MPS): matches the reference at "
          "2 ranks, and tandemd's plan lines show the fused kernel ran" *
          doctest::test_suite(kNeedsMpsTwoGpus)) {
  if (skipWithoutMps()) return;
  if (ranksFor("daemon", 2) < 2) return skipCase("the daemon executor runs one rank per GPU: this case needs 2 GPUs");
  const TempDir planDir;
  const ScopedEnv fingerprint("TANDEM_PLAN_FINGERPRINT", kTestFingerprint);
  const std::vector<LayoutCase> cases = agNnCases();
  const std::size_t entries =
      writeFusedPlans(planDir.path(), nodeGpuModel("daemon", planDir.path()), "daemon", {2}, cases);
  Daemon d(config("daemon", planDir.path().string()), {"--log-level", "debug"}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  REQUIRE(status(d)["plans"]["state"] == fmt::format("loaded {} entries", entries));
  runGemmCases(d, 2, cases, 2);
  const std::string log = d.log();
  INFO(log);
  // tandemd logs one plan line per shape, "rank <r>: <shape>: plan ..." (every rank runs the same plan).
  for (const LayoutCase& c : cases) CHECK(log.find(expectedPlanLine(c, 2, 0)) != std::string::npos);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}
