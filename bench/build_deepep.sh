#!/usr/bin/env bash
# bench/build_deepep.sh — builds a DeepEP V1 checkout (github.com/deepseek-ai/DeepEP, e.g. commit
# 567632d) in place, for sm_90, with the Python that runs epx, so that DeepEP itself runs beside
# epx on the same machine: bench/peer_deepep.sh (EPX_DEEPEP_SELF) and bench/engine_timing.py
# (--peer). None of DeepEP lives in this repository. Needs NVSHMEM as DeepEP does (the GPU
# machine's venv has the nvidia-nvshmem wheel); about 80 s on 16 cores.
#
#   bash bench/build_deepep.sh DEEPEP_DIR
set -euo pipefail
dir=$(cd "${1:?usage: build_deepep.sh DEEPEP_DIR}" && pwd)
py=${EPX_PYTHON:-}
[ -n "$py" ] || { [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3 || py=python3; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda=$(dirname "$(dirname "$nvcc")")
# CUDA 13 keeps CCCL (cuda/std/...) under include/cccl; NVSHMEM's headers include it.
export NVCC_PREPEND_FLAGS="-I$cuda/include/cccl ${NVCC_PREPEND_FLAGS:-}"
export CPLUS_INCLUDE_PATH="$cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
cd "$dir"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$py" setup.py build_ext --inplace
ls deep_ep_cpp*.so >/dev/null
