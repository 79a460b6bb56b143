// tandemctl advise / tune: the measurements (advise_measure.hpp).
#include "advise_measure.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu_kernels.hpp"
#endif

#include "plan_hook.hpp"
#include "session.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.h"

namespace tandem::ctl::advise {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace ref = tandem::reference;

// A layer's entry in the report, before its measurements.
json describe(const Layer& l) {
  return {{"name", l.name}, {"op", std::string(opKindName(l.op))}, {"m", l.m}, {"n", l.n}, {"k", l.k},
          {"dtype", std::string(dtypeName(l.dtype))}};
}

[[noreturn]] void die(tandem_status_t status, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {} ({})", what, tandem_last_error(), tandem_strerror(status)));
}
void checkC(tandem_status_t status, const std::string& what) {
  if (status != TANDEM_SUCCESS) die(status, what);
}

tandem_unique_id_t freshId() {
  tandem_unique_id_t id;
  checkC(tandem_get_unique_id(&id), "unique id");
  return id;
}

// One op's buffers on one communicator, allocated once per shape.
struct OpBuffers {
  OpDescriptor desc{};
  std::vector<tandem_buffer_t> buffers;
  std::vector<tandem_tensor_t> tensors = std::vector<tandem_tensor_t>(kMaxOpBuffers, tandem_tensor_t{nullptr, 0});
  OpBuffers() = default;
  OpBuffers(const OpBuffers&) = delete;
  OpBuffers& operator=(const OpBuffers&) = delete;
  ~OpBuffers() {
    for (auto b : buffers) tandem_free(b);
  }
};

// 4 MiB of bf16 values uniform in [-1, 1), tiled over every buffer. Random, not a constant pattern: a constant (or
// zero) operand toggles few bits, the GPU draws less power and, power-limited, clocks higher than on real data: on an
// H200 a 0x3c3c fill made GEMMs 15-19% faster than fused_e2e_bench measures them on random inputs.
const std::vector<uint16_t>& randomBlock() {
  static const std::vector<uint16_t> block = [] {
    std::vector<uint16_t> v(uint64_t{2} << 20);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (auto& e : v) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      const float f = static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
      uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof bits);
      e = static_cast<uint16_t>(bits >> 16);  // bf16: the float's upper half
    }
    return v;
  }();
  return block;
}

// Allocates the buffers of `desc` and fills them: on a GPU with the inputs `tandemctl run` makes there (a distinct
// uniform value per element and buffer, as fused_e2e_bench's fillUniform: advise read 8-18% below fused_e2e_bench
// with randomBlock() tiled, whose 4 MiB repeat puts the same values in A and B); on the host with
// randomBlock() tiled.
void allocate(tandem_session_t session, bool cuda, const OpDescriptor& desc, OpBuffers& out) {
#ifdef TANDEM_HAVE_CUDA
  static uint64_t nextKey = 0x5eed;  // a fresh key per buffer: no two buffers hold the same values
#endif
  out.desc = desc;
  for (std::size_t i = 0; i < kMaxOpBuffers; ++i) {
    if (desc.bufs[i].bytes == 0) continue;
    tandem_buffer_t b;
    checkC(tandem_alloc(session, desc.bufs[i].bytes, &b), fmt::format("allocate {} bytes", desc.bufs[i].bytes));
    out.buffers.push_back(b);
    out.tensors[i] = {b, 0};
    auto* p = static_cast<char*>(tandem_buffer_ptr(b));
    const uint64_t bytes = desc.bufs[i].bytes;
#ifdef TANDEM_HAVE_CUDA
    if (cuda) {
      // On the legacy default stream, as the ops: they see the values.
      if (desc.kind == OpKind::kAllGather) {
        ctl::gpu::fillBytes(p, bytes, nextKey++, nullptr);
      } else {
        ctl::gpu::fillUniform(p, desc.dtype, bytes / dtypeSize(desc.dtype), nextKey++, nullptr);
      }
      continue;
    }
#else
    (void)cuda;
#endif
    const auto& block = randomBlock();
    const uint64_t blockBytes = block.size() * sizeof(uint16_t);
    for (uint64_t at = 0; at < bytes; at += blockBytes) std::memcpy(p + at, block.data(), std::min(blockBytes, bytes - at));
  }
}

// Two buffer sets of one op. The timing alternates them, as fused_e2e_bench does, so that no op finds the previous
// op's operands in L2 (at M = 1024 they fit: timing one set over and over read 10-12% faster than fused_e2e_bench).
struct OpSets {
  OpBuffers set[2];
  const OpDescriptor& desc() const { return set[0].desc; }
};

void allocate(tandem_session_t session, bool cuda, const OpDescriptor& desc, OpSets& out) {
  for (OpBuffers& b : out.set) allocate(session, cuda, desc, b);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

tandem_status_t submit(tandem_comm_t comm, const OpBuffers& b, tandem_op_t* op) {
  const OpDescriptor& d = b.desc;
  const auto dt = static_cast<tandem_dtype_t>(d.dtype);
  const auto& t = b.tensors;
  switch (d.kind) {
    case OpKind::kAgGemm: {
      tandem_ag_gemm_args_t a{};  // named fields: the later ones (layout, FP8) stay at their zero defaults
      a.struct_size = sizeof a;
      a.dtype = dt;
      a.m = d.dims[0], a.n = d.dims[1], a.k = d.dims[2];
      a.a = t[0], a.b = t[1], a.c = t[2];
      return tandem_ag_gemm(comm, &a, op);
    }
    case OpKind::kGemmRs: {
      tandem_gemm_rs_args_t a{};
      a.struct_size = sizeof a;
      a.dtype = dt;
      a.m = d.dims[0], a.n = d.dims[1], a.k = d.dims[2];
      a.a = t[0], a.b = t[1], a.c = t[2];
      return tandem_gemm_rs(comm, &a, op);
    }
    case OpKind::kGemmAr: {
      tandem_gemm_ar_args_t a{};
      a.struct_size = sizeof a;
      a.dtype = dt;
      a.m = d.dims[0], a.n = d.dims[1], a.k = d.dims[2];
      a.a = t[0], a.b = t[1], a.c = t[2];
      return tandem_gemm_ar(comm, &a, op);
    }
    case OpKind::kAllGather: {
      tandem_allgather_args_t a{sizeof a, t[0], t[1], d.dims[0], nullptr};
      return tandem_allgather(comm, &a, op);
    }
    default: return TANDEM_ERROR_UNSUPPORTED;
  }
}

// One rank's side of the measurements.
class Rank {
 public:
  Rank(const std::string& socket, const Options& o, uint32_t rank, const tandem_unique_id_t& id)
      : o_(o), rank_(rank), baseId_(id) {
    checkC(tandem_connect(socket.empty() ? nullptr : socket.c_str(), &session_), "connect to tandemd");
    cuda_ = std::string(tandem_session_backend(session_)) == "cuda";
#ifdef TANDEM_HAVE_CUDA
    if (cuda_) {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        throw std::runtime_error("tandemd runs the cuda backend but this process sees no GPU; run tandemctl where "
                                 "CUDA_VISIBLE_DEVICES shows the node's GPUs");
      }
      // One rank per GPU, as the daemon executor needs.
      if (cudaSetDevice(static_cast<int>(rank_) % count) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    }
#else
    if (cuda_) {
      throw std::runtime_error("tandemd runs the cuda backend, but this tandemctl was built without CUDA; use the "
                               "tandemctl built with tandemd");
    }
#endif
    control_ = client::Session::connect(socket.empty() ? defaultSocketPath(true) : socket);
    v1::Request request;
    request.mutable_query_status();
    const auto status = control_->call(request).status_reply();
    gpuModel_ = status.plans().gpu().empty() ? std::string("cpu") : status.plans().gpu();
    hasTable_ = status.has_plans();
    join();
  }
  ~Rank() {
    if (comm_ != nullptr) {
      clearTrials(comm_);
      tandem_comm_destroy(comm_);
    }
    if (solo_ != nullptr) {
      clearTrials(solo_);
      tandem_comm_destroy(solo_);
    }
    control_.reset();
    tandem_disconnect(session_);
  }

  bool cuda() const { return cuda_; }
  const std::string& gpuModel() const { return gpuModel_; }
  const std::string& executor() const { return executor_; }

  // Every measurement of one layer.
  json measure(const Layer& l, const std::function<void(const std::string&)>& progress) {
    json out = describe(l);
    out["ranks"] = o_.ranks;
    ref::OpShape shape;
    shape.kind = l.op;
    shape.dtype = l.dtype;
    shape.m = l.m;
    shape.n = l.n;
    shape.k = l.k;
    OpSets main;
    allocate(session_, cuda_, ref::makeDescriptor(shape, rank_, o_.ranks), main);
    const PlanKey key = planKeyOf(main.desc(), gpuModel_, executor_);
    out["bucket"] = key.bucket;
    out["executor"] = executor_;
    json errors = json::array();
    const auto timed = [&](const std::string& label, const PlanChoice& plan) -> std::optional<double> {
      try {
        const double us = time(comm_, main, key, plan);
        progress(fmt::format("{}: {:.1f} us", label, us));
        return us;
      } catch (const std::exception& e) {
        errors.push_back({{"plan", label}, {"error", e.what()}});
        progress(fmt::format("{}: failed ({})", label, e.what()));
        rejoin();  // a failed op may have aborted the communicator: every rank starts a fresh one
        return std::nullopt;
      }
    };
    const auto put = [](json& j, const char* field, std::optional<double> v) {
      j[field] = v ? json(*v) : json(nullptr);
    };
    const bool oneRank = o_.ranks == 1;
    put(out, "builtin_us", timed("built-in rules", {}));
    std::optional<double> decomposed;
    if (!(oneRank && l.op == OpKind::kAgGemm)) decomposed = timed("decomposed", {PlanKind::kDecomposed, 0, 0});
    put(out, "decomposed_us", decomposed);
    json fused = json::array();
    if (!(oneRank && l.op == OpKind::kAgGemm)) {  // one rank gathers nothing: ag-gemm runs its local GEMM
      std::vector<uint32_t> splits = o_.sms;
      if (l.op != OpKind::kAgGemm) splits.insert(splits.begin(), 0);  // 0: every SM computes, producer warps copy
      for (uint32_t sms : splits) {
        const auto us = timed(sms == 0 ? std::string("fused, no comm SMs") : fmt::format("fused, {} comm SMs", sms),
                              {PlanKind::kFused, sms, 0});
        fused.push_back({{"comm_sms", sms}, {"us", us ? json(*us) : json(nullptr)}});
      }
    }
    out["fused"] = fused;
    // The overlap limit: the same GEMM with nothing to communicate, on a communicator of this rank alone (one rank:
    // gemm-rs and gemm-ar then run the GEMM core alone, ag-gemm its local GEMM).
    std::optional<double> gemmAlone;
    if (oneRank) {
      gemmAlone = l.op == OpKind::kAgGemm ? (out["builtin_us"].is_number() ? std::optional<double>(out["builtin_us"])
                                                                             : std::nullopt)
                                          : decomposed;
    } else {
      try {
        ref::OpShape solo = shape;
        if (l.op != OpKind::kAgGemm) solo.k = main.desc().dims[dim::kK];  // this rank's K slice
        OpSets b;
        allocate(session_, cuda_, ref::makeDescriptor(solo, 0, 1), b);
        const PlanKey soloKey = planKeyOf(b.desc(), gpuModel_, executor_);
        gemmAlone = time(solo_, b, soloKey, l.op == OpKind::kAgGemm ? PlanChoice{} : PlanChoice{PlanKind::kDecomposed, 0, 0});
        progress(fmt::format("the GEMM alone: {:.1f} us", *gemmAlone));
      } catch (const std::exception& e) {
        errors.push_back({{"plan", "the GEMM alone"}, {"error", e.what()}});
      }
    }
    put(out, "gemm_alone_us", gemmAlone);
    // The unfused baseline: the GEMM and the collective one after the other. ag-gemm: tandem's AllGather of the
    // shards, then the GEMM alone; gemm-rs/ar: the decomposed plan (the GEMM, then the reduction kernel, no overlap).
    out["baseline_us"] = oneRank ? out["gemm_alone_us"] : out["decomposed_us"];
    if (!oneRank && l.op == OpKind::kAgGemm) {
      out["baseline_us"] = nullptr;
      if (out["gemm_alone_us"].is_number()) {
        try {
          const double ag = allgatherUs(main.desc().bufs[slot::kA].bytes);
          out["allgather_us"] = ag;
          out["baseline_us"] = ag + out["gemm_alone_us"].get<double>();
          progress(fmt::format("all-gather of the shards: {:.1f} us", ag));
        } catch (const std::exception& e) {
          errors.push_back({{"plan", "all-gather"}, {"error", e.what()}});
        }
      }
    }
    // The winner among the explicit plans (the built-in rules pick one of them, so they are never better than it).
    std::optional<std::pair<PlanChoice, double>> best;
    const auto consider = [&](PlanChoice p, const json& us) {
      if (!us.is_number()) return;
      if (!best || us.get<double>() < best->second) best = std::make_pair(p, us.get<double>());
    };
    consider({PlanKind::kDecomposed, 0, 0}, out["decomposed_us"]);
    for (const auto& f : fused) consider({PlanKind::kFused, f["comm_sms"].get<uint32_t>(), 0}, f["us"]);
    if (best) {
      out["best"] = {{"kind", std::string(planKindName(best->first.kind))}, {"comm_sms", best->first.commSms},
                     {"us", best->second}};
    }
    out["errors"] = errors;
    return out;
  }

  // The link: one large AllGather (per-rank bytes), as bytes received per second by each rank.
  json link() {
    if (o_.ranks == 1) return {{"note", "one rank: no peer to measure a link to"}};
    const uint64_t bytes = cuda_ ? (uint64_t{64} << 20) : (uint64_t{4} << 20);
    try {
      const double us = allgatherUs(bytes);
      const double gbps = static_cast<double>(bytes) * (o_.ranks - 1) / us / 1e3;
      return {{"bytes_per_rank", bytes}, {"us", us}, {"gb_per_s", gbps}};
    } catch (const std::exception& e) {
      return {{"error", e.what()}};
    }
  }

  void clearTrials(tandem_comm_t comm) {
    if (!hasTable_ || rank_ != 0) return;
    try {
      v1::Request request;
      request.mutable_set_plan()->set_comm_handle(client::commHandle(comm));
      request.mutable_set_plan()->set_clear_trials(true);
      control_->call(request);
    } catch (const std::exception&) {
      // The communicator's trial plans go with it anyway (tandemd caps them); nothing to undo.
    }
  }

 private:
  void join() {
    tandem_unique_id_t id = baseId_;
    id.bytes[15] ^= static_cast<uint8_t>(generation_ * 2);  // every rank derives the same fresh id per generation
    id.bytes[14] ^= static_cast<uint8_t>(generation_ >> 7);
    checkC(tandem_comm_init(session_, &id, o_.ranks, rank_, o_.timeoutMs, &comm_), "join the measuring communicator");
    const std::string exec = client::commExecutor(comm_);
    executor_ = exec == "cpu" ? control_->executor() : exec;
    if (o_.ranks > 1 && solo_ == nullptr) {
      const tandem_unique_id_t soloId = freshId();
      checkC(tandem_comm_init(session_, &soloId, 1, 0, o_.timeoutMs, &solo_), "join a one-rank communicator");
    }
  }
  void rejoin() {
    if (comm_ != nullptr) {
      clearTrials(comm_);
      tandem_comm_destroy(comm_);
    }
    comm_ = nullptr;
    ++generation_;
    join();
  }

  // Sets the trial plan of `key` on `comm` (kAuto: none), then times `o_.iters` ops after `o_.warmup`: the median us
  // per op. Timed as fused_e2e_bench times (so that the two agree): one op at a time, each after a barrier of the
  // communicator and bracketed by CUDA events on its stream (cpu backend: the wall clock from submit to done), the
  // two buffer sets alternating. Back to back, with no barrier and one set, ops overlap their neighbours' launch and
  // tail and hit a warm L2: that read 10-12% below fused_e2e_bench on the H200.
  double time(tandem_comm_t comm, const OpSets& s, const PlanKey& key, const PlanChoice& plan) {
    client::setCommPlan(comm, key, plan);
    if (hasTable_ && rank_ == 0) {
      v1::Request request;
      auto* sp = request.mutable_set_plan();
      sp->set_comm_handle(client::commHandle(comm));
      sp->set_clear_trials(true);
      if (plan.kind != PlanKind::kAuto) {
        auto* e = sp->add_entries();
        e->set_op(std::string(opKindName(key.op)));
        e->set_dtype(std::string(dtypeName(key.dtype)));
        e->set_ranks(key.ranks);
        e->set_bucket(key.bucket);
        e->set_gpu(key.gpu);
        e->set_executor(key.executor);
        e->set_kind(std::string(planKindName(plan.kind)));
        e->set_comm_sms(plan.commSms);
        e->set_source("trial");
      }
      control_->call(request);
    }
    const std::string name(opKindName(s.desc().kind));
    const auto waitOp = [&](tandem_op_t op, std::string_view what) {
      checkC(tandem_wait(op, o_.timeoutMs), fmt::format("wait for {}", what));
    };
    for (uint32_t i = 0; i < o_.warmup; ++i) {
      tandem_op_t op;
      checkC(submit(comm, s.set[i % 2], &op), fmt::format("submit {}", name));
      waitOp(op, name);
    }
    std::vector<double> us;
    us.reserve(o_.iters);
#ifdef TANDEM_HAVE_CUDA
    // The ops are ordered on the legacy default stream (cuda_stream null), the barrier too: the events bracket the op.
    cudaEvent_t start = nullptr, stop = nullptr;
    if (cuda_ && (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess)) {
      throw std::runtime_error("cudaEventCreate failed");
    }
    struct Events {
      cudaEvent_t& a;
      cudaEvent_t& b;
      ~Events() {
        if (a != nullptr) cudaEventDestroy(a);
        if (b != nullptr) cudaEventDestroy(b);
      }
    } events{start, stop};
#endif
    for (uint32_t i = 0; i < o_.iters; ++i) {
      tandem_op_t barrier, op;
      checkC(tandem_barrier(comm, &barrier), "submit the barrier before a timed op");
#ifdef TANDEM_HAVE_CUDA
      if (cuda_) {
        cudaEventRecord(start, nullptr);
        checkC(submit(comm, s.set[i % 2], &op), fmt::format("submit {}", name));
        cudaEventRecord(stop, nullptr);
        waitOp(barrier, "the barrier before a timed op");
        waitOp(op, name);
        const cudaError_t err = cudaEventSynchronize(stop);
        float ms = 0;
        if (err != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
          throw std::runtime_error(fmt::format("timing events: {}", cudaGetErrorString(err)));
        }
        us.push_back(static_cast<double>(ms) * 1e3);
        continue;
      }
#endif
      waitOp(barrier, "the barrier before a timed op");
      const auto t0 = Clock::now();
      checkC(submit(comm, s.set[i % 2], &op), fmt::format("submit {}", name));
      waitOp(op, name);
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    return median(std::move(us));
  }

  double allgatherUs(uint64_t bytes) {
    ref::OpShape s;
    s.kind = OpKind::kAllGather;
    s.bytes = bytes;
    OpSets b;
    allocate(session_, cuda_, ref::makeDescriptor(s, rank_, o_.ranks), b);
    return time(comm_, b, PlanKey{}, {});
  }

  const Options& o_;
  uint32_t rank_;
  tandem_unique_id_t baseId_;
  uint32_t generation_ = 0;
  tandem_session_t session_ = nullptr;
  std::unique_ptr<client::Session> control_;
  tandem_comm_t comm_ = nullptr;
  tandem_comm_t solo_ = nullptr;
  bool cuda_ = false;
  bool hasTable_ = false;
  std::string gpuModel_, executor_;
};

}  // namespace

json measureAll(const std::string& socket, const Options& o, const std::vector<Layer>& layers, bool showProgress) {
  const tandem_unique_id_t id = freshId();
  const auto rankMain = [&](uint32_t r) {
    Rank rank(socket, o, r, id);
    json report{{"gpu", rank.gpuModel()}, {"executor", rank.executor()}, {"layers", json::array()}};
    std::size_t done = 0;
    for (const Layer& l : layers) {
      ++done;
      const auto progress = [&](const std::string& what) {
        if (showProgress && r == 0) {
          std::fprintf(stderr, "[%zu/%zu] %s: %s\n", done, layers.size(), l.name.c_str(), what.c_str());
        }
      };
      if (!l.misfit.empty() && rank.cuda()) {
        json skipped = describe(l);
        skipped["misfit"] = l.misfit;
        report["layers"].push_back(std::move(skipped));
        progress("skipped: " + l.misfit);
        continue;
      }
      report["layers"].push_back(rank.measure(l, progress));
    }
    if (showProgress && r == 0) std::fprintf(stderr, "link: measuring an all-gather\n");
    report["link"] = rank.link();
    return report;
  };
  if (o.ranks == 1) return rankMain(0);
  // Ranks 1..n-1 in children: each its own session and GPU, like the ranks of a job. Rank 0 stays here.
  std::vector<pid_t> children;
  for (uint32_t r = 1; r < o.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int code = 0;
      try {
        rankMain(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %u: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(nullptr);
      std::_Exit(code);
    }
    children.push_back(pid);
  }
  json report;
  std::string error;
  try {
    report = rankMain(0);
  } catch (const std::exception& e) {
    error = e.what();
    for (pid_t p : children) ::kill(p, SIGTERM);
  }
  bool childFailed = false;
  for (pid_t p : children) {
    int status = 0;
    ::waitpid(p, &status, 0);
    childFailed = childFailed || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (!error.empty()) throw std::runtime_error(error);
  if (childFailed) throw std::runtime_error("a rank process failed (its error is above)");
  return report;
}

}  // namespace tandem::ctl::advise
