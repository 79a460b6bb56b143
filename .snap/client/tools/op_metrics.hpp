// Figures of merit `tandemctl run` prints per op: the useful floating-point work of one rank, and the bytes that cross
// the interconnect counted as NCCL's tests count bus bandwidth (so the figure compares with link speed at any rank
// count). Ops without an entry print neither: an op needs none to run or to be checked.
#pragma once

#include <optional>

#include "tandem/common/descriptor.hpp"

namespace tandem::ctl {

struct OpMetrics {
  double flops = 0;     // this rank's share of the op's work (a multiply-add counts 2)
  double busBytes = 0;  // per rank, NCCL's bus-bandwidth convention; 0 with one rank
};

// The metrics of rank d.rank's descriptor, or none for an op without a formula.
std::optional<OpMetrics> metricsOf(const OpDescriptor& d);

}  // namespace tandem::ctl
