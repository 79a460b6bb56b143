// The CUDA DeviceCopier: how the tcp transport stages GPU memory through host memory (transport.hpp's DeviceCopier).
// The sender's proxy thread copies a kDevice source to host memory before the bytes go on the socket (toHost); the
// receiver's io threads copy a landed payload, and then its flag, into GPU memory (toDevice).
//
// Each copy goes through pinned bounce memory (cudaHostAlloc) on a non-blocking stream of the regions' GPU, so that
// it is a true DMA that runs while kernels spin (a kernel on the same GPU polling the flag this copier writes must not
// wait for the copy, nor the copy for it), and it is synchronous as the interface requires: when toHost / toDevice
// return, the bytes are at the destination, so a flag copied after its data is observed after it. A copy is cut into
// chunks of chunkBytes that cycle through the bounce buffer's slots: the host-side memcpy of one chunk overlaps the DMA
// of the ones before it (so a 512 KiB tcp frame costs about its memcpy plus one chunk's DMA, not both in full).
//
// Thread-safe: the copier holds `lanes` independent (bounce buffer, stream) pairs, and a call takes a free one (or
// waits for one), so the proxy's sends and the io threads' receives do not queue behind each other.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tandem/kernels/cuda_raii.hpp"
#include "transport/transport.hpp"

namespace tandem::daemon::cuda {

struct DeviceCopierOptions {
  int device = 0;                      ///< the GPU whose memory the registered kDevice regions live in
  uint64_t bounceBytes = 1024 * 1024;  ///< pinned bytes per lane (>= 2); 1 MiB: two of the tcp transport's 512 KiB frames
  uint64_t chunkBytes = 128 * 1024;    ///< pipeline piece; at most half of bounceBytes (larger values are clamped)
  uint32_t lanes = 2;                  ///< concurrent copies (1..64); each lane owns a bounce buffer and a stream
};

/// See the file comment. RAII: the constructor acquires every lane's resources (and throws Error(kCuda) naming the
/// call that failed, or Error(kInvalidArgument) for bad options); the destructor releases them and must not run while
/// a copy is in flight (the transport that uses it is destroyed first).
class CudaDeviceCopier final : public transport::DeviceCopier {
 public:
  explicit CudaDeviceCopier(DeviceCopierOptions options = {});
  ~CudaDeviceCopier() override;
  CudaDeviceCopier(const CudaDeviceCopier&) = delete;
  CudaDeviceCopier& operator=(const CudaDeviceCopier&) = delete;

  /// Copies `bytes` from GPU memory to host memory (any host memory: pageable or pinned). Synchronous.
  /// @throws Error(kInvalidArgument) for a null pointer with bytes > 0; Error(kCuda) naming the failed call.
  void toHost(void* host, const void* device, uint64_t bytes) override;
  /// Copies `bytes` from host memory to GPU memory. Synchronous: the bytes are in GPU memory when it returns.
  /// @throws as toHost.
  void toDevice(void* device, const void* host, uint64_t bytes) override;

  int device() const { return options_.device; }
  /// Copies made so far and bytes moved, both directions (for logs and tests).
  uint64_t copies() const { return copies_.load(std::memory_order_relaxed); }
  uint64_t bytesCopied() const { return bytes_.load(std::memory_order_relaxed); }

 private:
  struct Lane {
    std::mutex mutex;  // one copy at a time per lane
    kernels::PinnedHostBuffer bounce;
    kernels::CudaStream stream;
    std::vector<kernels::CudaEvent> done;  // one per bounce slot: recorded after the DMA that last used the slot
  };
  std::unique_lock<std::mutex> takeLane(Lane*& lane);
  static void drain(Lane& lane) noexcept;  // after a failure: no DMA may still use the bounce buffer

  DeviceCopierOptions options_;
  uint64_t chunk_ = 0;  // bytes per bounce slot
  uint32_t slots_ = 0;  // slots per lane (>= 2)
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<uint32_t> nextLane_{0};
  std::atomic<uint64_t> copies_{0}, bytes_{0};
};

}  // namespace tandem::daemon::cuda
