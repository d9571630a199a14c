"""epx ops' GPU time as the PyTorch profiler reports it (how DeepEP's figures were taken).

One process per GPU over an NCCL process group (the cpu backend over gloo where there is no GPU:
host times only, which checks the script). For each op of the standard workloads (perf.md §3) it
runs `--iters` calls back to back (no barrier between them) under torch.profiler and prints, per
rank and per call:
  wall     (last kernel / copy end - first start) / calls on this rank's device: idle gaps count,
           inside a call (ht exact mode waits for the host) and between calls when the host is
           slower than the device (eager rows: the profiler adds much host time per call)
  kernels  the sum of kernel and copy durations (DeepEP's "kernel time"). Overlapping work counts
           twice: copies beside a kernel, and with programmatic dependent launch a kernel that
           starts while the previous one runs and waits inside it (ll in graphs)
  host     wall time of the Python call (eager rows)
  then every kernel / copy: calls per op x mean duration.
Rows marked (graph): the calls captured in one CUDA graph, replayed once (no host between them).

    python bench/profile_kernels.py [--ops ll,ht,a2a] [--iters 20] [--ranks N]

NCCL kernels (the barriers) are left out. Needs torch with CUDA for the device columns.
"""

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Never enable NVLink multicast on the shared GPU hosts (inherited by the spawned ranks).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def uniform_topk(T, K, E, gen, device):
    """Uniform random routing: K distinct experts per token (int64)."""
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous().to(device)


def short_name(name):
    for cut in ("(", "<"):
        i = name.find(cut)
        if i > 0:
            name = name[:i]
    name = name.replace("void ", "").replace("epx::detail::", "")
    return name.strip()[:48]


def device_events(trace_path):
    with open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data  # (older torch: a list)
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        if "nccl" in e.get("name", "").lower():
            continue
        out.append((float(e["ts"]), float(e["dur"]), e["name"]))
    out.sort()
    return out


def profile_op(step, iters, device, sync, graph):
    """Times `iters` back-to-back calls of `step` under the profiler (no barrier or host sync
    between them: every op synchronises the ranks itself) -> per-call figures and per-kernel
    means. `graph` (cuda): the calls are captured in one CUDA graph, replayed once under the
    profiler, so no host time sits between them (else a slow host call makes the peer's kernel
    wait, and that wait counts in its duration)."""
    for _ in range(3):  # warm-up: lazy set-up, caching allocators
        step()
    sync()
    replay = None
    if graph and device.type == "cuda":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                step()
        replay = g.replay
    dist.barrier()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        if replay:
            replay()
        else:
            for _ in range(iters):
                step()
        host = (time.perf_counter() - t0) * 1e6 / iters
        sync()
    res = {"host": None if replay else host, "wall": None, "kernels": None, "per": {}}
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = device_events(path)
    finally:
        os.unlink(path)
    if not events or device.type != "cuda":
        return res
    res["wall"] = (max(t + d for t, d, _ in events) - events[0][0]) / iters
    res["kernels"] = sum(d for _, d, _ in events) / iters
    per = {}
    for _, d, name in events:
        per.setdefault(short_name(name), []).append(d)
    res["per"] = {k: (len(v) / iters, sum(v) / len(v)) for k, v in per.items()}
    return res


def run_ops(rank, world, device, args):
    import epx  # noqa: E402  (after the process group: the extension loads CUDA)

    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    group = epx.Group.from_process_group()
    gen = torch.Generator().manual_seed(1000 + rank)
    H, K, E = args.hidden, 8, args.experts
    results = []

    def add(name, step, graph=False):
        if graph and on_cuda:
            name += " (graph)"
        results.append((name, profile_op(step, args.iters, device, sync, graph)))

    if "ll" in args.ops:
        T = args.ll_tokens
        buf = epx.Buffer(group, H, K, E, T, enable_ht=False, enable_ll=True)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        idx = uniform_topk(T, K, E, gen, device)
        w = torch.rand(T, K, generator=gen).to(device)
        state = {"d": buf.ll_dispatch(x, idx, use_fp8=True)}
        y = torch.randn(state["d"].recv_x.shape, generator=gen).to(torch.bfloat16).to(device)
        for graph in (False, True):
            add(f"ll.dispatch fp8 T={T}",
                lambda: state.__setitem__("d", buf.ll_dispatch(x, idx, use_fp8=True)), graph)
            add(f"ll.combine T={T}", lambda: buf.ll_combine(y, idx, w, state["d"].handle), graph)
        del buf, state
    if "ht" in args.ops:
        T = args.ht_tokens
        buf = epx.Buffer(group, H, K, E, T)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        idx = uniform_topk(T, K, E, gen, device)
        w = torch.rand(T, K, generator=gen).to(device)
        st = {"d": buf.ht_dispatch(x, idx, w)}
        h = st["d"].handle
        add(f"ht.dispatch bf16 T={T}", lambda: st.__setitem__("d", buf.ht_dispatch(x, idx, w)))
        h = st["d"].handle
        add(f"ht.dispatch bf16 cached T={T}", lambda: buf.ht_dispatch(x, handle=h))
        # Worst-case mode (no host sync: capturable) and cached, in graphs: the count exchange's
        # and the dispatch kernel's own durations with no host between the calls.
        add(f"ht.dispatch bf16 worst-case T={T}",
            lambda: buf.ht_dispatch(x, idx, w, num_worst_tokens=T * world), True)
        add(f"ht.dispatch bf16 cached T={T}", lambda: buf.ht_dispatch(x, handle=h), True)
        add(f"ht.dispatch bf16 cached zero-copy T={T}",
            lambda: buf.ht_dispatch(x, handle=h, zero_copy=True))
        if epx.has_fp8_dtype and on_cuda:
            x8 = x.to(epx.fp8_dtype)
            s8 = torch.ones(T, H // 128, device=device)
            add(f"ht.dispatch fp8 T={T}", lambda: buf.ht_dispatch(x8, idx, w, x_scales=s8))
            h8 = buf.ht_dispatch(x8, idx, w, x_scales=s8).handle
            add(f"ht.dispatch fp8 cached T={T}", lambda: buf.ht_dispatch(x8, x_scales=s8, handle=h8))
        y = torch.randn(st["d"].recv_x.shape, generator=gen).to(torch.bfloat16).to(device)
        rw = st["d"].recv_topk_weights
        add(f"ht.combine T={T}", lambda: buf.ht_combine(y, h, rw))
        view = buf.ht_combine_buffer(h)
        view.copy_(y)
        add(f"ht.combine zero-copy T={T}", lambda: buf.ht_combine(view, h, rw, zero_copy=True))
        del buf, st, view
    if "a2a" in args.ops:
        T = args.a2a_tokens
        a2a = epx.A2a(group, max_tokens_per_rank=T, top_k=K, num_experts=E,
                      payload_bytes_per_token=[H * 2, K * 4, K * 4], combine_bytes_per_token=H * 2)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        idx = uniform_topk(T, K, E, gen, device).to(torch.int32)
        w = torch.rand(T, K, generator=gen).to(device)
        yv = torch.randn(world, T, H, generator=gen).to(torch.bfloat16).to(device)

        def dispatch_combine():  # a2a's order is dispatch -> combine -> dispatch
            a2a.dispatch(idx, [x, idx, w], T, expert_id_payload_index=1)
            view = a2a.combine_payload_view(T, H, torch.bfloat16)
            view.copy_(yv)  # the experts' write (a device copy, shown among the kernels)
            a2a.combine(view, T, payload_in_workspace=True)

        for graph in (False, True):
            add(f"a2a.dispatch+combine T={T} (+ y copy)", dispatch_combine, graph)
        del a2a
    return results


def worker(rank, world, init_file, args, queue):
    os.environ.update(NCCL_ENV)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120),
                            **({"device_id": device} if use_cuda else {}))
    try:
        queue.put((rank, run_ops(rank, world, device, args)))
    except BaseException as e:  # report, then let the parent fail
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="ll,ht,a2a")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=0, help="default: the GPUs found (2 on cpu)")
    ap.add_argument("--cpu", action="store_true", help="the cpu backend even where GPUs exist")
    ap.add_argument("--hidden", type=int, default=0, help="default 7168 (256 on cpu)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ll-tokens", type=int, default=128)
    ap.add_argument("--ht-tokens", type=int, default=0, help="default 4096 (256 on cpu)")
    ap.add_argument("--a2a-tokens", type=int, default=128)
    args = ap.parse_args()
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    use_cuda = torch.cuda.is_available() and not args.cpu
    world = args.ranks or (torch.cuda.device_count() if use_cuda else 2)
    args.hidden = args.hidden or (7168 if use_cuda else 256)
    args.ht_tokens = args.ht_tokens or (4096 if use_cuda else 256)
    os.environ.update(NCCL_ENV)
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(world, init_file, args, queue), nprocs=world, join=True)
    got = dict(queue.get() for _ in range(world))
    bad = {r: v for r, v in got.items() if isinstance(v, str)}
    if bad:
        raise SystemExit(f"profile_kernels: failed: {bad}")
    print(f"profile_kernels: {world} rank(s), {'cuda' if use_cuda else 'cpu backend (host only)'}, "
          f"H={args.hidden} K=8 E={args.experts}, {args.iters} calls per op, us per call")
    print(f"{'op':40s} {'rank':>4s} {'wall':>8s} {'kernels':>8s} {'host':>8s}  kernels (calls/op x mean us)")
    for i, (name, _) in enumerate(got[0]):
        for r in range(world):
            res = got[r][i][1]
            per = ", ".join(f"{k} {n:g}x{d:.1f}" for k, (n, d) in sorted(
                res["per"].items(), key=lambda kv: -kv[1][0] * kv[1][1]))
            print(f"{name:40s} {r:4d} {fmt(res['wall']):>8s} {fmt(res['kernels']):>8s} "
                  f"{fmt(res['host']):>8s}  {per}")


if __name__ == "__main__":
    main()
