// Every fused op end to end on the CPU backend: N rank processes (tandemctl run), checked against the
// independent fp64 reference, at 1, 2, 4 and 8 ranks.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "every_op.hpp"
#include "gemm_args.hpp"
#include "harness.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;

namespace {

void runChecked(const Daemon& d, const std::vector<std::string>& args) {
  int code = 1;
  std::vector<std::string> full = {"run"};
  full.insert(full.end(), args.begin(), args.end());
  full.push_back("--check");
  const std::string out = d.ctl(full, &code, 120000);
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("PASS") != std::string::npos);
}

// Every op of the table runs here: one without a shape fails "every op matches the reference".
const std::map<std::string, std::vector<std::string>> kOpShapes = {
    {"ag-gemm", {"--m", "37", "--n", "19", "--k", "24"}},
    {"gemm-rs", {"--m", "29", "--n", "17", "--k", "40"}},
    {"gemm-ar", {"--m", "21", "--n", "13", "--k", "36"}},
    {"moe-dispatch-gemm", {"--m", "13", "--n", "12", "--k", "16", "--experts", "8", "--topk", "2"}},
    {"moe-dispatch-ffn-combine", {"--m", "11", "--n", "10", "--k", "16", "--experts", "8", "--topk", "2"}},
    {"moe-ffn-backward", {"--m", "11", "--n", "10", "--k", "16", "--experts", "8", "--topk", "3"}},
    {"ring-attention", {"--seq", "29", "--heads", "2", "--head-dim", "16"}},
    {"ring-attention-backward", {"--seq", "29", "--heads", "4", "--head-dim", "16", "--kv-heads", "2"}},
    {"allgather", {"--bytes", "1000"}},
    {"barrier", {}},
};

}  // namespace

TEST_CASE("every op matches the reference at 1, 2, 4 and 8 ranks") {
  Daemon d;
  for (const auto& shape : everyOp(kOpShapes, "ops_test (tandemctl run on the cpu backend)")) {
    for (const char* ranks : {"1", "2", "4", "8"}) {
      CAPTURE(shape[0]);
      CAPTURE(ranks);
      auto args = shape;
      args.insert(args.end(), {"--ranks", ranks});
      if (tandem::findOp(shape[0])->typed) args.insert(args.end(), {"--dtype", "bf16"});  // (untyped: no --dtype)
      runChecked(d, args);
    }
  }
}

TEST_CASE("ops in fp16 and fp32, non-causal attention, and allgather") {
  Daemon d;
  runChecked(d, {"ag-gemm", "--ranks", "3", "--m", "31", "--n", "9", "--k", "8", "--dtype", "fp32"});
  runChecked(d, {"gemm-ar", "--ranks", "3", "--m", "10", "--n", "7", "--k", "33", "--dtype", "fp16"});
  runChecked(d, {"ring-attention", "--ranks", "3", "--seq", "20", "--heads", "1", "--head-dim", "8", "--no-causal",
                 "--dtype", "fp32"});
  runChecked(d, {"allgather", "--ranks", "4", "--bytes", "1000"});
  runChecked(d, {"barrier", "--ranks", "4", "--iters", "20"});
}

TEST_CASE("the MoE FFN ops with saved activations, through tandemctl run --saved-rows") {
  Daemon d;
  for (const char* op : {"moe-dispatch-ffn-combine", "moe-ffn-backward"}) {
    for (const char* ranks : {"1", "3"}) {
      CAPTURE(op);
      CAPTURE(ranks);
      // 3 ranks x 11 tokens x top-2: every row could land on one rank.
      runChecked(d, {op, "--ranks", ranks, "--m", "11", "--n", "10", "--k", "16", "--experts", "6", "--topk", "2",
                     "--saved-rows", "66", "--dtype", "bf16"});
    }
  }
}

// FP8 a and b through tandemctl run --dtype fp8-*: each op in every layout the cpu backend runs, at 1 to 4 ranks, with
// the four (format, scaling, c dtype) rows that cover every pair of those choices, on sizes off the 128 scale blocks
// (k spans two k-blocks on one rank; m and n end mid-block), and then n across two of B's 128-row blocks.
TEST_CASE("the GEMM ops with FP8 inputs: e4m3 and e5m2, tensor and block scales, bf16 and fp32 c, every layout") {
  Daemon d;
  struct Variant {
    const char* dtype;
    const char* scaling;
    const char* out;
  };
  const Variant variants[] = {{"fp8-e4m3", "tensor", "bf16"},
                              {"fp8-e4m3", "block", "fp32"},
                              {"fp8-e5m2", "tensor", "fp32"},
                              {"fp8-e5m2", "block", "bf16"}};
  const char* layouts[] = {"nt", "nn", "tn"};
  // gemm-rs and gemm-ar split k over the ranks: 300 keeps more than one k-block per rank up to 2 ranks.
  const std::map<std::string, std::vector<std::string>> shapes = {
      {"ag-gemm", {"--m", "37", "--n", "19", "--k", "200"}},
      {"gemm-rs", {"--m", "29", "--n", "19", "--k", "300"}},
      {"gemm-ar", {"--m", "21", "--n", "19", "--k", "300"}},
  };
  for (const auto& [op, shape] : shapes) {
    // 12 runs: i % 3 and i % 4 give every (layout, variant) pair, i / 3 every rank count with every layout.
    for (int i = 0; i < 12; ++i) {
      const Variant& v = variants[i % 4];
      const std::string ranks = std::to_string(1 + i / 3);
      CAPTURE(op);
      CAPTURE(i);
      std::vector<std::string> args = {op, "--ranks", ranks, "--layout", layouts[i % 3], "--dtype", v.dtype,
                                       "--scaling", v.scaling, "--out-dtype", v.out};
      args.insert(args.end(), shape.begin(), shape.end());
      runChecked(d, args);
    }
    runChecked(d, {op, "--ranks", "2", "--m", "9", "--n", "131", "--k", "260", "--dtype", "fp8-e4m3", "--scaling",
                   "block", "--layout", "nn"});
  }
}

// FP8 expert weights (--w-dtype fp8-e4m3: e4m3 with 128x128 block scales, x in bf16) through both MoE ops that take
// them, with hidden and n spanning two blocks.
TEST_CASE("the MoE ops with FP8 weights match the reference") {
  Daemon d;
  runChecked(d, {"moe-dispatch-gemm", "--ranks", "2", "--m", "13", "--n", "136", "--k", "200", "--experts", "4",
                 "--topk", "2", "--dtype", "bf16", "--w-dtype", "fp8-e4m3"});
  runChecked(d, {"moe-dispatch-ffn-combine", "--ranks", "2", "--m", "11", "--n", "140", "--k", "200", "--experts", "4",
                 "--topk", "2", "--dtype", "bf16", "--w-dtype", "fp8-e4m3"});
}

TEST_CASE("a communicator of 64 ranks forms and runs collectives") {
  Daemon d;
  runChecked(d, {"barrier", "--ranks", "64", "--iters", "3"});
  runChecked(d, {"gemm-ar", "--ranks", "64", "--m", "9", "--n", "5", "--k", "70", "--dtype", "fp32"});
}

TEST_CASE("the C++ API: two sessions in one process run ag-gemm with the gathered A") {
  Daemon d;
  const tandem_unique_id_t id = tandem::uniqueId();
  const uint64_t m = 10, n = 6, k = 8;
  std::vector<float> gathered[2], c[2];
  auto rank = [&](uint32_t r) {
    tandem::Session s(d.socket().c_str());
    tandem::Communicator comm(s, id, 2, r, 10000);
    const uint64_t rows = tandem::rowsOf(m, r, 2);
    tandem::Buffer a(s, rows * k * 4), b(s, n * k * 4), out(s, m * n * 4), ag(s, m * k * 4);
    for (uint64_t i = 0; i < rows * k; ++i) a.as<float>()[i] = static_cast<float>(r * 100 + i);
    for (uint64_t i = 0; i < n * k; ++i) b.as<float>()[i] = (i % 3 == 0) ? 1.0f : 0.0f;
    const auto args =
        agGemmArgs(TANDEM_DTYPE_FP32, m, n, k, a.tensor(), b.tensor(), out.tensor(), ag.tensor(), nullptr);
    tandem_op_t op;
    tandem::check(tandem_ag_gemm(comm.get(), &args, &op));
    tandem::wait(op, 10000);
    gathered[r].assign(ag.as<float>(), ag.as<float>() + m * k);
    c[r].assign(out.as<float>(), out.as<float>() + m * n);
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  // Rank 0 holds rows [0, 5), rank 1 rows [5, 10); gathered A is the same on both ranks.
  CHECK(gathered[0] == gathered[1]);
  CHECK(gathered[0][0] == 0.0f);
  CHECK(gathered[0][5 * k] == 100.0f);
  // C[i][j] = sum of A[i][kk] where B[j][kk] == 1; both ranks use the same B here.
  for (uint64_t i = 0; i < m; ++i) {
    for (uint64_t j = 0; j < n; ++j) {
      float expect = 0;
      for (uint64_t kk = 0; kk < k; ++kk) expect += ((j * k + kk) % 3 == 0) ? gathered[0][i * k + kk] : 0.0f;
      CHECK(c[0][i * n + j] == expect);
    }
  }
  CHECK(c[0] == c[1]);
}

TEST_CASE("ops that are never waited on do not get an honest session closed as non-draining") {
  // A stream-ordered loop submits ops and never waits on them (the stream orders them). Here each op's output is
  // watched in shared memory instead, so the client calls into libtandem only to submit, and far more completions
  // come back than the ring and limits.max_pending_completions hold together (8 + 16).
  Daemon d("rings:\n  capacity: 8\nlimits:\n  max_pending_completions: 16\n");
  tandem::Session s(d.socket().c_str());
  tandem::Communicator comm(s, tandem::uniqueId(), 1, 0, 10000);
  tandem::Buffer send(s, 8), recv(s, 8);
  auto* in = send.as<uint64_t>();
  volatile auto* out = recv.as<uint64_t>();
  tandem_op_t op{};
  for (uint64_t i = 1; i <= 200; ++i) {
    *in = i;
    const tandem_allgather_args_t args{sizeof args, send.tensor(), recv.tensor(), 8, nullptr};
    tandem::check(tandem_allgather(comm.get(), &args, &op));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (*out != i && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    REQUIRE(*out == i);
  }
  tandem::wait(op, 10000);
}

// The two fields appended to tandem_ring_attention_args_t: lse and the zigzag layout against the fp64 reference, a
// caller built against the 0.2 struct (struct_size ends at cuda_stream: no lse, contiguous), and a bad layout.
TEST_CASE("ring attention through the C API: lse, the zigzag layout, and callers of the 0.2 struct") {
  namespace ref = tandem::reference;
  Daemon d;
  const tandem_unique_id_t id = tandem::uniqueId();
  for (const bool zigzag : {true, false}) {
    CAPTURE(zigzag);
    ref::OpShape shape;
    shape.kind = tandem::OpKind::kRingAttention;
    shape.dtype = tandem::DType::kF32;
    shape.seq = 23;
    shape.heads = 2;
    shape.headDim = 8;
    shape.causal = true;
    shape.zigzag = zigzag;
    std::vector<tandem::OpDescriptor> descs;
    std::vector<std::array<std::vector<std::byte>, tandem::kMaxOpBuffers>> host(2);
    std::vector<std::array<const std::byte*, tandem::kMaxOpBuffers>> inputs(2);
    for (uint32_t r = 0; r < 2; ++r) {
      descs.push_back(ref::makeDescriptor(shape, r, 2));
      std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
      for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
        host[r][s].resize(descs[r].bufs[s].bytes);
        slots[s] = host[r][s].empty() ? nullptr : host[r][s].data();
        inputs[r][s] = slots[s];
      }
      ref::fillInputs(descs[r], slots, 99);
    }
    const ref::Expected want = ref::compute(descs, inputs);
    std::string result[2];
    auto rank = [&](uint32_t r) {
      tandem::Session s(d.socket().c_str());
      tandem::Communicator comm(s, id, 2, r, 10000);
      const tandem::OpDescriptor& desc = descs[r];
      std::vector<std::unique_ptr<tandem::Buffer>> b;
      for (int slotIndex = 0; slotIndex < 5; ++slotIndex) {
        const auto& h = host[r][static_cast<std::size_t>(slotIndex)];
        b.push_back(std::make_unique<tandem::Buffer>(s, std::max<std::size_t>(h.size(), 16)));
        if (!h.empty()) std::memcpy(b.back()->as<std::byte>(), h.data(), h.size());
      }
      tandem_ring_attention_args_t a{};
      a.struct_size = sizeof a;
      a.dtype = TANDEM_DTYPE_FP32;
      a.seq = desc.dims[tandem::dim::kSeq];
      a.heads = shape.heads;
      a.head_dim = shape.headDim;
      a.causal = 1;
      a.q = b[0]->tensor();
      a.k = b[1]->tensor();
      a.v = b[2]->tensor();
      a.out = b[3]->tensor();
      a.lse = b[4]->tensor();
      a.layout = zigzag ? TANDEM_ATTENTION_ZIGZAG : TANDEM_ATTENTION_CONTIGUOUS;
      tandem_op_t op;
      tandem::check(tandem_ring_attention(comm.get(), &a, &op));
      tandem::wait(op, 10000);
      std::array<const std::byte*, tandem::kMaxOpBuffers> got{};
      for (std::size_t i = 0; i < 5; ++i) got[i] = b[i]->as<std::byte>();
      const ref::Comparison c = ref::compareRank(desc, got, want[r]);
      result[r] = c.ok ? "ok" : c.detail;
      if (zigzag) return;
      // A 0.2 caller: its struct ends at cuda_stream, so lse and layout are never read (lse stays as it was).
      std::vector<float> lseBefore(b[4]->as<float>(), b[4]->as<float>() + a.seq * a.heads);
      a.lse = {nullptr, 0};
      a.layout = static_cast<tandem_attention_layout_t>(7);  // garbage past the old struct's end: must not be read
      a.struct_size = offsetof(tandem_ring_attention_args_t, cuda_stream) + sizeof(void*);
      std::memset(b[3]->as<std::byte>(), 0xFF, host[r][3].size());
      tandem::check(tandem_ring_attention(comm.get(), &a, &op));
      tandem::wait(op, 10000);
      std::array<const std::byte*, tandem::kMaxOpBuffers> outOnly{got[0], got[1], got[2], got[3]};
      std::array<std::vector<double>, tandem::kMaxOpBuffers> wantOut = want[r];
      wantOut[4].clear();
      const ref::Comparison c2 = ref::compareRank(desc, outOnly, wantOut);
      if (!c2.ok) result[r] = "0.2 struct: " + c2.detail;
      if (std::memcmp(lseBefore.data(), b[4]->as<float>(), lseBefore.size() * 4) != 0) {
        result[r] = "0.2 struct: lse written";
      }
      // A struct that has the layout field but an unknown value is refused before anything is submitted.
      a.struct_size = sizeof a;
      if (tandem_ring_attention(comm.get(), &a, &op) != TANDEM_ERROR_INVALID_ARGUMENT ||
          std::string(tandem_last_error()).find("layout 7") == std::string::npos) {
        result[r] = std::string("bad layout not refused: ") + tandem_last_error();
      }
    };
    std::thread t0(rank, 0), t1(rank, 1);
    t0.join();
    t1.join();
    CHECK(result[0] == "ok");
    CHECK(result[1] == "ok");
  }
}
