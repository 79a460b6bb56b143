#include "proxy_push_host.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <thread>

#include "cuda/device_copier.hpp"
#include "cuda/proxy_fifo_mapping.hpp"
#include "transport/proxy_fifo.hpp"
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
