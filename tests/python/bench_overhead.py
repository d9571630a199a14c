"""Python call overhead of epx ops (SPEC 6: at most 30 us per call in ll and a2a).

One rank (R = 1, gloo), tiny T, so the op itself is short; each pair of calls is timed through
  cpp      the C++ op in a C++ loop (default allocator)          -- the op's own cost
  epx      epx.Buffer / epx.A2a (torch tensors in and out)
  compat   epx.compat.deep_ep / epx.compat.flashinfer
and the overhead per call is (python - cpp) / 2 (a dispatch and a combine per iteration).

    PYTHONPATH=python /usr/bin/python3 tests/python/bench_overhead.py [--iters N]
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as deep_ep
import epx.compat.flashinfer as fi


def timed(fn, iters, repeats=9):
    fn()  # warm up (lazy buffer creation)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return min(samples)  # the least disturbed run: the machine may be shared


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    torch.manual_seed(0)
    # Small outputs (tens of KB) keep host malloc out of the picture: the question is the cost of
    # the Python call, not of the cpu backend's memory traffic.
    T, H, K, E, T_max = args.tokens, args.hidden, 8, args.experts, args.max_tokens
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    rows = []

    # ---- ll ----
    group = epx.Group.from_process_group()
    buf = epx.Buffer(group, H, K, E, T_max, enable_ht=False, enable_ll=True)
    y = torch.zeros(E, T_max, H, dtype=torch.bfloat16)
    for fp8 in (False, True):
        cpp = min(epx._epx._time_ll_cpp(buf._native, x, idx, w, fp8, args.iters) / 1e3
                                for _ in range(9))

        def epx_ll():
            r = buf.ll_dispatch(x, idx, use_fp8=fp8)
            buf.ll_combine(y, idx, w, r.handle)

        dbuf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)

        def compat_ll():
            r = dbuf.low_latency_dispatch(x, idx, T_max, E, use_fp8=fp8)
            dbuf.low_latency_combine(y, idx, w, r[2])

        name = "ll fp8" if fp8 else "ll bf16"
        rows.append((name, cpp, timed(epx_ll, args.iters), timed(compat_ll, args.iters)))

    # ---- a2a ----
    idx32 = idx.to(torch.int32)
    payloads = [x, idx32, w]
    a2a = epx.A2a(group, T_max, K, E, [H * 2, K * 4, K * 4], H * 2)
    ya = torch.zeros(1, T, H, dtype=torch.bfloat16)
    cpp = min(epx._epx._time_a2a_cpp(a2a._native, idx32, payloads, ya, T,
                                                    args.iters) / 1e3
                            for _ in range(9))

    def epx_a2a():
        a2a.dispatch(idx32, payloads, T)
        a2a.combine(ya, T)

    mapping = fi.Mapping(world_size=1, rank=0, tp_size=1, moe_ep_size=1)
    moe = fi.MoeAlltoAll(mapping, T_max, K, E, hidden_size=H)

    def compat_a2a():
        moe.dispatch(idx32, payloads, T)
        moe.combine(ya, T)

    rows.append(("a2a bf16", cpp, timed(epx_a2a, args.iters), timed(compat_a2a, args.iters)))

    # ---- ht ----
    try:
        hbuf = epx.Buffer(group, H, K, E, 64)
        cpp = min(epx._epx._time_ht_cpp(hbuf._native, x, idx, args.iters) / 1e3
                                for _ in range(9))

        def epx_ht():
            r = hbuf.ht_dispatch(x, idx, w)
            hbuf.ht_combine(r.recv_x, r.handle)

        dht = deep_ep.Buffer(dist.group.WORLD)
        per_expert = torch.zeros(E, dtype=torch.int32)

        def compat_ht():
            r = dht.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            dht.combine(r[0], r[4])

        rows.append(("ht bf16", cpp, timed(epx_ht, args.iters // 4),
                     timed(compat_ht, args.iters // 4)))
    except epx.Unsupported as e:
        print(f"ht skipped: {e}")

    print(f"T={T} H={H} K={K} E={E} T_max={T_max} R=1 cpu backend, torch {torch.__version__}, "
          f"{args.iters} iterations, best of 9")
    print("| op (dispatch + combine) | C++ loop us | epx.Buffer/A2a us | compat us | "
          "overhead per call, epx | overhead per call, compat |")
    print("|---|---|---|---|---|---|")
    for name, cpp, e, c in rows:
        print(f"| {name} | {cpp:.1f} | {e:.1f} | {c:.1f} | {(e - cpp) / 2:.1f} | "
              f"{(c - cpp) / 2:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
