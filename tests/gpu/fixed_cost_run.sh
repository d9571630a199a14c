#!/usr/bin/env bash
# tests/gpu/fixed_cost_run.sh — one bounded batch (< 2 min on 2 x H200), seventh session: the
# fixed cost of the ops. epx_ht_gpu_bench at T = 1 and 4096, 16 SMs (zero-copy rows, NCCL's
# all-to-all of 16 B per peer: the fixed cost of any op that waits for its peer, launch skew
# included), then epx_ll_gpu_bench at T = 128 and 1 with 128 (default) and 64 CTAs.
#   bash tests/gpu/fixed_cost_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start epx_ht_gpu_bench epx_ll_gpu_bench || exit 1
for T in 1 4096; do
  echo "-- ht T = $T"
  epx_batch_bench ht$T 60 "^SMs|zero-copy, g|combine bf16  |16 B per peer" epx_ht_gpu_bench \
    --iters 30 --tokens $T --sms 16
done
echo "-- ll"
epx_batch_bench ll 100 "." epx_ll_gpu_bench --tokens 128,1 --iters 20 \
  --sms 128,64
epx_batch_total
