// The MoE FFN's backward (moe-ffn-backward) on the cuda backend end to end: real rank processes run it through
// libtandem at 1, 2 and 4 ranks (ranks share the GPUs round robin, so one GPU serves them all) and check its four
// outputs (dx, dtopk_weights, dw1, dw2) against the fp64 reference of tandem.h's math (common/reference.hpp, the one the
// cpu backend is checked against), each case 3 times bitwise identical: uniform, skewed (80% of the tokens to expert 0)
// and sparse routings (a third of the experts receive no row: their dw1 and dw2 must be exactly zero), ranks of 0 to
// 300 tokens, top-k 1 to 4, bf16 and fp16. Then a bad expert id (every rank's op fails naming it, dx and
// dtopk_weights untouched) followed by a correct op on the same communicator, and the daemon executor (under MPS).
// Saved activations: the forward (moe-dispatch-ffn-combine) with saved, checked against the reference (out and the
// saved gate|up rows), then the backward from that saved tensor, checked against the recomputing backward's reference
// and repeated bitwise; a saved tensor too small for the rows fails both ops alone, and the communicator goes on.
#include <algorithm>
#include <cstdio>
#include <random>
#include <sstream>
#include <vector>

#include "rank_buffers.hpp"
#include "submit_op.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

enum class Routing { kUniform, kSkewed, kSparse };

const char* routingName(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kSparse: return "sparse";
  }
  return "?";
}

struct BwdCase {
  DType dtype = DType::kBF16;
  std::vector<uint64_t> tokens;  // rank r has tokens[r % size]
  uint64_t hidden = 0, ffn = 0, experts = 0, topk = 0;
  Routing routing = Routing::kUniform;
};

std::string describe(const BwdCase& c) {
  std::string ts;
  for (uint64_t t : c.tokens) ts += (ts.empty() ? "" : "/") + std::to_string(t);
  return fmt::format("moe-ffn-backward {} tokens={} hidden={} ffn={} experts={} topk={} {}",
                     tandem::dtypeName(c.dtype), ts, c.hidden, c.ffn, c.experts, c.topk, routingName(c.routing));
}

uint64_t tokensOf(const BwdCase& c, uint32_t r) { return c.tokens[r % c.tokens.size()]; }

// The experts a sparse routing never names.
bool unrouted(const BwdCase& c, uint64_t e) { return c.routing == Routing::kSparse && e % 3 == 1; }

// Rank r's expert ids: distinct per token, drawn by the routing from (seed, r).
std::vector<int32_t> routeIds(const BwdCase& c, uint32_t r, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + r);
  const uint64_t tokens = tokensOf(c, r);
  std::vector<int32_t> ids(tokens * c.topk);
  std::vector<int32_t> pool;
  for (uint64_t e = 0; e < c.experts; ++e) {
    if (!unrouted(c, e)) pool.push_back(static_cast<int32_t>(e));
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

// Every rank's descriptor of `kind` (the backward, or the forward of a saved-activations case); savedRows: each
// rank's saved rows (0: none).
std::vector<OpDescriptor> descriptorsOf(const BwdCase& c, uint32_t n, OpKind kind = OpKind::kMoeFfnBackward,
                                        uint64_t savedRows = 0) {
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) {
    ref::OpShape shape;
    shape.kind = kind;
    shape.savedRows = savedRows;
    shape.dtype = c.dtype;
    shape.m = tokensOf(c, q);
    shape.n = c.ffn;
    shape.k = c.hidden;
    shape.experts = c.experts;
    shape.topk = c.topk;
    v.push_back(ref::makeDescriptor(shape, q, n));
  }
  return v;
}

// One op as one rank runs it (RankBuffers), with the case's routing in every rank's topk_ids.
struct RankOp : RankBuffers {
  RankOp(tandem_session_t s, const BwdCase& c, uint32_t r, uint32_t n, uint64_t seed, bool reference,
         OpKind kind = OpKind::kMoeFfnBackward, uint64_t savedRows = 0)
      : RankBuffers(s, descriptorsOf(c, n, kind, savedRows), r, seed, reference, [&](uint32_t q, RankSlots& slots) {
          const std::vector<int32_t> ids = routeIds(c, q, seed);
          if (!ids.empty()) std::memcpy(slots[slot::kTopkIds].data(), ids.data(), ids.size() * 4);
        }) {}

  // `saved`: the tensor to pass as the backward's saved (the forward's); {} keeps the op's own slots.
  tandem_status_t submit(tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op,
                         tandem_tensor_t saved = {}) const {
    return submitOp(
        desc(),
        [this, saved](int s) {
          return s == slot::kMoeBwdSaved && desc().kind == OpKind::kMoeFfnBackward && saved.buffer != nullptr
                     ? saved
                     : tensor(s);
        },
        comm, stream, op);
  }
};

// Every rank's routed rows at most: each rank's saved tensor holds that many.
uint64_t worstRows(const BwdCase& c, uint32_t n) {
  uint64_t rows = 0;
  for (uint32_t q = 0; q < n; ++q) rows += tokensOf(c, q) * c.topk;
  return std::max<uint64_t>(rows, 1);
}

// The backward rounds gate|up and d(gate|up) to the dtype and each slot's dx before the sum (tandem.h): at fp16's
// 2e-3 that leaves too little room, so fp16 gets twice it; bf16 keeps its 1e-2.
double toleranceOf(const BwdCase& c) { return c.dtype == DType::kF16 ? 4e-3 : 0; }

// "" or which unrouted expert of this rank got a non-zero weight gradient (they must be exactly zero).
std::string emptyExpertsZero(const BwdCase& c, const RankOp& op, uint32_t rank, uint32_t n) {
  const uint64_t L = c.experts / n, es = tandem::dtypeSize(c.dtype);
  const uint64_t w1 = 2 * c.ffn * c.hidden * es, w2 = c.hidden * c.ffn * es;
  for (uint64_t le = 0; le < L; ++le) {
    if (!unrouted(c, rank * L + le)) continue;
    for (const auto& [s, bytes] : {std::pair{slot::kMoeDw1, w1}, std::pair{slot::kMoeDw2, w2}}) {
      const auto& h = op.host[rank][static_cast<std::size_t>(s)];
      const auto first = h.begin() + static_cast<std::ptrdiff_t>(le * bytes);
      if (std::any_of(first, first + static_cast<std::ptrdiff_t>(bytes), [](std::byte b) { return b != std::byte{0}; })) {
        return fmt::format("expert {} received no row but its {} is not zero", rank * L + le,
                           s == slot::kMoeDw1 ? "dw1" : "dw2");
      }
    }
  }
  return "";
}

// One rank: runs every case, checks it against the reference, then `repeats` - 1 more times bitwise alike.
std::string bwdRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                    const std::vector<BwdCase>& cases, int repeats) {
  Joined j(socket, id, nranks, rank);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i]);
    RankOp op(j.s, cases[i], rank, nranks, 5151 + i, true);
    std::vector<std::vector<std::byte>> first;
    for (int rep = 0; rep < repeats; ++rep) {
      op.poison(j.stream);
      tandem_op_t h;
      if (op.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
      }
      if (std::string e = finishOp(j.stream, h); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      op.download();
      if (rep == 0) {
        if (std::string e = op.compare(toleranceOf(cases[i])); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
        if (std::string e = emptyExpertsZero(cases[i], op, rank, nranks); !e.empty()) {
          return fmt::format("FAIL {}: {}", what, e);
        }
        first = op.outputBytes();
      } else if (op.outputBytes() != first) {
        return fmt::format("FAIL {}: run {} differs from run 0 (the op must be bitwise repeatable)", what, rep);
      }
    }
  }
  return "OK";
}

// One rank, saved activations: per case the forward with saved (out and saved against the reference), then the
// backward from it (against the recomputing backward's reference), `repeats` runs bitwise alike; the recomputing
// backward runs beside it, and whether the two agree bit for bit is reported (tandem.h promises the same math).
std::string savedRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                      const std::vector<BwdCase>& cases, int repeats) {
  Joined j(socket, id, nranks, rank);
  std::string bitwise;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const BwdCase& c = cases[i];
    const std::string what = describe(c) + " (saved activations)";
    const uint64_t seed = 6161 + i, rows = worstRows(c, nranks);
    RankOp fwd(j.s, c, rank, nranks, seed, true, OpKind::kMoeDispatchFfnCombine, rows);
    RankOp bwd(j.s, c, rank, nranks, seed, false, OpKind::kMoeFfnBackward, rows);
    RankOp plain(j.s, c, rank, nranks, seed, true);
    bwd.want = plain.want;  // the same inputs (same seed and slots): the recomputing backward's reference
    tandem_op_t h;
    fwd.poison(j.stream);
    if (fwd.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) {
      return fmt::format("FAIL {}: forward submit: {}", what, tandem_last_error());
    }
    if (std::string e = finishOp(j.stream, h); !e.empty()) return fmt::format("FAIL {} forward: {}", what, e);
    fwd.download();
    if (std::string e = fwd.compare(toleranceOf(c)); !e.empty()) return fmt::format("FAIL {} forward: {}", what, e);
    plain.poison(j.stream);
    if (plain.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) {
      return fmt::format("FAIL {}: recomputing backward submit: {}", what, tandem_last_error());
    }
    if (std::string e = finishOp(j.stream, h); !e.empty()) return fmt::format("FAIL {} recomputing: {}", what, e);
    plain.download();
    std::vector<std::vector<std::byte>> first;
    for (int rep = 0; rep < repeats; ++rep) {
      bwd.poison(j.stream);
      if (bwd.submit(j.comm, j.stream, &h, fwd.tensor(slot::kFfnSaved)) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
      }
      if (std::string e = finishOp(j.stream, h); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      bwd.download();
      if (rep == 0) {
        if (std::string e = bwd.compare(toleranceOf(c)); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
        if (std::string e = emptyExpertsZero(c, bwd, rank, nranks); !e.empty()) {
          return fmt::format("FAIL {}: {}", what, e);
        }
        first = bwd.outputBytes();
        if (first != plain.outputBytes()) bitwise += fmt::format("\n  {}: differs from the recomputing backward", what);
      } else if (bwd.outputBytes() != first) {
        return fmt::format("FAIL {}: run {} differs from run 0 (the op must be bitwise repeatable)", what, rep);
      }
    }
  }
  return bitwise.empty() ? "OK" : "OK (not bitwise the recomputing backward's:" + bitwise + ")";
}

// Saved tensors one row short of rank 0's rows: the forward and the backward fail alone naming the rows, write
// nothing, and the next ops (with room) run.
std::string savedTooSmallRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank) {
  const BwdCase c{DType::kBF16, {16}, 64, 32, 4, 2, Routing::kSkewed};
  Joined j(socket, id, 2, rank);
  // Rank 0's rows (experts 0 and 1), from every rank's ids.
  uint64_t rows = 0;
  for (uint32_t q = 0; q < 2; ++q) {
    for (int32_t e : routeIds(c, q, 88)) rows += e < 2 ? 1 : 0;
  }
  for (OpKind kind : {OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    RankOp op(j.s, c, rank, 2, 88, false, kind, rows - 1);
    const std::string needle = fmt::format("{}: rank 0 receives {} rows but its saved tensor holds saved_rows = {}",
                                           tandem::opKindName(kind), rows, rows - 1);
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
    if (std::string e = op.untouched(); !e.empty()) return fmt::format("FAIL {} after the error: {}", needle, e);
  }
  RankOp fwd(j.s, c, rank, 2, 89, true, OpKind::kMoeDispatchFfnCombine, worstRows(c, 2));
  fwd.poison(j.stream);
  tandem_op_t h;
  if (fwd.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) {
    return std::string("FAIL next submit: ") + tandem_last_error();
  }
  if (std::string e = finishOp(j.stream, h); !e.empty()) return "FAIL the op after the errors: " + e;
  fwd.download();
  if (std::string e = fwd.compare(); !e.empty()) return "FAIL the op after the errors: " + e;
  return "OK";
}

std::string listCases(const std::vector<BwdCase>& cases) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  return o.str();
}

// experts divisible by every rank count used (1, 2, 4); hidden and ffn multiples of 8, not of the GEMM tiles.
std::vector<BwdCase> cases() {
  const DType bf16 = DType::kBF16, fp16 = DType::kF16;
  return {
      {bf16, {96}, 264, 72, 8, 2, Routing::kUniform},
      {fp16, {130, 0}, 136, 136, 8, 1, Routing::kUniform},  // a rank of no tokens
      {bf16, {200, 57}, 264, 136, 16, 4, Routing::kSkewed},
      {bf16, {150}, 72, 40, 12, 4, Routing::kSparse},      // experts 1, 4, 7, 10 receive no row
      {fp16, {300, 40}, 264, 200, 4, 3, Routing::kSkewed},
      {fp16, {1, 5, 0, 17}, 8, 8, 4, 1, Routing::kSparse},  // expert 1 receives no row; ranks of 0 and 1 token
  };
}

// Every case at each rank count on a tandemd with `executor`, 3 runs each; `saved`: with saved activations.
void runCases(const std::string& executor, const std::vector<uint32_t>& rankCounts, bool saved = false) {
  Daemon d(config(executor), {}, "");
  REQUIRE(status(d)["executor"] == executor);
  const std::vector<BwdCase> all = cases();
  for (uint32_t n : rankCounts) {
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s), executor " << executor << ", MPS "
              << std::string(mpsRunning() ? "on" : "off") << (saved ? ", saved activations" : "") << ":"
              << listCases(all));
    runRankProcesses(d, n, 600000, [&](const tandem_unique_id_t& id, uint32_t r) {
      if (!saved) return bwdRank(d.socket(), id, n, r, all, 3);
      std::string result = savedRank(d.socket(), id, n, r, all, 3);
      if (result.rfind("OK (", 0) == 0) {  // passed; the difference from the recomputing path is worth seeing
        std::fprintf(stderr, "rank %u: %s\n", r, result.c_str());
        result = "OK";
      }
      return result;
    });
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

// A bad expert id on rank 1 of 2: every rank's op fails naming it, writes neither dx nor dtopk_weights, and the next
// op on the communicator runs and matches the reference.
void runBadExpertId(const std::string& executor) {
  const BwdCase c{DType::kBF16, {16}, 64, 32, 4, 2, Routing::kUniform};
  const std::string needle = "moe-ffn-backward: rank 1 topk_ids[5][1] = 9 is out of range";
  Daemon d(config(executor), {}, "");
  REQUIRE(status(d)["executor"] == executor);
  runRankProcesses(d, 2, 120000, [&](const tandem_unique_id_t& id, uint32_t r) -> std::string {
    Joined j(d.socket(), id, 2, r);
    RankOp op(j.s, c, r, 2, 77, false);
    if (r == 1) {
      const int32_t bad = 9;
      std::memcpy(op.mine()[slot::kTopkIds].data() + (5 * 2 + 1) * 4, &bad, 4);
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
    // Nothing written: the wgrad GEMM's gate (the routing state) keeps dw1 and dw2 too.
    for (int s : {slot::kMoeDx, slot::kMoeDtopkWeights, slot::kMoeDw1, slot::kMoeDw2}) {
      const auto& bytes = op.host[r][static_cast<std::size_t>(s)];
      if (std::any_of(bytes.begin(), bytes.end(), [](std::byte b) { return b != std::byte{0xFF}; })) {
        return fmt::format("FAIL after the error: slot {} was written", s);
      }
    }
    RankOp next(j.s, c, r, 2, 78, true);
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

TEST_CASE("moe-ffn-backward, client executor: dx, dtopk_weights, dw1 and dw2 match the reference at 1, 2 and 4 "
          "ranks, 3 runs bitwise identical") {
  runCases("client", {1, 2, 4});
}

TEST_CASE("moe-ffn-backward, client executor: a bad expert id fails every rank's op naming it, dx and dtopk_weights "
          "untouched; the next op runs") {
  runBadExpertId("client");
}

TEST_CASE("moe-ffn-backward with saved activations, client executor: the forward's saved gate|up gives the "
          "recomputing backward's results at 1, 2 and 4 ranks, 3 runs bitwise identical") {
  runCases("client", {1, 2, 4}, true);
}

TEST_CASE("moe ffn with saved activations, client executor: a saved tensor too small for the rows fails the forward "
          "and the backward alone, naming the rows; the next op runs") {
  Daemon d(config("client"), {}, "");
  runRankProcesses(d, 2, 120000,
                   [&](const tandem_unique_id_t& id, uint32_t r) { return savedTooSmallRank(d.socket(), id, r); });
}

TEST_CASE("moe-ffn-backward, daemon executor (MPS): matches the reference, 3 runs bitwise identical" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  std::vector<uint32_t> counts{1};
  if (gpuCount() >= 2) counts.push_back(2);  // the daemon executor runs one rank per GPU
  runCases("daemon", counts);
  runCases("daemon", counts, true);
}
