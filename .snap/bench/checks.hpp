// Failure checks shared by the CUDA benchmarks: a failed call prints where and why, then the benchmark exits 2; a
// stream that fails or hangs ends the benchmark (syncOrDie) instead of eating the device lease.
// Include after the libraries' headers: TK (libtandem), NK (NCCL) and BK (cuBLAS) exist only where tandem/tandem.h,
// nccl.h and cublasLt.h came first.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#define CK(call)                                                                                     \
  do {                                                                                               \
    const cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)
#ifdef TANDEM_TANDEM_H_
#define TK(call)                                                                                     \
  do {                                                                                               \
    const tandem_status_t s_ = (call);                                                               \
    if (s_ != TANDEM_SUCCESS) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, tandem_last_error());        \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)
#endif
#ifdef NCCL_MAJOR
#define NK(call)                                                                                     \
  do {                                                                                               \
    const ncclResult_t r_ = (call);                                                                  \
    if (r_ != ncclSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_));     \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)
#endif
#ifdef CUBLAS_API_H_
#define BK(call)                                                                                     \
  do {                                                                                               \
    const cublasStatus_t b_ = (call);                                                                \
    if (b_ != CUBLAS_STATUS_SUCCESS) {                                                               \
      std::fprintf(stderr, "%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, static_cast<int>(b_)); \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)
#endif

namespace tandem::bench {

// Waits for `s`; a CUDA error exits 4, a stream still busy after `seconds` (a hung kernel) exits 3.
inline void syncOrDie(cudaStream_t s, double seconds, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "FAIL: %s: %s (%s)\n", what.c_str(), cudaGetErrorName(e), cudaGetErrorString(e));
      std::fflush(stdout);
      std::_Exit(4);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      std::fprintf(stderr, "FAIL: %s: still running after %.0f s (hang?)\n", what.c_str(), seconds);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Device-to-device copy bandwidth in GB/s, counting bytes read + written (1 GiB copied, median of 10 after 2 warm-ups):
// the ceiling of a weight-streaming GEMM, measured in the same run as what it bounds.
inline double copyBandwidthGBs(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemsetAsync(src, 1, bytes, s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e1, s));
    syncOrDie(s, 30, "copy");
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(src));
  CK(cudaFree(dst));
  std::sort(t.begin(), t.end());
  return 2.0 * double(bytes) / (t[t.size() / 2] * 1e-3) / 1e9;
}

}  // namespace tandem::bench
