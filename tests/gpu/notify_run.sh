#!/usr/bin/env bash
# tests/gpu/notify_run.sh — one bounded batch (< 6 min on 2 x H200), tenth session: the count
# exchange (ht_notify_kernel) with each token's ids loaded together and pass 2 reading pass 1's
# masks from shared memory. (1) the ht GPU tests, every copy path (one with the old kernel,
# kHtNotifyOld); (2) epx_ht_gpu_bench exact / worst-case rows new vs old in one process, T = 4096
# and 128; (3) bench/profile_kernels.py (kernel durations, torch.profiler); (4) epx-bench ht.
#   bash tests/gpu/notify_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON -DEPX_BUILD_PYTHON=ON \
-DPython3_EXECUTABLE=/opt/torch/.venv/bin/python3" \
  epx_batch_start gpu_ht_test epx_ht_gpu_bench epx-bench _epx || exit 1
epx_batch_tests gpu_ht_test 200 'HtKeptPlan.*:HtKeptCopies.*:HtGpu.*'
for T in 4096 128; do
  epx_batch_bench "ab$T" 120 "^ht T|\(exact|worst|\(cached\)|\(cached, zero-copy\)" \
    epx_ht_gpu_bench --iters 20 --tokens $T --sms 16 --copy ce:kept,warp
done
PYTHONPATH="$PWD/python" timeout 200 /opt/torch/.venv/bin/python3 bench/profile_kernels.py \
  --iters 20 > "$OUT/profile.log" 2>&1
echo "== profile rc=$?"
grep -E "^(op|ll|ht|a2a|profile)" "$OUT/profile.log" | cut -c1-250
timeout 120 "$B/bench/epx-bench" ht --backend cuda > "$OUT/eb.log" 2>&1
echo "== epx-bench ht rc=$?"
grep -E "^ht\\." "$OUT/eb.log" | cut -c1-120
epx_batch_total
