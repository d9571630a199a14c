// src/cuda/kernels/a2a/common.cuh — device pieces shared by the a2a kernels: the workspace as
// the kernels see it (A2aSymm), per-CTA epochs, the completion counters, and a row walker that
// spreads (row, vector) pairs of a block of rows over a CTA without per-element division.
//
// Signalling (sync.cuh vocabulary: signal_ranks / wait_ranks, the inactive ranks skipped), per
// CTA and destination p:
//   all threads: plain stores of rows to p  -> __syncthreads()
//   thread p:    fence_acq_rel_sys() + red_add_relaxed_sys(&sync(p)->X_flag[rank], 1)   (release)
//   receiver:    thread s waits ld_acquire_sys(&sync(local)->X_flag[s]) >= e * C_s
//                -> __syncthreads() -> plain loads of what s wrote.
// Every CTA adds exactly once per call, so after call e the counter is e * C_s (mod 2^32,
// compared with seq_reached); nothing is ever reset.
#pragma once

#include <cstdint>

#include "cuda/kernels/a2a/a2a_layout.cuh"
#include "cuda/kernels/sync.cuh"

namespace epx::detail {

// The workspace of every rank plus what the flag targets need. Part of every a2a params struct.
struct A2aSymm {
  char* local;
  char* peers[kMaxRanks];         // peers[rank] == local
  uint32_t peer_ctas[kMaxRanks];  // C_p: CTAs of rank p's kernels
  A2aLayout layout;
};

// Thread 0 advances this CTA's epoch counter (only CTA blockIdx.x touches slot blockIdx.x; every
// CTA of every call does it once, so all CTAs and all ranks agree on e). Returns e to all threads.
__device__ __forceinline__ uint32_t a2a_next_epoch(uint32_t* epochs) {
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) {
    const uint32_t e = epochs[blockIdx.x] + 1;
    epochs[blockIdx.x] = e;
    s_epoch = e;
  }
  __syncthreads();
  return s_epoch;
}

// Walks the pairs (row, vector) of `num_rows` rows of `nv` vectors, row-major, thread-strided:
// pair i = threadIdx.x + k * blockDim.x. Advancing by blockDim.x pairs is one add and one
// compare (the stride is split into whole rows + remainder once).
struct RowWalker {
  int64_t row, vec;  // current pair
  int64_t step_rows, step_vecs;
  int64_t nv;
  __device__ __forceinline__ RowWalker(int64_t nv_, int64_t start) : nv(nv_) {
    row = start / nv_;
    vec = start - row * nv_;
    step_rows = blockDim.x / nv_;
    step_vecs = blockDim.x - step_rows * nv_;
  }
  __device__ __forceinline__ void advance() {
    row += step_rows;
    vec += step_vecs;
    if (vec >= nv) {
      vec -= nv;
      ++row;
    }
  }
};

}  // namespace epx::detail
