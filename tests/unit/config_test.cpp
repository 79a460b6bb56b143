// tandemd's config loader: defaults, the shipped config/tandemd.yaml, good files, and the text of every error.
#include "config.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

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
                  "communicators, cuda."});
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

  TEST_CASE("backend and executor names match the YAML spellings") {
    CHECK(std::string_view(backendName(BackendKind::kAuto)) == "auto");
    CHECK(std::string_view(backendName(BackendKind::kCpu)) == "cpu");
    CHECK(std::string_view(backendName(BackendKind::kCuda)) == "cuda");
    CHECK(std::string_view(executorName(ExecutorKind::kAuto)) == "auto");
    CHECK(std::string_view(executorName(ExecutorKind::kDaemon)) == "daemon");
    CHECK(std::string_view(executorName(ExecutorKind::kClient)) == "client");
  }
}
