// The fused GEMMs' host side (kernels/fused_ops.cpp), which both executors share: the workspace layout every rank must
// compute alike, and the checks that refuse an op before any kernel could write past a workspace. Host arithmetic
// only, so it runs (and guards the layout) on machines without a GPU; built where nvcc is.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <regex>
#include <string>

#include "tandem/common/error.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/kernels/ag_gemm.hpp"  // agGemmFp8Layout
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/gemm_rs.hpp"
#include "tandem/kernels/moe.hpp"  // kMoeControlBytes

namespace k = tandem::kernels;
using tandem::DType;
using tandem::ErrorCode;
using tandem::GemmOperands;
using tandem::OpDescriptor;
using tandem::OpKind;

namespace {

// Rank `rank`'s descriptor of a fused GEMM of the given global shape on `nranks` ranks.
OpDescriptor gemmDesc(OpKind kind, uint64_t m, uint64_t n, uint64_t kk, uint32_t nranks, DType dtype = DType::kBF16) {
  tandem::reference::OpShape shape;
  shape.kind = kind;
  shape.dtype = dtype;
  shape.m = m;
  shape.n = n;
  shape.k = kk;
  return tandem::reference::makeDescriptor(shape, 0, nranks);
}

k::FusedEnv envWith(uint64_t workspaceBytes, uint32_t nranks) {
  k::FusedEnv env;
  env.rank = 0;
  env.nranks = nranks;
  env.workspaceBytes = workspaceBytes;
  env.layout = k::WorkspaceLayout::fit(workspaceBytes, nranks);
  return env;
}

// Aligned stand-ins for the tensors: the checks read the addresses' alignment, never the memory.
k::DevicePointers alignedPointers() {
  k::DevicePointers p{};
  for (std::size_t s = 0; s < 4; ++s) p[s] = reinterpret_cast<void*>(uintptr_t{1} << 20 << s);
  return p;
}

// The error checkFusedGemm throws ("" when it accepts the op).
std::string refusal(const OpDescriptor& d, const k::DevicePointers& ptrs, const k::FusedEnv& env, ErrorCode* code) {
  try {
    k::checkFusedGemm(d, ptrs, env);
    return "";
  } catch (const tandem::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
}

}  // namespace

TEST_CASE("fused ops: the workspace layout keeps every region apart and inside the budget, for 1 to 8 ranks") {
  for (uint32_t n = 1; n <= 8; ++n) {
    uint64_t lastMat = 0;
    for (uint64_t bytes : {uint64_t{16} << 20, uint64_t{48} << 20, uint64_t{512} << 20, uint64_t{4} << 30}) {
      CAPTURE(n);
      CAPTURE(bytes);
      const k::WorkspaceLayout l = k::WorkspaceLayout::fit(bytes, n);
      CHECK(l.agFlagsOff == k::workspaceBytes(n));  // AllGather's region first, untouched
      CHECK(l.agFlagsOff + l.agFlagWords * 8 <= l.rsOff);
      CHECK(l.rsOff + k::gemmRsFixedWorkspaceBytes(static_cast<int64_t>(l.rsMatBytes), static_cast<int>(n)) ==
            l.dataOff);
      CHECK(l.dataBytes == 2 * l.rsMatBytes);
      // The span: the gemm-rs/ar staging matrices (after their flags) through the end of data.
      CHECK(l.spanOff == l.rsOff + k::gemmRsFixedFlagsBytes(static_cast<int64_t>(l.rsMatBytes), static_cast<int>(n)));
      CHECK(l.spanOff + l.spanBytes == l.dataOff + l.dataBytes);
      CHECK(l.spanBytes == (2 * n + 4) * l.rsMatBytes);
      CHECK(l.rsMatBytes % (64u << 10) == 0);
      if (bytes >= k::workspaceBytes(n)) CHECK(l.dataOff + l.dataBytes <= bytes);
      // The split-K scratch after the MoE control area, inside the budget.
      CHECK(l.splitKOff == l.moeOff + k::kMoeControlBytes);
      if (bytes >= l.splitKOff + k::kFusedSplitKBytes) {
        CHECK(l.splitKBytes == k::kFusedSplitKBytes);
      } else {
        CHECK(l.splitKBytes == 0);
        CHECK(l.rsMatBytes == 0);  // the scratch comes before any matrix
      }
      CHECK(l.splitKOff + l.splitKBytes <= std::max(bytes, l.splitKOff));
      CHECK(l.rsMatBytes >= lastMat);  // a larger budget never holds less
      lastMat = l.rsMatBytes;
    }
    // bytesFor is the inverse: the budget it names holds matrices of at least that size.
    for (uint64_t mat : {uint64_t{1}, uint64_t{3} << 20, uint64_t{128} << 20}) {
      CAPTURE(mat);
      const uint64_t bytes = k::WorkspaceLayout::bytesFor(mat, n);
      CHECK(bytes % (2u << 20) == 0);
      CHECK(k::WorkspaceLayout::fit(bytes, n).rsMatBytes >= mat);
    }
    // bytesForSpan likewise, for the span and the data region, and no larger than the span asks.
    for (uint64_t span : {uint64_t{1}, uint64_t{100} << 20, uint64_t{5} << 30}) {
      CAPTURE(span);
      const uint64_t bytes = k::WorkspaceLayout::bytesForSpan(span, 1u << 20, n);
      const k::WorkspaceLayout l = k::WorkspaceLayout::fit(bytes, n);
      CHECK(l.spanBytes >= span);
      CHECK(l.dataBytes >= (1u << 20));
      if (span >= (100u << 20)) {
        CHECK(bytes <= span + span / 64 + k::workspaceBytes(n) + k::kFusedSplitKBytes + (4u << 20));
      }
    }
  }
}

TEST_CASE("fused ops: what the kernels cannot run is refused with the remedy, the rest accepted") {
  const k::FusedEnv env = envWith(512u << 20, 2);
  const k::DevicePointers ptrs = alignedPointers();
  ErrorCode code = ErrorCode::kOk;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    CHECK(refusal(gemmDesc(kind, 1000, 1024, 512, 2), ptrs, env, nullptr).empty());

    CHECK(refusal(gemmDesc(kind, 256, 256, 64, 2, DType::kF32), ptrs, env, &code).find("bf16 or fp16") !=
          std::string::npos);
    CHECK(code == ErrorCode::kUnsupported);

    CHECK(refusal(gemmDesc(kind, 256, 12, 64, 2), ptrs, env, &code).find("n = 12 is not a multiple of 8") !=
          std::string::npos);
    CHECK(code == ErrorCode::kInvalidArgument);

    k::DevicePointers misaligned = ptrs;
    misaligned[tandem::slot::kB] = static_cast<char*>(misaligned[tandem::slot::kB]) + 8;
    CHECK(refusal(gemmDesc(kind, 256, 256, 64, 2), misaligned, env, &code).find("tensor b") != std::string::npos);
    CHECK(code == ErrorCode::kInvalidArgument);
  }
  // k: ag-gemm's whole K, gemm-rs/ar this rank's slice (K 120 over 2 ranks: slices of 60).
  CHECK(refusal(gemmDesc(OpKind::kAgGemm, 256, 256, 60, 2), ptrs, env, nullptr).find("k = 60") != std::string::npos);
  CHECK(refusal(gemmDesc(OpKind::kGemmRs, 256, 256, 120, 2), ptrs, env, nullptr).find("slice") != std::string::npos);
}

TEST_CASE("fused ops: NN and TN are accepted; TN's stored [k, m] A needs 16-byte rows, named with the fix") {
  const k::FusedEnv env = envWith(512u << 20, 2);
  const k::DevicePointers ptrs = alignedPointers();
  const auto withLayout = [](OpDescriptor d, GemmOperands l) {
    d.flags = static_cast<uint16_t>((d.flags & ~tandem::kFlagGemmLayout) | tandem::gemmLayoutFlags(l));
    return d;
  };
  ErrorCode code = ErrorCode::kOk;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    for (GemmOperands l : {GemmOperands::kNN, GemmOperands::kTN}) {
      CHECK(refusal(withLayout(gemmDesc(kind, 1008, 1024, 512, 2), l), ptrs, env, nullptr).empty());
      // TN always runs on the layouts core; NN too on ag-gemm unless the plan table names its fused plan (gemm-rs and
      // gemm-ar fuse it).
      CHECK(k::fusedGemmOnLayoutsCore(withLayout(gemmDesc(kind, 4096, 1024, 512, 2), l)) ==
            (l == GemmOperands::kTN || kind == OpKind::kAgGemm));
    }
    // NN keeps A [m, k]: any m. TN stores A [k, m]: m (ag-gemm: every rank's rows) a multiple of 8.
    CHECK(refusal(withLayout(gemmDesc(kind, 1001, 1024, 512, 2), GemmOperands::kNN), ptrs, env, nullptr).empty());
    const std::string why = refusal(withLayout(gemmDesc(kind, 1001, 1024, 512, 2), GemmOperands::kTN), ptrs, env, &code);
    CHECK(code == ErrorCode::kInvalidArgument);
    CHECK(why.find("layout tn") != std::string::npos);
    CHECK(why.find("multiple of 8") != std::string::npos);
  }
  // ag-gemm TN: m = 1000 gives 500 rows per rank (not a multiple of 8): the remedy names m's multiple of 16.
  const std::string ag =
      refusal(withLayout(gemmDesc(OpKind::kAgGemm, 1000, 1024, 512, 2), GemmOperands::kTN), ptrs, env, &code);
  CHECK(code == ErrorCode::kInvalidArgument);
  CHECK(ag.find("8 x 2 = 16") != std::string::npos);
  CHECK(refusal(withLayout(gemmDesc(OpKind::kGemmRs, 1000, 1024, 512, 2), GemmOperands::kTN), ptrs, env, nullptr)
            .empty());
}

TEST_CASE("fused ops: small M (decode) runs NT on the layouts core unless the plan table forces the fused kernels") {
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    for (uint32_t n : {1u, 2u, 4u}) {
      CHECK(k::fusedGemmOnLayoutsCore(gemmDesc(kind, 1, 8192, 8192, n)));
      CHECK(k::fusedGemmOnLayoutsCore(gemmDesc(kind, k::kFusedSmallM, 8192, 8192, n)));
      CHECK_FALSE(k::fusedGemmOnLayoutsCore(gemmDesc(kind, k::kFusedSmallM + 1, 8192, 8192, n)));
      tandem::PlanChoice fused;
      fused.kind = tandem::PlanKind::kFused;
      CHECK_FALSE(k::fusedGemmOnLayoutsCore(gemmDesc(kind, 64, 8192, 8192, n), fused));
    }
  }
}

TEST_CASE("ag-gemm: NN (dgrad) can take the fused plan with the weight loaded MN-major, TN stays decomposed") {
  k::AgGemmParams p{};
  p.rank = 0;
  p.nranks = 2;
  p.m = 8192;
  p.n = 8192;
  p.k = 8192;
  p.dtype = k::GemmDtype::kBf16;
  const auto withLayout = [&](k::GemmLayout l, int32_t plan, int32_t layoutsCore = 0) {
    k::AgGemmParams q = p;
    q.layout = l;
    q.plan = plan;
    q.layoutsCore = layoutsCore;
    return q;
  };
  // NN fuses where NT does (the same chooser), and a forced plan is kept either way.
  CHECK(k::agGemmFusedTakes(withLayout(k::GemmLayout::kAB, 0)));
  CHECK(k::resolveAgGemmPlan(withLayout(k::GemmLayout::kAB, 0)).plan ==
        k::resolveAgGemmPlan(withLayout(k::GemmLayout::kABt, 0)).plan);
  CHECK(k::resolveAgGemmPlan(withLayout(k::GemmLayout::kAB, 1)).plan == k::AgGemmPlan::kFused);
  CHECK(k::resolveAgGemmPlan(withLayout(k::GemmLayout::kAB, 2)).plan == k::AgGemmPlan::kDecomposed);
  // The decomposed plan of NN runs its GEMM on the layouts core (the forward core's own GEMM is NT only).
  CHECK(k::agGemmOnLayoutsCore(withLayout(k::GemmLayout::kAB, 2)));
  // layoutsCore and TN (each rank's shard [k, rows]) run the whole gather, then the layouts core.
  CHECK(k::resolveAgGemmPlan(withLayout(k::GemmLayout::kAB, 0, 1)).plan == k::AgGemmPlan::kDecomposed);
  CHECK_FALSE(k::agGemmFusedTakes(withLayout(k::GemmLayout::kAtB, 0)));
  CHECK(k::resolveAgGemmPlan(withLayout(k::GemmLayout::kAtB, 0)).plan == k::AgGemmPlan::kDecomposed);
  // One rank gathers nothing: the local plan, whatever the layout.
  k::AgGemmParams one = withLayout(k::GemmLayout::kAB, 1);
  one.nranks = 1;
  CHECK(k::resolveAgGemmPlan(one).plan == k::AgGemmPlan::kLocal);
  // The op level: NN, small M or large, runs on the layouts core unless the plan table names the fused kernel.
  tandem::PlanChoice fused;
  fused.kind = tandem::PlanKind::kFused;
  for (uint64_t m : {64u, 8192u}) {
    OpDescriptor d = gemmDesc(OpKind::kAgGemm, m, 8192, 8192, 2);
    d.flags = static_cast<uint16_t>((d.flags & ~tandem::kFlagGemmLayout) | tandem::gemmLayoutFlags(GemmOperands::kNN));
    CHECK(k::fusedGemmOnLayoutsCore(d));
    CHECK_FALSE(k::fusedGemmOnLayoutsCore(d, fused));
  }
}

TEST_CASE("fused ops: an op too large for the workspace names the workspace_bytes to create the communicator with") {
  const k::DevicePointers ptrs = alignedPointers();
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    const OpDescriptor big = gemmDesc(kind, 8192, 8192, 8192, 2);
    ErrorCode code = ErrorCode::kOk;
    const std::string why = refusal(big, ptrs, envWith(48u << 20, 2), &code);
    CHECK(code == ErrorCode::kInvalidArgument);
    std::smatch match;
    REQUIRE(std::regex_search(why, match, std::regex("tandem_comm_config_t\\.workspace_bytes >= ([0-9]+)")));
    const uint64_t suggested = std::stoull(match[1].str());
    CHECK(refusal(big, ptrs, envWith(suggested, 2), nullptr).empty());  // the remedy works
    CHECK(k::workspaceBytesFor(big, 2) == suggested);                    // and is what a rank would declare
  }
  // One rank exchanges nothing: any workspace will do.
  CHECK(refusal(gemmDesc(OpKind::kGemmAr, 8192, 8192, 8192, 1), ptrs, envWith(16u << 20, 1), nullptr).empty());
}

namespace {

// Rank 0's descriptor of a fused GEMM with FP8 inputs (e4m3, c in `out`), per-tensor or block scales.
OpDescriptor fp8Desc(OpKind kind, uint64_t m, uint64_t n, uint64_t kk, uint32_t nranks, bool block,
                     DType out = DType::kBF16) {
  tandem::reference::OpShape shape;
  shape.kind = kind;
  shape.dtype = DType::kF8E4M3;
  shape.m = m;
  shape.n = n;
  shape.k = kk;
  shape.outDtype = out;
  shape.blockScale = block;
  return tandem::reference::makeDescriptor(shape, 0, nranks);
}

// Aligned stand-ins for every slot, the scales included.
k::DevicePointers fp8Pointers() {
  k::DevicePointers p{};
  for (std::size_t s = 0; s < 6; ++s) p[s] = reinterpret_cast<void*>(uintptr_t{1} << 20 << s);
  return p;
}

}  // namespace

TEST_CASE("fused ops: FP8 inputs run in layout nt on one node; nn and tn refused naming the layout and the fix") {
  const k::DevicePointers ptrs = fp8Pointers();
  ErrorCode code = ErrorCode::kOk;
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    CAPTURE(tandem::opKindName(kind));
    const uint64_t kUnit = kind == OpKind::kAgGemm ? 16 : 32;  // every rank's k slice a multiple of 16 at 2 ranks
    for (uint32_t n : {1u, 2u, 4u}) {
      const k::FusedEnv env = envWith(512u << 20, n);
      for (bool block : {false, true}) {
        for (DType out : {DType::kBF16, DType::kF32}) {
          CHECK(refusal(fp8Desc(kind, 1000, 1024, kUnit * 32, n, block, out), ptrs, env, nullptr).empty());
        }
      }
      // Never the layouts core, small M included: the FP8 core runs them.
      CHECK_FALSE(k::fusedGemmOnLayoutsCore(fp8Desc(kind, 1, 8192, 8192, n, false)));
    }
    const k::FusedEnv env = envWith(512u << 20, 2);
    for (GemmOperands l : {GemmOperands::kNN, GemmOperands::kTN}) {
      OpDescriptor d = fp8Desc(kind, 1008, 1024, 512, 2, true);
      d.flags = static_cast<uint16_t>((d.flags & ~tandem::kFlagGemmLayout) | tandem::gemmLayoutFlags(l));
      const std::string why = refusal(d, ptrs, env, &code);
      CHECK(code == ErrorCode::kUnsupported);
      CHECK(why.find(fmt::format("layout {}", tandem::gemmLayoutName(l))) != std::string::npos);
      CHECK(why.find("layout nt") != std::string::npos);
      CHECK(why.find("Transpose") != std::string::npos);
    }
    // fp8 rows move in 16-byte words: k (gemm-rs/ar: the slice) a multiple of 16.
    CHECK(refusal(fp8Desc(kind, 256, 256, kind == OpKind::kAgGemm ? 40 : 80, 2, false), ptrs, env, &code)
              .find("not a multiple of 16") != std::string::npos);
    CHECK(code == ErrorCode::kInvalidArgument);
    // The scales are required.
    k::DevicePointers noScale = ptrs;
    noScale[static_cast<std::size_t>(tandem::gemmScaleSlot(kind, true))] = nullptr;
    CHECK(refusal(fp8Desc(kind, 256, 256, 256, 2, false), noScale, env, nullptr).find("b_scale") != std::string::npos);
  }
  // Block scales read in place (gemm-rs/ar; ag-gemm at one rank) need m % 4 == 0; ag-gemm's gather repacks them.
  for (OpKind kind : {OpKind::kGemmRs, OpKind::kGemmAr}) {
    CHECK(refusal(fp8Desc(kind, 1002, 1024, 512, 2, true), ptrs, envWith(512u << 20, 2), &code)
              .find("multiple of 4") != std::string::npos);
    CHECK(refusal(fp8Desc(kind, 1002, 1024, 512, 2, false), ptrs, envWith(512u << 20, 2), nullptr).empty());
  }
  CHECK(refusal(fp8Desc(OpKind::kAgGemm, 1002, 1024, 512, 1, true), ptrs, envWith(512u << 20, 1), nullptr)
            .find("multiple of 4") != std::string::npos);
  CHECK(refusal(fp8Desc(OpKind::kAgGemm, 1002, 1024, 512, 2, true), ptrs, envWith(512u << 20, 2), nullptr).empty());
}

TEST_CASE("fused ops: the workspace an FP8 op needs (fp8 rows and their scales, fp32 partials) is what it asks for") {
  const k::DevicePointers ptrs = fp8Pointers();
  for (OpKind kind : {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr}) {
    for (bool block : {false, true}) {
      for (DType out : {DType::kBF16, DType::kF32}) {
        CAPTURE(tandem::opKindName(kind));
        CAPTURE(block);
        const OpDescriptor big = fp8Desc(kind, 8192, 8192, 8192, 4, block, out);
        ErrorCode code = ErrorCode::kOk;
        const std::string why = refusal(big, ptrs, envWith(48u << 20, 4), &code);
        CHECK(code == ErrorCode::kInvalidArgument);
        std::smatch match;
        REQUIRE(std::regex_search(why, match, std::regex("tandem_comm_config_t\\.workspace_bytes >= ([0-9]+)")));
        const uint64_t suggested = std::stoull(match[1].str());
        CHECK(refusal(big, ptrs, envWith(suggested, 4), nullptr).empty());
        CHECK(k::workspaceBytesFor(big, 4) == suggested);
        const k::WorkspaceLayout l = k::WorkspaceLayout::fit(suggested, 4);
        if (kind == OpKind::kAgGemm) {
          // The gathered fp8 A (one byte a value) and the scales fit the data region, their flags the flag words.
          const auto fp8 = k::agGemmFp8Layout(8192, 8192, 4, block ? k::Fp8Scaling::kBlock : k::Fp8Scaling::kPerTensor);
          CHECK(static_cast<uint64_t>(fp8.bytes) <= l.dataBytes);
          CHECK(static_cast<uint64_t>(fp8.bytes) > 8192ull * 8192);
        } else {
          // fp32 partials: 4 bytes an element in each staging matrix.
          CHECK(l.rsMatBytes >= 8192ull * 8192 * 4);
        }
      }
    }
  }
}

TEST_CASE("fused ops: which ops wait for every rank's stream (gang) before they are released") {
  OpDescriptor barrier{};
  barrier.kind = OpKind::kNop;
  barrier.nranks = 2;
  CHECK(k::needsGang(barrier));
  barrier.nranks = 1;
  CHECK_FALSE(k::needsGang(barrier));  // a one-rank barrier meets nobody
  CHECK_FALSE(k::needsGang(gemmDesc(OpKind::kAgGemm, 1024, 1024, 512, 2)));
  CHECK_FALSE(k::needsGang(gemmDesc(OpKind::kGemmRs, 1024, 1024, 512, 2)));  // every rank owns rows: kernels keep step
  CHECK(k::needsGang(gemmDesc(OpKind::kGemmRs, 1, 1024, 512, 2)));           // rank 1 owns no row
}
