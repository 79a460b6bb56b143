# GEMM core vs cuBLASLt (included from bench/CMakeLists.txt inside if(TANDEM_HAVE_CUDA)).
# Run on an H200: gemm_bench [--json FILE] [--iters N] [--no-sweep] [--only big|odd] [--cluster 1|2]
# Results: bench/RESULTS.md, "GEMM core vs cuBLASLt". Exits non-zero on any correctness failure.
if(TANDEM_HAVE_CUDA)
  add_executable(gemm_bench gemm_bench.cu)
  target_link_libraries(gemm_bench PRIVATE tandem_kernels CUDA::cublasLt)
  set_target_properties(gemm_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 comes from tandem_kernels
endif()
