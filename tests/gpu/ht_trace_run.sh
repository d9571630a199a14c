#!/usr/bin/env bash
# tests/gpu/ht_trace_run.sh — one bounded batch (< 2.5 min on 2 x H200): where the ht zero-copy
# ops' fixed cost goes. A build with -DEPX_HT_TRACE=ON (kernels/ht/trace.cuh: thread 0 of every
# CTA stamps %globaltimer at each phase of the dispatch and of the staged combine), then
# epx_ht_gpu_bench --trace at T = 1 and 4096, 16 SMs: per rank and phase, min / median / max over
# CTAs after the first CTA entry, and the kernel span, beside the empty-kernel and NCCL 16-byte
# rows (the launch / timing overhead and another op's fixed cost). Logs under $OUT.
#   bash tests/gpu/ht_trace_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
t0=$(date +%s)
B=bht
EPX_CMAKE_EXTRA="-DEPX_HT_TRACE=ON" epx_device_build "$B" epx_ht_gpu_bench || exit 1
for T in 1 4096; do
  echo "-- T = $T"
  epx_batch_bench trace$T 90 "^\[trace|graph of 10|empty kernel|16 B per|zero-copy, graph\)" \
    epx_ht_gpu_bench --trace --iters 20 --tokens $T --sms 16
done
epx_batch_total
