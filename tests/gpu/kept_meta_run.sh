#!/usr/bin/env bash
# tests/gpu/kept_meta_run.sh STAGE — bounded batches on 2 x H200 for the eleventh session's
# dispatch changes, measured on the one-GPU proxy only (docs/perf.md, eleventh session): a
# token's routing in registers (kHtKeptMetaLate = the loads at the stores, the A/B), the
# receivers' metadata per block (kHtRecvMetaRows = row by row), the count exchange on a cluster of
# CTAs (kHtNotifyOneCta = one CTA), the split exact dispatch (kHtSplitSend, opt-in; since the
# twelfth session on a side stream, also under ce:kept), and the twelfth session's opt-in copying
# paths: the combine through the pull protocol (kHtCombineViaPull; chunked, kHtCombineViaPullWhole
# = the whole copy first) and the dispatch through the zero-copy kernels (kHtDispatchViaZeroCopy).
#   bash tests/gpu/kept_meta_run.sh tests   (< 8 min) the ht GPU tests, every copy path (the A/B
#                                            paths among them; T > 1024 cases)
#   bash tests/gpu/kept_meta_run.sh bench   (< 5 min) epx_ht_gpu_bench rows "exact[, zero-copy]"
#       / "worst-case" against "..., kept metadata late", "..., receive metadata by row",
#       "..., metadata old", "..., count exchange on one CTA", "exact, split", "combine bf16"
#       against "combine bf16 (via pull ...)", "dispatch ... (cached)" / "(exact)" against "...,
#       via zero-copy kernels", T = 4096, 16 SMs, ce:kept and warp; the phase trace of the
#       zero-copy exact dispatch (-DEPX_HT_TRACE=ON)
#   bash tests/gpu/kept_meta_run.sh epx     (< 6 min) epx-bench ht, --timing barrier and pipelined,
#       and with the opt-in copying paths (--ht-switches, checked)
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
case ${1:-} in
  tests)
    epx_batch_start gpu_ht_test || exit 1
    epx_batch_tests gpu_ht_test 420 'HtKeptPlan.*:HtGpu.*'
    # (Ranks/HtOneGpu.* passed on one GPU in the eleventh session: EPX_ONE_GPU=1 adds them.)
    [ "${EPX_ONE_GPU:-0}" = 1 ] && epx_batch_tests gpu_ht_test 120 'Ranks/HtOneGpu.*'
    ;;
  bench)
    EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON" epx_batch_start epx_ht_gpu_bench || exit 1
    epx_batch_bench ab4096 100 "\(exact|worst|\(cached|combine bf16" \
      epx_ht_gpu_bench --iters 20 --tokens 4096 --sms 16 --copy ce:kept,warp
    echo "== trace (EPX_HT_TRACE build)"
    EPX_CMAKE_EXTRA="-DEPX_HT_TRACE=ON" epx_device_build bht epx_ht_gpu_bench &&
      B=bht epx_batch_bench trace4096 90 "^\[trace" \
        epx_ht_gpu_bench --trace --iters 20 --tokens 4096 --sms 16 --copy ce:kept
    ;;
  epx)
    EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON" epx_batch_start epx-bench || exit 1
    echo "== epx-bench ht (each call alone after a barrier; then pipelined, DeepEP's method)"
    epx_batch_epx_bench_ht 100 default
    epx_batch_epx_bench_ht 100 pipelined --timing pipelined
    echo "== epx-bench ht --check with the opt-in copying paths (combine via pull, dispatch via"
    echo "   the zero-copy kernels: --ht-switches 1572864), both timings"
    epx_batch_epx_bench_ht 150 via --ht-switches 1572864 --check
    grep -E "check:" "$OUT/eb_via.log"
    epx_batch_epx_bench_ht 100 via_pipelined --ht-switches 1572864 --timing pipelined
    ;;
  *)
    echo "usage: bash tests/gpu/kept_meta_run.sh tests|bench|epx" >&2
    exit 2
    ;;
esac
epx_batch_total
