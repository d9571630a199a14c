#!/usr/bin/env bash
# tests/gpu/reduce_wide_run.sh — one bounded batch (< 4 min on 2 x H200), prepared in the fifth
# session: the ht combine reducers' wide step (cuda/tuning.h kHtReduceWide: 6 vectors per lane,
# 2 sources at a time, its own kernel instantiation; docs/perf-cuda-ht.md "Prepared").
#   tests.log  every ht GPU test (the copy paths now include warp + wide and
#              ce:kept:combine + wide + emulated bf16 rounding), bit for bit
#   ht*.log    epx_ht_gpu_bench T = 4096 and 8192 at 16, 24, 32 SMs: rows "combine bf16
#              [EPX_HT_COPY / default]" vs "[default, wide reducer step]", same process
# Logs under $OUT.  bash tests/gpu/reduce_wide_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_ht_test 240 '*'
for T in 4096 8192; do
  epx_batch_bench ht$T 90 "^SMs|combine bf16 \[" epx_ht_gpu_bench --tokens $T --sms 16,24,32 \
    --iters 20
done
epx_batch_total
