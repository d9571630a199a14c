#!/usr/bin/env bash
# tests/gpu/profile_run.sh — one bounded batch (< 4 min on 2 x H200): the Python extension, then
# bench/profile_kernels.py (torch.profiler kernel durations of ll / ht / a2a, SPEC 6), both ranks.
#   bash tests/gpu/profile_run.sh [extra profile_kernels.py flags]
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start_python || exit 1
epx_batch_profile 300 "^(op|ll|ht|a2a|profile)" "$@"
epx_batch_total
