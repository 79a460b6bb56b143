// Creates the transport a daemon's cluster runs on, from options that name no concrete transport type, so that
// the daemon's cluster code depends on the Transport interface alone.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace tandem::daemon::transport {

/// What a daemon knows about its cluster when it creates the transport (the cluster section of tandemd.yaml).
struct TransportOptions {
  TransportKind kind = TransportKind::kTcp;
  NodeIndex self = 0;
  uint32_t nodeCount = 0;            ///< entries of cluster.nodes (verbs sizes its peer table by it)
  NodeAddress listen;                ///< this node's entry of cluster.nodes
  std::string secret;                ///< cluster.secret, identical on every node; must not be empty
  uint32_t connectionsPerPeer = 1;   ///< cluster.connections_per_peer (verbs: queue pairs per peer)
  uint32_t ioThreads = 1;
  uint32_t connectTimeoutMs = 10000;     ///< cluster.connect_timeout_ms
  uint32_t heartbeatIntervalMs = 100;    ///< cluster.heartbeat_interval_ms
  uint32_t peerDeadlineMs = 2000;        ///< communicators.peer_lost_deadline_ms
  DeviceCopier* deviceCopier = nullptr;  ///< tcp: stages kDevice regions (the cuda backend's); not owned; may be null
};

/// Creates (and, for tcp, binds) the transport of `options.kind`. Throws what that transport's constructor throws
/// (Error(kInvalidConfig) for bad options, Error(kSystem) when the address cannot be bound), and
/// Error(kUnsupported) for the null transport (benchmarks only). verbs opens the first RDMA device with an active
/// port 1 (GID index 0) and binds its bootstrap at `listen`; it throws Error(kUnavailable) without a device.
std::unique_ptr<Transport> createTransport(const TransportOptions& options);

}  // namespace tandem::daemon::transport
