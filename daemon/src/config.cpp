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

constexpr std::span<const EnumName<BackendKind>> namesOf(BackendKind) { return kBackendNames; }
constexpr std::span<const EnumName<ExecutorKind>> namesOf(ExecutorKind) { return kExecutorNames; }

// ---- the schema: one table per section ----

// A uint32_t member written in YAML as octal permission bits (0660), like chmod.
template <typename S>
struct OctalMember {
  uint32_t S::*member;
};

template <typename S>
using Member = std::variant<std::string S::*, uint32_t S::*, uint64_t S::*, std::vector<uint32_t> S::*,
                            std::vector<std::string> S::*, BackendKind S::*, ExecutorKind S::*, OctalMember<S>>;

template <typename S>
struct Field {
  std::string_view key;   // snake_case, units in the name
  std::string_view help;  // comment lines printed above the key, '\n'-separated
  Member<S> member;
};

struct SectionHelp {
  std::string_view key;
  std::string_view help;
};

constexpr std::array<SectionHelp, 6> kSections{{
    {"daemon", "The daemon process: where it listens, which backend runs ops, how much it logs."},
    {"access", "Who may connect. Clients are identified by SO_PEERCRED on the socket."},
    {"limits", "Caps on what one client may ask for; a request beyond them fails with an error naming the cap."},
    {"rings", "The shared-memory submission ring of each session."},
    {"communicators", "Communicators: the groups of ranks that run fused ops together."},
    {"cuda", "The cuda backend (the cpu backend ignores this section)."},
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
     &DaemonSection::workerThreads},
});

constexpr auto kAccessFields = std::to_array<Field<AccessSection>>({
    {"allowed_uids", "User ids that may connect, besides root and the daemon's own user, which always may.",
     &AccessSection::allowedUids},
    {"allowed_gids", "Group ids that may connect: a client whose primary group is listed may.",
     &AccessSection::allowedGids},
    {"socket_mode",
     "Permission bits of the socket, always read as octal (like chmod): 0660 lets the owner and\n"
     "the socket's group connect.",
     OctalMember<AccessSection>{&AccessSection::socketMode}},
});

constexpr auto kLimitsFields = std::to_array<Field<LimitsSection>>({
    {"max_frame_bytes", "Largest control-plane message, 4096 to 67108864 bytes.", &LimitsSection::maxFrameBytes},
    {"max_buffer_bytes", "Largest single buffer allocation or registration; at most max_session_bytes.",
     &LimitsSection::maxBufferBytes},
    {"max_session_bytes", "Total bytes of all buffers one session may hold.", &LimitsSection::maxSessionBytes},
    {"max_sessions", "Most client sessions connected at once.", &LimitsSection::maxSessions},
});

constexpr auto kRingsFields = std::to_array<Field<RingsSection>>({
    {"capacity", "Descriptors per submission ring; a power of two from 8 to 65536.", &RingsSection::capacity},
    {"poll_window_us",
     "After the last descriptor the pump busy-polls this long before sleeping; longer lowers\n"
     "latency for bursty clients, shorter frees the CPU sooner.",
     &RingsSection::pollWindowUs},
});

constexpr auto kCommunicatorsFields = std::to_array<Field<CommunicatorsSection>>({
    {"join_timeout_ms", "Rendezvous timeout used when a client joins a communicator with timeout 0.",
     &CommunicatorsSection::joinTimeoutMs},
    {"peer_lost_deadline_ms", "A dead rank's peers get TANDEM_ERROR_PEER_LOST within this; at least 100.",
     &CommunicatorsSection::peerLostDeadlineMs},
});

constexpr auto kCudaFields = std::to_array<Field<CudaSection>>({
    {"devices", "GPUs to own, by UUID as `nvidia-smi -L` prints them (\"GPU-...\"); empty = every visible GPU.",
     &CudaSection::devices},
    {"daemon_linger_ms", "With executor daemon, the persistent kernel exits after idling this long.",
     &CudaSection::daemonLingerMs},
    {"comm_sms", "SMs given to the communication roles of fused kernels; 0 = chosen per shape.", &CudaSection::commSms},
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

// "16 GiB" for whole binary multiples, else "".
std::string humanBytes(uint64_t bytes) {
  if (bytes == 0) return {};
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

void checkConfig(const DaemonConfig& config, const Locate& at) {
  const DaemonSection& d = config.daemon;
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

}  // namespace tandem::daemon
