// What the end-to-end GPU tests of the ops share: one op as one rank runs it (every rank's descriptor and inputs, this
// rank's expected outputs from the fp64 reference, its device buffers), the rank's session, communicator and stream,
// and the forked rank processes a case runs in. Each test file keeps what is its op's own: the cases, the descriptors
// and the submit through the op's public C entry point.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "gpu_harness.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/common/validate.hpp"

namespace tandem::gputest {

using RankSlots = std::array<std::vector<std::byte>, kMaxOpBuffers>;

// Waits for the stream and the op; "" or what went wrong.
inline std::string finishOp(cudaStream_t stream, const tandem_op_t& op) {
  const std::string synced = syncWithin(stream, 60000);
  if (synced != "synced") return "stream " + synced;
  if (tandem_wait(op, 60000) != TANDEM_SUCCESS) return std::string("op failed: ") + tandem_last_error();
  return "";
}

// One op as one rank runs it. Every rank rebuilds every rank's inputs from the seed (the reference needs them all),
// so nothing crosses between the rank processes but the op itself.
// "" or what differs between a rank's outputs in `slots` and the fp64 reference `want` (reference::compareRank's
// tolerance per dtype, or any NaN). `tolerance` > 0 replaces the per-dtype one (for kernels documented less accurate
// than the output dtype, e.g. the FP8 core's fp32 c: fp8CoreTolerance); anything else compareRank refuses (NaN, an
// exact slot) still fails.
inline std::string compareWithin(const OpDescriptor& desc, std::span<const std::byte* const> slots,
                                 const std::array<std::vector<double>, kMaxOpBuffers>& want, double tolerance) {
  const reference::Comparison cmp = reference::compareRank(desc, slots, want);
  const bool ok = tolerance > 0 ? cmp.relError <= tolerance && (cmp.ok || cmp.relError > cmp.tolerance) : cmp.ok;
  if (ok) return "";
  if (cmp.ok || tolerance > 0) {
    return fmt::format("relative error {:.3g} > tolerance {:.3g}{}", cmp.relError, tolerance,
                       cmp.ok ? std::string() : "; " + cmp.detail);
  }
  return fmt::format("{} (relative error {:.3g})", cmp.detail, cmp.relError);
}

// The FP8 GEMM core's accuracy against the fp64 product of the dequantized inputs (tests/gpu/gemm_fp8_test.cpp's
// bounds): bf16 c rounds at 2^-9; fp32 c carries the tensor cores' fp8 accumulator of about 14 mantissa bits, for one
// k-block with block scaling (promoted to fp32 every 128 k), over the whole K per tensor. Not the reference's fp32
// 1e-5, which the cpu backend's fp32 GEMM meets.
inline double fp8CoreTolerance(DType outDtype, bool blockScale) {
  return outDtype == DType::kF32 && blockScale ? 2e-3 : 1e-2;
}

class RankBuffers {
 public:
  // `adjust(q, slots)` may rewrite rank q's host inputs after reference::fillInputs (e.g. a routing of the test's
  // own); `reference` false skips the expected outputs (cases that must fail).
  RankBuffers(tandem_session_t s, std::vector<OpDescriptor> all, uint32_t r, uint64_t seed, bool reference = true,
              const std::function<void(uint32_t, RankSlots&)>& adjust = {})
      : descs(std::move(all)), rank(r) {
    const std::size_t n = descs.size();
    std::vector<std::array<const std::byte*, kMaxOpBuffers>> inputs(n);
    host.resize(n);
    for (std::size_t q = 0; q < n; ++q) {
      std::array<std::byte*, kMaxOpBuffers> slots{};
      for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
        host[q][i].resize(descs[q].bufs[i].bytes);
        slots[i] = host[q][i].empty() ? nullptr : host[q][i].data();
        inputs[q][i] = slots[i];
      }
      reference::fillInputs(descs[q], slots, seed);  // inputs uniform in [-1, 1]; outputs poisoned with NaN
      if (adjust) adjust(static_cast<uint32_t>(q), host[q]);
    }
    if (reference) want = reference::compute(descs, inputs)[r];
    for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
      if (host[r][i].empty()) continue;
      TK(tandem_alloc(s, host[r][i].size(), &buf[i]));
      upload(static_cast<int>(i));
    }
    const SlotRules rules = expectedSlots(desc());
    for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
      if (rules[i].output && !host[r][i].empty()) outputs.push_back(static_cast<int>(i));
    }
  }
  ~RankBuffers() {
    for (tandem_buffer_t b : buf) {
      if (b != nullptr) tandem_free(b);
    }
  }
  RankBuffers(const RankBuffers&) = delete;
  RankBuffers& operator=(const RankBuffers&) = delete;

  const OpDescriptor& desc() const { return descs[rank]; }
  tandem_tensor_t tensor(int s) const { return {buf[static_cast<std::size_t>(s)], 0}; }
  void* ptr(int s) const { return tandem_buffer_ptr(buf[static_cast<std::size_t>(s)]); }
  RankSlots& mine() { return host[rank]; }

  // This rank's host copy of slot `s` to the GPU.
  void upload(int s) {
    const std::vector<std::byte>& h = host[rank][static_cast<std::size_t>(s)];
    if (h.empty()) return;
    CK(cudaMemcpy(ptr(s), h.data(), h.size(), cudaMemcpyHostToDevice));
    // A pageable copy may still be in flight when cudaMemcpy returns, and the ops' streams are non-blocking.
    CK(cudaDeviceSynchronize());
  }
  // The outputs back into this rank's host slots (replacing the poison).
  void download() {
    for (int s : outputs) {
      std::vector<std::byte>& h = host[rank][static_cast<std::size_t>(s)];
      CK(cudaMemcpy(h.data(), ptr(s), h.size(), cudaMemcpyDeviceToHost));
    }
  }
  // Every output byte 0xFF (NaN in bf16 and fp16, -1 in int32): an element the op fails to write cannot pass.
  void poison(cudaStream_t stream) const {
    for (int s : outputs) CK(cudaMemsetAsync(ptr(s), 0xFF, host[rank][static_cast<std::size_t>(s)].size(), stream));
  }
  // "" or what differs from the fp64 reference (compareWithin).
  std::string compare(double tolerance = 0) const {
    std::array<const std::byte*, kMaxOpBuffers> slots{};
    for (std::size_t i = 0; i < kMaxOpBuffers; ++i) slots[i] = host[rank][i].empty() ? nullptr : host[rank][i].data();
    return compareWithin(desc(), slots, want, tolerance);
  }
  // This rank's outputs as downloaded last, for bitwise comparisons between runs.
  std::vector<std::vector<std::byte>> outputBytes() const {
    std::vector<std::vector<std::byte>> v;
    for (int s : outputs) v.push_back(host[rank][static_cast<std::size_t>(s)]);
    return v;
  }
  // "" when every output byte is still 0xFF (an op that failed wrote nothing).
  std::string untouched() const {
    for (int s : outputs) {
      const auto& h = host[rank][static_cast<std::size_t>(s)];
      for (std::size_t b = 0; b < h.size(); ++b) {
        if (h[b] != std::byte{0xFF}) return fmt::format("slot {} byte {} was written", s, b);
      }
    }
    return "";
  }

  std::vector<OpDescriptor> descs;               // every rank's
  std::vector<RankSlots> host;                   // every rank's slots
  std::array<std::vector<double>, kMaxOpBuffers> want;  // this rank's expected outputs
  std::array<tandem_buffer_t, kMaxOpBuffers> buf{};     // this rank's device buffers
  std::vector<int> outputs;                      // the slots this rank's op writes
  uint32_t rank = 0;
};

// A rank's session, communicator and non-blocking stream on its GPU (rankDevice), closed with it.
struct Joined {
  tandem_session_t s = nullptr;
  tandem_comm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // `config`: the communicator's options (tandem_comm_init_config); null: the defaults.
  Joined(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
         const tandem_comm_config_t* config = nullptr) {
    CK(cudaSetDevice(rankDevice(rank)));
    TK(tandem_connect(socket.c_str(), &s));
    TK(tandem_comm_init_config(s, &id, nranks, rank, 60000, config, &comm));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~Joined() {
    if (comm != nullptr) tandem_comm_destroy(comm);
    if (s != nullptr) tandem_disconnect(s);
  }
  Joined(const Joined&) = delete;
  Joined& operator=(const Joined&) = delete;
};

// Forks `nranks` rank processes on one unique id, each running `body(id, rank)` (its result line: "OK", "OK <note>"
// or what failed), and checks every rank's result within `timeoutMs`, with the daemon's log beside a failure. Returns
// each rank's note ("" when none).
inline std::vector<std::string> runRankProcesses(
    const Daemon& d, uint32_t nranks, int timeoutMs,
    const std::function<std::string(const tandem_unique_id_t&, uint32_t)>& body) {
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < nranks; ++r) ranks.push_back(spawn([&, r](const Io&) { return body(id, r); }));
  std::vector<std::string> notes;
  for (uint32_t r = 0; r < nranks; ++r) {
    const std::string result = ranks[r].read(timeoutMs);
    INFO("rank " << r << " of " << nranks << ": " << result);
    INFO(d.log());
    CHECK((result == "OK" || result.rfind("OK ", 0) == 0));
    notes.push_back(result.rfind("OK ", 0) == 0 ? result.substr(3) : std::string());
  }
  for (auto& r : ranks) r.reap();
  return notes;
}

}  // namespace tandem::gputest
