// tandemd's config loader: defaults, the shipped config/tandemd.yaml, good files, and the text of every error.
// The cluster section: node addresses, the node index, the secret (inline or from a file), ranges.
#include "config.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>

#include "tandem/common/error.hpp"

namespace {

using tandem::ErrorCode;
using namespace tandem::daemon;

// The message parseConfig throws for `yaml` (read as "tandemd.yaml"); fails the test if it accepts it.
std::string configError(const std::string& yaml) {
  try {
    parseConfig(yaml, "tandemd.yaml");
  } catch (const tandem::Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidConfig);
    return e.what();
  }
  FAIL("parseConfig accepted this file:\n" << yaml);
  return {};
}

// Checks that the error for `yaml` contains every fragment (the source, line:column, key path, the fix).
void checkError(const std::string& yaml, std::initializer_list<std::string_view> fragments) {
  const std::string message = configError(yaml);
  INFO("file:\n" << yaml);
  INFO("error: " << message);
  for (const std::string_view fragment : fragments) {
    CHECK_MESSAGE(message.find(fragment) != std::string::npos, "missing: " << fragment);
  }
}

// The message `fn` throws as Error(kInvalidConfig); fails the test if it does not throw.
template <typename Fn>
std::string invalidConfigError(Fn&& fn) {
  try {
    fn();
  } catch (const tandem::Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidConfig);
    return e.what();
  }
  FAIL("no error was thrown");
  return {};
}

// Two nodes and an inline secret: the smallest valid multi-node cluster section, followed by `extra` lines.
std::string twoNodes(const std::string& extra = "") {
  return "cluster:\n"
         "  nodes: [\"10.0.0.1:7100\", \"10.0.0.2:7100\"]\n"
         "  secret: 0123456789abcdef0123\n" +
         extra;
}

std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A file in a fresh directory under the system temp dir, removed with the object.
class TempFile {
 public:
  explicit TempFile(const std::string& text)
      : dir_(std::filesystem::temp_directory_path() / ("tandem_config_test." + std::to_string(::getpid()))) {
    std::filesystem::create_directories(dir_);
    std::ofstream(path(), std::ios::binary) << text;
  }
  ~TempFile() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  std::filesystem::path dir() const { return dir_; }
  std::filesystem::path path() const { return dir_ / "tandemd.yaml"; }
  // Another file next to it, removed with the object.
  std::string sibling(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return (dir_ / name).string();
  }

 private:
  std::filesystem::path dir_;
};

}  // namespace

TEST_SUITE("config") {
  TEST_CASE("the default config prints as YAML that parses back to the defaults") {
    const DaemonConfig defaults;
    CHECK_NOTHROW(validateConfig(defaults));
    CHECK(parseConfig(defaultConfigYaml(), "default") == defaults);
    CHECK(defaultConfigYaml() == configYaml(defaults));
  }

  TEST_CASE("config/tandemd.yaml is exactly what --print-default-config prints") {
    const std::filesystem::path shipped = std::filesystem::path(TANDEM_SOURCE_DIR) / "config" / "tandemd.yaml";
    REQUIRE_MESSAGE(std::filesystem::exists(shipped),
                    shipped.string() << " is missing; regenerate with tandemd --print-default-config > "
                                        "config/tandemd.yaml");
    const std::string actual = readFile(shipped);
    const std::string expected = defaultConfigYaml();
    // Report the first differing line rather than two whole files.
    std::istringstream actualLines(actual);
    std::istringstream expectedLines(expected);
    std::string actualLine;
    std::string expectedLine;
    int line = 0;
    while (actual != expected) {
      ++line;
      const bool moreActual = static_cast<bool>(std::getline(actualLines, actualLine));
      const bool moreExpected = static_cast<bool>(std::getline(expectedLines, expectedLine));
      if (actualLine != expectedLine || moreActual != moreExpected || (!moreActual && !moreExpected)) break;
    }
    CHECK_MESSAGE(actual == expected, "config/tandemd.yaml differs from the built-in defaults at line "
                                          << line << ":\n  file:     " << actualLine << "\n  defaults: " << expectedLine
                                          << "\nregenerate with tandemd --print-default-config > config/tandemd.yaml");
  }

  TEST_CASE("an empty file or one with only comments gives the defaults") {
    const DaemonConfig defaults;
    CHECK(parseConfig("", "empty.yaml") == defaults);
    CHECK(parseConfig("# nothing set\n\n   # still nothing\n", "comments.yaml") == defaults);
    CHECK(parseConfig("---\n", "marker.yaml") == defaults);
    CHECK(parseConfig("daemon:\nrings: ~\n", "empty-sections.yaml") == defaults);
  }

  TEST_CASE("a file that sets every key parses into those values") {
    const std::string yaml =
        "daemon:\n"
        "  socket: /run/tandem/test.sock\n"
        "  backend: cpu\n"
        "  executor: client\n"
        "  log_level: debug\n"
        "  worker_threads: 3\n"
        "access:\n"
        "  allowed_uids: [1000, 1001]\n"
        "  allowed_gids:\n"
        "    - 27\n"
        "  socket_mode: 0600\n"
        "limits:\n"
        "  max_frame_bytes: 65536\n"
        "  max_buffer_bytes: 1073741824\n"
        "  max_session_bytes: 2147483648\n"
        "  max_sessions: 8\n"
        "rings:\n"
        "  capacity: 1024\n"
        "  poll_window_us: 0\n"
        "communicators:\n"
        "  join_timeout_ms: 500\n"
        "  peer_lost_deadline_ms: 100\n"
        "cuda:\n"
        "  devices: [GPU-0a1b, \"GPU-2c3d\"]\n"
        "  daemon_linger_ms: 0\n"
        "  comm_sms: 16\n";
    const DaemonConfig c = parseConfig(yaml, "full.yaml");
    CHECK(c.daemon.socket == "/run/tandem/test.sock");
    CHECK(c.daemon.backend == BackendKind::kCpu);
    CHECK(c.daemon.executor == ExecutorKind::kClient);
    CHECK(c.daemon.logLevel == "debug");
    CHECK(c.daemon.workerThreads == 3);
    CHECK(c.access.allowedUids == std::vector<uint32_t>{1000, 1001});
    CHECK(c.access.allowedGids == std::vector<uint32_t>{27});
    CHECK(c.access.socketMode == 0600);
    CHECK(c.limits.maxFrameBytes == 65536);
    CHECK(c.limits.maxBufferBytes == uint64_t{1} << 30);
    CHECK(c.limits.maxSessionBytes == uint64_t{2} << 30);
    CHECK(c.limits.maxSessions == 8);
    CHECK(c.rings.capacity == 1024);
    CHECK(c.rings.pollWindowUs == 0);
    CHECK(c.communicators.joinTimeoutMs == 500);
    CHECK(c.communicators.peerLostDeadlineMs == 100);
    CHECK(c.cuda.devices == std::vector<std::string>{"GPU-0a1b", "GPU-2c3d"});
    CHECK(c.cuda.daemonLingerMs == 0);
    CHECK(c.cuda.commSms == 16);

    // Printing any config and parsing it back is lossless, not only for the defaults.
    CHECK(parseConfig(configYaml(c), "printed.yaml") == c);
  }

  TEST_CASE("a partial file keeps the defaults of the keys it does not set") {
    const DaemonConfig c = parseConfig("rings:\n  capacity: 8\n", "partial.yaml");
    DaemonConfig expected;
    expected.rings.capacity = 8;
    CHECK(c == expected);
  }

  TEST_CASE("socket_mode is read as octal however it is written") {
    std::string text;
    SUBCASE("plain with a leading zero") { text = "0640"; }
    SUBCASE("quoted") { text = "\"0640\""; }
    SUBCASE("without the leading zero, like chmod") { text = "640"; }
    SUBCASE("with the YAML 1.2 0o prefix") { text = "0o640"; }
    CAPTURE(text);
    CHECK(parseConfig("access:\n  socket_mode: " + text + "\n", "mode.yaml").access.socketMode == 0640);
  }

  TEST_CASE("strings that YAML would misread are printed quoted and read back unchanged") {
    DaemonConfig c;
    c.daemon.socket = "/tmp/a b: #c\"d\\e";
    c.cuda.devices = {"GPU-1", "yes", "123", "~"};
    CHECK(parseConfig(configYaml(c), "quoted.yaml") == c);
  }

  TEST_CASE("unknown keys are errors that list the valid keys") {
    SUBCASE("at the top level") {
      checkError("daemon:\n  backend: cpu\ndeamon: {}\n",
                 {"tandemd.yaml:3:1: deamon: unknown key. Valid top-level keys: daemon, access, limits, rings, "
                  "communicators, cuda, cluster, plans."});
    }
    SUBCASE("inside a section, with a suggestion for a typo") {
      checkError("rings:\n  capacity: 64\n\n\n\n\n  capacty: 3\n",
                 {"tandemd.yaml:7:3: rings.capacty: unknown key. Valid keys in rings: capacity, poll_window_us.",
                  "Did you mean 'capacity'?"});
    }
    SUBCASE("camelCase instead of snake_case") {
      checkError("limits:\n  maxFrameBytes: 4096\n",
                 {"tandemd.yaml:2:3: limits.maxFrameBytes: unknown key. Valid keys in limits: max_frame_bytes,"});
    }
  }

  TEST_CASE("a value outside an enum names the choices") {
    checkError("daemon:\n  socket: /x\n\n  backend: gpu\n",
               {"tandemd.yaml:4:12: daemon.backend: 'gpu' is not one of auto, cpu, cuda. Set daemon.backend to auto, "
                "cpu or cuda."});
    checkError("daemon:\n  executor: mps\n", {"tandemd.yaml:2:13: daemon.executor: 'mps' is not one of auto, daemon, "
                                              "client. Set daemon.executor to auto, daemon or client."});
    checkError("daemon:\n  log_level: verbose\n",
               {"tandemd.yaml:2:14: daemon.log_level: 'verbose' is not one of trace, debug, info, warn, error."});
  }

  TEST_CASE("a value of the wrong type is an error at its position") {
    SUBCASE("a string where an integer is needed") {
      checkError("daemon:\n  worker_threads: four\n",
                 {"tandemd.yaml:2:19: daemon.worker_threads: 'four' is not a non-negative integer."});
    }
    SUBCASE("a list where an integer is needed") {
      checkError("rings:\n  capacity: [8]\n", {"tandemd.yaml:2:13: rings.capacity: expected a non-negative integer, "
                                               "got a list."});
    }
    SUBCASE("a map where a list is needed") {
      checkError("access:\n  allowed_uids: {a: 1}\n",
                 {"tandemd.yaml:2:17: access.allowed_uids: expected a list, got a map."});
    }
    SUBCASE("a scalar where a list is needed") {
      checkError("cuda:\n  devices: GPU-1\n", {"tandemd.yaml:2:12: cuda.devices: expected a list, got 'GPU-1'."});
    }
    SUBCASE("a list where a string is needed") {
      checkError("daemon:\n  socket: [a]\n", {"tandemd.yaml:2:11: daemon.socket: expected a string, got a list."});
    }
    SUBCASE("a scalar where a section is needed") {
      checkError("rings: 5\n",
                 {"tandemd.yaml:1:8: rings: expected a map of keys (capacity, poll_window_us), got '5'."});
    }
    SUBCASE("a key with no value where an integer is needed") {
      checkError("daemon:\n  worker_threads:\n", {"tandemd.yaml:2:3: daemon.worker_threads: has no value."});
    }
    SUBCASE("a socket mode that is not octal") {
      checkError("access:\n  socket_mode: 0680\n",
                 {"tandemd.yaml:2:16: access.socket_mode: '0680' is not an octal mode."});
    }
  }

  TEST_CASE("negative and oversized numbers are errors") {
    checkError("daemon:\n  worker_threads: -3\n",
               {"tandemd.yaml:2:19: daemon.worker_threads: -3 is negative. Set daemon.worker_threads to 0 or more."});
    checkError("access:\n  allowed_uids: [1000, -2]\n", {"tandemd.yaml:2:24: access.allowed_uids[1]: -2 is negative."});
    checkError("cuda:\n  comm_sms: 4294967296\n",
               {"tandemd.yaml:2:13: cuda.comm_sms: 4294967296 is too large. Set cuda.comm_sms to at most 4294967295."});
    checkError("limits:\n  max_session_bytes: 18446744073709551616\n",
               {"tandemd.yaml:2:22: limits.max_session_bytes: 18446744073709551616 is too large."});
  }

  TEST_CASE("a YAML syntax error is a config error with its position") {
    checkError("daemon: [\n", {"tandemd.yaml:2:1: YAML syntax error"});
    checkError("daemon:\n  backend: cpu\n backend: cuda\n", {"tandemd.yaml:3:2: YAML syntax error"});
  }

  TEST_CASE("a top level that is not a map is an error") {
    checkError("- daemon\n- rings\n", {"tandemd.yaml:1:1: the top level is a list, not a map of sections."});
    checkError("just text\n", {"tandemd.yaml:1:1: the top level is 'just text', not a map of sections."});
  }

  TEST_CASE("duplicate keys and extra documents are errors") {
    checkError("daemon:\n  backend: cpu\n  backend: cuda\n", {"tandemd.yaml:3:3: daemon.backend: duplicate key"});
    checkError("rings: {}\n---\nrings: {}\n", {"tandemd.yaml:3:1: a second YAML document"});
  }

  TEST_CASE("range and cross-field checks point at the offending key") {
    SUBCASE("ring capacity not a power of two") {
      checkError("rings:\n  capacity: 100\n",
                 {"tandemd.yaml:2:13: rings.capacity: 100 is not a power of two from 8 to 65536.",
                  "Set rings.capacity to a power of two such as 128."});
    }
    SUBCASE("ring capacity too small") {
      checkError("rings:\n  capacity: 4\n", {"tandemd.yaml:2:13: rings.capacity: 4 is not a power of two"});
    }
    SUBCASE("ring capacity too large") {
      checkError("rings:\n  capacity: 131072\n", {"tandemd.yaml:2:13: rings.capacity: 131072", "such as 65536."});
    }
    SUBCASE("frame cap outside 4 KiB to 64 MiB") {
      checkError("limits:\n  max_frame_bytes: 1024\n", {"tandemd.yaml:2:20: limits.max_frame_bytes: 1024 is outside"});
      checkError("limits:\n  max_frame_bytes: 67108865\n", {"tandemd.yaml:2:20: limits.max_frame_bytes: 67108865"});
    }
    SUBCASE("a buffer larger than a session") {
      checkError("limits:\n  max_buffer_bytes: 100\n  max_session_bytes: 50\n",
                 {"tandemd.yaml:2:21: limits.max_buffer_bytes: 100 is larger than limits.max_session_bytes (50)",
                  "Lower limits.max_buffer_bytes or raise limits.max_session_bytes."});
    }
    SUBCASE("a session cap below the default buffer cap points at the key the file set") {
      checkError("limits:\n  max_session_bytes: 50\n", {"tandemd.yaml:2:22: limits.max_buffer_bytes:"});
    }
    SUBCASE("peer-lost deadline below 100 ms") {
      checkError("communicators:\n  peer_lost_deadline_ms: 99\n",
                 {"tandemd.yaml:2:26: communicators.peer_lost_deadline_ms: 99 is below the minimum of 100 ms"});
    }
    SUBCASE("socket mode with bits beyond 0777") {
      checkError("access:\n  socket_mode: 04660\n",
                 {"tandemd.yaml:2:16: access.socket_mode: 04660 has bits beyond 0777"});
    }
    SUBCASE("no sessions") {
      checkError("limits:\n  max_sessions: 0\n", {"tandemd.yaml:2:17: limits.max_sessions: 0 would refuse"});
    }
    SUBCASE("a GPU listed twice") {
      checkError("cuda:\n  devices:\n    - GPU-a\n    - GPU-a\n",
                 {"tandemd.yaml:4:7: cuda.devices[1]: 'GPU-a' is listed twice."});
    }
  }

  TEST_CASE("validateConfig checks a config built in code and names the key without a position") {
    DaemonConfig c;
    c.rings.capacity = 3;
    CHECK_THROWS_WITH_AS(validateConfig(c), doctest::Contains("rings.capacity: 3 is not a power of two"),
                         tandem::Error);
    c = DaemonConfig{};
    c.limits.maxBufferBytes = c.limits.maxSessionBytes + 1;
    CHECK_THROWS_WITH_AS(validateConfig(c), doctest::Contains("limits.max_buffer_bytes:"), tandem::Error);
    c = DaemonConfig{};
    c.daemon.logLevel = "loud";
    CHECK_THROWS_WITH_AS(validateConfig(c), doctest::Contains("daemon.log_level: 'loud'"), tandem::Error);
  }

  TEST_CASE("loadConfigFile reads a file and names the path in its errors") {
    SUBCASE("a good file") {
      const TempFile file("rings:\n  capacity: 16\n");
      CHECK(loadConfigFile(file.path().string()).rings.capacity == 16);
    }
    SUBCASE("a bad file: errors carry the path as the source") {
      const TempFile file("rings:\n  capacity: 17\n");
      CHECK_THROWS_WITH_AS(loadConfigFile(file.path().string()),
                           doctest::Contains((file.path().string() + ":2:13: rings.capacity").c_str()), tandem::Error);
    }
    SUBCASE("a missing file names the path and --config") {
      const TempFile file("");
      const std::string missing = (file.dir() / "absent.yaml").string();
      try {
        loadConfigFile(missing);
        FAIL("loadConfigFile accepted a missing file");
      } catch (const tandem::Error& e) {
        CHECK(e.code() == ErrorCode::kInvalidConfig);
        const std::string message = e.what();
        INFO(message);
        CHECK(message.find(missing) != std::string::npos);
        CHECK(message.find("--config") != std::string::npos);
      }
    }
    SUBCASE("a directory is not a config file") {
      const TempFile file("");
      CHECK_THROWS_WITH_AS(loadConfigFile(file.dir().string()), doctest::Contains("--config"), tandem::Error);
    }
  }

  TEST_CASE("a cluster section parses into its values and prints back losslessly") {
    const std::string yaml =
        "communicators:\n"
        "  peer_lost_deadline_ms: 5000\n"
        "cluster:\n"
        "  nodes:\n"
        "    - 10.0.0.1:7100\n"
        "    - node-b.example.com:7100\n"
        "    - \"[fd00::3]:7200\"\n"
        "  node_index: 2\n"
        "  secret: \"a secret: with # odd chars\"\n"
        "  transport: verbs\n"
        "  connections_per_peer: 4\n"
        "  connect_timeout_ms: 1000\n"
        "  heartbeat_interval_ms: 2499\n"
        "  staging_bytes: 4096\n"
        "  gpu_exchange: off\n";
    const DaemonConfig c = parseConfig(yaml, "cluster.yaml");
    CHECK(c.cluster.nodes == std::vector<std::string>{"10.0.0.1:7100", "node-b.example.com:7100", "[fd00::3]:7200"});
    CHECK(c.cluster.nodeIndex == 2);
    CHECK(c.cluster.secret == "a secret: with # odd chars");
    CHECK(c.cluster.secretFile.empty());
    CHECK(c.cluster.transport == ClusterTransport::kVerbs);
    CHECK(c.cluster.connectionsPerPeer == 4);
    CHECK(c.cluster.connectTimeoutMs == 1000);
    CHECK(c.cluster.heartbeatIntervalMs == 2499);
    CHECK(c.cluster.stagingBytes == 4096);
    CHECK(c.cluster.gpuExchange == GpuExchange::kOff);
    CHECK(isMultiNode(c.cluster));
    CHECK(clusterSecret(c.cluster) == "a secret: with # odd chars");
    CHECK(parseConfig(configYaml(c), "printed.yaml") == c);

    // The defaults: a single node, tcp, and values the daemon can use as they are.
    const ClusterSection defaults;
    CHECK(defaults.nodes.empty());
    CHECK_FALSE(isMultiNode(defaults));
    CHECK(defaults.nodeIndex == 0);
    CHECK(defaults.transport == ClusterTransport::kTcp);
    CHECK(defaults.connectionsPerPeer == 2);
    CHECK(defaults.connectTimeoutMs == 60000);
    CHECK(defaults.heartbeatIntervalMs == 100);
    CHECK(defaults.stagingBytes == uint64_t{64} << 20);
    CHECK(defaults.gpuExchange == GpuExchange::kOn);  // as fast as the staged path over tcp, the design's path
    CHECK(std::string_view(gpuExchangeName(GpuExchange::kOn)) == "on");
    CHECK(std::string_view(gpuExchangeName(GpuExchange::kOff)) == "off");
    CHECK(parseConfig("cluster:\n  gpu_exchange: off\n", "off.yaml").cluster.gpuExchange == GpuExchange::kOff);
    CHECK(std::string_view(clusterTransportName(ClusterTransport::kTcp)) == "tcp");
    CHECK(std::string_view(clusterTransportName(ClusterTransport::kVerbs)) == "verbs");

    // One entry is a single node; it needs no secret.
    const DaemonConfig one = parseConfig("cluster:\n  nodes: [\"127.0.0.1:7100\"]\n", "one.yaml");
    CHECK_FALSE(isMultiNode(one.cluster));
  }

  TEST_CASE("a cluster config with a secret file prints back losslessly") {
    const TempFile file("");
    const std::string secretPath = file.sibling("cluster.secret", "0123456789abcdef-secret\n");
    const DaemonConfig c = parseConfig(
        "cluster:\n  nodes: [a:1, b:1]\n  node_index: 1\n  secret_file: " + secretPath + "\n", "file.yaml");
    CHECK(c.cluster.secretFile == secretPath);
    CHECK(c.cluster.secret.empty());  // the file's text is not copied into the config
    CHECK(clusterSecret(c.cluster) == "0123456789abcdef-secret");
    CHECK(parseConfig(configYaml(c), "printed.yaml") == c);
  }

  TEST_CASE("parseNodeEndpoint reads IPv4, names and bracketed IPv6") {
    CHECK(parseNodeEndpoint("10.0.0.1:7100") == NodeEndpoint{"10.0.0.1", 7100});
    CHECK(parseNodeEndpoint("node-1.example.com:1") == NodeEndpoint{"node-1.example.com", 1});
    CHECK(parseNodeEndpoint("gpu_node7:65535") == NodeEndpoint{"gpu_node7", 65535});
    CHECK(parseNodeEndpoint("[fd00::1]:7100") == NodeEndpoint{"fd00::1", 7100});
    CHECK(parseNodeEndpoint("[::1]:80") == NodeEndpoint{"::1", 80});
  }

  TEST_CASE("parseNodeEndpoint says what is wrong and how to write it") {
    struct Case {
      std::string text;
      std::vector<std::string_view> fragments;
    };
    const std::vector<Case> cases{
        {"", {"is empty", "host:port"}},
        {"10.0.0.1", {"'10.0.0.1' has no port", "such as 10.0.0.1:7100"}},
        {"fd00::1:7100", {"more than one ':'", "[fd00::1]:7100"}},
        {"[fd00::1", {"without a closing ']'", "[fd00::1]:7100"}},
        {"[fd00::1]7100", {"no ':port' after ']'", "[fd00::1]:7100"}},
        {"[fd00::1]", {"no ':port' after ']'"}},
        {"[node1]:7100", {"'node1' is not an IPv6 address", "without them"}},
        {":7100", {"no host before ':'"}},
        {"10.0.0.256:7100", {"'10.0.0.256' is neither an IPv4 address nor a host name"}},
        {"bad host:7100", {"'bad host' is neither"}},
        {"-node:7100", {"'-node' is neither"}},
        {"node..a:7100", {"'node..a' is neither"}},
        {"node:0", {"port '0' is not a number from 1 to 65535", "such as 7100"}},
        {"node:65536", {"port '65536'"}},
        {"node:http", {"port 'http'"}},
        {"node:", {"port ''"}},
        {"node:+80", {"port '+80'"}},
    };
    for (const auto& c : cases) {
      CAPTURE(c.text);
      const std::string message = invalidConfigError([&] { parseNodeEndpoint(c.text); });
      INFO("error: " << message);
      for (const auto fragment : c.fragments)
        CHECK_MESSAGE(message.find(fragment) != std::string::npos, "missing: " << fragment);
    }
  }

  TEST_CASE("cluster.nodes entries are checked at their position") {
    checkError("cluster:\n  nodes:\n    - 10.0.0.1:7100\n    - 10.0.0.2\n",
               {"tandemd.yaml:4:7: cluster.nodes[1]: '10.0.0.2' has no port.", "such as 10.0.0.2:7100"});
    checkError("cluster:\n  nodes: [\"fd00::1:7100\"]\n",
               {"tandemd.yaml:2:11: cluster.nodes[0]: 'fd00::1:7100' has more than one ':'.", "[fd00::1]:7100"});
    checkError("cluster:\n  nodes: [a:7100, b:7100, A:7100]\n",
               {"tandemd.yaml:2:27: cluster.nodes[2]: 'A:7100' is listed twice (also cluster.nodes[0]).",
                "need different ports"});
    checkError("cluster:\n  nodes: a:7100\n", {"tandemd.yaml:2:10: cluster.nodes: expected a list, got 'a:7100'."});
    // The same host on two ports is two nodes.
    CHECK_NOTHROW(parseConfig(twoNodes() + "  node_index: 1\n", "ok.yaml"));
    CHECK_NOTHROW(parseConfig("cluster:\n  nodes: [h:1, h:2]\n  secret: 0123456789abcdef\n", "ports.yaml"));
  }

  TEST_CASE("cluster.node_index must be a position in cluster.nodes") {
    checkError(twoNodes("  node_index: 2\n"),
               {"tandemd.yaml:4:15: cluster.node_index: 2 is not a position in cluster.nodes, which lists 2 nodes (0 "
                "to 1).",
                "--node-index / TANDEM_NODE_INDEX"});
    checkError(twoNodes("  node_index: -1\n"), {"tandemd.yaml:4:15: cluster.node_index: -1 is negative."});
    checkError("cluster:\n  node_index: -1\n", {"tandemd.yaml:2:15: cluster.node_index: -1 is negative."});
    checkError("cluster:\n  node_index: one\n",
               {"tandemd.yaml:2:15: cluster.node_index: 'one' is not an integer."});
    checkError("cluster:\n  node_index: 2147483648\n",
               {"tandemd.yaml:2:15: cluster.node_index: 2147483648 is out of range."});
    checkError("cluster:\n  node_index:\n", {"tandemd.yaml:2:3: cluster.node_index: has no value."});
    // Built in code, after --node-index overrode it: the same check without a position.
    DaemonConfig c = parseConfig(twoNodes(), "two.yaml");
    c.cluster.nodeIndex = 7;
    CHECK_THROWS_WITH_AS(validateConfig(c), doctest::Contains("cluster.node_index: 7 is not a position"),
                         tandem::Error);
  }

  TEST_CASE("two or more nodes need exactly one of cluster.secret and cluster.secret_file") {
    SUBCASE("neither") {
      checkError("cluster:\n  nodes: [a:1, b:1]\n",
                 {"tandemd.yaml:2:10: cluster: no cluster secret is set", "openssl rand -hex 32",
                  "set cluster.secret_file to that path"});
    }
    SUBCASE("both") {
      checkError(twoNodes("  secret_file: /etc/tandem/cluster.secret\n"),
                 {"tandemd.yaml:3:11: cluster.secret and cluster.secret_file are both set. Keep only one",
                  "remove cluster.secret"});
    }
    SUBCASE("both, even on a single node") {
      checkError("cluster:\n  secret: 0123456789abcdef\n  secret_file: /x\n", {"are both set"});
    }
    SUBCASE("an inline secret shorter than 16 bytes") {
      checkError("cluster:\n  nodes: [a:1, b:1]\n  secret: short\n",
                 {"tandemd.yaml:3:11: cluster.secret: the secret is 5 bytes; at least 16 are needed.",
                  "openssl rand -hex 32"});
      // Never echoes the secret itself.
      CHECK(configError("cluster:\n  secret: hunter2\n").find("hunter2") == std::string::npos);
    }
    SUBCASE("a single node needs no secret, and does not read secret_file") {
      CHECK_NOTHROW(parseConfig("cluster:\n  secret_file: /nonexistent/tandem/secret\n", "single.yaml"));
    }
  }

  TEST_CASE("cluster.secret_file is read at load time: first line, trailing whitespace stripped") {
    const TempFile file("");
    const std::string secret = "4f1c9e0b7a6d5c3e2b1a09f8e7d6c5b4";
    SUBCASE("with a newline and more lines") {
      const std::string path = file.sibling("s1", secret + "\nsecond line is ignored\n");
      ClusterSection c;
      c.secretFile = path;
      CHECK(clusterSecret(c) == secret);
    }
    SUBCASE("with CRLF and trailing blanks") {
      const std::string path = file.sibling("s2", secret + " \t\r\n");
      ClusterSection c;
      c.secretFile = path;
      CHECK(clusterSecret(c) == secret);
    }
    SUBCASE("without a newline") {
      const std::string path = file.sibling("s3", secret);
      ClusterSection c;
      c.secretFile = path;
      CHECK(clusterSecret(c) == secret);
    }
    SUBCASE("inline") {
      ClusterSection c;
      c.secret = secret;
      CHECK(clusterSecret(c) == secret);
    }
    SUBCASE("a missing file fails the load, naming the key, the path and the fix") {
      const std::string path = (file.dir() / "absent.secret").string();
      checkError(twoNodes().substr(0, twoNodes().find("  secret:")) + "  secret_file: " + path + "\n",
                 {"tandemd.yaml:3:16: cluster.secret_file: cannot read the cluster secret from " + path,
                  "No such file or directory", "openssl rand -hex 32 > " + path});
      ClusterSection c;
      c.secretFile = path;
      const std::string message = invalidConfigError([&] { clusterSecret(c); });
      CHECK_MESSAGE(message.find("cluster.secret_file: cannot read the cluster secret from " + path) !=
                        std::string::npos,
                    message);
    }
    SUBCASE("a secret shorter than 16 bytes") {
      const std::string path = file.sibling("short", "tooshort   \n0123456789abcdef0123456789\n");
      ClusterSection c;
      c.secretFile = path;
      const std::string message = invalidConfigError([&] { clusterSecret(c); });
      CHECK_MESSAGE(message.find("the secret on the first line of " + path + " is 8 bytes; at least 16") !=
                        std::string::npos,
                    message);
      CHECK(message.find("tooshort") == std::string::npos);
    }
    SUBCASE("an empty file") {
      ClusterSection c;
      c.secretFile = file.sibling("empty", "");
      CHECK_THROWS_WITH_AS(clusterSecret(c), doctest::Contains("is 0 bytes; at least 16"), tandem::Error);
    }
    SUBCASE("a directory") {
      ClusterSection c;
      c.secretFile = file.dir().string();
      CHECK_THROWS_WITH_AS(clusterSecret(c), doctest::Contains("not a directory"), tandem::Error);
    }
    SUBCASE("neither set") {
      CHECK_THROWS_WITH_AS(clusterSecret(ClusterSection{}), doctest::Contains("no cluster secret is set"),
                           tandem::Error);
    }
    SUBCASE("loadConfigFile with a good secret file") {
      const std::string path = file.sibling("good", secret + "\n");
      const TempFile config("cluster:\n  nodes: [a:1, b:1]\n  secret_file: " + path + "\n");
      CHECK(loadConfigFile(config.path().string()).cluster.secretFile == path);
    }
  }

  TEST_CASE("cluster ranges are checked with the fix") {
    checkError("cluster:\n  connections_per_peer: 0\n",
               {"tandemd.yaml:2:25: cluster.connections_per_peer: 0 is outside 1 to 16.", "the same on every node"});
    checkError("cluster:\n  connections_per_peer: 17\n", {"cluster.connections_per_peer: 17 is outside 1 to 16."});
    checkError("cluster:\n  connect_timeout_ms: 0\n",
               {"tandemd.yaml:2:23: cluster.connect_timeout_ms: 0 would give up", "(default 60000)"});
    checkError("cluster:\n  heartbeat_interval_ms: 9\n",
               {"tandemd.yaml:2:26: cluster.heartbeat_interval_ms: 9 is below the minimum of 10 ms."});
    checkError(twoNodes("  heartbeat_interval_ms: 1000\n"),
               {"tandemd.yaml:4:26: cluster.heartbeat_interval_ms: 1000 is not below half of "
                "communicators.peer_lost_deadline_ms (2000)",
                "Set cluster.heartbeat_interval_ms to at most 999 or raise communicators.peer_lost_deadline_ms."});
    CHECK_NOTHROW(parseConfig(twoNodes("  heartbeat_interval_ms: 999\n"), "ok.yaml"));
    CHECK_NOTHROW(parseConfig(twoNodes("  heartbeat_interval_ms: 10\n"), "ok.yaml"));
    // Lowering the deadline alone can break the default heartbeat of a cluster: the error points at the key the
    // file set.
    checkError("communicators:\n  peer_lost_deadline_ms: 200\n" + twoNodes(),
               {"tandemd.yaml:2:26: cluster.heartbeat_interval_ms: 100 is not below half", "at most 99"});
    // A single node sends no heartbeats: the shortest deadline stays valid with the default interval.
    CHECK_NOTHROW(parseConfig("communicators:\n  peer_lost_deadline_ms: 100\n", "single.yaml"));
    checkError("cluster:\n  staging_bytes: 4095\n",
               {"tandemd.yaml:2:18: cluster.staging_bytes: 4095 is outside 4096 (4 KiB) to 17179869184 (16 GiB).",
                "the default is 67108864 (64 MiB)"});
    checkError("cluster:\n  staging_bytes: 17179869185\n", {"cluster.staging_bytes: 17179869185 is outside"});
    CHECK_NOTHROW(parseConfig("cluster:\n  staging_bytes: 17179869184\n", "ok.yaml"));
    checkError("cuda:\n  workspace_bytes: 1048576\n",
               {"tandemd.yaml:2:20: cuda.workspace_bytes: 1048576 is below the minimum 16777216 (16 MiB).",
                "the default is 536870912 (512 MiB)"});
    CHECK(parseConfig("cuda:\n  workspace_bytes: 1073741824\n", "ok.yaml").cuda.workspaceBytes == (uint64_t{1} << 30));
    checkError("cluster:\n  transport: ib\n",
               {"tandemd.yaml:2:14: cluster.transport: 'ib' is not one of tcp, verbs. Set cluster.transport to tcp or "
                "verbs."});
    // YAML 1.1 would read a bare off as false; the key takes only its two names.
    checkError("cluster:\n  gpu_exchange: false\n",
               {"tandemd.yaml:2:17: cluster.gpu_exchange: 'false' is not one of on, off. Set cluster.gpu_exchange to on "
                "or off."});
    checkError("cluster:\n  gpu_exchange: [on]\n", {"cluster.gpu_exchange: expected one of on, off"});
    checkError("cluster:\n  node_idx: 1\n",
               {"tandemd.yaml:2:3: cluster.node_idx: unknown key. Valid keys in cluster: nodes, node_index,",
                "Did you mean 'node_index'?"});
  }

  TEST_CASE("every numeric key prints its range, and the shipped file documents the LimitNOFILE rule") {
    // A number after "key:" is a numeric key (socket_mode is octal and has its own check); each must carry a
    // "# Range:" (or "# Each item:" for lists of numbers) comment right above it.
    std::istringstream lines(defaultConfigYaml());
    std::string line, previous;
    int numericKeys = 0;
    while (std::getline(lines, line)) {
      const std::size_t colon = line.find(": ");
      const bool key = line.starts_with("  ") && !line.starts_with("  #") && colon != std::string::npos;
      if (key) {
        const std::string value = line.substr(colon + 2);
        const bool number = !value.empty() && std::isdigit(static_cast<unsigned char>(value[0])) != 0 &&
                            line.find("socket_mode") == std::string::npos;
        const bool numberList = value == "[]" && (line.find("_uids") != std::string::npos ||
                                                  line.find("_gids") != std::string::npos);
        if (number || numberList) {
          ++numericKeys;
          CHECK_MESSAGE((previous.starts_with("  # Range: ") || previous.starts_with("  # Each item: ")),
                        "no range comment above: " << line);
        }
      }
      previous = line;
    }
    CHECK(numericKeys >= 29);  // all of them today; a key whose default is not printed as a number is not counted
    CHECK(defaultConfigYaml().find("LimitNOFILE=65536") != std::string::npos);
    const DaemonConfig d;
    CHECK(uint64_t{d.limits.maxSessions} * d.limits.maxFdsPerSession * 2 <= 65536);
  }

  TEST_CASE("the systemd unit's LimitNOFILE fits the default sessions times fds per session, twice over") {
    const std::string unit = readFile(std::filesystem::path(TANDEM_SOURCE_DIR) / "systemd" / "tandemd.service.in");
    const std::size_t at = unit.find("\nLimitNOFILE=");
    REQUIRE_MESSAGE(at != std::string::npos, "systemd/tandemd.service.in sets no LimitNOFILE=");
    const uint64_t nofile = std::stoull(unit.substr(at + 13));
    const LimitsSection l;
    CHECK(nofile >= 2 * uint64_t{l.maxSessions} * l.maxFdsPerSession);
  }

  TEST_CASE("the hostile-client limits have their documented defaults") {
    const LimitsSection l;
    CHECK(l.maxSessionsPerUid == 64);
    CHECK(l.maxFdsPerSession == 128);
    CHECK(l.maxPendingCompletions == 4096);
    CHECK(l.maxJoiningCommsPerSession == 16);
    CHECK(l.maxScratchBytes == (uint64_t{1} << 30));
    CHECK(l.maxCpuWorkersPerSession == 0);
    CHECK(l.helloTimeoutMs == 5000);
    CHECK(l.frameTimeoutMs == 10000);
    CHECK(l.maxReplyBacklogBytes == (uint64_t{4} << 20));
    CHECK(CommunicatorsSection{}.maxJoinTimeoutMs == 600000);
    const DaemonConfig parsed = parseConfig(
        "limits:\n  max_sessions_per_uid: 2\n  max_fds_per_session: 16\n  max_pending_completions: 16\n"
        "  max_joining_comms_per_session: 1\n  max_scratch_bytes: 1048576\n  max_cpu_workers_per_session: 3\n"
        "  hello_timeout_ms: 50\n  frame_timeout_ms: 600000\n  max_reply_backlog_bytes: 1073741824\n"
        "communicators:\n  max_join_timeout_ms: 3600000\n",
        "ok.yaml");
    CHECK(parsed.limits.maxSessionsPerUid == 2);
    CHECK(parsed.limits.maxFdsPerSession == 16);
    CHECK(parsed.limits.maxPendingCompletions == 16);
    CHECK(parsed.limits.maxJoiningCommsPerSession == 1);
    CHECK(parsed.limits.maxScratchBytes == (uint64_t{1} << 20));
    CHECK(parsed.limits.maxCpuWorkersPerSession == 3);
    CHECK(parsed.limits.helloTimeoutMs == 50);
    CHECK(parsed.limits.frameTimeoutMs == 600000);
    CHECK(parsed.limits.maxReplyBacklogBytes == (uint64_t{1} << 30));
    CHECK(parsed.communicators.maxJoinTimeoutMs == 3600000);
  }

  TEST_CASE("the cpu worker share: the key, else half of the workers, at least 1, at most all") {
    LimitsSection l;
    CHECK(cpuWorkerShare(l, 8) == 4);
    CHECK(cpuWorkerShare(l, 3) == 1);
    CHECK(cpuWorkerShare(l, 1) == 1);
    l.maxCpuWorkersPerSession = 2;
    CHECK(cpuWorkerShare(l, 8) == 2);
    l.maxCpuWorkersPerSession = 100;
    CHECK(cpuWorkerShare(l, 8) == 8);
  }

  TEST_CASE("values outside a key's range exit as config errors naming the key, the range and line:column") {
    // The values the daemon used to accept and then misbehave with.
    checkError("daemon:\n  worker_threads: 100000\n",
               {"tandemd.yaml:2:19: daemon.worker_threads: 100000 is outside the range 0 to 1024.",
                "Set daemon.worker_threads within that range (default 0)."});
    checkError("rings:\n  poll_window_us: 4294967295\n",
               {"tandemd.yaml:2:19: rings.poll_window_us: 4294967295 is outside the range 0 to 10000."});
    checkError("communicators:\n  join_timeout_ms: 0\n",
               {"tandemd.yaml:2:20: communicators.join_timeout_ms: 0 is outside the range 100 to 3600000.",
                "(default 30000)"});
    checkError("limits:\n  max_buffer_bytes: 0\n",
               {"tandemd.yaml:2:21: limits.max_buffer_bytes: 0 is outside the range 4096 (4 KiB) to 17592186044416 "
                "(16 TiB).", "(default 17179869184 (16 GiB))"});
    checkError("access:\n  allowed_uids: [1000, 4294967295]\n",
               {"tandemd.yaml:2:24: access.allowed_uids[1]: 4294967295 is outside the range 0 to 4294967294."});
    checkError("cuda:\n  comm_sms: 257\n", {"tandemd.yaml:2:13: cuda.comm_sms: 257 is outside the range 0 to 256."});
    checkError("cluster:\n  node_index: 65536\n",
               {"tandemd.yaml:2:15: cluster.node_index: 65536 is outside the range 0 to 65535."});
  }

  TEST_CASE("each limit refuses the value just outside its range and accepts its bounds") {
    struct Case {
      const char* section;
      const char* key;
      uint64_t min, max;
    };
    const Case cases[] = {
        {"daemon", "worker_threads", 0, 1024},
        {"limits", "max_sessions", 1, 65536},
        {"limits", "max_sessions_per_uid", 1, 65536},
        {"limits", "max_fds_per_session", 16, 65536},
        {"limits", "max_pending_completions", 16, 1u << 20},
        {"limits", "max_joining_comms_per_session", 1, 4096},
        {"limits", "max_scratch_bytes", 1u << 20, uint64_t{16} << 40},
        {"limits", "max_cpu_workers_per_session", 0, 1024},
        {"limits", "hello_timeout_ms", 50, 600000},
        {"limits", "frame_timeout_ms", 50, 600000},
        {"limits", "max_reply_backlog_bytes", 1u << 21, 1u << 30},  // min: max_frame_bytes below is 2 MiB - 4
        {"rings", "poll_window_us", 0, 10000},
        {"communicators", "peer_lost_deadline_ms", 100, 600000},
        {"communicators", "max_join_timeout_ms", 30000, 3600000},  // min: join_timeout_ms defaults to 30000
        {"cuda", "daemon_linger_ms", 0, 3600000},
        {"cuda", "comm_sms", 0, 256},
        {"cuda", "workspace_bytes", 16u << 20, uint64_t{1} << 40},
        {"cluster", "connect_timeout_ms", 1, 86400000},
        {"cluster", "heartbeat_interval_ms", 10, 60000},
    };
    // max_reply_backlog_bytes is checked against a 2 MiB - 4 frame cap so that its lower bound is the cross-key rule.
    const std::string extra = "limits:\n  max_frame_bytes: 2097148\n";
    for (const Case& c : cases) {
      const std::string key = fmt::format("{}.{}", c.section, c.key);
      const auto file = [&](uint64_t value) {
        std::string text = fmt::format("{}:\n  {}: {}\n", c.section, c.key, value);
        if (std::string_view(c.section) == "limits") return text + fmt::format("  max_frame_bytes: 2097148\n");
        return text + extra;
      };
      INFO("key: " << key);
      CHECK_NOTHROW(parseConfig(file(c.min), "min.yaml"));
      CHECK_NOTHROW(parseConfig(file(c.max), "max.yaml"));
      CHECK(configError(file(c.max + 1)).find(key + ": ") != std::string::npos);
      if (c.min > 0) CHECK(configError(file(c.min - 1)).find(key) != std::string::npos);
    }
  }

  TEST_CASE("validateConfig checks ranges too, so a flag cannot bring in an absurd value") {
    DaemonConfig config;
    config.daemon.workerThreads = 100000;
    CHECK(invalidConfigError([&] { validateConfig(config); }).find("daemon.worker_threads: 100000 is outside") !=
          std::string::npos);
    config = DaemonConfig{};
    config.limits.helloTimeoutMs = 0;
    CHECK(invalidConfigError([&] { validateConfig(config); }).find("limits.hello_timeout_ms") != std::string::npos);
  }

  TEST_CASE("the reply backlog must hold one largest reply, and the default join timeout must be allowed") {
    checkError("limits:\n  max_frame_bytes: 1048576\n  max_reply_backlog_bytes: 1048579\n",
               {"tandemd.yaml:3:28: limits.max_reply_backlog_bytes: 1048579 is less than one largest reply",
                "at least 1048580"});
    CHECK_NOTHROW(parseConfig("limits:\n  max_frame_bytes: 1048576\n  max_reply_backlog_bytes: 1048580\n", "ok"));
    checkError("communicators:\n  join_timeout_ms: 60000\n  max_join_timeout_ms: 59999\n",
               {"tandemd.yaml:2:20: communicators.join_timeout_ms: 60000 is above communicators.max_join_timeout_ms "
                "(59999)"});
  }

  TEST_CASE("a socket path longer than sun_path is a config error, not a bind failure") {
    const std::string fits = "/tmp/" + std::string(102, 's');  // 107 bytes: the most sun_path holds
    CHECK(parseConfig("daemon:\n  socket: " + fits + "\n", "ok.yaml").daemon.socket == fits);
    checkError("daemon:\n  socket: " + fits + "x\n",
               {"tandemd.yaml:2:11: daemon.socket: the path is 108 bytes, but a Unix socket address holds at most 107",
                "Set daemon.socket (or --socket) to a shorter path"});
    DaemonConfig config;
    config.daemon.socket = fits + "x";
    CHECK(invalidConfigError([&] { validateConfig(config); }).find("daemon.socket") != std::string::npos);
  }

  TEST_CASE("backend and executor names match the YAML spellings") {
    CHECK(std::string_view(backendName(BackendKind::kAuto)) == "auto");
    CHECK(std::string_view(backendName(BackendKind::kCpu)) == "cpu");
    CHECK(std::string_view(backendName(BackendKind::kCuda)) == "cuda");
    CHECK(std::string_view(executorName(ExecutorKind::kAuto)) == "auto");
    CHECK(std::string_view(executorName(ExecutorKind::kDaemon)) == "daemon");
    CHECK(std::string_view(executorName(ExecutorKind::kClient)) == "client");
  }
}
