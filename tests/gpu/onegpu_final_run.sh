#!/usr/bin/env bash
# tests/gpu/onegpu_final_run.sh — one bounded batch on ONE GPU (< 6 min; twelfth session's last
# check): every ht GPU test that runs on one GPU (the 2-GPU ones skip), then the one-GPU
# side-stream paths (EPX_ONE_GPU_SIDE_STREAMS=1: ce:kept, the split dispatch, and with 16 SMs per
# rank the chunked combine via pull), then the one-GPU ll and a2a tests (the transport's
# hardware-queue rule changed).
#   bash tests/gpu/onegpu_final_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start gpu_ht_test gpu_ll_gpu_test gpu_a2a_gpu_test || exit 1
epx_batch_tests gpu_ht_test 240 '*'
EPX_ONE_GPU_SIDE_STREAMS=1 EPX_TEST_ONE_GPU_SMS=16 epx_batch_tests gpu_ht_test 150 \
  'Ranks/HtOneGpu.SideStream*/R2:Ranks/HtOneGpu.SideStream*/R4'
EPX_ONE_GPU_SIDE_STREAMS=1 epx_batch_tests gpu_ht_test 150 'Ranks/HtOneGpu.SideStream*'
epx_batch_tests gpu_ll_gpu_test 120 'Ranks/LlOneGpu.*'
epx_batch_tests gpu_a2a_gpu_test 120 'Ranks/A2aOneGpu.*'
epx_batch_total
