// tandem_gpu_tests: exits 77 (skipped) when no CUDA device is visible. The probe runs in a child process so that
// this process never initialises CUDA: every rank is a forked child, and CUDA does not survive a fork.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
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
    std::printf("SKIPPED tandem_gpu_tests: no CUDA device (%s); run on a GPU host\n", why);
    return 77;
  }
  ::setenv("TANDEM_TEST_GPU_COUNT", std::to_string(count).c_str(), 1);
  doctest::Context context(argc, argv);
  return context.run();
}
