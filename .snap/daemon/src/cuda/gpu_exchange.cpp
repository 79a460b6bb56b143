// The GPU-issued exchange's host side: see gpu_exchange.hpp.
#include "cuda/gpu_exchange.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <unistd.h>

#include "cluster.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/kernels/driver.hpp"

namespace tandem::daemon::cuda {
namespace {

namespace k = tandem::kernels;
using transport::NodeIndex;

static_assert(kMaxExchangePasses == k::kSpanMaxPasses, "the plan module's pass limit is the kernels'");
constexpr uint32_t kFifoCapacity = 4096;  // > kMaxExchangeWrites + 1: one destination batch always fits

template <typename T>
T loadAcquire(const T& word) {
  return std::atomic_ref<T>(const_cast<T&>(word)).load(std::memory_order_acquire);
}

}  // namespace

// ---- GpuCopiers ----------------------------------------------------------------------------------------------------

CudaDeviceCopier& GpuCopiers::copierFor(const void* device) {
  cudaPointerAttributes attr{};
  k::checkCuda(cudaPointerGetAttributes(&attr, device), "cudaPointerGetAttributes (GPU exchange copier)");
  if (attr.type != cudaMemoryTypeDevice) {
    fail(ErrorCode::kInvalidArgument, "GPU exchange copier: {} is not GPU memory", device);
  }
  return copierOf(attr.device);
}

CudaDeviceCopier& GpuCopiers::copierOf(int device) {
  std::lock_guard lock(mutex_);
  auto& c = copiers_[device];
  // 4 lanes: the GPU proxy's sends and the transport's two io threads' receives do not queue behind each other.
  if (!c) c = std::make_unique<CudaDeviceCopier>(DeviceCopierOptions{.device = device, .lanes = 4});
  return *c;
}

void GpuCopiers::prepare(int device) { copierOf(device); }

void GpuCopiers::toHost(void* host, const void* device, uint64_t bytes) {
  if (bytes == 0) return;
  copierFor(device).toHost(host, device, bytes);
}

void GpuCopiers::toDevice(void* device, const void* host, uint64_t bytes) {
  if (bytes == 0) return;
  copierFor(device).toDevice(device, host, bytes);
}

// ---- PostOnlyTransport ---------------------------------------------------------------------------------------------

void PostOnlyTransport::write(NodeIndex peer, transport::LocalRegion src, uint64_t srcOffset,
                              const transport::RemoteKey& dst, uint64_t dstOffset, uint64_t bytes, uint64_t cookie,
                              bool signal) {
  inner_.write(peer, src, srcOffset, dst, dstOffset, bytes, cookie, false);
  if (signal) posted_.push_back({cookie, peer, ErrorCode::kOk});
}

void PostOnlyTransport::writeFlag(NodeIndex peer, const transport::RemoteKey& dst, uint64_t dstOffset, uint64_t value,
                                  uint64_t cookie, bool signal) {
  inner_.writeFlag(peer, dst, dstOffset, value, cookie, false);
  if (signal) posted_.push_back({cookie, peer, ErrorCode::kOk});
}

std::size_t PostOnlyTransport::poll(std::span<transport::Completion> out) {
  const std::size_t n = std::min(out.size(), posted_.size());
  std::copy_n(posted_.begin(), n, out.begin());
  posted_.erase(posted_.begin(), posted_.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

// ---- GpuProxy ------------------------------------------------------------------------------------------------------

GpuProxy::GpuProxy(int device, transport::Transport& transport)
    : device_(device), cluster_(transport), transport_(transport) {
  fifo_ = GpuMappedProxyFifo::allocate(kFifoCapacity);
  fifo_.useDeviceHead(device);  // only this GPU's kernels push here: GPU-local claims
  transport::ProxyOptions po;
  po.name = fmt::format("proxy gpu{} {}", device, transport::transportKindName(transport.kind()));
  proxy_ = std::make_unique<transport::Proxy>(fifo_.view(), transport_, po);
  proxy_->setErrorHandler([this, name = po.name](const transport::ProxyCommandError& e) {
    const uint32_t id = e.command.dstBuffer;
    spdlog::error("{}: command {} (buffer {}) failed: {}", name, e.ticket, id, e.message);
    // Under the mutex: the region cannot go away meanwhile, and onError only stores the abort word and aborts a link.
    std::lock_guard lock(mutex_);
    if (auto it = entries_.find(id); it != entries_.end() && it->second.onError) {
      it->second.onError(e.code, fmt::format("{}: a transfer failed: {}", name, e.message));
    }
  });
  proxy_->start();
  spdlog::info("{}: GPU-issued exchange ready (FIFO of {} commands, ticket counter on the GPU)", po.name,
               kFifoCapacity);
}

GpuProxy::~GpuProxy() { shutdown(); }

uint32_t GpuProxy::add(void* base, uint64_t bytes, transport::MemoryKind kind, int dmabufFd,
                       transport::LocalRegion& region, std::function<void(ErrorCode, const std::string&)> onError) {
  std::lock_guard lock(mutex_);
  if (stopped_) fail(ErrorCode::kAborted, "GPU exchange: tandemd is shutting down");
  retireExpiredLocked(false);
  region = cluster_.registerMemory(transport::MemoryDesc{kind, base, bytes, dmabufFd});
  uint32_t id;
  if (!freeIds_.empty()) {
    id = freeIds_.back();
    freeIds_.pop_back();
  } else {
    id = nextId_++;
  }
  entries_[id] = Entry{region, bytes, {}, std::move(onError)};
  publishLocked();
  return id;
}

void GpuProxy::setPeerKeys(uint32_t id, const std::map<NodeIndex, transport::RemoteKey>& keys) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) fail(ErrorCode::kInternal, "GPU exchange: no region {}", id);
  it->second.keys = keys;
  publishLocked();
}

void GpuProxy::retire(uint32_t id, std::shared_ptr<void> keep, std::chrono::milliseconds grace) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  const transport::LocalRegion region = it->second.region;
  entries_.erase(it);
  if (stopped_) return;  // shutdown deregistered it; the memory may go now
  publishLocked();
  retired_.push_back(Retired{region, id, std::move(keep), std::chrono::steady_clock::now() + grace});
  retireExpiredLocked(false);
}

void GpuProxy::publishLocked() {
  auto table = std::make_shared<transport::ProxyBufferTable>();
  for (auto& [id, e] : entries_) {
    table->addLocal(id, e.region, e.bytes);
    for (auto& [peer, key] : e.keys) table->addRemote(id, peer, key);
  }
  proxy_->setBufferTable(std::move(table));
}

void GpuProxy::retireExpiredLocked(bool all) {
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(retired_, [&](Retired& r) {
    if (!all && r.until > now) return false;
    cluster_.deregisterMemory(r.region);
    freeIds_.push_back(r.id);
    return true;  // `keep` (the memory) goes after its registration
  });
}

void GpuProxy::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
  }
  fifo_.view().requestStop();  // a kernel waiting for room returns kStopped
  proxy_->stop();              // not under mutex_: the proxy thread's error handler takes it
  std::lock_guard lock(mutex_);
  for (auto& [id, e] : entries_) cluster_.deregisterMemory(e.region);
  retireExpiredLocked(true);
}

// ---- GpuExchangeHub ------------------------------------------------------------------------------------------------

std::shared_ptr<GpuProxy> GpuExchangeHub::proxy(int device, transport::Transport& transport) {
  std::lock_guard lock(mutex_);
  if (stopped_) fail(ErrorCode::kAborted, "GPU exchange: tandemd is shutting down");
  auto& p = proxies_[device];
  if (!p) {
    if (copiers_) copiers_->prepare(device);
    p = std::make_shared<GpuProxy>(device, transport);
  }
  return p;
}

void GpuExchangeHub::shutdown() {
  std::map<int, std::shared_ptr<GpuProxy>> proxies;
  {
    std::lock_guard lock(mutex_);
    stopped_ = true;
    proxies.swap(proxies_);
  }
  for (auto& [device, p] : proxies) p->shutdown();
}

// ---- GpuRegion -----------------------------------------------------------------------------------------------------

struct GpuRegion::Page {
  alignas(64) uint64_t abortWord;  // non-zero: this communicator's kernel waits end
  alignas(64) uint32_t failed;     // kSpanFailed*
  uint32_t pushStatus;
  alignas(64) uint64_t lastTicket;
  alignas(64) k::ErrorSlot errorSlot;
  alignas(64) uint64_t releaseValue;  // releaseWaits' source
  alignas(64) k::SpanExchangePlan plan[k::kSpanMaxPasses];  // the push's passes; [0] for every other kernel
};

namespace {

int driverAttribute(CUdevice_attribute a, int dev) {
  CUdevice d = 0;
  int v = 0;
  if (k::driver().deviceGet(&d, dev) != CUDA_SUCCESS || k::driver().deviceGetAttribute(&v, a, d) != CUDA_SUCCESS) {
    return 0;  // an attribute the driver cannot report: the weakest answer
  }
  return v;
}

// A dma-buf fd for [base, base + bytes) of GPU memory (the NIC registers it with ibv_reg_dmabuf_mr), or why there is
// none. `bytes` is a multiple of the host page, as the call requires of the range.
Fd exportDmabuf(int dev, void* base, uint64_t bytes, std::string& why) {
  if (driverAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) == 0) {
    why = "the driver reports no dma-buf support (an open kernel module and Linux >= 5.12 have it)";
    return Fd();
  }
  int fd = -1;
  const CUresult r = k::driver().memGetHandleForAddressRange(&fd, reinterpret_cast<CUdeviceptr>(base), bytes,
                                                             CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    why = fmt::format("cuMemGetHandleForAddressRange -> {}", k::driverErrorName(r));
    return Fd();
  }
  return Fd(fd);
}

}  // namespace

RegionChoice regionChoiceFor(transport::TransportKind transport, int dev) {
  RegionFacts f;
  f.tcp = transport == transport::TransportKind::kTcp;
  int mps = 0;
  f.mps = cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, dev) == cudaSuccess && mps != 0;
  f.writesOrdering = driverAttribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev);
  f.canFlushOnWait = (driverAttribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, dev) &
                      CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS) != 0;
  f.otherGpusRead = false;  // cuda_multinode.cpp reads the inboxes on the region's GPU only
  RegionChoice c = chooseRegionMemory(f);
  if (const char* e = std::getenv("TANDEM_GPU_REGION"); e != nullptr && *e != '\0') {
    const std::string_view v(e);
    if (v == "device" || v == "host") {
      // Forced into GPU memory, it still flushes where the rule would for a NIC's writes (tcp's are the host's copies).
      RegionFacts nic = f;
      nic.tcp = nic.mps = false;
      c.host = v == "host";
      c.flushOnArrival = !c.host && !f.tcp && chooseRegionMemory(nic).flushOnArrival;
      c.why = fmt::format("region in {} (TANDEM_GPU_REGION={})", c.host ? "mapped host memory" : "GPU memory", v);
    } else {
      spdlog::warn("TANDEM_GPU_REGION={} is neither device nor host; ignored", v);
    }
  }
  return c;
}

GpuRegion::GpuRegion(std::shared_ptr<GpuProxy> proxy, GpuRegionLayout layout, std::weak_ptr<CommLink> link,
                     std::chrono::milliseconds grace)
    : proxy_(std::move(proxy)), layout_(std::move(layout)), grace_(grace) {
  const int dev = proxy_->device();
  const transport::TransportKind kind = proxy_->transport().kind();
  const RegionChoice choice = regionChoiceFor(kind, dev);
  host_ = choice.host;
  flushOnArrival_ = choice.flushOnArrival;
  describe_ = choice.why;
  Fd dmabuf;
  if (host_) {
    k::CudaDeviceGuard guard(dev);  // the allocation's context: the proxy's GPU
    // Zeroed by allocate: the flags start at 0 (epochs start at 1) before any peer has our key.
    auto pinned = std::make_shared<k::PinnedHostBuffer>(k::PinnedHostBuffer::allocate(layout_.bytes(),
                                                                                       "GPU exchange region"));
    // The plan hands the kernels host addresses of the flags and the node-sum kernels read the inboxes in place:
    // that needs the GPU's view of the memory at the same address (unified addressing, every 64-bit Linux GPU).
    if (pinned->devicePtr() != pinned->get()) {
      fail(ErrorCode::kUnsupported, "GPU exchange: pinned host memory has another address on GPU {} (no unified "
           "addressing); set TANDEM_GPU_REGION=device", dev);
    }
    base_ = static_cast<std::byte*>(pinned->get());
    memory_ = std::move(pinned);
  } else {
    // Whole host pages: a dma-buf covers page-aligned ranges only (cudaMalloc's base is aligned far beyond a page).
    const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t allocBytes = (layout_.bytes() + page - 1) / page * page;
    auto buffer = std::make_shared<k::DeviceBuffer>(k::DeviceBuffer::allocate(dev, allocBytes, "GPU exchange region"));
    base_ = static_cast<std::byte*>(buffer->get());
    memory_ = std::move(buffer);
    // The flags start at 0 (epochs start at 1), before the peers may write into it (once they have our key). On a
    // stream of its own, never a device-wide sync: the daemon executor's persistent kernel, or another communicator's
    // exchange kernel, may be running on this GPU.
    const k::CudaStream stream = k::CudaStream::create(dev, "GPU exchange region setup");
    k::CudaDeviceGuard guard(dev);
    k::checkCuda(cudaMemsetAsync(base(), 0, GpuRegionLayout::kHeaderBytes, stream.get()),
                 "cudaMemsetAsync(GPU exchange header)");
    k::checkCuda(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize(GPU exchange header)");
    // A NIC reaches GPU memory through a dma-buf of it (ibv_reg_dmabuf_mr); without one the transport registers the
    // pointer itself (ibv_reg_mr, which needs nvidia-peermem). Only verbs registers anything with a NIC.
    if (kind == transport::TransportKind::kVerbs) {
      std::string why;
      dmabuf = exportDmabuf(dev, base_, allocBytes, why);
      if (!dmabuf) spdlog::warn("GPU exchange region on GPU {}: no dma-buf ({}); the NIC gets the pointer", dev, why);
    }
  }
  page_ = k::PinnedHostBuffer::allocate(sizeof(Page), "GPU exchange plan page");
  releaseStream_ = k::CudaStream::create(dev, "GPU exchange release");
  std::memset(page_.get(), 0, sizeof(Page));
  Page* pg = page();
  id_ = proxy_->add(base(), layout_.bytes(), host_ ? transport::MemoryKind::kHost : transport::MemoryKind::kDevice,
                    dmabuf.get(), region_,
                    [pg, link = std::move(link)](ErrorCode code, const std::string& reason) {
                      // release: pairs with the kernels' relaxed polls of the abort word (any later read sees it).
                      std::atomic_ref<uint64_t>(pg->abortWord).store(1, std::memory_order_release);
                      if (auto l = link.lock()) l->abort(code, reason);
                    });
  // The registration holds its own reference to the dma-buf: our fd closes here (Fd's destructor).
  if (const std::string how = proxy_->transport().registration(region_); !how.empty()) {
    describe_ += fmt::format(", registered with the NIC through {}", how);
  }
}

GpuRegion::~GpuRegion() {
  if (id_ != 0) proxy_->retire(id_, memory_, grace_);
}

GpuRegion::Page* GpuRegion::page() const { return static_cast<Page*>(page_.get()); }
GpuRegion::Page* GpuRegion::pageDevice() const { return static_cast<Page*>(page_.devicePtr()); }

transport::RemoteKey GpuRegion::key() const { return proxy_->transport().remoteKey(region_); }

void GpuRegion::setPeerKeys(const std::map<NodeIndex, transport::RemoteKey>& keys) { proxy_->setPeerKeys(id_, keys); }

k::SpanExchangePlan* GpuRegion::preparePlan(const ExchangeOp& op, uint64_t epoch, uint64_t prevEpoch,
                                            uint64_t timeoutNs, const std::vector<uint64_t>& cuts) {
  Page* pg = page();
  Page* dev = pageDevice();
  const auto passes = static_cast<uint32_t>(cuts.size() + 1);
  if (passes > k::kSpanMaxPasses) fail(ErrorCode::kInternal, "GPU exchange: {} passes", passes);
  k::SpanExchangePlan& p = pg->plan[0];
  p = k::SpanExchangePlan{};
  p.fifo = proxy_->deviceRef();
  p.abortWord = &dev->abortWord;
  p.errorSlot = &dev->errorSlot;
  p.failed = &dev->failed;
  p.pushStatus = &dev->pushStatus;
  p.lastTicket = &dev->lastTicket;
  p.timeoutNs = timeoutNs;
  p.epoch = epoch;
  p.prevEpoch = prevEpoch;
  p.arrivedFlagOffset = GpuRegionLayout::arrivedOffset(layout_.self);
  p.consumedFlagOffset = GpuRegionLayout::consumedOffset(layout_.self);
  p.bufferId = id_;
  p.op = static_cast<uint32_t>(op.descs.at(0).kind);
  p.self = layout_.self;
  const std::vector<uint32_t> peers = layout_.peers();
  if (peers.size() > k::kSpanPlanMaxPeers) fail(ErrorCode::kInternal, "GPU exchange: {} peers", peers.size());
  p.peers = static_cast<uint32_t>(peers.size());
  for (uint32_t i = 0; i < p.peers; ++i) {
    p.peerNode[i] = peers[i];
    p.arrived[i] = reinterpret_cast<const uint64_t*>(base() + GpuRegionLayout::arrivedOffset(peers[i]));
    p.consumed[i] = reinterpret_cast<const uint64_t*>(base() + GpuRegionLayout::consumedOffset(peers[i]));
  }
  for (uint32_t q = 1; q < passes; ++q) pg->plan[q] = p;  // the same words and peers; writes below
  uint32_t w[k::kSpanMaxPasses] = {};
  for (uint32_t i = 0; i < p.peers; ++i) {
    const auto split = splitIntoPasses(exchangeWrites(op, layout_, layout_.self, peers[i]), cuts);
    for (uint32_t q = 0; q < passes; ++q) {
      k::SpanExchangePlan& plan = pg->plan[q];
      plan.firstWrite[i] = w[q];
      for (const ExchangeWrite& x : split[q]) {
        if (w[q] == k::kSpanPlanMaxWrites) fail(ErrorCode::kInternal, "GPU exchange: more than {} writes", w[q]);
        plan.writes[w[q]++] = k::SpanPlanWrite{id_, id_, x.srcOffset, x.dstOffset, static_cast<uint32_t>(x.bytes)};
      }
      plan.writeCount[i] = w[q] - plan.firstWrite[i];
    }
  }
  for (uint32_t q = 0; q < passes; ++q) pg->plan[q].flag = q + 1 == passes ? 1 : 0;
  passes_ = passes;
  pg->failed = 0;
  pg->pushStatus = 0;
  pg->lastTicket = 0;
  pg->errorSlot = k::ErrorSlot{};
  // release: the plan and cleared words before the launches that read them (the launch orders them anyway).
  std::atomic_thread_fence(std::memory_order_release);
  return &p;
}

const k::SpanExchangePlan* GpuRegion::planDevice(uint32_t pass) const { return &pageDevice()->plan[pass]; }
const k::SpanExchangePlan* GpuRegion::plan(uint32_t pass) const { return &page()->plan[pass]; }

void GpuRegion::releaseWaits(uint64_t epoch) {
  // Past every epoch waited for, in the 32-bit wrap-aware compare of the stream waits (and >= for 64-bit readers).
  const uint64_t value = (epoch & 0xffffffffu) + (uint64_t{1} << 30);
  if (host_) {
    // release: a plain store the GPU's stream waits and polls see (they read the host memory itself).
    for (uint32_t n : layout_.nodes) {
      if (n == layout_.self) continue;
      for (uint64_t off : {GpuRegionLayout::arrivedOffset(n), GpuRegionLayout::consumedOffset(n)}) {
        std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base() + off)).store(value, std::memory_order_release);
      }
    }
    return;
  }
  page()->releaseValue = value;
  try {
    k::CudaDeviceGuard guard(device());
    for (uint32_t n : layout_.nodes) {
      if (n == layout_.self) continue;
      for (uint64_t off : {GpuRegionLayout::arrivedOffset(n), GpuRegionLayout::consumedOffset(n)}) {
        k::checkCuda(cudaMemcpyAsync(base() + off, &page()->releaseValue, 8, cudaMemcpyHostToDevice,
                                     releaseStream_.get()),
                     "cudaMemcpyAsync(GPU exchange release)");
      }
    }
    k::checkCuda(cudaStreamSynchronize(releaseStream_.get()), "cudaStreamSynchronize(GPU exchange release)");
  } catch (const std::exception& e) {
    spdlog::error("GPU exchange: releasing the stream waits failed: {}", e.what());
  }
}

std::string GpuRegion::failure() const {
  const Page* pg = page();
  // acquire: pairs with the kernels' release store of `failed` (after the error slot or the push status).
  const uint32_t why = loadAcquire(pg->failed);
  if (why == 0) return "";
  if (why == k::kSpanFailedPush) {
    static constexpr const char* kNames[] = {"ok", "the FIFO was stopped (tandemd is shutting down)",
                                             "no FIFO slot within the deadline (the proxy is stuck)", "too large"};
    const uint32_t s = loadAcquire(pg->pushStatus);
    return fmt::format("the GPU's push of transfer commands failed: {}", s < 4 ? kNames[s] : "?");
  }
  const k::ErrorSlot& e = pg->errorSlot;
  if (loadAcquire(e.claimed) != k::kErrorSlotReady) return "a GPU wait of the exchange failed";
  const bool timeout = e.code == static_cast<uint32_t>(k::WaitError::kTimeout);
  return fmt::format("{} waiting on the GPU for node {}'s {} flag >= {} (saw {})",
                     timeout ? "timed out" : "aborted", e.chunk,
                     e.role == static_cast<uint32_t>(k::Role::kInterSend) ? "consumed" : "arrived", e.expected,
                     e.observed);
}

uint64_t GpuRegion::lastTicket() const { return loadAcquire(page()->lastTicket); }

void GpuRegion::abort() {
  // release: the kernels poll it with relaxed system-scope loads; any later load sees it.
  std::atomic_ref<uint64_t>(page()->abortWord).store(1, std::memory_order_release);
}

bool GpuRegion::aborted() const { return loadAcquire(page()->abortWord) != 0; }

}  // namespace tandem::daemon::cuda
