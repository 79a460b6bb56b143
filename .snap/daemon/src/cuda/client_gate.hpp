// executor: client (client-gate). libtandem launches each op's kernels into the caller's stream; tandemd validates
// every collective and opens each rank's gate through its control page (ControlPage::publishVerdict: the verdict,
// then go) once every rank submitted the op, and, for gangs (kernels::needsGang), once every rank's stream reached it
// (ready). The stream writes done after the kernels; tandemd completes the op when it sees it.
#pragma once

#include "cuda/node_comm.hpp"

namespace tandem::daemon::cuda {

class ClientGateComm final : public NodeComm {
 public:
  using NodeComm::NodeComm;
  kernels::Executor executor() const override { return kernels::Executor::kClient; }

 private:
  bool needsReady(const Gang& g) const override;
  Release release(const std::shared_ptr<Gang>& g) override;
};

}  // namespace tandem::daemon::cuda
