# The fused GEMMs end to end (ag-gemm, gemm-rs, gemm-ar through libtandem on a private tandemd, backend cuda, executor
# client, one process per GPU) vs NCCL + cuBLASLt in the same processes (included from bench/CMakeLists.txt inside
# if(TANDEM_HAVE_CUDA)). NCCL is the baseline, so without nccl.h / libnccl the target is skipped with a message and the
# rest of the project still configures and builds.
# Run on a GPU host (`scripts/gpu-check.sh bench-fused` runs it at one rank):
#   fused_e2e_bench [--iters 20] [--warmup 3] [--op ag-gemm|gemm-rs|gemm-ar] [--shape I] [--gathered] [--json FILE]
# Exits 1 when tandem's output differs from the baseline's (rel. error >= 1e-2 or a non-finite value), 2 on errors.
if(TANDEM_HAVE_CUDA)
  find_path(TANDEM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
  find_library(TANDEM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)
  if(TANDEM_NCCL_INCLUDE_DIR AND TANDEM_NCCL_LIBRARY AND EXISTS "${TANDEM_NCCL_INCLUDE_DIR}/nccl.h")
    add_executable(fused_e2e_bench fused_e2e_bench.cu)
    target_include_directories(fused_e2e_bench PRIVATE ${PROJECT_SOURCE_DIR}/client/include ${TANDEM_NCCL_INCLUDE_DIR})
    target_link_libraries(fused_e2e_bench PRIVATE tandem CUDA::cublasLt CUDA::cudart_static ${TANDEM_NCCL_LIBRARY})
    set_target_properties(fused_e2e_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)
    target_compile_options(fused_e2e_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
    target_compile_definitions(fused_e2e_bench PRIVATE TANDEMD_PATH="$<TARGET_FILE:tandemd>")
    add_dependencies(fused_e2e_bench tandemd)
  else()
    message(STATUS "tandem: NCCL not found (nccl.h / libnccl): fused_e2e_bench (fused GEMMs through libtandem vs "
                   "NCCL + cuBLASLt) not built")
  endif()
endif()
