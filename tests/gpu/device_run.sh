#!/usr/bin/env bash
# tests/gpu/device_run.sh — one batch on a GPU machine: build the cuda backend, run the GPU tier
# test by test (each bounded), then the ht benchmark. Logs under $OUT (default /tmp/epx-out).
#   BENCH_ARGS="--sms 8,16,24,32" TESTS="OneRank TwoRanks" bash tests/gpu/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-10000}
export PATH="/opt/torch/.venv/bin:$PATH:/usr/local/cuda/bin"
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev}
{ date -u; nvidia-smi -L; nvidia-smi topo -m; nproc; } > "$OUT/env.log" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TOOLS=OFF \
         -DEPX_BUILD_PYTHON=OFF && \
       cmake --build "$BUILD" -j "$(nproc)" --target gpu_ht_test epx_ht_gpu_bench; } > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "== build: $(( $(date +%s) - t0 )) s"
TESTS=${TESTS:-"HtReference.* HtGpu.OneRankMatchesReference HtGpu.TwoRanksMatchReference HtGpu.WorstCaseGraphReplaysOneRank HtGpu.WorstCaseGraphReplaysTwoRanks HtGpu.DeviceErrorsAreReportedAndRecoverable HtGpu.MissingPeerTimesOut"}
for t in $TESTS; do
  s=$(date +%s)
  echo "==== $t" >> "$OUT/tests.log"
  timeout 240 "$BUILD/tests/gpu/gpu_ht_test" --gtest_filter="$t" > "$OUT/one.log" 2>&1
  rc=$?
  cat "$OUT/one.log" >> "$OUT/tests.log"
  echo "== test $t: rc=$rc ($(( $(date +%s) - s )) s)"
  [ $rc -ne 0 ] && grep -E "FAIL|rank [0-9]\]|Failure|error|Skipped" "$OUT/one.log" | head -15
done
rm -f "$OUT/one.log"
if [ "${RUN_BENCH:-1}" = 1 ]; then
  s=$(date +%s)
  timeout 240 "$BUILD/tests/gpu/epx_ht_gpu_bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  echo "== bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - s )) s)"
fi
