#!/usr/bin/env bash
# tests/gpu/send_order2_run.sh — one bounded batch (< 5 min on 2 x H200), eighth session: the ht
# dispatch senders send batch gw first, then draw their next batches from a per-rank counter
# (after send_order_run.sh: drawing every batch was 2-5 us slower at T = 1024). The ht tests, then
# epx_ht_gpu_bench at T = 4096 (16, 24 SMs) and T = 128 / 1024 / 8192 at 16 SMs, ce:kept: the
# zero-copy graph rows beside their fixed-order rows (kHtSendStatic). Logs under $OUT.
#   bash tests/gpu/send_order2_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 200 '*'
ROWS="^SMs|zero-copy, g|graph of 10|fixed send|cached, graph\)"
echo "-- T = 4096"
epx_batch_bench t4096 150 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16,24 \
  --copy ce:kept
for T in 128 1024 8192; do
  echo "-- T = $T"
  epx_batch_bench t$T 100 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens $T --sms 16 --copy ce:kept
done
epx_batch_total
