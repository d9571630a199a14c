#!/usr/bin/env bash
# tests/gpu/bf16hw_run.sh — one bounded batch (< 6 min on 2 x H200), fifth session: the hardware
# float32 -> bf16 conversion (core/numeric.h f32x2_to_bf16x2) in the ht and ll combines.
#   tests.log  NumericGpu (all 2^32 floats for e4m3 and bf16), every ht GPU test, every ll GPU test
#              (at that commit variants 0, 2, 8, 12 and 48 = both emulations;
#              now 0 and 48)
#   ht.log     epx_ht_gpu_bench T = 4096 at 16, 24, 32 SMs: combine default vs emulated rounding
#   ll.log     epx_ll_gpu_bench T = 128, 512: variant 0 vs 32 (combine's emulated rounding)
# Logs under $OUT.  bash tests/gpu/bf16hw_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_numeric_gpu_test gpu_ht_test gpu_ll_gpu_test epx_ll_gpu_bench \
  epx_ht_gpu_bench || exit 1
epx_batch_tests gpu_numeric_gpu_test 60 '*'
epx_batch_tests gpu_ht_test 240 '*'
epx_batch_tests gpu_ll_gpu_test 120 '*'
epx_batch_bench ht 150 "^SMs|combine|dispatch bf16 \(cached, graph\)|dispatch fp8 \(cached, graph\)" \
  epx_ht_gpu_bench --tokens 4096 --sms 16,24,32 --iters 20
epx_batch_bench ll 90 "^sweep|target|check" epx_ll_gpu_bench --tokens 128,512 --variant 0,32
epx_batch_total
