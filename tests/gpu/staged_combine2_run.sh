#!/usr/bin/env bash
# tests/gpu/staged_combine2_run.sh — one bounded batch (< 7 min on 2 x H200), seventh session,
# after the staged reducer became the zero-copy combine's default at 2 x 3072: the 2-GPU ht tests,
# the one-GPU ht test 3 times (an intermittent one-GPU failure was seen in the first run, in a
# copying combine), then the zero-copy rows of epx_ht_gpu_bench at T = 4096 (16, 24, 32 SMs)
# and the T sweep 128 / 512 / 1024 / 8192 at 16 and 32 SMs. Logs under $OUT.
#   bash tests/gpu/staged_combine2_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 150 '*-Ranks/HtOneGpu.*' 'Ranks/HtOneGpu.*' 'Ranks/HtOneGpu.*' \
  'Ranks/HtOneGpu.*'
ROWS="^SMs|zero-copy, g|combine bf16 \[EPX"
echo "-- T = 4096"
epx_batch_bench t4096 150 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16,24,32 \
  --copy ce:kept --pull 2x3584
for T in 128 512 1024 8192; do
  echo "-- T = $T"
  epx_batch_bench t$T 100 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens $T --sms 16,32 \
    --copy ce:kept
done
epx_batch_total
