"""bench/profile_kernels.py (the profiler timing of perf.md §1) runs end to end: on CI on the
cpu backend with 2 gloo ranks (host times only; the GPU machine runs it on the GPUs through
`bash bench/gpu_run.sh profile`)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_profile_kernels_script_runs_on_the_cpu_backend():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_kernels.py"),
                        "--cpu", "--iters", "2", "--ht-tokens", "64", "--experts", "16"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("profile_kernels: 2 rank(s), cpu backend")
    for op in ("ll.dispatch fp8", "ll.combine", "ht.dispatch bf16 T=64",
               "ht.dispatch bf16 cached T=64", "ht.dispatch bf16 worst-case", "ht.combine",
               "ht.combine zero-copy", "a2a.dispatch+combine"):
        rows = [ln for ln in lines if ln.startswith(op)]
        assert len(rows) >= 2, f"no row per rank for {op!r} in:\n{r.stdout}"
        for ln in rows:  # host time: a positive number on the cpu backend
            assert float(ln[40:].split()[3]) > 0, ln
