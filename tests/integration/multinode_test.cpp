// Multi-node (issue 7): several tandemd processes, each one "node", connected by the tcp transport. Where the
// test may create network namespaces each node lives in its own, linked through a bridge, so a link can be
// cut; otherwise the nodes use distinct loopback addresses and a hung node (SIGSTOP) stands in for a cut link.
// Clients are tandemctl processes on every node, each running its share of one communicator's ranks.
// A daemon that is killed and started again with the same config rejoins by itself.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <future>

#include "harness.hpp"
#include "netns.hpp"

using namespace tandem::testing;

namespace {

constexpr int kPeerDeadlineMs = 1000;

// A cluster of n daemons. Ports derive from the pid so parallel test processes on loopback do not collide.
struct Cluster {
  SimulatedNodes nodes;
  std::vector<std::string> configs;
  std::vector<std::unique_ptr<Daemon>> daemons;

  explicit Cluster(int n, const std::function<std::string(int)>& secretOf = {})
      : nodes(SimulatedNodes::create(n)) {
    if (!nodes.namespaces()) MESSAGE("network namespaces unavailable (" << nodes.reason() << "): using loopback");
    const int port = 20000 + static_cast<int>(::getpid() % 20000);
    std::string list;
    for (int i = 0; i < n; ++i) list += fmt::format("{}\"{}:{}\"", i ? ", " : "", nodes.address(i), port);
    for (int i = 0; i < n; ++i) {
      const std::string secret = secretOf ? secretOf(i) : "multinode-test-secret-0123456789";
      const std::string config = fmt::format(
          "communicators:\n  peer_lost_deadline_ms: {}\n"
          "cluster:\n  nodes: [{}]\n  node_index: {}\n  secret: \"{}\"\n  connect_timeout_ms: 15000\n"
          "  heartbeat_interval_ms: 50\n  staging_bytes: 4194304\n",
          kPeerDeadlineMs, list, i, secret);
      configs.push_back(config);
      daemons.push_back(std::make_unique<Daemon>(config, std::vector<std::string>{}, "cpu", nodes.prefix(i)));
    }
  }

  // Starts node i's daemon again (after it died) with the same config: the same address and port.
  void restart(int i) {
    daemons[i].reset();  // reaps it (SIGKILL first if it still runs)
    daemons[i] = std::make_unique<Daemon>(configs[i], std::vector<std::string>{}, "cpu", nodes.prefix(i));
  }

  // Waits until every daemon sees every other node in `state` (e.g. "connected").
  bool allNodes(const std::string& state, int timeoutMs = 15000) const {
    return clusterNodesIn(daemons, state, timeoutMs);
  }
  std::string logs() const { return clusterLogs(daemons); }
};

std::string newId(const Daemon& d) {
  int code = 0;
  std::string id = d.ctl({"new-id"}, &code);
  REQUIRE(code == 0);
  while (!id.empty() && std::isspace(static_cast<unsigned char>(id.back()))) id.pop_back();
  return id;
}

// Starts `tandemctl run` on nodes 0..localRanks.size()-1 at once, node i running localRanks[i], all in one
// communicator. `waitMs` bounds the rendezvous and every wait.
std::vector<std::future<CommandResult>> startEverywhere(Cluster& c, const std::vector<std::string>& args,
                                                        const std::vector<std::string>& localRanks,
                                                        int waitMs = 20000) {
  const std::string id = newId(*c.daemons[0]);
  std::vector<std::future<CommandResult>> futures;
  for (size_t i = 0; i < localRanks.size(); ++i) {
    std::vector<std::string> argv = {TANDEMCTL_PATH, "--socket", c.daemons[i]->socket(), "run"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--id", id, "--local-ranks", localRanks[i], "--timeout-ms", std::to_string(waitMs)});
    futures.push_back(std::async(std::launch::async, [argv, waitMs] { return runCommand(argv, waitMs + 40000); }));
  }
  return futures;
}

std::vector<CommandResult> runEverywhere(Cluster& c, const std::vector<std::string>& args,
                                         const std::vector<std::string>& localRanks, int waitMs = 20000) {
  std::vector<CommandResult> results;
  for (auto& f : startEverywhere(c, args, localRanks, waitMs)) results.push_back(f.get());
  return results;
}

// Waits until node 0's communicator has completed more than `ops` collectives.
void waitForOps(Cluster& c, uint64_t ops) {
  REQUIRE(eventually([&] {
    const auto st = daemonStatus(*c.daemons[0]);
    return !st["communicators"].empty() && st["communicators"][0]["ops_completed"].get<uint64_t>() > ops;
  }, 20000));
}

}  // namespace

TEST_CASE("three nodes run every op across nodes (ag-gemm, gemm-rs, gemm-ar, allgather, barrier, MoE, ring attention), matching the reference") {
  Cluster c(3);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  // Two ranks per node, then an uneven split (1 + 3 + 2) with odd shapes.
  const std::vector<std::vector<std::string>> splits = {{"0,1", "2,3", "4,5"}, {"0", "1-3", "4,5"}};
  const std::vector<std::vector<std::string>> ops = {
      {"ag-gemm", "--ranks", "6", "--m", "37", "--n", "19", "--k", "24"},
      {"gemm-rs", "--ranks", "6", "--m", "37", "--n", "19", "--k", "48"},
      {"gemm-ar", "--ranks", "6", "--m", "29", "--n", "16", "--k", "48", "--dtype", "fp16"},
      {"allgather", "--ranks", "6", "--bytes", "1001"},
      {"barrier", "--ranks", "6"},
      {"moe-dispatch-gemm", "--ranks", "6", "--m", "5", "--k", "16", "--n", "12", "--experts", "12", "--topk", "2"},
      {"moe-dispatch-ffn-combine", "--ranks", "6", "--m", "4", "--k", "16", "--n", "24", "--experts", "6", "--topk", "2"},
      {"ring-attention", "--ranks", "6", "--seq", "29", "--heads", "2", "--head-dim", "8"},
  };
  for (const auto& split : splits) {
    for (auto op : ops) {
      op.insert(op.end(), {"--check", "--iters", "3"});
      const auto results = runEverywhere(c, op, split);
      for (size_t i = 0; i < results.size(); ++i) {
        INFO(op[0] << " node " << i << " ranks " << split[i] << ":\n" << results[i].out << results[i].err);
        CHECK(results[i].exitCode == 0);
        if (results[i].exitCode != 0) MESSAGE(c.logs());
      }
    }
  }
  // Every node reports its share of the communicators it ran, and nothing is left behind.
  const auto st = daemonStatus(*c.daemons[1]);
  CHECK(st["cluster"]["self"] == 1);
  CHECK(st["communicators"].empty());
}

TEST_CASE("a daemon killed mid-op: every surviving rank gets PEER_LOST within the deadline") {
  Cluster c(3);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  auto futures = startEverywhere(c, {"gemm-ar", "--ranks", "3", "--m", "64", "--n", "64", "--k", "96", "--iters",
                                     "1000000"}, {"0", "1", "2"});
  // Let the ranks run ops for a while, then kill node 2's daemon.
  waitForOps(c, 20);
  const auto killedAt = Clock::now();
  c.daemons[2]->signal(SIGKILL);
  for (int i = 0; i < 2; ++i) {
    const CommandResult r = futures[i].get();
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count();
    INFO("node " << i << " after " << ms << " ms:\n" << r.out << r.err);
    CHECK(r.exitCode != 0);
    CHECK(r.out.find("node 2") != std::string::npos);
    CHECK(ms < kPeerDeadlineMs + 3000);
  }
  futures[2].get();
  // The survivors stay healthy: a communicator between them works.
  const auto results = runEverywhere(c, {"gemm-rs", "--ranks", "2", "--m", "16", "--n", "8", "--k", "16", "--check"},
                                     {"0", "1"});
  CHECK(results[0].exitCode == 0);
  CHECK(results[1].exitCode == 0);
}

TEST_CASE("a cut link (or a hung node) fails every surviving rank within the deadline, and nothing hangs") {
  Cluster c(2);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  auto futures = startEverywhere(c, {"ag-gemm", "--ranks", "4", "--m", "32", "--n", "32", "--k", "32", "--iters",
                                     "1000000"}, {"0,1", "2,3"});
  waitForOps(c, 20);
  const auto cutAt = Clock::now();
  if (c.nodes.namespaces()) {
    c.nodes.cutLink(1);
  } else {
    c.daemons[1]->signal(SIGSTOP);  // silent, not dead: only the heartbeat deadline can find it
  }
  const CommandResult r = futures[0].get();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - cutAt).count();
  INFO("node 0 after " << ms << " ms:\n" << r.out << r.err);
  CHECK(r.exitCode != 0);
  CHECK(r.out.find("node 1") != std::string::npos);
  CHECK(ms < kPeerDeadlineMs + 3000);
  if (c.nodes.namespaces()) {
    // Node 1 lost node 0 the same way.
    const CommandResult r1 = futures[1].get();
    INFO("node 1:\n" << r1.out << r1.err);
    CHECK(r1.exitCode != 0);
    CHECK(r1.out.find("node 0") != std::string::npos);
  } else {
    c.daemons[1]->signal(SIGKILL);
    futures[1].get();
  }
  CHECK(daemonStatus(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed");
}

TEST_CASE("a node with a different cluster secret is refused, with the reason on both sides") {
  Cluster c(2, [](int i) { return i == 0 ? std::string("the-right-secret-0123456789") : "a-wrong-secret-9876543210"; });
  REQUIRE_MESSAGE(c.allNodes("failed"), c.logs());
  for (int i = 0; i < 2; ++i) {
    const auto st = daemonStatus(*c.daemons[i]);
    const std::string reason = st["cluster"]["nodes"][1 - i]["reason"];
    INFO("node " << i << ": " << reason);
    CHECK(reason.find("secret") != std::string::npos);
  }
  // A communicator that needs both nodes cannot form: its ranks time out instead of hanging.
  const auto results = runEverywhere(c, {"barrier", "--ranks", "2"}, {"0", "1"}, 2000);
  for (const auto& r : results) {
    INFO(r.out << r.err);
    CHECK(r.exitCode != 0);
  }
}

TEST_CASE("a daemon killed and restarted with the same config rejoins by itself, and new communicators span it") {
  Cluster c(2);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  const std::vector<std::string> gemmRs = {"gemm-rs", "--ranks", "4", "--m", "37", "--n", "19", "--k", "48", "--check"};
  for (const auto& r : runEverywhere(c, gemmRs, {"0,1", "2,3"})) {
    INFO(r.out << r.err);
    REQUIRE(r.exitCode == 0);
  }
  c.daemons[1]->signal(SIGKILL);
  REQUIRE_MESSAGE(eventually([&] { return daemonStatus(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed"; },
                             5000), c.logs());
  const auto restartedAt = Clock::now();
  c.restart(1);  // systemd's Restart=on-failure, in short
  REQUIRE_MESSAGE(c.allNodes("connected", 15000), c.logs());
  MESSAGE("both nodes connected again ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - restartedAt).count(),
          " ms after the restart began");
  CHECK(daemonStatus(*c.daemons[0])["cluster"]["nodes"][1]["reason"] == "");
  // Communicators across the rejoined node work, in both splits of the ranks.
  for (const auto& split : std::vector<std::vector<std::string>>{{"0,1", "2,3"}, {"0", "1-3"}}) {
    const auto results = runEverywhere(c, gemmRs, split);
    for (size_t i = 0; i < results.size(); ++i) {
      INFO("node " << i << " ranks " << split[i] << ":\n" << results[i].out << results[i].err);
      CHECK(results[i].exitCode == 0);
      if (results[i].exitCode != 0) MESSAGE(c.logs());
    }
  }
}
