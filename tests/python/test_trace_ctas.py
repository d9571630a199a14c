"""bench/trace_ctas.py (docs/perf.md §5 item 37): the dispatch receive's copy time per CTA against
its rows and its SM, from `epx_ll_gpu_bench --trace-ctas` lines."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "trace_ctas.py")

# T = 128, fused: four CTAs with rows (copy 1.0, 2.5, 1.5, 3.0 us for 2, 4, 6, 9 rows: r = 0.73),
# one without (no copy stamps: -1.00), CTA 3 on two SMs; a combine line and other text ignored.
# T = 1, hook: two CTAs with the same rows (no correlation).
LOG = "\n".join([
    "[trace] rank 0, T=128, one kernel per op",
    "  cta T=128 fused dispatch   0 sm=4,4,4 rows=2 listed=7.00 copied=8.00 exit=8.50",
    "  cta T=128 fused dispatch   1 sm=5,5,5 rows=4 listed=7.00 copied=9.50 exit=9.00",
    "  cta T=128 fused dispatch   2 sm=6,6,6 rows=6 listed=7.10 copied=8.60 exit=9.60",
    "  cta T=128 fused dispatch   3 sm=7,9,7 rows=9 listed=7.20 copied=10.20 exit=11.00",
    "  cta T=128 fused dispatch   4 sm=8,8,8 rows=0 listed=-1.00 copied=-1.00 exit=6.00",
    "  cta T=128 fused combine   0 sm=4,4,4 rows=0 ids=4.00 pulled=9.00 exit=9.50",
    "  cta T=1 hook dispatch   0 sm=1,1 rows=1 listed=5.00 copied=6.20 exit=7.00",
    "  cta T=1 hook dispatch   1 sm=2,2 rows=1 listed=5.00 copied=6.00 exit=6.80",
])


def run(tmp_path, text):
    p = tmp_path / "trace.log"
    p.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, str(p)], capture_output=True, text=True,
                          timeout=60)


def test_copy_against_rows_and_sms(tmp_path):
    r = run(tmp_path, LOG)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # T = 128 first (larger T first), then T = 1.
    assert lines[0].startswith("T=128 fused: 4 CTAs with rows; copy median 2.00 max 3.00 us;")
    assert "corr(rows, copy) 0.73;" in lines[0]
    assert lines[0].endswith("one SM per CTA in every sample: no")
    assert lines[1] == "  copy by rows: 2:1.00(1) 4:2.50(1) 6:1.50(1) 9:3.00(1)"
    assert lines[2].startswith("  latest at exit (cta sm rows exit): 3/7/9/11.00 2/6/6/9.60")
    assert lines[3].startswith("T=1 hook: 2 CTAs with rows; copy median 1.10 max 1.20 us;")
    assert "corr(rows, copy) n/a (equal rows);" in lines[3]
    assert lines[3].endswith("one SM per CTA in every sample: yes")


def test_no_trace_lines_is_an_error(tmp_path):
    r = run(tmp_path, "[trace] rank 0, T=128\n  dispatch (fp8)\n")
    assert r.returncode == 1
    assert "no dispatch lines of --trace-ctas" in r.stdout
