"""bench/peer_deepep.sh: with EPX_DEEPEP_SELF each script runs with DeepEP itself and with epx's
drop-in, DeepEP first unless EPX_DEEPEP_SELF_AFTER=1 (bench/gpu_run.sh sweep alternates the two by
round), and only the drop-in's exit status counts."""

import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "peer_deepep.sh")

# A Python stand-in: `-m epx.compat.shim` prints the shim's folder, `-c` probes succeed (the
# module probe names the drop-in), and a script run prints which deep_ep it would import and
# exits with $STUB_RC_<lib>.
STUB = r"""#!/usr/bin/env bash
case "$1" in
  -m) echo "$STUB_SHIM" ;;
  -c) case "$2" in *__module__*) echo epx.compat.deep_ep ;; esac ;;
  *) if [ "${PYTHONPATH%%:*}" = "$STUB_SELF" ]; then lib=deepep; else lib=epx; fi
     echo "RUN $lib $*"; v=STUB_RC_$lib; exit "${!v:-0}" ;;
esac
"""


def run(tmp_path, after=None, rc_epx=0, rc_deepep=0):
    py = tmp_path / "python3"
    py.write_text(STUB)
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    tests, self_dir, shim = (tmp_path / d for d in ("tests", "DeepEP", "shim"))
    for d in (tests, self_dir, shim):
        d.mkdir(exist_ok=True)
    env = dict(os.environ, EPX_PYTHON=str(py), EPX_DEEPEP_SELF=str(self_dir), STUB_SELF=str(self_dir),
               STUB_SHIM=str(shim), STUB_RC_epx=str(rc_epx), STUB_RC_deepep=str(rc_deepep),
               EPX_DEEPEP_ARGS="--num-tokens 8")
    if after is not None:
        env["EPX_DEEPEP_SELF_AFTER"] = after
    r = subprocess.run(["bash", SCRIPT, str(tests), "1", "a.py", "b.py"], env=env,
                       capture_output=True, text=True)
    runs = [line.split()[1:3] for line in r.stdout.splitlines() if line.startswith("RUN ")]
    return r.returncode, runs, r.stdout


def test_deepep_itself_first_by_default_and_after_when_asked(tmp_path):
    rc, runs, out = run(tmp_path)
    assert rc == 0, out
    assert runs == [["deepep", "a.py"], ["epx", "a.py"], ["deepep", "b.py"], ["epx", "b.py"]]
    rc, runs, out = run(tmp_path, after="1")
    assert rc == 0, out
    assert runs == [["epx", "a.py"], ["deepep", "a.py"], ["epx", "b.py"], ["deepep", "b.py"]]
    # every run has its header and exit line, so bench/deepep_sweep_table.py reads either order
    assert out.count("(deep_ep = DeepEP itself,") == 2
    assert out.count("(deep_ep = epx.compat.deep_ep)") == 2
    assert out.count("with DeepEP itself: exit 0") == 2


def test_only_the_drop_ins_failures_count(tmp_path):
    for after in ("0", "1"):
        rc, runs, out = run(tmp_path, after=after, rc_deepep=3)
        assert rc == 0, out
        assert "with DeepEP itself: exit 3" in out
        rc, runs, out = run(tmp_path, after=after, rc_epx=1)
        assert rc == 2, out  # both scripts failed through the drop-in


# DeepEP 2.x's layout, made here (no DeepEP code): its helpers import deep_ep._C at the top, and
# its own deep_ep/__init__.py and utils/event.py must not be the ones imported.
FAKE_DEEPEP2 = {
    "deep_ep/__init__.py": "raise RuntimeError('DeepEP itself imported')\n",
    "deep_ep/utils/__init__.py": "raise RuntimeError('DeepEP utils/__init__ imported')\n",
    "deep_ep/utils/event.py": "raise RuntimeError('DeepEP utils/event imported')\n",
    "deep_ep/utils/comm.py": "import deep_ep._C as _C\n\n\ndef handle():\n"
                             "    return _C.get_physical_domain_size\n",
    "deep_ep/utils/envs.py": "import deep_ep._C as _C\nfrom .comm import handle\n\n\n"
                             "def init_dist(local_rank, num_local_ranks):\n"
                             "    return f'dist{local_rank}{num_local_ranks}'\n",
    "deep_ep/utils/math.py": "def calc_diff(x, y):\n    return abs(x - y)\n",
    "deep_ep/utils/testing.py": "def bench(fn):\n    return fn()\n",
    "tests/legacy/test_x.py": """import sys
import deep_ep
from deep_ep.utils.envs import init_dist
from deep_ep.utils.math import calc_diff
from deep_ep.utils.testing import bench
from deep_ep.utils.event import EventOverlap
from deep_ep.buffers.legacy import Buffer
import epx.compat.deep_ep as d
assert Buffer is d.Buffer is deep_ep.Buffer and EventOverlap is d.EventOverlap
from deep_ep.utils.comm import handle
try:
    handle()
    print("STANDIN none")
except AttributeError as e:
    print("STANDIN", "stand-in" in str(e) and "get_physical_domain_size" in str(e))
print("RESULT", init_dist(0, 1), bench(lambda: 7), calc_diff(5, 2), *sys.argv[1:])
""",
}


def test_deepep_2x_tests_dir_runs_with_deepeps_helpers(tmp_path):
    """A DeepEP 2.x tests/legacy/ dir: the script imports DeepEP's own helpers (deep_ep.utils.envs,
    .math, .testing, from the checkout) beside epx's drop-in (deep_ep, deep_ep.buffers.legacy,
    deep_ep.utils.event stay epx's); deep_ep._C is the stand-in; the overlay is removed after. The
    helpers are found from the tests dir, or named by EPX_DEEPEP_UTILS."""
    import sys
    src = tmp_path / "DeepEP"
    for rel, text in FAKE_DEEPEP2.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "test_x.py").write_text(FAKE_DEEPEP2["tests/legacy/test_x.py"])
    for tests, utils in ((src / "tests" / "legacy", None), (elsewhere, src / "deep_ep" / "utils")):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EPX_DEEPEP_SELF")}
        env.update(EPX_PYTHON=sys.executable, TMPDIR=str(scratch))
        if utils is not None:
            env["EPX_DEEPEP_UTILS"] = str(utils)
        r = subprocess.run(["bash", SCRIPT, str(tests), "1", "test_x.py"], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "STANDIN True" in r.stdout, r.stdout + r.stderr
        assert "RESULT dist01 7 3 --num-processes 1" in r.stdout, r.stdout + r.stderr
        assert "(deep_ep = epx.compat.deep_ep)" in r.stdout
        assert list(scratch.iterdir()) == []  # the overlay is gone
