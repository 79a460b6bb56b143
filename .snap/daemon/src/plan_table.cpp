#include "plan_table.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/v1/control.pb.h"

namespace tandem::daemon {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::optional<DType> dtypeFromName(std::string_view s) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kI32}) {
    if (dtypeName(t) == s) return t;
  }
  return std::nullopt;
}

// The NVIDIA kernel module's version from the first line of /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX
// x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."): the token after "Kernel Module". "none" where there is none.
std::string nvidiaDriverVersion() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!in || !std::getline(in, line)) return "none";
  const std::string marker = "Kernel Module";
  const auto at = line.find(marker);
  // "Kernel Module  550.54.15 ..." or "Open Kernel Module for x86_64  570.86.15 ...": the first word that starts
  // with a digit.
  std::istringstream rest(at == std::string::npos ? line : line.substr(at + marker.size()));
  std::string word;
  while (rest >> word) {
    if (!word.empty() && word[0] >= '0' && word[0] <= '9') return word;
  }
  return "unknown";
}

std::string isoTime(int64_t unixS) {
  if (unixS <= 0) return {};
  const std::time_t t = static_cast<std::time_t>(unixS);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

int64_t parseIsoTime(const std::string& s) {
  std::tm tm{};
  if (s.empty() || ::strptime(s.c_str(), "%Y-%m-%dT%H:%M:%SZ", &tm) == nullptr) return 0;
  return static_cast<int64_t>(::timegm(&tm));
}

}  // namespace

std::string PlanFingerprint::describe() const {
  return fmt::format("{}, driver {}, tandem {}", gpu, driver, tandem);
}

std::string planGpuModel(std::string_view backend, const std::vector<GpuInfo>& gpus) {
  if (backend == "cpu" || gpus.empty()) return "cpu";
  std::set<std::string> names;
  for (const auto& g : gpus) names.insert(g.name);
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : "+") + n;
  return out;
}

PlanFingerprint nodeFingerprint(std::string_view backend, const std::vector<GpuInfo>& gpus) {
  PlanFingerprint fp{planGpuModel(backend, gpus), backend == "cpu" ? std::string("none") : nvidiaDriverVersion(),
                     TANDEM_VERSION_STRING};
  const char* fake = std::getenv("TANDEM_PLAN_FINGERPRINT");
  if (fake == nullptr || *fake == '\0') return fp;
  std::string_view rest = fake;
  while (!rest.empty()) {
    const auto semi = rest.find(';');
    const std::string_view item = rest.substr(0, semi);
    rest = semi == std::string_view::npos ? std::string_view() : rest.substr(semi + 1);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view name = item.substr(0, eq), value = item.substr(eq + 1);
    if (name == "gpu") fp.gpu = value;
    if (name == "driver") fp.driver = value;
    if (name == "tandem") fp.tandem = value;
  }
  return fp;
}

std::string planKeyText(const PlanKey& key) {
  return fmt::format("{} {} {} rank{} {} on {}, executor {}", opKindName(key.op), dtypeName(key.dtype), key.ranks,
                     key.ranks == 1 ? "" : "s", key.bucket, key.gpu, key.executor);
}

std::string planChoiceText(const PlanChoice& plan) {
  std::string s(planKindName(plan.kind));
  if (plan.kind == PlanKind::kAuto) return "the kernels' own rules";
  s += plan.commSms == 0 ? ", the kernels' own SM split" : fmt::format(", {} comm SMs", plan.commSms);
  if (plan.chunkBytes != 0) s += fmt::format(", {}-byte chunks", plan.chunkBytes);
  return s;
}

std::string planStateDirectory(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (const char* sd = std::getenv("STATE_DIRECTORY"); sd != nullptr && *sd != '\0') {
    const std::string all = sd;
    return all.substr(0, all.find(':'));  // systemd lists one path per StateDirectory= entry, ':'-separated
  }
  if (::geteuid() == 0) return "/var/lib/tandem";
  if (const char* xdg = std::getenv("XDG_STATE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/tandem";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return std::string(home) + "/.local/state/tandem";
  }
  return fmt::format("/tmp/tandem-{}/state", ::geteuid());
}

// ---- the file ----------------------------------------------------------------------------------------------------

namespace {

std::string strField(const json& o, const char* key, const std::string& where) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_string()) {
    fail(ErrorCode::kInvalidArgument, "{}: \"{}\" is missing or not a string", where, key);
  }
  return o[key].get<std::string>();
}

const json& numField(const json& o, const char* key, const std::string& where) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_number()) {
    fail(ErrorCode::kInvalidArgument, "{}: \"{}\" is missing or not a number", where, key);
  }
  return o[key];
}

json recordJson(const PlanRecord& r) {
  return {{"op", std::string(opKindName(r.key.op))},
          {"dtype", std::string(dtypeName(r.key.dtype))},
          {"ranks", r.key.ranks},
          {"bucket", r.key.bucket},
          {"gpu", r.key.gpu},
          {"executor", r.key.executor},
          {"plan",
           {{"kind", std::string(planKindName(r.plan.kind))},
            {"comm_sms", r.plan.commSms},
            {"chunk_bytes", r.plan.chunkBytes}}},
          {"time_us", r.timeUs},
          {"baseline_us", r.baselineUs},
          {"source", r.source},
          {"saved_at", isoTime(r.savedAtUnixS)}};
}

// One entry, checked: the file's entries and SetPlan's go through here alike.
PlanRecord recordFromJson(const json& e, const std::string& where) {
  PlanRecord r;
  const std::string opName = strField(e, "op", where);
  const OpSpec* op = findOp(opName);
  if (op == nullptr || !plannedOp(op->kind)) {
    fail(ErrorCode::kInvalidArgument, "{}: op \"{}\" has no plans (ag-gemm, gemm-rs and gemm-ar do)", where, opName);
  }
  r.key.op = op->kind;
  const std::string dtName = strField(e, "dtype", where);
  const auto dt = dtypeFromName(dtName);
  if (!dt || *dt == DType::kI32) {
    fail(ErrorCode::kInvalidArgument, "{}: dtype \"{}\" is not bf16, fp16 or fp32", where, dtName);
  }
  r.key.dtype = *dt;
  const int64_t ranks = numField(e, "ranks", where).get<int64_t>();
  if (ranks < 1 || ranks > 65536) fail(ErrorCode::kInvalidArgument, "{}: ranks {} is not 1..65536", where, ranks);
  r.key.ranks = static_cast<uint32_t>(ranks);
  r.key.bucket = strField(e, "bucket", where);
  r.key.gpu = strField(e, "gpu", where);
  r.key.executor = strField(e, "executor", where);
  if (r.key.bucket.empty() || r.key.bucket.size() > 64 || r.key.gpu.size() > 256 || r.key.executor.size() > 16) {
    fail(ErrorCode::kInvalidArgument, "{}: bucket, gpu or executor is empty or too long", where);
  }
  if (!e.contains("plan") || !e["plan"].is_object()) {
    fail(ErrorCode::kInvalidArgument, "{}: \"plan\" is missing", where);
  }
  const json& p = e["plan"];
  const std::string kindName = strField(p, "kind", where + ".plan");
  const auto kind = planKindFromName(kindName);
  if (!kind || *kind == PlanKind::kAuto) {
    fail(ErrorCode::kInvalidArgument, "{}.plan: kind \"{}\" is not fused or decomposed", where, kindName);
  }
  r.plan.kind = *kind;
  const int64_t sms = numField(p, "comm_sms", where + ".plan").get<int64_t>();
  if (sms < 0 || sms > 1024) fail(ErrorCode::kInvalidArgument, "{}.plan: comm_sms {} is not 0..1024", where, sms);
  r.plan.commSms = static_cast<uint32_t>(sms);
  r.plan.chunkBytes = p.value("chunk_bytes", uint64_t{0});
  r.timeUs = e.value("time_us", 0.0);
  r.baselineUs = e.value("baseline_us", 0.0);
  r.source = e.value("source", std::string());
  if (r.source.size() > 64) r.source.resize(64);
  r.savedAtUnixS = parseIsoTime(e.value("saved_at", std::string()));
  return r;
}

}  // namespace

std::string PlanTable::toJson(const PlanFingerprint& fingerprint, const std::vector<PlanRecord>& records) {
  json entries = json::array();
  for (const auto& r : records) entries.push_back(recordJson(r));
  json j{{"format", std::string(kPlanTableFormat)},
         {"version", kPlanTableVersion},
         {"fingerprint", {{"gpu", fingerprint.gpu}, {"driver", fingerprint.driver}, {"tandem", fingerprint.tandem}}},
         {"entries", entries}};
  return j.dump(2) + "\n";
}

PlanTable::Parsed PlanTable::parse(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorCode::kInvalidArgument, "not JSON: {}", e.what());
  }
  if (strField(j, "format", "the file") != kPlanTableFormat) {
    fail(ErrorCode::kInvalidArgument, "the file's \"format\" is not \"{}\"", kPlanTableFormat);
  }
  Parsed out;
  out.version = numField(j, "version", "the file").get<int>();
  if (out.version != kPlanTableVersion) return out;  // the caller sets it aside; its entries may mean other things
  const json fp = j.contains("fingerprint") ? j["fingerprint"] : json();
  out.fingerprint = {strField(fp, "gpu", "fingerprint"), strField(fp, "driver", "fingerprint"),
                     strField(fp, "tandem", "fingerprint")};
  if (!j.contains("entries") || !j["entries"].is_array()) {
    fail(ErrorCode::kInvalidArgument, "\"entries\" is missing or not a list");
  }
  std::size_t i = 0;
  for (const json& e : j["entries"]) out.records.push_back(recordFromJson(e, fmt::format("entries[{}]", i++)));
  return out;
}

PlanRecord planRecordFromProto(const v1::PlanEntry& e) {
  json j{{"op", e.op()},
         {"dtype", e.dtype()},
         {"ranks", e.ranks()},
         {"bucket", e.bucket()},
         {"gpu", e.gpu()},
         {"executor", e.executor()},
         {"plan", {{"kind", e.kind()}, {"comm_sms", e.comm_sms()}, {"chunk_bytes", e.chunk_bytes()}}},
         {"time_us", e.time_us()},
         {"baseline_us", e.baseline_us()},
         {"source", e.source()},
         {"saved_at", e.saved_at()}};
  return recordFromJson(j, "plan entry");
}

void planRecordToProto(const PlanRecord& r, v1::PlanEntry* e) {
  e->set_op(std::string(opKindName(r.key.op)));
  e->set_dtype(std::string(dtypeName(r.key.dtype)));
  e->set_ranks(r.key.ranks);
  e->set_bucket(r.key.bucket);
  e->set_gpu(r.key.gpu);
  e->set_executor(r.key.executor);
  e->set_kind(std::string(planKindName(r.plan.kind)));
  e->set_comm_sms(r.plan.commSms);
  e->set_chunk_bytes(r.plan.chunkBytes);
  e->set_time_us(r.timeUs);
  e->set_baseline_us(r.baselineUs);
  e->set_source(r.source);
  e->set_saved_at(isoTime(r.savedAtUnixS));
}

void fillPlanTableInfo(const PlanTable& table, std::string_view autotune, const std::string& gpuModel,
                       v1::PlanTableInfo* info) {
  info->set_path(table.path());
  info->set_fingerprint(table.fingerprint().describe());
  info->set_gpu(gpuModel);
  info->set_state(table.state());
  info->set_autotune(std::string(autotune));
  info->set_trials(static_cast<uint32_t>(table.trialCount()));
  for (const auto& r : table.records()) planRecordToProto(r, info->add_entries());
}

// ---- the table -------------------------------------------------------------------------------------------------

PlanTable::PlanTable(std::string directory, PlanFingerprint fingerprint)
    : directory_(std::move(directory)), fingerprint_(std::move(fingerprint)) {
  if (directory_.empty()) {
    state_ = "memory only (no state directory)";
    return;
  }
  // The directory is created by the first save: a daemon that never tunes leaves nothing behind.
  path_ = (fs::path(directory_) / kPlanTableFileName).string();
  load();
}

void PlanTable::load() {
  std::ifstream in(path_);
  if (!in) {
    state_ = fs::exists(path_) ? fmt::format("new: {} is unreadable ({})", path_, std::strerror(errno)) : "new";
    return;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::string why;
  Parsed parsed;
  try {
    parsed = parse(text);
    if (parsed.version != kPlanTableVersion) {
      why = fmt::format("the file is format version {}, this tandemd writes {}", parsed.version, kPlanTableVersion);
    } else if (parsed.fingerprint != fingerprint_) {
      std::vector<std::string> changed;
      if (parsed.fingerprint.gpu != fingerprint_.gpu) {
        changed.push_back(fmt::format("GPU {} -> {}", parsed.fingerprint.gpu, fingerprint_.gpu));
      }
      if (parsed.fingerprint.driver != fingerprint_.driver) {
        changed.push_back(fmt::format("driver {} -> {}", parsed.fingerprint.driver, fingerprint_.driver));
      }
      if (parsed.fingerprint.tandem != fingerprint_.tandem) {
        changed.push_back(fmt::format("tandem {} -> {}", parsed.fingerprint.tandem, fingerprint_.tandem));
      }
      std::string list;
      for (const auto& c : changed) list += (list.empty() ? "" : ", ") + c;
      why = fmt::format("measured on another node setup ({})", list);
    }
  } catch (const Error& e) {
    why = fmt::format("it does not parse ({})", e.what());
  }
  if (why.empty()) {
    for (auto& r : parsed.records) entries_[r.key] = std::move(r);
    state_ = fmt::format("loaded {} entr{}", entries_.size(), entries_.size() == 1 ? "y" : "ies");
    return;
  }
  const std::string aside = path_ + ".invalidated";
  std::error_code ec;
  fs::rename(path_, aside, ec);
  state_ = fmt::format("invalidated: {}; {} {} entr{}; rerun `tandemctl tune`", why,
                       ec ? "could not set the file aside (" + ec.message() + "), dropped its" : "set aside as " + aside + ",",
                       parsed.records.size(), parsed.records.size() == 1 ? "y" : "ies");
  spdlog::warn("plan table {}: {}", path_, state_);
}

std::string PlanTable::state() const {
  std::lock_guard lock(mutex_);
  return state_;
}

std::optional<PlanChoice> PlanTable::find(const PlanKey& key, uint64_t commHandle) const {
  std::lock_guard lock(mutex_);
  if (commHandle != 0 && !trials_.empty()) {
    if (auto t = trials_.find(commHandle); t != trials_.end()) {
      if (auto e = t->second.find(key); e != t->second.end()) return e->second;
    }
  }
  if (auto e = entries_.find(key); e != entries_.end()) return e->second.plan;
  return std::nullopt;
}

std::vector<PlanRecord> PlanTable::records() const {
  std::lock_guard lock(mutex_);
  std::vector<PlanRecord> out;
  for (const auto& [k, r] : entries_) out.push_back(r);
  return out;
}

std::size_t PlanTable::size() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

void PlanTable::put(PlanRecord r) {
  if (r.savedAtUnixS == 0) {
    r.savedAtUnixS = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  }
  std::lock_guard lock(mutex_);
  const PlanKey key = r.key;
  entries_[key] = std::move(r);
}

bool PlanTable::erase(const PlanKey& key) {
  std::lock_guard lock(mutex_);
  return entries_.erase(key) > 0;
}

void PlanTable::clear() {
  std::lock_guard lock(mutex_);
  entries_.clear();
}

void PlanTable::save() {
  std::vector<PlanRecord> all;
  {
    std::lock_guard lock(mutex_);
    if (path_.empty()) return;
    for (const auto& [k, r] : entries_) all.push_back(r);
  }
  const std::string text = toJson(fingerprint_, all);
  std::error_code ec;
  fs::create_directories(directory_, ec);
  if (ec) {
    fail(ErrorCode::kUnavailable, "saving the plan table: cannot create its directory {} ({}). Set plans.state_dir to "
         "a directory tandemd's user may write, or StateDirectory=tandem in the unit", directory_, ec.message());
  }
  const std::string tmp = fmt::format("{}.tmp.{}", path_, ::getpid());
  const auto failWith = [&](const char* call) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(ErrorCode::kUnavailable, "saving the plan table to {} failed: {} -> {}. Make {} writable by tandemd's user "
         "(StateDirectory=tandem in the unit does), or set plans.state_dir", path_, call, std::strerror(err),
         directory_);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) failWith("open");
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      failWith("write");
    }
    done += static_cast<std::size_t>(n);
  }
  // Data before the rename: after a crash the name holds the old table or the whole new one.
  if (::fsync(fd) != 0) {
    ::close(fd);
    failWith("fsync");
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path_.c_str()) != 0) failWith("rename");
  std::lock_guard lock(mutex_);
  state_ = fmt::format("saved {} entr{}", all.size(), all.size() == 1 ? "y" : "ies");
}

void PlanTable::setTrial(uint64_t commHandle, const PlanKey& key, const PlanChoice& plan) {
  std::lock_guard lock(mutex_);
  auto& mine = trials_[commHandle];
  if (mine.size() >= kMaxTrialPlans && !mine.contains(key)) {
    fail(ErrorCode::kInvalidArgument, "communicator {:#x} already holds {} trial plans, the most one may; clear them "
         "(SetPlan with clear_trials) before setting more", commHandle, mine.size());
  }
  if (mine.insert_or_assign(key, plan).second) ++trialCount_;
  while (trialCount_ > kMaxTrialPlans && trials_.size() > 1) {
    auto oldest = trials_.begin();  // handles only grow: the smallest is the oldest communicator
    if (oldest->first == commHandle) oldest = std::next(oldest);
    trialCount_ -= oldest->second.size();
    trials_.erase(oldest);
  }
}

void PlanTable::clearTrials(uint64_t commHandle) {
  std::lock_guard lock(mutex_);
  if (auto t = trials_.find(commHandle); t != trials_.end()) {
    trialCount_ -= t->second.size();
    trials_.erase(t);
  }
}

std::size_t PlanTable::trialCount() const {
  std::lock_guard lock(mutex_);
  return trialCount_;
}

}  // namespace tandem::daemon
