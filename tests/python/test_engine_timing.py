"""bench/engine_timing.py on the cpu backend (host columns only): a run prints its table; a
worker that raises ends the run with exit status 1 and its traceback, instead of leaving the
parent waiting for results that never come."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "engine_timing.py")


def run(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, SCRIPT, "--cpu", "--hidden", "256", "--iters", "2",
                           *args], env=env, capture_output=True, text=True, timeout=240)


def test_cpu_run_prints_the_table():
    r = run("--tokens", "4", "--experts", "16")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("epx ")]
    assert rows and rows[0][:3] == ["epx", "0", "4"], r.stdout


def test_a_failing_worker_ends_the_run():
    r = run("--tokens", "4", "--experts", "4")  # top-8 of 4 experts: the worker raises
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "engine_timing: rank 0 failed:" in r.stderr and "Traceback" in r.stderr, r.stderr
