#!/usr/bin/env bash
# tests/gpu/notify_run.sh — one bounded batch (< 6 min on 2 x H200), tenth session: the count
# exchange (ht_notify_kernel) with each token's ids loaded together and pass 2 reading pass 1's
# masks from shared memory. (1) the ht GPU tests, every copy path (one with the old kernel,
# kHtNotifyOld); (2) epx_ht_gpu_bench exact / worst-case rows new vs old in one process, T = 4096
# and 128; (3) bench/profile_kernels.py (kernel durations, torch.profiler); (4) epx-bench ht.
#   bash tests/gpu/notify_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start_python gpu_ht_test epx_ht_gpu_bench epx-bench || exit 1
epx_batch_tests gpu_ht_test 200 'HtKeptPlan.*:HtKeptCopies.*:HtGpu.*'
for T in 4096 128; do
  epx_batch_bench "ab$T" 120 "^ht T|\(exact|worst|\(cached\)|\(cached, zero-copy\)" \
    epx_ht_gpu_bench --iters 20 --tokens $T --sms 16 --copy ce:kept,warp
done
epx_batch_profile 200 "^(op|ll|ht|a2a|profile)" --iters 20
echo "== epx-bench ht"
epx_batch_epx_bench_ht 120 default
epx_batch_total
