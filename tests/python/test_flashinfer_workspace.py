"""epx.compat.flashinfer's workspace handles and process checkpointing, as FlashInfer's own code
and tests use them: ``MoeAlltoAll.get_workspace`` (the cached dict; its workspace and metainfo
driving moe_a2a_dispatch / moe_a2a_combine, the combine payload written into the workspace), a
MoeAlltoAll's ``workspace`` / ``metainfo`` (the functional ops on the object's own state, mixed
with its methods), ``mnnvl_mem``, ``checkpoint_prepare`` / ``checkpoint_restore`` (the states
between them, then rounds equal to the reference), and the first EPLB gather while a rank is
masked off. Fresh random inputs, every element checked.

CPU tier: gloo rank pools (R = 1, 2, 4, 8), epx's cpu backend. The `gpu` cases run the same bodies
on NCCL pools, one GPU per rank."""

import gc
import random

import pytest
import torch

import epx
import epx.compat.flashinfer as fi
import reference as ref
from test_a2a_mask import _masked
from test_conformance_flashinfer import EngineComm, _backend_kw
from test_flashinfer_functional import H, MAX_TOKENS, _check_recv, _inputs, _stats, _ys

K = 3


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _mapping(ctx):
    R, r = ctx.world_size, ctx.rank
    return fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R)


def _check_zero_workspace(ws, R, size, dev):
    assert ws.dtype == torch.uint8 and list(ws.shape) == [R, size] and \
        ws.device.type == dev.type, (ws.dtype, ws.shape, ws.device)
    assert torch.equal(ws.cpu(), torch.zeros(R, size, dtype=torch.uint8))


def body_get_workspace(ctx, seed):
    """FlashInfer's get_workspace dict, cached per arguments, driving the functional ops as its
    test does: the combine payload written at combine_payload_offset of row ep_rank, or passed
    in with output=."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M, n = 2 * R, MAX_TOKENS, min(5, 2 * R)
    mapping = _mapping(ctx)
    # Fresh arguments: the cache lives as long as the rank's process.
    size = fi.moe_a2a_get_workspace_size_per_rank(R, M, H * 2 + 64, H * 4) + 4 * (seed % 4096)
    with pytest.raises(epx.InvalidArgument, match="'mapping'"):
        fi.MoeAlltoAll.get_workspace(size, r, R + 1, M, mapping)
    with pytest.raises(epx.InvalidArgument, match="'backend'"):
        fi.MoeAlltoAll.get_workspace(size, r, R, M, mapping, backend="tpu")
    with pytest.raises(epx.Unsupported, match="cake"):  # FlashInfer's: SM 100 / 103 only
        fi.MoeAlltoAll.get_workspace(size, r, R, M, mapping, backend="cake")
    kw = dict(comm_backend=EngineComm(ctx.group), **_backend_kw(ctx))
    got = fi.MoeAlltoAll.get_workspace(size, r, R, M, mapping, n, **kw)
    ws, meta = got["workspace"], got["metainfo"]
    assert got == dict(workspace_size_per_rank=size, max_num_tokens=M, ep_rank=r, ep_size=R,
                       eplb_stats_num_experts=n, mnnvl_mem=None, workspace=ws, metainfo=meta)
    _check_zero_workspace(ws, R, size, dev)
    assert meta.dtype == torch.int64 and list(meta.shape) == [8] and meta.device.type == "cpu"
    assert fi.MoeAlltoAll.get_workspace(size, r, R, M, mapping, n, **kw) is got  # nothing new
    assert torch.equal(fi.moe_a2a_initialize(ws, r, R, M, n), meta)  # the same context
    for step in range(3):
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step])
        idx = inputs[r]["topk_idx"].to(dev)
        payloads = [p.to(dev) for p in inputs[r]["payloads"]]
        recv, off, stats = fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E,
                                               eplb_local_stats=_stats(seed, step, r, n).to(dev))
        _check_recv(recv, inputs, r, E, R, M, f"step={step}")
        assert torch.equal(stats.cpu(), torch.stack([_stats(seed, step, s, n)
                                                     for s in range(R)])), step
        ys = _ys(seed, step, R, M, torch.bfloat16)
        want = ref.a2a_combine(inputs, ys, r, E, R)
        if step == 1:
            buf = torch.full((idx.shape[0], H), float("nan"), dtype=torch.bfloat16, device=dev)
            out = fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, off,
                                     output=buf)
            assert out is buf
        else:
            view = fi.moe_a2a_wrap_payload_tensor_in_workspace(
                ws[r], [R, M], off, off + R * M * H * 2, torch.bfloat16)
            view.copy_(ys[r].to(dev))
            out = fi.moe_a2a_combine(view, idx.shape[0], ws, meta, M, r, R, K, off,
                                     payload_in_workspace=True)
        assert torch.equal(out.cpu(), want), (seed, step)


def body_handles(ctx, seed):
    """A MoeAlltoAll's workspace / metainfo: the functional ops run on the object itself
    (FlashInfer's methods are those ops on its workspace), so its methods and the ops mix;
    the handles end with the object."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M = 2 * R, MAX_TOKENS
    # FlashInfer's default kernel choice named, where epx's default backend fits the pool.
    moe = fi.MoeAlltoAll(_mapping(ctx), M, K, E, hidden_size=H,
                         mnnvl_config=fi.MnnvlConfig(comm_backend=EngineComm(ctx.group)),
                         **(_backend_kw(ctx) or {"backend": "trtllm"}))
    ws, meta = moe.workspace, moe.metainfo
    assert moe.workspace is ws and moe.metainfo is meta and moe.mnnvl_mem is None
    _check_zero_workspace(ws, R, fi.MoeAlltoAll.get_moe_workspace_size_per_rank(R, K, M, H), dev)
    assert meta.dtype == torch.int64 and list(meta.shape) == [8] and meta.device.type == "cpu"
    assert torch.equal(fi.moe_a2a_initialize(ws, r, R, M), meta)  # FlashInfer's restore check

    inputs = _inputs(seed, 0, R, E, K, "uniform")
    idx, payloads = inputs[r]["topk_idx"].to(dev), [p.to(dev) for p in inputs[r]["payloads"]]
    _check_recv(moe.dispatch(idx, payloads, M), inputs, r, E, R, M, "method dispatch")
    with pytest.raises(epx.InvalidArgument, match="twice"):  # one state: the object's
        fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E)
    ys = _ys(seed, 0, R, M, torch.bfloat16)
    out = fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, 0)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), seed

    inputs = _inputs(seed, 1, R, E, K, "skewed")
    idx, payloads = inputs[r]["topk_idx"].to(dev), [p.to(dev) for p in inputs[r]["payloads"]]
    recv, off, stats = fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E)
    assert off == 0 and stats is None
    _check_recv(recv, inputs, r, E, R, M, "functional dispatch")
    with pytest.raises(epx.InvalidArgument, match="twice"):
        moe.dispatch(idx, payloads, M)
    ys = _ys(seed, 1, R, M, torch.float32)
    out = moe.combine(ys[r].to(dev), M)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), seed

    del moe, recv
    gc.collect()
    with pytest.raises(epx.InvalidArgument, match="no longer exists"):
        fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E)


class _WrongSizeComm(EngineComm):
    def Get_size(self):
        return super().Get_size() + 1


def body_checkpoint(ctx, seed):
    """checkpoint_prepare releases the workspaces and the group, checkpoint_restore makes them
    again; in between every use is InvalidArgument naming the state; rounds (with EPLB stats,
    payload_in_workspace) before and after equal the reference."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M, n = 2 * R, MAX_TOKENS, min(5, 2 * R)
    moe = fi.MoeAlltoAll(_mapping(ctx), M, K, E, hidden_size=H, eplb_stats_num_experts=n,
                         mnnvl_config=fi.MnnvlConfig(comm_backend=EngineComm(ctx.group)),
                         **_backend_kw(ctx))

    def dispatch(step):
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step])
        idx = inputs[r]["topk_idx"].to(dev)
        recv = moe.dispatch(idx, [p.to(dev) for p in inputs[r]["payloads"]], M,
                            eplb_local_stats=_stats(seed, step, r, n).to(dev),
                            enable_pdl=bool(step % 2))
        _check_recv(recv, inputs, r, E, R, M, f"step={step}")
        assert torch.equal(moe.eplb_gathered_stats.cpu(),
                           torch.stack([_stats(seed, step, s, n) for s in range(R)])), step
        return inputs

    def combine(step, inputs):
        ys = _ys(seed, step, R, M, torch.bfloat16)
        if step % 2:
            view = moe.get_combine_payload_tensor_in_workspace(M, H, torch.bfloat16)
            view.copy_(ys[r].to(dev))
            out = moe.combine(view, M, payload_in_workspace=True, enable_pdl=True)
        else:
            out = moe.combine(ys[r].to(dev), M)
        assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), (seed, step)

    inputs = dispatch(0)
    with pytest.raises(epx.InvalidArgument, match="between dispatch and combine"):
        moe.checkpoint_prepare()
    combine(0, inputs)
    comm = EngineComm(ctx.group)
    moe.checkpoint_restore(comm)  # not prepared: nothing
    combine(1, dispatch(1))
    moe.checkpoint_prepare()
    moe.checkpoint_prepare()  # again: nothing
    ws, meta = moe.workspace, moe.metainfo
    idx = torch.zeros(1, K, dtype=torch.int32, device=dev)
    x = [torch.zeros(1, H, dtype=torch.bfloat16, device=dev)]
    y = torch.zeros(R, 1, H, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(R, M, K, dtype=torch.int32, device=dev)
    for call in (lambda: moe.dispatch(idx, x, 1),
                 lambda: fi.moe_a2a_dispatch(idx, x, ws, meta, 1, r, R, K, E),
                 lambda: fi.moe_a2a_sanitize_expert_ids(ids, ws, meta, r, -1),
                 lambda: moe.get_combine_payload_tensor_in_workspace(1, H, torch.bfloat16),
                 lambda: moe.combine(y, 1)):
        with pytest.raises(epx.InvalidArgument, match="checkpoint_restore"):
            call()
    with pytest.raises(epx.InvalidArgument, match="'comm_backend'"):
        moe.checkpoint_restore(_WrongSizeComm(ctx.group))
    moe.checkpoint_restore(comm)
    moe.checkpoint_restore(comm)  # again: nothing
    for step in (2, 3):
        combine(step, dispatch(step))


def body_masked_first_eplb(ctx, seed):
    """The first EPLB gather after rank R - 1 stopped (masked off): the exchange exists since
    the MoeAlltoAll was made, so nothing collective over every rank is needed."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M, n = 2 * R, MAX_TOKENS, min(5, 2 * R)
    moe = fi.MoeAlltoAll(_mapping(ctx), M, K, E, hidden_size=H, eplb_stats_num_experts=n,
                         enable_rank_mask=True, **_backend_kw(ctx))
    everyone = fi.moe_a2a_active_rank_mask(range(R), R)
    inputs = _inputs(seed, 0, R, E, K, "uniform")
    idx = inputs[r]["topk_idx"].to(dev)
    payloads = [p.to(dev) for p in inputs[r]["payloads"]]
    _check_recv(moe.dispatch(idx, payloads, M, active_rank_mask=everyone), inputs, r, E, R, M,
                "everyone")
    ys = _ys(seed, 0, R, M, torch.bfloat16)
    out = moe.combine(ys[r].to(dev), M, active_rank_mask=everyone)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), seed
    if R > 1 and r == R - 1:
        return  # rank R - 1 "dies": it never calls again
    active = [q != R - 1 or R == 1 for q in range(R)]
    live = [q for q in range(R) if active[q]]
    mask = fi.moe_a2a_active_rank_mask(live, R)
    for step in (1, 2):
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step])
        masked = _masked(inputs, active, E, R)
        idx = inputs[r]["topk_idx"].to(dev)
        recv = moe.dispatch(idx, [p.to(dev) for p in inputs[r]["payloads"]], M,
                            eplb_local_stats=_stats(seed, step, r, n).to(dev),
                            active_rank_mask=mask)
        _check_recv(recv, masked, r, E, R, M, f"masked step={step}")
        got = moe.eplb_gathered_stats  # the survivors' rows; the dead rank's is unspecified
        assert torch.equal(got[live].cpu(), torch.stack([_stats(seed, step, s, n)
                                                         for s in live])), step
        ys = _ys(seed, step, R, M, torch.bfloat16)
        out = moe.combine(ys[r].to(dev), M, active_rank_mask=mask)
        assert torch.equal(out.cpu(), ref.a2a_combine(masked, ys, r, E, R)), (seed, step)


def body_shared_masked(ctx, seed):
    """Two layers' objects sharing one workspace, of different payload lists (each list its own
    A2a), after rank R - 1 stopped: the survivors' masked rounds through both layers are exact
    (the mask reaches each list's A2a when it is next used); a full mask after that is refused at
    once (masks only shrink), not sent to the stopped rank; a checkpoint round trip through one
    layer leaves the other idle and working."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M = 2 * R, MAX_TOKENS
    size = fi.moe_a2a_get_workspace_size_per_rank(R, M, H * 2 + 64, H * 4)
    layers = [fi.MoeAlltoAll(_mapping(ctx), M, K, E, workspace_size_per_rank=size,
                             enable_rank_mask=True, **_backend_kw(ctx)) for _ in range(2)]
    assert layers[0]._ws is layers[1]._ws  # (epx internals: shared)
    everyone = fi.moe_a2a_active_rank_mask(range(R), R)

    def round_trip(i, step, mask, active):
        moe = layers[i]
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step % len(ref.ROUTINGS)])
        for inp in inputs:  # layer 1: one payload less (its own A2a)
            inp["payloads"] = inp["payloads"][:len(inp["payloads"]) - i]
        masked = _masked(inputs, active, E, R)
        idx = inputs[r]["topk_idx"].to(dev)
        recv = moe.dispatch(idx, [p.to(dev) for p in inputs[r]["payloads"]], M,
                            active_rank_mask=mask)
        _check_recv(recv, masked, r, E, R, M, f"layer={i} step={step}")
        ys = _ys(seed, step, R, M, torch.bfloat16)
        out = moe.combine(ys[r].to(dev), M, active_rank_mask=mask)
        assert torch.equal(out.cpu(), ref.a2a_combine(masked, ys, r, E, R)), (seed, i, step)

    for i in range(2):
        round_trip(i, i, everyone, [True] * R)
    # Layer 1 dispatched, then a checkpoint round trip through layer 0: layer 1 is idle again
    # (its dispatch was dropped with the workspace) and works.
    inputs = _inputs(seed, 5, R, E, K, "uniform")
    layers[1].dispatch(inputs[r]["topk_idx"].to(dev),
                       [p.to(dev) for p in inputs[r]["payloads"][:-1]], M,
                       active_rank_mask=everyone)
    layers[0].checkpoint_prepare()
    with pytest.raises(epx.InvalidArgument, match="checkpoint_restore"):
        layers[1].combine(_ys(seed, 5, R, M, torch.bfloat16)[r].to(dev), M,
                          active_rank_mask=everyone)
    layers[0].checkpoint_restore(EngineComm(ctx.group))
    round_trip(1, 6, everyone, [True] * R)
    if R == 1:
        return
    if r == R - 1:
        return  # rank R - 1 "dies": it never calls again
    active = [q != R - 1 for q in range(R)]
    mask = fi.moe_a2a_active_rank_mask([q for q in range(R) if active[q]], R)
    round_trip(0, 2, mask, active)
    inputs = _inputs(seed, 3, R, E, K, "uniform")
    with pytest.raises(epx.InvalidArgument, match=f"marks rank {R - 1} active, which was masked"):
        layers[1].dispatch(inputs[r]["topk_idx"].to(dev),
                           [p.to(dev) for p in inputs[r]["payloads"][:-1]], M,
                           active_rank_mask=everyone)
    round_trip(1, 3, mask, active)
    round_trip(0, 4, mask, active)


_BODIES = [body_get_workspace, body_handles, body_checkpoint, body_masked_first_eplb,
           body_shared_masked]


@pytest.mark.parametrize("body", _BODIES, ids=lambda b: b.__name__[len("body_"):])
def test_workspace(pool, body):
    pool.run(body, _seed())


@pytest.mark.gpu
@pytest.mark.parametrize("body", _BODIES, ids=lambda b: b.__name__[len("body_"):])
def test_gpu_workspace(gpu_pool, body):
    gpu_pool.run(body, _seed())
