// The parent of `tandemctl run`: checks tandemd once, spawns this node's rank processes (in a process group of their
// own, each dying with the parent), relays what ranks tell each other, lets only as many host checks run at once as
// memory holds, shows progress, and summarises: per rank, then the slowest rank per iteration.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>

#include "op_metrics.hpp"
#include "rank.hpp"
#include "session.hpp"
#include "tandem/common/error.hpp"

namespace tandem::ctl {
namespace {

using Clock = std::chrono::steady_clock;

int signalPipe[2] = {-1, -1};
volatile sig_atomic_t stopSignal = 0;

void onSignal(int sig) {
  stopSignal = sig;
  const char c = 1;
  [[maybe_unused]] const ssize_t n = ::write(signalPipe[1], &c, 1);
}

// "SIGSEGV (segmentation fault)"
std::string signalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  const char* text = ::strsignal(sig);
  return abbrev != nullptr ? fmt::format("SIG{} ({})", abbrev, text != nullptr ? text : "?")
                           : fmt::format("signal {}", sig);
}

uint64_t memAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return uint64_t{4} << 30;  // no /proc/meminfo: assume a small machine
}

struct Child {
  uint32_t rank = 0;
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;  // our ends: its stdin, stdout, stderr
  std::string outBuf, errBuf;
  std::optional<json> result;
  uint64_t done = 0, total = 0;  // progress
  uint64_t checkBytes = 0;       // the memory its host check asked for
  bool checkGranted = false;     // ... and holds
  bool exited = false;
  int status = 0;
  std::string plan;
};

void writeLine(Child& c, const std::string& line) {
  if (c.in < 0) return;
  const std::string text = line + "\n";
  // Small lines into a pipe the child reads: a short or failed write means it is gone, which its exit reports.
  if (::write(c.in, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    ::close(c.in);
    c.in = -1;
  }
}

// The machine this ran on, for --json: host, kernel, tandemd and its GPUs.
json machineInfo(const std::string& socket) {
  json m;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  m["hostname"] = host;
  utsname u{};
  if (::uname(&u) == 0) m["kernel"] = fmt::format("{} {} {}", u.sysname, u.release, u.machine);
  m["tandemctl_version"] = tandem_version();
  try {
    auto session = client::Session::connect(socket);
    v1::Request request;
    request.mutable_query_status();
    const auto r = session->call(request).status_reply();
    m["tandemd_version"] = r.daemon_version();
    m["backend"] = r.backend();
    m["executor"] = r.executor();
    m["gpus"] = json::array();
    for (const auto& g : r.gpus()) {
      m["gpus"].push_back({{"name", g.name()}, {"uuid", g.uuid()}, {"sms", g.sms()}, {"memory_bytes", g.memory_bytes()},
                           {"compute_capability", g.compute_capability()}, {"pci_bus_id", g.pci_bus_id()},
                           {"mps", g.mps()}});
    }
  } catch (const std::exception& e) {
    m["status_error"] = e.what();
  }
  return m;
}

// Per iteration, the slowest local rank (every rank ran the same iterations); empty unless every rank has samples.
std::vector<double> slowestPerIteration(const std::vector<Child>& children, const std::string& key) {
  std::vector<double> out;
  for (const Child& c : children) {
    if (!c.result || !c.result->contains(key) || !(*c.result)[key].is_array()) return {};
    const auto& s = (*c.result)[key];
    if (out.empty()) out.assign(s.size(), 0.0);
    if (s.size() != out.size()) return {};
    for (std::size_t i = 0; i < s.size(); ++i) out[i] = std::max(out[i], s[i].get<double>());
  }
  return out;
}

std::string num(const json& r, const char* key, const char* format) {
  if (!r.contains(key) || !r[key].is_number()) return "-";
  return fmt::format(fmt::runtime(format), r[key].get<double>());
}

// The summary line's dtype: "bf16", "fp8-e4m3 (block scales, out fp32)", "bf16, weights fp8-e4m3", "none".
std::string dtypeSummary(const RunOptions& o) {
  if (!o.op->typed) return "none";
  if (o.op->fp8 && isFp8(o.shape.dtype)) return fmt::format("{} ({} scales, out {})", o.dtype, o.scaling, o.outDtype);
  if (o.op->fp8Weights && !o.wDtype.empty() && o.wDtype != o.dtype) {
    return fmt::format("{}, weights {}", o.dtype, o.wDtype);
  }
  return o.dtype;
}

}  // namespace

int runParent(const RunOptions& o, const std::string& socket) {
  // One connection first: a missing daemon or a refused user is said once, not once per rank.
  std::string backend;
  try {
    backend = client::Session::connect(socket)->backend();
  } catch (const Error& e) {
    throw UnavailableError(e.what());
  }
  if (o.compare && o.localRanks.size() != o.ranks) {
    throw UsageError("--compare runs the NCCL baseline inside one node: drop --local-ranks (or --compare)");
  }
  const bool wantPlan = std::getenv("TANDEM_LOG") == nullptr && backend == "cuda";
  if (wantPlan) ::setenv("TANDEM_LOG", "debug", 1);  // libtandem then names the plan each (op, shape) ran

  if (::pipe2(signalPipe, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("pipe for signals failed");
  struct sigaction sa{};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);

  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) throw std::runtime_error("cannot find tandemctl's own executable (/proc/self/exe)");
  self[len] = '\0';
  const pid_t parent = ::getpid();
  pid_t group = 0;  // the ranks' process group: the first rank's pid
  std::vector<Child> children;
  for (std::size_t i = 0; i < o.localRanks.size(); ++i) {
    int in[2], out[2], err[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      throw std::runtime_error(fmt::format("pipe for rank {} failed: {}", o.localRanks[i], std::strerror(errno)));
    }
    std::vector<std::string> args = {self, "--socket", socket, "run", o.opName, "--rank",
                                     std::to_string(o.localRanks[i]), "--local-index", std::to_string(i)};
    for (auto& a : rankArgs(o)) args.push_back(a);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(fmt::format("fork for rank {} failed: {}", o.localRanks[i], std::strerror(errno)));
    if (pid == 0) {
      // In the ranks' own process group (a terminal's Ctrl-C reaches the parent, which stops them all), and killed
      // when the parent dies however it dies.
      ::setpgid(0, group);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) std::_Exit(kExitFailed);  // the parent died before prctl
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(self, argv.data());
      std::_Exit(127);
    }
    ::setpgid(pid, group);  // also here: whichever of parent and child runs first
    if (group == 0) group = pid;
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    Child c;
    c.rank = o.localRanks[i];
    c.pid = pid;
    c.in = in[1];
    c.out = out[0];
    c.err = err[0];
    children.push_back(std::move(c));
  }

  const auto start = Clock::now();
  auto lastProgress = start;
  const bool allHere = o.localRanks.size() == o.ranks;
  if (!o.json) {
    std::printf("tandemctl run %s: %s, dtype %s, %u iteration(s)%s, backend %s%s%s\n", o.opName.c_str(),
                placement(o).c_str(), dtypeSummary(o).c_str(), o.iters,
                o.warmup > 0 ? fmt::format(" after {} warm-up", o.warmup).c_str() : "", backend.c_str(),
                o.check ? ", checking against the reference" : "", o.compare ? ", with the NCCL baseline" : "");
    if (!allHere) {
      std::printf("  communicator %s; the other ranks join through other nodes' tandemctl run with the same --id\n",
                  o.idHex.c_str());
    }
    std::fflush(stdout);
  }
  // Host checks share this node's memory: grant them while the bytes they asked for fit.
  const uint64_t checkBudget = memAvailableBytes() / 10 * 6;
  uint64_t checkInUse = 0;
  std::deque<std::size_t> checkQueue;
  bool toldQueue = false;
  const auto grantChecks = [&] {
    while (!checkQueue.empty()) {
      Child& c = children[checkQueue.front()];
      if (checkInUse > 0 && checkInUse + c.checkBytes > checkBudget) {
        if (!toldQueue && !o.json) {
          std::fprintf(stderr, "  host checks take turns: each needs about %.0f MiB, %.0f MiB are available\n",
                       static_cast<double>(c.checkBytes) / (1 << 20), static_cast<double>(checkBudget) / (1 << 20));
          toldQueue = true;
        }
        return;
      }
      checkInUse += c.checkBytes;
      c.checkGranted = true;
      checkQueue.pop_front();
      writeLine(c, "go");
    }
  };
  const auto releaseCheck = [&](Child& c) {
    if (c.checkGranted) checkInUse -= std::min(checkInUse, c.checkBytes);
    c.checkGranted = false;
    c.checkBytes = 0;
    grantChecks();
  };
  const auto onLine = [&](std::size_t idx, const std::string& line) {
    Child& c = children[idx];
    json j;
    try {
      j = json::parse(line);
    } catch (...) {
      std::fprintf(stderr, "rank %u: %s\n", c.rank, line.c_str());
      return;
    }
    if (!j.contains("event")) {
      c.result = j;
      return;
    }
    const std::string ev = j["event"];
    if (ev == "progress") {
      c.done = j.value("done", uint64_t{0});
      c.total = j.value("total", uint64_t{0});
    } else if (ev == "relay") {  // rank 0's NCCL id, to every other local rank
      for (Child& other : children) {
        if (&other != &c) writeLine(other, j["line"].get<std::string>());
      }
    } else if (ev == "check_wait") {
      c.checkBytes = std::max<uint64_t>(1, j.value("bytes", uint64_t{1}));
      checkQueue.push_back(idx);
      grantChecks();
    } else if (ev == "check_done") {
      releaseCheck(c);
    }
  };
  const auto onErrLine = [&](Child& c, const std::string& line) {
    // "tandem: rank 0: ag-gemm bf16 m=... on 2 ranks: plan ..." (TANDEM_LOG=debug): kept for the summary.
    if (const auto at = line.find(": plan "); wantPlan && line.rfind("tandem: rank ", 0) == 0 && at != std::string::npos) {
      c.plan = line.substr(at + 7);
      return;
    }
    std::fprintf(stderr, "rank %u: %s\n", c.rank, line.c_str());
  };

  const bool showProgress = !o.json || ::isatty(STDERR_FILENO) != 0;
  std::size_t open = children.size();
  int stoppedBy = 0;
  Clock::time_point killAt{};
  while (open > 0) {
    std::vector<pollfd> fds;
    fds.push_back({signalPipe[0], POLLIN, 0});
    for (Child& c : children) {
      fds.push_back({c.out, POLLIN, 0});
      fds.push_back({c.err, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 500);
    if ((fds[0].revents & POLLIN) != 0) {
      char drain[16];
      while (::read(signalPipe[0], drain, sizeof drain) > 0) {
      }
      if (stoppedBy == 0) {
        stoppedBy = stopSignal;
        ::killpg(group, SIGTERM);
        killAt = Clock::now() + std::chrono::seconds(2);
      }
    }
    if (stoppedBy != 0 && Clock::now() >= killAt) ::killpg(group, SIGKILL);
    for (std::size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      for (int which = 0; which < 2; ++which) {
        int& fd = which == 0 ? c.out : c.err;
        if (fd < 0 || (fds[1 + 2 * i + static_cast<std::size_t>(which)].revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
          continue;
        }
        char buf[65536];
        const ssize_t n = ::read(fd, buf, sizeof buf);
        std::string& acc = which == 0 ? c.outBuf : c.errBuf;
        if (n > 0) {
          acc.append(buf, static_cast<std::size_t>(n));
          for (std::size_t nl = acc.find('\n'); nl != std::string::npos; nl = acc.find('\n')) {
            const std::string line = acc.substr(0, nl);
            acc.erase(0, nl + 1);
            if (which == 0) onLine(i, line);
            else onErrLine(c, line);
          }
          continue;
        }
        if (!acc.empty()) {
          if (which == 0) onLine(i, acc);
          else onErrLine(c, acc);
          acc.clear();
        }
        ::close(fd);
        fd = -1;
        if (c.out < 0 && c.err < 0) {
          --open;
          ::waitpid(c.pid, &c.status, 0);
          c.exited = true;
          if (c.in >= 0) ::close(c.in);
          c.in = -1;
          // A rank that died holding a check slot, or waiting for one, gives it back.
          checkQueue.erase(std::remove(checkQueue.begin(), checkQueue.end(), i), checkQueue.end());
          releaseCheck(c);
        }
      }
    }
    // Progress goes to stderr; with --json only when a person watches it (a terminal), so that scripts reading both
    // streams get the JSON alone.
    if (stoppedBy == 0 && Clock::now() - lastProgress >= std::chrono::seconds(2) && open > 0 && showProgress) {
      lastProgress = Clock::now();
      uint64_t done = UINT64_MAX, total = 0;
      for (const Child& c : children) {
        if (c.exited || c.total == 0) continue;
        done = std::min(done, c.done);
        total = std::max(total, c.total);
      }
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (total > 0 && done != UINT64_MAX && done >= total) {
        std::fprintf(stderr, "  every iteration done; waiting for %zu rank(s) to finish%s, %.0f s elapsed\n", open,
                     o.check ? " (checking)" : "", elapsed);
      } else if (total > 0 && done != UINT64_MAX) {
        const std::string left = done > 0 ? fmt::format(", about {:.0f} s left", elapsed / static_cast<double>(done) *
                                                                                    static_cast<double>(total - done))
                                          : "";
        std::fprintf(stderr, "  iteration %lu/%lu (slowest rank), %.0f s elapsed%s\n",
                     static_cast<unsigned long>(done), static_cast<unsigned long>(total), elapsed, left.c_str());
      } else {
        std::fprintf(stderr, "  waiting for %zu rank(s), %.0f s elapsed\n", open, elapsed);
      }
    }
  }
  if (stoppedBy != 0) {
    std::fprintf(stderr, "tandemctl run: stopped by %s; its %zu rank process(es) were stopped too\n",
                 signalName(stoppedBy).c_str(), children.size());
    return 128 + stoppedBy;
  }

  // ---- summary
  bool allOk = true;
  json results = json::array();
  for (Child& c : children) {
    json r;
    if (c.result) {
      r = *c.result;
    } else {
      const std::string how = WIFSIGNALED(c.status)
                                  ? fmt::format("was killed by {}", signalName(WTERMSIG(c.status)))
                                  : fmt::format("exited with status {}", WEXITSTATUS(c.status));
      r = {{"rank", c.rank}, {"ok", false}, {"message", fmt::format("the rank process {} without a result", how)}};
    }
    if (!c.plan.empty()) r["plan"] = c.plan;
    allOk = allOk && r.value("ok", false);
    results.push_back(r);
  }
  json summary{{"op", o.opName}, {"ranks", o.ranks}, {"local_ranks", o.localRanks}, {"id", o.idHex},
               {"dtype", o.op->typed ? o.dtype : "none"}, {"check", o.check}, {"compare", o.compare},
               {"iters", o.iters}, {"warmup", o.warmup}, {"seed", o.seed}, {"backend", backend}};
  json shape = json::object();
  for (int i = 0; i < o.op->dimCount; ++i) {
    const DimSpec& d = o.op->dims[static_cast<std::size_t>(i)];
    if (!d.cli.empty()) shape[std::string(d.cli)] = o.shape.value(d.cli);
  }
  if ((o.op->flags & kFlagCausal) != 0) shape["causal"] = o.shape.causal;
  if ((o.op->flags & kFlagZigzag) != 0) shape["zigzag"] = o.shape.zigzag;
  if ((o.op->flags & kFlagGemmLayout) != 0) shape["layout"] = gemmLayoutName(o.shape.layout);
  if (o.op->fp8 && isFp8(o.shape.dtype)) {
    shape["scaling"] = o.scaling;
    shape["out-dtype"] = o.outDtype;
  }
  if (o.op->fp8Weights) shape["w-dtype"] = o.wDtype.empty() ? o.dtype : o.wDtype;
  summary["shape"] = shape;
  // The plan as libtandem names it (one per rank; usually the same).
  std::map<std::string, std::vector<uint32_t>> plans;
  for (const Child& c : children) {
    if (!c.plan.empty()) plans[c.plan].push_back(c.rank);
  }
  if (!plans.empty()) {
    summary["plan"] = json::object();
    for (const auto& [p, ranks] : plans) summary["plan"][formatRankList(ranks)] = p;
  }

  // The slowest local rank per iteration, and what that time means for this op.
  json agg = json::object();
  const std::vector<double> slowest = slowestPerIteration(children, "samples_us");
  if (!slowest.empty()) {
    putStats(agg, "", slowest);
    agg.erase("samples_us");
    double flops = 0;
    const OpDescriptor d0 = reference::makeDescriptor(o.shape, o.localRanks.front(), o.ranks);
    for (uint32_t r : o.localRanks) {
      if (const auto m = metricsOf(reference::makeDescriptor(o.shape, r, o.ranks))) flops += m->flops;
    }
    const double p50s = agg["p50_us"].get<double>() * 1e-6;
    if (const auto m = metricsOf(d0); m && p50s > 0) {
      if (flops > 0) agg["tflops_per_rank"] = flops / static_cast<double>(o.localRanks.size()) / p50s / 1e12;
      if (m->busBytes > 0) agg["bus_gbps"] = m->busBytes / p50s / 1e9;
    }
    const std::vector<double> base = slowestPerIteration(children, "baseline_samples_us");
    if (!base.empty()) {
      json b = json::object();
      putStats(b, "", base);
      agg["baseline_min_us"] = b["min_us"];
      agg["baseline_p50_us"] = b["p50_us"];
      agg["baseline_p99_us"] = b["p99_us"];
      agg["baseline_over_tandem"] = b["p50_us"].get<double>() / agg["p50_us"].get<double>();
    }
  }
  std::string baselineName, baselineNote;
  for (const auto& r : results) {
    if (r.contains("baseline")) baselineName = r["baseline"].get<std::string>();
    if (r.contains("baseline_note")) baselineNote = r["baseline_note"].get<std::string>();
  }
  if (!baselineName.empty()) agg["baseline"] = baselineName;
  if (!baselineNote.empty()) agg["baseline_note"] = baselineNote;
  summary["summary"] = agg;
  summary["machine"] = machineInfo(socket);
  summary["results"] = results;
  summary["ok"] = allOk;

  if (o.json) {
    std::cout << summary.dump(2) << std::endl;
    return allOk ? kExitOk : kExitFailed;
  }
  std::printf("%-5s %-4s %10s %10s %10s %11s %9s  %s\n", "rank", "ok", "min_us", "p50_us", "p99_us", "rel_error",
              "tolerance", "message");
  std::map<std::string, std::vector<uint32_t>> messages;
  for (const auto& r : results) {
    const std::string message = r.value("message", std::string());
    if (!message.empty()) messages[message].push_back(r.value("rank", 0u));
  }
  for (const auto& r : results) {
    const bool ok = r.value("ok", false);
    const std::string message = r.value("message", std::string());
    std::string relErr = num(r, "rel_error", "{:.3e}");
    if (r.contains("rel_error") && r["rel_error"].is_null()) relErr = "nan";
    std::printf("%-5d %-4s %10s %10s %10s %11s %9s  %s\n", r.value("rank", -1), ok ? "yes" : "NO",
                num(r, "min_us", "{:.1f}").c_str(), num(r, "p50_us", "{:.1f}").c_str(),
                num(r, "p99_us", "{:.1f}").c_str(), relErr.c_str(), num(r, "tolerance", "{:.0e}").c_str(),
                messages.size() > 1 || message.size() > 60 ? (message.empty() ? "" : "(below)") : message.c_str());
  }
  // Each distinct message once, with the ranks that gave it.
  if (messages.size() > 1 || (messages.size() == 1 && messages.begin()->first.size() > 60)) {
    for (const auto& [m, ranks] : messages) std::printf("rank %s: %s\n", formatRankList(ranks).c_str(), m.c_str());
  }
  if (!slowest.empty()) {
    std::printf("%s: min %.1f us, p50 %.1f us, p99 %.1f us over %zu iteration(s) (per iteration the slowest local rank)",
                o.opName.c_str(), agg["min_us"].get<double>(), agg["p50_us"].get<double>(),
                agg["p99_us"].get<double>(), slowest.size());
    if (agg.contains("tflops_per_rank")) std::printf(", %.3g TFLOP/s per rank", agg["tflops_per_rank"].get<double>());
    if (agg.contains("bus_gbps")) std::printf(", %.3g GB/s bus bandwidth", agg["bus_gbps"].get<double>());
    std::printf("\n");
    if (agg.contains("baseline_p50_us")) {
      std::printf("baseline (%s): min %.1f us, p50 %.1f us, p99 %.1f us; baseline/tandem %.3f (above 1: tandem is "
                  "faster)\n", baselineName.c_str(), agg["baseline_min_us"].get<double>(),
                  agg["baseline_p50_us"].get<double>(), agg["baseline_p99_us"].get<double>(),
                  agg["baseline_over_tandem"].get<double>());
    }
  }
  if (!baselineNote.empty()) std::printf("baseline: %s\n", baselineNote.c_str());
  for (const auto& [p, ranks] : plans) std::printf("plan (rank %s): %s\n", formatRankList(ranks).c_str(), p.c_str());
  std::printf("%s: %s on %s: %s%s\n", allOk ? "PASS" : "FAIL", o.opName.c_str(), placement(o).c_str(),
              o.check ? (allOk ? "matches the reference" : "did not match or failed") : (allOk ? "ran (no --check)" : "failed"),
              allHere ? "" : " (each node checks its own ranks)");
  return allOk ? kExitOk : kExitFailed;
}

}  // namespace tandem::ctl
