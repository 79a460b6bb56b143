// The baseline GEMM of every CUDA benchmark: cuBLASLt C = A·Bᵀ with row-major A [m, k], B [n, k], C [m, n] (the
// tandem kernels' layout; "TN" in cuBLAS's column-major terms), bf16 in and out, fp32 accumulation, the heuristic's
// first algorithm for the given workspace. Header-only; include after <cublasLt.h> is on the include path.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace tandem::bench {

inline void ltCheck(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS error %d: %s\n", static_cast<int>(s), what);
    std::_Exit(2);  // benchmarks exit 2 on a setup failure; _Exit skips NCCL/CUDA teardown that may hang
  }
}

struct LtGemm {
  cublasLtHandle_t handle{};
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulAlgo_t algo{};
  void* ws = nullptr;
  size_t wsSize = 0;

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
  void init(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool aKM, bool bKN) {
    ltCheck(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    // cuBLAS's A is our B, its B our A (column-major views of row-major storage); a K-major operand is transposed.
    const cublasOperation_t ta = bKN ? CUBLAS_OP_N : CUBLAS_OP_T, tb = aKM ? CUBLAS_OP_T : CUBLAS_OP_N;
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
    ltCheck(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
    // Column-major views: our B is cuBLAS's A (k x n), our A its B (k x m), our C its C (n x m).
    const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
    ltCheck(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, bKN ? u(n) : u(k), bKN ? u(k) : u(n), ldb), "layout B");
    ltCheck(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, aKM ? u(m) : u(k), aKM ? u(k) : u(m), lda), "layout A");
    ltCheck(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, static_cast<uint64_t>(n), static_cast<uint64_t>(m), ldc),
            "layout C");
    cublasLtMatmulPreference_t pref;
    ltCheck(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    ltCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsSize,
                                                 sizeof(wsSize)),
            "MAX_WORKSPACE_BYTES");
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    ltCheck(cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, pref, 1, &res, &found),
            "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt found no algorithm for %lldx%lldx%lld\n", static_cast<long long>(m),
                   static_cast<long long>(k), static_cast<long long>(n));
      std::_Exit(2);
    }
    algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const void* a, const void* b, void* c, cudaStream_t s) const {
    const float alpha = 1.0f, beta = 0.0f;
    ltCheck(cublasLtMatmul(handle, op, &alpha, b, la, a, lb, &beta, c, lc, c, lc, &algo, ws, wsSize, s),
            "cublasLtMatmul");
  }
};

}  // namespace tandem::bench
