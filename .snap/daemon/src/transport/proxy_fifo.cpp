#include "transport/proxy_fifo.hpp"

#include <pthread.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#if TANDEM_HAVE_NUMA
#include <numa.h>
#endif

namespace tandem::daemon::transport {

namespace {

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Host accessors for the plain-integer fields of the shared layout.
inline std::atomic_ref<uint64_t> ref(uint64_t& word) { return std::atomic_ref<uint64_t>(word); }
inline std::atomic_ref<uint32_t> ref(uint32_t& word) { return std::atomic_ref<uint32_t>(word); }
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(std::atomic_ref<uint64_t>::required_alignment <= alignof(uint64_t));

const char* opcodeName(ProxyOpcode op) {
  switch (op) {
    case ProxyOpcode::kInvalid: return "invalid";
    case ProxyOpcode::kWrite: return "write";
    case ProxyOpcode::kFlag: return "flag";
    case ProxyOpcode::kNop: return "nop";
  }
  return "unknown";
}

}  // namespace

// ---- ProxyFifoView ----

ProxyFifoView ProxyFifoView::format(std::byte* base, uint64_t bytes, uint32_t capacity) {
  if (!fifo::isPowerOfTwo(capacity) || capacity < kProxyFifoMinCapacity || capacity > kProxyFifoMaxCapacity)
    fail(ErrorCode::kInvalidArgument, "proxy fifo: capacity {} must be a power of two in [{}, {}]", capacity,
         kProxyFifoMinCapacity, kProxyFifoMaxCapacity);
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % alignof(ProxyFifoHeader) != 0)
    fail(ErrorCode::kInvalidArgument, "proxy fifo: region must be {}-byte aligned", alignof(ProxyFifoHeader));
  if (bytes < ProxyFifoLayout::bytesFor(capacity))
    fail(ErrorCode::kInvalidArgument, "proxy fifo: region of {} bytes is too small for {} slots ({} bytes needed)",
         bytes, capacity, ProxyFifoLayout::bytesFor(capacity));
  auto* header = reinterpret_cast<ProxyFifoHeader*>(base + ProxyFifoLayout::kHeaderOffset);
  auto* control = reinterpret_cast<ProxyFifoControl*>(base + ProxyFifoLayout::kControlOffset);
  auto* slots = reinterpret_cast<ProxyCommand*>(base + ProxyFifoLayout::kSlotsOffset);
  // Plain stores: nobody else uses the region before format returns and the daemon hands it out.
  std::memset(static_cast<void*>(control), 0, sizeof(ProxyFifoControl));
  for (uint64_t i = 0; i < capacity; ++i) {
    slots[i] = ProxyCommand{fifo::packControl(fifo::initialSeq(i, capacity), ProxyOpcode::kInvalid, 0, 0), 0, 0, 0, 0};
  }
  header->magic = kProxyFifoMagic;
  header->version = kProxyFifoVersion;
  header->capacity = capacity;
  return attach(base, bytes);
}

ProxyFifoView ProxyFifoView::attach(std::byte* base, uint64_t bytes) {
  if (base == nullptr || bytes < ProxyFifoLayout::kSlotsOffset)
    fail(ErrorCode::kProtocol, "proxy fifo: region of {} bytes is smaller than its header", bytes);
  const auto* header = reinterpret_cast<const ProxyFifoHeader*>(base);
  if (header->magic != kProxyFifoMagic)
    fail(ErrorCode::kProtocol, "proxy fifo: bad magic {:#x} (not a formatted proxy FIFO)", header->magic);
  if (header->version != kProxyFifoVersion)
    fail(ErrorCode::kProtocol, "proxy fifo: layout version {} (this build uses {}); restart clients and daemon "
         "from the same release", header->version, kProxyFifoVersion);
  const uint32_t cap = header->capacity;
  if (!fifo::isPowerOfTwo(cap) || cap < kProxyFifoMinCapacity || cap > kProxyFifoMaxCapacity ||
      bytes < ProxyFifoLayout::bytesFor(cap))
    fail(ErrorCode::kProtocol, "proxy fifo: header capacity {} does not fit a region of {} bytes", cap, bytes);
  ProxyFifoView v;
  v.control_ = reinterpret_cast<ProxyFifoControl*>(base + ProxyFifoLayout::kControlOffset);
  v.slots_ = reinterpret_cast<ProxyCommand*>(base + ProxyFifoLayout::kSlotsOffset);
  v.capacity_ = cap;
  return v;
}

void ProxyFifoView::requestStop() const {
  // release: everything the stopper wrote before is visible to a producer that sees the stop word.
  ref(control_->stop).store(1, std::memory_order_release);
}
bool ProxyFifoView::stopRequested() const { return ref(control_->stop).load(std::memory_order_acquire) != 0; }
// acquire: pairs with the release stores in Proxy::publishWatermarks (P3).
uint64_t ProxyFifoView::completed() const { return ref(control_->completed).load(std::memory_order_acquire); }
uint64_t ProxyFifoView::errors() const { return ref(control_->errors).load(std::memory_order_acquire); }

// ---- ProxyFifoProducer ----

namespace {
// Back off while the ring is full: spin briefly (the consumer is usually a few hundred ns behind), then yield,
// then sleep. Sleeping matters when threads outnumber cores: sched_yield does not reliably hand the CPU to the
// thread the consumer is waiting for under CFS.
void backoff(uint32_t& spins) {
  ++spins;
  if (spins < 1024) {
    cpuRelax();
  } else if (spins < 1024 + 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}
}  // namespace

void ProxyFifoProducer::waitForRoom(uint64_t lastTicket, uint32_t& spins) {
  ProxyFifoControl* ctl = fifo_.control();
  const uint64_t cap = fifo_.capacity();
  while (fifo::looksFull(lastTicket, tailCache_, cap)) {
    // acquire: pairs with the release store of tail in ProxyFifoConsumer::publishTail (P2): the consumer has
    // finished reading every slot below tail, so a slot may be overwritten once tail passes its last use.
    tailCache_ = ref(ctl->tail).load(std::memory_order_acquire);
    if (!fifo::looksFull(lastTicket, tailCache_, cap)) return;
    ++fullWaits_;
    if (fifo_.stopRequested())
      fail(ErrorCode::kAborted, "proxy fifo: stopped while waiting for a free slot (ticket {})", lastTicket);
    backoff(spins);
  }
}

uint64_t ProxyFifoProducer::claim(uint64_t n) {
  ProxyFifoControl* ctl = fifo_.control();
  const uint64_t cap = fifo_.capacity();
  uint32_t spins = 0;
  // Wait for room before claiming, so that a producer seldom holds claimed, unpublished tickets while it
  // waits (the consumer stalls at such a ticket, and every other producer with it). Only a hint: producers
  // race between this check and the fetch_add; waitForRoom after it is the real guard.
  for (;;) {
    // relaxed: head is only a ticket counter; a stale value only makes the hint more or less eager.
    const uint64_t head = ref(ctl->head).load(std::memory_order_relaxed);
    if (!fifo::lacksRoom(head, tailCache_, n, cap)) break;
    // acquire: pairs with the release store of tail in ProxyFifoConsumer::publishTail (P2).
    tailCache_ = ref(ctl->tail).load(std::memory_order_acquire);
    if (!fifo::lacksRoom(head, tailCache_, n, cap)) break;
    ++fullWaits_;
    if (fifo_.stopRequested()) fail(ErrorCode::kAborted, "proxy fifo: stopped while waiting for room");
    backoff(spins);
  }
  // relaxed: the head only hands out unique tickets; each slot's release store publishes its command (P1).
  return ref(ctl->head).fetch_add(n, std::memory_order_relaxed);
}

void ProxyFifoProducer::publish(uint64_t ticket, const ProxyCommand& command) {
  ProxyCommand& slot = fifo_.slots()[fifo::slotOf(ticket, fifo_.capacity())];
  // Plain stores: no reader touches these words until it has seen the release store below (P1), and no
  // other producer holds this slot until the consumer has passed it (P2).
  slot.srcBuffer = command.srcBuffer;
  slot.dstBuffer = command.dstBuffer;
  slot.a = command.a;
  slot.b = command.b;
  // release: publishes words 1..3 of the slot; pairs with the acquire load in ProxyFifoConsumer::pop (P1).
  ref(slot.control).store((command.control & ~uint64_t{0xffffffff}) | fifo::seqOf(ticket), std::memory_order_release);
}

uint64_t ProxyFifoProducer::push(const ProxyCommand& command) {
  const uint64_t ticket = claim(1);
  uint32_t spins = 0;
  waitForRoom(ticket, spins);
  publish(ticket, command);
  return ticket;
}

uint64_t ProxyFifoProducer::pushBatch(std::span<const ProxyCommand> commands) {
  if (commands.empty()) return ref(fifo_.control()->head).load(std::memory_order_relaxed);
  if (commands.size() > fifo_.capacity())
    fail(ErrorCode::kInvalidArgument, "proxy fifo: batch of {} commands exceeds the capacity {}", commands.size(),
         fifo_.capacity());
  const uint64_t first = claim(commands.size());
  uint32_t spins = 0;
  // Publish in ticket order, each slot as soon as it is free: the consumer can start on the first ones.
  for (std::size_t i = 0; i < commands.size(); ++i) {
    waitForRoom(first + i, spins);
    publish(first + i, commands[i]);
  }
  return first;
}

uint64_t ProxyFifoProducer::pushWrite(uint16_t peer, uint32_t srcBuffer, uint64_t srcOffset, uint32_t dstBuffer,
                                      uint64_t dstOffset, uint64_t bytes, bool signal) {
  if (srcOffset > kProxyMaxOffset || dstOffset > kProxyMaxOffset)
    fail(ErrorCode::kInvalidArgument, "proxy fifo: offset {} exceeds the command's 48-bit limit",
         std::max(srcOffset, dstOffset));
  if (bytes > kProxyMaxBytes)
    fail(ErrorCode::kInvalidArgument, "proxy fifo: write of {} bytes exceeds the command's 32-bit limit; split it",
         bytes);
  return push(fifo::makeWrite(peer, srcBuffer, srcOffset, dstBuffer, dstOffset, static_cast<uint32_t>(bytes),
                              signal ? kProxyFlagSignal : 0));
}

uint64_t ProxyFifoProducer::pushFlag(uint16_t peer, uint32_t dstBuffer, uint64_t dstOffset, uint64_t value,
                                     bool signal) {
  return push(fifo::makeFlag(peer, dstBuffer, dstOffset, value, signal ? kProxyFlagSignal : 0));
}

// ---- ProxyFifoConsumer ----

ProxyFifoConsumer::ProxyFifoConsumer(ProxyFifoView fifo) : fifo_(fifo) {
  // The consumer resumes where the replica says (a restarted proxy on a live FIFO); fresh FIFOs start at 0.
  index_ = published_ = ref(fifo_.control()->tail).load(std::memory_order_acquire);
}

std::size_t ProxyFifoConsumer::pop(std::span<ProxyCommand> out) {
  const uint64_t cap = fifo_.capacity();
  ProxyCommand* slots = fifo_.slots();
  std::size_t n = 0;
  while (n < out.size()) {
    ProxyCommand& slot = slots[fifo::slotOf(index_, cap)];
    // acquire: pairs with the release store of slot.control in ProxyFifoProducer::push (P1).
    const uint64_t control = ref(slot.control).load(std::memory_order_acquire);
    if (fifo::seqField(control) != fifo::seqOf(index_)) break;  // not yet published
    out[n] = ProxyCommand{control, slot.srcBuffer, slot.dstBuffer, slot.a, slot.b};
    ++index_;
    ++n;
  }
  return n;
}

void ProxyFifoConsumer::publishTail() {
  if (index_ == published_) return;
  // release: every slot below index_ has been copied out; pairs with the acquire load of tail in
  // ProxyFifoProducer::push (P2). Lazy: once per batch, and producers read it only when the ring looks full.
  ref(fifo_.control()->tail).store(index_, std::memory_order_release);
  published_ = index_;
}

// ---- ProxyBufferTable and validation ----

void ProxyBufferTable::addLocal(uint32_t id, LocalRegion region, uint64_t bytes) {
  if (id == 0 || id > kMaxBufferId)
    fail(ErrorCode::kInvalidArgument, "proxy buffer table: local id {} outside [1, {}]", id, kMaxBufferId);
  if (!region || bytes == 0)
    fail(ErrorCode::kInvalidArgument, "proxy buffer table: local id {} needs a registered, non-empty region", id);
  if (locals_.size() <= id) locals_.resize(id + 1);
  locals_[id] = Local{region, bytes};
}

void ProxyBufferTable::addRemote(uint32_t id, NodeIndex peer, const RemoteKey& key) {
  if (id == 0 || id > kMaxBufferId)
    fail(ErrorCode::kInvalidArgument, "proxy buffer table: remote id {} outside [1, {}]", id, kMaxBufferId);
  if (key.bytes == 0) fail(ErrorCode::kInvalidArgument, "proxy buffer table: remote id {} has an empty key", id);
  if (key.owner != peer)
    fail(ErrorCode::kInvalidArgument, "proxy buffer table: remote id {} for node {} carries a key owned by node {}",
         id, peer, key.owner);
  if (remotes_.size() <= id) remotes_.resize(id + 1);
  if (remotes_[id].size() <= peer) remotes_[id].resize(peer + 1);
  remotes_[id][peer] = key;
}

CommandCheck validateCommand(const ProxyCommand& c, const ProxyBufferTable& table, NodeIndex self, uint32_t nodeCount,
                             ResolvedCommand& out) {
  const ProxyOpcode op = fifo::opcodeField(c.control);
  const uint8_t flags = fifo::flagsField(c.control);
  const NodeIndex peer = fifo::peerField(c.control);
  auto bad = [&](ErrorCode code, std::string msg) { return CommandCheck{code, std::move(msg)}; };

  if (op != ProxyOpcode::kWrite && op != ProxyOpcode::kFlag)
    return bad(ErrorCode::kInvalidArgument,
               fmt::format("proxy command: unknown opcode {} (expected write=1 or flag=2)", static_cast<int>(op)));
  if ((flags & ~kProxyKnownFlags) != 0)
    return bad(ErrorCode::kInvalidArgument, fmt::format("proxy command: unknown flag bits {:#x}", flags & ~kProxyKnownFlags));
  if (peer >= nodeCount)
    return bad(ErrorCode::kInvalidArgument,
               fmt::format("proxy command: {} to node {}, but the cluster has {} nodes", opcodeName(op), peer, nodeCount));
  if (peer == self)
    return bad(ErrorCode::kInvalidArgument,
               fmt::format("proxy command: {} to node {}, which is this node; intra-node traffic goes over NVLink or "
                           "shared memory, not the proxy", opcodeName(op), peer));
  const RemoteKey* dst = table.remote(c.dstBuffer, peer);
  if (dst == nullptr)
    return bad(ErrorCode::kNotFound,
               fmt::format("proxy command: {} names remote buffer id {} that node {} has not registered with this "
                           "communicator", opcodeName(op), c.dstBuffer, peer));
  out = ResolvedCommand{};
  out.opcode = op;
  out.peer = peer;
  out.signal = (flags & kProxyFlagSignal) != 0;
  out.dst = dst;
  if (op == ProxyOpcode::kWrite) {
    const ProxyBufferTable::Local* src = table.local(c.srcBuffer);
    if (src == nullptr)
      return bad(ErrorCode::kNotFound,
                 fmt::format("proxy command: write names local buffer id {} that is not registered", c.srcBuffer));
    out.src = src->region;
    out.srcOffset = fifo::writeSrcOffset(c);
    out.dstOffset = fifo::writeDstOffset(c);
    out.bytes = fifo::writeBytes(c);
    if (out.bytes == 0) return bad(ErrorCode::kInvalidArgument, "proxy command: write of 0 bytes");
    if (!detail::inBounds(out.srcOffset, out.bytes, src->bytes))
      return bad(ErrorCode::kInvalidArgument,
                 fmt::format("proxy command: write reads [{}, +{}) of local buffer {} which has {} bytes", out.srcOffset,
                             out.bytes, c.srcBuffer, src->bytes));
    if (!detail::inBounds(out.dstOffset, out.bytes, dst->bytes))
      return bad(ErrorCode::kInvalidArgument,
                 fmt::format("proxy command: write to [{}, +{}) of remote buffer {} on node {} which has {} bytes",
                             out.dstOffset, out.bytes, c.dstBuffer, peer, dst->bytes));
  } else {
    if (c.srcBuffer != 0)
      return bad(ErrorCode::kInvalidArgument, "proxy command: flag with a nonzero source buffer id");
    out.dstOffset = fifo::flagDstOffset(c);
    out.value = fifo::flagValue(c);
    if (out.dstOffset % 8 != 0)
      return bad(ErrorCode::kInvalidArgument,
                 fmt::format("proxy command: flag offset {} is not 8-byte aligned", out.dstOffset));
    if (!detail::inBounds(out.dstOffset, 8, dst->bytes))
      return bad(ErrorCode::kInvalidArgument,
                 fmt::format("proxy command: flag at offset {} of remote buffer {} on node {} which has {} bytes",
                             out.dstOffset, c.dstBuffer, peer, dst->bytes));
  }
  return {};
}

// ---- Proxy ----

Proxy::Proxy(ProxyFifoView fifo, Transport& transport, ProxyOptions options)
    : fifo_(fifo), consumer_(fifo), transport_(transport), options_(std::move(options)) {
  if (!fifo_) fail(ErrorCode::kInvalidArgument, "proxy '{}': no FIFO", options_.name);
  if (options_.maxBatch == 0) options_.maxBatch = 1;
  batch_.resize(options_.maxBatch);
  completionBuf_.resize(std::max<uint32_t>(options_.maxBatch, 16));
  publishedCompleted_ = fifo_.completed();
  publishedErrors_ = errors_ = fifo_.errors();
}

Proxy::~Proxy() { stop(); }

void Proxy::setBufferTable(std::shared_ptr<const ProxyBufferTable> table) {
  std::lock_guard lock(tableMutex_);
  pendingTable_ = std::move(table);
  // release: the table is fully built before the proxy thread sees the flag (it then takes the mutex).
  tableChanged_.store(true, std::memory_order_release);
}

void Proxy::setErrorHandler(std::function<void(const ProxyCommandError&)> handler) {
  errorHandler_ = std::move(handler);
}

void Proxy::start() {
  if (thread_.joinable()) return;
  stop_.store(false, std::memory_order_relaxed);
  thread_ = std::thread([this] { threadMain(); });
}

void Proxy::stop() {
  stop_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) thread_.join();
}

void Proxy::reportError(uint64_t ticket, const ProxyCommand& command, ErrorCode code, std::string message) {
  ++errors_;
  ProxyCommandError e{ticket, command, code, std::move(message)};
  if (errorHandler_) {
    try {
      errorHandler_(e);
    } catch (const std::exception& ex) {
      spdlog::error("{}: error handler threw: {}", options_.name, ex.what());
    }
  } else {
    spdlog::warn("{}: command {} rejected: {}", options_.name, ticket, e.message);
  }
}

void Proxy::handleCompletion(const Completion& completion) {
  const uint64_t ticket = completion.cookie;
  auto it = std::lower_bound(outstanding_.begin(), outstanding_.end(), std::pair<uint64_t, bool>{ticket, false});
  if (it != outstanding_.end() && it->first == ticket) it->second = true;
  while (!outstanding_.empty() && outstanding_.front().second) outstanding_.pop_front();
  if (completion.code != ErrorCode::kOk) {
    failed_.store(failed_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    const PeerStatus st = transport_.peerStatus(completion.peer);
    reportError(ticket, ProxyCommand{}, completion.code,
                fmt::format("proxy: transfer to node {} failed: {}", completion.peer,
                            st.reason.empty() ? std::string(errorCodeName(completion.code)) : st.reason));
  }
}

void Proxy::publishWatermarks() {
  const uint64_t completed = outstanding_.empty() ? consumer_.index() : outstanding_.front().first;
  ProxyFifoControl* ctl = fifo_.control();
  if (completed != publishedCompleted_) {
    // release: pairs with the acquire load in ProxyFifoView::completed (P3).
    ref(ctl->completed).store(completed, std::memory_order_release);
    publishedCompleted_ = completed;
  }
  if (errors_ != publishedErrors_) {
    ref(ctl->errors).store(errors_, std::memory_order_release);  // P3, as above
    publishedErrors_ = errors_;
  }
}

std::size_t Proxy::runOnce() {
  const uint64_t first = consumer_.index();
  const std::size_t n = consumer_.pop(batch_);
  // Pick up a new table after popping, not before: a producer that set the table and then pushed published
  // both with the slot's release store, so a command popped here is always judged by a table at least as new.
  if (tableChanged_.load(std::memory_order_acquire)) {
    std::lock_guard lock(tableMutex_);
    table_ = pendingTable_;
    tableChanged_.store(false, std::memory_order_relaxed);
  }
  if (n > 0) {
    const NodeIndex self = transport_.self();
    const uint32_t nodes = transport_.nodeCount();
    uint64_t posted = 0, rejected = 0, failed = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const ProxyCommand& cmd = batch_[i];
      const uint64_t ticket = first + i;
      if (fifo::opcodeField(cmd.control) == ProxyOpcode::kNop) continue;
      if (!table_) {
        ++rejected;
        reportError(ticket, cmd, ErrorCode::kUnavailable,
                    "proxy command: no buffer table yet (the communicator has not finished setting up)");
        continue;
      }
      ResolvedCommand r;
      CommandCheck check = validateCommand(cmd, *table_, self, nodes, r);
      if (!check.ok()) {
        ++rejected;
        reportError(ticket, cmd, check.code, std::move(check.message));
        continue;
      }
      try {
        if (r.opcode == ProxyOpcode::kWrite) {
          transport_.write(r.peer, r.src, r.srcOffset, *r.dst, r.dstOffset, r.bytes, ticket, r.signal);
        } else {
          transport_.writeFlag(r.peer, *r.dst, r.dstOffset, r.value, ticket, r.signal);
        }
        ++posted;
        if (r.signal) outstanding_.emplace_back(ticket, false);
      } catch (const Error& e) {
        ++failed;
        reportError(ticket, cmd, e.code(), e.what());
      } catch (const std::exception& e) {
        ++failed;
        reportError(ticket, cmd, ErrorCode::kInternal, e.what());
      }
    }
    if (posted > 0) {
      transport_.submit();
      submits_.store(submits_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    }
    consumer_.publishTail();
    // Single writer: plain load+store instead of a locked read-modify-write.
    popped_.store(popped_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    posted_.store(posted_.load(std::memory_order_relaxed) + posted, std::memory_order_relaxed);
    rejected_.store(rejected_.load(std::memory_order_relaxed) + rejected, std::memory_order_relaxed);
    failed_.store(failed_.load(std::memory_order_relaxed) + failed, std::memory_order_relaxed);
  }
  const std::size_t k = transport_.poll(completionBuf_);
  for (std::size_t i = 0; i < k; ++i) handleCompletion(completionBuf_[i]);
  if (k > 0) completions_.store(completions_.load(std::memory_order_relaxed) + k, std::memory_order_relaxed);
  publishWatermarks();
  return n;
}

ProxyStats Proxy::stats() const {
  return ProxyStats{popped_.load(std::memory_order_relaxed),   posted_.load(std::memory_order_relaxed),
                    rejected_.load(std::memory_order_relaxed), failed_.load(std::memory_order_relaxed),
                    submits_.load(std::memory_order_relaxed),  completions_.load(std::memory_order_relaxed)};
}

void Proxy::pinThread() {
  const std::string threadName = options_.name.substr(0, 15);  // the kernel's limit (16 with NUL)
  pthread_setname_np(pthread_self(), threadName.c_str());
  if (options_.numaNode < 0) return;
#if TANDEM_HAVE_NUMA
  if (numa_available() < 0) {
    spdlog::warn("{}: not pinned to NUMA node {}: libnuma reports no NUMA support on this host", options_.name,
                 options_.numaNode);
    return;
  }
  if (options_.numaNode > numa_max_node()) {
    spdlog::warn("{}: not pinned to NUMA node {}: this host has nodes 0..{}", options_.name, options_.numaNode,
                 numa_max_node());
    return;
  }
  if (numa_run_on_node(options_.numaNode) != 0) {
    spdlog::warn("{}: not pinned to NUMA node {}: numa_run_on_node -> {}", options_.name, options_.numaNode,
                 std::strerror(errno));
    return;
  }
  numa_set_preferred(options_.numaNode);
  spdlog::info("{}: pinned to NUMA node {}", options_.name, options_.numaNode);
#else
  spdlog::warn("{}: not pinned to NUMA node {}: built without libnuma (install libnuma-dev and rebuild)",
               options_.name, options_.numaNode);
#endif
}

void Proxy::threadMain() {
  pinThread();
  uint32_t idle = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    std::size_t n = 0;
    try {
      n = runOnce();
    } catch (const std::exception& e) {
      // runOnce reports per-command errors itself; anything here is a transport fault (poll/submit threw).
      spdlog::error("{}: {}", options_.name, e.what());
    }
    if (n > 0 || !outstanding_.empty()) {
      idle = 0;
      continue;
    }
    if (++idle < options_.idleSpins) {
      cpuRelax();
    } else if (idle < options_.idleSpins + 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(options_.idleSleepUs));
    }
  }
}

}  // namespace tandem::daemon::transport
