"""epx.compat.deep_ep, low-latency mode (epx ll) on the cpu backend, against reference.py.

Every rank regenerates every rank's inputs from the test's seed, so it knows what it must receive;
outputs the caller provides are poisoned first; every valid element is compared bit for bit.
"""

import copy
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref
from conftest import get_pool, gpu_skip_reason

H = 256  # two fp8 groups of 128; ll needs H % 128 == 0
K = 4


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _inputs(seed, R, E, T_of, kind="uniform"):
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = T_of(s)
        out.append(dict(x=ref.rand_bf16((T, H), g, scale=3.0),
                        topk_idx=ref.routing(kind, T, K, E, R, g),
                        topk_weights=ref.rand_weights(T, K, g)))
    return out


def _y(seed, d, L, R, T_max):
    return ref.rand_bf16((L, R * T_max, H), ref.generator(seed, d, "y"))


def _check_dispatch(ctx, inputs, res, E, T_max, use_fp8, round_scale, use_ue8m0, what):
    R, r = ctx.world_size, ctx.rank
    L = E // R
    recv, count, handle, event, hook = res
    want = ref.ll_dispatch(inputs, r, E, R, T_max, use_fp8, round_scale)
    assert isinstance(event, deep_ep.EventOverlap)
    assert count.dtype == torch.int32 and list(count.shape) == [L], what
    assert count.tolist() == [w["count"] for w in want], what
    src_info, layout_range, t_max, hidden, num_experts = handle
    assert (t_max, hidden, num_experts) == (T_max, H, E), what
    assert list(src_info.shape) == [L, R * T_max] and src_info.dtype == torch.int32
    assert list(layout_range.shape) == [L, R] and layout_range.dtype == torch.int64
    count, src_info, layout_range = count.cpu(), src_info.cpu(), layout_range.cpu()
    if use_fp8:
        recv_x, scales = recv
        assert recv_x.dtype == epx.fp8_dtype and list(recv_x.shape) == [L, R * T_max, H], what
        G = H // 128
        if use_ue8m0:
            assert scales.dtype == torch.int32
            assert list(scales.shape) == [L, R * T_max, (G + 3) // 4], what
        else:
            assert scales.dtype == torch.float32 and list(scales.shape) == [L, R * T_max, G]
        # Column-major in the last two dims (what grouped-GEMM kernels read with TMA).
        assert scales.stride(1) == 1 and scales.stride(2) == R * T_max, (what, scales.stride())
        recv_x, scales = recv_x.cpu(), scales.cpu()
    else:
        recv_x, scales = recv.cpu(), None
        assert recv_x.dtype == torch.bfloat16 and list(recv_x.shape) == [L, R * T_max, H], what
    for l in range(L):
        n = want[l]["count"]
        assert torch.equal(layout_range[l], want[l]["layout_range"]), (what, l)
        assert torch.equal(src_info[l, :n], want[l]["src_info"]), (what, l)
        if n == 0:
            continue
        got = recv_x[l, :n]
        if use_fp8:
            assert torch.equal(got.view(torch.uint8), want[l]["x"]), (what, l)
            s = want[l]["scales"]
            exp = ref.ue8m0_pack(s) if use_ue8m0 else s
            assert torch.equal(scales[l, :n], exp), (what, l)
        else:
            assert torch.equal(got, want[l]["x"]), (what, l)


def _unread(t):
    """The x of a zero_copy combine: NaN, not the buffer's view, so a combine that read x instead
    of the rows written into the buffer would be caught."""
    return torch.full_like(t, float("nan"))


def _assert_combined(got, want, topk_idx, L, what, buf=None):
    """Bit-for-bit; on a mismatch say which tokens differ, how, and where their experts live,
    and first raise what the device reported (a timeout, a bad id) when `buf` is given."""
    if torch.equal(got, want):
        return
    if buf is not None and buf._ll is not None:
        buf._ll.check()  # an error found on the device explains the mismatch: raise it instead
    bad = (got.view(torch.int16) != want.view(torch.int16)).any(dim=1).nonzero().flatten()
    lines = []
    for t in bad[:8].tolist():
        cols = (got[t].view(torch.int16) != want[t].view(torch.int16)).nonzero().flatten()
        ids = topk_idx[t].tolist()
        lines.append(f"t={t} ids={ids} ranks={[e // L if e >= 0 else -1 for e in ids]} "
                     f"{len(cols)} cols differ, first {cols[:4].tolist()}: got "
                     f"{got[t, cols[:4]].tolist()} want {want[t, cols[:4]].tolist()}")
    raise AssertionError(f"{what}: {len(bad)} of {got.shape[0]} tokens differ\n" +
                         "\n".join(lines))


def body_ll_roundtrip(ctx, seed):
    """bf16 and fp8 (plain, round_scale, UE8M0) dispatch, bf16 also with round_scale and
    use_ue8m0 set (they act on fp8 only, as in DeepEP); combine; stats; handle; several routings
    and T = 0 on a rank."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    T_max = 24
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True,
                         num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
                             T_max, H, R, E))
    stats = torch.zeros(L, dtype=torch.int32, device=dev)
    expected_stats = torch.zeros(L, dtype=torch.int64)
    cases = [(kind, fp8, rs, ue) for kind in ref.ROUTINGS
             for fp8, rs, ue in ((False, False, False), (True, False, False))]
    cases += [("uniform", True, True, False), ("uniform", True, True, True),
              ("duplicates", True, True, True),
              # bf16 with the fp8 scale options set (as some engines pass them): ignored, as DeepEP
              ("uniform", False, True, True)]
    for i, (kind, use_fp8, round_scale, use_ue8m0) in enumerate(cases):
        what = f"seed={seed} case={i} kind={kind} fp8={use_fp8} rs={round_scale} ue={use_ue8m0}"
        s = seed + i
        inputs = _inputs(s, R, E, lambda src: 0 if (i % 3 == 1 and src == 0) else
                         (T_max if i % 4 == 0 else 7 + src), kind)
        mine = inputs[r]
        res = buf.low_latency_dispatch(mine["x"].to(dev), mine["topk_idx"].to(dev), T_max, E,
                                       cumulative_local_expert_recv_stats=stats,
                                       use_fp8=use_fp8, round_scale=round_scale,
                                       use_ue8m0=use_ue8m0)
        assert res[4] is None  # no hook unless asked
        _check_dispatch(ctx, inputs, res, E, T_max, use_fp8, round_scale, use_ue8m0, what)
        want = ref.ll_dispatch(inputs, r, E, R, T_max, use_fp8, round_scale)
        expected_stats += torch.tensor([w["count"] for w in want])
        assert torch.equal(stats.cpu().to(torch.int64), expected_stats), what
        ys = [_y(s, d, L, R, T_max) for d in range(R)]
        assert copy.copy(res[2]) is res[2] and copy.deepcopy(res[2]) is res[2]
        out, event, hook = buf.low_latency_combine(ys[r].to(dev), mine["topk_idx"].to(dev),
                                                   mine["topk_weights"].to(dev),
                                                   copy.deepcopy(res[2]))
        assert hook is None and isinstance(event, deep_ep.EventOverlap)
        assert out.dtype == torch.bfloat16 and list(out.shape) == [mine["x"].shape[0], H]
        _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), mine["topk_idx"], L,
                         what, buf)


def body_ll_hook_zero_copy_out(ctx, seed):
    """return_recv_hook (two dispatches in flight), zero_copy through
    get_next_low_latency_combine_buffer, `out=`, int32 topk_idx, clean_low_latency_buffer."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    L = E // R
    T_max = 16
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    a = _inputs(seed, R, E, lambda s: min(T_max, 5 + 2 * s))
    b = _inputs(seed + 1, R, E, lambda s: T_max - s)
    ad = {k: v.to(dev) for k, v in a[r].items()}
    bd = {k: v.to(dev) for k, v in b[r].items()}
    ra = buf.low_latency_dispatch(ad["x"], ad["topk_idx"], T_max, E, use_fp8=True,
                                  return_recv_hook=True)
    rb = buf.low_latency_dispatch(bd["x"], bd["topk_idx"].to(torch.int32), T_max, E,
                                  use_fp8=False, return_recv_hook=True)
    assert callable(ra[4]) and callable(rb[4])
    ra[4]()
    rb[4]()
    with pytest.raises(epx.InvalidArgument, match="second time"):
        ra[4]()
    _check_dispatch(ctx, a, ra, E, T_max, True, False, False, f"seed={seed} hook a")
    _check_dispatch(ctx, b, rb, E, T_max, False, False, False, f"seed={seed} hook b")

    # zero_copy: expert outputs written straight into the buffer's combine view.
    ys = [_y(seed, d, L, R, T_max) for d in range(R)]
    view = buf.get_next_low_latency_combine_buffer(ra[2])
    assert view.dtype == torch.bfloat16 and list(view.shape) == [L, R * T_max, H]
    view.copy_(ys[r].to(dev))
    out, _, hook = buf.low_latency_combine(_unread(view), ad["topk_idx"], ad["topk_weights"],
                                           ra[2], zero_copy=True, return_recv_hook=True)
    assert callable(hook)
    hook()
    assert torch.equal(out.cpu(), ref.ll_combine(a, ys, r, E, R)), f"seed={seed} zero_copy"

    # out=: poisoned caller tensor, returned as the result.
    ys = [_y(seed + 7, d, L, R, T_max) for d in range(R)]
    Tb = bd["x"].shape[0]
    dst = torch.full((Tb, H), float("nan"), dtype=torch.bfloat16, device=dev)
    out, _, _ = buf.low_latency_combine(ys[r].to(dev), bd["topk_idx"].to(torch.int32),
                                        bd["topk_weights"], rb[2], out=dst)
    assert out is dst
    assert torch.equal(dst.cpu(), ref.ll_combine(b, ys, r, E, R)), f"seed={seed} out="

    # Clean, then the buffer works as before.
    buf.clean_low_latency_buffer(T_max, H, E)
    buf.clean_low_latency_buffer(T_max + 1, H, E)  # no buffer of that shape: nothing to clean
    rc = buf.low_latency_dispatch(ad["x"], ad["topk_idx"], T_max, E, use_fp8=False)
    _check_dispatch(ctx, a, rc, E, T_max, False, False, False, f"seed={seed} after clean")


def body_ll_errors(ctx, seed):
    """Every bad input or unsupported option raises its mapped class with a clear message (on
    every rank alike, so no rank is left waiting)."""
    R, r = ctx.world_size, ctx.rank
    E = 2 * R
    T_max = 8
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    inp = _inputs(seed, R, E, lambda s: 4)[r]
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    res = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False)
    handle = res[2]
    y = torch.zeros(E // R, R * T_max, H, dtype=torch.bfloat16)
    cases = [
        # NVFP4 (DeepEP's use_fp8 defaults to True): one of the two; a global scale; e4m3 scales.
        (epx.InvalidArgument, "'use_nvfp4'", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_nvfp4=True, x_global_scale=torch.ones(1))),
        (epx.InvalidArgument, "'x_global_scale' is required", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=False, use_nvfp4=True)),
        (epx.InvalidArgument, "'x_global_scale'", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=False, use_nvfp4=True,
            x_global_scale=torch.ones(1, dtype=torch.float64))),
        (epx.Unsupported, "'use_ue8m0'", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=False, use_nvfp4=True, round_scale=True, use_ue8m0=True,
            x_global_scale=torch.ones(1))),
        (epx.InvalidArgument, "async_finish", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, async_finish=True, return_recv_hook=True)),
        # use_ue8m0 without round_scale: refused in every format, as DeepEP asserts it.
        (epx.InvalidArgument, "'use_ue8m0' is true", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=False, use_ue8m0=True)),
        (epx.OutOfCapacity, "T_max", lambda: buf.low_latency_dispatch(
            torch.zeros(T_max + 1, H, dtype=torch.bfloat16),
            torch.zeros(T_max + 1, K, dtype=torch.int64), T_max, E)),
        (epx.InvalidArgument, "'x' has dtype f32", lambda: buf.low_latency_dispatch(
            x.float(), idx, T_max, E)),
        (epx.InvalidArgument, f"value {E}", lambda: buf.low_latency_dispatch(
            x, torch.full_like(idx, E), T_max, E)),
        (epx.InvalidArgument, "value -2", lambda: buf.low_latency_dispatch(
            x, torch.full_like(idx, -2), T_max, E)),
        (epx.InvalidArgument, "round_scale", lambda: buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=True, use_ue8m0=True)),
        (epx.InvalidArgument, "cumulative_local_expert_recv_stats", lambda:
            buf.low_latency_dispatch(x, idx, T_max, E,
                                     cumulative_local_expert_recv_stats=torch.zeros(
                                         E // R, dtype=torch.int64))),
        (epx.InvalidArgument, "handle", lambda: buf.low_latency_combine(
            y, idx, w, (1, 2, 3, 4, 5))),
        (epx.InvalidArgument, "'topk_weights'", lambda: buf.low_latency_combine(
            y, idx, w[:, :1], handle)),
        (epx.InvalidArgument, "'y'", lambda: buf.low_latency_combine(y[:, :1], idx, w, handle)),
        (epx.InvalidArgument, "expected a torch.Tensor", lambda: buf.low_latency_dispatch(
            x.tolist(), idx, T_max, E)),
    ]
    for cls, needle, call in cases:
        with pytest.raises(cls) as info:
            call()
        assert needle in str(info.value), (needle, str(info.value))
        assert isinstance(info.value, epx.EpxError)
    # After all those failures the buffer still works (nothing was half-sent): zero expert rows
    # combine to zeros.
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    assert out.shape == (4, H) and not bool(out.any())

    normal = deep_ep.Buffer(ctx.group)  # low_latency_mode=False
    with pytest.raises(epx.InvalidArgument, match="low_latency_mode=False"):
        normal.low_latency_dispatch(x, idx, T_max, E)


def body_ll_staggered_destroy(ctx, seed):
    """Ranks drop their Buffers at different points, as the garbage collector does: rank 0
    before the next Buffer is made, rank 1 after that Buffer's dispatch and combine. Destruction
    is local, so the next Buffer's collectives still pair up and its results are exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    L = E // R
    T_max = 8
    for round_ in range(3):
        what = f"seed={seed} round={round_}"
        old = deep_ep.Buffer(ctx.group, low_latency_mode=True)
        old.low_latency_dispatch(torch.zeros(1, H, dtype=torch.bfloat16, device=dev),
                                 torch.zeros(1, 1, dtype=torch.int64, device=dev), T_max, E,
                                 use_fp8=False)
        if r == 0:
            del old
        buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
        inputs = _inputs(seed + round_, R, E, lambda src: 3 + src % 6)
        mine = inputs[r]
        res = buf.low_latency_dispatch(mine["x"].to(dev), mine["topk_idx"].to(dev), T_max, E,
                                       use_fp8=False)
        _check_dispatch(ctx, inputs, res, E, T_max, False, False, False, what)
        ys = [_y(seed + round_, d, L, R, T_max) for d in range(R)]
        out, _, _ = buf.low_latency_combine(ys[r].to(dev), mine["topk_idx"].to(dev),
                                            mine["topk_weights"].to(dev), res[2])
        _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), mine["topk_idx"], L,
                         what, buf)
        if r != 0:
            del old
        del buf, res, out


def _calc_diff(x, y):
    """DeepEP's tests' measure: 1 - 2 sum((x + 1)(y + 1)) / sum((x + 1)^2 + (y + 1)^2)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def body_ll_logfmt(ctx, seed):
    """low_latency_combine(use_logfmt=True) as DeepEP's test_low_latency.py --use-logfmt drives
    it: x batches of randn * 0.5 * u (and u = 0.2 with a few zeros: clipped groups), the identity
    expert (y = the received rows, fp8 cast back); hook or not, zero_copy or not, a poisoned out.
    Each result equals reference.ll_combine(use_logfmt=True) bit for bit (an independent torch
    implementation of LogFMT-10) and is within DeepEP's tolerance (calc_diff against x * sum(w)
    below 1e-5 after a bf16 dispatch, 9e-4 after an fp8 one). Then use_logfmt differing across
    ranks: InvalidArgument on every rank, and the buffer works after clean_low_latency_buffer."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    T_max = 16
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    for batch in range(3):
        inputs = []
        for s in range(R):
            g = ref.generator(seed + batch, s)
            T = 0 if (batch == 1 and s == R - 1 and R > 1) else T_max - s % 3
            u = 0.2 if batch == 2 else 0.5 * float(torch.rand(1, generator=g))
            x = (torch.randn(T, H, generator=g) * u).to(torch.bfloat16)
            if batch == 2 and T:
                x[:, 7] = 0  # a zero in group 0: lb = la - 32
            inputs.append(dict(x=x, topk_idx=ref.routing("uniform", T, K, E, R, g),
                               topk_weights=ref.rand_weights(T, K, g)))
        mine = {k: v.to(dev) for k, v in inputs[r].items()}
        T = mine["x"].shape[0]
        for use_fp8 in (False, True):
            recv, _, handle, _, _ = buf.low_latency_dispatch(mine["x"], mine["topk_idx"], T_max,
                                                             E, use_fp8=use_fp8)
            ys = []  # every rank's combine input: what it received, cast back to bf16
            for d in range(R):
                y = torch.zeros(L, R * T_max, H, dtype=torch.bfloat16)
                for l, w in enumerate(ref.ll_dispatch(inputs, d, E, R, T_max, use_fp8, False)):
                    if w["count"] and use_fp8:
                        f = ref.e4m3_decode(w["x"]).reshape(-1, H // 128, 128)
                        y[l, :w["count"]] = (f * w["scales"].reshape(-1, H // 128, 1)).reshape(
                            -1, H).to(torch.bfloat16)
                    elif w["count"]:
                        y[l, :w["count"]] = w["x"]
                ys.append(y)
            want = ref.ll_combine(inputs, ys, r, E, R, use_logfmt=True)
            wsum = inputs[r]["topk_weights"].masked_fill(inputs[r]["topk_idx"] == -1, 0).sum(1)
            for hooked, zero_copy in ((False, False), (True, False), (False, True), (True, True)):
                what = f"seed={seed} batch={batch} fp8={use_fp8} hook={hooked} zc={zero_copy}"
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle).copy_(ys[r].to(dev))
                out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
                x = ys[r].to(dev, copy=True)
                combined, _, hook = buf.low_latency_combine(
                    _unread(x) if zero_copy else x, mine["topk_idx"], mine["topk_weights"],
                    handle, use_logfmt=True, zero_copy=zero_copy, return_recv_hook=hooked,
                    out=out)
                if hooked:
                    hook()
                assert combined is out, what
                _assert_combined(combined.cpu(), want, inputs[r]["topk_idx"], L, what, buf)
                if T:
                    diff = _calc_diff(inputs[r]["x"].float() * wsum.view(-1, 1), combined.cpu())
                    assert diff < (9e-4 if use_fp8 else 1e-5), (what, diff)
    if R == 1:
        return
    inp = inputs[r]
    res = buf.low_latency_dispatch(inp["x"].to(dev), inp["topk_idx"].to(dev), T_max, E,
                                   use_fp8=False)
    y = torch.zeros(L, R * T_max, H, dtype=torch.bfloat16, device=dev)
    with pytest.raises(epx.InvalidArgument, match="argument 'use_logfmt' differs across ranks"):
        buf.low_latency_combine(y, inp["topk_idx"].to(dev), inp["topk_weights"].to(dev), res[2],
                                use_logfmt=r == R - 1)
        if dev.type == "cuda":  # found on the device: raised by check()
            torch.cuda.synchronize(dev)
            buf._ll.check()
    buf.clean_low_latency_buffer(T_max, H, E)
    res = buf.low_latency_dispatch(inp["x"].to(dev), inp["topk_idx"].to(dev), T_max, E,
                                   use_fp8=False)
    dst = torch.full((inp["x"].shape[0], H), float("nan"), dtype=torch.bfloat16, device=dev)
    out, _, _ = buf.low_latency_combine(y, inp["topk_idx"].to(dev), inp["topk_weights"].to(dev),
                                        res[2], use_logfmt=True, out=dst)
    assert out is dst and not bool(out.any())  # zero expert rows: zeros, every element written


def test_ll_logfmt(pool):
    pool.run(body_ll_logfmt, _seed())


def test_ll_dispatch_combine(pool):
    pool.run(body_ll_roundtrip, _seed())


def test_ll_hook_zero_copy_out_clean(pool):
    pool.run(body_ll_hook_zero_copy_out, _seed())


def test_ll_staggered_destroy(pool):
    pool.run(body_ll_staggered_destroy, _seed())


def test_ll_errors(pool):
    pool.run(body_ll_errors, _seed())


WAIT_DELAY_S = 0.2  # how late the straggler makes its calls
WAIT_DELAY_NS = int(WAIT_DELAY_S * 1e9)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def body_ll_wait_stats(ctx, seed):
    """dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats (docs/semantics.md §2.5):
    int64 [R] views into a larger tensor (guards on both sides), started at non-zero values. The
    last rank makes every call WAIT_DELAY_S late (after a barrier); every other rank must add at
    least half of that, in nanoseconds, to the straggler's element, on dispatch and on combine,
    over two rounds (the second with return_recv_hook: counted in the hook) that accumulate. Data
    that was there before the receive began costs 0 on the cpu backend (the own element, the
    straggler's whole vector) and little on cuda; nothing is negative; the guards stay. Then the
    validation errors, each naming the argument."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    L = E // R
    T_max = 8
    straggler = R - 1
    on_cpu = dev.type == "cpu"
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    inputs = _inputs(seed, R, E, lambda s: 5)
    mine = inputs[r]
    x, idx, w = mine["x"].to(dev), mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
    ys = [_y(seed, d, L, R, T_max) for d in range(R)]
    guard = -12345
    bases = [torch.full((R + 2,), guard, dtype=torch.int64, device=dev) for _ in range(2)]
    dstats, cstats = (b[1:R + 1] for b in bases)
    dstats.copy_(torch.arange(R) * 1000 + 7)
    cstats.copy_(torch.arange(R) * 1000 + 11)
    start = (dstats.cpu().clone(), cstats.cpu().clone())

    def check(what, before, after):
        added = (after - before).tolist()
        ctx_what = f"seed={seed} {what}: {before.tolist()} -> {after.tolist()}"
        assert all(a >= 0 for a in added), ctx_what
        for s, a in enumerate(added):
            if what.startswith("combine") and s == r:
                assert a == 0, ctx_what  # a rank does not wait for its own rows
            elif r == straggler or s == r:
                # There before the receive began.
                assert a == 0 if on_cpu else a < WAIT_DELAY_NS // 2, (s, ctx_what)
            elif s == straggler:
                assert a >= WAIT_DELAY_NS // 2, (s, ctx_what)
            else:
                assert a < WAIT_DELAY_NS // 2, (s, ctx_what)

    # The first call creates the epx buffer (collectively): made here, so that the timed calls
    # below wait for data only.
    handle = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False)[2]
    for round_, hooked in enumerate((False, True)):
        dist.barrier(group=ctx.group)
        before = dstats.cpu().clone()
        if r == straggler and R > 1:
            time.sleep(WAIT_DELAY_S)
        res = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False,
                                       dispatch_wait_recv_cost_stats=dstats,
                                       return_recv_hook=hooked)
        if hooked:
            res[4]()
        _sync(dev)
        _check_dispatch(ctx, inputs, res, E, T_max, False, False, False, f"seed={seed}")
        check(f"dispatch round {round_}", before, dstats.cpu())
        handle = res[2]
        dist.barrier(group=ctx.group)
        before = cstats.cpu().clone()
        if r == straggler and R > 1:
            time.sleep(WAIT_DELAY_S)
        out, _, hook = buf.low_latency_combine(ys[r].to(dev), idx, w, handle,
                                               return_recv_hook=hooked,
                                               combine_wait_recv_cost_stats=cstats)
        if hooked:
            hook()
        _sync(dev)
        _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), mine["topk_idx"], L,
                         f"seed={seed} round={round_}", buf)
        check(f"combine round {round_}", before, cstats.cpu())
    if R > 1 and r != straggler:  # two delays' worth, on top of the starting values
        assert dstats[straggler].item() - start[0][straggler].item() >= WAIT_DELAY_NS
        assert cstats[straggler].item() - start[1][straggler].item() >= WAIT_DELAY_NS
    for b in bases:
        assert b[0].item() == guard and b[R + 1].item() == guard, b.tolist()

    # Validation: each refused before any communication, naming the argument.
    bad = [torch.zeros(R, dtype=torch.int32, device=dev),          # dtype
           torch.zeros(R + 1, dtype=torch.int64, device=dev),      # shape
           torch.zeros(R, R, dtype=torch.int64, device=dev),       # DeepEP's docstring shape
           torch.zeros(2 * R, dtype=torch.int64, device=dev)[::2]]  # not contiguous
    if R == 1:
        bad.pop()  # one element: contiguous whatever its stride
    if dev.type == "cuda":
        bad.append(torch.zeros(R, dtype=torch.int64))  # not on the buffer's device
    for t in bad:
        with pytest.raises(epx.InvalidArgument, match="dispatch_wait_recv_cost_stats"):
            buf.low_latency_dispatch(x, idx, T_max, E, dispatch_wait_recv_cost_stats=t)
        with pytest.raises(epx.InvalidArgument, match="combine_wait_recv_cost_stats"):
            buf.low_latency_combine(ys[r].to(dev), idx, w, handle, combine_wait_recv_cost_stats=t)


def test_ll_wait_stats(pool):
    pool.run(body_ll_wait_stats, _seed())


def test_low_latency_rdma_size_hint():
    n = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256)
    assert isinstance(n, int) and n > 0 and n % 128 == 0
    assert n >= epx.Buffer.bytes_needed("ll", 7168, 8, 256, 128, 2,
                                        "cuda" if epx.built_with_cuda else "cpu")
    with pytest.raises(epx.InvalidArgument, match="hidden"):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 0, 2, 256)


def body_ll_graph(ctx, seed, hooked, num_replays=20):
    """GPU only (torch.cuda.graph), as engines capture DeepEP's low-latency calls in their decode
    graphs: fp8 (UE8M0) dispatch + combine of fixed T captured on a side stream — with
    `hooked`, both receive hooks called inside the capture and combine's expert outputs written
    through get_next_low_latency_combine_buffer (zero_copy) —, then replayed on new inputs
    copied into the captured tensors. Before every replay its outputs are poisoned; after it
    every valid element is compared with reference.py bit for bit."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    T_max = 16
    T = T_max - 3  # the same on every rank and replay (a graph's shapes are fixed)
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)

    def call_inputs(call):
        kind = ref.ROUTINGS[call % len(ref.ROUTINGS)]
        inputs = _inputs(seed + call, R, E, lambda src: T, kind)
        return inputs, [_y(seed + call, d, L, R, T_max) for d in range(R)]

    inputs, ys = call_inputs(0)
    x = inputs[r]["x"].to(dev)
    idx = inputs[r]["topk_idx"].to(dev)
    w = inputs[r]["topk_weights"].to(dev)
    y = ys[r].to(dev)
    y_unread = _unread(y)  # the zero-copy combine's x (its rows are in the buffer)

    def step():
        res = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=True, round_scale=True,
                                       use_ue8m0=True, return_recv_hook=hooked)
        if hooked:
            res[4]()
            buf.get_next_low_latency_combine_buffer(res[2]).copy_(y)
        out, _, hook = buf.low_latency_combine(y_unread if hooked else y, idx, w, res[2],
                                               zero_copy=hooked, return_recv_hook=hooked)
        if hooked:
            hook()
        return res, out

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # eager first: creates the buffer (collective, allocates)
        res, out = step()
    side.synchronize()
    what = f"seed={seed} hooked={hooked} eager"
    _check_dispatch(ctx, inputs, res, E, T_max, True, True, True, what)
    _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), inputs[r]["topk_idx"], L,
                     what, buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        res, out = step()
    (recv_x, scales), count = res[0], res[1]
    for call in range(1, num_replays + 1):
        what = f"seed={seed} hooked={hooked} replay={call}"
        inputs, ys = call_inputs(call)
        for dst, src in ((x, inputs[r]["x"]), (idx, inputs[r]["topk_idx"]),
                         (w, inputs[r]["topk_weights"]), (y, ys[r])):
            dst.copy_(src)
        recv_x.view(torch.uint8).fill_(0xFF)  # e4m3 NaN
        scales.fill_(-1)
        count.fill_(-1)
        out.view(torch.int16).fill_(-1)  # bf16 NaN
        graph.replay()
        torch.cuda.synchronize(dev)
        _check_dispatch(ctx, inputs, res, E, T_max, True, True, True, what)
        _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), inputs[r]["topk_idx"],
                         L, what, buf)
    return num_replays


# ---- rank masks: DeepEP's test_low_latency.py --shrink-test (docs/semantics.md §2.6) ----------

SHRINK_TIMEOUT_S = 1.5  # the epx group's timeout in the shrink test: what a dead rank costs
# DeepEP's failing ranks: the rank that stops at its first call of each API (where R has it).
SHRINK_FAILS = {"dispatch": 1, "combine": 3, "clean": 5}


def _fp8_back(q, scales, use_ue8m0):
    """DeepEP's per_token_cast_back of one expert's rows: e4m3 bits [n, H] and their scales
    (f32 [n, G], or packed UE8M0 int32 [n, ceil(G/4)]) -> bf16 [n, H]."""
    n = q.shape[0]
    if use_ue8m0:
        exps = scales.contiguous().view(torch.uint8).reshape(n, -1)[:, :H // 128]
        scales = (exps.to(torch.int32) << 23).view(torch.float32)
    f = ref.e4m3_decode(q).reshape(n, H // 128, 128) * scales.reshape(n, H // 128, 1)
    return f.reshape(n, H).to(torch.bfloat16)


def body_ll_shrink(ctx, seed):
    """DeepEP's --shrink-test on epx.compat.deep_ep with enable_shrink=True: rank 1 stops calling
    at its first low-latency dispatch, rank 3 at its first combine, rank 5 at its first
    clean_low_latency_buffer (those below R), as DeepEP's simulate_failure_and_skip; the live
    ranks go on through DeepEP's loop (x batches, hook or not, bf16 / fp8 / round_scale / UE8M0,
    one or two dispatches, combine plain and zero-copy, clean after each round) and after every
    call low_latency_query_mask_buffer shows exactly the failed ranks. Each call that meets a
    newly dead rank returns after about the group's timeout (clean: two), the others wait for
    nobody; every dispatch and combine equals reference.py bit for bit with the dead ranks'
    tokens absent and their experts' terms left out (DeepEP checks the same within its
    tolerances). One warm-up round first: epx creates the low-latency buffer collectively at the
    first call, which DeepEP's test makes rank 1 skip (docs/semantics.md §9)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    T, E = 16, 4 * R
    L = E // R
    fails = {api: q for api, q in SHRINK_FAILS.items() if q < R}
    inputs = _inputs(seed, R, E, lambda s: T)
    for s, inp in enumerate(inputs):  # DeepEP's x: the source rank, the token index at the end
        inp["x"] = torch.full((T, H), s - 128.0, dtype=torch.bfloat16)
        inp["x"][:, -128:] = torch.arange(T, dtype=torch.bfloat16).view(-1, 1)
    x_list = [inputs[r]["x"], (torch.randn(T, H, generator=ref.generator(seed, r, "x")) * 0.1)
              .to(torch.bfloat16)]
    all_x = [[inputs[s]["x"] for s in range(R)],
             [(torch.randn(T, H, generator=ref.generator(seed, s, "x")) * 0.1).to(torch.bfloat16)
              for s in range(R)]]
    saved = os.environ.get("EPX_TIMEOUT_MS")
    os.environ["EPX_TIMEOUT_MS"] = str(int(SHRINK_TIMEOUT_S * 1000))
    try:
        buf = deep_ep.Buffer(ctx.group, low_latency_mode=True, enable_shrink=True)
        mine = {k: v.to(dev) for k, v in inputs[r].items()}
        # Warm-up: every rank's first call creates the buffer (collective, not masked).
        res = buf.low_latency_dispatch(mine["x"], mine["topk_idx"], T, E, use_fp8=False)
        buf.low_latency_combine(torch.zeros(L, R * T, H, dtype=torch.bfloat16, device=dev),
                                mine["topk_idx"], mine["topk_weights"], res[2])
    finally:
        if saved is None:
            del os.environ["EPX_TIMEOUT_MS"]
        else:
            os.environ["EPX_TIMEOUT_MS"] = saved
    status = torch.zeros(R, dtype=torch.int32, device=dev)
    failed = set()  # DeepEP's expected_masked_ranks

    def stops(api):  # DeepEP's simulate_failure_and_skip
        if r in failed:
            return True
        if api in fails:
            failed.add(fails[api])
            return fails[api] == r
        return False

    def checked(api, call):
        """Runs call(), then: the mask is exactly `failed`, and the call waited about one
        timeout per rank it found dead (clean: two), else less than one."""
        buf.low_latency_query_mask_buffer(status)
        before = set(status.nonzero().flatten().tolist())
        t0 = time.monotonic()
        out = call()
        took = time.monotonic() - t0
        buf.low_latency_query_mask_buffer(status)
        assert set(status.nonzero().flatten().tolist()) == failed, (api, status, failed)
        waits = (2 if api == "clean" else 1) if failed != before else 0
        if waits:
            assert 0.9 * waits * SHRINK_TIMEOUT_S <= took < (waits + 1) * SHRINK_TIMEOUT_S + 5, \
                (api, took)
        else:
            assert took < 0.9 * SHRINK_TIMEOUT_S, (api, took)
        return out

    num_times = 0
    for which, current_x in enumerate(x_list):
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale else (False,)):
                        if stops("dispatch"):
                            break
                        what = (f"seed={seed} x={which} hook={return_recv_hook} fp8={use_fp8} "
                                f"round={round_scale} ue8m0={use_ue8m0}")
                        masked_at_dispatch = set(failed)
                        # The reference's inputs: this round's x, dead ranks without tokens.
                        live = [dict(inputs[s], x=all_x[which][s]) if s not in failed else
                                dict(x=inputs[s]["x"][:0], topk_idx=inputs[s]["topk_idx"][:0],
                                     topk_weights=inputs[s]["topk_weights"][:0])
                                for s in range(R)]
                        num_times += 1
                        for _ in range(num_times % 2 + 1):
                            stats = torch.zeros(L, dtype=torch.int32, device=dev)

                            def dispatch():
                                res = buf.low_latency_dispatch(
                                    current_x.to(dev), mine["topk_idx"], T, E,
                                    cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                                    round_scale=round_scale, use_ue8m0=use_ue8m0,
                                    async_finish=not return_recv_hook,
                                    return_recv_hook=return_recv_hook)
                                if return_recv_hook:
                                    res[4]()
                                else:
                                    res[3].current_stream_wait()
                                return res
                            res = checked("dispatch", dispatch)
                            _check_dispatch(ctx, live, res, E, T, use_fp8, round_scale,
                                            use_ue8m0, what)
                            assert stats.tolist() == res[1].tolist(), what
                        # Every rank's expert input: what it received, cast back (DeepEP's
                        # simulated_gemm_x).
                        ys = []
                        for d in range(R):
                            y = torch.zeros(L, R * T, H, dtype=torch.bfloat16)
                            for l, w in enumerate(ref.ll_dispatch(live, d, E, R, T, use_fp8,
                                                                  round_scale)):
                                if w["count"]:
                                    y[l, :w["count"]] = _fp8_back(
                                        w["x"], ref.ue8m0_pack(w["scales"]) if use_ue8m0 else
                                        w["scales"], use_ue8m0) if use_fp8 else w["x"]
                            ys.append(y)
                        if stops("combine"):
                            break
                        for zero_copy in (False, True):
                            if zero_copy:
                                buf.get_next_low_latency_combine_buffer(res[2]).copy_(ys[r].to(dev))
                            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16,
                                             device=dev)

                            def combine():
                                x = ys[r].to(dev)
                                combined, event, hook = buf.low_latency_combine(
                                    _unread(x) if zero_copy else x, mine["topk_idx"],
                                    mine["topk_weights"],
                                    res[2], async_finish=not return_recv_hook,
                                    zero_copy=zero_copy, return_recv_hook=return_recv_hook,
                                    out=out)
                                if return_recv_hook:
                                    hook()
                                else:
                                    event.current_stream_wait()
                                return combined
                            combined = checked("combine", combine)
                            # DeepEP: the failed owners' topk entries count as -1.
                            dropped = [dict(inp, topk_idx=torch.where(
                                (inp["topk_idx"] >= 0) & torch.isin(
                                    inp["topk_idx"] // L, torch.tensor(sorted(failed))),
                                -1, inp["topk_idx"])) for inp in live]
                            want = ref.ll_combine(dropped, ys, r, E, R)
                            _assert_combined(combined.cpu(), want, inputs[r]["topk_idx"], L,
                                             f"{what} zero_copy={zero_copy} masked at the "
                                             f"dispatch {sorted(masked_at_dispatch)}", buf)
                        if stops("clean"):
                            break
                        checked("clean", lambda: buf.clean_low_latency_buffer(T, H, E))
    assert num_times > 0 or r == fails.get("dispatch")


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ll_shrink(R):
    get_pool(R).run(body_ll_shrink, _seed())


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 4, 8])
def test_ll_shrink_gpu(R):
    reason = gpu_skip_reason(R)
    if reason:
        pytest.skip(reason)
    get_pool(R, "nccl").run(body_ll_shrink, _seed())


# ---- profiler rows: one kernel name per op, hook or not (DeepEP's bench_kineto) ---------------

def body_ll_hooked_kernel_names(ctx, seed, shrink, calls=4):
    """GPU only: under torch.profiler, `calls` hooked fp8 dispatches and combines (each hook
    called), the way DeepEP's bench_kineto times them with return_recv_hook. Its table matches
    kernel rows by name, one name per op, so the two launches of each op (the send now, the
    receive in the hook) must carry one kernel name: 2 * calls rows of one epx::ll::dispatch
    name and 2 * calls of one epx::ll::combine name. The last call's outputs are checked
    against reference.py."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    T_max = 16
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True, enable_shrink=shrink)
    inputs = _inputs(seed, R, E, lambda src: T_max - 2 - src % 3)
    ys = [_y(seed, d, L, R, T_max) for d in range(R)]
    x = inputs[r]["x"].to(dev)
    idx = inputs[r]["topk_idx"].to(dev)
    w = inputs[r]["topk_weights"].to(dev)
    y = ys[r].to(dev)

    def step():
        res = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=True, return_recv_hook=True)
        res[4]()
        out, _, hook = buf.low_latency_combine(y, idx, w, res[2], return_recv_hook=True)
        hook()
        return res, out

    step()  # warm-up: the first call sets up what the profiler should not see
    torch.cuda.synchronize(dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            res, out = step()
        torch.cuda.synchronize(dev)
    rows = {}
    for ev in prof.events():
        if "epx::" in ev.name and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows[ev.name] = rows.get(ev.name, 0) + 1
    what = f"seed={seed} shrink={shrink} rows={rows}"
    dispatch = {k: n for k, n in rows.items() if "epx::ll::dispatch<" in k}
    combine = {k: n for k, n in rows.items() if "epx::ll::combine<" in k}
    assert len(dispatch) == 1 and list(dispatch.values()) == [2 * calls], what
    assert len(combine) == 1 and list(combine.values()) == [2 * calls], what
    what = f"seed={seed} shrink={shrink}"
    _check_dispatch(ctx, inputs, res, E, T_max, True, False, False, what)
    _assert_combined(out.cpu(), ref.ll_combine(inputs, ys, r, E, R), inputs[r]["topk_idx"], L,
                     what, buf)
    return len(dispatch) + len(combine)


@pytest.mark.gpu
@pytest.mark.parametrize("shrink", [False, True], ids=["plain", "enable_shrink"])
def test_hooked_halves_one_kernel_name(gpu_pool, shrink):
    assert gpu_pool.run(body_ll_hooked_kernel_names, _seed(), shrink) == [2] * gpu_pool.world_size
