# Transport-layer tests, included from tests/CMakeLists.txt (after include(doctest)).
#   tandem_transport_tests  unit: verbs logic, wire formats, FIFO arithmetic and stress, validation, tcp logic
#   tandem_tcp_tests        integration: real sockets on 127.0.0.x, several transports and forked nodes
#   tandem_rdma_tests       rdma: needs an RDMA device; exits 77 (skipped) without one
# Inert until daemon/CMakeLists.txt has add_subdirectory(src/transport).
if(NOT TARGET tandem_transport)
  return()
endif()

add_executable(tandem_transport_tests
  unit/main.cpp
  unit/tcp_logic_test.cpp
  unit/transport_logic_test.cpp)
target_link_libraries(tandem_transport_tests PRIVATE tandem_transport doctest::doctest tandem_warnings)
doctest_discover_tests(tandem_transport_tests ADD_LABELS 1 PROPERTIES LABELS unit TIMEOUT 60)

add_executable(tandem_tcp_tests
  integration/main.cpp
  integration/tcp_transport_test.cpp)
target_link_libraries(tandem_tcp_tests PRIVATE tandem_transport doctest::doctest tandem_warnings)
doctest_discover_tests(tandem_tcp_tests ADD_LABELS 1 PROPERTIES LABELS integration TIMEOUT 60)

add_executable(tandem_rdma_tests rdma/verbs_hw_test.cpp)
target_link_libraries(tandem_rdma_tests PRIVATE tandem_transport doctest::doctest tandem_warnings)
# One CTest entry: the executable probes for a device before doctest runs and exits 77 without one.
add_test(NAME tandem_rdma_tests COMMAND tandem_rdma_tests)
set_tests_properties(tandem_rdma_tests PROPERTIES LABELS rdma SKIP_RETURN_CODE 77 TIMEOUT 120)

# tandemd refuses a cluster transport without a control channel (a daemon process; needs tandemd).
target_sources(tandem_integration_tests PRIVATE integration/cluster_transport_test.cpp)
