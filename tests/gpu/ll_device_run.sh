#!/usr/bin/env bash
# tests/gpu/ll_device_run.sh — one batch of the ll work on a GPU machine: build the ll GPU test and
# benchmark, run the test suites one by one (each bounded), then the benchmark. Logs under $OUT
# (default /tmp/epx-out). Results are recorded in docs/perf-cuda-ll.md.
#   TESTS="Ranks/LlGpu.*/R2" BENCH_ARGS="--tokens 128" bash tests/gpu/ll_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-5000}
export PATH="/opt/torch/.venv/bin:$PATH:/usr/local/cuda/bin"
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev-ll}
{ date -u; nvidia-smi -L; nvidia-smi topo -m; nproc; } > "$OUT/env.log" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TOOLS=OFF \
         -DEPX_BUILD_PYTHON=OFF && \
       cmake --build "$BUILD" -j 16 --target gpu_ll_gpu_test epx_ll_gpu_bench; } \
     > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "== build: $(( $(date +%s) - t0 )) s"
TESTS=${TESTS:-"LlGpuMemory.* LlGpuErrors.HookMisuseAndCapacity Ranks/LlGpu.*/R1 Ranks/LlGpu.*/R2 LlGpuGraph.* LlGpuErrors.BadExpert* LlGpuErrors.MissingPeer*"}
for t in $TESTS; do
  s=$(date +%s)
  echo "==== $t" >> "$OUT/tests.log"
  timeout ${TEST_TIMEOUT:-90} "$BUILD/tests/gpu/gpu_ll_gpu_test" --gtest_filter="$t" \
    > "$OUT/one.log" 2>&1
  rc=$?
  cat "$OUT/one.log" >> "$OUT/tests.log"
  echo "== test $t: rc=$rc ($(( $(date +%s) - s )) s)"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|FAILED  \]" "$OUT/one.log" | head -20
  [ $rc -ne 0 ] && grep -E "rank [0-9]|case [0-9]|Failure|error|mismatch|expected|exception" \
    "$OUT/one.log" | cut -c1-400 | head -25
done
rm -f "$OUT/one.log"
if [ "${RUN_BENCH:-1}" = 1 ]; then
  s=$(date +%s)
  timeout ${BENCH_TIMEOUT:-120} "$BUILD/tests/gpu/epx_ll_gpu_bench" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
  echo "== bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - s )) s)"
fi
