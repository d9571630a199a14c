#!/usr/bin/env bash
# tests/gpu/split_stream_run.sh — one bounded batch on ONE GPU (< 5 min; twelfth session): the
# split exact dispatch with its send kernel on a side stream (kHtSplitSend; now also under
# ce:kept), through the one-GPU ht tests (Ranks/HtOneGpu.* run it unsplit and split, R = 2, 4, 8)
# and the one-GPU proxy's A/B rows (epx_ht_onegpu_bench: "split" against the default; the
# default rows also note epx-bench's one-call-after-a-barrier time beside the back-to-back one);
# then epx-bench ht on one rank, checked, under --timing barrier and pipelined.
#   bash tests/gpu/split_stream_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON" epx_batch_start gpu_ht_test epx_ht_onegpu_bench epx-bench ||
  exit 1
# (The side-stream paths run in the one-GPU mode only with EPX_ONE_GPU_SIDE_STREAMS=1.)
export EPX_ONE_GPU_SIDE_STREAMS=1
epx_batch_tests gpu_ht_test 200 \
  'HtKeptPlan.*:HtGpu.OneRank*:HtGpu.WorstCaseGraphReplaysOneRank' 'Ranks/HtOneGpu.*'
epx_batch_bench proxy4096 150 "dispatch|layout|proxy" epx_ht_onegpu_bench --sms 16
for t in barrier pipelined; do
  echo "== epx-bench ht --ranks 1 --timing $t --check"
  epx_batch_epx_bench_ht 120 r1_$t --ranks 1 --iters 20 --check --timing $t
  grep -E "timing|check:" "$OUT/eb_r1_$t.log"
done
epx_batch_total
