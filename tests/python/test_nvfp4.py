"""NVFP4 in the low-latency dispatch (docs/semantics.md §2.2) and the scale interleave (§8):
epx.Buffer.ll_dispatch(use_nvfp4=True), the DeepEP drop-in's low_latency_dispatch(use_nvfp4=True,
x_global_scale=...) and epx.nvfp4_block_scale_interleave, against reference.py.

Every rank regenerates every rank's inputs from the test's seed; every valid value byte and block
scale of the received rows is compared bit for bit, read through the views the call returns (the
layout DeepEP's NVFP4 forks return). The bodies are device-generic: test_gpu.py runs them on one
GPU per rank.
"""

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import epx.compat.flashinfer as fi
import reference as ref
from conftest import gpu_skip_reason
from test_deep_ep_ll import H, K, _inputs, _seed  # H = 256: 16 blocks, 4 scale words a row


def _check_nvfp4(ctx, inputs, recv_x, scales, count, E, T_max, g, what):
    """The views' shapes and strides (epx/ll.h), then every valid row through them."""
    R, r = ctx.world_size, ctx.rank
    L, RT = E // R, R * T_max
    assert recv_x.dtype == torch.uint8 and recv_x.shape == (RT, H // 2, L), what
    assert recv_x.stride() == (H // 2, 1, RT * H // 2), what
    rm = (RT + 127) // 128
    assert scales.dtype == epx.fp8_dtype and scales.shape == (32, 4, rm, 4, H // 64, L), what
    assert scales.stride() == (16, 4, H // 64 * 512, 1, 512, rm * H // 64 * 512), what
    want = ref.ll_dispatch(inputs, r, E, R, T_max, False, nvfp4_scale=g)
    assert count.cpu().tolist() == [c["count"] for c in want], what
    xs, ss = ref.nvfp4_ll_rows(recv_x, scales)
    for l, c in enumerate(want):
        n = c["count"]
        if n == 0:
            continue
        assert torch.equal(xs[l, :n], c["x"]), (what, l)
        assert torch.equal(ss[l, :n], c["scales"]), (what, l)
        # The scales are already interleaved: each expert's storage holds, at the valid rows'
        # positions, what nvfp4_block_scale_interleave makes of its [RT, H/16] scales.
        block = torch.zeros(RT, H // 16, dtype=torch.uint8)
        block[:n] = c["scales"]
        flat = epx.nvfp4_block_scale_interleave(block)
        storage = scales.cpu().view(torch.uint8).permute(5, 2, 4, 0, 1, 3).reshape(L, -1)[l]
        rows = torch.arange(n)
        pos = torch.stack([_sf_offset(rows, j, H // 16) for j in range(H // 16)], dim=1)
        assert torch.equal(storage[pos], flat[pos]), (what, l)


def _sf_offset(r, c, cols):
    """docs/semantics.md §8: where scale (r, c) lands (cols padded to a multiple of 4)."""
    c4 = (cols + 3) // 4 * 4
    return (r // 128) * 128 * c4 + (c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def body_native_nvfp4(ctx, seed):
    """epx.Buffer.ll_dispatch(use_nvfp4=True): g as a Python float, a 0-dim tensor and a [3]
    tensor (element 0 read); hooks; rows per expert across a 128-row tile; every routing; then
    the combine of those handles is exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, T_max = 2 * R, 70  # R * 70 rows per expert: a partial second tile from R = 2 on
    L = E // R
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T_max,
                     enable_ht=False, enable_ll=True)
    gs = [448.0 * 6.0 / 12.0, torch.tensor(1.5), torch.tensor([5000.0, -1.0, 0.0]), 1e-3]
    for i, kind in enumerate(ref.ROUTINGS):
        g = gs[i % len(gs)]
        gv = float(g.flatten()[0]) if isinstance(g, torch.Tensor) else g
        what = f"seed={seed} case={i} kind={kind} g={gv}"
        inputs = _inputs(seed + i, R, E, lambda s: T_max if (i + s) % 3 == 0 else 9 + 7 * s, kind)
        x, idx = inputs[r]["x"].to(dev), inputs[r]["topk_idx"].to(dev)
        hook = i % 2 == 1
        res = buf.ll_dispatch(x, idx, use_fp8=False, use_nvfp4=True, return_recv_hook=hook,
                              x_global_scale=g.to(dev) if isinstance(g, torch.Tensor) else g)
        if hook:
            res.hook()
        _check_nvfp4(ctx, inputs, res.recv_x, res.recv_scales, res.recv_count, E, T_max, gv,
                     what)
        ys = [ref.rand_bf16((L, R * T_max, H), ref.generator(seed + i, d, "y")) for d in range(R)]
        out = buf.ll_combine(ys[r].to(dev), idx, inputs[r]["topk_weights"].to(dev), res.handle)
        assert torch.equal(out.out.cpu(), ref.ll_combine(inputs, ys, r, E, R)), what
    with pytest.raises(epx.InvalidArgument, match="'x_global_scale' is a str"):
        buf.ll_dispatch(x, idx, use_fp8=False, use_nvfp4=True, x_global_scale="1.0")
    with pytest.raises(epx.InvalidArgument, match="'global_scale' is -1"):
        buf.ll_dispatch(x, idx, use_fp8=False, use_nvfp4=True, x_global_scale=-1.0)


def body_deep_ep_nvfp4(ctx, seed):
    """The DeepEP drop-in as sglang drives its NVFP4 forks: low_latency_dispatch(use_fp8=False,
    use_nvfp4=True, x_global_scale=<0-dim float32 tensor>) -> ((recv_x, recv_scales), count,
    handle, event, hook) in the forks' layout; async_finish and hooks; x_global_scale passed with
    fp8 and bf16 too (accepted, unused); the combine of an NVFP4 handle is exact."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, T_max = 4 * R, 24
    L = E // R
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    for i, kind in enumerate(("uniform", "duplicates", "empty_rank", "skewed")):
        what = f"seed={seed} case={i} kind={kind}"
        inputs = _inputs(seed + i, R, E, lambda s: T_max - 3 * s if s < 8 else 0, kind)
        x, idx = inputs[r]["x"].to(dev), inputs[r]["topk_idx"].to(dev)
        x_max = max(float(inp["x"].float().abs().max()) for inp in inputs if inp["x"].numel())
        g = torch.tensor(448.0 * 6.0 / x_max, dtype=torch.float32, device=dev)  # as the forks' test
        hook = i % 2 == 1
        packed, count, handle, event, hook_fn = buf.low_latency_dispatch(
            x, idx, T_max, E, use_fp8=False, use_nvfp4=True, x_global_scale=g,
            async_finish=not hook, return_recv_hook=hook)
        if hook:
            hook_fn()
        else:
            event.current_stream_wait()
        recv_x, scales = packed
        _check_nvfp4(ctx, inputs, recv_x, scales, count, E, T_max, float(g), what)
        ys = [ref.rand_bf16((L, R * T_max, H), ref.generator(seed + i, d, "y")) for d in range(R)]
        out, _, _ = buf.low_latency_combine(ys[r].to(dev), idx,
                                            inputs[r]["topk_weights"].to(dev), handle)
        assert torch.equal(out.cpu(), ref.ll_combine(inputs, ys, r, E, R)), what
    # x_global_scale with fp8 and bf16: not read (the forks' test passes it on every call).
    inputs = _inputs(seed, R, E, lambda s: 5)
    x, idx = inputs[r]["x"].to(dev), inputs[r]["topk_idx"].to(dev)
    for use_fp8 in (True, False):
        res = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=use_fp8,
                                       x_global_scale=torch.ones((), device=dev))
        want = ref.ll_dispatch(inputs, r, E, R, T_max, use_fp8)
        assert res[1].cpu().tolist() == [c["count"] for c in want]
        recv = res[0][0] if use_fp8 else res[0]
        for l, c in enumerate(want):
            if c["count"]:
                got = recv[l, :c["count"]].cpu()
                assert torch.equal(got.view(torch.uint8) if use_fp8 else got, c["x"]), l


@pytest.mark.parametrize("body", [body_native_nvfp4, body_deep_ep_nvfp4],
                         ids=lambda b: b.__name__)
def test_ll_nvfp4(pool, body):
    pool.run(body, _seed())


# ---- epx.nvfp4_block_scale_interleave (local) ------------------------------------------------

def test_interleave_layout_and_the_flashinfer_compat_function():
    g = torch.Generator().manual_seed(_seed())
    for shape in [(130, 5), (2, 129, 7), (1, 4), (256, 448)]:
        sf = torch.randint(1, 256, shape, generator=g, dtype=torch.uint8)
        out = epx.nvfp4_block_scale_interleave(sf)
        B = shape[0] if len(shape) == 3 else 1
        rows, cols = shape[-2], shape[-1]
        per = (rows + 127) // 128 * 128 * ((cols + 3) // 4 * 4)
        assert out.shape == (B * per,) and out.dtype == torch.uint8
        src = sf.reshape(B, rows, cols)
        r = torch.arange(rows)[:, None].expand(rows, cols)
        c = torch.arange(cols)[None, :].expand(rows, cols)
        for b in range(B):
            assert torch.equal(out[b * per + _sf_offset(r, c, cols)], src[b])
        assert int((out != 0).sum()) == B * rows * cols  # the padding is 0
        assert torch.equal(fi.nvfp4_block_scale_interleave(sf), out)


@pytest.mark.gpu
def test_gpu_interleave_matches_cpu_and_captures():
    """CUDA tensors: one kernel on the current stream; equal to the CPU result for u8, int8,
    e4m3, bf16 and strided inputs; capturable in a CUDA graph and replayed on new scales."""
    reason = gpu_skip_reason(1)
    if reason:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(_seed())
    dtypes = [torch.uint8, torch.int8, torch.bfloat16] + ([epx.fp8_dtype] if epx.has_fp8_dtype
                                                           else [])
    for shape in [(130, 5), (3, 257, 9), (1024, 448)]:
        for dtype in dtypes:
            bits = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            one_byte = torch.empty((), dtype=dtype).element_size() == 1
            sf = bits.view(dtype) if one_byte else torch.randn(shape, generator=g).to(dtype)
            want = epx.nvfp4_block_scale_interleave(sf)
            got = epx.nvfp4_block_scale_interleave(sf.cuda())
            assert got.is_cuda and got.dtype == dtype
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (shape, dtype)
            wide = torch.cat([sf, sf], dim=-1)[..., ::2]  # strided
            # Bits, not values: random bytes viewed as float8_e4m3fn include NaN (0x7F, 0xFF).
            assert torch.equal(
                epx.nvfp4_block_scale_interleave(wide.cuda()).cpu().view(torch.uint8),
                epx.nvfp4_block_scale_interleave(wide.contiguous()).view(torch.uint8)), (shape,
                                                                                         dtype)
    src = torch.zeros(300, 12, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        epx.nvfp4_block_scale_interleave(src)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = epx.nvfp4_block_scale_interleave(src)
    for _ in range(3):
        new = torch.randint(0, 256, (300, 12), generator=g, dtype=torch.uint8)
        src.copy_(new)
        out.fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), epx.nvfp4_block_scale_interleave(new))
