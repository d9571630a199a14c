"""bench/deepep_sweep_table.py (the table of `bench/gpu_run.sh sweep`): rows per (R, T, library)
with every round side by side, a library whose run printed nothing shown as "—" with its exit line."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "deepep_sweep_table.py")


def run_log(tokens, lib, numbers, exit_code=0, ranks=1):
    """The lines bench/peer_deepep.sh prints around one run of test_low_latency.py."""
    who = "DeepEP itself, /x/DeepEP" if lib == "DeepEP" else "epx.compat.deep_ep"
    lines = [f"== test_low_latency.py --num-processes {ranks} --num-tokens {tokens} "
             f"(deep_ep = {who})"]
    if numbers:
        pair, pair_min, d, c, ds, dr, cs, cr = numbers
        if ranks > 1:  # another rank's lines first: only rank 0's are read
            lines.append("[rank 1] Dispatch bandwidth: 1.0 GB/s, avg_t=99.0 us | "
                         "Combine bandwidth: 2.0 GB/s, avg_t=99.0 us")
        lines += [
            f"[rank 0] Dispatch + combine bandwidth: 1.0 GB/s, avg_t={pair} us, "
            f"min_t={pair_min} us, max_t=999.00 us",
            f"[rank 0] Dispatch bandwidth: 1.0 GB/s, avg_t={d} us | "
            f"Combine bandwidth: 2.0 GB/s, avg_t={c} us",
            f"[rank 0] Dispatch send/recv time: {ds} + {dr} us | "
            f"Combine send/recv time: {cs} + {cr} us",
        ]
    suffix = " with DeepEP itself" if lib == "DeepEP" else ""
    lines.append(f"== test_low_latency.py{suffix}: exit {exit_code} (12 s)")
    return lines


def test_table_of_two_rounds(tmp_path):
    logs = []
    for rnd, base in ((1, 0.0), (2, 0.5)):
        for tokens in (1, 128):
            lines = []
            if tokens == 1:  # DeepEP refuses the shape: no numbers, exit 1
                lines += run_log(tokens, "DeepEP", None, exit_code=1)
            else:
                lines += run_log(tokens, "DeepEP", (241.93 + base, 68.8, 17.73, 21.27, 11.75,
                                                    8.49, 16.22, 9.68))
            lines += run_log(tokens, "epx", (40.0 + base, 38.0, 13.03 + base, 11.16, 5.54, 10.84,
                                             12.11, 11.55))
            p = tmp_path / f"sweep.T{tokens}.{rnd}.log"
            p.write_text("noise before\n" + "\n".join(lines) + "\n")
            logs.append(str(p))
    r = subprocess.run([sys.executable, SCRIPT] + logs, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("| R | T | library | dispatch row | combine row |")
    rows = [ln for ln in out if ln.startswith("| 1 | ")]
    assert rows == [
        "| 1 | 1 | epx | 13.03 / 13.53 | 11.16 / 11.16 | 5.54 + 10.84 / 5.54 + 10.84 | "
        "12.11 + 11.55 / 12.11 + 11.55 | 40.0 (38.0) / 40.5 (38.0) |",
        "| 1 | 1 | DeepEP | — / — | — / — | — / — | — / — | — / — |",
        "| 1 | 128 | epx | 13.03 / 13.53 | 11.16 / 11.16 | 5.54 + 10.84 / 5.54 + 10.84 | "
        "12.11 + 11.55 / 12.11 + 11.55 | 40.0 (38.0) / 40.5 (38.0) |",
        "| 1 | 128 | DeepEP | 17.73 / 17.73 | 21.27 / 21.27 | 11.75 + 8.49 / 11.75 + 8.49 | "
        "16.22 + 9.68 / 16.22 + 9.68 | 241.9 (68.8) / 242.4 (68.8) |",
    ], "\n".join(out)
    fails = [ln for ln in out if ln.startswith("R = ")]
    assert fails == [
        "R = 1, T = 1, DeepEP: test_low_latency.py with DeepEP itself: exit 1 (12 s)"] * 2


def test_either_order_gives_one_table(tmp_path):
    """gpu_run.sh sweep runs DeepEP itself first in odd rounds and the drop-in first in even ones:
    the table does not depend on the order within a log."""
    deepep = run_log(128, "DeepEP", (80.0, 70.0, 17.7, 21.3, 11.8, 8.5, 16.2, 9.7))
    epx = run_log(128, "epx", (40.0, 38.0, 10.5, 7.5, 4.8, 9.4, 12.2, 8.8))
    tables = []
    for order in ((deepep, epx), (epx, deepep)):
        p = tmp_path / "sweep.T128.1.log"
        p.write_text("\n".join(order[0] + order[1]) + "\n")
        r = subprocess.run([sys.executable, SCRIPT, str(p)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        tables.append([ln for ln in r.stdout.splitlines() if ln.startswith("| 1 | ")])
    assert tables[0] == tables[1]
    assert [ln.split(" | ")[2] for ln in tables[0]] == ["epx", "DeepEP"]
    assert "| 10.5 | 7.5 |" in tables[0][0] and "| 17.7 | 21.3 |" in tables[0][1]


def test_two_ranks_rank0_rows(tmp_path):
    p = tmp_path / "sweep.T128.1.log"
    p.write_text("\n".join(run_log(128, "epx", (45.0, 41.0, 14.1, 17.2, 6.0, 9.0, 7.0, 11.0),
                                    ranks=2)) + "\n")
    r = subprocess.run([sys.executable, SCRIPT, str(p)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 2 | ")]
    assert rows == ["| 2 | 128 | epx | 14.1 | 17.2 | 6.0 + 9.0 | 7.0 + 11.0 | 45.0 (41.0) |"]


def test_usage_without_logs():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "deepep_sweep_table.py LOG" in r.stderr
