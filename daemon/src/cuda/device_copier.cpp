#include "cuda/device_copier.hpp"

#include <algorithm>
#include <cstring>

namespace tandem::daemon::cuda {

using kernels::checkCuda;

CudaDeviceCopier::CudaDeviceCopier(DeviceCopierOptions options) : options_(options) {
  if (options_.bounceBytes < 2)
    fail(ErrorCode::kInvalidArgument, "device copier: bounceBytes {} is too small; give at least 2 (two halves), "
         "e.g. the tcp transport's chunkBytes times two", options_.bounceBytes);
  if (options_.lanes == 0 || options_.lanes > 64)
    fail(ErrorCode::kInvalidArgument, "device copier: lanes {} outside [1, 64]", options_.lanes);
  half_ = options_.bounceBytes / 2;
  lanes_.reserve(options_.lanes);
  for (uint32_t i = 0; i < options_.lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->bounce = kernels::PinnedHostBuffer::allocate(half_ * 2, "device copier bounce buffer");
    lane->stream = kernels::CudaStream::create(options_.device, "device copier stream");
    lane->done[0] = kernels::CudaEvent::create(options_.device, "device copier event");
    lane->done[1] = kernels::CudaEvent::create(options_.device, "device copier event");
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
    uint32_t k = 0;
    for (uint64_t off = 0; off < bytes; off += half_, ++k) {
      const uint64_t n = std::min(half_, bytes - off);
      const uint32_t h = k & 1;
      // The DMA that read this half two chunks ago must be done before the half is refilled.
      if (k >= 2) checkCuda(cudaEventSynchronize(lane->done[h].get()), "cudaEventSynchronize (device copier, GPU {})",
                            options_.device);
      std::memcpy(bounce + h * half_, src + off, n);
      checkCuda(cudaMemcpyAsync(dst + off, bounce + h * half_, n, cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync(host -> GPU {}, {} bytes at offset {} of {})", options_.device, n, off, bytes);
      if (off + n < bytes)
        checkCuda(cudaEventRecord(lane->done[h].get(), stream), "cudaEventRecord (device copier, GPU {})",
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
  try {
    // Chunk k lands in half k&1 while the host copies chunk k-1 out of the other half.
    uint64_t prevOff = 0, prevN = 0;
    uint32_t k = 0;
    for (uint64_t off = 0; off < bytes; off += half_, ++k) {
      const uint64_t n = std::min(half_, bytes - off);
      const uint32_t h = k & 1;
      checkCuda(cudaMemcpyAsync(bounce + h * half_, src + off, n, cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync(GPU {} -> host, {} bytes at offset {} of {})", options_.device, n, off, bytes);
      checkCuda(cudaEventRecord(lane->done[h].get(), stream), "cudaEventRecord (device copier, GPU {})",
                options_.device);
      if (k >= 1) {
        checkCuda(cudaEventSynchronize(lane->done[h ^ 1].get()), "cudaEventSynchronize (device copier, GPU {})",
                  options_.device);
        std::memcpy(dst + prevOff, bounce + (h ^ 1) * half_, prevN);
      }
      prevOff = off;
      prevN = n;
    }
    checkCuda(cudaEventSynchronize(lane->done[(k - 1) & 1].get()), "cudaEventSynchronize (device copier, GPU {})",
              options_.device);
    std::memcpy(dst + prevOff, bounce + ((k - 1) & 1) * half_, prevN);
  } catch (...) {
    drain(*lane);
    throw;
  }
  copies_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace tandem::daemon::cuda
