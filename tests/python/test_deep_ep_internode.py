"""epx.compat.deep_ep across nodes (the cpu backend's hierarchical path, docs/design.md §13),
modelled on DeepEP's tests/test_internode.py: a group of R ranks as N nodes of G
(Buffer(..., ranks_per_node=G), every split of R = 2, 4, 8 with N > 1), the calls an internode
caller makes and what it reads back:

  * get_dispatch_layout: num_tokens_per_rdma_rank [N] (and the per-rank / per-expert / in-rank
    layout) against reference.py;
  * dispatch with num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
    num_tokens_per_expert and DeepEP's Config(num_sms, 8, 512, 16, 128), with and without top-k,
    bf16 (random and DeepEP's x = rank) and fp8 with column-major scales, async_finish: rows,
    top-k, weights, per-expert list (DeepEP's gbl_num_tokens_per_expert check), the internode
    10-tuple handle (recv_rdma_rank_prefix_sum, recv_gbl_rank_prefix_sum = handle[-4], source
    indices), DeepEP's check_data, num_worst_tokens, cached dispatch with the handle;
  * combine with (bias_0, bias_1) and topk_weights: bit for bit against reference.py's
    node-first order (docs/semantics.md §1.6) with values that make the order matter, plus
    DeepEP's own calc_diff tolerance; internode_dispatch / internode_combine the same;
  * low-latency mode across nodes (test_internode's --test-ll-compatibility) against the
    node-first ll order (§2.3);
  * the node-size rule (ranks_per_node, allow_mnnvl, LOCAL_WORLD_SIZE, min(8, R)) and its errors.
Every element is compared (fresh random inputs per call; the seed is in every message).
"""

import os
import random

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref
import test_deep_ep_ht as ht
import test_deep_ep_ll as ll
from conftest import get_pool

H, K = 256, 4
assert H == ht.H == ll.H


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _splits(R):
    """Ranks per node of every topology of R ranks with more than one node."""
    return [G for G in range(1, R) if R % G == 0]


def _inputs(seed, R, E, T_of, fmt, values):
    """Every rank's x (bf16 random or DeepEP's x = rank, or fp8 bits with f32 scales), topk_idx
    with no -1 slots (DeepEP's test routes every token to K experts), weights."""
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = T_of(s)
        inp = dict(topk_idx=ref.routing("uniform", T, K, E, R, g, drop=0.0),
                   topk_weights=ref.rand_weights(T, K, g))
        if fmt == "fp8":
            inp["x"] = ref.rand_fp8_bits((T, H), g)
            inp["scales"] = torch.rand(T, H // 128, generator=g) + 0.01
        elif values == "rank":
            inp["x"] = torch.full((T, H), float(s), dtype=torch.bfloat16)
        else:
            inp["x"] = ref.rand_bf16((T, H), g)
        out.append(inp)
    return out


def _per_node(in_rank, N, G):
    """DeepEP's num_tokens_per_rdma_rank: per node, the tokens that go to some rank of it."""
    return in_rank.view(-1, N, G).any(dim=2).sum(dim=0, dtype=torch.int32)


def _check_internode_handle(ctx, inputs, handle, E, G, what):
    R, r = ctx.world_size, ctx.rank
    N = R // G
    want = ref.ht_dispatch(inputs, r, E, R)
    assert isinstance(handle, tuple) and len(handle) == 10, what
    in_rank, rdma_ch, gbl_ch, recv_rdma_ch, rdma_prefix, recv_gbl_ch, gbl_prefix, src_meta, \
        send_rdma_head, send_nvl_head = handle
    assert torch.equal(in_rank.cpu(), ref.ht_layout(inputs[r]["topk_idx"], E, R)[2]), what
    assert (rdma_ch, gbl_ch, recv_rdma_ch, recv_gbl_ch, send_rdma_head, send_nvl_head) == \
        (None,) * 6, what
    # Tokens (m, g) sends to this rank's node, prefix over the source nodes m.
    node, local = r // G, r % G
    counts = [int(_per_node(ref.ht_layout(inputs[m * G + local]["topk_idx"], E, R)[2], N,
                            G)[node]) for m in range(N)]
    assert rdma_prefix.dtype == torch.int32 and rdma_prefix.cpu().tolist() == \
        torch.tensor(counts).cumsum(0).tolist(), (what, counts)
    assert gbl_prefix.dtype == torch.int32 and torch.equal(
        gbl_prefix.cpu(), ref.rank_prefix_matrix(inputs, E, R)[:, r]), what
    assert handle[-4] is gbl_prefix  # where DeepEP's test reads it
    assert torch.equal(src_meta.cpu(), want["recv_src_idx"]), what
    return gbl_prefix.cpu()


def _check_data(recv_x, gbl_prefix, what):
    """DeepEP's check_data for x = rank: the rows from source i lie between the prefixes."""
    start = 0
    for i, end in enumerate(gbl_prefix.tolist()):
        assert bool((recv_x[start:end].float() == i).all()), (what, i)
        start = end


def body_internode(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    changed = {G: False for G in _splits(R)}  # did the node-first order change a combine here
    for G in _splits(R):
        N = R // G
        buffer = deep_ep.Buffer(ctx.group, int(2e9), int(1e9), ranks_per_node=G,
                                explicitly_destroy=True)
        assert (buffer.ranks_per_node, buffer.num_nodes) == (G, N)
        config = deep_ep.Config(24, 8, 512, 16, 128)  # test_internode's shape of Config
        for i, (fmt, values) in enumerate((("bf16", "rand"), ("bf16", "rank"), ("fp8", "rand"))):
            s = seed + 101 * G + i
            what = f"seed={seed} G={G} {fmt} {values}"
            inputs = _inputs(s, R, E, lambda src: 9 + (3 * src + i) % 7, fmt, values)
            mine = inputs[r]
            idx, w = mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
            per_rank, per_expert, in_rank = ref.ht_layout(mine["topk_idx"], E, R)
            l_rank, l_node, l_expert, l_in_rank, _ = buffer.get_dispatch_layout(idx, E)
            assert torch.equal(l_rank.cpu(), per_rank) and torch.equal(l_expert.cpu(), per_expert)
            assert torch.equal(l_in_rank.cpu(), in_rank), what
            assert l_node.dtype == torch.int32 and torch.equal(l_node.cpu(),
                                                               _per_node(in_rank, N, G)), what
            gbl_per_expert = sum(ref.ht_layout(inp["topk_idx"], E, R)[1] for inp in inputs)
            want = ref.ht_dispatch(inputs, r, E, R)
            # Expert outputs of every rank with wide values (not the received copies of x,
            # whose sums hardly depend on the order): only the node-first order gives these bits.
            ys = [ref.rand_bf16_wide((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), H),
                                     ref.generator(s, d, "y")) for d in range(R)]
            for with_topk in (False, True):
                async_mode = with_topk != (i % 2 == 0)
                args = dict(x=ht._x_arg(mine, dev), num_tokens_per_rank=l_rank,
                            num_tokens_per_rdma_rank=l_node, is_token_in_rank=l_in_rank,
                            num_tokens_per_expert=l_expert, config=config,
                            async_finish=async_mode)
                if with_topk:
                    args.update(topk_idx=idx, topk_weights=w)
                recv_x, recv_idx, recv_w, lst, handle, event = buffer.dispatch(**args)
                if async_mode:
                    event.current_stream_wait()
                wt = f"{what} topk={with_topk}"
                if fmt == "fp8":
                    recv_x, recv_scales = recv_x
                    assert torch.equal(ht._bits(recv_x), want["recv_x"]), wt
                    assert torch.equal(recv_scales.cpu(), want["recv_scales"]), wt
                else:
                    assert torch.equal(recv_x.cpu(), want["recv_x"]), wt
                assert lst == gbl_per_expert[r * L:(r + 1) * L].tolist(), wt
                if with_topk:
                    assert torch.equal(recv_idx.cpu(), want["recv_topk_idx"]), wt
                    assert torch.equal(recv_w.cpu(), want["recv_topk_weights"]), wt
                else:
                    assert recv_idx is None and recv_w is None, wt
                gbl_prefix = _check_internode_handle(ctx, inputs, handle, E, G, wt)
                if values == "rank":
                    _check_data(recv_x.cpu(), gbl_prefix, wt)
                n = recv_x.shape[0]
                if with_topk:  # num_worst_tokens: no host sync, padded with -1
                    worst = dict(args, num_worst_tokens=R * 16)
                    wx, widx, ww, empty, _, ev = buffer.dispatch(**worst)
                    if async_mode:
                        ev.current_stream_wait()
                    wx = wx[0] if fmt == "fp8" else wx
                    assert empty == [] and wx.shape[0] == R * 16 == widx.shape[0], wt
                    assert torch.equal(ht._bits(wx[:n]), ht._bits(recv_x)), wt
                    assert torch.equal(widx[:n].cpu(), want["recv_topk_idx"]), wt
                    assert torch.equal(ww[:n].cpu(), want["recv_topk_weights"]), wt
                    assert bool((widx[n:] == -1).all()), wt
                else:  # cached dispatch, with the internode handle
                    cx = buffer.dispatch(x=ht._x_arg(mine, dev), handle=handle, config=config)[0]
                    cx = cx[0] if fmt == "fp8" else cx
                    assert torch.equal(ht._bits(cx), ht._bits(recv_x)), wt
                if fmt == "fp8":
                    continue
                # Combine: biases as DeepEP's test (ones, random).
                g = ref.generator(s, r, "bias", with_topk)
                T = mine["x"].shape[0]
                b0 = torch.ones(T, H, dtype=torch.bfloat16)
                b1 = ref.rand_bf16((T, H), g)
                cargs = dict(x=ys[r].to(dev), handle=handle, bias=(b0.to(dev), b1.to(dev)),
                             config=config, async_finish=async_mode)
                if with_topk:
                    cargs["topk_weights"] = recv_w
                combined, cw, ev = buffer.combine(**cargs)
                if async_mode:
                    ev.current_stream_wait()
                want_c = ref.ht_combine(inputs, ys, r, E, R, b0, b1, ranks_per_node=G)
                assert torch.equal(combined.cpu().view(torch.int16), want_c.view(torch.int16)), wt
                flat = ref.ht_combine(inputs, ys, r, E, R, b0, b1)
                changed[G] |= not torch.equal(want_c, flat)
                if with_topk:
                    assert torch.equal(cw.cpu(), mine["topk_weights"]), wt  # no -1 slots
                # internode_* are dispatch / combine of this group.
                if with_topk and i == 0:
                    again = buffer.internode_dispatch(**args)
                    assert torch.equal(again[0].cpu(), recv_x.cpu()), wt
                    assert again[4][-4].tolist() == handle[-4].tolist(), wt
                    c2 = buffer.internode_combine(**cargs)[0]
                    assert torch.equal(c2.cpu(), combined.cpu()), wt
            # DeepEP's tolerance check on top (random x, no biases): the sum of a token's copies
            # over the ranks it went to, divided by their number, is x.
            if values == "rand" and fmt == "bf16":
                recv_x, _, _, _, handle, _ = buffer.dispatch(
                    ht._x_arg(mine, dev), num_tokens_per_rank=l_rank,
                    num_tokens_per_rdma_rank=l_node, is_token_in_rank=l_in_rank,
                    num_tokens_per_expert=l_expert, config=config)
                combined = buffer.combine(recv_x, handle, config=config)[0].cpu()
                check_x = combined.float() / in_rank.sum(dim=1, keepdim=True)
                assert ht_calc_diff(check_x, mine["x"].float()) < 5e-6, what
        buffer.destroy()
    return changed


def ht_calc_diff(x, y):
    """DeepEP's similarity measure (1 - cosine-like similarity of x + 1 and y + 1)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def body_ll_internode(ctx, seed):
    """Low-latency mode across nodes: dispatch (bf16, fp8) as on one node, combine in the
    node-first order of docs/semantics.md §2.3 (wide values; random weights with bf16, unit
    weights with fp8), with and without the hook."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L = E // R
    T_max = 12
    changed = {G: False for G in _splits(R)}
    for G in _splits(R):
        buffer = deep_ep.Buffer(ctx.group, low_latency_mode=True, ranks_per_node=G)
        for i, use_fp8 in enumerate((False, True)):
            s = seed + 31 * G + i
            what = f"seed={seed} G={G} fp8={use_fp8}"
            inputs = ll._inputs(s, R, E, lambda src: 5 + (src + i) % (T_max - 4))
            if use_fp8:  # unit weights: expert rows of +-2^24 cancel, exposing the order
                for inp in inputs:
                    inp["topk_weights"] = torch.ones_like(inp["topk_weights"])
            mine = inputs[r]
            hooked = i % 2 == 1
            res = buffer.low_latency_dispatch(mine["x"].to(dev), mine["topk_idx"].to(dev),
                                              T_max, E, use_fp8=use_fp8,
                                              return_recv_hook=hooked)
            if hooked:
                res[4]()
            ll._check_dispatch(ctx, inputs, res, E, T_max, use_fp8, False, False, what)
            ys = [ref.rand_bf16_wide((L, R * T_max, H), ref.generator(s, d, "y"))
                  for d in range(R)]
            out, _, hook = buffer.low_latency_combine(ys[r].to(dev), mine["topk_idx"].to(dev),
                                                      mine["topk_weights"].to(dev), res[2],
                                                      return_recv_hook=hooked)
            if hooked:
                hook()
            want = ref.ll_combine(inputs, ys, r, E, R, ranks_per_node=G)
            ll._assert_combined(out.cpu(), want, mine["topk_idx"], L, what)
            changed[G] |= not torch.equal(want, ref.ll_combine(inputs, ys, r, E, R))
    return changed


def body_internode_errors(ctx, seed):
    """The node size and the internode arguments are checked, naming what is wrong."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    bad = next(d for d in range(2, R + 2) if R % d)
    with pytest.raises(epx.InvalidArgument, match=f"'ranks_per_node' is {bad}, expected a "
                       f"divisor of the group size {R}"):
        deep_ep.Buffer(ctx.group, ranks_per_node=bad)
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "0"
        with pytest.raises(epx.InvalidArgument, match="LOCAL_WORLD_SIZE is"):
            deep_ep.Buffer(ctx.group)
        assert deep_ep.Buffer(ctx.group, allow_mnnvl=True).num_nodes == 1  # one NVLink domain
        assert deep_ep.Buffer(ctx.group, ranks_per_node=1).num_nodes == R  # the keyword wins
        os.environ["LOCAL_WORLD_SIZE"] = str(max(R // 2, 1))
        buf = deep_ep.Buffer(ctx.group)
        assert (buf.ranks_per_node, buf.num_nodes) == (max(R // 2, 1), R // max(R // 2, 1))
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    inputs = _inputs(seed, R, E, lambda src: 6, "bf16", "rand")
    mine = inputs[r]
    buf = deep_ep.Buffer(ctx.group, ranks_per_node=1)  # R nodes of one rank
    idx = mine["topk_idx"].to(dev)
    l_rank, l_node, l_expert, l_in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert list(l_node.shape) == [R]
    with pytest.raises(epx.InvalidArgument, match=rf"'num_tokens_per_rdma_rank' has shape "
                       rf"\[{R + 1}\], expected \[{R}\]"):
        buf.dispatch(mine["x"].to(dev), num_tokens_per_rank=l_rank,
                     num_tokens_per_rdma_rank=torch.zeros(R + 1, dtype=torch.int32),
                     is_token_in_rank=l_in_rank, num_tokens_per_expert=l_expert, topk_idx=idx)
    # num_tokens_per_rdma_rank is optional: the routing decides.
    out = buf.dispatch(mine["x"].to(dev), num_tokens_per_expert=l_expert, topk_idx=idx)
    assert torch.equal(out[0].cpu(), ref.ht_dispatch(inputs, r, E, R)["recv_x"])
    assert len(out[4]) == 10


@pytest.fixture(params=[2, 4, 8], ids=lambda r: f"R{r}")
def npool(request):
    """A CPU rank pool of R = 2, 4 and 8 ranks: every one splits into nodes."""
    return get_pool(request.param)


def test_internode_normal(npool):
    seed = _seed()
    changed = npool.run(body_internode, seed)
    for G in changed[0]:  # the comparison can fail: the order changed some rank's result
        assert any(c[G] for c in changed), (G, seed)


def test_internode_low_latency(npool):
    seed = _seed()
    changed = npool.run(body_ll_internode, seed)
    for G in changed[0]:
        assert any(c[G] for c in changed), (G, seed)


def test_internode_errors(npool):
    npool.run(body_internode_errors, _seed())


@pytest.mark.parametrize("R,explicit,mnnvl,local,want", [
    (4, None, False, None, 4), (8, None, False, None, 8), (16, None, False, None, 8),
    (32, None, False, None, 8), (16, None, True, None, 16), (16, None, False, "4", 4),
    (4, None, False, "8", 4), (16, 2, False, "8", 2), (16, 2, True, None, 2),
    (6, None, False, "3", 3)])
def test_node_size_rule(R, explicit, mnnvl, local, want):
    environ = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    assert deep_ep._node_size("Buffer", R, explicit, mnnvl, environ) == want


@pytest.mark.parametrize("R,explicit,local,match", [
    (12, None, None, "not a whole number of nodes of 8"), (16, None, "3", "LOCAL_WORLD_SIZE is"),
    (16, None, "x", "LOCAL_WORLD_SIZE is 'x'"), (16, 3, None, "'ranks_per_node' is 3"),
    (16, 0, None, "'ranks_per_node' is 0, expected an int >= 1")])
def test_node_size_rule_errors(R, explicit, local, match):
    environ = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    with pytest.raises(epx.InvalidArgument, match=match):
        deep_ep._node_size("Buffer", R, explicit, False, environ)


def test_config_rdma_chunks_checked_as_deepep():
    c = deep_ep.Config(24, 8, 512, 16, 128)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (16, 128)
    # 20 rounds up to 24 (two chunks of 12), kept rounded as DeepEP keeps it
    assert deep_ep.Config(24, 8, 512, 12, 20).num_max_rdma_chunked_recv_tokens == 24
    with pytest.raises(epx.InvalidArgument, match="'num_max_rdma_chunked_send_tokens' is 16, "
                       "expected at most half of num_max_rdma_chunked_recv_tokens rounded up"):
        deep_ep.Config(24, 8, 512, 16, 16)
    with pytest.raises(epx.InvalidArgument, match="'num_max_nvl_chunked_send_tokens' is 512"):
        deep_ep.Config(24, 512, 512)
    with pytest.raises(epx.InvalidArgument, match="num_max_rdma_chunked_recv_tokens"):
        deep_ep.Config(24, 8, 512, 6, 0)


def body_gpu_across_nodes_unsupported(ctx, seed):
    """cuda: a group that spans nodes is refused at the first op with Unsupported naming the
    option (never a flat run)."""
    R, dev = ctx.world_size, ctx.device
    buf = deep_ep.Buffer(ctx.group, ranks_per_node=1)
    idx = ref.routing("uniform", 4, K, 4 * R, R, ref.generator(seed, ctx.rank)).to(dev)
    with pytest.raises(epx.Unsupported, match="ranks_per_node"):
        buf.get_dispatch_layout(idx, 4 * R)


@pytest.mark.gpu
def test_gpu_across_nodes_unsupported(gpu_pool):
    if gpu_pool.world_size == 1:
        pytest.skip("one rank is one node")
    gpu_pool.run(body_gpu_across_nodes_unsupported, _seed())
