#!/usr/bin/env bash
# tests/gpu/profile_run.sh — one bounded batch (< 4 min on 2 x H200): the Python extension, then
# bench/profile_kernels.py (torch.profiler kernel durations of ll / ht / a2a, SPEC 6), both ranks.
#   bash tests/gpu/profile_run.sh [extra profile_kernels.py flags]
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_PYTHON=ON -DPython3_EXECUTABLE=/opt/torch/.venv/bin/python3" \
  epx_batch_start _epx || exit 1
PYTHONPATH="$PWD/python" timeout 300 /opt/torch/.venv/bin/python3 bench/profile_kernels.py "$@" \
  > "$OUT/profile.log" 2>&1
echo "== profile rc=$?"
grep -v "^\[W\|Warning" "$OUT/profile.log" | tail -60
epx_batch_total
