#!/usr/bin/env bash
# tests/gpu/zero_copy_all_run.sh — one bounded batch (< 5 min on 2 x H200), sixth session: the
# zero-copy ht dispatch with every CTA sending and then receiving. Every ht GPU test, then
# epx_ht_gpu_bench: T = 4096 at 16, 24, 32 SMs; the 14 + 2 split (--send-pct 88) at 16 SMs as
# the same-session A/B; T = 128, 512, 1024, 8192 for the sweep.
# Logs under $OUT.  bash tests/gpu/zero_copy_all_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 150 '*'
rows="^SMs|dispatch (bf16|fp8) \(cached(, graph)?\)|dispatch bf16 \(exact\)|zero-copy"
for T in 4096 128 512 1024 8192; do
  sms=16,32
  [ "$T" = 4096 ] && sms=16,24,32
  echo "-- T = $T"
  epx_batch_bench t$T 120 "$rows" epx_ht_gpu_bench --iters 20 --tokens $T --sms $sms
done
echo "-- T = 4096, --send-pct 88"
epx_batch_bench pct 120 "$rows" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --send-pct 88
epx_batch_total
