// tandemctl advise / tune (advise.hpp). Every number comes from tandemd's own ops on this node: each candidate plan is
// a trial plan that only the measuring communicator sees (tandemd's SetPlan for the daemon executor, libtandem's own
// copy for the client executor), so other tenants' ops keep their plans while it runs.
#include "advise.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <vector>

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

namespace tandem::ctl {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace ref = tandem::reference;

// A mistake on the command line: printed with a hint, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::vector<std::string> ops;     // "ag-gemm", "gemm-rs,gemm-ar", ...
  std::vector<std::string> shapes;  // "MxNxK"
  std::string fromJson;
  std::string dtype = "bf16";
  uint32_t ranks = 1;
  std::vector<uint32_t> sms = {8, 16, 32};  // the SM splits of the fused sweep (besides the kernels' own)
  uint32_t iters = 20;  // the median of these (time())
  uint32_t warmup = 2;
  bool json = false;
  bool save = false;
  std::string svg;
  std::string jsonFile;  // also write the JSON report here
  uint32_t timeoutMs = 120000;
};

Options gAdvise, gTune;
CLI::App* gAdviseCmd = nullptr;
CLI::App* gTuneCmd = nullptr;

// One shape of the user's model to measure.
struct Layer {
  std::string name;  // from --from-json, else "OP MxNxK"
  OpKind op = OpKind::kInvalid;
  uint64_t m = 0, n = 0, k = 0;  // k: the whole K (gemm-rs/ar split it over the ranks)
  DType dtype = DType::kBF16;
  std::string misfit;  // why the cuda kernels cannot take it ("" when they can)
};

std::optional<DType> dtypeNamed(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kF16;
  if (s == "fp32") return DType::kF32;
  return std::nullopt;
}

std::string shapeText(const Layer& l) { return fmt::format("{}x{}x{}", l.m, l.n, l.k); }

// What keeps the cuda backend's fused kernels from taking the shape, in words ("" when nothing).
std::string misfitOf(const Layer& l, uint32_t ranks) {
  if (l.dtype != DType::kBF16 && l.dtype != DType::kF16) return "the GPU kernels take bf16 or fp16 only";
  if (l.n % 8 != 0) return fmt::format("n = {} is not a multiple of 8 (pad n)", l.n);
  if (l.op == OpKind::kAgGemm) {
    if (l.k % 8 != 0) return fmt::format("k = {} is not a multiple of 8 (pad k)", l.k);
    if (l.m < ranks) return fmt::format("m = {} has fewer rows than ranks", l.m);
  } else if (l.k % (8 * ranks) != 0) {
    return fmt::format("K = {} does not split into {} slices that are multiples of 8 (pad K to a multiple of {})", l.k,
                       ranks, 8 * ranks);
  }
  return {};
}

uint64_t parseDim(const std::string& text, const std::string& what) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v == 0) {
    throw UsageError(fmt::format("{}: '{}' is not a positive number", what, text));
  }
  return v;
}

std::vector<Layer> layersOf(const Options& o) {
  std::vector<Layer> layers;
  const auto opOf = [](const std::string& name) {
    const OpSpec* spec = findOp(name);
    if (spec == nullptr || !plannedOp(spec->kind)) {
      throw UsageError(fmt::format("'{}' is not an op with plans; give ag-gemm, gemm-rs or gemm-ar", name));
    }
    return spec->kind;
  };
  const auto dt = dtypeNamed(o.dtype);
  if (!dt) throw UsageError(fmt::format("--dtype '{}' is not bf16, fp16 or fp32", o.dtype));
  if (!o.fromJson.empty()) {
    std::ifstream in(o.fromJson);
    if (!in) throw UsageError(fmt::format("--from-json: cannot read {}", o.fromJson));
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw UsageError(fmt::format("--from-json {}: not JSON ({})", o.fromJson, e.what()));
    }
    const json& list = j.is_object() && j.contains("layers") ? j["layers"] : j;
    if (!list.is_array() || list.empty()) {
      throw UsageError(fmt::format("--from-json {}: expected a list of layers, or {{\"layers\": [...]}}, each like "
                                   "{{\"name\": \"mlp.down\", \"op\": \"gemm-rs\", \"m\": 8192, \"n\": 8192, \"k\": 28672}}",
                                   o.fromJson));
    }
    std::size_t i = 0;
    for (const json& e : list) {
      const std::string where = fmt::format("--from-json {}: layer {}", o.fromJson, i++);
      if (!e.is_object() || !e.contains("op") || !e["op"].is_string()) throw UsageError(where + ": \"op\" is missing");
      Layer l;
      l.op = opOf(e["op"].get<std::string>());
      for (const char* key : {"m", "n", "k"}) {
        if (!e.contains(key) || !e[key].is_number_unsigned() || e[key].get<uint64_t>() == 0) {
          throw UsageError(fmt::format("{}: \"{}\" is missing or not a positive integer", where, key));
        }
      }
      l.m = e["m"].get<uint64_t>();
      l.n = e["n"].get<uint64_t>();
      l.k = e["k"].get<uint64_t>();
      const auto ldt = dtypeNamed(e.value("dtype", o.dtype));
      if (!ldt) throw UsageError(where + ": dtype is not bf16, fp16 or fp32");
      l.dtype = *ldt;
      l.name = e.value("name", fmt::format("{} {}", opKindName(l.op), shapeText(l)));
      layers.push_back(l);
    }
    return layers;
  }
  if (o.shapes.empty()) {
    throw UsageError("give the shapes to measure: --shape MxNxK (repeatable, e.g. --shape 8192x8192x8192) or "
                     "--from-json layers.json");
  }
  std::vector<OpKind> ops;
  for (const auto& item : o.ops) {
    std::size_t pos = 0;
    while (pos <= item.size()) {
      const std::size_t comma = std::min(item.find(',', pos), item.size());
      ops.push_back(opOf(item.substr(pos, comma - pos)));
      pos = comma + 1;
    }
  }
  if (ops.empty()) ops = {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr};
  for (OpKind op : ops) {
    for (const auto& s : o.shapes) {
      const auto x1 = s.find('x'), x2 = s.find('x', x1 == std::string::npos ? x1 : x1 + 1);
      if (x1 == std::string::npos || x2 == std::string::npos) {
        throw UsageError(fmt::format("--shape '{}' is not MxNxK (e.g. 8192x8192x8192)", s));
      }
      Layer l;
      l.op = op;
      l.m = parseDim(s.substr(0, x1), "--shape M");
      l.n = parseDim(s.substr(x1 + 1, x2 - x1 - 1), "--shape N");
      l.k = parseDim(s.substr(x2 + 1), "--shape K");
      l.dtype = *dt;
      l.name = fmt::format("{} {}", opKindName(op), shapeText(l));
      layers.push_back(l);
    }
  }
  return layers;
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
      tandem_ag_gemm_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], {nullptr, 0}, nullptr};
      return tandem_ag_gemm(comm, &a, op);
    }
    case OpKind::kGemmRs: {
      tandem_gemm_rs_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], nullptr};
      return tandem_gemm_rs(comm, &a, op);
    }
    case OpKind::kGemmAr: {
      tandem_gemm_ar_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], nullptr};
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
    json out{{"name", l.name}, {"op", std::string(opKindName(l.op))}, {"m", l.m}, {"n", l.n}, {"k", l.k},
             {"dtype", std::string(dtypeName(l.dtype))}, {"ranks", o_.ranks}};
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

// Runs every layer on every rank (rank r > 0 in forked children); returns rank 0's report.
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
        report["layers"].push_back({{"name", l.name}, {"op", std::string(opKindName(l.op))}, {"m", l.m}, {"n", l.n},
                                    {"k", l.k}, {"dtype", std::string(dtypeName(l.dtype))}, {"misfit", l.misfit}});
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

std::optional<double> num(const json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_number()) return std::nullopt;
  return j[key].get<double>();
}

std::string us(std::optional<double> v) { return v ? fmt::format("{:.1f}", *v) : std::string("-"); }

// The four questions, in plain words, from the measurements.
json answers(const json& report, uint32_t ranks) {
  std::vector<std::string> overlap, bottleneck, sms, patterns;
  const json& link = report["link"];
  int fit = 0, total = 0, fusedWins = 0;
  for (const json& l : report["layers"]) {
    ++total;
    const std::string name = l["name"].get<std::string>();
    if (l.contains("misfit")) {
      patterns.push_back(fmt::format("{}: does not fit the fused kernels: {}.", name, l["misfit"].get<std::string>()));
      continue;
    }
    ++fit;
    const auto alone = num(l, "gemm_alone_us"), base = num(l, "baseline_us");
    const json best = l.contains("best") ? l["best"] : json();
    std::optional<double> bestUs;
    if (best.is_object()) bestUs = best["us"].get<double>();
    const uint64_t tiles = ((l["m"].get<uint64_t>() + 127) / 128) * ((l["n"].get<uint64_t>() + 255) / 256);
    std::optional<double> bestFusedUs;
    for (const json& f : l["fused"]) {
      if (f["us"].is_number() && (!bestFusedUs || f["us"].get<double>() < *bestFusedUs)) bestFusedUs = f["us"].get<double>();
    }
    if (ranks == 1) {
      overlap.push_back(fmt::format("{}: one rank has nothing to overlap; the op is the GEMM ({} us){}.", name,
                                    us(alone), bestFusedUs && alone
                                                   ? fmt::format(", the fused kernel forced on it {:.2f}x of that",
                                                                 *bestFusedUs / *alone)
                                                   : std::string()));
    } else if (alone && base && bestUs) {
      const double hidden = *base > *alone ? (*base - *bestUs) / (*base - *alone) : 0.0;
      overlap.push_back(fmt::format(
          "{}: {} output tile{}; the best plan ({}) takes {:.1f} us against {:.1f} us unfused and {:.1f} us for the "
          "GEMM alone, so it hides {:.0f}% of the communication{}.",
          name, tiles, tiles == 1 ? "" : "s", best["kind"].get<std::string>() == "fused"
                           ? fmt::format("fused, {} comm SMs", best["comm_sms"].get<uint32_t>())
                           : std::string("decomposed"),
          *bestUs, *base, *alone, std::clamp(hidden, 0.0, 1.0) * 100,
          tiles < 264 ? " (fewer than two waves of tiles on 132 SMs: little room to overlap at tile granularity)"
                      : ""));
    }
    if (best.is_object() && best["kind"] == "fused") ++fusedWins;
    // SMs for communication: the sweep's fastest split against the one with none (or the smallest).
    const json& f = l["fused"];
    std::optional<std::pair<uint32_t, double>> fastest, fewest;
    for (const json& p : f) {
      if (!p["us"].is_number()) continue;
      const auto cand = std::make_pair(p["comm_sms"].get<uint32_t>(), p["us"].get<double>());
      if (!fastest || cand.second < fastest->second) fastest = cand;
      if (!fewest || cand.first < fewest->first) fewest = cand;
    }
    if (fastest && fewest && fastest->first != fewest->first) {
      sms.push_back(fmt::format("{}: yes, {} comm SMs ran {:.1f} us against {:.1f} us with {} ({:.1f}% shorter).", name,
                                fastest->first, fastest->second, fewest->second, fewest->first,
                                (1 - fastest->second / fewest->second) * 100));
    } else if (fastest) {
      sms.push_back(fmt::format("{}: no, the fewest comm SMs measured ({}) were the fastest ({:.1f} us); more SMs for "
                                "communication only take them from the GEMM.", name, fastest->first, fastest->second));
    }
    // Bottleneck: the bytes this op moves per rank at the measured link bandwidth, against the GEMM alone.
    if (ranks > 1 && link.contains("gb_per_s") && alone) {
      const double m = l["m"].get<double>(), n = l["n"].get<double>(), k = l["k"].get<double>();
      const double bytes = l["op"] == "ag-gemm" ? m * k * 2 * (ranks - 1) / ranks
                                                : m * n * 2 * (ranks - 1) / ranks * (l["op"] == "gemm-ar" ? 2 : 1);
      const double commUs = bytes / (link["gb_per_s"].get<double>() * 1e3);
      bottleneck.push_back(fmt::format("{}: it moves {:.1f} MiB per rank, {:.1f} us at the measured {:.1f} GB/s, against "
                                       "{:.1f} us of GEMM: {}.", name, bytes / (1 << 20), commUs,
                                       link["gb_per_s"].get<double>(), *alone,
                                       commUs > *alone ? "the link is the bottleneck (communication-bound)"
                                                       : "compute-bound; the link keeps up"));
    }
  }
  if (ranks == 1) {
    bottleneck.push_back("One rank: no link is used. Run with --ranks N (one GPU each) to measure NVLink; a node's "
                         "network enters only for communicators across nodes, which tandem stages through host memory.");
  } else {
    bottleneck.push_back("The network: this communicator is on one node, so only NVLink (or PCIe) carries it.");
  }
  if (report.value("gpu", std::string()) == "cpu") {
    sms.insert(sms.begin(), "This tandemd runs the cpu backend, where plans do not change how an op runs: these "
                            "differences are noise. Run advise against a cuda tandemd for the GPUs' answer.");
  }
  patterns.insert(patterns.begin(),
                  fmt::format("{} of {} layers fit the fused ops; the fused plan won for {} of them{}.", fit, total,
                              fusedWins, fit > fusedWins ? " (the others run best decomposed or as the GEMM alone: "
                                                           "with --save the plan table runs them that way)"
                                                         : ""));
  return {{"overlap", overlap}, {"bottleneck", bottleneck}, {"comm_sms", sms}, {"patterns", patterns}};
}

// Time against communication SMs, one panel per layer: the fused sweep (line), the GEMM alone (dashed, the overlap
// limit), the unfused baseline (dotted) and the decomposed plan (a square at x = 0).
std::string svgPlot(const json& report) {
  const auto& layers = report["layers"];
  const int cols = 3, panelW = 320, panelH = 220;
  const int n = static_cast<int>(layers.size());
  const int rows = std::max(1, (n + cols - 1) / cols);
  std::string s = fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
                              "font-family=\"sans-serif\" font-size=\"11\">\n", cols * panelW, rows * panelH + 30);
  s += fmt::format("<text x=\"10\" y=\"18\" font-size=\"14\">tandemctl advise: time per op (us) against communication "
                   "SMs on {} ({} executor)</text>\n", report.value("gpu", std::string()),
                   report.value("executor", std::string()));
  for (int i = 0; i < n; ++i) {
    const json& l = layers[i];
    const int x0 = (i % cols) * panelW + 50, y0 = (i / cols) * panelH + 40, w = panelW - 70, h = panelH - 60;
    std::vector<std::pair<double, double>> pts;
    for (const json& p : l.value("fused", json::array())) {
      if (p["us"].is_number()) pts.emplace_back(p["comm_sms"].get<double>(), p["us"].get<double>());
    }
    std::vector<double> ys;
    for (auto& [x, y] : pts) ys.push_back(y);
    for (const char* key : {"gemm_alone_us", "baseline_us", "decomposed_us"}) {
      if (auto v = num(l, key)) ys.push_back(*v);
    }
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0, y0 - 6, l["name"].get<std::string>());
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>\n", x0, y0, w, h);
    if (ys.empty()) {
      s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0 + 10, y0 + h / 2, l.contains("misfit") ? "does not fit" : "no data");
      continue;
    }
    double xmax = 32;
    for (auto& [x, y] : pts) xmax = std::max(xmax, x);
    const double ymin = 0, ymax = *std::max_element(ys.begin(), ys.end()) * 1.1;
    const auto X = [&](double x) { return x0 + x / xmax * w; };
    const auto Y = [&](double y) { return y0 + h - (y - ymin) / (ymax - ymin) * h; };
    for (int t = 0; t <= 4; ++t) {
      const double v = ymax * t / 4;
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0f}</text>\n", x0 - 4, Y(v) + 4, v);
      const double xs = xmax * t / 4;
      s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", X(xs), y0 + h + 14, xs);
    }
    const auto hline = [&](std::optional<double> v, const char* dash, const char* color, const char* label) {
      if (!v) return;
      s += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-dasharray=\"{}\"/>\n",
                       x0, x0 + w, Y(*v), Y(*v), color, dash);
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"{}\" text-anchor=\"end\">{}</text>\n", x0 + w - 2, Y(*v) - 3,
                       color, label);
    };
    hline(num(l, "gemm_alone_us"), "6,3", "#2a7", "GEMM alone");
    hline(num(l, "baseline_us"), "2,3", "#c33", "unfused");
    if (auto d = num(l, "decomposed_us")) {
      s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"6\" height=\"6\" fill=\"#e90\"><title>decomposed {:.1f} "
                       "us</title></rect>\n", X(0) - 3, Y(*d) - 3, *d);
    }
    if (!pts.empty()) {
      std::string poly;
      for (auto& [x, y] : pts) poly += fmt::format("{:.1f},{:.1f} ", X(x), Y(y));
      s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"#36c\" stroke-width=\"2\"/>\n", poly);
      for (auto& [x, y] : pts) {
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#36c\"><title>fused, {:.0f} comm SMs: "
                         "{:.1f} us</title></circle>\n", X(x), Y(y), x, y);
      }
    }
  }
  s += "</svg>\n";
  return s;
}

void printTable(const json& report) {
  std::printf("%-28s %-22s %11s %11s %11s %11s  %s\n", "layer", "bucket", "unfused", "GEMM alone", "decomposed",
              "best fused", "winner");
  for (const json& l : report["layers"]) {
    if (l.contains("misfit")) {
      std::printf("%-28s does not fit the fused kernels: %s\n", l["name"].get<std::string>().c_str(),
                  l["misfit"].get<std::string>().c_str());
      continue;
    }
    std::optional<double> bestFused;
    uint32_t bestSms = 0;
    for (const json& f : l["fused"]) {
      if (f["us"].is_number() && (!bestFused || f["us"].get<double>() < *bestFused)) {
        bestFused = f["us"].get<double>();
        bestSms = f["comm_sms"].get<uint32_t>();
      }
    }
    std::string winner = "-";
    if (l.contains("best")) {
      const json& b = l["best"];
      const uint32_t sms = b["comm_sms"].get<uint32_t>();
      winner = b["kind"] != "fused" ? std::string("decomposed")
               : sms == 0           ? std::string("fused, no comm SMs")
                                    : fmt::format("fused, {} comm SMs", sms);
      if (auto base = num(l, "baseline_us")) winner += fmt::format(" ({:.2f}x unfused)", *base / b["us"].get<double>());
    }
    std::printf("%-28s %-22s %11s %11s %11s %11s  %s\n", l["name"].get<std::string>().c_str(),
                l.value("bucket", std::string()).c_str(), us(num(l, "baseline_us")).c_str(),
                us(num(l, "gemm_alone_us")).c_str(), us(num(l, "decomposed_us")).c_str(),
                bestFused ? fmt::format("{:.1f}@{}", *bestFused, bestSms).c_str() : "-", winner.c_str());
    for (const json& e : l.value("errors", json::array())) {
      std::printf("    %s failed: %s\n", e["plan"].get<std::string>().c_str(), e["error"].get<std::string>().c_str());
    }
  }
}

// The winners as plan table entries (layers whose plans measured, on this node's GPU model and executor).
std::vector<v1::PlanEntry> winners(const json& report, const std::string& source) {
  std::map<std::string, v1::PlanEntry> byKey;  // one entry per key: the layer measured fastest for it wins
  for (const json& l : report["layers"]) {
    if (!l.contains("best")) continue;
    v1::PlanEntry e;
    e.set_op(l["op"].get<std::string>());
    e.set_dtype(l["dtype"].get<std::string>());
    e.set_ranks(l["ranks"].get<uint32_t>());
    e.set_bucket(l["bucket"].get<std::string>());
    e.set_gpu(report["gpu"].get<std::string>());
    e.set_executor(l["executor"].get<std::string>());
    e.set_kind(l["best"]["kind"].get<std::string>());
    e.set_comm_sms(l["best"]["comm_sms"].get<uint32_t>());
    e.set_time_us(l["best"]["us"].get<double>());
    if (auto b = num(l, "baseline_us")) e.set_baseline_us(*b);
    e.set_source(source);
    const std::string key = fmt::format("{}|{}|{}|{}", e.op(), e.dtype(), e.ranks(), e.bucket());
    byKey.insert_or_assign(key, e);
  }
  std::vector<v1::PlanEntry> out;
  for (auto& [k, e] : byKey) out.push_back(e);
  return out;
}

void saveWinners(const std::string& socket, const std::vector<v1::PlanEntry>& entries) {
  if (entries.empty()) return;
  auto session = client::Session::connect(socket.empty() ? defaultSocketPath(true) : socket);
  v1::Request request;
  auto* sp = request.mutable_set_plan();
  for (const auto& e : entries) *sp->add_entries() = e;
  sp->set_save(true);
  session->call(request);
}

int runAdvise(const std::string& socket, const Options& o, bool tune) {
  std::vector<Layer> layers = layersOf(o);
  for (auto& l : layers) l.misfit = misfitOf(l, o.ranks);
  if (o.iters == 0) throw UsageError("--iters must be at least 1");
  const auto t0 = Clock::now();
  json report = measureAll(socket, o, layers, !o.json || tune);
  report["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  report["ranks"] = o.ranks;
  const auto entries = winners(report, tune ? "tune" : "advise");
  if (tune || o.save) {
    saveWinners(socket, entries);
    report["saved"] = entries.size();
  }
  if (tune) {
    if (o.json) {
      std::cout << report.dump(2) << std::endl;
    } else {
      printTable(report);
      std::printf("tune: %zu plan%s saved into tandemd's plan table in %.1f s (tandemctl status shows it)\n",
                  entries.size(), entries.size() == 1 ? "" : "s", report["seconds"].get<double>());
    }
    return 0;
  }
  report["answers"] = answers(report, o.ranks);
  const std::string svgPath = o.svg.empty() ? std::string("tandem-advise.svg") : o.svg;
  {
    std::ofstream out(svgPath);
    out << svgPlot(report);
    if (!out) throw std::runtime_error(fmt::format("writing the plot to {} failed; pass --svg PATH", svgPath));
  }
  report["svg"] = svgPath;
  if (!o.jsonFile.empty()) {
    std::ofstream out(o.jsonFile);
    out << report.dump(2) << "\n";
    if (!out) throw std::runtime_error(fmt::format("writing the report to {} failed; pass another --json-file", o.jsonFile));
  }
  if (o.json) {
    std::cout << report.dump(2) << std::endl;
    return 0;
  }
  std::printf("tandemctl advise: %s, executor %s, %u rank%s, %zu layer%s measured in %.1f s (times in us per op)\n\n",
              report["gpu"].get<std::string>().c_str(), report["executor"].get<std::string>().c_str(), o.ranks,
              o.ranks == 1 ? "" : "s", layers.size(), layers.size() == 1 ? "" : "s", report["seconds"].get<double>());
  printTable(report);
  const json& link = report["link"];
  if (link.contains("gb_per_s")) {
    std::printf("\nlink: an all-gather of %.0f MiB per rank took %.1f us: %.1f GB/s received per rank\n",
                link["bytes_per_rank"].get<double>() / (1 << 20), link["us"].get<double>(),
                link["gb_per_s"].get<double>());
  }
  const json& a = report["answers"];
  const auto section = [&](const char* question, const char* key) {
    std::printf("\n%s\n", question);
    for (const auto& line : a[key]) std::printf("  - %s\n", line.get<std::string>().c_str());
  };
  section("Can my shapes overlap at tile granularity?", "overlap");
  section("Do NVLink and the network both bottleneck?", "bottleneck");
  section("Does giving SMs to communication shorten the pipeline?", "comm_sms");
  section("Do my model's patterns match the fused ops?", "patterns");
  std::printf("\nplot: %s (time against communication SMs)%s\n", svgPath.c_str(),
              o.save ? fmt::format("; {} winner{} saved into the plan table", entries.size(),
                                   entries.size() == 1 ? "" : "s").c_str()
                     : "; --save writes the winners into the plan table");
  return 0;
}

void addOptions(CLI::App* cmd, Options& o, bool tune) {
  cmd->add_option("ops", o.ops, "ag-gemm, gemm-rs, gemm-ar (comma-separated or repeated; default all three)");
  cmd->add_option("--shape", o.shapes, "MxNxK, global sizes as `tandemctl run` takes them (repeatable)");
  cmd->add_option("--from-json", o.fromJson,
                  "a model's layers: [{\"name\": ..., \"op\": \"gemm-rs\", \"m\": ..., \"n\": ..., \"k\": ..., "
                  "\"dtype\": \"bf16\"}, ...] (or {\"layers\": [...]})");
  cmd->add_option("--dtype", o.dtype, "bf16 | fp16 | fp32 (for --shape)");
  cmd->add_option("-r,--ranks", o.ranks, "ranks of the measuring communicator, one process and GPU each")
      ->check(CLI::Range(1, 8));
  cmd->add_option("--sms", o.sms, "communication SM counts of the fused sweep (default 8 16 32)");
  cmd->add_option("--iters", o.iters, "timed ops per plan")->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", o.warmup, "untimed ops per plan first")->check(CLI::Range(0, 1000));
  cmd->add_option("--timeout-ms", o.timeoutMs, "per-op and rendezvous timeout");
  cmd->add_flag("--json", o.json, "print the measurements (and the answers) as JSON");
  if (!tune) {
    cmd->add_flag("--save", o.save, "write the winners into tandemd's plan table");
    cmd->add_option("--svg", o.svg, "where to write the plot (default tandem-advise.svg)");
    cmd->add_option("--json-file", o.jsonFile, "also write the JSON report (--json's) to this file");
  }
}

}  // namespace

void addPlanCommands(CLI::App& app) {
  gAdviseCmd = app.add_subcommand(
      "advise",
      "measure, on this node, how your shapes run: unfused, decomposed, fused at several SM splits, the GEMM alone\n"
      "(the overlap limit) and the link bandwidth; answers whether they overlap, what bottlenecks, whether SMs for\n"
      "communication help and whether your layers fit the fused ops; a table, an SVG plot, --json, --save. E.g.\n"
      "  tandemctl advise gemm-rs --shape 8192x8192x8192 --shape 16384x8192x14336\n"
      "  tandemctl advise --from-json layers.json --ranks 2 --save");
  addOptions(gAdviseCmd, gAdvise, false);
  gTuneCmd = app.add_subcommand("tune", "measure every plan of the given shapes and save the fastest into tandemd's "
                                        "plan table (advise without the advice)");
  addOptions(gTuneCmd, gTune, true);
}

std::optional<int> runPlanCommands(const std::string& socket) {
  const bool advise = gAdviseCmd != nullptr && gAdviseCmd->parsed();
  const bool tune = gTuneCmd != nullptr && gTuneCmd->parsed();
  if (!advise && !tune) return std::nullopt;
  const char* name = advise ? "advise" : "tune";
  try {
    return runAdvise(socket, advise ? gAdvise : gTune, tune);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tandemctl %s: %s\nRun with --help for more information.\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandemctl %s: %s\n", name, e.what());
    return 1;
  }
}

void printPlanStatus(const v1::StatusReply& r) {
  if (!r.has_plans()) return;
  const auto& p = r.plans();
  std::printf("plan table: %s  (%s; autotune %s)\n", p.path().empty() ? "in memory" : p.path().c_str(),
              p.state().c_str(), p.autotune().c_str());
  std::printf("  fingerprint: %s; %d entr%s%s\n", p.fingerprint().c_str(), p.entries_size(),
              p.entries_size() == 1 ? "y" : "ies",
              p.trials() > 0 ? fmt::format(", {} trial plans", p.trials()).c_str() : "");
  for (const auto& e : p.entries()) {
    std::string plan = e.kind() + (e.comm_sms() != 0 ? fmt::format(", {} comm SMs", e.comm_sms()) : std::string());
    std::string measured = e.time_us() > 0 ? fmt::format("{:.1f} us", e.time_us()) : std::string();
    if (e.baseline_us() > 0 && e.time_us() > 0) measured += fmt::format(" ({:.2f}x unfused)", e.baseline_us() / e.time_us());
    std::printf("  %-8s %-4s %2u rank%s %-22s %-10s %-7s -> %-22s %s  [%s %s]\n", e.op().c_str(), e.dtype().c_str(),
                e.ranks(), e.ranks() == 1 ? " " : "s", e.bucket().c_str(), e.gpu().c_str(), e.executor().c_str(),
                plan.c_str(), measured.c_str(), e.source().c_str(), e.saved_at().c_str());
  }
}

json planStatusJson(const v1::StatusReply& r) {
  if (!r.has_plans()) return nullptr;
  const auto& p = r.plans();
  json entries = json::array();
  for (const auto& e : p.entries()) {
    entries.push_back({{"op", e.op()}, {"dtype", e.dtype()}, {"ranks", e.ranks()}, {"bucket", e.bucket()},
                       {"gpu", e.gpu()}, {"executor", e.executor()}, {"kind", e.kind()}, {"comm_sms", e.comm_sms()},
                       {"chunk_bytes", e.chunk_bytes()}, {"time_us", e.time_us()}, {"baseline_us", e.baseline_us()},
                       {"source", e.source()}, {"saved_at", e.saved_at()}});
  }
  return {{"path", p.path()}, {"fingerprint", p.fingerprint()}, {"state", p.state()}, {"autotune", p.autotune()},
          {"gpu", p.gpu()}, {"trials", p.trials()}, {"entries", entries}};
}

}  // namespace tandem::ctl
