#!/usr/bin/env bash
# The whole test suite from a fresh machine: install what is missing, build, run every test with CTest, then run the
# tests labelled `asan` again in a small AddressSanitizer build.
# GPU and RDMA tests report Skipped (exit 77) on machines without the hardware.
#
# Environment: BUILD_DIR (build), JOBS (nproc), ASAN_BUILD_DIR (build-asan), TANDEM_ASAN=0 skips the ASan step.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${JOBS:-$(nproc)}"

# 1. The normal build and every test.
./scripts/install-deps.sh
./scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$jobs" --timeout 300

# 2. AddressSanitizer + UBSan (TANDEM_SANITIZE) for the tests that exist to catch memory errors: a use after free
#    crashes them, and LeakSanitizer fails them for memory they never release. To keep CI time small this is a
#    second build of host code only (no CUDA, no benchmarks, Debug: -O0 compiles fastest) that builds just the
#    targets those tests need, not the whole tree.
[[ "${TANDEM_ASAN:-1}" == 0 ]] && exit 0
asan_build="${ASAN_BUILD_DIR:-build-asan}"
# The test executables that hold tests labelled `asan` (LABELS in their CMakeLists.txt), and the tandemd and
# tandemctl they start. Add an executable here when you label its tests `asan`.
asan_targets=(tandemd tandemctl tandem_capi_lifetime_tests tandem_hostile_tests)
cmake -S . -B "$asan_build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=ON -DTANDEM_WITH_CUDA=OFF \
      -DTANDEM_BUILD_BENCH=OFF >/dev/null
cmake --build "$asan_build" -j "$jobs" --target "${asan_targets[@]}"
# UBSan only prints by default; halt so that undefined behaviour fails the test. Leak checking is ASan's default.
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# --no-tests=error: a label that matches nothing (a renamed target, a lost label) fails instead of passing silently.
ctest --test-dir "$asan_build" -L asan --no-tests=error --output-on-failure -j "$jobs" --timeout 300
