#!/usr/bin/env bash
# tests/gpu/final8_run.sh — one bounded batch (< 9 min on 2 x H200), eighth session: the zero-copy
# dispatch rows at T = 4096 / 8192 (16 SMs, ce:kept) after the fp8 scale words moved into
# registers a token ahead (kernels/ht/dispatch.cuh TokenScales), then the README's test command
# (ll kernels now launched with PDL by default) and the main job. Logs under $OUT.
#   bash tests/gpu/final8_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start epx_ht_gpu_bench || exit 1
ROWS="^SMs|zero-copy, graph\)|graph of 10|fixed send"
for T in 4096 8192; do
  echo "-- T = $T"
  epx_batch_bench t$T 60 "$ROWS" epx_ht_gpu_bench --iters 20 --tokens $T --sms 16
done
echo "-- README test command"
EPX_TEST_JOBS=8 timeout 420 bash scripts/test.sh > "$OUT/test.log" 2>&1
echo "test.sh rc=$?"
grep -E "tests passed|FAILED|Failed|SKIPPED \[|passed,|== all|\*\*\*" "$OUT/test.log" | head -20
echo "-- main job"
timeout 100 bash scripts/run.sh > "$OUT/run.log" 2>&1
echo "run.sh rc=$?"
grep -E "^(ht|ll|a2a)\.|check:|main job" "$OUT/run.log" | cut -c1-150
epx_batch_total
