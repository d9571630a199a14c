# tests/gpu/device_lib.sh — what the one-batch device scripts share (sourced from the repository
# root): the GPU-machine environment, a bounded Release build of some targets, test filters run
# one by one (each bounded), and a bounded benchmark. Logs under $OUT (default /tmp/epx-out).

# epx_device_setup DEFAULT_TIMEOUT_MS: the environment every process on the GPU machines gets
# (never NVLink multicast), $OUT, and $OUT/env.log (GPUs, topology, cores).
epx_device_setup() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN} EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-$1}
  export PATH="/opt/torch/.venv/bin:$PATH:/usr/local/cuda/bin"
  OUT=${OUT:-/tmp/epx-out}
  mkdir -p "$OUT"
  { date -u; nvidia-smi -L; nvidia-smi topo -m; nproc; } > "$OUT/env.log" 2>&1
}

# epx_device_build BUILD_DIR TARGET...: configure (extra flags: $EPX_CMAKE_EXTRA) and build the
# targets; on failure the tail of $OUT/build.log and status 1.
epx_device_build() {
  local build=$1 t0
  shift
  t0=$(date +%s)
  # shellcheck disable=SC2086
  if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TOOLS=OFF \
           -DEPX_BUILD_PYTHON=OFF ${EPX_CMAKE_EXTRA:-} && \
         cmake --build "$build" -j "$(nproc)" --target "$@"; } > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    return 1
  fi
  echo "== build: $(( $(date +%s) - t0 )) s"
}

# epx_device_tests BINARY TIMEOUT_S FAILURE_REGEX FILTER...: each gtest filter in its own bounded
# run; all output appended to $OUT/tests.log; per filter its status and, when it failed, the
# lines matching FAILURE_REGEX.
epx_device_tests() {
  local bin=$1 limit=$2 pattern=$3 t s rc
  shift 3
  for t in "$@"; do
    s=$(date +%s)
    echo "==== $t" >> "$OUT/tests.log"
    timeout "$limit" "$bin" --gtest_filter="$t" > "$OUT/one.log" 2>&1
    rc=$?
    cat "$OUT/one.log" >> "$OUT/tests.log"
    echo "== test $t: rc=$rc ($(( $(date +%s) - s )) s)"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|FAILED  \]" "$OUT/one.log" | head -20
    [ $rc -ne 0 ] && grep -E "$pattern" "$OUT/one.log" | cut -c1-400 | head -25
  done
  rm -f "$OUT/one.log"
}

# epx_device_bench BINARY TIMEOUT_S: unless RUN_BENCH=0, the benchmark with $BENCH_ARGS, output
# to the terminal and $OUT/bench.log.
epx_device_bench() {
  [ "${RUN_BENCH:-1}" = 1 ] || return 0
  local s
  s=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$2" "$1" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  echo "== bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - s )) s)"
}

# epx_device_run NAME TIMEOUT_S CMD...: CMD bounded, stdout to $OUT/NAME.log, stderr to
# $OUT/NAME.err; prints its status and duration.
epx_device_run() {
  local name=$1 limit=$2 s
  shift 2
  s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2> "$OUT/$name.err"
  echo "== $name rc=$? ($(( $(date +%s) - s )) s)"
}

# ---- the one-batch scripts' common frame (tests/gpu/*_run.sh) ----------------------------------

# epx_batch_start TARGET...: the environment (a 5 s device timeout), t0 for epx_batch_total, and
# $B = build-dev holding the targets; status 1 when the build failed.
epx_batch_start() {
  epx_device_setup 5000
  t0=$(date +%s)
  B=build-dev
  epx_device_build "$B" "$@"
}

# epx_batch_total: the batch's duration so far.
epx_batch_total() {
  echo "== total $(( $(date +%s) - t0 )) s"
}

# epx_batch_tests BINARY TIMEOUT_S FILTER...: epx_device_tests of $B/tests/gpu/BINARY with the
# usual failure lines; the passing tests' lines are left out.
epx_batch_tests() {
  local bin=$1 limit=$2
  shift 2
  epx_device_tests "$B/tests/gpu/$bin" "$limit" \
    "rank [0-9]|case [0-9]|Failure|FAIL|error|mismatch|expected|exception" "$@" |
    grep -v "^\[       OK" | head -40
}

# epx_batch_bench NAME TIMEOUT_S ROWS BINARY ARGS...: $B/tests/gpu/BINARY ARGS bounded (logs
# $OUT/NAME.{log,err}); prints the log lines matching the extended regex ROWS and any error lines
# of stderr; an empty stderr file is removed ($OUT brings back only a few files).
epx_batch_bench() {
  local name=$1 limit=$2 rows=$3 bin=$4
  shift 4
  epx_device_run "$name" "$limit" "$B/tests/gpu/$bin" "$@"
  grep -E "$rows" "$OUT/$name.log" | sed 's/(sender CTAs: /(/' | cut -c1-160
  grep -iE "error|fail" "$OUT/$name.err" | head -5
  [ -s "$OUT/$name.err" ] || rm -f "$OUT/$name.err"
}

# epx_batch_start_python TARGET...: epx_batch_start with the tools and the Python extension
# (_epx, for /opt/torch/.venv's python) configured; builds _epx and the targets.
epx_batch_start_python() {
  EPX_CMAKE_EXTRA="-DEPX_BUILD_TOOLS=ON -DEPX_BUILD_PYTHON=ON \
-DPython3_EXECUTABLE=/opt/torch/.venv/bin/python3 ${EPX_CMAKE_EXTRA:-}" epx_batch_start _epx "$@"
}

# epx_batch_profile TIMEOUT_S ROWS ARGS...: bench/profile_kernels.py ARGS with the extension built
# by epx_batch_start_python (log $OUT/profile.log); prints its status and the lines matching ROWS.
epx_batch_profile() {
  local limit=$1 rows=$2
  shift 2
  PYTHONPATH="$PWD/python" timeout "$limit" /opt/torch/.venv/bin/python3 bench/profile_kernels.py \
    "$@" > "$OUT/profile.log" 2>&1
  echo "== profile rc=$?"
  grep -E "$rows" "$OUT/profile.log" | cut -c1-250
}

# epx_batch_epx_bench_ht TIMEOUT_S NAME [FLAG...]: epx-bench ht (eager, no --check; the flags
# added) from $B in the caller's environment; log $OUT/eb_NAME.log, prints its status and the rows.
epx_batch_epx_bench_ht() {
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$B/bench/epx-bench" ht --backend cuda "$@" > "$OUT/eb_$name.log" 2>&1
  echo "rc=$?"
  grep -E "^ht\\." "$OUT/eb_$name.log" | cut -c1-120
}

