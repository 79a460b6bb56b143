// tandemctl run's inputs: every value is a pure function of (seed, rank, slot, index), computed the same way on the
// host and on the GPU, so a rank can regenerate any rank's inputs (its own to check against the host reference, the
// others' for the GPU reference GEMM) without storing or exchanging them, and every node of a multi-node run agrees.
//   op-dtype, weight-dtype and raw slots: a hash of the index (uniform in [-1, 1), or one byte), stored in the slot's
//   dtype (FP8 included: the GEMM ops' FP8 a and b, the MoE ops' e4m3 weights), filled on the device on GPUs except
//   for FP8 (run_cuda.cpp says why);
//   int32 and fp32 slots (MoE routing, FP8 scales): reference::fillInputs (valid distinct expert ids, weights summing
//   to 1, positive scales around 1), on the host, copied to the device on GPUs;
//   outputs: poisoned with 0xFF bytes (NaN in every float dtype, -1 in int32), so an element an op skips shows up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/op_spec.hpp"

#ifdef __CUDACC__
#define TANDEMCTL_HD __host__ __device__
#else
#define TANDEMCTL_HD
#endif

namespace tandem::ctl {

// The 64-bit finaliser of MurmurHash3 (Appleby): every input bit affects every output bit.
TANDEMCTL_HD inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// One stream per (seed, rank, slot).
TANDEMCTL_HD inline uint64_t slotKey(uint64_t seed, uint32_t rank, uint32_t slot) {
  return mix64(mix64(seed + 0x632BE59BD9B4E019ULL) ^ (uint64_t{rank} << 8 | slot));
}

// Element i of a float slot: k / 2^23 - 1 for a 24-bit k, so exact in fp32 and rounded to bf16/fp16 identically by
// the host (numeric.hpp, round to nearest even) and the GPU (__float2bfloat16_rn, __float2half_rn).
TANDEMCTL_HD inline float uniformAt(uint64_t key, uint64_t i) {
  const uint64_t h = mix64(key + i * 0x9E3779B97F4A7C15ULL);
  return static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

// Byte i of a raw slot.
TANDEMCTL_HD inline uint8_t byteAt(uint64_t key, uint64_t i) {
  return static_cast<uint8_t>(mix64(key + i * 0x9E3779B97F4A7C15ULL) >> 56);
}

// Whether slot `s` of `op` is filled by the hash rather than by reference::fillInputs (the FP8 scales are fp32 slots:
// fillInputs).
inline bool hashFilled(const OpSpec& op, int s) {
  const ElementType t = op.slots[static_cast<std::size_t>(s)].type;
  return t == ElementType::kOpDtype || t == ElementType::kWeightDtype || t == ElementType::kRaw;
}

// Fills `desc`'s slots in host memory: inputs from (seed, desc.rank), outputs poisoned. Null or empty slots are
// skipped, so passing only the input slots regenerates another rank's inputs.
void fillHost(const OpDescriptor& desc, std::span<std::byte* const> slots, uint64_t seed);

// Only slot `s` (an input) of `desc`, into `p` (desc.bufs[s].bytes bytes).
void fillHostSlot(const OpDescriptor& desc, int s, std::byte* p, uint64_t seed);

}  // namespace tandem::ctl
