// tandemd's choice of cluster transport: the cluster's control messages need a transport with a control channel
// (transport::ControlChannel), so a transport without one is refused at startup, as a config error that says why.
#include <doctest/doctest.h>

#include <fstream>

#include "harness.hpp"

using namespace tandem::testing;

TEST_CASE("cluster.transport: verbs is refused at startup with exit 78, saying it has no control channel") {
  TempDir dir;
  const std::string config = (dir.path() / "verbs.yaml").string();
  std::ofstream(config) << "daemon:\n  backend: cpu\n"
                           "cluster:\n  nodes: [\"127.0.0.1:7301\", \"127.0.0.1:7302\"]\n  node_index: 0\n"
                           "  secret: \"cluster-transport-test-secret\"\n  transport: verbs\n";
  const auto r = runCommand({TANDEMD_PATH, "--foreground", "--config", config, "--socket", (dir.path() / "s").string()});
  CHECK(r.exitCode == 78);
  CHECK_MESSAGE(r.err.find("cluster.transport: verbs") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("no control channel") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("set cluster.transport: tcp") != std::string::npos, r.err);
}
