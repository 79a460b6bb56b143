// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) on the cuda backend end to end: real rank processes run them through
// libtandem and check every output against the fp64 reference (common/reference.hpp); gemm-rs and gemm-ar must also
// repeat bitwise, with both executors (the daemon executor under MPS). Then what must be refused before anything is
// submitted, and a peer that dies or never shows up in the middle of a fused GEMM.
#include <algorithm>
#include <array>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "rank_buffers.hpp"
#include "submit_op.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

// One op: kind, dtype, global m and n, and k (ag-gemm: k[0]; gemm-rs/ar: each rank's slice, k[r % k.size()]).
struct GemmCase {
  OpKind kind;
  DType dtype;
  uint64_t m, n;
  std::vector<uint64_t> k;
  bool gathered = true;  // ag-gemm: ask for a_gathered
};

std::string describe(const GemmCase& c) {
  std::string ks;
  for (uint64_t k : c.k) ks += (ks.empty() ? "" : "/") + std::to_string(k);
  return fmt::format("{} {} m={} n={} k={}{}", tandem::opKindName(c.kind), tandem::dtypeName(c.dtype), c.m, c.n, ks,
                     c.kind == OpKind::kAgGemm && !c.gathered ? " (no a_gathered)" : "");
}

// Rank r's descriptor (slot extents only; ids and offsets stay 0, as the reference wants them).
OpDescriptor descriptorOf(const GemmCase& c, uint32_t r, uint32_t n) {
  ref::OpShape shape;
  shape.kind = c.kind;
  shape.dtype = c.dtype;
  shape.m = c.m;
  shape.n = c.n;
  shape.k = c.k[0];
  OpDescriptor d = ref::makeDescriptor(shape, r, n);
  const uint64_t es = tandem::dtypeSize(c.dtype);
  if (c.kind == OpKind::kAgGemm) {
    if (!c.gathered) d.bufs[slot::kAGathered].bytes = 0;
  } else {
    const uint64_t k = c.k[r % c.k.size()];
    d.dims[dim::kK] = k;
    d.bufs[slot::kA].bytes = c.m * k * es;
    d.bufs[slot::kB].bytes = c.n * k * es;
  }
  return d;
}

std::vector<OpDescriptor> descriptorsOf(const GemmCase& c, uint32_t n) {
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(descriptorOf(c, q, n));
  return v;
}

tandem_status_t submit(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  return submitGemmOp(b.desc(), [&b](int s) { return b.tensor(s); }, comm, stream, op);
}

struct RunOptions {
  int repeats = 1;           // gemm-rs/ar: runs after the first that must reproduce it bit for bit
  bool backToBack = false;   // enqueue every case before waiting for any (ops of different kinds overlap)
  bool allgathers = false;   // an AllGather before every case on the same stream (executor daemon: its persistent
                             // kernel runs those, and yields to each fused GEMM)
};

// One rank: joins and runs every case, each checked against the reference.
std::string gemmRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                     const std::vector<GemmCase>& cases, const RunOptions& opt) {
  CK(cudaSetDevice(rankDevice(rank)));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, nranks, rank, 60000, &comm));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::unique_ptr<RankBuffers>> ops;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    ops.push_back(std::make_unique<RankBuffers>(s, descriptorsOf(cases[i], nranks), rank, 1000 + i));
  }
  std::vector<tandem_op_t> handles(cases.size());
  tandem_buffer_t agSend = nullptr, agRecv = nullptr;
  constexpr uint64_t kAgBytes = 64u << 10;
  if (opt.allgathers) {
    TK(tandem_alloc(s, kAgBytes, &agSend));
    TK(tandem_alloc(s, kAgBytes * nranks, &agRecv));
  }
  const auto run = [&](std::size_t i) -> std::string {
    if (opt.allgathers) {
      tandem_op_t ag;
      const tandem_allgather_args_t agArgs{sizeof agArgs, {agSend, 0}, {agRecv, 0}, kAgBytes, stream};
      if (tandem_allgather(comm, &agArgs, &ag) != TANDEM_SUCCESS) {
        return std::string("allgather before it: ") + tandem_last_error();
      }
    }
    if (submit(*ops[i], comm, stream, &handles[i]) != TANDEM_SUCCESS) return std::string("submit: ") + tandem_last_error();
    return "";
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i]);
    if (opt.backToBack) {
      if (std::string e = run(i); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
      continue;
    }
    if (std::string e = run(i); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    if (std::string e = finishOp(stream, handles[i]); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    ops[i]->download();
    if (std::string e = ops[i]->compare(); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    if (cases[i].kind == OpKind::kAgGemm) continue;
    const std::vector<std::byte> first = ops[i]->host[rank][slot::kC];
    for (int rep = 1; rep < opt.repeats; ++rep) {
      ops[i]->poison(stream);
      if (std::string e = run(i); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      if (std::string e = finishOp(stream, handles[i]); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      ops[i]->download();
      if (ops[i]->host[rank][slot::kC] != first) {
        return fmt::format("FAIL {}: run {} differs from run 0 (the reduction must be bitwise reproducible)", what, rep);
      }
    }
  }
  if (opt.backToBack) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      if (std::string e = finishOp(stream, handles[i]); !e.empty()) return fmt::format("FAIL {}: {}", describe(cases[i]), e);
    }
    for (std::size_t i = 0; i < cases.size(); ++i) {
      ops[i]->download();
      if (std::string e = ops[i]->compare(); !e.empty()) return fmt::format("FAIL {}: {}", describe(cases[i]), e);
    }
  }
  ops.clear();
  if (agSend != nullptr) {
    TK(tandem_free(agSend));
    TK(tandem_free(agRecv));
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

void runRanks(const Daemon& d, uint32_t nranks, const std::vector<GemmCase>& cases, const RunOptions& opt = {}) {
  runRankProcesses(d, nranks, 240000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return gemmRank(d.socket(), id, nranks, r, cases, opt);
  });
}

// Shapes for one op: the edges (one row; a rank without rows; M, N and K off the 128 x 256 x 64 tiles; a reduce-
// scatter split on tile rows, which writes no peer output, and one that is not), fp16, one shape of many tiles, and
// random ones (n and k multiples of 8, as the kernels require).
std::vector<GemmCase> casesFor(OpKind kind, uint32_t nranks, uint64_t seed) {
  std::vector<GemmCase> v;
  const DType bf16 = DType::kBF16;
  if (kind == OpKind::kAgGemm) {
    v.push_back({kind, bf16, 1, 8, {8}});
    v.push_back({kind, bf16, 777, 520, {264}, false});
    v.push_back({kind, DType::kF16, 300, 264, {72}});
    v.push_back({kind, bf16, 1536, 1024, {1024}});
  } else {
    v.push_back({kind, bf16, 1, 8, {8, 16}});
    v.push_back({kind, bf16, 256, 512, {64}});
    v.push_back({kind, bf16, 300, 520, {136, 72}});
    v.push_back({kind, DType::kF16, 777, 264, {40}});
    v.push_back({kind, bf16, 1536, 1024, {512}});
  }
  std::mt19937_64 rng(seed + static_cast<uint64_t>(kind) * 7919 + nranks);
  for (int i = 0; i < 2; ++i) {
    GemmCase c{kind, bf16, 1 + rng() % 1000, 8 * (1 + rng() % 100), {}, rng() % 2 == 0};
    for (uint32_t r = 0; r < (kind == OpKind::kAgGemm ? 1u : nranks); ++r) c.k.push_back(8 * (1 + rng() % 80));
    v.push_back(c);
  }
  return v;
}

std::string listCases(const std::vector<GemmCase>& cases) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  return o.str();
}

// Every case of `kind` at each rank count on a tandemd with `executor`; gemm-rs/ar repeated `repeats` times bitwise
// (at most 10 times past 2 ranks, which time-slice the GPU where only one exists).
void runOp(OpKind kind, const std::string& executor, int repeats, const std::vector<uint32_t>& rankCounts = {1, 2}) {
  Daemon d(config(executor), {}, "");
  REQUIRE(status(d)["executor"] == executor);
  for (uint32_t n : rankCounts) {
    const auto cases = casesFor(kind, n, 20261129);
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s), executor " << executor << ", MPS "
              << std::string(mpsRunning() ? "on" : "off") << ":" << listCases(cases));
    runRanks(d, n, cases, {kind == OpKind::kAgGemm ? 1 : (n > 2 ? std::min(repeats, 10) : repeats), false});
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

// Ten fused GEMMs enqueued without waiting in between, so that a rank may start op e + 1 while its peer still runs
// op e: every pair of kinds follows every other at least once.
std::vector<GemmCase> mixedCases() {
  const DType bf16 = DType::kBF16;
  return {
      {OpKind::kAgGemm, bf16, 1024, 1024, {512}},   {OpKind::kGemmRs, bf16, 1000, 1024, {256, 264}},
      {OpKind::kGemmRs, bf16, 1, 512, {64}},        {OpKind::kGemmAr, bf16, 1024, 768, {512}},
      {OpKind::kAgGemm, bf16, 777, 512, {256}},     {OpKind::kGemmAr, bf16, 640, 1024, {128, 136}},
      {OpKind::kGemmRs, bf16, 1024, 1024, {512}},   {OpKind::kGemmRs, bf16, 512, 256, {64}},
      {OpKind::kAgGemm, bf16, 2048, 512, {256}, false}, {OpKind::kGemmAr, bf16, 300, 264, {64}},
  };
}

}  // namespace

TEST_CASE("ag-gemm, client executor: matches the fp64 reference at 1, 2, 3 and 4 ranks") {
  runOp(OpKind::kAgGemm, "client", 1, {1, 2, 3, 4});
}

TEST_CASE("gemm-rs, client executor: matches the fp64 reference at 1, 2, 3 and 4 ranks, repeats bitwise identical") {
  runOp(OpKind::kGemmRs, "client", 100, {1, 2, 3, 4});
}

TEST_CASE("gemm-ar, client executor: matches the fp64 reference at 1, 2, 3 and 4 ranks, repeats bitwise identical") {
  runOp(OpKind::kGemmAr, "client", 100, {1, 2, 3, 4});
}

TEST_CASE("fused GEMMs, client executor: different ops back to back on one stream share the workspace safely") {
  const uint32_t n = 2;
  Daemon d(config("client"), {}, "");
  MESSAGE(n << " rank(s):" << listCases(mixedCases()));
  runRanks(d, n, mixedCases(), {1, true});
}

TEST_CASE("fused GEMMs, daemon executor (MPS): every op matches the fp64 reference at 1 and 2 ranks, repeats bitwise" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    runOp(kind, "daemon", 10, ranksFor("daemon", 2) > 1 ? std::vector<uint32_t>{1, 2} : std::vector<uint32_t>{1});
  }
}

TEST_CASE("fused GEMMs, daemon executor (MPS): back to back with AllGathers, the persistent kernel yields each time" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  const uint32_t n = ranksFor("daemon", 2);
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  MESSAGE(n << " rank(s), an AllGather before each:" << listCases(mixedCases()));
  runRanks(d, n, mixedCases(), {1, true, true});
  // One by one too: the persistent kernel lingers between ops, and each fused GEMM makes it leave.
  runRanks(d, n, mixedCases(), {1, false, true});
}

TEST_CASE("fused GEMMs: what the cuda backend cannot run is refused before submission, and the communicator lives on") {
  // 48 MiB per rank: AllGather's 2 x 16 MiB chunk slots and 2 x 2 MiB LL buffers; the rest (about 12 MiB) holds the
  // GEMMs' flags, staging and matrices.
  Daemon d(config("client") + "  workspace_bytes: " + std::to_string(48u << 20) + "\n", {}, "");
  const uint32_t n = 2;
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < n; ++r) {
    ranks.push_back(spawn([&, r](const Io&) -> std::string {
      CK(cudaSetDevice(rankDevice(r)));
      tandem_session_t s;
      TK(tandem_connect(d.socket().c_str(), &s));
      tandem_comm_t comm;
      TK(tandem_comm_init(s, &id, n, r, 60000, &comm));
      tandem_buffer_t a, b, c;
      TK(tandem_alloc(s, 16u << 20, &a));
      TK(tandem_alloc(s, 16u << 20, &b));
      TK(tandem_alloc(s, 16u << 20, &c));
      cudaStream_t stream;
      CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::string report;
      // Every rank makes the same calls: each refusal happens before submission, so the ranks stay in step.
      const auto expect = [&](const char* what, tandem_status_t got, tandem_status_t want, const char* needle) {
        const std::string msg = tandem_last_error();
        if (got != want || msg.find(needle) == std::string::npos) {
          report += fmt::format("\n{}: status {} (want {}), message '{}' (want '{}' in it)", what, static_cast<int>(got),
                                static_cast<int>(want), msg, needle);
        }
      };
      tandem_op_t op;
      const auto rs = gemmArgs<tandem_gemm_rs_args_t>(TANDEM_DTYPE_BF16, 256, 12, 64, {a, 0}, {b, 0}, {c, 0}, stream);
      expect("n not a multiple of 8", tandem_gemm_rs(comm, &rs, &op), TANDEM_ERROR_INVALID_ARGUMENT, "multiple of 8");
      auto ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_BF16, 256, 256, 60, {a, 0}, {b, 0}, {c, 0}, stream);
      expect("k not a multiple of 8", tandem_gemm_ar(comm, &ar, &op), TANDEM_ERROR_INVALID_ARGUMENT, "multiple of 8");
      ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_FP32, 256, 256, 64, {a, 0}, {b, 0}, {c, 0}, stream);
      expect("fp32", tandem_gemm_ar(comm, &ar, &op), TANDEM_ERROR_UNSUPPORTED, "bf16 or fp16");
      ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_BF16, 256, 256, 64, {a, 8}, {b, 0}, {c, 0}, stream);
      expect("a misaligned", tandem_gemm_ar(comm, &ar, &op), TANDEM_ERROR_INVALID_ARGUMENT, "16-byte aligned");
      if (n > 1) {
        ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_BF16, 2048, 2048, 64, {a, 0}, {b, 0}, {c, 0}, stream);
        expect("past the workspace", tandem_gemm_ar(comm, &ar, &op), TANDEM_ERROR_INVALID_ARGUMENT,
               "tandem_comm_config_t.workspace_bytes >= ");
        const auto ag = agGemmArgs(TANDEM_DTYPE_BF16, 4096, 256, 1024, {a, 0}, {b, 0}, {c, 0}, {}, stream);
        expect("ag-gemm past the workspace", tandem_ag_gemm(comm, &ag, &op), TANDEM_ERROR_INVALID_ARGUMENT,
               "tandem_comm_config_t.workspace_bytes >= ");
      }
      const tandem_moe_dispatch_gemm_args_t moe{sizeof moe, TANDEM_DTYPE_FP32, 8, 64, 64, 2 * n, 1, 16,
                                                {a, 0}, {b, 0}, {c, 0}, {a, 1u << 20}, {b, 1u << 20}, {c, 1u << 20},
                                                {a, 2u << 20}, stream, TANDEM_DTYPE_INVALID, {}};
      expect("moe-dispatch-gemm in fp32", tandem_moe_dispatch_gemm(comm, &moe, &op), TANDEM_ERROR_UNSUPPORTED,
             "bf16 or fp16");
      // A multi-rank op that cannot replay from a CUDA graph (ring attention's backward, which the cuda backend does
      // not run yet): refused during capture, and the capture holds none of it. (The ops that replay, ring attention
      // and the MoE ops among them: graph_replay_gpu_test.cpp.)
      {
        cudaStream_t capture;
        CK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
        CK(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
        tandem_ring_attention_backward_args_t bwd{};
        bwd.struct_size = sizeof bwd;
        bwd.dtype = TANDEM_DTYPE_BF16;
        bwd.seq = 64;
        bwd.heads = 2;
        bwd.head_dim = 64;
        bwd.causal = 1;
        bwd.layout = TANDEM_ATTENTION_CONTIGUOUS;
        bwd.q = {a, 0};
        bwd.k = {a, 1u << 20};
        bwd.v = {a, 2u << 20};
        bwd.o = {b, 0};
        bwd.dout = {b, 1u << 20};
        bwd.lse = {b, 2u << 20};
        bwd.dq = {c, 0};
        bwd.dk = {c, 1u << 20};
        bwd.dv = {c, 2u << 20};
        bwd.cuda_stream = capture;
        expect("ring-attention-backward during graph capture", tandem_ring_attention_backward(comm, &bwd, &op),
               TANDEM_ERROR_UNSUPPORTED, "no GPU implementation");
        cudaGraph_t graph = nullptr;
        CK(cudaStreamEndCapture(capture, &graph));
        size_t nodes = 0;
        CK(cudaGraphGetNodes(graph, nullptr, &nodes));
        if (nodes != 0) report += fmt::format("\nthe refused op left {} nodes in the captured graph", nodes);
        CK(cudaGraphDestroy(graph));
        CK(cudaStreamDestroy(capture));
      }
      // Nothing was submitted: the communicator still runs ops.
      ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_BF16, 256, 256, 64, {a, 0}, {b, 0}, {c, 0}, stream);
      if (tandem_gemm_ar(comm, &ar, &op) != TANDEM_SUCCESS) report += std::string("\nvalid gemm-ar: ") + tandem_last_error();
      else if (std::string e = finishOp(stream, op); !e.empty()) report += "\nvalid gemm-ar: " + e;
      TK(tandem_free(a));
      TK(tandem_free(b));
      TK(tandem_free(c));
      TK(tandem_comm_destroy(comm));
      tandem_disconnect(s);
      return report.empty() ? "OK" : "FAIL" + report;
    }));
  }
  for (auto& r : ranks) {
    const std::string out = r.read(120000);
    INFO(out);
    INFO(d.log());
    CHECK(out == "OK");
    r.reap();
  }
}

TEST_CASE("fused GEMMs, client executor: a rank SIGKILLed mid-op releases its peer's stream" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  for (GatedOp what : {GatedOp::kAgGemm, GatedOp::kGemmAr}) {
    CAPTURE(static_cast<int>(what));
    Daemon d(config("client"), {}, "");
    tandem_unique_id_t id;
    tandem_get_unique_id(&id);
    // The survivor's stream is gated, so the victim's kernel runs, waiting for the survivor's.
    Rank survivor = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 0, true, what); });
    Rank victim = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 1, false, what); });
    expectStreamReleasedAfterKill(survivor, victim, true, [&] { return d.log(); });
    CHECK(eventually([&] { return status(d)["total_bytes"] == 0 && status(d)["communicators"].empty(); }, 10000));
  }
}

TEST_CASE("fused GEMMs, client executor: a wait past its deadline fails the op and releases both streams") {
  // Rank 1's stream stays gated, so rank 0's kernel waits for a peer that never starts, until its 3 s deadline.
  ScopedEnv deadline("TANDEM_OP_TIMEOUT_MS", "3000");
  Daemon d(config("client"), {}, "");
  tandem_unique_id_t id;
  tandem_get_unique_id(&id);
  Rank waiting = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 0, false, GatedOp::kGemmAr); });
  Rank gated = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 1, true, GatedOp::kGemmAr); });
  REQUIRE(waiting.read(60000) == "submitted");
  REQUIRE(gated.read(60000) == "submitted");
  waiting.tell("sync");
  const std::string r0 = waiting.read(30000);
  INFO(r0);
  INFO(d.log());
  CHECK(r0.rfind("synced ", 0) == 0);
  CHECK((r0.find(" " + std::to_string(TANDEM_ERROR_TIMEOUT) + " ") != std::string::npos ||
         r0.find(" " + std::to_string(TANDEM_ERROR_ABORTED) + " ") != std::string::npos));
  CHECK(r0.find("timed out") != std::string::npos);
  // The gated rank's kernel starts after the communicator was aborted: it sees the abort and its stream drains.
  gated.tell("release");
  gated.tell("sync");
  const std::string r1 = gated.read(30000);
  INFO(r1);
  CHECK(r1.rfind("synced ", 0) == 0);
  waiting.reap();
  gated.reap();
}
