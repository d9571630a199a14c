"""bench/sass_issue.py (docs/perf.md §5 item 60): one warp's in-order issue over a SASS range, from
a synthetic nvdisasm listing whose cycle count is worked out by hand."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sass_issue  # noqa: E402

LISTING = """\
        .text.k:
        /*0000*/                   LDG.E.128.CONSTANT R20, [R2.64] ;
        /*0010*/                   FFMA R0, R1, R2, R3 ;
        /*0020*/                   FFMA R4, R0.reuse, R2, R3 ;
        /*0030*/                   IADD3 R5, P0, R6, R7, RZ ;
        /*0040*/                   SHFL.BFLY PT, R8, R4, 0x8, 0x1f ;
        /*0050*/                   FSETP.GT.AND P1, PT, R8, R5, PT ;
        /*0060*/               @P1 FSEL R9, R8, R5, P1 ;
        /*0070*/                   IMAD.X R10, R23, 0x1, R11, P0 ;
        /*0080*/                   STG.E.64 [R12.64], R8 ;
        /*0090*/                   EXIT ;
"""


def run(lo, hi, loads_ready=False):
    instrs = sass_issue.parse(LISTING.splitlines(), lo, hi)
    return instrs, sass_issue.model(instrs, loads_ready)


def test_parse_sources_and_destinations():
    instrs, _ = run(0, 0x100)
    by_addr = {a: (op, s, d) for a, op, s, d in instrs}
    assert len(instrs) == 10
    assert by_addr[0x00][2] == ["R20", "R21", "R22", "R23"]  # .128: four registers
    assert by_addr[0x00][1] == ["R2", "R3"]  # the address pair
    assert by_addr[0x30][2] == ["R5", "P0"]  # the carry out
    assert by_addr[0x40][2] == ["R8"] and by_addr[0x40][1] == ["R4"]  # PT dropped
    assert by_addr[0x50][2] == ["P1"]
    assert by_addr[0x60][1] == ["P1", "R8", "R5", "P1"]  # the guard is a source
    assert by_addr[0x70][1] == ["R23", "R11", "P0"]
    assert sorted(by_addr[0x80][1]) == ["R12", "R13", "R8", "R9"]  # 64-bit data, pair address
    assert by_addr[0x90][2] == []


def test_issue_cycles_by_hand():
    # 0x10-0x80 with the load left out: FFMA at 0 (R0 at 4); FFMA waits to 4 (R4 at 8); IADD3 at 5
    # (R5, P0 at 9); SHFL waits to 8 (R8 at 38); FSETP waits to 38 (P1 at 42); FSEL waits to 42
    # (R9 at 46); IMAD.X at 43 (R23 was never written: ready); STG waits for R9 to 46.
    instrs, (cycles, trace, stalls) = run(0x10, 0x90)
    assert [t for t, _ in trace] == [0, 4, 5, 8, 38, 42, 43, 46]
    assert cycles == 47
    assert stalls["SHFL"] == 2 and stalls["FSETP"] == 29 and stalls["STG"] == 2


def test_pipes_and_warps():
    # Independent instructions: the 16-lane integer / logic pipe takes one every 2 cycles, float
    # fma-class ones use both fma halves (one a cycle), a second warp shares the pipes.
    alu = "\n".join("        /*%04x*/                   LOP3.LUT R%d, R10, R11, RZ, 0xc0, !PT ;"
                     % (16 * i, i) for i in range(4))
    fma = "\n".join("        /*%04x*/                   FFMA R%d, R10, R11, R12 ;" % (16 * i, i)
                     for i in range(4))
    conv = "\n".join("        /*%04x*/                   F2FP.BF16.F32.PACK_AB R%d, R10, R11 ;"
                      % (16 * i, i) for i in range(2))
    for text, warps, issues, cycles in [(alu, 1, [0, 2, 4, 6], 7), (fma, 1, [0, 1, 2, 3], 4),
                                        (conv, 1, [0, 8], 9), (alu, 2, [0, 4, 8, 12], 15)]:
        instrs = sass_issue.parse(text.splitlines(), 0, 0x100)
        got, trace, _ = sass_issue.model(instrs, warps=warps)
        assert [t for t, _ in trace] == issues, (text.split()[1], warps, trace)
        assert got == cycles
    # A dependent chain leaves the pipe idle between its instructions: a second warp takes
    # turns in its gaps and ends two cycles after the first (the pipe holds each for 2).
    chain = "\n".join("        /*%04x*/                   LOP3.LUT R%d, R%d, R11, RZ, 0xc0, !PT ;"
                       % (16 * i, i + 1, i) for i in range(4))
    instrs = sass_issue.parse(chain.splitlines(), 0, 0x100)
    assert sass_issue.model(instrs, warps=1)[0] == 13  # issues at 0, 4, 8, 12
    assert sass_issue.model(instrs, warps=2)[0] == 15  # warp 1 at 2, 6, 10, 14


def test_loads_ready_and_load_latency():
    # With the load: IMAD.X reads R23, the load's last register.
    _, (_, trace, _) = run(0, 0x90)
    assert trace[7][0] == 400  # LDG issued at 0, its registers ready at 400
    _, (_, trace, _) = run(0, 0x90, loads_ready=True)
    assert trace[7][0] == 44  # one cycle after FSEL at 43: nothing waits for the load


def test_command_line(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text(LISTING)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass_issue.py"), str(path),
                          "0x10", "0x90"], capture_output=True, text=True, check=True).stdout
    assert "8 instructions, 1 warp(s), 47 cycles" in out
    two = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass_issue.py"), str(path),
                          "0x10", "0x90", "--warps", "2"], capture_output=True, text=True,
                         check=True).stdout
    # By hand: warp 1 takes the fma half warp 0 leaves free, then waits for the integer pipe
    # and the shuffle unit behind warp 0; its store issues at 51.
    assert "8 instructions, 2 warp(s), 52 cycles" in two
    empty = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass_issue.py"),
                            str(path), "0x1000", "0x2000"], capture_output=True, text=True)
    assert empty.returncode == 1 and "no instructions" in empty.stderr
