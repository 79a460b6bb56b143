// tandemd's configuration: plain structs with defaults as member initialisers, loaded from YAML
// (config/tandemd.yaml), then overridden by command-line flags. Precedence: defaults < file < flags.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tandem::daemon {

enum class BackendKind { kAuto, kCpu, kCuda };
enum class ExecutorKind { kAuto, kDaemon, kClient };

struct DaemonSection {
  std::string socket;           // empty: /run/tandem/tandemd.sock as root, else $XDG_RUNTIME_DIR/tandem/tandemd.sock
  BackendKind backend = BackendKind::kAuto;    // auto: cuda when a GPU is visible, else cpu
  ExecutorKind executor = ExecutorKind::kAuto; // auto: daemon when an MPS control daemon is reachable, else client
  std::string logLevel = "info";               // trace | debug | info | warn | error
  uint32_t workerThreads = 0;                  // CPU backend op threads; 0 = hardware concurrency

  bool operator==(const DaemonSection&) const = default;
};

struct AccessSection {
  std::vector<uint32_t> allowedUids;  // besides root and the daemon's own uid, which are always allowed
  std::vector<uint32_t> allowedGids;  // a client whose primary gid is listed is allowed
  uint32_t socketMode = 0660;         // octal in YAML

  bool operator==(const AccessSection&) const = default;
};

struct LimitsSection {
  uint64_t maxFrameBytes = 1u << 20;                 // control-plane frame cap
  uint64_t maxBufferBytes = uint64_t{16} << 30;      // one allocation or registration
  uint64_t maxSessionBytes = uint64_t{64} << 30;     // all buffers of one session
  uint32_t maxSessions = 256;

  bool operator==(const LimitsSection&) const = default;
};

struct RingsSection {
  uint32_t capacity = 256;       // descriptors per ring; power of two, 8..65536
  uint32_t pollWindowUs = 50;    // the pump busy-polls this long after the last descriptor before sleeping

  bool operator==(const RingsSection&) const = default;
};

struct CommunicatorsSection {
  uint32_t joinTimeoutMs = 30000;       // default rendezvous timeout when the client passes 0
  uint32_t peerLostDeadlineMs = 2000;   // a dead rank's peers see PEER_LOST within this

  bool operator==(const CommunicatorsSection&) const = default;
};

struct CudaSection {
  std::vector<std::string> devices;   // GPU UUIDs ("GPU-...") to own; empty = every visible GPU
  uint32_t daemonLingerMs = 1000;     // persistent kernel exits after idling this long
  uint32_t commSms = 0;               // SMs for communication roles; 0 = chosen per shape

  bool operator==(const CudaSection&) const = default;
};

struct DaemonConfig {
  DaemonSection daemon;
  AccessSection access;
  LimitsSection limits;
  RingsSection rings;
  CommunicatorsSection communicators;
  CudaSection cuda;

  bool operator==(const DaemonConfig&) const = default;
};

// Parses YAML text. `sourceName` appears in errors ("tandemd.yaml:12:3: daemon.backend: ...").
// Throws Error(kInvalidConfig) naming the key path and line:column; unknown keys list the valid ones.
// Also runs validateConfig's checks, so their errors point at the offending line too. Empty text or
// only comments gives the defaults.
DaemonConfig parseConfig(const std::string& yamlText, const std::string& sourceName);
// Reads and parses a file; a missing or unreadable file is Error(kInvalidConfig) naming the path.
DaemonConfig loadConfigFile(const std::string& path);
// Cross-field checks (ring capacity a power of two, limits ordered, ...). Throws Error(kInvalidConfig).
void validateConfig(const DaemonConfig& config);
// The commented default configuration, as `tandemd --print-default-config` prints it and as
// config/tandemd.yaml holds it. Equals configYaml(DaemonConfig{}).
std::string defaultConfigYaml();
// Any configuration as commented YAML that parseConfig reads back to an equal DaemonConfig (e.g. to
// log the effective configuration after flags were applied).
std::string configYaml(const DaemonConfig& config);

const char* backendName(BackendKind kind);
const char* executorName(ExecutorKind kind);

}  // namespace tandem::daemon
