"""Two ranks over gloo (CPU, epx's cpu backend) calling epx through DeepEP's API.

    PYTHONPATH=python python3 python/examples/deep_ep_gloo.py

Each rank routes 4 tokens to 2 of 4 experts, dispatches them in low-latency mode, lets every expert
be the identity, and combines: the result must be x * (sum of the token's weights).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epx.compat.deep_ep as deep_ep


def main(rank, world_size):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=rank,
                            world_size=world_size)
    buffer = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
    T, H, E, T_max = 4, 256, 4, 8
    torch.manual_seed(rank)
    x = torch.randn(T, H).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)])  # [T, 2], deep_ep.topk_idx_t
    topk_weights = torch.rand(T, 2)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, T_max, E, use_fp8=False)
    # recv_x: [local experts, ranks * T_max, H]; the first recv_count[l] rows of expert l are valid.
    out, event, hook = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    expected = x.float() * topk_weights.sum(dim=1, keepdim=True)
    ok = torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-2)
    print(f"rank {rank}: received {recv_count.tolist()} tokens per local expert, combine "
          f"{'matches' if ok else 'DIFFERS FROM'} x * sum(weights)", flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("EPX_TIMEOUT_MS", "20000")
    mp.spawn(main, args=(2,), nprocs=2)
