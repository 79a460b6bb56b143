#include "tandem/common/numeric.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace tandem {

uint16_t floatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: keep sign and top payload bits, force the quiet bit so truncation never yields Inf.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 dropped bits. A carry out of the mantissa bumps the exponent, which is
  // exactly right, and turns values past the largest bf16 into Inf.
  const uint32_t roundingBias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + roundingBias) >> 16);
}

float bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t floatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;

  if (abs >= 0x7F800000u) {
    if (abs == 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u);
    // NaN: quiet, keep the top payload bits.
    return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x03FFu));
  }
  // 65520 (0x477FF000) is halfway between the largest half, 65504, and 65536; ties-to-even rounds it up,
  // so it and everything above overflow to Inf.
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);

  if (abs < 0x38800000u) {
    // Below 2^-14: a half subnormal (units of 2^-24) or zero. Float subnormals are far below 2^-25.
    const uint32_t exponent = abs >> 23;
    if (exponent == 0) return sign;
    const uint32_t mantissa = (abs & 0x007FFFFFu) | 0x00800000u;  // value = mantissa * 2^(exponent - 150)
    const uint32_t shift = 126u - exponent;                         // to units of 2^-24
    if (shift > 24) return sign;                                    // < 2^-25: rounds to zero
    uint32_t q = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal, 0x0400
    return static_cast<uint16_t>(sign | q);
  }

  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  uint32_t h = (abs - 0x38000000u) >> 13;
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float halfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  uint32_t mantissa = bits & 0x03FFu;
  if (exponent == 0x1F) {
    return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));  // Inf or NaN (payload kept)
  }
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal half: normalise into a float (every half subnormal is a float normal).
  uint32_t e = 113;  // exponent of 2^-14, the subnormal scale, in float bias
  while ((mantissa & 0x0400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x03FFu) << 13));
}

namespace {

// An OCP FP8 format: 1 sign, kExp exponent and kMan mantissa bits. e4m3 ("fn": finite, no infinities; S.1111.111 is
// NaN, the largest finite 448) or e5m2 (IEEE-like: S.11111.00 is Inf, the largest finite 57344).
struct Fp8Format {
  int exp, man, bias;
  bool ieee;  // e5m2: has Inf; e4m3fn: only the all-ones code is NaN
};
constexpr Fp8Format kE4M3{4, 3, 7, false};
constexpr Fp8Format kE5M2{5, 2, 15, true};

float fp8ToFloat(uint8_t bits, Fp8Format f) {
  const float sign = (bits & 0x80u) != 0 ? -1.0f : 1.0f;
  const int e = (bits >> f.man) & ((1 << f.exp) - 1);
  const int m = bits & ((1 << f.man) - 1);
  const int eMax = (1 << f.exp) - 1;
  if (f.ieee && e == eMax) return m == 0 ? sign * std::numeric_limits<float>::infinity()
                                         : std::numeric_limits<float>::quiet_NaN();
  if (!f.ieee && e == eMax && m == (1 << f.man) - 1) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - f.bias - f.man);  // subnormal
  return sign * std::ldexp(static_cast<float>(m + (1 << f.man)), e - f.bias - f.man);
}

// Round to nearest even, as the GPUs' non-saturating conversion does (and torch's): past the largest finite value
// by more than half a step, e5m2 gives Inf and e4m3 NaN (it has no Inf).
uint8_t floatToFp8(float value, Fp8Format f) {
  const uint8_t sign = std::signbit(value) ? 0x80u : 0x00u;
  const auto overflowed = [&] {  // Inf (e5m2) or NaN (e4m3, which has no Inf)
    return static_cast<uint8_t>(sign | (f.ieee ? (((1 << f.exp) - 1) << f.man) : 0x7F));
  };
  if (std::isnan(value)) return static_cast<uint8_t>(sign | 0x7Fu);
  const float mag = std::fabs(value);
  if (std::isinf(mag)) return overflowed();
  const int eMax = (1 << f.exp) - 1;
  const int maxExp = (f.ieee ? eMax - 1 : eMax) - f.bias;  // the largest finite value's exponent
  const int maxMan = f.ieee ? (2 << f.man) - 1 : (2 << f.man) - 2;  // and its significand, in units of 2^-man
  const float maxFinite = std::ldexp(static_cast<float>(maxMan), maxExp - f.man);
  const int minExp = 1 - f.bias;  // the smallest normal's exponent
  int e = 0;
  std::frexp(mag, &e);  // mag = x * 2^e with x in [0.5, 1): its leading bit is 2^(e - 1)
  const int quantumExp = std::max(e - 1, minExp) - f.man;
  const float q = std::nearbyint(std::ldexp(mag, -quantumExp));  // ties to even (the default rounding mode)
  const float rounded = std::ldexp(q, quantumExp);
  if (rounded > maxFinite) return overflowed();
  if (rounded == 0.0f) return sign;
  int re = 0;
  std::frexp(rounded, &re);
  if (re - 1 < minExp) return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));  // subnormal: the mantissa alone
  const int m = static_cast<int>(std::ldexp(rounded, f.man - (re - 1))) - (1 << f.man);
  return static_cast<uint8_t>(sign | ((re - 1 + f.bias) << f.man) | m);
}

int32_t floatToInt32(float value) {
  if (std::isnan(value)) return 0;
  // NOTE: 2^31 is exactly representable as float; anything at or above it saturates.
  if (value >= 2147483648.0f) return std::numeric_limits<int32_t>::max();
  if (value < -2147483648.0f) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(std::nearbyint(value));
}

}  // namespace

float loadElement(const std::byte* base, DType dtype, std::size_t index) {
  switch (dtype) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, base + index * 4, 4);
      return v;
    }
    case DType::kF16:
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, base + index * 2, 2);
      return dtype == DType::kF16 ? halfToFloat(v) : bf16ToFloat(v);
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, base + index * 4, 4);
      return static_cast<float>(v);
    }
    case DType::kF8E4M3: return fp8ToFloat(std::to_integer<uint8_t>(base[index]), kE4M3);
    case DType::kF8E5M2: return fp8ToFloat(std::to_integer<uint8_t>(base[index]), kE5M2);
    case DType::kInvalid: break;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

void storeElement(std::byte* base, DType dtype, std::size_t index, float value) {
  switch (dtype) {
    case DType::kF32: std::memcpy(base + index * 4, &value, 4); return;
    case DType::kF16: {
      const uint16_t v = floatToHalf(value);
      std::memcpy(base + index * 2, &v, 2);
      return;
    }
    case DType::kBF16: {
      const uint16_t v = floatToBf16(value);
      std::memcpy(base + index * 2, &v, 2);
      return;
    }
    case DType::kI32: {
      const int32_t v = floatToInt32(value);
      std::memcpy(base + index * 4, &v, 4);
      return;
    }
    case DType::kF8E4M3: base[index] = std::byte{floatToFp8(value, kE4M3)}; return;
    case DType::kF8E5M2: base[index] = std::byte{floatToFp8(value, kE5M2)}; return;
    case DType::kInvalid: return;
  }
}

float roundTo(DType dtype, float value) {
  switch (dtype) {
    case DType::kF32: return value;
    case DType::kF16: return halfToFloat(floatToHalf(value));
    case DType::kBF16: return bf16ToFloat(floatToBf16(value));
    case DType::kI32: return static_cast<float>(floatToInt32(value));
    case DType::kF8E4M3: return fp8ToFloat(floatToFp8(value, kE4M3), kE4M3);
    case DType::kF8E5M2: return fp8ToFloat(floatToFp8(value, kE5M2), kE5M2);
    case DType::kInvalid: break;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

float quantizeE4m3Block(const float* in, std::size_t count, float* dequantized) {
  constexpr float kE4M3Max = 448.0f;
  constexpr float kMinAmax = 1e-30f;  // keeps 448 / a finite for an all-zero block, whose values then quantise to 0
  float amax = 0.0f;
  for (std::size_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(in[i]));
  amax = std::max(amax, kMinAmax);
  const float inv = kE4M3Max / amax;
  const float scale = amax / kE4M3Max;
  for (std::size_t i = 0; i < count; ++i) {
    // |v * inv| <= 448 up to one rounding, which e4m3 rounds to 448: the kernels' satfinite never acts.
    dequantized[i] = fp8ToFloat(floatToFp8(in[i] * inv, kE4M3), kE4M3) * scale;
  }
  return scale;
}

void loadElements(const std::byte* base, DType dtype, std::size_t count, float* out) {
  // The switch sits outside the loops so each loop is a tight conversion the compiler can unroll.
  switch (dtype) {
    case DType::kF32: std::memcpy(out, base, count * 4); return;
    case DType::kF16:
      for (std::size_t i = 0; i < count; ++i) {
        uint16_t v;
        std::memcpy(&v, base + i * 2, 2);
        out[i] = halfToFloat(v);
      }
      return;
    case DType::kBF16:
      for (std::size_t i = 0; i < count; ++i) {
        uint16_t v;
        std::memcpy(&v, base + i * 2, 2);
        out[i] = bf16ToFloat(v);
      }
      return;
    case DType::kI32:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kInvalid:
      for (std::size_t i = 0; i < count; ++i) out[i] = loadElement(base, dtype, i);
      return;
  }
}

void storeElements(std::byte* base, DType dtype, std::size_t count, const float* in) {
  switch (dtype) {
    case DType::kF32: std::memcpy(base, in, count * 4); return;
    case DType::kF16:
      for (std::size_t i = 0; i < count; ++i) {
        const uint16_t v = floatToHalf(in[i]);
        std::memcpy(base + i * 2, &v, 2);
      }
      return;
    case DType::kBF16:
      for (std::size_t i = 0; i < count; ++i) {
        const uint16_t v = floatToBf16(in[i]);
        std::memcpy(base + i * 2, &v, 2);
      }
      return;
    case DType::kI32:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kInvalid:
      for (std::size_t i = 0; i < count; ++i) storeElement(base, dtype, i, in[i]);
      return;
  }
}

}  // namespace tandem
