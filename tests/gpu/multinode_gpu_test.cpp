// Multi-node communicators on the cuda backend: two tandemd daemons, each owning one GPU (cuda.devices; both the one
// GPU where only one exists), connected as a two-node cluster over tcp on loopback (127.0.0.1 and 127.0.0.2). tandemd
// runs these ops itself (daemon/src/cuda/cuda_multinode.hpp): the fused GEMMs and allgather whose shapes the GEMM core
// takes on the GPUs, the bytes between the nodes issued by the GPUs (the GPU-issued exchange: kernels push transfer
// commands to a proxy thread of their GPU, which posts them through the transport into the peer's region), or, with
// cluster.gpu_exchange off and for what the GPU exchange does not take, moved by the host (staged exchange); the rest
// (fp32, odd shapes, barriers) on the host reference fallback. Every output is checked against the fp64 reference
// (common/reference.hpp), one op at a time and back to back on one stream, with one rank per node; then the fused GEMMs
// at GPU shapes off the tile with 1 and 2 ranks per node (the ranks interleaved over the nodes, so a node's rows are not
// contiguous), 20 repeats bitwise identical, gemm-ar bitwise identical on every rank, the daemons' logs naming the path;
// the same with the GPU exchange off, bitwise identical to it; the GPU path again over cluster.transport: verbs, on the
// verbs test double (tests/support/verbs_double, loaded by the daemons only), GPU memory registered with it, and a QP
// error it injects mid-op releasing both nodes' streams before the next communicator runs; under MPS the daemon
// executor over tcp and verbs. Then a rank killed mid-op on one node must release the other node's stream with
// PEER_LOST, before the first exchange and while the GPU's wait spins; so must a node's tandemd killed (then restarted
// with the same config: it rejoins, and the next communicator runs across it on the GPU path) and a hung node, which
// stands in for a cut link on loopback (SIGSTOP: found by the heartbeat deadline; after SIGCONT both nodes serve the
// next communicator).
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gpu_harness.hpp"
#include "rank_buffers.hpp"
#include "submit_op.hpp"
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

// The daemons' argv prefix for cluster.transport `transport`: verbs runs them on the verbs test double (its directory
// first in their LD_LIBRARY_PATH, so tandemd loads it in place of rdma-core; this process does not need it). Fails the
// test where the build has no double: verbs would then need a real RDMA device, which the GPU hosts do not have.
std::vector<std::string> transportPrefix(const std::string& transport) {
  if (transport != "verbs") return {};
#ifdef TANDEM_VERBS_DOUBLE_LIBDIR
  const char* inherited = std::getenv("LD_LIBRARY_PATH");
  std::string path = TANDEM_VERBS_DOUBLE_LIBDIR;
  if (inherited != nullptr && *inherited != '\0') path += std::string(":") + inherited;  // e.g. where libcuda is
  return {"/usr/bin/env", "LD_LIBRARY_PATH=" + path};
#else
  FAIL("cluster.transport: verbs needs the verbs test double, which this build of tandem_gpu_tests does not name "
       "(TANDEM_VERBS_DOUBLE_LIBDIR: tests/gpu/CMakeLists.txt defines it where tests/transport.cmake builds the double)");
  return {};
#endif
}

// communicators.peer_lost_deadline_ms of TwoNodes' daemons (heartbeats every 100 ms): a silent node is lost after this.
constexpr int kPeerLostDeadlineMs = 2000;

// Two daemons on loopback, daemon i owning GPU rankDevice(i) (both the one GPU where only one exists), with
// `executor` (daemon: under MPS), over cluster.transport `transport` (verbs: on the verbs test double). Ports derive
// from the pid (below the ephemeral range) so parallel test processes do not collide.
struct TwoNodes {
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> configs;                 // node i's tandemd.yaml, kept for restart
  std::vector<std::vector<std::string>> prefixes;   // and its argv prefix
  std::string previousLogs;                         // the logs of daemons that restart replaced

  // faults[i]: node i's TANDEM_VERBS_DOUBLE_FAULTS (verbs only), e.g. "qp_error_after_writes=40".
  explicit TwoNodes(const std::string& executor = "client", const std::string& gpuExchange = "on",
                    const std::string& transport = "tcp", const std::vector<std::string>& faults = {}) {
    const int port = 20000 + static_cast<int>((::getpid() + 7919) % 12000);
    const std::string nodes = fmt::format("\"127.0.0.1:{}\", \"127.0.0.2:{}\"", port, port);
    for (int i = 0; i < 2; ++i) {
      std::vector<std::string> prefix = transportPrefix(transport);
      if (static_cast<std::size_t>(i) < faults.size() && !faults[i].empty()) {
        REQUIRE_MESSAGE(!prefix.empty(), "verbs double faults need cluster.transport: verbs");
        prefix.push_back("TANDEM_VERBS_DOUBLE_FAULTS=" + faults[i]);  // another NAME=VALUE for /usr/bin/env
      }
      const std::string config = fmt::format(
          "daemon:\n  backend: cuda\n  executor: {}\n"
          "plans:\n  state_dir: {}\n"
          "cuda:\n  devices: [\"{}\"]\n"
          "communicators:\n  peer_lost_deadline_ms: {}\n"
          "cluster:\n  nodes: [{}]\n  node_index: {}\n  secret: \"gpu-multinode-test-secret-0123456789\"\n"
          "  transport: {}\n  connect_timeout_ms: 15000\n  heartbeat_interval_ms: 100\n  staging_bytes: 67108864\n"
          "  gpu_exchange: {}\n",
          executor, processPlanDir(), gpuUuid(rankDevice(static_cast<uint32_t>(i))), kPeerLostDeadlineMs, nodes, i,
          transport, gpuExchange);
      configs.push_back(config);
      prefixes.push_back(prefix);
      daemons.push_back(std::make_unique<Daemon>(config, std::vector<std::string>{}, "", prefix));
    }
  }
  // Starts node i's daemon again (after it died or was killed) with the same config and prefix: the same address and
  // port, so the other node's transport, which keeps re-dialing a lost node, finds it and it rejoins by itself. Its
  // socket is a new one (a new temp dir); the old daemon's log is kept for logs().
  void restart(int i) {
    previousLogs += fmt::format("---- node {} log before its restart:\n{}\n", i, daemons[i]->log());
    daemons[i].reset();  // reaps it (SIGKILL first if it still runs)
    daemons[i] = std::make_unique<Daemon>(configs[i], std::vector<std::string>{}, "", prefixes[i]);
  }
  bool connected(int timeoutMs = 20000) const { return clusterNodesIn(daemons, "connected", timeoutMs); }
  std::string logs() const { return previousLogs + clusterLogs(daemons); }
};

ref::OpShape shapeOf(OpKind kind, DType dtype, uint64_t m, uint64_t n, uint64_t k,
                     tandem::GemmOperands layout = tandem::GemmOperands::kNT) {
  ref::OpShape s;
  s.kind = kind;
  s.dtype = dtype;
  s.m = m;
  s.n = n;
  s.k = k;  // gemm-rs/ar: the total K, split over the ranks with rowsOf
  s.layout = layout;
  return s;
}

// The plan lines' suffix for a layout (cuda/multinode_common.hpp's layoutSuffix).
std::string layoutSuffix(tandem::GemmOperands layout) {
  return layout == tandem::GemmOperands::kNT ? std::string()
                                             : fmt::format(" layout {}", tandem::gemmLayoutName(layout));
}
ref::OpShape allgatherOf(uint64_t bytes) {
  ref::OpShape s;
  s.kind = OpKind::kAllGather;
  s.bytes = bytes;
  return s;
}

std::string describe(const ref::OpShape& s) {
  if (s.kind == OpKind::kAllGather) return fmt::format("allgather {} bytes", s.bytes);
  return fmt::format("{} {} m={} n={} k={}{}", tandem::opKindName(s.kind), tandem::dtypeName(s.dtype), s.m, s.n, s.k,
                     layoutSuffix(s.layout));
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
    want = ref::computeRank(descs, inputs, r);
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
    const tandem_status_t st = submitOp(descs[rank], [this](int s) { return tensor(s); }, comm, stream, &op);
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
    const OpDescriptor& d = descs[rank];
    const double tolerance = tandem::isFp8(d.dtype) ? fp8CoreTolerance(tandem::gemmOutDtype(d.dtype, d.flags),
                                                                       (d.flags & tandem::kFlagFp8BlockScale) != 0)
                                                    : 0;
    return compareWithin(d, slots, want, tolerance);
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

// A rank's process: on GPU `device`, connected to `socket`, rank `rank` of `n` in the communicator `id`, with a
// non-blocking stream. Throws (CK/TK) what failed.
struct JoinedRank {
  tandem_session_t s;
  tandem_comm_t comm;
  cudaStream_t stream;
};
JoinedRank joinRank(int device, const std::string& socket, const tandem_unique_id_t& id, uint32_t rank, uint32_t n) {
  JoinedRank j{};
  CK(cudaSetDevice(device));
  TK(tandem_connect(socket.c_str(), &j.s));
  TK(tandem_comm_init(j.s, &id, n, rank, 60000, &j.comm));
  CK(cudaStreamCreateWithFlags(&j.stream, cudaStreamNonBlocking));
  return j;
}

// Rank `rank` of 2, on GPU `rank`, through its own node's daemon.
std::string rankBody(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank) {
  constexpr uint32_t n = 2;
  auto [s, comm, stream] = joinRank(rankDevice(rank), socket, id, rank, n);
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
                                              {a, 2u << 20}, stream, TANDEM_DTYPE_INVALID, {}};
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

// The GPU path's cases: shapes off the 128-row tile, M split unevenly; k slices multiples of 8 (the GEMM core's rule;
// the balanced split of K can be uneven only by one, so an uneven K split always takes the host fallback); gemm-rs with
// n not a multiple of 8 (its partials are padded; ag-gemm writes C directly and needs n % 8 == 0). Then the backward's
// layouts (gpu_exchange_plan.hpp's gemmCoreRefusal has their rules): NN (dgrad) and TN (wgrad) of each op, TN with a k
// that is no multiple of 8 (the stored rows' count) and ag-gemm's TN shards [k, rows] of 8-row multiples; gemm-rs TN at
// m = 1000 pushes in passes starting at rows 328 and 664, columns of its stored A.
std::vector<ref::OpShape> gpuCases(uint32_t nranks) {
  const uint64_t k = nranks == 2 ? 1040 : 1056;  // k slices of 520 or 264
  std::vector<ref::OpShape> out;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    out.push_back(shapeOf(OpKind::kAgGemm, dt, 1001, 1000, 1040));
    out.push_back(shapeOf(OpKind::kGemmRs, dt, 1001, 1004, k));
    out.push_back(shapeOf(OpKind::kGemmAr, dt, 1000, 1000, k));
  }
  const auto NN = tandem::GemmOperands::kNN, TN = tandem::GemmOperands::kTN;
  out.push_back(shapeOf(OpKind::kAgGemm, DType::kBF16, 1001, 1016, 1040, NN));
  out.push_back(shapeOf(OpKind::kAgGemm, DType::kF16, 1024, 1008, 1003, TN));
  out.push_back(shapeOf(OpKind::kGemmRs, DType::kF16, 1001, 1000, k, NN));
  out.push_back(shapeOf(OpKind::kGemmRs, DType::kBF16, 1000, 1016, k + 3, TN));
  out.push_back(shapeOf(OpKind::kGemmAr, DType::kBF16, 999, 1008, k, NN));
  out.push_back(shapeOf(OpKind::kGemmAr, DType::kF16, 992, 1000, k + 5, TN));
  // FP8 inputs: ag-gemm's shards with their scales (per tensor, and block-scaled with an fp32 c: each shard's scales
  // regrouped for the FP8 core); gemm-rs/ar's fp32 partials from the FP8 core, per tensor with a bf16 c, block-scaled
  // with an fp32 c.
  ref::OpShape ag = shapeOf(OpKind::kAgGemm, DType::kF8E4M3, 1001, 1000, 1040);
  out.push_back(ag);
  ag.blockScale = true;
  ag.outDtype = DType::kF32;
  ag.n = 1008;
  out.push_back(ag);
  const uint64_t k16 = nranks == 2 ? 1056 : 1088;  // k slices of 528 or 272
  ref::OpShape rs = shapeOf(OpKind::kGemmRs, DType::kF8E4M3, 1001, 1000, k16);
  out.push_back(rs);
  ref::OpShape ar = shapeOf(OpKind::kGemmAr, DType::kF8E4M3, 1000, 1004, k16);
  ar.blockScale = true;
  ar.outDtype = DType::kF32;
  out.push_back(ar);
  return out;
}

// FNV-1a of the bytes: the ranks report their outputs' hashes, which the test compares across repeats and ranks.
uint64_t hashBytes(const std::vector<std::byte>& b) {
  uint64_t h = 1469598103934665603ull;
  for (std::byte x : b) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
  return h;
}

constexpr int kRepeats = 20;

// Rank `rank` of `n` on node rank % 2: every GPU case against the reference, then kRepeats more runs of it whose C
// must be bitwise the first's (C is poisoned before each). Returns "OK" and one C hash per case.
std::string spanBody(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank, uint32_t n) {
  auto [s, comm, stream] = joinRank(rankDevice(rank % 2), socket, id, rank, n);
  const auto all = gpuCases(n);
  std::string hashes;
  for (std::size_t i = 0; i < all.size(); ++i) {
    OpRun run(s, all[i], rank, n, 3000 + i);
    if (std::string e = run.submit(comm, stream); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
    if (std::string synced = syncWithin(stream, 60000); synced != "synced") {
      return fmt::format("FAIL {}: stream {}", describe(all[i]), synced);
    }
    if (std::string e = run.check(); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
    const tandem_buffer_t cbuf = run.buf[slot::kC];
    std::vector<std::byte> first(run.host[rank][slot::kC].size()), again(first.size());
    if (cbuf != nullptr) CK(cudaMemcpy(first.data(), tandem_buffer_ptr(cbuf), first.size(), cudaMemcpyDeviceToHost));
    for (int rep = 0; rep < kRepeats; ++rep) {
      if (cbuf != nullptr) CK(cudaMemsetAsync(tandem_buffer_ptr(cbuf), 0xff, first.size(), stream));  // NaN
      if (std::string e = run.submit(comm, stream); !e.empty()) {
        return fmt::format("FAIL {} repeat {}: {}", describe(all[i]), rep, e);
      }
      if (std::string synced = syncWithin(stream, 60000); synced != "synced") {
        return fmt::format("FAIL {} repeat {}: stream {}", describe(all[i]), rep, synced);
      }
      if (tandem_wait(run.op, 60000) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {} repeat {}: {}", describe(all[i]), rep, tandem_last_error());
      }
      if (cbuf != nullptr) CK(cudaMemcpy(again.data(), tandem_buffer_ptr(cbuf), again.size(), cudaMemcpyDeviceToHost));
      if (again != first) return fmt::format("FAIL {} repeat {}: C differs from the first run", describe(all[i]), rep);
    }
    hashes += fmt::format(" {:016x}", hashBytes(first));
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK" + hashes;
}

// The plan lines' paths.
const std::string kGpuExchangePlan = "GPU-issued exchange (proxy gpu";
const std::string kStagedOffPlan = "staged exchange + GPU GEMM; not GPU-issued: cluster.gpu_exchange is off";

// Whether `log` has a plan line for `shape` (k: rank 0's slice for gemm-rs/ar, as its descriptor says) at `nranks`
// ranks that names `plan`.
bool logShowsPlan(const std::string& log, const ref::OpShape& shape, uint32_t nranks, const std::string& plan) {
  const uint64_t k = shape.kind == OpKind::kAgGemm ? shape.k : tandem::rowsOf(shape.k, 0, nranks);
  const std::string what = fmt::format("{} {} m={} n={} k={}{} on {} ranks", tandem::opKindName(shape.kind),
                                       tandem::dtypeName(shape.dtype), shape.m, shape.n, k,
                                       layoutSuffix(shape.layout), nranks);
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find(what) != std::string::npos && line.find("plan " + plan) != std::string::npos) return true;
  }
  return false;
}

// One rank per node, each a process of its own running body(its node's socket, id, rank) for a fresh communicator of 2;
// their results in rank order, once both are read (each within timeoutMs) and reaped.
std::vector<std::string> onePerNode(
    const TwoNodes& c, const std::function<std::string(const std::string&, const tandem_unique_id_t&, uint32_t)>& body,
    int timeoutMs) {
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.push_back(spawn([&, r](const Io&) { return body(c.daemons[r]->socket(), id, r); }));
  }
  std::vector<std::string> results;
  for (auto& rank : ranks) results.push_back(rank.read(timeoutMs));
  for (auto& rank : ranks) rank.reap();
  return results;
}

}  // namespace

TEST_CASE("two nodes, one GPU each: ag-gemm, gemm-rs, gemm-ar, allgather and barriers across nodes match the fp64 "
          "reference") {
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  MESSAGE("cases (on the GPUs where the GEMM core takes them, else on the host reference fallback):");
  for (const auto& s : cases()) MESSAGE("  " << describe(s));
  const auto results = onePerNode(
      c, [](const std::string& socket, const tandem_unique_id_t& id, uint32_t r) { return rankBody(socket, id, r); },
      120000);
  for (uint32_t r = 0; r < 2; ++r) {
    INFO("rank " << r << " (node " << r << "): " << results[r]);
    INFO(c.logs());
    CHECK(results[r] == "OK");
  }
  const std::string hostPlan = "host reference fallback";
  for (const auto& d : c.daemons) {
    INFO(d->log());
    // Every path: bf16/fp16 at GPU shapes on the GPUs with the GPU-issued exchange (allgather too), fp32 on the host.
    CHECK(logShowsPlan(d->log(), shapeOf(OpKind::kAgGemm, DType::kBF16, 777, 520, 264), 2, kGpuExchangePlan));
    CHECK(logShowsPlan(d->log(), shapeOf(OpKind::kGemmAr, DType::kF16, 29, 16, 48), 2, kGpuExchangePlan));
    CHECK(logShowsPlan(d->log(), shapeOf(OpKind::kAgGemm, DType::kF32, 129, 33, 17), 2, hostPlan));
    CHECK(d->log().find("allgather 1001 bytes on 2 ranks across 2 nodes (1 here): plan GPU-issued exchange (proxy gpu") !=
          std::string::npos);
  }
  // k = 49 splits into 25 and 24: rank 0's slice is no GEMM core shape, so both nodes keep the host exchange (decided
  // from every rank's dims alike); node 0 computes on the host, node 1 on its GPU (n = 19: padded partials), and the
  // results still match the reference: both paths send the same fp32 payloads.
  CHECK(logShowsPlan(c.daemons[0]->log(), shapeOf(OpKind::kGemmRs, DType::kBF16, 37, 19, 49), 2, hostPlan));
  CHECK(logShowsPlan(c.daemons[1]->log(), shapeOf(OpKind::kGemmRs, DType::kBF16, 37, 19, 49), 2,
                     "staged exchange + GPU GEMM; not GPU-issued: k slice = 25 on rank 0"));
  for (const auto& d : c.daemons) {
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
}

namespace {

// The GPU cases at `perNode` ranks per node on `c` (each against the reference, 20 bitwise repeats, gemm-ar bitwise
// alike on every rank), every daemon's plan line naming `plan`. Returns rank 0's C hash per case.
std::vector<std::string> runGpuCases(TwoNodes& c, uint32_t perNode, const std::string& plan) {
  const uint32_t n = 2 * perNode;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < n; ++r) {
    ranks.push_back(spawn([&, r](const Io&) { return spanBody(c.daemons[r % 2]->socket(), id, r, n); }));
  }
  std::vector<std::vector<std::string>> hashes(n);
  for (uint32_t r = 0; r < n; ++r) {
    const std::string result = ranks[r].read(300000);
    INFO("rank " << r << " (node " << r % 2 << "): " << result);
    INFO(c.logs());
    REQUIRE(result.rfind("OK", 0) == 0);
    std::istringstream in(result.substr(2));
    for (std::string h; in >> h;) hashes[r].push_back(h);
  }
  for (auto& r : ranks) r.reap();
  const auto all = gpuCases(n);
  for (std::size_t i = 0; i < all.size(); ++i) {
    CAPTURE(describe(all[i]));
    // gemm-ar: every rank on every node holds bitwise the same C.
    if (all[i].kind == OpKind::kGemmAr) {
      for (uint32_t r = 1; r < n; ++r) CHECK(hashes[r].at(i) == hashes[0].at(i));
    }
    for (const auto& d : c.daemons) {
      INFO(d->log());
      CHECK(logShowsPlan(d->log(), all[i], n, plan));
    }
  }
  for (const auto& d : c.daemons) {
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
  return hashes[0];
}

}  // namespace

TEST_CASE("two nodes: the fused GEMMs across nodes run on the GPUs at 1 and 2 ranks per node, match the fp64 reference "
          "and repeat bitwise") {
  for (uint32_t perNode : {1u, 2u}) {
    CAPTURE(perNode);
    TwoNodes c;
    runGpuCases(c, perNode, kGpuExchangePlan);
  }
}

TEST_CASE("two nodes over cluster.transport: verbs (the verbs test double): the fused GEMMs run with the GPU-issued "
          "exchange, match the fp64 reference and repeat bitwise") {
  for (uint32_t perNode : {1u, 2u}) {
    CAPTURE(perNode);
    TwoNodes c("client", "on", "verbs");
    REQUIRE_MESSAGE(c.connected(), c.logs());
    for (const auto& d : c.daemons) {
      // On the double, not on rdma-core (whose device, if this host had one, would have another name).
      REQUIRE_MESSAGE(d->log().find("verbs transport: node") != std::string::npos, d->log());
      REQUIRE_MESSAGE(d->log().find("tandem_double0") != std::string::npos, d->log());
    }
    runGpuCases(c, perNode, kGpuExchangePlan);
    for (const auto& d : c.daemons) {
      const std::string log = d->log();
      INFO(log);
      // The plan lines name verbs and a region in GPU memory registered through a dma-buf (the H200 exports one and
      // orders NIC writes for its own reads: no flush), and the GPU regions were registered as GPU memory of the
      // double (its device-copy path placed every byte the results were checked on): not host memory taken for it,
      // no copy failed.
      CHECK(log.find("GPU-issued exchange (proxy gpu") != std::string::npos);
      CHECK(log.find(" verbs, region in GPU memory (GPUDirect writes ordering") != std::string::npos);
      CHECK(log.find("registered with the NIC through dma-buf) + GPU GEMM") != std::string::npos);
      CHECK(log.find(" tcp, region") == std::string::npos);
      CHECK(log.find("no dma-buf") == std::string::npos);
      CHECK(log.find("verbs double: registered GPU") != std::string::npos);
      CHECK(log.find("enters the error state") == std::string::npos);
    }
  }
}

namespace {

// Rank `rank` of 2: a small gemm-ar on the GPU path, checked once, then again and again until an op fails (the test
// injects a QP error). "released <status> <op> <message>", or "FAIL ..." when something else happened.
std::string gemmArUntilFailure(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank) {
  auto [s, comm, stream] = joinRank(rankDevice(rank), socket, id, rank, 2);
  OpRun run(s, shapeOf(OpKind::kGemmAr, DType::kBF16, 256, 256, 512), rank, 2, 91);
  for (int i = 0; i < 5000; ++i) {
    if (std::string e = run.submit(comm, stream); !e.empty()) return fmt::format("released submit {} {}", i, e);
    if (std::string synced = syncWithin(stream, 30000); synced != "synced") {
      return fmt::format("FAIL op {}: stream {}", i, synced);
    }
    const tandem_status_t st = tandem_wait(run.op, 30000);
    if (st != TANDEM_SUCCESS) return fmt::format("released {} {} {}", static_cast<int>(st), i, tandem_last_error());
    if (i == 0) {
      if (std::string e = run.check(); !e.empty()) return "FAIL first op: " + e;
    }
  }
  return "FAIL no op failed in 5000";
}

}  // namespace

TEST_CASE("two nodes over verbs (the verbs test double): a QP error mid-op on the GPU path releases both nodes' streams "
          "with PEER_LOST, and the next communicator runs on the GPU path") {
  // Node 1's 40th RDMA WRITE fails (its QP to node 0 enters the error state): about a dozen gemm-ar ops in (a data
  // write, the arrived flag and the consumed flag per op).
  TwoNodes c("client", "on", "verbs", {"", "qp_error_after_writes=40"});
  REQUIRE_MESSAGE(c.connected(), c.logs());
  const auto results = onePerNode(c, gemmArUntilFailure, 120000);
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string& result = results[r];
    INFO("rank " << r << ": " << result);
    INFO(c.logs());
    REQUIRE(result.rfind("released ", 0) == 0);
    // The op that was running fails with the peer lost (or aborted, as the communicator fails); a later submission
    // on the failed communicator is refused.
    CHECK((result.find(" " + std::to_string(TANDEM_ERROR_PEER_LOST) + " ") != std::string::npos ||
           result.find(" " + std::to_string(TANDEM_ERROR_ABORTED) + " ") != std::string::npos ||
           result.rfind("released submit", 0) == 0));
  }
  // Node 0 learns of it from node 1's "queue pairs down" message or from its own next write failing (as the CPU verbs
  // cluster test says); either names node 1.
  const std::string log0 = c.daemons[0]->log();
  CHECK_MESSAGE((log0.find("node 1 lost its queue pairs") != std::string::npos ||
                 log0.find("node 1 lost: work request") != std::string::npos),
                log0);
  for (const auto& d : c.daemons) {
    CHECK(logShowsPlan(d->log(), shapeOf(OpKind::kGemmAr, DType::kBF16, 256, 256, 512), 2, kGpuExchangePlan));
  }
  // The leader sets up new queue pairs; the nodes serve the next communicator on the GPU path.
  REQUIRE_MESSAGE(c.connected(30000), c.logs());
  runGpuCases(c, 1, kGpuExchangePlan);
}

TEST_CASE("two nodes: with cluster.gpu_exchange off the host moves the bytes, and the results are bitwise those of the "
          "GPU-issued exchange") {
  std::vector<std::string> on, off;
  {
    TwoNodes c("client", "on");
    on = runGpuCases(c, 1, kGpuExchangePlan);
  }
  {
    TwoNodes c("client", "off");
    off = runGpuCases(c, 1, kStagedOffPlan);
  }
  CHECK(on == off);
}

namespace {

// Rank of 2 whose communicator has run one op through the GPU exchange (its GPU regions and keys are set up), then
// submits an ag-gemm behind an optional gate, as gatedRank does (same orders).
std::string warmGatedRank(const Io& io, const std::string& socket, const tandem_unique_id_t& id, uint32_t rank,
                          bool gate) {
  auto [s, comm, stream] = joinRank(rankDevice(rank), socket, id, rank, 2);
  {
    OpRun warm(s, allgatherOf(4096), rank, 2, 77);
    if (std::string e = warm.submit(comm, stream); !e.empty()) return "FAIL warm-up " + e;
    if (std::string synced = syncWithin(stream, 30000); synced != "synced") return "FAIL warm-up stream " + synced;
    if (std::string e = warm.check(); !e.empty()) return "FAIL warm-up " + e;
  }
  constexpr uint64_t M = 2048, N = 2048, K = 2048;
  tandem_buffer_t a, b, c;
  TK(tandem_alloc(s, M * K, &a));  // this rank's half of A (bf16)
  TK(tandem_alloc(s, N * K * 2, &b));
  TK(tandem_alloc(s, M * N * 2, &c));
  uint32_t* flag = nullptr;
  if (gate) {
    CK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    *flag = 0;
    const CUresult r = tandem::kernels::driver().streamWaitValue32(stream, reinterpret_cast<CUdeviceptr>(flag), 1,
                                                                   CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) return "FAIL gate";
  }
  tandem_op_t op;
  const auto args = agGemmArgs(TANDEM_DTYPE_BF16, M, N, K, {a, 0}, {b, 0}, {c, 0}, {nullptr, 0}, stream);
  TK(tandem_ag_gemm(comm, &args, &op));
  io.say("submitted");
  for (;;) {
    const std::string order = io.hear();
    if (order == "release") {
      std::atomic_ref<uint32_t>(*flag).store(1);
    } else if (order == "sync") {
      const std::string synced = syncWithin(stream, 10000);
      const tandem_status_t st = tandem_wait(op, 10000);
      return fmt::format("{} {} {}", synced, static_cast<int>(st), tandem_last_error());
    } else {
      return "FAIL order '" + order + "'";
    }
  }
}

}  // namespace

TEST_CASE("two nodes, daemon executor (MPS): the fused GEMMs across nodes run on the GPUs, match the fp64 reference "
          "and repeat bitwise" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  // One rank per node: tandemd runs the op in its own context, beside the daemon executor's persistent kernel. The
  // GPU-issued exchange over both transports, its region in host memory: on tcp always, on verbs because a
  // GPU-memory region stalled under MPS on the double (chooseRegionMemory).
  for (const std::string transport : {"tcp", "verbs"}) {
    CAPTURE(transport);
    TwoNodes c("daemon", "on", transport);
    REQUIRE_MESSAGE(c.connected(), c.logs());
    for (const auto& d : c.daemons) REQUIRE(status(*d)["executor"] == "daemon");
    const auto results = onePerNode(
        c, [](const std::string& socket, const tandem_unique_id_t& id, uint32_t r) { return spanBody(socket, id, r, 2); },
        300000);
    for (uint32_t r = 0; r < 2; ++r) {
      INFO("rank " << r << " (node " << r << "): " << results[r]);
      INFO(c.logs());
      CHECK(results[r].rfind("OK", 0) == 0);
    }
    const std::string plan = kGpuExchangePlan;
    for (const auto& d : c.daemons) {
      INFO(d->log());
      for (const auto& shape : gpuCases(2)) CHECK(logShowsPlan(d->log(), shape, 2, plan));
      if (transport == "verbs") CHECK(d->log().find("region in mapped host memory (MPS") != std::string::npos);
      CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
    }
  }
}

TEST_CASE("two nodes, one GPU each: a rank killed mid-op on one node releases the other node's stream with PEER_LOST" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
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

TEST_CASE("two nodes, one GPU each: a rank killed while the other node's GPU waits for its data releases that stream "
          "with PEER_LOST" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  // After a first op through the GPU exchange, the survivor's node pushes its shards and its GPU spins on node 1's
  // arrived flag, which never comes: the victim's stream is gated. The kill must end that wait (the abort word).
  Rank survivor = spawn([&](const Io& io) { return warmGatedRank(io, c.daemons[0]->socket(), id, 0, false); });
  Rank victim = spawn([&](const Io& io) { return warmGatedRank(io, c.daemons[1]->socket(), id, 1, true); });
  const auto t0 = std::chrono::steady_clock::now();
  expectStreamReleasedAfterKill(survivor, victim, false, [&] { return c.logs(); });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not the kernels' 60 s deadline
  CHECK(logShowsPlan(c.daemons[0]->log(), shapeOf(OpKind::kAgGemm, DType::kBF16, 2048, 2048, 2048), 2,
                     kGpuExchangePlan));
  for (const auto& d : c.daemons) {
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
}

namespace {

// The next communicator after a failure case: a small ag-gemm and gemm-ar whose plan is the GPU-issued exchange (the
// first case checks both shapes take it), each once against the fp64 reference. "OK" or "FAIL ...".
std::vector<ref::OpShape> nextCommCases() {
  return {shapeOf(OpKind::kAgGemm, DType::kBF16, 777, 520, 264), shapeOf(OpKind::kGemmAr, DType::kF16, 29, 16, 48)};
}

std::string nextCommBody(const std::string& socket, const tandem_unique_id_t& id, uint32_t rank) {
  auto [s, comm, stream] = joinRank(rankDevice(rank), socket, id, rank, 2);
  const auto all = nextCommCases();
  for (std::size_t i = 0; i < all.size(); ++i) {
    OpRun run(s, all[i], rank, 2, 4000 + i);
    if (std::string e = run.submit(comm, stream); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
    if (std::string synced = syncWithin(stream, 30000); synced != "synced") {
      return fmt::format("FAIL {}: stream {}", describe(all[i]), synced);
    }
    if (std::string e = run.check(); !e.empty()) return fmt::format("FAIL {}: {}", describe(all[i]), e);
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

// The end of a node failure case: both nodes connected again, a fresh communicator across them runs on the GPU path
// and matches the reference, and neither daemon keeps a communicator or a byte of it.
void expectNextCommunicatorServed(TwoNodes& c) {
  REQUIRE_MESSAGE(c.connected(20000), c.logs());
  const auto results = onePerNode(c, nextCommBody, 60000);
  for (uint32_t r = 0; r < 2; ++r) {
    INFO("next communicator, rank " << r << " (node " << r << "): " << results[r]);
    INFO(c.logs());
    CHECK(results[r] == "OK");
  }
  for (const auto& d : c.daemons) {
    INFO(d->log());
    for (const auto& shape : nextCommCases()) CHECK(logShowsPlan(d->log(), shape, 2, kGpuExchangePlan));
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
}

// Whether a warmGatedRank "sync" report says its stream came back and its op ended with `st`.
bool releasedWith(const std::string& report, tandem_status_t st) {
  return report.rfind("synced ", 0) == 0 && report.find(" " + std::to_string(st) + " ") != std::string::npos;
}

// Whether `log` has the cluster's line for node 1 being lost, containing `why` ("" for any reason).
bool logShowsNode1Lost(const std::string& log, const std::string& why) {
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("cluster: node 1 (") != std::string::npos && line.find(" is lost: ") != std::string::npos &&
        line.find(why) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// The opening of both node failure cases: as in the killed rank case, after a first op through the GPU exchange
// node 0 pushes its shards and its GPU spins on node 1's arrived flag, which never comes (node 1's rank is gated).
// Then `sig` goes to node 1's tandemd, and node 0's stream must come back with PEER_LOST within `withinMs`, the GPU
// path having run. Returns node 1's rank, still gated, for the case to finish.
Rank expectReleasedWhenNode1Gets(TwoNodes& c, int sig, long long withinMs) {
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  Rank survivor = spawn([&](const Io& io) { return warmGatedRank(io, c.daemons[0]->socket(), id, 0, false); });
  Rank victim = spawn([&](const Io& io) { return warmGatedRank(io, c.daemons[1]->socket(), id, 1, true); });
  REQUIRE(survivor.read(60000) == "submitted");
  REQUIRE(victim.read(60000) == "submitted");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto hitAt = Clock::now();
  c.daemons[1]->signal(sig);
  // Nothing here asks node 1's daemon anything (stopped, tandemctl would wait for it).
  survivor.tell("sync");
  const std::string result = survivor.read(30000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - hitAt).count();
  survivor.reap();
  INFO("node 0's rank, " << ms << " ms after signal " << sig << " to node 1's tandemd: " << result);
  INFO(c.logs());
  CHECK(releasedWith(result, TANDEM_ERROR_PEER_LOST));
  CHECK(ms < withinMs);
  MESSAGE("node 0's stream released ", ms, " ms after signal ", sig, " to node 1's tandemd");
  CHECK(logShowsPlan(c.daemons[0]->log(), shapeOf(OpKind::kAgGemm, DType::kBF16, 2048, 2048, 2048), 2,
                     kGpuExchangePlan));
  return victim;
}

}  // namespace

TEST_CASE("two nodes, one GPU each: a tandemd killed while the other node's GPU waits on its arrived flag releases "
          "that stream with PEER_LOST, and the restarted node serves the next communicator on the GPU path" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  // Node 1's daemon dies: node 0's transport sees its connections close, losing the node fails the communicator, and
  // the abort word ends the GPU's wait (not the kernels' 60 s deadline).
  Rank victim = expectReleasedWhenNode1Gets(c, SIGKILL, 20000);
  // Node 1's rank lost its daemon (its next call would say DAEMON_LOST) and its stream stays gated: it goes too, before
  // the restarted daemon takes the GPU.
  victim.kill();
  victim.reap();
  CHECK(c.daemons[1]->waitExit(5000) == -SIGKILL);
  {
    const std::string log0 = c.daemons[0]->log();
    INFO(log0);
    CHECK(logShowsNode1Lost(log0, ""));
    CHECK(eventually([&] { return status(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed"; }, 5000));
    CHECK(eventually([&] {
      return status(*c.daemons[0])["total_bytes"] == 0 && status(*c.daemons[0])["communicators"].empty();
    }, 10000));
  }

  // systemd's Restart=on-failure, in short: the same config, address and port; node 0 re-dials it and it rejoins.
  const auto restartedAt = Clock::now();
  c.restart(1);
  expectNextCommunicatorServed(c);
  MESSAGE("the next communicator ran ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - restartedAt).count(),
          " ms after the restart began");
}

TEST_CASE("two nodes, one GPU each: a hung node (a cut link) while the other node's GPU waits on its arrived flag "
          "releases that stream with PEER_LOST within the peer deadline, and both nodes serve the next communicator" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  TwoNodes c;
  REQUIRE_MESSAGE(c.connected(), c.logs());
  // On loopback a hung node stands in for a cut link (tests/integration/multinode_test.cpp does the same): node 1's
  // tandemd is stopped, not dead, so no connection closes and only the heartbeat deadline can find it (within the
  // deadline, its heartbeat ticks and the release, as the CPU case).
  Rank victim = expectReleasedWhenNode1Gets(c, SIGSTOP, kPeerLostDeadlineMs + 3000);
  {
    const std::string log0 = c.daemons[0]->log();
    INFO(log0);
    // Silence found it: the heartbeat deadline, not a closed connection.
    CHECK(logShowsNode1Lost(log0, fmt::format("deadline {} ms", kPeerLostDeadlineMs)));
    CHECK(status(*c.daemons[0])["cluster"]["nodes"][1]["state"] == "failed");
    CHECK(eventually([&] {
      return status(*c.daemons[0])["total_bytes"] == 0 && status(*c.daemons[0])["communicators"].empty();
    }, 10000));
  }

  // The link comes back. Node 1 finds node 0 gone from under it (its connections closed, or silent for as long as it
  // slept) and fails the communicator too: its rank's stream, released from the gate, must come back rather than wait
  // for node 0's data for ever.
  c.daemons[1]->signal(SIGCONT);
  victim.tell("release");
  victim.tell("sync");
  const std::string victimResult = victim.read(30000);
  victim.reap();
  {
    INFO("node 1's rank after the SIGCONT: " << victimResult);
    INFO(c.logs());
    MESSAGE("node 1's rank after the SIGCONT: ", victimResult);
    CHECK(victimResult.rfind("synced ", 0) == 0);
    CHECK((releasedWith(victimResult, TANDEM_ERROR_PEER_LOST) ||
           releasedWith(victimResult, TANDEM_ERROR_ABORTED)));
  }
  for (const auto& d : c.daemons) {
    INFO(d->log());
    CHECK(eventually([&] { return status(*d)["total_bytes"] == 0 && status(*d)["communicators"].empty(); }, 10000));
  }
  // Node 0's transport kept re-dialing node 1; once node 1 runs again they connect (a new generation) and a new
  // communicator spans them on the GPU path.
  expectNextCommunicatorServed(c);
}
