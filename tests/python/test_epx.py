"""The epx package itself: exception mapping, groups over torch.distributed, the native Buffer and
A2a classes with torch tensors, the GIL being released while a rank waits, views keeping their
buffer alive, bounded waits (a rank left alone raises Timeout instead of hanging)."""

import random
import threading
import time

import pytest
import torch

import epx
from epx import _epx
import reference as ref


def _seed():
    return random.SystemRandom().randrange(1 << 30)


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,cls,base", [
    (0, epx.InvalidArgument, ValueError), (1, epx.Unsupported, NotImplementedError),
    (2, epx.OutOfCapacity, epx.EpxError), (3, epx.Timeout, TimeoutError),
    (4, epx.CudaError, epx.EpxError), (5, epx.NcclError, epx.EpxError),
    (6, epx.InternalError, epx.EpxError)])
def test_error_mapping(code, cls, base):
    msg = f"op: argument 'thing' is {code}, expected something else"
    with pytest.raises(cls) as info:
        _epx._raise(code, msg)
    assert isinstance(info.value, base) and isinstance(info.value, epx.EpxError)
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == f"epx {cls.code}: {msg}"  # the C++ message, unchanged


def test_unsupported_cuda_without_cuda_build():
    if epx.built_with_cuda:
        pytest.skip("epx was built with CUDA")
    with pytest.raises(epx.Unsupported, match="without CUDA"):
        epx.Group.cuda_from_comm(0x1234, 0)
    with pytest.raises(epx.Unsupported, match="without CUDA"):
        _epx.new_unique_id()


# ---- groups, native Buffer / A2a ----------------------------------------------------------------

def body_group(ctx, seed):
    g = epx.Group.from_process_group(ctx.group, timeout=5)
    assert (g.rank, g.size, g.backend) == (ctx.rank, ctx.world_size, "cpu")
    assert g.timeout == 5.0
    g.barrier()
    assert "epx.Group(rank=" in repr(g)
    g2 = epx.Group.from_process_group()  # default group, default timeout
    assert g2.size == ctx.world_size and g2.timeout > 0
    if not epx.built_with_cuda:
        with pytest.raises(epx.Unsupported, match="without CUDA"):
            epx.Group.from_process_group(ctx.group, device="cuda:0")
    with pytest.raises(epx.InvalidArgument, match="timeout"):
        epx.Group.from_process_group(ctx.group, timeout=0)


def body_native_ll(ctx, seed):
    """epx.Buffer (ll) with torch tensors: outputs are torch tensors from torch's allocator; the
    column-major scales are a strided view of their allocation; the zero-copy view outlives the
    Python Buffer object; bytes_needed / bytes_allocated; the handle's src_info."""
    R, r = ctx.world_size, ctx.rank
    H, K, E, T_max = 256, 2, 2 * R, 8
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T_max,
                     enable_ht=False, enable_ll=True)
    assert buf.bytes_allocated >= epx.Buffer.bytes_needed("ll", H, K, E, T_max, R, "cpu") > 0
    g = ref.generator(seed, r)
    x = ref.rand_bf16((5, H), g)
    idx = ref.routing("uniform", 5, K, E, R, g)
    res = buf.ll_dispatch(x, idx, use_fp8=True)
    assert isinstance(res, epx.LlDispatchResult) and isinstance(res.handle, epx.LlHandle)
    assert type(res.recv_x) is torch.Tensor and res.recv_x.dtype == epx.fp8_dtype
    s = res.recv_scales
    assert s.stride() == (s.shape[1] * s.shape[2], 1, s.shape[1]) and not s.is_contiguous()
    assert res.handle.max_tokens == T_max and res.handle.num_tokens == 5
    # src_info: per local expert, its rows' source token indices (all sources' tokens < 5).
    info, counts = res.handle.src_info, res.recv_count.tolist()
    assert info.dtype == torch.int32 and list(info.shape) == [E // R, R * T_max]
    for l, n in enumerate(counts):
        assert bool(((info[l, :n] >= 0) & (info[l, :n] < 5)).all()), (l, info[l, :n])
    view = buf.ll_next_combine_buffer(res.handle)
    handle = res.handle
    del buf, res
    view.fill_(1.0)  # the view keeps the symmetric memory alive
    assert float(view.float().sum()) == view.numel()
    del view, handle


def body_native_ht_zero_copy(ctx, seed):
    """epx.Buffer.ht_dispatch(zero_copy=True): the same rows as without it (exact and cached);
    on cuda recv_x is a view of the buffer's memory that combine refuses as y (cpu: an ordinary
    tensor, accepted). Device-generic: the GPU tier runs it too."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    H, K, E, T = 256, 2, 2 * R, 12
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T)
    g = ref.generator(seed, r)
    x = ref.rand_bf16((T, H), g).to(dev)
    idx = ref.routing("skewed", T, K, E, R, g).to(dev)
    want = buf.ht_dispatch(x, idx)
    want_x = want.recv_x.clone()
    got = buf.ht_dispatch(x, idx, zero_copy=True)
    assert torch.equal(got.recv_x, want_x)
    assert torch.equal(got.recv_src_idx, want.recv_src_idx)
    x2 = ref.rand_bf16((T, H), g).to(dev)
    want2 = buf.ht_dispatch(x2, handle=got.handle).recv_x.clone()
    got2 = buf.ht_dispatch(x2, handle=got.handle, zero_copy=True)
    assert torch.equal(got2.recv_x, want2)
    y = got2.recv_x.clone()
    if group.backend == "cuda":
        with pytest.raises(epx.InvalidArgument, match="'y'"):
            buf.ht_combine(got2.recv_x, got.handle)
    out = buf.ht_combine(y, got.handle).out
    assert torch.equal(out, buf.ht_combine(want2, want.handle).out)
    # Zero-copy combine: y written into the combine buffer (the same memory as the bf16
    # zero-copy recv_x view on cuda: in place).
    view = buf.ht_combine_buffer(got.handle)
    assert view.shape == y.shape and view.dtype == torch.bfloat16
    view.copy_(y)
    assert torch.equal(buf.ht_combine(view, got.handle, zero_copy=True).out, out)
    # Any other y is refused before communicating (on every rank: each has rows here; an empty y
    # is accepted, there is nothing to read).
    if int(got.handle.rank_prefix_matrix[-1].min()) > 0:
        with pytest.raises(epx.InvalidArgument, match="ht_combine_buffer"):
            buf.ht_combine(y, got.handle, zero_copy=True)


def body_native_a2a(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    E, K, H, M = R, 1, 32, 4
    group = epx.Group.from_process_group(ctx.group)
    a2a = epx.A2a(group, max_tokens_per_rank=M, top_k=K, num_experts=E,
                  payload_bytes_per_token=[H * 4], combine_bytes_per_token=H * 2)
    assert a2a.bytes_allocated >= epx.A2a.workspace_bytes(M, K, E, [H * 4], H * 2, R)
    inputs = []
    for s in range(R):
        g = ref.generator(seed, s)
        idx = ref.routing("uniform", 3, K, E, R, g, drop=0.0).to(torch.int32)
        inputs.append(dict(topk_idx=idx, payloads=[torch.randn(3, H, generator=g)]))
    res = a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
    want, counts = ref.a2a_dispatch(inputs, r, E, R)
    assert res.recv_counts.tolist() == counts
    for s in range(R):
        assert torch.equal(res.recv[0][s, :counts[s]], want[s][0])
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, d, "y")) for d in range(R)]
    view = a2a.combine_payload_view(M, H, torch.bfloat16)
    view.copy_(ys[r])
    out = a2a.combine(view, M, payload_in_workspace=True)
    assert torch.equal(out, ref.a2a_combine(inputs, ys, r, E, R))
    with pytest.raises(epx.InvalidArgument, match="dtype"):
        a2a.combine_payload_view(M, H, torch.int8)
    # float16 y through the binding, copied and in the workspace (K = 1: each token's row comes
    # back as it is; sums: test_flashinfer.body_a2a_f16_combine).
    for in_ws in (False, True):
        a2a.dispatch(inputs[r]["topk_idx"], inputs[r]["payloads"], M)
        ys = [(ref.rand_bf16((R, M, H), ref.generator(seed, d, "f16")) * 1e4).to(torch.float16)
              for d in range(R)]
        y = ys[r]
        if in_ws:
            y = a2a.combine_payload_view(M, H, torch.float16)
            y.copy_(ys[r])
        out = a2a.combine(y, M, payload_in_workspace=in_ws)
        assert out.dtype == torch.float16
        assert torch.equal(out, ref.a2a_combine(inputs, ys, r, E, R)), in_ws


def body_group_nodes(ctx, seed):
    """Group(ranks_per_node=): the topology (docs/design.md §13) is validated, resolved and
    honoured: ht and ll across R nodes of one rank return what one node returns (values whose
    float32 sums are exact in any order, so the node-first combine order cannot show; the ll
    combine with use_logfmt too, whose groups stay raw at these values)."""
    R, r = ctx.world_size, ctx.rank
    for per_node in [d for d in range(1, R + 1) if R % d == 0] + [0]:
        g = epx.Group.from_process_group(ctx.group, ranks_per_node=per_node)
        assert g.ranks_per_node == (per_node or R) and g.num_nodes == R // (per_node or R)
    for bad, match in [(True, "ranks_per_node"), (-1, "ranks_per_node"), (R + 1, "divisor")]:
        with pytest.raises(epx.InvalidArgument, match=match):
            epx.Group.from_process_group(ctx.group, ranks_per_node=bad)
    H, K, E, T = 256, 2, 2 * R, 6
    gen = ref.generator(seed, r)
    x = torch.randint(-4, 5, (T, H), generator=gen).to(torch.bfloat16)
    idx = ref.routing("uniform", T, K, E, R, gen)
    w = torch.ones(T, K)
    outs = []
    for per_node in (0, 1):
        group = epx.Group.from_process_group(ctx.group, ranks_per_node=per_node)
        buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T,
                         enable_ht=True, enable_ll=True)
        assert buf.bytes_allocated == sum(
            epx.Buffer.bytes_needed(m, H, K, E, T, R, "cpu", per_node) for m in ("ht", "ll"))
        d = buf.ht_dispatch(x, idx)
        c = buf.ht_combine(d.recv_x, d.handle)
        ld = buf.ll_dispatch(x, idx, use_fp8=False)
        lc = buf.ll_combine(ld.recv_x, idx, w, ld.handle)
        lf = buf.ll_combine(ld.recv_x, idx, w, ld.handle, use_logfmt=True)
        assert torch.equal(lf.out, lc.out)
        outs.append([d.recv_x, d.recv_src_idx, c.out, ld.recv_count, lc.out, lf.out])
    for one, across in zip(*outs):
        assert torch.equal(one, across)


def body_nodes_vs_flat(ctx, seed):
    """ht and ll with fresh random inputs (T differing per rank, -1 slots, fp8 ll) on every
    topology of R ranks (`ranks_per_node` = each divisor of R, and 0 = one node): every dispatch
    output equals the one-node output bit for bit (ht: rows, top-k, weights, source indices,
    per-expert counts, the handle's rank_prefix_matrix / is_token_in_rank / send_pos; ll: rows,
    scales, counts, src_info, layout_range); every combine equals reference.py's with that
    topology bit for bit (the node-first order of docs/semantics.md §1.6 / §2.3, with biases
    and wide-range values). Returns {ranks_per_node: (ht, ll) whether the node-first order
    changed some element of this rank's reference}, so the test can require that the comparison
    could fail."""
    R, r = ctx.world_size, ctx.rank
    H, K, E, T = 256, 4, 4 * R, 10
    L = E // R
    inputs = []
    for s in range(R):
        g = ref.generator(seed, s)
        n = T - s % 3
        # Unit weights: the ll combine's +-2^24 rows cancel, which exposes its order (random
        # weights: the one-node suites).
        inputs.append(dict(x=ref.rand_bf16((n, H), g),
                           topk_idx=ref.routing("uniform", n, K, E, R, g),
                           topk_weights=torch.ones(n, K)))
    mine = inputs[r]
    n_recv = [len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]) for d in range(R)]
    ys = [ref.rand_bf16_wide((n_recv[d], H), ref.generator(seed, d, "y")) for d in range(R)]
    lys = [ref.rand_bf16_wide((L, R * T, H), ref.generator(seed, d, "ly")) for d in range(R)]
    g = ref.generator(seed, r, "bias")
    b0, b1 = ref.rand_bf16_wide(mine["x"].shape, g), ref.rand_bf16_wide(mine["x"].shape, g)
    flat_ht = ref.ht_combine(inputs, ys, r, E, R, b0, b1)
    flat_ll = ref.ll_combine(inputs, lys, r, E, R)
    outs, changed = {}, {}
    for per_node in [0] + [d for d in range(1, R) if R % d == 0]:
        group = epx.Group.from_process_group(ctx.group, ranks_per_node=per_node)
        buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T,
                         enable_ht=True, enable_ll=True)
        d = buf.ht_dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"])
        h = d.handle
        c = buf.ht_combine(ys[r].clone(), h, bias0=b0, bias1=b1)
        want_ht = ref.ht_combine(inputs, ys, r, E, R, b0, b1, ranks_per_node=per_node)
        assert torch.equal(c.out.view(torch.int16), want_ht.view(torch.int16)), per_node
        ld = buf.ll_dispatch(mine["x"], mine["topk_idx"], use_fp8=True)
        lc = buf.ll_combine(lys[r].clone(), mine["topk_idx"], mine["topk_weights"], ld.handle)
        want_ll = ref.ll_combine(inputs, lys, r, E, R, ranks_per_node=per_node)
        assert torch.equal(lc.out.view(torch.int16), want_ll.view(torch.int16)), per_node
        outs[per_node] = [d.recv_x, d.recv_topk_idx, d.recv_topk_weights, d.recv_src_idx,
                          torch.tensor(d.num_recv_tokens_per_expert), h.rank_prefix_matrix,
                          h.is_token_in_rank, h.send_pos, ld.recv_count, ld.handle.layout_range]
        for l, n in enumerate(ld.recv_count.tolist()):  # the rows past the count are undefined
            outs[per_node] += [ld.recv_x[l, :n].view(torch.uint8),
                               ld.recv_scales[l, :n].contiguous().view(torch.int32),
                               ld.handle.src_info[l, :n]]
        changed[per_node] = (not torch.equal(want_ht, flat_ht), not torch.equal(want_ll, flat_ll))
    for per_node, out in outs.items():
        for i, (one, across) in enumerate(zip(outs[0], out)):
            assert torch.equal(one, across), (per_node, i)
    return changed


def body_gil_released(ctx, seed):
    """While rank 0 waits in a collective for a late rank 1, another Python thread of rank 0 keeps
    running (the op does not hold the GIL)."""
    R, r = ctx.world_size, ctx.rank
    H, K, E = 128, 1, R
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=4,
                     enable_ht=False, enable_ll=True)
    x = torch.zeros(2, H, dtype=torch.bfloat16)
    idx = torch.zeros(2, K, dtype=torch.int64)
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    if r == 1:
        time.sleep(0.5)
        buf.ll_dispatch(x, idx, use_fp8=False)
        return None
    t = threading.Thread(target=spin)
    t.start()
    try:
        res = buf.ll_dispatch(x, idx, use_fp8=False)
    finally:
        stop.set()
        t.join()
    assert ticks[0] > 50, f"the other thread ran only {ticks[0]} times during a 0.5 s wait"
    # Results released from another thread: their storage deleters take the GIL themselves.
    holder = [res]
    del res
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()


def body_timeout(ctx, seed):
    """Rank 0 never joins the collective: every other rank raises Timeout naming it, within the
    group's timeout, instead of hanging."""
    R, r = ctx.world_size, ctx.rank
    group = epx.Group.from_process_group(ctx.group, timeout=1.0)
    buf = epx.Buffer(group, hidden=128, top_k=1, num_experts=R, max_tokens_per_rank=4,
                     enable_ht=False, enable_ll=True)
    if r == 0:
        return None
    start = time.monotonic()
    with pytest.raises(epx.Timeout) as info:
        buf.ll_dispatch(torch.zeros(1, 128, dtype=torch.bfloat16),
                        torch.zeros(1, 1, dtype=torch.int64), use_fp8=False)
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 5.0, elapsed
    assert "[0]" in str(info.value) and "1000 ms" in str(info.value), str(info.value)
    assert isinstance(info.value, TimeoutError)


def body_shrink(ctx, seed):
    """The same dead rank 0 with enable_shrink=True: the others' dispatch and combine complete
    after about the group's timeout (no Timeout), without rank 0's tokens and experts, and
    ll_query_mask shows it masked; ll_update_mask / ll_clean_mask and their errors."""
    R, r = ctx.world_size, ctx.rank
    group = epx.Group.from_process_group(ctx.group, timeout=1.0)
    plain = epx.Buffer(group, hidden=128, top_k=1, num_experts=R, max_tokens_per_rank=4,
                       enable_ht=False, enable_ll=True)
    with pytest.raises(epx.InvalidArgument, match="enable_shrink = false"):
        plain.ll_update_mask((r + 1) % R, True)
    buf = epx.Buffer(group, hidden=128, top_k=1, num_experts=R, max_tokens_per_rank=4,
                     enable_ht=False, enable_ll=True, enable_shrink=True)
    status = torch.full((R,), -1, dtype=torch.int32)
    with pytest.raises(epx.InvalidArgument, match="cannot mask itself"):
        buf.ll_update_mask(r, True)
    with pytest.raises(epx.InvalidArgument, match="'mask_status'"):
        buf.ll_query_mask(torch.zeros(R, dtype=torch.int64))
    buf.ll_update_mask((r + 1) % R, True)
    buf.ll_query_mask(status)
    assert status.tolist() == [int(p == (r + 1) % R) for p in range(R)]
    buf.ll_clean_mask()
    buf.ll_query_mask(status)
    assert status.tolist() == [0] * R
    if r == 0:
        return None
    x = torch.ones(2, 128, dtype=torch.bfloat16) * r
    idx = torch.tensor([[0], [r]], dtype=torch.int64)  # rank 0's expert, and this rank's own
    start = time.monotonic()
    res = buf.ll_dispatch(x, idx, use_fp8=False)
    combined = buf.ll_combine(res.recv_x, idx, torch.ones(2, 1), res.handle).out
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 5.0, elapsed
    buf.ll_query_mask(status)
    assert status.tolist() == [1] + [0] * (R - 1)
    assert res.recv_count.tolist() == [1]  # its own token 1 (the others' go to rank 0)
    assert combined[0].float().abs().sum() == 0  # rank 0's expert: left out (+0)
    assert torch.equal(combined[1], x[1])


def test_group_from_process_group(pool):
    pool.run(body_group, _seed())


def test_native_ll_buffer(pool):
    pool.run(body_native_ll, _seed())


def test_native_ht_zero_copy(pool):
    pool.run(body_native_ht_zero_copy, _seed())


def test_native_a2a(pool):
    pool.run(body_native_a2a, _seed())


def test_group_nodes(pool):
    pool.run(body_group_nodes, _seed())


def test_nodes_vs_flat(pool):
    seed = _seed()
    changed = pool.run(body_nodes_vs_flat, seed)
    for per_node in changed[0]:
        if per_node:  # across nodes: the order must matter somewhere, in ht and in ll
            assert all(any(c[per_node][m] for c in changed) for m in (0, 1)), (per_node, seed)


def test_gil_released_while_waiting(pool2):
    pool2.run(body_gil_released, _seed())


def test_timeout_instead_of_hang(pool2):
    pool2.run(body_timeout, _seed())


def test_shrink_masks_instead_of_timeout(pool):
    if pool.world_size == 1:
        pytest.skip("a rank mask needs a peer to mask (R >= 2)")
    pool.run(body_shrink, _seed())
