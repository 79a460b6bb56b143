// span_bench: the fused GEMMs across two "nodes" against the same op on one node, with the bytes between the nodes
// issued by the GPUs (cluster.gpu_exchange: on) and moved by tandemd's link thread through host memory (off), in the
// same run. Each path: two private tandemds form a two-node cluster over tcp on loopback (127.0.0.1 and 127.0.0.2), one
// rank each (both on GPU 0 where only one GPU exists: they share it); a fifth private tandemd serves the one-node
// baseline, one rank with the whole op. Backend cuda, executor client. Every rank process times each op with
// steady_clock from submission to its stream synchronised and the op waited for, and reports the median of --iters
// (after --warmup). --paths picks the paths (gpu,staged).
//
//   span_bench [--tandemd PATH] [--iters 20] [--warmup 3] [--ms 1024,4096] [--nk 8192] [--ops ag-gemm,gemm-rs,gemm-ar]
//              [--dtype bf16|fp16] [--paths gpu,staged]
//
// Work per op: at one rank on one node, one GEMM M x N x K. Across two nodes, ag-gemm computes the whole C on every
// rank (two GEMMs of M x N x K on the shared GPU) and moves M/2 x K of A each way; gemm-rs and gemm-ar compute a
// partial M x N x K/2 per rank and move M/2 x N (rs) or M x N (ar) fp32 each way through tcp on loopback.
// Exits 2 when a daemon or rank fails.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "private_daemon.hpp"
#include "tandem/tandem.h"

namespace {

using Clock = std::chrono::steady_clock;

uint64_t rowsOf(uint64_t total, uint32_t r, uint32_t n) { return total / n + (r < total % n ? 1 : 0); }

std::vector<uint64_t> parseList(const std::string& s) {
  std::vector<uint64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoull(item));
  return out;
}
std::vector<std::string> parseNames(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

struct Job {
  std::string op;
  uint64_t m, n, k;
  tandem_dtype_t dtype;
  int iters, warmup;
};

#define RANK_CHECK(cond, ...)            \
  do {                                   \
    if (!(cond)) {                       \
      std::fprintf(stderr, __VA_ARGS__); \
      std::fprintf(stderr, "\n");        \
      return 2;                          \
    }                                    \
  } while (0)

// Values in [-1, 1) as bf16 or fp16 bits, from a xorshift (cheap: B is N x K = 64 Mi values at the largest shape).
std::vector<uint16_t> randomHalf(std::size_t count, tandem_dtype_t dtype, uint32_t seed) {
  std::vector<uint16_t> out(count);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const float f = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (dtype == TANDEM_DTYPE_BF16) {
      v = static_cast<uint16_t>(bits >> 16);  // truncated: the values need not be exact
    } else {  // fp16 of |f| < 1: exponent and 10 mantissa bits, truncated
      const uint32_t sign = (bits >> 16) & 0x8000u;
      const int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
      v = exp <= 0 ? static_cast<uint16_t>(sign)
                   : static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((bits >> 13) & 0x3ffu));
    }
  }
  return out;
}

// One rank's life: joins the communicator of `n` ranks through `socket`, runs every job in turn, and (rank 0) writes
// one line per job to `resultPath`: median, min and max milliseconds.
int rankMain(uint32_t rank, uint32_t n, int up, int down, const std::string& socket, const std::vector<Job>& jobs,
             const std::string& resultPath) {
  int gpus = 0;
  RANK_CHECK(cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0, "rank %u: no CUDA device", rank);
  RANK_CHECK(cudaSetDevice(static_cast<int>(rank) % gpus) == cudaSuccess, "cudaSetDevice failed");
  tandem_session_t s;
  RANK_CHECK(tandem_connect(socket.c_str(), &s) == TANDEM_SUCCESS, "connect: %s", tandem_last_error());
  tandem_unique_id_t id;
  if (rank == 0) {
    RANK_CHECK(tandem_get_unique_id(&id) == TANDEM_SUCCESS, "unique id: %s", tandem_last_error());
    tandem::bench::writeAll(up, &id, sizeof id);
  }
  tandem::bench::readAll(down, &id, sizeof id);
  tandem_comm_t comm;
  RANK_CHECK(tandem_comm_init(s, &id, n, rank, 60000, &comm) == TANDEM_SUCCESS, "comm init: %s", tandem_last_error());
  cudaStream_t stream;
  RANK_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
  std::ofstream result;
  if (rank == 0) result.open(resultPath);

  for (const Job& job : jobs) {
    const bool ag = job.op == "ag-gemm";
    const uint64_t aRows = ag ? rowsOf(job.m, rank, n) : job.m, kk = ag ? job.k : rowsOf(job.k, rank, n);
    const uint64_t cRows = job.op == "gemm-rs" ? rowsOf(job.m, rank, n) : job.m;
    tandem_buffer_t a, b, c;
    RANK_CHECK(tandem_alloc(s, std::max<uint64_t>(aRows * kk * 2, 16), &a) == TANDEM_SUCCESS, "alloc A: %s",
               tandem_last_error());
    RANK_CHECK(tandem_alloc(s, job.n * kk * 2, &b) == TANDEM_SUCCESS, "alloc B: %s", tandem_last_error());
    RANK_CHECK(tandem_alloc(s, cRows * job.n * 2, &c) == TANDEM_SUCCESS, "alloc C: %s", tandem_last_error());
    const auto hostA = randomHalf(aRows * kk, job.dtype, 17 + rank);
    const auto hostB = randomHalf(job.n * kk, job.dtype, 91 + rank);
    RANK_CHECK(cudaMemcpy(tandem_buffer_ptr(a), hostA.data(), hostA.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess,
               "upload A");
    RANK_CHECK(cudaMemcpy(tandem_buffer_ptr(b), hostB.data(), hostB.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess,
               "upload B");
    RANK_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    std::vector<double> ms;
    for (int i = 0; i < job.warmup + job.iters; ++i) {
      tandem_op_t op;
      tandem_status_t st;
      const auto t0 = Clock::now();
      // Named fields: the later ones (layout, FP8) stay at their zero defaults.
      if (ag) {
        tandem_ag_gemm_args_t args{};
        args.struct_size = sizeof args;
        args.dtype = job.dtype;
        args.m = job.m, args.n = job.n, args.k = job.k;
        args.a = {a, 0}, args.b = {b, 0}, args.c = {c, 0};
        args.cuda_stream = stream;
        st = tandem_ag_gemm(comm, &args, &op);
      } else if (job.op == "gemm-rs") {
        tandem_gemm_rs_args_t args{};
        args.struct_size = sizeof args;
        args.dtype = job.dtype;
        args.m = job.m, args.n = job.n, args.k = kk;
        args.a = {a, 0}, args.b = {b, 0}, args.c = {c, 0};
        args.cuda_stream = stream;
        st = tandem_gemm_rs(comm, &args, &op);
      } else {
        tandem_gemm_ar_args_t args{};
        args.struct_size = sizeof args;
        args.dtype = job.dtype;
        args.m = job.m, args.n = job.n, args.k = kk;
        args.a = {a, 0}, args.b = {b, 0}, args.c = {c, 0};
        args.cuda_stream = stream;
        st = tandem_gemm_ar(comm, &args, &op);
      }
      RANK_CHECK(st == TANDEM_SUCCESS, "%s submit: %s", job.op.c_str(), tandem_last_error());
      RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "stream sync");
      RANK_CHECK(tandem_wait(op, 120000) == TANDEM_SUCCESS, "%s: %s", job.op.c_str(), tandem_last_error());
      const double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (i >= job.warmup) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    if (rank == 0) {
      result << ms[ms.size() / 2] << " " << ms.front() << " " << ms.back() << std::endl;
      // As it comes, for a run cut short.
      std::printf("  %s, %u rank(s): %s M=%llu: median %.3f ms (min %.3f, max %.3f)\n", n == 1 ? "one node" : "two nodes",
                  n, job.op.c_str(), static_cast<unsigned long long>(job.m), ms[ms.size() / 2], ms.front(), ms.back());
      std::fflush(stdout);
    }
    tandem_free(a);
    tandem_free(b);
    tandem_free(c);
  }
  tandem_comm_destroy(comm);
  tandem_disconnect(s);
  return 0;
}

// printf into a std::string.
__attribute__((format(printf, 1, 2))) std::string fmt(const char* format, ...) {
  char buf[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof buf, format, args);
  va_end(args);
  return buf;
}

struct Timing {
  double median = -1, min = -1, max = -1;
};

// Runs `jobs` with one rank per socket; rank 0's times, one per job (median -1: none came back).
std::vector<Timing> run(const std::vector<std::string>& sockets, const std::vector<Job>& jobs) {
  const std::string resultPath = "/tmp/span-bench-" + std::to_string(::getpid()) + ".txt";
  std::remove(resultPath.c_str());
  const auto n = static_cast<uint32_t>(sockets.size());
  tandem::bench::RankProcesses ranks(n, [&](uint32_t r, int up, int down) {
    return rankMain(r, n, up, down, sockets[r], jobs, resultPath);
  });
  std::vector<Timing> out(jobs.size());
  if (ranks.relay(sizeof(tandem_unique_id_t))) ranks.wait();
  std::ifstream in(resultPath);
  for (Timing& t : out) {
    if (!(in >> t.median >> t.min >> t.max)) break;
  }
  std::remove(resultPath.c_str());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"span_bench: fused GEMMs across two tandemd nodes (tcp loopback) vs one node"};
  std::string tandemd = TANDEMD_PATH, msList = "1024,4096", opsList = "ag-gemm,gemm-rs,gemm-ar", dtypeName = "bf16";
  std::string pathsList = "gpu,staged";
  uint64_t nk = 8192;
  int iters = 20, warmup = 3;
  app.add_option("--tandemd", tandemd, "tandemd binary");
  app.add_option("--iters", iters, "timed runs per op (median reported)");
  app.add_option("--warmup", warmup, "untimed runs first");
  app.add_option("--ms", msList, "M values, comma separated");
  app.add_option("--nk", nk, "N = K");
  app.add_option("--ops", opsList, "ops, comma separated");
  app.add_option("--dtype", dtypeName, "bf16 or fp16");
  app.add_option("--paths", pathsList, "exchange paths across nodes, comma separated: gpu (cluster.gpu_exchange on), "
                                       "staged (off)");
  CLI11_PARSE(app, argc, argv);
  const tandem_dtype_t dtype = dtypeName == "fp16" ? TANDEM_DTYPE_FP16 : TANDEM_DTYPE_BF16;
  std::vector<std::string> paths;
  for (const std::string& p : parseNames(pathsList)) {
    if (p != "gpu" && p != "staged") {
      std::fprintf(stderr, "--paths: '%s' is neither gpu nor staged\n", p.c_str());
      return 2;
    }
    paths.push_back(p);
  }

  // staging_bytes: gemm-ar sends M x N fp32 to the peer (and the GPU exchange keeps the node sum in its send area);
  // workspace_bytes: gemm-ar's partial, node sum, running sum and receive slot at the largest M (bytes per rank,
  // rounded up).
  uint64_t maxM = 0;
  for (uint64_t m : parseList(msList)) maxM = std::max(maxM, m);
  const uint64_t f32 = maxM * nk * 4, staging = f32 + (1u << 20), workspace = (f32 * 3 + maxM * nk * 2) + (64u << 20);
  const int port = 21000 + static_cast<int>(::getpid() % 8000);
  // clusters[i]: the two nodes of paths[i] (each on its own port).
  std::vector<std::vector<std::unique_ptr<tandem::bench::PrivateDaemon>>> clusters;
  std::unique_ptr<tandem::bench::PrivateDaemon> single;
  try {
    for (std::size_t p = 0; p < paths.size(); ++p) {
      clusters.emplace_back();
      const std::string portText = std::to_string(port + static_cast<int>(p));
      for (int i = 0; i < 2; ++i) {
        const std::string config =
            "daemon:\n  backend: cuda\n  executor: client\n"
            "cuda:\n  workspace_bytes: " + std::to_string(workspace) + "\n"
            "cluster:\n  nodes: [\"127.0.0.1:" + portText + "\", \"127.0.0.2:" + portText + "\"]\n"
            "  node_index: " + std::to_string(i) + "\n  secret: \"span-bench-secret-0123456789abcdef\"\n"
            "  connect_timeout_ms: 15000\n  staging_bytes: " + std::to_string(staging) + "\n"
            "  gpu_exchange: " + (paths[p] == "gpu" ? "on" : "off") + "\n";
        clusters.back().push_back(std::make_unique<tandem::bench::PrivateDaemon>(tandemd, config));
      }
    }
    single = std::make_unique<tandem::bench::PrivateDaemon>(
        tandemd, "daemon:\n  backend: cuda\n  executor: client\ncuda:\n  workspace_bytes: " + std::to_string(workspace) +
                     "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::printf("span_bench: %s, N = K = %llu, median of %d (after %d warm-up), ms per op (steady_clock, submit to "
              "stream synced and op waited)\n", dtypeName.c_str(), static_cast<unsigned long long>(nk), iters, warmup);
  std::vector<Job> jobs;
  for (const std::string& op : parseNames(opsList)) {
    for (uint64_t m : parseList(msList)) jobs.push_back({op, m, nk, nk, dtype, iters, warmup});
  }
  std::fflush(stdout);
  // Two nodes first, each path in turn: for a run cut short, the new path's numbers.
  std::vector<std::vector<Timing>> two;
  for (std::size_t p = 0; p < paths.size(); ++p) {
    std::printf("two nodes, %s exchange:\n", paths[p] == "gpu" ? "GPU-issued" : "staged (host)");
    std::fflush(stdout);
    two.push_back(run({clusters[p][0]->socket(), clusters[p][1]->socket()}, jobs));
  }
  const std::vector<Timing> one = run({single->socket()}, jobs);
  std::string header = "| op | M | one node, 1 rank |", rule = "|---|---|---|";
  for (const std::string& p : paths) {
    header += fmt(" two nodes, %s (min..max) | / one node |", p == "gpu" ? "GPU-issued" : "staged");
    rule += "---|---|";
  }
  if (paths.size() == 2) {
    header += " GPU-issued / staged |";
    rule += "---|";
  }
  std::printf("%s\n%s\n", header.c_str(), rule.c_str());
  int rc = 0;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    std::string row = fmt("| %s | %llu | %.3f |", jobs[i].op.c_str(), static_cast<unsigned long long>(jobs[i].m),
                          one[i].median);
    if (one[i].median < 0) rc = 2;
    for (std::size_t p = 0; p < paths.size(); ++p) {
      const Timing& t = two[p][i];
      if (t.median < 0) rc = 2;
      row += fmt(" %.3f (%.3f..%.3f) | %.2fx |", t.median, t.min, t.max, one[i].median > 0 ? t.median / one[i].median : 0.0);
    }
    if (paths.size() == 2) row += fmt(" %.2fx |", two[1][i].median > 0 ? two[0][i].median / two[1][i].median : 0.0);
    std::printf("%s\n", row.c_str());
  }
  // The plan lines: which path each op took across the nodes.
  for (std::size_t p = 0; p < paths.size(); ++p) {
    std::istringstream log(clusters[p][0]->log());
    for (std::string line; std::getline(log, line);) {
      if (line.find(": plan ") != std::string::npos) std::printf("%s, node 0: %s\n", paths[p].c_str(), line.c_str());
    }
  }
  return rc;
}
