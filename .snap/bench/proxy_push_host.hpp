// Host side of bench/proxy_push_bench.cu: a GPU-mapped proxy FIFO drained by a real proxy thread into the
// NullTransport, behind a pimpl, because the transport headers use fmt, which nvcc cannot compile in C++20.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/common/proxy_fifo_layout.hpp"

namespace tandem::bench {

struct PushBenchStats {
  uint64_t popped = 0, posted = 0, rejected = 0, failed = 0, submits = 0;
};

/// The tcp transport's staging cost: mean time per synchronous copy through the CUDA DeviceCopier (default options:
/// 1 MiB of bounce per lane) between pageable host memory and GPU memory, and plain cudaMemcpy of the same pageable
/// memory as the baseline.
struct CopierRow {
  uint64_t bytes = 0;
  uint32_t copies = 0;
  double toDeviceUs = 0, toHostUs = 0, memcpyToDeviceUs = 0, memcpyToHostUs = 0;
};
std::vector<CopierRow> copierRows(int device, const std::vector<uint64_t>& sizes);

/// A FIFO of `capacity` slots in pinned, mapped host memory, its ticket counter in the region (host head) or in GPU
/// memory (deviceHead), and a started proxy thread (maxBatch commands per submit; `spin`: never sleep when idle) that
/// posts to a NullTransport(0, 2) whose table accepts kWrite peer 1, buffers 1 -> 1, any offset. Throws on failure.
class PushBenchProxy {
 public:
  PushBenchProxy(uint32_t capacity, bool deviceHead, int device, uint32_t maxBatch, bool spin);
  ~PushBenchProxy();
  PushBenchProxy(const PushBenchProxy&) = delete;
  PushBenchProxy& operator=(const PushBenchProxy&) = delete;

  ::tandem::proxy::ProxyFifoDeviceRef ref() const;
  PushBenchStats stats() const;
  uint64_t errorsWord() const;
  /// The ticket counter now (region or GPU memory): tickets handed out so far.
  uint64_t head() const;
  /// Sets the FIFO's stop word (a kernel stuck in a push returns).
  void requestStop();
  /// The host baseline: one host thread pushes a signalled write and waits for the completed watermark, `samples`
  /// times; returns each round trip in ns (steady_clock).
  std::vector<uint64_t> hostRoundTrips(uint32_t samples);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// GPU -> proxy -> tcp on loopback -> GPU, in one process (node 0 sends, node 1 receives, one GPU): a GPU-mapped FIFO
/// (ticket counter in GPU memory) drained by a proxy thread into a TcpTransport pair with `connections` connections
/// per peer and io threads, GPU memory at both ends (`bytes` of source and destination, an 8-byte flag) through one
/// CUDA DeviceCopier per node. Buffer ids: kSrc (local), kDst and kFlag (node 1's). Throws on failure.
class TcpPipeBench {
 public:
  static constexpr uint32_t kSrc = 1, kDst = 2, kFlag = 3;
  TcpPipeBench(int device, uint64_t bytes, uint32_t connections);
  ~TcpPipeBench();
  TcpPipeBench(const TcpPipeBench&) = delete;
  TcpPipeBench& operator=(const TcpPipeBench&) = delete;

  ::tandem::proxy::ProxyFifoDeviceRef ref() const;
  const uint64_t* flag() const;  ///< node 1's flag word (GPU memory)
  PushBenchStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::bench
