#!/usr/bin/env bash
# tests/gpu/zero_copy_sweep_run.sh — one bounded batch (< 4 min on 2 x H200), sixth session: the
# graph-replay and zero-copy ht GPU tests (after the test fix), then the zero-copy dispatch's
# sender batch (tokens per warp between two signals: each signal is a system-scope fence that
# waits for the warp's NVLink stores) swept: b4 (the default), b8, b16, b32.
# Logs under $OUT.  bash tests/gpu/zero_copy_sweep_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 120 "rank [0-9]|case [0-9]|Failure|FAIL|exception" \
  '*ZeroCopy*:*Graph*' | grep -v "^\[       OK" | head -20
rows="^SMs|dispatch (bf16|fp8) \(cached, graph\)|zero-copy, graph"
for sms in 16 32; do
  epx_device_run b$sms 150 $B/tests/gpu/epx_ht_gpu_bench --iters 20 --tokens 4096 --sms $sms \
    --copy ce:kept:combine,ce:kept:combine:b8,ce:kept:combine:b16,ce:kept:combine:b32
  grep -E "$rows" "$OUT/b$sms.log" | cut -c1-100
  [ -s "$OUT/b$sms.err" ] || rm -f "$OUT/b$sms.err"
done
echo "== total $(( $(date +%s) - t0 )) s"
