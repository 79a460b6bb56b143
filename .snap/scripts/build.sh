#!/usr/bin/env bash
# Configures and builds tandem into ${BUILD_DIR:-build} (RelWithDebInfo unless BUILD_TYPE says otherwise): every
# target, or only the TARGETs named (and what they link).
#   scripts/build.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
# shellcheck disable=SC2086  # CMAKE_ARGS holds several -D options
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" ${1:+--target "$@"}
