#!/usr/bin/env bash
# tests/gpu/onegpu_eager_run.sh — one bounded batch (< 3 min, 1 GPU is enough): the one-GPU
# multi-rank ht test that timed out in 4 of 8, 5 of 12 and 3 of 3 runs (docs/perf.md, ninth
# session; lazy kernel loading), 10 times now that the one-GPU mode loads kernels eagerly
# (CUDA_MODULE_LOADING=EAGER, set by run_cuda_ranks_one_gpu, required by
# Group::cuda_shared_device); then every one-GPU multi-rank test once.
#   bash tests/gpu/onegpu_eager_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test gpu_ll_gpu_test gpu_a2a_gpu_test || exit 1
pass=0
for i in 1 2 3 4 5 6 7 8 9 10; do
  timeout 60 "$B/tests/gpu/gpu_ht_test" --gtest_filter='Ranks/HtOneGpu.MatchesReference/R2' \
    > "$OUT/r2_$i.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then pass=$((pass + 1)); rm -f "$OUT/r2_$i.log"; else
    echo "run $i: rc=$rc"; grep -E "waited|Invalid|invalid" "$OUT/r2_$i.log" | cut -c1-300 | head -4
  fi
done
echo "== Ranks/HtOneGpu.MatchesReference/R2: $pass of 10 passed"
epx_batch_tests gpu_ht_test 200 'Ranks/HtOneGpu.*:HtGpu.OneRank*'
epx_batch_tests gpu_ll_gpu_test 120 'Ranks/LlOneGpu.*'
epx_batch_tests gpu_a2a_gpu_test 120 'Ranks/A2aOneGpu.*'
epx_batch_total
