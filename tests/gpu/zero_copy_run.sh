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
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 120 '*ZeroCopy*' '-*ZeroCopy*'
rows="^SMs|dispatch (bf16|fp8) \(cached, graph\)|dispatch bf16 \(exact\)|zero-copy"
epx_batch_bench ht4096 120 "$rows" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16,24,32
epx_batch_bench ht4096pct 120 "$rows" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 \
  --send-pct 75,94
epx_batch_bench ht8192 120 "$rows" epx_ht_gpu_bench --iters 20 --tokens 8192 --sms 16,32
epx_batch_total
