#!/usr/bin/env bash
# tests/gpu/onegpu_pool_run.sh — one bounded batch (< 6 min; any kind with >= 1 GPU; 2 GPUs add
# the R = 2 a2a tests): the one-GPU multi-rank ht failure (Ranks/HtOneGpu.MatchesReference/R2:
# 3 of 3 runs timed out on nvidia-h200-x4, docs/perf.md ninth session) with the device's shared
# memory pool (EPX_TEST_SHARED_POOL=1, as before) and with each rank's own pool (the default now),
# 4 times each, 5 s device timeout; then every one-GPU multi-rank test and the a2a GPU tests once.
#   bash tests/gpu/onegpu_pool_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test gpu_ll_gpu_test gpu_a2a_gpu_test || exit 1
R2='Ranks/HtOneGpu.MatchesReference/R2'
for pool in shared own; do
  echo "-- $R2, $pool pool, 4 times"
  if [ "$pool" = shared ]; then export EPX_TEST_SHARED_POOL=1; else unset EPX_TEST_SHARED_POOL; fi
  for i in 1 2 3 4; do
    s=$(date +%s)
    timeout 60 "$B/tests/gpu/gpu_ht_test" --gtest_filter="$R2" > "$OUT/r2_${pool}_$i.log" 2>&1
    rc=$?
    echo "run $i: rc=$rc ($(( $(date +%s) - s )) s)"
    grep -E "^\[rank|^\[one GPU" "$OUT/r2_${pool}_$i.log" | cut -c1-400 | head -6
    [ $rc -eq 0 ] && rm -f "$OUT/r2_${pool}_$i.log"
  done
done
unset EPX_TEST_SHARED_POOL
epx_batch_tests gpu_ht_test 200 'Ranks/HtOneGpu.*'
epx_batch_tests gpu_ll_gpu_test 120 'Ranks/LlOneGpu.*'
epx_batch_tests gpu_a2a_gpu_test 120 'Ranks/A2aOneGpu.*:Ranks/A2aGpu.*'
epx_batch_total
