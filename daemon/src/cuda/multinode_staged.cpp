// Multi-node communicators on the cuda backend, the staged exchange: one payload per node pair through the
// communicator's CommLink in host memory (the cpu backend's payloads, cpu_multinode.cpp), the GPUs computing; and the
// host reference fallback, where the host computes too. See cuda_multinode.hpp.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <set>

#include "cluster.hpp"
#include "cpu/cpu_ops.hpp"
#include "cuda/cuda_multinode.hpp"
#include "cuda/multinode_common.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::daemon::cuda {

namespace k = tandem::kernels;
using namespace multinode;

namespace {

constexpr uint64_t kPinStep = uint64_t{2} << 20;  // slot registrations grow in 2 MiB steps

}  // namespace

namespace multinode {

// As runCpuOpAcrossNodes: the bytes node `from` sends node `to`, the same on every node and in either path, so all
// nodes agree whether the op fits the staging before any of them starts.
void checkStaging(const Collective& c) {
  const OpDescriptor& d = c.ops[0].desc;
  std::vector<const OpDescriptor*> descs;
  for (const auto& op : c.ops) descs.push_back(&op.desc);
  auto payload = [&](uint32_t from, uint32_t to) { return crossNodeBytes(descs, c.nodeOfRank, from, to); };
  for (uint32_t from : c.link->nodes()) {
    for (uint32_t to : c.link->nodes()) {
      if (from == to) continue;
      if (const uint64_t need = payload(from, to); need > c.link->maxPayload()) {
        fail(ErrorCode::kInvalidArgument, "{} across nodes needs {} bytes of staging from node {} to node {}, but "
             "cluster.staging_bytes allows {} per peer node; raise cluster.staging_bytes on every node (to at least "
             "{}) or split the op", opKindName(d.kind), need, from, to, c.link->maxPayload(),
             need + CommLink::kPayloadHeaderBytes);
      }
    }
  }
}

}  // namespace multinode

void HostStaging::runStaged(Collective& c, const OpPaths& paths) {
  try {
    (this->*paths.staged)(c);
  } catch (...) {
    drain();  // nothing of ours may still write into the ranks' buffers once the op completes
    throw;
  }
}

// Each local rank's gathered A: the local shards GPU to GPU, then that rank's GEMM over the local rows while the
// exchange runs; the remote shards land in the first local rank's gathered A from the inbox and go GPU to GPU to the
// other local ranks; then the GEMM over the remote rows.
void HostStaging::agGemmStaged(Collective& c) {
  const AgGemmTensors t = agGemmTensors(c, nullptr);
  const std::vector<uint32_t>& mine = t.mine;
  const uint32_t lead = mine.front();
  // 1. This node's shards into every local rank's gathered A, and the GEMM of those rows.
  copyLocalShards(t);
  copiesThenCompute(t.devices);
  gemmRows(t, rowRuns(c, t.m, true));
  // 2. The exchange: our shards from the GPUs straight into each outbox; the peers' from the inbox to the lead's A.
  const int leadDev = deviceOf(lead);
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        uint64_t off = 0;
        for (uint32_t q : mine) off += t.sentBytes(q);
        pin(c, out.data(), off);
        off = 0;
        for (uint32_t q : mine) {
          k::CudaDeviceGuard guard(deviceOf(q));
          t.pack(q, out.data() + off, gpu(deviceOf(q)).copy.get());
          off += t.sentBytes(q);
        }
        for (int dev : t.devices) syncStream(dev, gpu(dev).copy.get(), "shards to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const std::vector<uint32_t> from = ranksOn(c, node);
        uint64_t expected = 0;
        for (uint32_t q : from) expected += t.sentBytes(q);
        if (in.size() != expected) {
          fail(ErrorCode::kProtocol, "ag-gemm: node {} sent {} bytes of A shards, expected {}", node, in.size(),
               expected);
        }
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        uint64_t off = 0;
        for (uint32_t q : from) {
          t.placeSent(lead, q, in.data() + off, gpu(leadDev).copy.get());
          off += t.sentBytes(q);
        }
        syncStream(leadDev, gpu(leadDev).copy.get(), "inbox to gathered A");  // the inbox is free once we return
      },
      kExchangeTimeoutMs);
  // 3. The remote rows to the other local ranks' gathered A, and the GEMM of the remote rows.
  const auto remote = rowRuns(c, t.m, false);
  for (uint32_t r : mine) {
    if (r == lead) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    for (auto [first, rows] : remote) {
      copyAsync(t.gathered[r] + first * t.rowBytes, t.gathered[lead] + first * t.rowBytes, rows * t.rowBytes,
                gpu(deviceOf(r)).copy.get(), "remote shards to gathered A");
    }
    // FP8: the remote ranks' scales too (every scales region has the same layout).
    for (uint32_t q = 0; t.fp8 && q < t.n; ++q) {
      if (c.ops[q].local()) continue;
      copyAsync(t.scales[r] + t.scaleOff[q], t.scales[lead] + t.scaleOff[q], t.scaleOff[q + 1] - t.scaleOff[q],
                gpu(deviceOf(r)).copy.get(), "remote scales to a local rank");
    }
  }
  copiesThenCompute(t.devices);
  gemmRows(t, remote);
  for (int dev : t.devices) syncStream(dev, gpu(dev).compute.get(), "ag-gemm");
}

void HostStaging::allGatherStaged(Collective& c) {
  const uint64_t bytes = c.ops[0].desc.dims[dim::kBytes];
  const std::vector<uint32_t> mine = localRanksOf(c);
  const uint32_t lead = mine.front();
  const int leadDev = deviceOf(lead);
  std::set<int> devices;
  for (uint32_t r : mine) devices.insert(deviceOf(r));
  auto recv = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kRecv); };
  auto send = [&](uint32_t r) { return slotPtr(c.ops[r], slot::kSend); };
  copyLocalSends(c, mine, bytes);
  c.link->exchange(
      c.epoch,
      [&](uint32_t, std::span<std::byte> out) {
        pin(c, out.data(), mine.size() * bytes);
        uint64_t off = 0;
        for (uint32_t q : mine) {
          k::CudaDeviceGuard guard(deviceOf(q));
          copyAsync(out.data() + off, send(q), bytes, gpu(deviceOf(q)).copy.get(), "send to the outbox");
          off += bytes;
        }
        for (int dev : devices) syncStream(dev, gpu(dev).copy.get(), "sends to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        const std::vector<uint32_t> from = ranksOn(c, node);
        if (in.size() != from.size() * bytes) fail(ErrorCode::kProtocol, "allgather: node {} sent a short payload", node);
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        for (std::size_t i = 0; i < from.size(); ++i) {
          copyAsync(recv(lead) + from[i] * bytes, in.data() + i * bytes, bytes, gpu(leadDev).copy.get(), "inbox");
        }
        syncStream(leadDev, gpu(leadDev).copy.get(), "inbox to recv");
      },
      kExchangeTimeoutMs);
  for (uint32_t r : mine) {
    if (r == lead) continue;
    k::CudaDeviceGuard guard(deviceOf(r));
    for (uint32_t q = 0; q < c.ops.size(); ++q) {
      if (c.ops[q].local()) continue;
      copyAsync(recv(r) + q * bytes, recv(lead) + q * bytes, bytes, gpu(deviceOf(r)).copy.get(), "remote shards");
    }
  }
  for (int dev : devices) syncStream(dev, gpu(dev).copy.get(), "allgather");
}

// Each local rank's partial with the GEMM core on its GPU; the node sum (rank order, fp32) on the lead's GPU; the
// rows each peer owns to it as fp32; the sum over nodes (node order, fp32) and one rounding into every local C.
void HostStaging::gemmReduceStaged(Collective& c) {
  ReduceTensors t = reduceTensors(c, nullptr);
  const bool allReduce = c.ops[0].desc.kind == OpKind::kGemmAr;
  const auto n = static_cast<uint32_t>(c.ops.size());
  const uint64_t m = t.m, cols = t.cols;
  const int leadDev = t.leadDev;
  cudaStream_t leadStream = t.leadStream;

  // 1. The partials, each on its rank's GPU.
  for (uint32_t r : t.mine) partialRows(c, t, r, 0, m);
  // 2. The node sum in rank order on the lead's GPU; the other GPUs' partials come over first.
  std::byte* outStaging = nullptr;
  {
    k::CudaDeviceGuard guard(leadDev);
    orderAfterPartials(t);
    outStaging = sumNodePartials(t, 0, m);
  }
  syncStream(leadDev, leadStream, "node sum");

  // The rows a node's ranks own, in rank order: (first row, rows).
  auto rowsFor = [&](uint32_t node) {
    RowRuns out;
    if (allReduce) {
      out.emplace_back(0, m);
    } else {
      for (uint32_t r : ranksOn(c, node)) out.emplace_back(rowOffset(m, r, n), rowsOf(m, r, n));
    }
    return out;
  };
  const auto myRows = rowsFor(c.link->self());
  uint64_t myFloats = 0;
  for (auto [first, rows] : myRows) myFloats += rows * cols;
  bool started = false, ownAdded = false;
  auto addToTotal = [&](const float* src, bool atOwnRows) {
    addRowsToTotal(t, myRows, src, atOwnRows, started);
    started = true;
  };
  auto addOwnBefore = [&](uint32_t node) {
    if (!ownAdded && c.link->self() < node) {
      addToTotal(t.nodeSum, true);
      ownAdded = true;
    }
  };
  // 3. The exchange.
  c.link->exchange(
      c.epoch,
      [&](uint32_t node, std::span<std::byte> out) {
        const auto rows = rowsFor(node);
        uint64_t bytes = 0;
        for (auto [first, count] : rows) bytes += count * cols * sizeof(float);
        pin(c, out.data(), bytes);
        k::CudaDeviceGuard guard(leadDev);
        uint64_t off = 0;
        for (auto [first, count] : rows) {
          copyAsync(out.data() + off, t.nodeSum + first * cols, count * cols * sizeof(float), leadStream,
                    "node partial to the outbox");
          off += count * cols * sizeof(float);
        }
        syncStream(leadDev, leadStream, "node partial to the outbox");
        return off;
      },
      [&](uint32_t node, std::span<const std::byte> in) {
        if (in.size() != myFloats * sizeof(float)) {
          fail(ErrorCode::kProtocol, "{}: node {} sent a payload of {} bytes, expected {}", t.name, node, in.size(),
               myFloats * sizeof(float));
        }
        addOwnBefore(node);
        pin(c, in.data(), in.size());
        k::CudaDeviceGuard guard(leadDev);
        // On the compute stream: after the previous node's add has read the receive slot.
        copyAsync(t.recvSlot, in.data(), in.size(), leadStream, "inbox to the receive slot");
        syncStream(leadDev, leadStream, "inbox to the receive slot");  // the inbox is free once we return
        addToTotal(t.recvSlot, false);
      },
      kExchangeTimeoutMs);
  if (!ownAdded) addToTotal(t.nodeSum, true);
  // 4. One rounding into every local rank's C (gemm-rs: its own rows; gemm-ar: all of them).
  roundOutputs(c, t, outStaging);
  syncStream(leadDev, leadStream, t.name);
}

void HostStaging::pin(const Collective& c, const std::byte* p, uint64_t bytes) {
  if (bytes == 0) return;
  const uint64_t slotBytes = c.link->maxPayload() + CommLink::kPayloadHeaderBytes;
  if (slotBytes % 4096 != 0) return;  // slots share pages: registering one would overlap the next
  const std::byte* slot = p - CommLink::kPayloadHeaderBytes;  // the payload follows the slot's {epoch, bytes}
  const uint64_t want = std::min(slotBytes, alignUp(CommLink::kPayloadHeaderBytes + bytes, kPinStep));
  Pin& pin = pins_[slot];
  if (pin.failed || pin.bytes >= want) return;
  if (!link_) link_ = c.link;  // its memory must outlive the registrations
  pin.reg.reset();
  pin.bytes = 0;
  try {
    pin.reg = k::HostRegistration::create(const_cast<std::byte*>(slot), want, "cudaHostRegister(CommLink slot)");
    pin.bytes = want;
  } catch (const Error& e) {
    pin.failed = true;
    spdlog::warn("communicator {:#x}: the staging slot stays pageable (slower copies): {}", handle_, e.what());
  }
}

// ---- the host reference fallback --------------------------------------------------------------------------------

void HostStaging::copy(int device, void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what) {
  if (bytes == 0) return;
  kernels::CudaDeviceGuard guard(device);
  cudaStream_t s = gpus_.at(device).copy.get();
  kernels::checkCuda(cudaMemcpyAsync(dst, src, bytes, kind, s), "{}", what);
  kernels::checkCuda(cudaStreamSynchronize(s), "{}", what);
}

void HostStaging::runHostReference(Collective& c) {
  {
    const std::size_t n = c.ops.size();
    std::vector<RankOp> ranks(n);
    std::vector<std::array<std::vector<std::byte>, kMaxOpBuffers>> host(n);
    struct Slot {
      int device;
      std::byte* gpu;
      std::byte* host;
      uint64_t bytes;
    };
    std::vector<Slot> outputs;
    for (std::size_t r = 0; r < n; ++r) {
      const PendingOp& op = c.ops[r];
      ranks[r].desc = op.desc;
      if (!op.local()) continue;
      const SlotRules rules = expectedSlots(op.desc);
      for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
        if (!op.buffers[i] || !op.buffers[i]->device) continue;
        const uint64_t bytes = op.desc.bufs[i].bytes;
        host[r][i].resize(std::max<uint64_t>(bytes, 1));  // never null: a null slot means "absent" to the cpu ops
        ranks[r].data[i] = host[r][i].data();
        const DeviceMemory& mem = *op.buffers[i]->device;
        Slot s{mem.device, reinterpret_cast<std::byte*>(mem.address + op.desc.bufs[i].offset), host[r][i].data(),
               bytes};
        if (rules[i].output) {
          outputs.push_back(s);
        } else {
          copy(s.device, s.host, s.gpu, s.bytes, cudaMemcpyDeviceToHost, "cudaMemcpyAsync(input to host)");
        }
      }
    }
    runCpuOpAcrossNodes(ranks, c.nodeOfRank, *c.link, c.epoch);
    for (const Slot& s : outputs) {
      copy(s.device, s.gpu, s.host, s.bytes, cudaMemcpyHostToDevice, "cudaMemcpyAsync(output to GPU)");
    }
  }
}

}  // namespace tandem::daemon::cuda
