// What the FP8 GPU tests share: OCP FP8 decoding for the fp64 references (written out, so a reference shares nothing
// with the kernel under test) and random finite fp8 inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "tandem/kernels/gemm_fp8.hpp"  // Fp8Format

namespace tandem::gputest {

// OCP FP8 decoding (the tensor cores' e4m3 / e5m2).
inline double decodeFp8(uint8_t v, kernels::Fp8Format f) {
  const double sign = (v & 0x80) != 0 ? -1.0 : 1.0;
  if (f == kernels::Fp8Format::kE4M3) {
    const int e = (v >> 3) & 15, m = v & 7;
    return sign * (e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7));
  }
  const int e = (v >> 2) & 31, m = v & 3;
  return sign * (e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1.0 + m / 4.0, e - 15));
}

// Random finite fp8 of magnitudes 2^-4 .. 2^5 (exponents spread, every mantissa, both signs): no NaN or infinity.
inline uint8_t randomFp8(std::mt19937_64& rng, kernels::Fp8Format f) {
  const uint64_t h = rng();
  const uint8_t s = static_cast<uint8_t>((h >> 12) & 1) << 7;
  if (f == kernels::Fp8Format::kE4M3) {
    return s | static_cast<uint8_t>((3 + h % 9) << 3) | static_cast<uint8_t>((h >> 8) & 7);
  }
  return s | static_cast<uint8_t>((11 + h % 9) << 2) | static_cast<uint8_t>((h >> 8) & 3);
}

}  // namespace tandem::gputest
