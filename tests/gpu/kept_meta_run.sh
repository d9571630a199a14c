#!/usr/bin/env bash
# tests/gpu/kept_meta_run.sh — one bounded batch (< 6 min on 2 x H200), prepared in the tenth
# session (compiled, not yet run): a kept row's routing metadata with the id and weight loaded
# together (kHtKeptMetaLate = the loads in series, the A/B). (1) the ht GPU tests, every copy
# path, and the one-GPU R2/R4/R8 ones; (2) epx_ht_gpu_bench rows "exact[, zero-copy]" vs
# "..., kept metadata late", T = 4096, 16 SMs, ce:kept and warp; (3) epx-bench ht;
# (4) profile_kernels.py --ops ht (the dispatch kernel's own duration, exact vs cached).
#   bash tests/gpu/kept_meta_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON -DEPX_BUILD_PYTHON=ON \
-DPython3_EXECUTABLE=/opt/torch/.venv/bin/python3" \
  epx_batch_start gpu_ht_test epx_ht_gpu_bench epx-bench _epx || exit 1
epx_batch_tests gpu_ht_test 200 'HtKeptPlan.*:HtGpu.*:Ranks/HtOneGpu.*'
epx_batch_bench ab4096 90 "\(exact|worst|\(cached\)" \
  epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --copy ce:kept,warp
timeout 100 "$B/bench/epx-bench" ht --backend cuda > "$OUT/eb.log" 2>&1
echo "== epx-bench ht rc=$?"
grep -E "^ht\\." "$OUT/eb.log" | cut -c1-120
PYTHONPATH="$PWD/python" timeout 100 /opt/torch/.venv/bin/python3 bench/profile_kernels.py \
  --ops ht --iters 20 > "$OUT/profile.log" 2>&1
echo "== profile rc=$?"
grep -E "^(op|ht)" "$OUT/profile.log" | cut -c1-200
epx_batch_total
