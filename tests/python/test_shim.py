"""The one-step opt-in (epx.compat.shim): with its directory first on PYTHONPATH, ``import deep_ep``
and ``import flashinfer`` give epx's drop-ins, with no code change in the engine. Every case runs
in a fresh interpreter (subprocess) with the PYTHONPATH the documented command builds: the shim
alone (a minimal flashinfer), or the shim in front of a "real" FlashInfer made in tmp_path (only
the MoE all-to-all names become epx's, also for submodules imported later), or one reachable only
through another import finder (as an editable install is)."""

import os
import random
import subprocess
import sys
import textwrap

import pytest

import epx.compat.shim as shim

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(shim.DIRECTORY)))  # .../python
EPX_MOE_NAMES = ("MoeAlltoAll", "moe_a2a_active_rank_mask", "moe_a2a_combine", "moe_a2a_dispatch",
                 "moe_a2a_get_workspace_size_per_rank", "moe_a2a_initialize",
                 "moe_a2a_sanitize_expert_ids", "moe_a2a_wrap_payload_tensor_in_workspace")


def _run(code, *extra_path, env_extra=None):
    """Runs `code` in a fresh interpreter with PYTHONPATH = shim dir, epx's package dir, then
    `extra_path`; returns its stdout (fails the test with its stderr when it fails)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([shim.DIRECTORY, PYTHON_DIR, *map(str, extra_path)])
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_module_prints_the_directory_and_the_documented_line_works():
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    out = subprocess.run([sys.executable, "-m", "epx.compat.shim"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.strip() == shim.DIRECTORY
    assert {"deep_ep", "flashinfer"} <= set(os.listdir(out.strip()))
    # The README's line, verbatim, in bash (python3 = this interpreter).
    script = ('python3() { "$PY" "$@"; }\n'
              'export PYTHONPATH="$(python3 -m epx.compat.shim)${PYTHONPATH:+:$PYTHONPATH}"\n'
              'python3 -c "import deep_ep, flashinfer.comm, epx.compat.deep_ep as d, '
              'epx.compat.flashinfer as f; '
              'print(deep_ep.Buffer is d.Buffer, flashinfer.comm.MoeAlltoAll is f.MoeAlltoAll)"\n'
              'echo "$PYTHONPATH"\n')
    proc = subprocess.run(["bash", "-c", script], env=dict(env, PY=sys.executable),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert lines[0] == "True True"
    assert lines[1] == os.pathsep.join([shim.DIRECTORY, PYTHON_DIR])


def test_deep_ep():
    out = _run("""
        import deep_ep
        import epx.compat.deep_ep as d
        from deep_ep import Buffer, Config, EventHandle, EventOverlap, topk_idx_t
        from deep_ep.buffer import Buffer as B2
        from deep_ep.utils import EventOverlap as E2
        import deep_ep.buffer, deep_ep.utils
        assert deep_ep.__file__.startswith(%r), deep_ep.__file__
        print(Buffer is d.Buffer, Config is d.Config, EventOverlap is d.EventOverlap,
              topk_idx_t is d.topk_idx_t, B2 is d.Buffer, E2 is d.EventOverlap,
              deep_ep.buffer.Config is d.Config, EventHandle is d.EventHandle,
              sorted(deep_ep.__all__))
        """ % shim.DIRECTORY)
    assert out.split() == ["True"] * 8 + ["['Buffer',", "'Config',", "'EventHandle',",
                                          "'EventOverlap',", "'topk_idx_t']"]


def test_deep_ep_2x_module_paths():
    """DeepEP 2.x's paths of its legacy API (deep_ep.buffers.legacy, deep_ep.utils.event) are epx's;
    its own ElasticBuffer API is absent the way engines probe for it: hasattr False, `from deep_ep
    import ElasticBuffer` an ImportError, attribute access an AttributeError naming the legacy
    Buffer."""
    out = _run("""
        import deep_ep
        import epx.compat.deep_ep as d
        from deep_ep.buffers.legacy import Buffer, Config, EventHandle, EventOverlap
        from deep_ep.utils.event import EventOverlap as E2, EventHandle as H2
        from deep_ep.utils import EventOverlap as E3
        import deep_ep.buffers.legacy, deep_ep.utils.event
        print(Buffer is d.Buffer, Config is d.Config, EventHandle is d.EventHandle,
              EventOverlap is d.EventOverlap, E2 is d.EventOverlap, H2 is d.EventHandle,
              E3 is d.EventOverlap)
        for name in ("ElasticBuffer", "EPHandle", "get_physical_domain_size",
                     "get_logical_domain_size"):
            assert not hasattr(deep_ep, name), name
            try:
                getattr(deep_ep, name)
            except AttributeError as e:
                assert f"deep_ep.{name}" in str(e) and "deep_ep.Buffer" in str(e), str(e)
        try:
            from deep_ep import ElasticBuffer
            print("imported")
        except ImportError:
            print("ImportError")
        try:
            deep_ep.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e), str(e)
        """)
    assert out.split() == ["True"] * 7 + ["ImportError"]


def test_flashinfer_minimal_engine_imports():
    """No FlashInfer installed: an engine's import block (SGLang's / vLLM's names) resolves to
    epx's, and nvfp4_block_scale_interleave is epx's."""
    out = _run("""
        import importlib.util, sys
        assert importlib.util.find_spec("flashinfer") is not None  # engines' availability check
        from flashinfer import nvfp4_block_scale_interleave
        from flashinfer.comm import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig, is_mnnvl_fabric_supported, CommBackend
        from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll as M2
        import flashinfer, flashinfer.comm
        import epx.compat.flashinfer as fi
        same = [nvfp4_block_scale_interleave is fi.nvfp4_block_scale_interleave,
                flashinfer.block_scale_interleave is fi.nvfp4_block_scale_interleave,
                MoeAlltoAll is fi.MoeAlltoAll, M2 is fi.MoeAlltoAll,
                moe_a2a_get_workspace_size_per_rank is fi.moe_a2a_get_workspace_size_per_rank,
                Mapping is fi.Mapping, MnnvlConfig is fi.MnnvlConfig,
                CommBackend is fi.CommBackend,
                all(getattr(flashinfer.comm, n) is getattr(fi, n) for n in fi.__all__),
                flashinfer.comm.MOE_A2A_RANK_MASK_WORDS == fi.MOE_A2A_RANK_MASK_WORDS]
        print(all(same), same, is_mnnvl_fabric_supported(0))
        """)
    assert out.split()[0] == "True" and out.split()[-1] == "False", out


def _fake_flashinfer(root, token):
    """A stand-in "real" FlashInfer under `root`: its own names, and sentinels where FlashInfer
    has the MoE all-to-all names. Its comm/__init__.py imports trtllm_moe_alltoall (as the real
    one does) but not mnnvl or mapping (imported later, lazily)."""
    pkg = root / "flashinfer"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"OTHER = {token!r}\nfp4_quantize = 'fake-fp4'\n")
    (pkg / "comm" / "__init__.py").write_text(
        "from .trtllm_moe_alltoall import MoeAlltoAll, moe_a2a_dispatch\n"
        f"OTHER_COMM = {token!r}\nallreduce_fusion = 'fake-allreduce'\nMapping = 'sentinel'\n")
    (pkg / "comm" / "trtllm_moe_alltoall.py").write_text(
        "MoeAlltoAll = 'sentinel'\nmoe_a2a_dispatch = 'sentinel'\nOTHER_A2A = 3\n")
    (pkg / "comm" / "mapping.py").write_text("Mapping = 'sentinel'\nOTHER_MAPPING = 5\n")
    (pkg / "comm" / "mnnvl.py").write_text(
        "MnnvlConfig = 'sentinel'\nCommBackend = 'fake-comm-backend'\n"
        "def is_mnnvl_fabric_supported(device_idx):\n    return True\n"
        "class MnnvlMemory:\n    pass\n")
    return pkg


_CHECK_REAL = """
    import sys
    import flashinfer
    import epx.compat.flashinfer as fi
    assert flashinfer.__file__ == {init!r}, flashinfer.__file__
    assert flashinfer.OTHER == {token!r} and flashinfer.fp4_quantize == "fake-fp4"
    assert not hasattr(flashinfer, "nvfp4_block_scale_interleave")  # stays FlashInfer's (absent)
    assert "flashinfer.comm" not in sys.modules
    import flashinfer.comm as comm
    assert comm.OTHER_COMM == {token!r} and comm.allreduce_fusion == "fake-allreduce"
    # Only the MoE all-to-all becomes epx's; FlashInfer's Mapping and MNNVL names stay its own
    # (the rest of FlashInfer uses them).
    assert comm.MoeAlltoAll is fi.MoeAlltoAll and comm.Mapping == "sentinel"
    assert all(getattr(comm, n) is getattr(fi, n) for n in {names!r})
    a2a = sys.modules["flashinfer.comm.trtllm_moe_alltoall"]
    assert a2a.MoeAlltoAll is fi.MoeAlltoAll and a2a.OTHER_A2A == 3
    assert a2a.MOE_A2A_RANK_MASK_WORDS == fi.MOE_A2A_RANK_MASK_WORDS
    assert "flashinfer.comm.mnnvl" not in sys.modules  # imported lazily, later: untouched
    from flashinfer.comm.mnnvl import MnnvlConfig, is_mnnvl_fabric_supported, CommBackend
    import flashinfer.comm.mnnvl as mnnvl
    assert MnnvlConfig == "sentinel" and is_mnnvl_fabric_supported(0) is True
    assert CommBackend == "fake-comm-backend" and mnnvl.MnnvlMemory.__module__ == mnnvl.__name__
    from flashinfer.comm.mapping import Mapping, OTHER_MAPPING
    assert Mapping == "sentinel" and OTHER_MAPPING == 5
    print("ok")
"""


def test_flashinfer_real_package_later_on_path(tmp_path):
    token = f"fake-{random.SystemRandom().randrange(1 << 30)}"
    pkg = _fake_flashinfer(tmp_path / "site", token)
    out = _run(_CHECK_REAL.format(init=str(pkg / "__init__.py"), token=token,
                                  names=EPX_MOE_NAMES), tmp_path / "site")
    assert out.split() == ["ok"]


def test_flashinfer_real_package_through_another_finder(tmp_path):
    """A FlashInfer that only a meta-path finder appended after the path finder can find (as an
    editable install's finder): found and patched the same way."""
    token = f"fake-{random.SystemRandom().randrange(1 << 30)}"
    pkg = _fake_flashinfer(tmp_path / "elsewhere", token)
    finder = f"""
        import importlib.machinery, sys
        class EditableFinder:
            def find_spec(self, name, path=None, target=None):
                if name != "flashinfer":
                    return None
                return importlib.machinery.PathFinder.find_spec(name, [{str(pkg.parent)!r}])
        sys.meta_path.append(EditableFinder())
    """
    out = _run(textwrap.dedent(finder) + textwrap.dedent(
        _CHECK_REAL.format(init=str(pkg / "__init__.py"), token=token, names=EPX_MOE_NAMES)))
    assert out.split() == ["ok"]


def test_flashinfer_shim_copies_are_not_taken_for_the_real_one(tmp_path):
    """A second copy of the shim (e.g. an installed one behind a source checkout's) further down
    the path is skipped: the minimal package loads, without recursion."""
    import shutil
    shutil.copytree(os.path.join(shim.DIRECTORY, "flashinfer"), tmp_path / "copy" / "flashinfer")
    out = _run("""
        import flashinfer, flashinfer.comm
        import epx.compat.flashinfer as fi
        print(flashinfer.__file__.startswith(%r), flashinfer.comm.MoeAlltoAll is fi.MoeAlltoAll,
              flashinfer.nvfp4_block_scale_interleave is fi.nvfp4_block_scale_interleave)
        """ % shim.DIRECTORY, tmp_path / "copy", shim.DIRECTORY)
    assert out.split() == ["True", "True", "True"]


def test_shim_runs_an_engine_call():
    """Through the shim names: the layout function and the sizing function return real values
    (the same as epx.compat.flashinfer's for fresh random inputs)."""
    seed = random.SystemRandom().randrange(1 << 30)
    out = _run(f"""
        import torch
        from flashinfer import nvfp4_block_scale_interleave
        from flashinfer.comm import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank
        import epx.compat.flashinfer as fi
        g = torch.Generator().manual_seed({seed})
        sf = torch.randint(0, 256, (3, 130, 7), generator=g, dtype=torch.uint8)
        out = nvfp4_block_scale_interleave(sf)
        assert out.shape == (3 * 256 * 8,) and int(out.sum()) == int(sf.sum())
        assert int(out[2048 + 1552]) == int(sf[1, 129, 4])  # batch 1, (129, 4) -> 1552
        # hidden 3584 (bf16), top-k 4 (int32 ids + f32 weights), 56 extra bytes per token
        n = moe_a2a_get_workspace_size_per_rank(4, 64, 3584 * 2 + 4 * 8 + 56, 3584 * 2)
        assert n == MoeAlltoAll.get_moe_workspace_size_per_rank(4, 4, 64, 3584, 56) > 0
        print("ok")
        """)
    assert out.split() == ["ok"]


@pytest.mark.parametrize("name", ["deep_ep", "flashinfer"])
def test_shim_packages_are_shipped(name):
    """setup.py installs every package under epx (find_packages), the shims included."""
    sys.path.insert(0, PYTHON_DIR)
    try:
        from setuptools import find_packages
        pkgs = find_packages(where=PYTHON_DIR, include=["epx", "epx.*"])
    finally:
        sys.path.remove(PYTHON_DIR)
    assert f"epx.compat.shim.{name}" in pkgs and "epx.compat.shim" in pkgs
    if name == "flashinfer":
        assert "epx.compat.shim.flashinfer.comm" in pkgs
    else:  # DeepEP V1's deep_ep.utils and DeepEP 2.x's deep_ep.buffers / deep_ep.utils packages
        assert {"epx.compat.shim.deep_ep.buffers", "epx.compat.shim.deep_ep.utils"} <= set(pkgs)
    setup_py = open(os.path.join(PYTHON_DIR, "setup.py")).read()
    assert 'find_packages(where=HERE, include=["epx", "epx.*"])' in setup_py
