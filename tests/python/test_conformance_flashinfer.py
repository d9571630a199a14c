"""epx.compat.flashinfer against FlashInfer's API as engines call it (SGLang's and vLLM's
FlashInfer all-to-all dispatchers): DP attention with a different token count on every rank (an
idle rank, with or without the engine's dummy token), runtime_max_tokens_per_rank from an
all-gather of those counts, payloads [hidden, (NVFP4 scales,) expert ids, weights], the expert ids
sanitised or not, the MoE output written into get_combine_payload_tensor_in_workspace
(payload_in_workspace) or passed in, combine(output=...), the scales swizzled with
nvfp4_block_scale_interleave; EPLB stats; every option FlashInfer accepts (honoured, or
epx.Unsupported naming it); the NVFP4 scale layout against a hand-derived index mapping.

CPU tier: gloo rank pools (R = 1, 2, 4, 8), epx's cpu backend. The `gpu` cases run the same bodies
on NCCL pools, one GPU per rank."""

import dataclasses
import inspect
import random

import pytest
import torch

import epx
import epx.compat.flashinfer as fi
import reference as ref

H = 64          # hidden; NVFP4 scale columns = H / 16 = 4
K = 3           # top-k
L = 4           # local experts per rank
MAX_TOKENS = 12


#: FlashInfer's quantised combines (output dtype, scale dtype, block): MXFP8, MXFP4, NVFP4
#: (e4m3 as this torch holds it: uint8 on torch 1.13).
_E4M3 = getattr(torch, "float8_e4m3fn", torch.uint8)
QUANTISED_COMBINES = ((_E4M3, torch.uint8, 32), (torch.uint8, torch.uint8, 32),
                      (torch.uint8, _E4M3, 16))
#: Their Unsupported names the option and why: FlashInfer runs them on SM >= 100 only.
QUANTISED_COMBINE_REASON = (r"output_scales: FlashInfer's quantised combine .* compute "
                            r"capability >= 10\.0: its binding \(csrc/trtllm_moe_alltoall\.cu\) "
                            r"rejects SM < 100")


def _seed():
    return random.SystemRandom().randrange(1 << 30)


class EngineComm:
    """An engine's bootstrap communicator over a ProcessGroup (SGLang's and vLLM's have these
    methods); not a subclass of epx's CommBackend."""

    def __init__(self, group):
        import torch.distributed as dist
        self._dist, self._group = dist, group

    def Get_rank(self):
        return self._dist.get_rank(self._group)

    def Get_size(self):
        return self._dist.get_world_size(self._group)

    def allgather(self, data):
        out = [None] * self.Get_size()
        self._dist.all_gather_object(out, data, group=self._group)
        return out

    def Split(self, color, key):
        return self

    def barrier(self):
        self._dist.barrier(group=self._group)


def _backend_kw(ctx):
    # An engine passes no backend: epx picks cuda where it is built with CUDA and torch sees a
    # GPU. The gloo pools on such a host need the cpu backend named.
    if ctx.device.type == "cpu" and epx.built_with_cuda and torch.cuda.is_available():
        return {"backend": "cpu"}
    return {}


def _sf_offset(r, c, cols):
    """Hand-derived position of scale (r, c) in the 128x4-tiled layout: tiles of 128 rows x 4
    columns (512 bytes), row tiles outermost, column tiles next; inside a tile row r sits in
    line r % 32 (16 bytes a line) at slot (r % 128) // 32 (4 bytes a slot), column c at byte
    c % 4 of that slot. Works on ints and on integer tensors."""
    cols_p = (cols + 3) // 4 * 4
    return (r // 128) * (128 * cols_p) + (c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + \
        c % 4


def _hidden_f32(x):
    """The hidden states as f32: bf16 rows as they are; NVFP4-packed rows (uint8 [n, H/2], two
    codes a byte) as their 4-bit codes, low nibbles then high nibbles, / 4 (a stand-in for the
    NVFP4 GEMM's dequantisation: the same bytes give the same values)."""
    if x.dtype == torch.uint8:
        xi = x.to(torch.int64)
        return torch.cat([xi & 15, xi >> 4], dim=1).to(torch.float32) * 0.25
    return x.to(torch.float32)


def _moe(x, ids, w, rank, E, R):
    """The MoE layer of rank `rank` on received rows: per row the f32 sum, in k order, of
    w[k] * x * (1 + local expert) over the top-k ids that live here, rounded once to bf16.
    Row-wise and elementwise, so the same rows give the same bits whatever else is around."""
    Lr = E // R
    xf = _hidden_f32(x)
    acc = torch.zeros(xf.shape[0], xf.shape[1], dtype=torch.float32)
    for k in range(ids.shape[1]):
        e = ids[:, k].to(torch.int64)
        local = ((e >= rank * Lr) & (e < (rank + 1) * Lr)).to(torch.float32)
        scale = (w[:, k].to(torch.float32) * (e - rank * Lr + 1).to(torch.float32)) * local
        acc = acc + xf * scale[:, None]
    return acc.to(torch.bfloat16)


# The engine call sequences: (NVFP4 hidden states + scales payloads, sanitise, dummy token on an
# idle rank, payload_in_workspace, output=).
VARIANTS = {
    "sglang_bf16_in_workspace_dummy": (False, False, True, True, False),
    "vllm_nvfp4_sanitised_output": (True, True, False, False, True),
    "idle_rank_sanitised_copied": (False, True, False, False, False),
    "nvfp4_in_workspace_output": (True, False, False, True, True),
}


def _step_inputs(seed, step, R, E, nvfp4, dummy):
    """Every rank's routing (what dispatch routes by) and payloads, and each rank's T. Rank R - 1
    is idle (T = 0) when R > 1; with `dummy` it sends SGLang's dummy token instead: routed to its
    own first expert, payload ids -1 and weights 0."""
    kind = ref.ROUTINGS[step % len(ref.ROUTINGS)]
    inputs, counts = [], []
    for s in range(R):
        g = ref.generator(seed, step, s)
        T = 0 if (R > 1 and s == R - 1) else int(torch.randint(1, MAX_TOKENS + 1, (1,),
                                                                generator=g))
        counts.append(T)
        ids = ref.routing(kind, T, K, E, R, g).to(torch.int32)
        x = torch.randint(0, 256, (T, H // 2), generator=g, dtype=torch.uint8) if nvfp4 else \
            ref.rand_bf16((T, H), g)
        w = ref.rand_weights(T, K, g)
        route = ids
        if dummy and T == 0:
            x = torch.zeros(1, x.shape[1], dtype=x.dtype)
            ids = torch.full((1, K), -1, dtype=torch.int32)
            w = torch.zeros(1, K, dtype=torch.float32)
            route = torch.full((1, K), s * (E // R), dtype=torch.int32)
        payloads = [x]
        if nvfp4:
            payloads.append(torch.randint(0, 256, (x.shape[0], H // 16), generator=g,
                                          dtype=torch.uint8))
        payloads += [ids, w]
        inputs.append(dict(topk_idx=route, payloads=payloads))
    return inputs, counts


class FlashInferMapping:
    """What a real FlashInfer's Mapping offers epx's MoeAlltoAll (the shim leaves FlashInfer's own
    Mapping in place): not epx's class."""

    def __init__(self, rank, moe_ep_size):
        self.rank, self.moe_ep_size, self.moe_ep_rank = rank, moe_ep_size, rank

    def is_multi_node(self):
        return False


@dataclasses.dataclass
class FlashInferMnnvlConfig:
    """FlashInfer's MnnvlConfig dataclass (its fields), not epx's class."""
    comm_backend: object = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


def body_engine_sequence(ctx, seed, variant, steps=3, comm_class=EngineComm,
                         flashinfer_own=False):
    """`flashinfer_own`: the Mapping and MnnvlConfig are FlashInfer's own classes' stand-ins (a
    real FlashInfer beside the shim), not epx's."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = L * R
    nvfp4, sanitise, dummy, in_ws, use_output = VARIANTS[variant]
    comm = comm_class(ctx.group)
    dispatch_bytes = (H // 2 + H // 16 if nvfp4 else H * 2) + K * 4 + K * 4  # as the engines
    ws = fi.moe_a2a_get_workspace_size_per_rank(
        ep_size=R, max_num_tokens=MAX_TOKENS,
        total_dispatch_payload_size_per_token=dispatch_bytes,
        combine_payload_size_per_token=H * 2)
    if flashinfer_own:
        mapping, config = FlashInferMapping(r, R), FlashInferMnnvlConfig(comm_backend=comm)
    else:
        mapping = fi.Mapping(rank=r, tp_size=R, moe_ep_size=R, world_size=R, gpus_per_node=8,
                             pp_size=1, cp_size=1)
        config = fi.MnnvlConfig(comm_backend=comm)
    moe = fi.MoeAlltoAll(mapping=mapping, max_num_tokens=MAX_TOKENS, top_k=K, num_experts=E,
                         workspace_size_per_rank=ws, mnnvl_config=config, **_backend_kw(ctx))
    idx_payload = 2 if nvfp4 else 1
    checked = 0
    for step in range(steps):
        what = f"seed={seed} variant={variant} step={step}"
        inputs, counts = _step_inputs(seed, step, R, E, nvfp4, dummy)
        mine = inputs[r]
        # DP attention: the largest token count of the step, as the engine gathers it.
        sizes = comm.allgather(int(mine["topk_idx"].shape[0]))
        assert sizes == [int(i["topk_idx"].shape[0]) for i in inputs], what
        M = max(sizes)
        kw = {"expert_id_payload_index": idx_payload}  # SGLang passes it even unsanitised
        if sanitise:
            kw["invalid_token_expert_id"] = E if step % 2 else -1
        recv = moe.dispatch(mine["topk_idx"].to(dev), [p.to(dev) for p in mine["payloads"]], M,
                            **kw)
        want, ref_counts = ref.a2a_dispatch(inputs, r, E, R)
        assert len(recv) == len(mine["payloads"]), what
        for i, view in enumerate(recv):
            assert list(view.shape) == [R, M] + list(mine["payloads"][i].shape[1:]), (what, i)
            for s in range(R):
                n = ref_counts[s]
                assert torch.equal(view[s, :n].cpu(), want[s][i]), (what, i, s)
                if sanitise and i == idx_payload:
                    assert bool((view[s, n:] == kw["invalid_token_expert_id"]).all()), (what, s)
        if nvfp4:  # the engine swizzles the received scales for its NVFP4 GEMM
            flat = recv[1].reshape(-1, H // 16)
            sw = fi.nvfp4_block_scale_interleave(flat).cpu()
            assert sw.shape == ((R * M + 127) // 128 * 128 * 4,) and sw.dtype == torch.uint8
            for s in range(R):
                rows = torch.arange(ref_counts[s]) + s * M
                for c in range(H // 16):
                    got = sw[_sf_offset(rows, c, H // 16)]
                    assert torch.equal(got, want[s][1][:, c]), (what, s, c)
        # The MoE layer on the received rows (padding rows too: combine never reads them).
        x = recv[0].reshape(R * M, -1).cpu()
        y = _moe(x, recv[idx_payload].reshape(-1, K).cpu(),
                 recv[idx_payload + 1].reshape(-1, K).cpu(), r, E, R).to(dev)
        if in_ws:
            moe_output = moe.get_combine_payload_tensor_in_workspace(M, H, torch.bfloat16)
            moe_output = moe_output.view(-1, H)  # what the engine hands its fused MoE
            moe_output.copy_(y)
            payload = moe_output.view(R, M, H)
        else:
            payload = y.view(R, M, H)
        T = mine["topk_idx"].shape[0]
        out_kw = {}
        if use_output:
            out_kw["output"] = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
        out = moe.combine(payload, M, payload_in_workspace=in_ws, **out_kw)
        if use_output:
            assert out is out_kw["output"], what
        ys = []
        for d in range(R):
            rows_d, counts_d = ref.a2a_dispatch(inputs, d, E, R)
            y_d = torch.zeros(R, M, H, dtype=torch.bfloat16)
            for s in range(R):
                n = counts_d[s]
                p = rows_d[s]
                y_d[s, :n] = _moe(p[0], p[idx_payload], p[idx_payload + 1], d, E, R)
            ys.append(y_d)
        want_out = ref.a2a_combine(inputs, ys, r, E, R)
        assert out.dtype == torch.bfloat16 and list(out.shape) == [T, H], what
        assert torch.equal(out.cpu(), want_out), what
        if dummy and counts[r] == 0:
            assert not bool(out.cpu().any()), what  # the dummy token's row, then dropped
        checked += 1
    return checked  # the steps whose every check ran


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_sequence(pool, variant):
    assert pool.run(body_engine_sequence, _seed(), variant) == [3] * pool.world_size


def test_engine_sequence_flashinfer_objects(pool):
    """A real FlashInfer's own Mapping and MnnvlConfig (the shim keeps them) drive epx's
    MoeAlltoAll."""
    variant = next(iter(VARIANTS))
    assert pool.run(body_engine_sequence, _seed(), variant, 3, EngineComm, True) == \
        [3] * pool.world_size


def body_eplb(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = L * R
    n = E - 1
    moe = fi.MoeAlltoAll(fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R), 8, K, E,
                         hidden_size=H, eplb_stats_num_experts=n,
                         mnnvl_config=fi.MnnvlConfig(comm_backend=EngineComm(ctx.group)),
                         **_backend_kw(ctx))
    assert moe.enable_eplb and moe.eplb_stats_num_experts == n and moe.eplb_gathered_stats is None
    for step in range(2):
        stats = [torch.randint(0, 1000, (n,), generator=ref.generator(seed, step, s),
                               dtype=torch.int32) for s in range(R)]
        g = ref.generator(seed, step, "in", r)
        idx = ref.routing("uniform", 5, K, E, R, g).to(torch.int32).to(dev)
        moe.dispatch(idx, [ref.rand_bf16((5, H), g).to(dev)], 5,
                     eplb_local_stats=stats[r].to(dev))
        got = moe.eplb_gathered_stats
        assert got.dtype == torch.int32 and got.device.type == dev.type
        assert torch.equal(got.cpu(), torch.stack(stats)), (seed, step)
        moe.combine(torch.zeros(R, 5, H, dtype=torch.bfloat16, device=dev), 5)
        assert moe.eplb_gathered_stats is None
    idx = torch.zeros(1, K, dtype=torch.int32, device=dev)
    with pytest.raises(epx.InvalidArgument, match="eplb_local_stats"):
        moe.dispatch(idx, [torch.zeros(1, H, device=dev)], 1,
                     eplb_local_stats=torch.zeros(n + 1, dtype=torch.int32, device=dev))
    plain = fi.MoeAlltoAll(fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R), 8, K, E,
                           hidden_size=H, **_backend_kw(ctx))
    with pytest.raises(epx.InvalidArgument, match="eplb_stats_num_experts=0"):
        plain.dispatch(idx, [torch.zeros(1, H, device=dev)], 1,
                       eplb_local_stats=torch.zeros(n, dtype=torch.int32, device=dev))


def test_eplb_stats(pool):
    pool.run(body_eplb, _seed())


def body_options(ctx, seed):
    """combine's options, enable_rank_mask without a mask or with one leaving out this rank, on
    fresh random inputs (use_low_precision: test_flashinfer_functional.py; workspace, metainfo,
    get_workspace, checkpointing: test_flashinfer_workspace.py)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = L * R
    mapping = fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R)
    moe = fi.MoeAlltoAll(mapping, 8, K, E, hidden_size=H, **_backend_kw(ctx))
    T = 6
    inputs = []
    for s in range(R):
        gs = ref.generator(seed, "in", s)
        inputs.append(dict(topk_idx=ref.routing("skewed", T, K, E, R, gs).to(torch.int32),
                           payloads=[ref.rand_bf16((T, H), gs)]))
    idx = inputs[r]["topk_idx"].to(dev)
    x = inputs[r]["payloads"][0].to(dev)
    ys = [ref.rand_bf16((R, T, H), ref.generator(seed, "y", d)) for d in range(R)]
    want = ref.a2a_combine(inputs, ys, r, E, R)
    y = ys[r].to(dev)

    with pytest.raises(epx.InvalidArgument, match="invalid_token_expert_id"):
        moe.dispatch(idx, [x], T, invalid_token_expert_id=-1)  # without expert_id_payload_index
    for call in range(3):
        moe.dispatch(idx, [x], T)
        for out_dtype, sf_dtype, block in QUANTISED_COMBINES:  # refused before any collective
            scales = torch.zeros(T * H // block, dtype=sf_dtype, device=dev)
            for layout in (None, 0, 1, 2):  # FlashInfer's SfLayout: 128x4, 8x4, linear
                with pytest.raises(epx.Unsupported, match=QUANTISED_COMBINE_REASON):
                    moe.combine(y, T, output_dtype=out_dtype, output_scales=scales,
                                output_scalar_scale=2.0, sf_layout=layout)
        with pytest.raises(epx.InvalidArgument, match="output_dtype"):
            moe.combine(y, T, output_dtype=torch.float32)
        with pytest.raises(epx.InvalidArgument, match="'output'"):
            moe.combine(y, T, output=torch.empty(T + 1, H, dtype=torch.bfloat16, device=dev))
        with pytest.raises(epx.InvalidArgument, match="'output'"):
            moe.combine(y, T, output=torch.empty(T, H, dtype=torch.float32, device=dev))
        with pytest.raises(epx.InvalidArgument, match="'output'"):
            moe.combine(y, T, output=torch.empty(H, T, dtype=torch.bfloat16, device=dev).t())
        if call == 0:  # every keyword, positionally where FlashInfer allows it
            buf = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
            out = moe.combine(y, T, False, torch.bfloat16, None, 0.5, "layout_128x4", buf,
                              use_low_precision=False, active_rank_mask=None)
            assert out is buf
        elif call == 1:
            out = moe.combine(y, T, output_dtype=torch.bfloat16, output_scalar_scale=2.0)
        else:
            view = moe.get_combine_payload_tensor_in_workspace(T, H, torch.bfloat16)
            view.copy_(y)
            buf = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
            out = moe.combine(view, T, payload_in_workspace=True, output=buf)
            assert out is buf
        assert torch.equal(out.cpu(), want), (seed, call)

    assert (moe.ep_rank, moe.ep_size, moe.top_k, moe.num_experts, moe.max_num_tokens) == \
        (r, R, K, E, 8)
    assert moe.enable_rank_mask is False and moe.eplb_gathered_stats is None

    masked = fi.MoeAlltoAll(mapping, 8, K, E, hidden_size=H, enable_rank_mask=True,
                            **_backend_kw(ctx))
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=True"):
        masked.dispatch(idx, [x], T)  # as FlashInfer: a mask on every call
    if R > 1:
        with pytest.raises(epx.InvalidArgument, match="leaves out this rank"):
            masked.dispatch(idx, [x], T, active_rank_mask=fi.moe_a2a_active_rank_mask(
                [q for q in range(R) if q != r], R))
    everyone = fi.moe_a2a_active_rank_mask(torch.arange(R), R)
    masked.dispatch(idx, [x], T, None, None, None, everyone)  # FlashInfer's positional order
    with pytest.raises(epx.InvalidArgument, match="enable_rank_mask=True"):
        masked.combine(y, T)
    out = masked.combine(y, T, active_rank_mask=everyone)
    assert torch.equal(out.cpu(), want)


def test_options(pool):
    pool.run(body_options, _seed())


# ---- local (no communication) ----------------------------------------------------------------

def test_nvfp4_block_scale_interleave_worked_example():
    """rows = 130, cols = 5 -> padded to 256 x 8 (two row tiles, two column tiles)."""
    g = torch.Generator().manual_seed(_seed())
    sf = torch.randint(1, 256, (130, 5), generator=g, dtype=torch.uint8)
    out = fi.nvfp4_block_scale_interleave(sf)
    assert out.shape == (256 * 8,) and out.dtype == torch.uint8
    cases = {(0, 0): 0, (0, 3): 3, (1, 0): 16, (31, 2): 31 * 16 + 2, (32, 0): 4, (64, 1): 9,
             (96, 3): 15, (127, 3): 511, (0, 4): 512, (5, 4): 512 + 80,
             (128, 0): 128 * 8, (129, 4): 1024 + 512 + 16}
    for (rr, cc), pos in cases.items():
        assert pos == _sf_offset(rr, cc, 5)
        assert int(out[pos]) == int(sf[rr, cc]), (rr, cc, pos)
    # Everything else is padding: the 650 scales are the only non-zeros.
    assert int((out != 0).sum()) == 130 * 5
    assert int(out[_sf_offset(0, 5, 5)]) == 0 and int(out[_sf_offset(130, 0, 5)]) == 0


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (129, 3), (300, 10), (2, 127, 6),
                                   (3, 33, 1), (4, 0, 4)])
def test_nvfp4_block_scale_interleave_mapping(shape):
    g = torch.Generator().manual_seed(_seed())
    sf = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    out = fi.nvfp4_block_scale_interleave(sf)
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2], shape[-1]
    rows_p, cols_p = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    want = torch.zeros(batch * rows_p * cols_p, dtype=torch.uint8)
    src = sf.reshape(batch, rows, cols)
    for b in range(batch):
        for rr in range(rows):
            for cc in range(cols):
                want[b * rows_p * cols_p + _sf_offset(rr, cc, cols)] = src[b, rr, cc]
    assert torch.equal(out, want)


def test_nvfp4_block_scale_interleave_dtypes():
    g = torch.Generator().manual_seed(_seed())
    bits = torch.randint(0, 256, (2, 70, 9), generator=g, dtype=torch.uint8)
    base = fi.nvfp4_block_scale_interleave(bits)
    assert torch.equal(fi.nvfp4_block_scale_interleave(bits.view(torch.int8)).view(torch.uint8),
                       base)
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:
        out = fi.nvfp4_block_scale_interleave(bits.view(f8))
        assert out.dtype == f8 and torch.equal(out.view(torch.uint8), base)
    # Non-contiguous input: the same as its contiguous copy.
    wide = torch.randint(0, 256, (70, 18), generator=g, dtype=torch.uint8)
    assert torch.equal(fi.nvfp4_block_scale_interleave(wide[:, ::2]),
                       fi.nvfp4_block_scale_interleave(wide[:, ::2].contiguous()))
    bf = torch.randn(130, 6, generator=g).to(torch.bfloat16)
    out = fi.nvfp4_block_scale_interleave(bf)
    assert out.dtype == torch.bfloat16 and out.shape == (256 * 8,)
    assert torch.equal(out[_sf_offset(129, 5, 6)], bf[129, 5])
    bad_inputs = (torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4),
                  torch.zeros(4, 4, 4, 4, dtype=torch.uint8))
    for bad in bad_inputs:
        with pytest.raises(epx.InvalidArgument, match="unswizzled_sf"):
            fi.nvfp4_block_scale_interleave(bad)


def test_wrap_payload_tensor_in_workspace():
    g = torch.Generator().manual_seed(_seed())
    R, S = 3, 1024
    ws = torch.randint(0, 256, (R, S), generator=g, dtype=torch.uint8)
    start = S + 128  # row 1, byte 128
    view = fi.moe_a2a_wrap_payload_tensor_in_workspace(ws, [2, 4], start, start + 2 * 4 * 8 * 4,
                                                       torch.float32)
    assert view.shape == (2, 4, 8) and view.dtype == torch.float32
    assert torch.equal(view.reshape(-1).view(torch.uint8), ws[1, 128:128 + 256])
    view.fill_(1.5)  # a view: writes land in the workspace
    assert bool((ws[1, 128:384].view(torch.float32) == 1.5).all())
    flat = fi.moe_a2a_wrap_payload_tensor_in_workspace(ws[2], [4], 0, 64, torch.int32)
    assert flat.shape == (4, 4) and torch.equal(flat.reshape(-1).view(torch.uint8), ws[2, :64])
    with pytest.raises(epx.InvalidArgument, match="inside one row"):
        fi.moe_a2a_wrap_payload_tensor_in_workspace(ws, [1], S - 8, S + 8, torch.uint8)


# FlashInfer's parameter lists (flashinfer/comm/trtllm_moe_alltoall.py, mapping.py, mnnvl.py), in
# order; "*" marks a keyword-only one.
FLASHINFER_SIGNATURES = {
    "MoeAlltoAll.__init__": "mapping max_num_tokens top_k num_experts workspace_size_per_rank "
                            "hidden_size mnnvl_config eplb_stats_num_experts enable_rank_mask",
    "MoeAlltoAll.dispatch": "token_selected_experts input_payloads runtime_max_tokens_per_rank "
                            "invalid_token_expert_id expert_id_payload_index eplb_local_stats "
                            "active_rank_mask enable_pdl",
    "MoeAlltoAll.combine": "payload runtime_max_tokens_per_rank payload_in_workspace output_dtype "
                           "output_scales output_scalar_scale sf_layout output "
                           "*use_low_precision *active_rank_mask *enable_pdl",
    "MoeAlltoAll.get_combine_payload_tensor_in_workspace": "runtime_max_tokens_per_rank "
                                                           "hidden_size dtype",
    "MoeAlltoAll.get_moe_workspace_size_per_rank": "ep_size top_k max_num_tokens hidden_size "
                                                   "extra_payload_bytes_per_token "
                                                   "eplb_stats_num_experts *backend",
    "MoeAlltoAll.get_workspace": "workspace_size_per_rank ep_rank ep_size max_num_tokens mapping "
                                 "eplb_stats_num_experts",
    "MoeAlltoAll.checkpoint_prepare": "",
    "MoeAlltoAll.checkpoint_restore": "comm_backend",
    "moe_a2a_initialize": "workspace ep_rank ep_size max_num_tokens eplb_stats_num_experts "
                          "*backend",
    "moe_a2a_dispatch": "token_selected_experts input_payloads workspace metainfo "
                        "runtime_max_tokens_per_rank ep_rank ep_size top_k num_experts enable_pdl "
                        "eplb_local_stats enable_rank_mask active_rank_mask *backend "
                        "*recv_view_cache",
    "moe_a2a_combine": "payload local_num_tokens workspace metainfo runtime_max_tokens_per_rank "
                       "ep_rank ep_size top_k combine_payload_offset payload_in_workspace "
                       "output_dtype output_scales output_scalar_scale sf_layout output "
                       "*use_low_precision *enable_pdl *enable_rank_mask *active_rank_mask "
                       "*backend",
    "moe_a2a_sanitize_expert_ids": "expert_ids workspace metainfo ep_rank invalid_expert_id "
                                   "enable_pdl *backend",
    "moe_a2a_wrap_payload_tensor_in_workspace": "workspace leading_shape slice_start slice_end "
                                                "dtype",
    "moe_a2a_get_workspace_size_per_rank": "ep_size max_num_tokens "
                                           "total_dispatch_payload_size_per_token "
                                           "combine_payload_size_per_token "
                                           "eplb_stats_num_experts *backend",
    "moe_a2a_active_rank_mask": "active_ranks ep_size",
    "Mapping.__init__": "world_size rank gpus_per_node *cp_size *cp_config *tp_size *pp_size "
                        "*moe_cluster_size *moe_tp_size *moe_ep_size *attn_tp_size *attn_cp_size "
                        "*auto_parallel *enable_attention_dp",
    "MnnvlConfig.__init__": "comm_backend allocation_granularity fabric_page_size",
    "is_mnnvl_fabric_supported": "device_idx",
}


@pytest.mark.parametrize("name", list(FLASHINFER_SIGNATURES))
def test_signature_accepts_every_flashinfer_argument(name):
    """Same names in the same order; FlashInfer's positional parameters are positional here too
    (epx-only extras, e.g. MoeAlltoAll's backend=, come after them, keyword-only)."""
    obj = fi
    for part in name.split("."):
        obj = getattr(obj, part)
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    want = FLASHINFER_SIGNATURES[name].split()
    assert [p.name for p in params[:len(want)]] == [w.lstrip("*") for w in want], name
    for p, w in zip(params, want):
        if not w.startswith("*"):
            assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, (name, p.name)
    for p in params[len(want):]:
        assert p.kind == inspect.Parameter.KEYWORD_ONLY, (name, p.name)


def test_mapping_and_config_keywords():
    m = fi.Mapping(world_size=4, rank=3, tp_size=4, moe_ep_size=4, attn_tp_size=4,
                   cp_config={"cp_type": "ulysses"})
    assert (m.moe_ep_rank, m.attn_tp_size, m.attn_cp_size, m.cp_config) == \
        (3, 4, 1, {"cp_type": "ulysses"})
    m = fi.Mapping(world_size=4, rank=2, auto_parallel=True)
    assert (m.tp_rank, m.pp_rank, m.cp_rank, m.moe_ep_rank, m.auto_parallel) == (0, 0, 0, 0, True)
    with pytest.raises(epx.InvalidArgument, match="attn_cp_size"):
        fi.Mapping(world_size=4, rank=0, tp_size=4, attn_cp_size=2)
    with pytest.raises(epx.InvalidArgument, match="auto_parallel"):
        fi.Mapping(world_size=4, rank=0, tp_size=4, auto_parallel=True)
    cfg = fi.MnnvlConfig(None, 1 << 21)  # FlashInfer's positional order
    assert (cfg.allocation_granularity, cfg.fabric_page_size) == (1 << 21, 1 << 29)
    assert fi.is_mnnvl_fabric_supported(0) is False
    assert fi.is_mnnvl_fabric_supported(torch.device("cpu")) is False


def test_static_workspace_size():
    ep, k, t, h, extra = 4, 8, 256, 7168, 7168 // 16
    n = fi.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, k, t, h, extra)
    assert n == fi.moe_a2a_get_workspace_size_per_rank(ep, t, h * 2 + k * 8 + extra, h * 2)
    backend = "cuda" if epx.built_with_cuda and torch.cuda.is_available() else "cpu"
    assert n >= epx.A2a.workspace_bytes(t, k, 256, [h * 2, k * 4, k * 4, extra], h * 2, ep,
                                        backend)
    assert fi.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, k, 2 * t, h) > \
        fi.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, k, t, h)
    assert fi.moe_a2a_get_workspace_size_per_rank(ep, t, 100, 200, eplb_stats_num_experts=256) \
        == fi.moe_a2a_get_workspace_size_per_rank(ep, t, 100, 200)
    # The newest FlashInfer's backend= on the static sizing too: its default kernel choice.
    assert fi.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, k, t, h, extra,
                                                          backend="trtllm") == n
    with pytest.raises(epx.Unsupported, match="cake"):
        fi.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, k, t, h, backend="cake")


# ---- GPU tier --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_engine_sequence(gpu_pool, variant):
    assert gpu_pool.run(body_engine_sequence, _seed(), variant) == [3] * gpu_pool.world_size


@pytest.mark.gpu
def test_gpu_options_and_eplb(gpu_pool):
    gpu_pool.run(body_options, _seed())
    gpu_pool.run(body_eplb, _seed())


@pytest.mark.gpu
def test_gpu_nvfp4_block_scale_interleave():
    g = torch.Generator().manual_seed(_seed())
    sf = torch.randint(0, 256, (2, 200, 13), generator=g, dtype=torch.uint8)
    out = fi.nvfp4_block_scale_interleave(sf.cuda())
    assert out.is_cuda and torch.equal(out.cpu(), fi.nvfp4_block_scale_interleave(sf))


def body_engine_sequence_inference(ctx, seed, variant):
    """The engine's sequence, MoeAlltoAll's construction included, under torch.inference_mode()
    (as engines serve), over FlashInfer's TorchDistBackend: its exchanges write tensors from
    gloo's worker thread, where inference tensors may not be updated."""
    with torch.inference_mode():
        return body_engine_sequence(ctx, seed, variant, comm_class=fi.TorchDistBackend)


@pytest.mark.parametrize("variant", ["sglang_bf16_in_workspace_dummy",
                                     "vllm_nvfp4_sanitised_output"])
def test_engine_sequence_inference_mode(pool, variant):
    assert pool.run(body_engine_sequence_inference, _seed(), variant) == [3] * pool.world_size
