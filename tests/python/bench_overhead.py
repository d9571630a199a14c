"""Python call overhead of epx ops (target: at most 30 us per call in ll and a2a).

One rank (R = 1), tiny T, so the op itself is short; each pair of calls is timed through
  cpp      the C++ op in a C++ loop (a caching allocator)        -- the op's own host cost
  epx      epx.Buffer / epx.A2a (torch tensors in and out)
  compat   epx.compat.deep_ep / epx.compat.flashinfer
and the overhead per call is (python - cpp) / 2 (a dispatch and a combine per iteration; in the
"+ hooks" row each with return_recv_hook and its hook called, so a call there is an op and its
hook).

--device cpu (default): a gloo group, the cpu backend, CPU tensors.
--device cuda: an NCCL group of one rank on GPU 0, the cuda backend, CUDA tensors. The ops are
asynchronous there, so every loop runs in chunks of --every iterations with a
torch.cuda.synchronize() after each chunk, outside the timed spans: the times are the host's
(the launch queue never fills), except where an op itself waits for the device (ht's exact
dispatch learns N through one host synchronisation: its row includes that wait). The "stream"
column is the device's wall time per iteration over one chunk (CUDA events): the rate of eager
calls back to back. Both devices: "allocs" and "in the allocator" are the epx row's output
allocations per iteration and the host time spent in them (epx._epx._alloc_stats; the mean over
all runs, where the row is the best run), a part of its overhead.

--breakdown ROUNDS: where the host time of one ll dispatch + combine goes, layer by layer (the
DeepEP drop-in as bench/engine_timing.py calls it, epx.Buffer, the extension's calls, the C++ op,
the output allocations; ll_breakdown), docs/perf.md §4.5; where the torch bridge's ATen path is
loaded (epx._epx_torch, docs/design.md §12), once with it ("ATen") and once with the attribute
path and new_empty ("attrs"), interleaved in every round of the same process.

--primitives ROUNDS: the host operations an ll pair is made of, one at a time (µs per call, best
of ROUNDS interleaved rounds, less an empty lambda's call), beside a fixed pure-Python workload
(100 integer multiply-adds): which calls a host makes dearer than its Python speed explains
(docs/perf.md §4.5).

    PYTHONPATH=python /usr/bin/python3 tests/python/bench_overhead.py [--iters N] [--device cuda]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as deep_ep
import epx.compat.flashinfer as fi
from epx import _epx


class Clock:
    """Host time per iteration of fn (best of `repeats` runs: the machine may be shared); on CUDA
    in chunks of `every` iterations, each followed by an untimed synchronisation."""

    def __init__(self, cuda, every, repeats=9):
        self.cuda, self.repeats = cuda, repeats
        self.every = every if cuda else 0
        self.sync = torch.cuda.synchronize if cuda else None
        self.stream_us = {}
        self.alloc = {}  # name -> (allocations, us) per iteration

    def run(self, fn, iters):
        """One run: host us per iteration of `iters` calls of fn (on CUDA in chunks)."""
        every = self.every or iters
        total, done = 0.0, 0
        while done < iters:
            n = min(every, iters - done)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            total += time.perf_counter() - start
            done += n
            if self.sync:
                self.sync()
        return total / iters * 1e6

    def timed(self, fn, iters, name=None):
        fn()  # warm up (lazy buffer creation)
        if self.sync:
            self.sync()
        every = self.every or iters
        _epx._alloc_stats(True)
        samples = [self.run(fn, iters) for _ in range(self.repeats)]
        calls, ns = _epx._alloc_stats(True)
        if name:
            n = iters * self.repeats
            self.alloc[name] = (calls / n, ns / n / 1e3)
        if self.cuda and name:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(every):
                fn()
            end.record()
            end.synchronize()
            self.stream_us[name] = begin.elapsed_time(end) * 1e3 / every
        return min(samples)

    def cpp(self, fn, iters):
        """A _time_*_cpp baseline (ns per iteration) -> best us of `repeats`."""
        return min(fn(iters, self.sync, self.every) / 1e3 for _ in range(self.repeats))


def ll_parts(clock, buf, x, idx, w, y, iters):
    """What one ll bf16 dispatch + combine through epx.Buffer is made of, timed apart."""
    from epx import _torch
    s = _torch.stream_of(x)
    nat = buf._native

    def native_pair():  # the extension's calls, without the Python wrappers
        r = nat.ll_dispatch(x, idx, False, False, False, False, None, s)
        nat.ll_combine(y, idx, w, r[3], False, False, None, s)

    r = buf.ll_dispatch(x, idx, use_fp8=False)
    shapes = [(t.shape, t.dtype) for t in (r.recv_x, r.recv_count, r.handle.src_info,
                                            r.handle.layout_range)]
    shapes.append(((x.shape[0], x.shape[1]), torch.bfloat16))  # combine's out
    buf.ll_combine(y, idx, w, r.handle)
    del r

    def empties():  # the outputs' torch.empty calls, from Python
        for shape, dtype in shapes:
            torch.empty(shape, dtype=dtype, device=x.device)

    return [("through epx.Buffer (the table's row)", clock.timed(
                lambda: (lambda d: buf.ll_combine(y, idx, w, d.handle))(
                    buf.ll_dispatch(x, idx, use_fp8=False)), iters)),
            ("through buf._native (no wrapper, stream looked up once)",
             clock.timed(native_pair, iters)),
            ("2 stream look-ups (_torch.stream_of)",
             clock.timed(lambda: (_torch.stream_of(x), _torch.stream_of(w)), iters)),
            (f"{len(shapes)} torch.empty of the outputs' shapes, from Python",
             clock.timed(empties, iters))]


def ll_breakdown(clock, dev, x, idx, w, y, T_max, E, iters, rounds):
    """Where the host time of one ll dispatch + combine goes, layer by layer (docs/perf.md §4.5):
    the DeepEP drop-in called as the engine harness calls it (bench/engine_timing.py: fp8,
    cumulative_local_expert_recv_stats, no hook; and bf16 without stats), then the same pair one
    layer lower each time, on the same epx buffer:
      compat   deep_ep.Buffer.low_latency_dispatch + low_latency_combine
      epx      epx.Buffer.ll_dispatch + ll_combine
      native   the extension's two calls (Buffer._native), the stream looked up once: pybind11's
               argument handling, the tensor views, the GIL, the output allocations, the result
               tuple and handle
      cpp      the C++ op alone, in a C++ loop (caching allocator; no stats tensor)
    and the output allocations inside the native calls (torch's allocator, called from C++ with
    the GIL taken back). Each layer's differences to the next: the per-pair cost of that layer.
    Each round times every layer once (`iters` pairs each, the layers interleaved); each layer's
    time is its best round (the machine may be shared), the allocations' the least of the native
    rounds'. With the ATen path loaded every round times the three Python layers with it and
    without it (_epx._set_torch_aten), and each layer has a column per path."""
    from epx import _torch
    stats = torch.zeros(E, dtype=torch.int32, device=dev)
    s = _torch.stream_of(x)
    out = {}
    aten_was = _epx._torch_aten_active()
    paths = (("ATen", True), ("attrs", False)) if aten_was else (("attrs", False),)
    for fp8, with_stats in ((True, True), (False, False)):
        st = stats if with_stats else None
        dbuf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
        dbuf.low_latency_dispatch(x, idx, T_max, E, cumulative_local_expert_recv_stats=st,
                                  use_fp8=fp8)  # creates the epx buffer
        buf = dbuf._ll
        nat = buf._native

        def compat():
            r = dbuf.low_latency_dispatch(x, idx, T_max, E, cumulative_local_expert_recv_stats=st,
                                          use_fp8=fp8)
            dbuf.low_latency_combine(y, idx, w, r[2])

        def wrapper():
            r = buf.ll_dispatch(x, idx, use_fp8=fp8, cumulative_local_expert_recv_stats=st)
            buf.ll_combine(y, idx, w, r.handle)

        def native():
            r = nat.ll_dispatch(x, idx, fp8, False, False, False, st, s)
            nat.ll_combine(y, idx, w, r[3], False, False, None, s)

        layers = {"compat": compat, "epx": wrapper, "native": native}
        for fn in layers.values():
            fn()
        if clock.sync:
            clock.sync()
        best = {(p, k): float("inf") for p, _ in paths for k in layers}
        cpp = float("inf")
        allocs = {p: [] for p, _ in paths}  # (allocations, host us) per pair, native loops
        for _ in range(rounds):
            for p, on in paths:
                _epx._set_torch_aten(on)
                for k, fn in layers.items():
                    if k == "native":
                        _epx._alloc_stats(True)
                    best[p, k] = min(best[p, k], clock.run(fn, iters))
                    if k == "native":
                        calls, ns = _epx._alloc_stats(True)
                        allocs[p].append((calls / iters, ns / iters / 1e3))
            cpp = min(cpp, _epx._time_ll_cpp(nat, x, idx, w, fp8, iters, clock.sync,
                                             clock.every) / 1e3)
        _epx._set_torch_aten(aten_was)
        for p, _ in paths:
            n_alloc = statistics.median(a[0] for a in allocs[p])
            alloc_us = min(a[1] for a in allocs[p])
            b = {k: best[p, k] for k in layers}
            out[f"{'fp8 + stats' if with_stats else 'bf16'}, {p}"] = [
                ("compat pair (the engine's call)", b["compat"]),
                ("host overhead: compat - C++ op", b["compat"] - cpp),
                ("deep_ep layer: compat - epx", b["compat"] - b["epx"]),
                ("epx.Buffer layer: epx - native", b["epx"] - b["native"]),
                ("bindings: native - cpp - allocations", b["native"] - cpp - alloc_us),
                ("output allocations per pair (count)", n_alloc),
                ("output allocations (us)", alloc_us),
                ("C++ op (C++ loop)", cpp)]
        del dbuf, buf, nat
    return out


def primitives(clock, dev, x, idx, T_max, E, rounds, n=2000):
    """µs per call of each host operation an ll pair through the drop-in is made of (the Python
    checks, the stream look-up, the extension's tensor views and allocations, torch's own
    allocation and kernel launch, the result objects), best of `rounds` interleaved rounds of n
    calls (clock.run: on CUDA in chunks with an untimed synchronisation after each, so the
    launch queue never fills), less an empty lambda's call; the first row is a fixed pure-Python
    workload, the unit of the host's Python speed."""
    from epx import _torch
    from epx.compat import _deep_ep_types
    dbuf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
    r = dbuf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False)
    native, buf = r[2]._handle, r[2]._buffer
    bf16 = _torch.CODE_OF[torch.bfloat16]
    cuda_index = x.get_device() if x.is_cuda else -1
    z = torch.zeros(8, dtype=torch.int32, device=dev)
    tf_len = getattr(torch._C, "_len_torch_function_stack", None)
    not_x = frozenset((torch.uint8,))

    def nothing():
        return None

    def workload():
        s = 0
        for i in range(100):
            s += i * i

    ops = [("pure Python: 100 integer multiply-adds (the unit)", workload),
           ("one more Python call (of an empty function)", lambda: nothing()),
           ("isinstance(x, Tensor) and x.dim()", lambda: isinstance(x, torch.Tensor) and x.dim()),
           ("x.dtype in a frozenset", lambda: x.dtype in not_x),
           ("x.shape[1]", lambda: x.shape[1]),
           ("x.is_cuda", lambda: x.is_cuda),
           ("x.get_device()", lambda: x.get_device()),
           ("_torch.device_key(x)", lambda: _torch.device_key(x)),
           ("_torch.stream_of(x)", lambda: _torch.stream_of(x)),
           ("pybind11 call, no arguments (_epx._torch_aten_active)", _epx._torch_aten_active),
           ("pybind11 call + ATen view of x (_epx._aten_view)", lambda: _epx._aten_view(x)),
           ("pybind11 call + to_view of x (_epx._tensor_view)",
            lambda: _epx._tensor_view(x, "x")),
           ("an output through the torch bridge (_epx._torch_empty, 8 x 256 bf16)",
            lambda: _epx._torch_empty(bf16, [8, 256], cuda_index)),
           ("torch.empty((8, 256), bf16, device)",
            lambda: torch.empty((8, 256), dtype=torch.bfloat16, device=dev)),
           ("x.new_empty((8, 256))", lambda: x.new_empty((8, 256))),
           ("a torch kernel launch (z.zero_(), 8 int32)", z.zero_),
           ("the drop-in's handle (_LlHandle)",
            lambda: deep_ep._LlHandle(native, buf, dbuf._ll_tail)),
           ("EventOverlap()", _deep_ep_types.EventOverlap)]
    if tf_len is not None:
        ops.append(("torch._C._len_torch_function_stack()", tf_len))
    empty = lambda: None  # noqa: E731
    best = [float("inf")] * len(ops)
    floor = float("inf")
    for _ in range(rounds):
        floor = min(floor, clock.run(empty, n))
        for i, (_, fn) in enumerate(ops):
            best[i] = min(best[i], clock.run(fn, n))
    del r, dbuf
    return [(name, b - floor) for (name, _), b in zip(ops, best)], floor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--every", type=int, default=32,
                        help="cuda: iterations between untimed synchronisations")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--alloc-ab", action="store_true",
                        help="also time the epx rows with outputs made by the ATen path (where "
                        "loaded), new_empty on a cached template and torch.empty")
    parser.add_argument("--breakdown", type=int, default=0, metavar="ROUNDS",
                        help="also time an ll pair layer by layer through the DeepEP drop-in "
                        "(fp8 with stats, as bench/engine_timing.py calls it, and bf16): best of "
                        "ROUNDS rounds of --iters pairs")
    parser.add_argument("--parts", action="store_true",
                        help="also time the parts of the ll bf16 row (wrapper, stream look-up, "
                        "torch.empty of its outputs' shapes)")
    parser.add_argument("--primitives", type=int, default=0, metavar="ROUNDS",
                        help="also time the host operations an ll pair is made of, one at a time "
                        "(best of ROUNDS rounds), beside a fixed pure-Python workload")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{path}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    clock = Clock(cuda, args.every, args.repeats)
    # Small outputs (tens of KB) keep host malloc out of the picture: the question is the cost of
    # the Python call, not of the cpu backend's memory traffic.
    T, H, K, E, T_max = args.tokens, args.hidden, 8, args.experts, args.max_tokens
    x = torch.randn(T, H).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K).to(dev)
    rows = []
    epx_fns = {}  # name -> (the epx row's body, iterations), for --alloc-ab

    # ---- ll ----
    group = epx.Group.from_process_group()
    buf = epx.Buffer(group, H, K, E, T_max, enable_ht=False, enable_ll=True)
    y = torch.zeros(E, T_max, H, dtype=torch.bfloat16, device=dev)
    for fp8, hook in ((False, False), (True, False), (True, True)):
        cpp = clock.cpp(lambda n, s, e: epx._epx._time_ll_cpp(buf._native, x, idx, w, fp8, n, s, e,
                                                               hook), args.iters)

        def epx_ll(fp8=fp8, hook=hook):  # bound now: --alloc-ab calls it after the loop
            r = buf.ll_dispatch(x, idx, use_fp8=fp8, return_recv_hook=hook)
            if hook:
                r.hook()
            c = buf.ll_combine(y, idx, w, r.handle, return_recv_hook=hook)
            if hook:
                c.hook()

        dbuf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)

        def compat_ll(fp8=fp8, hook=hook):
            r = dbuf.low_latency_dispatch(x, idx, T_max, E, use_fp8=fp8, return_recv_hook=hook)
            if hook:
                r[4]()
            c = dbuf.low_latency_combine(y, idx, w, r[2], return_recv_hook=hook)
            if hook:
                c[2]()

        name = ("ll fp8" if fp8 else "ll bf16") + (" + hooks" if hook else "")
        epx_fns[name] = (epx_ll, args.iters)
        rows.append((name, cpp, clock.timed(epx_ll, args.iters, name),
                     clock.timed(compat_ll, args.iters)))
        if args.parts and not fp8:
            parts = ll_parts(clock, buf, x, idx, w, y, args.iters)

    if args.primitives:
        prims, floor = primitives(clock, dev, x, idx, T_max, E, args.primitives)
    if args.breakdown:
        breakdown = ll_breakdown(clock, dev, x, idx, w, y, T_max, E, args.iters, args.breakdown)

    # ---- a2a ----
    idx32 = idx.to(torch.int32)
    payloads = [x, idx32, w]
    a2a = epx.A2a(group, T_max, K, E, [H * 2, K * 4, K * 4], H * 2)
    ya = torch.zeros(1, T, H, dtype=torch.bfloat16, device=dev)
    cpp = clock.cpp(
        lambda n, s, e: epx._epx._time_a2a_cpp(a2a._native, idx32, payloads, ya, T, n, s, e),
        args.iters)

    def epx_a2a():
        a2a.dispatch(idx32, payloads, T)
        a2a.combine(ya, T)

    mapping = fi.Mapping(world_size=1, rank=0, tp_size=1, moe_ep_size=1)
    moe = fi.MoeAlltoAll(mapping, T_max, K, E, hidden_size=H, backend=args.device)

    def compat_a2a():
        moe.dispatch(idx32, payloads, T)
        moe.combine(ya, T)

    epx_fns["a2a bf16"] = (epx_a2a, args.iters)
    rows.append(("a2a bf16", cpp, clock.timed(epx_a2a, args.iters, "a2a bf16"),
                 clock.timed(compat_a2a, args.iters)))

    # ---- ht ----
    try:
        hbuf = epx.Buffer(group, H, K, E, max(64, T))
        cpp = clock.cpp(lambda n, s, e: epx._epx._time_ht_cpp(hbuf._native, x, idx, n, s, e),
                        args.iters // 4)

        def epx_ht():
            r = hbuf.ht_dispatch(x, idx, w)
            hbuf.ht_combine(r.recv_x, r.handle)

        dht = deep_ep.Buffer(dist.group.WORLD)
        per_expert = torch.zeros(E, dtype=torch.int32, device=dev)

        def compat_ht():
            r = dht.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            dht.combine(r[0], r[4])

        epx_fns["ht bf16"] = (epx_ht, args.iters // 4)
        rows.append(("ht bf16", cpp, clock.timed(epx_ht, args.iters // 4, "ht bf16"),
                     clock.timed(compat_ht, args.iters // 4)))
    except epx.Unsupported as e:
        print(f"ht skipped: {e}")

    where = (f"cuda backend on {torch.cuda.get_device_name(0)}, chunks of {args.every}" if cuda
             else "cpu backend")
    aten = epx._torch.aten_status()
    print(f"T={T} H={H} K={K} E={E} T_max={T_max} R=1 {where}, torch {torch.__version__}, "
          f"{args.iters} iterations (ht: {args.iters // 4}), best of {args.repeats}; torch "
          f"bridge: {'ATen path' if aten.active else 'attribute path (' + aten.reason + ')'}")
    stream_head = " stream us (epx) |" if cuda else ""
    print("| op (dispatch + combine) | C++ loop us | epx.Buffer/A2a us | compat us | "
          f"overhead per call, epx | overhead per call, compat | allocs (epx) | "
          f"in the allocator us (epx) |{stream_head}")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for name, cpp, e, c in rows:
        stream = f" {clock.stream_us[name]:.1f} |" if cuda else ""
        allocs, alloc_us = clock.alloc[name]
        print(f"| {name} | {cpp:.1f} | {e:.1f} | {c:.1f} | {(e - cpp) / 2:.1f} | "
              f"{(c - cpp) / 2:.1f} | {allocs:.1f} | {alloc_us:.1f} |{stream}")
    if args.alloc_ab:
        # The bridge's ways of making an output, same process: the ATen path (where loaded; it
        # also reads the inputs), new_empty on a cached template, torch.empty(sizes, dtype=,
        # device=), then the first again (drift).
        ways = [("ATen", True, True)] if aten.active else []
        ways += [("new_empty", False, True), ("torch.empty", False, False)]
        ways.append((ways[0][0] + " again",) + ways[0][1:])
        print("| op (epx row) | " + " | ".join(f"us, {w[0]}" for w in ways) + " | " +
              " | ".join(f"in alloc us, {w[0]}" for w in ways[:-1]) + " |")
        print("|---|" + "---|" * (2 * len(ways) - 1))
        for name, (fn, n) in epx_fns.items():
            times, alloc_us = [], []
            for _, on, new_empty in ways:
                _epx._set_torch_aten(on)
                _epx._set_alloc_new_empty(new_empty)
                times.append(clock.timed(fn, n, name))
                alloc_us.append(clock.alloc[name][1])
            print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " | " +
                  " | ".join(f"{a:.1f}" for a in alloc_us[:-1]) + " |")
        _epx._set_torch_aten(aten.active)
    if args.breakdown:
        cols = list(breakdown)
        print(f"| ll dispatch + combine, layer (best of {args.breakdown} rounds) | " +
              " | ".join(f"us per pair, {c}" for c in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for i, (name, _) in enumerate(breakdown[cols[0]]):
            print(f"| {name} | " + " | ".join(f"{breakdown[c][i][1]:.1f}" for c in cols) + " |")
    if args.parts:
        print("| ll bf16 dispatch + combine, part | us per iteration |")
        print("|---|---|")
        for name, us in parts:
            print(f"| {name} | {us:.1f} |")
    if args.primitives:
        unit = prims[0][1]
        print(f"| host operation (best of {args.primitives} rounds; an empty lambda's call, "
              f"{floor:.3f} us, taken off) | us per call | in units of row 1 |")
        print("|---|---|---|")
        for name, us in prims:
            print(f"| {name} | {us:.3f} | {us / unit:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
