// The CPU backend's collectives across nodes: hierarchical, so that one payload per node pair
// crosses the network per op. Inside a node the ranks' memory is all mapped by this daemon (the CPU
// backend's "NVLink"); between nodes every node exchanges one aggregated payload with every other through
// CommLink::exchange (proxy FIFO -> transport -> the peer's staging inbox).
//
//   ag-gemm, allgather  each node sends its ranks' shards (raw bytes as stored, in the op's layout, rank order; with
//                       FP8 inputs each shard's A scales too) to every other node; every node then holds the whole
//                       gathered A and computes its ranks' outputs, in any layout, FP8 dequantized (cpu_ops.cpp's
//                       gemmOperand).
//   gemm-rs             each node sums its ranks' partial products (fp32, rank order; any layout, FP8 dequantized)
//                       and sends every other node only the rows that node's ranks own; the owner sums node
//                       partials in node order.
//   gemm-ar             as gemm-rs, with every row going to every node (one shot: fine for the reference).
//   barrier             an exchange of empty payloads.
//   moe-*, ring-attention  replicated: every node sends every other node its ranks' inputs, then runs the whole op
//                       (the single-node reference, cpu_ops.cpp), keeping its own ranks' outputs. Correct, and it
//                       moves every input to every node: a reference path, not a fast one.
// Reductions add node partials in ascending node order on every node, so every rank of gemm-ar gets bitwise
// the same output, and repeated runs give bitwise the same results.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cluster.hpp"
#include "cpu/cpu_ops.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon {
namespace {

constexpr uint32_t kExchangeTimeoutMs = 60000;  // a peer daemon that is alive but sends nothing this long

struct Layout {
  std::span<const RankOp> ranks;
  std::span<const uint32_t> nodeOf;
  uint32_t self;
  uint32_t nranks() const { return static_cast<uint32_t>(ranks.size()); }
  bool local(uint32_t r) const { return nodeOf[r] == self; }
  std::vector<uint32_t> ranksOn(uint32_t node) const {
    std::vector<uint32_t> out;
    for (uint32_t r = 0; r < nranks(); ++r) {
      if (nodeOf[r] == node) out.push_back(r);
    }
    return out;
  }
};

// The input slots of a rank's op (those the op reads), with their extents.
std::vector<std::pair<int, uint64_t>> inputSlots(const OpDescriptor& d) {
  const SlotRules rules = expectedSlots(d);
  std::vector<std::pair<int, uint64_t>> out;
  for (int s = 0; s < static_cast<int>(kMaxOpBuffers); ++s) {
    const auto i = static_cast<std::size_t>(s);
    if (!rules[i].name.empty() && !rules[i].output && d.bufs[i].bytes != 0) out.emplace_back(s, d.bufs[i].bytes);
  }
  return out;
}

// Bytes node `from` sends node `to` in this op (the op table's crossNodeBytes).
uint64_t payloadBytes(const Layout& l, uint32_t from, uint32_t to) {
  std::vector<const OpDescriptor*> descs;
  for (const RankOp& r : l.ranks) descs.push_back(&r.desc);
  return crossNodeBytes(descs, l.nodeOf, from, to);
}

// ag-gemm: every node sends its ranks' A shards as stored (in the op's layout) and, with FP8 inputs, their A scales;
// then each node has every rank's A and computes its own ranks' outputs from the gathered op(A), as cpu_ops.cpp does.
void agGemm(const Layout& l, CommLink& link, uint64_t epoch) {
  const OpDescriptor& d = l.ranks[0].desc;
  const OpSpec& op = opSpec(d.kind);
  const uint32_t n = l.nranks();
  const std::size_t m = d.dims[dim::kM], cols = d.dims[dim::kN], k = d.dims[dim::kK], es = dtypeSize(d.dtype);
  std::vector<int> sent{slot::kA};
  if (isFp8(d.dtype)) sent.push_back(gemmScaleSlot(d.kind, false));
  // Remote ranks' views point at the received copies of the sent slots.
  std::vector<RankOp> views(l.ranks.begin(), l.ranks.end());
  std::vector<std::vector<std::byte>> received;
  for (uint32_t r = 0; r < n; ++r) {
    if (l.local(r)) continue;
    for (int s : sent) {
      views[r].data[static_cast<std::size_t>(s)] = received.emplace_back(slotBytes(op, s, views[r].desc)).data();
    }
  }
  const std::vector<uint32_t> mine = l.ranksOn(l.self);
  link.exchange(
      epoch,
      [&](uint32_t, std::span<std::byte> out) {
        uint64_t off = 0;
        for (uint32_t r : mine) {
          for (int s : sent) {
            const uint64_t bytes = slotBytes(op, s, views[r].desc);
            if (bytes != 0) std::memcpy(out.data() + off, views[r].data[static_cast<std::size_t>(s)], bytes);
            off += bytes;
          }
        }
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        uint64_t off = 0;
        for (uint32_t r : l.ranksOn(node)) {
          for (int s : sent) {
            const uint64_t bytes = slotBytes(op, s, views[r].desc);
            if (off + bytes > in.size()) fail(ErrorCode::kProtocol, "ag-gemm: node {} sent a short payload", node);
            if (bytes != 0) std::memcpy(views[r].data[static_cast<std::size_t>(s)], in.data() + off, bytes);
            off += bytes;
          }
        }
      },
      kExchangeTimeoutMs);
  std::vector<float> a(m * k);
  for (uint32_t r = 0; r < n; ++r) {
    const std::size_t rows = rowsOf(m, r, n);
    if (rows == 0) continue;
    const std::vector<float> shard = gemmOperand(views[r], false, rows, k);
    std::copy(shard.begin(), shard.end(), a.begin() + static_cast<std::ptrdiff_t>(rowOffset(m, r, n) * k));
  }
  const DType out = gemmOutDtype(d.dtype, d.flags);
  std::vector<float> c(m * cols);
  for (uint32_t r : mine) {
    const std::vector<float> b = gemmOperand(l.ranks[r], true, cols, k);
    gemmNT(a.data(), b.data(), c.data(), m, cols, k);
    storeElements(l.ranks[r].data[slot::kC], out, m * cols, c.data());
    // a_gathered: the shards in rank order, bit for bit as stored, in every layout.
    if (std::byte* g = l.ranks[r].data[slot::kAGathered]; g != nullptr) {
      for (uint32_t src = 0; src < n; ++src) {
        const std::size_t bytes = rowsOf(m, src, n) * k * es;
        if (bytes != 0) std::memcpy(g + rowOffset(m, src, n) * k * es, views[src].data[slot::kA], bytes);
      }
    }
  }
}

void allGather(const Layout& l, CommLink& link, uint64_t epoch) {
  const uint64_t bytes = l.ranks[0].desc.dims[dim::kBytes];
  std::vector<uint32_t> mine = l.ranksOn(l.self);
  auto place = [&](uint32_t src, const std::byte* data) {
    for (uint32_t r : mine) std::memcpy(l.ranks[r].data[slot::kRecv] + src * bytes, data, bytes);
  };
  link.exchange(
      epoch,
      [&](uint32_t, std::span<std::byte> out) {
        uint64_t off = 0;
        for (uint32_t r : mine) {
          std::memcpy(out.data() + off, l.ranks[r].data[slot::kSend], bytes);
          off += bytes;
        }
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const auto from = l.ranksOn(node);
        if (in.size() != from.size() * bytes) fail(ErrorCode::kProtocol, "allgather: node {} sent a short payload", node);
        for (std::size_t i = 0; i < from.size(); ++i) place(from[i], in.data() + i * bytes);
      },
      kExchangeTimeoutMs);
  for (uint32_t r : mine) place(r, l.ranks[r].data[slot::kSend]);
}

void gemmReduce(const Layout& l, CommLink& link, uint64_t epoch) {
  const OpDescriptor& d = l.ranks[0].desc;
  const bool allReduce = opSpec(d.kind).crossNode == CrossNode::kAllReduce;
  const uint32_t n = l.nranks();
  const std::size_t m = d.dims[dim::kM], cols = d.dims[dim::kN];
  std::vector<uint32_t> mine = l.ranksOn(l.self);

  // This node's partial: its ranks' products summed in rank order.
  std::vector<float> partial(m * cols, 0.0f), product(m * cols);
  for (uint32_t r : mine) {
    const std::size_t k = l.ranks[r].desc.dims[dim::kK];
    const std::vector<float> a = gemmOperand(l.ranks[r], false, m, k);
    const std::vector<float> b = gemmOperand(l.ranks[r], true, cols, k);
    gemmNT(a.data(), b.data(), product.data(), m, cols, k);
    for (std::size_t i = 0; i < partial.size(); ++i) partial[i] += product[i];
  }
  // The rows this node's ranks receive, in rank order (all rows for all-reduce), and their sums over nodes.
  std::vector<std::pair<std::size_t, std::size_t>> myRows;  // (first row, rows)
  if (allReduce) {
    myRows.emplace_back(0, m);
  } else {
    for (uint32_t r : mine) myRows.emplace_back(rowOffset(m, r, n), rowsOf(m, r, n));
  }
  std::size_t total = 0;
  for (auto& [first, rows] : myRows) total += rows * cols;
  std::vector<float> sum(total, 0.0f);
  auto add = [&](const float* rowsInOrder) {
    for (std::size_t i = 0; i < total; ++i) sum[i] += rowsInOrder[i];
  };
  std::vector<float> own(total);
  {
    std::size_t off = 0;
    for (auto& [first, rows] : myRows) {
      std::copy_n(partial.data() + first * cols, rows * cols, own.data() + off);
      off += rows * cols;
    }
  }
  bool ownAdded = false;
  auto addOwnBefore = [&](uint32_t node) {
    if (!ownAdded && l.self < node) {
      add(own.data());
      ownAdded = true;
    }
  };
  std::vector<float> incoming(total);
  link.exchange(
      epoch,
      [&](uint32_t node, std::span<std::byte> out) {
        uint64_t off = 0;
        std::vector<std::pair<std::size_t, std::size_t>> rowsFor;
        if (allReduce) {
          rowsFor.emplace_back(0, m);
        } else {
          for (uint32_t r : l.ranksOn(node)) rowsFor.emplace_back(rowOffset(m, r, n), rowsOf(m, r, n));
        }
        for (auto& [first, rows] : rowsFor) {
          std::memcpy(out.data() + off, partial.data() + first * cols, rows * cols * sizeof(float));
          off += rows * cols * sizeof(float);
        }
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        if (in.size() != total * sizeof(float)) fail(ErrorCode::kProtocol, "{}: node {} sent a payload of {} bytes, "
                                                     "expected {}", opKindName(d.kind), node, in.size(), total * 4);
        addOwnBefore(node);
        std::memcpy(incoming.data(), in.data(), in.size());  // the inbox need not be float-aligned for the reader
        add(incoming.data());
      },
      kExchangeTimeoutMs);
  if (!ownAdded) add(own.data());
  const DType out = gemmOutDtype(d.dtype, d.flags);
  std::size_t off = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const uint32_t r = mine[i];
    if (allReduce) {
      storeElements(l.ranks[r].data[slot::kC], out, m * cols, sum.data());
    } else {
      const std::size_t rows = myRows[i].second;
      storeElements(l.ranks[r].data[slot::kC], out, rows * cols, sum.data() + off);
      off += rows * cols;
    }
  }
}

// moe-*, ring-attention: gather every rank's inputs everywhere, then run the single-node op on all ranks. Remote
// ranks' outputs land in scratch and are dropped; every node computes them identically, so nothing needs sending back.
void replicatedOp(const Layout& l, CommLink& link, uint64_t epoch) {
  std::vector<RankOp> all(l.ranks.begin(), l.ranks.end());
  std::vector<std::vector<std::byte>> scratch;
  for (uint32_t r = 0; r < l.nranks(); ++r) {
    if (l.local(r)) continue;
    const SlotRules rules = expectedSlots(all[r].desc);
    for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
      const uint64_t bytes = all[r].desc.bufs[s].bytes;
      if (rules[s].name.empty() || bytes == 0 || (rules[s].output && rules[s].optional)) continue;
      all[r].data[s] = scratch.emplace_back(bytes).data();
    }
  }
  const std::vector<uint32_t> mine = l.ranksOn(l.self);
  link.exchange(
      epoch,
      [&](uint32_t, std::span<std::byte> out) {
        uint64_t off = 0;
        for (uint32_t r : mine) {
          for (auto& [s, bytes] : inputSlots(all[r].desc)) {
            std::memcpy(out.data() + off, all[r].data[static_cast<std::size_t>(s)], bytes);
            off += bytes;
          }
        }
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        uint64_t off = 0;
        for (uint32_t r : l.ranksOn(node)) {
          for (auto& [s, bytes] : inputSlots(all[r].desc)) {
            if (off + bytes > in.size()) {
              fail(ErrorCode::kProtocol, "{}: node {} sent a short payload", opKindName(all[r].desc.kind), node);
            }
            std::memcpy(all[r].data[static_cast<std::size_t>(s)], in.data() + off, bytes);
            off += bytes;
          }
        }
      },
      kExchangeTimeoutMs);
  runCpuOp(all);
}

}  // namespace

void runCpuOpAcrossNodes(std::span<const RankOp> ranks, std::span<const uint32_t> nodeOfRank, CommLink& link,
                         uint64_t epoch) {
  const Layout l{ranks, nodeOfRank, link.self()};
  const OpKind kind = ranks[0].desc.kind;
  const OpSpec& op = opSpec(kind);
  for (uint32_t from : link.nodes()) {
    for (uint32_t to : link.nodes()) {
      if (from == to) continue;
      if (const uint64_t need = payloadBytes(l, from, to); need > link.maxPayload()) {
        fail(ErrorCode::kInvalidArgument, "{} across nodes needs {} bytes of staging from node {} to node {}, but "
             "cluster.staging_bytes allows {} per peer node; raise cluster.staging_bytes on every node (to at least "
             "{}) or split the op", opKindName(kind), need, from, to, link.maxPayload(),
             need + CommLink::kPayloadHeaderBytes);
      }
    }
  }
  switch (op.crossNode) {
    case CrossNode::kGather: return kind == OpKind::kAgGemm ? agGemm(l, link, epoch) : allGather(l, link, epoch);
    case CrossNode::kReduceScatter:
    case CrossNode::kAllReduce: return gemmReduce(l, link, epoch);
    case CrossNode::kReplicate: return replicatedOp(l, link, epoch);
    case CrossNode::kNone:
      link.exchange(epoch, [](uint32_t, std::span<std::byte>) { return uint64_t{0}; },
                    [](uint32_t, std::span<const std::byte>) {}, kExchangeTimeoutMs);
      return;
  }
}

}  // namespace tandem::daemon
