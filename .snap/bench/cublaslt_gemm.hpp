// The baseline GEMM of every CUDA benchmark: cuBLASLt C = A·Bᵀ with row-major A [m, k], B [n, k], C [m, n] (the
// tandem kernels' layout; "TN" in cuBLAS's column-major terms), bf16 in and out, fp32 accumulation, the heuristic's
// first algorithm for the given workspace; or FP8 in (LtFp8), bf16 or fp32 out. Header-only; include after
// <cublasLt.h> is on the include path.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tandem::bench {

inline void ltCheck(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS error %d: %s\n", static_cast<int>(s), what);
    std::_Exit(2);  // benchmarks exit 2 on a setup failure; _Exit skips NCCL/CUDA teardown that may hang
  }
}

// FP8 operands of an LtGemm: A [m, k] and B [n, k] K-major (the only form cuBLASLt's FP8 kernels take on Hopper), fp32
// scales in device memory as tandem takes them (tandem.h, tandem_fp8_scaling_t): per tensor one float each; block
// (`block`) A's 1x128 scales [ceil(k/128), m] M-major and B's 128x128 scales [ceil(n/128), ceil(k/128)], which are
// cuBLASLt's VEC128_32F and BLK128x128_32F layouts (cuBLAS 12.9+, sm_90). fastAccum: no promotion of the tensor cores'
// accumulator (CUBLASLT_MATMUL_DESC_FAST_ACCUM); cuBLASLt takes it per tensor only.
struct LtFp8 {
  cudaDataType_t ab = CUDA_R_8F_E4M3;  // A's and B's type
  cudaDataType_t c = CUDA_R_16BF;      // CUDA_R_16BF or CUDA_R_32F
  bool block = false;
  const float* aScale = nullptr;
  const float* bScale = nullptr;
  bool fastAccum = false;
};

struct LtGemm {
  cublasLtHandle_t handle{};
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulAlgo_t algo{};
  void* ws = nullptr;
  size_t wsSize = 0;
  // FP8 only: false when this cuBLASLt has no algorithm for the operands (`why` says why; run() must not be called).
  // The 16-bit constructors exit 2 instead.
  bool available = true;
  std::string why;

  // Packed operands: lda = ldb = k, ldc = n.
  LtGemm(cublasLtHandle_t h, int64_t m, int64_t n, int64_t k, void* workspace, size_t workspaceSize)
      : LtGemm(h, m, n, k, k, k, n, workspace, workspaceSize) {}
  // Packed operands in another layout: aKM stores A [k, m] (else [m, k]), bKN stores B [k, n] (else [n, k]).
  LtGemm(cublasLtHandle_t h, int64_t m, int64_t n, int64_t k, bool aKM, bool bKN, void* workspace, size_t workspaceSize)
      : handle(h), ws(workspace), wsSize(workspaceSize) {
    init(m, n, k, aKM ? m : k, bKN ? n : k, n, aKM, bKN);
  }
  // Row strides in elements.
  LtGemm(cublasLtHandle_t h, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, void* workspace,
         size_t workspaceSize)
      : handle(h), ws(workspace), wsSize(workspaceSize) {
    init(m, n, k, lda, ldb, ldc, false, false);
  }
  // FP8 in, packed K-major operands (lda = ldb = k, ldc = n). Never exits for a missing algorithm: see `available`.
  LtGemm(cublasLtHandle_t h, int64_t m, int64_t n, int64_t k, const LtFp8& fp8, void* workspace, size_t workspaceSize)
      : handle(h), ws(workspace), wsSize(workspaceSize) {
    init(m, n, k, k, k, n, false, false, &fp8);
  }
  void init(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool aKM, bool bKN,
            const LtFp8* fp8 = nullptr) {
    ltCheck(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    // cuBLAS's A is our B, its B our A (column-major views of row-major storage); a K-major operand is transposed.
    const cublasOperation_t ta = bKN ? CUBLAS_OP_N : CUBLAS_OP_T, tb = aKM ? CUBLAS_OP_T : CUBLAS_OP_N;
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
    // Column-major views: our B is cuBLAS's A (k x n), our A its B (k x m), our C its C (n x m).
    if (fp8 != nullptr && !setFp8(*fp8)) return;
    const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
    const cudaDataType_t ab = fp8 != nullptr ? fp8->ab : CUDA_R_16BF, ct = fp8 != nullptr ? fp8->c : CUDA_R_16BF;
    ltCheck(cublasLtMatrixLayoutCreate(&la, ab, bKN ? u(n) : u(k), bKN ? u(k) : u(n), ldb), "layout B");
    ltCheck(cublasLtMatrixLayoutCreate(&lb, ab, aKM ? u(m) : u(k), aKM ? u(k) : u(m), lda), "layout A");
    ltCheck(cublasLtMatrixLayoutCreate(&lc, ct, static_cast<uint64_t>(n), static_cast<uint64_t>(m), ldc), "layout C");
    cublasLtMatmulPreference_t pref;
    ltCheck(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    ltCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsSize,
                                                 sizeof(wsSize)),
            "MAX_WORKSPACE_BYTES");
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, pref, 1, &res, &found);
    if (fp8 != nullptr && (hs != CUBLAS_STATUS_SUCCESS || found == 0)) {
      // cuBLASLt answers NOT_SUPPORTED (or no algorithm) for what it cannot run, e.g. e5m2 x e5m2.
      why = "cuBLASLt has no FP8 algorithm for these operands (cublasLtMatmulAlgoGetHeuristic -> status " +
            std::to_string(static_cast<int>(hs)) + ", " + std::to_string(found) + " found)";
      available = false;
      cublasLtMatmulPreferenceDestroy(pref);
      return;
    }
    ltCheck(hs, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt found no algorithm for %lldx%lldx%lld\n", static_cast<long long>(m),
                   static_cast<long long>(k), static_cast<long long>(n));
      std::_Exit(2);
    }
    algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  ~LtGemm() {
    if (la != nullptr) cublasLtMatrixLayoutDestroy(la);
    if (lb != nullptr) cublasLtMatrixLayoutDestroy(lb);
    if (lc != nullptr) cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Scales and accumulation of an FP8 GEMM. cuBLAS's A is our B and its B our A (init), so the scale pointers and
  // modes swap too. False (with `why`) where this cuBLASLt cannot take the scaling.
  bool setFp8(const LtFp8& f) {
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &f.bScale, sizeof(f.bScale)),
            "A_SCALE_POINTER");
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &f.aScale, sizeof(f.aScale)),
            "B_SCALE_POINTER");
    if (f.block) {
#if CUBLAS_VERSION >= 120900  // the block-scaling modes (and their sm_90 kernels) came with cuBLAS 12.9
      const int32_t ours = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, theirs = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ours, sizeof(ours)),
              "A_SCALE_MODE");
      ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &theirs, sizeof(theirs)),
              "B_SCALE_MODE");
#else
      why = "this cuBLASLt (CUBLAS_VERSION " + std::to_string(CUBLAS_VERSION) +
            ") has no block-scaling mode: VEC128_32F / BLK128x128_32F need cuBLAS 12.9 (CUDA 12.9), as "
            "torch._scaled_mm's 1x128 / 128x128 block scales do";
      available = false;
      return false;
#endif
    }
    const int8_t fast = f.fastAccum ? 1 : 0;
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)), "FAST_ACCUM");
    return true;
  }

  void run(const void* a, const void* b, void* c, cudaStream_t s) const {
    const float alpha = 1.0f, beta = 0.0f;
    ltCheck(cublasLtMatmul(handle, op, &alpha, b, la, a, lb, &beta, c, lc, c, lc, &algo, ws, wsSize, s),
            "cublasLtMatmul");
  }
};

}  // namespace tandem::bench
