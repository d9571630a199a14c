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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-5000}
export PATH="/opt/torch/.venv/bin:$PATH:/usr/local/cuda/bin"
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
BUILD=${BUILD:-bt}
VARIANTS=${VARIANTS:-0,2,4,8,12}
t0=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_WITH_CUDA=ON \
         -DEPX_LL_TRACE=ON -DEPX_BUILD_TOOLS=OFF -DEPX_BUILD_PYTHON=OFF && \
       cmake --build "$BUILD" -j 16 --target gpu_ll_gpu_test epx_ll_gpu_bench; } \
     > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "== build: $(( $(date +%s) - t0 )) s"
run() {  # name timeout args...
  local name=$1 limit=$2
  shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2> "$OUT/$name.err"
  echo "== $name rc=$? ($(( $(date +%s) - s )) s)"
}
run test ${T1:-90} "$BUILD/tests/gpu/gpu_ll_gpu_test" \
  --gtest_filter='Ranks/LlGpu.*:LlGpuGraph.*:LlGpuErrors.BadExpert*'
grep -E "^\[  (PASSED|FAILED) |^\[       OK|FAILED|variant" "$OUT/test.log" "$OUT/test.err" | head -40
B="$BUILD/tests/gpu/epx_ll_gpu_bench"
run bench ${T2:-50} "$B" --tokens 128,1 --iters 20 --variant "$VARIANTS"
grep -vE "^\[bench" "$OUT/bench.log" | head -60
run trace ${T3:-25} "$B" --trace-only --tokens 128 --variant 0,12
grep -E "^\[trace\]|SPAN|wait|scan|copies|sent|signal|last" "$OUT/trace.log" | head -120
echo "== total $(( $(date +%s) - t0 )) s"
