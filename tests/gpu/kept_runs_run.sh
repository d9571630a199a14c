#!/usr/bin/env bash
# tests/gpu/kept_runs_run.sh — one bounded batch (< 9 min on 2 x H200), prepared in the eighth
# session (compiled, not yet run): (1) the 2-GPU ht tests, whose top_k = 1 case (~100 runs of
# kept tokens) now takes the kernel path under ce:kept (ht_kept_copies_pay), and the test where
# most sender batches are drawn (2 SMs, every copy path); (2) the cost that
# limit avoids: epx_ht_gpu_bench --topk 1 (rank 0 keeps ~T/4 runs) under ce:kept with the
# library's limit and with --kept-runs 1000000 (every run a copy call), warp beside them — the
# "host us per cached bf16 call" and eager rows; (3) the ll graph A/B of PDL (EPX_PDL=0 vs the
# default, ll kernels with PDL) with the bench's graph timer fixed (69c60ce); (4) epx-bench's
# eager zero-copy dispatch rows against the ht bench's host times. Logs under $OUT.
#   bash tests/gpu/kept_runs_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON" epx_batch_start gpu_ht_test epx_ht_gpu_bench \
  epx_ll_gpu_bench epx-bench || exit 1
epx_batch_tests gpu_ht_test 240 \
  'HtGpu.TwoRanksMatchReference:HtGpu.DrawnSenderBatchesTwoRanks:HtKeptCopies.*'
epx_batch_kept_runs_ab
# (4) Why epx-bench's eager zero-copy dispatch rows sit ~50 us above epx_ht_gpu_bench's: the ht
# bench's host time per zero-copy call at the standard workload, then epx-bench ht without
# --check, under the default copy path and under warp.
echo "-- standard workload, host time per call"
epx_batch_bench std 90 "runs|host us|\(cached, zero-copy\) |zero-copy, graph\)" epx_ht_gpu_bench \
  --iters 20 --tokens 4096 --sms 16 --copy ce:kept,warp
epx_batch_epx_bench_ht_copies 120
for v in 0 default 0 default; do
  echo "-- ll, EPX_PDL=$v"
  if [ "$v" = default ]; then
    epx_batch_bench ll$v 40 "^ +(1|128) |target" epx_ll_gpu_bench --tokens 128,1 --iters 20
  else
    EPX_PDL=$v epx_batch_bench ll$v 40 "^ +(1|128) |target" epx_ll_gpu_bench --tokens 128,1 \
      --iters 20
  fi
done
epx_batch_total
