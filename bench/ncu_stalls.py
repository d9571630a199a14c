#!/usr/bin/env python3
"""Where a kernel's warps stall, from Nsight Compute's warp-state sampling (`bash bench/gpu_run.sh
ncu`; docs/perf.md §5 item 32).

    ncu --clock-control none --section WarpStateStats --section SourceCounters
        --warp-sampling-interval 0 -o R ...   (one command)
    ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
    python3 bench/ncu_stalls.py R.csv [R2.csv ...] [--top N] [--kernel REGEX] [--lines D.txt]
        [--span FILE:A-B ...]

Per kernel of each CSV (its "Kernel Name" rows start a kernel's instructions; a listing repeated
with the same samples, as ncu 2025.3 exported each one twice, is shown once): one row with
the share of every stall reason in all the kernel's warp samples (barrier, wait, long and short
scoreboard, constant-cache miss "imc", no instruction, membar, the rest as "other"), then the N
instructions with the most samples (index, SASS, samples, their three largest reasons). A sample is
one warp seen at one instruction, so a reason's share is the share of warp time it took.

--lines: `nvdisasm -gi -c` of the profiled binary's cubins (the build has -lineinfo): each kernel
is matched to its function there by its instructions, its top instructions get their source line
(innermost, and the outermost call site after "<-"), and the N source lines with the most samples
are listed as well. --span FILE:A-B (repeatable, with --lines): the samples of the instructions
whose innermost source line is in FILE's lines A..B, as a share of the kernel's, and their largest
reasons (a phase's share: docs/perf.md §5 item 74).
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


FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")
LOC = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTR = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def parse_disasm(path):
    """{function: [(opcode, innermost "file:line", outermost "file:line")]} of `nvdisasm -gi`."""
    funcs, cur, block, fresh = {}, None, [], False
    with open(path, errors="replace") as f:
        for line in f:
            m = FUNC.match(line)
            if m:
                name, k = m.group(1), 1
                while name in funcs:  # the same function in another cubin: its own entry
                    name, k = f"{m.group(1)}#{k}", k + 1
                cur = funcs[name] = []
                block, fresh = [], False
                continue
            m = LOC.search(line)
            if m:
                loc = f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
                block = [loc] if not fresh else block + [loc]
                fresh = True
                continue
            m = INSTR.search(line)
            if m and cur is not None:
                fresh = False
                cur.append((m.group(2), block[0] if block else "?", block[-1] if block else "?"))
    return funcs


def opcode(sass):
    """The opcode of ncu's SASS text (`@!P0  BRA 0x...` -> `BRA`)."""
    parts = sass.split()
    while parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def match_function(rows, funcs):
    """The disassembled function whose instructions are the kernel's (count and opcodes), or None."""
    ops = [opcode(r.get("Source", "")) for r in rows]
    for name, instrs in funcs.items():
        if len(instrs) == len(ops) and all(a == b[0] for a, b in zip(ops, instrs)):
            return instrs
    return None


def reasons(row):
    """{reason: samples} of one instruction (the all-samples columns `stall_*`)."""
    return {k[6:]: as_int(v) for k, v in row.items()
            if k.startswith("stall_") and "Not Issued" not in k}


def summary(stalls):
    """(total samples, Counter of samples per reason) over a kernel's instructions' reasons."""
    per = Counter()
    for st in stalls:
        per.update(st)
    return sum(per.values()), per


def short_name(kernel):
    """`void epx::ll::dispatch<(int)1, (bool)0>(...)` -> `epx::ll::dispatch<(int)1, (bool)0>`."""
    m = re.match(r"^(?:void\s+)?(.*?)\((?!int\)|bool\))", kernel)
    return (m.group(1) if m else kernel).strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per kernel")
    ap.add_argument("--kernel", default="", help="only kernels whose name matches this regex")
    ap.add_argument("--lines", default="", help="nvdisasm -gi -c output of the profiled cubins")
    ap.add_argument("--span", action="append", default=[], metavar="FILE:A-B",
                    help="with --lines: the samples of the instructions whose innermost source "
                         "line is FILE's A..B, as a share of the kernel's (repeatable)")
    a = ap.parse_args(argv)
    if a.span and not a.lines:
        ap.error("--span needs --lines (the source lines come from the disassembly)")
    spans = []
    for text in a.span:
        m = re.fullmatch(r"(.+):(\d+)-(\d+)", text)
        if not m or int(m.group(2)) > int(m.group(3)):
            ap.error(f"--span {text!r}: expected FILE:A-B with A <= B")
        spans.append((text, m.group(1), int(m.group(2)), int(m.group(3))))
    funcs = parse_disasm(a.lines) if a.lines else {}
    heads = [TITLES.get(s, s) for s in SHOWN] + ["other"]
    print("| file | kernel | samples | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    tops, seen = [], set()
    for path in a.csv:
        for kernel, rows in parse(path):
            if a.kernel and not re.search(a.kernel, kernel):
                continue
            stalls = [reasons(r) for r in rows]  # an instruction's samples: the sum of its reasons
            total, per = summary(stalls)
            # The same listing with the same samples again (ncu 2025.3 exported it twice): once.
            key = (path, kernel, total, tuple(sorted(per.items())))
            if total == 0 or key in seen:
                continue
            seen.add(key)
            shares = [100.0 * per.get(s, 0) / total for s in SHOWN]
            other = 100.0 - sum(shares)
            cells = " | ".join(f"{x:.1f}" for x in shares + [other])
            print(f"| {path} | {short_name(kernel)} | {total} | {cells} |")
            tops.append((path, kernel, rows, stalls))
    if not tops:
        print("no kernel with warp samples in " + ", ".join(a.csv) + " (was SourceCounters "
              "collected?)", file=sys.stderr)
        return 1
    for path, kernel, rows, stalls in tops:
        src = match_function(rows, funcs) if funcs else None
        if funcs and src is None:
            print(f"\n{path}: {short_name(kernel)}: no function of {a.lines} has its instructions")
        print(f"\n{path}: {short_name(kernel)}, the {a.top} instructions with the most samples")
        samples = [sum(st.values()) for st in stalls]
        order = sorted(range(len(rows)), key=lambda i: -samples[i])[:a.top]
        for i in sorted(order):
            top3 = Counter(stalls[i]).most_common(3)
            why = ", ".join(f"{k} {v}" for k, v in top3 if v)
            where = f"  {src[i][1]} <- {src[i][2]}" if src else ""
            print(f"  {i:5d}  {samples[i]:6d}  {rows[i].get('Source', '').strip()[:64]:64s}"
                  f"  {why}{where}")
        if src:
            per_line, per_why = Counter(), {}
            for n, st, (_, inner, outer) in zip(samples, stalls, src):
                per_line[(inner, outer)] += n
                per_why.setdefault((inner, outer), Counter()).update(st)
            total = sum(per_line.values()) or 1
            print(f"{path}: {short_name(kernel)}, the {a.top} source lines with the most samples")
            for (inner, outer), n in per_line.most_common(a.top):
                why = ", ".join(f"{k} {v}" for k, v in per_why[(inner, outer)].most_common(2) if v)
                print(f"  {100.0 * n / total:5.1f} %  {inner} <- {outer}  {why}")
            for text, name, lo, hi in spans:
                n, why = 0, Counter()
                for k, st, (_, inner, _) in zip(samples, stalls, src):
                    file, _, line = inner.rpartition(":")
                    if file == name and line.isdigit() and lo <= int(line) <= hi:
                        n += k
                        why.update(st)
                top3 = ", ".join(f"{k} {v}" for k, v in why.most_common(3) if v)
                print(f"{path}: {short_name(kernel)}, span {text}: {n} of {total} samples "
                      f"({100.0 * n / total:.1f} %)" + (f", {top3}" if top3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
