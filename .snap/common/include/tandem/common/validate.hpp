// Shape rules of every op, in one place: the client checks them before submitting, the daemon checks them
// again (it never trusts the client), and the executors rely on them.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "tandem/common/descriptor.hpp"

namespace tandem {

struct SlotRule {
  std::string_view name;  // "a", "topk_ids", ... as in tandem.h; empty = slot unused by this kind
  DType dtype;            // element type the slot must hold
  uint64_t bytes;         // exact extent the shape implies
  bool optional;          // bufferId 0 allowed (the op then skips that output)
  bool output;            // written by the op
};
using SlotRules = std::array<SlotRule, kMaxOpBuffers>;

// Checks one rank's descriptor on its own: version, kind, dtype, flags, dims (non-zero, in range, within
// limits that keep byte counts from overflowing), rank < nranks <= kMaxRanks, unused dims and slots zero,
// every claimed BufferRef::bytes equal to what the shape implies, offsets aligned to the element size.
// Returns the slot rules. Throws Error(kInvalidArgument) naming the field and the fix.
SlotRules validateDescriptor(const OpDescriptor& desc);

// The slot rules a descriptor's kind, dtype, flags and dims imply, without looking at its BufferRefs (the
// client uses this to fill BufferRef::bytes). Throws Error(kInvalidArgument) for bad kind/dtype/dims exactly
// as validateDescriptor does. validateDescriptor = expectedSlots + the BufferRef checks.
SlotRules expectedSlots(const OpDescriptor& desc);

// Checks that all ranks' descriptors of one collective agree: same kind, dtype, flags, nranks and every
// dim that is global (per-rank dims such as k of gemm-rs, tokens of MoE or seq of attention may differ),
// and that descs[r].rank == r. Throws Error(kInvalidArgument) naming the rank and field.
void validateCollective(std::span<const OpDescriptor> descs);

}  // namespace tandem
