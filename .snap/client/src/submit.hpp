// libtandem-internal: submitting an op from its descriptor. Tools that derive every op from the op table
// (tandemctl run) submit through this one path, so adding an op does not touch them. Not part of the C ABI: tandem.h's
// per-op entry points stay the stable surface, and each of them ends in the same code as this.
#pragma once

#include <span>

#include "tandem/common/descriptor.hpp"
#include "tandem/tandem.h"

namespace tandem::client {

// Submits `desc` on `comm`: its kind, dtype, dims, flags and scale as the caller set them; version, rank, nranks,
// communicator handle and each slot's BufferRef are filled in here from `comm` and `tensors` (one per slot of the op,
// in op-table order; a null buffer leaves an optional slot out). Validation, the cuda backend's checks and the
// enqueue on `stream` (a cudaStream_t; null = the legacy default stream) are exactly those of the op's C entry point.
// Returns TANDEM_SUCCESS or a status with tandem_last_error() set; never throws. Thread-safety: as the C entry points.
tandem_status_t submitDescriptor(tandem_comm_t comm, const OpDescriptor& desc, std::span<const tandem_tensor_t> tensors,
                                 tandem_op_t* op, void* stream);

}  // namespace tandem::client
