// tandemctl advise --save / tune: the winners into tandemd's plan table (advise_plans.hpp); and the plan table's
// part of `tandemctl status` (advise.hpp).
#include "advise_plans.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <map>

#include "advise.hpp"
#include "advise_answers.hpp"
#include "session.hpp"
#include "tandem/common/paths.hpp"

namespace tandem::ctl {

using json = nlohmann::json;

namespace advise {

std::vector<v1::PlanEntry> winners(const json& report, const std::string& source) {
  std::map<std::string, v1::PlanEntry> byKey;  // one entry per key: the layer measured fastest for it wins
  for (const json& l : report["layers"]) {
    if (!l.contains("best")) continue;
    v1::PlanEntry e;
    e.set_op(l["op"].get<std::string>());
    e.set_dtype(l["dtype"].get<std::string>());
    e.set_ranks(l["ranks"].get<uint32_t>());
    e.set_bucket(l["bucket"].get<std::string>());
    e.set_gpu(report["gpu"].get<std::string>());
    e.set_executor(l["executor"].get<std::string>());
    e.set_kind(l["best"]["kind"].get<std::string>());
    e.set_comm_sms(l["best"]["comm_sms"].get<uint32_t>());
    e.set_time_us(l["best"]["us"].get<double>());
    if (auto b = num(l, "baseline_us")) e.set_baseline_us(*b);
    e.set_source(source);
    const std::string key = fmt::format("{}|{}|{}|{}", e.op(), e.dtype(), e.ranks(), e.bucket());
    byKey.insert_or_assign(key, e);
  }
  std::vector<v1::PlanEntry> out;
  for (auto& [k, e] : byKey) out.push_back(e);
  return out;
}

void saveWinners(const std::string& socket, const std::vector<v1::PlanEntry>& entries) {
  if (entries.empty()) return;
  auto session = client::Session::connect(socket.empty() ? defaultSocketPath(true) : socket);
  v1::Request request;
  auto* sp = request.mutable_set_plan();
  for (const auto& e : entries) *sp->add_entries() = e;
  sp->set_save(true);
  session->call(request);
}

}  // namespace advise

void printPlanStatus(const v1::StatusReply& r) {
  if (!r.has_plans()) return;
  const auto& p = r.plans();
  std::printf("plan table: %s  (%s; autotune %s)\n", p.path().empty() ? "in memory" : p.path().c_str(),
              p.state().c_str(), p.autotune().c_str());
  std::printf("  fingerprint: %s; %d entr%s%s\n", p.fingerprint().c_str(), p.entries_size(),
              p.entries_size() == 1 ? "y" : "ies",
              p.trials() > 0 ? fmt::format(", {} trial plans", p.trials()).c_str() : "");
  for (const auto& e : p.entries()) {
    std::string plan = e.kind() + (e.comm_sms() != 0 ? fmt::format(", {} comm SMs", e.comm_sms()) : std::string());
    std::string measured = e.time_us() > 0 ? fmt::format("{:.1f} us", e.time_us()) : std::string();
    if (e.baseline_us() > 0 && e.time_us() > 0) measured += fmt::format(" ({:.2f}x unfused)", e.baseline_us() / e.time_us());
    std::printf("  %-8s %-4s %2u rank%s %-22s %-10s %-7s -> %-22s %s  [%s %s]\n", e.op().c_str(), e.dtype().c_str(),
                e.ranks(), e.ranks() == 1 ? " " : "s", e.bucket().c_str(), e.gpu().c_str(), e.executor().c_str(),
                plan.c_str(), measured.c_str(), e.source().c_str(), e.saved_at().c_str());
  }
}

json planStatusJson(const v1::StatusReply& r) {
  if (!r.has_plans()) return nullptr;
  const auto& p = r.plans();
  json entries = json::array();
  for (const auto& e : p.entries()) {
    entries.push_back({{"op", e.op()}, {"dtype", e.dtype()}, {"ranks", e.ranks()}, {"bucket", e.bucket()},
                       {"gpu", e.gpu()}, {"executor", e.executor()}, {"kind", e.kind()}, {"comm_sms", e.comm_sms()},
                       {"chunk_bytes", e.chunk_bytes()}, {"time_us", e.time_us()}, {"baseline_us", e.baseline_us()},
                       {"source", e.source()}, {"saved_at", e.saved_at()}});
  }
  return {{"path", p.path()}, {"fingerprint", p.fingerprint()}, {"state", p.state()}, {"autotune", p.autotune()},
          {"gpu", p.gpu()}, {"trials", p.trials()}, {"entries", entries}};
}

}  // namespace tandem::ctl
