"""epx.Dispatcher (docs/semantics.md §7) on the cpu backend (R = 1, 2, 4 gloo ranks), against
reference.py.

Every rank regenerates every rank's inputs from the test's seed, so it knows what it must receive
and what combine must return without communicating. Checked: the stage machine and its messages,
`auto` switching over a prefill/decode sequence, hooks between the dispatch stages, expert load
against the routing, each format's outputs bit for bit (ht rows/ids/weights/counts and the
UE8M0 scales' MN-major TMA-aligned strides and padding, ll masked_m
and packed rows/scales, a2a rows/scales/ids/padding) and each combine bit for bit, and a full
MoE layer (experts in torch) against a dense float reference within a tolerance per quant.
The GPU tier runs the same bodies on one GPU per rank (NCCL); it skips with the reason where
there is no GPU, and a combination the cuda Dispatcher raises Unsupported for skips with that
message.
"""

import functools
import gc
import random
import threading
import time
import weakref

import pytest
import torch

import epx
import reference as ref

H = 640  # 5 fp8 groups: UE8M0 scales need two int32 words; 40 NVFP4 blocks
K = 3
E = 8  # a multiple of R = 1, 2, 4, 8
T_MAX = 12
GSCALE = 448.0 * 6.0 / 12.0  # NVFP4 global scale for inputs of amax <= ~12 (3 * N(0, 1))
QUANTS = ("bf16", "fp8", "fp8_ue8m0")


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _inputs(seed, R, T_of, call=0, kind="uniform"):
    out = []
    for s in range(R):
        g = ref.generator(seed, s, call)
        T = T_of(s)
        out.append(dict(x=ref.rand_bf16((T, H), g, scale=3.0),
                        topk_idx=ref.routing(kind, T, K, E, R, g),
                        topk_weights=ref.rand_weights(T, K, g)))
    return out


def _dispatcher(ctx, **kw):
    args = dict(num_experts=E, hidden=H, top_k=K, max_tokens_per_rank=T_MAX)
    args.update(kw)
    return epx.Dispatcher(ctx.group, **args)


def _to(inp, device):
    return inp["x"].to(device), inp["topk_idx"].to(device), inp["topk_weights"].to(device)


def _bits(t):
    t = t.cpu()
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ---- quantisation references (docs/semantics.md §2.2; NVFP4 as src/core/quant.h states it) -------

def _fp8_ref(x, quant):
    """-> (values uint8 [T, H], scales as the Dispatcher returns them: f32 [T, G] or UE8M0
    int32 [T, ceil(G/4)])."""
    q, s = ref.quantize_fp8(x, round_scale=quant == "fp8_ue8m0")
    return q, (ref.ue8m0_pack(s) if quant == "fp8_ue8m0" else s)


def _nvfp4_ref(x, g):
    """x [T, H] bf16 -> (values u8 [T, H/2], e4m3 scales u8 [T, H/16])."""
    return ref.quantize_nvfp4(x, g)


def _dequant(x, scale, quant):
    """Dispatched rows [..., H] (any leading dims) -> float32."""
    x = x.cpu()
    if quant == "bf16":
        return x.to(torch.float32)
    lead = x.shape[:-1]
    scale = scale.cpu().contiguous()
    if quant == "nvfp4":
        b = x.contiguous().to(torch.int64)
        v = torch.stack([ref.e2m1_decode(b & 0xF), ref.e2m1_decode(b >> 4)],
                        dim=-1).reshape(*lead, H)
        sf = ref.e4m3_decode(scale).repeat_interleave(16, dim=-1)
        return v * sf / torch.tensor(GSCALE, dtype=torch.float32)
    v = ref.e4m3_decode(_bits(x).contiguous())
    if quant == "fp8_ue8m0":
        w = scale.to(torch.int64) & 0xFFFFFFFF
        exps = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(*lead, -1)
        scale = torch.ldexp(torch.ones(exps.shape), exps - 127)[..., :H // 128]
    return v * scale.to(torch.float32).repeat_interleave(128, dim=-1)


# ---- the stage machine, configuration errors, hooks that raise ---------------------------------

def body_stage_machine(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    inputs = _inputs(seed, R, lambda s: 5 + s)
    x, idx, w = _to(inputs[r], ctx.device)
    d = _dispatcher(ctx, mode="normal")
    assert d.stage == "initial" and d.num_local_experts == E // R

    def expect(fn, stage):
        with pytest.raises(epx.InvalidArgument, match=f"expected stage {stage}"):
            fn()

    expect(d.dispatch_b, "after_dispatch_a")
    expect(lambda: d.combine_a(torch.zeros(1, H, dtype=torch.bfloat16)), "after_dispatch_b")
    expect(d.combine_b, "after_combine_a")
    d.dispatch_a(x, idx, w)
    assert d.stage == "after_dispatch_a" and d.last_format == "ht"
    expect(lambda: d.dispatch_a(x, idx, w), "initial")
    expect(d.combine_b, "after_combine_a")
    out = d.dispatch_b()
    assert d.stage == "after_dispatch_b"
    expect(d.dispatch_b, "after_dispatch_a")
    expect(lambda: d.dispatch(x, idx, w), "initial")
    d.combine_a(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16, device=ctx.device))
    assert d.stage == "after_combine_a"
    expect(lambda: d.combine_a(torch.zeros(1, H, dtype=torch.bfloat16)), "after_dispatch_b")
    expect(lambda: d.dispatch_a(x, idx, w), "initial")
    res = d.combine_b()
    assert d.stage == "initial" and res.shape == (x.shape[0], H) and res.dtype == torch.bfloat16

    # A hook that raises: dispatch_a raises it, the call stays started, dispatch_b finishes it.
    class HookError(Exception):
        pass

    def bad_hook():
        raise HookError("hook failed on purpose")

    d.register_hook(bad_hook)
    with pytest.raises(HookError, match="on purpose"):
        d.dispatch_a(x, idx, w)
    assert d.stage == "after_dispatch_a"
    d.clear_hooks()
    out = d.dispatch_b()
    want = ref.ht_dispatch(inputs, r, E, R)
    assert torch.equal(out.x.cpu(), want["recv_x"])
    d.combine(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16, device=ctx.device))
    with pytest.raises(epx.InvalidArgument, match="expected a callable"):
        d.register_hook(3)

    # Configuration errors name the argument.
    for kw, cls, text in [
            (dict(mode="fast"), epx.InvalidArgument, "'mode' is 'fast'"),
            (dict(backend="nccl"), epx.InvalidArgument, "'backend' is 'nccl'"),
            (dict(quant="int4"), epx.InvalidArgument, "'quant' is 'int4'"),
            (dict(num_experts=E + 1), epx.InvalidArgument, f"'num_experts' is {E + 1}"),
            (dict(hidden=100), epx.InvalidArgument, "'hidden' is 100"),
            (dict(quant="nvfp4"), epx.Unsupported,
             "nvfp4 with backend deepep needs mode low_latency"),
            (dict(backend="a2a", mode="low_latency"), epx.InvalidArgument, "low_latency")]:
        if R == 1 and "num_experts" in kw:
            continue  # E + 1 is a multiple of 1
        with pytest.raises(cls, match=text):
            _dispatcher(ctx, **kw)
    with pytest.raises(epx.InvalidArgument, match="forward_mode"):
        d.dispatch_a(x, idx, w, forward_mode="train")
    with pytest.raises(epx.InvalidArgument, match="'x'"):
        d.dispatch_a(x.float(), idx, w)
    assert d.stage == "initial"  # a rejected dispatch_a does not start a call
    a2a = _dispatcher(ctx, backend="a2a", mode="normal", quant="nvfp4")
    with pytest.raises(epx.InvalidArgument, match="global_scale"):
        a2a.dispatch_a(x, idx, w)

    # A hook that refers to its Dispatcher does not keep it alive (C++ holds a weak reference).
    d2 = _dispatcher(ctx, mode="normal")
    d2.register_hook(functools.partial(getattr, d2, "stage"))  # holds d2 strongly
    alive = weakref.ref(d2)
    del d2
    gc.collect()
    assert alive() is None


def body_gil(ctx, seed):
    """While rank 0 waits in dispatch for a late rank 1, another Python thread of rank 0 keeps
    running (the call does not hold the GIL); a Python hook runs inside it (taking the GIL) and
    may use torch."""
    R, r = ctx.world_size, ctx.rank
    inputs = _inputs(seed, R, lambda s: 4)
    x, idx, w = _to(inputs[r], ctx.device)
    d = _dispatcher(ctx, mode="normal")
    seen = []
    d.register_hook(lambda: seen.append(float(torch.ones(3).sum())))
    if r == 1:
        time.sleep(0.5)
        out = d.dispatch(x, idx, w)
    else:
        ticks = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        t = threading.Thread(target=spin)
        t.start()
        try:
            out = d.dispatch(x, idx, w)
        finally:
            stop.set()
            t.join()
        assert ticks[0] > 50, f"the other thread ran only {ticks[0]} times during a 0.5 s wait"
    assert seen == [3.0]
    d.combine(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16, device=ctx.device))


# ---- auto: format per call, hooks between the stages, expert load ------------------------------

def _sequence(R):
    """(forward mode, tokens of rank s) per call: prefill batches near T_MAX, decode batches
    small, one decode batch with T = 0 on the last rank."""
    return [("extend", lambda s: T_MAX - s), ("decode", lambda s: 2 + s),
            ("decode", lambda s: 1 + s % 2), ("extend", lambda s: min(T_MAX, 7 + s)),
            ("decode", lambda s: 0 if s == R - 1 else 3), ("extend", lambda s: T_MAX)]


def _expected_load(inputs, r, R):
    """Per local expert of rank r: tokens (of every rank) that selected it, once per token."""
    L = E // R
    return [sum(int((inp["topk_idx"] == r * L + l).any(dim=1).sum()) for inp in inputs)
            for l in range(L)]


def body_auto(ctx, seed, quant, check_load=True):
    R, r = ctx.world_size, ctx.rank
    L = E // R
    d = _dispatcher(ctx, mode="auto", quant=quant)
    events = []
    d.register_hook(lambda: events.append(("hook", d.stage)))
    load = [0] * L
    for call, (fm, T_of) in enumerate(_sequence(R)):
        inputs = _inputs(seed, R, T_of, call, kind="duplicates" if call % 2 else "uniform")
        x, idx, w = _to(inputs[r], ctx.device)
        events.clear()
        try:
            d.dispatch_a(x, idx, w, forward_mode=fm)
        except epx.Unsupported as e:
            return dict(unsupported=str(e))
        events.append(("dispatch_a returned", d.stage))
        out = d.dispatch_b()
        events.append(("dispatch_b returned", d.stage))
        assert events == [("hook", "after_dispatch_a"), ("dispatch_a returned", "after_dispatch_a"),
                          ("dispatch_b returned", "after_dispatch_b")], events
        want_format = "ll" if fm == "decode" else "ht"
        assert out.format == want_format == d.last_format, (call, out.format)
        ys = None
        if out.format == "ll":
            assert out.expected_m == (T_of(r) * R * K + E) // E
            assert out.masked_m.cpu().tolist() == [
                c["count"] for c in ref.ll_dispatch(inputs, r, E, R, T_MAX, False)]
            assert out.topk_idx is not None and torch.equal(out.topk_idx.cpu(), idx.cpu())
            ys = [ref.rand_bf16((L, R * T_MAX, H), ref.generator(seed, dd, call, "y"))
                  for dd in range(R)]
            res = d.combine(ys[r].to(ctx.device))
            want = ref.ll_combine(inputs, ys, r, E, R)
        else:
            assert out.expected_m is None and out.masked_m is None
            rows = [ref.ht_dispatch(inputs, dd, E, R)["recv_x"].shape[0] for dd in range(R)]
            assert out.x.shape[0] == rows[r]
            ys = [ref.rand_bf16((rows[dd], H), ref.generator(seed, dd, call, "y"))
                  for dd in range(R)]
            res = d.combine(ys[r].to(ctx.device))
            want = ref.ht_combine(inputs, ys, r, E, R)
        assert d.stage == "initial"
        assert torch.equal(res.cpu(), want), (call, out.format)
        load = [a + b for a, b in zip(load, _expected_load(inputs, r, R))]
        if check_load:
            assert d.expert_load().tolist() == load, (call, d.expert_load().tolist(), load)
    got = d.expert_load()
    assert got.dtype == torch.int64 and got.shape == (L,)
    d.reset_expert_load()
    assert d.expert_load().tolist() == [0] * L
    return dict(load=got.tolist(), want=load)


# ---- each format's outputs and combine, bit for bit -------------------------------------------

def body_ht(ctx, seed, quant, num_worst_tokens=0, check_load=True, zero_copy=False):
    R, r = ctx.world_size, ctx.rank
    L = E // R
    inputs = _inputs(seed, R, lambda s: max(0, T_MAX - 2 * s))
    d = _dispatcher(ctx, mode="normal", quant=quant, num_worst_tokens=num_worst_tokens,
                    ht_zero_copy=zero_copy)
    x, idx, w = _to(inputs[r], ctx.device)
    try:
        out = d.dispatch(x, idx, w)
    except epx.Unsupported as e:
        return dict(unsupported=str(e))
    assert out.format == "ht"
    if quant != "bf16":
        for inp in inputs:
            inp["x"], inp["scales"] = _fp8_ref(inp["x"], quant)
    want = ref.ht_dispatch(inputs, r, E, R)
    n = want["recv_x"].shape[0]
    rows = num_worst_tokens or n
    assert out.x.shape == (rows, H) and out.topk_idx.shape == (rows, K)
    assert torch.equal(out.topk_idx[:n].cpu(), want["recv_topk_idx"])
    assert torch.equal(out.topk_weights[:n].cpu(), want["recv_topk_weights"])
    assert (out.topk_idx[n:] == -1).all()
    if num_worst_tokens:
        assert out.num_recv_tokens_per_expert == []
    else:
        assert out.num_recv_tokens_per_expert == want["num_recv_tokens_per_expert"]
    if quant == "bf16":
        assert out.x.dtype == torch.bfloat16 and out.x_scale is None
        assert torch.equal(out.x[:n].cpu(), want["recv_x"])
    else:
        assert out.x.dtype == epx.fp8_dtype
        assert torch.equal(_bits(out.x[:n]), want["recv_x"])
        W = want["recv_scales"].shape[1]
        assert out.x_scale.shape == (rows, W)
        assert torch.equal(out.x_scale[:n].cpu(), want["recv_scales"])
        if quant == "fp8":
            assert out.x_scale.is_contiguous()
        else:
            # MN-major, TMA-aligned (what DeepGEMM's grouped GEMMs read): stride 1 along rows,
            # align4(rows) along the words; storage [W, M] with padding (and worst-case) rows 0.
            M = (rows + 3) // 4 * 4
            assert out.x_scale.dtype == torch.int32
            assert out.x_scale.stride() == (1, M)
            storage = out.x_scale.as_strided((W, M), (M, 1)).cpu()
            assert torch.equal(storage[:, :n], want["recv_scales"].t())
            assert (storage[:, n:] == 0).all()
    if check_load:
        assert d.expert_load().tolist() == _expected_load(inputs, r, R)
    ys = [ref.rand_bf16((num_worst_tokens or ref.ht_dispatch(inputs, dd, E, R)["recv_x"].shape[0],
                         H), ref.generator(seed, dd, "y")) for dd in range(R)]
    if zero_copy:  # y written into the combine buffer (in place over a bf16 x), no y argument
        assert out.moe_output_view.shape == ys[r].shape
        out.moe_output_view.copy_(ys[r].to(ctx.device))
        res = d.combine()
    else:
        res = d.combine(ys[r].to(ctx.device))
    # Worst-case padding rows are combined by nobody: compare against the real rows only.
    assert torch.equal(res.cpu(), ref.ht_combine(inputs, ys, r, E, R))
    return dict(L=L)


def body_ll(ctx, seed, quant, return_recv_hook, check_load=True):
    R, r = ctx.world_size, ctx.rank
    L = E // R
    inputs = _inputs(seed, R, lambda s: max(0, T_MAX - 3 * s), kind="duplicates")
    d = _dispatcher(ctx, mode="low_latency", quant=quant, return_recv_hook=return_recv_hook)
    x, idx, w = _to(inputs[r], ctx.device)
    hooked = []
    d.register_hook(lambda: hooked.append(d.stage))
    gs = GSCALE if quant == "nvfp4" else None
    out = d.dispatch(x, idx, w, forward_mode="extend", global_scale=gs)  # ll ignores the mode
    assert out.format == "ll" and hooked == ["after_dispatch_a"]
    assert out.expected_m == (x.shape[0] * R * K + E) // E
    assert out.topk_idx is idx and out.topk_weights is w  # the caller's own routing
    _check_ll_dispatch(out, inputs, r, R, quant)
    if check_load:
        assert d.expert_load().tolist() == _expected_load(inputs, r, R)
    ys = [ref.rand_bf16((L, R * T_MAX, H), ref.generator(seed, dd, "y")) for dd in range(R)]
    res = d.combine(ys[r].to(ctx.device))
    assert torch.equal(res.cpu(), ref.ll_combine(inputs, ys, r, E, R))


def _check_ll_dispatch(out, inputs, r, R, quant):
    """out (an ll DispatchOutput) against the reference: masked_m, layouts, every valid row."""
    L = E // R
    want = ref.ll_dispatch(inputs, r, E, R, T_MAX, quant != "bf16", quant == "fp8_ue8m0",
                           nvfp4_scale=GSCALE if quant == "nvfp4" else None)
    assert out.masked_m.dtype == torch.int32
    assert out.masked_m.cpu().tolist() == [c["count"] for c in want]
    if quant == "nvfp4":  # the views of epx/ll.h, read through their indexing
        RT = R * T_MAX
        assert out.x.shape == (RT, H // 2, L) and out.x.stride() == (H // 2, 1, RT * H // 2)
        assert out.x_scale.shape == (32, 4, (RT + 127) // 128, 4, H // 64, L)
        xs, ss = ref.nvfp4_ll_rows(out.x, out.x_scale)
        for l, c in enumerate(want):
            m = c["count"]
            if m:
                assert torch.equal(xs[l, :m], c["x"]) and torch.equal(ss[l, :m], c["scales"]), l
        return
    assert out.x.shape == (L, R * T_MAX, H)
    G = H // 128
    if quant != "bf16":
        words = (G + 3) // 4 if quant == "fp8_ue8m0" else G
        assert out.x_scale.shape == (L, R * T_MAX, words)
        assert out.x_scale.stride() == (words * R * T_MAX, 1, R * T_MAX)  # column-major
    for l, c in enumerate(want):
        m = c["count"]
        if m == 0:
            continue
        if quant == "bf16":
            assert torch.equal(out.x[l, :m].cpu(), c["x"]), l
        else:
            assert torch.equal(_bits(out.x[l, :m]), c["x"]), l
            s = c["scales"] if quant == "fp8" else ref.ue8m0_pack(c["scales"])
            assert torch.equal(out.x_scale[l, :m].cpu(), s), l


def body_ll_graph(ctx, seed, quant, return_recv_hook, num_replays=10):
    """ll on a side stream (torch.cuda.stream): one eager dispatch + combine, then the same
    captured with torch.cuda.graph on that stream and replayed on new inputs copied into the
    captured tensors; every call checked against the reference bit for bit."""
    R, r = ctx.world_size, ctx.rank
    L = E // R
    d = _dispatcher(ctx, mode="low_latency", quant=quant, return_recv_hook=return_recv_hook)
    hooked = []
    d.register_hook(lambda: hooked.append(torch.cuda.current_stream(ctx.device).cuda_stream))

    def call_inputs(call):
        inputs = _inputs(seed, R, lambda s: max(0, T_MAX - 3 * s), call, kind="duplicates")
        ys = [ref.rand_bf16((L, R * T_MAX, H), ref.generator(seed, dd, "y", call))
              for dd in range(R)]
        return inputs, ys

    def check(inputs, ys, out, res):
        _check_ll_dispatch(out, inputs, r, R, quant)
        assert torch.equal(res.cpu(), ref.ll_combine(inputs, ys, r, E, R))

    inputs, ys = call_inputs(0)
    x, idx, w = _to(inputs[r], ctx.device)
    y = ys[r].to(ctx.device)
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    gs = GSCALE if quant == "nvfp4" else None
    with torch.cuda.stream(side):
        out = d.dispatch(x, idx, w, forward_mode="decode", global_scale=gs)
        res = d.combine(y)
    side.synchronize()
    assert hooked == [side.cuda_stream]  # hooks run with the dispatch's stream current
    check(inputs, ys, out, res)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = d.dispatch(x, idx, w, forward_mode="decode", global_scale=gs)
        res = d.combine(y)
    for call in range(1, num_replays + 1):
        inputs, ys = call_inputs(call)
        for dst, src in zip((x, idx, w), _to(inputs[r], "cpu")):
            dst.copy_(src)
        y.copy_(ys[r])
        for t in (out.x, out.x_scale, out.masked_m, res):  # poisoned: each replay writes them
            if t is None:
                continue
            if t.element_size() == 1:  # fp8 / e2m1 bytes
                t.view(torch.uint8).fill_(0xA5)
            else:
                t.fill_(float("nan") if t.is_floating_point() else -7)
        graph.replay()
        torch.cuda.synchronize(ctx.device)
        check(inputs, ys, out, res)
    assert len(hooked) == 2  # the eager call and the capture; replays run no host code


def body_a2a(ctx, seed, quant, output_view, check_load=True):
    R, r = ctx.world_size, ctx.rank
    inputs = _inputs(seed, R, lambda s: T_MAX - 4 * (s % 2))
    d = _dispatcher(ctx, backend="a2a", mode="normal", quant=quant)
    x, idx, w = _to(inputs[r], ctx.device)
    try:
        out = d.dispatch(x, idx, w, global_scale=GSCALE if quant == "nvfp4" else None)
    except epx.Unsupported as e:
        return dict(unsupported=str(e))
    assert out.format == "a2a" and out.masked_m is None
    M = T_MAX
    for inp in inputs:
        if quant == "bf16":
            rows = [inp["x"]]
        elif quant == "nvfp4":
            rows = list(_nvfp4_ref(inp["x"], GSCALE))
        else:
            rows = list(_fp8_ref(inp["x"], quant))
        inp["payloads"] = rows + [inp["topk_idx"].to(torch.int32), inp["topk_weights"]]
    recv, counts = ref.a2a_dispatch(inputs, r, E, R)
    got = [out.x, out.x_scale] if quant != "bf16" else [out.x]
    got += [out.topk_idx, out.topk_weights]
    assert out.topk == (out.topk_idx, out.topk_weights)
    assert out.topk_idx.dtype == torch.int32 and out.topk_idx.shape == (R, M, K)
    assert out.moe_output_view.shape == (R, M, H) and out.moe_output_view.dtype == torch.bfloat16
    for s in range(R):
        n = counts[s]
        for p, (g, want) in enumerate(zip(got, recv[s])):
            g = g[s, :n].cpu()
            assert torch.equal(_bits(g) if want.dtype == torch.uint8 else g, want), (s, p)
        assert (out.topk_idx[s, n:] == -1).all(), s  # padding rows carry invalid ids
    if check_load:
        assert d.expert_load().tolist() == _expected_load(inputs, r, R)
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, dd, "y")) for dd in range(R)]
    if output_view:
        out.moe_output_view.copy_(ys[r].to(ctx.device))
        res = d.combine()
    else:
        res = d.combine(ys[r].to(ctx.device))
    assert torch.equal(res.cpu(), ref.a2a_combine(inputs, ys, r, E, R))


# ---- a full MoE layer: experts in torch, against a dense reference -----------------------------

# Max relative L2 error per token against the float32 dense layer. Measured on the cpu backend
# (5 seeds, R = 1 and 4): bf16 0.003, fp8 0.030, fp8_ue8m0 0.031, nvfp4 0.111.
LAYER_TOLERANCE = {"bf16": 0.01, "fp8": 0.05, "fp8_ue8m0": 0.06, "nvfp4": 0.18}


def _expert_weights(seed, e):
    return torch.randn(H, H, generator=ref.generator(seed, "w", e)) / H ** 0.5


def run_experts(out, quant, W_local, rank, num_local):
    """The expert GEMMs of one rank on a DispatchOutput (float32, a loop over local experts) ->
    what combine takes. Shared with demo/epx_demo.py's logic, written here independently."""
    if out.format == "ll" and quant == "nvfp4":
        xd = _dequant(*ref.nvfp4_ll_rows(out.x, out.x_scale), quant)
    else:
        xd = _dequant(out.x, out.x_scale, quant)
    if out.format == "ht":
        idx, w = out.topk_idx.cpu(), out.topk_weights.cpu()
        y = torch.zeros(xd.shape[0], H)
        for l in range(num_local):
            coef = (w * (idx == l)).sum(dim=1)
            rows = coef.nonzero().flatten()
            y[rows] += coef[rows, None] * (xd[rows] @ W_local[l])
        return y.to(torch.bfloat16)
    if out.format == "ll":
        m = out.masked_m.cpu().tolist()
        y = torch.zeros(num_local, xd.shape[1], H)
        for l in range(num_local):
            y[l, :m[l]] = xd[l, :m[l]] @ W_local[l]
        return y.to(torch.bfloat16)
    ids, w = out.topk_idx.cpu().to(torch.int64), out.topk_weights.cpu()
    R, M = ids.shape[:2]
    ids, w, xd = ids.reshape(R * M, -1), w.reshape(R * M, -1), xd.reshape(R * M, H)
    local = (ids >= 0) & (ids // num_local == rank)
    y = torch.zeros(R * M, H)
    for l in range(num_local):
        coef = (w * (local & (ids % num_local == l))).sum(dim=1)
        rows = coef.nonzero().flatten()
        y[rows] += coef[rows, None] * (xd[rows] @ W_local[l])
    return y.reshape(R, M, H).to(torch.bfloat16)


def dense_reference(x, idx, w, W_all):
    xf = x.to(torch.float32)
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += w[t, k] * (xf[t] @ W_all[e])
    return out


def max_rel_err(got, want):
    got = got.to(torch.float32)
    num = (got - want).norm(dim=1)
    den = want.norm(dim=1)
    zero = den == 0
    assert (num[zero] == 0).all(), "a token routed nowhere must combine to 0"
    return float((num[~zero] / den[~zero]).max()) if (~zero).any() else 0.0


def body_layer(ctx, seed, backend, mode, quant):
    R, r = ctx.world_size, ctx.rank
    L = E // R
    W_all = [_expert_weights(seed, e) for e in range(E)]
    W_local = W_all[r * L:(r + 1) * L]
    d = _dispatcher(ctx, backend=backend, mode=mode, quant=quant)
    worst = 0.0
    for call, fm in enumerate(["extend", "decode"]):
        T_of = (lambda s: T_MAX - s) if fm == "extend" else (lambda s: 2 + s)
        inputs = _inputs(seed, R, T_of, call)
        x, idx, w = _to(inputs[r], ctx.device)
        try:
            out = d.dispatch(x, idx, w, forward_mode=fm,
                             global_scale=GSCALE if quant == "nvfp4" else None)
        except epx.Unsupported as e:
            return dict(unsupported=str(e))
        y = run_experts(out, quant, W_local, r, L)
        if out.format == "a2a":
            out.moe_output_view.copy_(y.to(ctx.device))
            res = d.combine()
        else:
            res = d.combine(y.to(ctx.device))
        want = dense_reference(inputs[r]["x"], inputs[r]["topk_idx"], inputs[r]["topk_weights"],
                               W_all)
        worst = max(worst, max_rel_err(res.cpu(), want))
    assert worst <= LAYER_TOLERANCE[quant], (backend, mode, quant, worst)
    return dict(err=worst)


# ---- tests (CPU tier) ----------------------------------------------------------------------------

def _run(pool, body, *args):
    """Runs body on every rank. A rank reporting Unsupported skips the test on the GPU tier (the
    cuda Dispatcher's combinations, module docstring) and fails it on the cpu backend, which
    supports every one."""
    outs = pool.run(body, _seed(), *args)
    for o in outs:
        if isinstance(o, dict) and "unsupported" in o:
            if pool.backend != "nccl":
                pytest.fail(f"the cpu backend raised Unsupported: {o['unsupported']}")
            pytest.skip(f"Unsupported: {o['unsupported']}")
    return outs


def test_stage_machine_and_errors(pool):
    _run(pool, body_stage_machine)


def test_gil_released_and_hooks_take_it(pool2):
    _run(pool2, body_gil)


@pytest.mark.parametrize("quant", ("bf16", "fp8"))
def test_auto_switching_hooks_and_expert_load(pool, quant):
    outs = _run(pool, body_auto, quant)
    assert all(o["load"] == o["want"] for o in outs)


@pytest.mark.parametrize("quant", QUANTS)
def test_ht_outputs_and_combine(pool, quant):
    _run(pool, body_ht, quant)


@pytest.mark.parametrize("quant", ("bf16", "fp8_ue8m0"))
def test_ht_zero_copy(pool, quant):
    _run(pool, body_ht, quant, 0, True, True)


@pytest.mark.parametrize("quant", ("bf16", "fp8_ue8m0"))
def test_ht_worst_case_rows(pool, quant):
    _run(pool, body_ht, quant, 4 * T_MAX + 1)  # 49 rows: UE8M0 pads them to 52


@pytest.mark.parametrize("quant,hook", [("bf16", True), ("fp8", False), ("fp8_ue8m0", True),
                                        ("nvfp4", True), ("nvfp4", False)])
def test_ll_outputs_and_combine(pool, quant, hook):
    _run(pool, body_ll, quant, hook)


@pytest.mark.parametrize("quant,view", [("bf16", True), ("bf16", False), ("fp8", True),
                                        ("fp8_ue8m0", False), ("nvfp4", True)])
def test_a2a_outputs_and_combine(pool, quant, view):
    _run(pool, body_a2a, quant, view)


LAYER_CONFIGS = [("deepep", "normal", "bf16"), ("deepep", "normal", "fp8"),
                 ("deepep", "low_latency", "fp8_ue8m0"), ("deepep", "low_latency", "nvfp4"),
                 ("deepep", "auto", "fp8"),
                 ("a2a", "normal", "bf16"), ("a2a", "normal", "nvfp4")]


@pytest.mark.parametrize("backend,mode,quant", LAYER_CONFIGS, ids=lambda v: str(v))
def test_layer_against_dense_reference(pool, backend, mode, quant):
    _run(pool, body_layer, backend, mode, quant)


def test_quant_references_agree_with_dequant():
    """The test's own NVFP4 / UE8M0 helpers round-trip: dequant(quant(x)) is within the format's
    error of x (float64 bounds as in the C++ quant tests)."""
    g = ref.generator(_seed(), "q")
    x = ref.rand_bf16((9, H), g, scale=3.0)
    q, s = _nvfp4_ref(x, GSCALE)
    back = _dequant(q, s, "nvfp4")
    blocks = x.to(torch.float64).reshape(9, H // 16, 16).abs().amax(dim=2)
    bound = (blocks / 6 * (1 + 1 / 16) + blocks / 16).repeat_interleave(16, dim=1) + 1e-6
    assert ((back.to(torch.float64) - x.to(torch.float64)).abs() <= bound).all()
    for quant in ("fp8", "fp8_ue8m0"):
        q, s = _fp8_ref(x, quant)
        back = _dequant(q, s, quant).to(torch.float64)
        assert ((back - x.to(torch.float64)).abs() <= x.to(torch.float64).abs() / 16 + 1e-2).all()


# ---- GPU tier ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_stage_machine(gpu_pool):
    _run(gpu_pool, body_stage_machine)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ("bf16", "fp8"))
def test_gpu_auto_switching(gpu_pool, quant):
    _run(gpu_pool, body_auto, quant, False)


@pytest.mark.gpu
def test_gpu_expert_load(gpu_pool):
    _run(gpu_pool, body_auto, "bf16", True)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_ht(gpu_pool, quant):
    _run(gpu_pool, body_ht, quant, 0, False)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ("bf16", "fp8"))
def test_gpu_ht_zero_copy(gpu_pool, quant):
    _run(gpu_pool, body_ht, quant, 0, False, True)


@pytest.mark.gpu
def test_gpu_ht_worst_case_ue8m0(gpu_pool):
    _run(gpu_pool, body_ht, "fp8_ue8m0", 4 * T_MAX + 1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS + ("nvfp4",))
def test_gpu_ll(gpu_pool, quant):
    _run(gpu_pool, body_ll, quant, True, False)


@pytest.mark.gpu
@pytest.mark.parametrize("quant,hook", [("bf16", False), ("bf16", True), ("fp8", False),
                                        ("fp8", True), ("nvfp4", False), ("nvfp4", True)])
def test_gpu_ll_side_stream_and_graph(gpu_pool, quant, hook):
    _run(gpu_pool, body_ll_graph, quant, hook)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ("bf16", "nvfp4"))
def test_gpu_a2a(gpu_pool, quant):
    _run(gpu_pool, body_a2a, quant, True, False)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mode,quant", LAYER_CONFIGS, ids=lambda v: str(v))
def test_gpu_layer(gpu_pool, backend, mode, quant):
    _run(gpu_pool, body_layer, backend, mode, quant)
