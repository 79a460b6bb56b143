#include "proxy_push_host.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "cuda/device_copier.hpp"
#include "cuda/proxy_fifo_mapping.hpp"
#include "transport/proxy_fifo.hpp"
#include "transport/tcp_transport.hpp"
#include "transport/transport.hpp"

namespace tandem::bench {

using namespace tandem::daemon;
using namespace tandem::daemon::transport;

struct PushBenchProxy::Impl {
  cuda::GpuMappedProxyFifo fifo;
  NullTransport net{0, 2};
  std::unique_ptr<Proxy> proxy;
};

PushBenchProxy::PushBenchProxy(uint32_t capacity, bool deviceHead, int device, uint32_t maxBatch, bool spin)
    : impl_(std::make_unique<Impl>()) {
  impl_->fifo = cuda::GpuMappedProxyFifo::allocate(capacity);
  if (deviceHead) impl_->fifo.useDeviceHead(device);
  ProxyOptions o;
  o.name = "proxy push bench";
  o.maxBatch = maxBatch;
  if (spin) o.idleSpins = std::numeric_limits<uint32_t>::max();
  impl_->proxy = std::make_unique<Proxy>(impl_->fifo.view(), impl_->net, o);
  auto table = std::make_shared<ProxyBufferTable>();
  // As fifo_bench: the NullTransport keeps no bytes, so any offset of a 2^48-byte buffer is in bounds.
  table->addLocal(1, LocalRegion{1}, kProxyMaxOffset + 1);
  table->addRemote(1, 1, RemoteKey{TransportKind::kNull, 1, 1, 0, 0, uint64_t{1} << 40});
  impl_->proxy->setBufferTable(table);
  impl_->proxy->start();
}

PushBenchProxy::~PushBenchProxy() {
  if (impl_ && impl_->proxy) impl_->proxy->stop();
}

::tandem::proxy::ProxyFifoDeviceRef PushBenchProxy::ref() const { return impl_->fifo.deviceRef(); }

PushBenchStats PushBenchProxy::stats() const {
  const ProxyStats s = impl_->proxy->stats();
  return PushBenchStats{s.popped, s.posted, s.rejected, s.failed, s.submits};
}

uint64_t PushBenchProxy::errorsWord() const { return impl_->fifo.view().errors(); }

uint64_t PushBenchProxy::head() const {
  if (!impl_->fifo.deviceHead())
    return std::atomic_ref<uint64_t>(impl_->fifo.view().control()->head).load(std::memory_order_relaxed);
  uint64_t h = 0;
  kernels::checkCuda(cudaMemcpy(&h, impl_->fifo.deviceRef().head, sizeof h, cudaMemcpyDeviceToHost),
                     "cudaMemcpy(proxy fifo device head)");
  return h;
}

void PushBenchProxy::requestStop() { impl_->fifo.view().requestStop(); }

std::vector<uint64_t> PushBenchProxy::hostRoundTrips(uint32_t samples) {
  if (impl_->fifo.deviceHead()) return {};  // host producers use the region's head: not with a GPU-memory counter
  ProxyFifoProducer producer(impl_->fifo.view());
  std::vector<uint64_t> out;
  out.reserve(samples);
  using Clock = std::chrono::steady_clock;
  for (uint32_t i = 0; i < samples; ++i) {
    const auto t0 = Clock::now();
    const uint64_t ticket = producer.pushWrite(1, 1, 0, 1, 0, 4096, true);
    const auto deadline = t0 + std::chrono::seconds(5);
    while (impl_->fifo.view().completed() <= ticket) {
      if (Clock::now() > deadline) return out;  // the proxy is stuck: report what was measured
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    out.push_back(static_cast<uint64_t>(ns));
  }
  return out;
}

struct TcpPipeBench::Impl {
  // Declared in creation order: the regions outlive the transports, the transports the proxy.
  kernels::DeviceBuffer src, dst, flag;
  std::unique_ptr<cuda::CudaDeviceCopier> copier0, copier1;
  std::unique_ptr<TcpTransport> node0, node1;
  cuda::GpuMappedProxyFifo fifo;
  std::unique_ptr<Proxy> proxy;
};

TcpPipeBench::TcpPipeBench(int device, uint64_t bytes, uint32_t connections) : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  im.src = kernels::DeviceBuffer::allocate(device, bytes, "tcp pipe source");
  im.dst = kernels::DeviceBuffer::allocate(device, bytes, "tcp pipe destination");
  im.flag = kernels::DeviceBuffer::allocate(device, 8, "tcp pipe flag");
  {
    kernels::CudaDeviceGuard guard(device);
    kernels::checkCuda(cudaMemset(im.flag.get(), 0, 8), "cudaMemset(tcp pipe flag)");
  }
  im.copier0 = std::make_unique<cuda::CudaDeviceCopier>(
      cuda::DeviceCopierOptions{.device = device, .lanes = std::max<uint32_t>(2, connections)});
  im.copier1 = std::make_unique<cuda::CudaDeviceCopier>(
      cuda::DeviceCopierOptions{.device = device, .lanes = std::max<uint32_t>(2, connections)});
  auto config = [&](NodeIndex n, cuda::CudaDeviceCopier* copier) {
    TcpConfig c;
    c.self = n;
    c.listenHost = "127.0.0.1";
    c.secret = "proxy-push-bench";
    c.connectionsPerPeer = connections;
    c.ioThreads = connections;
    c.deviceCopier = copier;
    return c;
  };
  im.node0 = std::make_unique<TcpTransport>(config(0, im.copier0.get()));
  im.node1 = std::make_unique<TcpTransport>(config(1, im.copier1.get()));
  const std::vector<NodeAddress> addrs{{"127.0.0.1", im.node0->listenPort()}, {"127.0.0.1", im.node1->listenPort()}};
  std::string error;
  std::thread other([&] {
    try {
      im.node1->connect(addrs);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  im.node0->connect(addrs);
  other.join();
  if (!error.empty()) throw std::runtime_error("tcp pipe: node 1 did not connect: " + error);
  const LocalRegion s = im.node0->registerMemory({MemoryKind::kDevice, im.src.get(), bytes});
  const LocalRegion d = im.node1->registerMemory({MemoryKind::kDevice, im.dst.get(), bytes});
  const LocalRegion f = im.node1->registerMemory({MemoryKind::kDevice, im.flag.get(), 8});
  auto table = std::make_shared<ProxyBufferTable>();
  table->addLocal(kSrc, s, bytes);
  table->addRemote(kDst, 1, im.node1->remoteKey(d));
  table->addRemote(kFlag, 1, im.node1->remoteKey(f));
  im.fifo = cuda::GpuMappedProxyFifo::allocate(4096);
  im.fifo.useDeviceHead(device);
  ProxyOptions o;
  o.name = "proxy tcp bench";
  im.proxy = std::make_unique<Proxy>(im.fifo.view(), *im.node0, o);
  im.proxy->setBufferTable(table);
  im.proxy->start();
}

TcpPipeBench::~TcpPipeBench() {
  if (impl_ && impl_->proxy) impl_->proxy->stop();
}

::tandem::proxy::ProxyFifoDeviceRef TcpPipeBench::ref() const { return impl_->fifo.deviceRef(); }
const uint64_t* TcpPipeBench::flag() const { return static_cast<const uint64_t*>(impl_->flag.get()); }
PushBenchStats TcpPipeBench::stats() const {
  const ProxyStats s = impl_->proxy->stats();
  return PushBenchStats{s.popped, s.posted, s.rejected, s.failed, s.submits};
}

std::vector<CopierRow> copierRows(int device, const std::vector<uint64_t>& sizes) {
  using Clock = std::chrono::steady_clock;
  cuda::CudaDeviceCopier copier(cuda::DeviceCopierOptions{.device = device});
  std::vector<CopierRow> rows;
  for (uint64_t bytes : sizes) {
    std::vector<std::byte> host(bytes, std::byte{1});
    kernels::DeviceBuffer dev = kernels::DeviceBuffer::allocate(device, bytes, "copier bench buffer");
    CopierRow r;
    r.bytes = bytes;
    r.copies = static_cast<uint32_t>(std::clamp<uint64_t>((uint64_t{256} << 20) / bytes, 20, 2000));
    auto time = [&](auto&& copy) {
      copy();  // warm-up
      const auto t0 = Clock::now();
      for (uint32_t i = 0; i < r.copies; ++i) copy();
      return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / r.copies;
    };
    r.toDeviceUs = time([&] { copier.toDevice(dev.get(), host.data(), bytes); });
    r.toHostUs = time([&] { copier.toHost(host.data(), dev.get(), bytes); });
    kernels::CudaDeviceGuard guard(device);
    r.memcpyToDeviceUs = time([&] {
      kernels::checkCuda(cudaMemcpy(dev.get(), host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    });
    r.memcpyToHostUs = time([&] {
      kernels::checkCuda(cudaMemcpy(host.data(), dev.get(), bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    });
    rows.push_back(r);
  }
  return rows;
}

}  // namespace tandem::bench
