// GPU-side cost of GPU-issued transfers: how fast kernels push 32-byte commands into the proxy FIFO
// (kernels/device/proxy_push.cuh) and how long a push takes to come back, against a real proxy thread draining into
// the NullTransport (no wire: bench/fifo_bench measures the proxy alone at about 21-22 M commands/s per thread).
//
//   throughput  commands/s pushed by 1 warp, 1 CTA of 8 warps, 8/32/132 CTAs of 4 warps (one pushing lane per warp),
//               one command per claim and 8 per claim (proxyPushBatch), with the ticket counter in the FIFO region
//               (host head: every claim a system-scope atomic across PCIe) and in GPU memory (device head).
//               "kernel" is commands / kernel time (CUDA events); "drained" is commands / the time until the proxy
//               had popped them all (host clock, from just before the launch). With the FIFO's --capacity the ring
//               fills and producers wait for the proxy; the "ring never full" rows use 2^20 slots (more than they
//               push), so their kernel rate is the producers' own cost, not the proxy's.
//   round trip  one thread: %globaltimer, push a signalled write, spin until the proxy's `completed` watermark
//               passes its ticket, %globaltimer. That is GPU -> host memory -> proxy -> host memory -> GPU: a ROUND
//               trip, reported as such (nothing here measures one way). "push" is the time the push call itself
//               took. The host baseline (same proxy, a host thread pushing and waiting the same way) comes first.
//   tcp pipe    GPU -> proxy -> tcp on loopback -> GPU in one process: one thread pushes `bytes` as kWrite commands of
//               `piece` bytes (8 per claim) and a flag; a kernel on the "receiving node" spins on the flag in GPU
//               memory; GB/s = bytes / (launch to flag seen, host clock), best of 3. Sender and receiver share the
//               one GPU, its copy engines and the host's cores.
//   copier      the tcp transport's staging of GPU memory: us per synchronous copy through the CUDA DeviceCopier
//               (pageable host memory <-> pinned bounce <-> GPU), against plain cudaMemcpy of the same memory.
//
// Usage: proxy_push_bench [--commands N] [--samples N] [--capacity C] [--json FILE]
// Results: bench/RESULTS.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/ordering.cuh"
#include "device/proxy_push.cuh"
#include "proxy_push_host.hpp"

using namespace tandem::kernels;
namespace f = ::tandem::proxy::fifo;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kTimeoutNs = 20'000'000'000ull;  // no push waits longer than 20 s

struct Options {
  uint64_t commands = 4'000'000;  // per throughput row (the single-warp rows use a quarter)
  uint32_t samples = 20000;       // round-trip samples
  uint32_t capacity = 4096;
  std::string json;
};

__global__ void pushKernel(const ::tandem::proxy::ProxyFifoDeviceRef fifo, uint64_t perWarp, uint32_t batch,
                           uint32_t* status) {
  if (threadIdx.x % 32 != 0) return;
  ProxyPusher p = makeProxyPusher(fifo, kTimeoutNs);
  // A write of 4 KiB that the NullTransport accepts; the offset varies so that no two commands are alike.
  ProxyCommand cmds[8];
  ProxyPushStatus s = ProxyPushStatus::kOk;
  const uint64_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  for (uint64_t i = 0; i < perWarp && s == ProxyPushStatus::kOk; i += batch) {
    const uint32_t n = static_cast<uint32_t>(perWarp - i < batch ? perWarp - i : batch);
    if (batch == 1) {
      s = proxyPush(p, f::makeWrite(1, 1, (warp << 20) + i, 1, 0, 4096));
    } else {
      for (uint32_t k = 0; k < n; ++k) cmds[k] = f::makeWrite(1, 1, (warp << 20) + i + k, 1, 0, 4096);
      s = proxyPushBatch(p, cmds, n);
    }
  }
  if (s != ProxyPushStatus::kOk) atomicMax(status, static_cast<uint32_t>(s));
}

__global__ void pipeKernel(const ::tandem::proxy::ProxyFifoDeviceRef fifo, uint64_t bytes, uint32_t piece,
                           uint64_t flagValue, uint32_t* status) {
  ProxyPusher p = makeProxyPusher(fifo, kTimeoutNs);
  using Pipe = tandem::bench::TcpPipeBench;
  ProxyCommand cmds[8];
  ProxyPushStatus s = ProxyPushStatus::kOk;
  for (uint64_t off = 0; off < bytes && s == ProxyPushStatus::kOk;) {
    uint32_t n = 0;
    for (; n < 8 && off < bytes; ++n, off += piece) {
      const uint64_t len = bytes - off < piece ? bytes - off : piece;
      cmds[n] = f::makeWrite(1, Pipe::kSrc, off, Pipe::kDst, off, static_cast<uint32_t>(len));
    }
    s = proxyPushBatch(p, cmds, n);
  }
  if (s == ProxyPushStatus::kOk) s = proxyPush(p, f::makeFlag(1, Pipe::kFlag, 0, flagValue));
  if (s != ProxyPushStatus::kOk) *status = static_cast<uint32_t>(s);
}

__global__ void flagWaitKernel(const uint64_t* flag, uint64_t value, uint32_t* status) {
  const uint64_t start = globaltimerNs();
  while (ldAcquireSys(flag) < value) {  // acquire: pairs with the transport's flag store after the data (toDevice)
    if (globaltimerNs() - start > kTimeoutNs) {
      *status = 100;
      return;
    }
  }
}

__global__ void roundTripKernel(const ::tandem::proxy::ProxyFifoDeviceRef fifo, uint32_t samples, uint64_t* roundTrip,
                                uint64_t* pushOnly, uint64_t* total, uint32_t* status) {
  ProxyPusher p = makeProxyPusher(fifo, kTimeoutNs);
  const uint64_t begin = globaltimerNs();
  for (uint32_t i = 0; i < samples; ++i) {
    const uint64_t t0 = globaltimerNs();
    uint64_t ticket = 0;
    ProxyPushStatus s = proxyPush(p, f::makeWrite(1, 1, i, 1, 0, 4096, ::tandem::proxy::kProxyFlagSignal), &ticket);
    const uint64_t t1 = globaltimerNs();
    if (s == ProxyPushStatus::kOk) s = proxyWaitCompleted(p, ticket);
    const uint64_t t2 = globaltimerNs();
    if (s != ProxyPushStatus::kOk) {
      *status = static_cast<uint32_t>(s);
      return;
    }
    roundTrip[i] = t2 - t0;
    pushOnly[i] = t1 - t0;
  }
  *total = globaltimerNs() - begin;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "proxy_push_bench: %s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
    std::exit(1);
  }
}

double pct(std::vector<uint64_t> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))]);
}

struct ThroughputRow {
  std::string name;
  uint32_t capacity;
  bool deviceHead;
  int ctas, warps;
  uint32_t batch;
  uint64_t commands;
  double kernelMs, drainedMs;
  bool ok;
};

struct LatencyRow {
  std::string name;
  double p50, p90, p99, max, mean, pushP50;
  bool ok;
};

ThroughputRow throughput(const char* name, uint32_t capacity, bool deviceHead, int ctas, int warps, uint32_t batch,
                         uint64_t commands) {
  tandem::bench::PushBenchProxy proxy(capacity, deviceHead, 0, 64, false);
  const uint64_t totalWarps = static_cast<uint64_t>(ctas) * static_cast<uint64_t>(warps);
  const uint64_t perWarp = std::max<uint64_t>(1, commands / totalWarps);
  const uint64_t total = perWarp * totalWarps;
  uint32_t* status = nullptr;
  check(cudaMalloc(&status, 4), "cudaMalloc");
  check(cudaMemset(status, 0, 4), "cudaMemset");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  // Warm-up: one small launch (module load, first touches of the FIFO lines), not timed.
  pushKernel<<<1, 32, 0, stream>>>(proxy.ref(), 1024, batch, status);
  check(cudaStreamSynchronize(stream), "warm-up");
  // The proxy may still be popping the warm-up's last commands: count from where they are all in.
  const uint64_t base = 1024;
  const auto warmDeadline = Clock::now() + std::chrono::seconds(5);
  while (proxy.stats().popped < base && Clock::now() < warmDeadline) std::this_thread::yield();
  const auto t0 = Clock::now();
  check(cudaEventRecord(e0, stream), "cudaEventRecord");
  pushKernel<<<ctas, warps * 32, 0, stream>>>(proxy.ref(), perWarp, batch, status);
  check(cudaGetLastError(), "launch pushKernel");
  check(cudaEventRecord(e1, stream), "cudaEventRecord");
  // Poll the proxy while the kernel runs: drained time is when its last command was popped. Give up 0.5 s after the
  // kernel ended without the proxy having seen every command (lost tickets would show here), or after 20 s.
  const auto deadline = t0 + std::chrono::seconds(20);
  std::optional<Clock::time_point> kernelDone;
  while (proxy.stats().popped - base < total && Clock::now() < deadline) {
    if (!kernelDone && cudaEventQuery(e1) == cudaSuccess) kernelDone = Clock::now();
    if (kernelDone && Clock::now() - *kernelDone > std::chrono::milliseconds(500)) break;
    std::this_thread::yield();
  }
  const auto t1 = Clock::now();
  bool ok = proxy.stats().popped - base == total;
  if (!ok) proxy.requestStop();
  check(cudaStreamSynchronize(stream), "pushKernel");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  uint32_t st = 0;
  check(cudaMemcpy(&st, status, 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  const tandem::bench::PushBenchStats s = proxy.stats();
  ok = ok && st == 0 && s.rejected == 0 && s.failed == 0;
  if (!ok)
    std::fprintf(stderr, "%s (%s head): popped %llu of %llu, head %llu, status %u, rejected %llu, failed %llu\n",
                 name, deviceHead ? "device" : "host", static_cast<unsigned long long>(s.popped - base),
                 static_cast<unsigned long long>(total), static_cast<unsigned long long>(proxy.head()), st,
                 static_cast<unsigned long long>(s.rejected), static_cast<unsigned long long>(s.failed));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  cudaFree(status);
  return ThroughputRow{name, capacity, deviceHead, ctas, warps, batch, total, ms,
                       std::chrono::duration<double, std::milli>(t1 - t0).count(), ok};
}

LatencyRow roundTrip(const Options& o, const char* name, bool deviceHead) {
  tandem::bench::PushBenchProxy proxy(o.capacity, deviceHead, 0, 64, true);
  uint64_t *rt = nullptr, *push = nullptr, *total = nullptr;
  uint32_t* status = nullptr;
  check(cudaMalloc(&rt, o.samples * 8ull), "cudaMalloc");
  check(cudaMalloc(&push, o.samples * 8ull), "cudaMalloc");
  check(cudaMalloc(&total, 8), "cudaMalloc");
  check(cudaMalloc(&status, 4), "cudaMalloc");
  check(cudaMemset(status, 0, 4), "cudaMemset");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  roundTripKernel<<<1, 1, 0, stream>>>(proxy.ref(), std::min<uint32_t>(o.samples, 100), rt, push, total, status);
  check(cudaStreamSynchronize(stream), "warm-up");
  roundTripKernel<<<1, 1, 0, stream>>>(proxy.ref(), o.samples, rt, push, total, status);
  check(cudaGetLastError(), "launch roundTripKernel");
  check(cudaStreamSynchronize(stream), "roundTripKernel");
  std::vector<uint64_t> r(o.samples), p(o.samples);
  uint64_t tot = 0;
  uint32_t st = 0;
  check(cudaMemcpy(r.data(), rt, o.samples * 8ull, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(p.data(), push, o.samples * 8ull, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(&tot, total, 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(&st, status, 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaStreamDestroy(stream);
  cudaFree(rt);
  cudaFree(push);
  cudaFree(total);
  cudaFree(status);
  if (st != 0) std::fprintf(stderr, "%s: a push or wait returned status %u\n", name, st);
  return LatencyRow{name,        pct(r, 0.5),
                    pct(r, 0.9), pct(r, 0.99),
                    pct(r, 1.0), static_cast<double>(tot) / o.samples,
                    pct(p, 0.5), st == 0};
}

struct PipeRow {
  uint64_t bytes;
  uint32_t piece, connections;
  double bestMs;
  bool ok;
};

PipeRow tcpPipe(uint64_t bytes, uint32_t piece, uint32_t connections) {
  tandem::bench::TcpPipeBench pipe(0, bytes, connections);
  uint32_t* status = nullptr;
  check(cudaMalloc(&status, 4), "cudaMalloc");
  check(cudaMemset(status, 0, 4), "cudaMemset");
  cudaStream_t send, recv;
  check(cudaStreamCreateWithFlags(&send, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&recv, cudaStreamNonBlocking), "cudaStreamCreate");
  double best = 1e30;
  for (uint64_t round = 1; round <= 3; ++round) {
    const auto t0 = Clock::now();
    flagWaitKernel<<<1, 1, 0, recv>>>(pipe.flag(), round, status);
    pipeKernel<<<1, 1, 0, send>>>(pipe.ref(), bytes, piece, round, status);
    check(cudaGetLastError(), "launch tcp pipe kernels");
    check(cudaStreamSynchronize(recv), "flagWaitKernel");
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    check(cudaStreamSynchronize(send), "pipeKernel");
  }
  uint32_t st = 0;
  check(cudaMemcpy(&st, status, 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  const tandem::bench::PushBenchStats s = pipe.stats();
  const bool ok = st == 0 && s.rejected == 0 && s.failed == 0;
  if (!ok)
    std::fprintf(stderr, "tcp pipe %u B x %u conns: status %u, rejected %llu, failed %llu\n", piece, connections, st,
                 static_cast<unsigned long long>(s.rejected), static_cast<unsigned long long>(s.failed));
  cudaStreamDestroy(send);
  cudaStreamDestroy(recv);
  cudaFree(status);
  return PipeRow{bytes, piece, connections, best, ok};
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--commands") {
      o.commands = std::stoull(next());
    } else if (a == "--samples") {
      o.samples = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--capacity") {
      o.capacity = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--json") {
      o.json = next();
    } else {
      std::fprintf(stderr, "usage: proxy_push_bench [--commands N] [--samples N] [--capacity C] [--json FILE]\n");
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("proxy_push_bench: no CUDA device; run on a GPU host\n");
    return 77;
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  // Load both kernels now: a first launch under lazy loading can wait for running kernels (proxy_push.cuh).
  for (const void* fn : {reinterpret_cast<const void*>(&pushKernel), reinterpret_cast<const void*>(&roundTripKernel),
                         reinterpret_cast<const void*>(&pipeKernel), reinterpret_cast<const void*>(&flagWaitKernel)}) {
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, fn), "cudaFuncGetAttributes (loading the kernels)");
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int hostAtomics = 0;
  cudaDeviceGetAttribute(&hostAtomics, cudaDevAttrHostNativeAtomicSupported, 0);
  std::printf("proxy_push_bench on %s (%d SMs), FIFO %u slots, hostNativeAtomicSupported=%d\n", prop.name,
              prop.multiProcessorCount, o.capacity, hostAtomics);

  bool allOk = true;
  // Host baseline first, on a proxy of its own (same options as the GPU round trip).
  std::vector<uint64_t> host;
  {
    tandem::bench::PushBenchProxy proxy(o.capacity, false, 0, 64, true);
    proxy.hostRoundTrips(std::min<uint32_t>(o.samples, 1000));
    host = proxy.hostRoundTrips(o.samples);
    if (host.size() != o.samples) {
      std::fprintf(stderr, "host round trip: only %zu of %u samples\n", host.size(), o.samples);
      allOk = false;
    }
  }

  std::vector<LatencyRow> lat;
  lat.push_back(roundTrip(o, "GPU 1 thread, host head", false));
  lat.push_back(roundTrip(o, "GPU 1 thread, device head", true));

  struct Config {
    const char* name;
    int ctas, warps;
    uint32_t batch;
    uint64_t commands;
    bool neverFull;
  };
  constexpr uint32_t kBigRing = 1u << 20;
  const uint64_t n = o.commands, nBig = std::min<uint64_t>(o.commands, kBigRing - 4096);
  const std::vector<Config> configs{
      {"1 warp", 1, 1, 1, n / 4, false},
      {"1 warp, 8/claim", 1, 1, 8, n / 4, false},
      {"1 CTA x 8 warps", 1, 8, 1, n, false},
      {"8 CTAs x 4 warps", 8, 4, 1, n, false},
      {"32 CTAs x 4 warps", 32, 4, 1, n, false},
      {"132 CTAs x 4 warps", 132, 4, 1, n, false},
      {"132 CTAs x 4 warps, 8/claim", 132, 4, 8, n, false},
      {"1 warp, ring never full", 1, 1, 1, nBig / 4, true},
      {"1 CTA x 8 warps, never full", 1, 8, 1, nBig, true},
      {"132 CTAs x 4 warps, never full", 132, 4, 1, nBig, true},
      {"132x4, 8/claim, never full", 132, 4, 8, nBig, true},
  };
  std::vector<ThroughputRow> rows;
  for (bool deviceHead : {true, false}) {
    for (const Config& c : configs)
      rows.push_back(throughput(c.name, c.neverFull ? kBigRing : o.capacity, deviceHead, c.ctas, c.warps, c.batch,
                                c.commands));
  }

  std::printf("\nThroughput (one pushing lane per warp, 4 KiB kWrite commands, NullTransport, one proxy thread)\n");
  std::printf("%-30s %-7s %8s %10s %12s %12s %12s  %s\n", "producers", "head", "slots", "commands", "kernel ms",
              "kernel M/s", "drained M/s", "ok");
  for (const ThroughputRow& r : rows) {
    std::printf("%-30s %-7s %8u %10llu %12.2f %12.2f %12.2f  %s\n", r.name.c_str(), r.deviceHead ? "device" : "host",
                r.capacity, static_cast<unsigned long long>(r.commands), r.kernelMs, r.commands / r.kernelMs / 1e3,
                r.commands / r.drainedMs / 1e3, r.ok ? "yes" : "NO");
    allOk = allOk && r.ok;
  }
  std::printf("\nRound trip, push of a signalled command -> proxy -> `completed` seen by the producer (ns; %u samples; "
              "mean = loop time / samples)\n",
              o.samples);
  std::printf("%-30s %9s %9s %9s %9s %9s %11s  %s\n", "producer", "p50", "p90", "p99", "max", "mean", "push p50", "ok");
  std::printf("%-30s %9.0f %9.0f %9.0f %9.0f %9s %11s  %s\n", "host thread (baseline)", pct(host, 0.5), pct(host, 0.9),
              pct(host, 0.99), pct(host, 1.0), "-", "-", host.size() == o.samples ? "yes" : "NO");
  for (const LatencyRow& r : lat) {
    std::printf("%-30s %9.0f %9.0f %9.0f %9.0f %9.0f %11.0f  %s\n", r.name.c_str(), r.p50, r.p90, r.p99, r.max, r.mean,
                r.pushP50, r.ok ? "yes" : "NO");
    allOk = allOk && r.ok;
  }

  std::vector<PipeRow> pipes;
  for (uint32_t conns : {1u, 4u}) {
    for (uint32_t piece : {64u * 1024, 512u * 1024, 4u * 1024 * 1024})
      pipes.push_back(tcpPipe(64ull << 20, piece, conns));
  }
  std::printf("\ntcp pipe, GPU -> proxy -> tcp loopback -> GPU (64 MiB, best of 3; launch to flag seen)\n");
  std::printf("%10s %6s %10s %8s  %s\n", "piece", "conns", "ms", "GB/s", "ok");
  for (const PipeRow& r : pipes) {
    std::printf("%10u %6u %10.2f %8.2f  %s\n", r.piece, r.connections, r.bestMs,
                static_cast<double>(r.bytes) / r.bestMs / 1e6, r.ok ? "yes" : "NO");
    allOk = allOk && r.ok;
  }

  const std::vector<uint64_t> copySizes{8, 4096, 64 * 1024, 512 * 1024, 4 * 1024 * 1024};
  const std::vector<tandem::bench::CopierRow> copies = tandem::bench::copierRows(0, copySizes);
  std::printf("\nDeviceCopier (1 MiB bounce per lane) vs cudaMemcpy, pageable host memory (us per copy; GB/s)\n");
  std::printf("%10s %7s %14s %14s %14s %14s\n", "bytes", "copies", "copier ->GPU", "copier ->host", "memcpy ->GPU",
              "memcpy ->host");
  for (const tandem::bench::CopierRow& c : copies) {
    std::printf("%10llu %7u", static_cast<unsigned long long>(c.bytes), c.copies);
    for (double us : {c.toDeviceUs, c.toHostUs, c.memcpyToDeviceUs, c.memcpyToHostUs})
      std::printf(" %7.1f (%5.2f)", us, static_cast<double>(c.bytes) / us / 1e3);
    std::printf("\n");
  }

  if (!o.json.empty()) {
    FILE* j = std::fopen(o.json.c_str(), "w");
    if (j == nullptr) {
      std::fprintf(stderr, "cannot write %s: %s\n", o.json.c_str(), std::strerror(errno));
      return 1;
    }
    std::fprintf(j, "{\"device\": \"%s\", \"sms\": %d, \"capacity\": %u, \"hostNativeAtomicSupported\": %d,\n",
                 prop.name, prop.multiProcessorCount, o.capacity, hostAtomics);
    std::fprintf(j, " \"throughput\": [\n");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const ThroughputRow& r = rows[i];
      std::fprintf(j,
                   "  {\"producers\": \"%s\", \"head\": \"%s\", \"slots\": %u, \"ctas\": %d, \"warps\": %d, "
                   "\"batch\": %u, \"commands\": %llu, \"kernel_ms\": %.4f, \"drained_ms\": %.4f, \"ok\": %s}%s\n",
                   r.name.c_str(), r.deviceHead ? "device" : "host", r.capacity, r.ctas, r.warps, r.batch,
                   static_cast<unsigned long long>(r.commands), r.kernelMs, r.drainedMs, r.ok ? "true" : "false",
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(j, " ],\n \"round_trip_ns\": [\n");
    std::fprintf(j, "  {\"producer\": \"host thread\", \"p50\": %.0f, \"p90\": %.0f, \"p99\": %.0f, \"max\": %.0f},\n",
                 pct(host, 0.5), pct(host, 0.9), pct(host, 0.99), pct(host, 1.0));
    for (std::size_t i = 0; i < lat.size(); ++i) {
      const LatencyRow& r = lat[i];
      std::fprintf(j,
                   "  {\"producer\": \"%s\", \"p50\": %.0f, \"p90\": %.0f, \"p99\": %.0f, \"max\": %.0f, "
                   "\"mean\": %.1f, \"push_p50\": %.0f, \"ok\": %s}%s\n",
                   r.name.c_str(), r.p50, r.p90, r.p99, r.max, r.mean, r.pushP50, r.ok ? "true" : "false",
                   i + 1 < lat.size() ? "," : "");
    }
    std::fprintf(j, " ],\n \"tcp_pipe\": [\n");
    for (std::size_t i = 0; i < pipes.size(); ++i) {
      const PipeRow& r = pipes[i];
      std::fprintf(j, "  {\"bytes\": %llu, \"piece\": %u, \"connections\": %u, \"best_ms\": %.3f, \"ok\": %s}%s\n",
                   static_cast<unsigned long long>(r.bytes), r.piece, r.connections, r.bestMs, r.ok ? "true" : "false",
                   i + 1 < pipes.size() ? "," : "");
    }
    std::fprintf(j, " ],\n \"copier_us\": [\n");
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const tandem::bench::CopierRow& c = copies[i];
      std::fprintf(j,
                   "  {\"bytes\": %llu, \"copies\": %u, \"to_device\": %.2f, \"to_host\": %.2f, "
                   "\"memcpy_to_device\": %.2f, \"memcpy_to_host\": %.2f}%s\n",
                   static_cast<unsigned long long>(c.bytes), c.copies, c.toDeviceUs, c.toHostUs, c.memcpyToDeviceUs,
                   c.memcpyToHostUs, i + 1 < copies.size() ? "," : "");
    }
    std::fprintf(j, " ]}\n");
    std::fclose(j);
  }
  return allOk ? 0 : 1;
}
