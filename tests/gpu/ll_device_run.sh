#!/usr/bin/env bash
# tests/gpu/ll_device_run.sh — one batch of the ll work on a GPU machine: build the ll GPU test and
# benchmark, run the test suites one by one (each bounded), then the benchmark. Logs under $OUT
# (default /tmp/epx-out). Results are recorded in docs/perf-cuda-ll.md.
#   TESTS="Ranks/LlGpu.*/R2" BENCH_ARGS="--tokens 128" bash tests/gpu/ll_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_device_setup 5000
BUILD=${BUILD:-build-dev-ll}
epx_device_build "$BUILD" gpu_ll_gpu_test epx_ll_gpu_bench || exit 1
TESTS=${TESTS:-"LlGpuMemory.* LlGpuErrors.HookMisuseAndCapacity Ranks/LlGpu.*/R1 Ranks/LlGpu.*/R2 LlGpuGraph.* LlGpuErrors.BadExpert* LlGpuErrors.MissingPeer* LlGpuLifetime.* Ranks/LlOneGpu.*"}
# shellcheck disable=SC2086
epx_device_tests "$BUILD/tests/gpu/gpu_ll_gpu_test" "${TEST_TIMEOUT:-90}" \
  "rank [0-9]|case [0-9]|Failure|error|mismatch|expected|exception" $TESTS
epx_device_bench "$BUILD/tests/gpu/epx_ll_gpu_bench" "${BENCH_TIMEOUT:-120}"
