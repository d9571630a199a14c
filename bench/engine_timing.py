"""ll (and ht) through the DeepEP drop-in, timed the way engine developers time DeepEP.

One rank per GPU over NCCL (R = 1 on a one-GPU machine; the cpu backend over gloo with --cpu,
host columns only). For each T of --tokens and hook off / on it prints:
  rows      torch.profiler kernel rows: the mean CUDA time of the one kernel whose name contains
            "dispatch" / "combine" over --iters back-to-back dispatch + combine pairs that follow
            an 8192 x 8192 float matmul and an all_reduce (with the hook: send / receive halves
            from the trace events, as the hook launches the receive half of the same kernel)
  events    dispatch + combine between two CUDA events, after a 256 MB zero_() that flushes L2
            once, mean / min over --iters pairs after --iters warm-up pairs (no hook)
  host      wall time of the Python calls of one pair (dispatch, combine; with the hook also the
            two hooks), median over the event-timed pairs (and per call below the table); "idle": the same with the device
            synchronised before each pair (so no call waits for earlier work); "host loop":
            the host CPU's speed just before the event-timed pairs (host_loop_ms)
  cold      with --cold, the rows again as DeepEP 2.x's own harness takes them (bench_kineto of
            deep_ep/utils/testing.py, dd758ca, with the barrier test_low_latency.py asks for):
            before every pair a 256 MB zero_() (L2 flushed), ≈ 10 ms of GPU sleep and an
            all_reduce, so each row is a call after a cold L2
--ht-tokens T[,T..] adds normal mode (ht) as DeepEP's test_intranode times it: a cached dispatch
(with the handle) and a combine, each alone between CUDA events after one L2 flush, its host time,
and the profiler's device rows (kernels and copies, mean per launch, launches per call).
--peer DIR adds the same ll rows of DeepEP itself (a checkout built by bench/build_deepep.sh),
measured in the same processes after epx's: the side-by-side of docs/perf.md §4.3.
Options: --default-device makes torch.set_default_device('cuda') current first (DeepEP's test
utilities do, and engines may): every torch call in Python then passes through a
TorchFunctionMode. --breakdown prints cProfile's top functions of 200 pairs (host time per call:
where it goes).

    PYTHONPATH=python python3 bench/engine_timing.py [--tokens 1,32,128,256] [--default-device]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def trace_events(prof):
    """The profiler's chrome-trace events."""
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name) as f:
            return json.load(f)["traceEvents"]


def host_loop_ms():
    """The host CPU's speed now: ms for a fixed pure-Python loop (20,000 integer multiply-adds),
    median of 5. The GPU machines' CPU time per call varies up to 2x over seconds with nothing
    else of ours running (docs/perf.md §4.5), and a host-bound event pair with it: each row
    carries the speed of its window (≈ 0.95 ms at the H200 host's fastest)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        s = 0
        for i in range(20000):
            s += i * i
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def flushed_event_times(fn, iters, device):
    """fn() `iters` times after one 256 MB zero_() that flushes L2 (DeepEP's `bench`): the host
    wall time of each call (us) and, on CUDA, the event-timed mean / min (us, the first dropped)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        cache = torch.empty(int(256e6 // 4), dtype=torch.int, device=device)
        cache.zero_()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    host = []
    for i in range(iters):
        if cuda:
            ev[i][0].record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            ev[i][1].record()
    if not cuda:
        return host, None
    torch.cuda.synchronize()
    t = [a.elapsed_time(b) * 1e3 for a, b in ev][1:]
    return host, (statistics.mean(t), min(t))


def profile_after_gemm(fn, iters, device, settle):
    """torch.profiler (CUDA activity) over `iters` back-to-back fn() after an 8192^2 float matmul
    and an all_reduce (DeepEP's `bench_kineto`), the second of two rounds kept; `settle`: wait for
    the matmul before the calls."""
    sched = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                schedule=sched) as prof:
        for _ in range(2):
            a = torch.randn(8192, 8192, dtype=torch.float, device=device)
            a @ a
            dist.all_reduce(torch.ones(1, device=device))
            if settle:
                torch.cuda.synchronize()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            prof.step()
    return prof


def profile_cold(fn, iters, device):
    """torch.profiler (CUDA activity) over `iters` calls of fn(), each after a 256 MB zero_() that
    flushes L2, ≈ 10 ms of GPU sleep and an all_reduce (DeepEP 2.x's `bench_kineto` with its
    barrier), the second of two rounds kept."""
    sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    one = torch.ones(1, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                schedule=sched) as prof:
        for _ in range(2):
            for _ in range(iters):
                torch.empty(int(256e6 // 4), dtype=torch.int, device=device).zero_()
                torch.cuda._sleep(int(2e7))
                dist.all_reduce(one)
                fn()
            torch.cuda.synchronize()
            prof.step()
    return prof


def kernel_rows(prof, names, phases):
    """Mean device time (us) per launch of the kernel whose name contains each of `names`, split
    into `phases` launches per call (send / receive with a hook) by trace order."""
    events = trace_events(prof)
    out = {}
    for name in names:
        evs = sorted((e for e in events if e.get("cat") == "kernel" and f"::{name}" in e["name"]),
                     key=lambda e: e["ts"])
        kinds = {e["name"] for e in evs}
        if len(kinds) != 1:
            out[name] = f"{len(kinds)} kernel names"
            continue
        durs = [e["dur"] for e in evs]
        out[name] = [sum(durs[j::phases]) / max(len(durs[j::phases]), 1) for j in range(phases)]
    return out


def peer_module(path):
    """DeepEP itself from a checkout built by bench/build_deepep.sh (its deep_ep package and
    deep_ep_cpp extension at the top of `path`)."""
    sys.path.insert(0, path)
    try:
        import deep_ep
    finally:
        sys.path.remove(path)
    return deep_ep


def run(rank, world, args):
    import epx.compat.deep_ep as epx_deep_ep
    modules = [("epx", epx_deep_ep)] + ([("DeepEP", peer_module(args.peer))] if args.peer else [])
    results = []
    for name, deep_ep in modules:
        for row in run_module(rank, world, args, deep_ep):
            row["module"] = name
            results.append(row)
    return results


def run_module(rank, world, args, deep_ep):
    cuda = not args.cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if args.default_device:
            torch.set_default_device("cuda")
    H, K, E = args.hidden, args.topk, args.experts
    results = []
    gen = torch.Generator().manual_seed(1234 + rank)
    for T in args.tokens:
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
        buf = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True,
                             num_qps_per_rank=max(E // world, 1), explicitly_destroy=True)
        x = torch.randn(T, H, generator=gen, device="cpu").to(torch.bfloat16).to(device)
        scores = torch.rand(T, E, generator=gen, device="cpu")
        topk = scores.topk(K, dim=1).indices.to(torch.int64).to(device)
        w = torch.rand(T, K, generator=gen, device="cpu").to(device)
        stats = torch.zeros(E // world, dtype=torch.int32, device=device)
        y = None

        def pair(hook, stamps=None):
            nonlocal y
            clock = time.perf_counter
            t0 = clock()
            recv, count, handle, _, h = buf.low_latency_dispatch(
                x, topk, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                return_recv_hook=hook)
            t1 = clock()
            if hook:
                h()
            t2 = clock()
            if y is None:
                y = torch.randn(recv[0].shape, generator=gen, device="cpu").to(torch.bfloat16).to(device)
            t3 = clock()
            _, _, h = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=hook)
            t4 = clock()
            if hook:
                h()
            t5 = clock()
            if stamps is not None:
                stamps.append((t1 - t0, t2 - t1, t4 - t3, t5 - t4))

        row = {"T": T}
        for hook in (False, True):
            for _ in range(args.iters):
                pair(hook)
            stamps = []
            key = "hook" if hook else "plain"
            row[f"loop_{key}"] = host_loop_ms()
            host, events = flushed_event_times(lambda: pair(hook, stamps), args.iters, device)
            row[f"host_{key}"] = statistics.median(host)
            row[f"calls_{key}"] = [statistics.median(c) * 1e6 for c in zip(*stamps)]
            if cuda:  # the same with the device idle before each pair: no wait for it inside
                idle = []
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    pair(hook)
                    idle.append((time.perf_counter() - t0) * 1e6)
                row[f"idle_{key}"] = statistics.median(idle)
            if cuda:
                row[f"events_{key}"] = events
                prof = profile_after_gemm(lambda: pair(hook), args.iters, device, settle=False)
                row[f"rows_{key}"] = kernel_rows(prof, ("dispatch", "combine"), 2 if hook else 1)
                if args.cold:
                    prof = profile_cold(lambda: pair(hook), args.iters, device)
                    row[f"cold_{key}"] = kernel_rows(prof, ("dispatch", "combine"),
                                                     2 if hook else 1)
        if args.breakdown and rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                pair(False)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.breakdown)
            row["breakdown"] = s.getvalue()
        results.append(row)
        buf.destroy()
    return results


def device_rows(prof):
    """Mean device time (us) per launch and launches, per kernel / copy name (shortened)."""
    events = trace_events(prof)
    rows = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "nccl" in e["name"]:
            continue
        name = e["name"].split("(")[0].replace("void ", "").replace("epx::detail::", "")[:40]
        n, total = rows.get(name, (0, 0.0))
        rows[name] = (n + 1, total + e["dur"])
    return {k: (n, total / n) for k, (n, total) in rows.items()}


def run_ht(rank, world, args, device):
    """Normal mode through the drop-in, as DeepEP's test_intranode times it: each op alone between
    CUDA events after one L2 flush (cached dispatch with the handle, combine), and the profiler's
    device rows of --iters back-to-back calls of each op (after an 8192^2 matmul)."""
    import epx.compat.deep_ep as deep_ep
    cuda = device.type == "cuda"
    H, K, E = args.hidden, args.topk, args.experts
    gen = torch.Generator().manual_seed(4321 + rank)
    out = []
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, explicitly_destroy=True)
    for T in args.ht_tokens:
        x = torch.randn(T, H, generator=gen, device="cpu").to(torch.bfloat16).to(device)
        topk = torch.rand(T, E, generator=gen, device="cpu").topk(K, dim=1).indices.to(device)
        w = torch.rand(T, K, generator=gen, device="cpu").to(device)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        recv, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
        ops = {"dispatch": lambda: buf.dispatch(x, handle=handle),
               "combine": lambda: buf.combine(recv, handle)}
        row = {"T": T}
        for name, fn in ops.items():
            for _ in range(args.iters):
                fn()
            host, events = flushed_event_times(fn, args.iters, device)
            row[f"host_{name}"] = statistics.median(host)
            if cuda:
                row[f"events_{name}"] = events
                rows = device_rows(profile_after_gemm(fn, args.iters, device, settle=True))
                rows = {k: v for k, v in rows.items() if "gemm" not in k.lower() and
                        "elementwise" not in k and "fill" not in k.lower()}
                row[f"rows_{name}"] = rows
        out.append(row)
    buf.destroy()
    return out


def worker(rank, world, init_file, args, queue):
    os.environ.update(NCCL_ENV)
    backend = "gloo" if args.cpu else "nccl"
    kw = {}
    if not args.cpu:
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **kw)
    try:
        ll = run(rank, world, args) if args.tokens else []
        device = torch.device("cuda", rank) if not args.cpu else torch.device("cpu")
        ht = run_ht(rank, world, args, device) if args.ht_tokens else []
        queue.put((rank, (ll, ht)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))  # (collect(): the parent stops the run)
        raise
    finally:
        dist.destroy_process_group()


def collect(queue, procs):
    """Every worker's (rank, results), or, when one failed (its exception, or an exit without
    results), that failure printed, the other workers stopped and exit status 1: a worker that
    raised never answers, and waiting for it would hang the run."""
    both = {}
    while len(both) < len(procs):
        try:
            rank, value = queue.get(timeout=1.0)
        except Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if not dead:
                continue
            rank, value = procs.index(dead[0]), f"exited with status {dead[0].exitcode}"
        if isinstance(value, str):  # a failure
            print(f"engine_timing: rank {rank} failed: {value}", file=sys.stderr)
            for p in procs:
                p.terminate()
            sys.exit(1)
        both[rank] = value
    return both


def fmt_rows(r):
    if isinstance(r, str):
        return r
    return " + ".join(f"{v:.1f}" for v in r)


def kernel_cells(plain, hook):
    """The four kernel-row columns of a table line: the dispatch and combine rows without the
    hook (`plain`), then with it (`hook`: send + receive)."""
    return (f"{fmt_rows(plain.get('dispatch', '-')):>13} {fmt_rows(plain.get('combine', '-')):>12}"
            f" | {fmt_rows(hook.get('dispatch', '-')):>16} {fmt_rows(hook.get('combine', '-')):>15}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,32,128,256", help="ll T list ('' for none)")
    ap.add_argument("--ht-tokens", default="", help="normal-mode (ht) T list, e.g. 4096")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=0, help="default: the GPUs found (1 on cpu)")
    ap.add_argument("--cpu", action="store_true", help="the cpu backend (host columns only)")
    ap.add_argument("--default-device", action="store_true",
                    help="torch.set_default_device('cuda') first, as DeepEP's test utilities")
    ap.add_argument("--peer", default="", metavar="DIR",
                    help="also DeepEP itself, from a checkout built by bench/build_deepep.sh "
                         "(ll rows; the same processes, after epx's)")
    ap.add_argument("--cold", action="store_true",
                    help="also the rows as DeepEP 2.x's harness takes them (L2 flushed, GPU "
                         "sleep and all_reduce before every pair)")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N",
                    help="cProfile's top N functions (by own time) of 200 pairs, rank 0")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.ht_tokens = [int(t) for t in args.ht_tokens.split(",") if t]
    os.environ.update(NCCL_ENV)
    if not args.cpu and not torch.cuda.is_available():
        args.cpu = True
    world = args.ranks or (1 if args.cpu else torch.cuda.device_count())
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, init_file, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    both = collect(queue, procs)
    for p in procs:
        p.join()
    results = {r: v[0] for r, v in both.items()}
    for r in sorted(both):
        for row in both[r][1]:
            for name in ("dispatch", "combine"):
                ev = row.get(f"events_{name}")
                print(f"ht rank {r} T = {row['T']} {name} (cached dispatch with the handle): "
                      f"events mean / min {ev[0]:.1f} / {ev[1]:.1f} us, " if ev else
                      f"ht rank {r} T = {row['T']} {name}: ", end="")
                print(f"host {row[f'host_{name}']:.1f} us")
                for k, (n, mean) in sorted(row.get(f"rows_{name}", {}).items(),
                                           key=lambda kv: -kv[1][0] * kv[1][1]):
                    print(f"    {k:<40} {n / args.iters:5.2f} per call x {mean:8.1f} us")
    if not any(results.values()):
        return
    print(f"engine timing: R = {world}, H = {args.hidden}, K = {args.topk}, E = {args.experts}, "
          f"{'cpu' if args.cpu else 'cuda'}, default device "
          f"{'cuda' if args.default_device else 'unset'}; us")
    print(f"{'module':>6} {'rank':>4} {'T':>5} | {'dispatch row':>13} {'combine row':>12} | "
          f"{'hooked dispatch':>16} {'hooked combine':>15} | {'events mean/min':>16} | "
          f"{'host pair':>9} {'hooked':>7} {'idle':>6} {'hooked':>7}")
    for rank in sorted(results):
        for row in results[rank]:
            rp, rh = row.get("rows_plain", {}), row.get("rows_hook", {})
            ev = row.get("events_plain")
            print(f"{row['module']:>6} {rank:>4} {row['T']:>5} | {kernel_cells(rp, rh)}"
                  f" | {(f'{ev[0]:.1f} / {ev[1]:.1f}' if ev else '-'):>16} | "
                  f"{row['host_plain']:>9.1f} {row['host_hook']:>7.1f} "
                  f"{row.get('idle_plain', float('nan')):>6.1f} "
                  f"{row.get('idle_hook', float('nan')):>7.1f}")
    print("host per call, median us: dispatch / its hook / combine / its hook; host loop: ms "
          "of host_loop_ms()'s fixed workload just before (lower: a faster host window)")
    for rank in sorted(results):
        for row in results[rank]:
            print(f"{row['module']:>6} {rank:>4} {row['T']:>5} | no hook " +
                  " / ".join(f"{v:.1f}" for v in row["calls_plain"]) +
                  f", host loop {row['loop_plain']:.2f} | hook " +
                  " / ".join(f"{v:.1f}" for v in row["calls_hook"]) +
                  f", host loop {row['loop_hook']:.2f}")
    if args.cold and not args.cpu:
        print("cold rows (each pair after an L2 flush, GPU sleep and all_reduce, as DeepEP 2.x's "
              "bench_kineto): dispatch row, combine row | hooked dispatch, hooked combine; us")
        for rank in sorted(results):
            for row in results[rank]:
                print(f"{row['module']:>6} {rank:>4} {row['T']:>5} | "
                      f"{kernel_cells(row.get('cold_plain', {}), row.get('cold_hook', {}))}")
    for rank in sorted(results):
        for row in results[rank]:
            if "breakdown" in row:
                print(f"-- cProfile, rank {rank}, T = {row['T']}, 200 pairs (no hook)")
                print(row["breakdown"])


if __name__ == "__main__":
    main()
