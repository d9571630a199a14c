#!/usr/bin/env bash
# tests/gpu/staged_combine_run.sh — one bounded batch (< 6 min on 2 x H200), seventh session: the
# zero-copy combine's staged reducer (kernels/ht/combine_staged.cuh: row sources loaded by
# cp.async.bulk into shared memory, several chunks ahead, across tokens). Every ht GPU test (the
# copy paths include the register pair step under zero-copy and a 2 x 512 staging), then
# epx_ht_gpu_bench's zero-copy combine rows (graph) for several stagings against the register
# pair step, T = 4096 at 16, 24 and 32 SMs, T = 8192 at 16 and 32. Logs under $OUT.
#   bash tests/gpu/staged_combine_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 200 '*'
PULL=${PULL:-3x2048,2x3072,4x1536,2x3584,6x1024}  # the first run's list
echo "-- T = 4096"
epx_batch_bench t4096 200 "^SMs|zero-copy, graph|combine bf16 \[EPX|dispatch bf16 \(cached, zero-copy, g" \
  epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16,24,32 --copy ce:kept --pull "$PULL"
echo "-- T = 8192"
epx_batch_bench t8192 120 "^SMs|zero-copy, graph\)|register pair|combine bf16 \[EPX" \
  epx_ht_gpu_bench --iters 20 --tokens 8192 --sms 16,32 --copy ce:kept
epx_batch_total
