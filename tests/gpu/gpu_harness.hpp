// Shared by the GPU test files: forked rank processes that talk to the test over pipes, the daemon config and status,
// stream waits with deadlines, and the gated rank of the failure cases. Every rank is a forked child: the test process
// itself never initialises CUDA (CUDA does not survive a fork).
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "gemm_args.hpp"
#include "harness.hpp"
#include "skip.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/tandem.h"

namespace tandem::gputest {

using namespace tandem::testing;
using json = nlohmann::json;

inline int gpuCount() { return std::atoi(std::getenv("TANDEM_TEST_GPU_COUNT")); }

// Ranks take the GPUs round robin: with fewer GPUs than ranks they share one, which checks every multi-rank protocol
// on a single GPU (the processes time-slice it, or run side by side under MPS); only speed needs one GPU per rank.
inline int rankDevice(uint32_t rank) { return static_cast<int>(rank % static_cast<uint32_t>(gpuCount())); }
// The ranks a test can run with `executor`: the daemon executor runs one rank per GPU (one persistent kernel per GPU
// runs ops in order; tandemd refuses two ranks on one GPU), so it gets at most one per GPU.
inline uint32_t ranksFor(const std::string& executor, uint32_t want) {
  return executor == "daemon" ? std::min(want, static_cast<uint32_t>(gpuCount())) : want;
}

inline bool mpsRunning() {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = (env != nullptr && *env != '\0') ? env : "/tmp/nvidia-mps";
  struct stat st{};
  return ::stat((dir + "/control").c_str(), &st) == 0;
}

// The preconditions about MPS, for the cases of the suites kNeedsMps and kNeedsNoMps: each returns true, having
// recorded the case as skipped with the reason, when the case must not run here (`if (skipWithoutMps()) return;`).
inline bool skipWithoutMps() {
  if (mpsRunning()) return false;
  skipCase("MPS is not running (the daemon executor needs it; start it with nvidia-cuda-mps-control -d)");
  return true;
}
inline bool skipUnderMps(const char* why = "a kill mid-kernel under MPS poisons the MPS server") {
  if (!mpsRunning()) return false;
  skipCase(std::string("MPS is running (") + why + "; run this case without MPS)");
  return true;
}

// The plan table directory of every daemon this test process starts, empty unless a case fills it (removed at exit):
// a daemon that read the host's table (/var/lib/tandem as root, else ~/.local/state/tandem) would run the plans tuned
// there instead of the built-in rules the cases expect.
inline std::string processPlanDir() {
  static const TempDir dir;
  return dir.path().string();
}

// A GPU test daemon's config; planDir: its plans.state_dir (a case that forces plans passes a directory of its own
// holding a plans.json). The cuda section comes last: cases append keys of theirs to it.
inline std::string config(const std::string& executor, const std::string& planDir = processPlanDir()) {
  return "daemon:\n  backend: cuda\n  executor: " + executor + "\nplans:\n  state_dir: " + planDir +
         "\ncuda:\n  daemon_linger_ms: 500\n";
}

inline json status(const Daemon& d) { return daemonStatus(d); }

// A forked rank: reads lines from the parent (`tell`) and writes its report lines back (`read`). Killed and
// reaped when it goes out of scope (a failed REQUIRE must not leave a rank holding the GPU or ctest's pipes).
struct Rank {
  Rank() = default;
  Rank(Rank&& o) noexcept
      : pid(std::exchange(o.pid, -1)), fromChild(std::exchange(o.fromChild, -1)), toChild(std::exchange(o.toChild, -1)),
        buffered(std::move(o.buffered)) {}
  Rank& operator=(Rank&&) = delete;
  ~Rank() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      reap();
    }
  }
  pid_t pid = -1;
  int fromChild = -1, toChild = -1;
  std::string buffered;
  std::string read(int timeoutMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (buffered.find('\n') == std::string::npos && Clock::now() < deadline) {
      pollfd p{fromChild, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fromChild, buf, sizeof buf);
      if (n <= 0) break;
      buffered.append(buf, static_cast<size_t>(n));
    }
    const auto nl = buffered.find('\n');
    if (nl == std::string::npos) return "(no report: " + buffered + ")";
    std::string line = buffered.substr(0, nl);
    buffered.erase(0, nl + 1);
    return line;
  }
  void tell(const std::string& s) { [[maybe_unused]] ssize_t n = ::write(toChild, (s + "\n").data(), s.size() + 1); }
  void kill() { ::kill(pid, SIGKILL); }
  int reap() {
    if (pid <= 0) return 0;
    ::close(fromChild);
    ::close(toChild);
    int st = 0;
    ::waitpid(pid, &st, 0);
    pid = -1;
    return st;
  }
};

struct Io {
  int in, out;
  void say(const std::string& s) const { [[maybe_unused]] ssize_t n = ::write(out, (s + "\n").data(), s.size() + 1); }
  std::string hear() const {
    std::string line;
    char c;
    while (::read(in, &c, 1) == 1 && c != '\n') line += c;
    return line;
  }
};

inline Rank spawn(const std::function<std::string(const Io&)>& body) {
  int up[2], down[2];
  REQUIRE(::pipe(up) == 0);
  REQUIRE(::pipe(down) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test process
    ::close(up[0]);
    ::close(down[1]);
    Io io{down[0], up[1]};
    std::string result;
    try {
      result = body(io);
    } catch (const std::exception& e) {
      result = std::string("FAIL exception: ") + e.what();
    }
    // One line: the parent reads the result up to its first newline, so a multi-line report keeps its other lines.
    for (size_t at = result.find('\n'); at != std::string::npos; at = result.find('\n', at + 3)) {
      result.replace(at, 1, " | ");
    }
    io.say(result);
    std::_Exit(0);
  }
  ::close(up[1]);
  ::close(down[0]);
  Rank r;
  r.pid = pid;
  r.fromChild = up[0];
  r.toChild = down[1];
  return r;
}

#define CK(call)                                                                                 \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)
#define TK(call)                                                                                                 \
  do {                                                                                                           \
    const tandem_status_t s_ = (call);                                                                           \
    if (s_ != TANDEM_SUCCESS) throw std::runtime_error(std::string(#call) + ": " + tandem_last_error());         \
  } while (0)

// Waits for the stream with a deadline. Returns "synced", "error <text>" or "hung".
inline std::string syncWithin(cudaStream_t s, int ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return "synced";
    if (e != cudaErrorNotReady) return std::string("error ") + cudaGetErrorString(e);
    if (Clock::now() > deadline) return "hung";
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Sets an environment variable for a scope (the daemon and the ranks forked in it inherit it), then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// What the gated rank of the failure cases submits: an AllGather of 64 MiB, or a fused GEMM of 2048 x 2048 x 2048
// (gemm-ar: 1024 of K on each rank), enough work that a peer killed or gated mid-op finds its kernel running.
enum class GatedOp { kAllGather, kAgGemm, kGemmAr, kBarrier };

// Rank of 2 for the failure cases: joins, allocates, optionally gates its stream on a host flag, submits one op,
// reports "submitted", then follows the parent's orders ("release" the gate; "sync": report "<stream> <status>
// <message>" and end).
inline std::string gatedRank(const Io& io, const std::string& socket, const tandem_unique_id_t& id, uint32_t rank,
                             bool gate, GatedOp what = GatedOp::kAllGather) {
  CK(cudaSetDevice(rankDevice(rank)));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, 2, rank, 60000, &comm));
  constexpr uint64_t S = 64u << 20, M = 2048, N = 2048, K = 2048;
  tandem_buffer_t a, b, c;  // allgather: send, recv
  if (what == GatedOp::kAllGather) {
    TK(tandem_alloc(s, S, &a));
    TK(tandem_alloc(s, 2 * S, &b));
  } else {
    // Contents are whatever the allocation held: these ops are never checked.
    TK(tandem_alloc(s, M * K * 2, &a));
    TK(tandem_alloc(s, N * K * 2, &b));
    TK(tandem_alloc(s, M * N * 2, &c));
  }
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint32_t* flag = nullptr;
  if (gate) {
    CK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    *flag = 0;
    const CUresult r = tandem::kernels::driver().streamWaitValue32(
        stream, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) return "FAIL gate";
  }
  tandem_op_t op;
  switch (what) {
    case GatedOp::kAllGather: {
      const tandem_allgather_args_t args{sizeof args, {a, 0}, {b, 0}, S, stream};
      TK(tandem_allgather(comm, &args, &op));
      break;
    }
    case GatedOp::kAgGemm: {
      const auto args = agGemmArgs(TANDEM_DTYPE_BF16, M, N, K, {a, 0}, {b, 0}, {c, 0}, {nullptr, 0}, stream);
      TK(tandem_ag_gemm(comm, &args, &op));
      break;
    }
    case GatedOp::kBarrier: {
      const tandem_barrier_args_t args{sizeof args, stream};
      TK(tandem_barrier_stream(comm, &args, &op));
      break;
    }
    case GatedOp::kGemmAr: {
      const auto args = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_BF16, M, N, K / 2, {a, 0}, {b, 0}, {c, 0}, stream);
      TK(tandem_gemm_ar(comm, &args, &op));
      break;
    }
  }
  io.say("submitted");
  for (;;) {
    const std::string order = io.hear();
    if (order == "release") {
      std::atomic_ref<uint32_t>(*flag).store(1);
    } else if (order == "poll") {
      io.say(cudaStreamQuery(stream) == cudaErrorNotReady ? "running" : "finished");
    } else if (order == "sync") {
      const std::string synced = syncWithin(stream, 10000);
      const tandem_status_t st = tandem_wait(op, 10000);
      return fmt::format("{} {} {}", synced, static_cast<int>(st), tandem_last_error());
    } else {
      return "FAIL order '" + order + "'";
    }
  }
}

// Both ranks of a failure case have submitted; the victim is SIGKILLed 300 ms later. The survivor's stream must come
// back (synced) with PEER_LOST or ABORTED. `releaseSurvivor`: its stream was gated, so it is released after the kill.
inline void expectStreamReleasedAfterKill(Rank& survivor, Rank& victim, bool releaseSurvivor,
                                          const std::function<std::string()>& logs) {
  REQUIRE(survivor.read(60000) == "submitted");
  REQUIRE(victim.read(60000) == "submitted");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  victim.kill();
  victim.reap();
  if (releaseSurvivor) survivor.tell("release");
  survivor.tell("sync");
  const std::string result = survivor.read(30000);
  INFO(result);
  INFO(logs());
  CHECK(result.rfind("synced ", 0) == 0);
  CHECK((result.find(" " + std::to_string(TANDEM_ERROR_PEER_LOST) + " ") != std::string::npos ||
         result.find(" " + std::to_string(TANDEM_ERROR_ABORTED) + " ") != std::string::npos));
  survivor.reap();
}

}  // namespace tandem::gputest
