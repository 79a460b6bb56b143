// tandemd's configuration: plain structs with defaults as member initialisers, loaded from YAML
// (config/tandemd.yaml), then overridden by command-line flags. Precedence: defaults < file < flags.
#pragma once

#include <cstddef>
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
  uint32_t stopGraceMs = 30000;                // SIGTERM's drain may take this long before tandemd exits anyway

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
  uint32_t maxSessionsPerUid = 64;                   // sessions (and connections not yet past Hello) of one uid
  uint32_t maxFdsPerSession = 128;                   // fds the daemon holds for one session: buffers + fixed fds
  uint32_t maxPendingCompletions = 4096;             // completions queued beyond a session's undrained ring
  uint32_t maxJoiningCommsPerSession = 16;           // communicators a session has joined that are not yet complete
  uint64_t maxScratchBytes = uint64_t{1} << 30;      // host scratch one cpu-backend op may allocate
  uint32_t maxCpuWorkersPerSession = 0;              // 0 = half of daemon.worker_threads, at least 1
  uint32_t helloTimeoutMs = 5000;                    // a connection must send Hello within this
  uint32_t frameTimeoutMs = 10000;                   // a frame once started must arrive whole within this
  uint64_t maxReplyBacklogBytes = uint64_t{4} << 20; // replies queued for a client that does not read them

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
  uint32_t maxJoinTimeoutMs = 600000;   // the largest timeout a client may ask tandem_comm_init for

  bool operator==(const CommunicatorsSection&) const = default;
};

struct CudaSection {
  std::vector<std::string> devices;   // GPU UUIDs ("GPU-...") to own; empty = every visible GPU
  uint32_t daemonLingerMs = 1000;     // persistent kernel exits after idling this long
  uint32_t commSms = 0;               // SMs for communication roles; 0 = chosen per shape
  uint64_t workspaceBytes = uint64_t{512} << 20;  // GPU memory per communicator rank for fused ops' peer-visible staging

  bool operator==(const CudaSection&) const = default;
};

// How op data travels between nodes (named so as not to clash with transport::TransportKind).
enum class ClusterTransport { kTcp, kVerbs };
// Who moves a cuda communicator's bytes between nodes (cuda_multinode.hpp): on, the GPUs issue them through a proxy
// (the GPU-issued exchange, where the op and the transport allow it); off, tandemd's link thread through host memory.
enum class GpuExchange { kOn, kOff };

// Multi-node: the tandemd daemons of a cluster connect to each other. Single node when nodes has 0 or 1 entries.
struct ClusterSection {
  std::vector<std::string> nodes;     // "host:port" of every node's tandemd, the same list and order on every node
  int32_t nodeIndex = 0;              // this node's index in nodes (--node-index / TANDEM_NODE_INDEX override it)
  std::string secretFile;             // file whose first line is the shared cluster secret (>= 16 bytes)
  std::string secret;                 // the secret inline (secret_file is preferred: configs are often world-readable)
  ClusterTransport transport = ClusterTransport::kTcp;  // data transport between nodes: tcp | verbs
  uint32_t connectionsPerPeer = 2;    // tcp connections per peer node, 1..16
  uint32_t connectTimeoutMs = 60000;  // how long the daemons wait for every node to come up
  uint32_t heartbeatIntervalMs = 100; // >= 10, and (multi-node) less than communicators.peer_lost_deadline_ms / 2
  uint64_t stagingBytes = uint64_t{64} << 20;  // per multi-node communicator and peer node: inbox and outbox size,
                                               // 4 KiB .. 16 GiB
  GpuExchange gpuExchange = GpuExchange::kOn;  // cuda: on = GPU-issued exchange where available; the same on every node

  bool operator==(const ClusterSection&) const = default;
};

// When tandemd measures plans by itself (the plan table, daemon/src/plan_table.hpp).
enum class PlanAutotune { kOff, kOnFirstUse };

struct PlansSection {
  std::string stateDir;                          // empty: $STATE_DIRECTORY, else /var/lib/tandem as root, else
                                                 // $XDG_STATE_HOME/tandem (plan_table.hpp, planStateDirectory)
  PlanAutotune autotune = PlanAutotune::kOff;    // on-first-use: the first ops of an untuned shape try each plan
  uint32_t autotuneRuns = 3;                     // on-first-use: timed ops per candidate plan, 1..100

  bool operator==(const PlansSection&) const = default;
};

struct DaemonConfig {
  DaemonSection daemon;
  AccessSection access;
  LimitsSection limits;
  RingsSection rings;
  CommunicatorsSection communicators;
  CudaSection cuda;
  ClusterSection cluster;
  PlansSection plans;

  bool operator==(const DaemonConfig&) const = default;
};

// The cpu workers one session's ops may occupy at once, of the daemon's `workers` threads:
// limits.max_cpu_workers_per_session, or half of them (at least 1) when that is 0; never more than `workers`.
inline uint32_t cpuWorkerShare(const LimitsSection& limits, uint32_t workers) {
  const uint32_t share = limits.maxCpuWorkersPerSession != 0 ? limits.maxCpuWorkersPerSession : workers / 2;
  return share < 1 ? 1 : (share > workers && workers > 0 ? workers : share);
}

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
// log the effective configuration after flags were applied). It includes an inline cluster.secret verbatim:
// blank it before logging.
std::string configYaml(const DaemonConfig& config);

const char* backendName(BackendKind kind);
const char* executorName(ExecutorKind kind);
const char* clusterTransportName(ClusterTransport kind);  // "tcp" | "verbs", as in the YAML
const char* planAutotuneName(PlanAutotune kind);          // "off" | "on-first-use", as in the YAML
const char* gpuExchangeName(GpuExchange kind);            // "on" | "off", as in the YAML

// One entry of cluster.nodes.
struct NodeEndpoint {
  std::string host;  // IPv4 literal, host name, or IPv6 literal without the brackets
  uint16_t port = 0;
  bool operator==(const NodeEndpoint&) const = default;
};
// Parses "host:port", "name:port" or "[v6]:port" (port 1..65535). Throws Error(kInvalidConfig) saying what is
// wrong with `text` and how to write it.
NodeEndpoint parseNodeEndpoint(const std::string& text);

// Two or more nodes: this daemon is part of a multi-node cluster.
inline bool isMultiNode(const ClusterSection& c) { return c.nodes.size() >= 2; }

// The cluster secret: the first line of cluster.secret_file (trailing newline and whitespace stripped), else
// cluster.secret. Throws Error(kInvalidConfig) naming the key (and the path) with the fix when both or neither are
// set, when the file is missing or unreadable, or when the secret is shorter than kMinClusterSecretBytes. Reads
// the file on every call; validateConfig/parseConfig call it for a multi-node config, so a loaded config's file
// was readable at load time.
inline constexpr std::size_t kMinClusterSecretBytes = 16;
std::string clusterSecret(const ClusterSection& c);

}  // namespace tandem::daemon
