// bench/copy_probe.cu — a diagnostic (not a test, not in ctest): the ll dispatch receive's copy
// at R = 1, E = 288, H = 7168 (fp8 rows of 7 KB), K = 8 distinct experts per token, C = 128 CTAs of
// 512 threads, in two orders: by expert (the production's: a CTA takes experts b, b + C, ... and
// copies their rows with the production loop, ll_copy_rows: warps taking 4 KB chunks, so a message
// is read once per row) and by message (a CTA takes messages b, b + C, ... and loads each vector
// once, storing it into the message's K rows). Phase 1 writes the messages (as the send does), a grid barrier, then phase 2 copies;
// each CTA stamps %globaltimer after the barrier, after its copy (a CTA barrier: its stores
// issued) and after a fence (its stores done). Both orders get their row places from the host
// (nothing is counted or listed inside the timed part): what is compared is the copy alone.
// Prints, per T in {128, 256, 32}, order and L2 state (hot, or 256 MB written between launches),
// medians over iterations of the median and slowest CTA's copy and of the last CTA's fence after
// the barrier, and checks every row of the last launch (docs/perf.md §5 item 67). At T = 32 the
// by-message order leaves C - T CTAs without a message (a receive would split each message's
// vectors over C / T CTAs): that row bounds nothing.
//   epx_copy_probe [--iters I]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda/kernels/ll/common.cuh"
#include "gpu/gpu_support.h"

constexpr int kThreads = 512, kK = 8, kRowBytes = 7168, kNv = kRowBytes / 16;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct P {
  int T, L, mode;
  const int* rowof;      // [T][K] row of (t, k) in expert topk[t][k]'s block
  const int* topk;       // [T][K]
  const int* exp_first;  // [L + 1] offsets into exp_tok
  const int* exp_tok;    // tokens of expert l in order
  uint4* msgs;           // [T][kNv]
  uint4* recv;           // [L][T][kNv]
  unsigned* bar;
  unsigned epoch;
  unsigned long long* stamps;  // [C][3]
};

__global__ void __launch_bounds__(kThreads, 1) probe(P p) {
  __shared__ int s_tok[1024];
  __shared__ int s_dst[1024];
  __shared__ int s_n;
  const int b = blockIdx.x, C = gridDim.x;
  if (p.mode == 0 && threadIdx.x == 0) {  // the list, before the timed part
    int n = 0;
    for (int l = b; l < p.L; l += C)
      for (int i = p.exp_first[l]; i < p.exp_first[l + 1]; ++i) {
        s_tok[n] = p.exp_tok[i];
        s_dst[n] = l * p.T + (i - p.exp_first[l]);
        ++n;
      }
    s_n = n;
  }
  // By message: message t's K rows (vector offsets in recv); the first message's before the
  // timed part.
  int64_t dst[kK];
  auto rows_of = [&](int t) {
#pragma unroll
    for (int k = 0; k < kK; ++k)
      dst[k] = (int64_t(__ldg(p.topk + t * kK + k)) * p.T + __ldg(p.rowof + t * kK + k)) * kNv;
  };
  if (b < p.T) rows_of(b);
  // Phase 1: messages t = b, b + C, ...
  for (int t = b; t < p.T; t += C)
    for (int v = threadIdx.x; v < kNv; v += kThreads)
      p.msgs[int64_t(t) * kNv + v] = make_uint4(t * 7919u + v, p.epoch, v * 3u, t ^ v);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.bar, 1u);
    while (*((volatile unsigned*)p.bar) < p.epoch * C) {
    }
    __threadfence();
  }
  __syncthreads();
  const uint64_t t0 = now_ns();
  if (p.mode == 0) {
    // The production loop (kernels/ll/common.cuh): warps take 4 KB chunks of a row.
    epx::detail::ll_copy_rows<true>(s_n, kNv, true, [&](int m, const uint16_t** src, uint4** dst) {
      *src = reinterpret_cast<const uint16_t*>(p.msgs + int64_t(s_tok[m]) * kNv);
      *dst = p.recv + int64_t(s_dst[m]) * kNv;
    });
  } else {
    // By message: messages t = b, b + C, ...: each vector loaded once, stored into K rows.
    for (int t = b; t < p.T; t += C) {
      if (t != b) rows_of(t);
      for (int v = threadIdx.x; v < kNv; v += kThreads) {
        const uint4 x = epx::detail::ld_landed<uint4>(p.msgs + int64_t(t) * kNv + v);
#pragma unroll
        for (int k = 0; k < kK; ++k) p.recv[dst[k] + v] = x;
      }
    }
  }
  __syncthreads();
  const uint64_t t1 = now_ns();
  if (threadIdx.x == 0) __threadfence();
  __syncthreads();
  const uint64_t t2 = now_ns();
  if (threadIdx.x == 0) {
    p.stamps[b * 3 + 0] = t0;
    p.stamps[b * 3 + 1] = t1;
    p.stamps[b * 3 + 2] = t2;
  }
}

__global__ void flush(uint4* junk, int64_t n, unsigned s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    junk[i] = make_uint4(s, s, s, s);
}

int run(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--iters" && i + 1 < argc) {
      iters = std::max(6, std::atoi(argv[++i]));
    } else {
      std::printf("usage: epx_copy_probe [--iters I]\n");
      return 2;
    }
  }
  const int E = 288, C = 128;
  bool failed = false;
  std::mt19937 rng(1234);
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t junk_n = (256ll << 20) / 16;
  uint4* junk;
  CUDA_OK(cudaMalloc(&junk, junk_n * 16));
  for (int T : {128, 256, 32}) {
    // Routing: K distinct experts per token, uniform.
    std::vector<int> topk(T * kK), rowof(T * kK), cnt(E, 0);
    for (int t = 0; t < T; ++t) {
      std::vector<int> e(E);
      for (int i = 0; i < E; ++i) e[i] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int k = 0; k < kK; ++k) {
        topk[t * kK + k] = e[k];
        rowof[t * kK + k] = cnt[e[k]]++;
      }
    }
    std::vector<int> first(E + 1, 0), tok(T * kK);
    for (int l = 0; l < E; ++l) first[l + 1] = first[l] + cnt[l];
    {
      std::vector<int> fill(first.begin(), first.end() - 1);
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < kK; ++k) tok[fill[topk[t * kK + k]]++] = t;
    }
    int *d_rowof, *d_topk, *d_first, *d_tok;
    uint4 *msgs, *recv;
    unsigned* bar;
    unsigned long long* stamps;
    CUDA_OK(cudaMalloc(&d_rowof, rowof.size() * 4));
    CUDA_OK(cudaMalloc(&d_topk, topk.size() * 4));
    CUDA_OK(cudaMalloc(&d_first, first.size() * 4));
    CUDA_OK(cudaMalloc(&d_tok, tok.size() * 4));
    CUDA_OK(cudaMemcpy(d_rowof, rowof.data(), rowof.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_topk, topk.data(), topk.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_first, first.data(), first.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_tok, tok.data(), tok.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&msgs, int64_t(T) * kNv * 16));
    const int64_t recv_n = int64_t(E) * T * kNv;
    CUDA_OK(cudaMalloc(&recv, recv_n * 16));
    CUDA_OK(cudaMalloc(&bar, 4));
    CUDA_OK(cudaMemset(bar, 0, 4));
    CUDA_OK(cudaMalloc(&stamps, C * 3 * 8));
    unsigned epoch = 0;
    for (int flushed = 0; flushed < 2; ++flushed)
      for (int mode = 0; mode < 2; ++mode) {
        std::vector<double> copy_med, copy_max, fence_max;
        for (int it = 0; it < iters; ++it) {
          if (flushed) flush<<<sms * 4, 512>>>(junk, junk_n, it);
          P p{T, E, mode, d_rowof, d_topk, d_first, d_tok, msgs, recv, bar, ++epoch, stamps};
          probe<<<C, kThreads>>>(p);
          CUDA_OK(cudaGetLastError());
          CUDA_OK(cudaDeviceSynchronize());
          std::vector<unsigned long long> st(C * 3);
          CUDA_OK(cudaMemcpy(st.data(), stamps, st.size() * 8, cudaMemcpyDeviceToHost));
          std::vector<double> c, f;
          unsigned long long bar_max = 0;
          for (int b = 0; b < C; ++b) bar_max = std::max(bar_max, st[b * 3]);
          for (int b = 0; b < C; ++b) {
            c.push_back((st[b * 3 + 1] - st[b * 3]) * 1e-3);
            f.push_back((st[b * 3 + 2] - bar_max) * 1e-3);
          }
          std::sort(c.begin(), c.end());
          if (it >= 5) {
            copy_med.push_back(c[C / 2]);
            copy_max.push_back(c.back());
            fence_max.push_back(*std::max_element(f.begin(), f.end()));
          }
        }
        auto med = [](std::vector<double> v) {
          std::sort(v.begin(), v.end());
          return v[v.size() / 2];
        };
        std::printf(
            "T=%d %s %s: copy per CTA median %.2f max %.2f us; last CTA fenced %.2f us after the "
            "barrier\n",
            T, mode ? "by-message" : "by-expert ", flushed ? "L2-flushed" : "hot       ",
            med(copy_med), med(copy_max), med(fence_max));
        // Check every row of this mode's last launch.
        std::vector<uint4> row(kNv);
        int bad = 0;
        for (int t = 0; t < T && bad < 3; ++t)
          for (int k = 0; k < kK; ++k) {
            const int64_t off = (int64_t(topk[t * kK + k]) * T + rowof[t * kK + k]) * kNv;
            CUDA_OK(cudaMemcpy(row.data(), recv + off, kNv * 16, cudaMemcpyDeviceToHost));
            for (int v = 0; v < kNv; ++v)
              if (row[v].x != t * 7919u + v || row[v].y != epoch || row[v].z != v * 3u ||
                  row[v].w != unsigned(t ^ v)) {
                ++bad;
                break;
              }
          }
        if (bad) {
          std::printf("  CHECK FAILED (%d rows)\n", bad);
          failed = true;
        }
      }
    CUDA_OK(cudaFree(d_rowof));
    CUDA_OK(cudaFree(d_topk));
    CUDA_OK(cudaFree(d_first));
    CUDA_OK(cudaFree(d_tok));
    CUDA_OK(cudaFree(msgs));
    CUDA_OK(cudaFree(recv));
    CUDA_OK(cudaFree(bar));
    CUDA_OK(cudaFree(stamps));
  }
  std::printf("SMs %d; every row checked: %s\n", sms, failed ? "FAILED" : "ok");
  return failed ? 1 : 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::printf("epx_copy_probe: %s\n", e.what());
    return 1;
  }
}
