#include "transport/tcp_handshake.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <memory>

#include "tandem/common/error.hpp"

namespace tandem::daemon::transport::detail {

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

}  // namespace tandem::daemon::transport::detail
