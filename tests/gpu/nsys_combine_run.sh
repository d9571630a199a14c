#!/usr/bin/env bash
# tests/gpu/nsys_combine_run.sh — one bounded batch on ONE GPU (< 3 min; twelfth session): the
# timeline (Nsight Systems, where the machine has it) of the one-GPU proxy's combine rows —
# copying, via pull (chunked copies beside the kernel), via pull with the whole copy first,
# zero-copy — to see whether the chunked copies overlap the pull kernel.
#   bash tests/gpu/nsys_combine_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/device_lib.sh
epx_batch_start epx_ht_onegpu_bench || exit 1
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
  /usr/local/cuda/nsight-systems-*/bin/nsys 2>/dev/null | head -1)
if [ -z "$NSYS" ]; then
  echo "no nsys on this machine"
  exit 0
fi
echo "== nsys: $NSYS"
timeout 150 "$NSYS" profile -t cuda -o "$OUT/combine" --force-overwrite true \
  "$B/tests/gpu/epx_ht_onegpu_bench" --sms 16 --combine-only --calls 2 --rounds 1 \
  > "$OUT/nsys.log" 2>&1
echo "== profile rc=$?"
grep -E "combine" "$OUT/nsys.log"
timeout 60 "$NSYS" stats --report cuda_gpu_trace --format csv -o "$OUT/trace" \
  "$OUT/combine.nsys-rep" > /dev/null 2>&1
python3 - "$OUT" <<'PY'
import csv, glob, sys
out = sys.argv[1]
files = glob.glob(out + "/trace*.csv")
if not files:
    print("no trace csv"); sys.exit(0)
rows = list(csv.DictReader(open(files[0])))
t0 = min(int(r["Start (ns)"]) for r in rows)
for r in rows:
    name = r["Name"]
    if "combine" not in name and "engine_sync" not in name and "Memcpy" not in name:
        continue
    s = (int(r["Start (ns)"]) - t0) / 1e3
    d = int(r["Duration (ns)"]) / 1e3
    print(f"{s:10.1f} {d:8.1f} strm {r.get('Strm', '?'):>4} {name[:60]}")
PY
rm -f "$OUT"/*.nsys-rep "$OUT"/*.sqlite
epx_batch_total
