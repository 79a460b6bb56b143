// The `tcp` transport: Boost.Asio over real TCP sockets, for hosts without RDMA NICs and for every test.
//
// Connections. Each node dials every other node `connectionsPerPeer` times; a dialled connection carries
// data one way only (dialer -> acceptor) plus heartbeats, and a Goodbye in either direction at shutdown.
// So node A's writes to B travel on A's dialled connections, and B's writes to A on B's.
//
// Handshake (tcp_handshake.hpp has the messages): Hello, HelloReply, Auth, Result, fixed-size binary messages.
// Both sides prove they hold the cluster secret without sending it (HMAC-SHA256 over both nonces, through
// OpenSSL); the nonces make every handshake fresh; MACs are compared in constant time. A different secret,
// protocol version or connection count is reported on BOTH sides ("tcp transport: peer 10.0.0.2:7100 (node 1)
// presented a different cluster secret; set cluster.secret identically on every node") and connect() throws it.
//
// Frames after the handshake (tcp_wire.hpp): a 32-byte header {type, region id (the key), offset, length, value}, then
// `length` payload bytes; the types are data, flag, message, heartbeat and goodbye. A write is cut into data
// frames at multiples of `chunkBytes` in the destination region, and destination chunk i of region r always
// travels on connection (r + i) % connectionsPerPeer: large writes spread over every connection, yet two
// writes to the same bytes share a connection and land in the order they were issued (write-after-write
// order, as on one RC QP). The receiver reads a data payload straight into the registered region
// (bounds-checked first), or through a staging buffer and the DeviceCopier for GPU regions.
//
// Flag ordering with several connections (the choice, documented): every flag goes on connection 0 and
// carries, per connection, the number of data frames this node had queued on it before the flag. The
// receiver counts data frames fully written per connection and applies a flag only when every count has
// been reached, and flags strictly in the order they arrived (so flag values of one peer never go
// backwards). The flag store is a release store (std::atomic_ref) made after the data writes, which other
// receiving threads publish through the peer's mutex; a consumer's load-acquire of the flag sees the data.
//
// Control messages (sendMessage / setMessageHandler): the daemons' bootstrap channel, next to the data path as
// NCCL keeps sockets next to IB. A message is a kMessage frame on connection 0: the header (length = counts +
// payload bytes, value = payload bytes), then the per-connection data-frame counts exactly as a flag carries them,
// then the payload (at most kMaxMessageBytes; a larger one is a malformed frame that fails the peer). The
// receiver queues messages with the flags, in arrival order, and hands one to the message handler only when its
// counts have been reached and every flag and message before it was applied or handled: a handler sees every
// byte written and every flag stored before the message was sent. The handler runs on an io thread without
// transport locks held, one message at a time per peer (later flags and messages of that peer wait for it to
// return). sendMessage copies the payload and starts that peer's connections at once (no submit() needed);
// messages are not signalled ops and produce no completions. A message still waiting for its data when its
// peer fails or the transport shuts down is dropped.
//
// Completions. A signalled op completes once every frame queued to that peer up to and including its own has
// been handed to the kernel, on every connection: its source bytes (and those of every earlier op to that
// peer) may then be reused, as after a signalled WR on one RC QP. Frames carry no per-op completion state.
//
// Liveness. Idle connections send a heartbeat every heartbeatIntervalMs. EOF or a reset on any connection
// of a peer, a write error, a malformed frame, or no frame at all on one of its connections for
// peerDeadlineMs marks the peer failed; later ops on it throw Error(kPeerLost) naming it and the reason,
// and signalled ops still queued complete with kPeerLost. A peer that sends Goodbye is marked closed.
//
// Rejoin. A failed or closed peer is not given up: right after the failure (and its handler) the transport
// starts a new connection attempt for it. It re-dials the peer's address quietly with back-off (20 ms doubling
// to 500 ms; 5 s after a handshake refusal such as a different secret, which stays the reported reason), and
// its acceptor takes a fresh, fully authenticated handshake from that node index again (new nonces, the same
// secret, version and connection-count checks). While the attempt runs the peer stays failed/closed with its
// reason and every op on it throws kPeerLost. Once all connections of the attempt are up in both directions the
// peer is kConnected again as a new incarnation: peerGeneration() (1 after the first connect) goes up by one,
// and the rejoin handler (setPeerRejoinHandler) is called on an io thread without transport locks held, like
// the message handler. Messages of the new incarnation may reach the message handler a moment before the rejoin
// handler runs (its inbound side can be up first). Nothing of the old incarnation reaches the new one: its
// queued frames, pending completions (kPeerLost), pending flags and messages and data counts are dropped with
// the failure, and every connection carries the attempt it belongs to, so a late report or frame from an old
// connection is ignored. Remote keys carry no incarnation: a caller must not use keys of a peer's previous
// incarnation (its regions are gone; a restarted peer registers new ones and hands out new keys).
// A restarted node that dials a survivor which has not yet noticed its previous run ended is refused as a
// duplicate and keeps retrying until the survivor's heartbeat deadline fails the old incarnation.
//
// Threads: `ioThreads` threads run one io_context; each connection's handlers run on its own strand.
//
// Code: tcp_handshake.* (handshake messages, MACs, checks), tcp_wire.* (frames, striping, frame checks) and
// tcp_peer.* (peer life cycle, arrival order, completion tracking) are pure logic, unit-tested without sockets;
// tcp_connections.cpp runs the connections on Boost.Asio; this file's class and tcp_transport.cpp tie them
// together (private state in tcp_transport_impl.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace tandem::daemon::transport {

/// Version of the framing and handshake after Hello; bump on any incompatible change.
inline constexpr uint32_t kTcpProtocolVersion = 2;  // 2: control messages (kMessage frames)

struct TcpConfig {
  NodeIndex self = 0;
  std::string listenHost = "127.0.0.1";  ///< address to bind (cluster.nodes[self] in the daemon)
  uint16_t listenPort = 0;               ///< 0 picks a free port; listenPort() reports it
  std::string secret;                    ///< cluster.secret, identical on every node; must not be empty
  uint32_t connectionsPerPeer = 1;       ///< 1..16, identical on every node
  uint32_t ioThreads = 1;                ///< 1..64
  uint32_t connectTimeoutMs = 10000;     ///< connect(): dial with retry and handshake until this deadline
  uint32_t heartbeatIntervalMs = 100;    ///< an idle connection sends a heartbeat this often
  uint32_t peerDeadlineMs = 2000;        ///< silence on a connection longer than this fails the peer
  uint64_t chunkBytes = 512 * 1024;      ///< largest data frame; writes are cut and striped at this size
  uint32_t protocolVersion = kTcpProtocolVersion;  ///< tests only: pretend to be another release
  DeviceCopier* deviceCopier = nullptr;  ///< required to register MemoryKind::kDevice; not owned
};

/// TCP transport; see the file comment. Thread-safe as Transport. Carries a control channel (controlChannel()
/// returns this).
class TcpTransport final : public Transport, public ControlChannel {
 public:
  /// Validates the config, binds and listens, and starts the io threads. Throws Error(kInvalidConfig) for a
  /// bad config (empty secret, ...), Error(kSystem) when the address cannot be bound.
  explicit TcpTransport(TcpConfig config);
  /// Sends Goodbye to connected peers (bounded wait), then stops the io threads.
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  /// The bound port (the chosen one when config.listenPort was 0).
  uint16_t listenPort() const;
  /// This node's address for the bootstrap exchange (kind tcp, host, bound port, protocol version).
  TransportAddress address() const;

  // ---- ControlChannel ----
  /// Connects to every other node and accepts their connections; blocks until all are established.
  /// `nodes[i]` is node i's address (the entry for this node is ignored). Call once.
  /// Throws Error(kPermissionDenied) for a different cluster secret, Error(kVersionMismatch) for a different
  /// protocol version, Error(kInvalidConfig) for a different connection count, Error(kTimeout) when some peer
  /// is not connected by connectTimeoutMs (the text lists which and why). Peers not connected are marked failed
  /// (and then re-dialed in the background like any failed peer: they join when they come up).
  void connect(const std::vector<NodeAddress>& nodes) override;
  /// As ControlChannel; see the file comment for the rejoin.
  uint64_t peerGeneration(NodeIndex peer) const override;
  void setPeerRejoinHandler(std::function<void(NodeIndex)> handler) override;
  /// Sends a control message to `peer` on its dialled connection 0, as a kMessage frame carrying the data-frame
  /// counts a flag carries (see the file comment); throws as ControlChannel::sendMessage.
  void sendMessage(NodeIndex peer, std::span<const std::byte> payload) override;
  /// As ControlChannel: handlers run on a transport io thread.
  void setMessageHandler(MessageHandler handler) override;

  // ---- Transport ----
  TransportKind kind() const override { return TransportKind::kTcp; }
  NodeIndex self() const override;
  uint32_t nodeCount() const override;
  LocalRegion registerMemory(const MemoryDesc& desc) override;
  void deregisterMemory(LocalRegion region) override;
  RemoteKey remoteKey(LocalRegion region) const override;
  void write(NodeIndex peer, LocalRegion src, uint64_t srcOffset, const RemoteKey& dst, uint64_t dstOffset,
             uint64_t bytes, uint64_t cookie, bool signal) override;
  void writeFlag(NodeIndex peer, const RemoteKey& dst, uint64_t dstOffset, uint64_t value, uint64_t cookie,
                 bool signal) override;
  void submit() override;
  std::size_t poll(std::span<Completion> out) override;
  PeerStatus peerStatus(NodeIndex peer) const override;
  void setPeerFailureHandler(std::function<void(NodeIndex, const PeerStatus&)> handler) override;
  ControlChannel* controlChannel() override { return this; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::daemon::transport
