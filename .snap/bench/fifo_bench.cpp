// Proxy FIFO push-to-post benchmark: producers push 32-byte write commands into one FIFO, one proxy thread
// pops, validates and posts them to a transport with no wire. Prints a table:
//   throughput  commands/s through one proxy thread with 1 and 4 producers, one command per claim and (with
//               several producers) 8 per claim (NullTransport, the shipped one)
//   latency     push-to-post time per command: unloaded (one command in flight, ping-pong) and saturated
//               (producers pushing flat out; includes queueing, so it mostly measures the ring depth)
// Target: >= 10 million commands/s per proxy thread. Results: bench/RESULTS.md.
//
// Usage: tandem_fifo_bench [--commands N] [--capacity C] [--batch B] [--producers P[,P...]] [--push-batch N]
//                          [--latency-samples N]
//   --batch: commands the proxy pops per submit(); --push-batch: commands a producer claims per fetch_add in
//   the extra multi-producer rows (pushBatch, as a GPU warp would).
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "transport/proxy_fifo.hpp"
#include "transport/transport.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;
using Clock = std::chrono::steady_clock;

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

struct Options {
  uint64_t commands = 20'000'000;
  uint32_t capacity = 4096;
  uint32_t batch = 64;
  std::vector<int> producers{1, 4};
  uint64_t latencySamples = 200'000;
  uint32_t pushBatch = 8;  // commands per claim in the multi-producer batched rows
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--commands") {
      o.commands = std::stoull(next());
    } else if (a == "--capacity") {
      o.capacity = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--batch") {
      o.batch = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--push-batch") {
      o.pushBatch = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--latency-samples") {
      o.latencySamples = std::stoull(next());
    } else if (a == "--producers") {
      o.producers.clear();
      std::string list = next();
      for (std::size_t p = 0; p != std::string::npos;) {
        const std::size_t comma = list.find(',', p);
        o.producers.push_back(std::stoi(list.substr(p, comma == std::string::npos ? comma : comma - p)));
        p = comma == std::string::npos ? comma : comma + 1;
      }
    } else {
      fmt::print(stderr,
                 "usage: tandem_fifo_bench [--commands N] [--capacity C] [--batch B] [--producers P[,P...]] "
                 "[--push-batch N] [--latency-samples N]\n");
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  return o;
}

struct FifoMemory {
  explicit FifoMemory(uint32_t capacity) : bytes(ProxyFifoLayout::bytesFor(capacity)) {
    base = static_cast<std::byte*>(::operator new(bytes, std::align_val_t{4096}));
    std::memset(base, 0, bytes);  // fault the pages in before timing
    view = ProxyFifoView::format(base, bytes, capacity);
  }
  ~FifoMemory() { ::operator delete(base, std::align_val_t{4096}); }
  uint64_t bytes;
  std::byte* base;
  ProxyFifoView view;
};

// Measures push-to-post latency: each write carries its push time (ns since start) in srcOffset, which the
// buffer table allows (the local buffer is declared 2^48 bytes). Single writer: the proxy thread.
class LatencyTransport final : public Transport {
 public:
  LatencyTransport(int64_t epochNs, std::size_t reserve) : epochNs_(epochNs) { samples_.reserve(reserve); }
  TransportKind kind() const override { return TransportKind::kNull; }
  NodeIndex self() const override { return 0; }
  uint32_t nodeCount() const override { return 2; }
  LocalRegion registerMemory(const MemoryDesc&) override { return LocalRegion{1}; }
  void deregisterMemory(LocalRegion) override {}
  RemoteKey remoteKey(LocalRegion) const override { return {}; }
  void write(NodeIndex, LocalRegion, uint64_t srcOffset, const RemoteKey&, uint64_t, uint64_t, uint64_t, bool) override {
    const int64_t now = nowNs() - epochNs_;
    if (samples_.size() < samples_.capacity()) samples_.push_back(static_cast<uint32_t>(std::min<int64_t>(now - static_cast<int64_t>(srcOffset), UINT32_MAX)));
    posted_.store(posted_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  void writeFlag(NodeIndex, const RemoteKey&, uint64_t, uint64_t, uint64_t, bool) override {}
  void submit() override {}
  std::size_t poll(std::span<Completion>) override { return 0; }
  PeerStatus peerStatus(NodeIndex) const override { return {PeerState::kConnected, {}}; }
  void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)>) override {}
  uint64_t posted() const { return posted_.load(std::memory_order_acquire); }
  std::vector<uint32_t>& samples() { return samples_; }

 private:
  int64_t epochNs_;
  std::vector<uint32_t> samples_;
  std::atomic<uint64_t> posted_{0};
};

std::shared_ptr<ProxyBufferTable> benchTable() {
  auto t = std::make_shared<ProxyBufferTable>();
  t->addLocal(1, LocalRegion{1}, kProxyMaxOffset + 1);
  t->addRemote(1, 1, RemoteKey{TransportKind::kNull, 1, 1, 0, 0, uint64_t{1} << 40});
  return t;
}

struct Percentiles {
  double p50, p90, p99, p999, max;
};
Percentiles percentiles(std::vector<uint32_t>& v) {
  if (v.empty()) return {0, 0, 0, 0, 0};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return static_cast<double>(v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))]); };
  return {at(0.50), at(0.90), at(0.99), at(0.999), static_cast<double>(v.back())};
}

struct ThroughputResult {
  double seconds;
  uint64_t fullWaits;
  ProxyStats stats;
};

// P producers push `total` commands (`batch` per fetch_add); one proxy thread posts them to a NullTransport.
ThroughputResult throughput(const Options& o, int producers, uint32_t batch) {
  FifoMemory mem(o.capacity);
  NullTransport net(0, 2);
  Proxy proxy(mem.view, net, ProxyOptions{.name = "proxy bench", .maxBatch = o.batch});
  proxy.setBufferTable(benchTable());
  proxy.start();
  const uint64_t per = o.commands / static_cast<uint64_t>(producers);
  const uint64_t total = per * static_cast<uint64_t>(producers);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<uint64_t> fullWaits{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&] {
      ProxyFifoProducer prod(mem.view);
      const ProxyCommand cmd = fifo::makeWrite(1, 1, 0, 1, 0, 4096);
      const std::vector<ProxyCommand> cmds(batch, cmd);
      ++ready;
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      if (batch <= 1) {
        for (uint64_t i = 0; i < per; ++i) prod.push(cmd);
      } else {
        for (uint64_t i = 0; i < per; i += batch) prod.pushBatch(std::span(cmds).first(std::min<uint64_t>(batch, per - i)));
      }
      fullWaits += prod.fullWaits();
    });
  }
  while (ready.load() < producers) std::this_thread::yield();
  const auto start = Clock::now();
  go.store(true, std::memory_order_release);
  const auto deadline = start + std::chrono::seconds(120);
  while (net.writes() < total && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (net.writes() < total) {
    fmt::print(stderr, "proxy posted only {} of {} commands within 120 s\n", net.writes(), total);
    mem.view.requestStop();
  }
  for (auto& t : threads) t.join();
  proxy.stop();
  return {seconds, fullWaits.load(), proxy.stats()};
}

// Unloaded: one producer pushes one command, waits until it is posted, repeats.
std::vector<uint32_t> pingPongLatency(const Options& o) {
  FifoMemory mem(o.capacity);
  const int64_t epoch = nowNs();
  LatencyTransport net(epoch, o.latencySamples);
  Proxy proxy(mem.view, net, ProxyOptions{.name = "proxy bench", .maxBatch = o.batch, .idleSpins = UINT32_MAX});
  proxy.setBufferTable(benchTable());
  proxy.start();
  ProxyFifoProducer prod(mem.view);
  std::vector<uint32_t> rtt;
  rtt.reserve(o.latencySamples);
  for (uint64_t i = 0; i < o.latencySamples; ++i) {
    const int64_t t0 = nowNs();
    prod.push(fifo::makeWrite(1, 1, static_cast<uint64_t>(t0 - epoch), 1, 0, 64));
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (net.posted() <= i) {
      if (Clock::now() > deadline) {
        fmt::print(stderr, "command {} not posted within 5 s\n", i);
        std::exit(1);
      }
    }
  }
  proxy.stop();
  return std::move(net.samples());
}

// Saturated: P producers push flat out with timestamps; the proxy records push-to-post per command.
std::vector<uint32_t> loadedLatency(const Options& o, int producers) {
  FifoMemory mem(o.capacity);
  const int64_t epoch = nowNs();
  const uint64_t per = std::max<uint64_t>(o.commands / 4 / static_cast<uint64_t>(producers), 1);
  LatencyTransport net(epoch, per * static_cast<uint64_t>(producers));
  Proxy proxy(mem.view, net, ProxyOptions{.name = "proxy bench", .maxBatch = o.batch});
  proxy.setBufferTable(benchTable());
  proxy.start();
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&] {
      ProxyFifoProducer prod(mem.view);
      for (uint64_t i = 0; i < per; ++i) prod.push(fifo::makeWrite(1, 1, static_cast<uint64_t>(nowNs() - epoch), 1, 0, 64));
    });
  }
  for (auto& t : threads) t.join();
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (net.posted() < per * static_cast<uint64_t>(producers) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  proxy.stop();
  return std::move(net.samples());
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  fmt::print("proxy FIFO push-to-post, one proxy thread, no wire: capacity {} slots x 32 B, batch {}, {} hardware "
             "threads\n\n", o.capacity, o.batch, std::thread::hardware_concurrency());

  fmt::print("throughput (NullTransport)\n");
  fmt::print("| producers | commands per claim | commands | seconds | M commands/s | ns/command | proxy batch (avg) | "
             "producer full-waits |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (int p : o.producers) {
    for (uint32_t claim : {1u, o.pushBatch}) {
      if (claim == o.pushBatch && (claim <= 1 || p == 1)) continue;
      const auto r = throughput(o, p, claim);
      const double rate = static_cast<double>(r.stats.posted) / r.seconds;
      fmt::print("| {} | {} | {} | {:.3f} | {:.1f} | {:.1f} | {:.1f} | {} |\n", p, claim, r.stats.posted, r.seconds,
                 rate / 1e6, 1e9 / rate,
                 static_cast<double>(r.stats.popped) / static_cast<double>(std::max<uint64_t>(r.stats.submits, 1)),
                 r.fullWaits);
    }
  }

  fmt::print("\npush-to-post latency (ns)\n");
  fmt::print("| mode | samples | p50 | p90 | p99 | p99.9 | max |\n|---|---|---|---|---|---|---|\n");
  {
    auto v = pingPongLatency(o);
    const auto q = percentiles(v);
    fmt::print("| unloaded, 1 in flight | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |\n", v.size(), q.p50, q.p90,
               q.p99, q.p999, q.max);
  }
  for (int p : o.producers) {
    auto v = loadedLatency(o, p);
    const auto q = percentiles(v);
    fmt::print("| saturated, {} producer(s) | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |\n", p, v.size(), q.p50,
               q.p90, q.p99, q.p999, q.max);
  }
  return 0;
}
