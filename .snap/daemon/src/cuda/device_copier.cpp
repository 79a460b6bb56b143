#include "cuda/device_copier.hpp"

#include <algorithm>
#include <cstring>

namespace tandem::daemon::cuda {

using kernels::checkCuda;

CudaDeviceCopier::CudaDeviceCopier(DeviceCopierOptions options) : options_(options) {
  if (options_.bounceBytes < 2)
    fail(ErrorCode::kInvalidArgument, "device copier: bounceBytes {} is too small; give at least 2 (two slots), "
         "e.g. the tcp transport's chunkBytes times two", options_.bounceBytes);
  if (options_.chunkBytes == 0)
    fail(ErrorCode::kInvalidArgument, "device copier: chunkBytes must be > 0 (e.g. 128 KiB)");
  if (options_.lanes == 0 || options_.lanes > 64)
    fail(ErrorCode::kInvalidArgument, "device copier: lanes {} outside [1, 64]", options_.lanes);
  chunk_ = std::min(options_.chunkBytes, options_.bounceBytes / 2);
  slots_ = static_cast<uint32_t>(std::min<uint64_t>(options_.bounceBytes / chunk_, 64));
  lanes_.reserve(options_.lanes);
  for (uint32_t i = 0; i < options_.lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->bounce = kernels::PinnedHostBuffer::allocate(chunk_ * slots_, "device copier bounce buffer");
    lane->stream = kernels::CudaStream::create(options_.device, "device copier stream");
    for (uint32_t k = 0; k < slots_; ++k)
      lane->done.push_back(kernels::CudaEvent::create(options_.device, "device copier event"));
    lanes_.push_back(std::move(lane));
  }
}

CudaDeviceCopier::~CudaDeviceCopier() = default;

std::unique_lock<std::mutex> CudaDeviceCopier::takeLane(Lane*& lane) {
  const auto n = static_cast<uint32_t>(lanes_.size());
  const uint32_t start = nextLane_.fetch_add(1, std::memory_order_relaxed) % n;
  for (uint32_t i = 0; i < n; ++i) {
    Lane& l = *lanes_[(start + i) % n];
    std::unique_lock lock(l.mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      lane = &l;
      return lock;
    }
  }
  lane = lanes_[start].get();  // all busy: queue on one, spreading waiters over the lanes
  return std::unique_lock(lane->mutex);
}

void CudaDeviceCopier::drain(Lane& lane) noexcept {
  kernels::reportRelease(cudaStreamSynchronize(lane.stream.get()),
                         "device copier: draining its stream after a failure");
}

void CudaDeviceCopier::toDevice(void* device, const void* host, uint64_t bytes) {
  if (bytes == 0) return;
  if (device == nullptr || host == nullptr)
    fail(ErrorCode::kInvalidArgument, "device copier: copy of {} bytes to the GPU with a null pointer", bytes);
  Lane* lane = nullptr;
  const std::unique_lock lock = takeLane(lane);
  kernels::CudaDeviceGuard guard(options_.device);
  auto* dst = static_cast<std::byte*>(device);
  const auto* src = static_cast<const std::byte*>(host);
  auto* bounce = static_cast<std::byte*>(lane->bounce.get());
  cudaStream_t stream = lane->stream.get();
  try {
    uint64_t k = 0;
    for (uint64_t off = 0; off < bytes; off += chunk_, ++k) {
      const uint64_t n = std::min(chunk_, bytes - off);
      const auto s = static_cast<uint32_t>(k % slots_);
      // The DMA that read this slot one lap ago must be done before the slot is refilled.
      if (k >= slots_)
        checkCuda(cudaEventSynchronize(lane->done[s].get()), "cudaEventSynchronize (device copier, GPU {})",
                  options_.device);
      std::memcpy(bounce + s * chunk_, src + off, n);
      checkCuda(cudaMemcpyAsync(dst + off, bounce + s * chunk_, n, cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync(host -> GPU {}, {} bytes at offset {} of {})", options_.device, n, off, bytes);
      if (off + slots_ * chunk_ < bytes)  // only a slot that a later chunk of this copy refills needs the event
        checkCuda(cudaEventRecord(lane->done[s].get(), stream), "cudaEventRecord (device copier, GPU {})",
                  options_.device);
    }
    checkCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (device copier, host -> GPU {}, {} bytes)",
              options_.device, bytes);
  } catch (...) {
    drain(*lane);
    throw;
  }
  copies_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void CudaDeviceCopier::toHost(void* host, const void* device, uint64_t bytes) {
  if (bytes == 0) return;
  if (device == nullptr || host == nullptr)
    fail(ErrorCode::kInvalidArgument, "device copier: copy of {} bytes from the GPU with a null pointer", bytes);
  Lane* lane = nullptr;
  const std::unique_lock lock = takeLane(lane);
  kernels::CudaDeviceGuard guard(options_.device);
  auto* dst = static_cast<std::byte*>(host);
  const auto* src = static_cast<const std::byte*>(device);
  auto* bounce = static_cast<std::byte*>(lane->bounce.get());
  cudaStream_t stream = lane->stream.get();
  const uint64_t chunks = (bytes + chunk_ - 1) / chunk_;
  // Copies chunk `next` out of its slot once its DMA is done.
  uint64_t next = 0;
  auto drainOne = [&] {
    const auto s = static_cast<uint32_t>(next % slots_);
    checkCuda(cudaEventSynchronize(lane->done[s].get()), "cudaEventSynchronize (device copier, GPU {})",
              options_.device);
    const uint64_t off = next * chunk_;
    std::memcpy(dst + off, bounce + s * chunk_, std::min(chunk_, bytes - off));
    ++next;
  };
  try {
    // DMAs run up to a lap of slots ahead of the host's copies out.
    for (uint64_t k = 0; k < chunks; ++k) {
      if (k - next == slots_) drainOne();  // chunk k's slot still holds chunk k - slots_
      const uint64_t off = k * chunk_;
      const uint64_t n = std::min(chunk_, bytes - off);
      const auto s = static_cast<uint32_t>(k % slots_);
      checkCuda(cudaMemcpyAsync(bounce + s * chunk_, src + off, n, cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync(GPU {} -> host, {} bytes at offset {} of {})", options_.device, n, off, bytes);
      checkCuda(cudaEventRecord(lane->done[s].get(), stream), "cudaEventRecord (device copier, GPU {})",
                options_.device);
    }
    while (next < chunks) drainOne();
  } catch (...) {
    drain(*lane);
    throw;
  }
  copies_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace tandem::daemon::cuda
