#include "transport/factory.hpp"

#include "transport/tcp_transport.hpp"

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
      return std::make_unique<TcpTransport>(std::move(tc));
    }
    case TransportKind::kVerbs:
      fail(ErrorCode::kUnsupported, "verbs transport: cannot be created from cluster options yet: it needs the "
           "peers' queue-pair addresses (VerbsTransport::localQpInfo/connectPeer), which nothing exchanges, and it "
           "has no control channel for the daemons' messages; use the tcp transport");
    case TransportKind::kNull: break;
  }
  fail(ErrorCode::kUnsupported, "{} transport: cannot be created from cluster options; use the tcp transport",
       transportKindName(options.kind));
}

}  // namespace tandem::daemon::transport
