// tandemd's plan table: for each (op, shape bucket, dtype, ranks, GPU model, executor) the plan that won when it was
// measured (fused or decomposed, the SM split, chunk sizes), kept in a versioned JSON file in the daemon's state
// directory and loaded at start. The backends ask it for every fused op; with no entry the kernels' built-in rules
// apply. A table measured on another GPU model, driver or tandem release says nothing about this one: such a file is
// set aside at load (its fingerprint differs) and the table starts empty.
//
// Filled by measurement: `tandemctl tune` and `tandemctl advise --save` (client side: they run the candidate plans
// through ordinary ops on a communicator of their own, each candidate as a trial plan that only that communicator
// sees, and save the winners), and with plans.autotune: on-first-use by the backend itself.
//
// Thread-safe: the control thread changes it (SetPlan, status), the pump's backend reads it for every op.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

#include "tandem/common/ranked_mutex.hpp"
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend.hpp"
#include "tandem/common/plan_key.hpp"

namespace tandem::v1 {
class PlanEntry;
class PlanTableInfo;
}  // namespace tandem::v1

namespace tandem::daemon {

// The file's format. A file of another version is set aside like one of another fingerprint.
inline constexpr int kPlanTableVersion = 1;
inline constexpr std::string_view kPlanTableFormat = "tandem-plan-table";
inline constexpr std::string_view kPlanTableFileName = "plans.json";
// Trial plans held for communicators at once (tune and advise set one per candidate and clear them when done; the cap
// bounds what a client that never clears can make the daemon hold).
inline constexpr std::size_t kMaxTrialPlans = 4096;

// What the measurements depend on besides the shape: the GPU model(s), the GPU driver, and tandem's release.
struct PlanFingerprint {
  std::string gpu;     // GPU model names, sorted, '+'-joined ("NVIDIA H200"); "cpu" on the cpu backend
  std::string driver;  // the NVIDIA kernel module's version (/proc/driver/nvidia/version); "none" without one
  std::string tandem;  // TANDEM_VERSION_STRING
  bool operator==(const PlanFingerprint&) const = default;
  std::string describe() const;  // "NVIDIA H200, driver 550.54.15, tandem 0.2.0"
};

// This node's fingerprint for `backend` ("cpu", "cuda") and its GPUs. TANDEM_PLAN_FINGERPRINT, as
// "gpu=...;driver=...;tandem=..." (any subset), replaces those fields: the tests fake a driver update with it.
PlanFingerprint nodeFingerprint(std::string_view backend, const std::vector<GpuInfo>& gpus);

// The GPU model a key names for ops on `gpus` (one model: its name; "cpu" without GPUs).
std::string planGpuModel(std::string_view backend, const std::vector<GpuInfo>& gpus);

// One entry: the key, the plan that won, and what was measured (0 when unknown).
struct PlanRecord {
  PlanKey key;
  PlanChoice plan;
  double timeUs = 0;      // the winner's time per op
  double baselineUs = 0;  // the unfused baseline's (the kernels' own rules when no baseline ran)
  std::string source;     // "tune", "advise", "autotune", or what the client said
  int64_t savedAtUnixS = 0;
};

// "gemm-rs bf16 1 rank m8192.n8192.k8192 on NVIDIA H200, executor daemon"
std::string planKeyText(const PlanKey& key);
// "fused, 8 comm SMs" / "decomposed" / "fused, the kernels' own SM split"
std::string planChoiceText(const PlanChoice& plan);

// Where the table lives: plans.state_dir when set, else $STATE_DIRECTORY (systemd's StateDirectory=tandem; its first
// entry), else /var/lib/tandem when running as root, else $XDG_STATE_HOME/tandem, else ~/.local/state/tandem.
std::string planStateDirectory(const std::string& configured);

class PlanTable {
 public:
  // Loads `directory`/plans.json (save() creates the directory when missing). An empty directory: memory only.
  // Never throws for the file's content: a missing file is an empty table; a file of another format version or
  // fingerprint, or one that does not parse, is renamed to plans.json.invalidated (kept for a look) and the table
  // starts empty; state() says which and why.
  PlanTable(std::string directory, PlanFingerprint fingerprint);

  const std::string& path() const { return path_; }  // "" when in memory only
  const PlanFingerprint& fingerprint() const { return fingerprint_; }
  std::string state() const;  // "loaded 3 entries", "invalidated: ...", "new", "memory only: ..."

  // The plan for `key`: the trial plan of communicator `commHandle` (0: none) if it has one, else the table's entry.
  std::optional<PlanChoice> find(const PlanKey& key, uint64_t commHandle = 0) const;
  std::vector<PlanRecord> records() const;
  std::size_t size() const;

  // Adds or replaces the entry of r.key (in memory; save() writes the file).
  void put(PlanRecord r);
  bool erase(const PlanKey& key);
  void clear();
  // Writes the file (a temporary file renamed over it, so a crash leaves the old table or the new one). Throws
  // Error(kUnavailable) naming the path and what to do when it cannot. A memory-only table does nothing.
  void save();

  // A plan seen only by the ops of one communicator: tune and advise measure each candidate with it. Beyond
  // kMaxTrialPlans in all, the oldest communicator's trials are dropped.
  void setTrial(uint64_t commHandle, const PlanKey& key, const PlanChoice& plan);
  void clearTrials(uint64_t commHandle);
  std::size_t trialCount() const;

  // The file's text for `records`, and back. parse throws Error(kInvalidArgument) saying what is wrong; it does not
  // compare the fingerprint (the constructor does).
  static std::string toJson(const PlanFingerprint& fingerprint, const std::vector<PlanRecord>& records);
  struct Parsed {
    int version = 0;
    PlanFingerprint fingerprint;
    std::vector<PlanRecord> records;
  };
  static Parsed parse(const std::string& text);

 private:
  void load();

  std::string directory_, path_;
  PlanFingerprint fingerprint_;
  mutable RankedMutex mutex_{LockRank::kPlanTable, "PlanTable"};
  std::map<PlanKey, PlanRecord> entries_;
  std::map<uint64_t, std::map<PlanKey, PlanChoice>> trials_;  // by communicator handle (handles only grow: oldest first)
  std::size_t trialCount_ = 0;
  std::string state_;
};

// The protocol's view of entries (control.proto PlanEntry). fromProto checks the entry as a file's entries are
// checked and throws Error(kInvalidArgument) saying what is wrong.
PlanRecord planRecordFromProto(const v1::PlanEntry& e);
void planRecordToProto(const PlanRecord& r, v1::PlanEntry* e);
// `tandemctl status`: the table's path, fingerprint, state and entries; gpuModel: what this node's keys name.
void fillPlanTableInfo(const PlanTable& table, std::string_view autotune, const std::string& gpuModel,
                       v1::PlanTableInfo* info);

}  // namespace tandem::daemon
