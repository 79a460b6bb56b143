# Transport-layer tests, included from tests/CMakeLists.txt (after include(doctest)).
#   tandem_transport_tests  unit: verbs logic, wire formats, FIFO arithmetic and stress, validation, tcp logic
#   tandem_tcp_tests        integration: real sockets on 127.0.0.x, several transports and forked nodes
#   tandem_rdma_tests       rdma: needs an RDMA device; exits 77 (skipped) without one
# Inert until daemon/CMakeLists.txt has add_subdirectory(src/transport).
if(NOT TARGET tandem_transport)
  return()
endif()

# The verbs test double (libibverbs.so.1 in ${TANDEM_VERBS_DOUBLE_LIBDIR}); tests opt into it through LD_LIBRARY_PATH.
add_subdirectory(support/verbs_double)

add_executable(tandem_transport_tests
  unit/main.cpp
  unit/tcp_logic_test.cpp
  unit/transport_logic_test.cpp
  unit/verbs_control_logic_test.cpp)
target_link_libraries(tandem_transport_tests PRIVATE tandem_transport doctest::doctest tandem_warnings)
doctest_discover_tests(tandem_transport_tests ADD_LABELS 1 PROPERTIES LABELS unit TIMEOUT 60)

# tandem's use of verbs against the double: QP state machine, ordering, completions, faults, the verbs transport and
# its bootstrap. And the RDMA hardware suite, which finds the double's device instead of skipping.
set(TANDEM_VERBS_DOUBLE_ENV "LD_LIBRARY_PATH=${TANDEM_VERBS_DOUBLE_LIBDIR}")
add_executable(tandem_verbs_double_tests unit/main.cpp unit/verbs_double_test.cpp)
target_link_libraries(tandem_verbs_double_tests PRIVATE tandem_transport doctest::doctest tandem_warnings ${CMAKE_DL_LIBS})
target_include_directories(tandem_verbs_double_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
add_dependencies(tandem_verbs_double_tests tandem_verbs_double)
doctest_discover_tests(tandem_verbs_double_tests ADD_LABELS 1
                       PROPERTIES LABELS unit TIMEOUT 60 ENVIRONMENT "${TANDEM_VERBS_DOUBLE_ENV}")

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
add_test(NAME tandem_rdma_tests_on_verbs_double COMMAND tandem_rdma_tests)
set_tests_properties(tandem_rdma_tests_on_verbs_double PROPERTIES LABELS integration TIMEOUT 120
                     ENVIRONMENT "${TANDEM_VERBS_DOUBLE_ENV}")
add_dependencies(tandem_rdma_tests tandem_verbs_double)

# The cluster over cluster.transport: verbs on the double: real tandemd processes, every cross-node op, faults.
add_executable(tandem_verbs_cluster_tests integration/main.cpp integration/verbs_cluster_test.cpp)
target_link_libraries(tandem_verbs_cluster_tests PRIVATE tandem_client_core doctest::doctest fmt::fmt
                                                         nlohmann_json::nlohmann_json tandem_warnings ${CMAKE_DL_LIBS})
target_include_directories(tandem_verbs_cluster_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
target_compile_definitions(tandem_verbs_cluster_tests PRIVATE
  TANDEMD_PATH="$<TARGET_FILE:tandemd>" TANDEMCTL_PATH="$<TARGET_FILE:tandemctl>")
add_dependencies(tandem_verbs_cluster_tests tandemd tandemctl tandem_verbs_double)
doctest_discover_tests(tandem_verbs_cluster_tests
                       PROPERTIES LABELS integration TIMEOUT 180 ENVIRONMENT "${TANDEM_VERBS_DOUBLE_ENV}")
