// bench/trace_clock.cuh — the clocks of the phase traces (EPX_LL_TRACE / EPX_HT_TRACE builds):
// how fine %globaltimer steps on this GPU and the SM clock's rate, for the benchmarks' --trace
// (bench/ll_gpu_bench.cu, bench/ll_overlap_bench.cu).
#pragma once

#include <cuda_runtime.h>

#include "gpu/gpu_support.h"

namespace epx::bench {

// %globaltimer resolution and the SM clock (one thread, 2 ms): out = {dt ns, dclk, smallest
// step ns, distinct values seen}.
__global__ void clock_probe_kernel(unsigned long long* out) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  unsigned long long prev = t0, min_step = ~0ull, changes = 0;
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t != prev) {
      if (t - prev < min_step) min_step = t - prev;
      prev = t;
      ++changes;
    }
  } while (t - t0 < 2000000ull);
  const long long c1 = clock64();
  out[0] = t - t0;
  out[1] = static_cast<unsigned long long>(c1 - c0);
  out[2] = min_step;
  out[3] = changes;
}

struct TraceClock {
  double ns_per_clk = 0, step_ns = 0, mean_step_ns = 0;
  bool hybrid = false;  // %globaltimer too coarse: offsets = CTA entry (globaltimer) + clock64
};

inline TraceClock probe_clock(int dev) {
  unsigned long long* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 4 * sizeof(unsigned long long)));
  unsigned long long h[4] = {};
  for (int i = 0; i < 2; ++i) {  // the first one warms up
    clock_probe_kernel<<<1, 1>>>(d);
    CUDA_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
  }
  CUDA_OK(cudaFree(d));
  TraceClock c;
  c.ns_per_clk = h[1] ? static_cast<double>(h[0]) / static_cast<double>(h[1]) : 0;
  c.step_ns = static_cast<double>(h[2]);
  c.mean_step_ns = h[3] ? static_cast<double>(h[0]) / static_cast<double>(h[3]) : 0;
  c.hybrid = c.mean_step_ns > 100;
  (void)dev;
  return c;
}

}  // namespace epx::bench
