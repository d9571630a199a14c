#!/usr/bin/env bash
# tests/gpu/fp8hw_run.sh — one bounded batch (< 7 min on 2 x H200), fifth session: the hardware
# float32 -> e4m3 conversion (core/numeric.h f32x2_to_fp8x2_e4m3) in the ll send and the quant
# kernels.
#   tests.log  NumericGpu (all 2^32 floats, hardware vs emulation), the quant GPU tests, every ll
#              GPU test (at that commit variants 0, 2, 8, 12 and 16 = the emulation; now 0 and 48)
#   probe.log  epx_store_probe (fp8-hw8B vs fp8-8B: the conversion alone)
#   bench.log  epx_ll_gpu_bench, T in {1, 32, 128, 256, 512}, variant 0 (hardware) and 16
#              (emulation) in the same process
# Logs under $OUT.  bash tests/gpu/fp8hw_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_numeric_gpu_test gpu_quant_gpu_test gpu_ll_gpu_test epx_ll_gpu_bench \
  epx_store_probe || exit 1
epx_batch_tests gpu_numeric_gpu_test 60 '*'
epx_batch_tests gpu_quant_gpu_test 120 '*'
epx_batch_tests gpu_ll_gpu_test 240 '*'
timeout 20 $B/tests/gpu/epx_store_probe --ctas 128 --tokens-per-cta 1 > "$OUT/probe.log" 2>&1
cat "$OUT/probe.log"
BENCH_ARGS="--tokens 128,1,32,256,512 --variant 0,16" epx_device_bench $B/tests/gpu/epx_ll_gpu_bench 150 > /dev/null
grep -vE "^\[bench|^\[trace" "$OUT/bench.log" | tail -45
epx_batch_total
