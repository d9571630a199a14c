"""bench/ncu_stalls.py (the table of `bench/gpu_run.sh ncu`): per kernel the share of each stall
reason in its warp samples, a listing ncu repeats counted once, the top instructions in address
order with their largest reasons."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "ncu_stalls.py")
REASONS = ["barrier", "wait", "long_sb", "short_sb", "imc", "no_inst", "membar", "selected",
           "math"]


def kernel_rows(name, instrs):
    """The rows of one kernel in ncu's `--page source --print-source sass --csv` layout; instrs:
    [(sass, {reason: samples})]."""
    hdr = (["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Warp Stall Sampling (Not-issued Samples)", "# Samples"]
           + ["stall_" + r for r in REASONS] + ["stall_" + r + " (Not Issued)" for r in REASONS])
    rows = [["Kernel Name", name], hdr]
    for i, (sass, per) in enumerate(instrs):
        total = sum(per.values())
        rows.append([hex(0x7F0000 + 16 * i), sass, str(total), "0", str(total)]
                    + [str(per.get(r, 0)) for r in REASONS] + ["0"] * len(REASONS))
    return rows


def run(tmp_path, rows, *args):
    p = tmp_path / "k.csv"
    with open(p, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    r = subprocess.run([sys.executable, SCRIPT, str(p)] + list(args), capture_output=True,
                       text=True, timeout=60)
    return p, r


def test_shares_top_and_repeats(tmp_path):
    disp = kernel_rows("void epx::ll::dispatch<(int)1, (bool)0>(epx::detail::LlDispatchParams)", [
        ("LDC R1, c[0x0][0x28]", {"no_inst": 10}),
        ("ULDC.64 UR14, c[0x0][0x2b0]", {"imc": 30, "no_inst": 2}),
        ("B2R.RESULT RZ, P0", {"barrier": 50, "wait": 3}),
        ("ERRBAR", {"membar": 5}),
    ])
    comb = kernel_rows("void epx::ll::combine<(int)0, (bool)0>(epx::detail::LlCombineParams)", [
        ("IMAD.U32 R18, R48, 0x10000, RZ", {"long_sb": 60, "math": 20}),
        ("UMOV UR5, 0x400", {"barrier": 20}),
    ])
    p, r = run(tmp_path, disp + comb + disp, "--top", "2")  # the dispatch listed twice
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("| file | kernel | samples | barrier | wait | long scoreboard |")
    table = [ln for ln in out if ln.startswith(f"| {p} |")]
    assert table == [
        f"| {p} | epx::ll::dispatch<(int)1, (bool)0> | 100 | 50.0 | 3.0 | 0.0 | 0.0 | 30.0 | "
        "12.0 | 5.0 | 0.0 | 0.0 |",
        f"| {p} | epx::ll::combine<(int)0, (bool)0> | 100 | 20.0 | 0.0 | 60.0 | 0.0 | 0.0 | 0.0 | "
        "0.0 | 0.0 | 20.0 |",
    ], r.stdout
    # The dispatch's two largest instructions, in address order, with their reasons.
    i = out.index(f"{p}: epx::ll::dispatch<(int)1, (bool)0>, the 2 instructions with the most "
                  "samples")
    assert out[i + 1].split()[:3] == ["1", "32", "ULDC.64"]
    assert out[i + 1].endswith("imc 30, no_inst 2")
    assert out[i + 2].split()[:3] == ["2", "53", "B2R.RESULT"]
    assert out[i + 2].endswith("barrier 50, wait 3")
    assert sum(ln.startswith(f"{p}: ") for ln in out) == 2


def test_kernel_filter_and_no_samples(tmp_path):
    comb = kernel_rows("void epx::ll::combine<(int)0, (bool)0>(x)", [("EXIT", {"selected": 4})])
    _, r = run(tmp_path, comb, "--kernel", "dispatch")
    assert r.returncode == 1
    assert "no kernel with warp samples" in r.stderr
    _, r = run(tmp_path, comb, "--kernel", "combine")
    assert r.returncode == 0, r.stderr
    assert "| 4 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 100.0 | 0.0 |" in r.stdout


def test_source_lines_from_nvdisasm(tmp_path):
    instrs = [
        ("LDC R1, c[0x0][0x28]", {"no_inst": 10}),
        ("ULDC.64 UR14, c[0x0][0x2b0]", {"imc": 30}),
        ("@!P0  BRA 0x7f0040", {"barrier": 40}),
        ("B2R.RESULT RZ, P0", {"barrier": 50, "wait": 3}),
    ]
    rows = kernel_rows("void epx::ll::dispatch<(int)1, (bool)0>(x)", instrs)
    # nvdisasm -gi -c: a function's section label, frames innermost first (the last one the call
    # site), then the instructions they cover; another function that must not match.
    disasm = tmp_path / "ll.disasm"
    disasm.write_text("\n".join([
        "\t.section\t.text._ZN3epx2ll7combineE,\"ax\",@progbits",
        ".text._ZN3epx2ll7combineE:",
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        ".text._ZN3epx2ll8dispatchE:",
        '\t//## File "/src/cuda/kernels/sync.cuh", line 90 inlined at '
        '"/src/cuda/kernels/ll/dispatch.cuh", line 780',
        '\t//## File "/src/cuda/kernels/ll/dispatch.cuh", line 780',
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/                   ULDC.64 UR14, c[0x0][0x2b0] ;",
        ".L_x_12:",
        '\t//## File "/src/cuda/kernels/sync.cuh", line 230 inlined at '
        '"/src/cuda/kernels/ll/dispatch.cuh", line 700',
        '\t//## File "/src/cuda/kernels/ll/dispatch.cuh", line 700',
        "        /*0020*/              @!P0 BRA `(.L_x_13) ;",
        "        /*0030*/                   B2R.RESULT RZ, P0 ;",
    ]) + "\n")
    p, r = run(tmp_path, rows, "--top", "2", "--lines", str(disasm))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    i = out.index(f"{p}: epx::ll::dispatch<(int)1, (bool)0>, the 2 instructions with the most "
                  "samples")
    assert out[i + 1].split()[:3] == ["2", "40", "@!P0"]
    assert out[i + 1].endswith("barrier 40  sync.cuh:230 <- dispatch.cuh:700")
    assert out[i + 2].endswith("barrier 50, wait 3  sync.cuh:230 <- dispatch.cuh:700")
    j = out.index(f"{p}: epx::ll::dispatch<(int)1, (bool)0>, the 2 source lines with the most "
                  "samples")
    assert out[j + 1].split() == ["69.9", "%", "sync.cuh:230", "<-", "dispatch.cuh:700",
                                  "barrier", "90,", "wait", "3"]
    assert out[j + 2].split() == ["30.1", "%", "sync.cuh:90", "<-", "dispatch.cuh:780", "imc",
                                  "30,", "no_inst", "10"]
    # --span: the instructions whose innermost line falls in a range, against the kernel's total.
    p, r = run(tmp_path, rows, "--top", "1", "--lines", str(disasm), "--span", "sync.cuh:200-240",
               "--span", "dispatch.cuh:1-999")
    assert r.returncode == 0, r.stderr
    kern = f"{p}: epx::ll::dispatch<(int)1, (bool)0>"
    assert f"{kern}, span sync.cuh:200-240: 93 of 133 samples (69.9 %), barrier 90, wait 3" \
        in r.stdout.splitlines()
    assert f"{kern}, span dispatch.cuh:1-999: 0 of 133 samples (0.0 %)" in r.stdout.splitlines()
    _, r = run(tmp_path, rows, "--lines", str(disasm), "--span", "sync.cuh:240-200")
    assert r.returncode == 2 and "expected FILE:A-B" in r.stderr
    _, r = run(tmp_path, rows, "--span", "sync.cuh:1-2")
    assert r.returncode == 2 and "--span needs --lines" in r.stderr
    # Without a matching function the listing says so and keeps the instructions.
    other = tmp_path / "other.disasm"
    other.write_text(".text._Z1fv:\n        /*0000*/                   EXIT ;\n")
    _, r = run(tmp_path, rows, "--top", "1", "--lines", str(other))
    assert r.returncode == 0, r.stderr
    assert "no function of" in r.stdout


def test_real_export(tmp_path):
    """The first 8 instructions of each listing of a real export (ncu 2025.3.1, run 94 of
    docs/perf.md, `--page source --print-source sass --csv`; every listing there twice)."""
    data = os.path.join(ROOT, "tests", "python", "data", "ncu_ll_sass_sample.csv")
    r = subprocess.run([sys.executable, SCRIPT, data, "--top", "1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    table = [ln.split(" | ")[1:5] for ln in r.stdout.splitlines() if ln.startswith(f"| {data}")]
    # samples 833 / 889 (each listing counted once), imc 651 / 705 of them
    assert table == [["epx::ll::dispatch<(int)1, (bool)0>", "833", "0.0", "2.8"],
                     ["epx::ll::combine<(int)0, (bool)0>", "889", "0.0", "2.4"]], r.stdout
    assert "| 78.2 |" in r.stdout.splitlines()[2] and "| 79.3 |" in r.stdout.splitlines()[3]
    assert "ULDC.64 UR10, c[0x0][0x308]" in r.stdout
