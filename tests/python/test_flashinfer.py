"""epx.compat.flashinfer (MoeAlltoAll on epx a2a) on the cpu backend, against reference.py:
multi-payload dispatch, sanitising padding rows, combine with and without payload_in_workspace
(bf16, float16 and float32 payloads; float16 sums that overflow, subnormal ones, NaN), T = 0,
the dispatch -> combine state machine, and bad inputs."""

import random

import pytest
import torch

import epx
import epx.compat.flashinfer as fi
import reference as ref

H = 64
K = 3


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _inputs(seed, R, E, T_of, kind="uniform"):
    """Per rank: topk_idx (int32) and four payloads of different dtypes and shapes; payload 1 is
    the expert ids (int32 [T, K])."""
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = T_of(s)
        idx = ref.routing(kind, T, K, E, R, g).to(torch.int32)
        payloads = [ref.rand_bf16((T, H), g),                         # hidden states
                    idx.clone(),                                       # expert ids
                    ref.rand_weights(T, K, g),                         # weights, f32 [T, K]
                    ref.rand_fp8_bits((T, 2, 16), g)]                  # 3-d uint8 payload
        out.append(dict(topk_idx=idx, payloads=payloads))
    return out


def _backend(ctx):
    return "cpu" if ctx.device.type == "cpu" else "cuda"


def _on(inp, dev):
    return inp["topk_idx"].to(dev), [p.to(dev) for p in inp["payloads"]]


def _mapping(ctx):
    return fi.Mapping(world_size=ctx.world_size, rank=ctx.rank, tp_size=ctx.world_size,
                      moe_ep_size=ctx.world_size)


def _check_recv(ctx, inputs, recv, M, E, invalid_id, what):
    R, r = ctx.world_size, ctx.rank
    want, counts = ref.a2a_dispatch(inputs, r, E, R)
    assert len(recv) == len(inputs[r]["payloads"]), what
    for i, view in enumerate(recv):
        p = inputs[r]["payloads"][i]
        assert view.dtype == p.dtype, (what, i)
        assert list(view.shape) == [R, M] + list(p.shape[1:]), (what, i, view.shape)
        for s in range(R):
            n = counts[s]
            assert torch.equal(view[s, :n].cpu(), want[s][i]), (what, i, s)
            if invalid_id is not None and i == 1:
                assert bool((view[s, n:] == invalid_id).all()), (what, "sanitised", s)
    return counts


def body_a2a_roundtrip(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    max_tokens = 12
    ws = fi.moe_a2a_get_workspace_size_per_rank(R, max_tokens, H * 2 + K * 4 + K * 4 + 32,
                                                H * 4)
    a2a = fi.MoeAlltoAll(_mapping(ctx), max_tokens, K, E, workspace_size_per_rank=ws,
                         hidden_size=H, mnnvl_config=fi.MnnvlConfig(
                             comm_backend=fi.TorchDistBackend(ctx.group)),
                         backend=_backend(ctx))
    assert (a2a.ep_rank, a2a.ep_size) == (r, R)
    for i, kind in enumerate(ref.ROUTINGS):
        for j, (sanitise, in_ws, dtype) in enumerate(((None, False, torch.bfloat16),
                                                      (E + 5, True, torch.bfloat16),
                                                      (-1, False, torch.float32),
                                                      (E, True, torch.float32),
                                                      (E + 1, False, torch.float16),
                                                      (None, True, torch.float16))):
            s = seed + 10 * i + j
            what = f"seed={s} kind={kind} sanitise={sanitise} in_ws={in_ws} dtype={dtype}"
            T_of = (lambda src: 0 if src == R - 1 else 3 + 4 * src % 10) if j == 1 else \
                (lambda src: max_tokens - src)
            inputs = _inputs(s, R, E, T_of, kind)
            M = min(max(T_of(src) for src in range(R)) + (j % 2), max_tokens)
            idx, payloads = _on(inputs[r], dev)
            recv = a2a.dispatch(idx, payloads, M,
                                invalid_token_expert_id=sanitise,
                                expert_id_payload_index=1 if sanitise is not None else None)
            counts = _check_recv(ctx, inputs, recv, M, E, sanitise, what)
            assert a2a.recv_counts.cpu().tolist() == counts, what
            # The MoE kernel's output per received row: rank d's y_d[s][j].
            ys = [ref.rand_bf16((R, M, H), ref.generator(s, d, "y"), 2.0).to(dtype)
                  for d in range(R)]
            if in_ws:
                view = a2a.get_combine_payload_tensor_in_workspace(M, H, dtype)
                assert list(view.shape) == [R, M, H] and view.dtype == dtype, what
                view.copy_(ys[r].to(dev))
                out = a2a.combine(view, M, payload_in_workspace=True)
            else:
                out = a2a.combine(ys[r].to(dev), M)
            T = inputs[r]["topk_idx"].shape[0]
            assert out.dtype == dtype and list(out.shape) == [T, H], what
            assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), what


def _f16_ys(g, R, M):
    """y_d [R, M, H] float16 of one rank d, bit patterns over the whole format: ordinary values,
    the top binade (32768 .. 65504: sums of two of one sign overflow), subnormals and zeros, and
    rarely +-inf or a NaN; column 0 is 40000 (a token sent to two ranks overflows there) and
    column 1 3 * 2^-24 (its sums are subnormal)."""
    shape = (R, M, H)
    kind = torch.randint(0, 128, shape, generator=g)
    exp = torch.randint(9, 24, shape, generator=g)
    exp = torch.where(kind >= 88, torch.full_like(exp, 30), exp)
    exp = torch.where(kind >= 104, torch.zeros_like(exp), exp)
    exp = torch.where(kind >= 124, torch.full_like(exp, 31), exp)
    mant = torch.randint(0, 1024, shape, generator=g)
    mant = torch.where((kind >= 124) & (kind < 126), torch.zeros_like(mant), mant)  # inf
    mant = torch.where(kind >= 126, mant | 1, mant)  # NaN
    bits = torch.randint(0, 2, shape, generator=g) * 0x8000 + exp * 1024 + mant
    bits[:, :, 0] = 0x78E2
    bits[:, :, 1] = 0x0003
    return (bits - (bits >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.float16)


def _f16_bits_equal(got, want):
    """got (epx's float16 out) bit for bit want (torch's rounding of the f32 sum), but NaN: NaN
    where want is, written 0x7E00 (torch keeps a NaN's sign)."""
    nan = want.isnan()
    bits = got.view(torch.int16)
    return torch.equal(got.isnan(), nan) and bool((bits[nan] == 0x7E00).all()) and \
        torch.equal(bits[~nan], want.view(torch.int16)[~nan])


def body_a2a_f16_combine(ctx, seed):
    """float16 payloads (FlashInfer's half combine): the float32 sum in ascending rank order
    rounded once to float16, against reference.py's float32 sum rounded by torch; overflow to
    +-inf, subnormal results, inf and NaN; copy and in-workspace, output= and output_dtype=
    float16 (a poisoned output must be overwritten), every routing."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, max_tokens = 2 * R, 12
    a2a = fi.MoeAlltoAll(_mapping(ctx), max_tokens, K, E, hidden_size=H, backend=_backend(ctx))
    seen = {"inf": 0, "subnormal": 0, "nan": 0}
    for step, kind in enumerate(ref.ROUTINGS):
        s = seed + step
        in_ws, how = step % 2 == 1, ("output", "output_dtype", None)[step % 3]
        what = f"seed={s} kind={kind} in_ws={in_ws} {how}"
        inputs = _inputs(s, R, E, lambda src: max_tokens - 2 * src % 7, kind)
        M = max_tokens
        idx, payloads = _on(inputs[r], dev)
        a2a.dispatch(idx, payloads, M)
        ys = [_f16_ys(ref.generator(s, d, "f16"), R, M) for d in range(R)]
        T = inputs[r]["topk_idx"].shape[0]
        kw = {}
        if how == "output":
            # A NaN other than epx's 0x7E00, so an element left unwritten cannot pass as NaN.
            kw["output"] = torch.full((T, H), 0x7D55, dtype=torch.int16,
                                      device=dev).view(torch.float16)
        elif how == "output_dtype":
            kw["output_dtype"] = torch.float16
        if in_ws:
            payload = a2a.get_combine_payload_tensor_in_workspace(M, H, torch.float16)
            assert list(payload.shape) == [R, M, H] and payload.dtype == torch.float16, what
            payload.copy_(ys[r].to(dev))
            out = a2a.combine(payload, M, payload_in_workspace=True, **kw)
        else:
            out = a2a.combine(ys[r].to(dev), M, **kw)
        if how == "output":
            assert out is kw["output"], what
        assert out.dtype == torch.float16 and list(out.shape) == [T, H], what
        want = ref.a2a_combine(inputs, ys, r, E, R)
        assert want.dtype == torch.float16, what
        assert _f16_bits_equal(out.cpu(), want), what
        seen["inf"] += int(want.isinf().sum())
        seen["nan"] += int(want.isnan().sum())
        tiny = (want != 0) & (want.abs() < 2.0 ** -14)
        seen["subnormal"] += int(tiny.sum())
    # inf, NaN and subnormal rows reach the output at any R (R = 1: each token's one row, so
    # only the rounding of single values; R > 1 also sums: column 0 of a token sent to two
    # ranks overflows there, column 1's sums are subnormal).
    assert seen["inf"] > 0 and seen["subnormal"] > 0 and seen["nan"] > 0, seen
    # Another output dtype (as FlashInfer, only with output_scales): refused before communicating.
    a2a.dispatch(idx, payloads, M)
    with pytest.raises(epx.InvalidArgument, match="output_dtype"):
        a2a.combine(ys[r].to(dev), M, output_dtype=torch.bfloat16)
    with pytest.raises(epx.InvalidArgument, match="'output'"):
        a2a.combine(ys[r].to(dev), M, output=torch.empty(T, H, dtype=torch.bfloat16, device=dev))
    assert _f16_bits_equal(a2a.combine(ys[r].to(dev), M).cpu(), want)


def body_a2a_lazy_workspace(ctx, seed):
    """Only hidden_size given (no workspace size); a later dispatch with longer rows re-creates
    the workspace; the default group is used without mnnvl_config."""
    R, r = ctx.world_size, ctx.rank
    E = R
    a2a = fi.MoeAlltoAll(_mapping(ctx), 6, K, E, hidden_size=H, backend=_backend(ctx))
    # FlashInfer's attribute: the convenience size for hidden_size (epx sizes its own workspace
    # from the payloads, as the docstring says).
    assert a2a.workspace_size_per_rank == fi.MoeAlltoAll.get_moe_workspace_size_per_rank(
        R, K, 6, H)
    for step, width in enumerate((8, 32)):
        inputs = []
        for s in range(R):
            g = ref.generator(seed + step, s)
            idx = ref.routing("uniform", 5, K, E, R, g).to(torch.int32)
            inputs.append(dict(topk_idx=idx, payloads=[torch.randn(5, width, generator=g)]))
        recv = a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], 6)
        _check_recv(ctx, inputs, recv, 6, E, None, f"seed={seed} width={width}")
        ys = [ref.rand_bf16((R, 6, H), ref.generator(seed, d, step)) for d in range(R)]
        assert torch.equal(a2a.combine(ys[r], 6), ref.a2a_combine(inputs, ys, r, E, R))


def body_a2a_sized_workspace(ctx, seed):
    """A workspace of moe_a2a_get_workspace_size_per_rank's size for the dispatch bytes split into
    odd-sized payloads (epx rounds each row up to 4 bytes) and the combine bytes given holds both:
    the dispatch's rows and the combine of that width, exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M, C, widths = 2 * R, 4096, 64, (1, 3, 5)  # C bf16: 128 combine bytes per token
    size = fi.moe_a2a_get_workspace_size_per_rank(R, M, sum(widths), 2 * C)
    a2a = fi.MoeAlltoAll(_mapping(ctx), M, K, E, workspace_size_per_rank=size,
                         backend=_backend(ctx))
    assert a2a.workspace_size_per_rank == size
    inputs = []
    for s in range(R):
        g = ref.generator(seed, s)
        idx = ref.routing("uniform", 6, K, E, R, g).to(torch.int32)
        inputs.append(dict(topk_idx=idx, payloads=[ref.rand_fp8_bits((6, w), g) for w in widths]))
    idx, payloads = _on(inputs[r], dev)
    recv = a2a.dispatch(idx, payloads, 6)
    _check_recv(ctx, inputs, recv, 6, E, None, f"seed={seed}")
    ys = [ref.rand_bf16((R, 6, C), ref.generator(seed, d, "y")) for d in range(R)]
    out = a2a.combine(ys[r].to(dev), 6)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), seed


def body_a2a_shared_workspace(ctx, seed):
    """Engines make one MoeAlltoAll per MoE layer with the same sizes (SGLang), and FlashInfer's
    class-level cache gives them one workspace: epx's objects of one workspace share its group and
    A2a (one NCCL communicator and one symmetric workspace, not one per layer). One object serving
    layers of different payload lists (vLLM: NVFP4 layers' 4 payloads, a bf16 head's 3) keeps an
    A2a per list instead of re-creating one at every switch. Layer after layer, every result
    exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M = 2 * R, 6
    size = fi.moe_a2a_get_workspace_size_per_rank(R, M, H * 2 + K * 8 + 32, H * 2)
    layers = [fi.MoeAlltoAll(_mapping(ctx), M, K, E, workspace_size_per_rank=size,
                             backend=_backend(ctx)) for _ in range(3)]
    other = fi.MoeAlltoAll(_mapping(ctx), M + 1, K, E, workspace_size_per_rank=size,
                           backend=_backend(ctx))
    # (epx internals: the shared workspace object and its A2a per payload layout)
    assert layers[0]._ws is layers[1]._ws is layers[2]._ws and other._ws is not layers[0]._ws
    seen = {}
    for step in range(6):
        moe = layers[step % 3]
        what = f"seed={seed} step={step}"
        inputs = _inputs(seed + step, R, E, lambda src: M - src % 2)
        n = 4 if step % 2 == 0 else 3  # alternating payload lists
        for inp in inputs:
            inp["payloads"] = inp["payloads"][:n]
        idx, payloads = _on(inputs[r], dev)
        recv = moe.dispatch(idx, payloads, M)
        _check_recv(ctx, inputs, recv, M, E, None, what)
        ys = [ref.rand_bf16((R, M, H), ref.generator(seed + step, d, "y")) for d in range(R)]
        assert torch.equal(moe.combine(ys[r].to(dev), M).cpu(),
                           ref.a2a_combine(inputs, ys, r, E, R)), what
        a2a = moe._a2a
        assert seen.setdefault(n, a2a) is a2a, what  # each list's A2a made once
    assert len(layers[0]._ws.a2as) == 2


def body_a2a_any_dtype(ctx, seed):
    """Payloads of dtypes epx's a2a does not name (int8, int16, float64; float8_e5m2 where torch
    has it) travel as their bytes, as FlashInfer moves any dtype: the received rows are the sent
    ones, bit for bit, in their own dtype."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M = 2 * R, 5
    a2a = fi.MoeAlltoAll(_mapping(ctx), M, K, E, hidden_size=H, backend=_backend(ctx))
    inputs = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = M - s % 2
        idx = ref.routing("uniform", T, K, E, R, g).to(torch.int32)
        bits = torch.randint(-128, 128, (T, 24), generator=g, dtype=torch.int8)
        payloads = [bits[:, :6].clone(), bits[:, 6:12].clone().view(torch.int16),
                    bits[:, :16].clone().view(torch.float64)]
        if hasattr(torch, "float8_e5m2"):
            payloads.append(bits[:, :3].clone().view(torch.float8_e5m2))
        inputs.append(dict(topk_idx=idx, payloads=payloads))
    idx, payloads = _on(inputs[r], dev)
    recv = a2a.dispatch(idx, payloads, M)
    want, counts = ref.a2a_dispatch(inputs, r, E, R)
    for i, view in enumerate(recv):
        p = inputs[r]["payloads"][i]
        assert view.dtype == p.dtype and list(view.shape) == [R, M] + list(p.shape[1:]), i
        for s in range(R):
            got = view[s, :counts[s]].cpu().contiguous().view(torch.uint8)
            assert torch.equal(got, want[s][i].contiguous().view(torch.uint8)), (seed, i, s)
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, d, "y")) for d in range(R)]
    assert torch.equal(a2a.combine(ys[r].to(dev), M).cpu(), ref.a2a_combine(inputs, ys, r, E, R))


def body_a2a_errors(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    E = 2 * R
    a2a = fi.MoeAlltoAll(_mapping(ctx), 8, K, E, hidden_size=H, backend=_backend(ctx))
    inp = _inputs(seed, R, E, lambda s: 4)[r]
    idx, payloads = inp["topk_idx"], inp["payloads"]
    y = torch.zeros(R, 4, H, dtype=torch.bfloat16)

    with pytest.raises(epx.InvalidArgument, match="without a preceding dispatch"):
        a2a.combine(y, 4)
    with pytest.raises(epx.InvalidArgument, match="before dispatch"):
        a2a.get_combine_payload_tensor_in_workspace(4, H, torch.bfloat16)
    with pytest.raises(epx.OutOfCapacity, match="max_num_tokens"):
        a2a.dispatch(idx, payloads, 9)
    with pytest.raises(epx.OutOfCapacity, match="runtime_max_tokens_per_rank"):
        a2a.dispatch(idx, payloads, 3)  # T = 4 > runtime_max: never truncates
    with pytest.raises(epx.InvalidArgument, match=f"value {E}"):
        a2a.dispatch(torch.full_like(idx, E), payloads, 4)
    with pytest.raises(epx.InvalidArgument, match="expert_id_payload_index"):
        a2a.dispatch(idx, payloads, 4, invalid_token_expert_id=-1, expert_id_payload_index=7)
    with pytest.raises(epx.InvalidArgument, match="expert-id payload"):
        a2a.dispatch(idx, payloads, 4, invalid_token_expert_id=-1, expert_id_payload_index=0)

    a2a.dispatch(idx, payloads, 4)
    with pytest.raises(epx.InvalidArgument, match="twice without combine"):
        a2a.dispatch(idx, payloads, 4)
    with pytest.raises(epx.InvalidArgument, match="preceding dispatch, 4"):
        a2a.combine(torch.zeros(R, 5, H, dtype=torch.bfloat16), 5)
    with pytest.raises(epx.InvalidArgument, match="dtype"):
        a2a.combine(y.to(torch.int32), 4)
    with pytest.raises(epx.InvalidArgument, match="does not point into"):
        a2a.combine(y, 4, payload_in_workspace=True)
    # The low-precision combine rounds an in-workspace payload in place: a tensor that is not
    # the workspace view is refused before anything is written into it.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        mine = (torch.arange(R * 4 * H, dtype=torch.float32).view(R, 4, H) * 0.37 + 0.011).to(dtype)
        kept = mine.clone()
        with pytest.raises(epx.InvalidArgument, match="does not point into"):
            a2a.combine(mine, 4, payload_in_workspace=True, use_low_precision=True)
        assert torch.equal(mine.view(torch.uint8), kept.view(torch.uint8)), dtype
    out = a2a.combine(y, 4)  # the state machine is back at "dispatched -> combine"
    assert out.shape == (4, H)

    with pytest.raises(epx.InvalidArgument, match="eplb_stats_num_experts"):
        fi.MoeAlltoAll(_mapping(ctx), 8, K, E, hidden_size=H, eplb_stats_num_experts=E + 1)
    with pytest.raises(epx.InvalidArgument, match="hidden_size"):
        fi.MoeAlltoAll(_mapping(ctx), 8, K, E)
    if R > 1:
        wrong = fi.Mapping(world_size=R, rank=(r + 1) % R, tp_size=R, moe_ep_size=R)
        with pytest.raises(epx.InvalidArgument, match="moe_ep_rank"):
            fi.MoeAlltoAll(wrong, 8, K, E, hidden_size=H)


def test_a2a_dispatch_combine(pool):
    pool.run(body_a2a_roundtrip, _seed())


def test_a2a_f16_combine(pool):
    pool.run(body_a2a_f16_combine, _seed())


def test_a2a_lazy_workspace(pool):
    pool.run(body_a2a_lazy_workspace, _seed())


def test_a2a_sized_workspace(pool):
    pool.run(body_a2a_sized_workspace, _seed())


def test_a2a_shared_workspace(pool):
    pool.run(body_a2a_shared_workspace, _seed())


def test_a2a_any_dtype(pool):
    pool.run(body_a2a_any_dtype, _seed())


def test_a2a_errors(pool):
    pool.run(body_a2a_errors, _seed())


def test_mapping():
    m = fi.Mapping(world_size=8, rank=5, tp_size=8, moe_ep_size=8)
    assert (m.moe_ep_rank, m.moe_ep_size, m.moe_tp_size, m.tp_rank) == (5, 8, 1, 5)
    m = fi.Mapping(8, 6, 8, tp_size=4, pp_size=2, moe_ep_size=2)  # vLLM passes these positionally
    assert (m.tp_rank, m.pp_rank, m.moe_ep_rank, m.moe_tp_rank, m.moe_tp_size) == (2, 1, 0, 1, 2)
    m = fi.Mapping(world_size=2, rank=1, tp_size=2)
    assert (m.moe_ep_size, m.moe_tp_size, m.moe_ep_rank) == (1, 2, 0)
    with pytest.raises(epx.InvalidArgument, match="world_size"):
        fi.Mapping(world_size=4, rank=0, tp_size=2)
    with pytest.raises(epx.InvalidArgument, match="moe_tp_size"):
        fi.Mapping(world_size=4, rank=0, tp_size=4, moe_ep_size=3, moe_tp_size=1)


def test_config_objects():
    cfg = fi.MnnvlConfig(comm_backend=None, fabric_page_size=1 << 20)
    assert cfg.comm_backend is None and cfg.fabric_page_size == 1 << 20
    assert issubclass(fi.TorchDistBackend, fi.CommBackend)
    with pytest.raises(NotImplementedError):
        fi.CommBackend().Get_rank()


def test_workspace_size_per_rank():
    R, T, D, C = 2, 128, 7168 + 56 + 32 + 32, 7168 * 2
    n = fi.moe_a2a_get_workspace_size_per_rank(R, T, D, C)
    backend = "cuda" if epx.built_with_cuda and torch.cuda.is_available() else "cpu"
    # Enough for the same bytes split into several payloads (what dispatch then sees).
    assert n >= epx.A2a.workspace_bytes(T, 8, 256, [7168, 56, 32, 32], C, R, backend)
    # Monotone in every argument.
    assert fi.moe_a2a_get_workspace_size_per_rank(R, T, D, 2 * C) > n
    assert fi.moe_a2a_get_workspace_size_per_rank(R, 2 * T, D, C) > n
    with pytest.raises(epx.InvalidArgument, match="ep_size"):
        fi.moe_a2a_get_workspace_size_per_rank(0, T, D, C)
    # Whatever the split of the dispatch bytes into up to 8 payloads (each row rounded up to 4
    # bytes, each payload's region aligned), on either backend's layout.
    rng = random.Random(7)
    backends = ["cpu"] + (["cuda"] if epx.built_with_cuda else [])
    for _ in range(400):
        ep, t = rng.choice([1, 2, 4, 8]), rng.choice([1, 7, 128, 4096])
        parts = [rng.choice([0, 1, 3, 5, 64, 1023, 14336]) for _ in range(rng.randint(1, 8))]
        comb = rng.choice([0, 1, 127, 128, 14336])
        for be in backends:
            rows = [max((p + 3) // 4 * 4, 4) for p in parts]
            need = epx.A2a.workspace_bytes(t, 1, ep, rows, max((comb + 3) // 4 * 4, 4), ep, be)
            assert fi._workspace_size(ep, t, sum(parts), comb, be) >= need, (ep, t, parts, comb)


def body_a2a_graph(ctx, seed, in_ws, num_replays=20):
    """GPU only (torch.cuda.graph), as TensorRT-LLM and vLLM capture MoeAlltoAll in their decode
    graphs: dispatch of four payloads + combine (with `in_ws`, the expert outputs written into
    get_combine_payload_tensor_in_workspace) captured on a side stream, then replayed on new
    inputs and routings copied into the captured tensors. The received views, recv_counts and the
    combined output are poisoned before every replay and compared with reference.py bit for bit
    after it."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    max_tokens = 12
    T = M = max_tokens - 2  # the same on every rank and replay (a graph's shapes are fixed)
    a2a = fi.MoeAlltoAll(_mapping(ctx), max_tokens, K, E, hidden_size=H, backend="cuda",
                         mnnvl_config=fi.MnnvlConfig(comm_backend=fi.TorchDistBackend(ctx.group)))

    def call_inputs(call):
        kind = ref.ROUTINGS[call % len(ref.ROUTINGS)]
        inputs = _inputs(seed + call, R, E, lambda src: T, kind)
        return inputs, [ref.rand_bf16((R, M, H), ref.generator(seed + call, d, "y"), 2.0)
                        for d in range(R)]

    inputs, ys = call_inputs(0)
    idx, payloads = _on(inputs[r], dev)
    y = ys[r].to(dev)

    def step():
        recv = a2a.dispatch(idx, payloads, M)
        if in_ws:
            view = a2a.get_combine_payload_tensor_in_workspace(M, H, torch.bfloat16)
            view.copy_(y)
            return recv, a2a.recv_counts, a2a.combine(view, M, payload_in_workspace=True)
        return recv, a2a.recv_counts, a2a.combine(y, M)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # eager first: creates the workspace (collective, allocates)
        recv, counts, out = step()
    side.synchronize()
    what = f"seed={seed} in_ws={in_ws} eager"
    assert counts.cpu().tolist() == _check_recv(ctx, inputs, recv, M, E, None, what), what
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), what
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        recv, counts, out = step()
    for call in range(1, num_replays + 1):
        what = f"seed={seed} in_ws={in_ws} replay={call}"
        inputs, ys = call_inputs(call)
        for dst, src in zip([idx, *payloads, y], [inputs[r]["topk_idx"], *inputs[r]["payloads"],
                                                  ys[r]]):
            dst.copy_(src)
        for t in [*recv, counts, out]:
            t.fill_(float("nan") if t.is_floating_point() else (0xA5 if t.dtype == torch.uint8
                                                                 else -7))
        graph.replay()
        torch.cuda.synchronize(dev)
        assert counts.cpu().tolist() == _check_recv(ctx, inputs, recv, M, E, None, what), what
        assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R)), what
    return num_replays
