// One rank on a host-memory backend (cpu): buffers are tandemd's shared memory mapped here, so inputs are filled and
// outputs checked in place; each op is timed from submission to completion on the host clock.
#include <fmt/format.h>

#include <array>
#include <chrono>
#include <vector>

#include "inputs.hpp"
#include "rank.hpp"

namespace tandem::ctl {

namespace {

// This rank's tensors: one tandem_alloc per non-empty slot, freed on every path out.
struct HostBuffers {
  std::vector<tandem_buffer_t> owned;
  std::array<tandem_tensor_t, kMaxOpBuffers> tensors{};
  std::array<std::byte*, kMaxOpBuffers> ptrs{};
  HostBuffers() = default;
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;
  ~HostBuffers() {
    for (tandem_buffer_t b : owned) tandem_free(b);
  }
};

}  // namespace

void runCpuRank(RankContext& ctx) {
  const RunOptions& o = ctx.o;
  const OpSpec& op = *o.op;
  ctx.join();
  HostBuffers buf;
  for (int s = 0; s < op.slotCount; ++s) {
    const auto i = static_cast<std::size_t>(s);
    const uint64_t bytes = ctx.desc.bufs[i].bytes;
    if (bytes == 0) continue;
    tandem_buffer_t b = nullptr;
    checkC(tandem_alloc(ctx.session, bytes, &b), fmt::format("allocate {} ({} bytes)", op.slots[i].name, bytes));
    buf.owned.push_back(b);
    buf.tensors[i] = {b, 0};
    buf.ptrs[i] = static_cast<std::byte*>(tandem_buffer_ptr(b));
  }
  fillHost(ctx.desc, buf.ptrs, o.seed);

  const uint64_t total = uint64_t{o.warmup} + o.iters;
  std::vector<double> samples;
  samples.reserve(o.iters);
  const std::span<const tandem_tensor_t> tensors(buf.tensors.data(), op.slotCount);
  for (uint64_t it = 0; it < total; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    tandem_op_t handle{};
    checkC(submit(ctx.comm, ctx.desc, tensors, nullptr, &handle), fmt::format("submit {} #{}", op.name, it + 1));
    checkC(tandem_wait(handle, o.timeoutMs), fmt::format("{} #{}", op.name, it + 1));
    if (it >= o.warmup) {
      samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    ctx.link.progress(it + 1, total);
  }
  putStats(ctx.result, "", samples);
  ctx.result["timing"] = "host clock, submission to completion";
  ctx.result["ok"] = true;
  if (o.compare) ctx.result["baseline_note"] = "the cpu backend has no baseline to compare with (NCCL and cuBLAS need GPUs)";
  if (o.check) {
    std::array<const std::byte*, kMaxOpBuffers> outputs{};
    std::copy(buf.ptrs.begin(), buf.ptrs.end(), outputs.begin());
    const reference::Comparison cmp = checkOnHost(ctx, outputs);
    ctx.result["check"] = cmp.ok;
    ctx.result["check_method"] = "fp64 host reference";
    ctx.result["rel_error"] = cmp.relError;
    ctx.result["tolerance"] = cmp.tolerance;
    if (!cmp.ok) {
      ctx.result["ok"] = false;
      ctx.result["message"] = cmp.detail;
    }
  }
}

}  // namespace tandem::ctl
