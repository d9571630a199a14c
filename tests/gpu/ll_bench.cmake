# tests/gpu/ll_bench.cmake — the ll benchmark of the cuda backend (results:
# docs/perf.md §4.3). Included by tests/gpu/CMakeLists.txt; needs NCCL's headers for the
# NCCL baseline.
add_executable(epx_ll_gpu_bench ${CMAKE_CURRENT_LIST_DIR}/ll_gpu_bench.cu)
target_include_directories(epx_ll_gpu_bench PRIVATE ${EPX_NCCL_INCLUDE_DIR})
target_link_libraries(epx_ll_gpu_bench PRIVATE epx_gpu_testing)
epx_cuda_target(epx_ll_gpu_bench)

# A diagnostic of the ll send's per-CTA store rate (not a test; see the file's header).
add_executable(epx_store_probe ${CMAKE_CURRENT_LIST_DIR}/store_probe.cu)
target_link_libraries(epx_store_probe PRIVATE epx_gpu_testing)
epx_cuda_target(epx_store_probe)
