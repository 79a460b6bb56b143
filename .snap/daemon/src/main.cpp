// tandemd: the per-node tandem daemon. argv -> options -> config -> run.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/dist_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <boost/asio/signal_set.hpp>
#include <atomic>
#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "cluster.hpp"
#include "config.hpp"
#include "cpu/cpu_backend.hpp"
#include "engine.hpp"
#ifdef TANDEM_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif
#include "lifecycle.hpp"
#include "plan_table.hpp"
#include "server.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/protocol.hpp"

namespace td = tandem::daemon;

namespace {

struct Options {
  std::string configPath;
  std::string socketPath;
  std::string backend;
  std::string logLevel;
  std::string logFile;
  std::string nodeIndex;  // --node-index, as typed
  bool nodeIndexGiven = false;
  bool foreground = false;
  bool systemd = false;
  bool printDefaultConfig = false;
  bool version = false;
};

// Under systemd, stderr is the journal: each line carries its syslog priority as a "<N>" prefix (sd-daemon(3)), and
// the journal adds the time, the unit and the pid itself.
class JournalSink : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t text;
    formatter_->format(msg, text);
    std::fprintf(stderr, "<%d>%.*s", priority(msg.level), static_cast<int>(text.size()), text.data());
  }
  void flush_() override { std::fflush(stderr); }

 private:
  static int priority(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::critical: return 2;  // LOG_CRIT
      case spdlog::level::err: return 3;       // LOG_ERR
      case spdlog::level::warn: return 4;      // LOG_WARNING
      case spdlog::level::info: return 6;      // LOG_INFO
      default: return 7;                       // LOG_DEBUG
    }
  }
};

// Where tandemd logs: the journal under --systemd; else the terminal that started it (until it detaches) and
// --log-file when given. One logger over a dist_sink, so that detaching swaps its sinks without replacing the logger
// other threads are using.
class Logging {
 public:
  Logging() : sinks_(std::make_shared<spdlog::sinks::dist_sink_mt>()) {
    sinks_->add_sink(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    auto logger = std::make_shared<spdlog::logger>("tandemd", sinks_);
    spdlog::set_default_logger(logger);
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  // --systemd: the journal only, without timestamps of our own.
  void toJournal() {
    auto journal = std::make_shared<JournalSink>();
    journal->set_pattern("%v");
    sinks_->set_sinks({journal});
  }
  // Also to `path` (appended). Throws Error(kInvalidConfig) when it cannot be opened.
  void alsoToFile(const std::string& path) {
    try {
      file_ = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, false);
    } catch (const spdlog::spdlog_ex& e) {
      throw tandem::Error(tandem::ErrorCode::kInvalidConfig,
                          fmt::format("--log-file {}: {}. Pass a file the daemon's user may create or append to", path,
                                      e.what()));
    }
    file_->set_pattern("%Y-%m-%dT%H:%M:%S.%e %l %v");
    sinks_->add_sink(file_);
  }
  // Detached: the terminal is no longer ours; log to --log-file, or nowhere.
  void detach() {
    std::vector<spdlog::sink_ptr> keep;
    if (file_) keep.push_back(file_);
    sinks_->set_sinks(keep);
  }

 private:
  std::shared_ptr<spdlog::sinks::dist_sink_mt> sinks_;
  spdlog::sink_ptr file_;
};

// Builds the backend the config asks for. Runs after daemonizing: CUDA must not be initialised before a fork.
// Throws Error(kUnavailable) (exit 69) when the hardware the config demands is missing.
std::unique_ptr<td::Backend> makeBackend(const td::DaemonConfig& config) {
#ifdef TANDEM_HAVE_CUDA
  if (config.daemon.backend != td::BackendKind::kCpu) td::cuda::prepareEnvironment(config);
#endif
  switch (config.daemon.backend) {
    case td::BackendKind::kCpu: return td::makeCpuBackend(config);
    case td::BackendKind::kCuda:
#ifdef TANDEM_HAVE_CUDA
      return td::cuda::makeCudaBackend(config);
#else
      throw tandem::Error(tandem::ErrorCode::kUnavailable,
                          "daemon.backend is cuda, but this tandemd was built without CUDA (nvcc was not found when it "
                          "was configured); rebuild with the CUDA toolkit, or set daemon.backend to cpu or auto");
#endif
    case td::BackendKind::kAuto: {
#ifdef TANDEM_HAVE_CUDA
      std::string why;
      if (td::cuda::visibleDeviceCount(&why) > 0) return td::cuda::makeCudaBackend(config);
      spdlog::info("daemon.backend is auto and no GPU is usable ({}): using the cpu backend", why);
#endif
      return td::makeCpuBackend(config);
    }
  }
  return td::makeCpuBackend(config);
}

// Forks into the background; the parent returns only when the child reports that it serves (or failed).
// Returns the write end of the readiness pipe in the child, or exits in the parent.
int daemonize() {
  int pipeFds[2];
  if (::pipe(pipeFds) != 0) throw tandem::Error(tandem::ErrorCode::kSystem, "pipe for daemonizing failed");
  const pid_t pid = ::fork();
  if (pid < 0) throw tandem::Error(tandem::ErrorCode::kSystem, "fork failed");
  if (pid > 0) {
    ::close(pipeFds[1]);
    char status = 1;
    const ssize_t n = ::read(pipeFds[0], &status, 1);
    if (n == 1 && status == 0) std::_Exit(0);
    int wstatus = 0;
    ::waitpid(pid, &wstatus, 0);
    std::_Exit(WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 1);
  }
  ::close(pipeFds[0]);
  ::setsid();
  return pipeFds[1];
}

// The node index from --node-index, else from $TANDEM_NODE_INDEX (when set and not empty), else none. Throws
// Error(kInvalidConfig) naming where the text came from when it is not a number.
std::optional<int32_t> nodeIndexOverride(const Options& options, std::string* source) {
  std::string text;
  if (options.nodeIndexGiven) {
    text = options.nodeIndex;
    *source = "--node-index";
  } else if (const char* env = std::getenv("TANDEM_NODE_INDEX"); env != nullptr && *env != '\0') {
    text = env;
    *source = "TANDEM_NODE_INDEX";
  } else {
    return std::nullopt;
  }
  int32_t index = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), index);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || index < 0) {
    throw tandem::Error(tandem::ErrorCode::kInvalidConfig,
                        fmt::format("{}: '{}' is not a node index. Pass this node's 0-based position in cluster.nodes "
                                    "(0 on the first node, 1 on the second, ...).", *source, text));
  }
  return index;
}

// After the parent has gone: stdin, stdout and stderr to /dev/null, so that nothing (a library's message on stderr
// included) reaches the terminal that started the daemon.
void detachStdio() {
  const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0) return;
  for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) ::dup2(null, fd);
  ::close(null);
}

// TANDEM_TEST_STALL_CONTROL_LOOP_MS=N (tests only): N ms after serving starts, the control loop blocks for good, as a
// loop wedged by a bug would. The watchdog and the SIGTERM grace period are tested against it.
void stallControlLoopForTests(td::Server& server) {
  const char* text = std::getenv("TANDEM_TEST_STALL_CONTROL_LOOP_MS");
  if (text == nullptr || *text == '\0') return;
  const long ms = std::strtol(text, nullptr, 10);
  spdlog::warn("TANDEM_TEST_STALL_CONTROL_LOOP_MS is set: the control loop stops answering in {} ms (a test)", ms);
  server.every(std::chrono::milliseconds(std::max(ms, 1L)), [] {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  });
}

int run(const Options& options, Logging& logging) {
  td::DaemonConfig config;
  if (!options.configPath.empty()) config = td::loadConfigFile(options.configPath);
  // Flags override the file.
  if (!options.socketPath.empty()) config.daemon.socket = options.socketPath;
  if (!options.logLevel.empty()) config.daemon.logLevel = options.logLevel;
  if (!options.backend.empty()) {
    if (options.backend == "auto") config.daemon.backend = td::BackendKind::kAuto;
    else if (options.backend == "cpu") config.daemon.backend = td::BackendKind::kCpu;
    else if (options.backend == "cuda") config.daemon.backend = td::BackendKind::kCuda;
    else throw tandem::Error(tandem::ErrorCode::kInvalidConfig,
                             fmt::format("--backend: '{}' is not one of auto, cpu, cuda", options.backend));
  }
  std::string nodeIndexSource;
  if (const auto index = nodeIndexOverride(options, &nodeIndexSource)) config.cluster.nodeIndex = *index;
  try {
    td::validateConfig(config);
  } catch (const tandem::Error& e) {
    const std::string what = e.what();
    if (nodeIndexSource.empty() || what.find("cluster.node_index") == std::string::npos) throw;
    throw tandem::Error(e.code(), fmt::format("{} (cluster.node_index {} came from {})", what,
                                              config.cluster.nodeIndex, nodeIndexSource));
  }
  spdlog::set_level(spdlog::level::from_str(config.daemon.logLevel));

  const int readyFd = (options.foreground || options.systemd) ? -1 : daemonize();

  auto backend = makeBackend(config);
  // Multi-node: declared before the engine, so it outlives the engine's communicators and their staging.
  std::unique_ptr<td::Cluster> cluster;
  if (td::isMultiNode(config.cluster)) {
    cluster = std::make_unique<td::Cluster>(config, backend->name(), backend->gpus(), backend->deviceCopier());
  }
  td::Engine engine(config, std::move(backend));
  engine.attachCluster(cluster.get());
  // Loaded before the first op: its entries steer every fused op of a known shape (plan_table.hpp).
  auto plans = std::make_shared<td::PlanTable>(
      td::planStateDirectory(config.plans.stateDir),
      td::nodeFingerprint(engine.backend().name(), engine.backend().gpus()));
  spdlog::info("plan table {} ({}): {}", plans->path().empty() ? "in memory" : plans->path(),
               plans->fingerprint().describe(), plans->state());
  engine.attachPlans(plans);
  engine.start();
  const std::string backendName = engine.backend().name();
  td::Server server(config, engine, backendName);
  // A backend that failed beyond repair (a sticky CUDA error, a poisoned MPS server): every communicator has already
  // failed with the reason; stop serving and exit non-zero, so that systemd's Restart=on-failure brings up a fresh
  // daemon on a fresh context.
  std::atomic<bool> backendFailed{false};
  engine.setFatalHandler([&server, &backendFailed](const std::string& why) {
    td::notifySystemd("STATUS=backend failed: " + why);
    backendFailed = true;
    server.stop();
  });
  if (cluster) {
    // Peer events reach the engine on the control thread, like every client request.
    cluster->start(
        [&server, &engine](uint32_t from, const tandem::v1::PeerMessage& m) {
          server.post([&engine, from, m] { engine.onPeerMessage(from, m); });
        },
        [&server, &engine](uint32_t node, const std::string& reason) {
          server.post([&engine, node, reason] { engine.onNodeLost(node, reason); });
        });
  }
  spdlog::info("tandemd {} serving {} (backend {}, executor {}, pid {})", TANDEM_VERSION_STRING, server.socketPath(),
               backendName, engine.backend().executor(), ::getpid());
  if (readyFd >= 0) {
    std::printf("tandemd %s started (pid %d), socket %s\n", TANDEM_VERSION_STRING, ::getpid(), server.socketPath().c_str());
    std::fflush(stdout);
    logging.detach();
    detachStdio();
    const char ok = 0;
    [[maybe_unused]] ssize_t n = ::write(readyFd, &ok, 1);
    ::close(readyFd);
  }
  td::notifySystemd("READY=1\nSTATUS=serving " + server.socketPath());
  // The watchdog is fed from the control loop itself, so that a loop wedged for any reason stops feeding it and
  // systemd restarts tandemd (WatchdogSec= in tandemd.service) instead of leaving the node's clients hanging.
  if (const auto period = td::systemdWatchdogPeriod()) {
    spdlog::info("systemd watchdog: WATCHDOG=1 every {} ms from the control loop", period->count() / 1000);
    server.every(*period, [] { td::notifySystemd("WATCHDOG=1"); });
  }
  stallControlLoopForTests(server);

  // SIGINT/SIGTERM drain and exit: the server closes every session, the engine finishes running ops. The signal
  // thread gives that daemon.stop_grace_ms; past it (the control loop no longer answers, an op never ends) it ends
  // the process itself with the reason logged: a daemon that ignores SIGTERM holds up its node's shutdown.
  struct {
    std::mutex mutex;
    std::condition_variable cv;
    bool finished = false;
  } drain;
  const auto grace = std::chrono::milliseconds(config.daemon.stopGraceMs);
  std::thread signals([&server, &drain, grace] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    sigwait(&set, &sig);
    {
      std::lock_guard lock(drain.mutex);
      if (drain.finished) return;  // the wake-up sent once shutdown was done
    }
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    spdlog::info("received {}, shutting down", name);
    server.stop();
    std::unique_lock lock(drain.mutex);
    if (!drain.cv.wait_for(lock, grace, [&] { return drain.finished; })) {
      spdlog::critical("tandemd did not finish shutting down within daemon.stop_grace_ms ({} ms) of {}: its control "
                       "loop or an op is not answering. Exiting now without draining; clients see DAEMON_LOST",
                       grace.count(), name);
      spdlog::default_logger()->flush();
      td::notifySystemd("STATUS=stop grace period exceeded; exiting without draining");
      std::_Exit(td::kExitFailure);
    }
  });
  server.run();
  td::notifySystemd("STOPPING=1");
  engine.stop();
  if (cluster) cluster->stop();  // before the server goes: its callbacks post to the server
  {
    std::lock_guard lock(drain.mutex);
    drain.finished = true;
  }
  drain.cv.notify_all();
  // Wake the signal thread if shutdown came from a Shutdown request instead of a signal.
  ::kill(::getpid(), SIGTERM);
  signals.join();
  if (backendFailed) {
    spdlog::critical("tandemd stopped: its backend failed (see above); exit {} so that systemd restarts it",
                     td::kExitFailure);
    return td::kExitFailure;
  }
  spdlog::info("tandemd stopped");
  return td::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  // Block the termination signals in every thread; a dedicated thread takes them with sigwait.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  Logging logging;

  Options options;
  CLI::App app{"tandemd: the per-node tandem daemon. It owns the node's memory, communicators and fused-op "
               "executors, and serves libtandem clients over a Unix socket."};
  app.add_option("-c,--config", options.configPath, "YAML config file (see tandemd --print-default-config)");
  app.add_option("-s,--socket", options.socketPath, "control socket path (overrides daemon.socket)");
  app.add_option("--backend", options.backend, "auto | cpu | cuda (overrides daemon.backend)");
  app.add_option("--log-level", options.logLevel, "trace | debug | info | warn | error");
  app.add_option("--log-file", options.logFile,
                 "also log to this file (appended); a daemon that forks into the background logs only there "
                 "(without it, nowhere once it detaches). Under --systemd the journal is used instead");
  CLI::Option* nodeIndexOption = app.add_option("--node-index", options.nodeIndex,
                 "this node's 0-based position in cluster.nodes (overrides cluster.node_index; without the flag, "
                 "$TANDEM_NODE_INDEX is used when set). Lets every node share one config file")
      ->type_name("N");
  app.add_flag("-f,--foreground", options.foreground, "stay in the foreground (default: fork into the background "
                                                       "once serving)");
  app.add_flag("--systemd", options.systemd, "run under systemd: foreground, sd_notify READY=1/STOPPING=1");
  app.add_flag("--print-default-config", options.printDefaultConfig, "print the commented default config and exit");
  app.add_flag("-V,--version", options.version, "print the version and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : td::kExitConfig;
  }
  options.nodeIndexGiven = nodeIndexOption->count() > 0;
  if (options.version) {
    std::printf("tandemd %s (protocol %u)\n", TANDEM_VERSION_STRING, tandem::kProtocolVersion);
    return 0;
  }
  if (options.printDefaultConfig) {
    std::cout << td::defaultConfigYaml();
    return 0;
  }
  try {
    if (options.systemd) logging.toJournal();
    else if (!options.logFile.empty()) logging.alsoToFile(options.logFile);
    return run(options, logging);
  } catch (const tandem::Error& e) {
    spdlog::error("{}", e.what());
    switch (e.code()) {
      case tandem::ErrorCode::kInvalidConfig: return td::kExitConfig;
      case tandem::ErrorCode::kUnavailable:
      case tandem::ErrorCode::kCuda:
      case tandem::ErrorCode::kRdma: return td::kExitUnavailable;
      default: return td::kExitFailure;
    }
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return td::kExitFailure;
  }
}
