// src/cuda/kernels/a2a/resync.cuh — a2a set_active_ranks on the device: apply a new rank mask and
// bring the active ranks back to one set of epochs, e.g. after a Timeout left them at different
// points of a dispatch / combine (one rank may have completed a phase that another abandoned).
//
// One CTA on the stream given to set_active_ranks, generation g (the host's count of
// set_active_ranks calls; every active rank makes the same calls), A = the active ranks:
//   0. thread 0: clear the kernel-wide abort word, the error claim and the host error record (a
//      timed-out earlier kernel left them set; stream order: every earlier kernel has exited).
//   1. round 1, thread q in A \ {r}: sync(q)->active_mask[r] = mask; st_release_sys
//      sync(q)->resync[r] = 2g - 1; then wait local resync[q] >= 2g - 1 (2x the group timeout):
//      q's earlier kernels have exited too. Compare q's published mask with ours
//      (kDevErrA2aMask on a difference). Before the round each rank also publishes its mask in
//      its own region (own_mask, then own_generation = g, release); a waiter that finds q at a
//      generation >= g with a mask that does not count r stops waiting, records kDevErrA2aMask
//      and sets the abort word (its sibling threads stop too): q will never answer it (q counts
//      only its own members; masks only shrink), so it raises InvalidArgument at once instead
//      of Timeout. A rank that recorded a difference skips steps 2 and 3.
//   2. reset everything the epochs count, locally: dispatch_epoch / combine_epoch of every CTA,
//      entered / dispatch_flag / combine_flag of every source, and inactive_mask = ~mask. Nobody
//      writes them now: active peers are inside this kernel, inactive ones are gone (contract).
//   3. round 2, thread q in A \ {r}: fence + st_release_sys sync(q)->resync[r] = 2g; wait local
//      resync[q] >= 2g. Past it, every active rank has finished step 2, so the next dispatch's
//      first signal into a peer cannot be wiped by that peer's reset.
// A timeout in a round is recorded (op kOpA2aResync) and raised by check(); the object then
// stays unusable until the next set_active_ranks.
#pragma once

#include "cuda/kernels/a2a/common.cuh"

namespace epx::detail {

struct A2aResyncParams {
  A2aSymm symm;
  WaitContext wait;          // op kOpA2aResync, timeout 2x the group's
  DeviceErrorRecord* error;  // mapped pinned host record (cleared in step 0)
  uint64_t active_mask;      // bit p = rank p active (this rank's bit set)
  uint32_t generation;       // g >= 1
  int32_t num_ranks;
  int32_t rank;
};

// One round: publish `value` into every active peer's resync[r], wait for theirs. False if a
// wait failed (recorded). `first`: round 1, whose wait gives up on a peer whose own mask of this
// generation (or a later one) leaves this rank out.
__device__ __forceinline__ bool a2a_resync_round(const A2aResyncParams& p, uint32_t value,
                                                 bool first) {
  const A2aLayout& g = p.symm.layout;
  const uint64_t skipped = ~p.active_mask | (uint64_t{1} << p.rank);
  const int q = threadIdx.x;
  if (q < p.num_ranks && !rank_skipped(skipped, q)) {
    A2aSync* peer = g.sync(p.symm.peers[q]);
    peer->active_mask[p.rank] = p.active_mask;
    fence_acq_rel_sys();  // cumulative over the other threads' step-2 stores (__syncthreads)
    st_release_sys(&peer->resync[p.rank], value);  // pairs with the peer's wait below
  }
  bool ok = true;
  if (q < p.num_ranks && !rank_skipped(skipped, q)) {
    auto left_out = [&] {
      if (!first) return false;
      A2aSync* theirs = g.sync(p.symm.peers[q]);
      if (!seq_reached(ld_acquire_sys(&theirs->own_generation), p.generation)) return false;
      const uint64_t m = *reinterpret_cast<volatile uint64_t*>(&theirs->own_mask);
      if ((m >> p.rank) & 1u) return false;
      record_error(p.wait, kDevErrA2aMask, q, static_cast<int64_t>(p.active_mask),
                   static_cast<int64_t>(m));
      atomicExch(&p.wait.state->abort, 1u);  // the threads waiting for other peers stop too
      return true;
    };
    ok =
        wait_flag<true>(&g.sync(p.symm.local)->resync[q], value, p.wait, kWaitBarrier, q, left_out);
  }
  return __syncthreads_and(ok) != 0;
}

__global__ void __launch_bounds__(kA2aThreads) a2a_resync_kernel(A2aResyncParams p) {
  const A2aLayout& g = p.symm.layout;
  A2aState* state = g.state(p.symm.local);
  A2aSync* sync = g.sync(p.symm.local);

  // 0. Re-arm error reporting and the waits.
  if (threadIdx.x == 0) {
    state->dev.abort = 0;
    state->dev.error_claim = 0;
    volatile DeviceErrorRecord* rec = p.error;
    rec->code = kDevErrNone;
    __threadfence_system();
    sync->own_mask = p.active_mask;
    st_release_sys(&sync->own_generation, p.generation);  // pairs with round 1's left_out
  }
  __syncthreads();

  // 1. Round 1, then compare the masks the active peers apply.
  if (!a2a_resync_round(p, 2 * p.generation - 1, true)) return;
  const int q = threadIdx.x;
  bool differs = false;
  if (q < p.num_ranks && q != p.rank && ((p.active_mask >> q) & 1u)) {
    const uint64_t theirs = *reinterpret_cast<volatile uint64_t*>(&sync->active_mask[q]);
    if (theirs != p.active_mask) {
      record_error(p.wait, kDevErrA2aMask, q, static_cast<int64_t>(p.active_mask),
                   static_cast<int64_t>(theirs));
      differs = true;
    }
  }
  // A rank that sees a difference stops here (the record keeps the object unusable until the
  // next set_active_ranks). Round 2 would wait for members that may have given up in round 1;
  // and no rank without a difference waits for it there: all of that rank's members published
  // its mask, so this rank, one of them, would have seen none.
  if (__syncthreads_or(differs)) return;

  // 2. Reset the epochs and every flag they are compared with.
  for (int b = threadIdx.x; b < kMaxA2aCtas; b += blockDim.x) {
    state->dispatch_epoch[b] = 0;
    state->combine_epoch[b] = 0;
  }
  for (int s = threadIdx.x; s < kMaxRanks; s += blockDim.x) {
    sync->entered[s] = 0;
    sync->dispatch_flag[s] = 0;
    sync->combine_flag[s] = 0;
  }
  if (threadIdx.x == 0) state->inactive_mask = ~p.active_mask;
  __syncthreads();

  // 3. Round 2: every active rank finished its reset.
  a2a_resync_round(p, 2 * p.generation, false);
}

}  // namespace epx::detail
