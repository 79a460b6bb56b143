// Ordinary model shapes on tandemd's default configuration (no cuda.workspace_bytes or limits.* set): the MoE layers
// of Mixtral-8x7B (hidden 4096, expert ffn 14336, 8 experts, top-2) and DeepSeek-V3's routed experts (hidden 7168,
// expert ffn 2048, 256 experts, top-8), both as dispatch+FFN+combine and as dispatch+GEMM, at 4096 and 16384 tokens
// per rank; ring attention at 32K tokens per rank; ag-gemm at 16384 x 8192 per rank. Each at 1, 2 and 4 ranks sharing
// the GPUs round robin, client executor. Each rank declares the workspace its op needs when it creates the
// communicator (tandem_comm_config_t.workspace_bytes from kernels::workspaceBytesFor; the FFN's receive rows at 1.25x
// a balanced routing), as a model would. Every op must succeed and write its outputs; the values are not
// compared with the fp64 reference (at these sizes the host reference takes hours: tandem_moe_gpu_tests and
// tandem_gpu_tests check the values at smaller shapes of the same kernels). A shape whose ranks would not fit their GPU's
// free memory (each rank's workspace, its op's buffers and a CUDA context, summed over the ranks sharing the GPU) is
// not run: its case reports itself skipped with the bytes needed and free, and the shapes that fit still run.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "rank_buffers.hpp"
#include "submit_op.hpp"
#include "tandem/kernels/fused_ops.hpp"

using namespace tandem::gputest;
using tandem::DType;
using tandem::OpKind;

namespace {

// One op's device buffers on one rank: inputs filled on the GPU (no host copy of the weights), outputs poisoned.
struct BigOp {
  tandem::OpDescriptor d;
  std::array<tandem_buffer_t, tandem::kMaxOpBuffers> buf{};
  std::vector<int> outputs;

  BigOp(tandem_session_t s, const tandem::OpDescriptor& desc, cudaStream_t stream) : d(desc) {
    const tandem::SlotRules rules = tandem::expectedSlots(d);
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      const uint64_t bytes = d.bufs[i].bytes;
      if (bytes == 0) continue;
      TK(tandem_alloc(s, bytes, &buf[i]));
      // 0x3C in every byte: 0.0115 in bf16 (0x3C3C), small enough that no sum overflows; outputs get 0xFF (NaN).
      CK(cudaMemsetAsync(tandem_buffer_ptr(buf[i]), rules[i].output ? 0xFF : 0x3C, bytes, stream));
      if (rules[i].output) outputs.push_back(static_cast<int>(i));
    }
    if (d.kind == OpKind::kMoeDispatchGemm || d.kind == OpKind::kMoeDispatchFfnCombine) routeUniform(stream);
    CK(cudaStreamSynchronize(stream));
  }
  ~BigOp() {
    for (tandem_buffer_t b : buf) {
      if (b != nullptr) tandem_free(b);
    }
  }
  BigOp(const BigOp&) = delete;
  BigOp& operator=(const BigOp&) = delete;

  tandem_tensor_t t(int s) const { return {buf[static_cast<std::size_t>(s)], 0}; }

  // Token t's k-th expert: (t + k * experts / topk) % experts, distinct per token and spread evenly over the ranks;
  // each weight 1 / topk.
  void routeUniform(cudaStream_t stream) {
    namespace dim = tandem::dim;
    namespace slot = tandem::slot;
    const uint64_t tokens = d.dims[dim::kTokens], experts = d.dims[dim::kExperts], topk = d.dims[dim::kTopk];
    std::vector<int32_t> ids(tokens * topk);
    std::vector<float> weights(tokens * topk, 1.0f / static_cast<float>(topk));
    for (uint64_t tk = 0; tk < tokens; ++tk) {
      for (uint64_t k = 0; k < topk; ++k) ids[tk * topk + k] = static_cast<int32_t>((tk + k * (experts / topk)) % experts);
    }
    CK(cudaMemcpyAsync(tandem_buffer_ptr(buf[slot::kTopkIds]), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice,
                       stream));
    if (buf[slot::kTopkWeights] != nullptr) {
      CK(cudaMemcpyAsync(tandem_buffer_ptr(buf[slot::kTopkWeights]), weights.data(), weights.size() * 4,
                         cudaMemcpyHostToDevice, stream));
    }
    CK(cudaStreamSynchronize(stream));
  }

  tandem_status_t submit(tandem_comm_t comm, cudaStream_t stream, tandem_op_t* op) const {
    return tandem::gputest::submitOp(d, [this](int s) { return t(s); }, comm, stream, op);
  }

  // "" when no output byte is still the poison pattern's first row (every output was written, at least its start and
  // its end); the dispatch+GEMM's out and row_info only up to the rows this rank received (expert_counts says).
  std::string written() const {
    for (int s : outputs) {
      const uint64_t bytes = d.bufs[static_cast<std::size_t>(s)].bytes;
      if (d.kind == OpKind::kMoeDispatchGemm && s != tandem::slot::kExpertCounts) continue;  // past the rows: poison
      std::vector<std::byte> head(std::min<uint64_t>(bytes, 4096)), tail(head.size());
      const auto* p = static_cast<const std::byte*>(tandem_buffer_ptr(buf[static_cast<std::size_t>(s)]));
      CK(cudaMemcpy(head.data(), p, head.size(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(tail.data(), p + bytes - tail.size(), tail.size(), cudaMemcpyDeviceToHost));
      for (const auto* v : {&head, &tail}) {
        if (std::all_of(v->begin(), v->end(), [](std::byte b) { return b == std::byte{0xFF}; })) {
          return fmt::format("output slot {} was not written", s);
        }
      }
    }
    return "";
  }
};

// A case: its name and rank r's descriptor of n ranks. The name is a std::string: doctest streams a const char* as a
// pointer (DOCTEST_CONFIG_TREAT_CHAR_STAR_AS_STRING is off).
struct Shape {
  std::string name;
  std::function<tandem::OpDescriptor(uint32_t r, uint32_t n)> desc;
};

// An MoE layer with `tokens` per rank. dispatch+GEMM: capacity 1.25 x the balanced rows (tokens x topk), as
// capacity-factor routers size it; routeUniform sends each rank exactly the balanced rows.
Shape moe(std::string name, OpKind kind, uint64_t tokens, uint64_t hidden, uint64_t ffnOrNOut, uint64_t experts,
          uint64_t topk) {
  return {std::move(name), [=](uint32_t r, uint32_t n) {
            tandem::reference::OpShape s;
            s.kind = kind;
            s.dtype = DType::kBF16;
            s.m = tokens;
            s.k = hidden;
            s.n = ffnOrNOut;
            s.experts = experts;
            s.topk = topk;
            tandem::OpDescriptor d = tandem::reference::makeDescriptor(s, r, n);
            if (kind == OpKind::kMoeDispatchGemm) {
              const uint64_t capacity = tokens * topk * 5 / 4;
              d.dims[tandem::dim::kCapacity] = capacity;
              d.bufs[tandem::slot::kMoeOut].bytes = capacity * ffnOrNOut * 2;
              d.bufs[tandem::slot::kRowInfo].bytes = capacity * 16;
            }
            return d;
          }};
}

// The workspace rank r of n declares: what its op needs, with the FFN's receive rows at 1.25x a balanced routing.
uint64_t declaredWorkspace(const tandem::OpDescriptor& desc, uint32_t n) {
  const uint64_t rows = desc.dims[tandem::dim::kTokens] * desc.dims[tandem::dim::kTopk] * 5 / 4;
  return tandem::kernels::workspaceBytesFor(desc, n, rows);
}

constexpr uint64_t kDefaultWorkspace = 512ull << 20;  // cuda.workspace_bytes: the least a communicator gets
constexpr uint64_t kContextBytes = 1ull << 30;        // a rank process's CUDA context and kernels, with room to spare

// Free bytes on `device` now (tandemd's own use already taken), asked in a child: this process must not initialise
// CUDA, since its rank processes are forked from it.
uint64_t freeBytesOn(int device) {
  Rank probe = spawn([device](const Io&) -> std::string {
    size_t freeBytes = 0, totalBytes = 0;
    CK(cudaSetDevice(device));
    CK(cudaMemGetInfo(&freeBytes, &totalBytes));
    return std::to_string(freeBytes);
  });
  const std::string line = probe.read(60000);
  probe.reap();
  INFO("free-memory probe on GPU " << device << ": " << line);
  REQUIRE(!line.empty());
  REQUIRE(std::isdigit(static_cast<unsigned char>(line[0])));
  return std::stoull(line);
}

// "" when every GPU has room for the ranks that share it, else the GPU, the bytes needed and the bytes free.
std::string wontFit(const Shape& sh, uint32_t n) {
  std::vector<uint64_t> need(static_cast<std::size_t>(gpuCount()), 0);
  uint64_t workspace = kDefaultWorkspace;  // the communicator's: the largest any rank declares
  for (uint32_t r = 0; r < n; ++r) workspace = std::max(workspace, declaredWorkspace(sh.desc(r, n), n));
  for (uint32_t r = 0; r < n; ++r) {
    const tandem::OpDescriptor desc = sh.desc(r, n);
    uint64_t buffers = 0;
    for (const auto& b : desc.bufs) buffers += b.bytes;
    need[static_cast<std::size_t>(rankDevice(r))] += workspace + buffers + kContextBytes;
  }
  for (std::size_t g = 0; g < need.size(); ++g) {
    if (need[g] == 0) continue;
    const uint64_t freeBytes = freeBytesOn(static_cast<int>(g));
    if (need[g] > freeBytes) {
      return fmt::format("{} at {} rank(s): GPU {} needs {} bytes ({:.1f} GiB: {} bytes of workspace per rank, the "
                         "op's buffers and a {} GiB context per rank) but has {} bytes ({:.1f} GiB) free",
                         sh.name, n, g, need[g], static_cast<double>(need[g]) / (1ull << 30), workspace,
                         kContextBytes >> 30, freeBytes, static_cast<double>(freeBytes) / (1ull << 30));
    }
  }
  return "";
}

// Every rank count of `shapes` on one tandemd with the default configuration (the backend and executor excepted).
// Those that do not fit their GPUs are skipped: the case then reports itself skipped, naming each of them.
void runDefault(const std::vector<Shape>& shapes) {
  Daemon d(config("client"), {}, "");
  std::vector<std::string> skipped;
  for (const Shape& sh : shapes) {
    for (uint32_t n : {1u, 2u, 4u}) {
      CAPTURE(sh.name);
      CAPTURE(n);
      if (std::string why = wontFit(sh, n); !why.empty()) {
        MESSAGE("SKIPPED " << why);
        skipped.push_back(std::move(why));
        continue;
      }
      MESSAGE(sh.name << " at " << n << " rank(s) on " << gpuCount() << " GPU(s)");
      runRankProcesses(d, n, 590000, [&](const tandem_unique_id_t& id, uint32_t r) -> std::string {
        const tandem::OpDescriptor desc = sh.desc(r, n);
        const tandem_comm_config_t declare{sizeof declare, declaredWorkspace(desc, n)};
        Joined j(d.socket(), id, n, r, &declare);
        BigOp op(j.s, desc, j.stream);
        tandem_op_t h;
        if (op.submit(j.comm, j.stream, &h) != TANDEM_SUCCESS) return std::string("FAIL submit: ") + tandem_last_error();
        if (std::string e = finishOp(j.stream, h); !e.empty()) return "FAIL " + e;
        if (std::string e = op.written(); !e.empty()) return "FAIL " + e;
        return "OK";
      });
    }
  }
  if (!skipped.empty()) {
    std::string reason = fmt::format("{} shape(s) do not fit the GPU memory and were not run", skipped.size());
    for (const std::string& why : skipped) reason += "; " + why;
    skipCase(reason);
  }
}

}  // namespace

TEST_CASE("Mixtral-8x7B's MoE layer (hidden 4096, ffn 14336, 8 experts, top-2) runs on the default configuration") {
  runDefault({moe("mixtral ffn, 4096 tokens/rank", OpKind::kMoeDispatchFfnCombine, 4096, 4096, 14336, 8, 2),
              moe("mixtral dispatch+gemm, 4096 tokens/rank", OpKind::kMoeDispatchGemm, 4096, 4096, 14336, 8, 2),
              moe("mixtral ffn, 16384 tokens/rank", OpKind::kMoeDispatchFfnCombine, 16384, 4096, 14336, 8, 2),
              moe("mixtral dispatch+gemm, 16384 tokens/rank", OpKind::kMoeDispatchGemm, 16384, 4096, 14336, 8, 2)});
}

TEST_CASE("DeepSeek-V3's routed experts (hidden 7168, ffn 2048, 256 experts, top-8) run on the default configuration") {
  runDefault({moe("deepseek-v3 ffn, 4096 tokens/rank", OpKind::kMoeDispatchFfnCombine, 4096, 7168, 2048, 256, 8),
              moe("deepseek-v3 dispatch+gemm, 4096 tokens/rank", OpKind::kMoeDispatchGemm, 4096, 7168, 2048, 256, 8),
              moe("deepseek-v3 ffn, 16384 tokens/rank", OpKind::kMoeDispatchFfnCombine, 16384, 7168, 2048, 256, 8),
              moe("deepseek-v3 dispatch+gemm, 16384 tokens/rank", OpKind::kMoeDispatchGemm, 16384, 7168, 2048, 256,
                  8)});
}

TEST_CASE("ring attention at 32K tokens per rank and ag-gemm at 16384 x 8192 per rank run on the default configuration") {
  // Both shapes are global in OpShape (split over the ranks): n ranks get n times the per-rank size.
  const Shape attn{"ring attention, 32K tokens/rank", [](uint32_t r, uint32_t n) {
                     tandem::reference::OpShape s;
                     s.kind = OpKind::kRingAttention;
                     s.dtype = DType::kBF16;
                     s.seq = 32768ull * n;
                     s.heads = 32;
                     s.headDim = 128;
                     s.causal = true;
                     return tandem::reference::makeDescriptor(s, r, n);
                   }};
  const Shape ag{"ag-gemm, 16384x8192/rank", [](uint32_t r, uint32_t n) {
                   tandem::reference::OpShape s;
                   s.kind = OpKind::kAgGemm;
                   s.dtype = DType::kBF16;
                   s.m = 16384ull * n;
                   s.n = 8192;
                   s.k = 8192;
                   return tandem::reference::makeDescriptor(s, r, n);
                 }};
  runDefault({attn, ag});
}

TEST_CASE("a communicator whose workspace is over limits.max_session_bytes fails to form, naming the key and the bytes") {
  // 256 MiB per session, below the default workspace (cuda.workspace_bytes, 512 MiB per rank): the allocated
  // workspace is refused after setup. A declared 1 GiB is refused before the backend allocates it.
  Daemon d(config("client") + "limits:\n  max_buffer_bytes: 268435456\n  max_session_bytes: 268435456\n", {}, "");
  runRankProcesses(d, 2, 120000, [&](const tandem_unique_id_t& id, uint32_t r) -> std::string {
    CK(cudaSetDevice(rankDevice(r)));
    tandem_session_t s = nullptr;
    TK(tandem_connect(d.socket().c_str(), &s));
    tandem_comm_t comm = nullptr;
    const tandem_status_t st = tandem_comm_init(s, &id, 2, r, 60000, &comm);
    const std::string msg = tandem_last_error();
    if (comm != nullptr) tandem_comm_destroy(comm);
    tandem_disconnect(s);
    if (st == TANDEM_SUCCESS) return "FAIL the communicator formed";
    if (msg.find("limits.max_session_bytes") == std::string::npos || msg.find("workspace of") == std::string::npos ||
        msg.find("of its 268435456 bytes") == std::string::npos) {
      return "FAIL the message does not name the quota, the workspace and the bytes: " + msg;
    }
    return "OK";
  });
}

TEST_CASE("a workspace declared over limits.max_session_bytes fails the join before anything is allocated") {
  Daemon d(config("client") + "limits:\n  max_buffer_bytes: 1073741824\n  max_session_bytes: 1073741824\n", {}, "");
  runRankProcesses(d, 2, 120000, [&](const tandem_unique_id_t& id, uint32_t r) -> std::string {
    CK(cudaSetDevice(rankDevice(r)));
    tandem_session_t s = nullptr;
    TK(tandem_connect(d.socket().c_str(), &s));
    const tandem_comm_config_t declare{sizeof declare, uint64_t{2} << 30};  // 2 GiB per rank, over the 1 GiB quota
    tandem_comm_t comm = nullptr;
    const tandem_status_t st = tandem_comm_init_config(s, &id, 2, r, 60000, &declare, &comm);
    const std::string msg = tandem_last_error();
    if (comm != nullptr) tandem_comm_destroy(comm);
    tandem_disconnect(s);
    if (st != TANDEM_ERROR_OUT_OF_MEMORY || msg.find("limits.max_session_bytes") == std::string::npos ||
        msg.find("workspace of 2147483648 bytes") == std::string::npos) {
      return fmt::format("FAIL status {} '{}'", static_cast<int>(st), msg);
    }
    return "OK";
  });
}
