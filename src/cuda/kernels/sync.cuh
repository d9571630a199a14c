// src/cuda/kernels/sync.cuh — the memory-ordering vocabulary of every epx kernel, and the bounded
// wait. All cross-GPU signalling goes through these few helpers so each write can be paired with
// the read that consumes it:
//
//   producer: plain stores of the payload (any threads of the warp/CTA)
//             -> __syncwarp()/__syncthreads()   (orders the other threads' stores before ...)
//             -> fence_acq_rel_sys() + red_add_relaxed_sys(flag)   or   st_release_sys(flag)
//   consumer: wait_flag(flag, ...) (ld_acquire_sys until it holds) by one thread
//             -> __syncthreads()/__syncwarp()    (... the other threads' loads after it)
//             -> plain loads of the payload (ld_landed: L2, never a stale L1 line)
//
// Flags are 32-bit and compared wrap-safely (seq_reached). Waits are bounded by the group timeout
// (ns, %globaltimer); on timeout the waiter records who it waited for (DeviceErrorRecord), sets
// the kernel-wide abort word so other waits stop too, and returns false. No trap. One flag per
// rank with one thread per rank (ll, a2a): signal_ranks / wait_ranks. What a wait awaits and what
// an error reports (DeviceWait, DeviceOp, DeviceErrorCode, WaitContext): cuda/device_error.h.
#pragma once

#include <cstdint>

#include "cuda/device_error.h"

namespace epx::detail {

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A flag written by another kernel of this GPU (the ll overlapped combine's GEMM signals).
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
// The release fence where every thread that acquires the flag runs on this GPU (`gpu`: one GPU
// holds every rank's buffers; its acquires at system scope include this GPU's): gpu scope, else
// system scope.
__device__ __forceinline__ void fence_acq_rel(bool gpu) {
  if (gpu)
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  else
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}
// With a preceding fence_acq_rel_sys() in the same thread this is a release (PTX "release
// pattern"); the fence is cumulative over stores ordered before it by __syncwarp/__syncthreads.
__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Lets the next kernel on the stream, launched with programmatic dependent launch, start now
// (it must not read this kernel's outputs without its own griddepcontrol.wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// First instruction of a kernel that may be launched with programmatic dependent launch
// (cuda/launch.h; `pdl` = the launch used it): wait until the previous kernel on the stream
// completed and its memory is visible, then let the next kernel launch early (it waits the same
// way). Without PDL nothing (griddepcontrol.wait would return at once).
__device__ __forceinline__ void pdl_begin(int pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    pdl_launch_dependents();
  }
#else
  (void)pdl;
#endif
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Wait-cost statistics (docs/semantics.md §2.5): adds the nanoseconds since `start` (a
// globaltimer_ns() reading of this thread) to *acc.
__device__ __forceinline__ void add_wait_ns(int64_t* acc, uint64_t start) {
  const uint64_t now = globaltimer_ns();
  atomicAdd(reinterpret_cast<unsigned long long*>(acc),
            static_cast<unsigned long long>(now > start ? now - start : 0));
}

// Sequence numbers wrap at 2^32: `seen` has reached `want` if it is not behind it.
__device__ __forceinline__ bool seq_reached(uint32_t seen, uint32_t want) {
  return static_cast<int32_t>(seen - want) >= 0;
}

// Fills the record (WaitContext, device_error.h: part of every kernel's params); the caller
// claimed it (error_claim).
__device__ __forceinline__ void write_record(const WaitContext& ctx, uint32_t code, int32_t peer,
                                             int64_t a, int64_t b) {
  volatile DeviceErrorRecord* rec = ctx.error;
  rec->op = ctx.op;
  rec->rank = ctx.rank;
  rec->peer = peer;
  rec->a = a;
  rec->b = b;
  __threadfence_system();
  rec->code = code;  // read by BufferImpl::check() on the host
  __threadfence_system();
}

__device__ __forceinline__ void record_error(const WaitContext& ctx, uint32_t code, int32_t peer,
                                             int64_t a, int64_t b) {
  if (atomicCAS(&ctx.state->error_claim, 0u, 1u) != 0u) return;  // someone else reported first
  write_record(ctx, code, peer, a, b);
}

// A timed-out wait (what: DeviceWait, b: as the record's): the record when this is the first
// error, else, when it is the first timeout, DeviceState's lost_* fields (the host reports the
// earlier error's code and this wait); then the abort word, so every other wait stops too.
__device__ __forceinline__ void record_timeout(const WaitContext& ctx, int32_t peer, int64_t what,
                                               int64_t b) {
  if (atomicCAS(&ctx.state->error_claim, 0u, 1u) == 0u) {
    write_record(ctx, kDevErrTimeout, peer, what, b);
  } else if (atomicCAS(&ctx.state->lost_claim, 0u, 1u) == 0u) {
    volatile DeviceState* st = ctx.state;
    st->lost_what = static_cast<uint32_t>(what);
    st->lost_peer = peer;
    st->lost_b = b;
    st->lost_what_hi = static_cast<uint32_t>(static_cast<uint64_t>(what) >> 32);
  }
  __threadfence();
  atomicExch(&ctx.state->abort, 1u);
}

// The default of wait_flag's `give_up`: wait until the flag, the abort word or the timeout.
struct NeverGiveUp {
  __device__ bool operator()() const { return false; }
};

// The default of wait_flag's `on_timeout`: record the timeout (b: the value wanted in the high
// half, the value last seen in the low half, for the message) and set the abort word, so every
// other wait of this rank stops too.
struct RecordTimeout {
  __device__ void operator()(const WaitContext& ctx, uint32_t what, int32_t peer, uint32_t want,
                             uint32_t seen) const {
    record_timeout(ctx, peer, what,
                   static_cast<int64_t>((static_cast<uint64_t>(want) << 32) | seen));
  }
};

// Spins until *flag (read with acquire) satisfies seq_reached(*flag, want) for kSeq, or equals
// `want` otherwise. Returns false on timeout (after `on_timeout(ctx, what, peer, want, seen)`) or
// abort, or when `give_up()` (asked every 64 spins, after the abort word) returns true — it
// records its own error; never traps.
template <bool kSeq, typename GiveUp = NeverGiveUp, typename OnTimeout = RecordTimeout>
__device__ bool wait_flag(const uint32_t* flag, uint32_t want, const WaitContext& ctx,
                          uint32_t what, int32_t peer, GiveUp give_up = {},
                          OnTimeout on_timeout = {}) {
  auto ok = [&](uint32_t v) { return kSeq ? seq_reached(v, want) : v == want; };
  uint32_t v = ld_acquire_sys(flag);
  if (ok(v)) return true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    v = ld_acquire_sys(flag);
    if (ok(v)) return true;
    if ((spins & 63u) == 63u) {
      if (*reinterpret_cast<volatile uint32_t*>(&ctx.state->abort)) return false;
      if (give_up()) return false;
      if (globaltimer_ns() - start > ctx.timeout_ns) {
        on_timeout(ctx, what, peer, want, v);
        return false;
      }
    }
  }
}

// ---- one flag per rank, one thread per rank (ll and a2a) ----------------------------------------
// A rank mask (bit p = rank p) leaves ranks out: inactive ranks (a2a), and this rank where it
// does not signal itself.

__device__ __forceinline__ uint64_t rank_bit(int p) {
  return uint64_t{1} << p;
}
__device__ __forceinline__ bool rank_skipped(uint64_t skip_mask, int p) {
  return (skip_mask >> p) & 1u;
}

// Thread first + p, p < num_ranks (bit p of skip_mask clear), releases this CTA's earlier stores
// to rank p: *counter_of(p) += 1. Call after __syncthreads() so the fence covers every thread's
// stores (cumulativity). `first` > 0: threads that the work after the call leaves idle, so the
// fence holds no warp that has work. `one_gpu`: every rank is on this GPU (fence_acq_rel).
template <typename CounterOf>
__device__ __forceinline__ void signal_ranks(int num_ranks, uint64_t skip_mask,
                                             CounterOf counter_of, int first = 0,
                                             bool one_gpu = false) {
  const int p = static_cast<int>(threadIdx.x) - first;
  if (p >= 0 && p < num_ranks && !rank_skipped(skip_mask, p)) {
    fence_acq_rel(one_gpu);
    red_add_relaxed_sys(counter_of(p), 1u);
  }
}

// Thread s < num_ranks (bit s of skip_mask clear) waits until local flag[s] reached want_of(s)
// (seq_reached); false on the whole CTA when a wait timed out or the kernel aborted (then the CTA
// must leave). Skipped ranks are never read. Also the barrier that orders the CTA's later loads
// after the acquire. `wait_ns` (optional, [num_ranks] int64): thread s adds the nanoseconds from
// its start until it saw flag[s] ready to wait_ns[s] (not when its wait failed); null costs one
// branch.
template <typename WantOf>
__device__ __forceinline__ bool wait_ranks(const uint32_t* flag, int num_ranks, uint64_t skip_mask,
                                           WantOf want_of, const WaitContext& w, uint32_t what,
                                           int64_t* wait_ns = nullptr) {
  bool ok = true;
  const int s = threadIdx.x;
  if (s < num_ranks && !rank_skipped(skip_mask, s)) {
    if (wait_ns == nullptr) {
      ok = wait_flag<true>(flag + s, want_of(s), w, what, s);
    } else {
      const uint64_t start = globaltimer_ns();
      ok = wait_flag<true>(flag + s, want_of(s), w, what, s);
      if (ok) add_wait_ns(wait_ns + s, start);
    }
  }
  return __syncthreads_and(ok) != 0;
}

// ---- the payload loads of the consumer side
// ------------------------------------------------------

// Read-only input (not written during the kernel): non-coherent path.
template <typename V>
__device__ __forceinline__ V ld_input(const V* p) {
  return __ldg(p);
}
template <typename V>
__device__ __forceinline__ V ld_input(const void* p) {
  return __ldg(static_cast<const V*>(p));
}
// Data another rank (or another CTA) wrote during this operation, read after an acquire, or
// peer memory: L2, never a stale L1 line.
template <typename V>
__device__ __forceinline__ V ld_landed(const V* p) {
  return __ldcg(p);
}
template <typename V>
__device__ __forceinline__ V ld_landed(const void* p) {
  return __ldcg(static_cast<const V*>(p));
}

}  // namespace epx::detail
