#!/usr/bin/env bash
# tests/gpu/zero_copy_run.sh — one bounded batch (< 5 min on 2 x H200), sixth session: the ht
# zero-copy dispatch (HtDispatchArgs::zero_copy; docs/perf-cuda-ht.md "Zero-copy dispatch").
#   tests.log  the zero-copy tests first (a late reader against a fast peer), then every other ht
#              GPU test (each case also under ce:kept:combine / warp / ce with zero_copy)
#   ht*.log    epx_ht_gpu_bench: rows "dispatch ... zero-copy" next to the copying dispatch,
#              T = 4096 at 16, 24, 32 SMs; the senders' share at 16 SMs; T = 8192
# Logs under $OUT.  bash tests/gpu/zero_copy_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 120 "rank [0-9]|case [0-9]|Failure|FAIL|exception" \
  '*ZeroCopy*' '-*ZeroCopy*' | grep -v "^\[       OK" | head -40
rows="^SMs|dispatch (bf16|fp8) \(cached, graph\)|dispatch bf16 \(exact\)|zero-copy"
bench() {  # NAME ARGS...
  local name=$1
  shift
  epx_device_run "$name" 120 $B/tests/gpu/epx_ht_gpu_bench --iters 20 "$@"
  grep -E "$rows" "$OUT/$name.log" | sed 's/(sender CTAs/(/'
  grep -iE "error|fail" "$OUT/$name.err" | head -5
  [ -s "$OUT/$name.err" ] || rm -f "$OUT/$name.err"
}
bench ht4096 --tokens 4096 --sms 16,24,32
bench ht4096pct --tokens 4096 --sms 16 --send-pct 75,94
bench ht8192 --tokens 8192 --sms 16,32
echo "== total $(( $(date +%s) - t0 )) s"
