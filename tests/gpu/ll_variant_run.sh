#!/usr/bin/env bash
# tests/gpu/ll_variant_run.sh — one bounded batch (< 3 min on 2 x H200) for the ll dispatch
# variants (EPX_LL_VARIANT bits, src/cuda/kernels/ll/ll_layout.cuh; docs/perf-cuda-ll.md):
# a build with EPX_LL_TRACE=ON (as ll_trace_run.sh, so times compare with docs/perf.md), then
#   test.log      the ll GPU correctness tests; random, fixed and graph cases run every variant
#                 (tests/gpu/ll_gpu_test.cc kLlVariants) bit for bit against the oracle;
#   bench.log     T = 128 and 1 timed once per variant in one process (+ the bit-exact T = 128
#                 check per variant);
#   trace.log     the per-phase CTA trace at T = 128 for the default and the all-in variant.
# Logs under $OUT (default /tmp/epx-out).  bash tests/gpu/ll_variant_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
BUILD=${BUILD:-bt}
VARIANTS=${VARIANTS:-0,2,4,8,12}
t0=$(date +%s)
EPX_CMAKE_EXTRA="-DEPX_WITH_CUDA=ON -DEPX_LL_TRACE=ON" \
  epx_device_build "$BUILD" gpu_ll_gpu_test epx_ll_gpu_bench || exit 1
epx_device_run test ${T1:-90} "$BUILD/tests/gpu/gpu_ll_gpu_test" \
  --gtest_filter='Ranks/LlGpu.*:LlGpuGraph.*:LlGpuErrors.BadExpert*'
grep -E "^\[  (PASSED|FAILED) |^\[       OK|FAILED|variant" "$OUT/test.log" "$OUT/test.err" | head -40
B="$BUILD/tests/gpu/epx_ll_gpu_bench"
epx_device_run bench ${T2:-50} "$B" --tokens 128,1 --iters 20 --variant "$VARIANTS"
grep -vE "^\[bench" "$OUT/bench.log" | head -60
epx_device_run trace ${T3:-25} "$B" --trace-only --tokens 128 --variant 0,12
grep -E "^\[trace\]|SPAN|wait|scan|copies|sent|signal|last" "$OUT/trace.log" | head -120
echo "== total $(( $(date +%s) - t0 )) s"
