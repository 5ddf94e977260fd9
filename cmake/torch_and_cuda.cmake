# cmake/torch_and_cuda.cmake — finds LibTorch inside the project's Python torch wheel and decides
# whether the CUDA kernels are built (DPZERO_CUDA = AUTO | ON | OFF).
#
# LibTorch is taken from the same `torch` wheel that Python imports, so the C++ library and the
# Python module are one build (no ABI mismatch between `dpzero._C` and `torch`).
# Sets: DPZERO_WITH_CUDA (BOOL), TORCH_* from TorchConfig, DPZERO_TORCH_PYTHON_LIBRARY.

find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
          "import torch; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or ''); print(torch.__version__)"
  OUTPUT_VARIABLE _dpzero_torch_info
  RESULT_VARIABLE _dpzero_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _dpzero_torch_rc EQUAL 0)
  message(FATAL_ERROR "dpzero: `${Python3_EXECUTABLE} -c 'import torch'` failed; install the pinned "
                      "torch into the project venv first (scripts/setup.sh).")
endif()
string(REPLACE "\n" ";" _dpzero_torch_info "${_dpzero_torch_info}")
list(GET _dpzero_torch_info 0 DPZERO_TORCH_CMAKE_PREFIX)
list(GET _dpzero_torch_info 1 DPZERO_TORCH_CUDA_VERSION)
list(GET _dpzero_torch_info 2 DPZERO_TORCH_VERSION)
message(STATUS "dpzero: torch ${DPZERO_TORCH_VERSION} (CUDA '${DPZERO_TORCH_CUDA_VERSION}') from ${DPZERO_TORCH_CMAKE_PREFIX}")

# ---- CUDA decision ------------------------------------------------------------------------------
set(DPZERO_WITH_CUDA OFF)
if(NOT DPZERO_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "dpzero: DPZERO_CUDA must be AUTO, ON or OFF, got '${DPZERO_CUDA}'")
endif()
if(DPZERO_CUDA STREQUAL "OFF")
  message(STATUS "dpzero: CUDA kernels not built (DPZERO_CUDA=OFF)")
else()
  find_program(DPZERO_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
  set(_why "")
  if(NOT DPZERO_NVCC)
    set(_why "nvcc not found")
  elseif(DPZERO_TORCH_CUDA_VERSION STREQUAL "")
    set(_why "torch ${DPZERO_TORCH_VERSION} is a CPU-only build")
  else()
    execute_process(COMMAND "${DPZERO_NVCC}" --version OUTPUT_VARIABLE _nvcc_out)
    string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _m "${_nvcc_out}")
    set(_nvcc_major "${CMAKE_MATCH_1}")
    string(REGEX MATCH "^([0-9]+)" _m "${DPZERO_TORCH_CUDA_VERSION}")
    if(NOT _nvcc_major STREQUAL CMAKE_MATCH_1)
      set(_why "nvcc ${_nvcc_major}.x does not match torch's CUDA ${DPZERO_TORCH_CUDA_VERSION}")
    endif()
  endif()
  if(_why STREQUAL "")
    set(DPZERO_WITH_CUDA ON)
  elseif(DPZERO_CUDA STREQUAL "ON")
    message(FATAL_ERROR "dpzero: DPZERO_CUDA=ON but ${_why}")
  else()
    message(STATUS "dpzero: CUDA kernels not built (${_why})")
  endif()
endif()

if(DPZERO_WITH_CUDA)
  # A100 = sm_80, H100/H200 = sm_90. Override with -DCMAKE_CUDA_ARCHITECTURES="80;90;100", and
  # name arch-specific targets as nvcc does ("90a", "100a").
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80;90")
  endif()
  # Torch's own CUDA config ignores CMAKE_CUDA_ARCHITECTURES and would otherwise add gencode flags
  # for every architecture it knows (it cannot detect a GPU here), multiplying compile time; hand
  # it exactly our list as TORCH_CUDA_ARCH_LIST ("90a" -> "9.0a", "100" -> "10.0").
  # Note [cuda targets]: each listed architecture gets SASS (its machine code); the newest also
  # gets PTX, so that a GPU newer than every listed one still runs the kernels (the driver
  # JIT-compiles the PTX on first load) instead of failing with "no kernel image". That PTX is for
  # the newest listed number without its "a" suffix: PTX of compute_90a uses sm_90a-only
  # features and loads on sm_90 alone. CMake's suffixes: "-real" is SASS only (the newest number
  # gets no PTX when every entry of it is "-real"), "-virtual" PTX only (refused with "a": that
  # PTX would not run on a newer GPU either).
  set(_torch_arches "")
  set(_dpzero_ptx "")
  set(_newest -1)
  set(_newest_wants_ptx OFF)
  foreach(_a IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(NOT _a MATCHES "^([0-9]+)([0-9])(a?)(-real|-virtual)?$")
      message(FATAL_ERROR "dpzero: CMAKE_CUDA_ARCHITECTURES entry '${_a}' is not an architecture "
                          "number such as 80, 90, 90a, 100a or 90-real")
    endif()
    set(_number "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    if(CMAKE_MATCH_3 STREQUAL "a" AND CMAKE_MATCH_4 STREQUAL "-virtual")
      message(FATAL_ERROR "dpzero: CMAKE_CUDA_ARCHITECTURES entry '${_a}': PTX of an "
                          "arch-specific target loads on that GPU alone; write ${_number}-virtual")
    endif()
    if(NOT CMAKE_MATCH_4 STREQUAL "-virtual")
      list(APPEND _torch_arches "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    else()
      list(APPEND _dpzero_ptx "${_number}")
    endif()
    if(_number GREATER _newest)
      set(_newest "${_number}")
      set(_newest_wants_ptx OFF)
    endif()
    if(_number EQUAL _newest AND NOT CMAKE_MATCH_4 STREQUAL "-real")
      set(_newest_wants_ptx ON)
    endif()
  endforeach()
  if(_newest_wants_ptx)
    list(APPEND _dpzero_ptx "${_newest}")
  endif()
  list(REMOVE_DUPLICATES _dpzero_ptx)
  list(REMOVE_DUPLICATES _torch_arches)
  if(_torch_arches STREQUAL "")
    message(FATAL_ERROR "dpzero: CMAKE_CUDA_ARCHITECTURES '${CMAKE_CUDA_ARCHITECTURES}' names no "
                        "architecture to build machine code for (only -virtual entries)")
  endif()
  set(TORCH_CUDA_ARCH_LIST "${_torch_arches}" CACHE STRING "" FORCE)
  set(CMAKE_CUDA_COMPILER "${DPZERO_NVCC}")
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "dpzero: CUDA kernels ON for architectures ${CMAKE_CUDA_ARCHITECTURES} "
                 "(SASS: ${_torch_arches}; PTX of: ${_dpzero_ptx})")
endif()

list(APPEND CMAKE_PREFIX_PATH "${DPZERO_TORCH_CMAKE_PREFIX}")
find_package(Torch REQUIRED)
if(DPZERO_WITH_CUDA)
  # Note [cuda targets]: torch's config has put the SASS gencode flags into CMAKE_CUDA_FLAGS; add
  # the PTX ones after them.
  foreach(_p IN LISTS _dpzero_ptx)
    string(APPEND CMAKE_CUDA_FLAGS " -gencode arch=compute_${_p},code=compute_${_p}")
  endforeach()
endif()
# libtorch_python: pybind11 casters for at::Tensor used by dpzero._C.
find_library(DPZERO_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED NO_DEFAULT_PATH)
