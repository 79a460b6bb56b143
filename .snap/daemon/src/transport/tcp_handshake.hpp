// The tcp transport's handshake: how two nodes prove to each other that they hold the cluster secret, and
// agree on the protocol version, their node indices and the connection count, before any frame flows.
//
//   dialer   -> Hello      magic, protocol version, from node, to node, connection index/count, reserved, nonceD
//   acceptor -> HelloReply magic, version, status, node, connection count, nonceA,
//                          macA = HMAC-SHA256(secret, "tandem-tcp acceptor" | Hello | reply fields)
//   dialer   -> Auth       macD = HMAC-SHA256(secret, "tandem-tcp dialer" | Hello | reply fields)
//   acceptor -> Result     status, reserved
//
// Fixed-size little-endian messages whose layout never changes, so any two releases can at least tell each other
// their versions. Each MAC covers both nonces (the Hello carries nonceD, the reply fields nonceA), both node
// indices and both versions, so every handshake is fresh and neither side can replay an old one; the role label
// keeps one side's MAC from being reflected back as the other's. Neither side sends the secret. MACs are compared
// in constant time (CRYPTO_memcmp). The dialer sends its MAC even when the acceptor's did not verify, so the
// acceptor detects the mismatch too: a different secret, protocol version or connection count is reported on BOTH
// sides with the same text (the *Message functions below).
//
// Everything here is pure (no sockets), unit-tested in tcp_logic_test.cpp; tcp_connections.cpp drives it over the
// connections (Impl::serveInbound on the acceptor, Impl::dialHandshake on the dialer).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "transport/transport.hpp"

namespace tandem::daemon::transport::tcp {

// ---- crypto (OpenSSL libcrypto) ----

using Sha256Digest = std::array<uint8_t, 32>;
/// HMAC-SHA256 (RFC 2104) through OpenSSL's EVP_MAC. Throws Error(kInternal) naming the OpenSSL error if
/// libcrypto refuses (it does not for any key or message length).
Sha256Digest hmacSha256(std::span<const std::byte> key, std::span<const std::byte> message);
/// Compares two MACs in constant time (CRYPTO_memcmp), so timing does not reveal the first differing byte.
/// False when the lengths differ.
bool macEqual(std::span<const std::byte> a, std::span<const std::byte> b);

using Nonce = std::array<std::byte, 16>;
/// 16 bytes from OpenSSL's CSPRNG (RAND_bytes). Throws Error(kSystem) if it cannot be seeded.
Nonce randomNonce();

// ---- messages ----

inline constexpr uint64_t kHandshakeMagic = 0x3150435444464e54ull;  // "TNFDTCP1"
inline constexpr std::size_t kHelloBytes = 48;
inline constexpr std::size_t kReplyPrefixBytes = 40;  // reply fields covered by the MACs (everything but the MAC)
inline constexpr std::size_t kReplyBytes = kReplyPrefixBytes + 32;
inline constexpr std::size_t kAuthBytes = 32;
inline constexpr std::size_t kResultBytes = 8;

using HelloBytes = std::array<std::byte, kHelloBytes>;
using ReplyBytes = std::array<std::byte, kReplyBytes>;
using AuthBytes = std::array<std::byte, kAuthBytes>;
using ResultBytes = std::array<std::byte, kResultBytes>;

/// The acceptor's answer, in the reply (to the Hello) and in the result (to the Auth).
enum class HandshakeStatus : uint32_t {
  kOk = 0,
  kVersionMismatch = 1,
  kWrongNode = 2,     ///< Hello.to is not the acceptor's index
  kBadNode = 3,       ///< Hello.from is out of range or the acceptor itself
  kConnMismatch = 4,  ///< different connection count, or index out of range
  kBadSecret = 5,
  kDuplicate = 6,     ///< that connection index is already established
};

struct Hello {
  uint32_t version = 0;
  NodeIndex from = 0;
  NodeIndex to = 0;
  uint32_t connIndex = 0;
  uint32_t connCount = 0;
  Nonce nonce{};
};
HelloBytes encodeHello(const Hello& hello);
/// Nullopt when the magic is wrong: the other end does not speak the tandem transport handshake.
std::optional<Hello> decodeHello(std::span<const std::byte, kHelloBytes> bytes);

struct Reply {
  uint32_t version = 0;
  HandshakeStatus status = HandshakeStatus::kOk;
  NodeIndex node = 0;       ///< the acceptor's index
  uint32_t connCount = 0;   ///< the acceptor's connections per peer
  Nonce nonce{};
};
/// The reply fields, then macA over `hello` (as received) and those fields.
ReplyBytes encodeReply(const Reply& reply, std::string_view secret, std::span<const std::byte> hello);
/// Nullopt when the magic is wrong.
std::optional<Reply> decodeReply(std::span<const std::byte, kReplyBytes> bytes);

ResultBytes encodeResult(HandshakeStatus status);
HandshakeStatus decodeResult(std::span<const std::byte, kResultBytes> bytes);

// ---- authentication ----

enum class Role { kAcceptor, kDialer };
/// HMAC-SHA256(secret, "tandem-tcp acceptor|dialer" | hello | replyPrefix): binds both nonces, both node indices
/// and both versions.
Sha256Digest handshakeMac(std::string_view secret, Role role, std::span<const std::byte> hello,
                          std::span<const std::byte> replyPrefix);
/// Dialer side: whether the reply's MAC is the acceptor's for this Hello under `secret`.
bool acceptorMacValid(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                      std::span<const std::byte, kReplyBytes> reply);
/// Dialer side: the Auth message, macD over the Hello and the reply fields.
AuthBytes dialerAuth(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                     std::span<const std::byte, kReplyBytes> reply);
/// Acceptor side: whether `auth` is the dialer's MAC for this Hello and the reply sent.
bool dialerAuthValid(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                     std::span<const std::byte, kReplyBytes> reply, std::span<const std::byte, kAuthBytes> auth);

// ---- checks and the texts both sides report ----

/// What the acceptor checks a Hello against.
struct AcceptorIdentity {
  NodeIndex self = 0;
  uint32_t nodeCount = 0;
  uint32_t version = 0;
  uint32_t connectionsPerPeer = 0;
};
/// True if Hello.from names another node of the cluster.
bool helloFromValid(const Hello& hello, const AcceptorIdentity& me);
/// The acceptor's verdict on a Hello, checked in this order: version, addressee, sender, connection count/index.
HandshakeStatus checkHello(const Hello& hello, const AcceptorIdentity& me);

/// "tcp transport: peer <who> speaks protocol version T, this node speaks O; run the same tandem release ...".
std::string versionMismatchMessage(std::string_view who, uint32_t theirs, uint32_t ours);
/// "tcp transport: peer <who> uses T connections per peer, this node O; set cluster.connections_per_peer ...".
std::string connectionCountMismatchMessage(std::string_view who, uint32_t theirs, uint32_t ours);
/// "tcp transport: peer <who> presented a different cluster secret; set cluster.secret identically ...".
std::string secretMismatchMessage(std::string_view who);

}  // namespace tandem::daemon::transport::tcp
