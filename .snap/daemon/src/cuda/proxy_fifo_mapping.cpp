#include "cuda/proxy_fifo_mapping.hpp"

namespace tandem::daemon::cuda {

using kernels::checkCuda;
using transport::ProxyCommand;
using transport::ProxyFifoControl;
using transport::ProxyFifoLayout;
using transport::ProxyFifoView;

GpuMappedProxyFifo GpuMappedProxyFifo::allocate(uint32_t capacity) {
  GpuMappedProxyFifo f;
  // Check the capacity before allocating (format checks it too, but after cudaHostAlloc of a bogus size).
  if (!transport::fifo::isPowerOfTwo(capacity) || capacity < transport::kProxyFifoMinCapacity ||
      capacity > transport::kProxyFifoMaxCapacity)
    fail(ErrorCode::kInvalidArgument, "gpu proxy fifo: capacity {} must be a power of two in [{}, {}]", capacity,
         transport::kProxyFifoMinCapacity, transport::kProxyFifoMaxCapacity);
  const uint64_t bytes = ProxyFifoLayout::bytesFor(capacity);
  f.owned_ = kernels::PinnedHostBuffer::allocate(bytes, "proxy fifo");
  auto* base = static_cast<std::byte*>(f.owned_.get());
  f.view_ = ProxyFifoView::format(base, bytes, capacity);
  f.setDeviceRef(static_cast<std::byte*>(f.owned_.devicePtr()));
  return f;
}

GpuMappedProxyFifo GpuMappedProxyFifo::map(std::byte* base, uint64_t bytes) {
  GpuMappedProxyFifo f;
  f.view_ = ProxyFifoView::attach(base, bytes);  // throws kProtocol before anything is registered
  f.registration_ = kernels::HostRegistration::create(base, bytes, "proxy fifo");
  f.setDeviceRef(static_cast<std::byte*>(f.registration_.devicePtr()));
  return f;
}

void GpuMappedProxyFifo::setDeviceRef(std::byte* deviceBase) {
  ref_.control = reinterpret_cast<ProxyFifoControl*>(deviceBase + ProxyFifoLayout::kControlOffset);
  ref_.slots = reinterpret_cast<ProxyCommand*>(deviceBase + ProxyFifoLayout::kSlotsOffset);
  ref_.head = &ref_.control->head;
  ref_.capacity = view_.capacity();
}

void GpuMappedProxyFifo::useDeviceHead(int device) {
  deviceHead_ = kernels::DeviceBuffer::allocate(device, sizeof(uint64_t), "proxy fifo device head");
  kernels::CudaDeviceGuard guard(device);
  // The region's head may have moved already (a fresh region starts at 0): start where it is, so tickets stay unique.
  const uint64_t start = std::atomic_ref<uint64_t>(view_.control()->head).load(std::memory_order_acquire);
  checkCuda(cudaMemcpy(deviceHead_.get(), &start, sizeof start, cudaMemcpyHostToDevice),
            "cudaMemcpy(proxy fifo device head on GPU {})", device);
  ref_.head = static_cast<uint64_t*>(deviceHead_.get());
}

}  // namespace tandem::daemon::cuda
