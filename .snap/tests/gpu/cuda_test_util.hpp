// What the single-process GPU tests (a test that initialises CUDA itself) share: CUDA errors as doctest failures, a
// stream wait with a deadline, and owning device memory and streams.
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <thread>

namespace tandem::gputest {

inline void ck(cudaError_t e, const char* what) {
  // std::string: doctest prints a const char* as its address.
  REQUIRE_MESSAGE(e == cudaSuccess, std::string(what) << ": " << std::string(cudaGetErrorName(e)) << " ("
                                                      << std::string(cudaGetErrorString(e)) << ")");
}

// Waits for the stream with a deadline: a kernel that hangs fails the test instead of the whole run.
inline void syncWithin(cudaStream_t s, double seconds, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    REQUIRE_MESSAGE(e == cudaErrorNotReady, what << ": stream failed: " << std::string(cudaGetErrorName(e)) << " ("
                                                 << std::string(cudaGetErrorString(e)) << ")");
    REQUIRE_MESSAGE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds,
                    what << ": still running after " << seconds << " s (hang?)");
    std::this_thread::yield();
  }
}

struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(std::size_t bytes) { ck(cudaMalloc(&p, bytes == 0 ? 16 : bytes), "cudaMalloc"); }
  ~DeviceMem() { cudaFree(p); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

}  // namespace tandem::gputest
