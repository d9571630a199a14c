#!/usr/bin/env bash
# tests/gpu/split_stream_run.sh — one bounded batch on ONE GPU (< 5 min; twelfth session): the
# split exact dispatch with its send kernel on a side stream (kHtSplitSend; now also under
# ce:kept), through the one-GPU ht tests (Ranks/HtOneGpu.* run it unsplit and split, R = 2, 4, 8)
# and the one-GPU proxy's A/B rows (epx_ht_onegpu_bench: "split" against the default; the
# default rows also note epx-bench's one-call-after-a-barrier time beside the back-to-back one).
#   bash tests/gpu/split_stream_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test epx_ht_onegpu_bench || exit 1
epx_batch_tests gpu_ht_test 200 \
  'HtKeptPlan.*:HtGpu.OneRank*:HtGpu.WorstCaseGraphReplaysOneRank' 'Ranks/HtOneGpu.*'
epx_batch_bench proxy4096 150 "dispatch|layout|proxy" epx_ht_onegpu_bench --sms 16
epx_batch_total
