#!/usr/bin/env python3
"""Where a kernel's warps stall, from Nsight Compute's warp-state sampling (`bash bench/gpu_run.sh
ncu`; docs/perf.md §5 item 32).

    ncu --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 -o R ...
    ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
    python3 bench/ncu_stalls.py R.csv [R2.csv ...] [--top N] [--kernel REGEX]

Per kernel of each CSV (its "Kernel Name" rows start a kernel's instructions; a listing repeated
with the same samples, as ncu 2025.3 exports one per profiled launch, is shown once): one row with
the share of every stall reason in all the kernel's warp samples (barrier, wait, long and short
scoreboard, constant-cache miss "imc", no instruction, membar, the rest as "other"), then the N
instructions with the most samples (index, SASS, samples, their three largest reasons). A sample is
one warp seen at one instruction, so a reason's share is the share of warp time it took.
"""
import argparse
import csv
import re
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
# The columns of the table, in this order; every other reason is summed into "other".
SHOWN = ("barrier", "wait", "long_sb", "short_sb", "imc", "no_inst", "membar", "selected")
TITLES = {"long_sb": "long scoreboard", "short_sb": "short scoreboard",
          "imc": "constant-cache miss (imc)", "no_inst": "no instruction"}


def parse(path):
    """[(kernel name, [row dict])] of one `--page source --csv` export, in order."""
    kernels, hdr = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append((row[1] if len(row) > 1 else "?", []))
                hdr = None
            elif row[0] == "Address" or (hdr is None and SAMPLES in row):
                hdr = row
            elif hdr is not None and kernels:
                kernels[-1][1].append(dict(zip(hdr, row)))
    return kernels


def as_int(text):
    try:
        return int(float(text or 0))
    except ValueError:
        return 0


def reasons(row):
    """{reason: samples} of one instruction (the all-samples columns `stall_*`)."""
    return {k[6:]: as_int(v) for k, v in row.items()
            if k.startswith("stall_") and "Not Issued" not in k}


def summary(rows):
    """(total samples, Counter of samples per reason) over a kernel's instructions."""
    per = Counter()
    for r in rows:
        per.update(reasons(r))
    return sum(per.values()), per


def short_name(kernel):
    """`void epx::ll::dispatch<(int)1, (bool)0>(...)` -> `epx::ll::dispatch<(int)1, (bool)0>`."""
    m = re.match(r"^(?:void\s+)?(.*?)\((?!int\)|bool\))", kernel)
    return (m.group(1) if m else kernel).strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per kernel")
    ap.add_argument("--kernel", default="", help="only kernels whose name matches this regex")
    a = ap.parse_args(argv)
    heads = [TITLES.get(s, s) for s in SHOWN] + ["other"]
    print("| file | kernel | samples | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    tops, seen = [], set()
    found = False
    for path in a.csv:
        for kernel, rows in parse(path):
            if a.kernel and not re.search(a.kernel, kernel):
                continue
            total, per = summary(rows)
            # The same listing with the same samples again (ncu 2025.3 repeats it): shown once.
            key = (path, kernel, total, tuple(sorted(per.items())))
            if total == 0 or key in seen:
                continue
            seen.add(key)
            found = True
            shares = [100.0 * per.get(s, 0) / total for s in SHOWN]
            other = 100.0 - sum(shares)
            cells = " | ".join(f"{x:.1f}" for x in shares + [other])
            print(f"| {path} | {short_name(kernel)} | {total} | {cells} |")
            tops.append((path, kernel, rows))
    if not found:
        print("no kernel with warp samples in " + ", ".join(a.csv) + " (was SourceCounters "
              "collected?)", file=sys.stderr)
        return 1
    for path, kernel, rows in tops:
        print(f"\n{path}: {short_name(kernel)}, the {a.top} instructions with the most samples")
        order = sorted(range(len(rows)), key=lambda i: -as_int(rows[i].get(SAMPLES)))[:a.top]
        for i in sorted(order):
            r = rows[i]
            top3 = Counter(reasons(r)).most_common(3)
            why = ", ".join(f"{k} {v}" for k, v in top3 if v)
            print(f"  {i:5d}  {as_int(r.get(SAMPLES)):6d}  {r.get('Source', '').strip()[:64]:64s}"
                  f"  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
