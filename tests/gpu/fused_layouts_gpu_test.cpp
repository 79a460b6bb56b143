// The fused GEMMs (ag-gemm, gemm-rs, gemm-ar) in every operand layout (NT, NN, TN) on the cuda backend end to end:
// real rank processes run them through libtandem and check every output against the fp64 reference
// (common/reference.hpp), in bf16 and fp16, at shapes off the tiles, at 1, 2 and 4 ranks sharing the GPUs. Then small M
// (the decode path: M = 1 .. 256 on the layouts core's swap-AB tiles with split-K), each op run 20 times and every run
// bitwise identical to the first; and NN / TN with the daemon executor (MPS).
#include <sstream>
#include <vector>

#include "rank_buffers.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::GemmOperands;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

// One op: kind, layout, dtype, global m, n and k (gemm-rs/ar: K split evenly over the ranks).
struct LayoutCase {
  OpKind kind;
  GemmOperands layout;
  DType dtype;
  uint64_t m, n, k;
};

std::string describe(const LayoutCase& c) {
  return fmt::format("{} {} {} m={} n={} k={}", tandem::opKindName(c.kind), tandem::gemmLayoutName(c.layout),
                     tandem::dtypeName(c.dtype), c.m, c.n, c.k);
}

std::vector<OpDescriptor> descriptorsOf(const LayoutCase& c, uint32_t n) {
  ref::OpShape shape;
  shape.kind = c.kind;
  shape.dtype = c.dtype;
  shape.m = c.m;
  shape.n = c.n;
  shape.k = c.k;
  shape.layout = c.layout;
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(ref::makeDescriptor(shape, q, n));
  return v;
}

tandem_status_t submit(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  const OpDescriptor& d = b.desc();
  const auto dtype = static_cast<tandem_dtype_t>(d.dtype);
  const auto layout = static_cast<tandem_gemm_layout_t>(tandem::gemmOperandsOf(d.flags));
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], k = d.dims[dim::kK];
  if (d.kind == OpKind::kAgGemm) {
    const tandem_ag_gemm_args_t a{sizeof a,          dtype,  m, n, k, b.tensor(slot::kA), b.tensor(slot::kB),
                                  b.tensor(slot::kC), b.tensor(slot::kAGathered), stream, layout};
    return tandem_ag_gemm(comm, &a, op);
  }
  if (d.kind == OpKind::kGemmRs) {
    const tandem_gemm_rs_args_t a{sizeof a, dtype,  m, n, k, b.tensor(slot::kA), b.tensor(slot::kB),
                                  b.tensor(slot::kC), stream, layout};
    return tandem_gemm_rs(comm, &a, op);
  }
  const tandem_gemm_ar_args_t a{sizeof a, dtype,  m, n, k, b.tensor(slot::kA), b.tensor(slot::kB), b.tensor(slot::kC),
                                stream, layout};
  return tandem_gemm_ar(comm, &a, op);
}

// One rank: joins and runs every case `repeats` times, the first checked against the reference, the others against
// the first bit for bit (every output slot: C, and ag-gemm's a_gathered).
std::string layoutRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                       const std::vector<LayoutCase>& cases, int repeats) {
  CK(cudaSetDevice(rankDevice(rank)));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, nranks, rank, 60000, &comm));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i]);
    RankBuffers b(s, descriptorsOf(cases[i], nranks), rank, 5000 + i);
    std::vector<std::vector<std::byte>> first;
    for (int rep = 0; rep < repeats; ++rep) {
      if (rep > 0) b.poison(stream);
      tandem_op_t op;
      if (submit(b, comm, stream, &op) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {} run {}: submit: {}", what, rep, tandem_last_error());
      }
      if (std::string e = finishOp(stream, op); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      b.download();
      std::vector<std::vector<std::byte>> outs;
      for (int sl : {slot::kC, slot::kAGathered}) {
        if (static_cast<std::size_t>(sl) < b.host[rank].size()) outs.push_back(b.host[rank][sl]);
      }
      if (rep == 0) {
        if (std::string e = b.compare(); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
        first = std::move(outs);
      } else if (outs != first) {
        return fmt::format("FAIL {}: run {} differs from run 0 (the result must be bitwise repeatable)", what, rep);
      }
    }
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

void runRanks(const Daemon& d, uint32_t nranks, const std::vector<LayoutCase>& cases, int repeats) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  MESSAGE(nranks << " rank(s) on " << gpuCount() << " GPU(s), " << repeats << " run(s) each:" << o.str());
  runRankProcesses(d, nranks, 600000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return layoutRank(d.socket(), id, nranks, r, cases, repeats);
  });
}

// Every op in every layout, bf16 and fp16, at shapes off the 128 x 256 x 64 tiles (TN: m a multiple of 8 x nranks,
// as every rank's [k, rows] shard of ag-gemm needs; the others any m), one shape of many tiles, and one row.
std::vector<LayoutCase> layoutCases(uint32_t nranks) {
  std::vector<LayoutCase> v;
  const uint64_t tnUnit = 8 * nranks;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    const uint64_t kUnit = kind == OpKind::kAgGemm ? 8 : 8 * nranks;  // every rank's k slice a multiple of 8
    for (GemmOperands l : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
      const bool tn = l == GemmOperands::kTN;
      v.push_back({kind, l, DType::kBF16, tn ? tnUnit * 38 : 300, 264, kUnit * 9});
      v.push_back({kind, l, DType::kF16, tn ? tnUnit * 97 : 777, 520, kUnit * 17});
      v.push_back({kind, l, DType::kBF16, 1536, 1024, 512});
      v.push_back({kind, l, DType::kBF16, tn ? tnUnit : 1, 8, kUnit});
    }
  }
  return v;
}

// Small M: the decode sizes, N x K large enough that the layouts core splits K (N = 1024 gives 8 swap-AB row tiles on
// 132 SMs), every layout, bf16 and fp16 alternately.
std::vector<LayoutCase> smallMCases(uint32_t nranks, const std::vector<OpKind>& kinds) {
  std::vector<LayoutCase> v;
  int i = 0;
  for (OpKind kind : kinds) {
    for (uint64_t m : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
      for (GemmOperands l : {GemmOperands::kNT, GemmOperands::kNN, GemmOperands::kTN}) {
        // TN stores A [k, m] (ag-gemm: each rank's [k, rows]): m a multiple of 8 x nranks, the rest skip it.
        if (l == GemmOperands::kTN && m % (kind == OpKind::kAgGemm ? 8 * nranks : 8) != 0) continue;
        v.push_back({kind, l, (i++ % 2 == 0) ? DType::kBF16 : DType::kF16, m, 1024, 2048});
      }
    }
  }
  return v;
}

const std::vector<OpKind> kAllKinds = {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr};

}  // namespace

TEST_CASE("fused GEMMs in every layout, client executor: match the fp64 reference at 1, 2 and 4 ranks") {
  Daemon d(config("client"), {}, "");
  for (uint32_t n : {1u, 2u, 4u}) runRanks(d, n, layoutCases(n), 1);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("fused GEMMs at small M (1 .. 256), client executor: match the reference, 20 runs bitwise identical") {
  Daemon d(config("client"), {}, "");
  runRanks(d, 1, smallMCases(1, kAllKinds), 20);
  runRanks(d, 2, smallMCases(2, kAllKinds), 20);
  runRanks(d, 4, smallMCases(4, {OpKind::kGemmAr}), 5);  // four ranks time-slice one GPU: fewer runs
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

namespace {
// The daemon executor runs one rank per GPU under MPS: 1 rank, or 2 ranks on two GPUs.
void runDaemonExecutor(uint32_t n) {
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  std::vector<LayoutCase> cases = layoutCases(n);
  const std::vector<LayoutCase> small = smallMCases(n, kAllKinds);
  for (std::size_t i = 0; i < small.size(); i += 4) cases.push_back(small[i]);
  runRanks(d, n, cases, 5);
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}
}  // namespace

TEST_CASE("fused GEMMs in every layout, daemon executor (MPS): match the reference at 1 rank, repeat bitwise" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  runDaemonExecutor(1);
}

TEST_CASE("fused GEMMs in every layout, daemon executor (MPS): match the reference at 2 ranks, repeat bitwise" *
          doctest::test_suite(kNeedsMpsTwoGpus)) {
  if (skipWithoutMps()) return;
  if (ranksFor("daemon", 2) < 2) return skipCase("the daemon executor runs one rank per GPU: this case needs 2 GPUs");
  runDaemonExecutor(2);
}
