// Fused GEMM + ReduceScatter over NVLink: the kernels (fused persistent kernel, decomposed reduction kernel), the plan
// choice and the launcher. Device code: device/gemm_rs_sm90.cuh; host glue shared with gemm_ar.cu:
// gemm_rs_launch.cuh; design: tandem/kernels/gemm_rs.hpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "gemm_rs_launch.cuh"
#include "device/gemm_rs_sm90.cuh"
#include "tandem/kernels/gemm_rs.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::kernels {
namespace rs {
namespace {

// Roles from the role table: reduce, send, compute (one CTA per SM, all co-resident).
template <class T, class P, bool BMn>
__global__ void __launch_bounds__(gemm::kThreads, 1) gemmRsFusedKernel(const __grid_constant__ FusedKernelParams kp) {
  extern __shared__ uint8_t smemRaw[];
  runFusedCta<T, P, BMn>(kp, smemRaw);
}

// Decomposed plan: runs after the GEMM core wrote this rank's bf16 partial into its outbox.
template <class T, class P>
__global__ void __launch_bounds__(kThreads, 1) gemmRsReduceKernel(const __grid_constant__ FusedKernelParams kp) {
  runDecomposedReduce<T, P>(kp);
}

const KernelTable& kernels() {
  static const KernelTable kt = {
      {{{&gemmRsFusedKernel<__nv_bfloat16, float, false>, &gemmRsFusedKernel<__nv_bfloat16, float, true>},
        {&gemmRsFusedKernel<__nv_bfloat16, __nv_bfloat16, false>, &gemmRsFusedKernel<__nv_bfloat16, __nv_bfloat16, true>}},
       {{&gemmRsFusedKernel<__half, float, false>, &gemmRsFusedKernel<__half, float, true>},
        {&gemmRsFusedKernel<__half, __half, false>, &gemmRsFusedKernel<__half, __half, true>}}},
      {&gemmRsReduceKernel<__nv_bfloat16, __nv_bfloat16>, &gemmRsReduceKernel<__half, __half>},
      {&gemmRsReduceKernel<__nv_bfloat16, float>, &gemmRsReduceKernel<float, float>}};
  return kt;
}

constexpr const char* kOp = "gemm_rs";

}  // namespace
}  // namespace rs

size_t gemmRsWorkspaceBytes(int64_t maxM, int64_t maxN, int nranks) { return rs::layoutFor(maxM, maxN, nranks).total; }
size_t gemmRsFixedWorkspaceBytes(int64_t matBytes, int nranks) { return rs::layoutFixed(matBytes, nranks).total; }
size_t gemmRsFixedFlagsBytes(int64_t matBytes, int nranks) { return rs::layoutFixed(matBytes, nranks).stagingOff; }

const char* gemmRsPlanName(const GemmRsPlan& plan, bool allReduce) {
  thread_local std::string name;
  name = rs::planName(plan, allReduce);
  return name.c_str();
}

// Measured on nvidia-h200-x2 (bench/RESULTS.md, "Fused GEMM+ReduceScatter and GEMM+AllReduce", every plan timed at
// every benchmark shape in one call): fused/copy/bf16/epi on all 132 SMs is the fastest plan at M = 1024 ... 16384
// (N = 8192 / 14336, K_total = 8192), ahead of the best decomposed plan by 1.14-1.23x; reduce or send CTAs (8-16 SMs)
// and fp32 partials were slower everywhere. One rank: the GEMM core alone (plainGemmPlan).
GemmRsPlan chooseGemmRsPlan(int64_t m, int64_t n, int64_t k, int nranks, GemmDtype dtype) {
  (void)m;
  (void)n;
  (void)k;
  (void)dtype;
  return nranks == 1 ? rs::plainGemmPlan() : rs::fusedCopyPlan();
}

void preloadGemmRsKernels(int device) { rs::preloadTable(device, rs::kernels(), rs::kOp); }

GemmRsPlan launchGemmRs(const GemmRsParams& params, cudaStream_t stream) {
  return rs::launchFamily(rs::kOp, rs::kernels(), params,
                          chooseGemmRsPlan(params.m, params.n, params.k, params.nranks, params.dtype), false, stream);
}

}  // namespace tandem::kernels
