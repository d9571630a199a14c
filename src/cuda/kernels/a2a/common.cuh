// src/cuda/kernels/a2a/common.cuh — device pieces shared by the a2a kernels: the workspace as
// the kernels see it (A2aSymm), per-CTA epochs, the completion counters, and a row walker that
// spreads (row, vector) pairs of a block of rows over a CTA without per-element division.
//
// Signalling (sync.cuh vocabulary), per CTA and destination p:
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

// Bit p set: rank p is skipped by a2a_signal / a2a_wait_all (inactive ranks, and this rank
// where it does not signal itself).
__device__ __forceinline__ bool a2a_skipped(uint64_t skip_mask, int p) {
  return (skip_mask >> p) & 1u;
}

// Thread p < R (bit p of skip_mask clear) releases this CTA's stores to rank p:
// *counter_of(p) += 1. Call after __syncthreads() so the fence covers every thread's stores
// (cumulativity).
template <typename CounterOf>
__device__ __forceinline__ void a2a_signal(int num_ranks, uint64_t skip_mask, CounterOf counter_of) {
  const int p = threadIdx.x;
  if (p < num_ranks && !a2a_skipped(skip_mask, p)) {
    fence_acq_rel_sys();
    red_add_relaxed_sys(counter_of(p), 1u);
  }
}

// Thread s < R (bit s of skip_mask clear) waits until local counter[s] reached e * C_s (a
// completion counter, per_cta) or e (an epoch flag); returns false on the whole CTA when any wait
// timed out or the kernel aborted (then the CTA must exit). Skipped ranks are never read.
__device__ __forceinline__ bool a2a_wait_all(const uint32_t* counter, const A2aSymm& symm,
                                             int num_ranks, uint64_t skip_mask, uint32_t e,
                                             bool per_cta, const WaitContext& w, uint32_t what) {
  bool ok = true;
  const int s = threadIdx.x;
  if (s < num_ranks && !a2a_skipped(skip_mask, s)) {
    const uint32_t want = per_cta ? e * symm.peer_ctas[s] : e;
    ok = wait_flag<true>(counter + s, want, w, what, s);
  }
  return __syncthreads_and(ok) != 0;  // also the barrier that orders the CTA's later loads
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

// Read-only input (not written during the kernel): non-coherent path.
template <typename V>
__device__ __forceinline__ V a2a_ld_input(const void* p) {
  return __ldg(static_cast<const V*>(p));
}
// Data a peer (or another CTA) wrote after an acquire, or peer memory: L2, never a stale L1 line.
template <typename V>
__device__ __forceinline__ V a2a_ld_landed(const void* p) {
  return __ldcg(static_cast<const V*>(p));
}

}  // namespace epx::detail
