"""Conformance tier for epx.compat.deep_ep: real clients' call sequences, replayed.

Each rank body replays what a DeepEP client does, call for call and keyword for keyword, on the
rank pools of conftest.py (cpu backend over gloo; the `gpu` twins at the bottom run the same bodies
with CUDA tensors at R = 1):

  * DeepEP V1's tests/test_intranode.py (Buffer(group, int(2e9), 0, ...), get_dispatch_layout,
    dispatch with and without top-k, bf16 / fp8 with column-major scales, async_finish,
    previous_event=Buffer.capture(), num_worst_tokens, cached dispatch, combine with and without
    topk_weights, Config objects of different num_sms, set_num_sms + get_*_config, destroy);
  * DeepEP V1's tests/test_low_latency.py (the size hint, Buffer(..., low_latency_mode=True, ...),
    stats, fp8 / round_scale / UE8M0, async_finish vs return_recv_hook, -1 slots, out=, zero_copy
    through get_next_low_latency_combine_buffer, a dispatch repeated without its combine);
  * an engine's DeepEP dispatcher (SGLang's token_dispatcher/deepep.py: how it sizes and builds the
    Buffer, dispatch_a/dispatch_b with Buffer.capture() and async_finish, the low-latency hooks,
    one low_latency_mode Buffer serving prefill (normal) and decode (low latency) alternately,
    two-batch overlap with the caller dropping or overwriting its inputs before the hooks);
  * every keyword of DeepEP V1's Buffer / Config / EventOverlap (deep_ep/buffer.py at 567632d),
    by signature and by call.

Every output element is compared with reference.py bit for bit (epx's semantics are deterministic);
DeepEP's own tolerance checks (calc_diff) are replayed on top where DeepEP's test makes them.
Inputs are fresh random per call (the seed is in every failure message).
"""

import gc
import inspect
import itertools
import random

import pytest
import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref
import test_deep_ep_ht as ht
import test_deep_ep_ll as ll
from conftest import get_pool, gpu_skip_reason

H = 256  # two fp8 groups of 128 (== ht.H == ll.H, whose checks are reused)
assert H == ht.H == ll.H


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _num_experts(R):
    return max(8, 4 * R)


def _fresh(t, dev):
    """A private device copy (on CPU, .to() would alias the reference's tensor)."""
    return None if t is None else t.to(dev, copy=True)


def _calc_diff(x, y):
    """DeepEP's similarity measure (1 - cosine-like similarity of x + 1 and y + 1)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def _bits(t):
    return ht._bits(t)


def _ue8m0_unpack(packed, G):
    """int32 [N, ceil(G/4)] packed UE8M0 -> float32 [N, G] powers of two."""
    p = torch.empty(packed.shape, dtype=torch.int32)  # fresh strides (a [N, 1] view may not)
    p.copy_(packed)
    b = p.view(torch.uint8).reshape(packed.shape[0], -1)[:, :G]
    return (b.to(torch.int32) << 23).view(torch.float32)


def _cast_back(bits, scales):
    """fp8 e4m3 [N, H] with per-128-channel scales (f32 [N, G] or UE8M0 int32) -> bf16, what a
    grouped GEMM sees (the role of DeepEP's per_token_cast_back in its tests)."""
    bits = _bits(bits)
    N, HH = bits.shape
    G = HH // 128
    scales = scales.cpu()
    if scales.dtype == torch.int32:
        scales = _ue8m0_unpack(scales, G)
    f = ref.e4m3_decode(bits).reshape(N, G, 128) * scales.reshape(N, G, 1).to(torch.float32)
    return f.reshape(N, HH).to(torch.bfloat16)


def _x_arg(x, scales, dev):
    """What a DeepEP caller passes: bf16 x, or (fp8 x, scales) with the scales made column-major
    as DeepEP's test does (s.T.contiguous().T)."""
    x = _fresh(x, dev)
    if scales is None:
        return x
    if epx.has_fp8_dtype:
        x = x.view(epx.fp8_dtype)
    return (x, _fresh(scales, dev).T.contiguous().T)


def _combined_weights(inputs, ws, rank, E, R):
    """combined_topk_weights of `rank`: the float32 sum over d ascending of the weights rows rank
    d passed to combine for this rank's tokens (docs/semantics.md 1.6)."""
    idx = inputs[rank]["topk_idx"]
    acc = torch.zeros(idx.shape[0], ws[0].shape[1], dtype=torch.float32)
    for d in range(R):
        before = sum(int(ref.goes_to(inputs[s]["topk_idx"], d, E, R).sum()) for s in range(rank))
        sel = ref.goes_to(idx, d, E, R).nonzero().flatten()
        acc[sel] = ref.f32_add(acc[sel], ws[d][before:before + len(sel)])
    return acc


def _restore_num_sms(value=20):
    deep_ep.Buffer.set_num_sms(value)


# ==== 1. DeepEP V1 tests/test_intranode.py ========================================================

def _intranode_inputs(seed, R, E, K, T):
    """Per rank, as test_intranode.py: top-k of |randn| + 1 scores (unsorted), x_pure_rand,
    x = ones * rank, x_e4m3 (here: quantised random data, scales per 128 channels), weights
    ones * rank and random."""
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        scores = torch.randn(T, E, generator=g).abs() + 1
        idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
        x_rand = ref.rand_bf16((T, H), g)
        q, sc = ref.quantize_fp8(ref.rand_bf16((T, H), g, scale=4.0), round_scale=False)
        out.append(dict(topk_idx=idx, x_pure_rand=x_rand,
                        x=torch.full((T, H), float(s), dtype=torch.bfloat16),
                        x_e4m3=q, x_e4m3_scales=sc,
                        w=torch.full((T, K), float(s), dtype=torch.float32),
                        w_pure_rand=torch.randn(T, K, generator=g, dtype=torch.float32)))
    return out


def _check_data(check_x, rank_prefix_matrix, rank, R):
    """DeepEP's check_data: rows from source i are all equal to i (x = ones * rank)."""
    assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
    start = 0
    for i in range(R):
        end = int(rank_prefix_matrix[i][rank])
        assert int((check_x[start:end].float() - i).abs().sum()) == 0
        start = end


def body_intranode(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, K, T = _num_experts(R), 4, 24
    L = E // R
    num_sms = 24
    buffer = deep_ep.Buffer(ctx.group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)
    try:
        _intranode_main(ctx, seed, buffer, R, r, dev, E, K, T, L, num_sms)
    finally:
        _restore_num_sms()
    buffer.destroy()
    with pytest.raises(epx.InvalidArgument, match="destroyed"):
        buffer.get_dispatch_layout(torch.zeros(1, K, dtype=torch.int64, device=dev), E)
    dist.barrier(group=ctx.group)


def _intranode_main(ctx, seed, buffer, R, r, dev, E, K, T, L, num_sms):
    config = deep_ep.Config(num_sms, 8, 256)  # positional, as the test
    variants = list(itertools.product((False, True), (False, True),
                                      ("x_pure_rand", "x", "x_e4m3"), (False, True)))
    for i, (previous_mode, async_mode, xname, with_topk) in enumerate(variants):
        s = seed + i
        what = (f"seed={s} previous={previous_mode} async={async_mode} x={xname} "
                f"topk={with_topk}")
        inputs = _intranode_inputs(s, R, E, K, T)
        mine = inputs[r]
        topk_idx = _fresh(mine["topk_idx"], dev)
        fp8 = xname == "x_e4m3"
        for inp in inputs:  # the reference's view of what every rank sends
            inp["x_sent"] = inp[xname]
            inp["scales"] = inp["x_e4m3_scales"] if fp8 else None
            inp["topk_weights"] = inp["w_pure_rand" if xname == "x_pure_rand" else "w"]
        # (ht._check_recv treats a "scales" key as fp8: only fp8 inputs carry one.)
        ref_inputs = [dict(x=inp["x_sent"], topk_idx=inp["topk_idx"],
                           topk_weights=inp["topk_weights"],
                           **({"scales": inp["scales"]} if fp8 else {})) for inp in inputs]
        ref_rows = [ref.ht_dispatch(ref_inputs, d, E, R) for d in range(R)]

        # The test's own meta, then the layout kernel checked against it.
        per_rank, per_expert, in_rank = ref.ht_layout(mine["topk_idx"], E, R)
        gbl_per_expert = per_expert.to(dev).clone()
        dist.all_reduce(gbl_per_expert, group=ctx.group)
        gbl_per_rank = per_rank.to(dev).clone()
        dist.all_reduce(gbl_per_rank, group=ctx.group)
        l_rank, l_rdma, l_expert, l_in_rank, l_event = buffer.get_dispatch_layout(topk_idx, E)
        assert l_rdma is None and isinstance(l_event, deep_ep.EventOverlap)
        assert torch.equal(l_rank.cpu(), per_rank) and l_rank.dtype == torch.int32, what
        assert torch.equal(l_expert.cpu(), per_expert) and l_expert.dtype == torch.int32, what
        assert torch.equal(l_in_rank.cpu(), in_rank) and l_in_rank.dtype == torch.bool, what
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = l_rank, l_expert, l_in_rank

        current_x = _x_arg(mine[xname], mine["x_e4m3_scales"] if fp8 else None, dev)
        weights = _fresh(mine["topk_weights"], dev)
        dispatch_args = dict(x=current_x, num_tokens_per_rank=num_tokens_per_rank,
                             is_token_in_rank=is_token_in_rank,
                             num_tokens_per_expert=num_tokens_per_expert, config=config,
                             async_finish=async_mode)
        if with_topk:
            dispatch_args.update(topk_idx=topk_idx, topk_weights=weights)
        if previous_mode:
            dispatch_args.update(previous_event=deep_ep.Buffer.capture())
        out = buffer.dispatch(**dispatch_args)
        recv_x, recv_topk_idx, recv_topk_weights, num_list, handle, event = out
        if async_mode:
            event.current_stream_wait()
        want = ref_rows[r]
        N = len(want["recv_src_idx"])
        if with_topk:
            ht._check_recv(ctx, ref_inputs, out, E, 1, what)
        else:
            assert recv_topk_idx is None and recv_topk_weights is None, what
            if fp8:
                assert torch.equal(_bits(recv_x[0]), want["recv_x"]), what
                assert torch.equal(recv_x[1].cpu(), want["recv_scales"]), what
            else:
                assert torch.equal(recv_x.cpu(), want["recv_x"]), what
            assert torch.equal(handle[0].cpu(), ref.rank_prefix_matrix(ref_inputs, E, R)), what
            assert torch.equal(handle[3].cpu(), want["recv_src_idx"]), what
        # DeepEP's checks: the received count, the per-expert list = the global per-expert
        # counts of this rank's experts, the data's sources.
        assert int(gbl_per_rank[r]) == (recv_x[0] if fp8 else recv_x).shape[0] == N, what
        assert num_list == gbl_per_expert.view(R, -1)[r].tolist(), what
        assert num_list == want["num_recv_tokens_per_expert"], what
        recv_bf16 = _cast_back(recv_x[0], recv_x[1]) if fp8 else recv_x.cpu()
        rank_prefix_matrix = handle[0].cpu()
        if xname == "x":
            _check_data(recv_bf16, rank_prefix_matrix, r, R)
        recv_w_clone = None
        if with_topk:
            assert bool(((recv_topk_idx == -1) | ((recv_topk_idx >= 0) &
                                                   (recv_topk_idx < L))).all()), what
            for e, count in enumerate(num_list):
                assert int(recv_topk_idx.eq(e).sum()) == count, what
            recv_w_clone = recv_topk_weights.clone()
            if xname != "x_pure_rand":
                # As DeepEP's test: fill the weights of non-local slots with the row's max
                # (= the source rank), so check_data applies; combine then sums these.
                m = recv_topk_idx.eq(-1)
                recv_topk_weights[m] = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(
                    recv_topk_weights)[m]
                _check_data(recv_topk_weights.cpu(), rank_prefix_matrix, r, R)

        # num_worst_tokens != 0 (with top-k): the prefix equals the exact dispatch's.
        if with_topk:
            W = T * R
            dispatch_args.update(num_worst_tokens=W)
            wx, widx, ww, empty_list, _, event = buffer.dispatch(**dispatch_args)
            if async_mode:
                event.current_stream_wait()
            assert len(empty_list) == 0, what
            wx_data = wx[0] if fp8 else wx
            assert wx_data.shape[0] == widx.shape[0] == ww.shape[0] == W, what
            if fp8:
                assert torch.equal(_bits(wx[0])[:N], want["recv_x"]), what
                assert torch.equal(wx[1][:N].cpu(), want["recv_scales"]), what
            else:
                assert torch.equal(wx[:N].cpu(), recv_x.cpu()), what
            assert torch.equal(widx[:N].cpu(), recv_topk_idx.cpu()), what
            assert torch.equal(ww[:N].cpu(), recv_w_clone.cpu()), what
            assert bool((widx[N:] == -1).all()), what

        # Cached dispatch (without top-k), on new data of the same routing.
        if not with_topk:
            x2 = _intranode_inputs(s + 7919, R, E, K, T)
            cached_args = dict(x=_x_arg(x2[r][xname], x2[r]["x_e4m3_scales"] if fp8 else None,
                                        dev), handle=handle, config=config,
                               async_finish=async_mode)
            if previous_mode:
                cached_args.update(previous_event=deep_ep.Buffer.capture())
            c = buffer.dispatch(**cached_args)
            if async_mode:
                c[5].current_stream_wait()
            assert c[1:5] == (None, None, None, None), what
            ref2 = [dict(x=x2[src][xname], topk_idx=inputs[src]["topk_idx"],
                         **({"scales": x2[src]["x_e4m3_scales"]} if fp8 else {}))
                    for src in range(R)]
            want2 = ref.ht_dispatch(ref2, r, E, R)
            if fp8:
                assert torch.equal(_bits(c[0][0]), want2["recv_x"]), what + " cached"
                assert torch.equal(c[0][1].cpu(), want2["recv_scales"]), what + " cached"
            else:
                assert torch.equal(c[0].cpu(), want2["recv_x"]), what + " cached"
            if xname == "x":
                _check_data(c[0].cpu(), rank_prefix_matrix, r, R)

        # Combine: x = what was received (fp8 cast back), topk_weights = the received weights.
        combine_args = dict(x=_fresh(recv_bf16, dev), handle=handle, config=config,
                            async_finish=async_mode)
        if with_topk:
            combine_args.update(topk_weights=recv_topk_weights)
        if previous_mode:
            combine_args.update(previous_event=deep_ep.Buffer.capture())
        combined_x, combined_w, event = buffer.combine(**combine_args)
        if async_mode:
            event.current_stream_wait()
        ys = [ref_rows[d]["recv_x"] if not fp8 else
              _cast_back(ref_rows[d]["recv_x"], ref_rows[d]["recv_scales"]) for d in range(R)]
        assert torch.equal(combined_x.cpu(), ref.ht_combine(ref_inputs, ys, r, E, R)), \
            what + " combine"
        sent = mine[xname] if not fp8 else _cast_back(mine["x_e4m3"], mine["x_e4m3_scales"])
        check_x = combined_x.cpu().float() / in_rank.sum(dim=1).unsqueeze(1)
        assert _calc_diff(check_x, sent) < 5e-6, what  # DeepEP's own tolerance
        if with_topk:
            ws = []
            for d in range(R):
                wd = ref_rows[d]["recv_topk_weights"].clone()
                if xname != "x_pure_rand":
                    m = ref_rows[d]["recv_topk_idx"].eq(-1)
                    wd[m] = wd.amax(dim=1, keepdim=True).expand_as(wd)[m]
                ws.append(wd)
            assert torch.equal(combined_w.cpu(), _combined_weights(ref_inputs, ws, r, E, R)), \
                what + " combined_topk_weights"
            check_w = combined_w.cpu() if xname == "x_pure_rand" else \
                combined_w.cpu() / in_rank.sum(dim=1).unsqueeze(1)
            assert _calc_diff(check_w, mine["topk_weights"]) < 1e-9, what
        else:
            assert combined_w is None, what

    # Tuning part: Config objects of other chunk sizes and of another num_sms, then the
    # defaults after set_num_sms, for cached dispatch and combine (results must not change).
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        _fresh(inputs[r]["x"], dev), num_tokens_per_rank=num_tokens_per_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
        config=deep_ep.Config(num_sms, 4, 256))
    x_ref = [dict(x=inp["x"], topk_idx=inp["topk_idx"]) for inp in inputs]
    want = ref.ht_dispatch(x_ref, r, E, R)
    assert torch.equal(recv_x.cpu(), want["recv_x"])
    ys = [ref.ht_dispatch(x_ref, d, E, R)["recv_x"] for d in range(R)]
    expect = ref.ht_combine(x_ref, ys, r, E, R)
    for chunk in (4, 6, 0):
        if chunk:
            cfg = deep_ep.Config(num_sms, chunk, 256)
        else:
            deep_ep.Buffer.set_num_sms(num_sms)
            cfg = deep_ep.Buffer.get_dispatch_config(R)
            assert cfg.num_sms == num_sms
        res = buffer.dispatch(x=_fresh(inputs[r]["x"], dev), handle=handle, config=cfg)
        assert torch.equal(res[0].cpu(), want["recv_x"]), (seed, chunk)
        if not chunk:
            cfg = deep_ep.Buffer.get_combine_config(R)
            assert cfg.num_sms == num_sms
        out, _, _ = buffer.combine(x=recv_x, handle=handle, config=cfg)
        assert torch.equal(out.cpu(), expect), (seed, chunk)
    # Non-cached dispatches alternating between two SM budgets (each its own epx group).
    for n in (20, 24, 20):
        res = buffer.dispatch(_fresh(inputs[r]["x"], dev),
                              num_tokens_per_rank=num_tokens_per_rank,
                              is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=num_tokens_per_expert,
                              topk_idx=_fresh(inputs[r]["topk_idx"], dev),
                              config=deep_ep.Config(num_sms=n))
        assert torch.equal(res[0].cpu(), want["recv_x"]), (seed, n)
        out, _, _ = buffer.combine(res[0], res[4], config=deep_ep.Config(num_sms=n))
        assert torch.equal(out.cpu(), expect), (seed, n)


def body_token_in_rank_only(ctx, seed):
    """A dispatch routed by is_token_in_rank alone with an arbitrary routing (not derived from
    any top-k; tokens going nowhere included) and arbitrary num_tokens_per_expert: recv_topk_idx
    and recv_topk_weights None, the per-expert list = the sum over the ranks of
    num_tokens_per_expert for this rank's experts (aligned), worst-case rows, cached dispatch,
    combine (with bias) — bf16 and fp8."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = _num_experts(R)
    L = E // R
    buffer = deep_ep.Buffer(ctx.group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)
    for i, (fmt, alignment, worst) in enumerate(itertools.product(("bf16", "fp8"), (1, 4),
                                                                  (False, True))):
        s = seed + i
        what = f"seed={s} fmt={fmt} alignment={alignment} worst={worst}"
        inputs = []
        for src in range(R):
            g = ref.generator(s, src)
            T = 3 + 7 * src + (i % 3)
            in_rank = torch.rand(T, R, generator=g) < 0.5
            route = torch.where(in_rank, torch.arange(R) * L, torch.full((R,), -1))
            x = ref.rand_bf16((T, H), g)
            q, sc = ref.quantize_fp8(x, round_scale=False)
            inputs.append(dict(in_rank=in_rank, topk_idx=route.to(torch.int64),
                               x=q if fmt == "fp8" else x,
                               scales=sc if fmt == "fp8" else None,
                               per_expert=torch.randint(0, 50, (E,), generator=g,
                                                        dtype=torch.int32)))
        mine = inputs[r]
        want = ref.ht_dispatch(inputs, r, E, R)
        N = len(want["recv_src_idx"])
        W = max(len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]) for d in range(R)) + 3
        x_arg = _x_arg(mine["x"], mine["scales"], dev)
        recv_x, recv_idx, recv_w, num_list, handle, event = buffer.dispatch(
            x_arg, num_tokens_per_rank=_fresh(mine["in_rank"].sum(0).to(torch.int32), dev),
            is_token_in_rank=_fresh(mine["in_rank"], dev),
            num_tokens_per_expert=_fresh(mine["per_expert"], dev), expert_alignment=alignment,
            num_worst_tokens=W if worst else 0, async_finish=True)
        event.current_stream_wait()
        assert recv_idx is None and recv_w is None, what
        if worst:
            assert num_list == [], what
        else:
            total = sum(inp["per_expert"].to(torch.int64) for inp in inputs)
            assert num_list == [(int(c) + alignment - 1) // alignment * alignment
                                for c in total[r * L:(r + 1) * L]], what
        data = recv_x[0] if fmt == "fp8" else recv_x
        assert data.shape[0] == (W if worst else N), what
        if fmt == "fp8":
            assert torch.equal(_bits(recv_x[0])[:N], want["recv_x"]), what
            assert torch.equal(recv_x[1][:N].cpu(), want["recv_scales"]), what
        else:
            assert torch.equal(recv_x[:N].cpu(), want["recv_x"]), what
        assert torch.equal(handle[0].cpu(), ref.rank_prefix_matrix(inputs, E, R)), what
        # Cached dispatch of bf16 data on the same routing.
        x2 = [ref.rand_bf16((inp["x"].shape[0], H), ref.generator(s, src, "x2"))
              for src, inp in enumerate(inputs)]
        c = buffer.dispatch(_fresh(x2[r], dev), handle)  # handle passed positionally
        want2 = ref.ht_dispatch([dict(x=x2[src], topk_idx=inputs[src]["topk_idx"])
                                 for src in range(R)], r, E, R)
        assert torch.equal(c[0][:N].cpu(), want2["recv_x"]), what + " cached"
        # Combine with one bias; rows past N (worst case) are NaN and never read.
        ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                            ref.generator(s, d, "y")) for d in range(R)]
        y = ys[r]
        if worst:
            y = torch.cat([y, torch.full((W - N, H), float("nan"), dtype=torch.bfloat16)])
        b0 = ref.rand_bf16((mine["x"].shape[0], H), ref.generator(s, r, "bias"))
        out, cw, _ = buffer.combine(_fresh(y, dev), handle, bias=_fresh(b0, dev))
        assert cw is None
        assert torch.equal(out.cpu(), ref.ht_combine(inputs, ys, r, E, R, b0)), what + " combine"
    buffer.destroy()


# ==== 2. DeepEP V1 tests/test_low_latency.py ======================================================

def _ll_inputs(seed, R, E, K, T, structured, num_masked):
    """Per rank, as test_low_latency.py: top-k (sorted) of |randn| + 1 scores, some slots -1;
    x = ones * (rank - 128) with the last 128 channels = the token index, or randn * 0.1;
    weights |randn|."""
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        scores = torch.randn(T, E, generator=g).abs() + 1
        idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
        for _ in range(num_masked if T else 0):
            t = int(torch.randint(0, T, (1,), generator=g))
            k = int(torch.randint(0, K, (1,), generator=g))
            idx[t, k] = -1
        if structured:
            x = torch.full((T, H), float(s - 128), dtype=torch.bfloat16)
            x[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
        else:
            x = (torch.randn(T, H, generator=g) * 0.1).to(torch.bfloat16)
        out.append(dict(x=x, topk_idx=idx,
                        topk_weights=torch.randn(T, K, generator=g).abs().to(torch.float32)))
    return out


def _ll_simulated_gemm(recv, use_fp8):
    """What DeepEP's test feeds combine: the received rows cast back to bf16 [L, RT, H]."""
    if not use_fp8:
        return recv.cpu().clone()
    x, s = recv
    L, RT, HH = x.shape
    s = s.cpu().contiguous()
    return torch.stack([_cast_back(x[l], s[l]) for l in range(L)]).reshape(L, RT, HH)


def _ll_ref_ys(inputs, R, E, T_max, use_fp8, round_scale):
    """Every rank's combine input as the reference sees it: its received rows (cast back), the
    rows past recv_count zero (never read)."""
    L = E // R
    ys = []
    for d in range(R):
        y = torch.zeros(L, R * T_max, H, dtype=torch.bfloat16)
        for l, w in enumerate(ref.ll_dispatch(inputs, d, E, R, T_max, use_fp8, round_scale)):
            if w["count"]:
                y[l, :w["count"]] = _cast_back(w["x"], w["scales"]) if use_fp8 else w["x"]
        ys.append(y)
    return ys


def body_low_latency(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, K, T = _num_experts(R), 4, 16
    L = E // R
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    assert isinstance(num_rdma_bytes, int) and num_rdma_bytes > 0
    buffer = deep_ep.Buffer(ctx.group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=E // R, allow_nvlink_for_low_latency_mode=True,
                            explicitly_destroy=True, allow_mnnvl=False, enable_shrink=False)
    quant = [(False, False, False), (True, False, False), (True, True, False),
             (True, True, True)]
    num_times = 0
    for xi, structured in enumerate((True, False)):
        for return_recv_hook in (False, True):
            for use_fp8, round_scale, use_ue8m0 in quant:
                num_times += 1
                s = seed + 100 * xi + 10 * return_recv_hook + num_times
                what = (f"seed={s} structured={structured} hook={return_recv_hook} "
                        f"fp8={use_fp8} round_scale={round_scale} ue8m0={use_ue8m0}")
                inputs = _ll_inputs(s, R, E, K, T, structured, num_masked=3)
                mine = inputs[r]
                current_x, topk_idx = _fresh(mine["x"], dev), _fresh(mine["topk_idx"], dev)
                topk_weights = _fresh(mine["topk_weights"], dev)
                for _ in range((num_times % 2) + 1):  # sometimes twice, the first dropped
                    stats = torch.zeros(L, dtype=torch.int, device=dev)
                    packed_recv_x, packed_recv_count, handle, event, hook = \
                        buffer.low_latency_dispatch(
                            current_x, topk_idx, T, E, use_fp8=use_fp8, round_scale=round_scale,
                            use_ue8m0=use_ue8m0, cumulative_local_expert_recv_stats=stats,
                            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                    hook() if return_recv_hook else event.current_stream_wait()
                res = (packed_recv_x, packed_recv_count, handle, event, hook)
                ll._check_dispatch(ctx, inputs, res, E, T, use_fp8, round_scale, use_ue8m0, what)
                assert torch.equal(stats.cpu(), packed_recv_count.cpu()), what
                # DeepEP's structural checks.
                all_idx = torch.stack([inp["topk_idx"] for inp in inputs])
                for l in range(L):
                    e = r * L + l
                    n = int(packed_recv_count[l])
                    lr = handle[1][l].cpu()
                    assert n == int((lr & 0xFFFFFFFF).sum()) == int((all_idx == e).sum()), what
                    if not structured or n == 0:
                        continue
                    got = packed_recv_x[l, :n].cpu() if not use_fp8 else _cast_back(
                        packed_recv_x[0][l, :n], packed_recv_x[1][l, :n])
                    src = handle[0][l, :n].cpu()
                    assert torch.equal(got[:, :-128].amin(-1), got[:, :-128].amax(-1)), what
                    if round_scale:
                        assert _calc_diff(got[:, -1], src.float()) < 0.007, what
                    else:
                        assert int((got[:, -128:].float() - src.view(-1, 1) % T).sum()) == 0
                        for j in range(R):
                            b, c = int(lr[j] >> 32), int(lr[j] & 0xFFFFFFFF)
                            assert int((got[b:b + c, :-128].float() - j + 128).abs().sum()) == 0

                simulated_gemm_x = _ll_simulated_gemm(packed_recv_x, use_fp8)
                ys = _ll_ref_ys(inputs, R, E, T, use_fp8, round_scale)
                wants = {lf: ref.ll_combine(inputs, ys, r, E, R, use_logfmt=lf)
                         for lf in (False, True)}
                # DeepEP's loop, and its --use-logfmt run (with zero_copy too, which it refuses).
                for zero_copy, use_logfmt in ((False, False), (True, False), (False, True),
                                              (True, True)):
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = \
                            simulated_gemm_x.to(dev)
                    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
                    # DeepEP's test passes simulated_gemm_x in both modes; a zero-copy combine
                    # ignores x (its rows are in the buffer), so NaN there checks that it does.
                    x = _fresh(simulated_gemm_x, dev)
                    combined_x, event, hook = buffer.low_latency_combine(
                        ll._unread(x) if zero_copy else x, topk_idx, topk_weights, handle,
                        use_logfmt=use_logfmt, async_finish=not return_recv_hook,
                        zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                    hook() if return_recv_hook else event.current_stream_wait()
                    assert combined_x is out, what
                    ll._assert_combined(combined_x.cpu(), wants[use_logfmt], mine["topk_idx"], L,
                                        f"{what} zero_copy={zero_copy} logfmt={use_logfmt}",
                                        buffer)
                    assert int(torch.isnan(combined_x).sum()) == 0
                    if not round_scale:  # DeepEP's own tolerance
                        w = mine["topk_weights"].masked_fill(mine["topk_idx"] == -1, 0)
                        diff = _calc_diff(mine["x"].float() * w.sum(1).view(-1, 1),
                                          combined_x.cpu())
                        assert diff < (9e-4 if use_fp8 else 1e-5), (what, diff)
    buffer.destroy()


# ==== 3. An engine's dispatcher (SGLang token_dispatcher/deepep.py) ==============================

def _engine_buffer(ctx, E, T_max, mode="auto"):
    """DeepEPBuffer.get_deepep_buffer: the sizes from the Config hints and the low-latency size
    hint, num_qps_per_rank as the engine picks it, allow_mnnvl=True."""
    R = ctx.world_size
    hidden_bytes = H * 2
    num_nvl_bytes = num_rdma_bytes = 0
    if mode != "low_latency":
        for config in (deep_ep.Buffer.get_dispatch_config(R),
                       deep_ep.Buffer.get_combine_config(R)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, R), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, R),
                                 num_rdma_bytes)
    if mode != "normal":
        num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(T_max, H, R, E),
                             num_rdma_bytes)
    num_qps_per_rank = {"normal": deep_ep.Buffer.num_sms, "low_latency": E // R,
                        "auto": max(deep_ep.Buffer.num_sms, E // R)}[mode]
    return deep_ep.Buffer(ctx.group, num_nvl_bytes, num_rdma_bytes,
                          low_latency_mode=mode != "normal", num_qps_per_rank=num_qps_per_rank,
                          allow_mnnvl=True)


def _engine_inputs(seed, R, E, K, T_of, fmt="bf16", kind="uniform"):
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = T_of(s)
        x = ref.rand_bf16((T, H), g, scale=2.0)
        inp = dict(topk_idx=ref.routing(kind, T, K, E, R, g),
                   topk_weights=ref.rand_weights(T, K, g), x=x)
        if fmt == "fp8":
            inp["x"], inp["scales"] = ref.quantize_fp8(x, round_scale=False)
        elif fmt == "ue8m0":  # DeepGEMM's packed power-of-two scales
            inp["x"], sc = ref.quantize_fp8(x, round_scale=True)
            inp["scales"] = ref.ue8m0_pack(sc)
        out.append(inp)
    return out


def _engine_prefill(ctx, buf, seed, E, K, fmt, alignment, what):
    """_DeepEPDispatcherImplNormal with async_finish=True: dispatch_a (Buffer.capture()),
    dispatch_b (get_dispatch_layout with the event, dispatch with the layout's event,
    event.current_stream_wait()), combine_a (capture), combine_b (combine, wait)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    inputs = _engine_inputs(seed, R, E, K, lambda s: 5 + (seed + 11 * s) % 40, fmt)
    mine = inputs[r]
    # dispatch_a
    hidden_states = _x_arg(mine["x"], mine.get("scales"), dev)
    topk_ids = _fresh(mine["topk_idx"], dev).to(torch.int64)
    topk_weights = _fresh(mine["topk_weights"], dev)
    previous_event = deep_ep.Buffer.capture()
    # dispatch_b
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buf.get_dispatch_layout(topk_ids, E, previous_event=previous_event,
                                               async_finish=True,
                                               allocate_on_comm_stream=previous_event is not None)
    out = buf.dispatch(hidden_states, topk_idx=topk_ids, topk_weights=topk_weights,
                       num_tokens_per_rank=num_tokens_per_rank,
                       num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                       is_token_in_rank=is_token_in_rank,
                       num_tokens_per_expert=num_tokens_per_expert,
                       previous_event=previous_event, async_finish=True,
                       allocate_on_comm_stream=previous_event is not None,
                       expert_alignment=alignment, config=None)
    recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event = out
    event.current_stream_wait()
    ht._check_recv(ctx, inputs, out, E, alignment, what)
    # The experts' weighted outputs, then combine_a / combine_b.
    ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                        ref.generator(seed, d, "y")) for d in range(R)]
    previous_event = deep_ep.Buffer.capture()
    combined_x, _, event = buf.combine(_fresh(ys[r], dev), handle, async_finish=True,
                                       previous_event=previous_event,
                                       allocate_on_comm_stream=previous_event is not None,
                                       config=None)
    event.current_stream_wait()
    assert torch.equal(combined_x.cpu(), ref.ht_combine(inputs, ys, r, E, R)), what + " combine"


def _engine_decode(ctx, buf, seed, E, K, T_max, use_fp8, round_scale, hook_mode, what,
                   empty_rank=None):
    """_DeepEPDispatcherImplLowLatency: low_latency_dispatch (async_finish = not hook,
    return_recv_hook = hook), dispatch_b runs the hook or waits on the event; combine by keyword
    (x=, topk_idx=, topk_weights=, handle=), combine_b runs the hook or waits."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    L = E // R
    inputs = _engine_inputs(seed, R, E, K, lambda s: 0 if s == empty_rank else
                            1 + (seed + 5 * s) % T_max)
    mine = inputs[r]
    hidden_states, topk_ids = _fresh(mine["x"], dev), _fresh(mine["topk_idx"], dev)
    topk_weights = _fresh(mine["topk_weights"], dev)
    opts = dict(round_scale=round_scale, use_ue8m0=round_scale) if use_fp8 else {}
    packed_recv_hidden, packed_recv_count, handle, event, hook = buf.low_latency_dispatch(
        hidden_states, topk_ids, T_max, E, use_fp8=use_fp8, async_finish=not hook_mode,
        return_recv_hook=hook_mode, **opts)
    hook() if hook_mode else event.current_stream_wait()
    res = (packed_recv_hidden, packed_recv_count, handle, event, hook)
    ll._check_dispatch(ctx, inputs, res, E, T_max, use_fp8, round_scale, round_scale, what)
    ys = [ll._y(seed, d, L, R, T_max) for d in range(R)]
    combined, event, hook = buf.low_latency_combine(
        x=_fresh(ys[r], dev), topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
        async_finish=not hook_mode, return_recv_hook=hook_mode)
    hook() if hook_mode else event.current_stream_wait()
    ll._assert_combined(combined.cpu(), ref.ll_combine(inputs, ys, r, E, R), mine["topk_idx"],
                        L, what + " combine", buf)


def body_engine_auto(ctx, seed):
    """DeepEPMode.AUTO: one Buffer(low_latency_mode=True) serving prefill (normal mode) and
    decode (low latency) alternately; switching to decode after a prefill cleans the
    low-latency buffer first (DeepEPBuffer.set_dispatch_mode_as_low_latency). Prefill T varies
    per rank and step (the normal-mode buffer grows), decode has a rank with no tokens."""
    R = ctx.world_size
    E, K, T_max = _num_experts(R), 4, 8
    buf = _engine_buffer(ctx, E, T_max, "auto")
    assert buf.low_latency_mode and buf.allow_mnnvl
    steps = ["prefill", "decode", "decode", "prefill", "prefill", "decode", "prefill", "decode"]
    fmts = ("bf16", "fp8", "ue8m0")
    quants = ((False, False), (True, False), (True, True))
    last = None
    for i, step in enumerate(steps):
        s = seed + i
        if step == "prefill":
            fmt, alignment = fmts[i % 3], (1, 128)[i % 2]
            _engine_prefill(ctx, buf, s, E, K, fmt, alignment,
                            f"seed={s} step={i} prefill fmt={fmt} alignment={alignment}")
        else:
            if last == "prefill":
                buf.clean_low_latency_buffer(T_max, H, E)
            use_fp8, round_scale = quants[i % 3]
            hook_mode = i % 2 == 1
            _engine_decode(ctx, buf, s, E, K, T_max, use_fp8, round_scale, hook_mode,
                           f"seed={s} step={i} decode fp8={use_fp8} rs={round_scale} "
                           f"hook={hook_mode}", empty_rank=(i // 2) % R if R > 1 else None)
        last = step


# Two-batch overlap: programs over batches A, B (and C, the next layer's A). Steps:
#   ("d", b, hook)  dispatch b           ("h", b)   b's dispatch hook
#   ("c", b, hook, zero_copy)  combine b ("ch", b)  b's combine hook
TBO_SEQUENCES = {
    # The engine's order: both dispatches in flight, each combine sent before the other's
    # dispatch is received.
    "dA_dB_hA_cA_hB_cB_chA_chB": [("d", "A", True), ("d", "B", True), ("h", "A"),
                                  ("c", "A", True, False), ("h", "B"), ("c", "B", True, False),
                                  ("ch", "A"), ("ch", "B")],
    "dA_hA_dB_cA_hB_cB_chA_chB": [("d", "A", True), ("h", "A"), ("d", "B", True),
                                  ("c", "A", True, False), ("h", "B"), ("c", "B", True, False),
                                  ("ch", "A"), ("ch", "B")],
    # Hooks in the reverse order, combines in the reverse order.
    "dA_dB_hB_hA_cB_cA_chB_chA": [("d", "A", True), ("d", "B", True), ("h", "B"), ("h", "A"),
                                  ("c", "B", True, False), ("c", "A", True, False),
                                  ("ch", "B"), ("ch", "A")],
    # A hooked batch and a plain one mixed.
    "dA_dB(plain)_hA_cB(plain)_cA_chA": [("d", "A", True), ("d", "B", False), ("h", "A"),
                                         ("c", "B", False, False), ("c", "A", True, False),
                                         ("ch", "A")],
    # Zero-copy combines (expert outputs written through get_next_low_latency_combine_buffer).
    "zero_copy": [("d", "A", True), ("d", "B", True), ("h", "A"), ("c", "A", True, True),
                  ("h", "B"), ("c", "B", True, True), ("ch", "A"), ("ch", "B")],
    # Across layers: the next layer's dispatch (C) starts before B's combine hook.
    "next_layer": [("d", "A", True), ("d", "B", True), ("h", "A"), ("c", "A", True, False),
                   ("h", "B"), ("c", "B", True, False), ("ch", "A"), ("d", "C", True),
                   ("ch", "B"), ("h", "C"), ("c", "C", True, False), ("ch", "C")],
}


def _garbage(n):
    """Fills n with values that would corrupt any result read from it (NaN; 1, a valid expert
    id elsewhere: wrong routing, not an error; 0x7F bytes)."""
    return n.fill_(float("nan") if n.is_floating_point() else 0x7F if n.dtype == torch.uint8
                   else 1)


def _garbage_intact(n):
    return bool(torch.isnan(n).all()) if n.is_floating_point() else \
        bool((n == (0x7F if n.dtype == torch.uint8 else 1)).all())


def body_engine_tbo(ctx, seed, name, mutate):
    """Two-batch overlap on one low-latency Buffer with every call's inputs (x, topk_idx,
    topk_weights, the expert outputs, one batch's stats tensor) dropped right after the call
    returns (del + gc.collect() + new tensors of the same sizes filled with garbage, so the
    memory is reused) or overwritten in place with garbage, before the hooks run. Every output
    must still be exact. Then the same for normal mode (async dispatches of two batches, then
    their combines)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, K, T_max = _num_experts(R), 4, 12
    L = E // R
    buf = _engine_buffer(ctx, E, T_max, "low_latency")
    junk = []  # garbage tensors occupying freed memory until the end
    freed = []  # (address, bytes) of the dropped inputs
    state = {}
    program = TBO_SEQUENCES[name]
    batches = sorted({step[1] for step in program})
    for j, b in enumerate(batches):
        s = seed + 31 * j
        inputs = _engine_inputs(s, R, E, K, lambda src: (3 + 5 * src + 7 * j) % (T_max + 1),
                                kind=ref.ROUTINGS[(seed + j) % len(ref.ROUTINGS)])
        state[b] = dict(seed=s, inputs=inputs, use_fp8=j % 2 == 0,
                        ys=[ll._y(s, d, L, R, T_max) for d in range(R)])
    kept_stats = torch.zeros(L, dtype=torch.int32, device=dev)
    kept_expected = torch.zeros(L, dtype=torch.int64)

    def release(st, names):
        """The caller lets go of (or scribbles over) what it passed."""
        if mutate == "overwrite":
            for n in names:
                t = st["args"][n]
                t.fill_(float("nan") if t.is_floating_point() else 1)
            return
        meta = [(t.shape, t.dtype, t.device, t.numel() * t.element_size())
                for t in (st["args"][n] for n in names)]
        freed.extend((t.data_ptr(), t.numel() * t.element_size())
                     for t in (st["args"][n] for n in names) if t.numel())
        for n in names:
            del st["args"][n]
        gc.collect()
        # The caching allocator (GPU) hands the same-size blocks back; glibc's memalign (CPU)
        # rather reuses a freed chunk for a slightly smaller request: allocate both.
        for shape, dtype, device, nbytes in meta:
            junk.append(_garbage(torch.empty(shape, dtype=dtype, device=device)))
            for less in (64, 128, 256):
                if nbytes > less:
                    junk.append(_garbage(torch.empty(nbytes - less, dtype=torch.uint8,
                                                     device=device)))

    for step in program:
        op, b = step[0], step[1]
        st = state[b]
        inputs = st["inputs"]
        mine = inputs[r]
        what = f"seed={seed} seq={name} mutate={mutate} step={step} batch_seed={st['seed']}"
        if op == "d":
            hook_mode = step[2]
            st["args"] = dict(x=_fresh(mine["x"], dev), topk_idx=_fresh(mine["topk_idx"], dev))
            use_stats_kept = b == "A"
            if use_stats_kept:
                stats = kept_stats
            else:
                stats = torch.zeros(L, dtype=torch.int32, device=dev)
                st["args"]["stats"] = stats
            res = buf.low_latency_dispatch(
                st["args"]["x"], st["args"]["topk_idx"], T_max, E,
                cumulative_local_expert_recv_stats=stats, use_fp8=st["use_fp8"],
                async_finish=not hook_mode, return_recv_hook=hook_mode)
            del stats
            st["res"] = res
            if not hook_mode:
                res[3].current_stream_wait()
            if use_stats_kept:
                release(st, ["x", "topk_idx"])
            elif mutate == "drop":
                release(st, ["x", "topk_idx", "stats"])
            else:
                release(st, ["x", "topk_idx"])  # the stats accumulator stays the caller's
            if not hook_mode:
                ll._check_dispatch(ctx, inputs, res, E, T_max, st["use_fp8"], False, False, what)
                if use_stats_kept:
                    kept_expected += res[1].cpu().to(torch.int64)
        elif op == "h":
            st["res"][4]()
            ll._check_dispatch(ctx, inputs, st["res"], E, T_max, st["use_fp8"], False, False,
                               what)
            if b == "A":
                kept_expected += st["res"][1].cpu().to(torch.int64)
        elif op == "c":
            hook_mode, zero_copy = step[2], step[3]
            handle = st["res"][2]
            st["args"] = dict(y=_fresh(st["ys"][r], dev),
                              topk_idx=_fresh(mine["topk_idx"], dev),
                              topk_weights=_fresh(mine["topk_weights"], dev))
            if zero_copy:
                view = buf.get_next_low_latency_combine_buffer(handle)
                view.copy_(st["args"]["y"])
                x_arg = view
            else:
                x_arg = st["args"]["y"]
            out, event, hook = buf.low_latency_combine(
                x_arg, st["args"]["topk_idx"], st["args"]["topk_weights"], handle,
                zero_copy=zero_copy, async_finish=not hook_mode, return_recv_hook=hook_mode)
            del x_arg
            st["out"], st["chook"] = out, hook
            if not hook_mode:
                event.current_stream_wait()
            release(st, ["y", "topk_idx", "topk_weights"])
            if not hook_mode:
                ll._assert_combined(out.cpu(), ref.ll_combine(inputs, st["ys"], r, E, R),
                                    mine["topk_idx"], L, what, buf)
        elif op == "ch":
            st["chook"]()
            ll._assert_combined(st["out"].cpu(), ref.ll_combine(inputs, st["ys"], r, E, R),
                                mine["topk_idx"], L, what, buf)
    assert torch.equal(kept_stats.cpu().to(torch.int64), kept_expected), (seed, name)
    for t in junk:  # nothing wrote into memory the caller had let go of
        assert _garbage_intact(t), (seed, name, "memory of a dropped input was written")
    # How many dropped inputs' memory the garbage took over (the drop mode's reach).
    reused = sum(any(j.data_ptr() < p + n and p < j.data_ptr() + j.numel() * j.element_size()
                     for j in junk) for p, n in freed)
    junk.clear()

    # Normal mode, two batches in flight (async events), inputs released after every call.
    nb = _engine_buffer(ctx, E, T_max, "normal")
    batches = []
    for j in range(2):
        s = seed + 1000 + j
        inputs = _engine_inputs(s, R, E, K, lambda src: 4 + (s + 3 * src) % 20,
                                fmt=("bf16", "fp8")[j])
        args = dict(x=_x_arg(inputs[r]["x"], inputs[r].get("scales"), dev),
                    topk_idx=_fresh(inputs[r]["topk_idx"], dev),
                    topk_weights=_fresh(inputs[r]["topk_weights"], dev))
        layout = nb.get_dispatch_layout(args["topk_idx"], E)
        out = nb.dispatch(args["x"], topk_idx=args["topk_idx"], topk_weights=args["topk_weights"],
                          num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                          num_tokens_per_expert=layout[2],
                          previous_event=deep_ep.Buffer.capture(), async_finish=True)
        if mutate == "overwrite":
            for t in (args["topk_idx"], args["topk_weights"]):
                t.fill_(float("nan") if t.is_floating_point() else 1)
            (args["x"][0] if isinstance(args["x"], tuple) else args["x"]).fill_(0)
        del args, layout
        gc.collect()
        batches.append((s, inputs, out))
    for s, inputs, out in batches:
        out[5].current_stream_wait()
        ht._check_recv(ctx, inputs, out, E, 1, f"seed={s} normal two-batch")
    for s, inputs, out in batches:
        ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                            ref.generator(s, d, "y")) for d in range(R)]
        y = _fresh(ys[r], dev)
        combined, _, event = nb.combine(y, out[4], previous_event=deep_ep.Buffer.capture(),
                                        async_finish=True)
        if mutate == "overwrite":
            y.fill_(float("nan"))
        del y
        gc.collect()
        event.current_stream_wait()
        assert torch.equal(combined.cpu(), ref.ht_combine(inputs, ys, r, E, R)), \
            f"seed={s} normal two-batch combine"
    return reused, len(freed)


# ==== 4. Every keyword of DeepEP V1's API ===================================================

# (name, default) of every parameter, in order, as DeepEP V1's deep_ep/buffer.py (567632d) and
# its C++ Config binding declare them (read from the source; `self` left out). REQUIRED: no
# default.
REQUIRED = object()
DEEPEP_SIGNATURES = {
    "Buffer.__init__": [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                        ("low_latency_mode", False), ("num_qps_per_rank", 24),
                        ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                        ("use_fabric", False), ("explicitly_destroy", False),
                        ("enable_shrink", False), ("comm", None)],
    "Buffer.destroy": [],
    "Buffer.is_sm90_compiled": [],
    "Buffer.set_num_sms": [("new_num_sms", REQUIRED)],
    "Buffer.capture": [],
    "Buffer.get_low_latency_rdma_size_hint": [
        ("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
        ("num_ranks", REQUIRED), ("num_experts", REQUIRED)],
    "Buffer.get_comm_stream": [],
    "Buffer.get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0),
                                       ("use_rdma_buffer", False)],
    "Buffer.get_dispatch_config": [("num_ranks", REQUIRED)],
    "Buffer.get_combine_config": [("num_ranks", REQUIRED)],
    "Buffer.get_dispatch_layout": [("topk_idx", REQUIRED), ("num_experts", REQUIRED),
                                   ("previous_event", None), ("async_finish", False),
                                   ("allocate_on_comm_stream", False)],
    "Buffer.dispatch": [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                        ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                        ("num_tokens_per_expert", None), ("topk_idx", None),
                        ("topk_weights", None), ("expert_alignment", 1),
                        ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
                        ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None),
                       ("bias", None), ("config", None), ("previous_event", None),
                       ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.internode_dispatch": [
        ("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
        ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
        ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
        ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
        ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.internode_combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None),
                                 ("bias", None), ("config", None), ("previous_event", None),
                                 ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                        ("hidden", REQUIRED), ("num_experts", REQUIRED)],
    "Buffer.low_latency_dispatch": [
        ("x", REQUIRED), ("topk_idx", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
        ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
        ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
        ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "Buffer.low_latency_combine": [
        ("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
        ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
        ("async_finish", False), ("return_recv_hook", False), ("out", None),
        ("combine_wait_recv_cost_stats", None)],
    "Buffer.low_latency_update_mask_buffer": [("rank_to_mask", REQUIRED), ("mask", False)],
    "Buffer.low_latency_query_mask_buffer": [("mask_status", REQUIRED)],
    "Buffer.low_latency_clean_mask_buffer": [],
    "Buffer.get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
    # deep_ep_cpp.Config (pybind11 py::arg names and defaults).
    "Config.__init__": [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                        ("num_max_nvl_chunked_recv_tokens", 256),
                        ("num_max_rdma_chunked_send_tokens", 6),
                        ("num_max_rdma_chunked_recv_tokens", 256)],
    # deep_ep/utils.py (DeepEP 2.x's deep_ep/utils/event.py, dd758ca: release_handle and the
    # hook after the wait added)
    "EventOverlap.__init__": [("event", None), ("extra_tensors", None)],
    "EventOverlap.current_stream_wait": [("release_handle", False)],
    "EventOverlap.register_hook_after_wait": [("hook_after_wait", REQUIRED)],
    "EventOverlap.__call__": [("release_handle", False)],
}
DEEPEP_STATIC = ("is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint",
                 "get_dispatch_config", "get_combine_config")


def test_signatures_match_deepep():
    """Every DeepEP V1 parameter exists in epx's method at the same position (callers pass some
    positionally: Buffer(group, int(2e9), num_rdma_bytes), Config(24, 8, 256)), with DeepEP's
    default; extra epx parameters only after DeepEP's."""
    missing = []
    for qual, params in DEEPEP_SIGNATURES.items():
        cls_name, meth = qual.split(".")
        cls = getattr(deep_ep, cls_name)
        raw = inspect.getattr_static(cls, meth)
        sig = inspect.signature(getattr(cls, meth))
        names = [p for p in sig.parameters if p != "self"]
        for pos, (name, default) in enumerate(params):
            if pos >= len(names) or names[pos] != name:
                missing.append(f"{qual}: parameter {pos} is "
                               f"{names[pos] if pos < len(names) else None!r}, DeepEP's is "
                               f"{name!r}")
                continue
            p = sig.parameters[name]
            if p.kind not in (p.POSITIONAL_OR_KEYWORD,):
                missing.append(f"{qual}: {name} is {p.kind}, expected positional-or-keyword")
            want = p.empty if default is REQUIRED else default
            if p.default != want:
                missing.append(f"{qual}: {name} defaults to {p.default!r}, DeepEP's to {want!r}")
        for extra in names[len(params):]:  # epx-only / later-DeepEP parameters: keyword-safe
            if sig.parameters[extra].default is inspect.Parameter.empty:
                missing.append(f"{qual}: extra parameter {extra!r} has no default")
        if cls is deep_ep.Buffer and meth in DEEPEP_STATIC and not isinstance(raw, staticmethod):
            missing.append(f"{qual}: expected a staticmethod, as DeepEP's")
    assert not missing, "\n".join(missing)
    assert deep_ep.Buffer.num_sms == 20 and deep_ep.topk_idx_t is torch.int64


def test_event_overlap_deepep2_additions():
    """DeepEP 2.x's EventOverlap calls: the hook runs once, after the event's wait; release_handle
    drops the event after the wait (the call form and the `with event(release_handle=True):` form);
    a second hook before the wait, or a hook that is not callable, is InvalidArgument; a plain
    `with` keeps the event."""
    log = []

    class Event:
        def current_stream_wait(self):
            log.append("wait")

    ev = deep_ep.EventOverlap(Event())
    ev.register_hook_after_wait(lambda: log.append("hook"))
    with pytest.raises(epx.InvalidArgument, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    ev.current_stream_wait()
    assert log == ["wait", "hook", "wait"] and ev.event is not None
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None and log == ["wait", "hook", "wait", "wait"]
    ev.current_stream_wait()  # nothing left to wait for, as on the cpu backend
    assert log == ["wait", "hook", "wait", "wait"]

    log.clear()
    ev = deep_ep.EventOverlap(Event())
    ev.register_hook_after_wait(lambda: log.append("hook"))
    with ev(release_handle=True) as same:
        assert same is ev
        log.append("body")
    assert log == ["body", "wait", "hook"] and ev.event is None
    ev = deep_ep.EventOverlap(Event())
    with ev:
        pass
    assert ev.event is not None and log == ["body", "wait", "hook", "wait"]
    ev(release_handle=True)
    with ev:
        pass
    with ev:  # the flag applies to one `with` only; the event is gone after the first
        pass
    assert ev.event is None and log == ["body", "wait", "hook", "wait", "wait"]
    with pytest.raises(epx.InvalidArgument, match="hook_after_wait"):
        deep_ep.EventOverlap(None).register_hook_after_wait(3)
    # With no event (the cpu backend's) the hook still runs at the wait.
    ev = deep_ep.EventOverlap(None)
    ev.register_hook_after_wait(lambda: log.append("cpu hook"))
    with ev:
        pass
    assert log[-1] == "cpu hook"


def body_every_kwarg(ctx, seed):
    """Every keyword of every DeepEP V1 method, called with a non-default value: honoured (the
    result checked) or epx.Unsupported naming the option; never a TypeError."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, K, T, T_max = _num_experts(R), 4, 9, 12
    L = E // R
    unsupported = []

    def call(qual, kwarg, fn):
        try:
            return fn()
        except epx.Unsupported as e:
            assert kwarg in str(e) or qual.split(".")[-1] in str(e), (qual, kwarg, str(e))
            unsupported.append(f"{qual}({kwarg})")
            return None

    # ---- constructor
    base = deep_ep.Buffer(ctx.group)
    assert (base.num_nvl_bytes, base.num_rdma_bytes, base.low_latency_mode) == (0, 0, False)
    assert (base.explicitly_destroy, base.enable_shrink) == (False, False)
    kwargs = dict(num_nvl_bytes=1 << 20, num_rdma_bytes=2 << 20, low_latency_mode=True,
                  num_qps_per_rank=3, allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True,
                  use_fabric=True, explicitly_destroy=True, enable_shrink=True, comm=object())
    for k, v in kwargs.items():
        b = call("Buffer", k, lambda: deep_ep.Buffer(ctx.group, **{k: v}))
        if b is None:
            continue
        assert (b.rank, b.group_size, b.group) == (r, R, ctx.group), k
        if k in ("num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                 "allow_mnnvl", "use_fabric", "explicitly_destroy", "enable_shrink"):
            assert getattr(b, k) == v, k
        if k == "explicitly_destroy":
            b.destroy()
    # positional, as test_intranode.py; comm= without a group (an mpi4py-like communicator)
    b = deep_ep.Buffer(ctx.group, int(2e9), 1 << 20, True, 2)
    assert (b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode, b.num_qps_per_rank) == \
        (int(2e9), 1 << 20, True, 2)

    # ---- normal mode
    inputs = _engine_inputs(seed, R, E, K, lambda s: T + s)
    mine = inputs[r]
    x, idx, w = _fresh(mine["x"], dev), _fresh(mine["topk_idx"], dev), \
        _fresh(mine["topk_weights"], dev)
    want = ref.ht_dispatch(inputs, r, E, R)
    N = len(want["recv_src_idx"])
    per_rank, per_expert, in_rank = ref.ht_layout(mine["topk_idx"], E, R)
    layout_kw = dict(previous_event=deep_ep.Buffer.capture(), async_finish=True,
                     allocate_on_comm_stream=True)
    for k, v in layout_kw.items():
        res = call("get_dispatch_layout", k, lambda: base.get_dispatch_layout(idx, E, **{k: v}))
        assert torch.equal(res[0].cpu(), per_rank) and torch.equal(res[2].cpu(), per_expert)
        assert torch.equal(res[3].cpu(), in_rank) and res[1] is None, k
        if k == "async_finish":
            assert res[4].extra_tensors is not None  # the outputs are recorded, as DeepEP's
    res = base.get_dispatch_layout(topk_idx=idx, num_experts=E)
    pr, _, pe, ir, _ = res
    ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                        ref.generator(seed, d, "y")) for d in range(R)]
    expect_combine = ref.ht_combine(inputs, ys, r, E, R)
    # One node here: num_tokens_per_rdma_rank holds one count (the layout returns None for it).
    per_node = ir.any(dim=1).sum(dim=0, dtype=torch.int32).reshape(1)
    dispatch_kw = dict(num_tokens_per_rank=pr, num_tokens_per_rdma_rank=per_node,
                       is_token_in_rank=ir,
                       num_tokens_per_expert=pe, topk_weights=w, expert_alignment=4,
                       num_worst_tokens=R * (T + R), config=deep_ep.Config(num_sms=22),
                       previous_event=deep_ep.Buffer.capture(), async_finish=True,
                       allocate_on_comm_stream=True)
    handle = None
    for k, v in dispatch_kw.items():
        base_kw = dict(x=x, topk_idx=idx, num_tokens_per_expert=pe)
        base_kw[k] = v
        out = call("dispatch", k, lambda: base.dispatch(**base_kw))
        if out is None:
            continue
        rx, ridx, rw, lst, h, ev = out
        assert torch.equal(rx[:N].cpu(), want["recv_x"]), k
        assert torch.equal(ridx[:N].cpu(), want["recv_topk_idx"]), k
        if k == "topk_weights":
            assert torch.equal(rw.cpu(), want["recv_topk_weights"]), k
        else:
            assert rw is None, k
        if k == "expert_alignment":
            assert lst == ref.ht_dispatch(inputs, r, E, R, 4)["num_recv_tokens_per_expert"]
        elif k == "num_worst_tokens":
            assert lst == [] and rx.shape[0] == v and bool((ridx[N:] == -1).all()), k
        else:
            assert lst == want["num_recv_tokens_per_expert"], k
            handle = h
        if k == "async_finish":
            assert ev.extra_tensors is not None, k
    # handle (cached mode), passed by keyword
    out = base.dispatch(x=x, handle=handle)
    assert torch.equal(out[0].cpu(), want["recv_x"]) and out[1:5] == (None, None, None, None)
    g = ref.generator(seed, r, "bias")
    b0, b1 = ref.rand_bf16((mine["x"].shape[0], H), g), ref.rand_bf16((mine["x"].shape[0], H), g)
    recv_w = _fresh(want["recv_topk_weights"], dev)
    # The combine's config names the SM budget of the dispatch that made the handle (the class's:
    # that dispatch passed no config), as DeepEP's channel-count check requires.
    combine_kw = dict(topk_weights=recv_w, bias=(_fresh(b0, dev), _fresh(b1, dev)),
                      config=deep_ep.Config(deep_ep.Buffer.num_sms, 4, 256),
                      previous_event=deep_ep.Buffer.capture(),
                      async_finish=True, allocate_on_comm_stream=True)
    for k, v in combine_kw.items():
        res = call("combine", k, lambda: base.combine(x=_fresh(ys[r], dev), handle=handle,
                                                      **{k: v}))
        combined, cw, ev = res
        if k == "bias":
            assert torch.equal(combined.cpu(), ref.ht_combine(inputs, ys, r, E, R, b0, b1)), k
        else:
            assert torch.equal(combined.cpu(), expect_combine), k
        if k == "topk_weights":
            orig = torch.where(mine["topk_idx"] >= 0, mine["topk_weights"], torch.zeros(()))
            assert torch.equal(cw.cpu(), orig), k
        else:
            assert cw is None, k
    # internode_*: this group is one node, where DeepEP's internode kernels do not run: every
    # keyword is accepted and the call raises InvalidArgument, none a TypeError (across nodes:
    # test_deep_ep_internode.py).
    for k, v in dict(dispatch_kw, handle=handle).items():
        if k == "topk_weights":
            v = w
        with pytest.raises(epx.InvalidArgument, match="internode_dispatch: .* one node"):
            base.internode_dispatch(x, **{k: v})
    for k, v in combine_kw.items():
        with pytest.raises(epx.InvalidArgument, match="internode_combine: .* one node"):
            base.internode_combine(x, handle, **{k: v})

    # ---- low-latency mode
    lb = deep_ep.Buffer(ctx.group, low_latency_mode=True, enable_shrink=True)
    linputs = _engine_inputs(seed + 1, R, E, K, lambda s: T)
    lmine = linputs[r]
    lx, lidx, lw = _fresh(lmine["x"], dev), _fresh(lmine["topk_idx"], dev), \
        _fresh(lmine["topk_weights"], dev)
    stats = torch.zeros(L, dtype=torch.int32, device=dev)
    # use_fp8=False last: its handle (the latest dispatch's) serves the combines below.
    dispatch_ll_kw = dict(cumulative_local_expert_recv_stats=stats,
                          dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64,
                                                                    device=dev),
                          round_scale=True, use_ue8m0=True, async_finish=True,
                          return_recv_hook=True, use_fp8=False)
    handle = None
    for k, v in dispatch_ll_kw.items():
        extra = {k: v}
        if k == "use_ue8m0":
            extra["round_scale"] = True  # DeepEP: UE8M0 only with round_scale
        use_fp8 = extra.get("use_fp8", True)
        res = call("low_latency_dispatch", k,
                   lambda: lb.low_latency_dispatch(lx, lidx, T_max, E, **extra))
        if res is None:
            continue
        if k == "return_recv_hook":
            assert callable(res[4])
            res[4]()
        else:
            assert res[4] is None, k
        if k == "async_finish":
            assert res[3].extra_tensors is not None, k
        ll._check_dispatch(ctx, linputs, res, E, T_max, use_fp8, extra.get("round_scale", False),
                           extra.get("use_ue8m0", False), f"seed={seed} {k}")
        if k == "cumulative_local_expert_recv_stats":
            assert torch.equal(stats.cpu(), res[1].cpu()), k
        if k == "dispatch_wait_recv_cost_stats":  # ns waited per source (semantics.md §2.5)
            assert (v.cpu() >= 0).all(), (k, v)
        if k == "use_fp8":
            handle = res[2]
    ys = [ll._y(seed, d, L, R, T_max) for d in range(R)]
    lwant = ref.ll_combine(linputs, ys, r, E, R)
    lwant_logfmt = ref.ll_combine(linputs, ys, r, E, R, use_logfmt=True)
    combine_ll_kw = dict(use_logfmt=True, zero_copy=True, async_finish=True,
                         return_recv_hook=True,
                         out=torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev),
                         combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64,
                                                                  device=dev))
    for k, v in combine_ll_kw.items():
        if k == "zero_copy":
            lb.get_next_low_latency_combine_buffer(handle=handle).copy_(ys[r].to(dev))
        x = _fresh(ys[r], dev)
        if k == "zero_copy":
            x = ll._unread(x)  # ignored: the rows were written into the buffer above
        res = call("low_latency_combine", k, lambda: lb.low_latency_combine(
            x=x, topk_idx=lidx, topk_weights=lw, handle=handle, **{k: v}))
        if res is None:
            continue
        combined, ev, hook = res
        if k == "return_recv_hook":
            hook()
        else:
            assert hook is None, k
        if k == "out":
            assert combined is v, k
        if k == "combine_wait_recv_cost_stats":
            assert (v.cpu() >= 0).all() and v[r].item() == 0, (k, v)  # nothing for its own rows
        if k == "async_finish":
            assert ev.extra_tensors is not None, k
        assert torch.equal(combined.cpu(), lwant_logfmt if k == "use_logfmt" else lwant), k
    lb.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank=T_max, hidden=H, num_experts=E)
    # The rank mask (enable_shrink), by keyword: this rank masks the next one, reads it back,
    # cleans it (no ll call in between, so nobody waits for anyone).
    peer = (r + 1) % R
    call("low_latency_update_mask_buffer", "mask",
         lambda: lb.low_latency_update_mask_buffer(rank_to_mask=peer, mask=peer != r))
    status = torch.full((R,), -1, dtype=torch.int, device=dev)
    call("low_latency_query_mask_buffer", "mask_status",
         lambda: lb.low_latency_query_mask_buffer(mask_status=status))
    assert status.tolist() == [int(p == peer and peer != r) for p in range(R)], status
    call("low_latency_clean_mask_buffer", "", lambda: lb.low_latency_clean_mask_buffer())
    lb.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * R, status
    # The raw buffers: views of num_nvl_bytes / num_rdma_bytes from a byte offset, persistent.
    raw = deep_ep.Buffer(ctx.group, num_nvl_bytes=64, num_rdma_bytes=32)
    t = call("get_local_buffer_tensor", "use_rdma_buffer",
             lambda: raw.get_local_buffer_tensor(dtype=torch.bfloat16, size=torch.Size([2, 2]),
                                                 offset=8, use_rdma_buffer=True))
    # Before any op the raw buffer is on the current GPU wherever CUDA is available (DeepEP's
    # Buffer is a CUDA object, whatever its group's backend), else on the CPU.
    before = "cuda" if torch.cuda.is_available() else "cpu"
    assert (t.shape, t.dtype, t.device.type) == ((2, 2), torch.bfloat16, before)
    t.fill_(1.5)
    again = raw.get_local_buffer_tensor(torch.bfloat16, offset=8, use_rdma_buffer=True)
    assert again.numel() == 12 and again[:4].tolist() == [1.5] * 4 and again[4:].eq(0).all()
    assert raw.get_local_buffer_tensor(torch.int32).numel() == 16
    with pytest.raises(epx.InvalidArgument, match="'size'"):
        raw.get_local_buffer_tensor(torch.bfloat16, size=torch.Size([13]), offset=8,
                                    use_rdma_buffer=True)
    with pytest.raises(epx.InvalidArgument, match="'offset'"):
        raw.get_local_buffer_tensor(torch.int32, offset=6)
    assert (lb.get_comm_stream() is None) == (dev.type == "cpu")

    # ---- static and Config / EventOverlap keywords
    try:
        deep_ep.Buffer.set_num_sms(new_num_sms=26)
        assert deep_ep.Buffer.get_dispatch_config(num_ranks=R).num_sms == 26
        assert deep_ep.Buffer.get_combine_config(num_ranks=R).num_sms == 26
    finally:
        _restore_num_sms()
    n = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=T_max, hidden=H, num_ranks=R, num_experts=E)
    assert n == deep_ep.Buffer.get_low_latency_rdma_size_hint(T_max, H, R, E) > 0
    c = deep_ep.Config(num_sms=24, num_max_nvl_chunked_send_tokens=8,
                       num_max_nvl_chunked_recv_tokens=288, num_max_rdma_chunked_send_tokens=12,
                       num_max_rdma_chunked_recv_tokens=128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == \
        (24, 8, 288, 12, 132)  # 128 rounded up to whole send chunks of 12, as DeepEP keeps it
    assert c.get_nvl_buffer_size_hint(H * 2, R) > 0 and c.get_rdma_buffer_size_hint(H * 2, R) == 0
    t = torch.ones(2)
    ev = deep_ep.EventOverlap(event=None, extra_tensors=(t,))
    assert ev.extra_tensors[0] is t
    ev.current_stream_wait()
    return sorted(set(unsupported))


# The options epx names as Unsupported (anything else must be honoured).
EXPECTED_UNSUPPORTED = []


class _GroupComm:
    """An mpi4py-like communicator (Get_rank, Get_size, allgather) over the test's group, for
    DeepEP's comm= path (group=None)."""

    def __init__(self, group):
        self.group = group

    def Get_rank(self):
        return dist.get_rank(self.group)

    def Get_size(self):
        return dist.get_world_size(self.group)

    def allgather(self, obj):
        out = [None] * self.Get_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out


def body_comm(ctx, seed):
    """Buffer(None, comm=<mpi4py-like communicator>): normal mode (growing T, the
    is_token_in_rank-only per-expert sums) and low-latency mode, exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, K, T_max = _num_experts(R), 4, 8
    L = E // R
    buf = deep_ep.Buffer(None, num_nvl_bytes=1024, low_latency_mode=True,
                         comm=_GroupComm(ctx.group))
    assert (buf.rank, buf.group_size) == (r, R)
    # The raw buffer before any op: on the device CUDA offers (no ProcessGroup to ask).
    raw = buf.get_local_buffer_tensor(torch.int32, offset=8)
    want_dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert raw.shape == (254,) and raw.device.type == want_dev and int(raw.abs().sum()) == 0
    for i in range(2):
        s = seed + i
        inputs = _engine_inputs(s, R, E, K, lambda src: 3 + 9 * i + 2 * src)
        mine = inputs[r]
        out = buf.dispatch(_fresh(mine["x"], dev), topk_idx=_fresh(mine["topk_idx"], dev),
                           topk_weights=_fresh(mine["topk_weights"], dev),
                           num_tokens_per_expert=torch.zeros(E, dtype=torch.int32, device=dev))
        ht._check_recv(ctx, inputs, out, E, 1, f"seed={s} comm")
        pe = torch.full((E,), r + 1, dtype=torch.int32, device=dev)
        in_rank = ref.ht_layout(mine["topk_idx"], E, R)[2]
        res = buf.dispatch(_fresh(mine["x"], dev), is_token_in_rank=_fresh(in_rank, dev),
                           num_tokens_per_expert=pe)
        assert res[3] == [R * (R + 1) // 2] * L, f"seed={s} comm per-expert sums"
        assert torch.equal(res[0].cpu(), ref.ht_dispatch(inputs, r, E, R)["recv_x"])
    linputs = _engine_inputs(seed + 9, R, E, K, lambda src: T_max - src % 3)
    res = buf.low_latency_dispatch(_fresh(linputs[r]["x"], dev),
                                   _fresh(linputs[r]["topk_idx"], dev), T_max, E, use_fp8=False)
    ll._check_dispatch(ctx, linputs, res, E, T_max, False, False, False, f"seed={seed} comm ll")


# ==== tests ======================================================================================

@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def cpool(request):
    """The conformance tier's CPU pools: R = 1, 2, 4, 8."""
    return get_pool(request.param)


@pytest.fixture(params=[1, 2, 4], ids=lambda r: f"R{r}")
def cpool124(request):
    return get_pool(request.param)


def test_intranode_replay(cpool):
    cpool.run(body_intranode, _seed())


def test_dispatch_by_is_token_in_rank(cpool):
    cpool.run(body_token_in_rank_only, _seed())


def test_low_latency_replay(cpool):
    cpool.run(body_low_latency, _seed())


def test_engine_auto_mode_switching(cpool):
    cpool.run(body_engine_auto, _seed())


def body_engine_auto_inference(ctx, seed):
    """The engine's alternation of prefill and decode under torch.inference_mode(), where SGLang
    runs its model (the drop-in's buffers created and their shapes agreed inside it)."""
    with torch.inference_mode():
        body_engine_auto(ctx, seed)


def test_engine_auto_mode_switching_inference_mode(cpool124):
    cpool124.run(body_engine_auto_inference, _seed())


def _run_tbo(pool, name, mutate):
    out = pool.run(body_engine_tbo, _seed(), name, mutate)
    if mutate == "drop":  # garbage took over some dropped input's memory (else: vacuous)
        assert sum(reused for reused, _ in out) > 0, out


@pytest.mark.parametrize("mutate", ["drop", "overwrite"])
@pytest.mark.parametrize("name", list(TBO_SEQUENCES))
def test_engine_two_batch_overlap(cpool124, name, mutate):
    _run_tbo(cpool124, name, mutate)


@pytest.mark.parametrize("mutate", ["drop", "overwrite"])
@pytest.mark.parametrize("name", ["dA_dB_hA_cA_hB_cB_chA_chB", "next_layer"])
def test_engine_two_batch_overlap_r8(name, mutate):
    """R = 8: the engine's order and the cross-layer one (the whole matrix at R <= 4)."""
    _run_tbo(get_pool(8), name, mutate)


def test_every_kwarg_honoured_or_unsupported(cpool):
    got = cpool.run(body_every_kwarg, _seed())
    assert got == [EXPECTED_UNSUPPORTED] * cpool.world_size


def test_comm_instead_of_group(cpool):
    cpool.run(body_comm, _seed())


# ---- GPU twins: the same bodies with CUDA tensors, one rank -------------------------------

GPU_BODIES = [(body_intranode, ()), (body_token_in_rank_only, ()), (body_low_latency, ()),
              (body_engine_auto, ()), (body_engine_auto_inference, ()), (body_every_kwarg, ()),
              (body_comm, ())] + \
    [(body_engine_tbo, (name, mutate)) for name in TBO_SEQUENCES
     for mutate in ("drop", "overwrite")]


@pytest.mark.gpu
@pytest.mark.parametrize("body,args", GPU_BODIES, ids=[
    b.__name__ + "".join(f"-{a}" for a in args) for b, args in GPU_BODIES])
def test_gpu_conformance(body, args):
    reason = gpu_skip_reason(1)
    if reason:
        pytest.skip(reason)
    out = get_pool(1, "nccl").run(body, _seed(), *args)
    if body is body_every_kwarg:
        assert out == [EXPECTED_UNSUPPORTED]
