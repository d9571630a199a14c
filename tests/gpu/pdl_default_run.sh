#!/usr/bin/env bash
# tests/gpu/pdl_default_run.sh — one bounded batch (< 2 min on 2 x H200), eighth session: the ll
# bench with PDL off (EPX_PDL=0) and with the new default (EPX_PDL unset: ll kernels use PDL),
# same batch, T = 128 and 1: eager and graph rows. Logs under $OUT.
#   bash tests/gpu/pdl_default_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start epx_ll_gpu_bench || exit 1
for v in 0 default 0 default; do
  echo "-- EPX_PDL=$v"
  if [ "$v" = default ]; then
    epx_batch_bench ll$v 40 "^ +(1|128) " epx_ll_gpu_bench --tokens 128,1 --iters 20
  else
    EPX_PDL=$v epx_batch_bench ll$v 40 "^ +(1|128) " epx_ll_gpu_bench --tokens 128,1 --iters 20
  fi
done
epx_batch_total
