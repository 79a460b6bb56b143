// The GPU-issued exchange's host side (cuda backend): what lets the GPUs of a communicator that spans nodes issue its
// transfers themselves. The rules, the region layout and the commands are in gpu_exchange_plan.hpp; the kernels in
// kernels/span_exchange.cu; cuda_multinode.cpp runs the ops over it.
//
//   GpuCopiers       the backend's transport::DeviceCopier: the cluster's tcp transport stages kDevice regions through
//                    it (the sender's proxy copies a GPU source to host memory, the receiver's io threads copy a payload
//                    and then its flag into GPU memory). It routes each call to a CudaDeviceCopier of the GPU that
//                    holds the pointer, made at its first use.
//   GpuExchangeHub   one per backend. Per GPU that runs a GPU exchange, made at its first use: a proxy FIFO in mapped
//                    pinned memory with its ticket counter in that GPU's memory (only that GPU's kernels push into it),
//                    and its own transport::Proxy thread on the cluster's transport, with a buffer table of every
//                    communicator region on that GPU.
//   GpuRegion        one per communicator (made at its first GPU-exchange op, on its first local rank's GPU): the
//                    region (send area, inboxes, flags) registered with the transport, its buffer id in the GPU's
//                    table, and a page of mapped pinned memory with the kernels' plan, the abort word and the error
//                    slot.
//
// Where the region lives (regionChoiceFor; the rule in gpu_exchange_plan.hpp, chooseRegionMemory). On verbs, in GPU
// memory: the NIC writes into it and reads from it directly (GPUDirect RDMA), registered through a dma-buf of it
// (cuMemGetHandleForAddressRange, ibv_reg_dmabuf_mr) where the driver exports one, else as a pointer (ibv_reg_mr,
// nvidia-peermem); only this GPU's engines read its inboxes, after the arrived wait, which holds the flag after the
// data for writes ordering >= "owner" (the H200 reports 100), flushes below that where the GPU can, and where it
// cannot the region is in host memory. Under MPS on verbs, in host memory too (a GPU-memory region stalled under MPS
// on the verbs test double, cause unknown). On tcp, in mapped pinned host memory: tcp's bytes pass through the host's
// socket buffers whatever the region is, and a GPU-memory region on tcp costs a staged copy per 512 KiB frame on both
// sides, each waited for on the sending proxy thread or the receiving io thread (the H200 measured that path 1.4-2.3x
// slower than the host-staged exchange, bench/RESULTS.md). From host memory tcp sends zero-copy and receives straight into
// the inbox; the GPU fills the send area and reads the inboxes by DMA (the copy engines) or in place (the node-sum
// kernels), over PCIe, and polls the flags there as it polls the plan page. TANDEM_GPU_REGION=device|host overrides
// the choice (for measurements).
//
// Two proxies on one transport. The cluster's own proxy (host producers) and each GPU's post through the same
// transport. Posting from several threads is safe (tcp serialises per peer under its send mutex; a flag carries the
// data-frame counts of everything queued before it, whichever thread queued it, so it is applied after those frames
// too). Completions are not: Transport::poll hands a completion to whichever thread polls first, and the cookies (FIFO
// tickets) of two FIFOs collide. So a GPU's proxy posts through a PostOnlyTransport: every op unsignalled, poll empty.
// Its FIFO's completed word then means "posted" (the proxy publishes the consumer index when nothing is outstanding),
// not "sent": verbs reads a write's source after the post, and so does tcp from a host region. The peers' consumed
// flags stand in for completions: a peer stores consumed = e after it read its inbox of op e, which it could do only
// after every byte of ours had landed, so the send area is refilled only after every peer's consumed flag reached the
// previous op's epoch (the free wait, span_exchange.hpp), and the push into a peer's inbox comes after that too.
//
// Failures. Each communicator has its own abort word, which ends its kernels' waits (for the peer's consumed and
// arrived flags) at once; the FIFO's stop word is set only when the hub shuts down, because the FIFO is shared: a push
// that gives up half way leaves claimed, unpublished tickets at which the proxy stops for every communicator on that
// GPU. A command the proxy rejects or cannot post (peer lost) aborts the communicator that owns its buffer id, and
// only that one. A region of a destroyed communicator stays registered (and its memory allocated) for a grace period,
// as the cluster keeps its staging: a peer may still be writing into it, and a write into an unregistered region fails
// the whole link to that peer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_copier.hpp"
#include "cuda/gpu_exchange_plan.hpp"
#include "cuda/proxy_fifo_mapping.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/span_exchange.hpp"
#include "transport/proxy_fifo.hpp"
#include "transport/transport.hpp"

namespace tandem::daemon {
class CommLink;
}

namespace tandem::daemon::cuda {

/// See the file comment. Thread-safe.
class GpuCopiers final : public transport::DeviceCopier {
 public:
  void toHost(void* host, const void* device, uint64_t bytes) override;
  void toDevice(void* device, const void* host, uint64_t bytes) override;
  /// Makes `device`'s copier now (pinned bounce buffers, streams, events), before any exchange kernel of it runs:
  /// allocating pinned memory while a kernel spins on a flag that this copier is to deliver must never be the first
  /// use. Throws Error(kCuda).
  void prepare(int device);

 private:
  CudaDeviceCopier& copierFor(const void* device);
  CudaDeviceCopier& copierOf(int device);
  std::mutex mutex_;
  std::map<int, std::unique_ptr<CudaDeviceCopier>> copiers_;
};

/// Forwards to a transport with every op unsignalled and no completions of its own (see the file comment). A
/// signalled op gets a completion at once, meaning only "posted".
class PostOnlyTransport final : public transport::Transport {
 public:
  explicit PostOnlyTransport(transport::Transport& inner) : inner_(inner) {}
  transport::TransportKind kind() const override { return inner_.kind(); }
  transport::NodeIndex self() const override { return inner_.self(); }
  uint32_t nodeCount() const override { return inner_.nodeCount(); }
  transport::LocalRegion registerMemory(const transport::MemoryDesc& desc) override {
    return inner_.registerMemory(desc);
  }
  void deregisterMemory(transport::LocalRegion region) override { inner_.deregisterMemory(region); }
  transport::RemoteKey remoteKey(transport::LocalRegion region) const override { return inner_.remoteKey(region); }
  std::string registration(transport::LocalRegion region) const override { return inner_.registration(region); }
  void write(transport::NodeIndex peer, transport::LocalRegion src, uint64_t srcOffset, const transport::RemoteKey& dst,
             uint64_t dstOffset, uint64_t bytes, uint64_t cookie, bool signal) override;
  void writeFlag(transport::NodeIndex peer, const transport::RemoteKey& dst, uint64_t dstOffset, uint64_t value,
                 uint64_t cookie, bool signal) override;
  void submit() override { inner_.submit(); }
  std::size_t poll(std::span<transport::Completion> out) override;
  transport::PeerStatus peerStatus(transport::NodeIndex peer) const override { return inner_.peerStatus(peer); }
  void setPeerFailureHandler(std::function<void(transport::NodeIndex, const transport::PeerStatus&)>) override {}

 private:
  transport::Transport& inner_;
  std::vector<transport::Completion> posted_;  // proxy thread only
};

class GpuExchangeHub;

/// One GPU's FIFO, proxy thread and buffer table. Made by GpuExchangeHub; lives until the hub shuts down.
class GpuProxy {
 public:
  GpuProxy(int device, transport::Transport& transport);
  ~GpuProxy();
  GpuProxy(const GpuProxy&) = delete;
  GpuProxy& operator=(const GpuProxy&) = delete;

  int device() const { return device_; }
  ::tandem::proxy::ProxyFifoDeviceRef deviceRef() const { return fifo_.deviceRef(); }
  uint64_t completed() const { return fifo_.view().completed(); }
  transport::Transport& transport() { return transport_; }

  /// A communicator's region (GPU or mapped host memory: `kind`; `dmabufFd` a dma-buf of GPU memory, or -1):
  /// registered, its id returned; `onError(code, reason)` runs (on the proxy thread) for a command of it the proxy
  /// rejects or cannot post. Throws what registerMemory throws.
  uint32_t add(void* base, uint64_t bytes, transport::MemoryKind kind, int dmabufFd, transport::LocalRegion& region,
               std::function<void(ErrorCode, const std::string&)> onError);
  /// The peers' keys for region `id` (before the first push that names them).
  void setPeerKeys(uint32_t id, const std::map<transport::NodeIndex, transport::RemoteKey>& keys);
  /// The region leaves the table now; its registration and memory (`keep`) stay for the grace period.
  void retire(uint32_t id, std::shared_ptr<void> keep, std::chrono::milliseconds grace);
  /// Stops the proxy (its FIFO's stop word first), deregisters every region. Idempotent.
  void shutdown();

 private:
  struct Entry {
    transport::LocalRegion region;
    uint64_t bytes = 0;
    std::map<transport::NodeIndex, transport::RemoteKey> keys;
    std::function<void(ErrorCode, const std::string&)> onError;
  };
  struct Retired {
    transport::LocalRegion region;
    uint32_t id;
    std::shared_ptr<void> keep;
    std::chrono::steady_clock::time_point until;
  };
  void publishLocked();
  void retireExpiredLocked(bool all);

  int device_;
  transport::Transport& cluster_;
  PostOnlyTransport transport_;
  GpuMappedProxyFifo fifo_;
  std::unique_ptr<transport::Proxy> proxy_;
  std::mutex mutex_;
  std::map<uint32_t, Entry> entries_;
  std::vector<Retired> retired_;
  std::vector<uint32_t> freeIds_;
  uint32_t nextId_ = 1;
  bool stopped_ = false;
};

/// The backend's GPU proxies, made at first use. Thread-safe.
class GpuExchangeHub {
 public:
  /// `copiers`: the backend's (the cluster's transport copies through them); each GPU's is made with its proxy.
  explicit GpuExchangeHub(std::shared_ptr<GpuCopiers> copiers) : copiers_(std::move(copiers)) {}
  /// The proxy of `device` on `transport` (the cluster's; the same for every call). Throws Error(kCuda).
  std::shared_ptr<GpuProxy> proxy(int device, transport::Transport& transport);
  /// Backend::stop: every proxy stops and deregisters its regions (before the cluster's transport goes).
  void shutdown();

 private:
  std::shared_ptr<GpuCopiers> copiers_;
  std::mutex mutex_;
  std::map<int, std::shared_ptr<GpuProxy>> proxies_;
  bool stopped_ = false;
};

/// Where a GpuRegion's bytes live on `transport` and GPU `dev` (see the file comment): chooseRegionMemory
/// (gpu_exchange_plan.hpp) on what the GPU reports (MPS, GPUDirect writes ordering, stream-wait flush), unless
/// TANDEM_GPU_REGION=device|host says (for measurements).
RegionChoice regionChoiceFor(transport::TransportKind transport, int dev);

/// A communicator's GPU region and its kernels' plan page. Made on the link thread at the communicator's first
/// GPU-exchange op; used by that thread only, except abort() (any thread).
class GpuRegion {
 public:
  /// Allocates and zeroes the region (on the proxy's GPU or in mapped pinned host memory: regionChoiceFor),
  /// registers it (GPU memory on verbs: through a dma-buf of it where the driver exports one). `link`: aborted when
  /// the proxy fails one of its commands. Throws Error(kCuda) or the transport's error.
  GpuRegion(std::shared_ptr<GpuProxy> proxy, GpuRegionLayout layout, std::weak_ptr<CommLink> link,
            std::chrono::milliseconds grace);
  ~GpuRegion();
  GpuRegion(const GpuRegion&) = delete;
  GpuRegion& operator=(const GpuRegion&) = delete;

  const GpuRegionLayout& layout() const { return layout_; }
  GpuProxy& proxy() { return *proxy_; }
  int device() const { return proxy_->device(); }
  bool hostResident() const { return host_; }  // in mapped pinned host memory (the same address for the GPU)
  /// The arrived waits must flush GPUDirect writes (CU_STREAM_WAIT_VALUE_FLUSH): RegionChoice::flushOnArrival.
  bool flushOnArrival() const { return flushOnArrival_; }
  /// Where the region lives, why, and how the NIC reaches it: for the plan log.
  const std::string& describe() const { return describe_; }
  std::byte* base() const { return base_; }
  std::byte* sendArea() const { return base() + GpuRegionLayout::sendOffset(); }
  std::byte* inbox(uint32_t from) const { return base() + layout_.inboxOffset(layout_.self, from); }
  /// This node's key, for the peers.
  transport::RemoteKey key() const;
  /// The peers' keys (the first op exchanges them through the host staging).
  void setPeerKeys(const std::map<transport::NodeIndex, transport::RemoteKey>& keys);

  /// Fills the plans for op `op` of epoch `epoch` (prevEpoch: the previous GPU-exchange op's, 0 for none); clears
  /// the failure words. Call only while no kernel of this region runs. `cuts`: ascending source offsets (in the
  /// region) where a pass of the push starts, at most kSpanMaxPasses - 1: the writes are cut there, pass q's plan
  /// holds the pieces between cuts q-1 and q, and only the last pass sends the arrived flag. Returns plan 0.
  kernels::SpanExchangePlan* preparePlan(const ExchangeOp& op, uint64_t epoch, uint64_t prevEpoch, uint64_t timeoutNs,
                                         const std::vector<uint64_t>& cuts = {});
  uint32_t passes() const { return passes_; }
  /// Pass `pass`'s plan (the push's; every other kernel takes pass 0's): the device view and the host view.
  const kernels::SpanExchangePlan* planDevice(uint32_t pass = 0) const;
  const kernels::SpanExchangePlan* plan(uint32_t pass = 0) const;
  /// Releases stream waits on this region's arrived and consumed words for epochs up to `epoch` (writes a value past
  /// them into every such word: the communicator is failing, the words mean nothing more). Link thread only.
  void releaseWaits(uint64_t epoch);
  /// After the kernels: "" or what went wrong (the error slot or the push status).
  std::string failure() const;
  /// One past the last ticket the op's kernels pushed (0: none).
  uint64_t lastTicket() const;
  /// Releases this communicator's kernel waits now (any thread); a later preparePlan does not undo it.
  void abort();
  bool aborted() const;

 private:
  struct Page;  // the mapped page's layout
  Page* page() const;
  Page* pageDevice() const;

  std::shared_ptr<GpuProxy> proxy_;
  GpuRegionLayout layout_;
  std::chrono::milliseconds grace_;
  std::shared_ptr<void> memory_;  // a DeviceBuffer or a PinnedHostBuffer; kept past the region for the grace period
  std::byte* base_ = nullptr;
  bool host_ = false;
  bool flushOnArrival_ = false;
  std::string describe_;
  kernels::PinnedHostBuffer page_;
  kernels::CudaStream releaseStream_;  // releaseWaits' copies, beside every stream that may be waiting
  transport::LocalRegion region_;
  uint32_t id_ = 0;
  uint32_t passes_ = 1;
};

}  // namespace tandem::daemon::cuda
