// The GPU-issued exchange of communicators that span nodes (cuda backend): which ops take it, how a communicator's GPU
// region is laid out, and which transfer commands each node issues. Pure host logic on descriptors, the same on every
// node (so CI tests it without a GPU); cuda/gpu_exchange.hpp runs it, cuda/cuda_multinode.hpp uses it.
//
// The choice. An op's bytes between nodes go either through the GPU regions (the GPUs push the transfer commands,
// the proxy of their GPU posts them, the peer's transport copies them into its GPU region) or through CommLink's host
// staging (tandemd's link thread). Both ends of every transfer must take the same path, so the choice depends only on
// what every node knows alike: every rank's descriptor, where each rank lives, and the cluster section (identical on
// every node: NodeHello checks staging_bytes and gpu_exchange). Never on local pointers: a node whose tensor is not
// 16-byte aligned still takes the GPU exchange and copies that tensor aside (cuda_multinode.cpp).
//
// The region (one per communicator, on the GPU of its first local rank; the same layout on every node):
//   [0, 4096)        header: arrived[n] at 8n     the epoch whose payload node n put in my inbox from n
//                            consumed[n] at 2048 + 8n   the epoch of my payload that node n has read
//   [4096, +S)       the send area: this node's payload (ag-gemm, allgather: the local shards packed in rank order;
//                    gemm-rs, gemm-ar: the node's partial sum in fp32, m x n, read in place by the writes)
//   inbox i at 4096 + (1 + i) S   the payload of the receiver's i-th peer (peers ascending, the receiver excluded)
// S = cluster.staging_bytes rounded down to 256 bytes. No payload header: both ends know every size from the
// descriptors, and the epoch travels in the arrived flag.
//
// One op, epoch e (prev: the previous op of this communicator that took the GPU exchange, 0 for none):
//   push      for each peer p ascending: wait consumed[p] >= prev (p has read our previous payload, so its inbox from
//             us is free), then the writes to p and the flag arrived[self] = e in p's region: one destination batch,
//             one fence (proxyPushWritesThenFlag);
//   wait      for each peer p: arrived[p] >= e;
//   consumed  after the kernels and copies that read the inboxes: consumed[self] = e to every peer (flags only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "tandem/common/descriptor.hpp"

namespace tandem::daemon::cuda {

/// A communicator's GPU region (see the file comment). Node indices, not positions, index the header.
struct GpuRegionLayout {
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint32_t kMaxNodeIndex = 255;  // 2048 bytes of arrived words, 2048 of consumed
  static constexpr uint64_t kSlotAlign = 256;

  std::vector<uint32_t> nodes;  // ascending, self included
  uint32_t self = 0;
  uint64_t slotBytes = 0;       // S

  /// Throws Error(kInvalidArgument) for fewer than two nodes, unsorted or duplicate nodes, self missing, a node index
  /// past kMaxNodeIndex, or staging bytes below one slot alignment.
  static GpuRegionLayout make(std::vector<uint32_t> nodes, uint32_t self, uint64_t stagingBytes);

  static constexpr uint64_t arrivedOffset(uint32_t node) { return 8 * uint64_t{node}; }
  static constexpr uint64_t consumedOffset(uint32_t node) { return 2048 + 8 * uint64_t{node}; }
  static constexpr uint64_t sendOffset() { return kHeaderBytes; }
  /// In node `at`'s region: where node `from`'s payload lands (from != at, both in nodes).
  uint64_t inboxOffset(uint32_t at, uint32_t from) const;
  uint64_t bytes() const { return kHeaderBytes + nodes.size() * slotBytes; }
  std::vector<uint32_t> peers() const;  // nodes without self, ascending
};

/// What the choice and the commands depend on: every rank's descriptor, each rank's node, the communicator's nodes.
struct ExchangeOp {
  std::vector<OpDescriptor> descs;  // descs[r]: rank r's
  std::vector<uint32_t> nodeOfRank;
  std::vector<uint32_t> nodes;      // ascending
};

/// One write of a destination batch: from the sender's region to the receiver's (offsets in each).
struct ExchangeWrite {
  uint64_t srcOffset = 0, dstOffset = 0, bytes = 0;
  friend bool operator==(const ExchangeWrite&, const ExchangeWrite&) = default;
};

/// Largest transfer command (as CommLink cuts its writes): a command carries 32 bits of size.
inline constexpr uint64_t kMaxExchangeCommandBytes = uint64_t{1} << 30;
/// Limits of one op's command plan (the kernels' plan in pinned memory, span_exchange.hpp).
inline constexpr uint32_t kMaxExchangePeers = 64;
inline constexpr uint32_t kMaxExchangeWrites = 512;

/// Why op `op` cannot take the GPU exchange under `cluster`; empty when it takes it. The same on every node.
std::string gpuExchangeRefusal(const ExchangeOp& op, const ClusterSection& cluster);

/// Why the GEMM core cannot compute fused GEMM op `descs` (every rank's descriptor) for the ranks in `ranks` on the
/// GPUs across nodes; empty when it can. The core's rules on what every node knows alike (dtype, dims, each rank's k
/// and rows). 16-bit operands: each stored row a multiple of 8 elements (16-byte TMA strides), which is k for NT's A
/// and B and NN's A, n for NN's and TN's B (and ag-gemm's C), and the rows of TN's A: m for gemm-rs/ar, each rank's
/// shard for ag-gemm (whose gathered blocks then start 16-byte aligned). FP8 operands: the FP8 core's layout nt, k
/// (slices) of 16-byte multiples, and for gemm-rs/ar's block scales (read in place) m a multiple of 4. gpuExchangeRefusal asks it for every rank; a node's fallback for its own ranks (which adds
/// the local alignment of its tensors).
std::string gemmCoreRefusal(const std::vector<OpDescriptor>& descs, const std::vector<uint32_t>& ranks);

/// Bytes node `from` sends node `to` in op `op` (either path: the same payload as CommLink's).
uint64_t exchangePayloadBytes(const ExchangeOp& op, uint32_t from, uint32_t to);
/// Bytes of this node's send area the op fills (ag-gemm, allgather: its shards; gemm-rs/ar: the m x n fp32 sum).
uint64_t exchangeSendAreaBytes(const ExchangeOp& op, uint32_t node);

/// The writes node `from` issues to node `to` (in order; each at most kMaxExchangeCommandBytes), with `layout` the
/// region layout (the same on both nodes but for self).
std::vector<ExchangeWrite> exchangeWrites(const ExchangeOp& op, const GpuRegionLayout& layout, uint32_t from,
                                          uint32_t to);

/// gemm-rs / gemm-ar push in passes over row blocks of at least kExchangePassRows rows, at most kMaxExchangePasses
/// (span_exchange.hpp's kSpanMaxPasses): each block's rows go to the peers while the next block computes.
inline constexpr uint64_t kExchangePassRows = 256;
inline constexpr uint32_t kMaxExchangePasses = 4;
/// The first row of each pass of an op of m rows, ascending from 0 (one pass below 2 x kExchangePassRows rows), each a
/// multiple of 8: a TN partial's A block then starts 16-byte aligned (its rows are columns of the stored [k, m]).
std::vector<uint64_t> passRowStarts(uint64_t m);
/// Where each pass after the first starts in the send area (source offsets in the region): gemm-rs/ar, the node
/// sum's rows at their places; every other op has one pass (empty).
std::vector<uint64_t> exchangePassCuts(const ExchangeOp& op);
/// `writes` cut at `cuts` (ascending source offsets; each write's bytes are contiguous on both ends), each piece in
/// the pass that holds it: cuts.size() + 1 lists, in order, together exactly the bytes of `writes`.
std::vector<std::vector<ExchangeWrite>> splitIntoPasses(const std::vector<ExchangeWrite>& writes,
                                                        const std::vector<uint64_t>& cuts);

/// Where a communicator's region lives on the receiving node, and the rule that keeps "the flag after the data" true
/// for whoever reads its inboxes. Local to each node (the peers only see its key), so nodes may choose differently.
///
/// GPUDirect RDMA writes (a NIC writing into GPU memory) are ordered on the wire (an RC QP places a WRITE's bytes
/// before the next WRITE's, the arrived flag last), but the GPU may make them visible to its readers out of that
/// order: CUDA reports per GPU the scope within which it consumes them in order (writes ordering: 0 none, 100 its own
/// engines, 200 every GPU), and whether a stream wait can flush them (the MEMOPS flush option). The rule tandem
/// follows: only the region's own GPU reads its inboxes (its kernels, and copies issued on its streams; another local
/// GPU gets the bytes by a copy that the owner issues), after a wait on the arrived flag, so writes ordering >= 100
/// needs nothing more; below that the wait on the flag flushes (CU_STREAM_WAIT_VALUE_FLUSH) where the GPU can, and
/// where it cannot the region goes to pinned host memory, which a NIC writes in order as seen by any reader.
struct RegionFacts {
  bool tcp = false;               // the cluster's transport is tcp: its bytes pass through host sockets anyway
  bool mps = false;               // the GPU is shared through MPS
  int writesOrdering = 0;         // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING
  bool canFlushOnWait = false;    // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS in ..._FLUSH_WRITES_OPTIONS
  bool otherGpusRead = false;     // engines of other GPUs read the inboxes (tandem never does: see above)
};
struct RegionChoice {
  bool host = false;              // pinned host memory (else GPU memory)
  bool flushOnArrival = false;    // the arrived waits flush GPUDirect writes
  std::string why;                // for the plan log: why there, and what rule applies
};
/// The choice for `facts` (tcp: host; MPS: host, as GPU-memory regions stalled under MPS on the verbs test double;
/// else GPU memory under the ordering rule above).
RegionChoice chooseRegionMemory(const RegionFacts& facts);

/// The ranks on `node`, ascending.
std::vector<uint32_t> ranksOnNode(const ExchangeOp& op, uint32_t node);
/// gemm-rs / gemm-ar: the rows a node's ranks own, (first row, rows) in rank order, empty runs dropped (gemm-ar: all
/// rows, one run). The receiver's inbox holds them packed in this order.
std::vector<std::pair<uint64_t, uint64_t>> ownedRows(const ExchangeOp& op, uint32_t node);
/// The contiguous row runs [first, first + rows) that `ranks` (ascending) own of m rows split over n ranks
/// (rows_of), adjacent ranks' rows merged.
std::vector<std::pair<uint64_t, uint64_t>> rowRunsOf(uint64_t m, uint32_t n, const std::vector<uint32_t>& ranks);

}  // namespace tandem::daemon::cuda
