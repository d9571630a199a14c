"""Multi-node NVLink options, acceptance only (docs/semantics.md §8.1; no such hardware here):
DeepEP's Buffer(allow_mnnvl=True, use_fabric=True) and FlashInfer's MnnvlConfig with every field
are accepted and kept, and change nothing: normal-mode and low-latency dispatch + combine, and
MoeAlltoAll dispatch + combine, give the reference's results bit for bit.

CPU tier: gloo rank pools (R = 1, 2, 4, 8), epx's cpu backend. The `gpu` cases run the same bodies
on NCCL pools, one GPU per rank."""

import random

import pytest
import torch

import epx.compat.deep_ep as deep_ep
import epx.compat.flashinfer as fi
import reference as ref
import test_deep_ep_ht as ht
import test_deep_ep_ll as ll
import test_flashinfer as fa2a


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def body_deep_ep_mnnvl(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    buf = deep_ep.Buffer(ctx.group, 1 << 20, 1 << 20, True, 24, True, True, True)  # positional
    assert (buf.allow_mnnvl, buf.use_fabric, buf.low_latency_mode) == (True, True, True)
    # Normal mode.
    E = 2 * R
    inputs = ht._inputs(seed, R, E, lambda src: 5 + 3 * src)
    mine = inputs[r]
    idx, w = mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    out = buf.dispatch(ht._x_arg(mine, dev), num_tokens_per_rank=per_rank,
                       is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=w)
    ht._check_recv(ctx, inputs, out, E, 1, f"seed={seed} normal")
    ys = [ref.rand_bf16((len(ref.ht_dispatch(inputs, d, E, R)["recv_src_idx"]), ht.H),
                        ref.generator(seed, d, "y")) for d in range(R)]
    combined, _, _ = buf.combine(ys[r].to(dev), out[4], topk_weights=out[2])
    assert torch.equal(combined.cpu(), ref.ht_combine(inputs, ys, r, E, R))
    # Low-latency mode.
    E, T_max = 4 * R, 8
    inputs = ll._inputs(seed, R, E, lambda src: 3 + src % (T_max - 2))
    mine = inputs[r]
    res = buf.low_latency_dispatch(mine["x"].to(dev), mine["topk_idx"].to(dev), T_max, E,
                                   use_fp8=False)
    ll._check_dispatch(ctx, inputs, res, E, T_max, False, False, False, f"seed={seed} ll")
    ys = [ll._y(seed, d, E // R, R, T_max) for d in range(R)]
    y, _, _ = buf.low_latency_combine(ys[r].to(dev), mine["topk_idx"].to(dev),
                                      mine["topk_weights"].to(dev), res[2])
    assert torch.equal(y.cpu(), ref.ll_combine(inputs, ys, r, E, R))


def body_flashinfer_mnnvl_config(ctx, seed):
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E, M, H, K = 2 * R, 6, fa2a.H, fa2a.K
    cfg = fi.MnnvlConfig(fi.TorchDistBackend(ctx.group), 1 << 21, 1 << 28)  # positional
    assert (cfg.allocation_granularity, cfg.fabric_page_size) == (1 << 21, 1 << 28)
    assert fi.is_mnnvl_fabric_supported(dev.index if dev.type == "cuda" else 0) is False
    moe = fi.MoeAlltoAll(fi.Mapping(world_size=R, rank=r, tp_size=R, moe_ep_size=R), M, K, E,
                         hidden_size=H, mnnvl_config=cfg, backend=fa2a._backend(ctx))
    inputs = fa2a._inputs(seed, R, E, lambda s: M - s % M)
    idx, payloads = fa2a._on(inputs[r], dev)
    recv = moe.dispatch(idx, payloads, M)
    fa2a._check_recv(ctx, inputs, recv, M, E, None, f"seed={seed}")
    ys = [ref.rand_bf16((R, M, H), ref.generator(seed, d, "y")) for d in range(R)]
    out = moe.combine(ys[r].to(dev), M)
    assert torch.equal(out.cpu(), ref.a2a_combine(inputs, ys, r, E, R))


@pytest.mark.parametrize("body", [body_deep_ep_mnnvl, body_flashinfer_mnnvl_config],
                         ids=lambda b: b.__name__[len("body_"):])
def test_mnnvl_options_accepted(pool, body):
    pool.run(body, _seed())


@pytest.mark.gpu
@pytest.mark.parametrize("body", [body_deep_ep_mnnvl, body_flashinfer_mnnvl_config],
                         ids=lambda b: b.__name__[len("body_"):])
def test_gpu_mnnvl_options_accepted(gpu_pool, body):
    gpu_pool.run(body, _seed())
