#!/usr/bin/env bash
# tests/gpu/probe_run.sh — one bounded batch (< 4 min on 2 x H200), fifth session:
#   onegpu.log   Ranks/LlOneGpu.* x N1 and Ranks/HtOneGpu.* x N2 (the pageable-upload deadlock
#                fix in tests/gpu/gpu_support.cc; 5 s device timeout, so a deadlock costs ~10 s)
#   probe.log    epx_store_probe: per-CTA issue time of one ll message into the peer
# Logs under $OUT.  bash tests/gpu/probe_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
t0=$(date +%s)
epx_device_build build-dev gpu_ll_gpu_test gpu_ht_test epx_store_probe || exit 1
for i in $(seq 1 "${N1:-6}"); do
  timeout 60 build-dev/tests/gpu/gpu_ll_gpu_test --gtest_filter='Ranks/LlOneGpu.*' > "$OUT/one.log" 2>&1
  echo "ll-onegpu $i rc=$? $(grep -c '^\[       OK' "$OUT/one.log") ok ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/onegpu.log"
  grep -E "exception|Failure" "$OUT/one.log" | head -3 | cut -c1-300
done
for i in $(seq 1 "${N2:-3}"); do
  timeout 60 build-dev/tests/gpu/gpu_ht_test --gtest_filter='Ranks/HtOneGpu.*' > "$OUT/one.log" 2>&1
  echo "ht-onegpu $i rc=$? $(grep -c '^\[       OK' "$OUT/one.log") ok ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/onegpu.log"
  grep -E "exception|Failure" "$OUT/one.log" | head -3 | cut -c1-300
done
rm -f "$OUT/one.log"
P=build-dev/tests/gpu/epx_store_probe
{ timeout 20 $P --ctas 128 --tokens-per-cta 1; timeout 20 $P --ctas 64 --tokens-per-cta 2;
  timeout 20 $P --ctas 16 --tokens-per-cta 8; timeout 20 $P --ctas 1 --tokens-per-cta 1; } > "$OUT/probe.log" 2>&1
cat "$OUT/probe.log"
echo "== total $(( $(date +%s) - t0 )) s"
