#!/usr/bin/env bash
# tests/gpu/ll_final_run.sh — one bounded batch on ONE GPU (< 8 min; thirteenth session's check of
# the ll changes): a Release build (no trace) of the ll and Dispatcher GPU tests and the ll bench,
#   tests      every ll GPU test that runs on one GPU (R = 1, one-GPU R = 2 / 4 / 8, the R = 1
#              graph replays, errors and memory; the 2-GPU ones skip) under every EPX_LL_VARIANT
#              path the tests loop over, and the Dispatcher GPU tests (ll through the Dispatcher)
#   bench      epx_ll_gpu_bench --ranks 1 --experts 128 (the proxy of one EP2 rank's receive),
#              T = 128, 1, 32, 256, 512, the A/B variants $VARIANTS in one process
# then (trace build) the per-phase trace of the proxy at T = 128 (tests/gpu/ll_proxy_run.sh).
#   bash tests/gpu/ll_final_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ll_gpu_test gpu_dispatcher_gpu_test epx_ll_gpu_bench || exit 1
epx_batch_tests gpu_ll_gpu_test 240 '*'
epx_batch_tests gpu_dispatcher_gpu_test 120 '*'
epx_batch_bench bench ${T1:-120} '^ +[0-9]+ +-?[0-9]+ \||^sweep' epx_ll_gpu_bench --ranks 1 \
  --experts 128 --tokens 128,1,32,256,512 --iters 30 --variant "${VARIANTS:--1,64,128,256}"
epx_batch_total
