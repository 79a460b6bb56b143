// Grouped GEMM in the TN layout (sm_90a): the weight gradients of an MoE layer's experts in one persistent kernel.
//
// The rows of a [mTotal, m] and b [mTotal, n] are grouped by expert as the forward groups them: group e is rows
// [offsets[e], offsets[e + 1]) of both. For every expert
//     out[e] [m, n] = a_eᵀ · b_e        (summed over the group's rows, fp32 accumulation)
// e.g. dw2_e [hidden, ffn] = dy_eᵀ · h_e (a = the routing-weighted dy, b = h), dw1_e [2 ffn, hidden] =
// d(gate|up)_eᵀ · x_e. An expert with no rows gets zeros. K (a group's row count) varies per expert and is read from
// device memory by the kernel: a launch needs no host synchronisation and can be captured in a CUDA graph.
//
// Determinism: no split-K. Each 128 x 256 tile of out[e] is owned by one CTA, which sums the group's rows in order, so
// the result is bitwise repeatable from launch to launch and independent of the grid size.
//
// No row scale: scaling a's rows would cost a pass over each a tile in shared memory per k-block (and a second
// rounding of a to 16 bits); scale the rows where a is produced (the backward's weighted dy) instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/kernels/gemm.hpp"          // GemmDtype
#include "tandem/kernels/gemm_layouts.hpp"  // GemmOut

namespace tandem::kernels {

/// POD; zero-initialise (GroupedWgradParams p{}) and fill.
struct GroupedWgradParams {
  const void* a;                ///< [mTotal, m], row stride lda elements; 16-byte aligned
  const void* b;                ///< [mTotal, n], row stride ldb elements; 16-byte aligned
  void* out;                    ///< [numExperts, m, n], dense; 16-byte aligned; must not overlap any input
  const int32_t* groupOffsets;  ///< device memory, numExperts + 1 non-decreasing row offsets in [0, mTotal] (as
                                ///< GroupedGemmParams::groupOffsets). Rows outside [offsets[0], offsets[numExperts])
                                ///< are not summed. Offsets out of order give unspecified values in out but never an
                                ///< access outside a, b or out (they are clamped to [0, mTotal]).
  int64_t mTotal, m, n, numExperts;
  int64_t lda, ldb;             ///< elements; 0 = dense (m, n); otherwise multiples of 8, lda >= m, ldb >= n
  GemmDtype dtype;              ///< a and b: bf16 or fp16
  GemmOut outDtype;             ///< kInput (out in dtype, rounded to nearest even) or kFp32
  /// Optional gate, read by the kernel when it starts: unless *runIf == runValue, the launch writes nothing (out keeps
  /// its contents). The MoE backward points it at its routing state, so that a failed or rejected op leaves dw
  /// untouched, as the op's contract says, without a host round trip. Needs mTotal > 0.
  const int32_t* runIf;
  int32_t runValue;
};

/// Checks `params` against every rule the kernel needs, without touching the GPU.
/// @throws tandem::Error (kInvalidArgument) naming the rule broken and how to satisfy it.
void validateGroupedWgrad(const GroupedWgradParams& params);

/// Enqueues out[e] = a_eᵀ · b_e for every expert on `stream`. numSms > 0 caps the persistent grid (0: every SM).
/// m, n or numExperts == 0 enqueues nothing; mTotal == 0 zeroes out (cudaMemsetAsync). Thread-safe; tensor maps are
/// cached per (pointer, shape, stride).
/// @throws tandem::Error kInvalidArgument (validateGroupedWgrad's rules), kCuda (a CUDA call failed, or the device
///         is not sm_90).
void launchGroupedWgrad(const GroupedWgradParams& params, cudaStream_t stream, int numSms = 0);

/// Loads every grouped-wgrad kernel on `device` now (see preload.hpp for why). @throws tandem::Error (kCuda).
void preloadGroupedWgradKernels(int device);

}  // namespace tandem::kernels
