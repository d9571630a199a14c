#!/usr/bin/env bash
# tests/gpu/onegpu_trace_run.sh — one bounded batch (< 4 min, 1 GPU is enough): where each rank
# is when Ranks/HtOneGpu.MatchesReference/R2 times out (EPX_TEST_TRACE=1 step stamps, 5 s device
# timeout), 4 runs at the default SMs per rank (132 / 2), then 4 at 60 and 4 at 48 (slack on the
# GPU for anything else resident). Logs of failed runs under $OUT.
#   bash tests/gpu/onegpu_trace_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test || exit 1
export EPX_TEST_TRACE=1
for sms in default 60 48; do
  if [ "$sms" = default ]; then unset EPX_TEST_ONE_GPU_SMS; else export EPX_TEST_ONE_GPU_SMS=$sms; fi
  echo "-- SMs per rank: $sms"
  for i in 1 2 3 4; do
    s=$(date +%s)
    log="$OUT/r2_${sms}_$i.log"
    timeout 60 "$B/tests/gpu/gpu_ht_test" --gtest_filter='Ranks/HtOneGpu.MatchesReference/R2' \
      > "$log" 2>&1
    rc=$?
    echo "run $i: rc=$rc ($(( $(date +%s) - s )) s)"
    if [ $rc -ne 0 ]; then
      grep -E "^\[trace|waited" "$log" | grep -vE "rank [01]: (layout|exact dispatch)$" |
        cut -c1-230 | tail -16
    else
      rm -f "$log"
    fi
  done
done
epx_batch_total
