#!/usr/bin/env bash
# tests/gpu/ll_trace_run.sh — one bounded batch (< 3 min on 2 x H200) for the ll latency work:
# a build with EPX_LL_TRACE=ON, then
#   trace.log     timings (T = 128, 1, 512) + the per-phase CTA trace of every T, both ranks
#                 (the bit-exact T = 128 check runs first, on the traced kernels);
#   sms64.log     the same workload at T = 128 and 1 with 64 CTAs (trace only: launch width);
#   variant1.log  T = 128 timings with EPX_LL_VARIANT=1 (the row copies one load at a time, as
#                 before kLlCopyBatch): A/B of the batched copy against trace.log's row.
# Logs under $OUT (default /tmp/epx-out).  bash tests/gpu/ll_trace_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
BUILD=${BUILD:-bt}
t0=$(date +%s)
EPX_CMAKE_EXTRA="-DEPX_LL_TRACE=ON" epx_device_build "$BUILD" epx_ll_gpu_bench || exit 1
B="$BUILD/tests/gpu/epx_ll_gpu_bench"
epx_device_run trace ${T1:-80} "$B" --trace --tokens 128,1,512 --iters 20
grep -vE "^\[bench" "$OUT/trace.log" | head -400
epx_device_run sms64 ${T2:-30} "$B" --trace-only --tokens 128,1 --sms 64
grep -E "^\[trace\]|SPAN|exit|pulls|copies|wait" "$OUT/sms64.log" | head -120
EPX_LL_VARIANT=1 epx_device_run variant1 ${T3:-30} "$B" --tokens 128 --iters 20
grep -vE "^\[bench" "$OUT/variant1.log" | grep -v "^\[trace" | head -20
echo "== total $(( $(date +%s) - t0 )) s"
