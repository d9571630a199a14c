"""epx's ops under a TorchFunctionMode (torch.set_default_device installs one; DeepEP's test
utilities and some engines set it): the op must not route its own tensor-method calls through
the mode's Python handler (about 1 us each, ~60 per ll dispatch + combine), and must give the
same results. Runs on torch 2 and later, where torch keeps the mode stack in C and epx takes
the modes off it; skipped with the reason on torch 1.x (epx leaves the modes alone there).
"""

import pytest
import torch

import epx.compat.deep_ep as deep_ep
from epx import _torch
from conftest import get_pool


class CountingMode(torch.overrides.TorchFunctionMode):
    """Counts every call that reaches the mode."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


# Decided by the version, not by epx's own code (a regression of plain_torch must fail, not skip).
pytestmark = pytest.mark.skipif(
    int(torch.__version__.split(".")[0]) < 2,
    reason=f"torch {torch.__version__}: epx takes __torch_function__ modes off the stack on "
    "torch 2 and later only (torch 1.x keeps a Python helper mode in front of it, and has no "
    "set_default_device)")


def test_plain_torch_takes_modes_off_the_stack():
    probe = _torch.plain_torch(lambda t: t.dim())
    t = torch.zeros(1)
    with CountingMode() as mode:
        assert probe(t) == 1
        assert mode.calls == 0
        t.dim()  # outside the op the mode is back on the stack
        assert mode.calls == 1


def body_ll_under_mode(ctx, seed):
    g = torch.Generator().manual_seed(seed + ctx.rank)
    T, H, K, E = 6, 256, 4, 4 * ctx.world_size
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    buf = deep_ep.Buffer(ctx.group, 0, 0, low_latency_mode=True, explicitly_destroy=True)

    def pair():
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        y = recv.clone()
        out, _, _ = buf.low_latency_combine(y, topk, w, handle)
        return recv.clone(), count.clone(), out.clone()

    want = pair()
    with CountingMode() as mode:
        before = mode.calls
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, topk, w, handle)
        inside = mode.calls - before
    L = E // ctx.world_size
    for l in range(L):
        n = int(count[l])
        assert n == int(want[1][l])
        assert torch.equal(recv[l, :n].view(torch.int16), want[0][l, :n].view(torch.int16))
    assert torch.equal(out.view(torch.int16), want[2].view(torch.int16))
    buf.destroy()
    return inside


@pytest.mark.parametrize("world_size", [1, 2])
def test_ll_ops_bypass_torch_function_mode(world_size):
    seed = 4321
    calls = get_pool(world_size).run(body_ll_under_mode, seed)
    assert calls == [0] * world_size, f"calls that reached the mode inside the ops: {calls}"
