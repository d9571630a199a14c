#!/usr/bin/env bash
# tests/gpu/kept_meta_run.sh — one bounded batch (< 7 min on 2 x H200): the eleventh session's
# dispatch changes, measured on the one-GPU proxy only (docs/perf.md, eleventh session): a
# token's routing in registers (kHtKeptMetaLate = the loads at the stores, the A/B), the
# receivers' metadata per block (kHtRecvMetaRows = row by row), the count exchange on a cluster of
# CTAs (kHtNotifyOneCta = one CTA). (1) the ht GPU tests, every copy path (the A/B paths among
# them; new T > 1024 cases), and the one-GPU R2/R4/R8 ones; (2) epx_ht_gpu_bench rows "exact[,
# zero-copy]" / "worst-case" against "..., kept metadata late", "..., receive metadata by row",
# "..., metadata old" (both) and "..., count exchange on one CTA", T = 4096, 16 SMs, ce:kept and
# warp; (3) the phase trace of the zero-copy exact dispatch, new vs old metadata (a
# -DEPX_HT_TRACE=ON build); (4) epx-bench ht; (5) profile_kernels.py --ops ht.
#   bash tests/gpu/kept_meta_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start_python gpu_ht_test epx_ht_gpu_bench epx-bench || exit 1
epx_batch_tests gpu_ht_test 200 'HtKeptPlan.*:HtGpu.*:Ranks/HtOneGpu.*'
epx_batch_bench ab4096 90 "\(exact|worst|\(cached\)" \
  epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --copy ce:kept,warp
echo "== trace (EPX_HT_TRACE build)"
EPX_CMAKE_EXTRA="-DEPX_HT_TRACE=ON" epx_device_build bht epx_ht_gpu_bench &&
  B=bht epx_batch_bench trace4096 90 "^\[trace" \
    epx_ht_gpu_bench --trace --iters 20 --tokens 4096 --sms 16 --copy ce:kept
echo "== epx-bench ht"
epx_batch_epx_bench_ht 100 default
epx_batch_profile 100 "^(op|ht)" --ops ht --iters 20
epx_batch_total
