// src/cuda/kernels/ll/common.cuh — device pieces shared by the ll kernels: the region as the
// kernels see it (LlSymm), 8-element bf16 loads and stores with an unaligned fallback and an
// ordered block-wide compaction.
//
// Signalling (sync.cuh vocabulary: signal_ranks / wait_ranks, this rank's bit skipped where it
// does not signal itself):
//   all threads: plain stores to rank p            -> __syncthreads()
//   thread p:    fence_acq_rel(one_gpu) + red_add_relaxed_sys(&sync(p)->X[q][rank], 1) (release)
//   receiver:    thread s waits ld_acquire_sys(&sync(local)->X[q][s]) >= e * C
//                -> __syncthreads() -> plain (L2) loads of what s wrote.
// Every CTA adds exactly once per operation of slot q, so after the e-th it is e * C (mod 2^32,
// compared with seq_reached); nothing is ever reset.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "cuda/tuning.h"
#include "cuda/kernels/ll/ll_layout.cuh"
#include "cuda/kernels/ll/trace.cuh"
#include "cuda/kernels/sync.cuh"

namespace epx::detail {

// Every rank's region. Part of every ll params struct; in LlCombineParams right after the fields
// its first path reads, so that `local` (the epoch words and flags, at fixed offsets) shares a
// constant-cache line with them, and the first peers with `local` (docs/design.md §7.3,
// Parameters).
struct LlSymm {
  char* local;
  int32_t shrink;  // BufferConfig::enable_shrink: the rank mask applies, a timed-out wait masks
  int32_t one_gpu;  // every rank's buffers on this GPU (R = 1, or ranks sharing one device): the
                    // releases' fences at gpu scope (sync.cuh fence_acq_rel)
  char* peers[kMaxRanks];  // peers[rank] == local
  LlLayout layout;
};

// ---- the rank mask (enable_shrink, docs/semantics.md §2.6) -------------------------------------
//
// A CTA reads the mask once per phase (ll_masked_uniform) and skips the ranks in it: no stores,
// signals or waits for them. Its waits (ll_wait_ranks, ll_wait_or_mask) mask a peer they time out
// on (atomicOr: no error record, no abort word) and stop waiting for a peer masked meanwhile;
// the CTA then reads the mask again and goes on without it. Another CTA of the same kernel may
// have seen that peer's flag just before: where CTAs share outputs (the dispatch receive's units
// of one expert) they agree on the mask first (dispatch.cuh); elsewhere each CTA's outputs are
// consistent on their own (a combine token's terms, a send's signals). Without enable_shrink the
// mask is 0 and every wait is the plain bounded one (a timeout is an error).

// The kernel's dynamic shared memory (the combine: the overlapped send's ranges, or LogFMT's
// table and meta words; never both).
__device__ __forceinline__ unsigned char* ll_dyn_smem() {
  extern __shared__ __align__(16) unsigned char ll_dyn_smem_bytes[];
  return ll_dyn_smem_bytes;
}

// kShrink (here and in ll_wait_ranks): false in a kernel instantiation that the host launches
// only for groups without enable_shrink (symm.shrink == 0, the dispatch's), so the mask code is
// not compiled in; true where symm.shrink decides at run time.
//
// The mask now (0 without enable_shrink), the same value for every thread of the CTA (block-wide:
// every thread must call it).
template <bool kShrink = true>
__device__ __forceinline__ uint64_t ll_masked_uniform(const LlSymm& symm) {
  if (!kShrink || !symm.shrink) return 0;  // uniform: a kernel argument
  __shared__ uint64_t s_masked;
  __syncthreads();  // a previous call's value is read by every thread before it is replaced
  if (threadIdx.x == 0)
    s_masked = *reinterpret_cast<volatile unsigned long long*>(symm.layout.mask(symm.local));
  __syncthreads();
  return s_masked;
}

// One thread's wait for flag >= want from rank `peer` (!= this rank) with enable_shrink: true
// when it was reached; false when the wait timed out (it then masks `peer`) or found `peer`
// masked meanwhile.
__device__ __forceinline__ bool ll_wait_or_mask(const LlSymm& symm, const uint32_t* flag,
                                                uint32_t want, const WaitContext& w, uint32_t what,
                                                int peer) {
  unsigned long long* mask = symm.layout.mask(symm.local);
  const unsigned long long bit = 1ull << peer;
  return wait_flag<true>(
      flag, want, w, what, peer,
      [&] { return (*reinterpret_cast<volatile unsigned long long*>(mask) & bit) != 0; },
      [&](const WaitContext&, uint32_t, int32_t, uint32_t, uint32_t) { atomicOr(mask, bit); });
}

// ---- teams: whole warps of the CTA that run one phase on their own barrier ---------------------
//
// The fused dispatch (dispatch.cuh: both halves in one launch, no enable_shrink) sends on warps
// 0-7 while warps 8-15 store the routing rows, then scan and list the receive's rows; every other
// phase of every ll kernel runs on the whole CTA (ll_team_all). A team is threads
// [first, first + count) with hardware barrier `bar` (0, __syncthreads' own, for the whole CTA):
// team code uses tid() and count where block code uses threadIdx.x and blockDim.x.
struct LlTeam {
  int first;
  int count;
  int bar;
  __device__ __forceinline__ int tid() const { return static_cast<int>(threadIdx.x) - first; }
  __device__ __forceinline__ void sync() const {
    asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(count) : "memory");
  }
  // A barrier of the team: whether `pred` held on all of its threads.
  __device__ __forceinline__ bool all(bool pred) const {
    int r;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.s32 p, %1, 0;\n\tbar.red.and.pred q, %2, %3, p;\n"
        "\tselp.s32 %0, 1, 0, q;\n\t}"
        : "=r"(r)
        : "r"(static_cast<int>(pred)), "r"(bar), "r"(count)
        : "memory");
    return r != 0;
  }
};
__device__ __forceinline__ LlTeam ll_team_all() {
  return {0, static_cast<int>(blockDim.x), 0};
}
// `t` as values the compiler cannot follow back to the choice that made them, so code that runs
// on either team is compiled once, not once per team.
__device__ __forceinline__ LlTeam ll_team_opaque(LlTeam t) {
  asm volatile("mov.b32 %0, %0;" : "+r"(t.first));
  asm volatile("mov.b32 %0, %0;" : "+r"(t.count));
  asm volatile("mov.b32 %0, %0;" : "+r"(t.bar));
  return t;
}

// wait_ranks for the ll protocols (every thread of `team` calls it): thread s < R of the team, s
// not in `skip`, waits local flag[s] >= want_of(s). With enable_shrink a peer's wait masks instead
// of failing (ll_wait_or_mask); this rank's own (me) fails as without it. False (on the whole
// team) when a wait failed; `wait_ns` as wait_ranks', with enable_shrink also for a peer masked
// while it was awaited (the time until then). Also the team's barrier that orders its later loads
// after the acquires.
template <bool kShrink = true, typename WantOf>
__device__ __forceinline__ bool ll_wait_ranks(const LlTeam& team, const LlSymm& symm, int me,
                                              const uint32_t* flag, uint64_t skip, WantOf want_of,
                                              const WaitContext& w, uint32_t what,
                                              int64_t* wait_ns = nullptr) {
  const int R = symm.layout.num_ranks;
  const int s = team.tid();
  bool ok = true;
  if (s < R && !rank_skipped(skip, s)) {
    const uint64_t start = wait_ns ? globaltimer_ns() : 0;
    if (!kShrink || !symm.shrink || s == me)
      ok = wait_flag<true>(flag + s, want_of(s), w, what, s);
    else
      ll_wait_or_mask(symm, flag + s, want_of(s), w, what, s);
    if (ok && wait_ns) add_wait_ns(wait_ns + s, start);
  }
  return team.all(ok);
}

// ---- loads and stores ----------------------------------------------------------------------

// 8 bf16 at p; `vec16`: p is 16-byte aligned. kLanded: coherent (L2) loads, for data written
// during the kernel (peers' rows, the overlapped combine's GEMM output); else the non-coherent
// path of the kernel's read-only inputs.
template <bool kLanded>
__device__ __forceinline__ uint4 ll_ld8(const uint16_t* p, bool vec16) {
  if (vec16) return kLanded ? ld_landed<uint4>(p) : __ldg(reinterpret_cast<const uint4*>(p));
  uint16_t h[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = kLanded ? __ldcg(p + i) : __ldg(p + i);
  uint4 v;
  memcpy(&v, h, 16);
  return v;
}

// Read-only input of the kernel (x, y, topk_idx, weights): non-coherent path.
__device__ __forceinline__ uint4 ll_ld_input8(const uint16_t* p, bool vec16) {
  return ll_ld8<false>(p, vec16);
}

__device__ __forceinline__ void ll_st8(uint16_t* p, const uint4& v, bool vec16) {
  if (vec16) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  uint16_t h[8];
  memcpy(h, &v, 16);
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = h[i];
}

__device__ __forceinline__ void ll_bf16x8_to_f32(const uint4& v, float* f) {
  uint16_t h[8];
  memcpy(h, &v, 16);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = bf16_to_f32(h[i]);
}

// Expert id k of token t, widened; `is_i64` selects the element type (row stride in elements,
// innermost stride 1).
__device__ __forceinline__ int64_t ll_topk_at(const void* topk, bool is_i64, int64_t stride,
                                              int64_t t, int k) {
  return is_i64 ? static_cast<int64_t>(__ldg(static_cast<const long long*>(topk) + t * stride + k))
                : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(topk) + t * stride + k));
}

// Copy of `rows` rows of nv 16-byte vectors (8 bf16 each) over the CTA's warps. Items are (row m,
// chunk c) of 32 * kLlCopyBatch vectors, one warp each: `row(m, &src, &dst)` gives row m's source
// and destination (null: not copied) once per item, then lane i loads vectors i, i + 32, ... of
// the chunk together and stores them, so a lane's work per vector is a load and a store (an index
// division per vector made these copies instruction-bound at ≈ 17 GB/s per CTA: docs/perf.md
// §4.3); a full chunk has no per-vector bounds. `vec16`: every source row is 16-byte aligned
// (uniform); else each vector is loaded by ll_ld8's scalar path, one at a time, outside the
// unrolled loop (inlined per vector it would put ≈ 8 times its code between the stores: the
// instruction fetch that the dispatch's copy paid, §4.3). kLanded as ll_ld8.
template <bool kLanded, typename Row>
__device__ __forceinline__ void ll_copy_rows(int rows, int nv, bool vec16, Row row) {
  constexpr int kChunk = 32 * kLlCopyBatch;
  const int chunks = (nv + kChunk - 1) / kChunk;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int w = threadIdx.x >> 5; w < rows * chunks; w += warps) {
    const int m = w / chunks;
    const int c0 = (w - m * chunks) * kChunk;  // the chunk's first vector
    const uint16_t* src;
    uint4* dst;
    row(m, &src, &dst);
    if (!dst) continue;
    if (!vec16) {
      const int end = min(nv, c0 + kChunk);
#pragma unroll 1
      for (int v = c0 + lane; v < end; v += 32)
        dst[v] = ll_ld8<kLanded>(src + 8 * int64_t{v}, false);
      continue;
    }
    const uint4* s4 = reinterpret_cast<const uint4*>(src) + c0 + lane;
    uint4* d4 = dst + c0 + lane;
    uint4 val[kLlCopyBatch];
    if (c0 + kChunk <= nv) {
#pragma unroll
      for (int u = 0; u < kLlCopyBatch; ++u)
        val[u] = kLanded ? ld_landed<uint4>(s4 + 32 * u) : __ldg(s4 + 32 * u);
#pragma unroll
      for (int u = 0; u < kLlCopyBatch; ++u) d4[32 * u] = val[u];
    } else {
      const int left = nv - c0 - lane;  // vector c0 + lane + 32u is in the row while 32u < left
#pragma unroll
      for (int u = 0; u < kLlCopyBatch; ++u)
        if (32 * u < left) val[u] = kLanded ? ld_landed<uint4>(s4 + 32 * u) : __ldg(s4 + 32 * u);
#pragma unroll
      for (int u = 0; u < kLlCopyBatch; ++u)
        if (32 * u < left) d4[32 * u] = val[u];
    }
  }
}

// One combine output vector (docs/semantics.md §2.3): acc[c] = the fma chain over k = 0 .. K-1 in
// order of w[k] * f_k[c], selections with src[k] == 0 skipped, from 0.0f; the caller rounds once.
// load(k) fetches selection k's data (kBatch selections in flight), decode(k, data, f) makes its
// 8 floats f_k.
template <int kBatch, typename Load, typename Decode>
__device__ __forceinline__ void ll_reduce8(int K, const uintptr_t* src, const float* w, Load load,
                                           Decode decode, float* acc) {
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
  for (int kb = 0; kb < K; kb += kBatch) {
    uint4 val[kBatch];
#pragma unroll
    for (int kk = 0; kk < kBatch; ++kk)
      if (kb + kk < K && src[kb + kk]) val[kk] = load(kb + kk);
#pragma unroll
    for (int kk = 0; kk < kBatch; ++kk) {
      if (kb + kk >= K || !src[kb + kk]) continue;
      float f[8];
      decode(kb + kk, val[kk], f);
      const float wk = w[kb + kk];
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = __fmaf_rn(wk, f[c], acc[c]);
    }
  }
}

// ---- team-wide helpers (every thread of the team must call them) ------------------------------

// For each i < n (uniform, <= kLlUnitGroup): the exclusive prefix of bit i of `flags` over the
// team in thread order (pos[i]) and the number of its threads with it set (total[i]); one barrier
// pair for all n. The warps' counts are scanned across the lanes (lane w holds warp w's count;
// four shuffle steps), not summed by every thread from shared memory. The kLlUnitGroup scans run
// together, step by step, with no branch on n between them (a unit i >= n scans zeros): each is a
// chain of dependent shuffles, and one after another (a branch each) they took ≈ 260 cycles a
// unit of the listing's chain (bench/sass_issue.py), together ≈ 210.
__device__ __forceinline__ void ll_block_scan_group(const LlTeam& team, uint32_t flags, int n,
                                                    int (&pos)[kLlUnitGroup],
                                                    int (&total)[kLlUnitGroup]) {
  static_assert(kLlWarps <= 32, "one lane per warp's count");
  __shared__ int s_warp[kLlUnitGroup][kLlWarps];
  const int lane = threadIdx.x & 31, warp = team.tid() >> 5, warps = team.count >> 5;
  uint32_t b[kLlUnitGroup];
#pragma unroll
  for (int i = 0; i < kLlUnitGroup; ++i) {
    b[i] = __ballot_sync(0xffffffffu, i < n && (flags >> i & 1));
    if (lane == 0) s_warp[i][warp] = __popc(b[i]);
  }
  team.sync();
  int c[kLlUnitGroup];  // inclusive over lanes <= this one
#pragma unroll
  for (int i = 0; i < kLlUnitGroup; ++i) c[i] = lane < warps ? s_warp[i][lane] : 0;
#pragma unroll
  for (int d = 1; d < kLlWarps; d <<= 1) {
#pragma unroll
    for (int i = 0; i < kLlUnitGroup; ++i) {
      const int u = __shfl_up_sync(0xffffffffu, c[i], d);
      if (lane >= d) c[i] += u;
    }
  }
#pragma unroll
  for (int i = 0; i < kLlUnitGroup; ++i) {
    const int all = __shfl_sync(0xffffffffu, c[i], kLlWarps - 1);  // lanes >= warps add 0
    const int before = __shfl_sync(0xffffffffu, c[i], warp > 0 ? warp - 1 : 0);
    pos[i] = (warp > 0 ? before : 0) + __popc(b[i] & ((1u << lane) - 1u));
    total[i] = all;
  }
  team.sync();  // s_warp may be rewritten by the next call
}

}  // namespace epx::detail
