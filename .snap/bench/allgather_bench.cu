// AllGather bus bandwidth: tandem (client or daemon executor, push and pull) against ncclAllGather on the same
// GPUs, in the same processes, on the same buffers, interleaved per size.
//
//   allgather_bench [--ranks N] [--executor client|daemon] [--iters 20] [--warmup 5] [--min 65536]
//                   [--max 1073741824] [--json FILE] [--socket PATH]
//
// One forked process per rank (GPU r). The parent starts its own tandemd (unless --socket) and relays NCCL's
// unique id. Buffers rotate through a 1 GiB send pool (and n GiB receive pool) so small sizes do not run from L2.
// Inputs are random; each method is checked bitwise on device after timing (exit 1 on any mismatch).
// Timing: CUDA events around each op, median of --iters after --warmup. Bus bandwidth = (n-1) * bytes / time.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef TANDEM_HAVE_NCCL
#include <nccl.h>
#endif

#include "bench_kernels.cuh"
#include "private_daemon.hpp"
#include "tandem/tandem.h"

#include "checks.hpp"  // after the library headers: it defines TK/NK/BK for those it finds

namespace {

// A different word for every (index, seed): what each rank sends, and what the check expects to have arrived.
__device__ __forceinline__ uint32_t hashWord(uint64_t i, uint32_t seed) {
  return static_cast<uint32_t>(tandem::bench::mix(i * 0x9E3779B97F4A7C15ull + seed));
}
__global__ void fillKernel(uint32_t* p, uint64_t words, uint32_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words; i += uint64_t{gridDim.x} * blockDim.x)
    p[i] = hashWord(i, seed);
}
// Counts words of recv[q] that differ from rank q's fill (seed q).
__global__ void checkKernel(const uint32_t* recv, uint64_t wordsPerRank, uint32_t nranks, uint32_t seedBase,
                            unsigned long long* bad) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < wordsPerRank * nranks;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t q = static_cast<uint32_t>(i / wordsPerRank);
    if (recv[i] != hashWord(i % wordsPerRank, seedBase + q)) ++local;
  }
  if (local != 0) atomicAdd(bad, local);
}

struct Options {
  uint32_t ranks = 2;
  std::string executor = "client";
  int iters = 20, warmup = 5;
  uint64_t minBytes = 64u << 10, maxBytes = uint64_t{1} << 30;
  std::string json, socket;
};

// A method: tandem with its tuning overrides (allgather.hpp: allgatherTuning; every TANDEM_AG_* variable not named is
// unset), or NCCL. The overrides are read by whoever launches the kernel: this process with the client executor (with
// the daemon executor they change nothing, and every tandem row runs tandemd's default).
struct Method {
  const char* name;
  const char* env;  // "NAME=value NAME=value"
  bool nccl;
};
const Method kMethods[] = {
    {"tandem", "", false},  // the library's default configuration
    {"tandem-noLL", "TANDEM_AG_LL_MAX=0", false},
    {"tandem-push64x64K", "TANDEM_AG_LL_MAX=0 TANDEM_AG_CTAS=64 TANDEM_AG_CHUNK=65536", false},
    {"tandem-push64x16K", "TANDEM_AG_LL_MAX=0 TANDEM_AG_CTAS=64 TANDEM_AG_CHUNK=16384", false},
    {"tandem-push64", "TANDEM_AG_CTAS=64", false},
#ifdef TANDEM_HAVE_NCCL
    {"nccl", "", true},
#endif
};
constexpr int kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);

void applyTuning(const Method& m) {
  for (const char* v : {"TANDEM_AG_MODE", "TANDEM_AG_CTAS", "TANDEM_AG_CHUNK", "TANDEM_AG_LL_MAX"}) ::unsetenv(v);
  std::istringstream in(m.env);
  for (std::string kv; in >> kv;) {
    const auto eq = kv.find('=');
    ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
}

using tandem::bench::readAll;
using tandem::bench::writeAll;

// One rank. Rank 0 prints the table. Returns the process exit code.
int rankMain(const Options& o, uint32_t rank, int up, int down, const std::string& socket) {
  CK(cudaSetDevice(static_cast<int>(rank)));
  CK(cudaFree(nullptr));
#ifdef TANDEM_HAVE_NCCL
  ncclUniqueId ncclId;
  if (rank == 0) {
    NK(ncclGetUniqueId(&ncclId));
    writeAll(up, &ncclId, sizeof ncclId);
  }
  readAll(down, &ncclId, sizeof ncclId);
  ncclComm_t nccl;
  NK(ncclCommInitRank(&nccl, static_cast<int>(o.ranks), ncclId, static_cast<int>(rank)));
#endif
  tandem_unique_id_t tid;
  if (rank == 0) {
    TK(tandem_get_unique_id(&tid));
    writeAll(up, &tid, sizeof tid);
  }
  readAll(down, &tid, sizeof tid);
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &tid, o.ranks, rank, 60000, &comm));
  const uint64_t pool = std::max<uint64_t>(o.maxBytes, 1u << 30);
  tandem_buffer_t send, recv;
  TK(tandem_alloc(s, pool, &send));
  TK(tandem_alloc(s, pool * o.ranks, &recv));
  char* sendPtr = static_cast<char*>(tandem_buffer_ptr(send));
  char* recvPtr = static_cast<char*>(tandem_buffer_ptr(recv));
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&bad, sizeof *bad));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;
  if (rank == 0) {
    std::printf("allgather_bench: %u ranks, executor %s, median of %d after %d warm-ups; busbw = (n-1)*bytes/time\n",
                o.ranks, o.executor.c_str(), o.iters, o.warmup);
    std::printf("%-10s", "bytes");
    for (const auto& m : kMethods) std::printf(" %18s", m.name);
    std::printf(" %12s\n", "nccl/tandem");  // time ratio: above 1, tandem's default is faster
  }
  std::string jsonRows;
  for (uint64_t S = o.minBytes; S <= o.maxBytes; S *= 2) {
    const uint64_t stride = (S + 4095) & ~uint64_t{4095};
    const uint64_t slots = std::max<uint64_t>(1, pool / stride);
    // Random inputs in every slot the timing loop uses (fill the whole pool once per size).
    fillKernel<<<1024, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(sendPtr), pool / 4, 1000 + rank);
    CK(cudaGetLastError());
    double medianUs[kNumMethods] = {};
    for (int mi = 0; mi < kNumMethods; ++mi) {
      // Alternate the order per size so drift hits every method alike.
      const Method& m = kMethods[(S / o.minBytes) % 2 == 0 ? mi : kNumMethods - 1 - mi];
      const int slot = static_cast<int>(&m - kMethods);
      applyTuning(m);
      // Align the ranks before each method.
      tandem_op_t op;
      const tandem_barrier_args_t barrierArgs{sizeof barrierArgs, stream};
      TK(tandem_barrier_stream(comm, &barrierArgs, &op));
      // Back to back, as an application enqueues them (nccl-tests style): one event between consecutive ops,
      // one synchronisation at the end; per-op time = the gap between its two events.
      const int total = o.warmup + o.iters;
      std::vector<cudaEvent_t> evs(static_cast<size_t>(total) + 1);
      for (auto& e : evs) CK(cudaEventCreate(&e));
      CK(cudaEventRecord(evs[0], stream));
      for (int it = 0; it < total; ++it) {
        const uint64_t k = static_cast<uint64_t>(it) % slots;
        const uint64_t so = k * stride, ro = k * stride * o.ranks;
        if (m.nccl) {
#ifdef TANDEM_HAVE_NCCL
          NK(ncclAllGather(sendPtr + so, recvPtr + ro, S, ncclInt8, nccl, stream));
#endif
        } else {
          const tandem_allgather_args_t args{sizeof args, {send, so}, {recv, ro}, S, stream};
          TK(tandem_allgather(comm, &args, &op));
        }
        CK(cudaEventRecord(evs[static_cast<size_t>(it) + 1], stream));
      }
      CK(cudaStreamSynchronize(stream));
      if (!m.nccl && tandem_wait(op, 60000) != TANDEM_SUCCESS) {
        std::fprintf(stderr, "rank %u: %s %lu bytes failed: %s\n", rank, m.name, static_cast<unsigned long>(S),
                     tandem_last_error());
        ++failures;
      }
      std::vector<float> times;
      for (int it = o.warmup; it < total; ++it) {
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, evs[static_cast<size_t>(it)], evs[static_cast<size_t>(it) + 1]));
        times.push_back(ms * 1000.0f);
      }
      for (auto& e : evs) CK(cudaEventDestroy(e));
      std::sort(times.begin(), times.end());
      medianUs[slot] = times[times.size() / 2];
    }
    if (rank == 0) {
      std::printf("%-10lu", static_cast<unsigned long>(S));
      for (int mi = 0; mi < kNumMethods; ++mi) {
        const double busbw = (o.ranks - 1) * static_cast<double>(S) / (medianUs[mi] * 1e3);
        std::printf("     %7.1fus %4.0f", medianUs[mi], o.ranks > 1 ? busbw : static_cast<double>(S) / (medianUs[mi] * 1e3));
      }
#ifdef TANDEM_HAVE_NCCL
      std::printf(" %12.3f\n", medianUs[kNumMethods - 1] / medianUs[0]);
#else
      std::printf("\n");
#endif
      std::fflush(stdout);
      jsonRows += (jsonRows.empty() ? "" : ",\n") + std::string("    {\"bytes\": ") + std::to_string(S);
      for (int mi = 0; mi < kNumMethods; ++mi) {
        jsonRows += std::string(", \"") + kMethods[mi].name + "_us\": " + std::to_string(medianUs[mi]);
      }
      jsonRows += "}";
    }
  }
  // Exact check, default configuration and NCCL: a dedicated op per size class on freshly seeded data.
  for (uint64_t S : {uint64_t{65536}, uint64_t{1} << 20, uint64_t{64} << 20, o.maxBytes}) {
    if (S > o.maxBytes || S % 4 != 0) continue;
    for (int mi = 0; mi < kNumMethods; ++mi) {
      const Method& m = kMethods[mi];
      applyTuning(m);
      fillKernel<<<1024, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(sendPtr), S / 4, 7000 + rank);
      CK(cudaMemsetAsync(recvPtr, 0xEE, S * o.ranks, stream));
      tandem_op_t op;
      if (m.nccl) {
#ifdef TANDEM_HAVE_NCCL
        NK(ncclAllGather(sendPtr, recvPtr, S, ncclInt8, nccl, stream));
#endif
      } else {
        const tandem_allgather_args_t args{sizeof args, {send, 0}, {recv, 0}, S, stream};
        TK(tandem_allgather(comm, &args, &op));
      }
      CK(cudaMemsetAsync(bad, 0, sizeof *bad, stream));
      checkKernel<<<1024, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(recvPtr), S / 4, o.ranks, 7000, bad);
      unsigned long long nbad = 0;
      CK(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, stream));
      CK(cudaStreamSynchronize(stream));
      if (!m.nccl && tandem_wait(op, 60000) != TANDEM_SUCCESS) {
        std::fprintf(stderr, "rank %u: %s %lu bytes: %s\n", rank, m.name, static_cast<unsigned long>(S),
                     tandem_last_error());
        ++failures;
      }
      if (nbad != 0) {
        std::fprintf(stderr, "rank %u: %s %lu bytes: %llu words differ\n", rank, m.name, static_cast<unsigned long>(S),
                     nbad);
        ++failures;
      }
    }
  }
  if (rank == 0) {
    std::printf("correctness (bitwise, every method, 64 KiB / 1 MiB / 64 MiB / max): %s\n",
                failures == 0 ? "PASS" : "FAIL");
    std::fflush(stdout);  // the rank process leaves with _Exit, which does not flush
    if (!o.json.empty()) {
      std::ofstream(o.json) << "{\n  \"ranks\": " << o.ranks << ", \"executor\": \"" << o.executor
                            << "\", \"iters\": " << o.iters << ",\n  \"rows\": [\n" << jsonRows << "\n  ]\n}\n";
    }
  }
#ifdef TANDEM_HAVE_NCCL
  ncclCommDestroy(nccl);
#endif
  tandem_free(send);
  tandem_free(recv);
  tandem_comm_destroy(comm);
  tandem_disconnect(s);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--ranks") o.ranks = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--executor") o.executor = next();
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--min") o.minBytes = std::stoull(next());
    else if (a == "--max") o.maxBytes = std::stoull(next());
    else if (a == "--json") o.json = next();
    else if (a == "--socket") o.socket = next();
    else {
      std::fprintf(stderr, "usage: allgather_bench [--ranks N] [--executor client|daemon] [--iters N] [--warmup N] "
                           "[--min BYTES] [--max BYTES] [--json FILE] [--socket PATH]\n");
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<tandem::bench::PrivateDaemon> daemon;
  const std::string socket = tandem::bench::useDaemon(
      o.socket, TANDEMD_PATH, "daemon:\n  backend: cuda\n  executor: " + o.executor + "\n", daemon);
  if (socket.empty()) return 2;
  tandem::bench::RankProcesses ranks(o.ranks, [&](uint32_t r, int up, int down) {
    return rankMain(o, r, up, down, socket);
  });
  // Rank 0's ids (NCCL's, then tandem's) to every rank.
  bool relayed = ranks.started();
#ifdef TANDEM_HAVE_NCCL
  relayed = relayed && ranks.relay(sizeof(ncclUniqueId));
#endif
  if (relayed) ranks.relay(sizeof(tandem_unique_id_t));
  return ranks.wait();
}
