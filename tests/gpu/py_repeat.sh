#!/usr/bin/env bash
# tests/gpu/py_repeat.sh — diagnostic batch on a GPU machine: build the Python module only, then
# run pytest selections of the GPU tier several times each, one line per run (pass / fail).
#   REPEAT=4 SELECTIONS="R2 and ll_roundtrip|R2 and (ht_errors or ll_roundtrip)" \
#     bash tests/gpu/py_repeat.sh
# EPX_TEST_GC=1 in a selection's prefix ("gc:" before it) collects garbage after every rank body.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source tests/gpu/device_lib.sh
epx_device_setup 10000
BUILD=${BUILD:-build-py}
t0=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TOOLS=OFF \
         -DEPX_WITH_CUDA=ON -DEPX_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$(command -v python3)" &&
       cmake --build "$BUILD" -j "$(nproc)" --target _epx; } > "$OUT/pybuild.log" 2>&1; then
  tail -40 "$OUT/pybuild.log"
  exit 1
fi
echo "== python module build: $(( $(date +%s) - t0 )) s"
IFS='|' read -r -a sels <<< "${SELECTIONS:-R2 and ll_roundtrip}"
for sel in "${sels[@]}"; do
  gc=0
  if [[ "$sel" == gc:* ]]; then gc=1; sel=${sel#gc:}; fi
  for i in $(seq 1 "${REPEAT:-3}"); do
    s=$(date +%s)
    EPX_TEST_GC=$gc PYTHONPATH="$PWD/python" timeout "${PY_LIMIT:-120}" python3 -m pytest -q -x \
      tests/python/test_gpu.py -k "$sel" > "$OUT/py.log" 2>&1
    rc=$?
    echo "== gc=$gc [$sel] #$i rc=$rc ($(( $(date +%s) - s )) s): $(tail -1 "$OUT/py.log")"
    if [ $rc -ne 0 ]; then
      grep -E "^E  .*(Error|Timeout|differ|t=[0-9])" "$OUT/py.log" | cut -c1-220 | head -8
      cp "$OUT/py.log" "$OUT/py-fail-$gc-$i-$(echo "$sel" | tr -c 'a-zA-Z0-9' _).log"
    fi
  done
done
