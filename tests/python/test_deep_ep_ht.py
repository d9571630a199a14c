"""epx.compat.deep_ep, normal mode (epx ht) and the Buffer/Config/EventOverlap API, on the cpu
backend, against reference.py. Bodies are device-generic (ctx.device): the GPU tier reuses them.
"""

import copy
import random
from unittest import mock

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref
from conftest import get_pool

H = 256
K = 4


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _inputs(seed, R, E, T_of, kind="uniform", fmt="bf16"):
    """Every rank's x (bf16, or fp8 bits with f32 / packed UE8M0 scales), topk_idx, weights."""
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = T_of(s)
        inp = dict(topk_idx=ref.routing(kind, T, K, E, R, g),
                   topk_weights=ref.rand_weights(T, K, g))
        if fmt == "bf16":
            inp["x"] = ref.rand_bf16((T, H), g)
        else:
            inp["x"] = ref.rand_fp8_bits((T, H), g)
            if fmt == "fp8":
                inp["scales"] = torch.rand(T, H // 128, generator=g) + 0.01
            else:  # ue8m0: 4 exponent bytes per int32
                inp["scales"] = torch.randint(-(1 << 31), 1 << 31, (T, (H + 511) // 512),
                                              generator=g, dtype=torch.int64).to(torch.int32)
        out.append(inp)
    return out


def _to(t, device):
    return None if t is None else t.to(device)


def _x_arg(inp, device):
    """What a DeepEP caller passes: bf16 x, or (fp8 x, scales) with COLUMN-MAJOR scales."""
    if "scales" not in inp:
        return inp["x"].to(device)
    x = inp["x"].to(device)
    if epx.has_fp8_dtype:
        x = x.view(epx.fp8_dtype)
    s = inp["scales"]
    col_major = torch.empty(s.shape[1], s.shape[0], dtype=s.dtype, device=device).t()
    col_major.copy_(s)
    assert col_major.stride(0) == 1 or s.shape[0] <= 1
    return (x, col_major)


def _bits(t):
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype != torch.uint8 and t.element_size() == 1 else t


def _check_recv(ctx, inputs, out, E, alignment, what):
    R, r = ctx.world_size, ctx.rank
    recv_x, recv_idx, recv_w, num_list, handle, event = out
    want = ref.ht_dispatch(inputs, r, E, R, alignment)
    fp8 = "scales" in inputs[r]
    if fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, what
        recv_x, recv_scales = recv_x
        assert torch.equal(_bits(recv_x), want["recv_x"]), what
        assert torch.equal(recv_scales.cpu(), want["recv_scales"]), what
    else:
        assert recv_x.dtype == torch.bfloat16
        assert torch.equal(recv_x.cpu(), want["recv_x"]), what
    assert torch.equal(recv_idx.cpu(), want["recv_topk_idx"]), what
    assert recv_idx.dtype == torch.int64
    assert torch.equal(recv_w.cpu(), want["recv_topk_weights"]), what
    assert num_list == want["num_recv_tokens_per_expert"], what
    assert isinstance(num_list, list) and all(isinstance(n, int) for n in num_list)
    assert isinstance(handle, tuple) and len(handle) == 6
    prefix = handle[0]
    assert prefix.dtype == torch.int32 and list(prefix.shape) == [R, R]
    assert torch.equal(prefix.cpu(), ref.rank_prefix_matrix(inputs, E, R)), what
    assert torch.equal(handle[3].cpu(), want["recv_src_idx"]), what  # recv_src_idx
    assert isinstance(event, deep_ep.EventOverlap)
    return want


def body_ht_layout(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
    for i, kind in enumerate(ref.ROUTINGS):
        for T in (0, 1, 37):
            idx = ref.routing(kind, T, K, E, R, ref.generator(seed, i, T, r))
            res = buf.get_dispatch_layout(idx.to(dev), E)
            assert len(res) == 5 and res[1] is None and isinstance(res[4], deep_ep.EventOverlap)
            per_rank, per_expert, in_rank = ref.ht_layout(idx, E, R)
            assert torch.equal(res[0].cpu(), per_rank), (seed, kind, T)
            assert torch.equal(res[2].cpu(), per_expert), (seed, kind, T)
            assert torch.equal(res[3].cpu(), in_rank), (seed, kind, T)
            assert res[0].dtype == torch.int32 and res[2].dtype == torch.int32
            assert res[3].dtype == torch.bool


def body_ht_roundtrip(ctx, seed):
    """Exact dispatch (bf16, fp8 + column-major f32 scales, fp8 + UE8M0), expert_alignment,
    every routing, T = 0 on a rank; combine with 0/1/2 biases and topk_weights; cached dispatch."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=deep_ep.Config().get_nvl_buffer_size_hint(
        H * 2, R))
    cases = [(kind, fmt) for kind in ref.ROUTINGS for fmt in ("bf16", "fp8")]
    cases += [("uniform", "ue8m0"), ("duplicates", "ue8m0")]
    for i, (kind, fmt) in enumerate(cases):
        s = seed + i
        alignment = (1, 4, 3)[i % 3]
        what = f"seed={s} kind={kind} fmt={fmt} alignment={alignment}"
        inputs = _inputs(s, R, E, lambda src: 0 if (i % 4 == 1 and src == R - 1) else
                         9 + 5 * src, kind, fmt)
        mine = inputs[r]
        idx, w = mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        out = buf.dispatch(_x_arg(mine, dev), num_tokens_per_rank=per_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=idx, topk_weights=w, expert_alignment=alignment)
        want = _check_recv(ctx, inputs, out, E, alignment, what)
        handle = out[4]

        # Combine: y_d [N_d, H] random per rank; bias variants; the returned weights.
        ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                            ref.generator(s, d, "y")) for d in range(R)]
        T = mine["topk_idx"].shape[0]
        g = ref.generator(s, r, "bias")
        b0, b1 = ref.rand_bf16((T, H), g), ref.rand_bf16((T, H), g)
        bias = (None, b0.to(dev), (b0.to(dev), b1.to(dev)))[i % 3]
        combined, cw, event = buf.combine(ys[r].to(dev), handle, topk_weights=out[2], bias=bias)
        expect = ref.ht_combine(inputs, ys, r, E, R, b0 if i % 3 else None,
                                b1 if i % 3 == 2 else None)
        assert torch.equal(combined.cpu(), expect), what + " combine"
        # Each weight is local on exactly one rank: the sum returns the original weights,
        # zeroed where the expert was -1.
        orig = torch.where(mine["topk_idx"] >= 0, mine["topk_weights"], torch.zeros(()))
        assert torch.equal(cw.cpu(), orig), what + " combined_topk_weights"
        assert isinstance(event, deep_ep.EventOverlap)

        # Cached dispatch: another x, same routing, no layout.
        x2 = _inputs(s + 1000, R, E, lambda src: inputs[src]["topk_idx"].shape[0], kind, fmt)
        for src in range(R):
            x2[src]["topk_idx"] = inputs[src]["topk_idx"]
        # As DeepEP reads them: (x, None) is bf16 x; a copied handle is the handle; a
        # previous_event without an event is no dependency.
        x_arg = (_x_arg(x2[r], dev), None) if fmt == "bf16" else _x_arg(x2[r], dev)
        assert copy.copy(handle) is handle and copy.deepcopy(handle) is handle
        res = buf.dispatch(x_arg, handle=copy.deepcopy(handle), previous_event=object())
        assert len(res) == 6 and res[1:5] == (None, None, None, None), what
        want2 = ref.ht_dispatch(x2, r, E, R)
        if fmt == "bf16":
            assert torch.equal(res[0].cpu(), want2["recv_x"]), what + " cached"
        else:
            assert torch.equal(_bits(res[0][0]), want2["recv_x"]), what + " cached"
            assert torch.equal(res[0][1].cpu(), want2["recv_scales"]), what + " cached scales"
        del want


def body_ht_worst_case(ctx, seed):
    """num_worst_tokens: fixed rows, rows past N have topk_idx -1, empty list, combine works;
    N > num_worst_tokens raises OutOfCapacity on the ranks that overflow (never truncates)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    buf = deep_ep.Buffer(ctx.group)
    inputs = _inputs(seed, R, E, lambda s: 6 + 3 * s, "uniform")
    Ns = [len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]) for d in range(R)]
    W = max(Ns) + 3
    mine = inputs[r]
    per_expert = torch.zeros(E, dtype=torch.int32, device=dev)
    out = buf.dispatch(mine["x"].to(dev), num_tokens_per_expert=per_expert,
                       topk_idx=mine["topk_idx"].to(dev),
                       topk_weights=mine["topk_weights"].to(dev), num_worst_tokens=W)
    recv_x, recv_idx, recv_w, num_list, handle, _ = out
    want = ref.ht_dispatch(inputs, r, E, R)
    N = Ns[r]
    assert num_list == [], seed
    assert list(recv_x.shape) == [W, H] and list(recv_idx.shape) == [W, K], seed
    assert torch.equal(recv_x[:N].cpu(), want["recv_x"]), seed
    assert torch.equal(recv_idx[:N].cpu(), want["recv_topk_idx"]), seed
    assert bool((recv_idx[N:] == -1).all()), seed
    assert torch.equal(recv_w[:N].cpu(), want["recv_topk_weights"]), seed
    # The prefix of the worst-case outputs equals the exact mode's (DeepEP's own check).
    exact = buf.dispatch(mine["x"].to(dev), num_tokens_per_expert=per_expert,
                         topk_idx=mine["topk_idx"].to(dev),
                         topk_weights=mine["topk_weights"].to(dev))
    assert torch.equal(exact[0].cpu(), recv_x[:N].cpu())
    # Combine from W rows: rows past N are never read.
    ys = [ref.rand_bf16((Ns[d], H), ref.generator(seed, d, "y")) for d in range(R)]
    y = torch.cat([ys[r], torch.full((W - N, H), float("nan"), dtype=torch.bfloat16)])
    combined, _, _ = buf.combine(y.to(dev), handle)
    assert torch.equal(combined.cpu(), ref.ht_combine(inputs, ys, r, E, R)), seed
    # Cached dispatch keeps the worst-case row count.
    res = buf.dispatch(mine["x"].to(dev), handle=handle)
    assert list(res[0].shape) == [W, H] and torch.equal(res[0][:N].cpu(), want["recv_x"])

    # Overflow: all tokens to one expert, room for one row.
    over = _inputs(seed + 1, R, E, lambda s: 3, "all_to_one")
    over_N = [len(ref.ht_dispatch(over, d, E, R)["recv_src_idx"]) for d in range(R)]
    try:
        buf.dispatch(over[r]["x"].to(dev), num_tokens_per_expert=per_expert,
                     topk_idx=over[r]["topk_idx"].to(dev), num_worst_tokens=1)
        if str(dev).startswith("cuda"):
            # No host sync in worst-case mode: the device records the overflow and the next call
            # on the buffer raises it (docs/semantics.md 1.4).
            torch.cuda.synchronize()
            buf.get_dispatch_layout(over[r]["topk_idx"].to(dev), E)
        assert over_N[r] <= 1, f"seed={seed}: N = {over_N[r]} > 1 did not raise"
    except epx.OutOfCapacity as e:
        assert over_N[r] > 1, f"seed={seed}: raised with N = {over_N[r]}: {e}"
        assert "num_worst_tokens" in str(e) and f"N = {over_N[r]}" in str(e), str(e)


def body_ht_growth_and_events(ctx, seed):
    """The buffer grows collectively when a later call has more tokens (here only rank 0 does);
    an older handle stays usable; async_finish / previous_event / Config(num_sms) / capture."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    buf = deep_ep.Buffer(ctx.group)
    small = _inputs(seed, R, E, lambda s: 4)
    big = _inputs(seed + 1, R, E, lambda s: 300 if s == 0 else 2)
    per_expert = torch.zeros(E, dtype=torch.int32, device=dev)
    a = buf.dispatch(small[r]["x"].to(dev), num_tokens_per_expert=per_expert,
                     topk_idx=small[r]["topk_idx"].to(dev))
    prev = buf.capture()
    assert isinstance(prev, deep_ep.EventOverlap)
    b = buf.dispatch(big[r]["x"].to(dev), num_tokens_per_expert=per_expert,
                     topk_idx=big[r]["topk_idx"].to(dev), previous_event=prev,
                     async_finish=True, config=deep_ep.Config(num_sms=24))
    assert torch.equal(b[0].cpu(), ref.ht_dispatch(big, r, E, R)["recv_x"]), seed
    with b[5] as ev:  # EventOverlap as a context manager
        assert ev is b[5] and ev.extra_tensors is not None
    b[5].current_stream_wait()
    # The older handle (from the smaller buffer) still combines correctly.
    ys = [ref.rand_bf16((len(ref.ht_dispatch(small, d, E, R)["recv_src_idx"]), H),
                        ref.generator(seed, d)) for d in range(R)]
    out, cw, _ = buf.combine(ys[r].to(dev), a[4])
    assert cw is None
    assert torch.equal(out.cpu(), ref.ht_combine(small, ys, r, E, R)), seed
    assert buf.get_comm_stream() is None if dev.type == "cpu" else True


def body_ht_errors(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    buf = deep_ep.Buffer(ctx.group)
    inp = _inputs(seed, R, E, lambda s: 5)[r]
    x, idx, w = inp["x"].to(dev), inp["topk_idx"].to(dev), inp["topk_weights"].to(dev)
    pe = torch.zeros(E, dtype=torch.int32, device=dev)
    ok = buf.dispatch(x, num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
    handle = ok[4]
    N = ok[0].shape[0]
    n0 = deep_ep.Buffer.num_sms  # the SM budget of that dispatch (no config)
    fp8 = torch.zeros(5, H, dtype=torch.uint8, device=dev)
    if epx.has_fp8_dtype:
        fp8 = fp8.view(epx.fp8_dtype)
    cases = [
        (epx.InvalidArgument, "'x' has dtype f32", lambda: buf.dispatch(
            x.float(), num_tokens_per_expert=pe, topk_idx=idx)),
        (epx.InvalidArgument, f"value {E}", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, topk_idx=torch.full_like(idx, E))),
        (epx.InvalidArgument, "expected torch", lambda: buf.dispatch(
            (x, torch.ones(5, H // 128, device=dev)), num_tokens_per_expert=pe, topk_idx=idx)),
        (epx.InvalidArgument, "tuple of 3", lambda: buf.dispatch(
            (x, x, x), num_tokens_per_expert=pe, topk_idx=idx)),
        (epx.InvalidArgument, "x_scales", lambda: buf.dispatch(
            (fp8, torch.ones(5, 1, device=dev)), num_tokens_per_expert=pe, topk_idx=idx)),
        (epx.InvalidArgument, "neither 'topk_idx' nor 'is_token_in_rank'", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe)),
        (epx.InvalidArgument, "'topk_weights' is given without 'topk_idx'", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, is_token_in_rank=torch.zeros(5, R, dtype=torch.bool,
                                                                      device=dev), topk_weights=w)),
        (epx.InvalidArgument, "expected torch.bool", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, is_token_in_rank=torch.zeros(5, R, dtype=torch.int32,
                                                                      device=dev))),
        (epx.InvalidArgument, f"'num_tokens_per_rdma_rank' has shape [{E}], expected [1]",
         lambda: buf.dispatch(x, num_tokens_per_rdma_rank=pe, num_tokens_per_expert=pe,
                              topk_idx=idx)),
        (epx.InvalidArgument, "expert_alignment", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, topk_idx=idx, expert_alignment=0)),
        (epx.InvalidArgument, "is_token_in_rank", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, topk_idx=idx,
            is_token_in_rank=torch.zeros(1, 1, dtype=torch.bool))),
        (epx.InvalidArgument, "config", lambda: buf.dispatch(
            x, num_tokens_per_expert=pe, topk_idx=idx, config={"num_sms": 20})),
        # DeepEP's kernels take two SMs per channel: an odd or zero budget fails at the call.
        (epx.InvalidArgument, "'config' has num_sms 23, expected an even number", lambda:
            buf.dispatch(x, num_tokens_per_expert=pe, topk_idx=idx,
                         config=deep_ep.Config(num_sms=23))),
        (epx.InvalidArgument, "'config' has num_sms 0, expected an even number", lambda:
            buf.dispatch(x, num_tokens_per_expert=pe, topk_idx=idx,
                         config=deep_ep.Config(num_sms=0))),
        # The combine and a cached dispatch keep the budget of the dispatch that made the handle
        # (n0, the class's); DeepEP checks the channel count against the handle's.
        (epx.InvalidArgument, f"'config' has num_sms {n0 + 4}, expected {n0}: the SM budget of "
         "the dispatch that made 'handle'", lambda: buf.combine(
             torch.zeros(N, H, dtype=torch.bfloat16, device=dev), handle,
             config=deep_ep.Config(num_sms=n0 + 4))),
        (epx.InvalidArgument, f"'config' has num_sms {n0 + 4}, expected {n0}", lambda:
            buf.dispatch(x, handle=handle, config=deep_ep.Config(num_sms=n0 + 4))),
        (epx.InvalidArgument, "'config' is a dict", lambda: buf.combine(
            torch.zeros(N, H, dtype=torch.bfloat16, device=dev), handle,
            config={"num_sms": 20})),
        (epx.InvalidArgument, "handle", lambda: buf.dispatch(x, handle=tuple(handle))),
        (epx.InvalidArgument, "takes no topk_idx", lambda: buf.dispatch(
            x, handle=handle, topk_idx=idx)),
        (epx.InvalidArgument, "'x' has 4 tokens", lambda: buf.dispatch(x[:4], handle=handle)),
        (epx.InvalidArgument, "'y'", lambda: buf.combine(
            torch.zeros(N + 1, H, dtype=torch.bfloat16, device=dev), handle)),
        (epx.InvalidArgument, "bias", lambda: buf.combine(
            torch.zeros(N, H, dtype=torch.bfloat16, device=dev), handle,
            bias=torch.zeros(6, H, dtype=torch.bfloat16, device=dev))),
        (epx.InvalidArgument, "bias", lambda: buf.combine(
            torch.zeros(N, H, dtype=torch.bfloat16, device=dev), handle, bias=[x, x, x])),
        (epx.InvalidArgument, "handle", lambda: buf.combine(
            torch.zeros(N, H, dtype=torch.bfloat16, device=dev), None)),
        (epx.InvalidArgument, "topk_idx", lambda: buf.get_dispatch_layout(idx[0], E)),
    ]
    for cls, needle, call in cases:
        with pytest.raises(cls) as info:
            call()
        assert needle in str(info.value), (needle, str(info.value))
    out, _, _ = buf.combine(torch.zeros(N, H, dtype=torch.bfloat16, device=dev), handle)
    assert out.shape == (5, H)


def body_buffer_api(ctx, seed):
    """Constructor arguments and attributes, options epx cannot honour, destroy, capture,
    get_comm_stream (before any op too), runtime, the mask-buffer API without enable_shrink."""
    R, r = ctx.world_size, ctx.rank
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=256 << 20, num_rdma_bytes=0,
                         low_latency_mode=False, num_qps_per_rank=24,
                         allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                         explicitly_destroy=False, enable_shrink=False, comm=None)
    assert (buf.rank, buf.group_size, buf.group) == (r, R, ctx.group)
    assert (buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode) == (256 << 20, 0, False)
    with pytest.warns(UserWarning, match="allow_nvlink_for_low_latency_mode=False is accepted"):
        nonvl = deep_ep.Buffer(ctx.group, allow_nvlink_for_low_latency_mode=False)
    assert nonvl.allow_nvlink_for_low_latency_mode is False
    assert deep_ep.Buffer(ctx.group, enable_shrink=True).enable_shrink
    # allow_mnnvl=True permits (does not require) multi-node NVLink: accepted (SGLang passes it);
    # comm= is used only without a group (as in DeepEP).
    mn = deep_ep.Buffer(ctx.group, allow_mnnvl=True, comm=object())
    assert mn.allow_mnnvl and mn.group is ctx.group
    with pytest.raises(epx.InvalidArgument, match="'group' and 'comm'"):
        deep_ep.Buffer(None)
    with pytest.raises(epx.InvalidArgument, match="'comm'.*Get_rank"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(epx.InvalidArgument, match="num_nvl_bytes"):
        deep_ep.Buffer(ctx.group, num_nvl_bytes=-1)
    with pytest.raises(epx.InvalidArgument, match="explicitly_destroy"):
        buf.destroy()
    # The mask-buffer API needs enable_shrink=True (DeepEP asserts it).
    for call in (lambda: buf.low_latency_update_mask_buffer(0, True),
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(R, dtype=torch.int32)),
                 lambda: buf.low_latency_clean_mask_buffer()):
        with pytest.raises(epx.InvalidArgument, match="enable_shrink=False"):
            call()
    ev = buf.capture()
    assert isinstance(ev, deep_ep.EventOverlap)
    ev.current_stream_wait()
    # get_comm_stream before any op: the current GPU's stream wherever CUDA is available, the
    # group's backend regardless (DeepEP's Buffer is a CUDA object; vLLM gives it a gloo group),
    # None without CUDA.
    fresh = deep_ep.Buffer(ctx.group)
    if torch.cuda.is_available():
        assert fresh.get_comm_stream() == torch.cuda.current_stream()
    else:
        assert fresh.get_comm_stream() is None and ev.event is None
        # The rule on a machine with CUDA, whatever the group (here a CPU one): the current GPU.
        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "current_device", return_value=3):
            assert fresh._default_device() == "cuda:3"
    # runtime: DeepEP's layout queries (one node here: one RDMA rank), internals Unsupported.
    rt = buf.runtime
    assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank(), rt.get_root_rdma_rank(True),
            rt.get_root_rdma_rank(False), rt.is_available()) == (1, 0, r, 0, True)
    # No op yet: the default device above (the current GPU wherever CUDA is available, so on a
    # machine with a GPU this CPU-pool Buffer answers that GPU's index), else -1.
    assert rt.get_local_device_id() == (torch.cuda.current_device()
                                        if torch.cuda.is_available() else -1)
    with pytest.raises(epx.Unsupported, match="Buffer.runtime.get_local_ipc_handle"):
        rt.get_local_ipc_handle()

    d = deep_ep.Buffer(ctx.group, explicitly_destroy=True, low_latency_mode=True)
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=ctx.device)
    idx = torch.zeros(2, K, dtype=torch.int64, device=ctx.device)
    d.low_latency_dispatch(x, idx, 4, R, use_fp8=False)
    # After an op: that op's device (-1 for the CPU).
    assert d.runtime.get_local_device_id() == (ctx.device.index if ctx.device.type == "cuda"
                                               else -1)
    d.destroy()
    assert d.runtime.is_available() is False
    with pytest.raises(epx.InvalidArgument, match="destroyed"):
        d.low_latency_dispatch(x, idx, 4, R, use_fp8=False)


def test_ht_layout(pool):
    pool.run(body_ht_layout, _seed())


def test_ht_dispatch_combine_cached(pool):
    pool.run(body_ht_roundtrip, _seed())


def test_ht_worst_case(pool):
    pool.run(body_ht_worst_case, _seed())


def test_ht_growth_events_config(pool):
    pool.run(body_ht_growth_and_events, _seed())


def test_ht_errors(pool):
    pool.run(body_ht_errors, _seed())


def test_buffer_api(pool):
    pool.run(body_buffer_api, _seed())


def body_fresh_buffer_on_cuda(ctx, seed):
    """A Buffer on a gloo group (vLLM gives DeepEP its cpu_group) where CUDA is available: before
    its first op it is on the current GPU, as DeepEP's (a CUDA object whatever the group)."""
    assert str(torch.distributed.get_backend(ctx.group)).lower() == "gloo"
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=64, num_rdma_bytes=32)
    assert buf.get_comm_stream() == torch.cuda.current_stream(dev)
    t = buf.get_local_buffer_tensor(torch.int32, offset=8)
    assert t.device == dev and t.numel() == 14
    r = buf.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
    assert r.device == dev and r.numel() == 16
    assert buf.runtime.get_local_device_id() == dev.index


@pytest.mark.gpu
def test_fresh_buffer_on_a_gloo_group_with_cuda():
    """The GPU tier's half of body_buffer_api's device rule (the CPU tier patches torch.cuda): a
    real GPU, a real gloo group (skipped with conftest's reason where there is none)."""
    get_pool(1).run(body_fresh_buffer_on_cuda, _seed())


# ---- module-level API (no ranks needed) ---------------------------------------------------------

def test_module_exports():
    assert deep_ep.topk_idx_t is torch.int64
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert name in deep_ep.__all__ and hasattr(deep_ep, name)


def test_config():
    c = deep_ep.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == \
        (20, 6, 256, 6, 258)  # the rdma receive ring rounded up to whole send chunks, as DeepEP
    c = deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                          "num_max_nvl_chunked_recv_tokens": 512,
                          "num_max_rdma_chunked_send_tokens": 16,
                          "num_max_rdma_chunked_recv_tokens": 128})
    assert c.num_sms == 24 and c.num_max_nvl_chunked_recv_tokens == 512
    n = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert isinstance(n, int) and n > 0 and n % 128 == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    # As DeepEP's Config: any num_sms >= 0 is kept; the call that uses it needs an even one
    # (body_ht_errors).
    assert deep_ep.Config(num_sms=23).num_sms == 23 and deep_ep.Config(num_sms=0).num_sms == 0
    with pytest.raises(epx.InvalidArgument, match="num_sms"):
        deep_ep.Config(num_sms=-2)
    with pytest.raises(epx.InvalidArgument, match="num_max_nvl_chunked_send_tokens"):
        deep_ep.Config(num_max_nvl_chunked_send_tokens=0)


def test_event_overlap():
    t = torch.ones(3)
    ev = deep_ep.EventOverlap(None, (t,))
    assert ev.event is None and ev.extra_tensors[0] is t
    ev.current_stream_wait()
    with deep_ep.EventOverlap() as inner:
        assert inner.event is None


def test_buffer_static():
    assert deep_ep.Buffer.num_sms == 20
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.num_sms == 24
        assert deep_ep.Buffer.get_dispatch_config(8).num_sms == 24
        assert deep_ep.Buffer.get_combine_config(8).num_sms == 24
        with pytest.raises(epx.InvalidArgument, match="even"):
            deep_ep.Buffer.set_num_sms(25)
    finally:
        deep_ep.Buffer.set_num_sms(20)
    assert isinstance(deep_ep.Buffer.get_dispatch_config(2), deep_ep.Config)
    expect = epx.built_with_cuda and torch.cuda.is_available() and \
        torch.cuda.get_device_capability()[0] >= 9
    assert deep_ep.Buffer.is_sm90_compiled() == expect


def body_ht_graph(ctx, seed, num_replays=20):
    """GPU only (torch.cuda.graph): normal-mode dispatch in worst-case mode (num_worst_tokens,
    no host synchronisation) + combine captured on a side stream after an eager call of the
    shape, then replayed on new inputs and routings copied into the captured tensors (N, the
    rows received, changes every replay; the outputs keep W rows). The outputs are poisoned
    before every replay and compared with reference.py bit for bit after it: the first N rows,
    topk_idx -1 past them, and the combined tokens (y's rows past N are NaN: never read)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    T = 9  # every rank, every replay (a graph's shapes are fixed)
    W = R * T  # no rank can receive more (each token reaches a rank once)
    buf = deep_ep.Buffer(ctx.group)
    per_expert = torch.zeros(E, dtype=torch.int32, device=dev)

    def call_inputs(call):
        kind = ref.ROUTINGS[call % len(ref.ROUTINGS)]
        inputs = _inputs(seed + call, R, E, lambda s: T, kind)
        want = ref.ht_dispatch(inputs, r, E, R)
        N = len(want["recv_src_idx"])
        ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                            ref.generator(seed + call, d, "y")) for d in range(R)]
        y = torch.cat([ys[r], torch.full((W - N, H), float("nan"), dtype=torch.bfloat16)])
        return inputs, want, N, ys, y

    inputs, want, N, ys, y_host = call_inputs(0)
    x = inputs[r]["x"].to(dev)
    idx = inputs[r]["topk_idx"].to(dev)
    w = inputs[r]["topk_weights"].to(dev)
    y = y_host.to(dev)

    def step():
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
            num_worst_tokens=W)
        combined, _, _ = buf.combine(y, handle)
        return recv_x, recv_idx, recv_w, combined

    def check(outs, inputs, want, N, ys, what):
        recv_x, recv_idx, recv_w, combined = [t.cpu() for t in outs]
        assert list(recv_x.shape) == [W, H] and list(recv_idx.shape) == [W, K], what
        assert torch.equal(recv_x[:N], want["recv_x"]), what
        assert torch.equal(recv_idx[:N], want["recv_topk_idx"]), what
        assert bool((recv_idx[N:] == -1).all()), what
        assert torch.equal(recv_w[:N], want["recv_topk_weights"]), what
        assert torch.equal(combined, ref.ht_combine(inputs, ys, r, E, R)), what

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # eager first: sizes the buffer (collective, allocates)
        outs = step()
    side.synchronize()
    check(outs, inputs, want, N, ys, f"seed={seed} eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = step()
    for call in range(1, num_replays + 1):
        inputs, want, N, ys, y_host = call_inputs(call)
        for dst, src in ((x, inputs[r]["x"]), (idx, inputs[r]["topk_idx"]),
                         (w, inputs[r]["topk_weights"]), (y, y_host)):
            dst.copy_(src)
        for t in outs:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        graph.replay()
        torch.cuda.synchronize(dev)
        check(outs, inputs, want, N, ys, f"seed={seed} replay={call} N={N}")
    return num_replays
