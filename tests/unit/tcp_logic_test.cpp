// Host-only tests of the tcp transport's pure logic: the handshake's HMAC-SHA256 (RFC 4231 vectors) and MAC
// comparison. No sockets.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "transport/tcp_handshake.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;

namespace {

std::string hex(std::span<const uint8_t> d) {
  std::string s;
  for (uint8_t b : d) s += fmt::format("{:02x}", b);
  return s;
}
std::vector<std::byte> bytesOf(const std::string& s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}
std::vector<std::byte> repeated(std::size_t n, uint8_t b) { return std::vector<std::byte>(n, std::byte{b}); }

}  // namespace

// =========================================================================================================
// Crypto
// =========================================================================================================

TEST_CASE("HMAC-SHA256 matches every RFC 4231 test vector") {
  // Test case 1: a 20-byte key.
  CHECK(hex(detail::hmacSha256(repeated(20, 0x0b), bytesOf("Hi There"))) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2: a key shorter than the digest.
  CHECK(hex(detail::hmacSha256(bytesOf("Jefe"), bytesOf("what do ya want for nothing?"))) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 3: key and data of bytes that are not text.
  CHECK(hex(detail::hmacSha256(repeated(20, 0xaa), repeated(50, 0xdd))) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  // Test case 4: a 25-byte key 0x01..0x19.
  std::vector<std::byte> key4(25);
  for (std::size_t i = 0; i < key4.size(); ++i) key4[i] = static_cast<std::byte>(i + 1);
  CHECK(hex(detail::hmacSha256(key4, repeated(50, 0xcd))) ==
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Test case 5: the RFC gives only the first 128 bits.
  const auto t5 = detail::hmacSha256(repeated(20, 0x0c), bytesOf("Test With Truncation"));
  CHECK(hex(std::span(t5).first(16)) == "a3b6167473100ee06e0c796c2955552b");
  // Test case 6: a key longer than the block size is hashed first.
  CHECK(hex(detail::hmacSha256(repeated(131, 0xaa), bytesOf("Test Using Larger Than Block-Size Key - Hash Key First"))) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // Test case 7: key and data both longer than the block size.
  CHECK(hex(detail::hmacSha256(repeated(131, 0xaa),
                               bytesOf("This is a test using a larger than block-size key and a larger than block-size "
                                       "data. The key needs to be hashed before being used by the HMAC algorithm."))) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST_CASE("HMAC-SHA256 takes an empty key and an empty message") {
  // RFC 2104 pads any key, the empty one included, to the block size; OpenSSL's CLI gives the same value
  // (`printf '' | openssl dgst -sha256 -hmac ''`).
  CHECK(hex(detail::hmacSha256({}, {})) == "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

TEST_CASE("MACs compare equal only when every byte and the length match") {
  const auto a = repeated(32, 7);
  auto b = a;
  CHECK(detail::macEqual(a, b));
  for (std::size_t i : {std::size_t{0}, std::size_t{17}, std::size_t{31}}) {
    b = a;
    b[i] ^= std::byte{1};
    CHECK_FALSE(detail::macEqual(a, b));
  }
  CHECK_FALSE(detail::macEqual(std::span(a).first(31), a));
  CHECK(detail::macEqual({}, {}));
}

TEST_CASE("handshake nonces are random: no two of a thousand are equal") {
  std::set<detail::Nonce> seen;
  for (int i = 0; i < 1000; ++i) seen.insert(detail::randomNonce());
  CHECK(seen.size() == 1000);
}
