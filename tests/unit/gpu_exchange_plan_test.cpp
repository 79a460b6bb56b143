// The GPU-issued exchange's host-side rules (daemon/src/cuda/gpu_exchange_plan.hpp): the region layout, which ops take
// it (decided from every rank's descriptor and the cluster section only, so every node decides alike), and the
// transfer commands each node issues, checked against what the receiver reads, and their passes.
#include <doctest/doctest.h>

#include <set>

#include "cuda/gpu_exchange_plan.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/reference.hpp"

using namespace tandem;
using namespace tandem::daemon;
using namespace tandem::daemon::cuda;
namespace ref = tandem::reference;

namespace {

// `n` ranks, rank r on node nodeOf[r], of `shape`.
ExchangeOp opOf(const ref::OpShape& shape, std::vector<uint32_t> nodeOf) {
  ExchangeOp op;
  const auto n = static_cast<uint32_t>(nodeOf.size());
  for (uint32_t r = 0; r < n; ++r) op.descs.push_back(ref::makeDescriptor(shape, r, n));
  std::set<uint32_t> nodes(nodeOf.begin(), nodeOf.end());
  op.nodes.assign(nodes.begin(), nodes.end());
  op.nodeOfRank = std::move(nodeOf);
  return op;
}

ref::OpShape gemm(OpKind kind, DType dtype, uint64_t m, uint64_t n, uint64_t k,
                  GemmOperands layout = GemmOperands::kNT) {
  ref::OpShape s;
  s.kind = kind;
  s.dtype = dtype;
  s.m = m;
  s.n = n;
  s.k = k;
  s.layout = layout;
  return s;
}

ClusterSection tcp(uint64_t staging = uint64_t{64} << 20) {
  ClusterSection c;
  c.stagingBytes = staging;
  c.gpuExchange = GpuExchange::kOn;  // the default, set for clarity
  return c;
}

}  // namespace

TEST_SUITE("gpu exchange plan") {
  TEST_CASE("the region: a header, one send area, an inbox per peer, slots on 256 bytes") {
    const GpuRegionLayout l = GpuRegionLayout::make({0, 2, 5}, 2, 10000);
    CHECK(l.slotBytes == 9984);
    CHECK(l.bytes() == 4096 + 3 * 9984);
    CHECK(l.peers() == std::vector<uint32_t>{0, 5});
    CHECK(GpuRegionLayout::sendOffset() == 4096);
    CHECK(GpuRegionLayout::arrivedOffset(5) == 40);
    CHECK(GpuRegionLayout::consumedOffset(5) == 2088);
    // Node 2's inboxes: from 0 first, from 5 second; node 0's: from 2, then 5.
    CHECK(l.inboxOffset(2, 0) == 4096 + 9984);
    CHECK(l.inboxOffset(2, 5) == 4096 + 2 * 9984);
    CHECK(l.inboxOffset(0, 2) == 4096 + 9984);
    CHECK(l.inboxOffset(0, 5) == 4096 + 2 * 9984);
    CHECK(l.inboxOffset(5, 0) == 4096 + 9984);
    CHECK(l.inboxOffset(5, 2) == 4096 + 2 * 9984);
    // Every inbox of a region is distinct and inside it.
    for (uint32_t at : l.nodes) {
      std::set<uint64_t> seen;
      for (uint32_t from : l.nodes) {
        if (from == at) continue;
        const uint64_t off = l.inboxOffset(at, from);
        CHECK(seen.insert(off).second);
        CHECK(off >= 4096 + l.slotBytes);
        CHECK(off + l.slotBytes <= l.bytes());
      }
    }
    CHECK_THROWS_AS(GpuRegionLayout::make({0}, 0, 4096), Error);
    CHECK_THROWS_AS(GpuRegionLayout::make({1, 0}, 0, 4096), Error);
    CHECK_THROWS_AS(GpuRegionLayout::make({0, 1}, 2, 4096), Error);
    CHECK_THROWS_AS(GpuRegionLayout::make({0, 256}, 0, 4096), Error);
    CHECK_THROWS_AS(GpuRegionLayout::make({0, 1}, 0, 255), Error);
  }

  TEST_CASE("which ops take the GPU exchange: decided from every rank's dims and the cluster section") {
    const std::vector<uint32_t> two{0, 1, 0, 1};
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1001, 1000, 1040), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmRs, DType::kF16, 1001, 1004, 1056), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmAr, DType::kBF16, 1000, 1000, 1056), two), tcp()) == "");
    ref::OpShape ag;
    ag.kind = OpKind::kAllGather;
    ag.bytes = 1001;
    CHECK(gpuExchangeRefusal(opOf(ag, {0, 1}), tcp()) == "");

    ClusterSection off = tcp();
    off.gpuExchange = GpuExchange::kOff;
    CHECK(gpuExchangeRefusal(opOf(ag, {0, 1}), off) == "cluster.gpu_exchange is off");
    ClusterSection verbs = tcp();
    verbs.transport = ClusterTransport::kVerbs;
    CHECK(gpuExchangeRefusal(opOf(ag, {0, 1}), verbs) == "");  // verbs lands in GPU memory (the double too)
    ref::OpShape nop;
    nop.kind = OpKind::kNop;
    CHECK(gpuExchangeRefusal(opOf(nop, {0, 1}), tcp()).find("no GPU exchange") != std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kF32, 129, 32, 16), {0, 1}), tcp()).find("fp32") !=
          std::string::npos);
    // k = 49 splits 25 / 24: rank 1's slice would suit the GEMM core, rank 0's not, and both nodes refuse alike.
    const ExchangeOp odd = opOf(gemm(OpKind::kGemmRs, DType::kBF16, 37, 19, 49), {0, 1});
    CHECK(gpuExchangeRefusal(odd, tcp()).find("rank 0") != std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 64, 20, 16), {0, 1}), tcp()).find("n = 20") !=
          std::string::npos);
    // gemm-rs n = 19 is fine (padded partials); ag-gemm with a rank without rows too.
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmRs, DType::kBF16, 37, 19, 48), {0, 1}), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1, 8, 8), {0, 1}), tcp()) == "");
    // The layouts: NN and TN read b as [k, n] (n % 8), TN's a as [k, rows] (gemm-rs/ar: m % 8; ag-gemm: every
    // rank's shard rows % 8), while TN's k may be anything (it is the stored rows' count).
    const auto NN = GemmOperands::kNN, TN = GemmOperands::kTN;
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmRs, DType::kBF16, 1001, 1000, 1056, NN), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmRs, DType::kBF16, 1001, 1004, 1056, NN), two), tcp())
              .find("n = 1004 is not a multiple of 8 (the GEMM core's 16-byte rows of b [k, n] in nn)") !=
          std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmAr, DType::kF16, 1000, 1000, 1042, TN), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmAr, DType::kF16, 1001, 1000, 1040, TN), two), tcp())
              .find("m = 1001") != std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1024, 1000, 1000, TN), two), tcp()) == "");
    // 1000 rows over 4 ranks: 250 each, no multiple of 8.
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1000, 1000, 1000, TN), two), tcp())
              .find("rank 0's 250 rows") != std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1001, 1000, 1044, NN), two), tcp())
              .find("k = 1044") != std::string::npos);
    // FP8 inputs: NT on the FP8 core (k slices % 16; gemm-rs/ar's block scales: m % 4); the other layouts take the
    // host path.
    auto fp8 = [](OpKind kind, uint64_t m, uint64_t k, bool block, GemmOperands layout = GemmOperands::kNT) {
      ref::OpShape s = gemm(kind, DType::kF8E4M3, m, 1000, k, layout);
      s.blockScale = block;
      return s;
    };
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kGemmRs, 1001, 1024, false), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kGemmAr, 1000, 1024, true), two), tcp()) == "");
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kGemmAr, 1001, 1024, true), two), tcp()).find("m = 1001") !=
          std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kGemmRs, 1000, 1056, false), two), tcp()).find("k slice = 264") !=
          std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kGemmRs, 1000, 1024, false, NN), two), tcp()).find("layout nn") !=
          std::string::npos);
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kAgGemm, 1001, 1024, true), two), tcp()) == "");  // scales regrouped
    CHECK(gpuExchangeRefusal(opOf(fp8(OpKind::kAgGemm, 1001, 1048, false), two), tcp()).find("k = 1048") !=
          std::string::npos);
    // Too big for the slots: the host path (whose staging check then names the fix).
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmAr, DType::kBF16, 1024, 1024, 64), {0, 1}), tcp(1u << 20))
              .find("staging_bytes") != std::string::npos);
    // gemm-rs: the payloads fit, but not the node sum the send area holds.
    CHECK(gpuExchangeRefusal(opOf(gemm(OpKind::kGemmRs, DType::kBF16, 512, 512, 64), {0, 1}), tcp(600u << 10))
              .find("send area") != std::string::npos);
  }

  TEST_CASE("the writes: every byte the receiver reads comes from the sender's send area, packed in its inbox") {
    const GpuRegionLayout l0 = GpuRegionLayout::make({0, 1, 2}, 0, 1u << 20);
    SUBCASE("ag-gemm: the sender's shards, one write per peer") {
      const ExchangeOp op = opOf(gemm(OpKind::kAgGemm, DType::kBF16, 10, 8, 16), {0, 1, 2, 0, 1});
      // Node 0 holds ranks 0 and 3: rows 2 + 2, 32 bytes each.
      CHECK(exchangePayloadBytes(op, 0, 1) == 4 * 32);
      CHECK(exchangeSendAreaBytes(op, 0) == 4 * 32);
      CHECK(exchangeWrites(op, l0, 0, 2) == std::vector<ExchangeWrite>{{4096, l0.inboxOffset(2, 0), 128}});
      // Node 2 holds rank 2 only.
      CHECK(exchangePayloadBytes(op, 2, 0) == 2 * 32);
    }
    SUBCASE("gemm-rs: the owner's rows out of the node sum, runs merged, packed") {
      // 10 rows over 5 ranks, 2 each; node 1 owns ranks 1, 2 (rows 2..5, one run) and 4 (rows 8, 9).
      const ExchangeOp op = opOf(gemm(OpKind::kGemmRs, DType::kBF16, 10, 3, 40), {0, 1, 1, 0, 1});
      CHECK(ownedRows(op, 1) == std::vector<std::pair<uint64_t, uint64_t>>{{2, 4}, {8, 2}});
      const uint64_t row = 3 * 4, in = l0.inboxOffset(1, 0);
      CHECK(exchangeWrites(op, l0, 0, 1) ==
            std::vector<ExchangeWrite>{{4096 + 2 * row, in, 4 * row}, {4096 + 8 * row, in + 4 * row, 2 * row}});
      CHECK(exchangePayloadBytes(op, 0, 1) == 6 * row);
      CHECK(exchangeSendAreaBytes(op, 0) == 10 * row);
    }
    SUBCASE("gemm-ar: all rows to every peer") {
      const ExchangeOp op = opOf(gemm(OpKind::kGemmAr, DType::kF16, 7, 5, 16), {0, 1});
      const GpuRegionLayout l = GpuRegionLayout::make({0, 1}, 1, 1u << 20);
      CHECK(exchangeWrites(op, l, 1, 0) == std::vector<ExchangeWrite>{{4096, l.inboxOffset(0, 1), 7 * 5 * 4}});
    }
    SUBCASE("nothing to send: no write (the flag goes alone)") {
      const ExchangeOp op = opOf(gemm(OpKind::kAgGemm, DType::kBF16, 1, 8, 8), {0, 1});
      CHECK(exchangePayloadBytes(op, 1, 0) == 0);
      CHECK(exchangeWrites(op, GpuRegionLayout::make({0, 1}, 1, 4096), 1, 0).empty());
    }
  }

  TEST_CASE("gemm-rs/ar push in passes over row blocks: the writes cut where a pass starts, every byte once, in order") {
    // Passes of at least 256 rows, at most 4.
    CHECK(passRowStarts(100) == std::vector<uint64_t>{0});
    CHECK(passRowStarts(511) == std::vector<uint64_t>{0});
    CHECK(passRowStarts(512) == std::vector<uint64_t>{0, 256});
    CHECK(passRowStarts(1000) == std::vector<uint64_t>{0, 328, 664});  // multiples of 8 (a TN partial's A block)
    CHECK(passRowStarts(4096) == std::vector<uint64_t>{0, 1024, 2048, 3072});
    CHECK(passRowStarts(100000).size() == kMaxExchangePasses);
    // Only gemm-rs/ar are cut, at the node sum's rows (fp32, n columns) in the send area.
    CHECK(exchangePassCuts(opOf(gemm(OpKind::kAgGemm, DType::kBF16, 4096, 64, 64), {0, 1})).empty());
    const uint64_t s0 = GpuRegionLayout::sendOffset();
    CHECK(exchangePassCuts(opOf(gemm(OpKind::kGemmAr, DType::kBF16, 1024, 64, 64), {0, 1})) ==
          std::vector<uint64_t>{s0 + 256 * 256, s0 + 512 * 256, s0 + 768 * 256});
    // gemm-rs with interleaved ranks (nodes 0 1 0 1): node 0 sends node 1 two runs of rows; cut into three passes.
    const ExchangeOp op = opOf(gemm(OpKind::kGemmRs, DType::kF16, 1001, 40, 64), {0, 1, 0, 1});
    const std::vector<uint64_t> cuts = exchangePassCuts(op);
    REQUIRE(cuts.size() == 2);
    const GpuRegionLayout l = GpuRegionLayout::make({0, 1}, 0, 1u << 20);
    const std::vector<ExchangeWrite> whole = exchangeWrites(op, l, 0, 1);
    const auto split = splitIntoPasses(whole, cuts);
    REQUIRE(split.size() == 3);
    std::vector<ExchangeWrite> pieces;
    for (std::size_t q = 0; q < split.size(); ++q) {
      CAPTURE(q);
      CHECK_FALSE(split[q].empty());
      for (const ExchangeWrite& x : split[q]) {
        CHECK(x.bytes > 0);
        if (q > 0) CHECK(x.srcOffset >= cuts[q - 1]);              // nothing before its pass starts
        if (q + 1 < split.size()) CHECK(x.srcOffset + x.bytes <= cuts[q]);  // nor after it ends
        pieces.push_back(x);
      }
    }
    // Glued back where they touch on both ends, the pieces are the writes again.
    std::vector<ExchangeWrite> glued;
    for (const ExchangeWrite& x : pieces) {
      if (!glued.empty() && glued.back().srcOffset + glued.back().bytes == x.srcOffset &&
          glued.back().dstOffset + glued.back().bytes == x.dstOffset) {
        glued.back().bytes += x.bytes;
      } else {
        glued.push_back(x);
      }
    }
    CHECK(glued == whole);
    CHECK(splitIntoPasses(whole, {}) == std::vector<std::vector<ExchangeWrite>>{whole});
  }
}

TEST_CASE("GPU exchange region memory: tcp and MPS in host memory; GPU memory where GPUDirect writes are ordered for "
          "their readers or the arrived wait can flush them; host memory otherwise") {
  auto facts = [](int ordering, bool flush, bool others = false) {
    RegionFacts f;
    f.writesOrdering = ordering;
    f.canFlushOnWait = flush;
    f.otherGpusRead = others;
    return f;
  };
  RegionFacts tcp = facts(200, true);
  tcp.tcp = true;
  CHECK(chooseRegionMemory(tcp).host);
  RegionFacts mps = facts(200, true);
  mps.mps = true;
  CHECK(chooseRegionMemory(mps).host);
  CHECK(chooseRegionMemory(mps).why.find("MPS") != std::string::npos);
  // The H200 here: ordering 100 (owner), no stream-wait flush. Only the owner reads: GPU memory, nothing to flush.
  const RegionChoice h200 = chooseRegionMemory(facts(100, false));
  CHECK_FALSE(h200.host);
  CHECK_FALSE(h200.flushOnArrival);
  // Were other GPUs to read the inboxes, owner ordering would not do: a flush where it can, host memory where not.
  CHECK(chooseRegionMemory(facts(100, false, true)).host);
  const RegionChoice flushed = chooseRegionMemory(facts(100, true, true));
  CHECK_FALSE(flushed.host);
  CHECK(flushed.flushOnArrival);
  CHECK_FALSE(chooseRegionMemory(facts(200, false, true)).host);
  // No native ordering at all.
  CHECK(chooseRegionMemory(facts(0, true)).flushOnArrival);
  const RegionChoice none = chooseRegionMemory(facts(0, false));
  CHECK(none.host);
  CHECK(none.why.find("ordering 0 < 100") != std::string::npos);
}
