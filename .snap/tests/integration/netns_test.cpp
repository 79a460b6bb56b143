// The simulated-nodes harness (tests/support/netns.hpp): nodes in network namespaces linked through a bridge, links
// cut and restored, namespaces removed afterwards; or, where namespaces are unavailable, the loopback fallback.
// (Test names avoid ';': doctest_discover_tests would split them into several CTest names.)
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>

#include "harness.hpp"
#include "netns.hpp"

using namespace tandem::testing;

namespace {

bool listed(const std::string& name) {
  const auto names = SimulatedNodes::listNamespaces(findTool("ip"));
  return std::find(names.begin(), names.end(), name) != names.end();
}

long msSince(Clock::time_point t0) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
}

}  // namespace

TEST_CASE("simulated nodes: three nodes reach each other, a cut link fails fast and recovers, cleanup is complete") {
  const auto start = Clock::now();
  std::vector<std::string> names;
  {
    auto nodes = SimulatedNodes::create(3);
    REQUIRE(nodes.size() == 3);
    CHECK(nodes.address(0) != nodes.address(1));
    CHECK(nodes.address(1) != nodes.address(2));
    std::string detail;

    if (!nodes.namespaces()) {
      MESSAGE("network namespaces are unavailable, so the nodes share the host's loopback: " << nodes.reason());
      CHECK_FALSE(nodes.reason().empty());
      CHECK(nodes.address(0) == "127.0.0.1");
      CHECK(nodes.address(2) == "127.0.0.3");
      CHECK(nodes.prefix(1).empty());
      CHECK(nodes.namespaceNames().empty());
      CHECK_THROWS_AS(nodes.cutLink(1), std::logic_error);
      CHECK_MESSAGE(nodes.canConnect(0, 1, 2000, &detail), detail);
      CHECK_MESSAGE(nodes.canConnect(2, 0, 2000, &detail), detail);
      return;
    }

    CHECK(nodes.reason().empty());
    names = nodes.namespaceNames();
    REQUIRE(names.size() == 4);  // hub + 3 nodes
    for (const auto& name : names) {
      CAPTURE(name);
      CHECK(name.rfind("tnd-" + std::to_string(::getpid()) + "-", 0) == 0);
      CHECK(listed(name));
    }
    const auto prefix = nodes.prefix(0);
    REQUIRE(prefix.size() == 4);
    CHECK(prefix[1] == "netns");
    CHECK(prefix[3] == nodes.name(0));

    // The prefix runs a command inside the node: it sees its own address (and lo up), not another node's.
    std::vector<std::string> argv = prefix;
    argv.insert(argv.end(), {prefix[0], "-o", "addr", "show"});
    const CommandResult addrs = runCommand(argv, 5000);
    INFO(addrs.out << addrs.err);
    CHECK(addrs.exitCode == 0);
    CHECK(addrs.out.find(nodes.address(0) + "/24") != std::string::npos);
    CHECK(addrs.out.find(nodes.address(1) + "/") == std::string::npos);
    CHECK(addrs.out.find("127.0.0.1/8") != std::string::npos);

    CHECK_MESSAGE(nodes.canConnect(0, 1, 2000, &detail), detail);
    CHECK_MESSAGE(nodes.canConnect(2, 1, 2000, &detail), detail);
    CHECK_MESSAGE(nodes.canConnect(1, 1, 2000, &detail), detail);  // a node reaches its own address

    nodes.cutLink(1);
    auto t0 = Clock::now();
    CHECK_FALSE_MESSAGE(nodes.canConnect(0, 1, 1000, &detail), detail);
    CHECK(msSince(t0) < 2500);
    MESSAGE("after cutLink(1): " << detail);
    CHECK_FALSE_MESSAGE(nodes.canConnect(1, 2, 1000, &detail), detail);  // and node 1 reaches nobody
    CHECK_MESSAGE(nodes.canConnect(0, 2, 2000, &detail), detail);        // the others are unaffected

    nodes.restoreLink(1);
    t0 = Clock::now();
    CHECK_MESSAGE(nodes.canConnect(0, 1, 2000, &detail), detail);
    CHECK_MESSAGE(nodes.canConnect(1, 2, 2000, &detail), detail);
    CHECK(msSince(t0) < 2000);
  }
  for (const auto& name : names) {
    CAPTURE(name);
    CHECK_FALSE(listed(name));
  }
  CHECK(msSince(start) < 5000);
}

TEST_CASE("simulated nodes: stale namespaces of dead test processes are removed, a daemon runs inside a node") {
  const std::string ip = findTool("ip");
  const pid_t dead = ::fork();  // a pid that is certainly gone once reaped (reuse within this test is improbable)
  if (dead == 0) std::_Exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = "tnd-" + std::to_string(dead) + "-0-hub";
  const bool staleMade = !ip.empty() && runCommand({ip, "netns", "add", stale}, 5000).exitCode == 0;

  auto nodes = SimulatedNodes::create(1);
  if (!nodes.namespaces()) {
    if (staleMade) runCommand({ip, "netns", "delete", stale}, 5000);
    MESSAGE("network namespaces are unavailable (" << nodes.reason() << "); only the fallback is checked");
    Daemon d("", {}, "cpu", nodes.prefix(0));  // an empty prefix: the ordinary daemon
    CHECK(daemonStatus(d)["backend"] == "cpu");
    return;
  }
  REQUIRE(staleMade);
  CHECK_FALSE(listed(stale));
  if (listed(stale)) runCommand({ip, "netns", "delete", stale}, 5000);

  // The daemon runs in the node's namespace (`ip netns exec` execs in place, so pid() is tandemd's pid); its Unix
  // socket is on the shared file system, so tandemctl reaches it from the host's namespace.
  Daemon d("", {}, "cpu", nodes.prefix(0));
  struct stat mine{}, its{};
  REQUIRE(::stat(("/var/run/netns/" + nodes.name(0)).c_str(), &mine) == 0);
  REQUIRE(::stat(("/proc/" + std::to_string(d.pid()) + "/ns/net").c_str(), &its) == 0);
  CHECK(mine.st_ino == its.st_ino);
  CHECK(daemonStatus(d)["backend"] == "cpu");
}
