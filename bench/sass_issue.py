#!/usr/bin/env python3
"""One warp's in-order issue over a range of SASS, as a model (docs/perf.md §5 item 60): what a
stretch of straight-line code costs when its only limits are its dependencies and one issue per
cycle. Needs no GPU.

    python3 bench/ptx_size.py --cubin ll.cubin --sass --listing --kernel 'dispatch<1, false, true>' > l.txt
    python3 bench/sass_issue.py l.txt 0x4430 0x5030 [--loads-ready] [--verbose]

Each instruction in [LO, HI) (listing addresses), in listing order, issues at the later of one
cycle after the previous one and the cycle its source registers and predicates are ready; its
destinations are ready LATENCY cycles after it issues. Branches fall through: the range is read as
the path that runs straight through it (take a range without the slow paths' calls, or read the
total as an upper bound of that path). --loads-ready: global loads' results are ready at once (data
loaded ahead, as the send's prefetched x). Latencies in cycles: the dependent-chain rows of
epx_sync_probe on the H200 (§5 item 57: ALU 4.2, shuffle 30.6, shared-memory hop 29.1) where
measured, published figures for the rest (MUFU 18, constant load 20, conversions 6). Not modelled:
other warps on the scheduler, instruction fetch, register-bank conflicts, the memory pipes'
queues: a measured time above the model's is time the dependencies do not explain.
"""
import argparse
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
REG = re.compile(r"\b(U?R\d+|U?P[0-6])\b")
ZERO = {"RZ", "PT", "URZ", "UPT"}

LATENCY = {
    "SHFL": 30, "LDS": 29, "MUFU": 18, "LDC": 20, "ULDC": 6, "S2R": 20, "S2UR": 20,
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


def model(instrs, loads_ready=False):
    """(cycles, per-instruction (issue cycle, stall)), and stall cycles by the waiting opcode."""
    ready, trace, stalls = {}, [], {}
    t = -1
    for _, opcode, srcs, dsts in instrs:
        base = opcode.split(".")[0]
        earliest = t + 1
        need = max([ready.get(r, 0) for r in srcs] + [0])
        issue = max(earliest, need)
        stall = issue - earliest
        lat = LATENCY.get(base, ALU)
        if loads_ready and base in ("LDG", "LD"):
            lat = 1
        for d in dsts:
            ready[d] = issue + lat
        stalls[base] = stalls.get(base, 0) + stall
        trace.append((issue, stall))
        t = issue
    return t + 1, trace, stalls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("listing", help="nvdisasm output (bench/ptx_size.py --cubin --sass --listing)")
    ap.add_argument("lo", help="first address (hex)")
    ap.add_argument("hi", help="end address (hex, not included)")
    ap.add_argument("--loads-ready", action="store_true",
                    help="global loads' results ready at once (data loaded ahead)")
    ap.add_argument("--verbose", action="store_true", help="every instruction's issue cycle")
    a = ap.parse_args(argv)
    with open(a.listing) as f:
        instrs = parse(f.read().splitlines(), int(a.lo, 16), int(a.hi, 16))
    if not instrs:
        print("no instructions in [%s, %s)" % (a.lo, a.hi), file=sys.stderr)
        return 1
    cycles, trace, stalls = model(instrs, a.loads_ready)
    if a.verbose:
        for (addr, opcode, _, _), (issue, stall) in zip(instrs, trace):
            print("%6d %+5d  %04x  %s" % (issue, stall, addr, opcode))
    print("%d instructions, %d cycles (%.2f per instruction)" % (len(instrs), cycles,
                                                                 cycles / len(instrs)))
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
    print("stall cycles by the waiting opcode: " +
          ", ".join("%s %d" % kv for kv in top if kv[1] > 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
