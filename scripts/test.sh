#!/usr/bin/env bash
# The whole test suite from a fresh machine: install what is missing, build, run every test with CTest.
# GPU and RDMA tests report Skipped (exit 77) on machines without the hardware.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 300
