"""epx.compat.flashinfer's functional all-to-all (moe_a2a_initialize, moe_a2a_dispatch,
moe_a2a_sanitize_expert_ids, moe_a2a_wrap_payload_tensor_in_workspace, moe_a2a_combine) and the
low-precision (FP8) combine, modelled on FlashInfer's documented behaviour and on how its own
test drives the ops (tests/comm/test_trtllm_moe_alltoall.py): a caller-owned workspace
[ep_size, size_per_rank] and its metainfo; payloads of several dtypes, rows of any byte count; the
expert ids sanitised by the separate op (padding rows only); the MoE output written into the
workspace at combine_payload_offset or passed in, combine(output=); EPLB stats up to the reserved
count; enable_rank_mask / active_rank_mask (a mask without the flag, the flag without a mask, a
mask leaving out the caller, a dead rank); use_low_precision against an independent FP8 e4m3
table (reference.py), bit for bit, and within FlashInfer's own tolerance of the exact sum.

CPU tier: gloo rank pools (R = 1, 2, 4, 8), epx's cpu backend (the workspace on the CPU). The
`gpu` cases run the same bodies on NCCL pools, one GPU per rank (the workspace on the GPU)."""

import gc
import random

import pytest
import torch

import epx
import epx.compat.flashinfer as fi
import reference as ref
from test_a2a_mask import _masked
from test_conformance_flashinfer import QUANTISED_COMBINE_REASON, QUANTISED_COMBINES

H = 64
MAX_TOKENS = 12


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _e4m3(x):
    """Independent expectation of an FP8 e4m3 round trip (reference.py's table, saturating)."""
    return ref.e4m3_decode(ref.e4m3_encode(x.to(torch.float32)))


def _payloads(g, T, K, idx):
    """FlashInfer's test payloads: hidden states, the expert ids, a second 16-bit tensor, a
    one-byte-per-token tensor (rows whose byte count is not a multiple of 4), bools."""
    return [ref.rand_bf16((T, H), g),
            idx.clone(),
            torch.randn(T, 3, generator=g).to(torch.float16),       # 6 bytes per token
            torch.randint(0, 256, (T, 1), generator=g, dtype=torch.uint8),
            torch.rand(T, 1, generator=g) < 0.5]


def _inputs(seed, step, R, E, K, kind):
    out = []
    for s in range(R):
        g = ref.generator(seed, step, s)
        T = 0 if (R > 1 and s == (step % R)) else int(torch.randint(1, MAX_TOKENS + 1, (1,),
                                                                     generator=g))
        idx = ref.routing(kind, T, K, E, R, g).to(torch.int32)
        out.append(dict(topk_idx=idx, payloads=_payloads(g, T, K, idx)))
    return out


def _ys(seed, step, R, M, dtype, scale=2.0):
    """The MoE output of every rank d: y_d [R, M, H]."""
    return [ref.rand_bf16((R, M, H), ref.generator(seed, step, d, "y"), scale).to(dtype)
            for d in range(R)]


def _workspace(ctx, size):
    return torch.full((ctx.world_size, size), 0x5A, dtype=torch.uint8, device=ctx.device)


def _check_recv(recv, inputs, r, E, R, M, what):
    want, counts = ref.a2a_dispatch(inputs, r, E, R)
    assert len(recv) == len(inputs[r]["payloads"]), what
    for i, view in enumerate(recv):
        p = inputs[r]["payloads"][i]
        assert view.dtype == p.dtype and list(view.shape) == [R, M] + list(p.shape[1:]), \
            (what, i, view.dtype, view.shape)
        for s in range(R):
            assert torch.equal(view[s, :counts[s]].cpu(), want[s][i]), (what, i, s)
    return counts


def body_functional_roundtrip(ctx, seed):
    """FlashInfer's functional sequence, several steps and two geometries (top_k / num_experts
    change between dispatches: the workspace is re-created)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    size = fi.moe_a2a_get_workspace_size_per_rank(R, MAX_TOKENS, H * 2 + 8 * 4 + 6 + 1 + 1,
                                                  H * 4)
    ws = _workspace(ctx, size)
    meta = fi.moe_a2a_initialize(ws, r, R, MAX_TOKENS, comm_backend=ctx.group)
    assert meta.device.type == "cpu" and meta.dtype == torch.int64 and meta.dim() == 1
    assert not ws[r].any()  # this rank's row zeroed, as FlashInfer's initialize does
    again = fi.moe_a2a_initialize(ws, r, R, MAX_TOKENS, comm_backend=ctx.group)
    assert torch.equal(again, meta)  # idempotent
    steps = 0
    for K, E in ((3, 2 * R), (2, 4 * R)):
        for step, kind in enumerate(ref.ROUTINGS):
            # Over the six routings: every dtype with and without in_ws, output= with each dtype.
            in_ws, use_out, dtype = step % 2 == 1, step % 4 < 2, \
                (torch.bfloat16, torch.float32, torch.float16)[step % 3]
            what = (f"seed={seed} K={K} step={step} kind={kind} in_ws={in_ws} out={use_out} "
                    f"dtype={dtype}")
            inputs = _inputs(seed + K, step, R, E, K, kind)
            mine = inputs[r]
            T = mine["topk_idx"].shape[0]
            M = max(max(i["topk_idx"].shape[0] for i in inputs), 1)
            recv, off, stats = fi.moe_a2a_dispatch(
                mine["topk_idx"].to(dev), [p.to(dev) for p in mine["payloads"]], ws, meta, M,
                r, R, K, E, enable_pdl=True)
            assert stats is None and isinstance(off, int) and off >= 0, what
            counts = _check_recv(recv, inputs, r, E, R, M, what)
            # The expert ids' padding rows, and only those, get the invalid id.
            want_ids = recv[1].clone()
            for s in range(R):
                want_ids[s, counts[s]:] = -3
            fi.moe_a2a_sanitize_expert_ids(recv[1], ws, meta, r, -3, enable_pdl=False)
            assert torch.equal(recv[1].cpu(), want_ids.cpu()), what
            ys = _ys(seed + K, step, R, M, dtype)
            if in_ws:
                payload = fi.moe_a2a_wrap_payload_tensor_in_workspace(
                    ws[r], [R, M], off, off + R * M * H * ys[r].element_size(), dtype)
                assert list(payload.shape) == [R, M, H], what
                payload.copy_(ys[r].to(dev))
            else:
                payload = ys[r].to(dev)
            buf = torch.full((T, H), float("nan"), dtype=dtype, device=dev) if use_out else None
            out = fi.moe_a2a_combine(payload, T, ws, meta, M, r, R, K, off,
                                     payload_in_workspace=in_ws, output=buf)
            if use_out:
                assert out is buf, what
            assert out.dtype == dtype and list(out.shape) == [T, H], what
            assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), what
            steps += 1
    return steps


def body_functional_low_precision(ctx, seed):
    """combine(use_low_precision=True), functional and MoeAlltoAll: rows rounded to e4m3, summed
    in f32 in ascending rank order, rounded once to bf16 (the output dtype for bf16, fp16 and
    f32 payloads); saturation at 448 and subnormals included; within FlashInfer's tolerance
    (atol 0.5, rtol 0.2) of the exact sum where nothing saturates."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    K, E = 2, 2 * R
    size = fi.moe_a2a_get_workspace_size_per_rank(R, MAX_TOKENS, H * 2 + 8 * 4 + 8, H * 4)
    ws = _workspace(ctx, size)
    meta = fi.moe_a2a_initialize(ws, r, R, MAX_TOKENS, comm_backend=ctx.group)
    moe = fi.MoeAlltoAll(fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R), MAX_TOKENS,
                         K, E, hidden_size=H, backend="cpu" if dev.type == "cpu" else "cuda",
                         mnnvl_config=fi.MnnvlConfig(comm_backend=ctx.group))
    cases = [(dtype, in_ws, api) for api in ("functional", "class")
             for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for in_ws in (False, True)]
    for step, (dtype, in_ws, api) in enumerate(cases):
        what = f"seed={seed} step={step} dtype={dtype} in_ws={in_ws} api={api}"
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step % len(ref.ROUTINGS)])
        mine = inputs[r]
        T = mine["topk_idx"].shape[0]
        M = max(max(i["topk_idx"].shape[0] for i in inputs), 1)
        idx, payloads = mine["topk_idx"].to(dev), [p.to(dev) for p in mine["payloads"]]
        ys = _ys(seed, step, R, M, dtype, scale=1.0)
        if step % 3 == 2:  # saturating and subnormal magnitudes, infinities
            for d in range(R):
                y = ys[d].to(torch.float32)
                y[:, :, :8] *= 300.0
                y[:, :, 8:16] *= 2.0 ** -9
                y[:, :, 16] = float("inf")
                y[:, :, 17] = -float("inf")
                ys[d] = y.to(dtype)
        if api == "functional":
            # As the newest FlashInfer's callers do: an opaque view cache, left as it is.
            views = {}
            recv, off, _ = fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E,
                                               recv_view_cache=views)
            assert views == {}, what
        else:
            recv = moe.dispatch(idx, payloads, M)
        _check_recv(recv, inputs, r, E, R, M, what)
        if in_ws:
            if api == "functional":
                payload = fi.moe_a2a_wrap_payload_tensor_in_workspace(
                    ws[r], [R, M], off, off + R * M * H * ys[r].element_size(), dtype)
            else:
                payload = moe.get_combine_payload_tensor_in_workspace(M, H, dtype)
            payload.copy_(ys[r].to(dev))
        else:
            payload = ys[r].to(dev)
        kw = dict(payload_in_workspace=in_ws, use_low_precision=True)
        if step % 2:
            kw["output"] = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
        if step % 4 == 1:
            kw["output_dtype"] = torch.bfloat16
        if api == "functional":
            out = fi.moe_a2a_combine(payload, T, ws, meta, M, r, R, K, off, **kw)
        else:
            out = moe.combine(payload, M, **kw)
        if "output" in kw:
            assert out is kw["output"], what
        if in_ws and api == "class":  # rounded in place (an fp16 payload's as bf16 rows)
            held = payload.view(torch.bfloat16) if dtype == torch.float16 else payload
            assert torch.equal(held.cpu().to(torch.float32), _e4m3(ys[r])), what
        assert out.dtype == torch.bfloat16 and list(out.shape) == [T, H], what
        rounded = [_e4m3(y).to(torch.bfloat16) for y in ys]  # e4m3 values are bf16 values
        assert all(torch.equal(q.to(torch.float32), _e4m3(y)) for q, y in zip(rounded, ys))
        want = ref.a2a_combine(inputs, rounded, r, E, R)
        assert torch.equal(out.cpu(), want), what
        if step % 3 != 2:
            exact = ref.a2a_combine(inputs, [y.to(torch.float32) for y in ys], r, E, R)
            torch.testing.assert_close(out.cpu().to(torch.float32), exact, atol=0.5, rtol=0.2)
    # What FlashInfer rejects with use_low_precision.
    idx = torch.zeros(1, K, dtype=torch.int32, device=dev)
    x = torch.zeros(1, H, dtype=torch.bfloat16, device=dev)
    moe.dispatch(idx, [x], 1)
    y = torch.zeros(R, 1, H, dtype=torch.float32, device=dev)
    with pytest.raises(epx.InvalidArgument, match="output_dtype"):
        moe.combine(y, 1, output_dtype=torch.float32, use_low_precision=True)
    with pytest.raises(epx.InvalidArgument, match="'output'"):
        moe.combine(y, 1, output=torch.empty(1, H, device=dev), use_low_precision=True)
    with pytest.raises(epx.InvalidArgument, match="dtype"):
        moe.combine(y.to(torch.int32), 1, use_low_precision=True)
    with pytest.raises(epx.InvalidArgument, match="output_dtype"):  # fp16 out: without it
        moe.combine(y.to(torch.float16), 1, output_dtype=torch.float16, use_low_precision=True)
    assert bool((moe.combine(y, 1, use_low_precision=True) == 0).all())
    return len(cases)


def body_functional_eplb(ctx, seed):
    """EPLB stats through the functional dispatch: up to the count reserved at initialize."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    K, E = 2, 4 * R
    reserve = E // 2 + 1
    ws = _workspace(ctx, fi.moe_a2a_get_workspace_size_per_rank(
        R, MAX_TOKENS, H * 2, H * 2, eplb_stats_num_experts=reserve))
    meta = fi.moe_a2a_initialize(ws, r, R, MAX_TOKENS, reserve, comm_backend=ctx.group)
    for step, n in enumerate((reserve, 1, reserve - 2)):
        stats = [torch.arange(n, dtype=torch.int32) + 1000 * s +
                 torch.randint(0, 100, (n,), generator=ref.generator(seed, step, s),
                               dtype=torch.int32) for s in range(R)]
        g = ref.generator(seed, step, "x", r)
        idx = ref.routing("uniform", 4, K, E, R, g).to(torch.int32).to(dev)
        _, off, got = fi.moe_a2a_dispatch(idx, [ref.rand_bf16((4, H), g).to(dev)], ws, meta, 4,
                                          r, R, K, E, eplb_local_stats=stats[r].to(dev))
        assert got.dtype == torch.int32 and got.device.type == dev.type
        assert torch.equal(got.cpu(), torch.stack(stats)), (seed, step, n)
        fi.moe_a2a_combine(torch.zeros(R, 4, H, dtype=torch.bfloat16, device=dev), 4, ws, meta,
                           4, r, R, K, off)
    idx = torch.zeros(1, K, dtype=torch.int32, device=dev)
    x = [torch.zeros(1, H, dtype=torch.bfloat16, device=dev)]
    with pytest.raises(epx.InvalidArgument, match="eplb_local_stats"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, 1, r, R, K, E,
                            eplb_local_stats=torch.zeros(reserve + 1, dtype=torch.int32,
                                                         device=dev))
    with pytest.raises(epx.InvalidArgument, match="'recv_view_cache' is a list, expected a dict"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, 1, r, R, K, E, recv_view_cache=[])
    plain = _workspace(ctx, ws.shape[1])
    meta0 = fi.moe_a2a_initialize(plain, r, R, MAX_TOKENS, comm_backend=ctx.group)
    with pytest.raises(epx.InvalidArgument, match="eplb_local_stats"):
        fi.moe_a2a_dispatch(idx, x, plain, meta0, 1, r, R, K, E,
                            eplb_local_stats=torch.zeros(1, dtype=torch.int32, device=dev))


def _stats(seed, step, s, n):
    return torch.randint(0, 1 << 20, (n,), generator=ref.generator(seed, step, s, "eplb"),
                         dtype=torch.int32)


def body_functional_rank_mask(ctx, seed):
    """FlashInfer's mask rules, then rank R - 1 stops calling and the others go on (EPLB stats
    gathered among them)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    K, E, M = 3, 2 * R, MAX_TOKENS
    n = min(5, E)
    ws = _workspace(ctx, fi.moe_a2a_get_workspace_size_per_rank(R, M, H * 2 + 64, H * 4))
    meta = fi.moe_a2a_initialize(ws, r, R, M, n, comm_backend=ctx.group)
    everyone = fi.moe_a2a_active_rank_mask(range(R), R)
    inputs = _inputs(seed, 0, R, E, K, "uniform")
    idx, payloads = inputs[r]["topk_idx"].to(dev), [p.to(dev) for p in inputs[r]["payloads"]]
    with pytest.raises(epx.InvalidArgument, match="without 'active_rank_mask'"):
        fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E, enable_rank_mask=True)
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=False"):
        fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E, active_rank_mask=everyone)
    if R > 1:
        others = fi.moe_a2a_active_rank_mask([q for q in range(R) if q != r], R)
        with pytest.raises(epx.InvalidArgument, match="leaves out this rank"):
            fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E, enable_rank_mask=True,
                                active_rank_mask=others)
    recv, off, got = fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E, None,
                                         _stats(seed, 0, r, n).to(dev), True, everyone)
    _check_recv(recv, inputs, r, E, R, M, "everyone")
    assert torch.equal(got.cpu(), torch.stack([_stats(seed, 0, s, n) for s in range(R)]))
    ys = _ys(seed, 0, R, M, torch.bfloat16)
    with pytest.raises(epx.InvalidArgument, match="without 'active_rank_mask'"):
        fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, off,
                           enable_rank_mask=True)
    out = fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, off,
                             enable_rank_mask=True, active_rank_mask=everyone)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R))
    if R == 1 or r == R - 1:
        return  # rank R - 1 "dies": it never calls again
    active = [q != R - 1 for q in range(R)]
    mask = fi.moe_a2a_active_rank_mask([q for q in range(R) if active[q]], R)
    for step in (1, 2):
        inputs = _inputs(seed, step, R, E, K, ref.ROUTINGS[step])
        masked = _masked(inputs, active, E, R)
        idx = inputs[r]["topk_idx"].to(dev)
        recv, off, got = fi.moe_a2a_dispatch(idx, [p.to(dev) for p in inputs[r]["payloads"]],
                                             ws, meta, M, r, R, K, E,
                                             eplb_local_stats=_stats(seed, step, r, n).to(dev),
                                             enable_rank_mask=True, active_rank_mask=mask)
        counts = _check_recv(recv, masked, r, E, R, M, f"masked step={step}")
        assert counts[R - 1] == 0
        # The survivors' rows; the dead rank's row is unspecified.
        assert torch.equal(got[:R - 1].cpu(), torch.stack([_stats(seed, step, s, n)
                                                           for s in range(R - 1)]))
        ys = _ys(seed, step, R, M, torch.bfloat16)
        if step == 1:
            with pytest.raises(epx.InvalidArgument, match="differs from the mask"):
                fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, off,
                                   enable_rank_mask=True, active_rank_mask=everyone)
        out = fi.moe_a2a_combine(ys[r].to(dev), idx.shape[0], ws, meta, M, r, R, K, off,
                                 enable_rank_mask=True, active_rank_mask=mask)
        assert torch.equal(out.cpu(), ref.a2a_combine(masked, ys, r, E, R)), step


def body_functional_errors(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    K, E, M = 2, 2 * R, 4
    size = fi.moe_a2a_get_workspace_size_per_rank(R, 8, H * 2, H * 2)
    ws = _workspace(ctx, size)
    for bad, needle in ((torch.zeros(R, size, dtype=torch.int32, device=dev), "'workspace'"),
                        (torch.zeros(R + 1, size, dtype=torch.uint8, device=dev), "'workspace'"),
                        (torch.zeros(size, dtype=torch.uint8, device=dev), "'workspace'")):
        with pytest.raises(epx.InvalidArgument, match=needle):
            fi.moe_a2a_initialize(bad, r, R, 8)
    with pytest.raises(epx.InvalidArgument, match="ep_rank"):
        fi.moe_a2a_initialize(ws, R, R, 8)
    with pytest.raises(epx.Unsupported, match="backend='cake'"):
        fi.moe_a2a_initialize(ws, r, R, 8, backend="cake", comm_backend=ctx.group)
    meta = fi.moe_a2a_initialize(ws, r, R, 8, backend="trtllm", comm_backend=ctx.group)
    g = ref.generator(seed, r)
    idx = ref.routing("uniform", 3, K, E, R, g).to(torch.int32).to(dev)
    x = [ref.rand_bf16((3, H), g).to(dev)]
    with pytest.raises(epx.Unsupported, match="backend='cake'"):  # before any collective step
        fi.moe_a2a_dispatch(idx, x, ws, meta, 3, r, R, K, E, backend="cake")
    y = torch.zeros(R, M, H, dtype=torch.bfloat16, device=dev)
    other = _workspace(ctx, size)
    with pytest.raises(epx.InvalidArgument, match="'metainfo'"):
        fi.moe_a2a_dispatch(idx, x, ws, torch.zeros(8, dtype=torch.int64), M, r, R, K, E)
    with pytest.raises(epx.InvalidArgument, match="'metainfo'"):
        fi.moe_a2a_dispatch(idx, x, ws, meta.to(torch.int32), M, r, R, K, E)
    with pytest.raises(epx.InvalidArgument, match="'workspace'"):
        fi.moe_a2a_dispatch(idx, x, other, meta, M, r, R, K, E)
    with pytest.raises(epx.InvalidArgument, match="ep_rank"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, M, (r + 1) % (R + 1), R + 1, K, E)
    with pytest.raises(epx.InvalidArgument, match="preceding moe_a2a_dispatch"):
        fi.moe_a2a_combine(y, 3, ws, meta, M, r, R, K, 0)
    with pytest.raises(epx.InvalidArgument, match="before any moe_a2a_dispatch"):
        fi.moe_a2a_sanitize_expert_ids(torch.zeros(R, M, K, dtype=torch.int32, device=dev), ws,
                                       meta, r, -1)
    with pytest.raises(epx.InvalidArgument, match="token_selected_experts"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, M, r, R, K + 1, E)
    if R > 1:
        with pytest.raises(epx.InvalidArgument, match="num_experts"):
            fi.moe_a2a_dispatch(idx, x, ws, meta, M, r, R, K, E + 1)
    with pytest.raises(epx.OutOfCapacity, match="max_num_tokens"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, 9, r, R, K, E)
    _, off, _ = fi.moe_a2a_dispatch(idx, x, ws, meta, M, r, R, K, E)
    with pytest.raises(epx.InvalidArgument, match="twice"):
        fi.moe_a2a_dispatch(idx, x, ws, meta, M, r, R, K, E)
    for args, needle in (((y, 2, ws, meta, M, r, R, K, off), "local_num_tokens"),
                         ((y, 3, ws, meta, M, r, R, K + 1, off), "top_k"),
                         ((y, 3, ws, meta, M, r, R, K, off + 128), "combine_payload_offset")):
        with pytest.raises(epx.InvalidArgument, match=needle):
            fi.moe_a2a_combine(*args)
    with pytest.raises(epx.InvalidArgument, match="payload_in_workspace"):
        fi.moe_a2a_combine(y, 3, ws, meta, M, r, R, K, off, payload_in_workspace=True)
    with pytest.raises(epx.InvalidArgument, match="'output'"):
        fi.moe_a2a_combine(y, 3, ws, meta, M, r, R, K, off,
                           output=torch.empty(H, 3, dtype=torch.bfloat16, device=dev).t())
    with pytest.raises(epx.InvalidArgument, match="'expert_ids'"):
        fi.moe_a2a_sanitize_expert_ids(torch.zeros(R, M, K, dtype=torch.int64, device=dev), ws,
                                       meta, r, -1)
    for out_dtype, sf_dtype, block in QUANTISED_COMBINES:  # positionally, FlashInfer's order
        scales = torch.zeros(3 * H // block, dtype=sf_dtype, device=dev)
        with pytest.raises(epx.Unsupported, match=QUANTISED_COMBINE_REASON):
            fi.moe_a2a_combine(y, 3, ws, meta, M, r, R, K, off, False, out_dtype, scales, 0.5, 1)
    out = fi.moe_a2a_combine(y, 3, ws, meta, M, r, R, K, off)  # still dispatched: goes through
    assert list(out.shape) == [3, H] and not out.any()
    # A metainfo whose every original is gone names nothing any more (a clone does not count).
    ws2 = _workspace(ctx, size)
    meta2 = fi.moe_a2a_initialize(ws2, r, R, 8, comm_backend=ctx.group)
    copy = meta2.clone()
    del meta2
    gc.collect()
    with pytest.raises(epx.InvalidArgument, match="no longer exists"):
        fi.moe_a2a_dispatch(idx, x, ws2, copy, M, r, R, K, E)


@pytest.mark.parametrize("body", [body_functional_roundtrip, body_functional_low_precision,
                                  body_functional_eplb, body_functional_errors],
                         ids=lambda b: b.__name__[len("body_functional_"):])
def test_functional(pool, body):
    pool.run(body, _seed())


def test_functional_rank_mask(pool):
    pool.run(body_functional_rank_mask, _seed())


def body_eplb_in_groups(ctx, seed, max_top_k):
    """The EPLB exchange with epx's top-k limit lowered to `max_top_k`, so that the stats travel
    as several tokens (token g to ranks g * max_top_k ...), as they do beyond 32 ranks; with the
    rank mask too."""
    saved, fi._MAX_A2A_TOP_K = fi._MAX_A2A_TOP_K, max_top_k
    try:
        body_functional_eplb(ctx, seed)
        body_functional_rank_mask(ctx, seed)
    finally:
        fi._MAX_A2A_TOP_K = saved


def test_eplb_exchange_in_groups(pool):
    pool.run(body_eplb_in_groups, _seed(), 3)


# ---- local (no communication) ----------------------------------------------------------------

def test_round_to_e4m3_every_16_bit_value():
    """The FP8 rounding of use_low_precision against reference.py's e4m3 table: every bf16 and
    fp16 value, and float32 values across the range (ties, saturation, subnormals, NaN)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        x = bits.view(dtype)
        x = x[~torch.isnan(x.to(torch.float32))]
        assert torch.equal(fi._round_to_e4m3(x), _e4m3(x)), dtype
    g = torch.Generator().manual_seed(_seed())
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 1e-2, 1, 30, 300, 1e4)] +
                  [torch.tensor([0.0, -0.0, 448, 449, 463.9, 464, 464.1, 480, float("inf"),
                                 -float("inf"), 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9,
                                 2.0 ** -6, 1.0625, 1.1875, -1.0625])])
    got = fi._round_to_e4m3(x)
    assert torch.equal(got, _e4m3(x))
    assert torch.equal(torch.signbit(got), torch.signbit(x))
    assert bool(torch.isnan(fi._round_to_e4m3(torch.tensor([float("nan")]))).all())
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:  # torch's own conversion agrees where it does not overflow
        inside = x[x.abs() <= 448]
        assert torch.equal(fi._round_to_e4m3(inside), inside.to(f8).to(torch.float32))


def test_workspace_size_zero_payloads():
    """FlashInfer sizes a workspace with zero-byte payloads too (e.g. its EPLB test's combine)."""
    n = fi.moe_a2a_get_workspace_size_per_rank(4, 16, 0, 0)
    assert 0 < n <= fi.moe_a2a_get_workspace_size_per_rank(4, 16, 128, 128)
    assert fi.moe_a2a_get_workspace_size_per_rank(4, 16, 100, 0, eplb_stats_num_experts=8) > 0
    with pytest.raises(epx.InvalidArgument, match="combine_payload_size_per_token"):
        fi.moe_a2a_get_workspace_size_per_rank(4, 16, 100, -1)
    # FlashInfer's kernel choice: its default 'trtllm' is accepted (the same size), 'cake' (SM
    # 100 / 103 only) is Unsupported, anything else InvalidArgument.
    assert fi.moe_a2a_get_workspace_size_per_rank(4, 16, 128, 128, backend="trtllm") == \
        fi.moe_a2a_get_workspace_size_per_rank(4, 16, 128, 128)
    with pytest.raises(epx.Unsupported, match="backend='cake'"):
        fi.moe_a2a_get_workspace_size_per_rank(4, 16, 128, 128, backend="cake")
    with pytest.raises(epx.InvalidArgument, match="'backend' is 'bogus'"):
        fi.moe_a2a_get_workspace_size_per_rank(4, 16, 128, 128, backend="bogus")


# ---- GPU tier --------------------------------------------------------------------------------

def body_graph_eplb_low_precision(ctx, seed, api, num_replays=10):
    """GPU only: dispatch with eplb_local_stats (+ the functional sanitize) and
    combine(use_low_precision=True) captured with torch.cuda.graph on a side stream, then
    replayed on new routings, payloads, MoE outputs and stats copied into the captured tensors;
    the views, the gathered stats and the output are poisoned before every replay and compared
    with the reference after it."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    K, E = 2, 2 * R
    n = min(3, E)
    T = M = MAX_TOKENS - 2  # the same on every rank and replay (a graph's shapes are fixed)
    if api == "class":
        moe = fi.MoeAlltoAll(fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R),
                             MAX_TOKENS, K, E, hidden_size=H, eplb_stats_num_experts=n,
                             mnnvl_config=fi.MnnvlConfig(comm_backend=ctx.group), backend="cuda")
    else:
        ws = torch.zeros(R, fi.moe_a2a_get_workspace_size_per_rank(R, MAX_TOKENS, H * 2 + K * 4,
                                                                   H * 2),
                         dtype=torch.uint8, device=dev)
        meta = fi.moe_a2a_initialize(ws, r, R, MAX_TOKENS, n, comm_backend=ctx.group)

    def call_inputs(call):
        kind = ref.ROUTINGS[call % len(ref.ROUTINGS)]
        inputs = []
        for s in range(R):
            g = ref.generator(seed, call, s)
            idx = ref.routing(kind, T, K, E, R, g).to(torch.int32)
            inputs.append(dict(topk_idx=idx, payloads=[ref.rand_bf16((T, H), g), idx.clone()]))
        return inputs, _ys(seed, call, R, M, torch.bfloat16, 1.0), \
            [_stats(seed, call, s, n) for s in range(R)]

    inputs, ys, stats = call_inputs(0)
    idx, payloads = inputs[r]["topk_idx"].to(dev), [p.to(dev) for p in inputs[r]["payloads"]]
    y, st = ys[r].to(dev), stats[r].to(dev)

    def step():
        if api == "class":
            recv = moe.dispatch(idx, payloads, M, eplb_local_stats=st)
            return recv, moe.eplb_gathered_stats, moe.combine(y, M, use_low_precision=True)
        recv, off, got = fi.moe_a2a_dispatch(idx, payloads, ws, meta, M, r, R, K, E,
                                             eplb_local_stats=st)
        fi.moe_a2a_sanitize_expert_ids(recv[1], ws, meta, r, -1)
        return recv, got, fi.moe_a2a_combine(y, T, ws, meta, M, r, R, K, off,
                                             use_low_precision=True)

    def check(recv, got, out, inputs, ys, stats, what):
        counts = _check_recv(recv, inputs, r, E, R, M, what)
        if api != "class":
            for s in range(R):
                assert bool((recv[1][s, counts[s]:] == -1).all()), (what, s)
        assert torch.equal(got.cpu(), torch.stack(stats)), what
        want = ref.a2a_combine(inputs, [_e4m3(q).to(torch.bfloat16) for q in ys], r, E, R)
        assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), want), what

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # eager first: creates the workspaces (collective, allocates)
        recv, got, out = step()
    side.synchronize()
    check(recv, got, out, inputs, ys, stats, f"seed={seed} api={api} eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        recv, got, out = step()
    for call in range(1, num_replays + 1):
        inputs, ys, stats = call_inputs(call)
        for dst, src in zip([idx, *payloads, y, st], [inputs[r]["topk_idx"],
                                                      *inputs[r]["payloads"], ys[r], stats[r]]):
            dst.copy_(src)
        for t in [*recv, got, out]:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        graph.replay()
        torch.cuda.synchronize(dev)
        check(recv, got, out, inputs, ys, stats, f"seed={seed} api={api} replay={call}")
    return num_replays


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["class", "functional"])
def test_gpu_graph_eplb_low_precision(gpu_pool, api):
    """EPLB stats and the low-precision combine inside CUDA graphs (capture once, replay)."""
    assert gpu_pool.run(body_graph_eplb_low_precision, _seed(), api) == \
        [10] * gpu_pool.world_size


@pytest.mark.gpu
@pytest.mark.parametrize("body", [body_functional_roundtrip, body_functional_low_precision,
                                  body_functional_eplb, body_functional_rank_mask,
                                  body_functional_errors],
                         ids=lambda b: b.__name__[len("body_functional_"):])
def test_gpu_functional(gpu_pool, body):
    gpu_pool.run(body, _seed())
