// One rank process of `tandemctl run`: what the cpu and cuda paths share.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "ctl.hpp"

namespace tandem::ctl {

using json = nlohmann::json;

// The rank's side of its pipes to the parent: one JSON object per line on stdout (events, then the result, which has
// no "event" key), one line per answer on stdin.
class ParentLink {
 public:
  void send(const json& line);
  // Blocks for the parent's next line. Throws when the parent is gone.
  std::string receive();
  // At most one progress line a second: iterations done of total.
  void progress(uint64_t done, uint64_t total);

 private:
  std::chrono::steady_clock::time_point lastProgress_{};
};

[[noreturn]] void throwStatus(tandem_status_t status, const std::string& what);
inline void checkC(tandem_status_t status, const std::string& what) {
  if (status != TANDEM_SUCCESS) throwStatus(status, what);
}

// Submits `desc` with one tensor per slot through libtandem's generic path (the same one every C entry point ends
// in), on `stream` (cuda backend; null otherwise).
tandem_status_t submit(tandem_comm_t comm, const OpDescriptor& desc, std::span<const tandem_tensor_t> tensors,
                       void* stream, tandem_op_t* op);

struct RankContext {
  RankContext(const RunOptions& options, uint32_t r) : o(options), rank(r) {}
  const RunOptions& o;
  uint32_t rank;
  tandem_session_t session = nullptr;
  tandem_comm_t comm = nullptr;
  OpDescriptor desc{};  // this rank's, from the op table (reference::makeDescriptor)
  ParentLink link;
  json result;
  // tandem_comm_init with the run's id; on GPUs after the rank picked its device.
  void join();
};

// min, p50 and p99 of `samples` (microseconds) as <prefix>min_us, <prefix>p50_us, <prefix>p99_us, plus the samples.
void putStats(json& out, const std::string& prefix, std::vector<double> samples);

// Host memory the host check of `rank` needs: every rank's input slots, the reference's doubles, this rank's expected
// outputs (the parent lets only as many checks run at once as its memory holds).
uint64_t hostCheckBytes(const RunOptions& o, uint32_t rank);

// Checks this rank's outputs (host memory, one pointer per slot; inputs may be null) against the fp64 reference, from
// every rank's inputs regenerated here. Waits for the parent's go first, and tells it when the memory is free again.
reference::Comparison checkOnHost(RankContext& ctx, std::span<const std::byte* const> outputs);

void runCpuRank(RankContext& ctx);
void runCudaRank(RankContext& ctx);  // throws Error(kUnsupported) in a build without CUDA

}  // namespace tandem::ctl
