// Ring attention on the cuda backend end to end: real rank processes run tandem_ring_attention through libtandem on
// one tandemd, and every output (and lse) is checked against the fp64 reference (common/reference.hpp) at 1, 2 and 4
// ranks (ranks share the GPUs round robin): causal and not, both layouts, bf16 and fp16, head_dim 64 and 128,
// sequence shards that are not tile multiples and differ per rank, a rank with no rows, scale 0 and a custom one.
// Outputs must repeat bit for bit over 20 runs and never hold a NaN.
#include <array>
#include <memory>
#include <sstream>
#include <vector>

#include "gpu_harness.hpp"
#include "tandem/common/reference.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpDescriptor;
using tandem::OpKind;
namespace dim = tandem::dim;
namespace slot = tandem::slot;
namespace ref = tandem::reference;

namespace {

struct AttnCase {
  DType dtype;
  uint64_t heads, headDim;
  std::vector<uint64_t> seqs;  // rank r holds seqs[r % seqs.size()] rows
  bool causal;
  bool zigzag;
  float scale;       // 0: 1/sqrt(head_dim)
  bool lse = true;   // ask for lse
  int repeats = 1;   // runs after the first that must reproduce it bit for bit
};

std::string describe(const AttnCase& c, uint32_t n) {
  std::string seqs;
  for (uint32_t r = 0; r < n; ++r) seqs += (r == 0 ? "" : "/") + std::to_string(c.seqs[r % c.seqs.size()]);
  return fmt::format("{} heads={} hd={} seq={} {}{} scale={}{}", tandem::dtypeName(c.dtype), c.heads, c.headDim, seqs,
                     c.causal ? "causal" : "full", c.zigzag ? " zigzag" : "", c.scale, c.lse ? "" : " (no lse)");
}

OpDescriptor descriptorOf(const AttnCase& c, uint32_t r, uint32_t n) {
  ref::OpShape shape;
  shape.kind = OpKind::kRingAttention;
  shape.dtype = c.dtype;
  shape.heads = c.heads;
  shape.headDim = c.headDim;
  shape.causal = c.causal;
  shape.zigzag = c.zigzag;
  shape.seq = n;  // replaced below
  OpDescriptor d = ref::makeDescriptor(shape, r, n);
  const uint64_t seq = c.seqs[r % c.seqs.size()], es = tandem::dtypeSize(c.dtype);
  d.dims[dim::kSeq] = seq;
  d.scale = c.scale;
  for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut}) {
    d.bufs[static_cast<std::size_t>(s)].bytes = seq * c.heads * c.headDim * es;
  }
  d.bufs[slot::kAttnLse].bytes = c.lse ? c.heads * seq * 4 : 0;
  return d;
}

// One case as one rank runs it: every rank's inputs (each rank needs them all for the reference), this rank's
// expected outputs, and its device buffers.
struct RankCase {
  std::vector<OpDescriptor> descs;
  std::vector<std::array<std::vector<std::byte>, tandem::kMaxOpBuffers>> host;
  std::array<std::vector<double>, tandem::kMaxOpBuffers> want;
  std::array<tandem_buffer_t, tandem::kMaxOpBuffers> buf{};
  uint32_t rank;

  RankCase(tandem_session_t s, const AttnCase& c, uint32_t r, uint32_t n, uint64_t seed) : rank(r) {
    std::vector<std::array<const std::byte*, tandem::kMaxOpBuffers>> inputs(n);
    host.resize(n);
    for (uint32_t q = 0; q < n; ++q) {
      descs.push_back(descriptorOf(c, q, n));
      std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
      for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
        host[q][i].resize(descs[q].bufs[i].bytes);
        slots[i] = host[q][i].empty() ? nullptr : host[q][i].data();
        inputs[q][i] = slots[i];
      }
      ref::fillInputs(descs[q], slots, seed);  // inputs uniform in [-1, 1]; outputs poisoned with NaN
    }
    want = ref::compute(descs, inputs)[r];
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (host[r][i].empty()) continue;
      TK(tandem_alloc(s, host[r][i].size(), &buf[i]));
      CK(cudaMemcpy(tandem_buffer_ptr(buf[i]), host[r][i].data(), host[r][i].size(), cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize());
  }
  ~RankCase() {
    for (tandem_buffer_t b : buf) {
      if (b != nullptr) tandem_free(b);
    }
  }
  RankCase(const RankCase&) = delete;
  RankCase& operator=(const RankCase&) = delete;

  tandem_tensor_t tensor(int s) const { return {buf[static_cast<std::size_t>(s)], 0}; }
  void* ptr(int s) const { return tandem_buffer_ptr(buf[static_cast<std::size_t>(s)]); }

  tandem_status_t submit(tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) const {
    const OpDescriptor& d = descs[rank];
    tandem_ring_attention_args_t a{};
    a.struct_size = sizeof a;
    a.dtype = static_cast<tandem_dtype_t>(d.dtype);
    a.seq = d.dims[dim::kSeq];
    a.heads = d.dims[dim::kHeads];
    a.head_dim = d.dims[dim::kHeadDim];
    a.causal = (d.flags & tandem::kFlagCausal) != 0;
    a.scale = d.scale;
    a.q = tensor(slot::kQ);
    a.k = tensor(slot::kKey);
    a.v = tensor(slot::kValue);
    a.out = tensor(slot::kAttnOut);
    a.cuda_stream = stream;
    a.lse = tensor(slot::kAttnLse);
    a.layout = (d.flags & tandem::kFlagZigzag) != 0 ? TANDEM_ATTENTION_ZIGZAG : TANDEM_ATTENTION_CONTIGUOUS;
    return tandem_ring_attention(comm, &a, op);
  }
  void poison(cudaStream_t stream) const {
    for (int s : {slot::kAttnOut, slot::kAttnLse}) {
      if (!host[rank][static_cast<std::size_t>(s)].empty()) {
        CK(cudaMemsetAsync(ptr(s), 0xFF, host[rank][static_cast<std::size_t>(s)].size(), stream));
      }
    }
  }
  // This rank's out and lse, as bytes.
  std::vector<std::byte> download() {
    std::vector<std::byte> all;
    for (int s : {slot::kAttnOut, slot::kAttnLse}) {
      std::vector<std::byte>& h = host[rank][static_cast<std::size_t>(s)];
      if (h.empty()) continue;
      CK(cudaMemcpy(h.data(), ptr(s), h.size(), cudaMemcpyDeviceToHost));
      all.insert(all.end(), h.begin(), h.end());
    }
    return all;
  }
  std::string compare() const {
    std::array<const std::byte*, tandem::kMaxOpBuffers> slots{};
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      slots[i] = host[rank][i].empty() ? nullptr : host[rank][i].data();
    }
    const ref::Comparison cmp = ref::compareRank(descs[rank], slots, want);
    return cmp.ok ? std::string() : fmt::format("{} (relative error {:.3g})", cmp.detail, cmp.relError);
  }
};

std::string finish(cudaStream_t stream, const tandem_op_t& op) {
  const std::string synced = syncWithin(stream, 60000);
  if (synced != "synced") return "stream " + synced;
  if (tandem_wait(op, 60000) != TANDEM_SUCCESS) return std::string("op failed: ") + tandem_last_error();
  return "";
}

std::string attentionRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                          const std::vector<AttnCase>& cases) {
  CK(cudaSetDevice(rankDevice(rank)));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, nranks, rank, 60000, &comm));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string what = describe(cases[i], nranks);
    RankCase rc(s, cases[i], rank, nranks, 5000 + i);
    tandem_op_t op;
    if (rc.submit(comm, stream, &op) != TANDEM_SUCCESS) {
      return fmt::format("FAIL {}: submit: {}", what, tandem_last_error());
    }
    if (std::string e = finish(stream, op); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    const std::vector<std::byte> first = rc.download();
    if (std::string e = rc.compare(); !e.empty()) return fmt::format("FAIL {}: {}", what, e);
    for (int rep = 1; rep < cases[i].repeats; ++rep) {
      rc.poison(stream);
      if (rc.submit(comm, stream, &op) != TANDEM_SUCCESS) {
        return fmt::format("FAIL {} run {}: submit: {}", what, rep, tandem_last_error());
      }
      if (std::string e = finish(stream, op); !e.empty()) return fmt::format("FAIL {} run {}: {}", what, rep, e);
      if (rc.download() != first) return fmt::format("FAIL {}: run {} differs from run 0 (must be bitwise)", what, rep);
    }
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

void runRanks(const Daemon& d, uint32_t nranks, const std::vector<AttnCase>& cases) {
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < nranks; ++r) {
    ranks.push_back(spawn([&, r](const Io&) { return attentionRank(d.socket(), id, nranks, r, cases); }));
  }
  for (uint32_t r = 0; r < nranks; ++r) {
    const std::string result = ranks[r].read(240000);
    INFO("rank " << r << " of " << nranks << ": " << result);
    INFO(d.log());
    CHECK(result == "OK");
  }
  for (auto& r : ranks) r.reap();
}

// Shapes that are multiples of nothing (tiles are 128 query rows and 128 or 176 keys), a rank with no rows, both
// layouts, both dtypes and head sizes, the default and a custom scale; the first case repeats 20 times bitwise.
std::vector<AttnCase> casesFor(uint32_t n) {
  const DType bf16 = DType::kBF16, fp16 = DType::kF16;
  std::vector<AttnCase> v;
  v.push_back({bf16, 2, 128, {300, 177, 64, 251}, true, false, 0.0f, true, 20});
  v.push_back({bf16, 3, 128, {200, 329, 1, 130}, false, false, 0.0f});
  v.push_back({fp16, 2, 64, {257, 100, 190, 33}, true, true, 0.11f});
  v.push_back({bf16, 2, 64, {129, 0, 300, 77}, false, true, 0.0f, true, 20});
  v.push_back({fp16, 1, 128, {180, 260, 0, 150}, true, true, 0.0f, false});
  v.push_back({bf16, 2, 128, {333, 0, 128, 5}, true, false, 0.3f});
  if (n > 1) v.push_back({bf16, 2, 128, {0, 250, 99, 0}, true, true, 0.0f});  // rank 0 empty: the rest go on
  return v;
}

std::string listCases(const std::vector<AttnCase>& cases, uint32_t n) {
  std::ostringstream o;
  for (const auto& c : cases) o << "\n  " << describe(c, n);
  return o.str();
}

}  // namespace

TEST_CASE("ring attention, client executor: matches the fp64 reference at 1, 2 and 4 ranks, 20 runs bitwise") {
  Daemon d(config("client"), {}, "");
  REQUIRE(status(d)["executor"] == "client");
  for (uint32_t n : {1u, 2u, 4u}) {
    CAPTURE(n);
    const auto cases = casesFor(n);
    MESSAGE(n << " rank(s) on " << gpuCount() << " GPU(s), MPS " << std::string(mpsRunning() ? "on" : "off") << ":"
              << listCases(cases, n));
    runRanks(d, n, cases);
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

// Under MPS tandemd refuses two ranks on one GPU with the daemon executor, so one GPU runs 1 rank here; every GPU
// count above 1 runs as many ranks as GPUs.
TEST_CASE("ring attention, daemon executor (MPS): matches the fp64 reference, one rank per GPU") {
  if (!mpsRunning()) {
    MESSAGE("skipped: MPS is not running (the daemon executor needs it)");
    return;
  }
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  for (uint32_t n = 1; n <= static_cast<uint32_t>(gpuCount()); n *= 2) {
    CAPTURE(n);
    runRanks(d, n, casesFor(n));
  }
}
