# cmake/cuda.cmake — the cuda backend: CUDA language, NCCL (>= 2.28 with the device API), the
# sources under src/cuda/ and the NCCL transport. Included by the root CMakeLists.txt when
# EPX_WITH_CUDA is ON (the default whenever a CUDA compiler is found).
#
#   CMAKE_CUDA_ARCHITECTURES  default 90 (H100/H200); override on the command line
#   EPX_NCCL_ROOT             NCCL with include/{nccl.h,nccl_device.h} and lib{,64}/libnccl.so*;
#                             default: the torch venv's pip NCCL when present (the GPU machines),
#                             else the CUDA toolkit's copy. Device code is built against these
#                             headers, so they must match the libnccl loaded at run time (2.28's
#                             device structs are unversioned; checked when a group is created).

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# C++20 for .cu files (the public headers are C++20; nvcc >= 12 supports it). Older CMake
# (3.25) does not know nvcc's C++20 flag, so pass it directly there.
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.0)
  message(FATAL_ERROR "EPX_WITH_CUDA needs nvcc >= 12 (C++20 device code); found "
                      "${CMAKE_CUDA_COMPILER_VERSION}")
endif()

if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()

# Applies the cuda build settings to a target that has .cu sources (epx, tests, benchmarks).
function(epx_cuda_target target)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                                             CUDA_SEPARABLE_COMPILATION OFF)
  set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  # No fast-math anywhere: float32 reductions must match the cpu backend bit for bit.
  # The host half of .cu files evaluates core/logfmt.h too: no host fma contraction there either.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo
                                           --expt-relaxed-constexpr -Xcompiler=-Wall
                                           -Xcompiler=-ffp-contract=off>)
endfunction()

set(_epx_pip_nccl /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl)
if(NOT EPX_NCCL_ROOT)
  if(EXISTS ${_epx_pip_nccl}/include/nccl.h)
    set(EPX_NCCL_ROOT ${_epx_pip_nccl})
  else()
    set(EPX_NCCL_ROOT ${CUDAToolkit_LIBRARY_ROOT})
  endif()
endif()
set(EPX_NCCL_ROOT ${EPX_NCCL_ROOT} CACHE PATH "NCCL installation (include/, lib/)" FORCE)

find_path(EPX_NCCL_INCLUDE_DIR nccl_device.h PATHS ${EPX_NCCL_ROOT}/include NO_DEFAULT_PATH)
# The pip wheel ships only libnccl.so.2 (no libnccl.so symlink).
find_library(EPX_NCCL_LIBRARY NAMES libnccl.so.2 nccl
             PATHS ${EPX_NCCL_ROOT}/lib ${EPX_NCCL_ROOT}/lib64
                   ${EPX_NCCL_ROOT}/targets/x86_64-linux/lib
             NO_DEFAULT_PATH)
if(NOT EPX_NCCL_INCLUDE_DIR OR NOT EPX_NCCL_LIBRARY)
  message(FATAL_ERROR "EPX_WITH_CUDA: no NCCL with the device API under '${EPX_NCCL_ROOT}' "
                      "(need include/nccl_device.h and lib/libnccl.so.2); set EPX_NCCL_ROOT")
endif()
get_filename_component(EPX_NCCL_LIBDIR ${EPX_NCCL_LIBRARY} DIRECTORY)
message(STATUS "epx: cuda backend ON, arch ${CMAKE_CUDA_ARCHITECTURES}, "
               "NCCL ${EPX_NCCL_INCLUDE_DIR} / ${EPX_NCCL_LIBRARY}")

file(GLOB EPX_CUDA_SOURCES CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/src/cuda/*.cu ${PROJECT_SOURCE_DIR}/src/cuda/*.cc
     ${PROJECT_SOURCE_DIR}/src/transport/nccl_*.cc
     ${PROJECT_SOURCE_DIR}/src/transport/cuda_*.cc)
target_sources(epx PRIVATE ${EPX_CUDA_SOURCES})
target_compile_definitions(epx PUBLIC EPX_WITH_CUDA=1)
if(EPX_HT_TRACE)  # PUBLIC: the bench reads the stamps through the same define
  target_compile_definitions(epx PUBLIC EPX_HT_TRACE=1)
  message(STATUS "epx: EPX_HT_TRACE ON (ht kernels record phase timestamps)")
endif()
if(EPX_DIAGNOSTICS)  # PUBLIC: the GPU benchmarks call the hooks under the same define
  target_compile_definitions(epx PUBLIC EPX_DIAGNOSTICS=1)
  message(STATUS "epx: EPX_DIAGNOSTICS ON (ht ablations and tuning overrides compiled in)")
endif()
if(EPX_LL_TRACE)  # PUBLIC: the bench reads the stamps through the same define
  target_compile_definitions(epx PUBLIC EPX_LL_TRACE=1)
  message(STATUS "epx: EPX_LL_TRACE ON (ll kernels record phase timestamps)")
endif()
# Only GIN device code needs the DOCA headers some NCCL packages lack; epx has no GIN kernels.
if(NOT EXISTS ${EPX_NCCL_INCLUDE_DIR}/nccl_device/gin/gdaki/doca_gpunetio/doca_gpunetio_device.h)
  target_compile_definitions(epx PRIVATE NCCL_GIN_GDAKI_ENABLE=0)
endif()
target_include_directories(epx PRIVATE ${EPX_NCCL_INCLUDE_DIR})
set(EPX_NCCL_INCLUDE_DIR ${EPX_NCCL_INCLUDE_DIR} CACHE INTERNAL "")
target_include_directories(epx SYSTEM PUBLIC ${CUDAToolkit_INCLUDE_DIRS})
epx_cuda_target(epx)
# DT_RPATH (not RUNPATH) to the NCCL the headers came from, so LD_LIBRARY_PATH cannot swap in
# another libnccl under the unversioned device structs.
target_link_libraries(epx PUBLIC CUDA::cudart ${EPX_NCCL_LIBRARY}
                      "-Wl,--disable-new-dtags,-rpath,${EPX_NCCL_LIBDIR}")

# The sources with EPX_DIAGNOSTICS code compiled with it (not part of `all`): `cmake --build build
# --target epx_diagnostics_check`, which scripts/test.sh runs so that code keeps building while
# the default build leaves it out. The library's sources (epx_diagnostics_src) are also linked
# into one shared object (epx_diagnostics_link; unresolved symbols allowed), so that a symbol
# defined by two of them fails here and not first in a diagnostics build on a GPU machine; the GPU
# benchmarks' EPX_DIAGNOSTICS code (epx_diagnostics_bench: bench/ht_gpu_bench.cc --ablate
# --send-pct, bench/ht_onegpu_bench.cc --bits, bench/ll_gpu_bench.cu --ablate) is compiled only.
# epx_diagnostics_check is a custom target over both: under Ninja an object library's compile
# steps wait only for its dependencies' compile steps, not for their links.
add_library(epx_diagnostics_src OBJECT EXCLUDE_FROM_ALL
            ${PROJECT_SOURCE_DIR}/src/cuda/tuning.cc ${PROJECT_SOURCE_DIR}/src/cuda/ht.cu
            ${PROJECT_SOURCE_DIR}/src/cuda/ht_dispatch.cu ${PROJECT_SOURCE_DIR}/src/cuda/ht_combine.cu
            ${PROJECT_SOURCE_DIR}/src/cuda/ht_nodes.cu ${PROJECT_SOURCE_DIR}/src/cuda/ll.cu
            ${PROJECT_SOURCE_DIR}/src/cuda/ll_send.cu)
set_target_properties(epx_diagnostics_src PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(epx_diagnostics_link SHARED EXCLUDE_FROM_ALL $<TARGET_OBJECTS:epx_diagnostics_src>)
set_target_properties(epx_diagnostics_link PROPERTIES LINKER_LANGUAGE CXX)
add_library(epx_diagnostics_bench OBJECT EXCLUDE_FROM_ALL
            ${PROJECT_SOURCE_DIR}/tests/gpu/ht_nodes_gpu_test.cc
            ${PROJECT_SOURCE_DIR}/bench/ht_gpu_bench.cc ${PROJECT_SOURCE_DIR}/bench/ht_onegpu_bench.cc
            ${PROJECT_SOURCE_DIR}/bench/ll_gpu_bench.cu)
foreach(t epx_diagnostics_src epx_diagnostics_bench)
  target_include_directories(${t} PRIVATE $<TARGET_PROPERTY:epx,INCLUDE_DIRECTORIES>
                                          ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${t} PRIVATE $<TARGET_PROPERTY:epx,COMPILE_DEFINITIONS>
                                          EPX_DIAGNOSTICS=1)
  epx_cuda_target(${t})
endforeach()
add_custom_target(epx_diagnostics_check)
add_dependencies(epx_diagnostics_check epx_diagnostics_link epx_diagnostics_bench)
