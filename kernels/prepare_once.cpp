#include "prepare_once.hpp"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "tandem/common/error.hpp"

namespace tandem::kernels {

int prepareOnce(const char* family, int device, uint32_t variant, const std::function<cudaError_t()>& load) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, uint32_t>, int> smCounts;
  const auto key = std::make_tuple(std::string(family), device, variant);
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = smCounts.find(key); it != smCounts.end()) return it->second;
  const auto check = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
      fail(ErrorCode::kCuda, "{}: {} failed [-> {}: {}]", family, what, cudaGetErrorName(e), cudaGetErrorString(e));
    }
  };
  int sms = 0, major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    fail(ErrorCode::kCuda,
         "{}: needs an sm_90 (Hopper) GPU: the kernels use wgmma and TMA; device {} is sm_{}{}. Run on an H100/H200",
         family, device, major, minor);
  }
  check(load(), "loading the kernel (cudaFuncSetAttribute)");
  smCounts.emplace(key, sms);
  return sms;
}

}  // namespace tandem::kernels
