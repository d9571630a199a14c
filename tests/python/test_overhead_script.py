"""tests/python/bench_overhead.py (the Python call overhead, perf.md §4.5) runs end to end: on CI on
the cpu backend (one gloo rank); on a GPU machine also with --device cuda (one NCCL rank, CUDA
tensors: the chunked host timing and the stream column), skipped with the reason elsewhere."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ("ll bf16", "ll fp8", "ll fp8 + hooks", "a2a bf16", "ht bf16")


def run_overhead(*flags):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "python", "bench_overhead.py"),
                        "--iters", "40", "--repeats", "2", *flags],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in OPS:
            rows[cells[0]] = [float(c) for c in cells[1:]]
    assert set(rows) == set(OPS), r.stdout
    for op, (cpp, epx_us, compat_us, *rest) in rows.items():
        # Host times per iteration: positive (the overheads, differences of noisy times, may not
        # be).
        assert cpp > 0 and epx_us > 0 and compat_us > 0, (op, rows[op])
        allocs, alloc_us, *stream = rest[2:]
        assert allocs >= 1 and alloc_us > 0, (op, rows[op])  # every op allocates an output
        assert all(v > 0 for v in stream), (op, rows[op])  # cuda: the stream column
    return r.stdout, rows


def test_overhead_script_runs_on_the_cpu_backend():
    out, rows = run_overhead("--breakdown", "1")
    assert "R=1 cpu backend" in out
    assert all(len(v) == 7 for v in rows.values()), out
    # The ll pair layer by layer (perf.md §4.5): both configurations, every layer; with the
    # torch bridge's ATen path and without it where it is loaded (design.md §12).
    paths = ("ATen", "attrs") if "torch bridge: ATen path" in out else ("attrs",)
    cols = [f"us per pair, {c}, {p}" for c in ("fp8 + stats", "bf16") for p in paths]
    assert "| ll dispatch + combine, layer (best of 1 rounds) | " + " | ".join(cols) + " |" \
        in out, out
    for layer in ("compat pair", "deep_ep layer", "epx.Buffer layer", "bindings",
                  "output allocations (us)", "C++ op"):
        assert f"| {layer}" in out, (layer, out)


def test_overhead_script_times_the_host_primitives():
    out, _ = run_overhead("--primitives", "1")
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    head = next(i for i, line in enumerate(lines) if line.startswith("| host operation"))
    rows = {}
    for line in lines[head + 1:]:  # the separator row does not start with "| "
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            break
        rows[cells[0]] = (float(cells[1]), float(cells[2]))
    # Every operation of the pair has its row; the unit row is 1 of itself and takes time.
    for name in ("pure Python: 100 integer multiply-adds (the unit)", "_torch.stream_of(x)",
                 "pybind11 call + ATen view of x (_epx._aten_view)",
                 "an output through the torch bridge (_epx._torch_empty, 8 x 256 bf16)",
                 "torch.empty((8, 256), bf16, device)", "the drop-in's handle (_LlHandle)",
                 "EventOverlap()"):
        assert name in rows, (name, out)
    unit_us, unit = rows["pure Python: 100 integer multiply-adds (the unit)"]
    assert unit_us > 0 and unit == 1.0, out
    # An allocation costs more than the empty lambda taken off every row.
    assert rows["torch.empty((8, 256), bf16, device)"][0] > 0, out


@pytest.mark.gpu  # skipped with the reason where there is no GPU (conftest.py)
def test_overhead_script_runs_on_the_cuda_backend():
    out, rows = run_overhead("--device", "cuda", "--every", "8")
    assert "cuda backend on" in out
    assert all(len(v) == 8 for v in rows.values()), out
