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
// The message layouts, the checks and the texts are pure functions, unit-tested without sockets; the two
// coroutines at the end drive them over a connected socket.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace tandem::daemon::transport::detail {

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

}  // namespace tandem::daemon::transport::detail
