#include "op_metrics.hpp"

namespace tandem::ctl {

std::optional<OpMetrics> metricsOf(const OpDescriptor& d) {
  const double n = d.nranks, share = n > 1 ? (n - 1) / n : 0.0;  // the fraction of the data a rank receives
  const double es = static_cast<double>(dtypeSize(d.dtype));
  // gemm-rs and gemm-ar reduce c, which FP8 inputs make bf16 or fp32.
  const double cs = static_cast<double>(dtypeSize(gemmOutDtype(d.dtype, d.flags)));
  const auto dim = [&](int i) { return static_cast<double>(d.dims[static_cast<std::size_t>(i)]); };
  switch (d.kind) {
    case OpKind::kAgGemm:  // every rank computes all of C and gathers A
      return OpMetrics{2 * dim(dim::kM) * dim(dim::kN) * dim(dim::kK), dim(dim::kM) * dim(dim::kK) * es * share};
    case OpKind::kGemmRs:  // each rank its K slice; a reduce-scatter of [M, N]
      return OpMetrics{2 * dim(dim::kM) * dim(dim::kN) * dim(dim::kK), dim(dim::kM) * dim(dim::kN) * cs * share};
    case OpKind::kGemmAr:  // an all-reduce moves twice a reduce-scatter
      return OpMetrics{2 * dim(dim::kM) * dim(dim::kN) * dim(dim::kK), 2 * dim(dim::kM) * dim(dim::kN) * cs * share};
    case OpKind::kAllGather: return OpMetrics{0, n * dim(dim::kBytes) * share};
    case OpKind::kMoeDispatchGemm:  // this rank's tokens, each through topk experts
      return OpMetrics{2 * dim(dim::kTokens) * dim(dim::kTopk) * dim(dim::kHidden) * dim(dim::kNOut), 0};
    case OpKind::kMoeDispatchFfnCombine:  // gate, up and down projections
      return OpMetrics{6 * dim(dim::kTokens) * dim(dim::kTopk) * dim(dim::kHidden) * dim(dim::kFfn), 0};
    case OpKind::kMoeFfnBackward: {  // gate|up recomputed unless saved, dout w2, dw2, dw1 and dx (tandem.h: 8 or 6
                                     // ffn hidden multiply-adds a row)
      const double macs = d.dims[dim::kSavedRows] != 0 ? 6 : 8;
      return OpMetrics{2 * macs * dim(dim::kTokens) * dim(dim::kTopk) * dim(dim::kHidden) * dim(dim::kFfn), 0};
    }
    default: return std::nullopt;
  }
}

}  // namespace tandem::ctl
