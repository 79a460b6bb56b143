// The GPU-issued exchange's pieces on one GPU, in seconds, below tandemd: two "nodes" in this process, each with the
// real GpuProxy (its FIFO mapped for the GPU, its ticket counter on the GPU, its proxy thread) on a real tcp transport
// (loopback; the regions in mapped pinned host memory, where tandemd puts them on tcp), a real GpuRegion each, and the
// real span exchange kernels (kernels/span_exchange.cu) running the plans gpu_exchange_plan.hpp makes. Checked:
// payloads land in the peer's inbox before its arrived flag is seen, over several epochs (the consumed handshake lets
// an inbox be reused); several writes per destination batch (gemm-rs rows of interleaved ranks); a push in passes
// lands the whole payload; a wait ends at the abort word and at its deadline, and says so through the error slot; a
// command the proxy rejects aborts only its own region, and another region on the same GPU proxy keeps working. Every
// wait has a deadline (kernels: their plan's timeout; host: the stream polls below).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gpu_exchange.hpp"
#include "tandem/common/reference.hpp"
#include "transport/tcp_transport.hpp"

using namespace tandem;
using namespace tandem::daemon;
using namespace tandem::daemon::cuda;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace ref = tandem::reference;

namespace {

constexpr int kDevice = 0;
constexpr uint64_t kTimeoutNs = 10'000'000'000ull;  // the kernels' waits give up after 10 s
constexpr uint64_t kStaging = 8u << 20;

void cudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

bool streamFinishes(cudaStream_t s, std::chrono::milliseconds timeout) {
  cudaError_t e = cudaErrorNotReady;
  const bool done = waitFor([&] { return (e = cudaStreamQuery(s)) != cudaErrorNotReady; }, timeout);
  if (done) cudaOk(e, "a kernel of the test");
  return done;
}

template <typename T>
std::vector<T> download(const void* device, uint64_t count) {
  std::vector<T> v(count);
  cudaOk(cudaMemcpy(v.data(), device, count * sizeof(T), cudaMemcpyDefault), "cudaMemcpy to the host");  // GPU or pinned
  return v;
}

uint64_t word(const GpuRegion& r, uint64_t offset) { return download<uint64_t>(r.base() + offset, 1)[0]; }

// Two nodes on loopback, sharing one set of copiers (they route by pointer), each with its GPU proxy.
struct TwoNodes {
  TwoNodes() {
    for (NodeIndex n = 0; n < 2; ++n) {
      TcpConfig c;
      c.self = n;
      c.secret = "span-exchange-gpu-test";
      c.connectionsPerPeer = 2;
      c.ioThreads = 2;
      c.connectTimeoutMs = 5000;
      c.deviceCopier = &copiers;
      nodes[n] = std::make_unique<TcpTransport>(c);
    }
    const std::vector<NodeAddress> addrs{{"127.0.0.1", nodes[0]->listenPort()}, {"127.0.0.1", nodes[1]->listenPort()}};
    std::array<std::optional<std::string>, 2> errors;
    std::vector<std::thread> threads;
    for (int n = 0; n < 2; ++n) {
      threads.emplace_back([&, n] {
        try {
          nodes[n]->connect(addrs);
        } catch (const std::exception& e) {
          errors[n] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int n = 0; n < 2; ++n) {
      if (errors[n]) FAIL("node ", n, " did not connect: ", *errors[n]);
    }
    copiers.prepare(kDevice);  // as GpuExchangeHub does: before any exchange kernel runs
    for (NodeIndex n = 0; n < 2; ++n) proxies[n] = std::make_shared<GpuProxy>(kDevice, *nodes[n]);
  }
  ~TwoNodes() {
    for (auto& p : proxies) p->shutdown();
  }
  // A region per node for one communicator, keys exchanged (unless `keys` is false).
  std::array<std::unique_ptr<GpuRegion>, 2> regions(bool keys = true) {
    std::array<std::unique_ptr<GpuRegion>, 2> r;
    for (NodeIndex n = 0; n < 2; ++n) {
      r[n] = std::make_unique<GpuRegion>(proxies[n], GpuRegionLayout::make({0, 1}, n, kStaging),
                                         std::weak_ptr<CommLink>{}, 100ms);
    }
    if (keys) {
      r[0]->setPeerKeys({{1, r[1]->key()}});
      r[1]->setPeerKeys({{0, r[0]->key()}});
    }
    return r;
  }

  GpuCopiers copiers;  // before the transports: they copy through it until they are gone
  std::array<std::unique_ptr<TcpTransport>, 2> nodes;
  std::array<std::shared_ptr<GpuProxy>, 2> proxies;
};

ExchangeOp opOf(const ref::OpShape& shape, std::vector<uint32_t> nodeOf) {
  ExchangeOp op;
  const auto n = static_cast<uint32_t>(nodeOf.size());
  for (uint32_t r = 0; r < n; ++r) op.descs.push_back(ref::makeDescriptor(shape, r, n));
  op.nodeOfRank = std::move(nodeOf);
  op.nodes = {0, 1};
  return op;
}

std::vector<uint8_t> pattern(uint64_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  for (uint64_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 12));
  return v;
}

struct Streams {
  kernels::CudaStream s[2] = {kernels::CudaStream::create(kDevice, "node 0"),
                              kernels::CudaStream::create(kDevice, "node 1")};
  cudaStream_t operator[](int n) const { return s[n].get(); }
};

// Every case: the GPU chosen and the kernels loaded (before any proxy thread runs), two nodes, a stream each;
// WithRegions adds one communicator's region per node, keys exchanged.
struct Net {
  Net() {
    cudaOk(cudaSetDevice(kDevice), "cudaSetDevice");
    kernels::preloadSpanExchangeKernels(kDevice);
  }
  TwoNodes net;
  Streams st;
};
struct WithRegions : Net {
  std::array<std::unique_ptr<GpuRegion>, 2> regions = net.regions();
};

}  // namespace

TEST_CASE_FIXTURE(WithRegions,
                  "span exchange: payloads land in the peer's GPU inbox before its arrived flag, epoch after epoch") {
  SUBCASE("allgather: one write per peer, 3 MiB + 5 bytes (frames of 512 KiB on two connections)") {
    ref::OpShape shape;
    shape.kind = OpKind::kAllGather;
    shape.bytes = (3u << 20) + 5;
    const ExchangeOp op = opOf(shape, {0, 1});
    uint64_t prev = 0;
    for (uint64_t epoch = 3; epoch <= 7; epoch += 2) {  // epochs need not be consecutive (host-path ops between)
      CAPTURE(epoch);
      std::array<std::vector<uint8_t>, 2> sent;
      for (int n = 0; n < 2; ++n) {
        sent[n] = pattern(shape.bytes, static_cast<uint32_t>(epoch * 2 + n));
        const kernels::SpanExchangePlan* p = regions[n]->preparePlan(op, epoch, prev, kTimeoutNs);
        CHECK(p->peers == 1);
        CHECK(p->writeCount[0] == 1);
        // The send area is refilled only once the peer consumed the previous epoch (the free kernel), as tandemd does.
        cudaOk(kernels::launchSpanFree(regions[n]->planDevice(), st[n]), "free");
        cudaOk(cudaMemcpyAsync(regions[n]->sendArea(), sent[n].data(), shape.bytes, cudaMemcpyDefault, st[n]), "fill");
        cudaOk(kernels::launchSpanPush(regions[n]->planDevice(), st[n]), "push");
        cudaOk(kernels::launchSpanWait(regions[n]->planDevice(), st[n]), "wait");
      }
      for (int n = 0; n < 2; ++n) REQUIRE_MESSAGE(streamFinishes(st[n], 20s), "node ", n, "'s push/wait did not end");
      for (int n = 0; n < 2; ++n) {
        CAPTURE(n);
        CHECK(regions[n]->failure() == "");
        CHECK(word(*regions[n], GpuRegionLayout::arrivedOffset(1 - n)) == epoch);
        const auto got = download<uint8_t>(regions[n]->inbox(1 - n), shape.bytes);
        CHECK_MESSAGE(got == sent[1 - n], "the inbox differs from the peer's send area after its flag");
        cudaOk(kernels::launchSpanConsumed(regions[n]->planDevice(), st[n]), "consumed");
      }
      for (int n = 0; n < 2; ++n) REQUIRE(streamFinishes(st[n], 20s));
      for (int n = 0; n < 2; ++n) {
        CAPTURE(n);
        CHECK(regions[n]->failure() == "");
        // Every command of the op is posted once the proxy's completed word passes the op's last ticket.
        CHECK(regions[n]->lastTicket() > 0);
        CHECK(waitFor([&] { return regions[n]->proxy().completed() >= regions[n]->lastTicket(); }, 5s));
        CHECK(waitFor([&] { return word(*regions[1 - n], GpuRegionLayout::consumedOffset(n)) == epoch; }, 5s));
      }
      prev = epoch;
    }
  }
  SUBCASE("gemm-rs with interleaved ranks: each peer's rows out of the node sum, several writes per batch") {
    // 4 ranks, nodes 0 1 0 1: node 1 owns rows of ranks 1 and 3 (two runs), node 0 those of 0 and 2.
    ref::OpShape shape;
    shape.kind = OpKind::kGemmRs;
    shape.m = 1001;
    shape.n = 300;
    shape.k = 64;
    const ExchangeOp op = opOf(shape, {0, 1, 0, 1});
    const uint64_t sumBytes = shape.m * shape.n * 4;
    std::array<std::vector<uint8_t>, 2> sums;
    for (int n = 0; n < 2; ++n) {
      sums[n] = pattern(sumBytes, 40 + static_cast<uint32_t>(n));
      cudaOk(cudaMemcpy(regions[n]->sendArea(), sums[n].data(), sumBytes, cudaMemcpyDefault), "fill");
      const kernels::SpanExchangePlan* p = regions[n]->preparePlan(op, 1, 0, kTimeoutNs);
      CHECK(p->writeCount[0] == 2);
      cudaOk(kernels::launchSpanPush(regions[n]->planDevice(), st[n]), "push");
      cudaOk(kernels::launchSpanWait(regions[n]->planDevice(), st[n]), "wait");
    }
    for (int n = 0; n < 2; ++n) REQUIRE(streamFinishes(st[n], 20s));
    for (uint32_t n = 0; n < 2; ++n) {
      CAPTURE(n);
      CHECK(regions[n]->failure() == "");
      // The inbox holds the rows node n owns, packed in rank order, from the peer's node sum.
      std::vector<uint8_t> want;
      for (auto [first, rows] : ownedRows(op, n)) {
        const uint8_t* from = sums[1 - n].data() + first * shape.n * 4;
        want.insert(want.end(), from, from + rows * shape.n * 4);
      }
      CHECK(want.size() == exchangePayloadBytes(op, 1 - n, n));
      CHECK(download<uint8_t>(regions[n]->inbox(1 - n), want.size()) == want);
    }
  }
}

TEST_CASE_FIXTURE(WithRegions, "span exchange: a push in passes (writes cut where a pass starts, the flag with the "
                               "last) lands the whole payload") {
  // gemm-ar: every row of the node sum to the peer, one write of it cut into three passes at rows 100 and 333.
  ref::OpShape shape;
  shape.kind = OpKind::kGemmAr;
  shape.m = 600;
  shape.n = 72;
  shape.k = 64;
  const ExchangeOp op = opOf(shape, {0, 1});
  const uint64_t rowBytes = shape.n * 4, sumBytes = shape.m * rowBytes;
  const std::vector<uint64_t> cuts{GpuRegionLayout::sendOffset() + 100 * rowBytes,
                                   GpuRegionLayout::sendOffset() + 333 * rowBytes};
  std::array<std::vector<uint8_t>, 2> sums;
  for (int n = 0; n < 2; ++n) {
    sums[n] = pattern(sumBytes, 70 + static_cast<uint32_t>(n));
    cudaOk(cudaMemcpy(regions[n]->sendArea(), sums[n].data(), sumBytes, cudaMemcpyDefault), "fill");
    regions[n]->preparePlan(op, 1, 0, kTimeoutNs, cuts);
    REQUIRE(regions[n]->passes() == 3);
    uint64_t bytes = 0;
    for (uint32_t q = 0; q < 3; ++q) {
      const kernels::SpanExchangePlan* p = regions[n]->plan(q);
      CAPTURE(q);
      CHECK(p->flag == (q == 2 ? 1u : 0u));
      REQUIRE(p->writeCount[0] == 1);
      const kernels::SpanPlanWrite& w = p->writes[p->firstWrite[0]];
      CHECK(w.srcOffset == GpuRegionLayout::sendOffset() + bytes);  // contiguous pieces, in order
      bytes += w.bytes;
    }
    CHECK(bytes == sumBytes);
    for (uint32_t q = 0; q < 3; ++q) cudaOk(kernels::launchSpanPush(regions[n]->planDevice(q), st[n]), "push");
    cudaOk(kernels::launchSpanWait(regions[n]->planDevice(), st[n]), "wait");
  }
  for (int n = 0; n < 2; ++n) REQUIRE(streamFinishes(st[n], 20s));
  for (int n = 0; n < 2; ++n) {
    CAPTURE(n);
    CHECK(regions[n]->failure() == "");
    CHECK(download<uint8_t>(regions[n]->inbox(1 - n), sumBytes) == sums[1 - n]);
    CHECK(waitFor([&] { return regions[n]->proxy().completed() >= regions[n]->lastTicket(); }, 5s));
  }
}

TEST_CASE_FIXTURE(WithRegions,
                  "span exchange: a wait ends at the communicator's abort word or at its deadline, and says which") {
  ref::OpShape shape;
  shape.kind = OpKind::kAllGather;
  shape.bytes = 4096;
  const ExchangeOp op = opOf(shape, {0, 1});
  SUBCASE("abort word: node 1 waits for a payload node 0 never sends") {
    regions[1]->preparePlan(op, 1, 0, kTimeoutNs);
    cudaOk(kernels::launchSpanWait(regions[1]->planDevice(), st[1]), "wait");
    std::this_thread::sleep_for(200ms);
    CHECK(cudaStreamQuery(st[1]) == cudaErrorNotReady);  // still waiting: nothing came
    const auto t0 = Clock::now();
    regions[1]->abort();
    REQUIRE_MESSAGE(streamFinishes(st[1], 5s), "the wait did not end at the abort word");
    CHECK(Clock::now() - t0 < 2s);
    CHECK(regions[1]->aborted());
    CHECK(regions[1]->failure().find("aborted waiting on the GPU for node 0's arrived flag >= 1") != std::string::npos);
    // The later kernels of the op return at once.
    cudaOk(kernels::launchSpanConsumed(regions[1]->planDevice(), st[1]), "consumed");
    REQUIRE(streamFinishes(st[1], 5s));
    CHECK(regions[1]->lastTicket() == 0);
  }
  SUBCASE("deadline: node 0's free wait for consumed of an epoch node 1 never read, and the push after it") {
    regions[0]->preparePlan(op, 2, 1, 300'000'000ull);  // prevEpoch 1 never consumed; 300 ms
    const auto t0 = Clock::now();
    cudaOk(kernels::launchSpanFree(regions[0]->planDevice(), st[0]), "free");
    cudaOk(kernels::launchSpanPush(regions[0]->planDevice(), st[0]), "push");  // returns at once: failed before
    REQUIRE_MESSAGE(streamFinishes(st[0], 10s), "the free wait did not give up at its deadline");
    CHECK(Clock::now() - t0 >= 300ms);
    CHECK(regions[0]->failure().find("timed out waiting on the GPU for node 1's consumed flag >= 1") !=
          std::string::npos);
    CHECK(regions[0]->lastTicket() == 0);  // nothing was pushed
    CHECK_FALSE(regions[0]->aborted());
  }
}

TEST_CASE_FIXTURE(Net, "span exchange: a command the proxy rejects aborts its own communicator only") {
  ref::OpShape shape;
  shape.kind = OpKind::kAllGather;
  shape.bytes = 65536;
  const ExchangeOp op = opOf(shape, {0, 1});
  // Node 0's first region has no peer keys: the proxy rejects its write (unknown remote buffer) and aborts it.
  auto bad = net.regions(false);
  bad[0]->preparePlan(op, 1, 0, kTimeoutNs);
  cudaOk(kernels::launchSpanPush(bad[0]->planDevice(), st[0]), "push");
  cudaOk(kernels::launchSpanWait(bad[0]->planDevice(), st[0]), "wait");
  REQUIRE_MESSAGE(streamFinishes(st[0], 10s), "the rejected region's wait did not end");
  CHECK(bad[0]->aborted());
  CHECK(bad[0]->failure().find("aborted") != std::string::npos);
  // A second communicator on the same GPU proxies: unaffected.
  auto good = net.regions();
  const auto data = pattern(shape.bytes, 5);
  for (int n = 0; n < 2; ++n) {
    cudaOk(cudaMemcpy(good[n]->sendArea(), data.data(), shape.bytes, cudaMemcpyDefault), "fill");
    good[n]->preparePlan(op, 1, 0, kTimeoutNs);
    cudaOk(kernels::launchSpanPush(good[n]->planDevice(), st[n]), "push");
    cudaOk(kernels::launchSpanWait(good[n]->planDevice(), st[n]), "wait");
  }
  for (int n = 0; n < 2; ++n) REQUIRE(streamFinishes(st[n], 20s));
  for (int n = 0; n < 2; ++n) {
    CAPTURE(n);
    CHECK_FALSE(good[n]->aborted());
    CHECK(good[n]->failure() == "");
    CHECK(download<uint8_t>(good[n]->inbox(1 - n), shape.bytes) == data);
  }
}
