// The three executor strategies: how one communicator's ops reach the GPU. tandemd picks one per communicator when it
// sets the communicator up and names it in the join reply (JoinInfo.executor); libtandem takes the same strategy on
// its side. Both refuse the ops a strategy does not run: tandemd when a descriptor is admitted, libtandem before it
// submits one.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "tandem/common/op_spec.hpp"
#include "tandem/kernels/gpu_ops.hpp"

namespace tandem::kernels {

enum class Executor {
  // client-gate: libtandem launches the op's kernels into the caller's stream, behind a gate tandemd opens once every
  // rank submitted the op (go, verdict); the stream reports done.
  kClient,
  // persistent: tandemd runs the op in its own context (one persistent kernel per GPU, or its own stream for the fused
  // GEMMs); the caller's stream writes ready and waits for done. Needs MPS.
  kDaemon,
  // host-staged: the ranks live on several nodes; tandemd runs the op itself, the exchange between nodes staged through
  // host memory, between the stream's ready and done (as kDaemon). No client-mapped workspaces.
  kHost,
};

/// The wire name: "client", "daemon" or "host".
inline const char* executorName(Executor e) {
  switch (e) {
    case Executor::kClient: return "client";
    case Executor::kDaemon: return "daemon";
    case Executor::kHost: return "host";
  }
  return "unknown";
}

/// The strategy a wire name names; nullopt for any other text.
inline std::optional<Executor> executorFromName(std::string_view name) {
  if (name == "client") return Executor::kClient;
  if (name == "daemon") return Executor::kDaemon;
  if (name == "host") return Executor::kHost;
  return std::nullopt;
}

/// The ops a strategy runs. The client and daemon executors run every op with an entry in gpu_ops.cpp (they launch the
/// same kernels), the client executor less those whose entry names a clientPending; host staging runs the fused GEMMs, AllGather and barriers in tandemd, on the GPUs or through the
/// cpu backend's code (tandemd's cuda_multinode.hpp): it has no MoE or attention code.
inline OpSet executorOps(Executor e) {
  switch (e) {
    case Executor::kClient:
    case Executor::kDaemon: {
      OpSet s;
      for (const OpSpec& op : ops()) {
        const GpuOp* entry = findGpuOp(op.kind);
        if (entry != nullptr && (e == Executor::kDaemon || entry->clientPending == nullptr)) s.add(op.kind);
      }
      return s;
    }
    case Executor::kHost: return {OpKind::kAgGemm, OpKind::kGemmRs, OpKind::kGemmAr, OpKind::kAllGather, OpKind::kNop};
  }
  return {};
}

/// Why strategy `e` refuses `kind`: unsupportedOpMessage, plus the entry's clientPending where the client executor
/// lacks an op the daemon executor runs.
inline std::string executorRefusal(Executor e, OpKind kind) {
  std::string m = unsupportedOpMessage("cuda", executorOps(e), kind);
  const GpuOp* entry = e == Executor::kClient ? findGpuOp(kind) : nullptr;
  if (entry != nullptr && entry->clientPending != nullptr) {
    m += ". With the client executor: ";
    m += entry->clientPending;
  }
  return m;
}

}  // namespace tandem::kernels
