# cmake/torch_aten.cmake — epx._epx_torch, the optional ATen half of the torch bridge
# (python/src/torch_aten.cc; docs/design.md §12). Included by python/CMakeLists.txt after _epx.
#
#   EPX_TORCH_BRIDGE  AUTO (default): build it when the Python torch's C++ headers and libraries
#                     are there and the source compiles against them, else skip it with a message;
#                     ON: the same, but a skip is an error; OFF: never build it.
# Everything comes from the torch that ${Python3_EXECUTABLE} imports: include paths and library
# paths (torch.utils.cpp_extension), _GLIBCXX_USE_CXX11_ABI and the version, which is compiled
# into the module (epx/_torch.py loads it only under that same torch). Sets, for _epx,
#   EPX_TORCH_ATEN_BUILT  ON when the target _epx_torch exists
#   EPX_TORCH_ATEN_NOTE   why it does not ("" when it does)
# and writes both into generated/torch_aten_build.h for _epx (module.cc).

set(EPX_TORCH_BRIDGE AUTO CACHE STRING "Build epx._epx_torch (AUTO, ON or OFF)")
set_property(CACHE EPX_TORCH_BRIDGE PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${EPX_TORCH_BRIDGE}" _epx_tb)
if(NOT _epx_tb MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "EPX_TORCH_BRIDGE is '${EPX_TORCH_BRIDGE}', expected AUTO, ON or OFF")
endif()
set(EPX_TORCH_ATEN_BUILT OFF)
set(EPX_TORCH_ATEN_NOTE "")

# Finds torch and checks that torch_aten.cc compiles against it; sets EPX_TORCH_ATEN_NOTE on
# the first thing missing, else the _epx_torch_* variables the target needs.
function(_epx_torch_aten_probe)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
            "import torch, torch.utils.cpp_extension as e\n\
print(torch.__version__)\n\
print(','.join(e.include_paths()))\n\
print(','.join(e.library_paths()))\n\
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    OUTPUT_VARIABLE out
    ERROR_VARIABLE err
    RESULT_VARIABLE rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    string(REGEX MATCH "[^\n]*\n?$" last "${err}")
    string(STRIP "${last}" last)
    set(EPX_TORCH_ATEN_NOTE "${Python3_EXECUTABLE} cannot import torch (${last})" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  list(GET lines 0 version)
  list(GET lines 1 include_paths)
  list(GET lines 2 library_paths)
  list(GET lines 3 cxx11_abi)
  string(REPLACE "," ";" include_paths "${include_paths}")
  string(REPLACE "," ";" library_paths "${library_paths}")
  set(include_dirs "")
  foreach(dir IN LISTS include_paths)
    if(IS_DIRECTORY "${dir}")
      list(APPEND include_dirs "${dir}")
    endif()
  endforeach()
  find_path(_epx_torch_header torch/csrc/autograd/python_variable.h
            PATHS ${include_dirs} NO_DEFAULT_PATH NO_CACHE)
  if(NOT _epx_torch_header)
    string(REPLACE ";" ", " dirs "${include_paths}")
    string(CONCAT note "torch ${version} has no C++ headers (torch/csrc/autograd/"
           "python_variable.h under none of ${dirs}; Debian: libtorch-dev)")
    set(EPX_TORCH_ATEN_NOTE "${note}" PARENT_SCOPE)
    return()
  endif()
  set(libraries "")
  foreach(name c10 torch_cpu torch_python)
    find_library(_epx_torch_lib_${name} ${name} PATHS ${library_paths} NO_DEFAULT_PATH NO_CACHE)
    if(NOT _epx_torch_lib_${name})
      string(REPLACE ";" ", " dirs "${library_paths}")
      set(EPX_TORCH_ATEN_NOTE "torch ${version}: no lib${name} in ${dirs}" PARENT_SCOPE)
      return()
    endif()
    list(APPEND libraries "${_epx_torch_lib_${name}}")
  endforeach()
  # The probe compiles the real source (no link), once per torch: what builds it is the torch,
  # not the source, which the build itself compiles again.
  set(all_includes ${include_dirs} ${pybind11_INCLUDE_DIR} ${Python3_INCLUDE_DIRS}
                   "${CMAKE_CURRENT_SOURCE_DIR}/src")
  string(SHA1 key "${version};${cxx11_abi};${all_includes};${CMAKE_CXX_COMPILER}")
  set(result_var "EPX_TORCH_ATEN_COMPILES_${key}")
  if(NOT DEFINED ${result_var})
    message(STATUS "epx: compiling the torch bridge against torch ${version} (once)")
    set(probe "${CMAKE_CURRENT_BINARY_DIR}/torch_aten_probe.cc")
    file(WRITE "${probe}" "#define _GLIBCXX_USE_CXX11_ABI ${cxx11_abi}\n"
                          "#define EPX_TORCH_VERSION \"probe\"\n"
                          "#include \"${CMAKE_CURRENT_SOURCE_DIR}/src/torch_aten.cc\"\n")
    set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
    try_compile(compiles
                SOURCES "${probe}"
                CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${all_includes}"
                CXX_STANDARD 20
                OUTPUT_VARIABLE log)
    set(first_error "")
    if(NOT compiles)
      string(REGEX MATCH "error: [^\n]*" first_error "${log}")
    endif()
    set(EPX_TORCH_ATEN_ERROR_${key} "${first_error}" CACHE INTERNAL "")
    set(${result_var} ${compiles} CACHE INTERNAL "torch_aten.cc compiles against this torch")
  endif()
  if(NOT ${${result_var}})
    string(CONCAT note "python/src/torch_aten.cc does not compile against torch ${version} "
           "(${EPX_TORCH_ATEN_ERROR_${key}}; the whole log: CMake's configure log)")
    set(EPX_TORCH_ATEN_NOTE "${note}" PARENT_SCOPE)
    return()
  endif()
  set(_epx_torch_version "${version}" PARENT_SCOPE)
  set(_epx_torch_include_dirs "${include_dirs}" PARENT_SCOPE)
  set(_epx_torch_library_paths "${library_paths}" PARENT_SCOPE)
  set(_epx_torch_libraries "${libraries}" PARENT_SCOPE)
  set(_epx_torch_defines "_GLIBCXX_USE_CXX11_ABI=${cxx11_abi}" "EPX_TORCH_VERSION=\"${version}\""
      PARENT_SCOPE)
endfunction()

if(_epx_tb STREQUAL "OFF")
  set(EPX_TORCH_ATEN_NOTE "EPX_TORCH_BRIDGE=OFF")
else()
  _epx_torch_aten_probe()
endif()

if(EPX_TORCH_ATEN_NOTE STREQUAL "")
  Python3_add_library(_epx_torch MODULE WITH_SOABI src/torch_aten.cc)
  # torch's include directories first: a wheel's own pybind11 (under torch/include) wins over
  # pybind11's; SYSTEM: torch's headers' warnings are not ours.
  target_include_directories(_epx_torch SYSTEM PRIVATE ${_epx_torch_include_dirs}
                                                       ${pybind11_INCLUDE_DIR})
  target_include_directories(_epx_torch PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/src")
  target_compile_definitions(_epx_torch PRIVATE ${_epx_torch_defines})
  target_compile_options(_epx_torch PRIVATE -Wall -Wextra)
  # The shared libstdc++ torch uses (not _epx's static one): only C types cross to _epx.
  target_link_libraries(_epx_torch PRIVATE ${_epx_torch_libraries})
  set_target_properties(
    _epx_torch
    PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
               BUILD_RPATH "${_epx_torch_library_paths}" INSTALL_RPATH
               "${_epx_torch_library_paths}" LIBRARY_OUTPUT_DIRECTORY
               "$<1:${EPX_PYTHON_OUTPUT_DIR}>")
  # Building _epx (setup.py builds only that target) builds the bridge too.
  add_dependencies(_epx _epx_torch)
  set(EPX_TORCH_ATEN_BUILT ON)
  message(STATUS "epx: torch bridge epx._epx_torch: built against torch ${_epx_torch_version}")
else()
  if(_epx_tb STREQUAL "ON")
    message(FATAL_ERROR "EPX_TORCH_BRIDGE=ON but epx._epx_torch cannot be built: "
                        "${EPX_TORCH_ATEN_NOTE}")
  endif()
  message(STATUS "epx: torch bridge epx._epx_torch skipped: ${EPX_TORCH_ATEN_NOTE}")
  # An earlier build's module would otherwise still be imported from the output directory.
  file(GLOB _epx_torch_stale "${EPX_PYTHON_OUTPUT_DIR}/_epx_torch.*")
  if(_epx_torch_stale)
    file(REMOVE ${_epx_torch_stale})
  endif()
endif()
# What _epx reports (epx._epx.torch_aten_built / torch_aten_note), as a generated header rather
# than -D flags, which cannot carry every character of a note.
string(REPLACE "\\" "\\\\" _epx_torch_note "${EPX_TORCH_ATEN_NOTE}")
string(REPLACE "\"" "\\\"" _epx_torch_note "${_epx_torch_note}")
string(REPLACE "\n" " " _epx_torch_note "${_epx_torch_note}")
if(EPX_TORCH_ATEN_BUILT)
  set(_epx_torch_built 1)
else()
  set(_epx_torch_built 0)
endif()
string(CONCAT _epx_torch_header "// Generated by cmake/torch_aten.cmake.\n#pragma once\n"
       "#define EPX_TORCH_ATEN_BUILT ${_epx_torch_built}\n"
       "#define EPX_TORCH_ATEN_NOTE \"${_epx_torch_note}\"\n")
file(CONFIGURE OUTPUT "${CMAKE_CURRENT_BINARY_DIR}/generated/torch_aten_build.h"
     CONTENT "${_epx_torch_header}" @ONLY)
target_include_directories(_epx PRIVATE "${CMAKE_CURRENT_BINARY_DIR}/generated")
