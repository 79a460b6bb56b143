// Ring attention on the cuda backend end to end: real rank processes run tandem_ring_attention through libtandem on
// one tandemd, and every output (and lse) is checked against the fp64 reference (common/reference.hpp) at 1, 2 and 4
// ranks (ranks share the GPUs round robin): causal and not, both layouts, bf16 and fp16, head_dim 64 and 128,
// sequence shards that are not tile multiples and differ per rank, a rank with no rows, scale 0 and a custom one,
// grouped-query attention (kv_heads 1 and 2 of 4 query heads).
// Outputs must repeat bit for bit over 20 runs and never hold a NaN.
#include <array>
#include <memory>
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

struct AttnCase {
  DType dtype;
  uint64_t heads, headDim;
  std::vector<uint64_t> seqs;  // rank r holds seqs[r % seqs.size()] rows
  bool causal;
  bool zigzag;
  float scale;       // 0: 1/sqrt(head_dim)
  bool lse = true;   // ask for lse
  int repeats = 1;   // runs after the first that must reproduce it bit for bit
  uint64_t kvHeads = 0;  // 0: heads
};

std::string describe(const AttnCase& c, uint32_t n) {
  std::string seqs;
  for (uint32_t r = 0; r < n; ++r) seqs += (r == 0 ? "" : "/") + std::to_string(c.seqs[r % c.seqs.size()]);
  return fmt::format("{} heads={} kv_heads={} hd={} seq={} {}{} scale={}{}", tandem::dtypeName(c.dtype), c.heads,
                     c.kvHeads == 0 ? c.heads : c.kvHeads, c.headDim, seqs, c.causal ? "causal" : "full",
                     c.zigzag ? " zigzag" : "", c.scale, c.lse ? "" : " (no lse)");
}

OpDescriptor descriptorOf(const AttnCase& c, uint32_t r, uint32_t n) {
  ref::OpShape shape;
  shape.kind = OpKind::kRingAttention;
  shape.dtype = c.dtype;
  shape.heads = c.heads;
  shape.headDim = c.headDim;
  shape.kvHeads = c.kvHeads;
  shape.causal = c.causal;
  shape.zigzag = c.zigzag;
  shape.seq = n;  // replaced below
  OpDescriptor d = ref::makeDescriptor(shape, r, n);
  const uint64_t seq = c.seqs[r % c.seqs.size()], es = tandem::dtypeSize(c.dtype);
  d.dims[dim::kSeq] = seq;
  d.scale = c.scale;
  const uint64_t kvHeads = c.kvHeads == 0 ? c.heads : c.kvHeads;
  for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut}) {
    const bool kv = s == slot::kKey || s == slot::kValue;
    d.bufs[static_cast<std::size_t>(s)].bytes = seq * (kv ? kvHeads : c.heads) * c.headDim * es;
  }
  d.bufs[slot::kAttnLse].bytes = c.lse ? c.heads * seq * 4 : 0;
  return d;
}

std::vector<OpDescriptor> descriptorsOf(const AttnCase& c, uint32_t n) {
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(descriptorOf(c, q, n));
  return v;
}

tandem_status_t submit(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  return tandem::gputest::submitOp(b.desc(), [&b](int s) { return b.tensor(s); }, comm, stream, op);
}

std::string attentionRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                          const std::vector<AttnCase>& cases) {
  Joined j(socket, id, nranks, rank);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i], nranks);
    RankBuffers rc(j.s, descriptorsOf(cases[i], nranks), rank, 5000 + i);
    tandem_op_t op;
    if (submit(rc, j.comm, j.stream, &op) != TANDEM_SUCCESS) {
      return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
    }
    if (std::string e = finishOp(j.stream, op); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    rc.download();
    const auto first = rc.outputBytes();
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
  return "OK";
}

void runRanks(const Daemon& d, uint32_t nranks, const std::vector<AttnCase>& cases) {
  runRankProcesses(d, nranks, 240000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return attentionRank(d.socket(), id, nranks, r, cases);
  });
}

// Shapes that are multiples of nothing (tiles are 128 query rows and 128 or 176 keys), a rank with no rows, both
// layouts, both dtypes and head sizes, the default and a custom scale; the first case repeats 20 times bitwise.
std::vector<AttnCase> casesFor(uint32_t n) {
  const DType bf16 = DType::kBF16, fp16 = DType::kF16;
  std::vector<AttnCase> v;
  v.push_back({bf16, 2, 128, {300, 177, 64, 251}, true, false, 0.0f, true, 20});
  v.push_back({bf16, 3, 128, {200, 329, 1, 130}, false, false, 0.0f});
  v.push_back({fp16, 2, 64, {257, 100, 190, 33}, true, true, 0.11f});
  v.push_back({bf16, 2, 64, {129, 0, 300, 77}, false, true, 0.0f, true, 20});
  v.push_back({fp16, 1, 128, {180, 260, 0, 150}, true, true, 0.0f, false});
  v.push_back({bf16, 2, 128, {333, 0, 128, 5}, true, false, 0.3f});
  if (n > 1) v.push_back({bf16, 2, 128, {0, 250, 99, 0}, true, true, 0.0f});  // rank 0 empty: the rest go on
  // Grouped-query attention: 4 query heads over 1 and 2 KV heads, both layouts, repeats bit for bit.
  v.push_back({bf16, 4, 128, {300, 177, 64, 251}, true, false, 0.0f, true, 20, 1});
  v.push_back({fp16, 4, 64, {257, 100, 190, 33}, false, true, 0.0f, true, 1, 2});
  v.push_back({bf16, 4, 128, {129, 0, 300, 77}, true, true, 0.0f, true, 1, 2});
  return v;
}

std::string listCases(const std::vector<AttnCase>& cases, uint32_t n) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c, n);
  return o.str();
}

}  // namespace

TEST_CASE("ring attention, client executor: matches the fp64 reference at 1, 2 and 4 ranks, 20 runs bitwise") {
  Daemon d(config("client"), {}, "");
  REQUIRE(status(d)["executor"] == "client");
  for (uint32_t n : {1u, 2u, 4u}) {
    CAPTURE(n);
    const auto cases = casesFor(n);
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s), MPS " << std::string(mpsRunning() ? "on" : "off") << ":"
              << listCases(cases, n));
    runRanks(d, n, cases);
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

// Under MPS tandemd refuses two ranks on one GPU with the daemon executor, so one GPU runs 1 rank here; every GPU
// count above 1 runs as many ranks as GPUs.
TEST_CASE("ring attention, daemon executor (MPS): matches the fp64 reference, one rank per GPU" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  for (uint32_t n = 1; n <= static_cast<uint32_t>(gpuCount()); n *= 2) {
    CAPTURE(n);
    runRanks(d, n, casesFor(n));
  }
}
