# Fused AllGather+GEMM (launchAgGemm) vs NCCL all-gather + cuBLASLt on 2 GPUs, one process (included from
# bench/CMakeLists.txt inside if(TANDEM_HAVE_CUDA)). Needs NCCL (nccl.h + libnccl) for the baseline: where it is
# missing the target is skipped with a message, and the rest of the project still configures and builds.
# Run on nvidia-h200-x2: ag_gemm_bench [--only check|time] [--iters N] [--shape I]
# Results: bench/RESULTS.md, "Fused AllGather+GEMM vs NCCL + cuBLASLt". Exits non-zero on any correctness failure.
if(TANDEM_HAVE_CUDA)
  find_path(TANDEM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
  find_library(TANDEM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)
  if(TANDEM_NCCL_INCLUDE_DIR AND TANDEM_NCCL_LIBRARY)
    add_executable(ag_gemm_bench ag_gemm_bench.cu)
    target_include_directories(ag_gemm_bench PRIVATE ${TANDEM_NCCL_INCLUDE_DIR})
    target_link_libraries(ag_gemm_bench PRIVATE tandem_kernels CUDA::cublasLt ${TANDEM_NCCL_LIBRARY})
    set_target_properties(ag_gemm_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 from tandem_kernels
  else()
    message(STATUS "tandem: NCCL not found (nccl.h / libnccl): ag_gemm_bench (AllGather+GEMM baseline) not built")
  endif()
endif()
