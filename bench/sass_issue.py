#!/usr/bin/env python3
"""Warps' in-order issue over a range of SASS on one scheduler, a model (docs/perf.md §5 item 60):
what a stretch of straight-line code costs when its only limits are its dependencies, one issue a
cycle per scheduler and the throughput of the pipe each instruction needs. Needs no GPU.

    python3 bench/ptx_size.py --cubin ll.cubin --sass --listing --kernel 'dispatch<1, false, true>' > l.txt
    python3 bench/sass_issue.py l.txt 0x4430 0x5030 [--warps W] [--loads-ready] [--verbose]

W warps (default 1) each run the instructions in [LO, HI) (listing addresses) in listing order on
one of the SM's four schedulers. Each cycle the scheduler issues at most one instruction: that of
the warp that issued least recently among those whose next instruction has its source registers
and predicates ready and its pipe free; its destinations are ready LATENCY cycles later, and its
pipe is held 32 / lanes cycles (the CUDA C++ Programming Guide's throughput table for compute
capability 9.0: float add / mul / fma on two 16-lane halves, IMAD on one of them, the integer,
compare, min / max, select and logic instructions on 16 lanes, shuffles on 8, conversions, MUFU
and leading-zero counts on 4). Branches fall through: the range is read as the path that runs
straight through it (take a range without the slow paths' calls, or read the total as an upper
bound of that path). --loads-ready: global loads' results are ready at once (data loaded ahead,
as the send's prefetched x). Latencies in cycles: epx_sync_probe's dependent chains on the H200
(§5 item 57: ALU 4.2, shuffle 30.6, shared-memory hop 29.1; item 59: redux.sync 47.4) where
measured, published figures for the rest (MUFU 18, constant load 20, conversions 6). Not
modelled: other code on the same scheduler, instruction fetch (item 59: not a cost of code run
once), register-bank conflicts, the memory pipes' queues and caches' misses: a measured time above
the model's is time that dependencies and pipe throughput do not explain.
"""
import argparse
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
REG = re.compile(r"\b(U?R\d+|U?P[0-6])\b")
ZERO = {"RZ", "PT", "URZ", "UPT"}

LATENCY = {
    "SHFL": 30, "REDUX": 47, "LDS": 29, "MUFU": 18, "LDC": 20, "ULDC": 6, "S2R": 20, "S2UR": 20,
    "LDG": 400, "LD": 400, "LDL": 30,
    "F2FP": 6, "F2F": 6, "I2F": 6, "F2I": 6, "FRND": 6, "FLO": 6, "POPC": 6, "FCHK": 6,
}
ALU = 4
# Opcodes without a register destination: their operands are all sources.
NO_DEST = {"ST", "STG", "STS", "STL", "RED", "REDG", "BRA", "BSSY", "BSYNC", "BAR", "EXIT", "CALL",
           "RET", "WARPSYNC", "MEMBAR", "FENCE", "CCTL", "ERRBAR", "CGAERRBAR", "NOP", "YIELD",
           "BMOV", "DEPBAR", "PREEXIT", "NANOSLEEP"}
# Opcodes whose first two operands are destinations (predicates, or a predicate and a register).
TWO_DEST = {"ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "SHFL", "VOTE"}
# Opcodes that may write a carry or predicate right after their destination register.
CARRY = {"IADD3", "LEA", "IMAD", "LOP3", "SHF"}


def operands(text):
    """The operand strings of an instruction (commas inside [...] kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def names(op_text, width=1):
    """Registers an operand names; a destination of `width` registers names its successors."""
    found = REG.findall(op_text.replace(".reuse", ""))
    out = []
    for r in found:
        if width > 1 and r.startswith("R") and r != "RZ":
            out += ["R%d" % (int(r[1:]) + i) for i in range(width)]
        else:
            out.append(r)
    return out


def dest_width(opcode):
    if ".128" in opcode:
        return 4
    if ".64" in opcode or opcode.startswith(("CS2R", "IMAD.WIDE")):
        return 2
    return 1


def parse(lines, lo, hi):
    """[(address, opcode, sources, destinations)] of the listing's instructions in [lo, hi)."""
    out = []
    for line in lines:
        m = LINE.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        if not lo <= addr < hi:
            continue
        guard, opcode, rest = m.group(2), m.group(3), m.group(4)
        base = opcode.split(".")[0]
        ops = operands(rest)
        srcs = names(guard) if guard else []
        dsts = []
        if base in NO_DEST:
            for o in ops:  # an address [Rn.64] is a pair; a store's data is the opcode's width
                if "[" in o:
                    srcs += names(o, 2 if ".64" in o else 1)
                else:
                    srcs += names(o, dest_width(opcode) if base.startswith("ST") else 1)
        elif base in TWO_DEST:
            dsts += names(ops[0]) + (names(ops[1]) if len(ops) > 1 else [])
            for o in ops[2:]:
                srcs += names(o)
        elif ops:
            dsts += names(ops[0], dest_width(opcode))
            rest_ops = ops[1:]
            if base in CARRY and rest_ops and re.fullmatch(r"P[0-6T]", rest_ops[0]):
                dsts += names(rest_ops[0])
                rest_ops = rest_ops[1:]
            for i, o in enumerate(rest_ops):
                wide = ("[" in o and ".64" in o) or (
                    opcode.startswith("IMAD.WIDE") and i == len(rest_ops) - 1)
                srcs += names(o, 2 if wide else 1)
        out.append((addr, opcode, [s for s in srcs if s not in ZERO],
                    [d for d in dsts if d not in ZERO]))
    return out


# The pipe each opcode issues to, and the cycles it holds it per warp instruction on one of the
# SM's four schedulers (32 / lanes per scheduler; the CUDA C++ Programming Guide's throughput table
# for compute capability 9.0, per SM per clock: 32-bit float add/mul/fma 128, integer add, multiply-
# add, shift, logic, compare, min/max 64, shuffle 32, conversions, MUFU, leading zeros 16). Float
# fma-class instructions take either of the two fma halves (heavy or lite, 2 cycles each), IMAD
# only the heavy one.
PIPE = {
    "FFMA": ("fma", 2), "FMUL": ("fma", 2), "FADD": ("fma", 2),
    "IMAD": ("fmaheavy", 2),
    "F2FP": ("conv", 8), "F2F": ("conv", 8), "I2F": ("conv", 8), "F2I": ("conv", 8),
    "FRND": ("conv", 8),
    "MUFU": ("xu", 8), "FLO": ("xu", 8), "POPC": ("xu", 8), "BREV": ("xu", 8),
    "SHFL": ("shfl", 4), "REDUX": ("shfl", 4),
}
MEM = {"LDG", "LD", "STG", "ST", "LDS", "STS", "LDL", "STL", "LDC", "ATOMG", "ATOM", "ATOMS",
       "RED", "REDG", "CCTL", "MEMBAR", "FENCE"}
ONE = {"BRA", "BSSY", "BSYNC", "BAR", "EXIT", "CALL", "RET", "WARPSYNC", "NOP", "YIELD", "BMOV",
       "DEPBAR", "PREEXIT", "ERRBAR", "CGAERRBAR", "NANOSLEEP", "B2R", "S2R", "S2UR", "CS2R"}


def pipe_of(opcode):
    """(pipe, cycles held) of an opcode: the table above, the memory pipe, branch and uniform
    instructions (1 cycle), else the 16-lane integer / compare / logic pipe (2 cycles)."""
    base = opcode.split(".")[0]
    if opcode.startswith("IMAD.WIDE"):
        return "fmaheavy", 4
    if base in PIPE:
        return PIPE[base]
    if base in MEM:
        return "mem", 1
    if base in ONE:
        return "branch", 1
    if base.startswith("U"):
        return "uniform", 1
    return "alu", 2


def model(instrs, loads_ready=False, warps=1):
    """`warps` warps run the range on one scheduler: each cycle the scheduler issues at most one
    instruction, of the warp that issued least recently among those whose next instruction has
    its operands ready and its pipe free. Returns (cycles until the last warp's last issue + 1,
    per-instruction (issue cycle, stall) of warp 0, stall cycles of warp 0 by the waiting
    opcode)."""
    n = len(instrs)
    ready = [{} for _ in range(warps)]
    pc = [0] * warps
    last = [-1] * warps
    busy = {}  # pipe -> first free cycle
    trace, stalls = [], {}
    cycle = 0
    while min(pc) < n:
        order = sorted((w for w in range(warps) if pc[w] < n), key=lambda w: (last[w], w))
        for w in order:
            _, opcode, srcs, dsts = instrs[pc[w]]
            if max([ready[w].get(r, 0) for r in srcs] + [0]) > cycle:
                continue
            pipe, hold = pipe_of(opcode)
            units = ["fmaheavy", "fmalite"] if pipe == "fma" else [pipe]
            unit = min(units, key=lambda u: busy.get(u, 0))
            if busy.get(unit, 0) > cycle:
                continue
            busy[unit] = cycle + hold
            base = opcode.split(".")[0]
            lat = 1 if loads_ready and base in ("LDG", "LD") else LATENCY.get(base, ALU)
            for d in dsts:
                ready[w][d] = cycle + lat
            if w == 0:
                earliest = last[0] + 1
                trace.append((cycle, cycle - earliest))
                stalls[base] = stalls.get(base, 0) + cycle - earliest
            last[w] = cycle
            pc[w] += 1
            break
        cycle += 1
    return max(last) + 1, trace, stalls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("listing", help="nvdisasm output (bench/ptx_size.py --cubin --sass --listing)")
    ap.add_argument("lo", help="first address (hex)")
    ap.add_argument("hi", help="end address (hex, not included)")
    ap.add_argument("--loads-ready", action="store_true",
                    help="global loads' results ready at once (data loaded ahead)")
    ap.add_argument("--warps", type=int, default=1,
                    help="warps running the range together on one scheduler (default 1)")
    ap.add_argument("--verbose", action="store_true", help="every instruction's issue cycle")
    a = ap.parse_args(argv)
    with open(a.listing) as f:
        instrs = parse(f.read().splitlines(), int(a.lo, 16), int(a.hi, 16))
    if not instrs:
        print("no instructions in [%s, %s)" % (a.lo, a.hi), file=sys.stderr)
        return 1
    if not 1 <= a.warps <= 16:
        print("--warps %d: expected 1..16" % a.warps, file=sys.stderr)
        return 2
    cycles, trace, stalls = model(instrs, a.loads_ready, a.warps)
    if a.verbose:
        for (addr, opcode, _, _), (issue, stall) in zip(instrs, trace):
            print("%6d %+5d  %04x  %s" % (issue, stall, addr, opcode))
    print("%d instructions, %d warp(s), %d cycles (%.2f per instruction of a warp)" % (
        len(instrs), a.warps, cycles, cycles / len(instrs)))
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
    print("warp 0's stall cycles by the waiting opcode: " +
          ", ".join("%s %d" % kv for kv in top if kv[1] > 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
