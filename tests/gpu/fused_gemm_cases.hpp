// What the fused GEMM ops' end-to-end GPU tests share (fused_layouts_gpu_test.cpp, fused_fp8_gpu_test.cpp): one case
// (op, layout, dtype, shape, and the FP8 output dtype and scaling), its descriptors, its submission through the public
// C entry points, and the rank process that runs a list of cases, checks the first run of each against the fp64
// reference and every later run against the first, bit for bit.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "rank_buffers.hpp"
#include "submit_op.hpp"

namespace tandem::gputest {

// One op: kind, layout, dtype, global m, n and k (gemm-rs/ar: K split evenly over the ranks); FP8 dtypes also take
// c's dtype (kInvalid: bf16) and the scaling (block, else per tensor). tolerance > 0 replaces the reference's
// (RankBuffers::compare).
struct GemmCase {
  OpKind kind;
  GemmOperands layout;
  DType dtype;
  uint64_t m, n, k;
  DType outDtype = DType::kInvalid;
  bool blockScale = false;
  double tolerance = 0;
};

inline std::string describe(const GemmCase& c) {
  std::string s = fmt::format("{} {} {} m={} n={} k={}", opKindName(c.kind), gemmLayoutName(c.layout),
                              dtypeName(c.dtype), c.m, c.n, c.k);
  if (isFp8(c.dtype)) {
    s += fmt::format(" out={} {}", dtypeName(c.outDtype == DType::kInvalid ? DType::kBF16 : c.outDtype),
                     c.blockScale ? "block-scaled" : "per-tensor");
  }
  return s;
}

inline std::vector<OpDescriptor> descriptorsOf(const GemmCase& c, uint32_t n) {
  reference::OpShape shape;
  shape.kind = c.kind;
  shape.dtype = c.dtype;
  shape.m = c.m;
  shape.n = c.n;
  shape.k = c.k;
  shape.layout = c.layout;
  shape.outDtype = c.outDtype;
  shape.blockScale = c.blockScale;
  std::vector<OpDescriptor> v;
  for (uint32_t q = 0; q < n; ++q) v.push_back(reference::makeDescriptor(shape, q, n));
  return v;
}

// The op of `b` through tandem_ag_gemm / tandem_gemm_rs / tandem_gemm_ar, its FP8 fields from the descriptor (zero,
// and the scale slots absent, for other dtypes).
inline tandem_status_t submitGemm(const RankBuffers& b, tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) {
  return submitGemmOp(b.desc(), [&b](int s) { return b.tensor(s); }, comm, stream, op);
}

// One rank: joins and runs every case `repeats` times, the first checked against the reference, the others against
// the first bit for bit (every output slot: C, and ag-gemm's a_gathered).
inline std::string gemmCasesRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks,
                                 uint32_t rank, const std::vector<GemmCase>& cases, int repeats) {
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
      if (submitGemm(b, comm, stream, &op) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {} run {}: submit: {}", what, rep, tandem_last_error());
      }
      if (std::string e = finishOp(stream, op); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      b.download();
      std::vector<std::vector<std::byte>> outs;
      for (int sl : {slot::kC, slot::kAGathered}) {
        if (static_cast<std::size_t>(sl) < b.host[rank].size()) outs.push_back(b.host[rank][sl]);
      }
      if (rep == 0) {
        if (std::string e = b.compare(cases[i].tolerance); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
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

// `nranks` rank processes on daemon `d`, each running gemmCasesRank.
inline void runGemmCases(const Daemon& d, uint32_t nranks, const std::vector<GemmCase>& cases, int repeats) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c);
  MESSAGE(nranks << " rank(s) on " << gpuCount() << " GPU(s), " << repeats << " run(s) each:" << o.str());
  runRankProcesses(d, nranks, 600000, [&](const tandem_unique_id_t& id, uint32_t r) {
    return gemmCasesRank(d.socket(), id, nranks, r, cases, repeats);
  });
}

}  // namespace tandem::gputest
