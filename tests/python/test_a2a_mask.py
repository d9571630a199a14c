"""The a2a rank mask (fault tolerance) from Python on the cpu backend, against reference.py:
epx.A2a.set_active_ranks with random masks (outputs, recv_counts, drop counters, reset), a dead
peer (TimeoutError, refused until the survivors set a mask, then exact results), validation, and
FlashInfer's active_rank_mask in epx.compat.flashinfer.

The expected results of a mask are the reference's on masked inputs: an inactive source sends
nothing (T = 0) and an active source's selections of inactive ranks become -1."""

import random

import pytest
import torch

import epx
import epx.compat.flashinfer as fi
import reference as ref
from test_flashinfer import _backend

H, K = 32, 3


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _mask(seed, R):
    """The same random mask on every rank (at least one rank active)."""
    g = random.Random(seed)
    active = [g.random() < 0.6 for _ in range(R)]
    active[g.randrange(R)] = True
    return active


def _inputs(seed, R, E, M):
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = int(torch.randint(0, M + 1, (1,), generator=g))
        idx = ref.routing("uniform", T, K, E, R, g).to(torch.int32)
        out.append(dict(topk_idx=idx, payloads=[torch.randn(T, H, generator=g), idx.clone()]))
    return out


def _masked(inputs, active, E, R):
    """What the reference must see: inactive sources empty, selections of inactive ranks -1."""
    L = E // R
    out = []
    for s, inp in enumerate(inputs):
        idx = inp["topk_idx"].clone()
        keep = torch.tensor([bool(active[e // L]) if e >= 0 else True
                             for e in idx.flatten().tolist()], dtype=torch.bool).view(idx.shape)
        idx[~keep] = -1
        if not active[s]:
            idx, payloads = idx[:0], [p[:0] for p in inp["payloads"]]
        else:
            payloads = list(inp["payloads"])
        out.append(dict(topk_idx=idx, payloads=payloads))
    return out


def _drops(idx, active, E, R):
    L = E // R
    tokens = selections = 0
    for row in idx.tolist():
        valid = [e for e in row if e >= 0]
        off = [e for e in valid if not active[e // L]]
        selections += len(off)
        tokens += bool(valid) and len(off) == len(valid)
    return tokens, selections


def _cycle(a2a, inputs, active, r, R, E, M, seed):
    """One dispatch + combine on rank r under `active`, checked against the reference."""
    masked = _masked(inputs, active, E, R)
    res = a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
    want, counts = ref.a2a_dispatch(masked, r, E, R)
    assert res.recv_counts.tolist() == counts
    for s in range(R):
        assert counts[s] == 0 or active[s]
        for i in range(2):
            assert torch.equal(res.recv[i][s, :counts[s]], want[s][i]), (s, i)
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, d, "y")) for d in range(R)]
    out = a2a.combine(ys[r], M)
    assert torch.equal(out, ref.a2a_combine(masked, ys, r, E, R))
    return out


def body_random_masks(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    E, M = 2 * R, 6
    group = epx.Group.from_process_group(ctx.group)
    a2a = epx.A2a(group, max_tokens_per_rank=M, top_k=K, num_experts=E,
                  payload_bytes_per_token=[H * 4, K * 4], combine_bytes_per_token=H * 2)
    assert a2a.active_ranks() == [True] * R
    # The group's device: set_active_ranks / reset_dropped_counts default to its current stream.
    assert torch.device(a2a._native.device).type == torch.device(ctx.device).type
    _cycle(a2a, _inputs(seed, R, E, M), [True] * R, r, R, E, M, seed)
    active = _mask(seed, R)
    if not active[r]:
        return  # this rank is "dead" from here on
    a2a.set_active_ranks(active)
    assert a2a.active_ranks() == active
    want = [0, 0]
    for c in range(3):
        inputs = _inputs(seed + 1 + c, R, E, M)
        out = _cycle(a2a, inputs, active, r, R, E, M, seed + c)
        t, s = _drops(inputs[r]["topk_idx"], active, E, R)
        want = [want[0] + t, want[1] + s]
        assert a2a.dropped_counts() == tuple(want)
        # Tokens whose selections were all dropped come back as zeros.
        for i, row in enumerate(inputs[r]["topk_idx"].tolist()):
            if any(e >= 0 for e in row) and all(e < 0 or not active[e // (E // R)] for e in row):
                assert not out[i].any()
    a2a.reset_dropped_counts()
    assert a2a.dropped_counts() == (0, 0)


def test_random_masks(pool):
    for _ in range(2):
        pool.run(body_random_masks, _seed())


def body_dead_peer(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    E, M = 2 * R, 5
    # 1 s: the survivors' resynchronisation waits 2 timeouts for every live rank, and on a loaded
    # 2-core CI machine a live rank once took longer than 0.8 s to get there.
    group = epx.Group.from_process_group(ctx.group, timeout=1.0)
    a2a = epx.A2a(group, max_tokens_per_rank=M, top_k=K, num_experts=E,
                  payload_bytes_per_token=[H * 4, K * 4], combine_bytes_per_token=H * 2)
    _cycle(a2a, _inputs(seed, R, E, M), [True] * R, r, R, E, M, seed)
    if r == R - 1:
        return  # dies: never dispatches again
    inputs = _inputs(seed + 1, R, E, M)
    with pytest.raises(epx.Timeout, match="a2a dispatch"):
        a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
    with pytest.raises(epx.InternalError, match="set_active_ranks"):
        a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
    active = [True] * (R - 1) + [False]
    a2a.set_active_ranks(active)
    for c in range(2):
        _cycle(a2a, _inputs(seed + 2 + c, R, E, M), active, r, R, E, M, seed + c)


def test_dead_peer_then_survivors_continue(pool):
    if pool.world_size == 1:
        pytest.skip("a dead peer needs a peer (R >= 2)")
    pool.run(body_dead_peer, _seed())


def body_validation(ctx):
    R, r = ctx.world_size, ctx.rank
    group = epx.Group.from_process_group(ctx.group)
    a2a = epx.A2a(group, max_tokens_per_rank=2, top_k=1, num_experts=R,
                  payload_bytes_per_token=[4], combine_bytes_per_token=4)
    with pytest.raises(epx.InvalidArgument, match=f"'active' has {R + 1} entries, expected {R}"):
        a2a.set_active_ranks([True] * (R + 1))
    off = [True] * R
    off[r] = False
    with pytest.raises(epx.InvalidArgument, match=rf"'active\[{r}\]' \(this rank\) is false"):
        a2a.set_active_ranks(off)
    assert a2a.active_ranks() == [True] * R


def test_validation(pool2):
    pool2.run(body_validation)


def body_flashinfer_mask(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    E, M = 2 * R, 4
    active = [rank != 2 for rank in range(R)]  # rank 2 "failed"
    mask = fi.moe_a2a_active_rank_mask([q for q in range(R) if active[q]], R)
    assert mask.numel() == fi.MOE_A2A_RANK_MASK_WORDS and int(mask[0]) == 0b1011
    with pytest.raises(epx.InvalidArgument, match="out of range"):
        fi.moe_a2a_active_rank_mask([R], R)
    mapping = fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R)
    moe = fi.MoeAlltoAll(mapping, M, K, E, hidden_size=H, enable_rank_mask=True,
                         backend=_backend(ctx))
    inputs = _inputs(seed, R, E, M)
    # First dispatch with every rank: creates the workspace (collective over all ranks). As in
    # FlashInfer, enable_rank_mask=True needs a mask on every call.
    everyone = fi.moe_a2a_active_rank_mask(range(R), R)
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=True"):
        moe.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
    recv = moe.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M,
                        active_rank_mask=everyone)
    y = torch.zeros(R, M, H, dtype=torch.bfloat16)
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=True"):
        moe.combine(y, M)
    moe.combine(y, M, active_rank_mask=everyone)
    if not active[r]:
        return
    inputs = _inputs(seed + 1, R, E, M)
    masked = _masked(inputs, active, E, R)
    recv = moe.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M, active_rank_mask=mask)
    want, counts = ref.a2a_dispatch(masked, r, E, R)
    assert moe.recv_counts.tolist() == counts
    for s in range(R):
        assert torch.equal(recv[0][s, :counts[s]], want[s][0])
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, d, "y")) for d in range(R)]
    with pytest.raises(epx.InvalidArgument, match="differs from the mask of the preceding"):
        moe.combine(ys[r], M, active_rank_mask=fi.moe_a2a_active_rank_mask(range(R), R))
    out = moe.combine(ys[r], M, active_rank_mask=mask)
    assert torch.equal(out, ref.a2a_combine(masked, ys, r, E, R))
    assert moe.dropped_counts() == _drops(inputs[r]["topk_idx"], active, E, R)


def test_flashinfer_active_rank_mask():
    from conftest import get_pool
    get_pool(4).run(body_flashinfer_mask, _seed())


def body_flashinfer_mask_needs_enable(ctx):
    R, r = ctx.world_size, ctx.rank
    mapping = fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R)
    moe = fi.MoeAlltoAll(mapping, 2, 1, R, hidden_size=H, backend=_backend(ctx))
    idx = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=False"):
        moe.dispatch(idx, [torch.zeros(1, H)], 1, active_rank_mask=[True] * R)


def test_flashinfer_mask_needs_enable(pool2):
    pool2.run(body_flashinfer_mask_needs_enable)
