# The GEMM core's layouts and small-M path vs cuBLASLt in the same layout (included from bench/CMakeLists.txt inside
# if(TANDEM_HAVE_CUDA)). Run on an H100/H200: gemm_layouts_bench [--iters N] [--only big|decode] [--dtype bf16|fp16]
# Results: bench/RESULTS.md. Exits 1 on any correctness failure. Links only tandem_gemm_layouts and cuBLASLt.
if(TARGET tandem_gemm_layouts)
  add_executable(gemm_layouts_bench gemm_layouts_bench.cu)
  target_link_libraries(gemm_layouts_bench PRIVATE tandem_gemm_layouts CUDA::cublasLt)
  set_target_properties(gemm_layouts_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 from the library
endif()
