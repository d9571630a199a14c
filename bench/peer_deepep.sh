#!/usr/bin/env bash
# bench/peer_deepep.sh — DeepEP's own V1 test scripts, unmodified, against epx: `import deep_ep`
# resolves to epx.compat.deep_ep through the README's one-step opt-in (python -m epx.compat.shim).
#
#   bash bench/peer_deepep.sh DEEPEP_TESTS_DIR [NUM_PROCESSES] [SCRIPT...]
#
# DEEPEP_TESTS_DIR holds DeepEP's tests/ (test_low_latency.py, test_intranode.py, utils.py) taken
# from a DeepEP checkout (e.g. `git show 567632d:tests/<file>` of github.com/deepseek-ai/DeepEP);
# none of DeepEP lives in this repository. DeepEP 2.x keeps these scripts in tests/legacy/ and their
# helpers in its package (deep_ep/utils/envs.py, math.py, testing.py, which import deep_ep._C): for
# such a DIR (no utils.py in it) EPX_DEEPEP_UTILS names that checkout's deep_ep/utils (default:
# DIR/../../deep_ep/utils where it exists), and the drop-in runs from a temporary copy of the shim
# with DeepEP's helper modules added to its deep_ep.utils and a stand-in deep_ep._C that only lets
# them import (a name used from it raises AttributeError). Scripts default to test_low_latency.py
# and test_intranode.py; NUM_PROCESSES (default 1) is their --num-processes (one GPU each). Needs
# the extension built with CUDA in python/epx (EPX_PYTHON: the Python to use; default
# /opt/torch/.venv/bin/python3 where it exists, else python3). Each script's output goes to the
# terminal; the exit status is the number of scripts that failed. EPX_DEEPEP_SELF=DIR (a DeepEP
# checkout built by bench/build_deepep.sh): each script also runs with DeepEP itself, the same way:
# before the drop-in, or after it with EPX_DEEPEP_SELF_AFTER=1 (bench/gpu_run.sh sweep alternates
# the two by round); its exit status is printed, not counted: DeepEP refuses some shapes, e.g. T = 1
# at R = 1, where it requires R * T_max to be a multiple of 4; a DIR without an importable deep_ep
# exits 2 before any script. EPX_DEEPEP_ARGS: more arguments for every script, both runs (e.g.
# "--num-tokens 32"). EPX_REPO: the epx tree whose python/ the drop-in comes from (default: this
# script's; bench/gpu_run.sh ab runs its base tree's drop-in this way).
set -uo pipefail
repo=$(cd "${EPX_REPO:-$(dirname "$0")/..}" && pwd)
read -r -a extra <<< "${EPX_DEEPEP_ARGS:-}"
dir=$(cd "${1:?usage: peer_deepep.sh DEEPEP_TESTS_DIR [NUM_PROCESSES] [SCRIPT...]}" && pwd)
n=${2:-1}
shift $(( $# >= 2 ? 2 : 1 ))
scripts=("$@")
[ ${#scripts[@]} -gt 0 ] || scripts=(test_low_latency.py test_intranode.py)
py=${EPX_PYTHON:-}
[ -n "$py" ] || { [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3 || py=python3; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
self=""
if [ -n "${EPX_DEEPEP_SELF:-}" ]; then
  # Absolute (each script runs from DEEPEP_TESTS_DIR), and importable: a DeepEP that is not built
  # there is a set-up error, not one of the shapes DeepEP refuses.
  self=$(cd "$EPX_DEEPEP_SELF" && pwd) || exit 2
  (cd / && PYTHONPATH="$self" "$py" -c 'import deep_ep') || {
    echo "peer_deepep.sh: EPX_DEEPEP_SELF=$EPX_DEEPEP_SELF holds no importable deep_ep (bench/build_deepep.sh)" >&2
    exit 2
  }
fi
# The one-step opt-in of the README, as an engine's launcher would run it.
shim=$(PYTHONPATH="$repo/python" "$py" -m epx.compat.shim) || exit 1
utils=${EPX_DEEPEP_UTILS:-}
if [ -z "$utils" ] && [ ! -e "$dir/utils.py" ] && [ -e "$dir/../../deep_ep/utils/testing.py" ]; then
  utils="$dir/../../deep_ep/utils"
fi
if [ -n "$utils" ]; then
  # DeepEP 2.x's helpers beside the shim's deep_ep.utils (its __init__ and event stay epx's).
  utils=$(cd "$utils" && pwd) || exit 2
  overlay=$(mktemp -d)
  trap 'rm -rf "$overlay"' EXIT
  cp -r "$shim/deep_ep" "$overlay/deep_ep"
  for f in "$utils"/*.py; do
    [ -e "$overlay/deep_ep/utils/$(basename "$f")" ] || cp "$f" "$overlay/deep_ep/utils/"
  done
  cat > "$overlay/deep_ep/_C.py" <<'PY'
"""A stand-in for DeepEP's compiled deep_ep._C, written by epx's bench/peer_deepep.sh so that
DeepEP 2.x's test helpers (deep_ep.utils.envs, .comm) import under epx's drop-in."""


def __getattr__(name):
    raise AttributeError(f"deep_ep._C.{name}: DeepEP's compiled module is not part of epx's "
                         "drop-in (bench/peer_deepep.sh's stand-in only lets DeepEP's test "
                         "helpers import)")
PY
  shim=$overlay
fi
export PYTHONPATH="$shim:$repo/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# run_self SCRIPT: SCRIPT with DeepEP itself (EPX_DEEPEP_SELF), its exit status printed.
run_self() {
  local t0 rc
  t0=$(date +%s)
  echo "== $1 --num-processes $n${extra[*]:+ ${extra[*]}} (deep_ep = DeepEP itself, $self)"
  (cd "$dir" && PYTHONPATH="$self" "$py" "$1" --num-processes "$n" "${extra[@]}")
  rc=$?
  echo "== $1 with DeepEP itself: exit $rc ($(( $(date +%s) - t0 )) s)"
}
after=${EPX_DEEPEP_SELF_AFTER:-0}
failed=0
for s in "${scripts[@]}"; do
  [ -n "$self" ] && [ "$after" != 1 ] && run_self "$s"
  t0=$(date +%s)
  echo "== $s --num-processes $n${extra[*]:+ ${extra[*]}} (deep_ep = $(cd "$dir" && "$py" -c 'import deep_ep; print(deep_ep.Buffer.__module__)'))"
  (cd "$dir" && "$py" "$s" --num-processes "$n" "${extra[@]}")
  rc=$?
  echo "== $s: exit $rc ($(( $(date +%s) - t0 )) s)"
  [ $rc -eq 0 ] || failed=$((failed + 1))
  [ -n "$self" ] && [ "$after" = 1 ] && run_self "$s"
done
exit $failed
