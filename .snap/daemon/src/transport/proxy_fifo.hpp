// The GPU-to-daemon transfer-command FIFO (ARCHITECTURE.md decision 6) and the proxy thread that drains it.
//
// Memory: one region of pinned, shared host memory (a memfd mapped by the daemon, registered with the GPU
// as host-mapped memory), laid out as ProxyFifoLayout says:
//   [0,128)    ProxyFifoHeader   magic, version, capacity (written once by the daemon before any producer)
//   [128,512)  ProxyFifoControl  head | tail | completed+errors+stop, each on its own 128-byte line
//   [512,...)  ProxyCommand[capacity], 32 bytes each, capacity a power of two
//
// Protocol (several producers, one consumer):
//   producer: while (head - tailCache >= capacity)         looks full (a hint, before claiming): only now
//                 tailCache = load_acquire(tail)            re-read tail
//             t = fetch_add(head, 1)                       claims ticket t, slot t & (capacity-1)
//             while (t - tailCache >= capacity)             still full (producers raced): re-read tail
//                 tailCache = load_acquire(tail)
//             write words 1..3 of the slot (plain stores)
//             store_release(slot.control, seq(t)|opcode|flags|peer)    one release store publishes it
//   consumer: c = its private index
//             if (load_acquire(slot[c].control).seq == seq(c))  copy the command out, c += 1
//             after each batch: store_release(tail, c)   the lazy replica of c that producers read
// Pairs:
//   (P1) producer release store of slot.control  -> consumer acquire load in ProxyFifoConsumer::pop
//        publishes the command words.
//   (P2) consumer release store of tail in publishTail -> producer acquire load of tail in push
//        publishes "the consumer has finished reading every slot below tail", so the producer may overwrite.
//   (P3) proxy release store of completed / errors -> producer acquire load in completed()/errors()
//        publishes that the transfers up to that ticket completed (or were rejected).
// The head counter needs no ordering of its own (relaxed fetch_add): it only hands out unique tickets.
//
// A slot's seq is the low 32 bits of ticket+1; a slot never yet written holds the seq of "ticket - capacity"
// (the previous lap), so it never matches. 32 bits suffice because a slot is reused only after the consumer
// has read it, so the stale value a consumer can see is exactly one lap (capacity < 2^31) behind.
//
// Per-producer order: a producer's tickets increase in program order and the consumer takes tickets in
// order, so each producer's commands are seen in the order it pushed them.
//
// Device side (NOTE for the CUDA executor, kernels/device/): every field is a plain integer accessed
// through an atomic_ref, so the same layout works with cuda::atomic_ref<_, cuda::thread_scope_system>:
//   t = atomic_ref(head).fetch_add(1, relaxed); spin on tail with ld.acquire.sys while full (checking the
//   stop word and a globaltimer deadline through waitUntil); write words 1..3; then
//   atomic_ref(slot.control).store(packControl(seq(t), ...), release) at system scope (stReleaseSys).
// One thread per warp pushes (kernels/device/proxy_push.cuh). The encode helpers are constexpr and free of std::
// containers, in tandem/common/proxy_fifo_layout.hpp, which device code includes too.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/common/proxy_fifo_layout.hpp"
#include "transport/transport.hpp"

namespace tandem::daemon::transport {

// ---------------------------------------------------------------------------------------------------------
// Layout (plain data, shared with device code)
// ---------------------------------------------------------------------------------------------------------

// The layout lives in tandem/common/proxy_fifo_layout.hpp so that kernels include the same definitions.
using ::tandem::proxy::kProxyFifoMagic;
using ::tandem::proxy::kProxyFifoMaxCapacity;
using ::tandem::proxy::kProxyFifoMinCapacity;
using ::tandem::proxy::kProxyFifoVersion;
using ::tandem::proxy::kProxyFlagSignal;
using ::tandem::proxy::kProxyKnownFlags;
using ::tandem::proxy::kProxyMaxBytes;
using ::tandem::proxy::kProxyMaxOffset;
using ::tandem::proxy::ProxyCommand;
using ::tandem::proxy::ProxyFifoControl;
using ::tandem::proxy::ProxyFifoDeviceRef;
using ::tandem::proxy::ProxyFifoHeader;
using ::tandem::proxy::ProxyFifoLayout;
using ::tandem::proxy::ProxyOpcode;
namespace fifo = ::tandem::proxy::fifo;

// ---------------------------------------------------------------------------------------------------------
// Host views (producers on the CPU backend's executor threads, the consumer in the proxy thread)
// ---------------------------------------------------------------------------------------------------------

/// Non-owning view of a formatted FIFO region. The mapping must outlive every view.
class ProxyFifoView {
 public:
  ProxyFifoView() = default;
  /// Formats a fresh region of at least ProxyFifoLayout::bytesFor(capacity) bytes (daemon side, before
  /// any producer or consumer uses it). Throws Error(kInvalidArgument) for a bad capacity, size or alignment.
  static ProxyFifoView format(std::byte* base, uint64_t bytes, uint32_t capacity);
  /// Attaches to a formatted region; throws Error(kProtocol) if the header does not match.
  static ProxyFifoView attach(std::byte* base, uint64_t bytes);

  uint32_t capacity() const { return capacity_; }
  ProxyFifoControl* control() const { return control_; }
  ProxyCommand* slots() const { return slots_; }
  explicit operator bool() const { return control_ != nullptr; }

  /// The stop word: producers waiting on a full ring give up once it is set (teardown).
  void requestStop() const;
  bool stopRequested() const;
  /// Watermarks the proxy publishes (P3).
  uint64_t completed() const;
  uint64_t errors() const;

 private:
  ProxyFifoControl* control_ = nullptr;
  ProxyCommand* slots_ = nullptr;
  uint32_t capacity_ = 0;
};

/// One producer's handle (one per thread; the FIFO supports any number). Not thread-safe itself.
class ProxyFifoProducer {
 public:
  explicit ProxyFifoProducer(ProxyFifoView fifo) : fifo_(fifo) {}

  /// Waits while the ring looks full (spinning, then yielding, then sleeping 20 us at a time; it re-reads the
  /// consumer's tail only then), claims a slot, writes `command` with seq filled in and publishes it with one
  /// release store. Waiting before the claim keeps a preempted, waiting producer from stalling the consumer.
  /// Returns the ticket. Throws Error(kAborted) if the stop word is set while it waits; the claimed slot
  /// then stays unpublished, which is harmless because the FIFO is being torn down.
  uint64_t push(const ProxyCommand& command);
  /// Pushes several commands with one fetch_add (fewer trips of the contended head line; a GPU warp does the
  /// same with one atomicAdd for its lanes). Consecutive tickets, published in order, each as soon as its slot
  /// is free. Returns the first ticket. Throws Error(kInvalidArgument) if more than capacity, kAborted as push.
  uint64_t pushBatch(std::span<const ProxyCommand> commands);

  /// Validating helpers for host code: throw Error(kInvalidArgument) for offsets or sizes the command
  /// encoding cannot carry.
  uint64_t pushWrite(uint16_t peer, uint32_t srcBuffer, uint64_t srcOffset, uint32_t dstBuffer, uint64_t dstOffset,
                     uint64_t bytes, bool signal = false);
  uint64_t pushFlag(uint16_t peer, uint32_t dstBuffer, uint64_t dstOffset, uint64_t value, bool signal = false);

  /// How often push found the ring looking full (re-read tail).
  uint64_t fullWaits() const { return fullWaits_; }

 private:
  uint64_t claim(uint64_t n);                              // waits for room (a hint), then fetch_add(head, n)
  void waitForRoom(uint64_t lastTicket, uint32_t& spins);  // until held ticket lastTicket's slot is free
  void publish(uint64_t ticket, const ProxyCommand& command);

  ProxyFifoView fifo_;
  uint64_t tailCache_ = 0;  // this producer's stale copy of the consumer index
  uint64_t fullWaits_ = 0;
};

/// The single consumer. Not thread-safe: one proxy thread owns it.
class ProxyFifoConsumer {
 public:
  explicit ProxyFifoConsumer(ProxyFifoView fifo);

  /// Copies up to out.size() published commands, in ticket order, into `out`; the first has ticket
  /// `index()` as it was before the call. Stops at the first unpublished slot. Never blocks.
  std::size_t pop(std::span<ProxyCommand> out);
  /// Makes the consumed slots available to producers (release store of tail, P2). Cheap when unchanged.
  void publishTail();
  uint64_t index() const { return index_; }

 private:
  ProxyFifoView fifo_;
  uint64_t index_ = 0;      // next ticket to consume
  uint64_t published_ = 0;  // last value stored to tail
};

// ---------------------------------------------------------------------------------------------------------
// Validation and the proxy thread
// ---------------------------------------------------------------------------------------------------------

/// Maps FIFO buffer ids to registrations: local ids to (LocalRegion, size), remote ids to a RemoteKey per
/// peer. Built by the communicator, then handed to the proxy immutable (Proxy::setBufferTable swaps it).
class ProxyBufferTable {
 public:
  static constexpr uint32_t kMaxBufferId = 1u << 20;  // bounds the dense tables; ids are small integers
  struct Local {
    LocalRegion region;
    uint64_t bytes = 0;
  };

  /// Throws Error(kInvalidArgument) for id 0, an id above kMaxBufferId or an empty region.
  void addLocal(uint32_t id, LocalRegion region, uint64_t bytes);
  void addRemote(uint32_t id, NodeIndex peer, const RemoteKey& key);

  const Local* local(uint32_t id) const {
    return id < locals_.size() && locals_[id].bytes != 0 ? &locals_[id] : nullptr;
  }
  const RemoteKey* remote(uint32_t id, NodeIndex peer) const {
    if (id >= remotes_.size() || peer >= remotes_[id].size()) return nullptr;
    const RemoteKey& k = remotes_[id][peer];
    return k.bytes != 0 ? &k : nullptr;
  }

 private:
  std::vector<Local> locals_;                   // index = id
  std::vector<std::vector<RemoteKey>> remotes_; // [id][peer]
};

/// A command resolved against the buffer table, ready to post.
struct ResolvedCommand {
  ProxyOpcode opcode = ProxyOpcode::kInvalid;
  NodeIndex peer = 0;
  bool signal = false;
  LocalRegion src;
  uint64_t srcOffset = 0;
  const RemoteKey* dst = nullptr;
  uint64_t dstOffset = 0;
  uint64_t bytes = 0;
  uint64_t value = 0;
};

/// Outcome of validateCommand: code kOk, or the error and a message naming the field and the fix.
struct CommandCheck {
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  bool ok() const { return code == ErrorCode::kOk; }
};

/// Checks one command (copied out of shared memory, so the producer cannot change it afterwards):
/// opcode, flags, peer in range and not this node, buffer ids known, ranges in bounds without overflow,
/// flag offset 8-byte aligned. Never throws for bad input.
CommandCheck validateCommand(const ProxyCommand& command, const ProxyBufferTable& table, NodeIndex self,
                             uint32_t nodeCount, ResolvedCommand& out);

/// A command the proxy could not carry out, reported once per command.
struct ProxyCommandError {
  uint64_t ticket = 0;
  ProxyCommand command{};
  ErrorCode code = ErrorCode::kOk;
  std::string message;
};

struct ProxyOptions {
  std::string name = "proxy";        ///< thread name (first 15 chars) and log prefix, e.g. "proxy gpu0 tcp"
  int numaNode = -1;                 ///< pin the thread to this NUMA node (best effort, logged); -1: no pinning
  uint32_t maxBatch = 64;            ///< commands popped, then posted with one submit()
  uint32_t idleSpins = 2048;         ///< empty polls before yielding the CPU
  uint32_t idleSleepUs = 20;         ///< after spinning and yielding, sleep this long between polls
};

struct ProxyStats {
  uint64_t popped = 0, posted = 0, rejected = 0, failed = 0, submits = 0, completions = 0;
};

/// The proxy: one thread per (GPU, transport). It pops commands, validates them, posts them through the
/// transport in batches (one submit() per batch), polls completions and publishes the completed/errors
/// watermarks. A bad command is reported (error handler + errors word) and skipped; never a crash.
///
/// The FIFO memory, the transport and the table's registrations must outlive the proxy.
class Proxy {
 public:
  Proxy(ProxyFifoView fifo, Transport& transport, ProxyOptions options);
  ~Proxy();  ///< stops the thread
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  /// Thread-safe; the proxy picks the new table up before its next batch.
  void setBufferTable(std::shared_ptr<const ProxyBufferTable> table);
  /// Called from the proxy thread for each failed command. Default: log a warning. Set before start().
  void setErrorHandler(std::function<void(const ProxyCommandError&)> handler);

  void start();
  /// Stops and joins the thread. Commands still in the FIFO stay there. Idempotent.
  void stop();

  /// One iteration in the caller's thread (tests and caller-driven loops; not while the thread runs):
  /// pop up to maxBatch, validate, post, submit, poll completions, publish tail and watermarks.
  /// Returns the number of commands popped.
  std::size_t runOnce();

  /// Snapshot; safe from any thread.
  ProxyStats stats() const;

 private:
  void threadMain();
  void pinThread();
  void handleCompletion(const Completion& completion);
  void reportError(uint64_t ticket, const ProxyCommand& command, ErrorCode code, std::string message);
  void publishWatermarks();

  ProxyFifoView fifo_;
  ProxyFifoConsumer consumer_;
  Transport& transport_;
  ProxyOptions options_;
  std::function<void(const ProxyCommandError&)> errorHandler_;

  std::mutex tableMutex_;                               // guards pendingTable_
  std::shared_ptr<const ProxyBufferTable> pendingTable_;
  std::atomic<bool> tableChanged_{false};
  std::shared_ptr<const ProxyBufferTable> table_;       // proxy thread only

  std::vector<ProxyCommand> batch_;                     // proxy thread only
  std::vector<Completion> completionBuf_;
  // Signalled tickets not yet completed, ascending; completed_ is published as the lowest of them (or
  // the consumer index when none is outstanding).
  std::deque<std::pair<uint64_t, bool>> outstanding_;  // (ticket, done)
  uint64_t errors_ = 0;
  uint64_t publishedCompleted_ = 0, publishedErrors_ = 0;

  std::atomic<uint64_t> popped_{0}, posted_{0}, rejected_{0}, failed_{0}, submits_{0}, completions_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem::daemon::transport
