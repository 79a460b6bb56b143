#include "cuda/client_gate.hpp"

#include <array>
#include <span>

#include "tandem/common/op_spec.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/gpu_ops.hpp"

namespace tandem::daemon::cuda {

// Ops released only once every rank's stream reached them (kernels::needsGang, shared with libtandem). Measured on
// nvidia-h200-x2 (bench/RESULTS.md): a GPU-to-GPU barrier kernel over the workspaces was slower than this host gate at
// 2 ranks (16.6 vs 13.4 us p50 round trip), so barriers stay gated by tandemd.
bool ClientGateComm::needsReady(const Gang& g) const { return kernels::needsGang(g.c.ops[0].desc); }

NodeComm::Release ClientGateComm::release(const std::shared_ptr<Gang>& g) {
  const kernels::GpuOp* op = kernels::findGpuOp(g->kind);
  if (g->rejected && op != nullptr && op->launch != nullptr && !opSpec(g->kind).readsVerdict) {
    // Unlike AllGather's and the MoE ops' kernels, these (the fused GEMMs, ring attention) read no verdict: once go
    // opens they run, and ranks that disagree on the shape would wait on each other's flags until their deadline.
    // Abort the communicator before go opens (the abort word set first, so the kernels unwind at once); every rank
    // already has the rejection's error.
    abortFromBackend(ErrorCode::kAborted,
                     fmt::format("{} (op epoch {}) was rejected: {}; a fused GEMM cannot be skipped once its stream "
                                 "reaches it, so the communicator was aborted",
                                 opKindName(g->kind), g->epoch, g->c.error));
    return Release::kAborted;
  }
  if (op != nullptr && op->needsRankRows && !g->rejected) {
    // Each rank's launch needs every rank's rows on its host (ring attention's backward): libtandem's host waits for
    // them after submitting the op. The op needs no gang-ready, so they go out once every rank submitted it (and the
    // ops before it were released), before the verdict.
    std::array<uint64_t, kernels::kPageRanks> rows{};
    for (uint32_t r = 0; r < nranks() && r < rows.size(); ++r) rows[r] = g->c.ops[r].desc.dims[dim::kSeq];
    for (uint32_t r = 0; r < nranks(); ++r) page(r).publishRankRows(g->epoch, std::span(rows.data(), nranks()));
  }
  for (uint32_t r = 0; r < nranks(); ++r) page(r).publishVerdict(g->epoch, !g->rejected);
  return Release::kReleased;
}

}  // namespace tandem::daemon::cuda
