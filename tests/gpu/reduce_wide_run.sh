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
epx_device_setup 5000
t0=$(date +%s)
B=build-dev
epx_device_build $B gpu_ht_test epx_ht_gpu_bench || exit 1
epx_device_tests $B/tests/gpu/gpu_ht_test 240 "rank [0-9]|case [0-9]|Failure|FAIL|exception" '*' |
  grep -v "^\[       OK" | head -30
for T in 4096 8192; do
  epx_device_run ht$T 90 $B/tests/gpu/epx_ht_gpu_bench --tokens $T --sms 16,24,32 --iters 20
  grep -E "^SMs|combine bf16 \[" "$OUT/ht$T.log" | sed 's/(sender CTAs.*//'
done
echo "== total $(( $(date +%s) - t0 )) s"
