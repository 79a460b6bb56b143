// Multi-node: several tandemd processes, each one "node", connected by the tcp transport. Where the
// test may create network namespaces each node lives in its own, linked through a bridge, so a link can be
// cut; otherwise the nodes use distinct loopback addresses and a hung node (SIGSTOP) stands in for a cut link.
// Clients are tandemctl processes on every node, each running its share of one communicator's ranks.
// A daemon that is killed and started again with the same config rejoins by itself.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include "cluster_harness.hpp"
#include "every_op.hpp"

using namespace tandem::testing;

namespace {
constexpr int kPeerDeadlineMs = kClusterPeerDeadlineMs;
}  // namespace

TEST_CASE("three nodes run every op across nodes (ag-gemm, gemm-rs, gemm-ar, allgather, barrier, MoE, ring attention), matching the reference") {
  SimCluster c(3);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  // Two ranks per node, then an uneven split (1 + 3 + 2) with odd shapes.
  const std::vector<std::vector<std::string>> splits = {{"0,1", "2,3", "4,5"}, {"0", "1-3", "4,5"}};
  // Every op of the table crosses the nodes here: one without arguments fails, naming this test.
  const auto ops = everyOpAcrossNodes("multinode_test (the tcp cross-node path)");
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

TEST_CASE("three nodes run the GEMM ops across nodes in the nn and tn layouts and with FP8 inputs, matching the reference") {
  SimCluster c(3);
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  for (auto op : gemmVariantsAcrossNodes()) {
    std::string label;
    for (const auto& a : op) label += a + " ";
    op.insert(op.end(), {"--check", "--iters", "2"});
    const auto results = runEverywhere(c, op, {"0", "1-3", "4,5"});
    for (size_t i = 0; i < results.size(); ++i) {
      INFO(label << "node " << i << ":\n" << results[i].out << results[i].err);
      CHECK(results[i].exitCode == 0);
    }
  }
}

TEST_CASE("a daemon killed mid-op: every surviving rank gets PEER_LOST within the deadline") {
  SimCluster c(3);
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
  SimCluster c(2);
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
  SimCluster c(2, {.secretOf = [](int i) {
                     return i == 0 ? std::string("the-right-secret-0123456789") : "a-wrong-secret-9876543210";
                   },
                   .faults = {},
                   .portSalt = 1});
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
  SimCluster c(2);
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
