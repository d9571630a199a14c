#!/usr/bin/env bash
# tests/gpu/device_run.sh — one batch on a GPU machine: build the cuda backend, run the GPU tier
# test by test (each bounded), then the ht benchmark. Logs under $OUT (default /tmp/epx-out).
#   BENCH_ARGS="--sms 8,16,24,32" TESTS="OneRank TwoRanks" bash tests/gpu/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 10000
BUILD=${BUILD:-build-dev}
epx_device_build "$BUILD" gpu_ht_test epx_ht_gpu_bench || exit 1
TESTS=${TESTS:-"HtReference.* HtGpu.OneRankMatchesReference HtGpu.TwoRanksMatchReference HtGpu.WorstCaseGraphReplaysOneRank HtGpu.WorstCaseGraphReplaysTwoRanks HtGpu.DeviceErrorsAreReportedAndRecoverable HtGpu.MissingPeerTimesOut"}
# shellcheck disable=SC2086
epx_device_tests "$BUILD/tests/gpu/gpu_ht_test" 240 "FAIL|rank [0-9]\]|Failure|error|Skipped" $TESTS
epx_device_bench "$BUILD/tests/gpu/epx_ht_gpu_bench" 240
