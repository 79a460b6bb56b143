// Several tandemd processes (cpu backend), each one "node" of one cluster, and tandemctl clients running one
// communicator's ranks across them: what the multi-node tests over tcp and over the verbs test double share. Where the
// test may create network namespaces each node lives in its own, linked through a bridge, so a link can be cut;
// otherwise the nodes use distinct loopback addresses.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "harness.hpp"
#include "netns.hpp"

namespace tandem::testing {

inline constexpr int kClusterPeerDeadlineMs = 1000;

struct ClusterOptions {
  std::string transport = "tcp";                  // cluster.transport
  std::function<std::string(int)> secretOf;       // node i's cluster.secret (default: one secret for all)
  std::vector<std::string> faults;                // node i's TANDEM_VERBS_DOUBLE_FAULTS, if any
  int portSalt = 1;  // ports derive from pid * salt, so parallel test processes on loopback do not collide
};

// A cluster of n daemons with the same node list, each started with its node index.
struct SimCluster {
  SimulatedNodes nodes;
  std::vector<std::string> configs;
  std::vector<std::vector<std::string>> prefixes;
  std::vector<std::unique_ptr<Daemon>> daemons;

  explicit SimCluster(int n, const ClusterOptions& o = {}) : nodes(SimulatedNodes::create(n)) {
    if (!nodes.namespaces()) MESSAGE("network namespaces unavailable (" << nodes.reason() << "): using loopback");
    const int port = 20000 + static_cast<int>((::getpid() * o.portSalt) % 20000);
    std::string list;
    for (int i = 0; i < n; ++i) list += fmt::format("{}\"{}:{}\"", i ? ", " : "", nodes.address(i), port);
    for (int i = 0; i < n; ++i) {
      const std::string secret = o.secretOf ? o.secretOf(i) : "cluster-test-secret-0123456789";
      configs.push_back(fmt::format(
          "communicators:\n  peer_lost_deadline_ms: {}\n"
          "cluster:\n  nodes: [{}]\n  node_index: {}\n  secret: \"{}\"\n  transport: {}\n  connect_timeout_ms: 15000\n"
          "  heartbeat_interval_ms: 50\n  staging_bytes: 4194304\n",
          kClusterPeerDeadlineMs, list, i, secret, o.transport));
      std::vector<std::string> prefix = nodes.prefix(i);
      if (i < static_cast<int>(o.faults.size()) && !o.faults[i].empty())
        prefix.insert(prefix.end(), {"/usr/bin/env", "TANDEM_VERBS_DOUBLE_FAULTS=" + o.faults[i]});
      prefixes.push_back(prefix);
      daemons.push_back(std::make_unique<Daemon>(configs[i], std::vector<std::string>{}, "cpu", prefix));
    }
  }

  // Starts node i's daemon again (after it died) with the same config and prefix: the same address and port.
  void restart(int i) {
    daemons[i].reset();  // reaps it (SIGKILL first if it still runs)
    daemons[i] = std::make_unique<Daemon>(configs[i], std::vector<std::string>{}, "cpu", prefixes[i]);
  }
  // Waits until every daemon sees every other node in `state` (e.g. "connected").
  bool allNodes(const std::string& state, int timeoutMs = 15000) const {
    return clusterNodesIn(daemons, state, timeoutMs);
  }
  std::string logs() const { return clusterLogs(daemons); }
};

inline std::string newId(const Daemon& d) {
  int code = 0;
  std::string id = d.ctl({"new-id"}, &code);
  REQUIRE(code == 0);
  while (!id.empty() && std::isspace(static_cast<unsigned char>(id.back()))) id.pop_back();
  return id;
}

// Starts `tandemctl run` on nodes 0..localRanks.size()-1 at once, node i running localRanks[i], all in one
// communicator. `waitMs` bounds the rendezvous and every wait.
inline std::vector<std::future<CommandResult>> startEverywhere(SimCluster& c, const std::vector<std::string>& args,
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

inline std::vector<CommandResult> runEverywhere(SimCluster& c, const std::vector<std::string>& args,
                                                const std::vector<std::string>& localRanks, int waitMs = 20000) {
  std::vector<CommandResult> results;
  for (auto& f : startEverywhere(c, args, localRanks, waitMs)) results.push_back(f.get());
  return results;
}

// Every node's tandemctl exited 0 (else its output and every daemon's log).
inline void checkAllPass(const SimCluster& c, const std::vector<CommandResult>& results, const std::string& what) {
  for (size_t i = 0; i < results.size(); ++i) {
    INFO(what << " node " << i << ":\n" << results[i].out << results[i].err);
    CHECK(results[i].exitCode == 0);
    if (results[i].exitCode != 0) MESSAGE(c.logs());
  }
}

// Waits until node 0's communicator has completed more than `ops` collectives.
inline void waitForOps(SimCluster& c, uint64_t ops) {
  REQUIRE_MESSAGE(eventually([&] {
    const auto st = daemonStatus(*c.daemons[0]);
    return !st["communicators"].empty() && st["communicators"][0]["ops_completed"].get<uint64_t>() > ops;
  }, 20000), c.logs());
}

}  // namespace tandem::testing
