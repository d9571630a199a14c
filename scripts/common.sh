# Shared by scripts/test.sh and scripts/run.sh. One place that decides the build.
#   EPX_BUILD_DIR   build directory (default build)
#   EPX_WITH_CUDA   ON/OFF (default: ON when nvcc exists; GPU tests skip without a GPU)
#   EPX_PYTHON      the Python the extension and pytest use (default: /opt/torch/.venv's on the
#                   GPU machines, else Debian's /usr/bin/python3)

epx_setup_env() {
  export EPX_BUILD_DIR="${EPX_BUILD_DIR:-build}"
  # Never enable NVLink multicast on the shared GPU hosts; passed on to every child process.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [ -x /opt/torch/.venv/bin/python3 ]; then
    export PATH="/opt/torch/.venv/bin:$PATH"          # the GPU machine's cmake and ninja
  fi
  if [ -n "${EPX_PYTHON:-}" ]; then
    :                                                 # the caller's choice
  elif [ -x /opt/torch/.venv/bin/python3 ]; then
    EPX_PYTHON=/opt/torch/.venv/bin/python3           # the GPU machine
  else
    EPX_PYTHON=/usr/bin/python3                       # Debian's, with apt packages
  fi
  export EPX_PYTHON
  if [ -z "${EPX_WITH_CUDA:-}" ]; then
    # Compile the cuda backend wherever nvcc exists (CI too); GPU tests skip without a GPU.
    if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
      EPX_WITH_CUDA=ON
    else
      EPX_WITH_CUDA=OFF
    fi
  fi
  export EPX_WITH_CUDA
  export PATH="$PATH:/usr/local/cuda/bin"
}

epx_python_ready() {
  "$EPX_PYTHON" -c "import torch, pytest, pybind11" >/dev/null 2>&1
}

epx_install_deps() {
  local need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v g++ >/dev/null || need+=(g++)
  [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
  if [ "$EPX_PYTHON" = /usr/bin/python3 ]; then
    /usr/bin/python3 -c "import torch" >/dev/null 2>&1 || need+=(python3-torch)
    /usr/bin/python3 -c "import pybind11" >/dev/null 2>&1 || need+=(python3-pybind11)
    /usr/bin/python3 -c "import pytest" >/dev/null 2>&1 || need+=(python3-pytest)
    /usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || need+=(python3-numpy)
  fi
  if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      echo "== installing: ${need[*]} =="
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      echo "== missing ${need[*]} and cannot install (no apt or not root); continuing =="
    fi
  fi
}

# The build of this tree in EPX_BUILD_DIR (configured once); `cmake --build` of every target, or
# of the space-separated targets in $1 when given (bench/gpu_run.sh: the ones its batches use).
epx_configure_and_build() {
  local targets=${1:-}
  local py=OFF
  epx_python_ready && [ -f python/CMakeLists.txt ] && py=ON
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if [ ! -f "$EPX_BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S . -B "$EPX_BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DEPX_WITH_CUDA="$EPX_WITH_CUDA" -DEPX_BUILD_PYTHON="$py" \
      -DPython3_EXECUTABLE="$EPX_PYTHON"
  else
    cmake "$EPX_BUILD_DIR" -DEPX_WITH_CUDA="$EPX_WITH_CUDA" -DEPX_BUILD_PYTHON="$py" >/dev/null
  fi
  # shellcheck disable=SC2086  # targets: a list of words
  cmake --build "$EPX_BUILD_DIR" -j "$(nproc)" ${targets:+--target $targets}
}
