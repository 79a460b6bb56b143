// Ring attention's backward on the cuda backend end to end: real rank processes run tandem_ring_attention_backward
// through libtandem on one tandemd, and dq, dk and dv are checked against the fp64 reference (common/reference.hpp):
// causal and not, both layouts, bf16 and fp16, head_dim 64 and 128, shards that are not tile multiples and differ per
// rank, a rank with no rows, scale 0 and a custom one, grouped-query attention; the gradients must repeat bit for bit
// over 10 runs and never hold a NaN. The client executor runs it at 1, 2 and 4 ranks (ranks share GPUs where there
// are fewer), and replays from CUDA graphs at 2 and 4 ranks once a warm-up taught each rank its peers' seq (a capture
// without one is refused, naming it). The daemon executor (MPS) runs
// it at 1, 2 and 4 ranks (one rank per GPU, as many as there are), and gives the client executor's bits exactly.
#include <fstream>
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

struct BwdCase {
  DType dtype;
  uint64_t heads, headDim;
  std::vector<uint64_t> seqs;  // rank r holds seqs[r % seqs.size()] rows
  bool causal;
  bool zigzag;
  float scale;           // 0: 1/sqrt(head_dim)
  int repeats = 1;       // runs after the first that must reproduce it bit for bit
  uint64_t kvHeads = 0;  // 0: heads
};

std::string describe(const BwdCase& c, uint32_t n) {
  std::string seqs;
  for (uint32_t r = 0; r < n; ++r) seqs += (r == 0 ? "" : "/") + std::to_string(c.seqs[r % c.seqs.size()]);
  return fmt::format("{} heads={} kv_heads={} hd={} seq={} {}{} scale={}", tandem::dtypeName(c.dtype), c.heads,
                     c.kvHeads == 0 ? c.heads : c.kvHeads, c.headDim, seqs, c.causal ? "causal" : "full",
                     c.zigzag ? " zigzag" : "", c.scale);
}

OpDescriptor descriptorOf(const BwdCase& c, uint32_t r, uint32_t n) {
  ref::OpShape shape;
  shape.kind = OpKind::kRingAttentionBackward;
  shape.dtype = c.dtype;
  shape.heads = c.heads;
  shape.headDim = c.headDim;
  shape.kvHeads = c.kvHeads;
  shape.causal = c.causal;
  shape.zigzag = c.zigzag;
  shape.seq = n;  // replaced below
  OpDescriptor d = ref::makeDescriptor(shape, r, n);
  const uint64_t seq = c.seqs[r % c.seqs.size()], es = tandem::dtypeSize(c.dtype);
  const uint64_t kvHeads = c.kvHeads == 0 ? c.heads : c.kvHeads;
  d.dims[dim::kSeq] = seq;
  d.scale = c.scale;
  for (int s : {slot::kQ, slot::kAttnOut, slot::kDout, slot::kDq}) {
    d.bufs[static_cast<std::size_t>(s)].bytes = seq * c.heads * c.headDim * es;
  }
  for (int s : {slot::kKey, slot::kValue, slot::kDk, slot::kDv}) {
    d.bufs[static_cast<std::size_t>(s)].bytes = seq * kvHeads * c.headDim * es;
  }
  d.bufs[slot::kBwdLse].bytes = c.heads * seq * 4;
  return d;
}

std::vector<OpDescriptor> descriptorsOf(const BwdCase& c, uint32_t n) {
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(descriptorOf(c, q, n));
  return v;
}

tandem_status_t submit(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  return tandem::gputest::submitOp(b.desc(), [&b](int s) { return b.tensor(s); }, comm, stream, op);
}

// FNV-1a over every output's bytes: what a rank reports of a case, for the comparison across executors.
uint64_t hashOutputs(const std::vector<std::vector<std::byte>>& outputs) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& o : outputs) {
    for (std::byte b : o) {
      h ^= static_cast<uint64_t>(b);
      h *= 1099511628211ull;
    }
  }
  return h;
}

// Runs every case (checked against the reference, repeats bitwise). `hashFile` not empty: writes one line per case
// with the hash of its outputs there.
std::string backwardRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                         const std::vector<BwdCase>& cases, const std::string& hashFile = {}) {
  Joined j(socket, id, nranks, rank);
  std::string hashes;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i], nranks);
    RankBuffers rc(j.s, descriptorsOf(cases[i], nranks), rank, 7000 + i);
    tandem_op_t op;
    if (submit(rc, j.comm, j.stream, &op) != TANDEM_SUCCESS) {
      return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
    }
    if (std::string e = finishOp(j.stream, op); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    rc.download();
    const auto first = rc.outputBytes();
    hashes += fmt::format("{:016x}\n", hashOutputs(first));
    if (std::string e = rc.compare(); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    for (int rep = 1; rep < cases[i].repeats; ++rep) {
      rc.poison(j.stream);
      if (submit(rc, j.comm, j.stream, &op) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {} run {}: submit: {}", what, rep, tandem_last_error());
      }
      if (std::string e = finishOp(j.stream, op); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      rc.download();
      if (rc.outputBytes() != first) return fmt::format("FAIL {}: run {} differs from run 0 (must be bitwise)", what, rep);
    }
  }
  if (!hashFile.empty()) {
    std::ofstream out(hashFile);
    out << hashes;
    if (!out) return "FAIL: cannot write " + hashFile;
  }
  return "OK";
}

// Captures the op of `rc` into a CUDA graph on the stream: the submit's status and, on failure, its error text.
std::pair<tandem_status_t, std::string> captureInto(const RankBuffers& rc, const Joined& j, cudaGraph_t& graph) {
  tandem_op_t op;
  CK(cudaStreamBeginCapture(j.stream, cudaStreamCaptureModeRelaxed));
  const tandem_status_t captured = submit(rc, j.comm, j.stream, &op);
  const std::string e = captured == TANDEM_SUCCESS ? std::string() : tandem_last_error();
  graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(j.stream, &graph);
  if (captured == TANDEM_SUCCESS) CK(ended);  // a refused submit invalidates the capture: its end reports that
  (void)cudaGetLastError();
  return {captured, e};
}

// Executor client, several ranks, CUDA graphs. A replay has no tandemd step to learn the peers' seq from, so:
// 1. a capture before any eager call of the shape is refused, naming the warm-up, and writes nothing;
// 2. after an eager call (the warm-up, checked against the reference), the capture succeeds, and `replays` replays
//    with the outputs poisoned before each give the eager call's bits;
// 3. an eager call after the replays still gives them (eager and replayed ops stay in step);
// 4. a capture with another seq on this rank than the warm-up's is refused, naming it.
std::string captureRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                        const BwdCase& c, int replays) {
  Joined j(socket, id, nranks, rank);
  RankBuffers rc(j.s, descriptorsOf(c, nranks), rank, 7100);
  const std::string what = describe(c, nranks);
  cudaGraph_t graph = nullptr;
  auto [st, e] = captureInto(rc, j, graph);
  if (graph != nullptr) CK(cudaGraphDestroy(graph));
  if (st != TANDEM_ERROR_UNSUPPORTED) return "FAIL " + what + ": a capture before any eager call was not refused";
  if (e.find("CUDA graph") == std::string::npos || e.find("warm-up") == std::string::npos) {
    return "FAIL " + what + ": the refusal does not name the warm-up: " + e;
  }
  CK(cudaStreamSynchronize(j.stream));
  rc.download();
  if (std::string w = rc.untouched(); !w.empty()) return "FAIL " + what + ": a refused capture wrote: " + w;

  tandem_op_t op;
  const auto eager = [&]() -> std::string {
    rc.poison(j.stream);
    if (submit(rc, j.comm, j.stream, &op) != TANDEM_SUCCESS) return fmt::format("submit: {}", tandem_last_error());
    if (std::string f = finishOp(j.stream, op); !f.empty()) return f;
    rc.download();
    return rc.compare();
  };
  if (std::string f = eager(); !f.empty()) return "FAIL " + what + " (warm-up): " + f;
  const std::vector<std::vector<std::byte>> want = rc.outputBytes();

  std::tie(st, e) = captureInto(rc, j, graph);
  if (st != TANDEM_SUCCESS) return "FAIL " + what + ": capture after the warm-up: " + e;
  cudaGraphExec_t exec = nullptr;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < replays; ++i) {
    rc.poison(j.stream);
    CK(cudaGraphLaunch(exec, j.stream));
    if (syncWithin(j.stream, 60000) != "synced") return fmt::format("FAIL {}: replay {} did not finish", what, i);
    rc.download();
    if (rc.outputBytes() != want) return fmt::format("FAIL {}: replay {} differs from the eager call's bits", what, i);
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  if (std::string f = eager(); !f.empty()) return "FAIL " + what + " (eager after the replays): " + f;
  if (rc.outputBytes() != want) return "FAIL " + what + ": the eager call after the replays gives other bits";

  BwdCase longer = c;
  for (auto& s : longer.seqs) s += 8;
  RankBuffers other(j.s, descriptorsOf(longer, nranks), rank, 7200);
  std::tie(st, e) = captureInto(other, j, graph);
  if (graph != nullptr) CK(cudaGraphDestroy(graph));
  if (st != TANDEM_ERROR_UNSUPPORTED || e.find("warm up with the seq") == std::string::npos) {
    return "FAIL " + what + ": a capture with another seq than the warm-up's was not refused naming it: " + e;
  }
  // The communicator still runs the op eagerly after the refusals.
  if (std::string f = eager(); !f.empty()) return "FAIL " + what + " (eager after the refusal): " + f;
  return "OK";
}

// Tiles are 128 query rows and 128 keys: shards of no multiple, a rank with no rows, both layouts, both dtypes and
// head sizes, the default and a custom scale, grouped-query attention; three cases repeat 10 times bitwise.
std::vector<BwdCase> casesFor(uint32_t n) {
  const DType bf16 = DType::kBF16, fp16 = DType::kF16;
  std::vector<BwdCase> v;
  v.push_back({bf16, 2, 128, {300, 177, 64, 251}, true, false, 0.0f, 10});
  v.push_back({fp16, 2, 64, {257, 100, 190, 33}, true, true, 0.11f, 10});
  v.push_back({bf16, 3, 128, {200, 329, 1, 130}, false, false, 0.0f});
  v.push_back({bf16, 2, 64, {129, 0, 300, 77}, false, true, 0.0f});
  v.push_back({fp16, 1, 128, {180, 260, 0, 150}, true, false, 0.3f});
  if (n > 1) v.push_back({bf16, 2, 128, {0, 250, 99, 0}, true, true, 0.0f});  // rank 0 empty: the rest go on
  // Grouped-query attention: 4 query heads over 1 and 2 KV heads (dk/dv sum each group), both layouts.
  v.push_back({bf16, 4, 128, {300, 177, 64, 251}, true, true, 0.0f, 10, 1});
  v.push_back({fp16, 4, 64, {257, 100, 190, 33}, false, false, 0.0f, 1, 2});
  v.push_back({bf16, 4, 128, {129, 0, 300, 77}, true, true, 0.0f, 1, 2});
  return v;
}

std::string listCases(const std::vector<BwdCase>& cases, uint32_t n) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c, n);
  return o.str();
}

}  // namespace

TEST_CASE("ring attention backward, client executor: matches the fp64 reference at 1, 2 and 4 ranks, 10 runs "
          "bitwise") {
  Daemon d(config("client"), {}, "");
  REQUIRE(status(d)["executor"] == "client");
  for (uint32_t n : {1u, 2u, 4u}) {
    CAPTURE(n);
    const auto cases = casesFor(n);
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s):" << listCases(cases, n));
    runRankProcesses(d, n, 240000, [&](const tandem_unique_id_t& id, uint32_t r) {
      return backwardRank(d.socket(), id, n, r, cases);
    });
  }
}

TEST_CASE("ring attention backward, client executor: CUDA graphs at 2 and 4 ranks replay the eager bits; a capture "
          "without a warm-up of its shape is refused, naming it") {
  Daemon d(config("client"), {}, "");
  REQUIRE(status(d)["executor"] == "client");
  const char* v = std::getenv("TANDEM_TEST_REPLAYS");
  const int replays = v != nullptr && *v != '\0' ? std::atoi(v) : 100;
  for (uint32_t n : {2u, 4u}) {
    CAPTURE(n);
    // GQA, zigzag, uneven shards, a rank with no rows at 4 ranks.
    const BwdCase c{DType::kBF16, 4, 128, {100, 60, 0, 130}, true, true, 0.0f, 1, 2};
    runRankProcesses(d, n, 240000, [&](const tandem_unique_id_t& id, uint32_t r) {
      return captureRank(d.socket(), id, n, r, c, replays);
    });
  }
}

// Under MPS tandemd refuses two ranks on one GPU with the daemon executor, so one GPU runs 1 rank here; every GPU
// count above 1 runs as many ranks as GPUs, doubling (1, 2, 4). The client executor runs the same cases on the same
// ranks first: every rank's outputs must hash alike under both executors (the same pairs, the same sums).
TEST_CASE("ring attention backward, daemon executor (MPS): matches the fp64 reference, 10 runs bitwise, the client "
          "executor's bits" * doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  tandem::testing::TempDir hashes;
  const auto hashFile = [&](const char* executor, uint32_t n, uint32_t r) {
    return (hashes.path() / fmt::format("{}-{}-{}", executor, n, r)).string();
  };
  const auto run = [&](const char* executor) {
    Daemon d(config(executor), {}, "");
    REQUIRE(status(d)["executor"] == executor);
    for (uint32_t n = 1; n <= static_cast<uint32_t>(gpuCount()); n *= 2) {
      CAPTURE(executor);
      CAPTURE(n);
      const auto cases = casesFor(n);
      MESSAGE(executor << ": " << n << " rank(s) on " << gpuCount() << " GPU(s):" << listCases(cases, n));
      runRankProcesses(d, n, 240000, [&](const tandem_unique_id_t& id, uint32_t r) {
        return backwardRank(d.socket(), id, n, r, cases, hashFile(executor, n, r));
      });
    }
  };
  run("client");
  run("daemon");
  const auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream all;
    all << in.rdbuf();
    return all.str();
  };
  for (uint32_t n = 1; n <= static_cast<uint32_t>(gpuCount()); n *= 2) {
    for (uint32_t r = 0; r < n; ++r) {
      CAPTURE(n);
      CAPTURE(r);
      const std::string client = read(hashFile("client", n, r)), daemon = read(hashFile("daemon", n, r));
      CHECK(!client.empty());
      CHECK(client == daemon);  // one line per case: the case's outputs hashed
    }
  }
}
