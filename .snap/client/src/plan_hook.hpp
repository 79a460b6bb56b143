// Internal to tandem (tandemctl tune and advise), not part of the C ABI: what a client needs to measure plans on a
// communicator of its own. Declared here, defined in c_api.cpp.
#pragma once

#include <cstdint>

#include "tandem/common/plan_key.hpp"
#include "tandem/tandem.h"

namespace tandem::client {

// tandemd's handle of `comm` (SetPlan's comm_handle).
uint64_t commHandle(tandem_comm_t comm);
// The executor tandemd chose for `comm`: "client", "daemon", "host", or "cpu" on the cpu backend.
const char* commExecutor(tandem_comm_t comm);
// executor client: this rank launches ops of `key` with `plan` from now on (the other executors take trial plans from
// tandemd: SetPlan). Every rank of the communicator must set the same plan before its next op of that key.
void setCommPlan(tandem_comm_t comm, const PlanKey& key, const PlanChoice& plan);

}  // namespace tandem::client
