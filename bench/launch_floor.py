"""The profiler row of a kernel that does nothing, launched as the ll kernels are launched.

A torch.profiler kernel row (DeepEP's `bench_kineto`) runs from the kernel's start to its end as
CUPTI records them, which is more than its CTAs' first entry to last exit (the SPAN of the ll
trace, docs/perf.md §5 item 56). This script measures that floor: empty kernels of the ll
kernels' shape (`kLlThreads` = 512 threads, one CTA per SM up to --ctas), with a kernel
parameter block and static shared memory of the sizes given, each CTA's thread 0 storing one
word (so the kernel is not empty to the compiler), timed the way DeepEP's test scripts time the
ll kernels: an 8192² matmul queued first, then --calls launches back to back under
torch.profiler, the mean of the kernel's rows. Also each kernel's mean over the same calls from
CUDA events around the loop (no profiler), and the row of a 1-CTA 32-thread empty kernel.

    python bench/launch_floor.py [--ctas 128] [--calls 30] [--rounds 3]

Needs a GPU and torch's C++ extension toolchain (nvcc, ninja); prints one table.
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_kernels import device_events  # noqa: E402  (the chrome trace's kernel rows)

PARAMS = (8, 1024)          # bytes of the kernel's parameter block
SMEM = (0, 8192, 32768)     # bytes of static shared memory

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

template <int kBytes> struct Block { int32_t* out; char pad[kBytes > 8 ? kBytes - 8 : 1]; };

template <int kParam, int kSmem>
__global__ void __launch_bounds__(512) epx_floor_kernel(Block<kParam> p) {
  if constexpr (kSmem > 0) {
    __shared__ int32_t s[kSmem / 4];
    s[threadIdx.x % (kSmem / 4)] = threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) p.out[blockIdx.x] = s[blockIdx.x % (kSmem / 4)];
  } else {
    if (threadIdx.x == 0) p.out[blockIdx.x] = blockIdx.x;
  }
}

template <int kParam, int kSmem>
void launch(torch::Tensor out, int64_t ctas, int64_t threads) {
  Block<kParam> p{};
  p.out = out.data_ptr<int32_t>();
  epx_floor_kernel<kParam, kSmem><<<ctas, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
}

void floor_launch(torch::Tensor out, int64_t param, int64_t smem, int64_t ctas, int64_t threads) {
  TORCH_CHECK(out.is_cuda() && out.dtype() == torch::kInt32 && out.numel() >= ctas, "out");
  if (param == 8 && smem == 0) return launch<8, 0>(out, ctas, threads);
  if (param == 8 && smem == 8192) return launch<8, 8192>(out, ctas, threads);
  if (param == 8 && smem == 32768) return launch<8, 32768>(out, ctas, threads);
  if (param == 1024 && smem == 0) return launch<1024, 0>(out, ctas, threads);
  if (param == 1024 && smem == 8192) return launch<1024, 8192>(out, ctas, threads);
  if (param == 1024 && smem == 32768) return launch<1024, 32768>(out, ctas, threads);
  TORCH_CHECK(false, "param must be 8 or 1024, smem 0, 8192 or 32768; got ", param, ", ", smem);
}
"""

CPP_SRC = "void floor_launch(torch::Tensor out, int64_t param, int64_t smem, int64_t ctas, " \
          "int64_t threads);"


def profiled_row(launch, calls):
    """Mean kernel duration (µs) over `calls` back-to-back launches after a queued 8192² matmul,
    from torch.profiler's device events; and the events' mean per call around the same loop."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _ = a @ a
        for _ in range(calls):
            launch()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        rows = [d for _, d, name in device_events(path) if "epx_floor_kernel" in name]
    finally:
        os.unlink(path)
    assert len(rows) == calls, (len(rows), calls)
    row = statistics.mean(rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _ = a @ a
    start.record()
    for _ in range(calls):
        launch()
    end.record()
    torch.cuda.synchronize()
    return row, start.elapsed_time(end) * 1e3 / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctas", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_floor.py: needs a GPU")
    ext = load_inline("epx_launch_floor", CPP_SRC, cuda_sources=CUDA_SRC,
                      functions=["floor_launch"], extra_cuda_cflags=["-O3", "-arch=sm_90"],
                      verbose=False)
    out = torch.zeros(max(args.ctas, 1), dtype=torch.int32, device="cuda")
    cases = [(p, s, args.ctas, 512) for p in PARAMS for s in SMEM] + [(8, 0, 1, 32)]
    print(f"{torch.cuda.get_device_name()}: empty kernels, {args.calls} back-to-back launches "
          f"after a queued 8192^2 bf16 matmul, {args.rounds} rounds (us; median of the rounds' "
          f"means)")
    print(f"{'param B':>8} {'smem B':>7} {'CTAs':>5} {'threads':>7} | {'profiler row':>12} "
          f"{'events/call':>11}")
    for p, s, c, t in cases:
        res = [profiled_row(lambda: ext.floor_launch(out, p, s, c, t), args.calls)
               for _ in range(args.rounds)]
        assert int(out[c - 1]) >= 0
        print(f"{p:>8} {s:>7} {c:>5} {t:>7} | {statistics.median(r[0] for r in res):>12.2f} "
              f"{statistics.median(r[1] for r in res):>11.2f}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
