#include "transport/transport.hpp"

#include <fmt/format.h>

namespace tandem::daemon::transport {

std::string_view transportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kNull: return "null";
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kVerbs: return "verbs";
  }
  return "unknown";
}

std::string_view peerStateName(PeerState state) {
  switch (state) {
    case PeerState::kConnecting: return "connecting";
    case PeerState::kConnected: return "connected";
    case PeerState::kFailed: return "failed";
    case PeerState::kClosed: return "closed";
  }
  return "unknown";
}

std::string NodeAddress::toString() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

namespace {
bool knownKind(uint8_t k) { return k <= static_cast<uint8_t>(TransportKind::kVerbs); }
}  // namespace

// RemoteKey wire format (32 bytes, little-endian):
//   u8 version | u8 transport | u16 reserved(0) | u32 owner | u32 regionId | u32 rkey | u64 addr | u64 bytes
std::vector<std::byte> RemoteKey::encode() const {
  std::vector<std::byte> out;
  out.reserve(kWireBytes);
  detail::WireWriter w(out);
  w.put<uint8_t>(kWireVersion);
  w.put<uint8_t>(static_cast<uint8_t>(transport));
  w.put<uint16_t>(0);
  w.put<uint32_t>(owner);
  w.put<uint32_t>(regionId);
  w.put<uint32_t>(rkey);
  w.put<uint64_t>(addr);
  w.put<uint64_t>(bytes);
  return out;
}

RemoteKey RemoteKey::decode(std::span<const std::byte> in) {
  if (in.size() != kWireBytes)
    fail(ErrorCode::kProtocol, "remote key: expected {} bytes, got {}", kWireBytes, in.size());
  detail::WireReader r(in, "remote key");
  const auto version = r.get<uint8_t>();
  if (version != kWireVersion)
    fail(ErrorCode::kProtocol, "remote key: version {} (this node reads version {}); run the same tandem release on "
         "every node", version, kWireVersion);
  const auto kind = r.get<uint8_t>();
  if (!knownKind(kind)) fail(ErrorCode::kProtocol, "remote key: unknown transport kind {}", kind);
  if (r.get<uint16_t>() != 0) fail(ErrorCode::kProtocol, "remote key: reserved bits set");
  RemoteKey key;
  key.transport = static_cast<TransportKind>(kind);
  key.owner = r.get<uint32_t>();
  key.regionId = r.get<uint32_t>();
  key.rkey = r.get<uint32_t>();
  key.addr = r.get<uint64_t>();
  key.bytes = r.get<uint64_t>();
  if (key.regionId == 0) fail(ErrorCode::kProtocol, "remote key: region id 0 is never issued");
  if (key.bytes == 0) fail(ErrorCode::kProtocol, "remote key: region {} has size 0", key.regionId);
  return key;
}

// TransportAddress wire format (little-endian):
//   u32 magic "TTA1" | u8 version | u8 kind | u16 reserved(0) | u32 node | u32 protocolVersion
//   | u16 hostLen | host bytes | u16 port | u32 blobLen | blob bytes
namespace {
constexpr uint32_t kAddressMagic = 0x31415454;  // "TTA1" little-endian
constexpr uint8_t kAddressVersion = 1;
}  // namespace

std::vector<std::byte> TransportAddress::encode() const {
  if (host.size() > kMaxHostBytes)
    fail(ErrorCode::kInvalidArgument, "transport address: host '{}...' is longer than {} bytes", host.substr(0, 32),
         kMaxHostBytes);
  if (blob.size() > kMaxBlobBytes)
    fail(ErrorCode::kInvalidArgument, "transport address: blob of {} bytes exceeds {}", blob.size(), kMaxBlobBytes);
  std::vector<std::byte> out;
  detail::WireWriter w(out);
  w.put<uint32_t>(kAddressMagic);
  w.put<uint8_t>(kAddressVersion);
  w.put<uint8_t>(static_cast<uint8_t>(kind));
  w.put<uint16_t>(0);
  w.put<uint32_t>(node);
  w.put<uint32_t>(protocolVersion);
  w.put<uint16_t>(static_cast<uint16_t>(host.size()));
  w.putBytes(std::as_bytes(std::span(host.data(), host.size())));
  w.put<uint16_t>(port);
  w.put<uint32_t>(static_cast<uint32_t>(blob.size()));
  w.putBytes(blob);
  return out;
}

TransportAddress TransportAddress::decode(std::span<const std::byte> in) {
  detail::WireReader r(in, "transport address");
  if (r.get<uint32_t>() != kAddressMagic)
    fail(ErrorCode::kProtocol, "transport address: bad magic (not a tandem transport address)");
  const auto version = r.get<uint8_t>();
  if (version != kAddressVersion)
    fail(ErrorCode::kProtocol, "transport address: version {} (this node reads version {}); run the same tandem "
         "release on every node", version, kAddressVersion);
  const auto kind = r.get<uint8_t>();
  if (!knownKind(kind)) fail(ErrorCode::kProtocol, "transport address: unknown transport kind {}", kind);
  if (r.get<uint16_t>() != 0) fail(ErrorCode::kProtocol, "transport address: reserved bits set");
  TransportAddress a;
  a.kind = static_cast<TransportKind>(kind);
  a.node = r.get<uint32_t>();
  a.protocolVersion = r.get<uint32_t>();
  const auto hostLen = r.get<uint16_t>();
  if (hostLen > kMaxHostBytes)
    fail(ErrorCode::kProtocol, "transport address: host length {} exceeds {}", hostLen, kMaxHostBytes);
  const auto host = r.getBytes(hostLen);
  a.host.assign(reinterpret_cast<const char*>(host.data()), host.size());
  for (char c : a.host) {
    if (c <= ' ' || c > '~') fail(ErrorCode::kProtocol, "transport address: host contains a non-printable byte");
  }
  a.port = r.get<uint16_t>();
  const auto blobLen = r.get<uint32_t>();
  if (blobLen > kMaxBlobBytes)
    fail(ErrorCode::kProtocol, "transport address: blob length {} exceeds {}", blobLen, kMaxBlobBytes);
  const auto blob = r.getBytes(blobLen);
  a.blob.assign(blob.begin(), blob.end());
  r.expectEnd();
  return a;
}

std::string TransportAddress::toString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return fmt::format("{}{}{}:{} (node {})", v6 ? "[" : "", host, v6 ? "]" : "", port, node);
}

// ---- NullTransport ----

LocalRegion NullTransport::registerMemory(const MemoryDesc& desc) {
  if (desc.bytes == 0) fail(ErrorCode::kInvalidArgument, "null transport: cannot register an empty region");
  std::lock_guard lock(mutex_);
  regions_.push_back(desc.bytes);
  return LocalRegion{static_cast<uint32_t>(regions_.size())};
}

void NullTransport::deregisterMemory(LocalRegion region) {
  std::lock_guard lock(mutex_);
  if (region.id == 0 || region.id > regions_.size()) return;
  regions_[region.id - 1] = 0;
}

RemoteKey NullTransport::remoteKey(LocalRegion region) const {
  std::lock_guard lock(mutex_);
  if (region.id == 0 || region.id > regions_.size() || regions_[region.id - 1] == 0)
    fail(ErrorCode::kNotFound, "null transport: unknown region {}", region.id);
  return RemoteKey{TransportKind::kNull, self_, region.id, 0, 0, regions_[region.id - 1]};
}

void NullTransport::checkPeer(NodeIndex peer) const {
  if (peer >= nodeCount_) fail(ErrorCode::kInvalidArgument, "null transport: peer {} out of range ({} nodes)", peer, nodeCount_);
  if (!anyFailed_.load(std::memory_order_acquire)) return;  // fast path: no peer ever failed
  std::lock_guard lock(mutex_);
  if (!failed_[peer].empty()) fail(ErrorCode::kPeerLost, "null transport: node {} lost: {}", peer, failed_[peer]);
}

void NullTransport::write(NodeIndex peer, LocalRegion, uint64_t, const RemoteKey&, uint64_t, uint64_t bytes,
                          uint64_t cookie, bool signal) {
  checkPeer(peer);
  writes_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (signal) {
    std::lock_guard lock(mutex_);
    pending_.push_back(Completion{cookie, peer, ErrorCode::kOk});
    anyPending_.store(true, std::memory_order_relaxed);
  }
}

void NullTransport::writeFlag(NodeIndex peer, const RemoteKey&, uint64_t, uint64_t value, uint64_t cookie,
                              bool signal) {
  checkPeer(peer);
  flags_.fetch_add(1, std::memory_order_relaxed);
  lastFlag_.store(value, std::memory_order_relaxed);
  if (signal) {
    std::lock_guard lock(mutex_);
    pending_.push_back(Completion{cookie, peer, ErrorCode::kOk});
    anyPending_.store(true, std::memory_order_relaxed);
  }
}

std::size_t NullTransport::poll(std::span<Completion> out) {
  if (!anyPending_.load(std::memory_order_relaxed)) return 0;
  std::lock_guard lock(mutex_);
  const std::size_t n = std::min(out.size(), pending_.size());
  std::copy_n(pending_.begin(), n, out.begin());
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
  anyPending_.store(!pending_.empty(), std::memory_order_relaxed);
  return n;
}

PeerStatus NullTransport::peerStatus(NodeIndex peer) const {
  std::lock_guard lock(mutex_);
  if (peer < failed_.size() && !failed_[peer].empty()) return PeerStatus{PeerState::kFailed, failed_[peer]};
  return PeerStatus{PeerState::kConnected, {}};
}

void NullTransport::failPeer(NodeIndex peer, std::string reason) {
  std::lock_guard lock(mutex_);
  if (failed_.empty()) failed_.resize(nodeCount_);
  failed_.at(peer) = std::move(reason);
  anyFailed_.store(true, std::memory_order_release);
}

}  // namespace tandem::daemon::transport
