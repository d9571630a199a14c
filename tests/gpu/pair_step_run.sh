#!/usr/bin/env bash
# tests/gpu/pair_step_run.sh — one bounded batch (< 4 min on 2 x H200), sixth session: the ht
# combine reducers' pair step (tokens with <= 2 row sources: 7 vectors of each source in flight,
# 4 steps per 7168-wide row instead of 5; the weights loaded before the row) in its own kernel
# instantiation. Every ht GPU test (a path with kHtReducePairOff keeps the general step tested),
# then epx_ht_gpu_bench rows with and without the pair step, T = 4096 at 16 and 32 SMs, T = 8192.
# Logs under $OUT.  bash tests/gpu/pair_step_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 150 '*'
for T in 4096 8192; do
  echo "-- T = $T"
  epx_batch_bench t$T 120 "^SMs|combine bf16 [^[]|combine bf16 \[(EPX|default, no pair)" \
    epx_ht_gpu_bench --iters 20 --tokens $T --sms 16,32
done
epx_batch_total
