"""epx_demo.py — an expert-parallel MoE layer in PyTorch through epx.Dispatcher, end to end.

Every rank (one process; one GPU each over an NCCL group, or the cpu backend over gloo):

    x [T, H] bf16 -> router: top-k of random logits, softmax over the k -> topk_idx, topk_weights
      -> epx.Dispatcher.dispatch (ht / ll / a2a rows, bf16 or quantised)
      -> this rank's experts: expert e(x) = silu(x @ W1_e) @ W2_e, float32 on the dequantised
         rows, a loop over the local experts (ht/a2a: the rows that selected it; ll: its first
         masked_m rows)
      -> epx.Dispatcher.combine -> out [T, H] bf16

checked against a single-device dense reference out_ref[t] = sum_k w[t,k] * expert_{e_tk}(x[t])
(float32; every rank regenerates any expert's weights from the seed) and timed (median over the
timed calls, the slowest rank's): the layer (dispatch + experts + combine) next to dispatch +
combine alone, timed in a separate loop on the same inputs without experts (combine of zeros, or
of the a2a workspace as it is). Per mode: normal (ht),
low_latency (ll), auto (prefill batches ht, decode batches ll, alternating) and a2a, each in bf16
and the quantised formats the backend supports; a combination the backend raises Unsupported for
prints "skipped: <reason>".

    python demo/epx_demo.py                 # all visible GPUs, else 4 cpu-backend ranks
    python demo/epx_demo.py --help
Needs the epx package on the path (PYTHONPATH=python).
"""

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Never enable NVLink multicast on the shared GPU hosts (inherited by the spawned ranks).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}

# (name, backend, mode, quant, batches, tolerance on the max relative error per token).
# batches: 'prefill' (T tokens, forward_mode extend), 'decode' (decode_tokens, forward_mode
# decode) or 'both' (alternating, starting with prefill).
CONFIGS = [
    ("normal (ht) bf16", "deepep", "normal", "bf16", "prefill", 0.02),
    ("normal (ht) fp8", "deepep", "normal", "fp8", "prefill", 0.08),
    ("low_latency (ll) bf16", "deepep", "low_latency", "bf16", "decode", 0.02),
    ("low_latency (ll) fp8", "deepep", "low_latency", "fp8", "decode", 0.08),
    ("low_latency (ll) fp8 ue8m0", "deepep", "low_latency", "fp8_ue8m0", "decode", 0.1),
    ("auto (ht/ll) bf16", "deepep", "auto", "bf16", "both", 0.02),
    ("auto (ht/ll) fp8", "deepep", "auto", "fp8", "both", 0.08),
    ("a2a bf16", "a2a", "normal", "bf16", "prefill", 0.02),
    ("a2a fp8", "a2a", "normal", "fp8", "prefill", 0.08),
    ("a2a nvfp4", "a2a", "normal", "nvfp4", "prefill", 0.25),
]

# NVFP4 global scale, calibrated for inputs ~N(0, 1) (amax ~ 5): engines pass 448 * 6 / amax.
NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0


# ---- number formats (dequantisation of what the experts receive) -----------------------------

def _e4m3_table():
    vals = []
    for b in range(256):
        e, m = (b >> 3) & 0xF, b & 7
        v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        if b & 0x7F == 0x7F:
            v = float("nan")
        vals.append(-v if b & 0x80 else v)
    return torch.tensor(vals, dtype=torch.float32)


E4M3 = _e4m3_table()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def _u8(t):
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def dequant(x, scale, quant, hidden):
    """Rows [..., H] as the Dispatcher delivered them -> float32 [..., H] on their device."""
    if quant == "bf16":
        return x.float()
    lut = E4M3.to(x.device)
    lead = x.shape[:-1]
    if quant == "nvfp4":
        b = _u8(x).long()
        v = torch.stack([E2M1.to(x.device)[b & 0xF], E2M1.to(x.device)[b >> 4]], dim=-1)
        sf = lut[_u8(scale).long()].repeat_interleave(16, dim=-1)
        return v.reshape(*lead, hidden) * sf / NVFP4_GLOBAL_SCALE
    v = lut[_u8(x).long()]
    if quant == "fp8_ue8m0":  # int32 words of 4 exponent bytes, group g in byte g % 4
        words = scale.long() & 0xFFFFFFFF
        exps = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
        exps = exps.reshape(*lead, -1)[..., :hidden // 128]
        scale = torch.exp2(exps.float() - 127.0)
    return v * scale.float().repeat_interleave(128, dim=-1)


# ---- the layer ---------------------------------------------------------------------------------

class Experts:
    """All E experts' weights (float32), regenerated from the seed on every rank."""

    def __init__(self, num_experts, hidden, inter, seed, device):
        self.W1, self.W2 = [], []
        for e in range(num_experts):
            g = torch.Generator().manual_seed(seed * 1000003 + e)
            self.W1.append((torch.randn(hidden, inter, generator=g) / math.sqrt(hidden)).to(device))
            self.W2.append((torch.randn(inter, hidden, generator=g) / math.sqrt(inter)).to(device))

    def ffn(self, x, e):
        return torch.nn.functional.silu(x @ self.W1[e]) @ self.W2[e]


def run_local_experts(out, quant, experts, rank, num_local, hidden):
    """The expert GEMMs of one rank on a DispatchOutput -> what combine takes (bf16)."""
    xd = dequant(out.x, out.x_scale, quant, hidden)
    first = rank * num_local
    if out.format == "ll":
        # Expert-major rows: expert l's first masked_m[l] rows (the rest are never combined).
        y = torch.zeros(xd.shape[0], xd.shape[1], hidden, device=xd.device)
        for l, m in enumerate(out.masked_m.tolist()):
            if m:
                y[l, :m] = experts.ffn(xd[l, :m], first + l)
        return y.to(torch.bfloat16)
    if out.format == "ht":  # local ids, weighted by the caller
        ids, w = out.topk_idx, out.topk_weights
        is_local = lambda l: ids == l  # noqa: E731
    else:  # a2a: [R, M, ...] rows with global ids; padding rows carry -1
        R, M = out.x.shape[:2]
        xd = xd.reshape(R * M, hidden)
        ids = out.topk_idx.reshape(R * M, -1).long()
        w = out.topk_weights.reshape(R * M, -1)
        is_local = lambda l: ids == first + l  # noqa: E731
    y = torch.zeros(xd.shape[0], hidden, device=xd.device)
    for l in range(num_local):
        coef = (w * is_local(l)).sum(dim=1)
        rows = coef.nonzero().flatten()
        if rows.numel():
            y.index_add_(0, rows, coef[rows, None] * experts.ffn(xd[rows], first + l))
    y = y.to(torch.bfloat16)
    return y.reshape(out.x.shape[0], out.x.shape[1], hidden) if out.format == "a2a" else y


def dense_reference(x, idx, w, experts):
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in torch.unique(idx[idx >= 0]).tolist():
        coef = (w * (idx == e)).sum(dim=1)
        rows = coef.nonzero().flatten()
        out.index_add_(0, rows, coef[rows, None] * experts.ffn(xf[rows], e))
    return out


def max_rel_err(got, want):
    num = (got.float() - want).norm(dim=1)
    den = want.norm(dim=1)
    ok = den > 0
    worst = float((num[ok] / den[ok]).max()) if bool(ok.any()) else 0.0
    if bool((num[~ok] > 0).any()):
        worst = float("inf")  # a token routed nowhere must combine to 0
    return worst


def router(T, args, g, device):
    """Top-k of random logits, softmax over the chosen k."""
    logits = torch.randn(T, args.experts, generator=g)
    vals, idx = logits.topk(args.top_k, dim=1)
    return idx.to(device), torch.softmax(vals, dim=1).to(device)


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def run_config(cfg, args, rank, world, group, device, experts):
    import epx
    name, backend, mode, quant, batches, tol = cfg
    L = args.experts // world
    d = epx.Dispatcher(group, num_experts=args.experts, hidden=args.hidden, top_k=args.top_k,
                       max_tokens_per_rank=args.tokens, backend=backend, mode=mode, quant=quant)
    timer = Timer(device)
    fwd = dict(global_scale=NVFP4_GLOBAL_SCALE if quant == "nvfp4" else None)

    def inputs(it):
        decode = batches == "decode" or (batches == "both" and it % 2 == 1)
        T = args.decode_tokens if decode else args.tokens - rank % 2  # T may differ per rank
        g = torch.Generator().manual_seed(args.seed * 7919 + rank * 104729 + it)
        x = torch.randn(T, args.hidden, generator=g).to(torch.bfloat16).to(device)
        idx, w = router(T, args, g, device)
        return x, idx, w, "decode" if decode else "extend"

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # The layer: dispatch + experts + combine, checked against the dense reference.
    worst, layer_ms, formats = 0.0, [], []
    for it in range(args.iters + 1):  # call 0 warms up, untimed
        x, idx, w, fm = inputs(it)
        dist.barrier(group=args.pg)
        t0 = timer.mark()
        out = d.dispatch(x, idx, w, forward_mode=fm, **fwd)
        y = run_local_experts(out, quant, experts, rank, L, args.hidden)
        if out.format == "a2a":
            out.moe_output_view.copy_(y)  # the experts' sums go straight into the workspace
            res = d.combine()
        else:
            res = d.combine(y)
        t1 = timer.mark()
        sync()
        if it > 0:
            layer_ms.append(timer.ms(t0, t1))
        if out.format not in formats:
            formats.append(out.format)
        worst = max(worst, max_rel_err(res, dense_reference(x, idx, w, experts)))
    # Dispatch + combine alone on the same inputs: no experts between them (y = zeros, made
    # between the timed stages; a2a combines its workspace as it is).
    comm_ms = []
    for it in range(args.iters + 1):
        x, idx, w, fm = inputs(it)
        dist.barrier(group=args.pg)
        t0 = timer.mark()
        out = d.dispatch(x, idx, w, forward_mode=fm, **fwd)
        t1 = timer.mark()
        y = None
        if out.format == "ht":
            y = torch.zeros(out.x.shape[0], args.hidden, dtype=torch.bfloat16, device=device)
        elif out.format == "ll":
            y = torch.zeros(out.x.shape, dtype=torch.bfloat16, device=device)
        t2 = timer.mark()
        d.combine(y)
        t3 = timer.mark()
        sync()
        if it > 0:
            comm_ms.append(timer.ms(t0, t1) + timer.ms(t2, t3))
    stats = torch.tensor([worst, statistics.median(layer_ms), statistics.median(comm_ms)],
                         dtype=torch.float64)
    # Max over ranks (the slowest rank sets the layer time).
    stats = stats.to(device) if device.type == "cuda" else stats
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=args.pg)
    worst, layer, comm = stats.tolist()
    return worst, layer, comm, "+".join(formats), worst <= tol


def worker(rank, world, init_file, use_cuda, args, result_queue):
    os.environ.update(NCCL_ENV)
    sys.path.insert(0, args.python_path)
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import epx
    args.pg = dist.group.WORLD
    group = epx.Group.from_process_group(args.pg, device=device)
    experts = Experts(args.experts, args.hidden, args.inter, args.seed, device)
    if rank == 0:
        print(f"epx_demo.py: {group.backend} backend, {world} ranks ({device.type}), "
              f"T={args.tokens} (decode {args.decode_tokens}) H={args.hidden} I={args.inter} "
              f"K={args.top_k} E={args.experts}, median of {args.iters} timed calls each", flush=True)
        print(f"{'configuration':28s} {'format':7s} {'max rel err':>11s} {'tolerance':>9s} "
              f"{'layer ms':>9s} {'dispatch+combine ms':>20s}", flush=True)
    failures = 0
    for cfg in CONFIGS:
        try:
            worst, layer, comm, fmt, ok = run_config(cfg, args, rank, world, group, device,
                                                     experts)
        except epx.Unsupported as e:  # raised the same way on every rank, before communicating
            if rank == 0:
                print(f"{cfg[0]:28s} skipped: {e}", flush=True)
            continue
        failures += not ok
        if rank == 0:
            print(f"{cfg[0]:28s} {fmt:7s} {worst:11.2e} {cfg[5]:9.2g} {layer:9.3f} {comm:20.3f} "
                  f"{'ok' if ok else 'TOO LARGE'}", flush=True)
    if rank == 0:
        result_queue.put(failures)
    dist.barrier()
    dist.destroy_process_group()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=0,
                   help="ranks (0: every visible GPU, or 4 cpu-backend ranks without GPUs)")
    p.add_argument("--cpu", action="store_true", help="use the cpu backend even with GPUs")
    p.add_argument("--tokens", type=int, default=0, help="prefill tokens per rank "
                   "(0: 512 on GPU, 64 on CPU)")
    p.add_argument("--decode-tokens", type=int, default=0, help="decode tokens per rank "
                   "(0: 64 on GPU, 8 on CPU)")
    p.add_argument("--hidden", type=int, default=0, help="H, a multiple of 128 "
                   "(0: 2048 on GPU, 256 on CPU)")
    p.add_argument("--inter", type=int, default=0, help="expert intermediate size (0: H/2)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--experts", type=int, default=0, help="E, a multiple of the ranks "
                   "(0: 32 on GPU, 16 on CPU)")
    p.add_argument("--iters", type=int, default=0, help="timed calls per configuration and "
                   "loop, reported as their median (0: 20 on GPU, 2 on CPU)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.python_path = os.path.join(os.path.dirname(here), "python")
    sys.path.insert(0, args.python_path)
    import epx
    use_cuda = (not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() > 0
                and epx.built_with_cuda)
    if not use_cuda and torch.cuda.is_available() and not epx.built_with_cuda and not args.cpu:
        print("epx_demo.py: GPUs visible but epx was built without CUDA: cpu backend")
    world = args.ranks or (torch.cuda.device_count() if use_cuda else 4)
    if use_cuda and world > torch.cuda.device_count():
        p.error(f"--ranks {world}: only {torch.cuda.device_count()} GPUs visible")
    gpu = use_cuda
    args.tokens = args.tokens or (512 if gpu else 64)
    args.decode_tokens = args.decode_tokens or (64 if gpu else 8)
    args.hidden = args.hidden or (2048 if gpu else 256)
    args.inter = args.inter or args.hidden // 2
    args.experts = args.experts or (32 if gpu else 16)
    args.iters = args.iters or (20 if gpu else 2)
    if args.experts % world:
        p.error(f"--experts {args.experts} is not a multiple of the {world} ranks")
    os.environ.update(NCCL_ENV)
    fd, init_file = tempfile.mkstemp(prefix="epx-demo-rdzv-")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.spawn(worker, args=(world, init_file, use_cuda, args, queue), nprocs=world, join=True)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    failures = queue.get() if not queue.empty() else 1
    print(f"epx_demo.py: {'OK' if failures == 0 else f'{failures} configuration(s) FAILED'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
