// GPU-issued transfers end to end on one GPU: kernels push commands into a real proxy FIFO in GPU-mapped pinned
// memory (kernels/device/proxy_push.cuh), a real proxy thread drains it into a real tcp transport pair on loopback
// (node 0 and node 1 in this process), both ends kDevice regions staged through the CUDA DeviceCopier, and a kernel of
// the "receiving node" spins on the flags in GPU memory and checks every byte: flag-after-data across GPU -> proxy ->
// tcp -> bounce buffer -> GPU. Also: the copier itself (chunked, several threads), malformed commands from the GPU
// rejected and counted in the errors word the GPU reads, and producers blocked on a full FIFO that return on the stop
// word or their deadline. Every wait has a deadline (kernels: %globaltimer; host: the stream polls below).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_copier.hpp"
#include "cuda/proxy_fifo_mapping.hpp"
#include "proxy_gpu_kernels.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "transport/proxy_fifo.hpp"
#include "transport/tcp_transport.hpp"

using namespace tandem;
using namespace tandem::daemon;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using tandem::test::patternWord;

namespace {

constexpr uint64_t kKernelTimeoutNs = 10'000'000'000ull;  // every in-kernel wait gives up after 10 s
constexpr int kDevice = 0;

void cudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Polls `pred` until it holds or `timeout` passes.
bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

// True when everything queued on the stream has finished within `timeout` (the kernels' own deadlines are shorter).
bool streamFinishes(cudaStream_t s, std::chrono::milliseconds timeout) {
  cudaError_t e = cudaErrorNotReady;
  const bool done = waitFor([&] { return (e = cudaStreamQuery(s)) != cudaErrorNotReady; }, timeout);
  if (done) cudaOk(e, "a kernel of the test");
  return done;
}

kernels::DeviceBuffer deviceBuffer(uint64_t bytes, int fill) {
  kernels::DeviceBuffer b = kernels::DeviceBuffer::allocate(kDevice, bytes, "proxy gpu test buffer");
  cudaOk(cudaMemset(b.get(), fill, bytes), "cudaMemset");
  return b;
}

template <typename T>
std::vector<T> download(const void* device, uint64_t count) {
  std::vector<T> v(count);
  cudaOk(cudaMemcpy(v.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
  return v;
}

// Node 0 and node 1 of a two-node cluster on loopback, each with its own DeviceCopier (the GPU is shared).
struct Loopback {
  explicit Loopback(uint32_t connections, uint64_t chunkBytes, uint64_t bounceBytes)
      : copier0({.device = kDevice, .bounceBytes = bounceBytes, .lanes = 2}),
        copier1({.device = kDevice, .bounceBytes = bounceBytes, .lanes = 2}) {
    std::array<cuda::CudaDeviceCopier*, 2> copiers{&copier0, &copier1};
    for (NodeIndex n = 0; n < 2; ++n) {
      TcpConfig c;
      c.self = n;
      c.listenHost = "127.0.0.1";
      c.secret = "proxy-gpu-test";
      c.connectionsPerPeer = connections;
      c.ioThreads = 2;
      c.connectTimeoutMs = 5000;
      c.chunkBytes = chunkBytes;
      c.deviceCopier = copiers[n];
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
  }
  LocalRegion registerDevice(NodeIndex node, void* p, uint64_t bytes) {
    return nodes[node]->registerMemory(MemoryDesc{MemoryKind::kDevice, p, bytes});
  }

  cuda::CudaDeviceCopier copier0, copier1;
  std::array<std::unique_ptr<TcpTransport>, 2> nodes;
};

// The proxy's rejected commands, as its error handler reports them.
struct ErrorLog {
  std::mutex mutex;
  std::vector<ProxyCommandError> errors;
  std::function<void(const ProxyCommandError&)> handler() {
    return [this](const ProxyCommandError& e) {
      std::lock_guard lock(mutex);
      errors.push_back(e);
    };
  }
  std::vector<ProxyCommandError> snapshot() {
    std::lock_guard lock(mutex);
    return errors;
  }
};

uint64_t headOf(const cuda::GpuMappedProxyFifo& fifo) {
  if (!fifo.deviceHead()) return std::atomic_ref<uint64_t>(fifo.view().control()->head).load(std::memory_order_relaxed);
  return download<uint64_t>(fifo.deviceRef().head, 1)[0];
}

}  // namespace

TEST_CASE("GPU producers' writes and flags land in the peer's GPU memory through the proxy and tcp, flag after data") {
  cudaOk(cudaSetDevice(kDevice), "cudaSetDevice");
  cudaOk(test::preloadProxyTestKernels(), "loading the test's kernels");
  bool deviceHead = false;
  SUBCASE("ticket counter in the FIFO region (system-scope atomics across PCIe)") { deviceHead = false; }
  SUBCASE("ticket counter in GPU memory") { deviceHead = true; }
  constexpr int kCtas = 4, kWarpsPerCta = 4, kWarps = kCtas * kWarpsPerCta;
  constexpr uint64_t kWordsPerWarp = 64 * 1024;  // 256 KiB per warp, 4 MiB in all
  constexpr uint32_t kWritesPerWarp = 4;         // 64 KiB per write
  constexpr uint64_t kDataBytes = kWarps * kWordsPerWarp * 4, kFlagBytes = (kWarps + 1) * 8;
  constexpr uint64_t kCommandsPerRound = kWarps * (kWritesPerWarp + 1) + 1;

  // Regions first, so they outlive the transports and the proxy.
  kernels::DeviceBuffer src = deviceBuffer(kDataBytes, 0);
  kernels::DeviceBuffer dst = deviceBuffer(kDataBytes, 0);
  kernels::DeviceBuffer flags = deviceBuffer(kFlagBytes, 0);
  kernels::DeviceBuffer scratch = deviceBuffer(4096, 0);  // arrivals, status, counters
  // 128 KiB frames striped over two connections; a 64 KiB bounce buffer, so every 64 KiB write is two copies.
  Loopback net(2, 128 * 1024, 64 * 1024);
  const LocalRegion srcRegion = net.registerDevice(0, src.get(), kDataBytes);
  const LocalRegion dstRegion = net.registerDevice(1, dst.get(), kDataBytes);
  const LocalRegion flagRegion = net.registerDevice(1, flags.get(), kFlagBytes);
  auto table = std::make_shared<ProxyBufferTable>();
  table->addLocal(1, srcRegion, kDataBytes);
  table->addRemote(2, 1, RemoteKey::decode(net.nodes[1]->remoteKey(dstRegion).encode()));
  table->addRemote(3, 1, RemoteKey::decode(net.nodes[1]->remoteKey(flagRegion).encode()));

  // 64 slots for 81 commands a round: producers wait for room, and tickets wrap the ring.
  cuda::GpuMappedProxyFifo fifo = cuda::GpuMappedProxyFifo::allocate(64);
  if (deviceHead) fifo.useDeviceHead(kDevice);
  ErrorLog log;
  Proxy proxy(fifo.view(), *net.nodes[0], ProxyOptions{.name = "proxy gpu test"});
  proxy.setBufferTable(table);
  proxy.setErrorHandler(log.handler());
  proxy.start();

  kernels::CudaStream sendStream = kernels::CudaStream::create(kDevice, "producer stream");
  kernels::CudaStream recvStream = kernels::CudaStream::create(kDevice, "checker stream");
  auto* arrivals = static_cast<uint64_t*>(scratch.get());
  auto* status = reinterpret_cast<uint32_t*>(static_cast<std::byte*>(scratch.get()) + 64);
  auto* mismatches = reinterpret_cast<uint32_t*>(static_cast<std::byte*>(scratch.get()) + 1024);
  auto* timeouts = mismatches + 1;

  for (uint32_t round = 1; round <= 2; ++round) {
    CAPTURE(round);
    cudaOk(cudaMemset(scratch.get(), 0, 4096), "cudaMemset");
    // The checker spins first: it must see each flag only after its data, whatever the timing.
    const test::CheckParams cp{static_cast<const uint64_t*>(flags.get()), static_cast<const uint32_t*>(dst.get()),
                               kWordsPerWarp, kWarps, round, kKernelTimeoutNs, mismatches, timeouts};
    cudaOk(test::launchChecker(cp, recvStream.get()), "launch checker");
    test::ProducerParams pp{};
    pp.fifo = fifo.deviceRef();
    pp.src = static_cast<uint32_t*>(src.get());
    pp.wordsPerWarp = kWordsPerWarp;
    pp.writesPerWarp = kWritesPerWarp;
    pp.round = round;
    pp.peer = 1;
    pp.srcBuffer = 1;
    pp.dstBuffer = 2;
    pp.flagBuffer = 3;
    pp.timeoutNs = kKernelTimeoutNs;
    pp.arrivals = arrivals;
    pp.status = status;
    cudaOk(test::launchProducer(pp, kCtas, kWarpsPerCta, sendStream.get()), "launch producer");
    REQUIRE_MESSAGE(streamFinishes(sendStream.get(), 30s), "the producer kernel did not finish within 30 s");
    REQUIRE_MESSAGE(streamFinishes(recvStream.get(), 30s), "the checker kernel did not finish within 30 s");

    const auto st = download<uint32_t>(status, kWarps + 1);
    for (int w = 0; w <= kWarps; ++w) {
      CAPTURE(w);
      CHECK(st[w] == test::kPushOk);
    }
    const auto counters = download<uint32_t>(mismatches, 2);
    CHECK_MESSAGE(counters[1] == 0, counters[1], " of ", kWarps + 1, " flags never arrived (head ", headOf(fifo),
                  ", expected ", round * kCommandsPerRound, ")");
    CHECK_MESSAGE(counters[0] == 0, counters[0], " words differ after their flag was seen");
    CHECK(headOf(fifo) == round * kCommandsPerRound);
    CHECK(waitFor([&] { return proxy.stats().popped == round * kCommandsPerRound; }, 5s));
    // Each round's flag values go up, so the host's copy of the final flag says this round landed.
    CHECK(download<uint64_t>(static_cast<std::byte*>(flags.get()) + kWarps * 8, 1)[0] == round);
  }
  const ProxyStats stats = proxy.stats();
  CHECK(stats.rejected == 0);
  CHECK(stats.failed == 0);
  CHECK(log.snapshot().empty());
  CHECK(fifo.view().errors() == 0);
  // Both directions went through the copiers: the sources out of GPU memory, the data and flags into it.
  CHECK(net.copier0.bytesCopied() == 2 * kDataBytes);
  CHECK(net.copier1.bytesCopied() == 2 * (kDataBytes + 8 * (kWarps + 1)));
  proxy.stop();
}

TEST_CASE("The CUDA DeviceCopier copies both ways in chunks, from several threads at once") {
  cudaOk(cudaSetDevice(kDevice), "cudaSetDevice");
  cudaOk(test::preloadProxyTestKernels(), "loading the test's kernels");
  cuda::CudaDeviceCopier copier({.device = kDevice, .bounceBytes = 64 * 1024, .lanes = 2});
  const std::vector<uint64_t> sizes{1, 8, 4095, 32 * 1024, 32 * 1024 + 1, 64 * 1024, 64 * 1024 + 7, 1024 * 1024 + 3};
  constexpr int kThreads = 4;
  std::vector<kernels::DeviceBuffer> buffers;
  for (int t = 0; t < kThreads; ++t) buffers.push_back(deviceBuffer(sizes.back(), 0));
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int rep = 0; rep < 3; ++rep) {
          for (uint64_t n : sizes) {
            std::vector<uint8_t> out(n), back(n, 0);
            for (uint64_t i = 0; i < n; ++i)
              out[i] = static_cast<uint8_t>(i * 131 + n + static_cast<uint64_t>(t) * 7 + static_cast<uint64_t>(rep));
            copier.toDevice(buffers[t].get(), out.data(), n);
            copier.toHost(back.data(), buffers[t].get(), n);
            if (back != out) {
              const auto at = std::mismatch(out.begin(), out.end(), back.begin()).first - out.begin();
              failures[t] = "round trip of " + std::to_string(n) + " bytes differs at byte " + std::to_string(at);
              return;
            }
          }
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    CAPTURE(t);
    CHECK(failures[t].empty());
    INFO(failures[t]);
  }
  CHECK(copier.copies() == 2u * kThreads * 3 * sizes.size());
  // Nothing to copy is no error; a null pointer with bytes is.
  copier.toDevice(nullptr, nullptr, 0);
  std::array<uint8_t, 8> host{};
  try {
    copier.toHost(host.data(), nullptr, 8);
    FAIL("toHost from a null device pointer did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("Malformed commands from the GPU are rejected and counted in the errors word it reads; the next one lands") {
  cudaOk(cudaSetDevice(kDevice), "cudaSetDevice");
  cudaOk(test::preloadProxyTestKernels(), "loading the test's kernels");
  constexpr uint64_t kBytes = 64 * 1024;
  constexpr uint64_t kGoodOffset = 1024;
  constexpr uint32_t kGoodBytes = 4096;
  constexpr uint64_t kFlagValue = 77;
  kernels::DeviceBuffer src = deviceBuffer(kBytes, 0);
  kernels::DeviceBuffer dst = deviceBuffer(kBytes, 0xEE);
  kernels::DeviceBuffer flag = deviceBuffer(4096, 0);
  kernels::DeviceBuffer out = deviceBuffer(4096, 0);
  std::vector<uint8_t> pattern(kBytes);
  for (uint64_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 3);
  cudaOk(cudaMemcpy(src.get(), pattern.data(), kBytes, cudaMemcpyHostToDevice), "cudaMemcpy");

  Loopback net(1, 512 * 1024, 1024 * 1024);
  const LocalRegion srcRegion = net.registerDevice(0, src.get(), kBytes);
  const LocalRegion dstRegion = net.registerDevice(1, dst.get(), kBytes);
  const LocalRegion flagRegion = net.registerDevice(1, flag.get(), 4096);
  auto table = std::make_shared<ProxyBufferTable>();
  table->addLocal(1, srcRegion, kBytes);
  table->addRemote(2, 1, net.nodes[1]->remoteKey(dstRegion));
  table->addRemote(3, 1, net.nodes[1]->remoteKey(flagRegion));

  // The FIFO as the cluster makes it (a memfd, mapped shared, formatted), then registered for the GPU.
  const uint64_t fifoBytes = ProxyFifoLayout::bytesFor(64);
  Fd fifoFd = Fd::memfd("proxy-gpu-test-fifo", fifoBytes);
  Mapping fifoMapping = Mapping::shared(fifoFd.get(), fifoBytes);
  ProxyFifoView::format(fifoMapping.data(), fifoBytes, 64);
  cuda::GpuMappedProxyFifo fifo = cuda::GpuMappedProxyFifo::map(fifoMapping.data(), fifoBytes);
  ErrorLog log;
  Proxy proxy(fifo.view(), *net.nodes[0], ProxyOptions{.name = "proxy gpu test"});
  proxy.setBufferTable(table);
  proxy.setErrorHandler(log.handler());
  proxy.start();

  kernels::CudaStream stream = kernels::CudaStream::create(kDevice, "malformed stream");
  auto* outWords = static_cast<uint64_t*>(out.get());
  auto* waitResult = reinterpret_cast<uint32_t*>(outWords + 8);
  test::MalformedParams mp{};
  mp.fifo = fifo.deviceRef();
  mp.peer = 1;
  mp.srcBuffer = 1;
  mp.dstBuffer = 2;
  mp.flagBuffer = 3;
  mp.unknownBuffer = 9;
  mp.dstBytes = kBytes;
  mp.goodOffset = kGoodOffset;
  mp.goodBytes = kGoodBytes;
  mp.flagValue = kFlagValue;
  mp.timeoutNs = kKernelTimeoutNs;
  mp.out = outWords;
  cudaOk(test::launchMalformed(mp, stream.get()), "launch malformed");
  cudaOk(test::launchWaitFlag(static_cast<const uint64_t*>(flag.get()), kFlagValue, kKernelTimeoutNs, waitResult,
                              stream.get()),
         "launch wait");
  REQUIRE_MESSAGE(streamFinishes(stream.get(), 30s), "the malformed-command kernels did not finish within 30 s");

  const auto o = download<uint64_t>(outWords, 4);
  CHECK(o[0] == 0);
  CHECK_MESSAGE(o[1] == 3, "the GPU read errors = ", o[1], " after three malformed commands");
  CHECK(o[2] == test::kPushOk);
  CHECK(o[3] == test::kPushOk);
  CHECK(download<uint32_t>(waitResult, 1)[0] == 1);
  CHECK(fifo.view().errors() == 3);
  const ProxyStats stats = proxy.stats();
  CHECK(stats.rejected == 3);
  CHECK(stats.posted == 2);
  const auto errors = log.snapshot();
  REQUIRE(errors.size() == 3);
  CHECK(errors[0].ticket == 0);
  CHECK(errors[0].code == ErrorCode::kNotFound);  // unknown destination buffer id
  CHECK(errors[1].code == ErrorCode::kInvalidArgument);  // past the end of the destination
  CHECK(errors[1].message.find("remote buffer 2") != std::string::npos);
  CHECK(errors[2].code == ErrorCode::kInvalidArgument);  // opcode 7
  CHECK(errors[2].message.find("unknown opcode 7") != std::string::npos);

  // Only the good write landed: every other byte keeps the fill.
  const auto landed = download<uint8_t>(dst.get(), kBytes);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kBytes; ++i) {
    const bool good = i >= kGoodOffset && i < kGoodOffset + kGoodBytes;
    wrong += landed[i] != (good ? pattern[i - kGoodOffset] : uint8_t{0xEE});
  }
  CHECK_MESSAGE(wrong == 0, wrong, " bytes of the destination are not what only the good write leaves");
  proxy.stop();
}

TEST_CASE("A GPU producer never hangs: on a full FIFO it returns at the stop word or its deadline, too large at once") {
  cudaOk(cudaSetDevice(kDevice), "cudaSetDevice");
  cudaOk(test::preloadProxyTestKernels(), "loading the test's kernels");
  constexpr uint32_t kCapacity = 8;
  // No proxy drains this FIFO: after kCapacity commands the next push has no room.
  cuda::GpuMappedProxyFifo fifo = cuda::GpuMappedProxyFifo::allocate(kCapacity);
  kernels::PinnedHostBuffer words = kernels::PinnedHostBuffer::allocate(4096, "blocked test words");
  auto* hostWords = static_cast<std::byte*>(words.get());
  auto* devWords = static_cast<std::byte*>(words.devicePtr());
  auto& progress = *reinterpret_cast<uint32_t*>(hostWords);
  auto& status = *reinterpret_cast<uint32_t*>(hostWords + 128);
  auto& elapsed = *reinterpret_cast<uint64_t*>(hostWords + 256);
  kernels::CudaStream stream = kernels::CudaStream::create(kDevice, "blocked stream");
  test::BlockedParams bp{fifo.deviceRef(), kCapacity, 0, reinterpret_cast<uint32_t*>(devWords),
                         reinterpret_cast<uint32_t*>(devWords + 128), reinterpret_cast<uint64_t*>(devWords + 256)};
  // acquire: pairs with the kernel's st.release.sys of the word.
  auto load = [](uint32_t& w) { return std::atomic_ref<uint32_t>(w).load(std::memory_order_acquire); };

  SUBCASE("the stop word set while it waits") {
    bp.timeoutNs = 20'000'000'000ull;  // only the stop word can end this wait within the test's 10 s deadlines
    cudaOk(test::launchBlocked(bp, stream.get()), "launch blocked");
    REQUIRE_MESSAGE(waitFor([&] { return load(progress) == kCapacity; }, 10s), "the kernel did not fill the FIFO");
    // The extra push has claimed its ticket: it is waiting for room now.
    REQUIRE(waitFor([&] { return std::atomic_ref<uint64_t>(fifo.view().control()->head).load() == kCapacity + 1; },
                    10s));
    CHECK(load(status) == 0);
    fifo.view().requestStop();
    REQUIRE_MESSAGE(streamFinishes(stream.get(), 10s), "the blocked kernel did not return after the stop word");
    CHECK(load(status) == test::kPushStopped);
  }
  SUBCASE("past its deadline") {
    bp.timeoutNs = 200'000'000ull;  // 200 ms
    cudaOk(test::launchBlocked(bp, stream.get()), "launch blocked");
    REQUIRE_MESSAGE(streamFinishes(stream.get(), 10s), "the blocked kernel did not return at its deadline");
    CHECK(load(status) == test::kPushTimeout);
    const uint64_t waited = std::atomic_ref<uint64_t>(elapsed).load(std::memory_order_acquire);
    CHECK(waited >= bp.timeoutNs);
    CHECK(waited < 5'000'000'000ull);
    CHECK_FALSE(fifo.view().stopRequested());
  }
  SUBCASE("a batch larger than the FIFO is refused and claims nothing") {
    cudaOk(test::launchTooLarge(fifo.deviceRef(), reinterpret_cast<uint32_t*>(devWords + 512), stream.get()),
           "launch too large");
    REQUIRE_MESSAGE(streamFinishes(stream.get(), 10s), "the too-large kernel did not return");
    CHECK(std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(hostWords + 512)).load() == test::kPushTooLarge);
    CHECK(std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(hostWords + 516)).load() == test::kPushTooLarge);
    CHECK(std::atomic_ref<uint64_t>(fifo.view().control()->head).load() == 0);
  }
}
