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
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 150 "rank [0-9]|case [0-9]|Failure|FAIL|exception" \
  '*' | grep -v "^\[       OK" | head -20
for T in 4096 8192; do
  epx_device_run t$T 120 $B/tests/gpu/epx_ht_gpu_bench --iters 20 --tokens $T --sms 16,32
  echo "-- T = $T"
  grep -E "^SMs|combine bf16" "$OUT/t$T.log" | grep -v "emulated\|narrow" |
    sed 's/(sender CTAs: //' | cut -c1-100
  [ -s "$OUT/t$T.err" ] || rm -f "$OUT/t$T.err"
done
echo "== total $(( $(date +%s) - t0 )) s"
