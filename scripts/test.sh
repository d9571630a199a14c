#!/usr/bin/env bash
# Runs every test: GoogleTest (CPU tier, plus the GPU tier where GPUs exist) and pytest.
# Installs what it needs where it can (Debian: apt), skips what is already there.
# Usage: bash scripts/test.sh             (build dir: build/, override with EPX_BUILD_DIR)
#        bash scripts/test.sh ctest       only GoogleTest; `pytest`: only pytest (the same tiers
#                                         in two commands, e.g. under a per-command time limit)
set -euo pipefail
tiers=("$@")
[ ${#tiers[@]} -gt 0 ] || tiers=(ctest pytest)
for t in "${tiers[@]}"; do
  case $t in
    ctest | pytest) ;;
    *) echo "test.sh: unknown tier '$t' (expected ctest or pytest)" >&2; exit 2 ;;
  esac
done
want() { [[ " ${tiers[*]} " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
source scripts/common.sh
epx_setup_env
epx_install_deps
epx_configure_and_build
# The EPX_DIAGNOSTICS code (ablations, tuning overrides; CMakeLists.txt) compiled, the library's
# part also linked, not run, so it keeps building while the default build leaves it out.
if [ "$EPX_WITH_CUDA" = ON ]; then
  cmake --build "$EPX_BUILD_DIR" --target epx_diagnostics_check -j "$(nproc)"
fi
# Every tier runs even when an earlier one fails; the exit status reports any failure.
failed=()
summary=()
ctest_log=$(mktemp)
pytest_log=$(mktemp)
trap 'rm -f "$ctest_log" "$pytest_log"' EXIT
# logged LOG CMD...: CMD's output to the terminal and appended to LOG; CMD's exit status.
logged() {
  local log=$1 rc
  shift
  set +e
  "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
if want ctest; then
  echo "== GoogleTest (ctest) =="
  # Timing assertions (the *Perf* tests) run alone, after everything else.
  logged "$ctest_log" bash -c "cd '$EPX_BUILD_DIR' && ctest --output-on-failure \
    -j '${EPX_TEST_JOBS:-2}' -E Perf" || failed+=(ctest)
  logged "$ctest_log" bash -c "cd '$EPX_BUILD_DIR' && ctest --output-on-failure -R Perf" ||
    failed+=(ctest-perf)
  # ctest's "100% tests passed" counts skipped tests as passed: count them apart.
  n_run=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#' "$ctest_log" || true)
  n_skip=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#.*\*\*\*Skipped' "$ctest_log" || true)
  n_fail=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#.*\*\*\*(Failed|Timeout|Exception)' "$ctest_log" || true)
  summary+=("GoogleTest: $n_run tests, $((n_run - n_skip - n_fail)) passed, $n_fail failed, $n_skip skipped")
  # Without a GPU, say why the GPU GoogleTests were skipped (ctest only prints "Skipped").
  if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    for t in "$EPX_BUILD_DIR"/tests/gpu/gpu_*test; do
      [ -x "$t" ] || continue
      out=$("$t" 2>&1 || true)
      # gtest's summary line: "[  SKIPPED ] N tests, listed below:" (each test is also listed).
      skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9][0-9]*\) tests\{0,1\},.*/\1/p' <<<"$out" | head -n 1)
      reason=$(grep -A1 -m1 ': Skipped$' <<<"$out" | tail -n 1 || true)
      echo "== GPU tier $(basename "$t"): ${skipped:-0} tests skipped: ${reason:-none} =="
      if [ "${skipped:-0}" -gt 0 ]; then
        summary+=("  $(basename "$t"): ${skipped} skipped (${reason:-no reason printed})")
      fi
    done
  fi
fi
if want pytest; then
  if [ -d tests/python ] && epx_python_ready; then
    echo "== pytest =="
    PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" logged "$pytest_log" \
      "$EPX_PYTHON" -m pytest -q -rs tests/python || failed+=(pytest)
    summary+=("pytest: $(tail -n 1 "$pytest_log" | sed 's/^=* *//; s/ *=*$//')")
    reasons=$(grep -E '^SKIPPED \[' "$pytest_log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]+(:[0-9]+)?: /\1 /' |
              awk '{n = $1; $1 = ""; c[$0] += n} END {for (r in c) printf "  %d skipped:%s\n", c[r], r}' |
              sort -rn | head -n 8)
    if [ -n "$reasons" ]; then summary+=("$reasons"); fi
  else
    echo "== pytest: SKIPPED (no Python package or no torch/pytest for $EPX_PYTHON) =="
  fi
fi
echo "== summary =="
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]} =="
  exit 1
fi
echo "== all tests passed (${tiers[*]}) =="
