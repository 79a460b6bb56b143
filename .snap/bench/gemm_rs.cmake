# Fused GEMM+ReduceScatter / GEMM+AllReduce vs cuBLASLt + NCCL (included from bench/CMakeLists.txt inside
# if(TANDEM_HAVE_CUDA)). Needs NCCL for the baseline: without nccl.h / libnccl the target is skipped with a message,
# so the project still configures and builds on machines without NCCL.
# Run on nvidia-h200-x2: gemm_rs_bench [--iters N] [--det-reps N] [--json FILE] [--skip-big] [--skip-odd] [--shape I]
# Results: bench/RESULTS.md, "Fused GEMM+ReduceScatter and GEMM+AllReduce". Exits non-zero on any failed check.
if(TANDEM_HAVE_CUDA)
  find_path(TANDEM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(TANDEM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(TANDEM_NCCL_INCLUDE_DIR AND TANDEM_NCCL_LIBRARY)
    add_executable(gemm_rs_bench gemm_rs_bench.cu)
    target_include_directories(gemm_rs_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/../kernels ${TANDEM_NCCL_INCLUDE_DIR})
    target_link_libraries(gemm_rs_bench PRIVATE tandem_kernels CUDA::cublasLt ${TANDEM_NCCL_LIBRARY})
    set_target_properties(gemm_rs_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 from tandem_kernels
  else()
    message(STATUS "gemm_rs_bench: nccl.h / libnccl not found; the GEMM+RS / GEMM+AR benchmark is not built")
  endif()
endif()

# The fused kernels forced onto their fused plans at one rank against the GEMM alone, on one GPU (no NCCL needed).
# Run on one H200: gemm_rs_one_rank_bench [--iters N] [--json FILE] [--shape MxNxK]. Results: bench/RESULTS.md,
# "Plans, advise and the daemon executor's fixed cost". Exits 1 on a failed check, 77 without a GPU.
if(TANDEM_HAVE_CUDA)
  add_executable(gemm_rs_one_rank_bench gemm_rs_one_rank_bench.cu)
  target_include_directories(gemm_rs_one_rank_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/../kernels)
  target_link_libraries(gemm_rs_one_rank_bench PRIVATE tandem_kernels CUDA::cublasLt)
  set_target_properties(gemm_rs_one_rank_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)
endif()
