// bench/store_probe.cu — a diagnostic for issue 5 (not a test, not in ctest): how long does
// one CTA of 512 threads take to issue one ll message (a token row) into a peer GPU's memory?
// The ll send trace measured 5.8 µs per token per CTA (2026-11-30); this isolates the
// store pattern from everything else in ll_dispatch (no flags, no routing, no NCCL).
//
// One process, GPU 0 writes into GPU 1 through cudaDeviceEnablePeerAccess. C CTAs, each sends
// `per_cta` tokens of H channels (token t = b, b + C, ...); thread 0 stamps %globaltimer after a
// start barrier, after its own stores were issued, after the CTA barrier, and after a system
// fence (the stores acknowledged). Modes:
//   bf16-16B   the bf16 row as 16-byte stores (ll's bf16 path)
//   fp8-8B     quantised as ll does, 8-byte stores per lane (ll's fp8 path) + scales
//   fp8-raw8B  the same stores without the quantisation (isolates the conversion)
//   fp8-16B    quantised, lane pairs packed into one 16-byte store by the even lane
//   fp8-8B-2d  fp8-8B to the peer and to local memory (ll at EP2: each token to both ranks)
//   fp8-8B-loc fp8-8B to local memory only
//   fp8-hw8B   fp8-8B with the hardware conversion (f32x2_to_fp8x2_e4m3) instead of the emulation
// Prints per mode the median over CTAs (of the last of `iters` launches) of each phase, µs.
//   store_probe [--tokens-per-cta N] [--ctas C] [--hidden H] [--iters I]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "gpu/gpu_support.h"

namespace {

enum Mode { kBf16x16, kFp8x8, kFp8Raw8, kFp8x16, kFp8x8TwoDest, kFp8x8Local, kFp8Hw8, kNumModes };
const char* kModeNames[] = {"bf16-16B",  "fp8-8B",     "fp8-raw8B", "fp8-16B",
                            "fp8-8B-2d", "fp8-8B-loc", "fp8-hw8B"};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void bf16x8_to_f32(const uint4& raw, float* f) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// One vector (8 channels) quantised with its half-warp's group scale, as ll_send_fp8.
__device__ __forceinline__ uint2 quantise8(const uint4& raw, float* scale_out, bool hw) {
  float f[8];
  bf16x8_to_f32(raw, f);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = epx::detail::fp8_scale_from_amax(amax, false);
  const float inv = 1.0f / scale;
  uint2 packed;
  if (hw) {  // the hardware conversion, as the kernels since 7558298
    packed.x = epx::detail::f32x4_to_fp8x4_e4m3(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
    packed.y = epx::detail::f32x4_to_fp8x4_e4m3(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv);
  } else {  // the emulation, as the kernels before
    uint8_t b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = epx::detail::f32_to_fp8_e4m3(f[i] * inv);
    memcpy(&packed, b, 8);
  }
  *scale_out = scale;
  return packed;
}

// stamps[b * 4 + i]: start, own stores issued, CTA barrier, system fence.
__global__ void __launch_bounds__(512, 1) probe(int mode, const uint16_t* x, char* peer,
                                                char* local, int H, int tokens, uint64_t* stamps) {
  const int nv = H / 8;
  const int64_t msg_bytes = mode == kBf16x16 ? 2 * H : H + 4 * (H / 128);
  __syncthreads();
  const uint64_t t0 = now_ns();
  for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
    const uint16_t* row = x + static_cast<int64_t>(t) * H;
    char* dst = (mode == kFp8x8Local ? local : peer) + t * msg_bytes;
    char* dst2 = local + t * msg_bytes;
    // Warp-uniform trip count (every lane joins the shuffles), as ll's loop per warp.
    const int lane = threadIdx.x & 31;
    for (int base = threadIdx.x - lane; base < nv; base += blockDim.x) {
      const int v = base + lane;
      const bool active = v < nv;
      const uint4 raw = active ? __ldg(reinterpret_cast<const uint4*>(row) + v) : uint4{0, 0, 0, 0};
      if (mode == kBf16x16) {
        if (active) reinterpret_cast<uint4*>(dst)[v] = raw;
        continue;
      }
      float scale = 1.0f;
      uint2 q;
      if (mode == kFp8Raw8) {
        q = uint2{raw.x ^ raw.z, raw.y ^ raw.w};
      } else {
        q = quantise8(raw, &scale, mode == kFp8Hw8);
      }
      if (mode == kFp8x16) {
        const uint2 other{__shfl_down_sync(0xffffffffu, q.x, 1),
                          __shfl_down_sync(0xffffffffu, q.y, 1)};
        if (active && (lane & 1) == 0)
          reinterpret_cast<uint4*>(dst)[v / 2] = uint4{q.x, q.y, other.x, other.y};
      } else if (active) {
        reinterpret_cast<uint2*>(dst)[v] = q;
        if (mode == kFp8x8TwoDest) reinterpret_cast<uint2*>(dst2)[v] = q;
      }
      if (active && (lane & 15) == 0) {
        reinterpret_cast<float*>(dst + H)[v / 16] = scale;
        if (mode == kFp8x8TwoDest) reinterpret_cast<float*>(dst2 + H)[v / 16] = scale;
      }
    }
  }
  const uint64_t t1 = now_ns();
  __syncthreads();
  const uint64_t t2 = now_ns();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint64_t t3 = now_ns();
    uint64_t* s = stamps + 4 * blockIdx.x;
    s[0] = t0;
    s[1] = t1;
    s[2] = t2;
    s[3] = t3;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int per_cta = 1, ctas = 128, H = 7168, iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--tokens-per-cta")
      per_cta = v;
    else if (a == "--ctas")
      ctas = v;
    else if (a == "--hidden")
      H = v;
    else if (a == "--iters")
      iters = v;
  }
  const int n = epx::gpu_testing::visible_gpus();
  if (n < 2) {
    std::printf("store_probe: needs 2 GPUs (%d visible)\n", n);
    return 0;
  }
  const int tokens = per_cta * ctas;
  const size_t msg = 2 * static_cast<size_t>(H) + 64;
  char* peer = nullptr;
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaMalloc(&peer, msg * tokens));
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaDeviceEnablePeerAccess(1, 0));
  char* local = nullptr;
  uint16_t* x = nullptr;
  uint64_t* stamps = nullptr;
  CUDA_OK(cudaMalloc(&local, msg * tokens));
  CUDA_OK(cudaMalloc(&x, 2 * static_cast<size_t>(H) * tokens));
  CUDA_OK(cudaMalloc(&stamps, 32 * static_cast<size_t>(ctas)));
  std::vector<uint16_t> hx(static_cast<size_t>(H) * tokens);
  for (size_t i = 0; i < hx.size(); ++i)
    hx[i] = static_cast<uint16_t>(0x3C00 + (i * 2654435761u >> 20) % 512);
  CUDA_OK(cudaMemcpy(x, hx.data(), 2 * hx.size(), cudaMemcpyHostToDevice));
  std::printf(
      "store_probe: %d CTAs x 512 threads, %d token(s) per CTA, H = %d, last of %d launches; "
      "median over CTAs, us from the CTA's start\n",
      ctas, per_cta, H, iters);
  std::printf("%-11s %10s %10s %10s %12s\n", "mode", "own-issue", "cta-issue", "fenced",
              "kernel(ev)");
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  for (int mode = 0; mode < kNumModes; ++mode) {
    float ms = 0.0f;
    for (int it = 0; it < iters; ++it) {
      CUDA_OK(cudaEventRecord(e0));
      probe<<<ctas, 512>>>(mode, x, peer, local, H, tokens, stamps);
      CUDA_OK(cudaEventRecord(e1));
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaEventSynchronize(e1));
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    }
    std::vector<uint64_t> s(4 * static_cast<size_t>(ctas));
    CUDA_OK(cudaMemcpy(s.data(), stamps, 8 * s.size(), cudaMemcpyDeviceToHost));
    std::vector<double> a, b, c;
    for (int i = 0; i < ctas; ++i) {
      a.push_back((s[4 * i + 1] - s[4 * i]) * 1e-3);
      b.push_back((s[4 * i + 2] - s[4 * i]) * 1e-3);
      c.push_back((s[4 * i + 3] - s[4 * i]) * 1e-3);
    }
    std::printf("%-11s %10.2f %10.2f %10.2f %12.2f\n", kModeNames[mode], median(a), median(b),
                median(c), ms * 1e3);
  }
  return 0;
}
