#!/usr/bin/env bash
# tests/gpu/ep4_run.sh PHASE — issue 8 on nvidia-h200-x4 (4 GPUs; any R >= 2 works), in three
# calls of < 10 min each, one after the other on the same warm machine (phase 1 builds build/,
# the later phases reuse it). Logs under $OUT.
#   tests   the README's test command, GoogleTest part (`scripts/test.sh ctest`): the GPU tier at
#           R = 1, 2 and 4 (8 where 8 GPUs), the one-GPU multi-rank tier, the CPU tier
#   main    the README's test command, pytest part (GPU tier at R = 1, 2, 4), then the main job
#           (`scripts/run.sh`: the demo on every GPU, epx-bench ht / ll / a2a at EP = GPUs with
#           NCCL's all-to-all and the NVLink ceiling in the same run)
#   bench   (builds if needed) the tests the first x4 run failed, then EP = GPUs benches: ht
#           (T = 4096, 16-32 SMs, 3 copy paths), ll (T in 1..512), a2a; then, on 2 of the GPUs,
#           what kept_runs_run.sh measures (epx-bench's eager rows, the kept-run limit)
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
unset EPX_TIMEOUT_MS  # the library's default device timeout, as the README commands run
t0=$(date +%s)
B=build
G=$(nvidia-smi -L | wc -l)
summary() {  # FILE: the lines of a test log worth reading in the call's output tail
  grep -E "tests passed|tests failed|FAILED|Failed|SKIPPED \(|^== |Timeout|\*\*\*|passed|failed" \
    "$1" | grep -vE "^\[       OK|Passed +[0-9.]+ sec" | cut -c1-220 | head -60
}
case ${1:-} in
  tests)
    EPX_TEST_JOBS=8 timeout 560 bash scripts/test.sh ctest > "$OUT/ctest.log" 2>&1
    echo "== test.sh ctest rc=$? ($(( $(date +%s) - t0 )) s)"
    summary "$OUT/ctest.log"
    grep -E "Test +#[0-9]+: gpu_" "$OUT/ctest.log" | sed 's/  */ /g' | cut -c1-120
    ;;
  main)
    timeout 330 bash scripts/test.sh pytest > "$OUT/pytest.log" 2>&1
    echo "== test.sh pytest rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "R4|R8" "$OUT/pytest.log" | head -5
    tail -5 "$OUT/pytest.log"
    s=$(date +%s)
    timeout 220 bash scripts/run.sh > "$OUT/run.log" 2>&1
    echo "== run.sh rc=$? ($(( $(date +%s) - s )) s)"
    grep -E "^== |^ht\.|^ll\.|^a2a\.|PASS|FAIL|ranks|target|ceil" "$OUT/run.log" | cut -c1-200 |
      head -70
    ;;
  bench)
    # The build of the phases above (incremental; a fresh machine builds everything, ~40 s).
    source scripts/common.sh
    epx_setup_env
    epx_configure_and_build > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "== build done ($(( $(date +%s) - t0 )) s)"
    # Fixed tests first: the a2a R4 cases (test sizes fixed after the first x4 run) and the
    # one-GPU R2 ht case that timed out there (now with the flag values in the message).
    epx_batch_tests gpu_a2a_gpu_test 120 'Ranks/A2aGpu.*/R4'
    epx_device_tests "$B/tests/gpu/gpu_ht_test" 200 "waited|FAIL|Failure" \
      'Ranks/HtOneGpu.MatchesReference/R2' 'Ranks/HtOneGpu.MatchesReference/R2' |
      grep -v "^\[       OK"
    ROWS="^SMs|^ +[0-9]+ |dispatch|combine|NCCL|ceiling|runs"
    echo "-- ht EP$G T=4096"
    epx_batch_bench ht4096 150 "$ROWS" epx_ht_gpu_bench --ranks "$G" --iters 20 --tokens 4096 \
      --sms 16,24,32
    echo "-- ll EP$G"
    epx_batch_bench ll 90 "^ +(1|32|128|256|512) |target|ceiling|NCCL" epx_ll_gpu_bench \
      --ranks "$G" --tokens 1,32,128,256,512 --iters 20
    echo "-- a2a EP$G"
    epx_batch_bench a2a 90 "^ +[0-9]+ |target|ceiling|NCCL" epx_a2a_gpu_bench --ranks "$G" \
      --iters 20
    # On 2 of the GPUs: epx-bench's eager ht rows.
    export CUDA_VISIBLE_DEVICES=0,1
    epx_batch_epx_bench_ht 100 default
    ;;
  *)
    echo "usage: bash tests/gpu/ep4_run.sh tests|main|bench" >&2
    exit 2
    ;;
esac
epx_batch_total
