#!/usr/bin/env bash
# tests/gpu/zero_copy_all_run.sh — one bounded batch (< 5 min on 2 x H200), sixth session: the
# zero-copy ht dispatch with every CTA sending and then receiving. Every ht GPU test, then
# epx_ht_gpu_bench: T = 4096 at 16, 24, 32 SMs; the 14 + 2 split (--send-pct 88) at 16 SMs as
# the same-session A/B; T = 128, 512, 1024, 8192 for the sweep.
# Logs under $OUT.  bash tests/gpu/zero_copy_all_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 150 "rank [0-9]|case [0-9]|Failure|FAIL|exception" \
  '*' | grep -v "^\[       OK" | head -20
rows="^SMs|dispatch (bf16|fp8) \(cached(, graph)?\)|dispatch bf16 \(exact\)|zero-copy"
for T in 4096 128 512 1024 8192; do
  extra=(--sms 16,24,32)
  [ "$T" = 4096 ] || extra=(--sms 16,32)
  epx_device_run t$T 120 $B/tests/gpu/epx_ht_gpu_bench --iters 20 --tokens $T "${extra[@]}"
  echo "-- T = $T"
  grep -E "$rows" "$OUT/t$T.log" | cut -c1-110
  [ -s "$OUT/t$T.err" ] || rm -f "$OUT/t$T.err"
done
epx_device_run pct 120 $B/tests/gpu/epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --send-pct 88
echo "-- T = 4096, --send-pct 88"
grep -E "$rows" "$OUT/pct.log" | cut -c1-110
echo "== total $(( $(date +%s) - t0 )) s"
