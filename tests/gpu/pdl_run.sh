#!/usr/bin/env bash
# tests/gpu/pdl_run.sh — one bounded batch (< 3.5 min on 2 x H200), seventh session: programmatic
# dependent launch (EPX_PDL=1, cuda/launch.h) for the ht and ll kernels, default off. The ll GPU
# tests with EPX_PDL=1 (graphs with and without hooks included), the same-process-free A/B of
# the benches (EPX_PDL=0 then 1: ll T = 128 and 1, graph rows of 20 ops; ht T = 4096 at 16 SMs,
# graphs of 10 calls), then the 2-GPU ht graph and zero-copy tests with EPX_PDL=1.
#   bash tests/gpu/pdl_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test gpu_ll_gpu_test epx_ht_gpu_bench epx_ll_gpu_bench || exit 1
EPX_PDL=1 epx_batch_tests gpu_ll_gpu_test 60 '*'
for v in 0 1; do
  echo "-- EPX_PDL=$v"
  EPX_PDL=$v epx_batch_bench ll$v 40 "^ +(1|128) " epx_ll_gpu_bench --tokens 128,1 --iters 20
  EPX_PDL=$v epx_batch_bench ht$v 40 "graph of 10|zero-copy, graph\)" epx_ht_gpu_bench \
    --iters 20 --tokens 4096 --sms 16
done
EPX_PDL=1 epx_batch_tests gpu_ht_test 80 'HtGpu.WorstCaseGraphReplaysTwoRanks' \
  'HtGpu.ZeroCopyViewSurvivesAFastPeer:HtGpu.DeviceErrorsAreReportedAndRecoverable'
epx_batch_total
