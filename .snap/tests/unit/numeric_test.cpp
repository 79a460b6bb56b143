#include "tandem/common/numeric.hpp"

#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

using tandem::DType;

float fromBits(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t toBits(float value) { return std::bit_cast<uint32_t>(value); }
constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("bf16 conversion keeps exactly representable values") {
  for (float v : {0.0f, 1.0f, -1.0f, 2.0f, 0.5f, -3.0f, 1.0078125f /* 1 + 2^-7 */, 65280.0f,
                  fromBits(0x7F7F0000) /* largest finite bf16 */}) {
    CHECK(tandem::bf16ToFloat(tandem::floatToBf16(v)) == v);
  }
  CHECK(tandem::floatToBf16(1.0f) == 0x3F80);
  CHECK(tandem::floatToBf16(-2.0f) == 0xC000);
  CHECK(tandem::floatToBf16(-0.0f) == 0x8000);
  CHECK(std::signbit(tandem::bf16ToFloat(0x8000)));
}

TEST_CASE("bf16 conversion rounds to nearest with ties to even") {
  // 1 + 2^-8 lies halfway between 1 (even mantissa) and 1 + 2^-7: ties to 1.
  CHECK(tandem::floatToBf16(fromBits(0x3F808000)) == 0x3F80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): ties up.
  CHECK(tandem::floatToBf16(fromBits(0x3F818000)) == 0x3F82);
  // Just above and below the halfway point round to the nearer value.
  CHECK(tandem::floatToBf16(fromBits(0x3F808001)) == 0x3F81);
  CHECK(tandem::floatToBf16(fromBits(0x3F807FFF)) == 0x3F80);
  // Negative values round symmetrically.
  CHECK(tandem::floatToBf16(fromBits(0xBF808000)) == 0xBF80);
  CHECK(tandem::floatToBf16(fromBits(0xBF818000)) == 0xBF82);
  // A carry out of the mantissa bumps the exponent.
  CHECK(tandem::floatToBf16(fromBits(0x3FFFFFFF)) == 0x4000);
}

TEST_CASE("bf16 conversion handles NaN, infinity and overflow") {
  CHECK(tandem::floatToBf16(kInf) == 0x7F80);
  CHECK(tandem::floatToBf16(-kInf) == 0xFF80);
  CHECK(std::isinf(tandem::bf16ToFloat(0x7F80)));
  // The largest finite float rounds past the largest bf16 (0x7F7F) to infinity.
  CHECK(tandem::floatToBf16(std::numeric_limits<float>::max()) == 0x7F80);
  CHECK(tandem::floatToBf16(fromBits(0x7F7F7FFF)) == 0x7F7F);
  CHECK(tandem::floatToBf16(fromBits(0x7F7F8000)) == 0x7F80);  // tie, odd mantissa: up, to infinity
  SUBCASE("a NaN whose payload lies only in the dropped bits stays NaN") {
    const uint16_t b = tandem::floatToBf16(fromBits(0x7F800001));
    CHECK((b & 0x7F80) == 0x7F80);
    CHECK((b & 0x007F) != 0);
    CHECK(std::isnan(tandem::bf16ToFloat(b)));
  }
  SUBCASE("the sign of a NaN is kept") {
    CHECK((tandem::floatToBf16(-std::numeric_limits<float>::quiet_NaN()) & 0x8000) == 0x8000);
    CHECK(std::isnan(tandem::bf16ToFloat(tandem::floatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  }
}

TEST_CASE("bf16 conversion keeps subnormals") {
  // bf16 has float's exponent range, so float subnormals round on the mantissa alone.
  CHECK(tandem::floatToBf16(fromBits(0x00010000)) == 0x0001);
  CHECK(tandem::bf16ToFloat(0x0001) == fromBits(0x00010000));
  CHECK(tandem::floatToBf16(fromBits(0x00008000)) == 0x0000);  // tie to even (zero)
  CHECK(tandem::floatToBf16(fromBits(0x00018000)) == 0x0002);  // tie to even (up)
  CHECK(tandem::floatToBf16(fromBits(0x007FFFFF)) == 0x0080);  // rounds up into the smallest normal
}

TEST_CASE("fp16 conversion keeps exactly representable values") {
  for (float v : {0.0f, 1.0f, -1.0f, 0.5f, 2048.0f, 65504.0f, -65504.0f, 0.000061035156f /* 2^-14 */,
                  5.9604645e-08f /* 2^-24 */, 1.0009765625f /* 1 + 2^-10 */}) {
    CHECK(tandem::halfToFloat(tandem::floatToHalf(v)) == v);
  }
  CHECK(tandem::floatToHalf(1.0f) == 0x3C00);
  CHECK(tandem::floatToHalf(-2.0f) == 0xC000);
  CHECK(tandem::floatToHalf(65504.0f) == 0x7BFF);
  CHECK(tandem::floatToHalf(-0.0f) == 0x8000);
  CHECK(tandem::halfToFloat(0x3555) == doctest::Approx(0.333251953125));
}

TEST_CASE("fp16 conversion rounds to nearest with ties to even") {
  // 1 + 2^-11: halfway between 1 and 1 + 2^-10, ties to 1.
  CHECK(tandem::floatToHalf(1.0f + 0x1.0p-11f) == 0x3C00);
  // 1 + 3*2^-11: halfway between 1 + 2^-10 (odd) and 1 + 2^-9: up.
  CHECK(tandem::floatToHalf(1.0f + 3 * 0x1.0p-11f) == 0x3C02);
  CHECK(tandem::floatToHalf(1.0f + 0x1.0p-11f + 0x1.0p-20f) == 0x3C01);
  CHECK(tandem::floatToHalf(-(1.0f + 3 * 0x1.0p-11f)) == 0xBC02);
  // Mantissa carry into the exponent: 2 - 2^-12 rounds to 2.
  CHECK(tandem::floatToHalf(2.0f - 0x1.0p-12f) == 0x4000);
}

TEST_CASE("fp16 conversion overflows to infinity exactly past the rounding boundary") {
  CHECK(tandem::floatToHalf(65519.996f) == 0x7BFF);  // below 65520 rounds down to 65504
  CHECK(tandem::floatToHalf(65520.0f) == 0x7C00);    // the tie rounds to even, which is infinity
  CHECK(tandem::floatToHalf(1e6f) == 0x7C00);
  CHECK(tandem::floatToHalf(-1e6f) == 0xFC00);
  CHECK(tandem::floatToHalf(kInf) == 0x7C00);
  CHECK(tandem::floatToHalf(-kInf) == 0xFC00);
  CHECK(std::isinf(tandem::halfToFloat(0x7C00)));
  CHECK(tandem::halfToFloat(0xFC00) == -kInf);
}

TEST_CASE("fp16 conversion keeps NaN a NaN") {
  for (uint32_t bits : {0x7FC00000u, 0x7F800001u, 0xFFC00000u, 0x7F802000u, 0x7FFFFFFFu}) {
    const uint16_t h = tandem::floatToHalf(fromBits(bits));
    CHECK((h & 0x7C00) == 0x7C00);
    CHECK((h & 0x03FF) != 0);
    CHECK((h & 0x8000) == ((bits >> 16) & 0x8000));
    CHECK(std::isnan(tandem::halfToFloat(h)));
  }
  CHECK(std::isnan(tandem::halfToFloat(0x7C01)));
  CHECK(std::isnan(tandem::halfToFloat(0xFE00)));
}

TEST_CASE("fp16 conversion handles subnormals and underflow") {
  const float tiny = 0x1.0p-24f;  // smallest fp16 subnormal
  CHECK(tandem::floatToHalf(tiny) == 0x0001);
  CHECK(tandem::halfToFloat(0x0001) == tiny);
  CHECK(tandem::halfToFloat(0x03FF) == 1023 * tiny);  // largest subnormal
  CHECK(tandem::halfToFloat(0x8001) == -tiny);
  CHECK(tandem::floatToHalf(3 * tiny) == 0x0003);
  CHECK(tandem::floatToHalf(0x1.0p-25f) == 0x0000);                  // tie between 0 and 2^-24: even (0)
  CHECK(tandem::floatToHalf(0x1.0p-25f * 1.0000001f) == 0x0001);     // just above the tie
  CHECK(tandem::floatToHalf(1.5f * tiny) == 0x0002);                 // tie between 1 and 2 units: even (2)
  CHECK(tandem::floatToHalf(2.5f * tiny) == 0x0002);                 // tie between 2 and 3 units: even (2)
  CHECK(tandem::floatToHalf(1023.5f * tiny) == 0x0400);              // rounds up into the smallest normal
  CHECK(tandem::floatToHalf(0x1.0p-30f) == 0x0000);
  CHECK(tandem::floatToHalf(-0x1.0p-30f) == 0x8000);                 // underflow keeps the sign
  CHECK(tandem::floatToHalf(fromBits(0x00000001)) == 0x0000);        // float subnormal
  CHECK(tandem::floatToHalf(0x1.0p-14f) == 0x0400);                  // smallest normal
}

TEST_CASE("fp16 conversion round-trips every finite half exactly") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00) continue;
    const float f = tandem::halfToFloat(static_cast<uint16_t>(h));
    REQUIRE(tandem::floatToHalf(f) == h);
  }
}

TEST_CASE("bf16 conversion round-trips every finite bf16 exactly") {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7F80) == 0x7F80) continue;
    REQUIRE(tandem::floatToBf16(tandem::bf16ToFloat(static_cast<uint16_t>(b))) == b);
  }
}

TEST_CASE("loadElement, storeElement and roundTo agree for every dtype") {
  std::array<std::byte, 64> buf{};
  SUBCASE("fp32 stores the value unchanged") {
    tandem::storeElement(buf.data(), DType::kF32, 3, 1.2345678f);
    CHECK(tandem::loadElement(buf.data(), DType::kF32, 3) == 1.2345678f);
    CHECK(tandem::roundTo(DType::kF32, 1.2345678f) == 1.2345678f);
  }
  SUBCASE("bf16 and fp16 round once") {
    for (DType t : {DType::kBF16, DType::kF16}) {
      for (float v : {0.1f, -3.14159f, 1000.7f, 1e-6f}) {
        tandem::storeElement(buf.data(), t, 5, v);
        CHECK(tandem::loadElement(buf.data(), t, 5) == tandem::roundTo(t, v));
      }
    }
    CHECK(tandem::roundTo(DType::kBF16, 0.1f) == tandem::bf16ToFloat(tandem::floatToBf16(0.1f)));
    CHECK(tandem::roundTo(DType::kF16, 0.1f) == tandem::halfToFloat(tandem::floatToHalf(0.1f)));
  }
  SUBCASE("int32 converts numerically") {
    tandem::storeElement(buf.data(), DType::kI32, 2, 7.0f);
    int32_t raw;
    std::memcpy(&raw, buf.data() + 8, 4);
    CHECK(raw == 7);
    CHECK(tandem::loadElement(buf.data(), DType::kI32, 2) == 7.0f);
    CHECK(tandem::roundTo(DType::kI32, 2.5f) == 2.0f);  // nearest, ties to even
    CHECK(tandem::roundTo(DType::kI32, -3.7f) == -4.0f);
    tandem::storeElement(buf.data(), DType::kI32, 0, 1e20f);
    CHECK(tandem::loadElement(buf.data(), DType::kI32, 0) == 2147483647.0f);
  }
  SUBCASE("elements are placed at index * size, unaligned bases work") {
    tandem::storeElement(buf.data() + 1, DType::kBF16, 1, 1.0f);
    uint16_t raw;
    std::memcpy(&raw, buf.data() + 3, 2);
    CHECK(raw == 0x3F80);
  }
  SUBCASE("the bulk forms give the same bits as the element forms") {
    const std::array<float, 5> values{0.1f, -2.5f, 65520.0f, 0x1.0p-25f, std::numeric_limits<float>::quiet_NaN()};
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::array<std::byte, 32> a{}, b{};
      tandem::storeElements(a.data(), t, values.size(), values.data());
      for (std::size_t i = 0; i < values.size(); ++i) tandem::storeElement(b.data(), t, i, values[i]);
      CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
      std::array<float, 5> back{};
      tandem::loadElements(a.data(), t, back.size(), back.data());
      for (std::size_t i = 0; i < values.size(); ++i) {
        const float one = tandem::loadElement(a.data(), t, i);
        CHECK(toBits(back[i]) == toBits(one));
      }
    }
  }
}
