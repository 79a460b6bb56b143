// The MoE ops (moe-dispatch-gemm, moe-dispatch-ffn-combine) on the cuda backend end to end: real rank processes run
// them through libtandem at 1, 2 and 4 ranks (ranks share the GPUs round robin) and check every output against the
// fp64 reference (common/reference.hpp: the cpu backend's layout, exactly, for row_info and expert_counts), each case
// 20 times bitwise identical; uniform, skewed (80% of the tokens to expert 0) and sparse (a third of the experts
// empty) routings, ranks with no tokens, top-k 1 to 8, bf16 and fp16, sizes that are multiples of 8 but not of the
// tiles. Then a capacity overflow (the error names the rows needed, nothing is written) and bad expert ids, each
// followed by a correct op on the same communicator in both executors (a data error fails the op, not the
// communicator), the shapes the kernels refuse before submission (the communicator lives on), and the daemon executor
// (under MPS). The FFN with FP8 weights (e4m3 w1 and w2 with 128 x 128 block scales, x and h quantised per 1 x 128
// block) against the reference of the quantised layer (reference.hpp's FP8 MoE tolerance), 20 runs bitwise identical,
// at 1, 2 and 4 ranks, and its refusals (ffn off 128, hidden off 16, a missing scale, an fp16 x).
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

enum class Routing { kUniform, kSkewed, kSparse };

const char* routingName(Routing r) {
  switch (r) {
    case Routing::kUniform:
      return "uniform";
    case Routing::kSkewed:
      return "skewed";
    case Routing::kSparse:
      return "sparse";
  }
  return "?";
}

struct MoeCase {
  OpKind kind = OpKind::kMoeDispatchGemm;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> tokens;  // rank r has tokens[r % size]
  uint64_t hidden = 0, n = 0;    // n: n_out (dispatch+GEMM) or ffn
  uint64_t experts = 0, topk = 0;
  Routing routing = Routing::kUniform;
  int64_t capacityDelta = 0;  // dispatch+GEMM: rank 0's capacity is its rows + this (< 0: overflow); others: worst case
  DType weightDtype = DType::kInvalid;  // the experts' weights' dtype (kF8E4M3: FP8 weights); kInvalid: dtype
};

std::string describe(const MoeCase& c) {
  std::string ts;
  for (uint64_t t : c.tokens) ts += (ts.empty() ? "" : "/") + std::to_string(t);
  return fmt::format("{} {}{} tokens={} hidden={} {}={} experts={} topk={} {}", tandem::opKindName(c.kind),
                     tandem::dtypeName(c.dtype),
                     c.weightDtype == DType::kInvalid ? "" : fmt::format(" w {}", tandem::dtypeName(c.weightDtype)),
                     ts, c.hidden, c.kind == OpKind::kMoeDispatchGemm ? "n_out" : "ffn", c.n, c.experts, c.topk,
                     routingName(c.routing));
}

uint64_t tokensOf(const MoeCase& c, uint32_t r) { return c.tokens[r % c.tokens.size()]; }

// Rank r's expert ids: distinct per token, drawn by the routing from (seed, r).
std::vector<int32_t> routeIds(const MoeCase& c, uint32_t r, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + r);
  const uint64_t tokens = tokensOf(c, r);
  std::vector<int32_t> ids(tokens * c.topk);
  std::vector<int32_t> pool;
  for (uint64_t e = 0; e < c.experts; ++e) {
    if (c.routing != Routing::kSparse || e % 3 != 1) pool.push_back(static_cast<int32_t>(e));
  }
  for (uint64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> chosen;
    if (c.routing == Routing::kSkewed && rng() % 10 < 8) chosen.push_back(0);
    while (chosen.size() < c.topk) {
      const int32_t e = pool[rng() % pool.size()];
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);  // expert 0 in any slot
    std::copy(chosen.begin(), chosen.end(), ids.begin() + static_cast<std::ptrdiff_t>(t * c.topk));
  }
  return ids;
}

// Rows rank d receives: the pairs of every rank whose expert it owns.
uint64_t rowsFor(const MoeCase& c, uint32_t d, uint32_t n, uint64_t seed) {
  const uint64_t L = c.experts / n;
  uint64_t rows = 0;
  for (uint32_t s = 0; s < n; ++s) {
    for (int32_t e : routeIds(c, s, seed)) rows += static_cast<uint64_t>(e) / L == d ? 1 : 0;
  }
  return rows;
}

OpDescriptor descriptorOf(const MoeCase& c, uint32_t r, uint32_t n, uint64_t seed) {
  ref::OpShape shape;
  shape.kind = c.kind;
  shape.dtype = c.dtype;
  shape.m = tokensOf(c, r);
  shape.n = c.n;
  shape.k = c.hidden;
  shape.experts = c.experts;
  shape.topk = c.topk;
  shape.weightDtype = c.weightDtype;
  OpDescriptor d = ref::makeDescriptor(shape, r, n);
  if (c.kind == OpKind::kMoeDispatchGemm) {
    uint64_t all = 0;
    for (uint32_t q = 0; q < n; ++q) all += tokensOf(c, q) * c.topk;
    uint64_t capacity = std::max<uint64_t>(all, 1);
    if (r == 0 && c.capacityDelta != 0) {
      capacity = static_cast<uint64_t>(static_cast<int64_t>(rowsFor(c, 0, n, seed)) + c.capacityDelta);
    }
    d.dims[dim::kCapacity] = capacity;
    d.bufs[slot::kMoeOut].bytes = capacity * c.n * tandem::dtypeSize(c.dtype);
    d.bufs[slot::kRowInfo].bytes = capacity * 16;
  }
  return d;
}

std::vector<OpDescriptor> descriptorsOf(const MoeCase& c, uint32_t n, uint64_t seed) {
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(descriptorOf(c, q, n, seed));
  return v;
}

// One op as one rank runs it (RankBuffers), with the case's routing in every rank's topk_ids.
struct RankOp : RankBuffers {
  RankOp(tandem_session_t s, const MoeCase& c, uint32_t r, uint32_t n, uint64_t seed, bool reference)
      : RankBuffers(s, descriptorsOf(c, n, seed), r, seed, reference, [&](uint32_t q, RankSlots& slots) {
          const std::vector<int32_t> ids = routeIds(c, q, seed);
          if (!ids.empty()) std::memcpy(slots[slot::kTopkIds].data(), ids.data(), ids.size() * 4);
        }) {}

  tandem_status_t submit(tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) const {
    return submitOp(desc(), [this](int s) { return tensor(s); }, comm, stream, op);
  }
};

// One rank: runs every case, checks it against the reference, then `repeats` - 1 more times bitwise alike.
std::string moeRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                    const std::vector<MoeCase>& cases, int repeats) {
  Joined j(socket, id, nranks, rank);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i]);
    RankOp op(j.s, cases[i], rank, nranks, 4242 + i, true);
    std::vector<std::vector<std::byte>> first;
    for (int rep = 0; rep < repeats; ++rep) {
      op.poison(j.stream);
      tandem_op_t h;
      if (op.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS)
        return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
      if (std::string e = finishOp(j.stream, h); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      op.download();
      if (rep == 0) {
        if (std::string e = op.compare(); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
        first = op.outputBytes();
      } else if (op.outputBytes() != first) {
        return fmt::format("FAIL {}: run {} differs from run 0 (the op must be bitwise repeatable)", what, rep);
      }
    }
  }
  return "OK";
}

void runRanks(const Daemon& d, uint32_t nranks, const std::vector<MoeCase>& cases, int repeats) {
  runRankProcesses(d, nranks, 400000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return moeRank(d.socket(), id, nranks, r, cases, repeats);
  });
}

std::string listCases(const std::vector<MoeCase>& cases) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  return o.str();
}

// experts must be divisible by every rank count used (1, 2, 4).
std::vector<MoeCase> casesFor(OpKind kind) {
  const DType bf16 = DType::kBF16;
  const bool gemm = kind == OpKind::kMoeDispatchGemm;
  std::vector<MoeCase> v;
  v.push_back({kind, bf16, {96}, 264, gemm ? 200u : 72u, 8, 2, Routing::kUniform});
  v.push_back({kind, DType::kF16, {130, 0}, 136, gemm ? 264u : 136u, 8, 1, Routing::kUniform});  // a rank of no tokens
  v.push_back({kind, bf16, {200, 57}, 520, gemm ? 136u : 264u, 16, 8, Routing::kSkewed});
  v.push_back({kind, bf16, {150}, 72, 40, 12, 4, Routing::kSparse});  // experts 1, 4, 7, 10 get no rows
  v.push_back({kind, DType::kF16, {300, 40}, 264, gemm ? 520u : 200u, 4, 3, Routing::kSkewed});
  v.push_back({kind, bf16, {1, 5}, 8, 8, 4, 1, Routing::kUniform});
  return v;
}

// The MoE ops with FP8 weights (e4m3, 128 x 128 block scales; x, and the FFN's h, quantised per 1 x 128 block): hidden
// a multiple of 16 (one case off the 128 blocks: a partial last block of x's scales and of w's k-blocks); the FFN's
// ffn of 128, dispatch+GEMM's n_out of 8 (off the 128 blocks: a partial last row block of w_scale, and one below a
// block); uneven and skewed routing, a rank with no tokens, top-k 1 to 8, DeepSeek-V3's ffn/hidden ratio in small;
// dispatch+GEMM also with rows of out past its routed rows (capacity above them), which stay untouched.
std::vector<MoeCase> fp8Cases(OpKind kind) {
  const DType bf16 = DType::kBF16, e4m3 = DType::kF8E4M3;
  std::vector<MoeCase> v;
  if (kind == OpKind::kMoeDispatchGemm) {
    v.push_back({kind, bf16, {96}, 256, 200, 8, 2, Routing::kUniform, 0, e4m3});
    v.push_back({kind, bf16, {130, 0}, 384, 136, 8, 1, Routing::kUniform, 0, e4m3});  // a rank of no tokens
    v.push_back({kind, bf16, {200, 57}, 528, 264, 16, 8, Routing::kSkewed, 5, e4m3});
    v.push_back({kind, bf16, {150}, 208, 40, 12, 4, Routing::kSparse, 0, e4m3});  // hidden off the 128 blocks
    v.push_back({kind, bf16, {1, 5}, 128, 128, 4, 1, Routing::kUniform, 0, e4m3});
    return v;
  }
  v.push_back({kind, bf16, {96}, 256, 128, 8, 2, Routing::kUniform, 0, e4m3});
  v.push_back({kind, bf16, {130, 0}, 384, 256, 8, 1, Routing::kUniform, 0, e4m3});  // a rank of no tokens
  v.push_back({kind, bf16, {200, 57}, 528, 128, 16, 8, Routing::kSkewed, 0, e4m3});
  v.push_back({kind, bf16, {150}, 208, 128, 12, 4, Routing::kSparse, 0, e4m3});  // hidden off the 128 blocks
  v.push_back({kind, bf16, {1, 5}, 128, 128, 4, 1, Routing::kUniform, 0, e4m3});
  return v;
}

// Every case of `kind` at 1, 2 and 4 ranks on a tandemd with `executor`, 20 runs each (`fp8`: fp8Cases(kind)).
void runOp(OpKind kind, const std::string& executor, std::vector<uint32_t> rankCounts, bool fp8 = false) {
  Daemon d(config(executor), {}, "");
  REQUIRE(status(d)["executor"] == executor);
  for (uint32_t n : rankCounts) {
    const auto cases = fp8 ? fp8Cases(kind) : casesFor(kind);
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s), executor " << executor << ", MPS "
              << std::string(mpsRunning() ? "on" : "off") << ":" << listCases(cases));
    runRanks(d, n, cases, 20);
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

// A case whose op fails on the GPU: every rank's op must fail naming `needle` and write nothing; then a correct op on
// the same communicator must pass (a data error fails the op, not the communicator), on `executor`.
void runFailing(
    const MoeCase& c, uint32_t nranks, const std::string& needle,
    const std::function<void(std::vector<std::array<std::vector<std::byte>, tandem::kMaxOpBuffers>>&)>& corrupt = {},
    const std::string& executor = "client") {
  Daemon d(config(executor), {}, "");
  REQUIRE(status(d)["executor"] == executor);
  runRankProcesses(d, nranks, 120000, [&](const tandem_unique_id_t& id, uint32_t r) -> std::string {
    Joined j(d.socket(), id, nranks, r);
    RankOp op(j.s, c, r, nranks, 77, false);
    if (corrupt) {
      corrupt(op.host);
      op.upload(slot::kTopkIds);
    }
    op.poison(j.stream);
    tandem_op_t h;
    if (op.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) return std::string("FAIL submit: ") + tandem_last_error();
    const std::string synced = syncWithin(j.stream, 60000);
    if (synced != "synced") return "FAIL stream " + synced;
    const tandem_status_t st = tandem_wait(h, 60000);
    const std::string msg = tandem_last_error();
    if (st == TANDEM_SUCCESS || msg.find(needle) == std::string::npos) {
      return fmt::format("FAIL status {} message '{}' (want '{}' in it)", static_cast<int>(st), msg, needle);
    }
    op.download();
    if (std::string e = op.untouched(); !e.empty()) return "FAIL after the error: " + e;
    // The communicator lives on: the next op, a correct one, runs and matches the reference.
    MoeCase good = c;
    good.capacityDelta = 0;
    RankOp next(j.s, good, r, nranks, 78, true);
    next.poison(j.stream);
    if (next.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) {
      return std::string("FAIL the op after the error: submit: ") + tandem_last_error();
    }
    if (std::string e = finishOp(j.stream, h); !e.empty()) return "FAIL the op after the error: " + e;
    next.download();
    if (std::string e = next.compare(); !e.empty()) return "FAIL the op after the error: " + e;
    return "OK";
  });
}

}  // namespace

TEST_CASE(
    "moe-dispatch-gemm, client executor: matches the reference exactly in layout at 1, 2 and 4 ranks, 20 runs "
    "bitwise identical") {
  runOp(OpKind::kMoeDispatchGemm, "client", {1, 2, 4});
}

TEST_CASE(
    "moe-dispatch-ffn-combine, client executor: matches the reference at 1, 2 and 4 ranks, 20 runs bitwise "
    "identical") {
  runOp(OpKind::kMoeDispatchFfnCombine, "client", {1, 2, 4});
}

TEST_CASE(
    "moe-dispatch-ffn-combine with FP8 weights, client executor: matches the reference of the quantised layer at 1, 2 "
    "and 4 ranks, 20 runs bitwise identical") {
  runOp(OpKind::kMoeDispatchFfnCombine, "client", {1, 2, 4}, true);
}

TEST_CASE(
    "moe-dispatch-gemm with FP8 weights, client executor: matches the reference of the quantised op exactly in layout "
    "at 1, 2 and 4 ranks, 20 runs bitwise identical") {
  runOp(OpKind::kMoeDispatchGemm, "client", {1, 2, 4}, true);
}

TEST_CASE("moe ops, daemon executor (MPS): match the reference, 20 runs bitwise identical" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  std::vector<uint32_t> counts{1};
  if (gpuCount() >= 2) counts.push_back(2);  // the daemon executor runs one rank per GPU
  runOp(OpKind::kMoeDispatchGemm, "daemon", counts);
  runOp(OpKind::kMoeDispatchFfnCombine, "daemon", counts);
  runOp(OpKind::kMoeDispatchFfnCombine, "daemon", counts, true);
  runOp(OpKind::kMoeDispatchGemm, "daemon", counts, true);
}

namespace {

// A capacity overflow at every rank count `executor` can run here (the daemon's: one rank per GPU).
void runCapacityOverflow(const std::string& executor) {
  for (uint32_t n : {1u, 2u, 4u}) {
    if (ranksFor(executor, n) != n) continue;
    CAPTURE(n);
    MoeCase c{OpKind::kMoeDispatchGemm, DType::kBF16, {64, 48}, 64, 32, 4, 2, Routing::kSkewed, -1};
    const uint64_t rows = rowsFor(c, 0, n, 77);
    runFailing(c, n,
               fmt::format("rank 0 receives {} rows but capacity is {}; pass capacity >= {}", rows, rows - 1, rows),
               {}, executor);
  }
}

// A bad expert id on rank 1 of 2.
void runBadExpertId(const std::string& executor) {
  MoeCase c{OpKind::kMoeDispatchFfnCombine, DType::kBF16, {16}, 64, 32, 4, 2, Routing::kUniform};
  runFailing(c, 2, "rank 1 topk_ids[5][1] = 9 is out of range", [](auto& host) {
    auto& ids = host[1][slot::kTopkIds];
    const int32_t bad = 9;
    std::memcpy(ids.data() + (5 * 2 + 1) * 4, &bad, 4);
  }, executor);
}

}  // namespace

TEST_CASE(
    "moe-dispatch-gemm, client executor: a capacity overflow fails every rank's op naming the rows needed and writes "
    "nothing; the next op on the communicator runs") {
  runCapacityOverflow("client");
}

TEST_CASE(
    "moe-dispatch-gemm, daemon executor (MPS): a capacity overflow fails every rank's op naming the rows needed and "
    "writes nothing; the next op on the communicator runs" * doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  runCapacityOverflow("daemon");
}

TEST_CASE("moe ops, client executor: a bad expert id fails every rank's op naming it and writes nothing; the next op "
          "runs") {
  runBadExpertId("client");
}

TEST_CASE("moe ops, daemon executor (MPS): a bad expert id fails every rank's op naming it and writes nothing; the "
          "next op runs" * doctest::test_suite(kNeedsMpsTwoGpus)) {
  if (skipWithoutMps()) return;
  if (ranksFor("daemon", 2) < 2) return skipCase("the daemon executor runs one rank per GPU: this case needs 2 GPUs");
  runBadExpertId("daemon");
}

TEST_CASE("moe ops: what the cuda backend cannot run is refused before submission, and the communicator lives on") {
  Daemon d(config("client"), {}, "");
  const uint32_t n = 2;
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < n; ++r) {
    ranks.push_back(spawn([&, r](const Io&) -> std::string {
      Joined j(d.socket(), id, n, r);
      tandem_buffer_t a, b, c;
      TK(tandem_alloc(j.s, 16u << 20, &a));
      TK(tandem_alloc(j.s, 16u << 20, &b));
      TK(tandem_alloc(j.s, 16u << 20, &c));
      std::string report;
      const auto expect = [&](const char* what, tandem_status_t got, tandem_status_t want, const char* needle) {
        std::string msg = tandem_last_error();
        if (got != want || msg.find(needle) == std::string::npos) {
          std::replace(msg.begin(), msg.end(), '\n', ' ');  // the rank reports one line
          report += fmt::format(" | {}: status {} (want {}), message '{}' (want '{}' in it)", what,
                                static_cast<int>(got), static_cast<int>(want), msg, needle);
        }
      };
      const auto args = [&](tandem_dtype_t dt, uint64_t hidden, uint64_t nOut, uint64_t experts, uint64_t topk,
                            uint64_t xOffset) {
        return tandem_moe_dispatch_gemm_args_t{sizeof(tandem_moe_dispatch_gemm_args_t),
                                               dt,
                                               8,
                                               hidden,
                                               nOut,
                                               experts,
                                               topk,
                                               64,
                                               {a, xOffset},
                                               {b, 0},
                                               {b, 1u << 20},
                                               {c, 0},
                                               {c, 12u << 20},
                                               {a, 8u << 20},
                                               {b, 8u << 20},
                                               j.stream,
                                               TANDEM_DTYPE_INVALID,
                                               {}};
      };
      tandem_op_t op;
      auto m = args(TANDEM_DTYPE_BF16, 60, 64, 4, 2, 0);
      expect("hidden not a multiple of 8", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_INVALID_ARGUMENT,
             "multiple of 8");
      m = args(TANDEM_DTYPE_BF16, 64, 60, 4, 2, 0);
      expect("n_out not a multiple of 8", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_INVALID_ARGUMENT,
             "multiple of 8");
      m = args(TANDEM_DTYPE_FP32, 64, 64, 4, 2, 0);
      expect("fp32", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_UNSUPPORTED, "bf16 or fp16");
      m = args(TANDEM_DTYPE_BF16, 64, 64, 4, 2, 8);
      expect("x misaligned", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_INVALID_ARGUMENT,
             "16-byte aligned");
      m = args(TANDEM_DTYPE_BF16, 64, 64, 64, 33, 0);
      expect("topk 33", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_INVALID_ARGUMENT, "topk");
      m = args(TANDEM_DTYPE_BF16, 64, 64, 2048, 2, 0);
      expect("2048 experts", tandem_moe_dispatch_gemm(j.comm, &m, &op), TANDEM_ERROR_INVALID_ARGUMENT, "experts");
      const tandem_moe_ffn_args_t f{
          sizeof f,      TANDEM_DTYPE_BF16, 8,       64, 12, 4, 2, {a, 0}, {b, 0}, {b, 1u << 20}, {c, 0},
          {c, 4u << 20}, {a, 8u << 20},     j.stream, 0, {}, TANDEM_DTYPE_INVALID, {}, {}};
      expect("ffn not a multiple of 8", tandem_moe_dispatch_ffn_combine(j.comm, &f, &op), TANDEM_ERROR_INVALID_ARGUMENT,
             "multiple of 8");
      // FP8 weights: ffn off the 128-row scale blocks, hidden off 16 bytes, a missing scale, a non-bf16 x.
      const auto fp8 = [&](tandem_dtype_t dt, uint64_t hidden, uint64_t ffn, bool scales) {
        return tandem_moe_ffn_args_t{sizeof(tandem_moe_ffn_args_t), dt, 8, hidden, ffn, 4, 2, {a, 0}, {b, 0},
                                     {b, 1u << 20}, {c, 0}, {c, 4u << 20}, {a, 8u << 20}, j.stream, 0, {},
                                     TANDEM_DTYPE_FP8_E4M3, {scales ? b : nullptr, scales ? 2u << 20 : 0},
                                     {b, 3u << 20}};
      };
      auto g = fp8(TANDEM_DTYPE_BF16, 128, 64, true);
      expect("FP8 ffn not a multiple of 128", tandem_moe_dispatch_ffn_combine(j.comm, &g, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "ffn = 64 must be a multiple of 128 with FP8 weights");
      g = fp8(TANDEM_DTYPE_BF16, 136, 128, true);
      expect("FP8 hidden not a multiple of 16", tandem_moe_dispatch_ffn_combine(j.comm, &g, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "hidden = 136 must be a multiple of 16 with FP8 weights");
      g = fp8(TANDEM_DTYPE_BF16, 128, 128, false);
      expect("FP8 without w1_scale", tandem_moe_dispatch_ffn_combine(j.comm, &g, &op), TANDEM_ERROR_INVALID_ARGUMENT,
             "tensor w1_scale is required");
      g = fp8(TANDEM_DTYPE_FP16, 128, 128, true);
      expect("FP8 weights with fp16 x", tandem_moe_dispatch_ffn_combine(j.comm, &g, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "w_dtype fp8-e4m3 needs dtype bf16");
      // Dispatch+GEMM with FP8 weights: hidden off 16 bytes, a missing w_scale, a non-bf16 x.
      const auto fp8Gemm = [&](tandem_dtype_t dt, uint64_t hidden, bool scale) {
        auto v = args(dt, hidden, 64, 4, 2, 0);
        v.w_dtype = TANDEM_DTYPE_FP8_E4M3;
        v.w_scale = {scale ? b : nullptr, scale ? 2u << 20 : 0};
        return v;
      };
      m = fp8Gemm(TANDEM_DTYPE_BF16, 136, true);
      expect("FP8 dispatch+GEMM hidden not a multiple of 16", tandem_moe_dispatch_gemm(j.comm, &m, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "hidden = 136 must be a multiple of 16 with FP8 weights");
      m = fp8Gemm(TANDEM_DTYPE_BF16, 128, false);
      expect("FP8 dispatch+GEMM without w_scale", tandem_moe_dispatch_gemm(j.comm, &m, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "w_scale");
      m = fp8Gemm(TANDEM_DTYPE_FP16, 128, true);
      expect("FP8 dispatch+GEMM with fp16 x", tandem_moe_dispatch_gemm(j.comm, &m, &op),
             TANDEM_ERROR_INVALID_ARGUMENT, "w_dtype fp8-e4m3 needs dtype bf16");
      report += [&]() -> std::string {
        // Nothing was submitted: the communicator still runs an op (an MoE op, checked).
        const MoeCase ok{OpKind::kMoeDispatchGemm, DType::kBF16, {32}, 64, 64, 4, 2, Routing::kUniform};
        RankOp good(j.s, ok, r, n, 5, true);
        good.poison(j.stream);
        tandem_op_t h;
        if (good.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS)
          return std::string(" | valid op: ") + tandem_last_error();
        if (std::string e = finishOp(j.stream, h); !e.empty()) return " | valid op: " + e;
        good.download();
        if (std::string e = good.compare(); !e.empty()) return " | valid op: " + e;
        return "";
      }();
      TK(tandem_free(a));
      TK(tandem_free(b));
      TK(tandem_free(c));
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
