// tandemd's plan table (daemon/src/plan_table.hpp): the file format and its version, the fingerprint that invalidates
// it, persistence across a reload, trial plans per communicator, the checks on entries, the shape buckets, where the
// table lives, and the plans section of the config.
#include "plan_table.hpp"

#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "config.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/v1/control.pb.h"

namespace {

using namespace tandem;
using namespace tandem::daemon;
namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "tandem-plan-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const PlanFingerprint kH200{"NVIDIA H200", "550.54.15", "0.2.0"};

PlanRecord record(OpKind op, uint64_t m, PlanKind kind, uint32_t sms) {
  PlanRecord r;
  r.key = PlanKey{op, DType::kBF16, 2, shapeBucket(m, 8192, 4096), "NVIDIA H200", "daemon"};
  r.plan = PlanChoice{kind, sms, 0};
  r.timeUs = 1234.5;
  r.baselineUs = 1500.0;
  r.source = "tune";
  r.savedAtUnixS = 1764633600;  // 2025-12-02T00:00:00Z
  return r;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("shape buckets round each dimension up to a power of two") {
  CHECK(bucketDim(1) == 1);
  CHECK(bucketDim(1000) == 1024);
  CHECK(bucketDim(8192) == 8192);
  CHECK(bucketDim(8193) == 16384);
  CHECK(shapeBucket(16384, 14336, 8192) == "m16384.n16384.k8192");
  CHECK(shapeBucket(4000, 8192, 4096) == shapeBucket(4096, 8192, 4096));
  CHECK(shapeBucket(4097, 8192, 4096) != shapeBucket(4096, 8192, 4096));
  // The layouts are planned apart; nt keeps the bucket it had before layouts existed.
  CHECK(shapeBucket(4096, 8192, 4096, GemmOperands::kNT) == "m4096.n8192.k4096");
  CHECK(shapeBucket(4096, 8192, 4096, GemmOperands::kNN) == "m4096.n8192.k4096.nn");
  CHECK(shapeBucket(4096, 8192, 4096, GemmOperands::kTN) == "m4096.n8192.k4096.tn");
  OpDescriptor d{};
  d.kind = OpKind::kAgGemm;
  d.dtype = DType::kBF16;
  d.nranks = 2;
  d.dims[dim::kM] = 4096;
  d.dims[dim::kN] = 8192;
  d.dims[dim::kK] = 4096;
  const PlanKey nt = planKeyOf(d, "NVIDIA H100 80GB HBM3", "client");
  d.flags = gemmLayoutFlags(GemmOperands::kNN);
  const PlanKey nn = planKeyOf(d, "NVIDIA H100 80GB HBM3", "client");
  CHECK(nt.bucket == "m4096.n8192.k4096");
  CHECK(nn.bucket == "m4096.n8192.k4096.nn");
  CHECK(nt != nn);
}

TEST_CASE("the file format round-trips every field and names its format and version") {
  const std::vector<PlanRecord> records = {record(OpKind::kGemmRs, 8192, PlanKind::kFused, 16),
                                           record(OpKind::kAgGemm, 1024, PlanKind::kDecomposed, 0)};
  const std::string text = PlanTable::toJson(kH200, records);
  const auto j = nlohmann::json::parse(text);
  CHECK(j["format"] == "tandem-plan-table");
  CHECK(j["version"] == kPlanTableVersion);
  CHECK(j["fingerprint"]["driver"] == "550.54.15");
  CHECK(j["entries"][0]["plan"]["kind"] == "fused");
  CHECK(j["entries"][0]["saved_at"] == "2025-12-02T00:00:00Z");
  const PlanTable::Parsed back = PlanTable::parse(text);
  CHECK(back.version == kPlanTableVersion);
  CHECK(back.fingerprint == kH200);
  REQUIRE(back.records.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(back.records[i].key == records[i].key);
    CHECK(back.records[i].plan == records[i].plan);
    CHECK(back.records[i].timeUs == records[i].timeUs);
    CHECK(back.records[i].baselineUs == records[i].baselineUs);
    CHECK(back.records[i].source == records[i].source);
    CHECK(back.records[i].savedAtUnixS == records[i].savedAtUnixS);
  }
}

TEST_CASE("entries that mean nothing are refused with what is wrong") {
  const auto errorOf = [](const std::string& entry) {
    const std::string text = R"({"format": "tandem-plan-table", "version": 1, "fingerprint": {"gpu": "g",
      "driver": "d", "tandem": "t"}, "entries": [)" + entry + "]}";
    try {
      PlanTable::parse(text);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    FAIL("accepted: " << entry);
    return std::string();
  };
  const std::string rest = R"("dtype": "bf16", "ranks": 2, "bucket": "m1.n1.k1", "gpu": "g", "executor": "daemon")";
  CHECK(errorOf(R"({"op": "allgather", )" + rest + R"(, "plan": {"kind": "fused", "comm_sms": 0}})")
            .find("has no plans") != std::string::npos);
  CHECK(errorOf(R"({"op": "gemm-rs", )" + rest + R"(, "plan": {"kind": "auto", "comm_sms": 0}})")
            .find("is not fused or decomposed") != std::string::npos);
  CHECK(errorOf(R"({"op": "gemm-rs", "dtype": "bf16", "ranks": 0, "bucket": "b", "gpu": "g", "executor": "e",
                  "plan": {"kind": "fused", "comm_sms": 0}})")
            .find("ranks 0") != std::string::npos);
  CHECK(errorOf(R"({"op": "gemm-rs", )" + rest + R"(, "plan": {"kind": "fused"}})").find("comm_sms") !=
        std::string::npos);
  CHECK_THROWS_AS(PlanTable::parse("not json"), Error);
  CHECK_THROWS_AS(PlanTable::parse(R"({"format": "something else", "version": 1})"), Error);
}

TEST_CASE("a saved table is there after a reload with the same fingerprint") {
  TempDir dir;
  {
    PlanTable t((dir.path / "state").string(), kH200);  // the directory does not exist yet: save creates it
    CHECK(t.state() == "new");
    CHECK_FALSE(fs::exists(dir.path / "state"));
    t.put(record(OpKind::kGemmRs, 8192, PlanKind::kFused, 16));
    t.put(record(OpKind::kGemmAr, 4096, PlanKind::kDecomposed, 32));
    t.save();
    CHECK(t.state().find("saved 2 entries") != std::string::npos);
  }
  CHECK(fs::exists(dir.path / "state" / "plans.json"));
  PlanTable again((dir.path / "state").string(), kH200);
  CHECK(again.state() == "loaded 2 entries");
  REQUIRE(again.size() == 2);
  const auto found = again.find(record(OpKind::kGemmRs, 8000, PlanKind::kAuto, 0).key);  // same bucket as 8192
  REQUIRE(found.has_value());
  CHECK(found->kind == PlanKind::kFused);
  CHECK(found->commSms == 16);
  CHECK_FALSE(again.find(record(OpKind::kGemmRs, 16384, PlanKind::kAuto, 0).key).has_value());
}

TEST_CASE("a changed driver, GPU or tandem release invalidates the table and sets its file aside") {
  TempDir dir;
  {
    PlanTable t(dir.path.string(), kH200);
    t.put(record(OpKind::kGemmRs, 8192, PlanKind::kFused, 16));
    t.save();
  }
  SUBCASE("driver") {
    PlanFingerprint other = kH200;
    other.driver = "560.28.03";
    PlanTable t(dir.path.string(), other);
    CHECK(t.size() == 0);
    CHECK(t.state().find("invalidated") != std::string::npos);
    CHECK(t.state().find("driver 550.54.15 -> 560.28.03") != std::string::npos);
    CHECK(fs::exists(dir.path / "plans.json.invalidated"));
    CHECK_FALSE(fs::exists(dir.path / "plans.json"));
    CHECK_FALSE(t.find(record(OpKind::kGemmRs, 8192, PlanKind::kAuto, 0).key).has_value());
  }
  SUBCASE("GPU model") {
    PlanFingerprint other = kH200;
    other.gpu = "NVIDIA H100 80GB HBM3";
    PlanTable t(dir.path.string(), other);
    CHECK(t.size() == 0);
    CHECK(t.state().find("GPU NVIDIA H200 -> NVIDIA H100 80GB HBM3") != std::string::npos);
  }
  SUBCASE("tandem release") {
    PlanFingerprint other = kH200;
    other.tandem = "0.3.0";
    PlanTable t(dir.path.string(), other);
    CHECK(t.size() == 0);
    CHECK(t.state().find("tandem 0.2.0 -> 0.3.0") != std::string::npos);
  }
}

TEST_CASE("a file of another format version or one that does not parse is set aside, not misread") {
  TempDir dir;
  SUBCASE("another version") {
    std::ofstream(dir.path / "plans.json") << R"({"format": "tandem-plan-table", "version": 99, "entries": []})";
    PlanTable t(dir.path.string(), kH200);
    CHECK(t.state().find("format version 99") != std::string::npos);
  }
  SUBCASE("garbage") {
    std::ofstream(dir.path / "plans.json") << "{ truncated";
    PlanTable t(dir.path.string(), kH200);
    CHECK(t.state().find("does not parse") != std::string::npos);
  }
  CHECK(fs::exists(dir.path / "plans.json.invalidated"));
  PlanTable t(dir.path.string(), kH200);
  t.put(record(OpKind::kGemmRs, 8192, PlanKind::kFused, 0));
  t.save();  // a new table replaces nothing that still mattered
  CHECK(PlanTable::parse(slurp(dir.path / "plans.json")).records.size() == 1);
}

TEST_CASE("a trial plan steers only its own communicator and goes when cleared") {
  PlanTable t("", kH200);  // memory only
  CHECK(t.state().find("memory only") != std::string::npos);
  const PlanRecord saved = record(OpKind::kGemmRs, 8192, PlanKind::kFused, 16);
  t.put(saved);
  t.save();  // memory only: nothing to write, no error
  t.setTrial(7, saved.key, PlanChoice{PlanKind::kDecomposed, 0, 0});
  CHECK(t.trialCount() == 1);
  CHECK(t.find(saved.key, 7)->kind == PlanKind::kDecomposed);
  CHECK(t.find(saved.key, 8)->kind == PlanKind::kFused);  // another communicator sees the table's entry
  CHECK(t.find(saved.key)->kind == PlanKind::kFused);
  const PlanKey other = record(OpKind::kGemmAr, 8192, PlanKind::kAuto, 0).key;
  t.setTrial(7, other, PlanChoice{PlanKind::kFused, 8, 0});
  CHECK(t.find(other, 7)->commSms == 8);
  CHECK_FALSE(t.find(other, 8).has_value());
  t.clearTrials(7);
  CHECK(t.trialCount() == 0);
  CHECK(t.find(saved.key, 7)->kind == PlanKind::kFused);
  CHECK_FALSE(t.find(other, 7).has_value());
}

TEST_CASE("trial plans are bounded: the oldest communicator's go first, and one communicator cannot hold more") {
  PlanTable t("", kH200);
  PlanKey key = record(OpKind::kGemmRs, 8192, PlanKind::kAuto, 0).key;
  for (uint32_t ranks = 1; ranks <= kMaxTrialPlans; ++ranks) {
    key.ranks = ranks;
    t.setTrial(1, key, PlanChoice{PlanKind::kFused, 0, 0});
  }
  key.ranks = static_cast<uint32_t>(kMaxTrialPlans) + 1;
  CHECK_THROWS_WITH_AS(t.setTrial(1, key, PlanChoice{PlanKind::kFused, 0, 0}),
                       doctest::Contains("the most one may"), Error);
  t.setTrial(2, key, PlanChoice{PlanKind::kFused, 0, 0});
  CHECK(t.trialCount() == 1);  // communicator 1's trials were dropped to make room
  CHECK(t.find(key, 2).has_value());
}

TEST_CASE("protocol entries are checked like the file's") {
  v1::PlanEntry e;
  planRecordToProto(record(OpKind::kGemmAr, 8192, PlanKind::kFused, 8), &e);
  CHECK(e.op() == "gemm-ar");
  CHECK(e.kind() == "fused");
  const PlanRecord back = planRecordFromProto(e);
  CHECK(back.key == record(OpKind::kGemmAr, 8192, PlanKind::kFused, 8).key);
  CHECK(back.plan.commSms == 8);
  e.set_kind("sideways");
  CHECK_THROWS_WITH_AS(planRecordFromProto(e), doctest::Contains("not fused or decomposed"), Error);
  const auto names = planFromNames("gemm-rs", "bf16", 2, "m1.n1.k1", "g", "client", "decomposed", 4, 0);
  REQUIRE(names.has_value());
  CHECK(names->second.kind == PlanKind::kDecomposed);
  CHECK_FALSE(planFromNames("moe-dispatch-gemm", "bf16", 2, "b", "g", "client", "fused", 0, 0).has_value());
}

TEST_CASE("the fingerprint can be faked field by field for tests") {
  ::setenv("TANDEM_PLAN_FINGERPRINT", "driver=fake-1;tandem=9.9.9", 1);
  const PlanFingerprint fp = nodeFingerprint("cpu", {});
  ::unsetenv("TANDEM_PLAN_FINGERPRINT");
  CHECK(fp.gpu == "cpu");
  CHECK(fp.driver == "fake-1");
  CHECK(fp.tandem == "9.9.9");
  CHECK(nodeFingerprint("cpu", {}).driver == "none");
  GpuInfo a, b;
  a.name = "NVIDIA H200";
  b.name = "NVIDIA H200";
  CHECK(planGpuModel("cuda", {a, b}) == "NVIDIA H200");
  b.name = "NVIDIA H100";
  CHECK(planGpuModel("cuda", {a, b}) == "NVIDIA H100+NVIDIA H200");
}

TEST_CASE("the table lives in plans.state_dir, else systemd's STATE_DIRECTORY") {
  CHECK(planStateDirectory("/srv/tandem") == "/srv/tandem");
  ::setenv("STATE_DIRECTORY", "/var/lib/tandem:/var/lib/other", 1);
  CHECK(planStateDirectory("") == "/var/lib/tandem");
  ::unsetenv("STATE_DIRECTORY");
  CHECK_FALSE(planStateDirectory("").empty());
}

TEST_CASE("the plans section of the config: its keys, their ranges and values") {
  const DaemonConfig c = parseConfig("plans:\n  state_dir: /tmp/x\n  autotune: on-first-use\n  autotune_runs: 5\n", "t");
  CHECK(c.plans.stateDir == "/tmp/x");
  CHECK(c.plans.autotune == PlanAutotune::kOnFirstUse);
  CHECK(c.plans.autotuneRuns == 5);
  CHECK(parseConfig(configYaml(c), "t") == c);
  CHECK_THROWS_WITH_AS(parseConfig("plans:\n  autotune: sometimes\n", "t"), doctest::Contains("off or on-first-use"),
                       Error);
  CHECK_THROWS_WITH_AS(parseConfig("plans:\n  autotune_runs: 0\n", "t"), doctest::Contains("plans.autotune_runs"),
                       Error);
  CHECK_THROWS_WITH_AS(parseConfig("plans:\n  autotune_runs: 101\n", "t"), doctest::Contains("plans.autotune_runs"),
                       Error);
  CHECK(defaultConfigYaml().find("plans:\n") != std::string::npos);
}
