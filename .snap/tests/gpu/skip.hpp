// A GPU test case whose precondition is missing (MPS running, or not running) reports itself skipped instead of
// passing without its checks: it calls skipCase(reason) and returns. main.cpp prints the reason, and exits 77 (CTest:
// Skipped) when every case it ran was skipped. CTest runs the cases of each precondition as an entry of their own
// (doctest test suites, tests/gpu/CMakeLists.txt), so a missing precondition shows as a Skipped entry with the reason,
// never inside a Passed one.
#pragma once

#include <string>

namespace tandem::gputest {

// Doctest test suites of the cases with a precondition; tandem_add_gpu_test (CMakeLists.txt) names the same ones.
inline constexpr const char* kNeedsMps = "mps";       // the daemon executor (one persistent kernel per GPU under MPS)
inline constexpr const char* kNeedsNoMps = "no_mps";  // a kill mid-kernel, or the refusal without MPS
inline constexpr const char* kNeedsMpsTwoGpus = "mps_two_gpus";  // the daemon executor with 2 ranks: one per GPU

// Records the running case as skipped and prints why (once per case, whatever its subcases). The caller returns.
void skipCase(const std::string& reason);

}  // namespace tandem::gputest
