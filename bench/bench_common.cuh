// bench/bench_common.cuh — what the a2a and ll GPU benchmarks share: error checks, the
// median, and the two baselines measured in the same run as epx:
//   * time_push: the NVLink ceiling, an SM-driven push (16-byte stores, all ranks at once) of
//     `bytes` into the next rank's symmetric memory;
//   * time_nccl: grouped ncclSend/ncclRecv of a rank's `bytes` of remote traffic, split evenly
//     over its R - 1 peers (to and from each). Ranks move
//     different byte counts under random routing; NCCL's point-to-point needs matching counts
//     (a rank with 0 bytes skips its calls and its peer waits forever), so every rank first
//     agrees on the largest count (one ncclAllReduce) and all move that.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "epx/group.h"
#include "transport/nccl_transport.h"
#include "transport/transport.h"

#define CK(call)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)
#define NK(call)                                                                                 \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

namespace epx::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__global__ void push_kernel(const uint4* src, uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Median us per call of `n_it` calls of `enqueue` back to back on `s` (events between them,
// read at the end: no launch gaps), the first `warmup` not counted.
template <typename F>
double time_back_to_back(cudaStream_t s, int warmup, int iters, F&& enqueue) {
  const int n_it = warmup + iters;
  std::vector<cudaEvent_t> ev(n_it + 1);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  CK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < n_it; ++i) {
    enqueue();
    CK(cudaEventRecord(ev[i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  std::vector<double> t;
  for (int i = warmup; i < n_it; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    t.push_back(ms * 1e3);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return median(t);
}

// Median us of pushing `bytes` to the next rank with `ctas` CTAs, all ranks at once.
inline double time_push(const Group& g, detail::SymmetricMemory& mem, const void* src,
                        size_t bytes, int ctas, cudaStream_t s, int warmup, int iters) {
  const size_t n = bytes / 16;
  auto* dst = static_cast<uint4*>(mem.peer((g.rank() + 1) % g.size()));
  g.transport()->barrier("bench: ceiling");
  const double us = time_back_to_back(s, warmup, iters, [&] {
    push_kernel<<<ctas, 512, 0, s>>>(static_cast<const uint4*>(src), dst, n);
  });
  g.transport()->barrier("bench: ceiling done");  // no rank frees while a peer still pushes
  return us;
}

// The largest `bytes` over the ranks (collective).
inline size_t agree_max_bytes(const Group& g, size_t bytes, cudaStream_t s) {
  auto comm = static_cast<ncclComm_t>(detail::nccl_comm_of(*g.transport()));
  uint64_t* d = nullptr;
  CK(cudaMalloc(&d, sizeof(uint64_t)));
  uint64_t v = bytes;
  CK(cudaMemcpyAsync(d, &v, sizeof v, cudaMemcpyHostToDevice, s));
  NK(ncclAllReduce(d, d, 1, ncclUint64, ncclMax, comm, s));
  CK(cudaMemcpyAsync(&v, d, sizeof v, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(d));
  return static_cast<size_t>(v);
}

// Median us of an NCCL all-to-all moving this rank's `bytes` of remote traffic in all: the largest
// `bytes` over the ranks, split evenly over the R - 1 peers (to and from each; `send`/`recv` hold
// R times the per-peer bytes). Collective.
inline double time_nccl(const Group& g, void* send, void* recv, size_t bytes, cudaStream_t s,
                        int warmup, int iters) {
  auto comm = static_cast<ncclComm_t>(detail::nccl_comm_of(*g.transport()));
  const int R = g.size(), me = g.rank();
  if (R == 1) return 0;
  const size_t n = (agree_max_bytes(g, bytes, s) + R - 2) / (R - 1);
  if (n == 0) return 0;
  return time_back_to_back(s, warmup, iters, [&] {
    NK(ncclGroupStart());
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      NK(ncclSend(static_cast<char*>(send) + p * n, n, ncclUint8, p, comm, s));
      NK(ncclRecv(static_cast<char*>(recv) + p * n, n, ncclUint8, p, comm, s));
    }
    NK(ncclGroupEnd());
  });
}

}  // namespace epx::bench
