// A data error fails one op, not the communicator (cpu backend): a capacity overflow, a bad expert id and a shape over
// a limits.* quota each fail the op on every rank with its message and write nothing, and the next op on the same
// communicator runs and matches the fp64 reference. Two ranks, each a thread with its own session.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;
namespace ref = tandem::reference;
namespace dim = tandem::dim;
namespace slot = tandem::slot;

namespace {

constexpr uint32_t kRanks = 2;

using Slots = std::array<std::vector<std::byte>, tandem::kMaxOpBuffers>;

// One MoE op of `shape` on every rank: the descriptors, every rank's inputs, and the reference outputs.
struct MoeOp {
  std::vector<tandem::OpDescriptor> descs;
  std::vector<Slots> host;

  MoeOp(const ref::OpShape& shape, uint64_t seed) : host(kRanks) {
    for (uint32_t r = 0; r < kRanks; ++r) {
      descs.push_back(ref::makeDescriptor(shape, r, kRanks));
      std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
      for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) {
        host[r][s].resize(descs[r].bufs[s].bytes);
        slots[s] = host[r][s].empty() ? nullptr : host[r][s].data();
      }
      ref::fillInputs(descs[r], slots, seed);  // outputs poisoned (NaN): a failed op must leave them so
    }
  }

  ref::Expected expected() const {
    std::vector<std::array<const std::byte*, tandem::kMaxOpBuffers>> inputs(kRanks);
    for (uint32_t r = 0; r < kRanks; ++r) {
      for (std::size_t s = 0; s < tandem::kMaxOpBuffers; ++s) inputs[r][s] = host[r][s].empty() ? nullptr : host[r][s].data();
    }
    return ref::compute(descs, inputs);
  }
};

// Rank r's buffers of one op, filled from `op.host` (outputs poisoned), and its submission through the C API.
struct RankBuffers {
  std::vector<std::unique_ptr<tandem::Buffer>> b;
  const tandem::OpDescriptor& d;

  RankBuffers(tandem::Session& s, const MoeOp& op, uint32_t r) : d(op.descs[r]) {
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      const auto& h = op.host[r][i];
      b.push_back(std::make_unique<tandem::Buffer>(s, std::max<std::size_t>(h.size(), 16)));
      if (!h.empty()) std::memcpy(b.back()->as<std::byte>(), h.data(), h.size());
    }
  }
  tandem_tensor_t t(int s) const { return b[static_cast<std::size_t>(s)]->tensor(); }

  tandem_status_t submit(tandem_comm_t comm, tandem_op_t* h) const {
    const auto dtype = static_cast<tandem_dtype_t>(d.dtype);
    if (d.kind == tandem::OpKind::kMoeDispatchGemm) {
      const tandem_moe_dispatch_gemm_args_t a{sizeof a, dtype, d.dims[dim::kTokens], d.dims[dim::kHidden],
                                              d.dims[dim::kNOut], d.dims[dim::kExperts], d.dims[dim::kTopk],
                                              d.dims[dim::kCapacity], t(slot::kX), t(slot::kTopkIds),
                                              t(slot::kTopkWeights), t(slot::kW), t(slot::kMoeOut), t(slot::kRowInfo),
                                              t(slot::kExpertCounts), nullptr, TANDEM_DTYPE_INVALID, {}};
      return tandem_moe_dispatch_gemm(comm, &a, h);
    }
    const tandem_moe_ffn_args_t a{sizeof a, dtype, d.dims[dim::kTokens], d.dims[dim::kHidden], d.dims[dim::kFfn],
                                  d.dims[dim::kExperts], d.dims[dim::kTopk], t(slot::kX), t(slot::kTopkIds),
                                  t(slot::kTopkWeights), t(slot::kW1), t(slot::kW2), t(slot::kFfnOut), nullptr,
                                  d.dims[dim::kSavedRows],
                                  d.dims[dim::kSavedRows] != 0 ? t(slot::kFfnSaved) : tandem_tensor_t{},
                                  TANDEM_DTYPE_INVALID, {}, {}};
    return tandem_moe_dispatch_ffn_combine(comm, &a, h);
  }

  // "" when every output slot still holds what it was filled with (the poison).
  std::string untouched(const MoeOp& op, uint32_t r) const {
    const tandem::OpSpec& spec = tandem::opSpec(d.kind);
    for (int s = 0; s < spec.slotCount; ++s) {
      if (!spec.slots[s].output) continue;
      const auto& h = op.host[r][static_cast<std::size_t>(s)];
      const auto* got = b[static_cast<std::size_t>(s)]->as<std::byte>();
      for (std::size_t i = 0; i < h.size(); ++i) {
        if (got[i] != h[i]) return fmt::format("output slot {} byte {} was written", s, i);
      }
    }
    return "";
  }
};

// Every rank runs `bad` (which must fail naming `needle` and write nothing), then `good` on the same communicator
// (which must match the reference). Returns each rank's verdict ("ok" or what went wrong).
std::array<std::string, kRanks> failThenRun(const Daemon& d, const MoeOp& bad, const std::string& needle,
                                            const MoeOp& good) {
  const tandem_unique_id_t id = tandem::uniqueId();
  const ref::Expected want = good.expected();
  std::array<std::string, kRanks> result;
  auto rank = [&](uint32_t r) {
    try {
      tandem::Session s(d.socket().c_str());
      tandem::Communicator comm(s, id, kRanks, r, 10000);
      RankBuffers first(s, bad, r);
      tandem_op_t h;
      tandem::check(first.submit(comm.get(), &h));
      const tandem_status_t st = tandem_wait(h, 60000);
      const std::string msg = tandem_last_error();
      if (st != TANDEM_ERROR_INVALID_ARGUMENT || msg.find(needle) == std::string::npos) {
        result[r] = fmt::format("the bad op: status {} '{}', want INVALID_ARGUMENT naming '{}'", static_cast<int>(st),
                                msg, needle);
        return;
      }
      if (std::string e = first.untouched(bad, r); !e.empty()) {
        result[r] = "the bad op: " + e;
        return;
      }
      RankBuffers second(s, good, r);
      tandem::check(second.submit(comm.get(), &h));
      tandem::wait(h, 60000);
      std::array<const std::byte*, tandem::kMaxOpBuffers> got{};
      for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) got[i] = second.b[i]->as<std::byte>();
      const ref::Comparison c = ref::compareRank(good.descs[r], got, want[r]);
      result[r] = c.ok ? "ok" : "the op after the error: " + c.detail;
    } catch (const std::exception& e) {
      result[r] = e.what();
    }
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  return result;
}

ref::OpShape moeShape(tandem::OpKind kind, uint64_t tokens, uint64_t hidden, uint64_t n) {
  ref::OpShape shape;
  shape.kind = kind;
  shape.dtype = tandem::DType::kBF16;
  shape.m = tokens;
  shape.k = hidden;
  shape.n = n;
  shape.experts = 8;
  shape.topk = 2;
  return shape;
}

}  // namespace

TEST_CASE("a capacity overflow fails the op on every rank and writes nothing; the next op on the communicator runs") {
  Daemon d;
  const ref::OpShape shape = moeShape(tandem::OpKind::kMoeDispatchGemm, 13, 16, 12);
  MoeOp bad(shape, 7);
  for (auto& desc : bad.descs) desc.dims[dim::kCapacity] = 1;  // every rank receives more than one row
  const MoeOp good(shape, 8);
  const auto result = failThenRun(d, bad, "but capacity is 1; pass capacity >=", good);
  CHECK(result[0] == "ok");
  CHECK(result[1] == "ok");
}

TEST_CASE("a bad expert id fails the op on every rank and writes nothing; the next op on the communicator runs") {
  Daemon d;
  const ref::OpShape shape = moeShape(tandem::OpKind::kMoeDispatchFfnCombine, 11, 16, 10);
  MoeOp bad(shape, 7);
  const int32_t nine = 9;  // experts is 8
  std::memcpy(bad.host[1][slot::kTopkIds].data() + (5 * 2 + 1) * 4, &nine, 4);
  const MoeOp good(shape, 8);
  const auto result = failThenRun(d, bad, "rank 1 topk_ids[5][1] = 9 is out of range", good);
  CHECK(result[0] == "ok");
  CHECK(result[1] == "ok");
}

TEST_CASE("a shape over the scratch quota fails naming limits.max_scratch_bytes and the bytes; the next op runs") {
  Daemon d("limits:\n  max_scratch_bytes: 1048576\n");
  // 2 x 8 bytes per element of every slot of both ranks: w1 alone is 4 x 512 x 256 per rank, far over 1 MiB.
  const ref::OpShape big = moeShape(tandem::OpKind::kMoeDispatchFfnCombine, 64, 256, 256);
  const MoeOp bad(big, 7);
  const MoeOp good(moeShape(tandem::OpKind::kMoeDispatchFfnCombine, 11, 16, 10), 8);
  // The message (181 bytes) is longer than one completion record: its remedy arrives in the record after it.
  const auto result =
      failThenRun(d, bad, "above limits.max_scratch_bytes (1048576); pass a smaller shape or raise the limit", good);
  CHECK(result[0] == "ok");
  CHECK(result[1] == "ok");
}

TEST_CASE("a workspace asked for at the join over limits.max_session_bytes fails the join naming the key and the bytes") {
  Daemon d("limits:\n  max_buffer_bytes: 16777216\n  max_session_bytes: 16777216\n");
  const tandem_unique_id_t id = tandem::uniqueId();
  std::array<std::string, kRanks> result;
  auto rank = [&](uint32_t r) {
    tandem::Session s(d.socket().c_str());
    // Rank 1 asks for 1 GiB per rank; the communicator would get it on every rank, so every rank's join fails.
    const tandem_comm_config_t config{sizeof config, r == 1 ? uint64_t{1} << 30 : 0};
    tandem_comm_t comm = nullptr;
    const tandem_status_t st = tandem_comm_init_config(s.get(), &id, kRanks, r, 10000, &config, &comm);
    const std::string msg = tandem_last_error();
    if (comm != nullptr) tandem_comm_destroy(comm);
    if (st != TANDEM_ERROR_OUT_OF_MEMORY || msg.find("limits.max_session_bytes") == std::string::npos ||
        msg.find("workspace of 1073741824 bytes") == std::string::npos || msg.find("of its 16777216 bytes") == std::string::npos) {
      result[r] = fmt::format("status {} '{}'", static_cast<int>(st), msg);
      return;
    }
    result[r] = "ok";
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  CHECK(result[0] == "ok");
  CHECK(result[1] == "ok");
  // Within the quota the same daemon forms the communicator; a config of the wrong size is refused before any join.
  tandem::Session s(d.socket().c_str());
  tandem_comm_config_t config{sizeof config, 1u << 20};
  tandem_comm_t comm = nullptr;
  const tandem_unique_id_t id2 = tandem::uniqueId();
  CHECK(tandem_comm_init_config(s.get(), &id2, 1, 0, 10000, &config, &comm) == TANDEM_SUCCESS);
  if (comm != nullptr) tandem_comm_destroy(comm);
  config.struct_size = 4;
  CHECK(tandem_comm_init_config(s.get(), &id2, 1, 0, 10000, &config, &comm) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(tandem_last_error()).find("struct_size") != std::string::npos);
}
