// The cluster over the verbs transport (cluster.transport: verbs), on the verbs test double: several real tandemd
// processes, each one "node", whose QPs are set up through the cluster's bootstrap handshake, whose staging memory is
// registered once per communicator and whose completions the proxy polls. ctest runs this executable with the double
// first in LD_LIBRARY_PATH (tests/support/verbs_double), so the same tandemd binary that runs on rdma-core runs on
// it. Nodes live in network namespaces where the test may create them, else on distinct loopback addresses.
// These tests check behaviour (every op the cpu backend runs across nodes, QP errors and a killed daemon releasing
// every rank, the next communicator served); the double makes no speed claim.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <fstream>

#include "cluster_harness.hpp"
#include "every_op.hpp"
#include "verbs_double/verbs_double.hpp"

using namespace tandem::testing;

namespace {

constexpr int kPeerDeadlineMs = kClusterPeerDeadlineMs;

// The cluster on the verbs transport; `faults[i]` (if any) is node i's TANDEM_VERBS_DOUBLE_FAULTS.
ClusterOptions verbs(std::vector<std::string> faults = {}) {
  return {.transport = "verbs", .secretOf = {}, .faults = std::move(faults), .portSalt = 7};
}

const std::vector<std::string> kGemmRsCheck = {"gemm-rs", "--ranks", "4", "--m", "37", "--n", "19", "--k", "48",
                                               "--check"};

}  // namespace

TEST_CASE("verbs cluster: three nodes run every op across nodes on the verbs double, matching the reference") {
  SimCluster c(3, verbs());
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  const auto st = daemonStatus(*c.daemons[0]);
  CHECK(st["cluster"]["transport"] == "verbs");
  // The daemons really run on the double: its device is the one each transport opened.
  REQUIRE_MESSAGE(c.daemons[1]->log().find("tandem_double0") != std::string::npos,
                  verbs_double::notLoadedReason() << "\n" << c.daemons[1]->log());
  const std::vector<std::string> split = {"0", "1-3", "4,5"};  // uneven: 1 + 3 + 2 ranks
  // Every op of the table crosses the nodes here: one without arguments fails, naming this test.
  const auto ops = everyOpAcrossNodes("verbs_cluster_test (the verbs cross-node path)");
  for (auto op : ops) {
    op.insert(op.end(), {"--check", "--iters", "3"});
    checkAllPass(c, runEverywhere(c, op, split), op[0]);
  }
  // Large enough to cut the staging payload into many RDMA WRITEs over both QPs of each peer.
  checkAllPass(c, runEverywhere(c, {"allgather", "--ranks", "3", "--bytes", "3000000", "--check"}, {"0", "1", "2"}),
               "allgather 3 MB");
  CHECK(daemonStatus(*c.daemons[1])["communicators"].empty());
}

TEST_CASE("verbs cluster: a QP error injected mid-op releases every rank with the peer lost, and the next communicator runs") {
  // Node 1's 60th RDMA WRITE fails (its QP to node 0 enters the error state): a few dozen ops into the run.
  SimCluster c(2, verbs({"", "qp_error_after_writes=60"}));
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  auto futures = startEverywhere(c, {"gemm-ar", "--ranks", "4", "--m", "32", "--n", "32", "--k", "64", "--iters",
                                     "1000000"}, {"0,1", "2,3"});
  for (size_t i = 0; i < futures.size(); ++i) {
    REQUIRE_MESSAGE(futures[i].wait_for(std::chrono::seconds(30)) == std::future_status::ready, c.logs());
    const CommandResult r = futures[i].get();
    INFO("node " << i << ":\n" << r.out << r.err);
    CHECK(r.exitCode != 0);
    CHECK(r.out.find(fmt::format("node {}", 1 - i)) != std::string::npos);
  }
  // Node 0 learns of the QP error one of two ways, whichever comes first: node 1's "queue pairs down" message over the
  // bootstrap link, or its own next write to node 1 failing (the peer's QP is in the error state). Either names node 1.
  const std::string log0 = c.daemons[0]->log();
  CHECK_MESSAGE((log0.find("node 1 lost its queue pairs") != std::string::npos ||
                 log0.find("node 1 lost: work request") != std::string::npos),
                log0);
  // The leader sets up new QPs; the nodes are connected again and serve the next communicator.
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  checkAllPass(c, runEverywhere(c, kGemmRsCheck, {"0,1", "2,3"}), "gemm-rs after the QP error");
}

TEST_CASE("verbs cluster: delayed completions slow the proxy down but every op still matches the reference") {
  SimCluster c(2, verbs({"delay_completions_ms=3", "delay_completions_ms=3"}));
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  checkAllPass(c, runEverywhere(c, {"gemm-ar", "--ranks", "3", "--m", "29", "--n", "16", "--k", "48", "--check",
                                    "--iters", "4"}, {"0", "1,2"}), "gemm-ar with delayed completions");
  checkAllPass(c, runEverywhere(c, {"ag-gemm", "--ranks", "2", "--m", "16", "--n", "8", "--k", "16", "--check"},
                                {"0", "1"}), "ag-gemm with delayed completions");
}

TEST_CASE("verbs cluster: a daemon killed mid-op (its HCA disappears) fails the survivors within the deadline, and they serve the next communicator") {
  SimCluster c(3, verbs());
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  auto futures = startEverywhere(c, {"gemm-ar", "--ranks", "3", "--m", "64", "--n", "64", "--k", "96", "--iters",
                                     "1000000"}, {"0", "1", "2"});
  waitForOps(c, 20);
  const auto killedAt = Clock::now();
  c.daemons[2]->signal(SIGKILL);
  for (int i = 0; i < 2; ++i) {
    const CommandResult r = futures[static_cast<size_t>(i)].get();
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count();
    INFO("node " << i << " after " << ms << " ms:\n" << r.out << r.err);
    CHECK(r.exitCode != 0);
    CHECK(r.out.find("node 2") != std::string::npos);
    CHECK(ms < kPeerDeadlineMs + 3000);
  }
  futures[2].get();
  checkAllPass(c, runEverywhere(c, {"gemm-rs", "--ranks", "2", "--m", "16", "--n", "8", "--k", "16", "--check"},
                                {"0", "1"}), "gemm-rs between the survivors");
}

TEST_CASE("verbs cluster: a cut link (or a hung node) fails the surviving ranks within the deadline through the bootstrap's heartbeats") {
  SimCluster c(2, verbs());
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  auto futures = startEverywhere(c, {"ag-gemm", "--ranks", "4", "--m", "32", "--n", "32", "--k", "32", "--iters",
                                     "1000000"}, {"0,1", "2,3"});
  waitForOps(c, 20);
  const auto cutAt = Clock::now();
  // A cut link stops the bootstrap's tcp connection only (the double's queue pairs use unix sockets), a hung node
  // stops its HCA too: either way only the heartbeat deadline can tell, as on a real fabric.
  if (c.nodes.namespaces()) {
    c.nodes.cutLink(1);
  } else {
    c.daemons[1]->signal(SIGSTOP);
  }
  const CommandResult r = futures[0].get();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - cutAt).count();
  INFO("node 0 after " << ms << " ms:\n" << r.out << r.err);
  CHECK(r.exitCode != 0);
  CHECK(r.out.find("node 1") != std::string::npos);
  CHECK(ms < kPeerDeadlineMs + 3000);
  if (!c.nodes.namespaces()) c.daemons[1]->signal(SIGKILL);
  futures[1].get();
  CHECK(daemonStatus(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed");
}

TEST_CASE("verbs cluster: a daemon killed and restarted rejoins with new queue pairs, and new communicators span it") {
  SimCluster c(2, verbs());
  REQUIRE_MESSAGE(c.allNodes("connected"), c.logs());
  checkAllPass(c, runEverywhere(c, kGemmRsCheck, {"0,1", "2,3"}), "gemm-rs before the restart");
  c.daemons[1]->signal(SIGKILL);
  REQUIRE_MESSAGE(eventually([&] { return daemonStatus(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed"; },
                             5000), c.logs());
  c.restart(1);  // a new process: a new HCA (a new GID), so only new queue pairs can reach it
  REQUIRE_MESSAGE(c.allNodes("connected", 15000), c.logs());
  for (const auto& split : std::vector<std::vector<std::string>>{{"0,1", "2,3"}, {"0", "1-3"}})
    checkAllPass(c, runEverywhere(c, kGemmRsCheck, split), "gemm-rs after the restart");
}

TEST_CASE("cluster.transport: verbs without an RDMA device: tandemd exits 69 saying so and naming the fix") {
  TempDir dir;
  const std::string config = (dir.path() / "verbs.yaml").string();
  std::ofstream(config) << "daemon:\n  backend: cpu\n"
                           "cluster:\n  nodes: [\"127.0.0.1:7301\", \"127.0.0.1:7302\"]\n  node_index: 0\n"
                           "  secret: \"cluster-transport-test-secret\"\n  transport: verbs\n";
  // The double with no device stands in for a host without a NIC (on rdma-core the result depends on the host).
  const auto r = runCommand({"/usr/bin/env", "TANDEM_VERBS_DOUBLE_DEVICES=0", TANDEMD_PATH, "--foreground", "--config",
                             config, "--socket", (dir.path() / "s").string()});
  CHECK(r.exitCode == 69);
  CHECK_MESSAGE(r.err.find("no RDMA device") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("set cluster.transport: tcp") != std::string::npos, r.err);
}
