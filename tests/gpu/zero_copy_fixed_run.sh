#!/usr/bin/env bash
# tests/gpu/zero_copy_fixed_run.sh — one bounded batch (< 3 min on 2 x H200), seventh session:
# where the zero-copy ops' fixed cost sits. epx_ht_gpu_bench at 16 SMs, T = 128, 1024, 4096,
# under warp (the kernel places the kept rows) and ce:kept (copy engines copy them, the default),
# with the zero-copy combine also timed without topk_weights (no weights-mirror copy before the
# kernel). Logs under $OUT.   bash tests/gpu/zero_copy_fixed_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start epx_ht_gpu_bench || exit 1
for T in 128 1024 4096; do
  echo "-- T = $T"
  epx_batch_bench t$T 100 "^SMs|zero-copy, g|zero-copy, graph, no w" epx_ht_gpu_bench \
    --iters 20 --tokens $T --sms 16 --copy warp,ce:kept
done
epx_batch_total
