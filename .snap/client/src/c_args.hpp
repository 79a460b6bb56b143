// libtandem-internal: reading an op's C argument struct (tandem.h) through the op table's field list, so that each
// tandem_<op> entry point is one call and a new op needs no hand-written copy.
#pragma once

#include <array>
#include <cstdint>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/tandem.h"

namespace tandem::client {

struct CArgs {
  OpDescriptor desc{};  // kind, dtype, dims, flags and scale; the rest is submitDescriptor's
  std::array<tandem_tensor_t, kMaxOpBuffers> tensors{};  // one per slot of the op, in op-table order
  uint8_t tensorCount = 0;
  void* stream = nullptr;  // cuda_stream
};

// Reads `args`, which points at spec.cStruct, field by field at the offsets of cArgsLayout(spec). Fields up to and
// including cuda_stream are required (struct_size must cover them); fields after it were appended in later versions,
// so one that struct_size does not cover reads as 0: an absent tensor, a clear flag. Throws Error(kInvalidArgument)
// for a NULL `args`, a struct_size too small, or an enum field out of range.
CArgs unpackArgs(const OpSpec& spec, const void* args);

}  // namespace tandem::client
