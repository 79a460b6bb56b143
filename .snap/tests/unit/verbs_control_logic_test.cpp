// The verbs control channel's pure logic: how a message is cut into SEND fragments for the peer's receive slots and
// put back together, and what a malformed fragment does. No NIC (the channel itself runs in verbs_double_test.cpp).
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "transport/verbs_logic.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;

TEST_CASE("control messages cut into slot-sized fragments come back whole, for every size around the slot") {
  constexpr std::size_t kSlot = 64;
  std::mt19937 rng(7);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, kSlot - 5, kSlot - 4, kSlot - 3, 2 * (kSlot - 4),
                        2 * (kSlot - 4) + 1, std::size_t{1000}}) {
    std::vector<std::byte> payload(n);
    for (auto& b : payload) b = static_cast<std::byte>(rng());
    std::vector<uint32_t> lengths;
    const auto wire = verbs::fragmentMessage(payload, kSlot, lengths);
    INFO("payload of " << n << " bytes");
    CHECK(lengths.size() == (n == 0 ? 1 : (n + kSlot - 5) / (kSlot - 4)));
    std::vector<std::byte> assembling;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      CHECK(lengths[i] <= kSlot);
      const bool last = verbs::appendFragment(std::span(wire).subspan(i * kSlot, lengths[i]), assembling, 1 << 20);
      CHECK(last == (i + 1 == lengths.size()));
    }
    CHECK(assembling == payload);
  }
}

TEST_CASE("a malformed control fragment or an oversized message is a protocol error") {
  std::vector<std::byte> assembling;
  const std::byte shortFragment[2] = {};
  CHECK_THROWS_AS(verbs::appendFragment(shortFragment, assembling, 100), Error);
  std::byte bad[8] = {std::byte{9}};
  CHECK_THROWS_AS(verbs::appendFragment(bad, assembling, 100), Error);
  std::byte reserved[8] = {std::byte{verbs::kFragmentLast}, std::byte{1}};
  CHECK_THROWS_AS(verbs::appendFragment(reserved, assembling, 100), Error);
  std::vector<uint32_t> lengths;
  const std::vector<std::byte> big(300);
  const auto wire = verbs::fragmentMessage(big, 128, lengths);
  try {
    for (std::size_t i = 0; i < lengths.size(); ++i)
      verbs::appendFragment(std::span(wire).subspan(i * 128, lengths[i]), assembling, 200);
    FAIL("a 300-byte message passed a 200-byte limit");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kProtocol);
  }
  CHECK_THROWS_AS(verbs::fragmentMessage(big, 4, lengths), Error);  // a slot with room for the header only
}
