// Round trip of an empty op on the cuda backend: tandem_barrier_stream on the rank's stream, from the submit
// call until cudaStreamSynchronize returns (the client's stream completed it), p50 and p99, per executor.
//
//   roundtrip_bench [--executor client|daemon] [--ranks 1|2] [--iters 5000] [--warmup 500] [--socket PATH]
//
// Forks one process per rank (GPU r mod the GPU count) and starts its own tandemd with the executor (unless
// --socket). Rank 0 reports. For scale it also times the same loop with no tandem op (a bare cudaStreamSynchronize after a
// cudaEventRecord), which is the floor any stream-ordered op pays. With TANDEM_TRACE_OPS=1 (inherited by the private
// tandemd) it also prints the daemon's breakdown of each op's time (arrival -> release -> done seen).
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "private_daemon.hpp"
#include "tandem/tandem.h"

#include "checks.hpp"  // after the library headers: it defines TK/NK/BK for those it finds

namespace {

using Clock = std::chrono::steady_clock;


struct Options {
  std::string executor = "client";
  uint32_t ranks = 1;
  int iters = 5000, warmup = 500;
  std::string socket;
};

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

int rankMain(const Options& o, uint32_t rank, int idFd, const std::string& socket) {
  int devices = 0;
  CK(cudaGetDeviceCount(&devices));
  // Ranks take the GPUs round robin: with fewer GPUs than ranks they share one (time-sliced, or side by side under MPS).
  CK(cudaSetDevice(static_cast<int>(rank % static_cast<uint32_t>(devices))));
  CK(cudaFree(nullptr));
  tandem_unique_id_t id;
  if (::read(idFd, &id, sizeof id) != sizeof id) return 3;
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, o.ranks, rank, 60000, &comm));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  std::vector<double> us, floorUs;
  tandem_op_t op;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const auto t0 = Clock::now();
    const tandem_barrier_args_t barrierArgs{sizeof barrierArgs, stream};
    TK(tandem_barrier_stream(comm, &barrierArgs, &op));
    CK(cudaStreamSynchronize(stream));
    const auto t1 = Clock::now();
    if (i >= o.warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    // The floor: an empty stream round trip.
    const auto f0 = Clock::now();
    CK(cudaEventRecord(ev, stream));
    CK(cudaStreamSynchronize(stream));
    if (i >= o.warmup) floorUs.push_back(std::chrono::duration<double, std::micro>(Clock::now() - f0).count());
  }
  if (tandem_wait(op, 10000) != TANDEM_SUCCESS) {
    std::fprintf(stderr, "rank %u: last op failed: %s\n", rank, tandem_last_error());
    return 1;
  }
  if (rank == 0) {
    std::printf("roundtrip_bench: executor %s, %u rank(s), %d iterations: empty op submit -> stream done  p50 %.2f us  "
                "p99 %.2f us  (bare stream sync p50 %.2f us, p99 %.2f us)\n",
                o.executor.c_str(), o.ranks, o.iters, percentile(us, 0.5), percentile(us, 0.99),
                percentile(floorUs, 0.5), percentile(floorUs, 0.99));
    std::fflush(stdout);  // the rank process leaves with _Exit, which does not flush
  }
  tandem_comm_destroy(comm);
  tandem_disconnect(s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--executor") o.executor = next();
    else if (a == "--ranks") o.ranks = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--socket") o.socket = next();
    else {
      std::fprintf(stderr, "usage: roundtrip_bench [--executor client|daemon] [--ranks N] [--iters N] [--warmup N] "
                           "[--socket PATH]\n");
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<tandem::bench::PrivateDaemon> daemon;
  const std::string socket = tandem::bench::useDaemon(
      o.socket, TANDEMD_PATH, "daemon:\n  backend: cuda\n  executor: " + o.executor + "\n", daemon);
  if (socket.empty()) return 2;
  tandem_unique_id_t id;
  if (tandem_get_unique_id(&id) != TANDEM_SUCCESS) return 2;
  std::vector<pid_t> pids;
  for (uint32_t r = 0; r < o.ranks; ++r) {
    int p[2];
    if (::pipe(p) != 0) return 2;
    [[maybe_unused]] ssize_t w = ::write(p[1], &id, sizeof id);
    const pid_t pid = ::fork();
    if (pid == 0) std::_Exit(rankMain(o, r, p[0], socket));
    ::close(p[0]);
    ::close(p[1]);
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  if (daemon && std::getenv("TANDEM_TRACE_OPS") != nullptr) {  // the private tandemd's trace lines (cuda_backend.cpp)
    std::istringstream log(daemon->log());
    for (std::string line; std::getline(log, line);) {
      if (line.find("trace:") != std::string::npos) std::printf("tandemd %s\n", line.c_str());
    }
  }
  return rc;
}
