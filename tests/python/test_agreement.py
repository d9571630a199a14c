"""Agreement across ranks (docs/semantics.md §4), cpu backend, R = 2 and 3 rank processes.

Geometry and options that differ across ranks — epx.Buffer (ht, ll), epx.A2a, epx.Dispatcher,
epx.compat.deep_ep's lazily created buffers (low-latency and normal mode) — and per-call values
that must agree (ht fp8 vs bf16, num_worst_tokens, expert_alignment; ll use_fp8; ll round_scale
is checked in C++, tests/unit/agreement_test.cc)
raise InvalidArgument on EVERY rank, naming the field (for deep_ep: DeepEP's argument) and each
rank's value; no wrong rows, no crash (the hidden 128 vs 65536 case once died of SIGBUS), no hang.
Each body returns every rank's message; the test checks them all, then the object or group works
with consistent arguments.
"""

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import epx.compat.flashinfer as fi
from conftest import get_pool


@pytest.fixture(params=[2, 3], ids=lambda r: f"R{r}")
def pool23(request):
    return get_pool(request.param)


def _group(ctx):
    if "epx_group" not in ctx.cache:
        ctx.cache["epx_group"] = epx.Group.from_process_group(ctx.group)
    return ctx.cache["epx_group"]


def _message(fn):
    """str of the InvalidArgument fn raises ('' when it raises nothing)."""
    try:
        fn()
    except epx.InvalidArgument as e:
        return str(e)
    return ""


def _check(msgs, needles, what):
    """Every rank's message has every needle ("has V" also matches "have V": several ranks with
    the value V)."""
    for r, m in enumerate(msgs):
        assert m, f"{what}: rank {r} raised no InvalidArgument"
        for n in needles:
            ok = n in m or (n.startswith("has ") and "have " + n[4:] in m)
            assert ok, f"{what}: rank {r}: {m!r} lacks {n!r}"


def _values(R, common, odd):
    """The per-rank part of the message: the last rank has `odd`, the others `common`."""
    first = "rank 0 has" if R == 2 else f"ranks 0, 1 have"
    return [f"{first} {common}", f"rank {R - 1} has {odd}"]


# ---- epx.Buffer / A2a / Dispatcher construction -------------------------------------------------

BUFFER_CASES = {
    # name: (kwargs of every rank, changes on the last rank, field, common, odd)
    "ht hidden": (dict(hidden=256, enable_ht=True), dict(hidden=512), "shape.hidden", 256, 512),
    "ll hidden vast": (dict(hidden=128, enable_ht=False, enable_ll=True), dict(hidden=65536),
                       "shape.hidden", 128, 65536),
    "ll T_max": (dict(enable_ht=False, enable_ll=True), dict(max_tokens_per_rank=16),
                 "shape.max_tokens_per_rank", 8, 16),
    "ht top_k": (dict(), dict(top_k=3), "shape.top_k", 2, 3),
    "ll experts": (dict(enable_ht=False, enable_ll=True), dict(num_experts=12),
                   "shape.num_experts", 6, 12),
    "enable_ll": (dict(), dict(enable_ll=True), "config.enable_ll", "false", "true"),
}


def body_buffer_construction(ctx, name):
    base, odd, *_ = BUFFER_CASES[name]
    kw = dict(hidden=256, top_k=2, num_experts=6, max_tokens_per_rank=8, enable_ht=True,
              enable_ll=False)
    kw.update(base)
    mine = dict(kw, **(odd if ctx.rank == ctx.world_size - 1 else {}))
    g = _group(ctx)
    msg = _message(lambda: epx.Buffer(g, **mine))
    ok = epx.Buffer(g, **kw)  # the group is usable afterwards
    assert ok.hidden == kw["hidden"]
    return msg


@pytest.mark.parametrize("name", list(BUFFER_CASES))
def test_buffer_construction_differs(pool23, name):
    *_, field, common, odd = BUFFER_CASES[name]
    msgs = pool23.run(body_buffer_construction, name)
    R = pool23.world_size
    _check(msgs, [f"Buffer: {field} differs across ranks", "expected the same on every rank"] +
           _values(R, common, odd), name)


def body_a2a_construction(ctx):
    R, last = ctx.world_size, ctx.world_size - 1
    g = _group(ctx)
    payloads = [32, 8] if ctx.rank != last else [32, 12]
    msg = _message(lambda: epx.A2a(g, 8, 2, 6, payloads, 64))
    epx.A2a(g, 8, 2, 6, [32, 8], 64)
    return msg


def test_a2a_construction_differs(pool23):
    msgs = pool23.run(body_a2a_construction)
    _check(msgs, ["A2a: shape.payload_bytes_per_token[1] differs across ranks"] +
           _values(pool23.world_size, 8, 12), "a2a")


DISPATCHER_CASES = {
    "num_experts": (dict(num_experts=12), "config.num_experts", 6, 12),
    "hidden": (dict(hidden=256), "config.hidden", 128, 256),
    "mode": (dict(mode="low_latency"), "config.mode", "auto", "low_latency"),
    "quant": (dict(quant="fp8"), "config.quant", "bf16", "fp8"),
    "backend": (dict(backend="a2a"), "config.backend", "deepep", "a2a"),
    "num_worst_tokens": (dict(num_worst_tokens=64), "config.num_worst_tokens", 0, 64),
    "return_recv_hook": (dict(return_recv_hook=False), "config.return_recv_hook", "true",
                         "false"),
}


def body_dispatcher_construction(ctx, name):
    odd = DISPATCHER_CASES[name][0]
    kw = dict(num_experts=6, hidden=128, top_k=2, max_tokens_per_rank=16)
    mine = dict(kw, **(odd if ctx.rank == ctx.world_size - 1 else {}))
    g = _group(ctx)
    msg = _message(lambda: epx.Dispatcher(g, **mine))
    epx.Dispatcher(g, **kw)
    return msg


@pytest.mark.parametrize("name", list(DISPATCHER_CASES))
def test_dispatcher_construction_differs(pool23, name):
    _, field, common, odd = DISPATCHER_CASES[name]
    msgs = pool23.run(body_dispatcher_construction, name)
    _check(msgs, [f"Dispatcher: {field} differs across ranks"] +
           _values(pool23.world_size, common, odd), name)


def body_group_agree(ctx):
    g = _group(ctx)
    out = g.agree("op", [("hidden", 256), ("flag", True)], [10 * ctx.rank, 7])
    assert out == [[10 * p, 7] for p in range(ctx.world_size)]
    return _message(lambda: g.agree("op", [("argument 'x'", ctx.rank == 1)]))


def test_group_agree(pool23):
    msgs = pool23.run(body_group_agree)
    R = pool23.world_size
    want = ("op: argument 'x' differs across ranks: rank 0 has false, rank 1 has true"
            if R == 2 else "op: argument 'x' differs across ranks: ranks 0, 2 have false, "
            "rank 1 has true")
    _check(msgs, [want + "; expected the same on every rank"], "Group.agree")


# ---- per-call values: epx.Buffer ht and ll -----------------------------------------------------

def _x(T, H, fp8=False):
    if not fp8:
        return torch.ones(T, H, dtype=torch.bfloat16)
    x = torch.full((T, H), 0x38, dtype=torch.uint8)
    return x.view(epx.fp8_dtype) if epx.has_fp8_dtype else x


def _topk(T, R):
    return torch.tensor([[t % (2 * R), (t + 1) % (2 * R)] for t in range(T)], dtype=torch.int64)


HT_CALL_CASES = {
    "fp8 vs bf16": ["the dtype of argument 'x' differs across ranks", "has bf16",
                    "has fp8_e4m3"],
    "num_worst_tokens": ["argument 'num_worst_tokens' differs across ranks", "has 0", "has 32"],
    "expert_alignment": ["argument 'expert_alignment' differs across ranks", "has 1", "has 4"],
}


def body_ht_call(ctx, name):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    g = _group(ctx)
    if "ht" not in ctx.cache:
        ctx.cache["ht"] = epx.Buffer(g, 128, 2, 2 * R, 8)
    buf = ctx.cache["ht"]
    T = 6
    kw = dict(x=_x(T, 128), topk_idx=_topk(T, R))
    if odd and name == "fp8 vs bf16":
        kw.update(x=_x(T, 128, True), x_scales=torch.ones(T, 1))
    if odd and name == "num_worst_tokens":
        kw.update(num_worst_tokens=32)
    if odd and name == "expert_alignment":
        kw.update(expert_alignment=4)
    msg = _message(lambda: buf.ht_dispatch(**kw))
    d = buf.ht_dispatch(_x(T, 128), topk_idx=_topk(T, R))
    out = buf.ht_combine(d.recv_x, d.handle).out
    assert out.shape == (T, 128)
    return msg


@pytest.mark.parametrize("name", list(HT_CALL_CASES))
def test_ht_call_values_differ(pool23, name):
    msgs = pool23.run(body_ht_call, name)
    _check(msgs, ["ht_dispatch: "] + HT_CALL_CASES[name], name)


def body_ll_call(ctx):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    g = _group(ctx)
    buf = epx.Buffer(g, 128, 2, 2 * R, 8, enable_ht=False, enable_ll=True)
    x, idx = _x(4, 128), _topk(4, R)
    msg = _message(lambda: buf.ll_dispatch(x, idx, use_fp8=not odd))
    buf.ll_clean()
    # Consistent again: every rank sends the same routing, so local expert l of rank r gets the
    # tokens selecting expert 2r + l from each of the R ranks.
    want = [R * int((idx == 2 * ctx.rank + l).any(1).sum()) for l in range(2)]
    assert buf.ll_dispatch(x, idx).recv_count.tolist() == want
    return msg


def test_ll_call_values_differ(pool23):
    msgs = pool23.run(body_ll_call)
    _check(msgs, ["ll_dispatch: argument 'use_fp8' differs across ranks"] +
           _values(pool23.world_size, "true", "false"), "ll use_fp8")


# ---- epx.compat.deep_ep: low-latency mode ------------------------------------------------------

LL_CASES = {
    # name: (changes on the last rank, the DeepEP argument named, common, odd)
    "num_max_dispatch_tokens_per_rank": (dict(T_max=16),
                                         "argument 'num_max_dispatch_tokens_per_rank'", 8, 16),
    "hidden": (dict(H=512), "hidden (x.shape[1])", 256, 512),
    "hidden vast": (dict(H=65536), "hidden (x.shape[1])", 256, 65536),
    "num_experts": (dict(E=12), "argument 'num_experts'", 6, 12),
    "topk": (dict(K=3), "top-k (topk_idx.shape[1])", 2, 3),
}


def _ll_call(buf, R, T_max=8, H=256, E=6, K=2, use_fp8=True):
    T = 4
    x = torch.ones(T, H, dtype=torch.bfloat16)
    idx = torch.tensor([[(t + k) % E for k in range(K)] for t in range(T)], dtype=torch.int64)
    return buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=use_fp8)


def body_deep_ep_ll(ctx, name):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    change = LL_CASES[name][0] if odd else {}
    msg = _message(lambda: _ll_call(buf, R, **change))
    recv, count, handle, _, _ = _ll_call(buf, R)  # consistent: works on the same Buffer
    assert handle[2:] == (8, 256, 6)
    return msg


@pytest.mark.parametrize("name", list(LL_CASES))
def test_deep_ep_ll_shape_differs(pool23, name):
    _, arg, common, odd = LL_CASES[name]
    msgs = pool23.run(body_deep_ep_ll, name)
    _check(msgs, [f"low_latency_dispatch: {arg} differs across ranks"] +
           _values(pool23.world_size, common, odd), name)


def body_deep_ep_ll_switch_apart(ctx):
    """Ranks switch T_max at different calls: the rank that re-creates its buffer meets ranks that
    dispatch on the old one (cpu backend): an error on every rank, never mixed rows — the
    re-creating rank's construction exchange sees another call (InvalidArgument), a rank on the
    old buffer finds the peer's header at another call (OutOfStep) or the exchange's board."""
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    _ll_call(buf, R)
    try:
        _ll_call(buf, R, T_max=16 if odd else 8)
    except (epx.InvalidArgument, epx.OutOfStep) as e:
        return str(e)
    return ""


def test_deep_ep_ll_ranks_switch_shape_apart(pool23):
    msgs = pool23.run(body_deep_ep_ll_switch_apart)
    _check(msgs, ["same"], "switch apart")


def body_deep_ep_ll_fp8(ctx):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    return _message(lambda: _ll_call(buf, R, use_fp8=not odd))


def test_deep_ep_ll_use_fp8_differs(pool23):
    msgs = pool23.run(body_deep_ep_ll_fp8)
    _check(msgs, ["ll_dispatch: argument 'use_fp8' differs across ranks"] +
           _values(pool23.world_size, "true", "false"), "use_fp8")


# ---- epx.compat.deep_ep: normal mode -----------------------------------------------------------

NORMAL_CASES = {
    # name: (where the error is raised, needles besides the values, common, odd)
    "topk layout": ("get_dispatch_layout", "get_dispatch_layout: top-k (topk_idx.shape[1]) "
                    "differs across ranks", 2, 3),
    "experts layout": ("get_dispatch_layout", "get_dispatch_layout: argument 'num_experts' "
                       "differs across ranks", 6, 12),
    "topk dispatch": ("dispatch", "dispatch: top-k (topk_idx.shape[1]) differs across ranks", 2,
                      3),
    "experts dispatch": ("dispatch", "dispatch: the number of experts "
                         "(num_tokens_per_expert.shape[0]) differs across ranks", 6, 12),
    "hidden dispatch": ("dispatch", "dispatch: hidden (x.shape[1]) differs across ranks", 128,
                        256),
    "fp8 vs bf16": ("dispatch", "ht_dispatch: the dtype of argument 'x' differs across ranks",
                    "bf16", "fp8_e4m3"),
    "num_worst_tokens": ("dispatch", "ht_dispatch: argument 'num_worst_tokens' differs across "
                         "ranks", 0, 64),
    "expert_alignment": ("dispatch", "ht_dispatch: argument 'expert_alignment' differs across "
                         "ranks", 1, 8),
}


def _normal(buf, R, name, odd, layout_first):
    T, H, K, E = 6, 128, 2, 6
    kw = {}
    if odd:
        if name.startswith("topk"):
            K = 3
        elif name.startswith("experts"):
            E = 12
        elif name.startswith("hidden"):
            H = 256
    idx = torch.tensor([[(t + k) % E for k in range(K)] for t in range(T)], dtype=torch.int64)
    x = torch.ones(T, H, dtype=torch.bfloat16)
    if odd and name == "fp8 vs bf16":
        x = (_x(T, H, True), torch.ones(T, H // 128))
    if odd and name == "num_worst_tokens":
        kw["num_worst_tokens"] = 64
    if odd and name == "expert_alignment":
        kw["expert_alignment"] = 8
    if layout_first:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    else:
        per_expert = torch.bincount(idx.flatten(), minlength=E).to(torch.int32)
        per_rank, in_rank = None, None
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx,
                        topk_weights=torch.ones(T, K), **kw)


def body_deep_ep_normal(ctx, name):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    buf = deep_ep.Buffer(ctx.group)
    msg = _message(lambda: _normal(buf, R, name, odd, NORMAL_CASES[name][0] ==
                                   "get_dispatch_layout"))
    recv_x, _, _, _, handle, _ = _normal(buf, R, "", False, True)  # consistent: works
    out, _, _ = buf.combine(recv_x, handle)
    assert out.shape == (6, 128)
    return msg


@pytest.mark.parametrize("name", list(NORMAL_CASES))
def test_deep_ep_normal_differs(pool23, name):
    _, needle, common, odd = NORMAL_CASES[name]
    msgs = pool23.run(body_deep_ep_normal, name)
    _check(msgs, [needle] + _values(pool23.world_size, common, odd), name)


# ---- epx.compat.flashinfer: the lazily sized workspace ------------------------------------------

def body_flashinfer_payloads(ctx):
    R, odd = ctx.world_size, ctx.rank == ctx.world_size - 1
    mapping = fi.Mapping(world_size=R, rank=ctx.rank, tp_size=R, moe_ep_size=R)
    a2a = fi.MoeAlltoAll(mapping, 6, 2, R, hidden_size=128)
    idx = torch.tensor([[t % R, (t + 1) % R] for t in range(5)], dtype=torch.int32)
    width = 16 if odd else 8
    msg = _message(lambda: a2a.dispatch(idx, [torch.ones(5, width)], 6))
    recv = a2a.dispatch(idx, [torch.ones(5, 8)], 6)  # consistent: works
    assert list(recv[0].shape) == [R, 6, 8]
    return msg


def test_flashinfer_payload_sizes_differ(pool23):
    msgs = pool23.run(body_flashinfer_payloads)
    _check(msgs, ["MoeAlltoAll.dispatch: the bytes per token of 'input_payloads[0]'",
                  "differs across ranks"] + _values(pool23.world_size, 32, 64), "flashinfer")


def test_python_message_format_matches_the_core():
    """epx.errors.per_rank_values / check_agreement write what src/core/agree.cc writes."""
    from epx import errors
    assert errors.per_rank_values([256, 512]) == "rank 0 has 256, rank 1 has 512"
    assert errors.per_rank_values([256, 512, 256]) == "ranks 0, 2 have 256, rank 1 has 512"
    assert errors.per_rank_values([1, 1, 1, 1, 0, 1, 1, 1]) == \
        "ranks 0-3, 5-7 have 1, rank 4 has 0"
    assert errors.per_rank_values([False, True, True]) == "rank 0 has false, ranks 1, 2 have true"
    errors.check_agreement("op", [("a", [1, 1])])
    with pytest.raises(epx.InvalidArgument) as e:
        errors.check_agreement("dispatch", [("hidden (x.shape[1])", [128, 256]), ("k", [2, 2]),
                                            ("e", [6, 12])])
    assert str(e.value) == ("epx invalid_argument: dispatch: hidden (x.shape[1]) differs across "
                            "ranks: rank 0 has 128, rank 1 has 256; e differs across ranks: rank "
                            "0 has 6, rank 1 has 12; expected the same on every rank")
