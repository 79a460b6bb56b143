// The inter-node transport interface (ARCHITECTURE.md decision 6) that the daemon's proxy threads post
// through, and the plain-data types that travel in the bootstrap exchange between daemons.
//
// Two implementations: `TcpTransport` (Boost.Asio; every machine, every test) and `VerbsTransport` (RC QPs).
// A `NullTransport` that discards transfers measures the proxy loop alone (bench/fifo_bench.cpp).
//
// Model, shared by both implementations (it is the RDMA model):
//  - A node registers memory and gets a `LocalRegion` handle plus a serialisable `RemoteKey` it sends to peers.
//  - `write` copies bytes from a local region into a peer's region named by its RemoteKey. The source bytes
//    must stay unchanged until the op completes locally. A signalled op's completion means that op and every
//    op issued to the same peer before it have completed locally (as a signalled WR on one RC QP does), so
//    one signalled op at the end of a batch covers the whole batch. The transport copies source bytes only
//    where it stages through host memory.
//  - `writeFlag` stores a 64-bit value into a peer's region, ordered after every earlier `write` to that peer
//    by this transport: a receiver that observes the value (load-acquire) also observes all of those bytes.
//  - Ops are queued by `write`/`writeFlag` and guaranteed to start after `submit()` (one doorbell or one
//    socket kick per batch); an implementation may start them earlier.
//  - `poll` returns local completions: one per op posted with `signal = true`, and one with an error code for
//    each signalled op that could not complete because its peer failed.
//  - Per-peer failure: a peer that dies, hangs up or breaks the protocol is marked failed with a reason;
//    every later op on it throws Error(kPeerLost) whose text names the peer and the reason.
//
// Thread-safety: every method may be called from any thread. Ops to one peer issued from one thread keep
// their order; ops issued concurrently from several threads are ordered as the transport serialises them.
//
// Control channel: a transport may also carry the daemons' control messages, ordered after the data sent before
// them (ControlChannel, returned by controlChannel()). tcp and verbs do; null does not.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tandem/common/error.hpp"

namespace tandem::daemon::transport {

/// A node's index in the cluster's node list (the same list, in the same order, on every node).
using NodeIndex = uint32_t;

enum class TransportKind : uint8_t { kNull = 0, kTcp = 1, kVerbs = 2 };
std::string_view transportKindName(TransportKind kind);

/// Where registered memory lives.
enum class MemoryKind : uint8_t {
  kHost = 1,    ///< host memory (pinned or not); addressable by the CPU
  kDevice = 2,  ///< GPU memory; tcp stages it through host memory with a DeviceCopier, verbs registers it
};

/// Copies between GPU memory and host memory, for transports that stage GPU data through host memory (tcp).
/// The CUDA backend provides one; the CPU backend never registers kDevice memory.
/// Both calls are synchronous: when they return, the bytes are at the destination and visible to later
/// copies, so a flag copied with toDevice after data copied with toDevice is observed after it.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual void toHost(void* host, const void* device, uint64_t bytes) = 0;
  virtual void toDevice(void* device, const void* host, uint64_t bytes) = 0;
};

/// What to register. The memory is owned by the caller and must outlive the registration.
struct MemoryDesc {
  MemoryKind kind = MemoryKind::kHost;
  void* addr = nullptr;  ///< host pointer, or device pointer for kDevice
  uint64_t bytes = 0;
  /// kDevice on verbs: a dma-buf fd for the range (cuMemGetHandleForAddressRange), or -1 to register the
  /// device pointer with ibv_reg_mr (nvidia-peermem). Not owned; may be closed after registration.
  int dmabufFd = -1;
  uint64_t dmabufOffset = 0;  ///< offset of `addr` inside the dma-buf
};

/// A local registration. Valid from registerMemory until deregisterMemory; id 0 is never issued.
struct LocalRegion {
  uint32_t id = 0;
  explicit operator bool() const { return id != 0; }
};

/// The key a peer uses to address a registered region: trivially copyable, 32 bytes on the wire.
/// It carries the region's size so the sender checks bounds before anything reaches the wire; the owner
/// checks them again on arrival (tcp) or the NIC does (verbs rkey).
struct RemoteKey {
  TransportKind transport = TransportKind::kNull;
  NodeIndex owner = 0;     ///< node that registered the region
  uint32_t regionId = 0;   ///< the owner's LocalRegion id
  uint32_t rkey = 0;       ///< verbs rkey; 0 for tcp
  uint64_t addr = 0;       ///< verbs: iova of the region's first byte; 0 for tcp
  uint64_t bytes = 0;      ///< region size

  static constexpr std::size_t kWireBytes = 32;
  static constexpr uint8_t kWireVersion = 1;
  std::vector<std::byte> encode() const;
  /// Throws Error(kProtocol) naming what is wrong for a truncated, oversized or malformed key.
  static RemoteKey decode(std::span<const std::byte> bytes);
  friend bool operator==(const RemoteKey&, const RemoteKey&) = default;
};

/// One local completion.
struct Completion {
  uint64_t cookie = 0;                 ///< as passed to write/writeFlag
  NodeIndex peer = 0;
  ErrorCode code = ErrorCode::kOk;     ///< kOk, or kPeerLost when the peer failed before the op completed
};

enum class PeerState : uint8_t {
  kConnecting = 0,
  kConnected = 1,
  kFailed = 2,  ///< died, hung up, timed out or broke the protocol; see reason
  kClosed = 3,  ///< shut its transport down cleanly
};
std::string_view peerStateName(PeerState state);

struct PeerStatus {
  PeerState state = PeerState::kConnecting;
  std::string reason;  ///< empty unless failed or closed
};

/// A node's transport address, exchanged in the bootstrap (daemon <-> daemon) before connecting.
struct TransportAddress {
  TransportKind kind = TransportKind::kTcp;
  NodeIndex node = 0;
  uint32_t protocolVersion = 0;  ///< the transport's wire protocol version
  std::string host;              ///< tcp: listen address (IPv4/IPv6 literal or name), at most 255 bytes
  uint16_t port = 0;             ///< tcp: listen port
  std::vector<std::byte> blob;   ///< transport-specific (verbs: encoded QpInfo list), at most 64 KiB

  static constexpr std::size_t kMaxHostBytes = 255;
  static constexpr std::size_t kMaxBlobBytes = 64 * 1024;
  std::vector<std::byte> encode() const;
  /// Throws Error(kProtocol) for truncated, oversized, trailing or malformed input.
  static TransportAddress decode(std::span<const std::byte> bytes);
  std::string toString() const;  ///< "host:port (node N)"
  friend bool operator==(const TransportAddress&, const TransportAddress&) = default;
};

/// A node's listen address, as cluster.nodes lists it, for transports that dial their peers (tcp).
struct NodeAddress {
  std::string host;  ///< IPv4/IPv6 literal or host name
  uint16_t port = 0;
  std::string toString() const;  ///< "host:port" ("[v6]:port")
};

/// The daemons' control channel (proto/tandem/v1/cluster.proto messages), carried next to the data path the way
/// NCCL keeps its bootstrap sockets next to IB: messages to one peer arrive in the order sent, and each arrives
/// only after every write and writeFlag issued to that peer before it has landed and is visible. The channel also
/// owns the peers' life cycle beyond the first failure: it connects them, and a peer that failed or closed is
/// brought back as a new incarnation (peerGeneration + 1), reported through the rejoin handler.
///
/// A transport that carries one returns it from Transport::controlChannel(); it lives as long as the transport.
/// Thread-safety: as Transport.
class ControlChannel {
 public:
  virtual ~ControlChannel() = default;

  /// Largest message payload.
  static constexpr std::size_t kMaxMessageBytes = 16u << 20;
  using MessageHandler = std::function<void(NodeIndex from, std::span<const std::byte> payload)>;

  /// Connects to every other node and accepts their connections; blocks until all are established or the
  /// transport's connect deadline passes. `nodes[i]` is node i's address (this node's entry is ignored). Call once,
  /// after setting the handlers. Throws Error(kPermissionDenied) for a different cluster secret,
  /// Error(kVersionMismatch) for a different protocol version, Error(kInvalidConfig) for a configuration the peers
  /// disagree on, Error(kTimeout) naming the peers not connected by the deadline. Peers not connected are marked
  /// failed and keep being retried in the background: they join (as a rejoin) when they come up.
  virtual void connect(const std::vector<NodeAddress>& nodes) = 0;
  /// Sends a message to `peer`, ordered after every write/writeFlag issued to it before (see the class comment).
  /// Starts at once (no submit() needed). The payload is copied; it may be reused when this returns. Messages are no
  /// signalled ops: they produce no completions. Throws Error(kPeerLost) naming the peer and why if it failed,
  /// Error(kInvalidArgument) for a payload over kMaxMessageBytes or a bad peer index (self included),
  /// Error(kUnavailable) before connect().
  virtual void sendMessage(NodeIndex peer, std::span<const std::byte> payload) = 0;
  /// Called for every message received, on a transport thread without transport locks held, in order per peer, one
  /// at a time per peer. It must not block for long; it may call sendMessage. The payload is valid only during the
  /// call; an exception it throws is logged and the message dropped. Without a handler messages are dropped (with a
  /// warning). Set before connect().
  virtual void setMessageHandler(MessageHandler handler) = 0;
  /// Called when a failed or closed peer is connected again (a new incarnation), on a transport thread without
  /// transport locks held; it may call sendMessage. Not called for the first connect. Set before connect().
  virtual void setPeerRejoinHandler(std::function<void(NodeIndex)> handler) = 0;
  /// How many times `peer` became connected: 0 before, 1 after connect(), +1 per rejoin. 0 for this node.
  virtual uint64_t peerGeneration(NodeIndex peer) const = 0;
};

/// The interface the proxy threads use. See the file comment for the model.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual TransportKind kind() const = 0;
  virtual NodeIndex self() const = 0;
  virtual uint32_t nodeCount() const = 0;

  /// Registers memory. Throws Error(kInvalidArgument) for a null or empty range, Error(kUnsupported) for a
  /// kind this transport cannot carry, Error(kRdma)/Error(kSystem) when the registration itself fails.
  virtual LocalRegion registerMemory(const MemoryDesc& desc) = 0;
  /// Drops a registration. Peers must have stopped writing into it (communicator teardown).
  virtual void deregisterMemory(LocalRegion region) = 0;
  /// The key to send to peers. Throws Error(kNotFound) for an unknown region.
  virtual RemoteKey remoteKey(LocalRegion region) const = 0;
  /// How `region` is registered with the NIC, for logs ("dma-buf", "ibv_reg_mr"); empty where nothing is.
  virtual std::string registration(LocalRegion) const { return {}; }

  /// Queues a write of `bytes` from `src`+srcOffset to the peer's region `dst`+dstOffset.
  /// Throws Error(kPeerLost) if the peer failed (the text names it and why), Error(kInvalidArgument) for
  /// out-of-bounds ranges, a key of another owner or transport, or an unknown local region.
  virtual void write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
                     uint64_t bytes, uint64_t cookie, bool signal) = 0;
  /// Queues a store of `value` into 8 bytes at dst+dstOffset (8-byte aligned), ordered after every earlier
  /// write to that peer. The receiver observes it with a load-acquire. Throws as write.
  virtual void writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                         bool signal) = 0;
  /// Starts every queued op (one doorbell / socket kick per peer connection).
  virtual void submit() = 0;
  /// Takes up to out.size() completions; returns how many it wrote. Never blocks. Completions of one peer
  /// arrive in issue order; across peers in any order.
  virtual std::size_t poll(std::span<Completion> out) = 0;

  virtual PeerStatus peerStatus(NodeIndex peer) const = 0;
  /// Called once per peer when it fails or closes, from a transport thread (or the thread whose op found
  /// the failure) with transport locks held: it must not call back into the transport. Set it before
  /// connecting.
  virtual void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) = 0;

  /// The control channel this transport carries, or null when it has none (the null transport).
  virtual ControlChannel* controlChannel() { return nullptr; }
};

/// Discards transfers and completes signalled ops immediately. It measures the proxy loop without a wire
/// (bench/fifo_bench.cpp) and stands in for peers in tests. Regions are sized bookkeeping only.
class NullTransport final : public Transport {
 public:
  NullTransport(NodeIndex self, uint32_t nodeCount) : self_(self), nodeCount_(nodeCount) {}

  TransportKind kind() const override { return TransportKind::kNull; }
  NodeIndex self() const override { return self_; }
  uint32_t nodeCount() const override { return nodeCount_; }
  LocalRegion registerMemory(const MemoryDesc& desc) override;
  void deregisterMemory(LocalRegion region) override;
  RemoteKey remoteKey(LocalRegion region) const override;
  void write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
             uint64_t bytes, uint64_t cookie, bool signal) override;
  void writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                 bool signal) override;
  void submit() override { submits_.fetch_add(1, std::memory_order_relaxed); }
  std::size_t poll(std::span<Completion> out) override;
  PeerStatus peerStatus(NodeIndex peer) const override;
  void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)>) override {}

  /// Marks a peer failed (tests of the proxy's error path).
  void failPeer(NodeIndex peer, std::string reason);

  uint64_t writes() const { return writes_.load(std::memory_order_relaxed); }
  uint64_t flags() const { return flags_.load(std::memory_order_relaxed); }
  uint64_t bytesWritten() const { return bytes_.load(std::memory_order_relaxed); }
  uint64_t submits() const { return submits_.load(std::memory_order_relaxed); }
  uint64_t lastFlagValue() const { return lastFlag_.load(std::memory_order_relaxed); }

 private:
  void checkPeer(NodeIndex peer) const;

  NodeIndex self_;
  uint32_t nodeCount_;
  mutable std::mutex mutex_;  // guards regions_, failed_, pending_
  std::vector<uint64_t> regions_;          // index id-1 -> bytes; 0 = deregistered
  std::vector<std::string> failed_;        // per peer: reason, empty = alive
  std::vector<Completion> pending_;
  std::atomic<bool> anyPending_{false};    // lets poll skip the lock when nothing is queued
  std::atomic<bool> anyFailed_{false};     // lets write skip the lock while every peer is alive
  std::atomic<uint64_t> writes_{0}, flags_{0}, bytes_{0}, submits_{0}, lastFlag_{0};
};

namespace detail {

// Little-endian encoder/decoder for the fixed wire formats (keys, addresses, QpInfo, tcp frames).
class WireWriter {
 public:
  explicit WireWriter(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void put(T value) {
    static_assert(std::is_integral_v<T>);
    const auto v = static_cast<uint64_t>(value);
    for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  }
  void putBytes(std::span<const std::byte> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }

 private:
  std::vector<std::byte>& out_;
};

// Every read checks the remaining length and throws Error(kProtocol) "<what>: truncated ..." when short.
class WireReader {
 public:
  WireReader(std::span<const std::byte> in, std::string_view what) : in_(in), what_(what) {}
  template <typename T>
  T get() {
    static_assert(std::is_integral_v<T>);
    need(sizeof(T));
    uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::span<const std::byte> getBytes(std::size_t n) {
    need(n);
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::size_t remaining() const { return in_.size() - pos_; }
  /// Throws unless every byte was consumed.
  void expectEnd() const {
    if (remaining() != 0) fail(ErrorCode::kProtocol, "{}: {} trailing bytes after the end", what_, remaining());
  }

 private:
  void need(std::size_t n) const {
    if (remaining() < n)
      fail(ErrorCode::kProtocol, "{}: truncated: needs {} more bytes at offset {}, has {}", what_, n, pos_, remaining());
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
  std::string_view what_;
};

/// True if [offset, offset+bytes) lies inside a region of `size` bytes, without overflow.
constexpr bool inBounds(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

}  // namespace detail
}  // namespace tandem::daemon::transport
