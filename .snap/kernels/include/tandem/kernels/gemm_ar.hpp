// Fused GEMM + AllReduce over NVLink. Inputs as GEMM + ReduceScatter (gemm_rs.hpp: K split across ranks);
// every rank receives the full C = Σ_r A_r · B_rᵀ, [m, n].
//
// Plans (GemmRsPlan; chooseGemmArPlan picks from measurements, see gemm_ar.cu):
// - two-shot: the fused reduce-scatter of gemm_rs.hpp, and the reduced bf16 values of each half tile go into every
//   rank's output over NVLink (transport kCopy: the copier warps broadcast them from the local output) with a
//   per-half-tile flag there (the all-gather, fused in the same kernel). Every rank's kernel ends after the flags of the
//   tiles its peers reduced have arrived. Measured fastest at every size, small outputs included.
// - one-shot (plan.oneShot): every rank computes its whole partial into its local outbox and flags each half tile;
//   reduce CTAs on every rank pull the peers' partials of each tile as it is flagged and sum in rank order into the
//   local output.
// - decomposed: the GEMM core, then our own reduction kernel (one-shot or two-shot, no NCCL).
#pragma once

#include <cuda_runtime_api.h>

#include "tandem/kernels/gemm_rs.hpp"

namespace tandem::kernels {

// The plan tandem runs for this all-reduce shape (measured on nvidia-h200-x2; bench/RESULTS.md).
GemmRsPlan chooseGemmArPlan(int64_t m, int64_t n, int64_t k, int nranks, GemmDtype dtype);

// Enqueues GEMM + AllReduce on `stream`; params.out is [m, n] on every rank and params.peerOut must map every rank's
// out (two-shot plans write into it). Same rules and errors as launchGemmRs. Returns the plan that was enqueued.
GemmRsPlan launchGemmAr(const GemmRsParams& params, cudaStream_t stream);

}  // namespace tandem::kernels
