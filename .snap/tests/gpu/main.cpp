// The GPU test executables' main: exits 77 (skipped) when no CUDA device is visible. The probe runs in a child process
// so that this process never initialises CUDA: in the forking suites every rank is a forked child, and CUDA does not
// survive a fork. A case whose precondition is missing calls skipCase (skip.hpp); when every case that ran was
// skipped, the process exits 77 too, so that CTest reports the entry Skipped rather than Passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "skip.hpp"

namespace {

constexpr int kSkipped = 77;  // CTest SKIP_RETURN_CODE

// Cases started and cases skipped in this run; the case now running and whether it has skipped.
struct Tally {
  int started = 0;
  int skipped = 0;
  bool currentSkipped = false;
  std::string current;
} tally;

// Counts the cases doctest starts (after its filters) and the ones that skipped, once each whatever their subcases.
struct SkipListener : doctest::IReporter {
  explicit SkipListener(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    ++tally.started;
    tally.currentSkipped = false;
    tally.current = tc.m_name;
  }
  void test_case_end(const doctest::CurrentTestCaseStats&) override {
    if (tally.currentSkipped) ++tally.skipped;
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("gpu_skips", 1, SkipListener);

}  // namespace

void tandem::gputest::skipCase(const std::string& reason) {
  if (!tally.currentSkipped) {
    std::printf("SKIPPED case \"%s\": %s\n", tally.current.c_str(), reason.c_str());
    std::fflush(stdout);
  }
  tally.currentSkipped = true;
}

int main(int argc, char** argv) {
  const char* name = std::strrchr(argv[0], '/') != nullptr ? std::strrchr(argv[0], '/') + 1 : argv[0];
  int p[2];
  if (::pipe(p) != 0) return 1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    char msg[256];
    const int len = std::snprintf(msg, sizeof msg, "%d %s", e == cudaSuccess ? n : 0,
                                  e == cudaSuccess ? (n == 0 ? "no device visible" : "ok") : cudaGetErrorString(e));
    [[maybe_unused]] ssize_t w = ::write(p[1], msg, static_cast<size_t>(len));
    std::_Exit(0);
  }
  ::close(p[1]);
  char buf[256] = {};
  [[maybe_unused]] ssize_t r = ::read(p[0], buf, sizeof buf - 1);
  ::close(p[0]);
  ::waitpid(pid, nullptr, 0);
  int count = 0;
  std::sscanf(buf, "%d", &count);
  if (count <= 0) {
    const char* why = std::strchr(buf, ' ') != nullptr ? std::strchr(buf, ' ') + 1 : "probe failed";
    std::printf("SKIPPED %s: no CUDA device (%s); run on a GPU host\n", name, why);
    return kSkipped;
  }
  ::setenv("TANDEM_TEST_GPU_COUNT", std::to_string(count).c_str(), 1);
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit() || rc != 0) return rc;
  if (tally.started == 0) {
    // A CTest entry whose filter selects nothing would otherwise pass without running a check.
    std::printf("FAILED %s: no test case matched the filters\n", name);
    return 1;
  }
  if (tally.skipped == tally.started) {
    std::printf("SKIPPED %s: all %d selected case(s) skipped (reasons above)\n", name, tally.started);
    return kSkipped;
  }
  if (tally.skipped > 0) {
    std::printf("%s: %d of %d case(s) skipped (reasons above); the other %d ran\n", name, tally.skipped, tally.started,
                tally.started - tally.skipped);
  }
  return 0;
}
