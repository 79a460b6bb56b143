// One rank of `tandemctl run`, the part both backends share: the link to the parent, the generic submission, the
// statistics and the host check against the fp64 reference.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "inputs.hpp"
#include "rank.hpp"
#include "submit.hpp"
#include "tandem/common/error.hpp"

namespace tandem::ctl {

void ParentLink::send(const json& line) {
  const std::string text = line.dump() + "\n";
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

std::string ParentLink::receive() {
  std::string line;
  if (!std::getline(std::cin, line)) {
    throw std::runtime_error("the tandemctl parent closed this rank's input (it exited or was stopped)");
  }
  return line;
}

void ParentLink::progress(uint64_t done, uint64_t total) {
  const auto now = std::chrono::steady_clock::now();
  if (done < total && now - lastProgress_ < std::chrono::seconds(1)) return;
  lastProgress_ = now;
  send({{"event", "progress"}, {"done", done}, {"total", total}});
}

void throwStatus(tandem_status_t status, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {} ({})", what, tandem_last_error(), tandem_strerror(status)));
}

tandem_status_t submit(tandem_comm_t comm, const OpDescriptor& desc, std::span<const tandem_tensor_t> tensors,
                       void* stream, tandem_op_t* op) {
  return client::submitDescriptor(comm, desc, tensors, op, stream);
}

void RankContext::join() {
  const tandem_unique_id_t id = fromHex(o.idHex);
  checkC(tandem_comm_init(session, &id, o.ranks, rank, o.timeoutMs, &comm),
         fmt::format("join the communicator as rank {} of {} (tandem_comm_init)", rank, o.ranks));
}

void putStats(json& out, const std::string& prefix, std::vector<double> samples) {
  if (samples.empty()) return;
  std::sort(samples.begin(), samples.end());
  // Nearest rank: the smallest sample with at least q of them at or below it.
  const auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(samples.size())));
    return samples[std::min(samples.size() - 1, i == 0 ? 0 : i - 1)];
  };
  out[prefix + "min_us"] = samples.front();
  out[prefix + "p50_us"] = at(0.50);
  out[prefix + "p99_us"] = at(0.99);
  out[prefix + "samples_us"] = samples;
}

uint64_t hostCheckBytes(const RunOptions& o, uint32_t rank) {
  const OpSpec& op = *o.op;
  uint64_t bytes = 0;
  for (uint32_t r = 0; r < o.ranks; ++r) {
    const OpDescriptor d = reference::makeDescriptor(o.shape, r, o.ranks);
    for (int s = 0; s < op.slotCount; ++s) {
      const SlotSpec& sl = op.slots[static_cast<std::size_t>(s)];
      const uint64_t b = d.bufs[static_cast<std::size_t>(s)].bytes;
      const uint64_t elements = b / std::max<std::size_t>(1, slotElementSize(sl, d));
      if (!sl.output) bytes += b + 8 * elements;                // the inputs, and the reference's doubles of them
      if (sl.output && r == rank) bytes += b + 16 * elements;  // this rank's outputs, expected values as doubles
    }
  }
  return bytes;
}

namespace {

// Tells the parent that a check's memory is free again, however the check ends.
class CheckSlot {
 public:
  CheckSlot(ParentLink& link, uint64_t bytes) : link_(link) {
    link_.send({{"event", "check_wait"}, {"bytes", bytes}});
    const std::string answer = link_.receive();
    if (answer != "go") throw std::runtime_error("unexpected answer from the tandemctl parent: " + answer);
  }
  ~CheckSlot() {
    try {
      link_.send({{"event", "check_done"}});
    } catch (...) {
    }
  }
  CheckSlot(const CheckSlot&) = delete;
  CheckSlot& operator=(const CheckSlot&) = delete;

 private:
  ParentLink& link_;
};

}  // namespace

reference::Comparison checkOnHost(RankContext& ctx, std::span<const std::byte* const> outputs) {
  const RunOptions& o = ctx.o;
  const OpSpec& op = *o.op;
  const CheckSlot slot(ctx.link, hostCheckBytes(o, ctx.rank));
  // Every rank's inputs are a pure function of (seed, rank, ranks): regenerate them (also those of ranks on other
  // nodes), input slots only, and compute this rank's expected outputs alone.
  std::vector<OpDescriptor> descs;
  std::vector<std::vector<std::vector<std::byte>>> storage(o.ranks);
  std::vector<std::array<const std::byte*, kMaxOpBuffers>> inputs(o.ranks);
  for (uint32_t r = 0; r < o.ranks; ++r) {
    descs.push_back(reference::makeDescriptor(o.shape, r, o.ranks));
    storage[r].resize(kMaxOpBuffers);
    inputs[r].fill(nullptr);
    for (int s = 0; s < op.slotCount; ++s) {
      const auto i = static_cast<std::size_t>(s);
      if (op.slots[i].output || descs[r].bufs[i].bytes == 0) continue;
      storage[r][i].resize(descs[r].bufs[i].bytes);
      fillHostSlot(descs[r], s, storage[r][i].data(), o.seed);
      inputs[r][i] = storage[r][i].data();
    }
  }
  const auto expected = reference::computeRank(descs, inputs, ctx.rank);
  return reference::compareRank(ctx.desc, outputs, expected);
}

#ifndef TANDEM_HAVE_CUDA
void runCudaRank(RankContext&) {
  fail(ErrorCode::kUnsupported, "tandemd runs the cuda backend, but this tandemctl was built without CUDA (nvcc was "
       "not found when it was configured); rebuild tandem with the CUDA toolkit");
}
#endif

int runRank(const RunOptions& o, const std::string& socket) {
  RankContext ctx(o, static_cast<uint32_t>(o.rank));
  ctx.result = {{"rank", o.rank}, {"ok", false}};
  // If memory runs out, the kernel should pick a rank process, not tandemd (whose unit lowers its own score).
  if (const int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); fd >= 0) {
    [[maybe_unused]] const ssize_t n = ::write(fd, "500", 3);
    ::close(fd);
  }
  try {
    checkC(tandem_connect(socket.c_str(), &ctx.session), "connect to tandemd");
    ctx.desc = reference::makeDescriptor(o.shape, ctx.rank, o.ranks);
    const std::string backend = tandem_session_backend(ctx.session);
    ctx.result["backend"] = backend;
    if (backend == "cuda") {
      runCudaRank(ctx);
    } else {
      runCpuRank(ctx);
    }
  } catch (const std::exception& e) {
    ctx.result["ok"] = false;
    ctx.result["message"] = e.what();
  }
  if (ctx.comm != nullptr) tandem_comm_destroy(ctx.comm);
  if (ctx.session != nullptr) tandem_disconnect(ctx.session);
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) == 0) ctx.result["max_rss_kib"] = usage.ru_maxrss;
  ctx.link.send(ctx.result);
  return ctx.result["ok"].get<bool>() ? kExitOk : kExitFailed;
}

}  // namespace tandem::ctl
