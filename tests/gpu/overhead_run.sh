#!/usr/bin/env bash
# tests/gpu/overhead_run.sh — one bounded batch (< 5 min, one GPU suffices): the Python extension,
# then tests/python/bench_overhead.py (SPEC 6: the CPU cost of one Python call) on the cuda
# backend with CUDA tensors — the tiny shape of docs/perf-python.md and the standard ll decode
# shape —, the same on the cpu backend of this host for comparison, and its pytest (cpu, cuda).
#   bash tests/gpu/overhead_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start_python || exit 1
PY=/opt/torch/.venv/bin/python3
overhead() {  # NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2
  shift 2
  epx_device_run "$name" "$limit" env PYTHONPATH="$PWD/python" "$PY" \
    tests/python/bench_overhead.py "$@"
  grep -E "^T=|^\||skipped" "$OUT/$name.log"
  tail -5 "$OUT/$name.err"
}
echo "== cuda, tiny shape"
overhead oh_cuda 150 --device cuda --iters 3000 --parts --alloc-ab
echo "== cuda, ll decode shape (T = 128, H = 7168, E = 256, T_max = 128)"
overhead oh_cuda_decode 150 --device cuda --iters 1000 --tokens 128 --hidden 7168 --experts 256 \
  --max-tokens 128
echo "== cpu backend, this host"
overhead oh_cpu 150 --iters 3000 --parts --alloc-ab
echo "== pytest test_overhead_script.py"
PYTHONPATH="$PWD/python" timeout 200 "$PY" -m pytest -q -rs tests/python/test_overhead_script.py \
  > "$OUT/oh_pytest.log" 2>&1
echo "rc=$?"
tail -4 "$OUT/oh_pytest.log"
epx_batch_total
