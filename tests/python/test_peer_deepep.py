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
