#!/usr/bin/env bash
# tests/gpu/zero_copy_combine_run.sh — one bounded batch (< 5 min on 2 x H200), sixth session:
# the zero-copy (pull) ht combine (HtCombineArgs::zero_copy + Buffer::ht_combine_buffer). Every
# ht GPU test (each case also combines zero-copy; the graph test in place under the zero-copy
# paths), then epx_ht_gpu_bench rows "combine bf16 (zero-copy[, graph])" next to the default
# combine: T = 4096 at 16, 24, 32 SMs, T = 1024 and 8192 at 16 and 32.
# Logs under $OUT.  bash tests/gpu/zero_copy_combine_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 150 '*'
for T in 4096 1024 8192; do
  sms=16,32
  [ "$T" = 4096 ] && sms=16,24,32
  echo "-- T = $T"
  epx_batch_bench t$T 120 "^SMs|combine bf16 [^[]|combine bf16 \[EPX|zero-copy, graph" \
    epx_ht_gpu_bench --iters 20 --tokens $T --sms $sms
done
epx_batch_total
