#!/usr/bin/env bash
# tests/gpu/ll_proxy_run.sh — one bounded batch on ONE GPU (< 4 min; thirteenth session): the ll
# dispatch's receive half on a one-GPU proxy. One rank with E = 128 has one EP2 rank's receive
# work at T = 128 (128 local experts, ~8 rows each, one expert per CTA); nothing crosses NVLink,
# so the send and hand-off phases are NOT EP2's (see docs/perf-cuda-ll.md, "Thirteenth session").
# A trace build (EPX_LL_TRACE=ON), then
#   r1e128.log   timings + per-phase CTA trace, T = 128 and 1, variants $VARIANTS (A/B in one
#                process; default "-1": no override)
#   r1e256.log   the same with E = 256 (two experts per CTA)
#   tests        the ll GPU tests that run on one GPU (R = 1, one-GPU R = 2/4/8) under every
#                variant of $TEST_VARIANTS (EPX_LL_VARIANT)
#   bash tests/gpu/ll_proxy_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_LL_TRACE=ON" epx_batch_start epx_ll_gpu_bench gpu_ll_gpu_test || exit 1
V=${VARIANTS:--1}
ROWS='^\[trace\]|^ *(T|[0-9])|var|disp|comb|SPAN|span|phase'
epx_batch_bench r1e128 ${T1:-90} "$ROWS" epx_ll_gpu_bench --ranks 1 --experts 128 --trace \
  --tokens 128,1 --iters 20 --variant "$V"
epx_batch_bench r1e256 ${T2:-60} "$ROWS" epx_ll_gpu_bench --ranks 1 --trace --tokens 128 \
  --iters 20 --variant "$V"
for tv in ${TEST_VARIANTS:-0}; do
  echo "== tests under EPX_LL_VARIANT=$tv"
  EPX_LL_VARIANT=$tv epx_batch_tests gpu_ll_gpu_test 120 'Ranks/LlGpu.*/R1:Ranks/LlOneGpu.*'
done
epx_batch_total
