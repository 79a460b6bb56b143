#include "transport/tcp_handshake.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "tandem/common/error.hpp"

namespace tandem::daemon::transport::tcp {

// ---------------------------------------------------------------------------------------------------------
// Crypto
// ---------------------------------------------------------------------------------------------------------
namespace {

// The most recent OpenSSL error of this thread, as text (and the queue cleared), for error messages.
std::string opensslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no OpenSSL error queued";
  std::array<char, 256> buf{};
  ERR_error_string_n(e, buf.data(), buf.size());
  return buf.data();
}

struct MacDeleter {
  void operator()(EVP_MAC* m) const noexcept { EVP_MAC_free(m); }
};
struct MacCtxDeleter {
  void operator()(EVP_MAC_CTX* c) const noexcept { EVP_MAC_CTX_free(c); }
};

}  // namespace

Sha256Digest hmacSha256(std::span<const std::byte> key, std::span<const std::byte> message) {
  // Fetched per call: a handshake computes two MACs, and no static then owns a libcrypto object.
  const std::unique_ptr<EVP_MAC, MacDeleter> mac(EVP_MAC_fetch(nullptr, OSSL_MAC_NAME_HMAC, nullptr));
  if (!mac) fail(ErrorCode::kInternal, "HMAC-SHA256: EVP_MAC_fetch(HMAC) failed: {}", opensslError());
  const std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> ctx(EVP_MAC_CTX_new(mac.get()));
  if (!ctx) fail(ErrorCode::kInternal, "HMAC-SHA256: EVP_MAC_CTX_new failed: {}", opensslError());
  char digest[] = "SHA256";
  const std::array<OSSL_PARAM, 2> params{OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                         OSSL_PARAM_construct_end()};
  // A non-null key pointer even for an empty key: EVP_MAC_init reads a null key as "keep the previous one".
  static constexpr unsigned char kEmpty = 0;
  const auto* keyBytes = key.empty() ? &kEmpty : reinterpret_cast<const unsigned char*>(key.data());
  if (EVP_MAC_init(ctx.get(), keyBytes, key.size(), params.data()) != 1)
    fail(ErrorCode::kInternal, "HMAC-SHA256: EVP_MAC_init failed: {}", opensslError());
  if (!message.empty() &&
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1)
    fail(ErrorCode::kInternal, "HMAC-SHA256: EVP_MAC_update failed: {}", opensslError());
  Sha256Digest out{};
  std::size_t outBytes = 0;
  if (EVP_MAC_final(ctx.get(), out.data(), &outBytes, out.size()) != 1 || outBytes != out.size())
    fail(ErrorCode::kInternal, "HMAC-SHA256: EVP_MAC_final failed ({} bytes): {}", outBytes, opensslError());
  return out;
}

bool macEqual(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Nonce randomNonce() {
  Nonce n{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1)
    fail(ErrorCode::kSystem, "tcp transport: RAND_bytes could not produce a handshake nonce: {}; check that the "
         "kernel's random source (getrandom) works", opensslError());
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// Messages (little-endian)
// ---------------------------------------------------------------------------------------------------------

HelloBytes encodeHello(const Hello& h) {
  std::vector<std::byte> out;
  out.reserve(kHelloBytes);
  detail::WireWriter w(out);
  w.put<uint64_t>(kHandshakeMagic);
  w.put<uint32_t>(h.version);
  w.put<uint32_t>(h.from);
  w.put<uint32_t>(h.to);
  w.put<uint32_t>(h.connIndex);
  w.put<uint32_t>(h.connCount);
  w.put<uint32_t>(0);
  w.putBytes(h.nonce);
  HelloBytes bytes{};
  std::copy(out.begin(), out.end(), bytes.begin());
  return bytes;
}

std::optional<Hello> decodeHello(std::span<const std::byte, kHelloBytes> bytes) {
  detail::WireReader r(bytes, "tcp hello");
  if (r.get<uint64_t>() != kHandshakeMagic) return std::nullopt;
  Hello h;
  h.version = r.get<uint32_t>();
  h.from = r.get<uint32_t>();
  h.to = r.get<uint32_t>();
  h.connIndex = r.get<uint32_t>();
  h.connCount = r.get<uint32_t>();
  r.get<uint32_t>();  // reserved; covered by the MACs like every other byte
  const auto nonce = r.getBytes(h.nonce.size());
  std::copy(nonce.begin(), nonce.end(), h.nonce.begin());
  return h;
}

ReplyBytes encodeReply(const Reply& reply, std::string_view secret, std::span<const std::byte> hello) {
  std::vector<std::byte> out;
  out.reserve(kReplyBytes);
  detail::WireWriter w(out);
  w.put<uint64_t>(kHandshakeMagic);
  w.put<uint32_t>(reply.version);
  w.put<uint32_t>(static_cast<uint32_t>(reply.status));
  w.put<uint32_t>(reply.node);
  w.put<uint32_t>(reply.connCount);
  w.putBytes(reply.nonce);
  const auto macA = handshakeMac(secret, Role::kAcceptor, hello, out);
  w.putBytes(std::as_bytes(std::span(macA)));
  ReplyBytes bytes{};
  std::copy(out.begin(), out.end(), bytes.begin());
  return bytes;
}

std::optional<Reply> decodeReply(std::span<const std::byte, kReplyBytes> bytes) {
  detail::WireReader r(bytes, "tcp hello reply");
  if (r.get<uint64_t>() != kHandshakeMagic) return std::nullopt;
  Reply reply;
  reply.version = r.get<uint32_t>();
  reply.status = static_cast<HandshakeStatus>(r.get<uint32_t>());
  reply.node = r.get<uint32_t>();
  reply.connCount = r.get<uint32_t>();
  const auto nonce = r.getBytes(reply.nonce.size());
  std::copy(nonce.begin(), nonce.end(), reply.nonce.begin());
  return reply;
}

ResultBytes encodeResult(HandshakeStatus status) {
  std::vector<std::byte> out;
  detail::WireWriter w(out);
  w.put<uint32_t>(static_cast<uint32_t>(status));
  w.put<uint32_t>(0);
  ResultBytes bytes{};
  std::copy(out.begin(), out.end(), bytes.begin());
  return bytes;
}

HandshakeStatus decodeResult(std::span<const std::byte, kResultBytes> bytes) {
  detail::WireReader r(bytes, "tcp handshake result");
  return static_cast<HandshakeStatus>(r.get<uint32_t>());
}

// ---------------------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------------------
namespace {
std::span<const std::byte> bytesOf(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }
}  // namespace

Sha256Digest handshakeMac(std::string_view secret, Role role, std::span<const std::byte> hello,
                          std::span<const std::byte> replyPrefix) {
  const std::string_view label = role == Role::kAcceptor ? "tandem-tcp acceptor" : "tandem-tcp dialer";
  std::vector<std::byte> msg;
  msg.reserve(label.size() + hello.size() + replyPrefix.size());
  msg.insert(msg.end(), bytesOf(label).begin(), bytesOf(label).end());
  msg.insert(msg.end(), hello.begin(), hello.end());
  msg.insert(msg.end(), replyPrefix.begin(), replyPrefix.end());
  return hmacSha256(bytesOf(secret), msg);
}

bool acceptorMacValid(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                      std::span<const std::byte, kReplyBytes> reply) {
  const auto expected = handshakeMac(secret, Role::kAcceptor, hello, reply.first(kReplyPrefixBytes));
  return macEqual(reply.subspan(kReplyPrefixBytes), std::as_bytes(std::span(expected)));
}

AuthBytes dialerAuth(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                     std::span<const std::byte, kReplyBytes> reply) {
  const auto macD = handshakeMac(secret, Role::kDialer, hello, reply.first(kReplyPrefixBytes));
  AuthBytes auth{};
  std::transform(macD.begin(), macD.end(), auth.begin(), [](uint8_t b) { return std::byte{b}; });
  return auth;
}

bool dialerAuthValid(std::string_view secret, std::span<const std::byte, kHelloBytes> hello,
                     std::span<const std::byte, kReplyBytes> reply, std::span<const std::byte, kAuthBytes> auth) {
  const auto expected = handshakeMac(secret, Role::kDialer, hello, reply.first(kReplyPrefixBytes));
  return macEqual(auth, std::as_bytes(std::span(expected)));
}

// ---------------------------------------------------------------------------------------------------------
// Checks and texts
// ---------------------------------------------------------------------------------------------------------

bool helloFromValid(const Hello& hello, const AcceptorIdentity& me) {
  return hello.from < me.nodeCount && hello.from != me.self;
}

HandshakeStatus checkHello(const Hello& hello, const AcceptorIdentity& me) {
  if (hello.version != me.version) return HandshakeStatus::kVersionMismatch;
  if (hello.to != me.self) return HandshakeStatus::kWrongNode;
  if (!helloFromValid(hello, me)) return HandshakeStatus::kBadNode;
  if (hello.connCount != me.connectionsPerPeer || hello.connIndex >= hello.connCount)
    return HandshakeStatus::kConnMismatch;
  return HandshakeStatus::kOk;
}

std::string versionMismatchMessage(std::string_view who, uint32_t theirs, uint32_t ours) {
  return fmt::format("tcp transport: peer {} speaks protocol version {}, this node speaks {}; run the same tandem "
                     "release on every node", who, theirs, ours);
}

std::string connectionCountMismatchMessage(std::string_view who, uint32_t theirs, uint32_t ours) {
  return fmt::format("tcp transport: peer {} uses {} connections per peer, this node {}; set "
                     "cluster.connections_per_peer identically on every node", who, theirs, ours);
}

std::string secretMismatchMessage(std::string_view who) {
  return fmt::format("tcp transport: peer {} presented a different cluster secret; set cluster.secret identically "
                     "on every node", who);
}

}  // namespace tandem::daemon::transport::tcp
