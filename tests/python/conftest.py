"""pytest set-up for epx: the `gpu` marker, rank pools (R in {1, 2, 4, 8}) shared by the session.

CPU tier: ranks are spawned processes joined by gloo; epx runs its cpu backend. GPU tier (marker
`gpu`): ranks joined by NCCL, one GPU each; skipped with a reason where there is no GPU or epx was
built without CUDA.
"""

import contextlib
import sys

import pytest

from rankpool import RankPool

_POOLS = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs and epx built with CUDA (skipped "
                            "otherwise)")


def gpu_skip_reason(num_gpus=1):
    """Why a GPU test cannot run here, or None."""
    import torch

    import epx
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if torch.cuda.device_count() < num_gpus:
        return f"needs {num_gpus} GPUs, {torch.cuda.device_count()} visible"
    if not epx.built_with_cuda:
        return "epx was built without CUDA (EPX_WITH_CUDA=OFF): no cuda backend"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or gpu_skip_reason(1)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@contextlib.contextmanager
def deep_ep_shim_on_path():
    """The imports inside see epx's shim directory first on sys.path (the README's one-step
    opt-in), so ``import deep_ep`` is the shim; afterwards the path is restored and every
    ``deep_ep`` module the block imported is dropped from sys.modules (rank pools and other tests
    share the process)."""
    import epx.compat.shim as shim

    before = set(sys.modules)
    sys.path.insert(0, shim.DIRECTORY)
    try:
        yield
    finally:
        sys.path.remove(shim.DIRECTORY)
        for name in set(sys.modules) - before:
            if name == "deep_ep" or name.startswith("deep_ep."):
                del sys.modules[name]


def get_pool(world_size, backend="gloo"):
    key = (world_size, backend)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend)
    return _POOLS[key]


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def pool(request):
    """A CPU rank pool of R = 1, 2, 4 and 8 ranks."""
    return get_pool(request.param)


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def gpu_pool(request):
    """An NCCL rank pool of R = 1, 2, 4 and 8 ranks, one GPU each (skipped with the reason where
    there are not that many GPUs or epx has no cuda backend)."""
    reason = gpu_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return get_pool(request.param, "nccl")


@pytest.fixture
def pool2():
    return get_pool(2)


@pytest.fixture
def pool1():
    return get_pool(1)


def pytest_sessionfinish(session, exitstatus):
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
