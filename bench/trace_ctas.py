#!/usr/bin/env python3
"""Summarise `epx_ll_gpu_bench --trace-ctas` (docs/perf.md §5 item 37): is a late dispatch-receive
CTA late for its SM or for its work?

The bench prints one line per CTA and op, e.g.
  cta T=128 fused dispatch   8 sm=16,16,16,16,16 rows=17 listed=7.40 copied=11.50 exit=12.20
(µs from the op's first CTA entry, means over the samples). For each T and mode this prints the
dispatch receive's copy time per CTA (copied - listed): its median and maximum, its correlation
with the CTA's rows, the mean copy time by row count, whether every CTA stayed on one SM, and the
latest CTAs at exit with their SM and rows.

Usage: trace_ctas.py LOG [LOG ...]
"""

import math
import re
import statistics
import sys

LINE = re.compile(
    r"^\s*cta T=(?P<T>\d+) (?P<mode>\w+) dispatch\s+(?P<cta>\d+) sm=(?P<sm>[\d,]+) "
    r"rows=(?P<rows>-?\d+) listed=(?P<listed>-?[\d.]+) copied=(?P<copied>-?[\d.]+) "
    r"exit=(?P<exit>-?[\d.]+)")


def parse(lines):
    """{(T, mode): [cta dicts]} of the dispatch lines that reached their copy."""
    out = {}
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        listed, copied = float(m["listed"]), float(m["copied"])
        if listed < 0 or copied < 0:  # a CTA without rows (no copy stamps)
            continue
        sms = [int(v) for v in m["sm"].split(",")]
        out.setdefault((int(m["T"]), m["mode"]), []).append({
            "cta": int(m["cta"]), "sms": sms, "rows": int(m["rows"]),
            "copy": copied - listed, "exit": float(m["exit"])})
    return out


def correlation(xs, ys):
    """Pearson's r, or nan when either side is constant."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def summary(key, ctas, latest=6):
    T, mode = key
    copies = [c["copy"] for c in ctas]
    r = correlation([c["rows"] for c in ctas], copies)
    stable = all(len(set(c["sms"])) == 1 for c in ctas)
    corr = "n/a (equal rows)" if math.isnan(r) else f"{r:.2f}"
    lines = [f"T={T} {mode}: {len(ctas)} CTAs with rows; copy median {statistics.median(copies):.2f}"
             f" max {max(copies):.2f} us; corr(rows, copy) {corr}; one SM per CTA in every"
             f" sample: {'yes' if stable else 'no'}"]
    by_rows = {}
    for c in ctas:
        by_rows.setdefault(c["rows"], []).append(c["copy"])
    lines.append("  copy by rows: " + " ".join(
        f"{k}:{statistics.fmean(v):.2f}({len(v)})" for k, v in sorted(by_rows.items())))
    late = sorted(ctas, key=lambda c: c["exit"], reverse=True)[:latest]
    lines.append("  latest at exit (cta sm rows exit): " + " ".join(
        f"{c['cta']}/{c['sms'][0]}/{c['rows']}/{c['exit']:.2f}" for c in late))
    return lines


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    status = 0
    for path in argv[1:]:
        with open(path, encoding="utf-8") as f:
            found = parse(f.read().splitlines())
        if len(argv) > 2:
            print(f"== {path}")
        if not found:
            print("trace_ctas.py: no dispatch lines of --trace-ctas in " + path)
            status = 1
        for key in sorted(found, key=lambda k: (-k[0], k[1])):
            print("\n".join(summary(key, found[key])))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
