"""The hooked ll halves as DeepEP's harness runs them, for Nsight Compute (`bash bench/gpu_run.sh
ncu` with EPX_NCU_HOOK=1; docs/perf.md §5 item 72).

One rank (NCCL, one GPU), the DeepEP drop-in, fp8 dispatch with
`cumulative_local_expert_recv_stats`, bf16 combine. It runs --warmup hooked pairs and then one
more, each as DeepEP's `test_low_latency.py` times the hook: dispatch (send half), an N x N float
matmul, the hook (receive half), combine (send half), the matmul, the hook. So each receive half
starts after a matmul has replaced the L2's contents and the SMs' caches, as in the harness's
hooked rows. Launch order of the kernels named "dispatch": send, receive, send, receive, ...; the
last pair's send half is launch 2 * warmup and its receive 2 * warmup + 1 (what `ncu -k
regex:^dispatch --launch-skip` takes; the same for "combine"). Each send half follows the previous
hook with no matmul between, as in the harness. It prints those indices and checks nothing: the
tests compare the outputs.

    ncu -k regex:^dispatch --launch-skip $((2 * W + 1)) --launch-count 1 ... \\
        python bench/ncu_hook.py --tokens T --warmup W

--fused: no hook, as the harness's kernel rows run (its `bench_kineto`): W pairs of a fused
dispatch and a combine, the matmul, then two more pairs; the second of those follows a combine
with its caches as the pairs leave them. Its dispatch and combine are launch W + 1 of their
names (what `gpu_run.sh ncu` with EPX_NCU_BYTES=1 profiles, --cache-control none).
--fused --no-combine: the same without the combines (dispatch W + 1 follows a dispatch): whether
the dispatch's DRAM traffic needs the combine's working set in the L2 between them.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from engine_timing import NCCL_ENV  # (bench/, this script's directory, is on sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--warmup", type=int, default=4,
                    help="hooked pairs before the last one (--fused: pairs before the matmul)")
    ap.add_argument("--gemm", type=int, default=8192, help="N of the matmul before each hook")
    ap.add_argument("--fused", action="store_true",
                    help="pairs without a hook, one matmul before the last two (see above)")
    ap.add_argument("--no-combine", action="store_true",
                    help="with --fused: dispatches only, no combine between them")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_hook.py: needs a GPU")
    os.environ.update(NCCL_ENV)
    import epx.compat.deep_ep as deep_ep

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                            device_id=device)
    try:
        T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
        gen = torch.Generator().manual_seed(1234)
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
        buf = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True,
                             num_qps_per_rank=E, explicitly_destroy=True)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        topk = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(device)
        w = torch.rand(T, K, generator=gen).to(device)
        stats = torch.zeros(E, dtype=torch.int32, device=device)
        mat = torch.randn(args.gemm, args.gemm, device=device)
        y = None
        if args.fused:
            for i in range(args.warmup + 2):
                if i == args.warmup:
                    mat @ mat
                recv, _, handle, _, _ = buf.low_latency_dispatch(
                    x, topk, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True)
                if args.no_combine:
                    continue
                if y is None:
                    y = torch.randn(recv[0].shape, generator=gen).to(torch.bfloat16).to(device)
                buf.low_latency_combine(y, topk, w, handle)
            torch.cuda.synchronize()
            names = "'dispatch'" if args.no_combine else "'dispatch' and of 'combine'"
            what = "dispatches only" if args.no_combine else "pairs"
            print(f"ncu_hook: T = {T}, E = {E}, fused {what}; the second after the matmul is "
                  f"launch {args.warmup + 1} of {names}")
        else:
            for _ in range(args.warmup + 1):
                recv, _, handle, _, hook = buf.low_latency_dispatch(
                    x, topk, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                    return_recv_hook=True)
                mat @ mat
                hook()
                if y is None:
                    y = torch.randn(recv[0].shape, generator=gen).to(torch.bfloat16).to(device)
                _, _, hook = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
                mat @ mat
                hook()
            torch.cuda.synchronize()
            print(f"ncu_hook: T = {T}, E = {E}; the last send and receive halves are launches "
                  f"{2 * args.warmup} and {2 * args.warmup + 1} of 'dispatch' and of 'combine'")
        buf.destroy()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
