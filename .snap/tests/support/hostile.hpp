// What the hostile-client tests share: an honest client in its own process and the check that follows every attack
// (an honest gemm-ar in normal time, fds and RSS back near their baseline, SIGTERM obeyed). The /proc probes and
// the raw protocol are in daemon_probes.hpp (shared with the soak).
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "daemon_probes.hpp"
#include "gemm_args.hpp"
#include "harness.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/tandem.hpp"
#include "tandem/v1/control.pb.h"

#if TANDEM_HOSTILE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tandem::testing {
namespace hostile_detail {
namespace pb = tandem::v1;


// Short deadlines, so that the attacks end within the test's few seconds.
inline constexpr const char* kFastLimits =
    "limits:\n"
    "  hello_timeout_ms: 300\n"
    "  frame_timeout_ms: 300\n";

// The backend the attacks of the suite "hostile clients (any backend)" run against: cpu, or cuda when
// TANDEM_HOSTILE_BACKEND=cuda (`scripts/gpu-check.sh hostile`). The other cases are about the cpu backend or the
// control plane alone and always run a cpu tandemd.
inline std::string hostileBackend() {
  const char* b = std::getenv("TANDEM_HOSTILE_BACKEND");
  return b != nullptr && *b != '\0' ? b : "cpu";
}
inline bool onCuda() { return hostileBackend() == "cuda"; }

// The config a case's own keys follow: with the cuda backend, the client executor, whose 2 ranks may share the one
// GPU (the daemon executor, chosen under MPS, takes one rank per GPU).
inline std::string backendYaml() { return onCuda() ? "daemon:\n  executor: client\n" : ""; }

// A forked child that runs `body` and writes what it returns back through a pipe; killed and reaped by result()
// or the destructor. A wedged daemon cannot hang the test, and with the cuda backend every CUDA call happens in a
// child: the test process never initialises CUDA, which does not survive a fork into the next child.
class ChildRun {
 public:
  explicit ChildRun(const std::function<std::string()>& body) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(p[0]);
      std::string out;
      try {
        out = body();
      } catch (const std::exception& e) {
        out = std::string("threw: ") + e.what();
      }
      out += '\n';
      [[maybe_unused]] ssize_t w = ::write(p[1], out.data(), out.size());
      std::_Exit(0);
    }
    ::close(p[1]);
    fd_ = p[0];
  }
  ~ChildRun() { finish(); }
  ChildRun(const ChildRun&) = delete;
  ChildRun& operator=(const ChildRun&) = delete;

  // What the body returned (without the newline), or a text saying it did not answer within timeoutMs.
  std::string result(int timeoutMs) {
    std::string out;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (Clock::now() < deadline && out.find('\n') == std::string::npos) {
      pollfd pf{fd_, POLLIN, 0};
      if (::poll(&pf, 1, 20) <= 0) continue;
      char buf[512];
      const ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    finish();
    if (const auto nl = out.find('\n'); nl != std::string::npos) return out.substr(0, nl);
    return out.empty() ? fmt::format("no answer within {} ms (hung)", timeoutMs) : out;
  }

 private:
  void finish() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
};

// In a child about to use libtandem against a cuda tandemd: GPU 0 current. 0 on success.
inline int cudaSetDeviceZero() {
#if TANDEM_HOSTILE_CUDA
  return cudaSetDevice(0) == cudaSuccess ? 0 : -1;
#else
  return -1;
#endif
}

inline std::string inChild(const std::function<std::string()>& body, int timeoutMs = 20000) {
  return ChildRun(body).result(timeoutMs);
}

// cpu: one rank of a 2-rank fp32 gemm-ar on host memory, checked. "ok" or what went wrong.
inline std::string honestGemmArRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t r) {
  const uint64_t m = 8, n = 8, k = 16;
  ::tandem::Session s(socket.c_str());
  ::tandem::Communicator comm(s, id, 2, r, 5000);
  ::tandem::Buffer a(s, m * k * 4), b(s, n * k * 4), c(s, m * n * 4);
  for (uint64_t i = 0; i < m * k; ++i) a.as<float>()[i] = 1.0f;
  for (uint64_t i = 0; i < n * k; ++i) b.as<float>()[i] = static_cast<float>(r + 1);
  const auto args =
      gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_FP32, m, n, k, a.tensor(), b.tensor(), c.tensor(), nullptr);
  tandem_op_t op;
  ::tandem::check(tandem_gemm_ar(comm.get(), &args, &op));
  ::tandem::wait(op, 5000);
  // C = sum over ranks of k * (r + 1) = 16 * 1 + 16 * 2.
  for (uint64_t i = 0; i < m * n; ++i) {
    if (c.as<float>()[i] != 48.0f) return fmt::format("wrong result {} at {}", c.as<float>()[i], i);
  }
  return "ok";
}

// cuda: one rank of a 2-rank 64 KiB allgather on GPU 0's memory (the ranks share the GPU), every byte checked.
inline std::string honestAllGatherRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t r) {
#if TANDEM_HOSTILE_CUDA
  if (cudaSetDevice(0) != cudaSuccess) return "cudaSetDevice(0) failed: no GPU to run the cuda backend's honest op";
  const uint64_t bytes = 64 * 1024;
  auto pattern = [](uint32_t rank, uint64_t i) { return static_cast<unsigned char>(i * 7 + rank * 13 + 1); };
  ::tandem::Session s(socket.c_str());
  ::tandem::Communicator comm(s, id, 2, r, 5000);
  ::tandem::Buffer send(s, bytes), recv(s, 2 * bytes);
  std::vector<unsigned char> host(2 * bytes);
  for (uint64_t i = 0; i < bytes; ++i) host[i] = pattern(r, i);
  // The legacy default stream orders these copies with the op (cuda_stream NULL) and with each other.
  if (cudaMemcpy(send.data(), host.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemset(recv.data(), 0xCD, 2 * bytes) != cudaSuccess) {
    return "cudaMemcpy/cudaMemset into tandem_alloc memory failed";
  }
  tandem_allgather_args_t args{sizeof args, send.tensor(), recv.tensor(), bytes, nullptr};
  tandem_op_t op;
  ::tandem::check(tandem_allgather(comm.get(), &args, &op));
  ::tandem::wait(op, 5000);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(host.data(), recv.data(), 2 * bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return "the stream or the copy back failed after the allgather";
  }
  for (uint32_t q = 0; q < 2; ++q) {
    for (uint64_t i = 0; i < bytes; ++i) {
      if (host[q * bytes + i] != pattern(q, i)) {
        return fmt::format("wrong byte {:#x} at {} of rank {}'s shard", host[q * bytes + i], i, q);
      }
    }
  }
  return "ok";
#else
  (void)socket, (void)id, (void)r;
  return "this build has no CUDA (TANDEM_WITH_CUDA=OFF): build with CUDA to run the attacks against the cuda backend";
#endif
}

// An honest client: two ranks, each in its own process, run the backend's honest op (cpu: a 2-rank fp32 gemm-ar;
// cuda: a 2-rank allgather on GPU memory) and check it. Returns the milliseconds from the start to both checked
// results, or -1 (with `error` set) when it failed or did not finish within timeoutMs.
inline long honestOp(const std::string& socket, const std::string& backend, std::string* error = nullptr,
                     int timeoutMs = 10000) {
  const auto t0 = Clock::now();
  const tandem_unique_id_t id = ::tandem::uniqueId();
  auto rank = [&](uint32_t r) {
    return [&socket, &backend, id, r] {
      return backend == "cuda" ? honestAllGatherRank(socket, id, r) : honestGemmArRank(socket, id, r);
    };
  };
  ChildRun r0(rank(0)), r1(rank(1));
  const std::string a = r0.result(timeoutMs);
  const auto left = timeoutMs - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  const std::string b = r1.result(static_cast<int>(std::max<long>(1, left)));
  const long ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  if (a == "ok" && b == "ok") return ms;
  if (error != nullptr) *error = fmt::format("rank 0: {} / rank 1: {}", a, b);
  return -1;
}

// The cpu backend's honest op (what the control-plane cases and the cpu-only engine cases check with).
inline long honestGemmAr(const std::string& socket, std::string* error = nullptr, int timeoutMs = 10000) {
  return honestOp(socket, "cpu", error, timeoutMs);
}

// Whether this test, and so the tandemd of its build, runs under AddressSanitizer (TANDEM_SANITIZE builds all host
// code of the tree with it).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kUnderAsan = true;
#else
inline constexpr bool kUnderAsan = false;
#endif
#else
inline constexpr bool kUnderAsan = false;
#endif

// The argv prefix that starts tandemd with 64 open files at most (a hard limit it cannot raise). Under the
// sanitizers (TANDEM_SANITIZE turns on ASan and UBSan together) UBSan only reports in that daemon instead of
// halting it: UBSan's vptr check reads an object's vtable through a pipe(2) it opens to probe the memory, so in a
// process with no fd left a valid tandem::Error being thrown is reported as having an "invalid vptr", and
// halt_on_error would end the daemon for that false report. sanitizerReportsBesidesFalseVptr() then fails the test
// on any other report, so ASan and the rest of UBSan still count.
inline std::vector<std::string> lowFdPrefix() {
  std::vector<std::string> argv;
  if (kUnderAsan) {
    const char* ubsan = std::getenv("UBSAN_OPTIONS");
    const std::string options = ubsan != nullptr && *ubsan != '\0' ? std::string(ubsan) + ":" : std::string();
    // Without a stack trace: symbolizing one would load tandemd's debug info, tens of MiB the RSS check would count.
    argv = {"/usr/bin/env", "UBSAN_OPTIONS=" + options + "halt_on_error=0:print_stacktrace=0"};
  }
  argv.insert(argv.end(), {"/usr/bin/prlimit", "--nofile=64:64", "--"});
  return argv;
}

// The sanitizer reports in a low-fd daemon's log that are not UBSan's false "invalid vptr" (lowFdPrefix), one line
// each; empty when there are none.
inline std::string sanitizerReportsBesidesFalseVptr(const std::string& log) {
  std::string out;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    const bool ubsan = line.find("runtime error:") != std::string::npos;
    const bool falseVptr = ubsan && line.find("which does not point to an object of type") != std::string::npos;
    if ((ubsan && !falseVptr) || line.find("ERROR: AddressSanitizer") != std::string::npos ||
        line.find("ERROR: LeakSanitizer") != std::string::npos) {
      out += line + "\n";
    }
  }
  return out;
}

// The side of the fp32 GEMMs the cpu-worker cases keep the workers busy with: long enough (a good part of a second)
// that an honest op arrives while they run. ASan's build (Debug, instrumented) runs them tens of times slower.
inline constexpr uint64_t kBusyGemmDim = kUnderAsan ? 384 : 1024;

// How far above its baseline the daemon's RSS may stay once an attack is over, in KiB. glibc's malloc keeps some of
// what was freed (16 MiB of slack). ASan's allocator does not reuse freed blocks at once: it holds them in a
// quarantine of quarantine_size_mb (256 MiB unless ASAN_OPTIONS, which tandemd inherits from this test, says
// otherwise), each with its shadow (1/8 more), so under ASan that much more is no leak. A leak of what an attack
// allocates per request still shows once it is larger than the quarantine, so the tests give ASan a small one
// (tests/integration/CMakeLists.txt).
inline long rssSlackKiB() {
  constexpr long kMallocSlackKiB = 16 * 1024;
  if (!kUnderAsan) return kMallocSlackKiB;
  long quarantineMb = 256;
  const char* env = std::getenv("ASAN_OPTIONS");
  const std::string options = env != nullptr ? env : "";
  // The last setting wins, as in ASan's own parser.
  for (std::size_t at = options.find("quarantine_size_mb="); at != std::string::npos;
       at = options.find("quarantine_size_mb=", at + 1)) {
    quarantineMb = std::strtol(options.c_str() + at + std::strlen("quarantine_size_mb="), nullptr, 10);
  }
  return kMallocSlackKiB + quarantineMb * 1024 * 9 / 8;
}

// The daemon's state before an attack.
struct Baseline {
  int fds;
  long rssKiB;
  long honestMs;
  std::string backend;  // what the honest op runs on
};

inline Baseline baseline(Daemon& d, const std::string& backend = "cpu") {
  // A first op warms up whatever the daemon opens once (worker threads, lazily loaded state); the second is timed.
  std::string warmError;
  INFO("warm-up: " << warmError);
  REQUIRE(honestOp(d.socket(), backend, &warmError) >= 0);
  // The daemon is idle once the warm-up's sessions are gone: poll until the count stops falling.
  int idleFds = fdCount(d.pid());
  while (eventually([&] { return fdCount(d.pid()) < idleFds; }, 100)) idleFds = fdCount(d.pid());
  const std::string idleList = fdList(d.pid());
  std::string error;
  const long ms = honestOp(d.socket(), backend, &error);
  INFO(error);
  REQUIRE(ms >= 0);
  // The honest client's sessions close asynchronously: count once their fds are gone.
  INFO("idle fds:\n" << idleList);
  CHECK_MESSAGE(eventually([&] { return fdCount(d.pid()) <= idleFds; }, 3000), "now:\n" << fdList(d.pid()));
  return {fdCount(d.pid()), rssKiB(d.pid()), ms, backend};
}

// After an attack: an honest op in normal time, fds and RSS back near the baseline, SIGTERM obeyed.
inline void checkRecovered(Daemon& d, const Baseline& b, const std::string& attack) {
  std::string error;
  const long ms = honestOp(d.socket(), b.backend, &error);
  INFO("attack: " << attack << "; honest op (" << b.backend << "): " << error);
  CHECK(ms >= 0);
  // Its normal time: the baseline's, with room for a loaded machine (and 2 s at least).
  CHECK(ms < std::max<long>(2000, 3 * b.honestMs));
  // The honest session leaves too; allow a couple of fds for lazily opened things (the journal, /proc reads).
  CHECK(eventually([&] { return fdCount(d.pid()) <= b.fds + 2; }, 3000));
  const long rss = rssKiB(d.pid());
  CHECK(rss <= b.rssKiB + rssSlackKiB());
  MESSAGE(attack << " (" << b.backend << "): honest op " << b.honestMs << " ms before, " << ms
                 << " ms after; daemon fds " << b.fds << " -> " << fdCount(d.pid()) << ", RSS " << b.rssKiB
                 << " -> " << rss << " KiB (slack " << rssSlackKiB() << " KiB)");
  CHECK(!d.exited());
  d.signal(SIGTERM);
  // The cuda backend releases its contexts and GPU memory on the way out.
  CHECK(d.waitExit(b.backend == "cuda" ? 15000 : 5000) == 0);
}

}  // namespace hostile_detail
using namespace hostile_detail;
}  // namespace tandem::testing
