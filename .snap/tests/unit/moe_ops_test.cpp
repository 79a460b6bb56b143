// The MoE ops' host side (kernels/moe_ops.cpp, kernels/moe.cpp), which both executors share: the receive-area and
// scratch arithmetic, and the checks that refuse an op before any kernel could write past a workspace. Host arithmetic
// only (no GPU); built where nvcc is.
#include <doctest/doctest.h>

#include <string>

#include "tandem/common/error.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/kernels/moe.hpp"
#include "tandem/kernels/moe_ops.hpp"

namespace k = tandem::kernels;
using tandem::DType;
using tandem::ErrorCode;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;

namespace {

OpDescriptor moeDesc(OpKind kind, uint64_t tokens, uint64_t hidden, uint64_t n, uint64_t experts, uint64_t topk,
                     uint32_t nranks, DType dtype = DType::kBF16) {
  tandem::reference::OpShape shape;
  shape.kind = kind;
  shape.dtype = dtype;
  shape.m = tokens;
  shape.k = hidden;
  shape.n = n;
  shape.experts = experts;
  shape.topk = topk;
  return tandem::reference::makeDescriptor(shape, 0, nranks);
}

// Every rank's workspace at a 2 MiB-aligned stand-in address: the checks read addresses, never the memory.
k::FusedEnv envWith(uint64_t workspaceBytes, uint32_t nranks) {
  k::FusedEnv env;
  env.rank = 0;
  env.nranks = nranks;
  env.workspaceBytes = workspaceBytes;
  env.layout = k::WorkspaceLayout::fit(workspaceBytes, nranks);
  for (uint32_t r = 0; r < nranks; ++r) env.workspaces[r] = reinterpret_cast<char*>(uintptr_t{1} << 40 << r);
  return env;
}

k::DevicePointers alignedPointers() {
  k::DevicePointers p{};
  for (std::size_t s = 0; s < 10; ++s) p[s] = reinterpret_cast<void*>(uintptr_t{1} << 30 << s);
  return p;
}

std::string refusal(const OpDescriptor& d, const k::DevicePointers& ptrs, const k::FusedEnv& env, ErrorCode* code) {
  try {
    k::checkMoeOp(d, ptrs, env);
    return "";
  } catch (const tandem::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
}

}  // namespace

TEST_CASE("moe ops: the receive area holds the rows it is sized for, and no more than its bytes") {
  for (int64_t hidden : {8, 264, 7168}) {
    for (int64_t ffn : {0, 8, 2048}) {
      CAPTURE(hidden);
      CAPTURE(ffn);
      for (uint64_t bytes : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{300} << 20}) {
        const int64_t rows = k::moeRecvRows(bytes, hidden, ffn);
        CHECK(k::moeRecvBytes(rows, hidden, ffn) <= bytes);
        CHECK(k::moeRecvBytes(rows + 1, hidden, ffn) > bytes);  // the most that fit
      }
      CHECK(k::moeRecvBytes(10, hidden, ffn) >= static_cast<uint64_t>(10 * hidden * 2 * (ffn > 0 ? 2 : 1) + 160));
      if (ffn == 0) continue;
      // The backward's rows: x and dout of hidden, h, gate|up and g (4 ffn), row info, weight and dtopk_weight.
      for (uint64_t bytes : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{300} << 20}) {
        const int64_t rows = k::moeRecvRows(bytes, hidden, ffn, true);
        CHECK(k::moeRecvBytes(rows, hidden, ffn, true) <= bytes);
        CHECK(k::moeRecvBytes(rows + 1, hidden, ffn, true) > bytes);
      }
      CHECK(k::moeRecvBytes(10, hidden, ffn, true) >= static_cast<uint64_t>(10 * (4 * hidden + 8 * ffn + 24)));
      // FP8 weights: x and h in e4m3 with their 1 x 128 scales, y in bf16, row info.
      for (uint64_t bytes : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{300} << 20}) {
        const int64_t rows = k::moeRecvRows(bytes, hidden, ffn, false, true);
        CHECK(k::moeRecvBytes(rows, hidden, ffn, false, true) <= bytes);
        CHECK(k::moeRecvBytes(rows + 1, hidden, ffn, false, true) > bytes);
        if (bytes >= (1u << 20)) CHECK(rows >= k::moeRecvRows(bytes, hidden, ffn));  // more rows than bf16's
      }
      const auto fp8Row = static_cast<uint64_t>(3 * hidden + ffn + 4 * ((hidden + 127) / 128 + (ffn + 127) / 128) + 16);
      CHECK(k::moeRecvBytes(10, hidden, ffn, false, true) >= 10 * fp8Row);
    }
  }
  CHECK(k::moeScratchBytes(1000, 8, 256) >= 1000 * 8 * 4 + 2 * 256 * 4);
}

TEST_CASE("moe ops: the workspace keeps the MoE control area apart from every other region") {
  for (uint32_t n = 1; n <= 8; ++n) {
    const k::WorkspaceLayout l = k::WorkspaceLayout::fit(512u << 20, n);
    CHECK(l.moeOff >= l.dataOff + l.dataBytes);
    CHECK(l.spanOff + l.spanBytes == l.moeOff);  // the FFN's receive rows end where the control area begins
    CHECK(l.moeOff + k::kMoeControlBytes <= (512u << 20));
    CHECK(l.moeOff % 128 == 0);
  }
}

TEST_CASE("moe ops: the FFN's workspace is its receive rows and scratch plus the flags, at 1, 2 and 4 ranks") {
  // DeepSeek-V3's routed experts at 16384 tokens per rank, the receive rows at 1.25x a balanced routing. The rows fill
  // the span (the gemm-rs/ar staging matrices and the data region): sized into the data region alone (2 of the
  // 2 nranks + 4 matrices), the workspace was nranks + 2 times the rows, 16.2, 21.6 and 32.4 GB at 1, 2 and 4 ranks.
  const int64_t tokens = 16384, hidden = 7168, ffn = 2048, experts = 256, topk = 8, rows = tokens * topk * 5 / 4;
  const uint64_t recv = k::moeRecvBytes(rows, hidden, ffn), scratch = k::moeScratchBytes(tokens, topk, experts);
  CHECK(recv == 5371330560);  // x and y of hidden, h of ffn (SwiGLU's output), 16 bytes of row info, bf16
  // Before the fused GEMMs' split-K region (k::kFusedSplitKBytes, part of every workspace): measured sizes.
  const uint64_t withoutSplitK[] = {0, 5410652160, 5425332224, 0, 5456789504};
  for (uint32_t n : {1u, 2u, 4u}) {
    CAPTURE(n);
    const OpDescriptor d = moeDesc(OpKind::kMoeDispatchFfnCombine, tokens, hidden, ffn, experts, topk, n);
    const uint64_t bytes = k::workspaceBytesFor(d, n, rows);
    CHECK(bytes == withoutSplitK[n] + k::kFusedSplitKBytes);
    // On top of the rows: AllGather's region, the flags (1/64 of a matrix), the MoE control area, 2 MiB rounding.
    CHECK(bytes <= recv + scratch + recv / 64 + k::workspaceBytes(n) + k::kFusedSplitKBytes + (4u << 20));
    const k::WorkspaceLayout l = k::WorkspaceLayout::fit(bytes, n);
    CHECK(k::moeRecvRows(l.spanBytes - scratch - 256, hidden, ffn) >= rows);
    CHECK(l.dataBytes >= scratch + 256);
    CHECK(refusal(d, alignedPointers(), envWith(bytes, n), nullptr).empty());
  }
}

TEST_CASE("moe ops: what the kernels cannot run is refused with the remedy, the rest accepted") {
  const k::FusedEnv env = envWith(512u << 20, 2);
  const k::DevicePointers ptrs = alignedPointers();
  ErrorCode code = ErrorCode::kOk;
  for (OpKind kind : {OpKind::kMoeDispatchGemm, OpKind::kMoeDispatchFfnCombine, OpKind::kMoeFfnBackward}) {
    CAPTURE(tandem::opKindName(kind));
    CHECK(refusal(moeDesc(kind, 100, 264, 200, 8, 2, 2), ptrs, env, nullptr).empty());
    CHECK(refusal(moeDesc(kind, 0, 264, 200, 8, 2, 2), ptrs, env, nullptr).empty());  // a rank of no tokens
    CHECK(refusal(moeDesc(kind, 100, 260, 200, 8, 2, 2), ptrs, env, &code).find("multiple of 8") != std::string::npos);
    CHECK(code == ErrorCode::kInvalidArgument);
    CHECK(refusal(moeDesc(kind, 100, 264, 204, 8, 2, 2), ptrs, env, &code).find("multiple of 8") != std::string::npos);
    CHECK(refusal(moeDesc(kind, 100, 264, 200, 8, 2, 2, DType::kF32), ptrs, env, &code).find("bf16 or fp16") !=
          std::string::npos);
    CHECK(code == ErrorCode::kUnsupported);
    CHECK(refusal(moeDesc(kind, 100, 264, 200, 64, 33, 2), ptrs, env, &code).find("topk") != std::string::npos);
    CHECK(refusal(moeDesc(kind, 100, 264, 200, 2048, 2, 2), ptrs, env, &code).find("experts") != std::string::npos);
    k::DevicePointers off = ptrs;
    off[tandem::slot::kX] = static_cast<char*>(off[tandem::slot::kX]) + 8;
    CHECK(refusal(moeDesc(kind, 100, 264, 200, 8, 2, 2), off, env, &code).find("16-byte aligned") != std::string::npos);
  }
  // A capacity whose receive rows do not fit names the workspace size that would.
  OpDescriptor big = moeDesc(OpKind::kMoeDispatchGemm, 100, 7168, 200, 8, 2, 2);
  big.dims[dim::kCapacity] = 1u << 20;
  const std::string why = refusal(big, ptrs, env, &code);
  CHECK(why.find("tandem_comm_config_t.workspace_bytes >= ") != std::string::npos);
  CHECK(code == ErrorCode::kInvalidArgument);
  // The workspace workspaceBytesFor declares for it fits it, for dispatch+GEMM and for the FFN's balanced rows.
  CHECK(refusal(big, ptrs, envWith(k::workspaceBytesFor(big, 2), 2), nullptr).empty());
  const OpDescriptor ffn = moeDesc(OpKind::kMoeDispatchFfnCombine, 4096, 4096, 14336, 8, 2, 2);
  CHECK(refusal(ffn, ptrs, envWith(k::workspaceBytesFor(ffn, 2), 2), nullptr).empty());
  // A workspace too small for even the control area says so.
  const k::FusedEnv tiny = envWith(1u << 20, 2);
  CHECK(refusal(moeDesc(OpKind::kMoeDispatchGemm, 1, 8, 8, 2, 1, 2), ptrs, tiny, nullptr).find("workspace") !=
        std::string::npos);
}

TEST_CASE("moe ops: a data error's text names the op, the rank and the bad id or the rows") {
  const OpDescriptor d = moeDesc(OpKind::kMoeDispatchGemm, 64, 256, 256, 8, 2, 2);
  k::OpFault f{};
  f.epoch = 1;
  f.code = static_cast<uint32_t>(k::WaitError::kMoeRouting);
  f.op = static_cast<uint32_t>(OpKind::kMoeDispatchGemm);
  f.atFault = 1;
  f.chunk = 5;                                  // the token
  f.observed = (uint64_t{1} << 32) | 13u;       // slot 1, id 13 (out of range for 8 experts)
  std::string text = k::moeFaultText(f, d);
  INFO(text);
  CHECK(text.find("moe-dispatch-gemm: rank 1 topk_ids[5][1] = 13 is out of range") == 0);
  f.observed = (uint64_t{1} << 62) | 4u;        // slot 0 repeats expert 4
  text = k::moeFaultText(f, d);
  CHECK(text.find("token 5 names expert 4 twice") != std::string::npos);
  f.code = static_cast<uint32_t>(k::WaitError::kMoeCapacity);
  f.atFault = 0;
  f.chunk = 100;  // capacity
  f.observed = 130;
  text = k::moeFaultText(f, d);
  CHECK(text.find("rank 0 receives 130 rows but capacity is 100; pass capacity >= 130") != std::string::npos);
  const OpDescriptor ffn = moeDesc(OpKind::kMoeDispatchFfnCombine, 64, 256, 256, 8, 2, 2);
  f.op = static_cast<uint32_t>(OpKind::kMoeDispatchFfnCombine);
  text = k::moeFaultText(f, ffn);
  CHECK(text.find("moe-dispatch-ffn-combine: rank 0 receives 130 rows but its workspace holds 100") == 0);
  CHECK(text.find("still usable") != std::string::npos);
  // The backward's rows live in the workspace too: the remedy names the larger workspace its rows need.
  const OpDescriptor bwd = moeDesc(OpKind::kMoeFfnBackward, 64, 256, 256, 8, 2, 2);
  f.op = static_cast<uint32_t>(OpKind::kMoeFfnBackward);
  text = k::moeFaultText(f, bwd);
  CHECK(text.find("moe-ffn-backward: rank 0 receives 130 rows but its workspace holds 100") == 0);
  CHECK(k::workspaceBytesFor(bwd, 2, 100000) > k::workspaceBytesFor(ffn, 2, 100000));
}
