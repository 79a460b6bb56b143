#include "launch_support.hpp"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "tandem/common/error.hpp"
#include "tandem/kernels/driver.hpp"

namespace tandem::kernels {

void checkCudaFor(const char* family, cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fail(ErrorCode::kCuda, "{}: {} failed [-> {}: {}]", family, what, cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

CUtensorMap cachedTensorMap(const char* family, const TensorMapKey& k, const char* what) {
  static TensorMapCache cache;
  CUtensorMap map;
  CUresult r = CUDA_SUCCESS;
  try {
    r = cache.get(k, &map);
  } catch (const std::runtime_error& e) {
    fail(ErrorCode::kCuda, "{}: {}", family, e.what());
  }
  if (r != CUDA_SUCCESS) {
    fail(ErrorCode::kCuda, "{}: cuTensorMapEncodeTiled failed for {} ({}-d, {}x{}x{}x{}) [-> {}]", family, what,
         k.rank, k.dims[0], k.dims[1], k.dims[2], k.dims[3], driverErrorName(r));
  }
  return map;
}

int prepareOnce(const char* family, int device, uint32_t variant, const std::function<cudaError_t()>& load) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, uint32_t>, int> smCounts;
  const auto key = std::make_tuple(std::string(family), device, variant);
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = smCounts.find(key); it != smCounts.end()) return it->second;
  int sms = 0, major = 0, minor = 0;
  checkCudaFor(family, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  checkCudaFor(family, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "cudaDeviceGetAttribute");
  checkCudaFor(family, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
               "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    fail(ErrorCode::kCuda,
         "{}: needs an sm_90 (Hopper) GPU: the kernels use wgmma and TMA; device {} is sm_{}{}. Run on an H100/H200",
         family, device, major, minor);
  }
  checkCudaFor(family, load(), "loading the kernel (cudaFuncSetAttribute)");
  smCounts.emplace(key, sms);
  return sms;
}

}  // namespace tandem::kernels
