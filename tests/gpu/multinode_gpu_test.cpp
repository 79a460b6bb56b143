// Multi-node communicators on the cuda backend (issue 7): two tandemd daemons, each owning one GPU (cuda.devices),
// connected as a two-node cluster over tcp on loopback (127.0.0.1 and 127.0.0.2), and one rank per node. tandemd
// stages these ops through host memory (daemon/src/cuda/cuda_multinode.hpp): every output is checked against the fp64
// reference (common/reference.hpp), one op at a time and back to back on one stream. Then a rank killed mid-op on one
// node must release the other node's stream with PEER_LOST. Needs 2 GPUs.
#include <array>
#include <memory>
#include <vector>

#include "gpu_harness.hpp"
#include "tandem/common/gpu_uuid.hpp"
#include "tandem/common/reference.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

// The UUID of GPU `ordinal`, read in a child (this process never initialises CUDA).
std::string gpuUuid(int ordinal) {
  Rank child = spawn([ordinal](const Io&) -> std::string {
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, ordinal));
    return tandem::formatGpuUuid(prop.uuid.bytes);
  });
  std::string uuid = child.read(30000);
  child.reap();
  REQUIRE_MESSAGE(uuid.rfind("GPU-", 0) == 0, uuid);
  return uuid;
}

// Two daemons on loopback, daemon i owning GPU rankDevice(i) (both the one GPU where only one exists), executor client. Ports derive from the pid (below the ephemeral
// range) so parallel test processes do not collide.
struct TwoNodes {
  std::vector<std::unique_ptr<Daemon>> daemons;

  TwoNodes() {
    const int port = 20000 + static_cast<int>((::getpid() + 7919) % 12000);
    const std::string nodes = fmt::format("\"127.0.0.1:{}\", \"127.0.0.2:{}\"", port, port);
    for (int i = 0; i < 2; ++i) {
      const std::string config = fmt::format(
          "daemon:\n  backend: cuda\n  executor: client\n"
          "cuda:\n  devices: [\"{}\"]\n"
          "communicators:\n  peer_lost_deadline_ms: 2000\n"
          "cluster:\n  nodes: [{}]\n  node_index: {}\n  secret: \"gpu-multinode-test-secret-0123456789\"\n"
          "  connect_timeout_ms: 15000\n  heartbeat_interval_ms: 100\n  staging_bytes: 67108864\n",
          gpuUuid(rankDevice(static_cast<uint32_t>(i))), nodes, i);
      daemons.push_back(std::make_unique<Daemon>(config, std::vector<std::string>{}, ""));
    }
  }
  bool connected(int timeoutMs = 20000) const { return clusterNodesIn(daemons, "connected", timeoutMs); }
  std::string logs() const { return clusterLogs(daemons); }
};

ref::OpShape shapeOf(OpKind kind, DType dtype, uint64_t m, uint64_t n, uint64_t k) {
  ref::OpShape s;
  s.kind = kind;
  s.dtype = dtype;
  s.m = m;
  s.n = n;
  s.k = k;  // gemm-rs/ar: the total K, split over the ranks with rowsOf
  return s;
}
ref::OpShape allgatherOf(uint64_t bytes) {
  ref::OpShape s;
  s.kind = OpKind::kAllGather;
  s.bytes = bytes;
  return s;
}

std::string describe(const ref::OpShape& s) {
  if (s.kind == OpKind::kAllGather) return fmt::format("allgather {} bytes", s.bytes);
  return fmt::format("{} {} m={} n={} k={}", tandem::opKindName(s.kind), tandem::dtypeName(s.dtype), s.m, s.n, s.k);
}

// Odd shapes on purpose: the host-staged path has none of the kernels' tile, alignment or dtype rules. Includes a rank
// without rows (m = 1) and fp32.
std::vector<ref::OpShape> cases() {
  const DType bf16 = DType::kBF16, fp16 = DType::kF16, fp32 = DType::kF32;
  return {
      shapeOf(OpKind::kAgGemm, bf16, 1, 8, 8),         shapeOf(OpKind::kAgGemm, bf16, 777, 520, 264),
      shapeOf(OpKind::kAgGemm, fp16, 300, 264, 72),    shapeOf(OpKind::kAgGemm, fp32, 129, 33, 17),
      shapeOf(OpKind::kAgGemm, bf16, 1024, 768, 512),  shapeOf(OpKind::kGemmRs, bf16, 1, 8, 16),
      shapeOf(OpKind::kGemmRs, bf16, 300, 520, 208),   shapeOf(OpKind::kGemmRs, fp16, 777, 264, 80),
      shapeOf(OpKind::kGemmRs, bf16, 37, 19, 49),      shapeOf(OpKind::kGemmRs, bf16, 1024, 768, 512), 
      shapeOf(OpKind::kGemmAr, bf16, 300, 264, 128),   shapeOf(OpKind::kGemmAr, fp16, 29, 16, 48),
      allgatherOf(1001),                               allgatherOf((1u << 20) + 3),
  };
}

// One op as one rank runs it: every rank's inputs (the reference needs them all), this rank's expected outputs and
// device buffers.
struct OpRun {
  std::vector<OpDescriptor> descs;
  std::vector<std::array<std::vector<std::byte>, tandem::kMaxOpBuffers>> host;
  std::array<std::vector<double>, tandem::kMaxOpBuffers> want;
  std::array<tandem_buffer_t, tandem::kMaxOpBuffers> buf{};
  uint32_t rank;
  tandem_op_t op{};

  OpRun(tandem_session_t s, const ref::OpShape& shape, uint32_t r, uint32_t n, uint64_t seed) : rank(r) {
    std::vector<std::array<const std::byte*, tandem::kMaxOpBuffers>> inputs(n);
    host.resize(n);
    for (uint32_t q = 0; q < n; ++q) {
      descs.push_back(ref::makeDescriptor(shape, q, n));
      std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
      for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
        host[q][i].resize(descs[q].bufs[i].bytes);
        slots[i] = host[q][i].empty() ? nullptr : host[q][i].data();
        inputs[q][i] = slots[i];
      }
      ref::fillInputs(descs[q], slots, seed);  // outputs poisoned with NaN
    }
    want = ref::compute(descs, inputs)[r];
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (host[r][i].empty()) continue;  // e.g. the A shard of a rank without rows: no buffer
      TK(tandem_alloc(s, host[r][i].size(), &buf[i]));
    }
    upload();
  }
  ~OpRun() {
    for (tandem_buffer_t b : buf) {
      if (b != nullptr) tandem_free(b);
    }
  }
  OpRun(const OpRun&) = delete;
  OpRun& operator=(const OpRun&) = delete;

  // Inputs, and the poisoned outputs, to the GPU.
  void upload() {
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (buf[i] != nullptr) {
        CK(cudaMemcpy(tandem_buffer_ptr(buf[i]), host[rank][i].data(), host[rank][i].size(), cudaMemcpyHostToDevice));
      }
    }
    // A pageable copy may still be in flight when cudaMemcpy returns, and the ops' streams are non-blocking.
    CK(cudaDeviceSynchronize());
  }
  tandem_tensor_t tensor(int s) const { return {buf[static_cast<std::size_t>(s)], 0}; }

  std::string submit(tandem_comm_t comm, cudaStream_t stream) {
    const OpDescriptor& d = descs[rank];
    const auto dtype = static_cast<tandem_dtype_t>(d.dtype);
    tandem_status_t st = TANDEM_SUCCESS;
    switch (d.kind) {
      case OpKind::kAgGemm: {
        const tandem_ag_gemm_args_t args{sizeof args, dtype, d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK],
                                         tensor(slot::kA), tensor(slot::kB), tensor(slot::kC),
                                         tensor(slot::kAGathered), stream};
        st = tandem_ag_gemm(comm, &args, &op);
        break;
      }
      case OpKind::kGemmRs: {
        const tandem_gemm_rs_args_t args{sizeof args, dtype, d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK],
                                         tensor(slot::kA), tensor(slot::kB), tensor(slot::kC), stream};
        st = tandem_gemm_rs(comm, &args, &op);
        break;
      }
      case OpKind::kGemmAr: {
        const tandem_gemm_ar_args_t args{sizeof args, dtype, d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK],
                                         tensor(slot::kA), tensor(slot::kB), tensor(slot::kC), stream};
        st = tandem_gemm_ar(comm, &args, &op);
        break;
      }
      case OpKind::kAllGather: {
        const tandem_allgather_args_t args{sizeof args, tensor(slot::kSend), tensor(slot::kRecv), d.dims[dim::kBytes],
                                           stream};
        st = tandem_allgather(comm, &args, &op);
        break;
      }
      default: return "unexpected kind";
    }
    return st == TANDEM_SUCCESS ? "" : std::string("submit: ") + tandem_last_error();
  }

  // After the stream synced: "" or what differs from the reference.
  std::string check() {
    if (tandem_wait(op, 60000) != TANDEM_SUCCESS) return std::string("op failed: ") + tandem_last_error();
    std::array<const std::byte*, tandem::kMaxOpBuffers> slots{};
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (!want[i].empty() && buf[i] != nullptr) {
        CK(cudaMemcpy(host[rank][i].data(), tandem_buffer_ptr(buf[i]), host[rank][i].size(), cudaMemcpyDeviceToHost));
      }
      slots[i] = host[rank][i].empty() ? nullptr : host[rank][i].data();
    }
    const ref::Comparison cmp = ref::compareRank(descs[rank], slots, want);
    return cmp.ok ? std::string() : fmt::format("{} (relative error {:.3g})", cmp.detail, cmp.relError);
  }
};

std::string barrier(tandem_comm_t comm, cudaStream_t stream) {
  tandem_op_t op;
  const tandem_barrier_args_t args{sizeof args, stream};
  if (tandem_barrier_stream(comm, &args, &op) != TANDEM_SUCCESS) return std::string("submit: ") + tandem_last_error();
  if (std::string synced = syncWithin(stream, 30000); synced != "synced") return "stream " + synced;
  if (tandem_wait(op, 30000) != TANDEM_SUCCESS) return std::string("failed: ") + tandem_last_error();
  return "";
}

// Rank `rank` of 2, on GPU `rank`, through its own node's daemon.
std::string rankBody(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank) {
  constexpr uint32_t n = 2;
  CK(cudaSetDevice(rankDevice(rank)));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, n, rank, 60000, &comm));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto all = cases();

  // One at a time.
  for (std::size_t i = 0; i < all.size(); ++i) {
    OpRun run(s, all[i], rank, n, 1000 + i);
    if (std::string e = run.submit(comm, stream); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
    if (std::string synced = syncWithin(stream, 30000); synced != "synced") {
      return fmt::format("FAIL {}: stream {}", describe(all[i]), synced);
    }
    if (std::string e = run.check(); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
  }
  for (int i = 0; i < 3; ++i) {
    if (std::string e = barrier(comm, stream); !e.empty()) return fmt::format("FAIL barrier {}: {}", i, e);
  }

  // Back to back on one stream, a barrier in the middle: each op's inputs are read only once the stream reached it.
  {
    std::vector<std::unique_ptr<OpRun>> runs;
    for (std::size_t i = 0; i < all.size(); ++i) runs.push_back(std::make_unique<OpRun>(s, all[i], rank, n, 2000 + i));
    tandem_op_t mid{};
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (std::string e = runs[i]->submit(comm, stream); !e.empty()) {
        return fmt::format("FAIL back to back {}: {}", describe(all[i]), e);
      }
      const tandem_barrier_args_t barrierArgs{sizeof barrierArgs, stream};
      if (i == all.size() / 2 && tandem_barrier_stream(comm, &barrierArgs, &mid) != TANDEM_SUCCESS) {
        return std::string("FAIL back to back barrier: ") + tandem_last_error();
      }
    }
    if (std::string synced = syncWithin(stream, 60000); synced != "synced") return "FAIL back to back: stream " + synced;
    if (tandem_wait(mid, 10000) != TANDEM_SUCCESS) return std::string("FAIL back to back barrier: ") + tandem_last_error();
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (std::string e = runs[i]->check(); !e.empty()) return fmt::format("FAIL back to back {}: {}", describe(all[i]), e);
    }
  }

  // What does not run across nodes is refused before submission (both ranks alike), and the communicator lives on.
  {
    tandem_buffer_t a, b, c;
    TK(tandem_alloc(s, 16u << 20, &a));
    TK(tandem_alloc(s, 16u << 20, &b));
    TK(tandem_alloc(s, 16u << 20, &c));
    const tandem_moe_dispatch_gemm_args_t moe{sizeof moe, TANDEM_DTYPE_BF16, 8, 64, 64, 2 * n, 1, 16,
                                              {a, 0}, {b, 0}, {c, 0}, {a, 1u << 20}, {b, 1u << 20}, {c, 1u << 20},
                                              {a, 2u << 20}, stream};
    tandem_op_t op;
    const tandem_status_t st = tandem_moe_dispatch_gemm(comm, &moe, &op);
    const std::string msg = tandem_last_error();
    TK(tandem_free(a));
    TK(tandem_free(b));
    TK(tandem_free(c));
    if (st != TANDEM_ERROR_UNSUPPORTED || msg.find("several nodes") == std::string::npos) {
      return fmt::format("FAIL moe-dispatch-gemm across nodes gave {} '{}'", static_cast<int>(st), msg);
    }
    if (std::string e = barrier(comm, stream); !e.empty()) return "FAIL barrier after the refusal: " + e;
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

}  // namespace

TEST_CASE("two nodes, one GPU each: ag-gemm, gemm-rs, gemm-ar, allgather and barriers across nodes match the fp64 "
          "reference") {
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  MESSAGE("cases (tandemd stages them through host memory):");
  for (const auto& s : cases()) MESSAGE("  " << describe(s));
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.push_back(spawn([&, r](const Io&) { return rankBody(c.daemons[r]->socket(), id, r); }));
  }
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string result = ranks[r].read(120000);
    INFO("rank " << r << " (node " << r << "): " << result);
    INFO(c.logs());
    CHECK(result == "OK");
  }
  for (auto& r : ranks) r.reap();
  for (const auto& d : c.daemons) {
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
}

TEST_CASE("two nodes, one GPU each: a rank killed mid-op on one node releases the other node's stream with PEER_LOST") {
  if (mpsRunning()) {
    MESSAGE("skipped: needs no MPS (a kill under MPS poisons the MPS server)");
    return;
  }
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  // The victim's stream is gated, so it never reaches the op: the survivor's node has sent its payload and waits.
  Rank survivor = spawn([&](const Io& io) { return gatedRank(io, c.daemons[0]->socket(), id, 0, false, GatedOp::kAgGemm); });
  Rank victim = spawn([&](const Io& io) { return gatedRank(io, c.daemons[1]->socket(), id, 1, true, GatedOp::kAgGemm); });
  expectStreamReleasedAfterKill(survivor, victim, false, [&] { return c.logs(); });
  for (const auto& d : c.daemons) {
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
}
