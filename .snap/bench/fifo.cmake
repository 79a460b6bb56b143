# The proxy FIFO benchmark, included from bench/CMakeLists.txt. A plain chrono loop (no Google Benchmark):
# it needs producer and consumer threads with their own timing, and prints a table; see bench/RESULTS.md.
# Inert until daemon/CMakeLists.txt has add_subdirectory(src/transport).
if(TARGET tandem_transport)
  add_executable(tandem_fifo_bench fifo_bench.cpp)
  target_link_libraries(tandem_fifo_bench PRIVATE tandem_transport tandem_warnings)
endif()
