// Ring attention's backward from the op descriptors to a stream (ring_attention_bwd.hpp says what each step is for).
// Host C++.
#include "tandem/kernels/ring_attention_bwd.hpp"

#include <algorithm>
#include <iterator>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/kernels/attention_bwd.hpp"
#include "tandem/kernels/cuda_raii.hpp"

namespace tandem::kernels {
namespace ring_bwd_detail {
// Called from ring_attention_bwd.cu (fmt, which error.hpp uses, does not compile under nvcc).
[[noreturn]] void failCuda(const std::string& what) {
  throw Error(ErrorCode::kCuda, "ring attention backward: " + what);
}
}  // namespace ring_bwd_detail

namespace {

constexpr uint64_t kScratchAlign = 256;

// The forward's positions (ring_attention.cpp): chunk c's rows start at c << 32, so only chunk order matters.
int64_t chunkStart(uint32_t c) { return static_cast<int64_t>(c) << 32; }

// One run of a rank's rows: rows [row0, row0 + rows) of its tensors, at global positions start, start + 1, ...
struct Run {
  uint32_t rank;
  int64_t row0, rows, start;
};

// Rank q's non-empty runs, in row order: one (contiguous) or two (zigzag: ceil(seq/2) rows at chunk q, the rest at
// chunk 2n-1-q), as the forward places them.
std::vector<Run> runsOf(std::span<const OpDescriptor> descs, uint32_t q) {
  const auto n = static_cast<uint32_t>(descs.size());
  const auto seq = static_cast<int64_t>(descs[q].dims[dim::kSeq]);
  std::vector<Run> runs;
  if ((descs[q].flags & kFlagZigzag) == 0) {
    runs.push_back({q, 0, seq, chunkStart(q)});
  } else {
    const int64_t first = seq - seq / 2;
    runs.push_back({q, 0, first, chunkStart(q)});
    runs.push_back({q, first, seq - first, chunkStart(2 * n - 1 - q)});
  }
  std::erase_if(runs, [](const Run& r) { return r.rows == 0; });
  return runs;
}

// A pair contributes unless causal masking hides every key of the KV run from every row of the q run.
bool contributes(const Run& qRun, const Run& kvRun, bool causal) {
  return !causal || kvRun.start <= qRun.start + qRun.rows - 1;
}

AttentionDtype attentionDtype(DType t) { return t == DType::kF16 ? AttentionDtype::kFp16 : AttentionDtype::kBf16; }

uint64_t alignUp(uint64_t x) { return (x + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Frees the launch's scratch in stream order, also when a launch in between threw: work already enqueued still runs
// before the free.
struct StreamScratch {
  void* mem = nullptr;
  cudaStream_t stream = nullptr;
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  StreamScratch(uint64_t bytes, cudaStream_t s) : stream(s) {
    checkCuda(cudaMallocAsync(&mem, std::max<uint64_t>(bytes, 16), s),
              "cudaMallocAsync({} bytes of ring attention backward scratch)", bytes);
  }
  ~StreamScratch() { reportRelease(cudaFreeAsync(mem, stream), "cudaFreeAsync(ring attention backward scratch)"); }
  char* at(uint64_t off) const { return static_cast<char*>(mem) + off; }
};

}  // namespace

void checkRingAttentionBackward(const OpDescriptor& d, const DevicePointers& ptrs, const FusedEnv& env) {
  const std::string_view op = opKindName(d.kind);
  if (d.kind != OpKind::kRingAttentionBackward) fail(ErrorCode::kInternal, "{} is not ring attention's backward", op);
  if (d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    fail(ErrorCode::kUnsupported, "{}: the cuda backend's attention backward takes bf16 or fp16, not {}; convert the "
         "tensors, or run it on a tandemd with daemon.backend: cpu", op, dtypeName(d.dtype));
  }
  const uint64_t hd = d.dims[dim::kHeadDim], heads = d.dims[dim::kHeads], seq = d.dims[dim::kSeq];
  if (hd != 64 && hd != 128) {
    fail(ErrorCode::kUnsupported, "{}: head_dim {} is not 64 or 128, the head sizes the cuda backend's attention "
         "backward is built for; pad the head dimension with zeros to 64 or 128 (and pass the scale for the real one)",
         op, hd);
  }
  if (heads > (1u << 20)) fail(ErrorCode::kInvalidArgument, "{}: heads {} is over 2^20 on the cuda backend", op, heads);
  if (seq >= (uint64_t{1} << 31)) {
    fail(ErrorCode::kInvalidArgument, "{}: seq {} on one rank is over 2^31 - 1 on the cuda backend", op, seq);
  }
  static constexpr const char* kSlotNames[] = {"q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv"};
  for (std::size_t s = 0; s < std::size(kSlotNames); ++s) {
    if (ptrs[s] != nullptr && reinterpret_cast<uintptr_t>(ptrs[s]) % 16 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: tensor {} starts at {}, which is not 16-byte aligned; the cuda backend's "
           "attention backward loads 16-byte rows: use an offset that is a multiple of 16", op, kSlotNames[s],
           ptrs[s]);
    }
  }
  if (env.nranks > kMaxLocalRanks) {
    fail(ErrorCode::kUnsupported, "{}: {} ranks; the cuda backend runs ring attention on at most {} ranks of a node",
         op, env.nranks, kMaxLocalRanks);
  }
}

namespace {

// Rank `rank`'s gradients from every rank's inputs (descs[q], ptrs[q]: rank q's seq and slots, as the launching
// process reaches them), both executors: the pairs, their order and the sums are the one definition of the op's
// result. Returns the number of core calls.
std::size_t enqueuePairs(std::span<const OpDescriptor> descs, std::span<const DevicePointers> ptrs, uint32_t rank,
                         cudaStream_t stream) {
  const auto n = static_cast<uint32_t>(descs.size());
  const OpDescriptor& d = descs[rank];
  const bool causal = (d.flags & kFlagCausal) != 0;
  const auto heads = static_cast<int64_t>(d.dims[dim::kHeads]);
  const auto hd = static_cast<int64_t>(d.dims[dim::kHeadDim]);
  const auto kvHeads = d.dims[dim::kKvHeads] == 0 ? heads : static_cast<int64_t>(d.dims[dim::kKvHeads]);
  const auto seq = static_cast<int64_t>(d.dims[dim::kSeq]);
  if (seq == 0) return 0;  // no rows: no gradients to write (the peers read this rank's empty inputs: nothing)

  std::vector<std::vector<Run>> runs(n);
  int64_t maxRun = 0;
  for (uint32_t q = 0; q < n; ++q) {
    runs[q] = runsOf(descs, q);
    for (const Run& r : runs[q]) maxRun = std::max(maxRun, r.rows);
  }

  // One core call per pair; `pairs` in the order the sums take them: for each other rank o = 0..n-1, r's q runs
  // against o's KV runs (dq; dk/dv too where o == r), then o's q runs against r's KV runs (dk/dv, o != r).
  struct Pair {
    const Run* q;
    const Run* kv;
    bool dq, dkv;
  };
  std::vector<Pair> pairs;
  for (uint32_t o = 0; o < n; ++o) {
    for (const Run& kv : runs[o])
      for (const Run& qr : runs[rank])
        if (contributes(qr, kv, causal)) pairs.push_back({&qr, &kv, true, o == rank});
    if (o == rank) continue;
    for (const Run& qr : runs[o])
      for (const Run& kv : runs[rank])
        if (contributes(qr, kv, causal)) pairs.push_back({&qr, &kv, false, true});
  }

  const auto qRowBytes = static_cast<uint64_t>(heads * hd * 2), kvRowBytes = static_cast<uint64_t>(kvHeads * hd * 2);
  const auto paramsOf = [&](const Pair& p) {
    const DevicePointers& qp = ptrs[p.q->rank];
    const DevicePointers& kp = ptrs[p.kv->rank];
    const uint64_t qOff = static_cast<uint64_t>(p.q->row0) * qRowBytes;
    const uint64_t kOff = static_cast<uint64_t>(p.kv->row0) * kvRowBytes;
    AttentionBwdParams c{};
    c.q = static_cast<const char*>(qp[slot::kQ]) + qOff;
    c.o = static_cast<const char*>(qp[slot::kAttnOut]) + qOff;
    c.dout = static_cast<const char*>(qp[slot::kDout]) + qOff;
    c.k = static_cast<const char*>(kp[slot::kKey]) + kOff;
    c.v = static_cast<const char*>(kp[slot::kValue]) + kOff;
    c.sq = p.q->rows;
    c.sk = p.kv->rows;
    c.heads = static_cast<int32_t>(heads);
    c.kvHeads = static_cast<int32_t>(kvHeads);
    c.headDim = static_cast<int32_t>(hd);
    c.dtype = attentionDtype(d.dtype);
    c.causal = causal;
    c.dqMode = AttentionBwdDq::kDeterministic;  // bitwise repeatable
    c.scale = d.scale;
    c.qStart = p.q->start;
    c.kStart = p.kv->start;
    return c;
  };
  uint64_t coreBytes = 0;
  for (const Pair& p : pairs) coreBytes = std::max<uint64_t>(coreBytes, attentionBwdWorkspaceBytes(paramsOf(p)));

  // Scratch: fp32 sums of this rank's gradients, one pair's partials, a run's lse as [heads, run rows], the core's.
  const uint64_t qElems = static_cast<uint64_t>(seq * heads * hd), kvElems = static_cast<uint64_t>(seq * kvHeads * hd);
  uint64_t off = 0;
  const auto take = [&off](uint64_t bytes) { const uint64_t at = off; off += alignUp(bytes); return at; };
  const uint64_t accDqOff = take(qElems * 4), accDkOff = take(kvElems * 4), accDvOff = take(kvElems * 4);
  const uint64_t partDqOff = take(static_cast<uint64_t>(maxRun) * qRowBytes);
  const uint64_t partDkOff = take(static_cast<uint64_t>(maxRun) * kvRowBytes);
  const uint64_t partDvOff = take(static_cast<uint64_t>(maxRun) * kvRowBytes);
  const uint64_t lseOff = take(static_cast<uint64_t>(maxRun * heads) * 4);
  const uint64_t coreOff = take(coreBytes);
  StreamScratch scratch(off, stream);
  auto* const accDq = reinterpret_cast<float*>(scratch.at(accDqOff));
  auto* const accDk = reinterpret_cast<float*>(scratch.at(accDkOff));
  auto* const accDv = reinterpret_cast<float*>(scratch.at(accDvOff));
  checkCuda(cudaMemsetAsync(scratch.mem, 0, partDqOff, stream), "cudaMemsetAsync(ring attention backward sums)");

  const bool bf16 = d.dtype != DType::kF16;
  const auto accumulate = [&](float* acc, int64_t row0, int64_t rows, uint64_t rowElems, uint64_t partOff) {
    launchGradAccumulate({acc + static_cast<uint64_t>(row0) * rowElems, scratch.at(partOff), nullptr,
                          static_cast<int64_t>(static_cast<uint64_t>(rows) * rowElems), bf16},
                         stream);
  };
  for (const Pair& p : pairs) {
    AttentionBwdParams c = paramsOf(p);
    // lse is [heads, seq] per rank: a run that is not the whole rank is repacked into [heads, run rows].
    const auto* lse = static_cast<const float*>(ptrs[p.q->rank][slot::kBwdLse]);
    const auto qSeq = static_cast<int64_t>(descs[p.q->rank].dims[dim::kSeq]);
    if (p.q->rows == qSeq) {
      c.lse = lse;
    } else {
      auto* packed = reinterpret_cast<float*>(scratch.at(lseOff));
      checkCuda(cudaMemcpy2DAsync(packed, static_cast<size_t>(p.q->rows) * 4, lse + p.q->row0,
                                  static_cast<size_t>(qSeq) * 4, static_cast<size_t>(p.q->rows) * 4,
                                  static_cast<size_t>(heads), cudaMemcpyDefault, stream),
                "cudaMemcpy2DAsync(lse of rank {}, rows {}..{})", p.q->rank, p.q->row0, p.q->row0 + p.q->rows);
      c.lse = packed;
    }
    c.dq = scratch.at(partDqOff);
    c.dk = scratch.at(partDkOff);
    c.dv = scratch.at(partDvOff);
    c.workspace = scratch.at(coreOff);
    c.workspaceBytes = coreBytes;
    launchAttentionBwd(c, stream);
    if (p.dq) accumulate(accDq, p.q->row0, p.q->rows, static_cast<uint64_t>(heads * hd), partDqOff);
    if (p.dkv) {
      accumulate(accDk, p.kv->row0, p.kv->rows, static_cast<uint64_t>(kvHeads * hd), partDkOff);
      accumulate(accDv, p.kv->row0, p.kv->rows, static_cast<uint64_t>(kvHeads * hd), partDvOff);
    }
  }
  const DevicePointers& mine = ptrs[rank];
  launchGradRound({accDq, nullptr, mine[slot::kDq], static_cast<int64_t>(qElems), bf16}, stream);
  launchGradRound({accDk, nullptr, mine[slot::kDk], static_cast<int64_t>(kvElems), bf16}, stream);
  launchGradRound({accDv, nullptr, mine[slot::kDv], static_cast<int64_t>(kvElems), bf16}, stream);
  return pairs.size();
}

RingBackwardFlags* bwdFlagsOf(const FusedEnv& env, uint32_t r) {
  return reinterpret_cast<RingBackwardFlags*>(env.workspaces[r] + kRingBwdFlagsOffset);
}
RingAttentionFlags* fwdFlagsOf(const FusedEnv& env, uint32_t r) {
  return reinterpret_cast<RingAttentionFlags*>(env.workspaces[r] + kRingFlagsOffset);
}

// A barrier over the ranks on per-peer words (the forward's finish kernel): peer q's word for this rank is
// theirs(q), this rank's word for q is mine(q).
template <class Theirs, class Mine>
void launchBarrier(const OpDescriptor& d, const FusedEnv& env, uint64_t value, cudaStream_t stream, Theirs theirs,
                   Mine mine) {
  RingFinishParams f{};
  for (uint32_t q = 0; q < env.nranks; ++q) {
    if (q == env.rank) continue;
    f.peerDone[q] = theirs(q);
    f.myDone[q] = mine(q);
  }
  f.abortWord = &env.ctl->abort;
  f.errorSlot = &env.ctl->error;
  f.value = value;
  f.epochWord = env.epochWord;  // device-epoch mode: the op entry's epoch
  f.timeoutNs = env.timeoutNs;
  f.rank = env.rank;
  f.nranks = env.nranks;
  f.op = static_cast<uint32_t>(d.kind);
  launchRingFinish(f, stream);
}

}  // namespace

void checkRingAttentionBackwardStaging(const OpDescriptor& d, const DevicePointers& /*ptrs*/, const FusedEnv& env) {
  if (env.nranks <= 1) return;  // one rank reads its own tensors: nothing is staged
  const uint64_t seq = d.dims[dim::kSeq];
  const RingBackwardStaging s = ringBackwardStaging(d, seq);
  if (s.bytes <= env.layout.dataBytes) return;
  fail(ErrorCode::kInvalidArgument, "{}: seq {} on this rank needs {} bytes of q, k, v, o, dout and lse in the "
       "workspace (with the client executor the peers read them there), but this communicator's workspace holds {}; "
       "{}, or split the sequence over more ranks", opKindName(d.kind), seq, s.bytes, env.layout.dataBytes,
       workspaceRemedy(WorkspaceLayout::bytesFor((s.bytes + 1) / 2, env.nranks)));
}

std::string launchRingAttentionBackward(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t epoch,
                                        const FusedEnv& env, std::span<const uint64_t> rankRows, cudaStream_t stream) {
  const uint32_t n = env.nranks, me = env.rank;
  const bool zigzag = (d.flags & kFlagZigzag) != 0;
  if (n == 1) {
    const std::size_t pairs = enqueuePairs({&d, 1}, {&ptrs, 1}, 0, stream);
    return fmt::format("attention backward core per chunk pair, one rank, {} chunk pairs", pairs);
  }
  if (rankRows.size() < n || rankRows[me] != d.dims[dim::kSeq]) {
    fail(ErrorCode::kInternal, "{}: the rows tandemd published do not match this rank's seq {}", opKindName(d.kind),
         d.dims[dim::kSeq]);
  }
  const uint64_t value = epoch & 0xffffffffu;  // as the forward's words (its stream writes 32 bits)

  // Every rank's seq and inputs as this rank reaches them: its own tensors, the peers' staged copies.
  std::vector<OpDescriptor> descs(n, d);
  std::vector<DevicePointers> all(n);
  for (uint32_t q = 0; q < n; ++q) {
    descs[q].dims[dim::kSeq] = rankRows[q];
    descs[q].rank = q;
    if (q == me) {
      all[q] = ptrs;
      continue;
    }
    char* const base = env.workspaces[q] + env.layout.dataOff;
    const RingBackwardStaging s = ringBackwardStaging(d, rankRows[q]);
    all[q][slot::kQ] = base + s.q;
    all[q][slot::kKey] = base + s.k;
    all[q][slot::kValue] = base + s.v;
    all[q][slot::kAttnOut] = base + s.o;
    all[q][slot::kDout] = base + s.dout;
    all[q][slot::kBwdLse] = base + s.lse;
  }

  // 1: this rank's inputs into its workspace, where the peers read them.
  const RingBackwardStaging s = ringBackwardStaging(d, d.dims[dim::kSeq]);
  const uint64_t heads = d.dims[dim::kHeads], hd = d.dims[dim::kHeadDim], seq = d.dims[dim::kSeq];
  const uint64_t kvHeads = d.dims[dim::kKvHeads] == 0 ? heads : d.dims[dim::kKvHeads];
  const uint64_t qBytes = seq * heads * hd * 2, kvBytes = seq * kvHeads * hd * 2, lseBytes = heads * seq * 4;
  char* const mine = env.workspaces[me] + env.layout.dataOff;
  const struct {
    int slot;
    uint64_t off, bytes;
    const char* name;
  } copies[] = {{slot::kQ, s.q, qBytes, "q"},        {slot::kKey, s.k, kvBytes, "k"},
                {slot::kValue, s.v, kvBytes, "v"},   {slot::kAttnOut, s.o, qBytes, "o"},
                {slot::kDout, s.dout, qBytes, "dout"}, {slot::kBwdLse, s.lse, lseBytes, "lse"}};
  for (const auto& c : copies) {
    if (c.bytes == 0) continue;
    checkCuda(cudaMemcpyAsync(mine + c.off, ptrs[static_cast<std::size_t>(c.slot)], c.bytes, cudaMemcpyDeviceToDevice,
                              stream),
              "cudaMemcpyAsync({} into the workspace)", c.name);
  }
  // 2: every rank's inputs are staged.
  launchBarrier(d, env, value, stream, [&](uint32_t q) { return &bwdFlagsOf(env, q)->staged[me]; },
                [&](uint32_t q) { return &bwdFlagsOf(env, me)->staged[q]; });
  // 3: the daemon executor's core calls and sums.
  const std::size_t pairs = enqueuePairs(descs, all, me, stream);
  // 4: no peer reads this rank's workspace once the op completes.
  launchBarrier(d, env, value, stream, [&](uint32_t q) { return &fwdFlagsOf(env, q)->done[me]; },
                [&](uint32_t q) { return &fwdFlagsOf(env, me)->done[q]; });
  return fmt::format("attention backward core per chunk pair, {} ranks{}, inputs staged in the workspaces, fp32 sums "
                     "in rank order, {} chunk pairs", n, zigzag ? ", zigzag" : "", pairs);
}

std::string launchRingAttentionBackwardMapped(std::span<const OpDescriptor> descs,
                                              std::span<const DevicePointers> ptrs, uint32_t rank,
                                              cudaStream_t stream) {
  const bool zigzag = (descs[rank].flags & kFlagZigzag) != 0;
  const std::size_t pairs = enqueuePairs(descs, ptrs, rank, stream);
  return fmt::format("attention backward core per chunk pair, {} ranks{}, inputs read where tandemd maps them, fp32 "
                     "sums in rank order, {} chunk pairs", descs.size(), zigzag ? ", zigzag" : "", pairs);
}

void preloadRingAttentionBackwardKernels(int device) {
  preloadAttentionBwdKernels(device);
  preloadGradSumKernels(device);
}

}  // namespace tandem::kernels
