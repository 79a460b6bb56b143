// The proxy FIFO mapped for GPU kernels: its host region registered (or allocated) as pinned, mapped, portable
// memory, the host's ProxyFifoView over it for the proxy thread, and the ProxyFifoDeviceRef that kernels push with
// (kernels/device/proxy_push.cuh). The proxy and host producers keep using the view exactly as for a plain mapping.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/common/proxy_fifo_layout.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "transport/proxy_fifo.hpp"

namespace tandem::daemon::cuda {

/// Owns the GPU mapping of one FIFO region (and the region itself when it allocated it). Move-only; not thread-safe
/// itself (set it up, then hand view() to the proxy and deviceRef() to kernels). Kernels that push into it, and the
/// proxy, must be done before it is destroyed.
class GpuMappedProxyFifo {
 public:
  GpuMappedProxyFifo() = default;
  /// Allocates pinned host memory (cudaHostAlloc, mapped and portable) for `capacity` slots and formats it.
  /// @throws Error(kInvalidArgument) for a bad capacity, Error(kCuda) naming the failed call.
  static GpuMappedProxyFifo allocate(uint32_t capacity);
  /// Maps an existing, formatted region (the cluster's memfd mapping, say) with cudaHostRegister(Mapped|Portable); the
  /// region must be page-aligned and outlive this object. @throws Error(kProtocol) if it is not a formatted FIFO,
  /// Error(kCuda) naming the failed call.
  static GpuMappedProxyFifo map(std::byte* base, uint64_t bytes);

  /// Moves the ticket counter to `device`'s memory (a word there, starting at the region's head), which makes every
  /// claim a GPU-local atomic instead of one on host memory across PCIe. Only for a FIFO that kernels of that GPU alone
  /// push into, and only before any push: host producers (ProxyFifoProducer) keep using the region's head and would
  /// hand out the same tickets. The consumer never reads head, so it needs no change. Without it, host and GPU
  /// producers share the region's head, which is atomic across both only where cudaDevAttrHostNativeAtomicSupported
  /// is set (proxy_push.cuh). @throws Error(kCuda) naming the failed call.
  void useDeviceHead(int device);
  bool deviceHead() const { return deviceHead_.get() != nullptr; }

  /// For the proxy thread and host producers.
  transport::ProxyFifoView view() const { return view_; }
  /// For kernels: the same words at their device addresses.
  ::tandem::proxy::ProxyFifoDeviceRef deviceRef() const { return ref_; }
  explicit operator bool() const { return static_cast<bool>(view_); }

 private:
  void setDeviceRef(std::byte* deviceBase);

  kernels::PinnedHostBuffer owned_;          // allocate(): the region itself
  kernels::HostRegistration registration_;   // map(): the caller's region, registered
  kernels::DeviceBuffer deviceHead_;         // useDeviceHead(): the ticket counter in GPU memory
  transport::ProxyFifoView view_;
  ::tandem::proxy::ProxyFifoDeviceRef ref_{};
};

}  // namespace tandem::daemon::cuda
