#!/usr/bin/env bash
# tests/gpu/send_order_run.sh — one bounded batch (< 6 min on 2 x H200), eighth session: the ht
# dispatch senders draw their token batches from a per-rank counter (kernels/ht/dispatch.cuh)
# instead of the fixed order (kHtSendStatic, the A/B). The 2-GPU and one-GPU ht tests (every
# copy path, plus the fixed order under zero-copy warp and bulk), then epx_ht_gpu_bench at
# T = 4096 (16, 24, 32 SMs; ce:kept, ce:kept:b2, ce:kept:b8) and T = 128 / 1024 / 8192 at 16 SMs:
# the zero-copy graph rows beside their fixed-order rows. Logs under $OUT.
#   bash tests/gpu/send_order_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 200 '*'
ROWS="^SMs|zero-copy, g|graph of 10|fixed send|cached, graph\)"
echo "-- T = 4096"
epx_batch_bench t4096 150 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16,24,32 \
  --copy ce:kept,ce:kept:b2,ce:kept:b8
for T in 128 1024 8192; do
  echo "-- T = $T"
  epx_batch_bench t$T 100 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens $T --sms 16 --copy ce:kept
done
epx_batch_total
