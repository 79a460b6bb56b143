// backend: cpu. Host shared memory (sealed memfds), every op of the table on worker threads: the reference backend
// of CI and of machines without a GPU. Never presented as fast.
#pragma once

#include <memory>

#include "backend.hpp"
#include "config.hpp"

namespace tandem::daemon {

std::unique_ptr<Backend> makeCpuBackend(const DaemonConfig& config);

}  // namespace tandem::daemon
