#!/usr/bin/env python3
"""The table of a DeepEP `test_low_latency.py` token sweep (`bash bench/gpu_run.sh sweep`): one
row per (R, T, library) with the rows the script prints (rank 0's), every round of the sweep side
by side.

    python3 bench/deepep_sweep_table.py LOG [LOG...]

Each LOG is one `bench/peer_deepep.sh` run of test_low_latency.py (with EPX_DEEPEP_SELF: DeepEP
itself and epx's drop-in, in either order), its --num-processes (R) and --num-tokens read from each
run's "== ..." header line. The
columns: dispatch and combine kernel rows (`bench_kineto`), the hooked send + receive rows, and the
L2-flushed dispatch + combine event time, mean (min); "—" where a library's run printed no
numbers (it failed or refused the shape: its exit line is listed below the table). µs throughout.
"""
import re
import sys

HEADER = re.compile(
    r"^== (\S+) --num-processes (\d+) .*?--num-tokens (\d+).*\(deep_ep = (.*)\)$")
EXIT = re.compile(r"^== (\S+)( with DeepEP itself)?: exit (\d+)")
PAIR = re.compile(r"Dispatch \+ combine bandwidth: .*avg_t=([\d.]+) us, min_t=([\d.]+) us")
ROWS = re.compile(r"Dispatch bandwidth: .*avg_t=([\d.]+) us \| Combine bandwidth: .*avg_t=([\d.]+) us")
HOOK = re.compile(r"Dispatch send/recv time: ([\d.]+) \+ ([\d.]+) us \| "
                  r"Combine send/recv time: ([\d.]+) \+ ([\d.]+) us")
COLUMNS = ("dispatch row", "combine row", "hooked dispatch send + receive",
           "hooked combine send + receive", "dispatch + combine events, mean (min)")


def parse(lines):
    """[((ranks, tokens), library, {column: text}, exit_line)] of one log, in order."""
    runs, cur = [], None
    for line in lines:
        line = line.rstrip("\n")
        m = HEADER.match(line)
        if m:
            lib = "DeepEP" if m.group(4).startswith("DeepEP itself") else "epx"
            cur = ((int(m.group(2)), int(m.group(3))), lib, {}, None)
            runs.append(cur)
            continue
        if cur is None:
            continue
        m = EXIT.match(line)
        if m:
            runs[-1] = cur = (cur[0], cur[1], cur[2], line[3:] if m.group(3) != "0" else None)
            continue
        if "[rank 0]" not in line:
            continue
        cols = cur[2]
        m = PAIR.search(line)
        if m:
            cols[COLUMNS[4]] = f"{float(m.group(1)):.1f} ({float(m.group(2)):.1f})"
        m = ROWS.search(line)
        if m:
            cols[COLUMNS[0]], cols[COLUMNS[1]] = m.group(1), m.group(2)
        m = HOOK.search(line)
        if m:
            cols[COLUMNS[2]] = f"{m.group(1)} + {m.group(2)}"
            cols[COLUMNS[3]] = f"{m.group(3)} + {m.group(4)}"
    return runs


def table(paths):
    """The markdown table (and the failed runs' exit lines) of the logs at `paths`."""
    rounds = {}  # ((ranks, tokens), library) -> [{column: text}] in log order
    failures = []
    for path in paths:
        with open(path, errors="replace") as f:
            for shape, lib, cols, exit_line in parse(f):
                rounds.setdefault((shape, lib), []).append(cols)
                if exit_line:
                    failures.append(f"R = {shape[0]}, T = {shape[1]}, {lib}: {exit_line}")
    out = ["| R | T | library | " + " | ".join(COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
    order = {"epx": 0, "DeepEP": 1}
    for shape, lib in sorted(rounds, key=lambda k: (k[0], order.get(k[1], 2))):
        cells = [" / ".join(r.get(c, "—") for r in rounds[(shape, lib)]) for c in COLUMNS]
        out.append(f"| {shape[0]} | {shape[1]} | {lib} | " + " | ".join(cells) + " |")
    return "\n".join(out + [""] + failures)


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
