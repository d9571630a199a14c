#!/usr/bin/env bash
# tests/gpu/kept_meta_run.sh — one bounded batch (< 6 min on 2 x H200), prepared in the tenth
# session (compiled, not yet run): a kept row's routing metadata with the id and weight loaded
# together (kHtKeptMetaLate = the loads in series, the A/B). (1) the ht GPU tests, every copy
# path, and the one-GPU R2/R4/R8 ones; (2) epx_ht_gpu_bench rows "exact[, zero-copy]" vs
# "..., kept metadata late", T = 4096, 16 SMs, ce:kept and warp; (3) epx-bench ht;
# (4) profile_kernels.py --ops ht (the dispatch kernel's own duration, exact vs cached).
#   bash tests/gpu/kept_meta_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start_python gpu_ht_test epx_ht_gpu_bench epx-bench || exit 1
epx_batch_tests gpu_ht_test 200 'HtKeptPlan.*:HtGpu.*:Ranks/HtOneGpu.*'
epx_batch_bench ab4096 90 "\(exact|worst|\(cached\)" \
  epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --copy ce:kept,warp
echo "== epx-bench ht"
epx_batch_epx_bench_ht 100 default
epx_batch_profile 100 "^(op|ht)" --ops ht --iters 20
epx_batch_total
