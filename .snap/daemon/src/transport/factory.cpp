#include "transport/factory.hpp"

#include "transport/tcp_transport.hpp"
#include "transport/verbs_transport.hpp"

namespace tandem::daemon::transport {

std::unique_ptr<Transport> createTransport(const TransportOptions& options) {
  switch (options.kind) {
    case TransportKind::kTcp: {
      TcpConfig tc;
      tc.self = options.self;
      tc.listenHost = options.listen.host;
      tc.listenPort = options.listen.port;
      tc.secret = options.secret;
      tc.connectionsPerPeer = options.connectionsPerPeer;
      tc.ioThreads = options.ioThreads;
      tc.connectTimeoutMs = options.connectTimeoutMs;
      tc.heartbeatIntervalMs = options.heartbeatIntervalMs;
      tc.peerDeadlineMs = options.peerDeadlineMs;
      tc.deviceCopier = options.deviceCopier;
      return std::make_unique<TcpTransport>(std::move(tc));
    }
    case TransportKind::kVerbs: {
      // Queue-pair addresses, liveness and rejoin go through the verbs transport's own bootstrap link (an
      // authenticated tcp connection per peer, at the node's cluster address); messages and data over the QPs.
      VerbsConfig vc;
      vc.self = options.self;
      vc.nodeCount = options.nodeCount;
      vc.qpsPerPeer = options.connectionsPerPeer;
      vc.bootstrap.enabled = true;
      vc.bootstrap.listenHost = options.listen.host;
      vc.bootstrap.listenPort = options.listen.port;
      vc.bootstrap.secret = options.secret;
      vc.bootstrap.connectTimeoutMs = options.connectTimeoutMs;
      vc.bootstrap.heartbeatIntervalMs = options.heartbeatIntervalMs;
      vc.bootstrap.peerDeadlineMs = options.peerDeadlineMs;
      return std::make_unique<VerbsTransport>(std::move(vc));
    }
    case TransportKind::kNull: break;
  }
  fail(ErrorCode::kUnsupported, "{} transport: cannot be created from cluster options; use the tcp transport",
       transportKindName(options.kind));
}

}  // namespace tandem::daemon::transport
