// CUDA graphs on multi-rank communicators (client executor, device-resident epochs: kernels/include/tandem/kernels/
// op_entry.hpp). Real rank processes through tandemd, 2 and 4 ranks sharing the GPUs (rankDevice): every op that
// replays (allgather on its LL and chunked paths, ag-gemm, gemm-rs and gemm-ar on their small-M and fused plans, ring
// attention contiguous and zigzag and its backward, the MoE ops and the FFN's backward, the barrier) is captured into
// a graph of its own and replayed TANDEM_TEST_REPLAYS times (1000) with new inputs written between replays, every
// replay bitwise equal to the eager op on the same inputs (the eager result checked against the fp64 reference); eager
// ops run between replays and the graphs of one communicator replay in turns. Each replay is checked on the device
// behind it (graph_replay_compare.cu: its outputs against a device copy of the eager run's), and a rank synchronises
// to read what the checks found only every kCheckEvery replays, so the replays run back to back; a MESSAGE per rank
// gives the time of its replay loop. Then the failures: a rank SIGKILLed mid-replay releases its peer with PEER_LOST
// (not the deadline), ranks replaying different graphs fail with an error instead of meeting on each other's flags,
// and tandemd serves the next communicator; an MoE replay with a bad expert id writes nothing, its error comes with
// the next eager op's wait, and the next ops work.
//
// TANDEM_TEST_CORRUPT_REPLAY=N (N below TANDEM_TEST_REPLAYS) shows that the replay check fails: replay N of every op
// on every rank gets one output bit flipped after the replay, before its check, and the replay cases must fail with
// "FAIL <op>: replay N (inputs N%3) differs from the eager run (1 replays differ; first byte ...)". Set it only for
// those cases (-tc='*every replayable op*'): the failure cases' next communicator replays too.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "graph_replay_compare.hpp"
#include "rank_buffers.hpp"
#include "submit_op.hpp"
#include "tandem/kernels/driver.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

struct GraphCase {
  OpKind kind;
  uint64_t m = 0, n = 0, k = 0;  // the GEMMs (gemm-rs/ar: K over all ranks); MoE: tokens per rank, n_out or ffn, hidden
  uint64_t bytes = 0;            // allgather: per rank
  uint64_t seq = 0;              // ring attention: over all ranks (4 heads, 2 KV heads, head_dim 128, causal)
  bool zigzag = false;
  tandem::DType dtype = DType::kBF16;  // the GEMM ops: FP8 inputs (block scales or one per tensor, bf16 c)
  bool blockScale = false;
  tandem::DType weightDtype = DType::kInvalid;  // the MoE forward ops: FP8 expert weights
};

// The GEMM and MoE ops' FP8 variants, on the FP8 core and the FP8 grouped GEMM.
GraphCase fp8Case(OpKind kind, uint64_t m, uint64_t n, uint64_t k, bool block) {
  GraphCase c{kind, m, n, k};
  if (kind == OpKind::kMoeDispatchGemm || kind == OpKind::kMoeDispatchFfnCombine) {
    c.weightDtype = DType::kF8E4M3;
  } else {
    c.dtype = DType::kF8E4M3;
    c.blockScale = block;
  }
  return c;
}

bool isMoe(OpKind kind) {
  return kind == OpKind::kMoeDispatchGemm || kind == OpKind::kMoeDispatchFfnCombine || kind == OpKind::kMoeFfnBackward;
}

std::string describeShape(const GraphCase& c) {
  if (c.kind == OpKind::kAllGather) return fmt::format("allgather {} bytes", c.bytes);
  if (c.kind == OpKind::kNop) return "barrier";
  if (c.kind == OpKind::kRingAttention || c.kind == OpKind::kRingAttentionBackward) {
    return fmt::format("{} seq={}{}", tandem::opKindName(c.kind), c.seq, c.zigzag ? " zigzag" : "");
  }
  if (isMoe(c.kind)) {
    return fmt::format("{} tokens={} hidden={} {}={} experts=8 topk=2", tandem::opKindName(c.kind), c.m, c.k,
                       c.kind == OpKind::kMoeDispatchGemm ? "n_out" : "ffn", c.n);
  }
  return fmt::format("{} m={} n={} k={}", tandem::opKindName(c.kind), c.m, c.n, c.k);
}

std::string describe(const GraphCase& c) {
  if (tandem::isFp8(c.weightDtype)) return describeShape(c) + " fp8 weights";
  if (!tandem::isFp8(c.dtype)) return describeShape(c);
  return fmt::format("{} fp8 {}", describeShape(c), c.blockScale ? "block scales" : "per tensor");
}

std::vector<OpDescriptor> descriptorsOf(const GraphCase& c, uint32_t n) {
  ref::OpShape shape;
  shape.kind = c.kind;
  shape.dtype = c.dtype;
  shape.blockScale = c.blockScale;
  shape.weightDtype = c.weightDtype;
  shape.m = c.m;
  shape.n = c.n;
  shape.k = c.k;
  shape.bytes = c.bytes;
  if (c.kind == OpKind::kRingAttention || c.kind == OpKind::kRingAttentionBackward) {
    shape.seq = c.seq;
    shape.heads = 4;
    shape.kvHeads = 2;
    shape.headDim = 128;
    shape.causal = true;
    shape.zigzag = c.zigzag;
  }
  shape.experts = 8;  // MoE: 8 experts, top 2; capacity the worst case (makeDescriptor)
  shape.topk = 2;
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(ref::makeDescriptor(shape, q, n));
  return v;
}

tandem_status_t submit(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  return submitOp(b.desc(), [&b](int s) { return b.tensor(s); }, comm, stream, op);
}

// Every op that replays, on each of its paths: LL and chunked allgather; small M (the layouts core, then the
// collective) and the fused kernels for each GEMM; ring attention contiguous and zigzag (its KV published by a kernel
// with the device epoch); ring attention's backward (every rank's seq from the eager runs before the capture, its
// warm-up); the three MoE ops (new expert ids with every input set); the FP8 GEMM ops (ag-gemm's second gather of
// the scales) and FP8 expert weights (the quantising dispatch); the barrier (the op entry alone).
std::vector<GraphCase> graphCases(uint32_t nranks) {
  const uint64_t kUnit = 8 * nranks;  // gemm-rs/ar: every rank's k slice a multiple of 8
  return {{OpKind::kAllGather, 0, 0, 0, 64u << 10},
          {OpKind::kAllGather, 0, 0, 0, (640u << 10) + 48},
          {OpKind::kAgGemm, 64, 512, 256},
          {OpKind::kAgGemm, 512, 512, 256},
          {OpKind::kGemmRs, 128, 512, kUnit * 32},
          {OpKind::kGemmRs, 1024, 512, kUnit * 32},
          {OpKind::kGemmAr, 16, 1024, kUnit * 64},
          {OpKind::kGemmAr, 512, 512, kUnit * 32},
          {OpKind::kRingAttention, 0, 0, 0, 0, 256 * nranks},
          {OpKind::kRingAttention, 0, 0, 0, 0, 512 * nranks, true},
          {OpKind::kRingAttentionBackward, 0, 0, 0, 0, 384 * nranks, true},
          {OpKind::kMoeDispatchGemm, 128, 256, 256},
          {OpKind::kMoeDispatchFfnCombine, 128, 256, 256},
          {OpKind::kMoeFfnBackward, 128, 256, 256},
          fp8Case(OpKind::kAgGemm, 512, 512, 256, true),
          fp8Case(OpKind::kAgGemm, 256, 512, 256, false),
          fp8Case(OpKind::kGemmRs, 512, 512, kUnit * 32, true),
          fp8Case(OpKind::kGemmAr, 256, 512, kUnit * 32, false),
          fp8Case(OpKind::kMoeDispatchGemm, 128, 256, 256, true),
          fp8Case(OpKind::kMoeDispatchFfnCombine, 128, 256, 256, true),
          {OpKind::kNop}};
}

int replays() {
  const char* v = std::getenv("TANDEM_TEST_REPLAYS");
  return v != nullptr && *v != '\0' ? std::atoi(v) : 1000;
}

// TANDEM_TEST_CORRUPT_REPLAY: the replay whose output the test corrupts, to show that its check fails; -1: none.
int corruptReplay() {
  const char* v = std::getenv("TANDEM_TEST_CORRUPT_REPLAY");
  return v != nullptr && *v != '\0' ? std::atoi(v) : -1;
}

constexpr int kInputSets = 3;  // input sets cycled through the replays, each with its eager result
constexpr int kCheckEvery = 50;  // replays between two reads of the device checks (each read synchronises)
static_assert(tandem::kMaxOpBuffers <= kMaxCompareSlots);

// One captured op of one rank: its buffers, its input sets (in device memory, copied into the op's inputs on the
// stream before each run), the eager result of each set (on the host, and in device memory for the device check of
// the replays), its graph, and what the device checks found.
struct Captured {
  Captured(tandem_session_t s, const GraphCase& c, uint32_t nranks, uint32_t rank, uint64_t seed)
      : what(describe(c)), b(s, descriptorsOf(c, nranks), rank, seed) {
    CK(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(ReplayMismatches)));
    const tandem::SlotRules rules = tandem::expectedSlots(b.desc());
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (!rules[i].output && !b.mine()[i].empty()) inputs.push_back(static_cast<int>(i));
    }
    for (int set = 0; set < kInputSets; ++set) {
      // Set 0 is what RankBuffers filled (its reference is b.want); the others come from other seeds.
      std::vector<std::vector<std::byte>> host(tandem::kMaxOpBuffers);
      std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
      for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
        host[i].resize(b.mine()[i].size());
        slots[i] = host[i].empty() ? nullptr : host[i].data();
      }
      ref::fillInputs(b.desc(), slots, seed + 7919u * static_cast<uint64_t>(set));
      if (set == 0) host.assign(b.mine().begin(), b.mine().end());
      for (int in : inputs) {
        const std::vector<std::byte>& h = host[static_cast<std::size_t>(in)];
        void* d = nullptr;
        CK(cudaMalloc(&d, h.size()));
        CK(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
        sets[set].push_back(d);
      }
    }
  }
  ~Captured() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    for (auto& set : sets) {
      for (void* d : set) cudaFree(d);
    }
    for (auto& set : eagerOnDevice) {
      for (void* d : set) cudaFree(d);
    }
    cudaFree(mismatches);
  }
  // Input set `set` into the op's inputs and every output poisoned, on the stream.
  void prepare(int set, cudaStream_t stream) {
    for (std::size_t j = 0; j < inputs.size(); ++j) {
      const auto s = static_cast<std::size_t>(inputs[j]);
      CK(cudaMemcpyAsync(b.ptr(inputs[j]), sets[set][j], b.mine()[s].size(), cudaMemcpyDeviceToDevice, stream));
    }
    b.poison(stream);
  }
  // This rank's outputs after the stream finished.
  std::vector<std::vector<std::byte>> outputs(cudaStream_t stream) {
    if (syncWithin(stream, 60000) != "synced") throw std::runtime_error(what + ": the stream did not finish");
    b.download();
    return b.outputBytes();
  }
  // The outputs of the eager run of input set `set` just enqueued, copied on the stream into the set's device copy of
  // them (one buffer per output slot).
  void keepEager(int set, cudaStream_t stream) {
    std::vector<void*>& kept = eagerOnDevice[set];
    for (std::size_t k = 0; k < b.outputs.size(); ++k) {
      const int s = b.outputs[k];
      const std::size_t bytes = b.mine()[static_cast<std::size_t>(s)].size();
      if (kept.size() == k) CK(cudaMalloc(&kept.emplace_back(), bytes));
      CK(cudaMemcpyAsync(kept[k], b.ptr(s), bytes, cudaMemcpyDeviceToDevice, stream));
    }
  }
  // Enqueues the device check of the run just enqueued against input set `set`'s eager outputs, as replay `index`.
  void enqueueCheck(int set, int index, cudaStream_t stream) {
    ReplayCompare c{};
    c.count = static_cast<uint32_t>(b.outputs.size());
    c.replay = static_cast<uint32_t>(index);
    c.record = mismatches;
    for (std::size_t k = 0; k < b.outputs.size(); ++k) {
      const int s = b.outputs[k];
      c.slots[k] = {b.ptr(s), eagerOnDevice[set][k], b.mine()[static_cast<std::size_t>(s)].size()};
    }
    CK(launchReplayCompare(c, stream));
  }
  // Enqueues one bit flipped in the middle of the first output (a replay made to differ from the eager run).
  void corruptOutput(cudaStream_t stream) {
    if (b.outputs.empty()) return;
    CK(launchFlipByte(b.ptr(b.outputs[0]), b.mine()[static_cast<std::size_t>(b.outputs[0])].size() / 2, stream));
  }
  // What the device checks found since their reset, after the stream finished.
  ReplayMismatches checked(cudaStream_t stream) {
    if (const std::string synced = syncWithin(stream, 60000); synced != "synced") {
      throw std::runtime_error(fmt::format("{}: the stream of the replays did not finish: {}", what, synced));
    }
    ReplayMismatches m{};
    CK(cudaMemcpy(&m, mismatches, sizeof m, cudaMemcpyDeviceToHost));
    return m;
  }
  // "<n> replays differ; first byte <b> of output slot <s>" for `m` (firstReplay set).
  std::string differences(const ReplayMismatches& m) const {
    const int s = m.firstSlot < b.outputs.size() ? b.outputs[m.firstSlot] : -1;
    return fmt::format("{} replays differ; first byte {} of output slot {}", m.replays, m.firstByte, s);
  }

  std::string what;
  RankBuffers b;
  std::vector<int> inputs;
  std::array<std::vector<void*>, kInputSets> sets;
  std::array<std::vector<std::vector<std::byte>>, kInputSets> eager;
  std::array<std::vector<void*>, kInputSets> eagerOnDevice;
  ReplayMismatches* mismatches = nullptr;  // device memory
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

std::string eagerRun(Captured& c, tandem_comm_t comm, cudaStream_t stream, int set) {
  c.prepare(set, stream);
  tandem_op_t op;
  if (submit(c.b, comm, stream, &op) != TANDEM_SUCCESS) return fmt::format("eager submit: {}", tandem_last_error());
  return finishOp(stream, op);
}

// Captures `c`'s op on the rank's stream into its graph and instantiates it; "" or what went wrong.
std::string capture(Captured& c, const Joined& j) {
  // Global mode, as torch.cuda.graph captures: any CUDA call libtandem makes that a capture forbids fails here.
  CK(cudaStreamBeginCapture(j.stream, cudaStreamCaptureModeGlobal));
  tandem_op_t op;
  const tandem_status_t st = submit(c.b, j.comm, j.stream, &op);
  const std::string why = st == TANDEM_SUCCESS ? std::string() : tandem_last_error();
  const cudaError_t ended = cudaStreamEndCapture(j.stream, &c.graph);
  if (st != TANDEM_SUCCESS) return fmt::format("capture refused: {}", why);
  if (op.seq != 0) return fmt::format("a captured op was submitted to tandemd (seq {})", op.seq);
  CK(ended);
  CK(cudaGraphInstantiate(&c.exec, c.graph, 0));
  return "";
}

// One rank of the replay case. Every rank runs the same sequence: eager runs of every op (the references), the
// captures, then per op its replays with an eager run every 250, then every graph in turns with eager runs between.
// Each replay's check runs on the device; the rank reads what they found every kCheckEvery replays and at the end of
// each op's replays, and after the rounds. "OK <time of the replay loop>" or what failed.
std::string replayRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                       const std::vector<GraphCase>& cases, int count) {
  Joined j(socket, id, nranks, rank);
  CK(preloadReplayCompareKernels());
  std::vector<std::unique_ptr<Captured>> ops;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    ops.push_back(std::make_unique<Captured>(j.s, cases[i], nranks, rank, 9000 + i));
    Captured& c = *ops.back();
    for (int set = 0; set < kInputSets; ++set) {
      if (std::string e = eagerRun(c, j.comm, j.stream, set); !e.empty()) return fmt::format("FAIL {}: {}", c.what, e);
      c.keepEager(set, j.stream);
      c.eager[set] = c.outputs(j.stream);
      if (set == 0) {
        if (std::string e = c.b.compare(); !e.empty()) return fmt::format("FAIL {} (eager): {}", c.what, e);
      }
    }
  }
  for (auto& c : ops) {
    if (std::string e = capture(*c, j); !e.empty()) return fmt::format("FAIL {}: {}", c->what, e);
  }
  const int corrupt = corruptReplay();
  const auto start = std::chrono::steady_clock::now();
  for (auto& c : ops) {
    CK(resetReplayMismatches(c->mismatches, j.stream));
    for (int i = 0; i < count; ++i) {
      const int set = i % kInputSets;
      c->prepare(set, j.stream);  // the poison in it: a replay that writes nothing differs
      CK(cudaGraphLaunch(c->exec, j.stream));
      if (i == corrupt) c->corruptOutput(j.stream);
      c->enqueueCheck(set, i, j.stream);
      if (i % kCheckEvery == kCheckEvery - 1 || i == count - 1) {
        if (const ReplayMismatches m = c->checked(j.stream); m.firstReplay != kNoReplay) {
          return fmt::format("FAIL {}: replay {} (inputs {}) differs from the eager run ({})", c->what, m.firstReplay,
                             m.firstReplay % kInputSets, c->differences(m));
        }
      }
      if (i % 250 == 249) {  // eager, replay, eager: the device epoch and tandemd's stay in step
        if (std::string e = eagerRun(*c, j.comm, j.stream, set); !e.empty()) {
          return fmt::format("FAIL {}: eager run after replay {}: {}", c->what, i, e);
        }
        if (c->outputs(j.stream) != c->eager[set]) return fmt::format("FAIL {}: eager run after replay {}", c->what, i);
      }
    }
  }
  const double replaySeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Several graphs of one communicator in turns, with an eager op between rounds; each graph's replays checked on the
  // device as replays 0..19, read after the rounds.
  constexpr int kRounds = 20;
  for (auto& c : ops) CK(resetReplayMismatches(c->mismatches, j.stream));
  for (int round = 0; round < kRounds; ++round) {
    for (auto& c : ops) {
      const int set = (round + 1) % kInputSets;
      c->prepare(set, j.stream);
      CK(cudaGraphLaunch(c->exec, j.stream));
      c->enqueueCheck(set, round, j.stream);
    }
    Captured& e = *ops[static_cast<std::size_t>(round) % ops.size()];
    if (std::string err = eagerRun(e, j.comm, j.stream, 0); !err.empty()) return "FAIL eager between rounds: " + err;
    if (e.outputs(j.stream) != e.eager[0]) return fmt::format("FAIL {}: eager between rounds {}", e.what, round);
  }
  for (auto& c : ops) {
    if (const ReplayMismatches m = c->checked(j.stream); m.firstReplay != kNoReplay) {
      return fmt::format("FAIL {}: round {} of every graph (inputs {}) differs from the eager run ({})", c->what,
                         m.firstReplay, (m.firstReplay + 1) % kInputSets, c->differences(m));
    }
  }
  tandem_op_t op;
  const tandem_barrier_args_t a{sizeof a, j.stream};
  TK(tandem_barrier_stream(j.comm, &a, &op));
  if (std::string e = finishOp(j.stream, op); !e.empty()) return "FAIL the last barrier: " + e;
  const std::size_t n = ops.size();
  ops.clear();
  return fmt::format("OK replay loop {:.2f} s ({} ops x {} replays, {:.0f} us a replay)", replaySeconds, n, count,
                     count > 0 ? replaySeconds * 1e6 / static_cast<double>(n * static_cast<std::size_t>(count)) : 0.0);
}

void runReplays(const Daemon& d, uint32_t nranks) {
  const auto cases = graphCases(nranks);
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  MESSAGE(nranks << " ranks on " << gpuCount() << " GPU(s), " << replays() << " replays of each:" << o.str());
  const std::vector<std::string> notes = runRankProcesses(d, nranks, 1800000, [&](const tandem_unique_id_t& id,
                                                                                  uint32_t r) {
    return replayRank(d.socket(), id, nranks, r, cases, replays());
  });
  for (std::size_t r = 0; r < notes.size(); ++r) MESSAGE(nranks << " ranks, rank " << r << ": " << notes[r]);
}

// A rank of the failure cases: joins, runs an allgather of `eagerBytes` per rank eagerly once (alike on both ranks),
// captures one of `graphBytes`, reports "captured"; on "gate" its stream waits on a host flag (never released) before
// the replay; on "replay" it launches the graph and reports "launched"; on "sync" it reports "<stream> <ms> <status of
// a barrier after it> <message>".
std::string failureRank(const Io& io, const std::string& socket, const tandem_unique_id_t& id, uint32_t rank,
                        uint64_t eagerBytes, uint64_t graphBytes) {
  Joined j(socket, id, 2, rank);
  Captured warm(j.s, GraphCase{OpKind::kAllGather, 0, 0, 0, eagerBytes}, 2, rank, 76);
  if (std::string e = eagerRun(warm, j.comm, j.stream, 0); !e.empty()) return "FAIL eager: " + e;
  Captured op(j.s, GraphCase{OpKind::kAllGather, 0, 0, 0, graphBytes}, 2, rank, 77);
  CK(cudaStreamBeginCapture(j.stream, cudaStreamCaptureModeGlobal));
  tandem_op_t handle;
  const tandem_status_t st = submit(op.b, j.comm, j.stream, &handle);
  CK(cudaStreamEndCapture(j.stream, &op.graph));
  if (st != TANDEM_SUCCESS) return std::string("FAIL capture: ") + tandem_last_error();
  CK(cudaGraphInstantiate(&op.exec, op.graph, 0));
  io.say("captured");
  uint32_t* flag = nullptr;
  for (;;) {
    const std::string order = io.hear();
    if (order == "gate") {
      CK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4096, cudaHostAllocMapped | cudaHostAllocPortable));
      *flag = 0;
      if (tandem::kernels::driver().streamWaitValue32(j.stream, reinterpret_cast<CUdeviceptr>(flag), 1,
                                                      CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
        return "FAIL gate";
      }
    } else if (order == "replay") {
      CK(cudaGraphLaunch(op.exec, j.stream));
      io.say("launched");
    } else if (order == "sync") {
      const auto start = std::chrono::steady_clock::now();
      const std::string synced = syncWithin(j.stream, 30000);
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
      tandem_op_t b;
      const tandem_barrier_args_t a{sizeof a, j.stream};
      tandem_status_t s = tandem_barrier_stream(j.comm, &a, &b);
      if (s == TANDEM_SUCCESS) s = tandem_wait(b, 10000);
      return fmt::format("{} {} {} {}", synced, ms, static_cast<int>(s), tandem_last_error());
    } else {
      return "FAIL order '" + order + "'";
    }
  }
}

// One rank of the MoE replay-error case (2 ranks): `kind` captured and replayed with good inputs; then rank 1's
// topk_ids[3][0] = 13 (of 8 experts) in the graph's input: the replay writes nothing on any rank, and the wait of the
// next eager op (a barrier, which itself ran) reports the replay's error; then the good inputs again, eager and
// replayed, match the first run, and a last barrier reports nothing.
std::string moeFaultRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank, OpKind kind) {
  Joined j(socket, id, 2, rank);
  Captured c(j.s, GraphCase{kind, 64, 256, 256}, 2, rank, 4242);
  const std::string what = c.what;
  if (std::string e = eagerRun(c, j.comm, j.stream, 0); !e.empty()) return fmt::format("FAIL {} eager: {}", what, e);
  c.eager[0] = c.outputs(j.stream);
  if (std::string e = c.b.compare(); !e.empty()) return fmt::format("FAIL {} (eager): {}", what, e);
  if (std::string e = capture(c, j); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
  c.prepare(0, j.stream);
  CK(cudaGraphLaunch(c.exec, j.stream));
  if (c.outputs(j.stream) != c.eager[0]) return fmt::format("FAIL {}: the good replay differs from eager", what);

  static const int32_t kBadId = 13;  // static: the pageable source of the async copy outlives it
  c.prepare(0, j.stream);
  if (rank == 1) {
    auto* ids = static_cast<char*>(c.b.ptr(slot::kTopkIds));
    CK(cudaMemcpyAsync(ids + (3 * 2 + 0) * sizeof(int32_t), &kBadId, sizeof kBadId, cudaMemcpyHostToDevice, j.stream));
  }
  CK(cudaGraphLaunch(c.exec, j.stream));
  (void)c.outputs(j.stream);  // synchronises, downloads
  if (std::string e = c.b.untouched(); !e.empty()) return fmt::format("FAIL {}: the failed replay wrote: {}", what, e);

  tandem_op_t op;
  const tandem_barrier_args_t a{sizeof a, j.stream};
  TK(tandem_barrier_stream(j.comm, &a, &op));
  if (syncWithin(j.stream, 60000) != "synced") return "FAIL the barrier after the failed replay: stream";
  const tandem_status_t st = tandem_wait(op, 60000);
  const std::string msg = st == TANDEM_SUCCESS ? std::string() : tandem_last_error();
  const std::string needle = fmt::format("a replay of {} from a CUDA graph failed: {}: rank 1 topk_ids[3][0] = 13 is "
                                         "out of range", tandem::opKindName(kind), tandem::opKindName(kind));
  if (st != TANDEM_ERROR_INVALID_ARGUMENT || msg.find(needle) == std::string::npos) {
    return fmt::format("FAIL {}: the barrier after the failed replay: status {} message '{}' (want '{}' in it)", what,
                       static_cast<int>(st), msg, needle);
  }
  // The op's result sticks (Python reads the status, then the message): the same error again.
  if (tandem_wait(op, 60000) != TANDEM_ERROR_INVALID_ARGUMENT || tandem_last_error() != msg) {
    return "FAIL a second wait of the barrier did not report the same error";
  }

  if (std::string e = eagerRun(c, j.comm, j.stream, 0); !e.empty()) {
    return fmt::format("FAIL {} eager after the error: {}", what, e);
  }
  if (c.outputs(j.stream) != c.eager[0]) return fmt::format("FAIL {}: the eager run after the error differs", what);
  c.prepare(0, j.stream);
  CK(cudaGraphLaunch(c.exec, j.stream));
  if (c.outputs(j.stream) != c.eager[0]) return fmt::format("FAIL {}: the replay after the error differs", what);
  TK(tandem_barrier_stream(j.comm, &a, &op));
  if (std::string e = finishOp(j.stream, op); !e.empty()) return "FAIL the last barrier: " + e;
  return "OK";
}

// A fresh communicator after the failures: an eager allgather, then 10 replays of it, checked.
void expectNextCommunicatorServed(const Daemon& d) {
  runRankProcesses(d, 2, 120000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return replayRank(d.socket(), id, 2, r, {{OpKind::kAllGather, 0, 0, 0, 64u << 10}}, 10);
  });
}

}  // namespace

TEST_CASE("CUDA graphs, client executor: every replayable op replays bitwise like its eager run at 2 ranks") {
  Daemon d(config("client"), {}, "");
  runReplays(d, 2);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("CUDA graphs, client executor: every replayable op replays bitwise like its eager run at 4 ranks") {
  Daemon d(config("client"), {}, "");
  runReplays(d, 4);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("CUDA graphs: a rank SIGKILLed mid-replay releases its peer with PEER_LOST, then tandemd serves the next" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  Daemon d(config("client"), {}, "");
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  Rank survivor = spawn([&](const Io& io) { return failureRank(io, d.socket(), id, 0, 64u << 10, 64u << 20); });
  Rank victim = spawn([&](const Io& io) { return failureRank(io, d.socket(), id, 1, 64u << 10, 64u << 20); });
  REQUIRE(survivor.read(120000) == "captured");
  REQUIRE(victim.read(120000) == "captured");
  victim.tell("gate");  // the victim's replay never starts: the survivor's op entry waits for it
  victim.tell("replay");
  REQUIRE(victim.read(30000) == "launched");
  survivor.tell("replay");
  REQUIRE(survivor.read(30000) == "launched");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  victim.kill();
  victim.reap();
  survivor.tell("sync");
  const std::string result = survivor.read(60000);
  INFO(result);
  INFO(d.log());
  CHECK(result.rfind("synced ", 0) == 0);
  // Released by tandemd's abort (the op deadline is 60 s), and the communicator reports the loss.
  std::istringstream in(result.substr(7));
  long ms = -1;
  int code = -1;
  in >> ms >> code;
  CHECK(ms >= 0);
  CHECK(ms < 20000);
  CHECK((code == TANDEM_ERROR_PEER_LOST || code == TANDEM_ERROR_ABORTED));
  survivor.reap();
  expectNextCommunicatorServed(d);
}

TEST_CASE("CUDA graphs: ranks replaying different graphs get an error within the deadline, then tandemd serves the "
          "next communicator") {
  Daemon d(config("client"), {}, "");
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  // The same eager op on both ranks, then graphs of another shape each: rank 0 gathers 64 KiB per rank, rank 1 128 KiB.
  Rank r0 = spawn([&](const Io& io) { return failureRank(io, d.socket(), id, 0, 64u << 10, 64u << 10); });
  Rank r1 = spawn([&](const Io& io) { return failureRank(io, d.socket(), id, 1, 64u << 10, 128u << 10); });
  REQUIRE(r0.read(120000) == "captured");
  REQUIRE(r1.read(120000) == "captured");
  r0.tell("replay");
  r1.tell("replay");
  REQUIRE(r0.read(30000) == "launched");
  REQUIRE(r1.read(30000) == "launched");
  r0.tell("sync");
  r1.tell("sync");
  for (Rank* r : {&r0, &r1}) {
    const std::string result = r->read(90000);
    INFO(result);
    INFO(d.log());
    CHECK(result.rfind("synced ", 0) == 0);  // released: neither rank hangs
    std::istringstream in(result.substr(result.find(' ') + 1));
    long ms = -1;
    int code = -1;
    in >> ms >> code;
    CHECK(ms < 20000);  // the op entry's comparison, not the 60 s deadline
    CHECK(code != TANDEM_SUCCESS);  // the communicator failed, and its reason names the divergence
    CHECK(result.find("replayed different graphs") != std::string::npos);
    r->reap();
  }
  expectNextCommunicatorServed(d);
}

TEST_CASE("CUDA graphs: an MoE replay with a bad expert id writes nothing, the next eager op's wait reports it, and "
          "the communicator goes on") {
  Daemon d(config("client"), {}, "");
  for (OpKind kind : {OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine}) {
    CAPTURE(tandem::opKindName(kind));
    runRankProcesses(d, 2, 300000, [&](const tandem_unique_id_t& id, uint32_t r) {
      return moeFaultRank(d.socket(), id, r, kind);
    });
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}
