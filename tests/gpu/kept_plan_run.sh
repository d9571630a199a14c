#!/usr/bin/env bash
# tests/gpu/kept_plan_run.sh — one bounded batch (< 7 min on 2 x H200), prepared in the ninth
# session (compiled, not yet run): the exact-mode ce:kept copy plan from the count exchange's
# mapped result (docs/perf.md, ninth session, item 7). (1) the ht GPU tests, every copy path
# (the new plan under ce:kept, the old one under the kHtKeptPlanCopied path); (2) its A/B in one
# process: epx_ht_gpu_bench rows "dispatch bf16 (exact)" vs "(exact, plan copied)" and the
# zero-copy pair, T = 4096, 16 SMs, ce:kept beside warp; (3) epx-bench ht eager under the default
# and warp (item 3's table: exact bf16 456.7 default vs 387.8 warp before the change).
#   bash tests/gpu/kept_plan_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON" epx_batch_start gpu_ht_test epx_ht_gpu_bench epx-bench ||
  exit 1
epx_batch_tests gpu_ht_test 240 'HtKeptPlan.*:HtKeptCopies.*:HtGpu.*:Ranks/HtOneGpu.*'
epx_batch_bench std 120 "runs|^SMs|\(exact|\(cached\)|host us" epx_ht_gpu_bench --iters 20 \
  --tokens 4096 --sms 16 --copy ce:kept,warp
epx_batch_epx_bench_ht_copies 120
epx_batch_total
