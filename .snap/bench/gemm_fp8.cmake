# The FP8 GEMM core vs cuBLASLt's FP8 GEMM (included from bench/CMakeLists.txt inside if(TANDEM_HAVE_CUDA)). Run on an
# H100/H200: gemm_fp8_bench [--iters N]; the PyTorch baseline: python3 bench/scaled_mm_baseline.py. Results:
# bench/RESULTS.md. Exits 1 on any correctness failure. Links only tandem_gemm_fp8 and cuBLASLt.
if(TARGET tandem_gemm_fp8)
  add_executable(gemm_fp8_bench gemm_fp8_bench.cu)
  target_link_libraries(gemm_fp8_bench PRIVATE tandem_gemm_fp8 CUDA::cublasLt)
  set_target_properties(gemm_fp8_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 from the library
endif()
