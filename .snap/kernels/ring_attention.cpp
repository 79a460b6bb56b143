// Ring attention from an op descriptor to a stream (ring_attention.hpp says what each step is for). Host C++.
#include "tandem/kernels/ring_attention.hpp"

#include <cuda.h>

#include <iterator>

#include "tandem/common/error.hpp"
#include "tandem/kernels/attention.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/driver.hpp"

namespace tandem::kernels {
namespace ring_detail {
// Called from ring_attention.cu (fmt, which error.hpp uses, does not compile under nvcc).
[[noreturn]] void failCuda(const std::string& what) { throw Error(ErrorCode::kCuda, "ring attention: " + what); }
}  // namespace ring_detail

namespace {

constexpr uint64_t kRowAlign = 256;  // the V half of the data region starts on a TMA-friendly boundary

// Bytes of one row of k or v: kv_heads heads (grouped-query attention moves only the KV heads around the ring).
uint64_t rowBytes(const OpDescriptor& d) { return d.dims[dim::kKvHeads] * d.dims[dim::kHeadDim] * 2; }

// Rows of KV one rank's half of the data region holds: k in the first half, v in the second, the same on every rank
// (the layout depends only on the workspace and the global kv_heads and head_dim, so peers agree on it).
uint64_t kvCapacityRows(const OpDescriptor& d, const FusedEnv& env) {
  const uint64_t half = env.layout.dataBytes / 2 / kRowAlign * kRowAlign;
  const uint64_t rows = half / rowBytes(d);
  return rows < (uint64_t{1} << 31) ? rows : (uint64_t{1} << 31) - 1;
}
uint64_t kvHalfBytes(const FusedEnv& env) { return env.layout.dataBytes / 2 / kRowAlign * kRowAlign; }

RingAttentionFlags* flagsOf(const FusedEnv& env, uint32_t r) {
  return reinterpret_cast<RingAttentionFlags*>(env.workspaces[r] + kRingFlagsOffset);
}

// Global position of chunk c's first row: only the order of positions matters (causal masking), so each chunk gets
// 2^32 positions of its own and no rank needs the others' lengths.
int64_t chunkStart(uint32_t c) { return static_cast<int64_t>(c) << 32; }

void writeWord32(cudaStream_t s, const uint64_t* word, uint64_t value, const char* what) {
  // Default flags: the write follows a fence over the stream's earlier work (as __threadfence_system), so a peer that
  // sees it sees what the stream wrote before (the KV copy, the length).
  checkCuda(driver().streamWriteValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(word),
                                        static_cast<cuuint32_t>(value), CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32({})", what);
}

AttentionDtype attentionDtype(DType t) { return t == DType::kF16 ? AttentionDtype::kFp16 : AttentionDtype::kBf16; }

}  // namespace

void checkRingAttention(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env) {
  const std::string_view op = opKindName(d.kind);
  if (d.kind != OpKind::kRingAttention) fail(ErrorCode::kInternal, "{} is not ring attention", op);
  if (d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    fail(ErrorCode::kUnsupported, "{}: the cuda backend's attention kernel takes bf16 or fp16, not {}; convert q, k "
         "and v, or run it on a tandemd with daemon.backend: cpu", op, dtypeName(d.dtype));
  }
  const uint64_t hd = d.dims[dim::kHeadDim], heads = d.dims[dim::kHeads], seq = d.dims[dim::kSeq];
  if (hd != 64 && hd != 128) {
    fail(ErrorCode::kUnsupported, "{}: head_dim {} is not 64 or 128, the head sizes the cuda backend's attention "
         "kernel is built for; pad the head dimension with zeros to 64 or 128 (and pass the scale for the real one)",
         op, hd);
  }
  if (heads > (1u << 20)) fail(ErrorCode::kInvalidArgument, "{}: heads {} is over 2^20 on the cuda backend", op, heads);
  if (seq >= (uint64_t{1} << 31)) {
    fail(ErrorCode::kInvalidArgument, "{}: seq {} on one rank is over 2^31 - 1 on the cuda backend", op, seq);
  }
  static constexpr const char* kSlotNames[] = {"q", "k", "v", "out"};
  for (std::size_t s = 0; s < std::size(kSlotNames); ++s) {
    if (ptrs[s] != nullptr && reinterpret_cast<uintptr_t>(ptrs[s]) % 16 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: tensor {} starts at {}, which is not 16-byte aligned; the cuda backend "
           "moves whole 16-byte rows (tensor memory accelerator): use an offset that is a multiple of 16", op,
           kSlotNames[s], ptrs[s]);
    }
  }
  if (env.nranks > kMaxLocalRanks || env.nranks > static_cast<uint32_t>(kMaxAttentionKvSegments)) {
    fail(ErrorCode::kUnsupported, "{}: {} ranks; the cuda backend runs ring attention on at most {} ranks of a node",
         op, env.nranks, kMaxAttentionKvSegments);
  }
  if (env.nranks > 1 && seq > kvCapacityRows(d, env)) {
    // The data region is two matrices of rsMatBytes: k fills (most of) the first, v the second.
    const uint64_t bytes = WorkspaceLayout::bytesFor(seq * rowBytes(d) + kRowAlign, env.nranks);
    fail(ErrorCode::kInvalidArgument, "{}: seq {} x kv_heads {} x head_dim {} on this rank needs {} bytes of k and v "
         "in the workspace, but this communicator's workspace holds {} rows; {}, or split the sequence over more ranks",
         op, seq, d.dims[dim::kKvHeads], hd, 2 * seq * rowBytes(d), kvCapacityRows(d, env), workspaceRemedy(bytes));
  }
}

std::string launchRingAttention(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch,
                                const FusedEnv& env, cudaStream_t stream) {
  const uint32_t n = env.nranks, me = env.rank;
  const bool zigzag = (d.flags & kFlagZigzag) != 0;
  const uint64_t seq = d.dims[dim::kSeq];
  const uint64_t value = epoch & 0xffffffffu;  // the stream writes 32 bits
  AttentionParams p{};
  p.q = ptrs[slot::kQ];
  p.out = ptrs[slot::kAttnOut];
  p.lse = static_cast<float*>(ptrs[slot::kAttnLse]);
  p.sq = static_cast<int64_t>(seq);
  p.heads = static_cast<int32_t>(d.dims[dim::kHeads]);
  p.kvHeads = static_cast<int32_t>(d.dims[dim::kKvHeads]);
  p.headDim = static_cast<int32_t>(d.dims[dim::kHeadDim]);
  p.dtype = attentionDtype(d.dtype);
  p.causal = (d.flags & kFlagCausal) != 0;
  p.scale = d.scale;
  const int64_t first = static_cast<int64_t>(seq - seq / 2);  // zigzag: rows in chunk `me`, the rest in 2n-1-me
  p.qStart = chunkStart(me);
  if (zigzag) {
    p.qSplit = first;
    p.qStart2 = chunkStart(2 * n - 1 - me);
  }
  AttentionKvSegment& local = p.kv[0];
  local.k = ptrs[slot::kKey];
  local.v = ptrs[slot::kValue];
  local.length = static_cast<int64_t>(seq);
  local.start = p.qStart;
  local.split = zigzag ? first : 0;
  local.start2 = p.qStart2;
  p.numKv = 1;
  std::string plan = fmt::format("attention core ({}), ", attentionConfigName(p));
  if (n == 1) {
    launchAttention(p, stream);
    return plan + "one rank";
  }

  // 1-2: what peers read of this rank. Device-epoch mode: a kernel writes the words with the op entry's epoch (a
  // graph would replay a stream memory operation's value as captured).
  RingAttentionFlags* mine = flagsOf(env, me);
  const uint64_t kvBytes = seq * rowBytes(d);
  char* const data = env.workspaces[me] + env.layout.dataOff;
  const bool deviceEpoch = env.epochWord != nullptr;
  if (deviceEpoch) {
    launchRingPublish(RingPublishParams{mine, env.epochWord, seq, 0}, stream);
  } else {
    writeWord32(stream, &mine->kvLength, seq, "ring attention kvLength");
    writeWord32(stream, &mine->started, value, "ring attention started");
  }
  if (kvBytes > 0) {
    checkCuda(cudaMemcpyAsync(data, local.k, kvBytes, cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync(k into the workspace)");
    checkCuda(cudaMemcpyAsync(data + kvHalfBytes(env), local.v, kvBytes, cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync(v into the workspace)");
  }
  if (deviceEpoch) {
    launchRingPublish(RingPublishParams{mine, env.epochWord, seq, 1}, stream);
  } else {
    writeWord32(stream, &mine->kvReady, value, "ring attention kvReady");
  }

  // 3: the core over the local KV, then every peer's, nearest lower rank first (contiguous causal: the ones this
  // rank's rows see in full).
  const auto capacity = static_cast<int64_t>(kvCapacityRows(d, env));
  for (uint32_t i = 1; i < n; ++i) {
    const uint32_t q = (me + n - i) % n;
    RingAttentionFlags* theirs = flagsOf(env, q);
    char* const peerData = env.workspaces[q] + env.layout.dataOff;
    AttentionKvSegment& s = p.kv[p.numKv++];
    s.k = peerData;
    s.v = peerData + kvHalfBytes(env);
    s.length = capacity;  // the maps cover the capacity; the kernel reads the peer's length
    s.start = chunkStart(q);
    s.start2 = chunkStart(2 * n - 1 - q);
    s.splitHalves = zigzag;
    s.arrival = &theirs->kvReady;
    s.arrivalValue = value;
    s.lengthWord = &theirs->kvLength;
    s.lengthReady = &theirs->started;
    s.lengthReadyValue = value;
  }
  p.rotateFrom = 1;  // the peers: CTAs start on different ones, so every peer is read at once
  p.abortWord = &env.ctl->abort;
  p.errorSlot = &env.ctl->error;
  p.timeoutNs = env.timeoutNs;
  p.waitOp = static_cast<uint32_t>(d.kind);
  p.waitRank = me;
  p.epochWord = env.epochWord;  // device-epoch mode: the waits' values are the op entry's epoch
  launchAttention(p, stream);  // nothing when seq is 0: this rank's peers still read its (empty) KV words

  // 4: the end-of-op handshake.
  RingFinishParams f{};
  for (uint32_t q = 0; q < n; ++q) {
    if (q == me) continue;
    f.peerDone[q] = &flagsOf(env, q)->done[me];
    f.myDone[q] = &mine->done[q];
  }
  f.abortWord = &env.ctl->abort;
  f.errorSlot = &env.ctl->error;
  f.value = value;
  f.epochWord = env.epochWord;
  f.timeoutNs = env.timeoutNs;
  f.rank = me;
  f.nranks = n;
  f.op = static_cast<uint32_t>(d.kind);
  launchRingFinish(f, stream);
  return plan + fmt::format("{} ranks{}, KV read from the peers' workspaces", n, zigzag ? ", zigzag" : "");
}

std::string launchRingAttentionMapped(std::span<const OpDescriptor> descs, std::span<const DevicePointers> ptrs,
                                      uint32_t rank, cudaStream_t stream) {
  const auto n = static_cast<uint32_t>(descs.size());
  const OpDescriptor& d = descs[rank];
  const bool zigzag = (d.flags & kFlagZigzag) != 0;
  AttentionParams p{};
  const uint64_t seq = d.dims[dim::kSeq];
  p.q = ptrs[rank][slot::kQ];
  p.out = ptrs[rank][slot::kAttnOut];
  p.lse = static_cast<float*>(ptrs[rank][slot::kAttnLse]);
  p.sq = static_cast<int64_t>(seq);
  p.heads = static_cast<int32_t>(d.dims[dim::kHeads]);
  p.kvHeads = static_cast<int32_t>(d.dims[dim::kKvHeads]);
  p.headDim = static_cast<int32_t>(d.dims[dim::kHeadDim]);
  p.dtype = attentionDtype(d.dtype);
  p.causal = (d.flags & kFlagCausal) != 0;
  p.scale = d.scale;
  p.qStart = chunkStart(rank);
  if (zigzag) {
    p.qSplit = static_cast<int64_t>(seq - seq / 2);
    p.qStart2 = chunkStart(2 * n - 1 - rank);
  }
  for (uint32_t i = 0; i < n; ++i) {  // this rank's KV first, then rank - 1, rank - 2, ...
    const uint32_t q = (rank + n - i) % n;
    const uint64_t len = descs[q].dims[dim::kSeq];
    AttentionKvSegment& s = p.kv[p.numKv++];
    s.k = ptrs[q][slot::kKey];
    s.v = ptrs[q][slot::kValue];
    s.length = static_cast<int64_t>(len);
    s.start = chunkStart(q);
    s.split = zigzag ? static_cast<int64_t>(len - len / 2) : 0;
    s.start2 = chunkStart(2 * n - 1 - q);
  }
  p.rotateFrom = 1;  // the peers: CTAs start on different ones, so every peer is read at once
  launchAttention(p, stream);
  return fmt::format("attention core ({}), {} ranks{}, KV read where tandemd maps it", attentionConfigName(p), n,
                     zigzag ? ", zigzag" : "");
}

void preloadRingAttentionKernels(int device) {
  preloadAttentionKernels(device);
  preloadRingFinishKernel(device);
}

}  // namespace tandem::kernels
