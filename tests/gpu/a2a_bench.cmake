# tests/gpu/a2a_bench.cmake — the a2a benchmark of the cuda backend (results:
# docs/perf.md §4.4). Included by tests/gpu/CMakeLists.txt; needs NCCL's headers for the
# NCCL baseline.
add_executable(epx_a2a_gpu_bench ${CMAKE_CURRENT_LIST_DIR}/a2a_gpu_bench.cu)
target_include_directories(epx_a2a_gpu_bench PRIVATE ${EPX_NCCL_INCLUDE_DIR})
target_link_libraries(epx_a2a_gpu_bench PRIVATE epx_gpu_testing)
epx_cuda_target(epx_a2a_gpu_bench)
