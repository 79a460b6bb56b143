// Element conversions for the dtypes tandem carries. bf16, fp16 and fp8 round to nearest even, as GPUs do; fp8 (OCP
// e4m3fn and e5m2) does not saturate: past its largest finite value e5m2 gives Inf and e4m3 NaN, as torch's casts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/common/descriptor.hpp"

namespace tandem {

uint16_t floatToBf16(float value);
float bf16ToFloat(uint16_t bits);
uint16_t floatToHalf(float value);
float halfToFloat(uint16_t bits);

// Element `index` of a dense array of `dtype` at `base`, widened to float (kI32 converts numerically;
// kInvalid gives NaN). `base` needs no alignment.
float loadElement(const std::byte* base, DType dtype, std::size_t index);
// Rounds once to `dtype` and stores element `index` (kI32: nearest integer, saturating, NaN -> 0;
// kInvalid: stores nothing).
void storeElement(std::byte* base, DType dtype, std::size_t index, float value);
// Value after one round trip through dtype (what storing then loading gives).
float roundTo(DType dtype, float value);

// The MoE FFN's activation quantisation (tandem.h, FP8 weights): one 1 x 128 block of `count` values to e4m3 with one
// fp32 scale, as the cuda backend's kernels compute it: a = max(amax, 1e-30), q = e4m3(v * (448 / a)) (fp32 product,
// round to nearest even), scale = a / 448. Writes the dequantised values q * scale (what the next GEMM multiplies) to
// `dequantized` (which may be `in`) and returns the scale.
float quantizeE4m3Block(const float* in, std::size_t count, float* dequantized);

// Bulk forms of loadElement/storeElement for `count` consecutive elements (same conversions, same results).
// `base` needs no alignment.
void loadElements(const std::byte* base, DType dtype, std::size_t count, float* out);
void storeElements(std::byte* base, DType dtype, std::size_t count, const float* in);

}  // namespace tandem
