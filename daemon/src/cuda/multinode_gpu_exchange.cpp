// Multi-node communicators on the cuda backend, the GPU-issued exchange: the payloads filled and consumed on the GPUs
// in stream order, the transfers pushed by kernels of the first local rank's GPU into its proxy FIFO (gpu_exchange.hpp,
// kernels/span_exchange.cu). See cuda_multinode.hpp.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "cluster.hpp"
#include "cuda/cuda_multinode.hpp"
#include "cuda/multinode_common.hpp"
#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm_fp8.hpp"
#include "tandem/kernels/gemm_layouts.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/span_exchange.hpp"

namespace tandem::daemon::cuda {

namespace k = tandem::kernels;
using namespace multinode;

namespace {

constexpr uint64_t kExchangeTimeoutNs = uint64_t{kExchangeTimeoutMs} * 1'000'000;

}  // namespace

GpuRegion& HostStaging::gpuRegion(Collective& c) {
  if (region_) return *region_;
  if (!hub_) fail(ErrorCode::kInternal, "GPU exchange: the backend gave no GPU proxies");
  const int leadDev = deviceOf(localRanksOf(c).front());
  // Never loaded lazily behind a spinning exchange kernel (tandem/kernels/preload.hpp).
  for (auto& [device, g] : gpus_) {
    k::preloadSpanExchangeKernels(device);
    k::preloadGemmKernels(device);
    k::preloadGemmLayoutKernels(device);  // nn, tn
    k::preloadGemmFp8Kernels(device);
  }
  Cluster& cluster = c.link->cluster();
  const DaemonConfig& config = cluster.config();
  const auto grace = std::chrono::milliseconds(std::max<uint32_t>(10000, 3 * config.communicators.peerLostDeadlineMs));
  auto region = std::make_unique<GpuRegion>(
      hub_->proxy(leadDev, cluster.transport()),
      GpuRegionLayout::make(c.link->nodes(), c.link->self(), config.cluster.stagingBytes), c.link, grace);
  // The keys through the host staging, once per communicator, at the first op every node sends through the GPUs.
  const std::vector<std::byte> mine = region->key().encode();
  std::map<transport::NodeIndex, transport::RemoteKey> keys;
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        if (out.size() < mine.size()) fail(ErrorCode::kInternal, "GPU exchange: no room for the region key");
        std::memcpy(out.data(), mine.data(), mine.size());
        return static_cast<uint64_t>(mine.size());
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const transport::RemoteKey key = transport::RemoteKey::decode(in);
        if (key.owner != node || key.bytes != region->layout().bytes()) {
          fail(ErrorCode::kProtocol, "GPU exchange: node {} sent a region key of node {} with {} bytes (expected {})",
               node, key.owner, key.bytes, region->layout().bytes());
        }
        keys[node] = key;
      },
      kExchangeTimeoutMs);
  region->setPeerKeys(keys);
  std::lock_guard lock(mutex_);
  region_ = std::move(region);
  if (failed_) region_->abort();
  return *region_;
}

// Stream waits (the GPU's front end polls the word; no SM, no time slice held). 32-bit, wrap-aware (>=): the low half
// of the 64-bit epochs, which stay far below 2^31 apart.
void HostStaging::streamWait(cudaStream_t s, const uint64_t* word, uint64_t value, const char* what, bool flush) {
  const unsigned flags = static_cast<unsigned>(CU_STREAM_WAIT_VALUE_GEQ) |
                         (flush ? static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH) : 0u);
  const CUresult r = k::driver().streamWaitValue32(s, reinterpret_cast<CUdeviceptr>(word),
                                                   static_cast<cuuint32_t>(value), flags);
  k::checkCuda(r, "cuStreamWaitValue32({})", what);
}

void HostStaging::waitSendAreaFree(int leadDev, cudaStream_t s) {
  GpuRegion& region = *region_;
  const k::SpanExchangePlan& plan = *region.plan();
  if (plan.prevEpoch == 0) return;
  k::CudaDeviceGuard guard(leadDev);
  if (!streamWaits_) {
    k::checkCuda(k::launchSpanFree(region.planDevice(), s), "span exchange free");
    return;
  }
  for (uint32_t i = 0; i < plan.peers; ++i) streamWait(s, plan.consumed[i], plan.prevEpoch, "consumed");
}

void HostStaging::push(int leadDev, cudaStream_t exch, uint32_t pass) {
  k::CudaDeviceGuard guard(leadDev);
  k::checkCuda(k::launchSpanPush(region_->planDevice(pass), exch), "span exchange push");
}

void HostStaging::pushThenWait(int leadDev, cudaStream_t exch) {
  push(leadDev, exch, 0);
  waitArrived(leadDev, exch);
}

void HostStaging::markConsumed(int leadDev, cudaStream_t exch) {
  k::CudaDeviceGuard guard(leadDev);
  k::checkCuda(k::launchSpanConsumed(region_->planDevice(), exch), "span exchange consumed");
}

void HostStaging::waitArrived(int leadDev, cudaStream_t exch) {
  GpuRegion& region = *region_;
  const k::SpanExchangePlan& plan = *region.plan();
  k::CudaDeviceGuard guard(leadDev);
  if (!streamWaits_) k::checkCuda(k::launchSpanWait(region.planDevice(), exch), "span exchange wait");
  // Where GPUDirect writes need a flush before this GPU reads them (gpu_exchange_plan.hpp, chooseRegionMemory), a
  // stream wait does it, also after the wait kernel (then already satisfied).
  if (!streamWaits_ && !region.flushOnArrival()) return;
  for (uint32_t i = 0; i < plan.peers; ++i) {
    streamWait(exch, plan.arrived[i], plan.epoch, "arrived", region.flushOnArrival());
  }
}

void HostStaging::waitGpuWork(Collective& c) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2 * kExchangeTimeoutMs);
  // Stream waits have no deadline of their own: past the kernels' timeout the host releases them (and fails the op).
  const auto waitDeadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kExchangeTimeoutMs);
  bool aborted = false, timedOut = false;
  for (uint32_t spins = 0;; ++spins) {
    bool busy = false;
    for (auto& [device, g] : gpus_) {
      k::CudaDeviceGuard guard(device);
      for (cudaStream_t s : {g.exchange.get(), g.compute.get(), g.copy.get()}) {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaErrorNotReady) {
          busy = true;
          break;
        }
        k::checkCuda(e, "the GPU work of {} across nodes", opKindName(c.ops[0].desc.kind));
      }
      if (busy) break;
    }
    if (!busy) break;
    if (!aborted && (c.link->abortedFor(c.epoch) || failedNow())) {
      aborted = true;
      if (region_) {
        region_->abort();                   // the kernels' waits end; the rest of the op drains
        region_->releaseWaits(c.epoch);     // and the stream waits
      }
    }
    if (!aborted && !timedOut && streamWaits_ && spins % 256 == 255 && std::chrono::steady_clock::now() > waitDeadline) {
      timedOut = true;
      if (region_) {
        region_->abort();
        region_->releaseWaits(c.epoch);
      }
    }
    if (spins % 256 == 255 && std::chrono::steady_clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "{} across nodes: the GPU work did not finish within {} ms",
           opKindName(c.ops[0].desc.kind), 2 * kExchangeTimeoutMs);
    }
    backoff(spins);
  }
  if (aborted) {
    c.link->throwIfAborted(c.epoch);
    std::lock_guard lock(mutex_);
    fail(failCode_, "{}", reason_);
  }
  if (timedOut) {
    fail(ErrorCode::kTimeout, "{} across nodes: the peers' data or consumed flags did not come within {} ms (the peer "
         "daemon is alive but silent; check its log)", opKindName(c.ops[0].desc.kind), kExchangeTimeoutMs);
  }
}

void HostStaging::finishGpuExchange(Collective& c) {
  GpuRegion& region = *region_;
  if (const std::string why = region.failure(); !why.empty()) {
    c.link->throwIfAborted(c.epoch);
    if (failedNow()) {
      std::lock_guard lock(mutex_);
      fail(failCode_, "{}", reason_);
    }
    fail(ErrorCode::kTimeout, "{} across nodes: {}; the peer daemon is alive but its data never came (check its log)",
         opKindName(c.ops[0].desc.kind), why);
  }
  const uint64_t last = region.lastTicket();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kExchangeTimeoutMs);
  for (uint32_t spins = 0; region.proxy().completed() < last; ++spins) {
    c.link->throwIfAborted(c.epoch);
    if (spins % 256 == 255 && std::chrono::steady_clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "{} across nodes: the GPU's proxy did not post this node's transfers within {} ms",
           opKindName(c.ops[0].desc.kind), kExchangeTimeoutMs);
    }
    backoff(spins);
  }
  prevGpuEpoch_ = c.epoch;
  // A rank may destroy the communicator as soon as this op completes; the CommFail that sends must tell the peers
  // that this node's part of it is done (they still finish it), as the host exchange's completion does.
  c.link->markCompleted(c.epoch);
}

void HostStaging::runGpuExchange(Collective& c, const ExchangeOp& op, const OpPaths& paths) {
  GpuRegion& region = gpuRegion(c);
  // gemm-rs/ar push pass by pass (gemmReduceGpu), the plans cut alike.
  region.preparePlan(op, c.epoch, prevGpuEpoch_, kExchangeTimeoutNs, exchangePassCuts(op));
  try {
    (this->*paths.gpuIssued)(c, op);
    waitGpuWork(c);
  } catch (...) {
    // Nothing of ours may still wait or write once the op completes; the communicator fails either way.
    region.abort();
    region.releaseWaits(c.epoch);
    drain();
    throw;
  }
  finishGpuExchange(c);
}

// As agGemmStaged, with the exchange on the lead GPU's exchange stream: the local shards into the send area and the
// local rows' GEMM, the push; then the wait, the remote shards from the inboxes into every gathered A, the remote rows'
// GEMM.
void HostStaging::agGemmGpu(Collective& c, const ExchangeOp& op) {
  Aside aside;
  const AgGemmTensors t = agGemmTensors(c, &aside);
  const int leadDev = deviceOf(t.mine.front());
  GpuRegion& region = *region_;
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  // 1. This node's shards into the send area (packed in rank order, once it is free) and into every local rank's
  //    gathered A.
  waitSendAreaFree(leadDev, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    uint64_t off = 0;
    for (uint32_t q : t.mine) {
      t.pack(q, region.sendArea() + off, lead.copy.get());
      off += t.sentBytes(q);
    }
  }
  copyLocalShards(t);
  // 2. The push once the send area is filled, then the wait; meanwhile the local rows' GEMMs.
  order(leadDev, lead.copy.get(), exch);
  pushThenWait(leadDev, exch);
  copiesThenCompute(t.devices);
  gemmRows(t, rowRuns(c, t.m, true));
  // 3. The peers' shards from the inboxes into every local rank's gathered A, once they arrived: on the lead's copy
  //    stream, whatever GPU the destination is on (only the region's GPU reads its inboxes: chooseRegionMemory).
  order(leadDev, exch, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (uint32_t p : region.layout().peers()) {
      uint64_t off = 0;
      for (uint32_t q : ranksOnNode(op, p)) {
        for (uint32_t r : t.mine) t.placeSent(r, q, region.inbox(p) + off, lead.copy.get());
        off += t.sentBytes(q);
      }
    }
  }
  // 4. The inboxes are read once those copies are done: tell the peers; the remote rows' GEMMs meanwhile.
  order(leadDev, lead.copy.get(), exch);
  markConsumed(leadDev, exch);
  for (int dev : t.devices) order(leadDev, lead.copy.get(), gpu(dev).compute.get());
  gemmRows(t, rowRuns(c, t.m, false));
  // 5. Outputs computed aside go home (on the compute streams, after the GEMMs).
  aside.flush();
  for (uint32_t r : t.mine) {
    if (t.home[r] == nullptr) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    copyAsync(t.home[r], t.gathered[r], t.m * t.rowBytes, gpu(deviceOf(r)).compute.get(), "gathered A to its tensor");
  }
}

// As allGatherStaged, with the exchange on the lead GPU's exchange stream.
void HostStaging::allGatherGpu(Collective& c, const ExchangeOp& op) {
  const uint64_t bytes = c.ops[0].desc.dims[dim::kBytes];
  const std::vector<uint32_t> mine = localRanksOf(c);
  const int leadDev = deviceOf(mine.front());
  GpuRegion& region = *region_;
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  std::set<int> devices;
  for (uint32_t r : mine) devices.insert(deviceOf(r));
  auto recv = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kRecv); };
  auto send = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kSend); };
  waitSendAreaFree(leadDev, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      copyAsync(region.sendArea() + i * bytes, send(mine[i]), bytes, lead.copy.get(), "send to the send area");
    }
  }
  order(leadDev, lead.copy.get(), exch);
  pushThenWait(leadDev, exch);
  copyLocalSends(c, mine, bytes);
  // The inboxes into every local rank's recv on the lead's copy stream (only the region's GPU reads its inboxes).
  order(leadDev, exch, lead.copy.get());
  {
    k::CudaDeviceGuard guard(leadDev);
    for (uint32_t p : region.layout().peers()) {
      const std::vector<uint32_t> from = ranksOnNode(op, p);
      for (std::size_t i = 0; i < from.size(); ++i) {
        for (uint32_t r : mine) {
          copyAsync(recv(r) + from[i] * bytes, region.inbox(p) + i * bytes, bytes, lead.copy.get(), "inbox to recv");
        }
      }
    }
  }
  for (int dev : devices) order(dev, gpu(dev).copy.get(), exch);
  markConsumed(leadDev, exch);
}

// As gemmReduceStaged, over the GPU region: the node sum goes into the send area (written there in place when the
// region is GPU memory; computed in the workspace and the rows the peers get copied there by DMA when it is host
// memory, so that the SMs never write or read it over PCIe), the push reads each peer's rows from it in place, and the
// sum over nodes adds our node sum and each inbox (copied into the receive slot first when host memory) in node order:
// the same fp32 adds in the same order as gemmReduceStaged, bitwise the same results.
void HostStaging::gemmReduceGpu(Collective& c, const ExchangeOp& op) {
  Aside aside;
  ReduceTensors t = reduceTensors(c, &aside);  // the inputs, once (copied aside where misaligned)
  const uint64_t m = t.m, cols = t.cols;
  const int leadDev = t.leadDev;
  GpuRegion& region = *region_;
  const bool host = region.hostResident();
  Gpu& lead = gpu(leadDev);
  cudaStream_t exch = lead.exchange.get();
  cudaStream_t leadStream = t.leadStream;
  // The lead's workspace as gemmReduceStaged lays it out, but for the node sum: the send area holds it unless the
  // region is host memory.
  auto* sendSum = reinterpret_cast<float*>(region.sendArea());
  if (!host) t.nodeSum = sendSum;

  const uint32_t self = region.layout().self;
  const bool allReduce = c.ops[0].desc.kind == OpKind::kGemmAr;
  // The rows the peers get (all of them for gemm-ar, each peer's own for gemm-rs).
  RowRuns sent;
  if (allReduce) {
    sent.emplace_back(0, m);
  } else {
    for (uint32_t p : region.layout().peers()) {
      for (auto run : ownedRows(op, p)) sent.push_back(run);
    }
  }
  // Pass by pass over row blocks (the region's plans cut the writes alike: runGpuExchange), so that a block's rows
  // go to the peers while the next block's GEMMs run: 1. each local rank's partial rows on its GPU; 2. their node sum
  // in rank order on the lead's GPU (into the send area in place, or in the workspace and the sent rows copied to
  // the send area by DMA); 3. the push of that pass's writes. The GEMM core computes each output element alike
  // whatever the rows around it, so the results stay bitwise those of one pass (and of the staged path).
  const std::vector<uint64_t> starts = passRowStarts(m);
  std::byte* outStaging = nullptr;  // past the other GPUs' partials, as sumNodePartials returns
  for (uint32_t q = 0; q < starts.size(); ++q) {
    const uint64_t r0 = starts[q], r1 = q + 1 < starts.size() ? starts[q + 1] : m;
    for (uint32_t r : t.mine) partialRows(c, t, r, r0, r1);
    {
      k::CudaDeviceGuard guard(leadDev);
      orderAfterPartials(t);
      if (q == 0 && !host) waitSendAreaFree(leadDev, leadStream);  // the node sum goes into the send area itself
      outStaging = sumNodePartials(t, r0, r1 - r0);
      if (host) {
        if (q == 0) waitSendAreaFree(leadDev, leadStream);
        for (auto [first, rows] : sent) {
          const uint64_t lo = std::max(first, r0), hi = std::min(first + rows, r1);
          if (lo >= hi) continue;
          copyAsync(sendSum + lo * cols, t.nodeSum + lo * cols, (hi - lo) * cols * sizeof(float), leadStream,
                    "node sum to the send area");
        }
      }
    }
    order(leadDev, leadStream, exch);
    push(leadDev, exch, q);
  }
  // The wait for the peers' payloads, then the sum over nodes.
  waitArrived(leadDev, exch);
  order(leadDev, exch, leadStream);
  // 4. The sum over nodes in node order: our node sum at our rows, each peer's inbox packed.
  const auto myRows = ownedRows(op, self);
  uint64_t myFloats = 0;
  for (auto [first, rows] : myRows) myFloats += rows * cols;
  bool started = false;
  for (uint32_t node : region.layout().nodes) {
    const float* src = node == self ? t.nodeSum : reinterpret_cast<const float*>(region.inbox(node));
    if (node != self && host) {
      k::CudaDeviceGuard guard(leadDev);
      copyAsync(t.recvSlot, src, myFloats * sizeof(float), leadStream, "inbox to the receive slot");
      src = t.recvSlot;
    }
    addRowsToTotal(t, myRows, src, node == self, started);
    started = true;
  }
  // The inboxes are read: tell the peers, while the outputs are rounded.
  order(leadDev, leadStream, exch);
  markConsumed(leadDev, exch);
  // 5. One rounding into every local rank's C (gemm-rs: its own rows; gemm-ar: all of them), as gemmReduceStaged.
  roundOutputs(c, t, outStaging);
}

}  // namespace tandem::daemon::cuda
