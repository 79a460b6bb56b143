# AllGather and empty-op round trip on the cuda backend. Included from bench/CMakeLists.txt inside
# if(TANDEM_HAVE_CUDA). Run on a GPU host (`scripts/gpu-check.sh bench-comm` does):
#   allgather_bench [--ranks 2] [--executor client|daemon] [--json FILE]   vs ncclAllGather when NCCL is found
#   roundtrip_bench [--executor client|daemon] [--ranks 1|2]
# Results: bench/RESULTS.md, "GPU runtime: AllGather and round trip".
if(TANDEM_HAVE_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  add_executable(allgather_bench allgather_bench.cu)
  target_link_libraries(allgather_bench PRIVATE tandem CUDA::cudart_static)
  target_include_directories(allgather_bench PRIVATE ${PROJECT_SOURCE_DIR}/client/include)
  set_target_properties(allgather_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)
  target_compile_options(allgather_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  target_compile_definitions(allgather_bench PRIVATE TANDEMD_PATH="$<TARGET_FILE:tandemd>")
  add_dependencies(allgather_bench tandemd)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    target_include_directories(allgather_bench PRIVATE ${NCCL_INCLUDE_DIR})
    target_link_libraries(allgather_bench PRIVATE ${NCCL_LIBRARY})
    target_compile_definitions(allgather_bench PRIVATE TANDEM_HAVE_NCCL=1)
  else()
    message(STATUS "tandem: nccl.h not found; allgather_bench builds without its NCCL baseline")
  endif()

  add_executable(roundtrip_bench allgather_roundtrip_bench.cpp)
  target_link_libraries(roundtrip_bench PRIVATE tandem CUDA::cudart_static tandem_warnings)
  target_include_directories(roundtrip_bench PRIVATE ${PROJECT_SOURCE_DIR}/client/include)
  target_compile_definitions(roundtrip_bench PRIVATE TANDEMD_PATH="$<TARGET_FILE:tandemd>")
  add_dependencies(roundtrip_bench tandemd)
endif()
