// tandemd's configuration: YAML (yaml-cpp) into the plain structs of config.hpp, and back out as commented
// YAML. One table per section (key, help text, member) drives parsing, the unknown-key message and printing,
// so a key cannot be read under one name and printed under another, and the printed defaults are the
// member initialisers themselves.

// gcc 12 instantiates every alternative of a section's Member variant in std::visit, including member types the
// section does not have (a vector<string> of RingsSection), and then warns -Warray-bounds about that dead
// branch. The branch never runs: each field's variant holds the member's real type.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif

#include "config.hpp"

#include <arpa/inet.h>
#include <sys/un.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <type_traits>
#include <variant>

#include "tandem/common/error.hpp"


namespace tandem::daemon {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

// Fewer than 8 slots leaves no room to queue ops while one runs; 65536 slots of 384-byte descriptors
// (sizeof(OpDescriptor)) are already 24 MiB of shared memory per session.
constexpr uint32_t kMinRingCapacity = 8;
constexpr uint32_t kMaxRingCapacity = 65536;
// One page; a smaller cap would refuse ordinary control messages. 64 MiB bounds what one client can make
// the daemon buffer for a single frame.
constexpr uint64_t kMinFrameBytes = 4 * kKiB;
constexpr uint64_t kMaxFrameBytes = 64 * kMiB;
// Below this, ordinary scheduling jitter on a loaded host would declare live ranks lost.
constexpr uint32_t kMinPeerLostDeadlineMs = 100;
constexpr uint32_t kMaxSocketMode = 0777;
// cluster: the tcp transport's own limits, and what keeps heartbeats from flooding or starving the deadline.
constexpr uint32_t kMaxConnectionsPerPeer = 16;
constexpr uint32_t kMinHeartbeatIntervalMs = 10;
constexpr uint64_t kMinStagingBytes = 4 * kKiB;
constexpr uint64_t kMaxStagingBytes = 16 * kGiB;
// A socket path must fit sockaddr_un::sun_path with its terminating NUL.
constexpr std::size_t kSunPathBytes = sizeof(sockaddr_un{}.sun_path);
constexpr std::size_t kFrameHeaderBytes = 4;  // the length prefix of every control frame (common/framing.hpp)
constexpr std::size_t kMaxSecretLineBytes = 64 * 1024;  // a longer first line is not a secret file

// ---- ranges of the numeric keys (each key's Range in its table below names which it uses) ----
constexpr uint64_t kTiB = 1024 * kGiB;
// Beyond the hardware threads of any current host (the largest have a few hundred), more cpu workers only add
// context switches; 100000 made thread creation fail with EAGAIN.
constexpr uint64_t kMaxWorkerThreads = 1024;
// (uid_t)-1 and (gid_t)-1 name no user or group: the kernel reads them as "unchanged" in chown.
constexpr uint64_t kMaxId = 4294967294;
// One page, the granularity of every mapping: a smaller buffer cap refuses every allocation.
constexpr uint64_t kMinBufferBytes = 4 * kKiB;
// Beyond the memory of any single node (host or GPU); a larger cap is no cap.
constexpr uint64_t kMaxMemoryBytes = 16 * kTiB;
// Sessions and connections: the fds they hold (limits.max_fds_per_session each) must fit in the daemon's
// RLIMIT_NOFILE, and the kernel's fs.nr_open defaults to 1048576.
constexpr uint64_t kMaxSessions = 65536;
// A session always holds its socket, its pidfd, its ring memfd and its eventfds; 16 leaves room for a few buffers.
constexpr uint64_t kMinFdsPerSession = 16;
constexpr uint64_t kMaxFdsPerSession = 65536;
// Queued completions cost a few dozen bytes each: 2^20 of them are tens of MiB for one session that never drains.
constexpr uint64_t kMinPendingCompletions = 16;
constexpr uint64_t kMaxPendingCompletions = uint64_t{1} << 20;
constexpr uint64_t kMaxJoiningComms = 4096;
// Below 1 MiB even test-sized cpu ops would be refused.
constexpr uint64_t kMinScratchBytes = kMiB;
// Control-plane deadlines: below 50 ms an honest client on a loaded host misses them; above 10 minutes a
// silent connection holds its fds and buffer for nothing.
constexpr uint64_t kMinControlDeadlineMs = 50;
constexpr uint64_t kMaxControlDeadlineMs = 600000;
// A reply backlog under 64 KiB would disconnect clients that pipeline a handful of requests.
constexpr uint64_t kMinReplyBacklogBytes = 64 * kKiB;
constexpr uint64_t kMaxReplyBacklogBytes = kGiB;
// Past 10 ms of busy polling a core burns for latency no client sees: a sleeping pump wakes in microseconds.
constexpr uint64_t kMaxPollWindowUs = 10000;
// Joins: below 100 ms ranks started together cannot meet; a rendezvous pending for over an hour is a dead job
// whose half-joined communicator only costs memory.
constexpr uint64_t kMinJoinTimeoutMs = 100;
constexpr uint64_t kMaxJoinTimeoutMs = 3600000;
// A dead rank that goes unnoticed for more than 10 minutes is never noticed in practice.
constexpr uint64_t kMaxPeerLostDeadlineMs = 600000;
constexpr uint64_t kMaxLingerMs = 3600000;
// More SMs than any GPU has (an H200 has 132).
constexpr uint64_t kMaxCommSms = 256;
constexpr uint64_t kMinWorkspaceBytes = 16 * kMiB;  // below this nothing useful fits
constexpr uint64_t kMaxWorkspaceBytes = kTiB;       // more than any GPU's memory
constexpr uint64_t kMaxNodeIndex = 65535;
constexpr uint64_t kMaxConnectTimeoutMs = 86400000;  // a day: nodes are started by hand at worst
// Heartbeats further apart than a minute cannot meet any useful peer-lost deadline.
constexpr uint64_t kMaxHeartbeatIntervalMs = 60000;
// Autotune runs every candidate plan this many times on real ops: past 100 the exploration costs more than a
// wrong plan would.
constexpr uint64_t kMaxAutotuneRuns = 100;

constexpr std::array<std::string_view, 5> kLogLevels{"trace", "debug", "info", "warn", "error"};

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};
constexpr std::array<EnumName<BackendKind>, 3> kBackendNames{
    {{BackendKind::kAuto, "auto"}, {BackendKind::kCpu, "cpu"}, {BackendKind::kCuda, "cuda"}}};
constexpr std::array<EnumName<ExecutorKind>, 3> kExecutorNames{
    {{ExecutorKind::kAuto, "auto"}, {ExecutorKind::kDaemon, "daemon"}, {ExecutorKind::kClient, "client"}}};

constexpr std::array<EnumName<ClusterTransport>, 2> kClusterTransportNames{
    {{ClusterTransport::kTcp, "tcp"}, {ClusterTransport::kVerbs, "verbs"}}};
constexpr std::array<EnumName<PlanAutotune>, 2> kPlanAutotuneNames{
    {{PlanAutotune::kOff, "off"}, {PlanAutotune::kOnFirstUse, "on-first-use"}}};

constexpr std::span<const EnumName<BackendKind>> namesOf(BackendKind) { return kBackendNames; }
constexpr std::span<const EnumName<ExecutorKind>> namesOf(ExecutorKind) { return kExecutorNames; }
constexpr std::span<const EnumName<ClusterTransport>> namesOf(ClusterTransport) { return kClusterTransportNames; }
constexpr std::span<const EnumName<PlanAutotune>> namesOf(PlanAutotune) { return kPlanAutotuneNames; }
constexpr std::array<EnumName<GpuExchange>, 2> kGpuExchangeNames{{{GpuExchange::kOn, "on"}, {GpuExchange::kOff, "off"}}};
constexpr std::span<const EnumName<GpuExchange>> namesOf(GpuExchange) { return kGpuExchangeNames; }

// ---- the schema: one table per section ----

// A uint32_t member written in YAML as octal permission bits (0660), like chmod.
template <typename S>
struct OctalMember {
  uint32_t S::*member;
};

template <typename S>
using Member = std::variant<std::string S::*, uint32_t S::*, uint64_t S::*, int32_t S::*, std::vector<uint32_t> S::*,
                            std::vector<std::string> S::*, BackendKind S::*, ExecutorKind S::*,
                            ClusterTransport S::*, PlanAutotune S::*, GpuExchange S::*, OctalMember<S>>;

// The values a numeric key (or each item of a numeric list) may take. The printed config states it under the
// key's help, and checkConfig enforces it, so the two cannot disagree.
struct Range {
  uint64_t min = 0;
  uint64_t max = 0;
  bool empty() const { return min == 0 && max == 0; }
};

template <typename S>
struct Field {
  std::string_view key;   // snake_case, units in the name
  std::string_view help;  // comment lines printed above the key, '\n'-separated
  Member<S> member;
  Range range = {};       // numeric keys only; empty for the others
};

struct SectionHelp {
  std::string_view key;
  std::string_view help;
};

constexpr std::array<SectionHelp, 8> kSections{{
    {"daemon", "The daemon process: where it listens, which backend runs ops, how much it logs."},
    {"access", "Who may connect. Clients are identified by SO_PEERCRED on the socket."},
    {"limits", "Caps on what one client may ask for; a request beyond them fails with an error naming the cap."},
    {"rings", "The shared-memory submission ring of each session."},
    {"communicators", "Communicators: the groups of ranks that run fused ops together."},
    {"cuda", "The cuda backend (the cpu backend ignores this section)."},
    {"cluster",
     "Multi-node: the tandemd of every node connects to the others (authenticated with a shared secret) and\n"
     "communicators span nodes. Leave nodes empty on a single node. Two nodes, the same file on both:\n"
     "  nodes: [\"10.0.0.1:7100\", \"10.0.0.2:7100\"]\n"
     "  secret_file: /etc/tandem/cluster.secret\n"
     "and tandemd --node-index 0 on the first node, --node-index 1 on the second."},
    {"plans",
     "The plan table: per op, shape, dtype, ranks, GPU model and executor, the plan that measured fastest\n"
     "(fused or decomposed, the SM split). Filled by `tandemctl tune` (or `tandemctl advise --save`), kept\n"
     "across restarts, dropped when the GPU, its driver or tandem changes. Without an entry the built-in\n"
     "rules apply. `tandemctl status` shows it."},
}};

constexpr auto kDaemonFields = std::to_array<Field<DaemonSection>>({
    {"socket",
     "Unix socket clients connect to. Empty: /run/tandem/tandemd.sock when run as root, else\n"
     "$XDG_RUNTIME_DIR/tandem/tandemd.sock. A socket passed by systemd (tandemd.socket) is used instead.",
     &DaemonSection::socket},
    {"backend",
     "Where ops run: auto (cuda when a GPU is visible, else cpu), cpu (the host reference backend,\n"
     "never fast) or cuda.",
     &DaemonSection::backend},
    {"executor",
     "Where the cuda backend runs fused kernels: auto (daemon when an MPS control daemon is reachable,\n"
     "else client), daemon (a persistent kernel in tandemd; needs MPS) or client (the caller's stream).",
     &DaemonSection::executor},
    {"log_level", "Log verbosity: trace, debug, info, warn or error.", &DaemonSection::logLevel},
    {"worker_threads", "Threads the cpu backend runs ops on; 0 = one per hardware thread.",
     &DaemonSection::workerThreads, {0, kMaxWorkerThreads}},
    {"stop_grace_ms",
     "After SIGTERM or SIGINT, tandemd closes every session and finishes running ops; if that takes\n"
     "longer than this, it exits at once (status 1) with the reason in its log, rather than hang the\n"
     "node's shutdown. Keep it below the unit's TimeoutStopSec.",
     &DaemonSection::stopGraceMs, {100, 3600000}},
});

constexpr auto kAccessFields = std::to_array<Field<AccessSection>>({
    {"allowed_uids", "User ids that may connect, besides root and the daemon's own user, which always may.",
     &AccessSection::allowedUids, {0, kMaxId}},
    {"allowed_gids", "Group ids that may connect: a client whose primary group is listed may.",
     &AccessSection::allowedGids, {0, kMaxId}},
    {"socket_mode",
     "Permission bits of the socket, always read as octal (like chmod): 0660 lets the owner and\n"
     "the socket's group connect.",
     OctalMember<AccessSection>{&AccessSection::socketMode}},
});

constexpr auto kLimitsFields = std::to_array<Field<LimitsSection>>({
    {"max_frame_bytes", "Largest control-plane message.", &LimitsSection::maxFrameBytes,
     {kMinFrameBytes, kMaxFrameBytes}},
    {"max_buffer_bytes", "Largest single buffer allocation or registration; at most max_session_bytes.",
     &LimitsSection::maxBufferBytes, {kMinBufferBytes, kMaxMemoryBytes}},
    {"max_session_bytes", "Total bytes of all buffers one session may hold, registrations included.",
     &LimitsSection::maxSessionBytes, {kMinBufferBytes, kMaxMemoryBytes}},
    {"max_sessions",
     "Most client sessions connected at once. Connections that have not said Hello yet count too, so a\n"
     "flood of silent connections cannot crowd out clients. The daemon needs about\n"
     "max_sessions x max_fds_per_session open files plus headroom: the shipped systemd unit sets\n"
     "LimitNOFILE=65536 for the defaults (256 x 128 = 32768, plus as much again for connections,\n"
     "communicators and the backend); raise LimitNOFILE with either key.",
     &LimitsSection::maxSessions, {1, kMaxSessions}},
    {"max_sessions_per_uid",
     "Most sessions (and connections not yet past Hello) of one user id, so that one user cannot take\n"
     "every slot of max_sessions.",
     &LimitsSection::maxSessionsPerUid, {1, kMaxSessions}},
    {"max_fds_per_session",
     "File descriptors the daemon holds for one session: one per buffer it allocated or registered, plus\n"
     "its fixed ones (socket, pidfd, ring, eventfds). An allocation beyond it fails naming this key.",
     &LimitsSection::maxFdsPerSession, {kMinFdsPerSession, kMaxFdsPerSession}},
    {"max_pending_completions",
     "Completions the daemon queues for a session beyond its completion ring when the client does not\n"
     "drain the ring; past it the session is closed as unresponsive.",
     &LimitsSection::maxPendingCompletions, {kMinPendingCompletions, kMaxPendingCompletions}},
    {"max_joining_comms_per_session",
     "Communicators one session may have joined that are still waiting for their other ranks.",
     &LimitsSection::maxJoiningCommsPerSession, {1, kMaxJoiningComms}},
    {"max_scratch_bytes",
     "Host scratch memory one cpu-backend op may allocate, computed from its shape; an op that would\n"
     "need more is refused naming this key.",
     &LimitsSection::maxScratchBytes, {kMinScratchBytes, kMaxMemoryBytes}},
    {"max_cpu_workers_per_session",
     "Cpu workers (daemon.worker_threads) one session's ops may occupy at once, so one tenant's large\n"
     "ops cannot hold all of them; 0 = half of the workers, at least 1.",
     &LimitsSection::maxCpuWorkersPerSession, {0, kMaxWorkerThreads}},
    {"hello_timeout_ms", "A new connection that has not sent Hello within this is dropped.",
     &LimitsSection::helloTimeoutMs, {kMinControlDeadlineMs, kMaxControlDeadlineMs}},
    {"frame_timeout_ms",
     "A control message, once its first byte arrived, must arrive whole within this, or the connection\n"
     "is dropped (a client that trickles bytes or leaves a frame half-sent holds memory for nothing).",
     &LimitsSection::frameTimeoutMs, {kMinControlDeadlineMs, kMaxControlDeadlineMs}},
    {"max_reply_backlog_bytes",
     "Replies queued for a client that does not read them; past it the client is disconnected. At\n"
     "least max_frame_bytes + 4, so that any single reply fits.",
     &LimitsSection::maxReplyBacklogBytes, {kMinReplyBacklogBytes, kMaxReplyBacklogBytes}},
});

constexpr auto kRingsFields = std::to_array<Field<RingsSection>>({
    {"capacity", "Descriptors per submission ring; a power of two.", &RingsSection::capacity,
     {kMinRingCapacity, kMaxRingCapacity}},
    {"poll_window_us",
     "After the last descriptor the pump busy-polls this long before sleeping; longer lowers\n"
     "latency for bursty clients, shorter frees the CPU sooner.",
     &RingsSection::pollWindowUs, {0, kMaxPollWindowUs}},
});

constexpr auto kCommunicatorsFields = std::to_array<Field<CommunicatorsSection>>({
    {"join_timeout_ms",
     "Rendezvous timeout used when a client joins a communicator with timeout 0; at most\n"
     "max_join_timeout_ms.",
     &CommunicatorsSection::joinTimeoutMs, {kMinJoinTimeoutMs, kMaxJoinTimeoutMs}},
    {"peer_lost_deadline_ms", "A dead rank's peers get TANDEM_ERROR_PEER_LOST within this.",
     &CommunicatorsSection::peerLostDeadlineMs, {kMinPeerLostDeadlineMs, kMaxPeerLostDeadlineMs}},
    {"max_join_timeout_ms",
     "The longest timeout a client may pass to tandem_comm_init; a longer one is refused naming this\n"
     "key. A communicator waiting for its ranks holds memory until then.",
     &CommunicatorsSection::maxJoinTimeoutMs, {kMinJoinTimeoutMs, kMaxJoinTimeoutMs}},
});

constexpr auto kCudaFields = std::to_array<Field<CudaSection>>({
    {"devices", "GPUs to own, by UUID as `nvidia-smi -L` prints them (\"GPU-...\"); empty = every visible GPU.",
     &CudaSection::devices},
    {"daemon_linger_ms", "With executor daemon, the persistent kernel exits after idling this long.",
     &CudaSection::daemonLingerMs, {0, kMaxLingerMs}},
    {"comm_sms", "SMs given to communication: AllGather's CTA cap and ag-gemm's communication CTAs (gemm-rs and\n"
     "gemm-ar choose their own plan); 0 = chosen per shape, which measured best (bench/RESULTS.md).",
     &CudaSection::commSms, {0, kMaxCommSms}},
    {"workspace_bytes",
     "GPU memory per communicator rank that peers write into (gathered A, reduce-scatter staging, flags,\n"
     "MoE rows): the starting size. A communicator gets more when a rank declares more as it creates it\n"
     "(tandem_comm_config_t.workspace_bytes; an op that needs more fails naming the bytes to declare).\n"
     "Every rank's workspace counts against its session's limits.max_session_bytes.",
     &CudaSection::workspaceBytes, {kMinWorkspaceBytes, kMaxWorkspaceBytes}},
});

constexpr auto kClusterFields = std::to_array<Field<ClusterSection>>({
    {"nodes",
     "Every node's tandemd as \"host:port\" (IPv4 address, host name, or \"[v6]:port\"), the same list in the\n"
     "same order on every node: a node's position in it is its identity. The port is the one tandemd\n"
     "listens on for the other daemons; open it between the nodes. Empty or one entry: a single node.",
     &ClusterSection::nodes},
    {"node_index",
     "This node's 0-based position in nodes. Keep one shared file and pass --node-index N (or set\n"
     "TANDEM_NODE_INDEX) on each node instead of editing it per node.",
     &ClusterSection::nodeIndex, {0, kMaxNodeIndex}},
    {"secret_file",
     "File whose first line is the cluster secret (at least 16 bytes; trailing whitespace ignored), the same\n"
     "on every node. Needed with two or more nodes unless secret is set. Create it once and copy it to every\n"
     "node, readable only by tandemd's user: (umask 077; openssl rand -hex 32 > /etc/tandem/cluster.secret).\n"
     "Give an absolute path: a relative one is read from tandemd's working directory.",
     &ClusterSection::secretFile},
    {"secret",
     "The cluster secret inline, instead of secret_file (set only one). Prefer secret_file: config files are\n"
     "often world-readable, and whoever knows the secret can join the cluster.",
     &ClusterSection::secret},
    {"transport",
     "How op data travels between nodes: tcp (any network) or verbs (RDMA NICs). With verbs the daemons'\n"
     "messages ride the queue pairs too, and a tcp link per peer at the same address sets them up and\n"
     "carries the heartbeats.",
     &ClusterSection::transport},
    {"connections_per_peer",
     "TCP connections (verbs: queue pairs) from this node to each other node; large transfers are\n"
     "striped over them.\n"
     "Must be the same on every node.",
     &ClusterSection::connectionsPerPeer, {1, kMaxConnectionsPerPeer}},
    {"connect_timeout_ms",
     "At startup, how long the daemons wait for every node in nodes to come up and connect; start\n"
     "tandemd on all nodes within this window.",
     &ClusterSection::connectTimeoutMs, {1, kMaxConnectTimeoutMs}},
    {"heartbeat_interval_ms",
     "An idle connection sends a heartbeat this often, so a dead node is noticed within\n"
     "communicators.peer_lost_deadline_ms. With two or more nodes, below half of peer_lost_deadline_ms.",
     &ClusterSection::heartbeatIntervalMs, {kMinHeartbeatIntervalMs, kMaxHeartbeatIntervalMs}},
    {"staging_bytes",
     "Size of the inbox and of the outbox a multi-node communicator keeps for each peer node; memory\n"
     "grows with communicators x peer nodes.",
     &ClusterSection::stagingBytes, {kMinStagingBytes, kMaxStagingBytes}},
    {"gpu_exchange",
     "cuda backend: on (the default) lets the GPUs issue a communicator's transfers between nodes\n"
     "themselves for ag-gemm, gemm-rs, gemm-ar and allgather (a proxy thread per GPU posts them; verbs\n"
     "writes GPU memory to GPU memory, tcp sends from and receives into mapped pinned host memory that the\n"
     "GPUs fill and read by DMA); off moves them through host memory on tandemd's link thread (the staged\n"
     "exchange). Over tcp on one H200 the two measured the same (bench/RESULTS.md). Ops the GPU\n"
     "exchange cannot take use the staged path either way, and each op's plan line names its path. Under\n"
     "MPS on verbs its region is in mapped pinned host memory (a GPU-memory region stalled there).\n"
     "Must be the same on every node. Each communicator that uses it holds staging_bytes x its nodes of\n"
     "memory (pinned host memory on tcp, GPU memory on verbs) for its first local rank's GPU: an inbox per\n"
     "peer node and one send area.",
     &ClusterSection::gpuExchange},
});

constexpr auto kPlansFields = std::to_array<Field<PlansSection>>({
    {"state_dir",
     "Directory of the plan table file (plans.json). Empty: $STATE_DIRECTORY (systemd's\n"
     "StateDirectory=tandem, i.e. /var/lib/tandem), else /var/lib/tandem as root, else\n"
     "$XDG_STATE_HOME/tandem (~/.local/state/tandem).",
     &PlansSection::stateDir},
    {"autotune",
     "off: only tandemctl tune fills the table. on-first-use: the first ops of a shape with no entry run\n"
     "each candidate plan autotune_runs times (results stay correct), and the fastest is saved.",
     &PlansSection::autotune},
    {"autotune_runs", "With autotune on-first-use: timed ops per candidate plan.", &PlansSection::autotuneRuns,
     {1, kMaxAutotuneRuns}},
});

// ---- small text helpers ----

template <typename Range>
std::string joinComma(const Range& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

// "a, b or c"
template <typename Range>
std::string joinOr(const Range& items) {
  std::string out;
  const std::size_t n = std::size(items);
  std::size_t i = 0;
  for (const auto& item : items) {
    if (i > 0) out += (i + 1 == n) ? " or " : ", ";
    out += item;
    ++i;
  }
  return out;
}

template <typename E>
std::vector<std::string_view> enumNameList() {
  std::vector<std::string_view> names;
  for (const auto& entry : namesOf(E{})) names.push_back(entry.name);
  return names;
}

template <typename S, std::size_t N>
std::vector<std::string_view> keysOf(const std::array<Field<S>, N>& fields) {
  std::vector<std::string_view> keys;
  for (const auto& field : fields) keys.push_back(field.key);
  return keys;
}

std::size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// " Did you mean 'capacity'?" for a near miss (a typo or two), else "".
std::string didYouMean(std::string_view key, std::span<const std::string_view> validKeys) {
  std::string_view best;
  std::size_t bestDistance = 3;  // further than two edits is a different word, not a typo
  for (const auto candidate : validKeys) {
    const std::size_t d = editDistance(key, candidate);
    if (d < bestDistance) {
      bestDistance = d;
      best = candidate;
    }
  }
  return best.empty() ? std::string() : fmt::format(" Did you mean '{}'?", best);
}

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return fmt::format("'{}'", node.Scalar());
    default:
      return "nothing";
  }
}

// "16 GiB" (or TiB, MiB, KiB) for whole binary multiples, else "".
std::string humanBytes(uint64_t bytes) {
  if (bytes == 0) return {};
  if (bytes % kTiB == 0) return fmt::format("{} TiB", bytes / kTiB);
  if (bytes % kGiB == 0) return fmt::format("{} GiB", bytes / kGiB);
  if (bytes % kMiB == 0) return fmt::format("{} MiB", bytes / kMiB);
  if (bytes % kKiB == 0) return fmt::format("{} KiB", bytes / kKiB);
  return {};
}

std::string joinPath(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string(key) : fmt::format("{}.{}", parent, key);
}

// ---- checks shared by parseConfig (with line:column) and validateConfig (without) ----

// Returns the "source:line:col: " prefix for the first of `paths` that the file set, "" when there is none.
using Locate = std::function<std::string(std::initializer_list<std::string_view> paths)>;

const Locate kNoLocation = [](std::initializer_list<std::string_view>) { return std::string(); };

// An IPv4 literal, or a host name: dot-separated labels of letters, digits, '-' and '_', not starting or ending
// with '-'. All digits and dots must be a valid IPv4 address (10.0.0.256 is a typo, not a name).
bool validHost(std::string_view host) {
  if (host.size() > 253) return false;
  if (std::all_of(host.begin(), host.end(), [](char c) { return (c >= '0' && c <= '9') || c == '.'; })) {
    in_addr a4{};
    return ::inet_pton(AF_INET, std::string(host).c_str(), &a4) == 1;
  }
  std::size_t start = 0;
  while (start <= host.size()) {
    const std::size_t dot = std::min(host.find('.', start), host.size());
    const std::string_view label = host.substr(start, dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
    if (!std::all_of(label.begin(), label.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '_';
        }))
      return false;
    start = dot + 1;
  }
  return true;
}

// What is wrong with one cluster.nodes entry, as a sentence and its fix ("" when nothing); fills `out` when fine.
std::string endpointProblem(std::string_view text, NodeEndpoint& out) {
  constexpr std::string_view kForms = "such as 10.0.0.1:7100, node1.example.com:7100 or [fd00::1]:7100";
  if (text.empty()) return fmt::format("is empty. Write host:port, {}.", kForms);
  std::string_view host;
  std::string_view port;
  if (text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string_view::npos)
      return fmt::format("'{}' opens '[' without a closing ']'. Write an IPv6 address as [fd00::1]:7100.", text);
    host = text.substr(1, close - 1);
    in6_addr a6{};
    if (::inet_pton(AF_INET6, std::string(host).c_str(), &a6) != 1)
      return fmt::format("'{}': '{}' is not an IPv6 address. Brackets hold IPv6 addresses only; write other hosts "
                         "without them, {}.", text, host, kForms);
    const std::string_view rest = text.substr(close + 1);
    if (rest.empty() || rest.front() != ':')
      return fmt::format("'{}' has no ':port' after ']'. Add the port tandemd listens on for the cluster, such as "
                         "[{}]:7100.", text, host);
    port = rest.substr(1);
  } else {
    const std::size_t colon = text.rfind(':');
    if (colon == std::string_view::npos)
      return fmt::format("'{}' has no port. Add the port tandemd listens on for the cluster, such as {}:7100.", text,
                         text);
    if (text.find(':') != colon)
      return fmt::format("'{}' has more than one ':'. Write an IPv6 address in brackets, such as [fd00::1]:7100.",
                         text);
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.empty()) return fmt::format("'{}' has no host before ':'. Write host:port, {}.", text, kForms);
    if (!validHost(host))
      return fmt::format("'{}': '{}' is neither an IPv4 address nor a host name (letters, digits, '-', '.'). Write "
                         "host:port, {}.", text, host, kForms);
  }
  unsigned number = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), number);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || number == 0 || number > 65535)
    return fmt::format("'{}': port '{}' is not a number from 1 to 65535. Use the fixed port tandemd listens on for "
                       "the cluster, such as 7100.", text, port);
  out = NodeEndpoint{std::string(host), static_cast<uint16_t>(number)};
  return {};
}

// The first line of a secret file, trailing whitespace stripped; errors name the key, the path and the fix, never
// the secret.
std::string readSecretFile(const std::string& path, const std::string& where) {
  const auto failRead = [&](int err) {
    const std::string remedy =
        err == ENOENT
            ? fmt::format("Create it once, readable only by tandemd's user, and copy the same file to every node "
                          "((umask 077; openssl rand -hex 32 > {})), or fix cluster.secret_file.", path)
        : err == EACCES ? std::string("Make it readable by the user tandemd runs as (chown it to them, chmod 600).")
        : err == EISDIR ? std::string("Point cluster.secret_file at a file, not a directory.")
                        : std::string("Check the path and its permissions.");
    fail(ErrorCode::kInvalidConfig, "{}cluster.secret_file: cannot read the cluster secret from {}: {}. {}", where,
         path, std::strerror(err), remedy);
  };
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) failRead(errno);
  std::string line;
  for (int c = std::fgetc(file.get()); c != EOF && c != '\n'; c = std::fgetc(file.get())) {
    if (line.size() == kMaxSecretLineBytes) {
      fail(ErrorCode::kInvalidConfig,
           "{}cluster.secret_file: the first line of {} is longer than {} bytes, so it is not a secret file. Put the "
           "secret alone on the first line ((umask 077; openssl rand -hex 32 > {})).",
           where, path, kMaxSecretLineBytes, path);
    }
    line += static_cast<char>(c);
  }
  if (std::ferror(file.get()) != 0) failRead(errno != 0 ? errno : EIO);
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back())) != 0) line.pop_back();
  if (line.size() < kMinClusterSecretBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.secret_file: the secret on the first line of {} is {} bytes; at least {} are needed. Put a long "
         "random secret there ((umask 077; openssl rand -hex 32 > {})) and copy the file to every node.",
         where, path, line.size(), kMinClusterSecretBytes, path);
  }
  return line;
}

// The checks of secret and secret_file that need no file: not both, and an inline secret long enough.
void checkSecretShape(const ClusterSection& c, const Locate& at) {
  if (!c.secret.empty() && !c.secretFile.empty()) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.secret and cluster.secret_file are both set. Keep only one: preferably secret_file (config files "
         "are often world-readable), so remove cluster.secret.",
         at({"cluster.secret", "cluster.secret_file"}));
  }
  if (!c.secret.empty() && c.secret.size() < kMinClusterSecretBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.secret: the secret is {} bytes; at least {} are needed. Use a long random secret, the same on "
         "every node, such as the output of `openssl rand -hex 32` (better: put it in a file and set "
         "cluster.secret_file).",
         at({"cluster.secret"}), c.secret.size(), kMinClusterSecretBytes);
  }
}

std::string resolveSecret(const ClusterSection& c, const Locate& at) {
  checkSecretShape(c, at);
  if (!c.secretFile.empty()) return readSecretFile(c.secretFile, at({"cluster.secret_file"}));
  if (c.secret.empty()) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster: no cluster secret is set, and the daemons of a cluster authenticate each other with it. Create "
         "one and copy it to every node ((umask 077; openssl rand -hex 32 > /etc/tandem/cluster.secret)), then set "
         "cluster.secret_file to that path.",
         at({"cluster.nodes"}));
  }
  return c.secret;
}

void checkCluster(const DaemonConfig& config, const Locate& at) {
  const ClusterSection& k = config.cluster;
  std::vector<std::pair<NodeEndpoint, std::size_t>> seen;
  for (std::size_t i = 0; i < k.nodes.size(); ++i) {
    const std::string path = fmt::format("cluster.nodes[{}]", i);
    NodeEndpoint endpoint;
    if (const std::string problem = endpointProblem(k.nodes[i], endpoint); !problem.empty())
      fail(ErrorCode::kInvalidConfig, "{}{}: {}", at({path}), path, problem);
    std::transform(endpoint.host.begin(), endpoint.host.end(), endpoint.host.begin(),
                   [](char ch) { return static_cast<char>(std::tolower(static_cast<unsigned char>(ch))); });
    for (const auto& [other, j] : seen) {
      if (other == endpoint) {
        fail(ErrorCode::kInvalidConfig,
             "{}{}: '{}' is listed twice (also cluster.nodes[{}]). List each node once; two daemons on one host "
             "need different ports.",
             at({path}), path, k.nodes[i], j);
      }
    }
    seen.emplace_back(std::move(endpoint), i);
  }
  if (k.nodeIndex < 0) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.node_index: {} is negative. Set cluster.node_index (or --node-index / TANDEM_NODE_INDEX) to this "
         "node's 0-based position in cluster.nodes.",
         at({"cluster.node_index"}), k.nodeIndex);
  }
  if (isMultiNode(k) && static_cast<std::size_t>(k.nodeIndex) >= k.nodes.size()) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.node_index: {} is not a position in cluster.nodes, which lists {} nodes (0 to {}). Set "
         "cluster.node_index (or --node-index / TANDEM_NODE_INDEX) to this node's 0-based position in that list.",
         at({"cluster.node_index", "cluster.nodes"}), k.nodeIndex, k.nodes.size(), k.nodes.size() - 1);
  }
  if (k.connectionsPerPeer == 0 || k.connectionsPerPeer > kMaxConnectionsPerPeer) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.connections_per_peer: {} is outside 1 to {}. Set cluster.connections_per_peer within that range "
         "(default {}), the same on every node.",
         at({"cluster.connections_per_peer"}), k.connectionsPerPeer, kMaxConnectionsPerPeer,
         ClusterSection{}.connectionsPerPeer);
  }
  if (k.connectTimeoutMs == 0) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.connect_timeout_ms: 0 would give up before any node connects. Set it to how long the daemons may "
         "wait for every node to start (default {}).",
         at({"cluster.connect_timeout_ms"}), ClusterSection{}.connectTimeoutMs);
  }
  const uint32_t deadline = config.communicators.peerLostDeadlineMs;
  if (k.heartbeatIntervalMs < kMinHeartbeatIntervalMs) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.heartbeat_interval_ms: {} is below the minimum of {} ms. Set cluster.heartbeat_interval_ms to {} "
         "or more (default {}).",
         at({"cluster.heartbeat_interval_ms"}), k.heartbeatIntervalMs, kMinHeartbeatIntervalMs,
         kMinHeartbeatIntervalMs, ClusterSection{}.heartbeatIntervalMs);
  }
  // Only a cluster sends heartbeats: a single node may keep the short peer-lost deadlines it always could.
  if (isMultiNode(k) && uint64_t{k.heartbeatIntervalMs} * 2 >= deadline) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.heartbeat_interval_ms: {} is not below half of communicators.peer_lost_deadline_ms ({}), so one "
         "late heartbeat would report a live node lost. Set cluster.heartbeat_interval_ms to at most {} or raise "
         "communicators.peer_lost_deadline_ms.",
         at({"cluster.heartbeat_interval_ms", "communicators.peer_lost_deadline_ms"}), k.heartbeatIntervalMs,
         deadline, (deadline - 1) / 2);
  }
  if (k.stagingBytes < kMinStagingBytes || k.stagingBytes > kMaxStagingBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}cluster.staging_bytes: {} is outside {} ({}) to {} ({}). Set cluster.staging_bytes within that range; the "
         "default is {} ({}).",
         at({"cluster.staging_bytes"}), k.stagingBytes, kMinStagingBytes, humanBytes(kMinStagingBytes),
         kMaxStagingBytes, humanBytes(kMaxStagingBytes), ClusterSection{}.stagingBytes,
         humanBytes(ClusterSection{}.stagingBytes));
  }
  checkSecretShape(k, at);
  if (isMultiNode(k)) (void)resolveSecret(k, at);  // read secret_file now: a missing file fails the load, not the join
}

// "4096 (4 KiB)" for byte keys with a whole binary multiple, else the plain number.
std::string describeValue(std::string_view key, uint64_t value) {
  const std::string human = key.ends_with("_bytes") ? humanBytes(value) : std::string();
  return human.empty() ? fmt::format("{}", value) : fmt::format("{} ({})", value, human);
}

// Every key of one section with a Range: its value (each item, for a list) lies within it.
template <typename S, std::size_t N>
void checkRanges(std::string_view sectionKey, const S& section, const std::array<Field<S>, N>& fields,
                 const Locate& at) {
  const S defaults{};
  for (const auto& field : fields) {
    if (field.range.empty()) continue;
    const std::string path = joinPath(sectionKey, field.key);
    // `shown` is the value as written (a negative int32 has no uint64_t form); `value` is nullopt when negative.
    const auto check = [&](const std::string& itemPath, std::optional<uint64_t> value, const std::string& shown,
                           const std::string& defaultText) {
      if (value && *value >= field.range.min && *value <= field.range.max) return;
      fail(ErrorCode::kInvalidConfig, "{}{}: {} is outside the range {} to {}. Set {} within that range (default {}).",
           at({itemPath, path}), itemPath, shown, describeValue(field.key, field.range.min),
           describeValue(field.key, field.range.max), path, defaultText);
    };
    std::visit(
        [&](auto member) {
          using M = decltype(member);
          if constexpr (std::is_same_v<M, uint32_t S::*> || std::is_same_v<M, uint64_t S::*>) {
            const uint64_t value = section.*member;
            check(path, value, describeValue(field.key, value), describeValue(field.key, defaults.*member));
          } else if constexpr (std::is_same_v<M, int32_t S::*>) {
            const int32_t value = section.*member;
            check(path, value < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(value)),
                  fmt::format("{}", value), fmt::format("{}", defaults.*member));
          } else if constexpr (std::is_same_v<M, std::vector<uint32_t> S::*>) {
            const auto& items = section.*member;
            for (std::size_t i = 0; i < items.size(); ++i) {
              check(fmt::format("{}[{}]", path, i), items[i], fmt::format("{}", items[i]), "[]");
            }
          }
        },
        field.member);
  }
}

void checkConfig(const DaemonConfig& config, const Locate& at) {
  // kMinWorkspaceBytes: a communicator always gets at least AllGather's region for its rank count.
  if (config.cuda.workspaceBytes < kMinWorkspaceBytes) {
    fail(ErrorCode::kInvalidConfig, "{}cuda.workspace_bytes: {} is below the minimum {} ({}). Set at least {}; the "
         "default is {} ({}).", at({"cuda.workspace_bytes"}), config.cuda.workspaceBytes, kMinWorkspaceBytes,
         humanBytes(kMinWorkspaceBytes), kMinWorkspaceBytes, CudaSection{}.workspaceBytes,
         humanBytes(CudaSection{}.workspaceBytes));
  }
  const DaemonSection& d = config.daemon;
  if (d.socket.size() >= kSunPathBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}daemon.socket: the path is {} bytes, but a Unix socket address holds at most {} (sun_path). Set "
         "daemon.socket (or --socket) to a shorter path, such as one under /run/tandem or $XDG_RUNTIME_DIR.",
         at({"daemon.socket"}), d.socket.size(), kSunPathBytes - 1);
  }
  if (std::find(kLogLevels.begin(), kLogLevels.end(), d.logLevel) == kLogLevels.end()) {
    fail(ErrorCode::kInvalidConfig, "{}daemon.log_level: '{}' is not one of {}. Set daemon.log_level to {}.",
         at({"daemon.log_level"}), d.logLevel, joinComma(kLogLevels), joinOr(kLogLevels));
  }

  const AccessSection& a = config.access;
  if (a.socketMode > kMaxSocketMode) {
    fail(ErrorCode::kInvalidConfig,
         "{}access.socket_mode: 0{:03o} has bits beyond 0777 (setuid, setgid and sticky mean nothing on a socket). "
         "Set access.socket_mode to permission bits only, such as 0{:03o}.",
         at({"access.socket_mode"}), a.socketMode, AccessSection{}.socketMode);
  }

  const LimitsSection& l = config.limits;
  if (l.maxFrameBytes < kMinFrameBytes || l.maxFrameBytes > kMaxFrameBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}limits.max_frame_bytes: {} is outside {} ({}) to {} ({}). Set limits.max_frame_bytes within that "
         "range; the default is {}.",
         at({"limits.max_frame_bytes"}), l.maxFrameBytes, kMinFrameBytes, humanBytes(kMinFrameBytes), kMaxFrameBytes,
         humanBytes(kMaxFrameBytes), LimitsSection{}.maxFrameBytes);
  }
  if (l.maxBufferBytes > l.maxSessionBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}limits.max_buffer_bytes: {} is larger than limits.max_session_bytes ({}), so no session could hold "
         "such a buffer. Lower limits.max_buffer_bytes or raise limits.max_session_bytes.",
         at({"limits.max_buffer_bytes", "limits.max_session_bytes"}), l.maxBufferBytes, l.maxSessionBytes);
  }
  if (l.maxSessions == 0) {
    fail(ErrorCode::kInvalidConfig,
         "{}limits.max_sessions: 0 would refuse every client. Set limits.max_sessions to 1 or more (default {}).",
         at({"limits.max_sessions"}), LimitsSection{}.maxSessions);
  }

  const RingsSection& r = config.rings;
  if (r.capacity < kMinRingCapacity || r.capacity > kMaxRingCapacity || !std::has_single_bit(r.capacity)) {
    const uint32_t suggestion =
        r.capacity > kMaxRingCapacity ? kMaxRingCapacity : std::max(kMinRingCapacity, std::bit_ceil(r.capacity));
    fail(ErrorCode::kInvalidConfig,
         "{}rings.capacity: {} is not a power of two from {} to {}. Set rings.capacity to a power of two such as {}.",
         at({"rings.capacity"}), r.capacity, kMinRingCapacity, kMaxRingCapacity, suggestion);
  }

  const CommunicatorsSection& c = config.communicators;
  if (c.peerLostDeadlineMs < kMinPeerLostDeadlineMs) {
    fail(ErrorCode::kInvalidConfig,
         "{}communicators.peer_lost_deadline_ms: {} is below the minimum of {} ms, at which live ranks would be "
         "reported lost. Set communicators.peer_lost_deadline_ms to {} or more (default {}).",
         at({"communicators.peer_lost_deadline_ms"}), c.peerLostDeadlineMs, kMinPeerLostDeadlineMs,
         kMinPeerLostDeadlineMs, CommunicatorsSection{}.peerLostDeadlineMs);
  }

  const CudaSection& g = config.cuda;
  std::set<std::string_view> seen;
  for (std::size_t i = 0; i < g.devices.size(); ++i) {
    const std::string path = fmt::format("cuda.devices[{}]", i);
    if (g.devices[i].empty()) {
      fail(ErrorCode::kInvalidConfig,
           "{}{}: empty GPU UUID. List UUIDs as `nvidia-smi -L` prints them (GPU-...), or leave cuda.devices empty "
           "to use every visible GPU.",
           at({path}), path);
    }
    if (!seen.insert(g.devices[i]).second) {
      fail(ErrorCode::kInvalidConfig, "{}{}: '{}' is listed twice. Remove the duplicate from cuda.devices.", at({path}),
           path, g.devices[i]);
    }
  }

  checkCluster(config, at);

  // The specific checks above explain the common mistakes; these bound every numeric key.
  checkRanges("daemon", config.daemon, kDaemonFields, at);
  checkRanges("access", config.access, kAccessFields, at);
  checkRanges("limits", config.limits, kLimitsFields, at);
  checkRanges("rings", config.rings, kRingsFields, at);
  checkRanges("communicators", config.communicators, kCommunicatorsFields, at);
  checkRanges("cuda", config.cuda, kCudaFields, at);
  checkRanges("cluster", config.cluster, kClusterFields, at);
  checkRanges("plans", config.plans, kPlansFields, at);

  // Cross-key rules over the keys added with the ranges.
  if (l.maxReplyBacklogBytes < l.maxFrameBytes + kFrameHeaderBytes) {
    fail(ErrorCode::kInvalidConfig,
         "{}limits.max_reply_backlog_bytes: {} is less than one largest reply (limits.max_frame_bytes {} + {} bytes "
         "of header), so a client could be disconnected for a single reply. Raise limits.max_reply_backlog_bytes to "
         "at least {} or lower limits.max_frame_bytes.",
         at({"limits.max_reply_backlog_bytes", "limits.max_frame_bytes"}), l.maxReplyBacklogBytes, l.maxFrameBytes,
         kFrameHeaderBytes, l.maxFrameBytes + kFrameHeaderBytes);
  }
  if (c.joinTimeoutMs > c.maxJoinTimeoutMs) {
    fail(ErrorCode::kInvalidConfig,
         "{}communicators.join_timeout_ms: {} is above communicators.max_join_timeout_ms ({}), so a default join "
         "would be refused. Lower communicators.join_timeout_ms or raise communicators.max_join_timeout_ms.",
         at({"communicators.join_timeout_ms", "communicators.max_join_timeout_ms"}), c.joinTimeoutMs,
         c.maxJoinTimeoutMs);
  }
}

// ---- the parser ----

class Parser {
 public:
  explicit Parser(std::string_view source) : source_(source) {}

  DaemonConfig parse(const std::string& text) {
    std::vector<YAML::Node> documents;
    try {
      documents = YAML::LoadAll(text);
    } catch (const YAML::Exception& e) {
      fail(ErrorCode::kInvalidConfig,
           "{}YAML syntax error: {}. Fix the YAML at that position; `tandemd --print-default-config` prints a valid "
           "file to compare with.",
           where(e.mark), e.msg);
    }
    DaemonConfig config;
    if (documents.size() > 1) {
      fail(ErrorCode::kInvalidConfig,
           "{}a second YAML document starts here, but tandemd reads one. Remove the '---' line and merge the keys "
           "into the first document.",
           where(documents[1].Mark()));
    }
    if (documents.empty() || documents[0].IsNull()) return config;  // empty, or only comments
    const YAML::Node& root = documents[0];
    if (!root.IsMap()) {
      fail(ErrorCode::kInvalidConfig,
           "{}the top level is {}, not a map of sections. Write sections such as 'daemon:' at the top level "
           "(valid: {}).",
           where(root.Mark()), describe(root), joinComma(sectionKeys()));
    }
    forEachEntry(root, "", sectionKeys(),
                 [&](std::string_view key, const std::string& path, const YAML::Node& value, const YAML::Mark&) {
                   if (key == "daemon") config.daemon = parseDaemon(value, path);
                   if (key == "access") config.access = parseAccess(value, path);
                   if (key == "limits") config.limits = parseLimits(value, path);
                   if (key == "rings") config.rings = parseRings(value, path);
                   if (key == "communicators") config.communicators = parseCommunicators(value, path);
                   if (key == "cuda") config.cuda = parseCuda(value, path);
                   if (key == "cluster") config.cluster = parseSection(value, path, kClusterFields);
                   if (key == "plans") config.plans = parseSection(value, path, kPlansFields);
                 });
    checkConfig(config, [this](std::initializer_list<std::string_view> paths) {
      for (const auto path : paths) {
        if (const auto it = marks_.find(path); it != marks_.end()) return where(it->second);
      }
      return fmt::format("{}: ", source_);
    });
    return config;
  }

 private:
  static std::vector<std::string_view> sectionKeys() {
    std::vector<std::string_view> keys;
    for (const auto& section : kSections) keys.push_back(section.key);
    return keys;
  }

  // "source:line:column: " (1-based), or "source: " when yaml-cpp has no position.
  std::string where(const YAML::Mark& mark) const {
    if (mark.is_null()) return fmt::format("{}: ", source_);
    return fmt::format("{}:{}:{}: ", source_, mark.line + 1, mark.column + 1);
  }

  // An absent value (`key:` with nothing after it) carries the position of whatever follows; point at the key.
  static YAML::Mark valueMark(const YAML::Node& key, const YAML::Node& value) {
    return value.IsNull() || value.Mark().is_null() ? key.Mark() : value.Mark();
  }

  // Calls fn(key, path, value, mark) for each entry, after rejecting non-scalar, unknown and duplicate keys.
  template <typename Fn>
  void forEachEntry(const YAML::Node& map, std::string_view parent, std::span<const std::string_view> validKeys,
                    Fn&& fn) {
    const std::string validList = parent.empty() ? fmt::format("Valid top-level keys: {}.", joinComma(validKeys))
                                                 : fmt::format("Valid keys in {}: {}.", parent, joinComma(validKeys));
    std::set<std::string, std::less<>> seen;
    for (const auto& entry : map) {
      // Copies, not references: yaml-cpp's map iterators yield temporaries that die with the iteration.
      const YAML::Node keyNode = entry.first;
      const YAML::Node value = entry.second;
      if (!keyNode.IsScalar()) {
        fail(ErrorCode::kInvalidConfig, "{}{}: a key is {}, not a name. {}", where(keyNode.Mark()),
             parent.empty() ? "top level" : parent, describe(keyNode), validList);
      }
      const std::string& key = keyNode.Scalar();
      const std::string path = joinPath(parent, key);
      if (std::find(validKeys.begin(), validKeys.end(), key) == validKeys.end()) {
        fail(ErrorCode::kInvalidConfig, "{}{}: unknown key. {}{}", where(keyNode.Mark()), path, validList,
             didYouMean(key, validKeys));
      }
      if (!seen.insert(key).second) {
        fail(ErrorCode::kInvalidConfig, "{}{}: duplicate key; it is already set above. Keep only one.",
             where(keyNode.Mark()), path);
      }
      fn(std::string_view(key), path, value, valueMark(keyNode, value));
    }
  }

  DaemonSection parseDaemon(const YAML::Node& node, std::string_view path) {
    return parseSection(node, path, kDaemonFields);
  }
  AccessSection parseAccess(const YAML::Node& node, std::string_view path) {
    return parseSection(node, path, kAccessFields);
  }
  LimitsSection parseLimits(const YAML::Node& node, std::string_view path) {
    return parseSection(node, path, kLimitsFields);
  }
  RingsSection parseRings(const YAML::Node& node, std::string_view path) {
    return parseSection(node, path, kRingsFields);
  }
  CommunicatorsSection parseCommunicators(const YAML::Node& node, std::string_view path) {
    return parseSection(node, path, kCommunicatorsFields);
  }
  CudaSection parseCuda(const YAML::Node& node, std::string_view path) { return parseSection(node, path, kCudaFields); }

  template <typename S, std::size_t N>
  S parseSection(const YAML::Node& node, std::string_view path, const std::array<Field<S>, N>& fields) {
    S section;
    if (node.IsNull()) return section;  // `rings:` with nothing under it: all defaults
    const std::vector<std::string_view> keys = keysOf(fields);
    if (!node.IsMap()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: expected a map of keys ({}), got {}. Indent those keys under '{}:'.",
           where(node.Mark()), path, joinComma(keys), describe(node), path);
    }
    forEachEntry(
        node, path, keys,
        [&](std::string_view key, const std::string& keyPath, const YAML::Node& value, const YAML::Mark& mark) {
          marks_[keyPath] = mark;
          const auto field =
              std::find_if(fields.begin(), fields.end(), [&](const Field<S>& f) { return f.key == key; });
          std::visit([&](auto member) { parseValue(section, member, value, keyPath, mark); }, field->member);
        });
    return section;
  }

  template <typename S>
  void parseValue(S& section, std::string S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = parseString(value, path, mark);
  }
  template <typename S>
  void parseValue(S& section, uint32_t S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = static_cast<uint32_t>(parseUnsigned(value, path, mark, std::numeric_limits<uint32_t>::max()));
  }
  template <typename S>
  void parseValue(S& section, uint64_t S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = parseUnsigned(value, path, mark, std::numeric_limits<uint64_t>::max());
  }
  template <typename S>
  void parseValue(S& section, int32_t S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = parseInt32(value, path, mark);
  }
  template <typename S>
  void parseValue(S& section, std::vector<uint32_t> S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = parseList<uint32_t>(
        value, path, mark, [&](const YAML::Node& item, const std::string& itemPath, const YAML::Mark& itemMark) {
          return static_cast<uint32_t>(parseUnsigned(item, itemPath, itemMark, std::numeric_limits<uint32_t>::max()));
        });
  }
  template <typename S>
  void parseValue(S& section, std::vector<std::string> S::*member, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    section.*member = parseList<std::string>(
        value, path, mark, [&](const YAML::Node& item, const std::string& itemPath, const YAML::Mark& itemMark) {
          return parseString(item, itemPath, itemMark);
        });
  }
  template <typename S, typename E>
  requires std::is_enum_v<E>
  void parseValue(S& section, E S::*member, const YAML::Node& value, const std::string& path, const YAML::Mark& mark) {
    const std::vector<std::string_view> names = enumNameList<E>();
    if (value.IsScalar()) {
      for (const auto& entry : namesOf(E{})) {
        if (value.Scalar() == entry.name) {
          section.*member = entry.value;
          return;
        }
      }
      fail(ErrorCode::kInvalidConfig, "{}{}: '{}' is not one of {}. Set {} to {}.", where(mark), path, value.Scalar(),
           joinComma(names), path, joinOr(names));
    }
    fail(ErrorCode::kInvalidConfig, "{}{}: expected one of {}, got {}. Set {} to {}.", where(mark), path,
         joinComma(names), describe(value), path, joinOr(names));
  }
  template <typename S>
  void parseValue(S& section, OctalMember<S> octal, const YAML::Node& value, const std::string& path,
                  const YAML::Mark& mark) {
    // yaml-cpp 0.7 converts a plain 0660 as octal but YAML 1.2 says decimal, and a quoted "0660" is a string:
    // read the text ourselves so every spelling means the same bits.
    if (value.IsScalar()) {
      std::string_view text = value.Scalar();
      if (text.starts_with("0o") || text.starts_with("0O")) text.remove_prefix(2);
      uint32_t mode = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mode, 8);
      if (!text.empty() && ec == std::errc() && end == text.data() + text.size()) {
        section.*(octal.member) = mode;
        return;
      }
    }
    fail(ErrorCode::kInvalidConfig,
         "{}{}: {} is not an octal mode. Set {} to octal permission bits such as 0{:03o} (quoted or not, it is read "
         "as octal).",
         where(mark), path, value.IsScalar() ? describe(value) : fmt::format("{}, not a number,", describe(value)),
         path, AccessSection{}.socketMode);
  }

  std::string parseString(const YAML::Node& value, const std::string& path, const YAML::Mark& mark) {
    if (value.IsNull()) return {};
    if (!value.IsScalar()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: expected a string, got {}. Set {} to a single string.", where(mark), path,
           describe(value), path);
    }
    return value.Scalar();
  }

  // Decimal digits only: no sign, no yaml-cpp base guessing (0660 would silently become 432).
  uint64_t parseUnsigned(const YAML::Node& value, const std::string& path, const YAML::Mark& mark, uint64_t max) {
    if (value.IsNull()) {
      fail(ErrorCode::kInvalidConfig,
           "{}{}: has no value. Set {} to a non-negative integer, or remove the key to use the default.", where(mark),
           path, path);
    }
    if (!value.IsScalar()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: expected a non-negative integer, got {}. Set {} to a single number.",
           where(mark), path, describe(value), path);
    }
    const std::string& text = value.Scalar();
    const auto isDigits = [](std::string_view s) {
      return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (text.starts_with('-') && isDigits(std::string_view(text).substr(1))) {
      fail(ErrorCode::kInvalidConfig, "{}{}: {} is negative. Set {} to 0 or more.", where(mark), path, text, path);
    }
    if (!isDigits(text)) {
      fail(ErrorCode::kInvalidConfig, "{}{}: '{}' is not a non-negative integer. Set {} to a number in decimal digits.",
           where(mark), path, text, path);
    }
    uint64_t number = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
    if (ec != std::errc() || number > max) {
      fail(ErrorCode::kInvalidConfig, "{}{}: {} is too large. Set {} to at most {}.", where(mark), path, text, path,
           max);
    }
    return number;
  }

  // Decimal digits with an optional leading '-'.
  int32_t parseInt32(const YAML::Node& value, const std::string& path, const YAML::Mark& mark) {
    if (value.IsNull()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: has no value. Set {} to an integer, or remove the key to use the default.",
           where(mark), path, path);
    }
    if (!value.IsScalar()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: expected an integer, got {}. Set {} to a single number.", where(mark),
           path, describe(value), path);
    }
    const std::string& text = value.Scalar();
    const std::string_view digits = std::string_view(text).substr(text.starts_with('-') ? 1 : 0);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      fail(ErrorCode::kInvalidConfig, "{}{}: '{}' is not an integer. Set {} to a number in decimal digits.",
           where(mark), path, text, path);
    }
    int32_t number = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
    if (ec != std::errc() || end != text.data() + text.size()) {
      fail(ErrorCode::kInvalidConfig, "{}{}: {} is out of range. Set {} to a number from {} to {}.", where(mark), path,
           text, path, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
    }
    return number;
  }

  template <typename T, typename ParseItem>
  std::vector<T> parseList(const YAML::Node& value, const std::string& path, const YAML::Mark& mark,
                           ParseItem&& parseItem) {
    std::vector<T> items;
    if (value.IsNull()) return items;  // `allowed_uids:` with nothing after it: an empty list
    if (!value.IsSequence()) {
      fail(ErrorCode::kInvalidConfig,
           "{}{}: expected a list, got {}. Write it as [a, b] or as '- item' lines indented under {}.", where(mark),
           path, describe(value), path);
    }
    for (std::size_t i = 0; i < value.size(); ++i) {
      const YAML::Node item = value[i];
      const std::string itemPath = fmt::format("{}[{}]", path, i);
      const YAML::Mark itemMark = item.IsNull() || item.Mark().is_null() ? mark : item.Mark();
      marks_[itemPath] = itemMark;
      items.push_back(parseItem(item, itemPath, itemMark));
    }
    return items;
  }

  std::string_view source_;
  std::map<std::string, YAML::Mark, std::less<>> marks_;  // key path -> position of its value, for checkConfig
};

// ---- the printer ----

// Plain when YAML reads it back as the same string, else double-quoted with escapes.
std::string yamlString(std::string_view text) {
  // YAML 1.1 booleans and nulls, which a reader may not take as strings.
  static constexpr std::array<std::string_view, 9> kReserved{"true", "false", "yes", "no", "on",
                                                             "off",  "null",  "y",   "n"};
  const bool plain =
      !text.empty() && (std::isalpha(static_cast<unsigned char>(text[0])) != 0 || text[0] == '/') &&
      std::all_of(text.begin(), text.end(),
                  [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) != 0 || (c != '\0' && std::strchr("_./@+-", c));
                  }) &&
      std::none_of(kReserved.begin(), kReserved.end(), [&](std::string_view word) {
        return text.size() == word.size() && std::equal(text.begin(), text.end(), word.begin(), [](char a, char b) {
                 return std::tolower(static_cast<unsigned char>(a)) == b;
               });
      });
  if (plain) return std::string(text);
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

template <typename S>
std::string formatValue(const S& section, std::string S::*member) {
  return yamlString(section.*member);
}
template <typename S, typename T>
requires std::is_integral_v<T> std::string formatValue(const S& section, T S::*member) {
  return fmt::format("{}", section.*member);
}
template <typename S>
std::string formatValue(const S& section, std::vector<uint32_t> S::*member) {
  return fmt::format("[{}]", fmt::join(section.*member, ", "));
}
template <typename S>
std::string formatValue(const S& section, std::vector<std::string> S::*member) {
  std::vector<std::string> quoted;
  for (const auto& item : section.*member) quoted.push_back(yamlString(item));
  return fmt::format("[{}]", fmt::join(quoted, ", "));
}
template <typename S, typename E>
requires std::is_enum_v<E> std::string formatValue(const S& section, E S::*member) {
  for (const auto& entry : namesOf(E{})) {
    if (entry.value == section.*member) return std::string(entry.name);
  }
  fail(ErrorCode::kInternal, "no name for enum value {} of a config key", static_cast<int>(section.*member));
}
template <typename S>
std::string formatValue(const S& section, OctalMember<S> octal) {
  return fmt::format("0{:03o}", section.*(octal.member));
}

void appendComment(std::string& out, std::string_view indent, std::string_view text) {
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    out += fmt::format("{}# {}\n", indent, text.substr(0, newline));
    text = newline == std::string_view::npos ? std::string_view() : text.substr(newline + 1);
  }
}

template <typename S, std::size_t N>
void appendSection(std::string& out, std::string_view key, const S& section, const std::array<Field<S>, N>& fields) {
  const auto help =
      std::find_if(kSections.begin(), kSections.end(), [&](const SectionHelp& h) { return h.key == key; });
  out += '\n';
  appendComment(out, "", help->help);
  out += fmt::format("{}:\n", key);
  for (const auto& field : fields) {
    appendComment(out, "  ", field.help);
    if (!field.range.empty()) {
      const bool list = std::holds_alternative<std::vector<uint32_t> S::*>(field.member);
      out += fmt::format("  # {}: {} to {}.\n", list ? "Each item" : "Range", describeValue(field.key, field.range.min),
                         describeValue(field.key, field.range.max));
    }
    const std::string value = std::visit([&](auto member) { return formatValue(section, member); }, field.member);
    std::string note;
    if (field.key.ends_with("_bytes")) {
      const std::string human = std::visit(
          [&](auto member) -> std::string {
            if constexpr (std::is_same_v<decltype(member), uint64_t S::*>) return humanBytes(section.*member);
            return {};
          },
          field.member);
      if (!human.empty()) note = fmt::format("  # {}", human);
    }
    out += fmt::format("  {}: {}{}\n", field.key, value, note);
  }
}

constexpr std::string_view kHeader =
    "# tandemd configuration.\n"
    "#\n"
    "# Printed by `tandemd --print-default-config` from the daemon's built-in defaults: every key is optional\n"
    "# and the value shown is its default. Precedence: built-in defaults < this file < command-line flags.\n"
    "# Unknown keys are errors. Sizes are in bytes; durations carry their unit in the key name (_ms, _us).\n"
    "# Under systemd tandemd reads /etc/tandem/tandemd.yaml; pass another file with --config PATH.\n";

std::string readConfigFile(const std::string& path) {
  const auto failRead = [&](const char* call, int err) {
    const char* remedy =
        err == ENOENT   ? "Create it (tandemd --print-default-config > {0}) or pass an existing file with --config."
        : err == EISDIR ? "Pass the path of a file, not a directory, with --config."
                        : "Make {0} readable by the daemon's user, or pass another file with --config.";
    fail(ErrorCode::kInvalidConfig, "cannot read config file {}: {} [{} -> errno {}]. {}", path, std::strerror(err),
         call, err, fmt::format(fmt::runtime(remedy), path));
  };
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) failRead("fopen", errno);
  std::string text;
  std::array<char, 16384> chunk;
  while (true) {
    const std::size_t n = std::fread(chunk.data(), 1, chunk.size(), file.get());
    text.append(chunk.data(), n);
    if (n < chunk.size()) {
      if (std::ferror(file.get()) != 0) failRead("fread", errno);
      break;
    }
  }
  return text;
}

}  // namespace

DaemonConfig parseConfig(const std::string& yamlText, const std::string& sourceName) {
  return Parser(sourceName).parse(yamlText);
}

DaemonConfig loadConfigFile(const std::string& path) {
  DaemonConfig config = parseConfig(readConfigFile(path), path);
  // parseConfig already ran these checks with line:column; this keeps "load = parse + validate" true even if
  // parseConfig changes.
  validateConfig(config);
  return config;
}

void validateConfig(const DaemonConfig& config) {
  checkConfig(config, [](std::initializer_list<std::string_view>) { return std::string(); });
}

std::string configYaml(const DaemonConfig& config) {
  // The order here is the order of config/tandemd.yaml.
  std::string out(kHeader);
  appendSection(out, "daemon", config.daemon, kDaemonFields);
  appendSection(out, "access", config.access, kAccessFields);
  appendSection(out, "limits", config.limits, kLimitsFields);
  appendSection(out, "rings", config.rings, kRingsFields);
  appendSection(out, "communicators", config.communicators, kCommunicatorsFields);
  appendSection(out, "cuda", config.cuda, kCudaFields);
  appendSection(out, "cluster", config.cluster, kClusterFields);
  appendSection(out, "plans", config.plans, kPlansFields);
  return out;
}

std::string defaultConfigYaml() { return configYaml(DaemonConfig{}); }

const char* backendName(BackendKind kind) {
  for (const auto& entry : kBackendNames) {
    if (entry.value == kind) return entry.name.data();  // points into a string literal, so NUL-terminated
  }
  return "unknown";
}

const char* executorName(ExecutorKind kind) {
  for (const auto& entry : kExecutorNames) {
    if (entry.value == kind) return entry.name.data();
  }
  return "unknown";
}

const char* clusterTransportName(ClusterTransport kind) {
  for (const auto& entry : kClusterTransportNames) {
    if (entry.value == kind) return entry.name.data();
  }
  return "unknown";
}

const char* gpuExchangeName(GpuExchange kind) {
  for (const auto& entry : kGpuExchangeNames) {
    if (entry.value == kind) return entry.name.data();
  }
  return "unknown";
}

const char* planAutotuneName(PlanAutotune kind) {
  for (const auto& entry : kPlanAutotuneNames) {
    if (entry.value == kind) return entry.name.data();
  }
  return "unknown";
}

NodeEndpoint parseNodeEndpoint(const std::string& text) {
  NodeEndpoint endpoint;
  if (const std::string problem = endpointProblem(text, endpoint); !problem.empty())
    fail(ErrorCode::kInvalidConfig, "cluster node address {}", problem);
  return endpoint;
}

std::string clusterSecret(const ClusterSection& c) { return resolveSecret(c, kNoLocation); }

}  // namespace tandem::daemon
