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
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 150 "rank [0-9]|case [0-9]|Failure|FAIL|exception" \
  '*' | grep -v "^\[       OK" | head -20
rows="^SMs|combine bf16|zero-copy, graph"
for T in 4096 1024 8192; do
  extra=(--sms 16,24,32)
  [ "$T" = 4096 ] || extra=(--sms 16,32)
  epx_device_run t$T 120 $B/tests/gpu/epx_ht_gpu_bench --iters 20 --tokens $T "${extra[@]}"
  echo "-- T = $T"
  grep -E "$rows" "$OUT/t$T.log" | grep -v "emulated\|narrow" | sed 's/(sender CTAs: //' | cut -c1-100
  [ -s "$OUT/t$T.err" ] || rm -f "$OUT/t$T.err"
done
echo "== total $(( $(date +%s) - t0 )) s"
