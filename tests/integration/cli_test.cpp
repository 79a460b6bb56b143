// tandemctl and tandemd as a user meets them on the command line, as real processes: `run`'s up-front argument
// checks, one message when no daemon runs, signals named, ranks that die with their parent, progress, failed rows
// without fake numbers, --help and --version, check memory that does not grow with the square of the ranks, the
// client's socket fallback and its "join the group" message, and where a backgrounded or systemd tandemd logs.
#include <doctest/doctest.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>

#include <regex>

#include "harness.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/tandem.h"

using namespace tandem::testing;

namespace {

// A process whose stdout and stderr are read until both close (or the deadline), and whose pid the test knows.
class Proc {
 public:
  explicit Proc(const std::vector<std::string>& argv) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::_Exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }
  ~Proc() {
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  Proc(const Proc&) = delete;
  Proc& operator=(const Proc&) = delete;
  pid_t pid() const { return pid_; }
  // Reads what is there within timeoutMs; returns whether `text` has appeared on stdout or stderr.
  bool waitFor(const std::string& text, int timeoutMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (out_.find(text) == std::string::npos && err_.find(text) == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || !pump(static_cast<int>(left))) return out_.find(text) != std::string::npos ||
                                                             err_.find(text) != std::string::npos;
    }
    return true;
  }
  // Reads to the end and reaps; the exit code, 128 + N if killed by signal N, -1 at the deadline.
  int finish(int timeoutMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (fds_[0] >= 0 || fds_[1] >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return -1;
      pump(static_cast<int>(left));
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  std::string output() const { return out_ + err_; }
  const std::string& out() const { return out_; }

 private:
  // One poll round; false when both pipes are closed.
  bool pump(int timeoutMs) {
    pollfd p[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
    if (fds_[0] < 0 && fds_[1] < 0) return false;
    ::poll(p, 2, timeoutMs);
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0 || (p[i].revents & (POLLIN | POLLHUP)) == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds_[i], buf, sizeof buf);
      if (n > 0) {
        (i == 0 ? out_ : err_).append(buf, static_cast<size_t>(n));
      } else {
        ::close(fds_[i]);
        fds_[i] = -1;
      }
    }
    return true;
  }
  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string out_, err_;
  bool reaped_ = false;
};

// The children of `pid` (Linux's /proc/PID/task/PID/children).
std::vector<pid_t> childrenOf(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/task/{}/children", pid, pid));
  std::vector<pid_t> out;
  for (pid_t c; in >> c;) out.push_back(c);
  return out;
}

// Gone, or a zombie nobody reaped yet (a container's init may not reap): either way no longer running.
bool notRunning(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return true;
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("tandemctl run refuses bad arguments before starting anything: exit 2, one message naming the flag") {
  TempDir dir;
  // No daemon at this socket: a check that ran after connecting would exit 69 instead.
  const std::string socket = (dir.path() / "none.sock").string();
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> named;
  };
  const std::vector<Case> cases = {
      {{"ag-gemm", "--m", "-5"}, {"--m"}},
      {{"moe-dispatch-gemm", "--topk", "9"}, {"--topk", "--experts"}},
      {{"moe-dispatch-ffn-combine", "--experts", "0"}, {"--experts"}},
      {{"moe-dispatch-gemm", "--ranks", "3"}, {"--experts", "--ranks"}},
      {{"gemm-rs", "--ranks", "4", "--k", "3"}, {"--k", "--ranks"}},
      {{"allgather", "--m", "5"}, {"--m", "--bytes"}},
      {{"ag-gemm", "--ranks", "0"}, {"--ranks"}},
      {{"no-such-op"}, {"ag-gemm"}},
      {{"barrier", "--dtype", "fp16"}, {"--dtype"}},
      {{"ag-gemm", "--m", "5000000000"}, {"--m"}},
      // FP8: only the ops that take it, and its options only with it.
      {{"ring-attention", "--dtype", "fp8-e4m3"}, {"--dtype", "ring-attention", "ag-gemm, gemm-rs, gemm-ar"}},
      {{"moe-dispatch-gemm", "--dtype", "fp8-e5m2"}, {"--dtype", "--w-dtype fp8-e4m3"}},
      {{"ag-gemm", "--dtype", "fp8"}, {"--dtype", "fp8-e4m3", "fp8-e5m2"}},
      {{"ag-gemm", "--scaling", "block"}, {"--scaling", "--dtype fp8-e4m3"}},
      {{"gemm-rs", "--dtype", "bf16", "--out-dtype", "fp32"}, {"--out-dtype"}},
      {{"gemm-ar", "--dtype", "fp8-e4m3", "--out-dtype", "fp16"}, {"--out-dtype", "bf16", "fp32"}},
      {{"gemm-ar", "--dtype", "fp8-e4m3", "--scaling", "row"}, {"--scaling", "tensor", "block"}},
      {{"ag-gemm", "--w-dtype", "fp8-e4m3"}, {"--w-dtype", "ag-gemm"}},
      {{"moe-dispatch-gemm", "--w-dtype", "fp8-e5m2"}, {"--w-dtype", "fp8-e4m3"}},
      {{"moe-dispatch-gemm", "--w-dtype", "fp8-e4m3", "--dtype", "fp16"}, {"--w-dtype", "--dtype bf16"}},
      {{"moe-dispatch-ffn-combine", "--w-dtype", "fp8-e4m3", "--saved-rows", "8"}, {"--saved-rows", "--w-dtype"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {TANDEMCTL_PATH, "--socket", socket, "run"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const CommandResult r = runCommand(argv, 10000);
    INFO(fmt::format("{}", fmt::join(c.args, " ")) << ":\n" << r.out << r.err);
    CHECK(r.exitCode == 2);
    for (const std::string& flag : c.named) CHECK(r.err.find(flag) != std::string::npos);
    CHECK(r.err.find("cannot reach") == std::string::npos);
    CHECK(count(r.err, "\n") <= 3);  // one message (and CLI11's hint), not one per rank
  }
}

TEST_CASE("with no daemon, tandemctl run says so once and exits 69") {
  TempDir dir;
  const CommandResult r =
      runCommand({TANDEMCTL_PATH, "--socket", (dir.path() / "none.sock").string(), "run", "barrier", "--ranks", "4"});
  INFO(r.out << r.err);
  CHECK(r.exitCode == 69);
  CHECK(count(r.out + r.err, "cannot reach tandemd") == 1);
}

TEST_CASE("tandemctl --version, run --help with the defaults and the exit codes") {
  CommandResult r = runCommand({TANDEMCTL_PATH, "--version"});
  CHECK(r.exitCode == 0);
  CHECK(r.out.find(std::string("tandemctl ") + tandem_version()) != std::string::npos);
  r = runCommand({TANDEMCTL_PATH, "run", "--help"});
  INFO(r.out);
  CHECK(r.exitCode == 0);
  // CLI11 2.1 prints "--m UINT:COUNT=256", 2.4 "--m UINT:COUNT [256]".
  CHECK(std::regex_search(r.out, std::regex(R"(--m\s+\S*(=256\b|\s*\[256\]))")));
  CHECK(r.out.find("causal mask (default: on)") != std::string::npos);
  for (const char* dtype : {"bf16", "fp16", "fp32", "fp8-e4m3", "fp8-e5m2"}) {
    CHECK(r.out.find(dtype) != std::string::npos);
  }
  for (const char* option : {"--scaling", "--out-dtype", "--w-dtype"}) CHECK(r.out.find(option) != std::string::npos);
  CHECK(r.out.find("Exit codes: 0") != std::string::npos);
  CHECK(r.out.find("69") != std::string::npos);
}

TEST_CASE("a rank killed by a signal is reported with the signal's name, and the run fails") {
  Daemon d;
  Proc ctl({TANDEMCTL_PATH, "--socket", d.socket(), "run", "barrier", "--ranks", "2", "--iters", "1000000",
            "--timeout-ms", "5000"});
  std::vector<pid_t> ranks;
  REQUIRE_MESSAGE(eventually([&] { return (ranks = childrenOf(ctl.pid())).size() == 2; }, 10000),
                  "tandemctl did not start 2 rank processes");
  // Let the ranks join and run, then crash one.
  REQUIRE(eventually([&] { return !daemonStatus(d)["communicators"].empty(); }, 10000));
  ::kill(ranks[1], SIGFPE);
  const int code = ctl.finish(30000);
  INFO(ctl.output());
  CHECK(code == 1);
  CHECK(ctl.output().find("killed by SIGFPE") != std::string::npos);
}

TEST_CASE("rank processes die with tandemctl: SIGTERM stops them and is named, SIGKILL of the parent takes them too") {
  Daemon d;
  SUBCASE("SIGTERM, after the progress line of a long run") {
    Proc ctl({TANDEMCTL_PATH, "--socket", d.socket(), "run", "barrier", "--ranks", "2", "--iters", "1000000"});
    // Progress comes every 2 s: iterations done of the total, and the time left.
    REQUIRE_MESSAGE(ctl.waitFor("s left", 20000), ctl.output());
    CHECK(std::regex_search(ctl.output(), std::regex(R"(iteration \d+/1000000)")));
    const std::vector<pid_t> ranks = childrenOf(ctl.pid());
    REQUIRE(ranks.size() == 2);
    ::kill(ctl.pid(), SIGTERM);
    const int code = ctl.finish(20000);
    INFO(ctl.output());
    CHECK(code == 128 + SIGTERM);
    CHECK(ctl.output().find("stopped by SIGTERM") != std::string::npos);
    for (pid_t r : ranks) CHECK(eventually([&] { return notRunning(r); }, 5000));
  }
  SUBCASE("SIGKILL of the parent") {
    Proc ctl({TANDEMCTL_PATH, "--socket", d.socket(), "run", "barrier", "--ranks", "2", "--iters", "1000000"});
    std::vector<pid_t> ranks;
    REQUIRE(eventually([&] { return (ranks = childrenOf(ctl.pid())).size() == 2; }, 10000));
    ::kill(ctl.pid(), SIGKILL);
    ctl.finish(20000);
    for (pid_t r : ranks) CHECK_MESSAGE(eventually([&] { return notRunning(r); }, 5000), "rank ", r, " outlived tandemctl");
  }
  // The daemon lost its clients and serves on.
  CHECK(eventually([&] { return daemonStatus(d)["communicators"].empty(); }, 10000));
}

TEST_CASE("a failed rank's row shows no numbers it does not have") {
  Daemon d;
  int code = 0;
  // Rank 1 never comes: rank 0's join times out, so it has no latency, error or tolerance to show.
  const std::string out = d.ctl({"run", "barrier", "--ranks", "2", "--local-ranks", "0", "--id",
                                 "00112233445566778899aabbccddeeff", "--timeout-ms", "300"},
                                &code);
  INFO(out);
  CHECK(code == 1);
  std::smatch row;
  REQUIRE(std::regex_search(out, row, std::regex(R"(\n0\s+NO\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+))")));
  for (std::size_t i = 1; i < row.size(); ++i) CHECK(row[i].str() == "-");
  CHECK(out.find("FAIL") != std::string::npos);
}

TEST_CASE("--check memory grows linearly with the ranks: each rank computes only its own expected outputs") {
  Daemon d;
  // allgather's output is ranks x bytes; checking every rank's outputs in every rank (as before) held ranks^2 x bytes
  // as doubles in each process: 8 ranks x 8 x 256 KiB x 8 bytes = 128 MiB. One rank's own: 16 MiB.
  const auto peakKiB = [&](const char* ranks) {
    int code = 0;
    const std::string out = d.ctl({"run", "allgather", "--ranks", ranks, "--bytes", "262144", "--check", "--json"},
                                  &code, 120000);
    INFO(out);
    REQUIRE(code == 0);
    const auto j = nlohmann::json::parse(out.substr(out.find('{')));
    int64_t peak = 0;
    for (const auto& r : j["results"]) {
      CHECK(r["check"] == true);
      peak = std::max(peak, r["max_rss_kib"].get<int64_t>());
    }
    return peak;
  };
  const int64_t one = peakKiB("1"), eight = peakKiB("8");
  MESSAGE("peak RSS of a checking rank: " << one << " KiB at 1 rank, " << eight << " KiB at 8");
  CHECK(eight - one < 96 * 1024);
}

TEST_CASE("tandemctl run --json has the shape, dtype, plan (where the backend names one), machine and statistics") {
  Daemon d;
  int code = 0;
  const std::string out = d.ctl({"run", "gemm-ar", "--ranks", "2", "--m", "8", "--n", "8", "--k", "16", "--iters", "5",
                                 "--check", "--json", "--dtype", "fp32"},
                                &code);
  INFO(out);
  REQUIRE(code == 0);
  const auto j = nlohmann::json::parse(out);
  CHECK(j["shape"]["m"] == 8);
  CHECK(j["shape"]["k"] == 16);
  CHECK(j["dtype"] == "fp32");
  CHECK(j["machine"]["backend"] == "cpu");
  CHECK(j["machine"].contains("hostname"));
  CHECK(j["summary"]["p50_us"].get<double>() > 0);
  CHECK(j["summary"]["min_us"].get<double>() <= j["summary"]["p99_us"].get<double>());
  CHECK(j["summary"].contains("tflops_per_rank"));
  CHECK(j["summary"].contains("bus_gbps"));
  for (const auto& r : j["results"]) CHECK(r["samples_us"].size() == 5);
}

TEST_CASE("tandemctl run names the FP8 options in its summary line and in the --json shape") {
  Daemon d;
  int code = 0;
  std::string out = d.ctl({"run", "gemm-rs", "--ranks", "2", "--m", "8", "--n", "8", "--k", "160", "--dtype",
                           "fp8-e5m2", "--scaling", "block", "--out-dtype", "fp32", "--check", "--json"},
                          &code);
  INFO(out);
  REQUIRE(code == 0);
  auto j = nlohmann::json::parse(out);
  CHECK(j["dtype"] == "fp8-e5m2");
  CHECK(j["shape"]["scaling"] == "block");
  CHECK(j["shape"]["out-dtype"] == "fp32");
  CHECK_FALSE(j["shape"].contains("w-dtype"));
  for (const auto& r : j["results"]) CHECK(r["check"] == true);
  out = d.ctl({"run", "ag-gemm", "--ranks", "2", "--m", "8", "--n", "8", "--k", "16", "--dtype", "fp8-e4m3"}, &code);
  CHECK(code == 0);
  CHECK(out.find("dtype fp8-e4m3 (tensor scales, out bf16)") != std::string::npos);
  out = d.ctl({"run", "moe-dispatch-gemm", "--ranks", "2", "--m", "4", "--n", "8", "--k", "16", "--experts", "2",
               "--topk", "1", "--w-dtype", "fp8-e4m3", "--json"},
              &code);
  INFO(out);
  REQUIRE(code == 0);
  j = nlohmann::json::parse(out);
  CHECK(j["dtype"] == "bf16");
  CHECK(j["shape"]["w-dtype"] == "fp8-e4m3");
  CHECK_FALSE(j["shape"].contains("scaling"));
  out = d.ctl({"run", "moe-dispatch-gemm", "--ranks", "2", "--m", "4", "--n", "8", "--k", "16", "--experts", "2",
               "--topk", "1", "--w-dtype", "fp8-e4m3"},
              &code);
  CHECK(code == 0);
  CHECK(out.find("dtype bf16, weights fp8-e4m3") != std::string::npos);
}

TEST_CASE("a client finds the system daemon's socket when it has none of its own") {
  TempDir dir;
  const std::string own = (dir.path() / "own.sock").string(), system = (dir.path() / "system.sock").string();
  CHECK(tandem::chooseClientSocket(own, system) == own);  // neither exists: the error names the user's own
  std::ofstream(system) << "";
  CHECK(tandem::chooseClientSocket(own, system) == system);
  std::ofstream(own) << "";
  CHECK(tandem::chooseClientSocket(own, system) == own);
}

TEST_CASE("a socket this user may not open says to join the daemon's group") {
  Daemon d;
  // Root may open any socket: drop to nobody in a child. Another user: a socket of mode 000 refuses its owner too.
  int pipeFds[2];
  REQUIRE(::pipe(pipeFds) == 0);
  const bool root = ::geteuid() == 0;
  if (!root) ::chmod(d.socket().c_str(), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (root) {
      const passwd* nobody = ::getpwnam("nobody");
      if (nobody == nullptr || ::setgroups(0, nullptr) != 0 || ::setgid(nobody->pw_gid) != 0 ||
          ::setuid(nobody->pw_uid) != 0) {
        std::_Exit(3);
      }
    }
    tandem_session_t s = nullptr;
    const tandem_status_t st = tandem_connect(d.socket().c_str(), &s);
    const std::string message = tandem_last_error();
    [[maybe_unused]] const ssize_t n = ::write(pipeFds[1], message.data(), message.size());
    std::_Exit(st == TANDEM_SUCCESS ? 1 : 0);
  }
  ::close(pipeFds[1]);
  std::string message;
  char buf[1024];
  for (ssize_t n; (n = ::read(pipeFds[0], buf, sizeof buf)) > 0;) message.append(buf, static_cast<size_t>(n));
  ::close(pipeFds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!root) ::chmod(d.socket().c_str(), 0660);
  INFO(message);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(message.find("EACCES") != std::string::npos);
  CHECK(message.find("join that group") != std::string::npos);
  CHECK(message.find("Start it") == std::string::npos);
}

TEST_CASE("a backgrounded tandemd leaves the terminal once it serves, and logs to --log-file") {
  TempDir dir;
  const std::string socket = (dir.path() / "d.sock").string(), logFile = (dir.path() / "tandemd.log").string();
  // runCommand reads until stdout and stderr close: a daemon that kept the terminal's pipes would hold it to the
  // deadline.
  const auto start = Clock::now();
  const CommandResult r = runCommand({TANDEMD_PATH, "--backend", "cpu", "--socket", socket, "--log-file", logFile}, 20000);
  INFO(r.out << r.err);
  REQUIRE(r.exitCode == 0);
  CHECK(Clock::now() - start < std::chrono::seconds(15));
  std::smatch m;
  REQUIRE(std::regex_search(r.out, m, std::regex(R"(started \(pid (\d+)\))")));
  const pid_t pid = std::stoi(m[1].str());
  CHECK(r.err.find("shutting down") == std::string::npos);
  const CommandResult stop = runCommand({TANDEMCTL_PATH, "--socket", socket, "shutdown"});
  CHECK(stop.exitCode == 0);
  CHECK(eventually([&] { return notRunning(pid); }, 10000));
  std::ifstream in(logFile);
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  INFO(log);
  CHECK(log.find("serving") != std::string::npos);
  CHECK(log.find("tandemd stopped") != std::string::npos);
}

TEST_CASE("under --systemd tandemd logs journal lines (syslog priority prefixes, no timestamps)") {
  Daemon d("", {"--systemd"});
  int code = 0;
  d.ctl({"shutdown"}, &code);
  CHECK(d.waitExit(10000) == 0);
  const std::string log = d.log();
  INFO(log);
  CHECK(std::regex_search(log, std::regex(R"((^|\n)<6>tandemd \S+ serving)")));
  CHECK(log.find("<6>tandemd stopped") != std::string::npos);
}
