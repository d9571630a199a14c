// src/cuda/kernels/ht/common.cuh — small device pieces shared by the ht kernels: expert ids,
// prefix-matrix arithmetic, and the end-of-operation protocol (last CTA resets the block
// counters, advances the sequence number and tells every peer its region is free again).
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/ht_params.cuh"
#include "cuda/kernels/ht/trace.cuh"

namespace epx::detail {

inline constexpr int kHtThreads = 512;  // dispatch / combine CTA size (16 warps)
inline constexpr int kHtWarps = kHtThreads / 32;
inline constexpr int kNotifyThreads = 1024;
inline constexpr int kCopyUnroll = 8;  // 16-byte vectors in flight per lane in row copies

// Expert id k of token t in a [T, K] int64 / int32 topk_idx, rows `stride` elements apart.
__device__ __forceinline__ int64_t ht_load_expert(const void* topk, int64_t stride, int is_i64,
                                                  int64_t t, int k) {
  return is_i64 ? static_cast<const int64_t*>(topk)[t * stride + k]
                : static_cast<const int32_t*>(topk)[t * stride + k];
}

__device__ __forceinline__ WaitContext with_op(WaitContext w, uint32_t op) {
  w.op = op;
  return w;
}

// flags(peer)[rank] = value on every peer, one release store each; `flags` names the flag array
// (&HtRegion::ready, &HtRegion::yready). One thread; the caller fences before as it needs.
__device__ __forceinline__ void signal_peers(const HtSymm& symm,
                                             uint32_t* (HtRegion::*flags)(char*) const,
                                             int num_ranks, int rank, uint32_t value) {
  for (int p = 0; p < num_ranks; ++p)
    if (p != rank) st_release_sys((symm.region.*flags)(symm.peers[p]) + rank, value);
}

// Called by every thread of every CTA at the very end of an operation that used the symmetric
// region. The last CTA to arrive runs `reset_counters` (all its threads), then publishes
// seq = cur locally and ready[rank] = cur on every peer: the release that pairs with the
// wait_flag<true>(ready[rank], cur) of the peer's next operation before it writes to us.
// kReadyDeferred (zero-copy dispatch): recv_x is a view of this region, so the signal waits for
// the rank's next ht op (state->ready_pending, publish_deferred_ready).
enum HtReady : int { kReadyNow = 0, kReadyDeferred = 2 };
// wait_peers (zero-copy combine, whose peers read this rank's memory): after the ready signal,
// also wait until every peer finished the op, so the memory is free when the kernel ends.
template <typename ResetFn>
__device__ void finish_operation(const HtSymm& symm, const WaitContext& w, uint32_t cur,
                                 int num_ranks, ResetFn reset_counters, int ready = kReadyNow,
                                 bool wait_peers = false) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(&w.state->finished, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  reset_counters();
  __syncthreads();
  if (threadIdx.x == 0) {
    w.state->finished = 0;
    w.state->seq = cur;
    if (ready == kReadyDeferred) {
      w.state->ready_pending = cur;
      w.state->ready_pending_set = 1u;
    }
    __threadfence();
    if (ready == kReadyNow) signal_peers(symm, &HtRegion::ready, num_ranks, w.rank, cur);
    for (int p = 0; p < num_ranks && wait_peers; ++p) {
      if (p == w.rank) continue;
      if (!wait_flag<true>(symm.region.ready(symm.local) + p, cur, w, kWaitReady, p)) break;
    }
  }
}

// The finishing CTA's reset of this rank's per-block counters (every thread): the blocks of each
// source slot slot_of(q, rank), counting the rows q sent this rank (dispatch) or, when
// `rows_went_out`, the rows this rank sent q (combine: they come back through that slot).
__device__ __forceinline__ void zero_block_counters(const HtSymm& symm, const int32_t* rpm,
                                                    int num_ranks, int rank, bool rows_went_out) {
  for (int q = 0; q < num_ranks; ++q) {
    if (q == rank) continue;
    const int32_t rows = rows_went_out ? rows_between(rpm, num_ranks, rank, q)
                                       : rows_between(rpm, num_ranks, q, rank);
    const int64_t nb = (rows + kHtRowsPerBlock - 1) / kHtRowsPerBlock;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x)
      *symm.region.counter(symm.local, HtRegion::slot_of(q, rank), b) = 0u;
  }
}

// At the start of every ht op that communicates, by one thread (thread 0 of CTA 0; lane 0 of the
// engine-sync warp), before it waits for anything: the ready signal a zero-copy dispatch deferred.
// Every earlier kernel and copy on the stream (the readers of the zero-copy recv_x) has finished.
// Only the next op's own threads touch ready_pending, the finishing CTA after every CTA passed
// this.
__device__ __forceinline__ void publish_deferred_ready(const HtSymm& symm, const WaitContext& w,
                                                       int num_ranks) {
  if (*reinterpret_cast<volatile uint32_t*>(&w.state->ready_pending_set) == 0u) return;
  const uint32_t pending = *reinterpret_cast<volatile uint32_t*>(&w.state->ready_pending);
  w.state->ready_pending_set = 0u;
  __threadfence_system();
  signal_peers(symm, &HtRegion::ready, num_ranks, w.rank, pending);
}

// Before the first write into peer p's region in operation `cur`: p finished operation cur - 1
// (pairs with the st_release_sys in p's finish_operation). One thread per peer.
__device__ __forceinline__ bool wait_peer_ready(const HtSymm& symm, const WaitContext& w, int p,
                                                uint32_t cur) {
  return wait_flag<true>(symm.region.ready(symm.local) + p, cur - 1, w, kWaitReady, p);
}

// The per-call agreement of the cached dispatch and the combine (docs/semantics.md §4.2): a
// source's format word (ht_call_format), stored by the source before the signals its rows are
// acquired with (ht_region.cuh: callword), against this rank's, read once that signal was
// acquired. A difference is recorded (kDevErrHtCallDiffers, the field kHtCallFormat, the peer)
// and aborts the kernel's waits: the outputs are undefined and ht needs reset().
__device__ __forceinline__ void store_call_word(uint32_t* word, uint32_t value) {
  *reinterpret_cast<volatile uint32_t*>(word) = value;
  __threadfence_system();  // before any signal of this thread's CTA (after its __syncthreads)
}
__device__ __forceinline__ bool call_word_matches(const WaitContext& w, const uint32_t* word,
                                                  uint32_t mine, int peer) {
  const uint32_t theirs = ld_landed(word);
  if (theirs == mine) return true;
  record_error(w, kDevErrHtCallDiffers, peer,
               static_cast<int64_t>(static_cast<uint64_t>(kHtCallFormat) << 32 | theirs),
               static_cast<int64_t>(mine));
  atomicExch(&w.state->abort, 1u);
  return false;
}

}  // namespace epx::detail
