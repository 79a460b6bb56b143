// The plan table and `tandemctl tune` / `tandemctl advise` end to end on the cpu backend: real tandemd and tandemctl
// processes over a real socket. tune writes the winners into the table's file; a restarted tandemd loads them and
// `tandemctl status` shows them; a faked driver update (TANDEM_PLAN_FINGERPRINT) invalidates the file; advise answers
// the four questions with a table, an SVG plot and --json, showing progress, at one rank and at two.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "harness.hpp"

namespace {

using tandem::testing::Daemon;
using tandem::testing::TempDir;
namespace fs = std::filesystem;
using json = nlohmann::json;

std::string configFor(const fs::path& stateDir) {
  return fmt::format("plans:\n  state_dir: {}\n", stateDir.string());
}

json planStatus(const Daemon& d) {
  const json st = tandem::testing::daemonStatus(d);
  REQUIRE(st.contains("plans"));
  return st["plans"];
}

// Sets an environment variable for the daemons started in its scope (they inherit it at fork).
struct ScopedEnv {
  std::string name;
  ScopedEnv(std::string n, const std::string& value) : name(std::move(n)) { ::setenv(name.c_str(), value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name.c_str()); }
};

}  // namespace

TEST_CASE("tandemctl tune fills the plan table, which survives a restart and is invalidated by a new driver") {
  TempDir state;
  {
    Daemon d(configFor(state.path()));
    const json before = planStatus(d);
    CHECK(before["state"] == "new");
    CHECK(before["entries"].empty());
    int code = -1;
    const std::string out =
        d.ctl({"tune", "gemm-rs,gemm-ar", "--shape", "64x64x64", "--iters", "2", "--warmup", "1"}, &code);
    INFO(out);
    REQUIRE(code == 0);
    CHECK(out.find("saved into tandemd's plan table") != std::string::npos);
    CHECK(out.find("[1/2] gemm-rs 64x64x64") != std::string::npos);  // progress, per layer and plan
    const json after = planStatus(d);
    REQUIRE(after["entries"].size() == 2);
    for (const json& e : after["entries"]) {
      CHECK(e["ranks"] == 1);
      CHECK(e["bucket"] == "m64.n64.k64");
      CHECK(e["gpu"] == "cpu");
      CHECK(e["source"] == "tune");
      CHECK((e["kind"] == "fused" || e["kind"] == "decomposed"));
      CHECK(e["time_us"].get<double>() > 0);
    }
    const std::string text = d.ctl({"status"});
    CHECK(text.find("plan table: " + (state.path() / "plans.json").string()) != std::string::npos);
    CHECK(text.find("gemm-rs") != std::string::npos);
  }
  const fs::path file = state.path() / "plans.json";
  REQUIRE(fs::exists(file));
  const json saved = json::parse(std::ifstream(file));
  CHECK(saved["format"] == "tandem-plan-table");
  CHECK(saved["version"] == 1);
  CHECK(saved["fingerprint"]["gpu"] == "cpu");
  CHECK(saved["entries"].size() == 2);
  {
    Daemon again(configFor(state.path()));
    const json p = planStatus(again);
    CHECK(p["state"] == "loaded 2 entries");
    CHECK(p["entries"].size() == 2);
  }
  {
    ScopedEnv fake("TANDEM_PLAN_FINGERPRINT", "driver=999.0-faked");
    Daemon updated(configFor(state.path()));
    const json p = planStatus(updated);
    INFO(p.dump());
    CHECK(p["state"].get<std::string>().find("invalidated") != std::string::npos);
    CHECK(p["state"].get<std::string>().find("driver none -> 999.0-faked") != std::string::npos);
    CHECK(p["entries"].empty());
    CHECK(p["fingerprint"].get<std::string>().find("999.0-faked") != std::string::npos);
  }
  CHECK(fs::exists(state.path() / "plans.json.invalidated"));
}

TEST_CASE("tandemctl advise answers the four questions with a table, an SVG plot and JSON") {
  TempDir state;
  Daemon d(configFor(state.path()));
  const fs::path svg = state.path() / "advise.svg";
  SUBCASE("one rank, text") {
    int code = -1;
    const std::string out = d.ctl({"advise", "ag-gemm,gemm-rs", "--shape", "64x64x64", "--iters", "2", "--warmup",
                                   "1", "--svg", svg.string()},
                                  &code);
    INFO(out);
    REQUIRE(code == 0);
    for (const char* q : {"Can my shapes overlap at tile granularity?", "Do NVLink and the network both bottleneck?",
                          "Does giving SMs to communication shorten the pipeline?",
                          "Do my model's patterns match the fused ops?", "GEMM alone", "unfused"}) {
      CHECK(out.find(q) != std::string::npos);
    }
    CHECK(out.find("--save writes the winners") != std::string::npos);
    CHECK(planStatus(d)["entries"].empty());  // advise without --save changes nothing
    CHECK(planStatus(d)["trials"] == 0);      // and leaves no trial plan behind
  }
  SUBCASE("two ranks, JSON, --save, layers from a file") {
    const fs::path layers = state.path() / "layers.json";
    std::ofstream(layers) << R"({"layers": [
        {"name": "attn.o", "op": "gemm-rs", "m": 64, "n": 64, "k": 128},
        {"name": "mlp.up", "op": "ag-gemm", "m": 64, "n": 128, "k": 64}]})";
    int code = -1;
    const std::string out = d.ctl({"advise", "--from-json", layers.string(), "--ranks", "2", "--iters", "2",
                                   "--warmup", "1", "--json", "--save", "--svg", svg.string()},
                                  &code);
    INFO(out);
    REQUIRE(code == 0);
    const json j = json::parse(out.substr(out.find('{')));
    REQUIRE(j["layers"].size() == 2);
    CHECK(j["ranks"] == 2);
    for (const json& l : j["layers"]) {
      CHECK(l["gemm_alone_us"].is_number());
      CHECK(l["baseline_us"].is_number());
      CHECK(l["decomposed_us"].is_number());
      CHECK(l["fused"].size() >= 3);
      CHECK(l.contains("best"));
      CHECK(l["errors"].empty());
    }
    CHECK(j["layers"][1]["allgather_us"].is_number());  // ag-gemm's unfused baseline: the all-gather, then the GEMM
    CHECK(j["link"]["gb_per_s"].get<double>() > 0);
    for (const char* key : {"overlap", "bottleneck", "comm_sms", "patterns"}) CHECK_FALSE(j["answers"][key].empty());
    CHECK(j["saved"] == 2);
    const json p = planStatus(d);
    CHECK(p["entries"].size() == 2);
    CHECK(p["entries"][0]["source"] == "advise");
    CHECK(p["entries"][0]["ranks"] == 2);
  }
  REQUIRE(fs::exists(svg));
  std::ifstream in(svg);
  const std::string plot((std::istreambuf_iterator<char>(in)), {});
  CHECK(plot.rfind("<svg", 0) == 0);
  CHECK(plot.find("polyline") != std::string::npos);
  CHECK(plot.find("GEMM alone") != std::string::npos);
}

TEST_CASE("tandemctl advise refuses what it cannot measure, saying how to ask") {
  Daemon d;
  int code = -1;
  std::string out = d.ctl({"advise", "gemm-rs"}, &code);
  CHECK(code == 2);
  CHECK(out.find("--shape MxNxK") != std::string::npos);
  out = d.ctl({"advise", "allgather", "--shape", "64x64x64"}, &code);
  CHECK(code == 2);
  CHECK(out.find("give ag-gemm, gemm-rs or gemm-ar") != std::string::npos);
  out = d.ctl({"advise", "gemm-rs", "--shape", "64x64"}, &code);
  CHECK(code == 2);
  CHECK(out.find("is not MxNxK") != std::string::npos);
}
