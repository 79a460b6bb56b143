// See gpu_exchange_plan.hpp. Pure logic (no CUDA): compiled into every build, so CI tests it.
#include "cuda/gpu_exchange_plan.hpp"

#include <algorithm>
#include <limits>

#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem::daemon::cuda {

GpuRegionLayout GpuRegionLayout::make(std::vector<uint32_t> nodes, uint32_t self, uint64_t stagingBytes) {
  if (nodes.size() < 2) fail(ErrorCode::kInvalidArgument, "GPU region: a communicator across {} node(s)", nodes.size());
  for (std::size_t i = 1; i < nodes.size(); ++i) {
    if (nodes[i] <= nodes[i - 1]) fail(ErrorCode::kInvalidArgument, "GPU region: nodes not ascending and distinct");
  }
  if (nodes.back() > kMaxNodeIndex) {
    fail(ErrorCode::kInvalidArgument, "GPU region: node index {} past {} (the header's words)", nodes.back(),
         kMaxNodeIndex);
  }
  if (std::find(nodes.begin(), nodes.end(), self) == nodes.end()) {
    fail(ErrorCode::kInvalidArgument, "GPU region: node {} is not one of the communicator's", self);
  }
  const uint64_t slot = stagingBytes / kSlotAlign * kSlotAlign;
  if (slot == 0) fail(ErrorCode::kInvalidArgument, "GPU region: staging bytes {} below {}", stagingBytes, kSlotAlign);
  return GpuRegionLayout{std::move(nodes), self, slot};
}

uint64_t GpuRegionLayout::inboxOffset(uint32_t at, uint32_t from) const {
  // `from`'s position among `at`'s peers: its position in nodes, less one when `at` comes before it.
  const auto pos = static_cast<uint64_t>(std::find(nodes.begin(), nodes.end(), from) - nodes.begin());
  const auto atPos = static_cast<uint64_t>(std::find(nodes.begin(), nodes.end(), at) - nodes.begin());
  const uint64_t index = pos > atPos ? pos - 1 : pos;
  return kHeaderBytes + (1 + index) * slotBytes;
}

std::vector<uint32_t> GpuRegionLayout::peers() const {
  std::vector<uint32_t> out;
  for (uint32_t n : nodes) {
    if (n != self) out.push_back(n);
  }
  return out;
}

std::vector<uint32_t> ranksOnNode(const ExchangeOp& op, uint32_t node) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < op.nodeOfRank.size(); ++r) {
    if (op.nodeOfRank[r] == node) out.push_back(r);
  }
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> ownedRows(const ExchangeOp& op, uint32_t node) {
  const OpDescriptor& d = op.descs.at(0);
  const uint64_t m = d.dims[dim::kM];
  if (d.kind == OpKind::kGemmAr) return m == 0 ? std::vector<std::pair<uint64_t, uint64_t>>{} : std::vector{std::pair{uint64_t{0}, m}};
  return rowRunsOf(m, static_cast<uint32_t>(op.descs.size()), ranksOnNode(op, node));
}

std::vector<std::pair<uint64_t, uint64_t>> rowRunsOf(uint64_t m, uint32_t n, const std::vector<uint32_t>& ranks) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (uint32_t r : ranks) {
    const uint64_t first = rowOffset(m, r, n), rows = rowsOf(m, r, n);
    if (rows == 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == first) {
      runs.back().second += rows;
    } else {
      runs.emplace_back(first, rows);
    }
  }
  return runs;
}

uint64_t exchangePayloadBytes(const ExchangeOp& op, uint32_t from, uint32_t to) {
  std::vector<const OpDescriptor*> descs;
  for (const OpDescriptor& d : op.descs) descs.push_back(&d);
  return crossNodeBytes(descs, op.nodeOfRank, from, to);  // the op table's rule, as the cpu backend's
}

uint64_t exchangeSendAreaBytes(const ExchangeOp& op, uint32_t node) {
  const OpDescriptor& d = op.descs.at(0);
  switch (d.kind) {
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: return d.dims[dim::kM] * d.dims[dim::kN] * sizeof(float);
    default:
      for (uint32_t to : op.nodes) {
        if (to != node) return exchangePayloadBytes(op, node, to);  // the same payload for every peer
      }
      return 0;
  }
}

namespace {
// Appends [src, src + bytes) -> [dst, ...) cut into commands of at most kMaxExchangeCommandBytes.
void appendCut(std::vector<ExchangeWrite>& out, uint64_t src, uint64_t dst, uint64_t bytes) {
  for (uint64_t off = 0; off < bytes; off += kMaxExchangeCommandBytes) {
    out.push_back({src + off, dst + off, std::min(kMaxExchangeCommandBytes, bytes - off)});
  }
}
}  // namespace

std::vector<ExchangeWrite> exchangeWrites(const ExchangeOp& op, const GpuRegionLayout& layout, uint32_t from,
                                          uint32_t to) {
  const OpDescriptor& d = op.descs.at(0);
  const uint64_t inbox = layout.inboxOffset(to, from);
  std::vector<ExchangeWrite> out;
  if (d.kind == OpKind::kGemmRs) {
    // The rows `to` owns, straight out of the node sum in the send area, packed in its inbox.
    const uint64_t rowBytes = d.dims[dim::kN] * sizeof(float);
    uint64_t packed = 0;
    for (auto [first, rows] : ownedRows(op, to)) {
      appendCut(out, GpuRegionLayout::sendOffset() + first * rowBytes, inbox + packed, rows * rowBytes);
      packed += rows * rowBytes;
    }
    return out;
  }
  appendCut(out, GpuRegionLayout::sendOffset(), inbox, exchangePayloadBytes(op, from, to));
  return out;
}

std::vector<uint64_t> passRowStarts(uint64_t m) {
  const uint64_t passes = std::clamp<uint64_t>(m / kExchangePassRows, 1, kMaxExchangePasses);
  std::vector<uint64_t> starts;
  for (uint64_t q = 0; q < passes; ++q) starts.push_back(q * m / passes / 8 * 8);
  return starts;
}

std::vector<uint64_t> exchangePassCuts(const ExchangeOp& op) {
  const OpDescriptor& d = op.descs.at(0);
  std::vector<uint64_t> cuts;
  if (d.kind != OpKind::kGemmRs && d.kind != OpKind::kGemmAr) return cuts;
  const std::vector<uint64_t> starts = passRowStarts(d.dims[dim::kM]);
  for (std::size_t q = 1; q < starts.size(); ++q) {
    cuts.push_back(GpuRegionLayout::sendOffset() + starts[q] * d.dims[dim::kN] * sizeof(float));
  }
  return cuts;
}

std::vector<std::vector<ExchangeWrite>> splitIntoPasses(const std::vector<ExchangeWrite>& writes,
                                                        const std::vector<uint64_t>& cuts) {
  const std::size_t passes = cuts.size() + 1;
  std::vector<std::vector<ExchangeWrite>> out(passes);
  for (const ExchangeWrite& x : writes) {
    const uint64_t end = x.srcOffset + x.bytes;
    for (std::size_t q = 0; q < passes; ++q) {
      const uint64_t lo = std::max(x.srcOffset, q == 0 ? 0 : cuts[q - 1]);
      const uint64_t hi = std::min(end, q + 1 == passes ? end : cuts[q]);
      if (lo < hi) out[q].push_back({lo, x.dstOffset + (lo - x.srcOffset), hi - lo});
    }
  }
  return out;
}

std::string gemmCoreRefusal(const std::vector<OpDescriptor>& descs, const std::vector<uint32_t>& ranks) {
  const OpDescriptor& d = descs.at(0);
  const bool ag = d.kind == OpKind::kAgGemm;
  const GemmOperands layout = gemmOperandsOf(d.flags);
  const std::string_view name = gemmLayoutName(layout);
  const bool fp8 = isFp8(d.dtype);
  if (!fp8 && d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    return fmt::format("{}: the GEMM cores take bf16, fp16 and fp8", dtypeName(d.dtype));
  }
  constexpr uint64_t kMaxDim = std::numeric_limits<int32_t>::max();
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN];
  if (m > kMaxDim || n > kMaxDim) return "a dimension past 2^31 - 1";
  if (fp8) {
    // The FP8 core (gemm_fp8.hpp): K-major operands, rows of k fp8 bytes as 16-byte words, a_scale rows of m floats
    // (ag-gemm's gathered scales are laid out for it: agScaleOffsets).
    if (layout != GemmOperands::kNT) {
      return fmt::format("layout {} with {} inputs: the FP8 core reads K-major operands only", name, dtypeName(d.dtype));
    }
    if (ag && n % 8 != 0) return fmt::format("n = {} is not a multiple of 8 (the FP8 core's 16-byte rows of C)", n);
    if (!ag && (d.flags & kFlagFp8BlockScale) != 0 && m % 4 != 0) {
      return fmt::format("m = {} is not a multiple of 4 (the FP8 core's 16-byte rows of block scales)", m);
    }
    for (uint32_t r : ranks) {
      if (const uint64_t kk = descs.at(r).dims[dim::kK]; kk > kMaxDim || kk % 16 != 0) {
        return fmt::format("{} = {} on rank {} is not a multiple of 16 (the FP8 core's 16-byte rows)",
                           ag ? "k" : "k slice", kk, r);
      }
    }
    return "";
  }
  if (ag && n % 8 != 0) return fmt::format("n = {} is not a multiple of 8 (the GEMM core's 16-byte rows of C)", n);
  if (layout != GemmOperands::kNT && n % 8 != 0) {
    return fmt::format("n = {} is not a multiple of 8 (the GEMM core's 16-byte rows of b [k, n] in {})", n, name);
  }
  if (layout == GemmOperands::kTN && !ag && m % 8 != 0) {
    return fmt::format("m = {} is not a multiple of 8 (the GEMM core's 16-byte rows of a [k, m] in tn)", m);
  }
  const auto nranks = static_cast<uint32_t>(descs.size());
  for (uint32_t r : ranks) {
    const uint64_t kk = descs.at(r).dims[dim::kK];
    if (kk > kMaxDim) return "a dimension past 2^31 - 1";
    if (layout != GemmOperands::kTN && kk % 8 != 0) {
      return fmt::format("{} = {} on rank {} is not a multiple of 8 (the GEMM core's 16-byte rows)",
                         ag ? "k" : "k slice", kk, r);
    }
    if (layout == GemmOperands::kTN && ag && rowsOf(m, r, nranks) % 8 != 0) {
      return fmt::format("rank {}'s {} rows are not a multiple of 8 (the GEMM core's 16-byte rows of its shard [k, "
                         "rows] in tn)", r, rowsOf(m, r, nranks));
    }
  }
  return "";
}

std::string gpuExchangeRefusal(const ExchangeOp& op, const ClusterSection& cluster) {
  if (cluster.gpuExchange == GpuExchange::kOff) return "cluster.gpu_exchange is off";
  if (op.descs.empty() || op.descs.size() != op.nodeOfRank.size()) return "no descriptors";
  const OpDescriptor& d = op.descs[0];
  const bool ag = d.kind == OpKind::kAgGemm;
  if (d.kind != OpKind::kAllGather && !ag && d.kind != OpKind::kGemmRs && d.kind != OpKind::kGemmAr) {
    return fmt::format("no GPU exchange for {}", opKindName(d.kind));
  }
  if (op.nodes.size() > kMaxExchangePeers + 1) return fmt::format("more than {} nodes", kMaxExchangePeers + 1);
  if (op.nodes.size() < 2 || op.nodes.back() > GpuRegionLayout::kMaxNodeIndex) {
    return fmt::format("node index past {}", GpuRegionLayout::kMaxNodeIndex);
  }
  if (d.kind != OpKind::kAllGather) {
    std::vector<uint32_t> all(op.descs.size());
    for (uint32_t r = 0; r < all.size(); ++r) all[r] = r;
    if (std::string why = gemmCoreRefusal(op.descs, all); !why.empty()) return why;
  }
  const GpuRegionLayout layout = GpuRegionLayout::make(op.nodes, op.nodes[0], cluster.stagingBytes);
  for (uint32_t from : op.nodes) {
    if (const uint64_t b = exchangeSendAreaBytes(op, from); b > layout.slotBytes) {
      return fmt::format("node {}'s send area needs {} bytes, cluster.staging_bytes gives {}", from, b,
                         layout.slotBytes);
    }
    std::size_t writes = 0;
    for (uint32_t to : op.nodes) {
      if (to == from) continue;
      if (const uint64_t b = exchangePayloadBytes(op, from, to); b > layout.slotBytes) {
        return fmt::format("node {} sends node {} {} bytes, cluster.staging_bytes gives {}", from, to, b,
                           layout.slotBytes);
      }
      writes += exchangeWrites(op, layout, from, to).size();
    }
    if (writes > kMaxExchangeWrites) return fmt::format("node {} would issue {} writes (at most {})", from, writes,
                                                        kMaxExchangeWrites);
  }
  return "";
}

RegionChoice chooseRegionMemory(const RegionFacts& f) {
  if (f.tcp) return {true, false, "region in mapped host memory (tcp: the bytes pass through the host's sockets)"};
  if (f.mps) {
    return {true, false, "region in mapped host memory (MPS: a GPU-memory region stalled under MPS on the verbs "
                         "test double; unchecked on a real NIC)"};
  }
  const int needed = f.otherGpusRead ? 200 : 100;
  if (f.writesOrdering >= needed) {
    return {false, false, fmt::format("region in GPU memory (GPUDirect writes ordering {} >= {}: in order for its "
                                      "readers)", f.writesOrdering, needed)};
  }
  if (f.canFlushOnWait) {
    return {false, true, fmt::format("region in GPU memory, the arrived waits flush GPUDirect writes (writes ordering "
                                     "{} < {})", f.writesOrdering, needed)};
  }
  return {true, false, fmt::format("region in mapped host memory (GPUDirect writes ordering {} < {} and no stream-wait "
                                   "flush on this GPU)", f.writesOrdering, needed)};
}

}  // namespace tandem::daemon::cuda
