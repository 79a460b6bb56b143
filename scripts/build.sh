#!/usr/bin/env bash
# Configures and builds tandem into ${BUILD_DIR:-build} (RelWithDebInfo unless BUILD_TYPE says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}"
