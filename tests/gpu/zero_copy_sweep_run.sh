#!/usr/bin/env bash
# tests/gpu/zero_copy_sweep_run.sh — one bounded batch (< 4 min on 2 x H200), sixth session: the
# graph-replay and zero-copy ht GPU tests (after the test fix), then the zero-copy dispatch's
# sender batch (tokens per warp between two signals: each signal is a system-scope fence that
# waits for the warp's NVLink stores) swept: b4 (the default), b8, b16, b32.
# Logs under $OUT.  bash tests/gpu/zero_copy_sweep_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 120 '*ZeroCopy*:*Graph*'
for sms in 16 32; do
  epx_batch_bench b$sms 150 "^SMs|dispatch (bf16|fp8) \(cached, graph\)|zero-copy, graph" \
    epx_ht_gpu_bench --iters 20 --tokens 4096 --sms $sms \
    --copy ce:kept:combine,ce:kept:combine:b8,ce:kept:combine:b16,ce:kept:combine:b32
done
epx_batch_total
