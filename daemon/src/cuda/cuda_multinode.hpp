// Multi-node communicators on the cuda backend (the host-staged executor strategy): tandemd runs the op, the GPUs
// compute, and the bytes between nodes take one of two paths.
//
// A communicator whose ranks live on several nodes gets no client-mapped workspaces and runs no tandem kernel from the
// client: libtandem's "host" mode (JoinInfo.executor) only orders each op in the rank's stream, WriteValue32(ready, e)
// then WaitValue32(done >= e) on the rank's control page, and tandemd runs the op itself:
//   1. the accepted collective waits (polled by the pump) until every local rank's stream wrote ready >= e: the
//      inputs are final and nothing in those streams touches the op's buffers until done;
//   2. on the communicator's own thread (CommLink::post), one of three paths, logged once per shape ("plan ..."):
//      GPU-issued exchange + GPU GEMM (gpu_exchange_plan.hpp decides, alike on every node, from every rank's
//      descriptor and the cluster section: ag-gemm, gemm-rs, gemm-ar in bf16/fp16 (any layout) and gemm-rs/ar with
//      fp8 inputs (nt), whose every rank's dims the GEMM cores take (gemmCoreRefusal), and allgather, over tcp or verbs, cluster.gpu_exchange on, payloads within cluster.staging_bytes):
//      the same payloads as below, filled and consumed on the GPUs in stream order, the transfers pushed by kernels of
//      the first local rank's GPU into its proxy FIFO (gpu_exchange.hpp; kernels/span_exchange.cu) and landing in the
//      peers' regions (GPU memory on verbs, mapped pinned host memory on tcp: gpu_exchange.hpp says why); the link
//      thread only launches, then waits for the streams:
//        ag-gemm, allgather  the local shards into the send area (and every local rank's gathered A) and the local
//                            rows' GEMM, the push, then the wait and the remote rows from the inboxes (copies into
//                            each gathered A, the remote rows' GEMM): remote shards land while local ones compute;
//        gemm-rs, gemm-ar    in up to 4 passes over row blocks: each local rank's partial rows, their node sum in
//                            rank order in fp32 into the send area (in place, or by DMA from the workspace on a host
//                            region), and that pass's writes of the rows the peers own pushed at once (the arrived
//                            flag with the last pass), so a block travels while the next computes; then the wait, the
//                            sum over nodes in node order in fp32 (each inbox read in place, or copied to the receive
//                            slot first), one rounding (span_reduce.hpp): bitwise the results of the staged path below;
//        the waits (the peers' consumed flags before the send area is filled, their arrived flags after the push)
//        are stream waits (cuStreamWaitValue32 on the region's words: the GPU's front end polls, no SM or time slice
//        is held), released by the host writing past them when the communicator fails or kExchangeTimeoutMs passes;
//        TANDEM_SPAN_WAIT=kernel waits in the one-warp kernels instead (abort word, %globaltimer deadline,
//        ErrorSlot). H200, span_bench, both
//        "nodes" on one GPU without MPS: no faster either way at ag-gemm and gemm-rs, gemm-ar M=1024 20.8 vs 30.4 ms
//        (3 runs each);
//        a local tensor that is not 16-byte aligned is copied aside (an input) or computed aside and copied back (an
//        output), so that a node-local fact never changes the path, which both ends must share;
//      staged exchange + GPU GEMM (the other ops the GPUs compute, and every op when the GPU exchange refuses it, the
//      reason in the plan line): hierarchical, one payload per
//      node pair, the same payloads as the cpu backend's (cpu_multinode.cpp), so each node may take this path or the
//      host fallback for an op and the others cannot tell:
//        ag-gemm, allgather  the local ranks' shards go GPU -> the CommLink outbox (pinned once, no other host copy)
//                            -> every other node; each local rank gets the gathered A on its GPU (local shards GPU to
//                            GPU before the exchange, remote ones host -> GPU from the inbox), and the GEMM core
//                            (launchGemm) computes its C there: the local rows' GEMM runs while the exchange waits;
//        gemm-rs, gemm-ar    each local rank's partial A_r·B_rᵀ with the GEMM core on its GPU (rounded to the dtype,
//                            as the GEMM core stores), the node's partials summed in rank order in fp32 on the first
//                            local rank's GPU (span_reduce.hpp), the rows other nodes own (all rows for gemm-ar) sent
//                            as fp32 (the cpu backend's payload, and one rounding only, at the owner); the owner adds
//                            the node partials in node order in fp32 and rounds once to the dtype: repeats are bitwise
//                            identical, and gemm-ar is bitwise identical on every rank of every node;
//      host reference fallback (barriers, fp32, shapes the GEMM core refuses: k or, for ag-gemm, n not a multiple of
//      8, misaligned tensors; never for an op the GPU exchange takes): every local rank's input slots are copied
//      GPU -> host, runCpuOpAcrossNodes exchanges and computes the outputs on one host core (the CPU reference's
//      numerics), and the outputs are copied host -> GPU;
//   3. done = e on every local rank's control page (release), then the ops complete.
// Resources, made once at setup: per local rank a GPU workspace of cuda.workspace_bytes (gathered A, partials, node
// sums; an op that needs more is refused with the bytes it needs, naming cuda.workspace_bytes), per local GPU a
// compute stream, a copy stream, an exchange stream and an event. The outbox and inbox slots are registered with CUDA
// (pinned) at their first use, growing with the largest payload seen; where that fails they are copied as pageable
// memory. The GPU region (gpu_exchange.hpp) at the first op that takes the GPU exchange: its key goes to the peers
// through one host exchange of that op's epoch (the same op on every node), so the join protocol is unchanged.
//
// Failures. An op whose descriptors were rejected fails on every node alike and writes done at once. A failed
// communicator (peer lost, a rank's session gone, abort) fails the collective waiting for ready at once, and the one
// running on the link thread when it ends (its exchange ends with the reason; the GPU work it queued is drained
// before the op completes; on the GPU exchange the communicator's abort word ends its kernels' waits, which the link
// thread sets when the link or the backend aborts); the backend's abort releases the streams (go/done jump ahead). A
// CUDA error, a GPU-exchange wait past its deadline, or an op this node's workspace cannot hold, fails the op and
// then the communicator, so the other nodes learn of it through CommFail instead of waiting for this node's payload.
//
// HostStagedComm is the strategy (cuda_comm.hpp); HostStaging is its part that the communicator's link thread shares.
// One file per path: cuda_multinode.cpp the communicator, the wait for the streams, the choice of path and the op
// table (each op's two GPU paths); multinode_gpu_exchange.cpp the GPU-issued exchange; multinode_staged.cpp the
// staged exchange and the host reference fallback; multinode_compute.cpp the GPU work both exchanges share (gathered
// A and GEMMs, partials, node sum, sum over nodes, rounding), so that they compute alike; multinode_common.hpp the
// helpers of all four.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/gpu_exchange.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/span_reduce.hpp"

namespace tandem::daemon::cuda {

namespace multinode {
class Aside;  // multinode_common.hpp
}

class HostStaging {
 public:
  struct LocalRank {
    uint32_t rank;
    int device;                  // the rank's GPU (daemon ordinal)
    kernels::ControlPage* page;  // the rank's control page (owned by the communicator, which outlives this)
  };
  // Creates the streams and event of every GPU of the local ranks, and a workspace of `workspaceBytes` per local rank
  // (cuda.workspace_bytes). `handle`: the communicator's, for the log; `hub`: the backend's GPU proxies (the GPU
  // exchange). Throws Error(kCuda).
  HostStaging(uint64_t handle, std::vector<LocalRank> local, uint64_t workspaceBytes,
              std::shared_ptr<GpuExchangeHub> hub);
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Backend::execute for a collective of this communicator (c.link set). Completes a rejected collective (and writes
  // done) at once and returns true; otherwise keeps it until every local stream reached it and returns false: the
  // link thread calls `finished` once it completed.
  bool execute(Collective c, std::function<void()> finished);
  // Pump: hands the waiting collective to the communicator's thread once every local rank's ready >= its epoch.
  // Appends (handle, reason) once to `failed` after a CUDA error in the staging copies. Returns whether it did work.
  bool poll(uint64_t handle, std::vector<std::pair<uint64_t, std::string>>& failed);
  bool waiting() const;
  // The communicator failed: the waiting collective completes with the error now, a running one when it ends, and
  // done is never written again (the caller then releases the streams). Call before releasing them.
  void abort(ErrorCode code, const std::string& reason);
  // The highest epoch handed to execute (for the abort's stream lead).
  uint64_t lastEpoch() const;

 private:
  struct Waiting {
    Collective c;
    std::function<void()> finished;
  };
  struct Gpu {
    kernels::CudaStream compute, copy;  // GEMMs and sums; copies that may run beside them
    kernels::CudaStream exchange;       // the GPU exchange's push, wait and consumed kernels (the lead GPU's)
    kernels::CudaEvent event;           // orders one stream after the other
  };
  // A CommLink slot (outbox or inbox) registered with CUDA from its start, `bytes` long.
  struct Pin {
    kernels::HostRegistration reg;
    uint64_t bytes = 0;
    bool failed = false;  // registration refused: copies stay pageable
  };
  // One op's two GPU paths, looked up by kind (the table is in cuda_multinode.cpp): the ops the GPUs compute across
  // nodes. A new op there gets both exchanges and the plan line; fallbackReason and checkWorkspaces read its kind.
  struct OpPaths {
    OpKind kind;
    const char* compute;  // what the GPUs do beside the exchange, for the plan line: "GEMM" or "copies"
    bool gemm;            // runs the GEMM core: fallbackReason checks the dtype, dims and alignment it takes
    void (HostStaging::*staged)(Collective&);
    void (HostStaging::*gpuIssued)(Collective&, const ExchangeOp&);
  };
  // ag-gemm's tensors on this node, alike on both exchanges (agGemmTensors).
  struct AgGemmTensors {
    uint32_t n = 0;  // ranks
    uint64_t m = 0, cols = 0, kk = 0, es = 0, rowBytes = 0;
    DType dtype = DType::kBF16;
    GemmOperands layout = GemmOperands::kNT;  // TN: each shard is [k, rows], a block of rows x k elements all the same
    std::vector<uint32_t> mine;              // the local ranks; mine.front() is the lead
    std::vector<std::byte*> gathered;        // by rank: its gathered A (its tensor, or its workspace)
    std::vector<std::byte*> home;            // by rank: a misaligned gathered A's tensor (built in the workspace)
    std::vector<std::byte*> c;               // by rank: where its GEMM writes C (aside when misaligned)
    std::vector<const std::byte*> a, b;      // by rank: its A shard (null without rows), its B (aside when misaligned)
    std::set<int> devices;                   // the local ranks' GPUs
    uint64_t ces = 0;                        // bytes of an element of C (FP8 inputs: out_dtype's)
    // FP8 inputs: every rank's A scales travel after its shard (the cpu backend's payload) and land in each local
    // rank's scales region, rank q's at scaleOff[q] (16-byte aligned; block scales as [kBlocks, ldsa(q)], the FP8
    // core's layout); the GEMMs run per rank's shard with its scales.
    bool fp8 = false, block = false;
    uint64_t kBlocks = 0;
    std::vector<uint64_t> scaleSent;        // by rank: bytes of its A scales in the payload
    std::vector<uint64_t> scaleOff;         // by rank: where they go in a scales region
    std::vector<std::byte*> scales;         // by local rank: its scales region (in its workspace)
    std::vector<const std::byte*> aScale, bScale;  // by local rank: its a_scale and b_scale (aside when misaligned)
    uint64_t shardBytes(uint32_t r) const;   // rank r's A shard
    uint64_t sentBytes(uint32_t r) const { return shardBytes(r) + (fp8 ? scaleSent[r] : 0); }  // its payload
    // Rank q's payload (its shard, then its scales) from `src`, packed as sent, into rank r's gathered A and scales.
    void placeSent(uint32_t r, uint32_t q, const std::byte* src, cudaStream_t s) const;
    // Rank q's own shard and scales (a local rank) into rank r's gathered A and scales.
    void placeOwn(uint32_t r, uint32_t q, cudaStream_t s) const;
    // Local rank q's payload packed at `dst` (sentBytes(q) bytes).
    void pack(uint32_t q, std::byte* dst, cudaStream_t s) const;
    // Rank q's A scales as its a_scale holds them, from `src` into `dst` (its place in a scales region).
    void copyScales(uint32_t q, std::byte* dst, const std::byte* src, cudaStream_t s) const;
  };
  // gemm-rs / gemm-ar on this node, alike on both exchanges (reduceTensors): the shape and the lead's workspace, as
  // checkWorkspaces sizes it: its partial, the node sum, the running sum over nodes, the receive slot, then the other
  // GPUs' partials and the staging of their outputs.
  // FP8 inputs: partials in fp32 from the FP8 core (as its fp32 c), scales from each rank's a_scale and b_scale.
  struct ReduceTensors {
    uint64_t m = 0, cols = 0, ldp = 0;  // ldp: the partials' row stride
    uint64_t es = 0, pes = 0, ces = 0;  // bytes of an input element, a partial's, an output's
    DType dtype = DType::kBF16;
    GemmOperands layout = GemmOperands::kNT;
    kernels::SpanElem partialElem = kernels::SpanElem::kF32, outElem = kernels::SpanElem::kF32;
    const char* name = "";  // the op's name, for messages
    std::vector<uint32_t> mine;
    int leadDev = -1;
    cudaStream_t leadStream = nullptr;  // the lead GPU's compute stream: sums, roundings
    uint64_t partialBytes = 0, f32Bytes = 0;
    float* nodeSum = nullptr;
    float* total = nullptr;
    float* recvSlot = nullptr;
    std::byte* next = nullptr;  // the other GPUs' partials
    std::set<int> devices;
    struct Inputs {
      const std::byte *a = nullptr, *b = nullptr;
      const float *aScale = nullptr, *bScale = nullptr;  // FP8 only
    };
    std::map<uint32_t, Inputs> inputs;  // by rank, the ranks with a k slice
  };
  static const OpPaths* pathsOf(OpKind kind);  // null: the GPUs compute no such op across nodes

  // ---- cuda_multinode.cpp: the dispatch ----
  void run(Collective& c);  // the link thread: picks the path, runs it, finishes the op
  // Why op `c` takes the host reference fallback; empty for the GPU path.
  std::string fallbackReason(const Collective& c) const;
  // Throws Error(kInvalidArgument), with the bytes needed and naming cuda.workspace_bytes, when some local rank's
  // workspace cannot hold what `c` keeps there.
  void checkWorkspaces(const Collective& c) const;
  void logPlanOnce(const Collective& c, const std::string& plan);
  // Records an event on `from` (of device fromDev) and makes `to` wait for it.
  void order(int fromDev, cudaStream_t from, cudaStream_t to);
  void drain() noexcept;  // waits for every stream, ignoring errors (after a failure mid-op)
  bool failedNow() const;
  void finish(Collective& c, int32_t code, std::string message);
  void storeDoneLocked(uint64_t epoch);
  std::byte* workspace(uint32_t rank) const;
  int deviceOf(uint32_t rank) const;
  Gpu& gpu(int device) { return gpus_.at(device); }

  // ---- multinode_staged.cpp: the exchange through host memory (CommLink), the GPUs computing ----
  void runStaged(Collective& c, const OpPaths& paths);
  void agGemmStaged(Collective& c);
  void allGatherStaged(Collective& c);
  void gemmReduceStaged(Collective& c);
  // Makes the slot holding [p, p + bytes) pinned (at least that far), where it can be.
  void pin(const Collective& c, const std::byte* p, uint64_t bytes);
  // The host reference fallback: the inputs to the host, the cpu backend's exchange and compute, the outputs back.
  void runHostReference(Collective& c);
  void copy(int device, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what);

  // ---- multinode_gpu_exchange.cpp: the GPU-issued exchange (gpu_exchange.hpp) ----
  // Throws Error with the reason; the caller fails the communicator for any error but the communicator's own failure.
  void runGpuExchange(Collective& c, const ExchangeOp& op, const OpPaths& paths);
  void agGemmGpu(Collective& c, const ExchangeOp& op);
  void allGatherGpu(Collective& c, const ExchangeOp& op);
  void gemmReduceGpu(Collective& c, const ExchangeOp& op);
  GpuRegion& gpuRegion(Collective& c);  // made at the first GPU-exchange op (its key exchanged then)
  // On `s`, before anything fills the send area: every peer's consumed flag reached the previous GPU-exchange op's
  // epoch (stream waits, or the free kernel), so the transport has sent all of that op (gpu_exchange.hpp).
  void waitSendAreaFree(int leadDev, cudaStream_t s);
  // On the exchange stream: the push (pass `pass` of the region's plans), then the wait for the peers' payloads
  // (stream waits, or the wait kernel). pushThenWait: one pass, then the wait.
  void push(int leadDev, cudaStream_t exch, uint32_t pass);
  void waitArrived(int leadDev, cudaStream_t exch);
  void pushThenWait(int leadDev, cudaStream_t exch);
  // On the exchange stream: this node read its inboxes (the consumed kernel).
  void markConsumed(int leadDev, cudaStream_t exch);
  static void streamWait(cudaStream_t s, const uint64_t* word, uint64_t value, const char* what, bool flush = false);
  // Waits until every local GPU's streams are idle, polling for the communicator's failure: on one it sets the
  // region's abort word (the kernels' waits end) and, once the streams are idle, throws the failure.
  void waitGpuWork(Collective& c);
  // After waitGpuWork: throws what the kernels reported, then waits until the GPU's proxy has posted every command
  // of this op (the ranks may destroy the communicator right after, and the peers still need our data and flags).
  void finishGpuExchange(Collective& c);

  // ---- multinode_compute.cpp: the GPU work both exchanges share, so that the two compute alike, bit for bit ----
  // `aside` (the GPU exchange's): misaligned B and C there; null on the staged exchange, which never sees one
  // (fallbackReason sends such an op to the host reference).
  AgGemmTensors agGemmTensors(const Collective& c, multinode::Aside* aside);
  // This node's shards into every local rank's gathered A, GPU to GPU on the destinations' copy streams.
  void copyLocalShards(const AgGemmTensors& t);
  // Each GPU's compute stream after what its copy stream holds.
  void copiesThenCompute(const std::set<int>& devices);
  // Every local rank's GEMM of the gathered A's rows `runs` on its compute stream.
  void gemmRows(const AgGemmTensors& t, const std::vector<std::pair<uint64_t, uint64_t>>& runs);
  // allgather: every local rank's send into every local rank's recv, on the destinations' copy streams.
  void copyLocalSends(const Collective& c, const std::vector<uint32_t>& mine, uint64_t bytes);
  ReduceTensors reduceTensors(const Collective& c, multinode::Aside* aside);
  // Rank r's partial product, rows [r0, r1), into its workspace on its compute stream (zeros without a k slice).
  void partialRows(const Collective& c, const ReduceTensors& t, uint32_t r, uint64_t r0, uint64_t r1);
  // The lead's stream after every other GPU's partials (the lead's device current).
  void orderAfterPartials(const ReduceTensors& t);
  // The node's partials summed in rank order in fp32 into t.nodeSum, rows [firstRow, firstRow + rows), on the lead's
  // stream; returns the first byte past the other GPUs' partials (the outputs' staging).
  std::byte* sumNodePartials(const ReduceTensors& t, uint64_t firstRow, uint64_t rows);
  // t.total[rows] (+)= src (accumulate: false for the first source) over `rows` (runs of (first row, count)) on the
  // lead's stream, src holding those rows packed in order, or at their own rows when `atOwnRows`: one fp32 add per
  // element and source, so the order of the calls fixes the result bit for bit.
  void addRowsToTotal(const ReduceTensors& t, const std::vector<std::pair<uint64_t, uint64_t>>& rows, const float* src,
                      bool atOwnRows, bool accumulate);
  // The sum over nodes rounded once into every local rank's C (gemm-rs: its own rows; gemm-ar: all of them).
  void roundOutputs(const Collective& c, const ReduceTensors& t, std::byte* outStaging);

  uint64_t handle_;
  std::vector<LocalRank> local_;
  uint64_t workspaceBytes_;
  // Used by the link thread only (after construction). Declared in creation order (destroyed in reverse): the
  // registrations go before the link whose memory they pin.
  std::map<int, Gpu> gpus_;                        // by device
  std::map<uint32_t, kernels::DeviceBuffer> workspaces_;  // by rank
  std::shared_ptr<CommLink> link_;                 // kept while its slots are registered
  std::map<const std::byte*, Pin> pins_;           // by slot start
  std::set<std::string> logged_;                   // plans logged (logPlanOnce)
  std::shared_ptr<GpuExchangeHub> hub_;
  uint64_t prevGpuEpoch_ = 0;                      // the previous op that took the GPU exchange (0: none)
  bool streamWaits_ = true;                        // GPU exchange waits: stream waits (else the wait kernel)
  mutable std::mutex mutex_;             // guards everything below
  std::optional<Waiting> waiting_;
  uint64_t lastEpoch_ = 0;
  bool failed_ = false;
  ErrorCode failCode_ = ErrorCode::kAborted;
  std::string reason_;
  std::string copyFailure_;  // a CUDA error in the copies, for poll() to report
  bool copyFailureReported_ = false;
  std::unique_ptr<GpuRegion> region_;  // set (under the mutex: abort reads it) and used by the link thread
};

// A communicator with ranks on other nodes: a control page and a tandemd-private GPU workspace per local rank; the ops
// run between the streams' ready and done (HostStaging). Either executor: tandemd runs the op in its own context.
class HostStagedComm final : public CudaComm {
 public:
  // `pages`: one per rank, empty for the ranks on other nodes; `devices`: each rank's GPU (-1 on other nodes);
  // `workspaceBytes`: each local rank's GPU workspace (cuda.workspace_bytes); `hub`: the backend's GPU proxies.
  // @throws Error(kCuda) when a stream, event or workspace cannot be created.
  HostStagedComm(uint64_t handle, std::vector<kernels::ControlPage> pages, const std::vector<int>& devices,
                 uint64_t workspaceBytes, std::shared_ptr<GpuExchangeHub> hub);
  kernels::Executor executor() const override { return kernels::Executor::kHost; }
  uint64_t bytesPerRank() const override { return workspaceBytes_ + kernels::kControlBytes; }
  CommMapping mapping(const std::shared_ptr<CommResources>& self, uint32_t rank) const override;
  bool execute(Collective c, std::function<void()> finished) override;
  void abort(ErrorCode code, const std::string& reason) override;

 private:
  uint64_t workspaceBytes(uint32_t /*rank*/) const override { return 0; }
  bool progress(std::vector<std::pair<uint64_t, std::string>>& failed) override;
  bool hasWork() const override { return staging_.waiting(); }  // polling the local streams' ready words
  uint64_t lastEpoch(uint32_t /*rank*/) const override { return staging_.lastEpoch(); }

  // The local ranks, pointing into the base's control pages (built before staging_, destroyed after it).
  std::vector<HostStaging::LocalRank> localRanks(const std::vector<int>& devices);

  uint64_t workspaceBytes_;
  HostStaging staging_;
};

}  // namespace tandem::daemon::cuda
