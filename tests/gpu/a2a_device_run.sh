#!/usr/bin/env bash
# tests/gpu/a2a_device_run.sh — one batch of the a2a work on a GPU machine: build the a2a GPU test
# and benchmark, run the test suites one by one (each bounded), then the benchmark. Logs under
# $OUT (default /tmp/epx-out). Results are recorded in docs/perf-cuda-a2a.md.
#   TESTS="Ranks/A2aGpu.*R2*" BENCH_ARGS="--tokens 128,4096" bash tests/gpu/a2a_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 10000
BUILD=${BUILD:-build-dev-a2a}
epx_device_build "$BUILD" gpu_a2a_gpu_test epx_a2a_gpu_bench || exit 1
TESTS=${TESTS:-"A2aGpuWorkspace.* Ranks/A2aGpu.*/R1 Ranks/A2aGpu.*/R2 A2aGpuErrors.*"}
# shellcheck disable=SC2086
epx_device_tests "$BUILD/tests/gpu/gpu_a2a_gpu_test" "${TEST_TIMEOUT:-120}" \
  "rank [0-9]|Failure|error|mismatch|differ|Expected" $TESTS
epx_device_bench "$BUILD/tests/gpu/epx_a2a_gpu_bench" "${BENCH_TIMEOUT:-150}"
