// src/cuda/kernels/ll/dispatch.cuh — ll dispatch (docs/semantics.md §2.1-2.2): every rank sends
// each token ONCE to every rank that holds one of its experts (quantised once, on the sender), then
// every rank expands what it received into the expert-major outputs.
//
// Rank r, T tokens, C CTAs of kLlThreads, slot q (the host's call parity), epoch
// e = state.dispatch_epoch[q][b] + 1 (CTA b's word, read at its start; advanced by CTA b at the
// end of the receive half, so send and receive kernels of one dispatch agree on it).
//
// send half (epx::ll::dispatch with kLlPhaseSend: the call with a hook, a kernel of its own
// module, src/cuda/ll_send.cu; or both halves):
//   1. Threads d < R wait dispatch_freed[q][d] >= (e - 1) * C: rank d finished reading its
//      slot-q staging of the previous dispatch through q (normally long ago: a local flag read).
//   2. CTA 0: header {T, format} into staging(d, q, src = r) on every rank d.
//   3. CTA b, tokens t = b, b + C, ...: the routing row (ids outside [-1, E) are reported as
//      InvalidArgument and become -1) into topk(d, q, r)[t] on EVERY rank d, and the message into
//      msg(d, q, r, t) on every rank d that holds one of t's experts:
//        fp8:  per 128-channel group g (16 lanes of 8 elements): amax (core/numeric.h order),
//              scale = fp8_scale_from_amax, q_i = e4m3(x_i * (1 / scale)) (the hardware
//              conversion, f32x2_to_fp8x2_e4m3); bytes [H]
//              then f32 scales [G];
//        NVFP4: per 16-value block (2 lanes of 8 elements): amax, (sf, inv) =
//              nvfp4_block_scale(amax, g), 4 bytes of e2m1 pairs per lane (nvfp4_pack8; sm_90 has
//              no e2m1 conversion: core/quant.h's f32_to_e2m1 is the definition); e2m1 [H/2]
//              then the e4m3 scales [H/16], 4 per 32-bit store (lanes 8i gather them);
//              g is element 0 of x_global_scale (read once per CTA) or the host value;
//        bf16: the row as is.
//   4. Every CTA: release +1 into dispatch_sent[q][r] and dispatch_routed[q][r] of every rank (self
//      included; one fence).
// receive half (kLlPhaseRecv: the hook, or the second half without one):
//   Units (l, sub): local expert l, sub < S = max(1, C / L) CTAs sharing it; CTA b takes units
//   b, b + C, ... in groups of up to kLlUnitGroup that share each scan and copy round (more than
//   one only when L > C). A unit waits dispatch_sent[q][s] >= e * C for every s, then over the
//   concatenation "source 0's tokens t < T_0, source 1's, ..." in order, 512 entries at a time
//   (when R * T_max <= 512: every source's T_max slots in order, one round, each slot's T_s read
//   with its routing row, the slots t >= T_s left out; LlRecvSources):
//   (s, t) selects expert r * L + l (once, however often its row lists it) -> row = rows so far
//   (an ordered block-wide compaction), and row_map(s, q)[t][k0] = ll_row_entry(row, expert, e)
//   is stored on source s (k0: the first k of t's routing row listing the expert; s's combine
//   finds its rows there); the unit's share of rows (entries i = sub, sub + S, ...)
//   is written by warps taking 4 KB chunks of a message each (ll_dispatch_copy_entries):
//     recv_x[l][row] = msg bytes, recv_scales[l][g][row] (f32, or UE8M0 bytes packed 4 per int32
//     [l][g / 4][row]) = scales, src_info[l][row] = t; NVFP4: recv_x[l][row] = the e2m1 pairs,
//     and scales 4j..4j+3 (one 32-bit word) at byte l * pad128(RT) * H/16 +
//     nvfp4_sf_offset(row, 4j) of recv_scales (the interleaved layout, epx/ll.h);
//   sub 0 writes layout_range[l][s] = begin << 32 | count, recv_count[l], stats[l] += count.
//   Wait-cost statistics (docs/semantics.md §2.5; wait_stats non-null): CTA 0's thread s reads
//   %globaltimer when it starts waiting for dispatch_sent[q][s] and adds the nanoseconds until it
//   saw it reached to wait_stats[s] (atomicAdd; one wait per source per call: every unit waits
//   for the same counters at about the same time, so CTA 0's wait stands for all of them).
//   Every CTA then releases +1 into dispatch_freed[q][r] on every rank (its reads of the staging
//   are done: the senders may overwrite it once all C did; a CTA with units from its last
//   kMaxRanks threads right after its last copies, beside its layout writes) and sets its epoch
//   word to e.
// The fused launch (both halves, no enable_shrink) splits each CTA into two teams (LlTeam): warps
// 0-7 run steps 1 and 3 without the routing rows (x quantised and sent by 256 threads) while
// warps 8-15 (ll_dispatch_route) wait for dispatch_freed too, store the header (CTA 0) and the
// CTA's routing rows, arrive at the barrier that warps 0-7 pass before step 4 (so step 4's
// release covers the routing rows as well: a peer's hooked receive reads them after
// dispatch_sent alone) and release +1 into dispatch_routed[q][r] of every rank at once. In the
// receive, warps 8-15 wait dispatch_routed[q][s] >= e * C (the routing rows and headers, which
// every CTA stores by ~1.5 us, long before its messages), then scan and list, 256 entries per
// round; warps 0-7 wait dispatch_sent[q][s] >= e * C (the wait statistics time this one) and
// then join every copy round (a barrier of all 16 warps per round, its entries in shared
// memory), so the scan and the list overlap the quantisation, the stores and the flags' round
// trip instead of following them. The rows, their order and every output are the same.
// Rank mask (enable_shrink, common.cuh): the send skips the ranks this rank masks in steps 1-4
// (no wait, nothing written, no signal), and a step-1 wait that times out masks its rank; the
// receive neither waits for nor reads a masked source (0 tokens: layout_range count 0) and
// releases only the unmasked ranks; its CTAs agree on the mask first (ll_dispatch_recv_agree),
// so a peer masked during the call by one CTA's wait is absent from every expert's rows.
// Outputs are plain device tensors from the caller's allocator; null outputs are skipped (the
// host passes null when the allocator failed, so the collective still completes).
#pragma once

#include <type_traits>

#include "core/quant.h"
#include "cuda/kernels/ll/common.cuh"

namespace epx::detail {

struct LlDispatchParams {
  const uint16_t* x;  // [T, H] bf16, row stride x_stride elements, innermost 1
  int64_t x_stride;
  const void* topk_idx;  // [T, K] int32 / int64, row stride topk_stride elements
  int64_t topk_stride;
  int32_t topk_is_i64;
  int32_t num_tokens;  // T
  int32_t x_vec16;     // x rows are 16-byte aligned
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_ue8m0;
  int32_t use_nvfp4;
  const float* global_scale_ptr;  // NVFP4: element 0 is g (device memory), or null: global_scale
  float global_scale;
  int32_t slot;              // q
  int32_t rank;              // r
  int32_t units_per_expert;  // S
  uint8_t* recv_x;           // [L, RT, H] e4m3 or bf16, or [L, RT, H/2] e2m1 pairs, contiguous
                             // (or null)
  void* recv_scales;         // storage [L, G, RT] f32 or [L, ceil(G/4), RT] int32, or NVFP4
                             // [L, pad128(RT) * H/16] e4m3 interleaved (or null)
  int32_t* recv_count;       // [L]
  int32_t* src_info;         // [L, RT]
  int64_t* layout_range;     // [L, R]
  int32_t* stats;            // optional [L], element stride stats_stride
  int64_t stats_stride;
  int64_t* wait_stats;  // optional [R] int64, contiguous: dispatch_wait_recv_cost_stats
  int32_t phases;       // kLlPhaseSend | kLlPhaseRecv: which halves this launch runs
  int32_t pdl;          // launched with programmatic dependent launch (cuda/launch.h)
#ifdef EPX_DIAGNOSTICS
  int32_t ablate;  // LlAblate bits (cuda/tuning.h, diagnostics builds only)
#endif
  LlSymm symm;
  WaitContext wait;
#ifdef EPX_LL_TRACE
  uint64_t* trace;  // trace.cuh (null: off)
#endif
};

// The dispatch kernel's message formats (its template parameter kQuant; the host picks the one
// of use_fp8 / use_nvfp4): each instantiation carries its format's code only, as the combine's
// forms do (combine.cuh), so bf16 and fp8 pay nothing for NVFP4.
enum LlQuant : int { kLlQuantBf16 = 0, kLlQuantFp8 = 1, kLlQuantNvfp4 = 2 };

// The 8 bf16 of an input vector as float into f (zeros when !active) and their amax, the lane's
// share of a quantisation group's or block's amax. core/numeric.h's amax (index order, NaN
// skipped, from 0) is the largest |x_i| that is not NaN, or +0: the same value in any order, so
// a tree of fmaxf (max.f32 returns its non-NaN operand), ended with 0 for an all-NaN vector
// (|x| maps -0 to +0, as the reference's comparisons never store -0).
__device__ __forceinline__ float ll_vector_amax(const uint4& raw, bool active, float* f) {
  if (active) {
    ll_bf16x8_to_f32(raw, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = 0.0f;
  }
  const float a01 = fmaxf(fabsf(f[0]), fabsf(f[1])), a23 = fmaxf(fabsf(f[2]), fabsf(f[3]));
  const float a45 = fmaxf(fabsf(f[4]), fabsf(f[5])), a67 = fmaxf(fabsf(f[6]), fabsf(f[7]));
  return fmaxf(fmaxf(fmaxf(a01, a23), fmaxf(a45, a67)), 0.0f);
}

// Where step 3 stores token t's message: at byte `off` = msg_offset(q, r, t) of every rank d in
// the token's mask (never empty), the first rank's address computed once per token (what every
// vector stores to at R = 1, and first in general), the others' per vector.
struct LlSendDests {
  char* first;    // peers[the mask's lowest rank] + off
  uint64_t more;  // the mask without that rank
  size_t off;
};
__device__ __forceinline__ LlSendDests ll_send_dests(const LlDispatchParams& p, uint64_t mask,
                                                     size_t off) {
  return {p.symm.peers[__ffsll(static_cast<long long>(mask)) - 1] + off, mask & (mask - 1), off};
}
// put(message address) for every destination of `d`.
template <typename Put>
__device__ __forceinline__ void ll_for_dests(const LlDispatchParams& p, const LlSendDests& d,
                                             Put put) {
  put(d.first);
  for (uint64_t m = d.more; m != 0; m &= m - 1)
    put(p.symm.peers[__ffsll(static_cast<long long>(m)) - 1] + d.off);
}

// The largest of the amax values of lanes 0-15, on those lanes, and of lanes 16-31, on those:
// two warp-wide redux.sync maxima, each with the other half's lanes at 0, in place of a 4-round
// shuffle butterfly. The values are ll_vector_amax's (never NaN, never negative: -0 excluded),
// whose bit patterns order as unsigned integers as the floats order, so the integer maximum is
// the float one (the same bits as an fmaxf of the two).
__device__ __forceinline__ float ll_half_warp_amax(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const bool high = (threadIdx.x & 16) != 0;
  const uint32_t lo = __reduce_max_sync(0xffffffffu, high ? 0u : bits);
  const uint32_t hi = __reduce_max_sync(0xffffffffu, high ? bits : 0u);
  return __uint_as_float(high ? hi : lo);
}

// fp8 step 3 of one vector: lanes 0-15 and 16-31 of a warp each hold one 128-channel group
// (`active` is uniform per half-warp); every lane of the warp calls it (warp-wide reductions,
// ll_half_warp_amax). Quantises the 8 elements of vector v of token t (amax in core/numeric.h
// order, scale = fp8_scale_from_amax) and stores the bytes, and lane 0 of the half-warp the group's
// scale, into the message of every destination in `dests`.
__device__ __forceinline__ void ll_send_fp8(const LlDispatchParams& p, const uint4& raw, int v,
                                            bool active, const LlSendDests& dests) {
  const LlLayout& g = p.symm.layout;
  const int64_t H = g.hidden;
  float f[8];
  float amax = ll_vector_amax(raw, active, f);
  amax = ll_half_warp_amax(amax);
  const float scale = fp8_scale_from_amax(amax, p.round_scale != 0);
  const float inv = 1.0f / scale;
  uint2 packed;
  packed.x = f32x4_to_fp8x4_e4m3(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
  packed.y = f32x4_to_fp8x4_e4m3(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv);
  if (!active) return;
  ll_for_dests(p, dests, [&](char* msg) {
    *reinterpret_cast<uint2*>(msg + 8 * v) = packed;
    if ((threadIdx.x & 15) == 0) *reinterpret_cast<float*>(msg + H + 4 * (v / 16)) = scale;
  });
}

// NVFP4 step 3 of one vector: lanes 2i and 2i + 1 hold one 16-value block (`active` is uniform
// per 8 lanes); every lane of the warp calls it (shuffles). Quantises the 8 elements of vector v
// of token t with core/quant.h's formula and stores their 4 bytes of e2m1 pairs, and lane 8i the
// 4 scales of lanes 8i .. 8i + 7 (one 32-bit word), into the message of every destination in
// `dests`.
__device__ __forceinline__ void ll_send_nvfp4(const LlDispatchParams& p, const uint4& raw, int v,
                                              bool active, const LlSendDests& dests, float gs) {
  const LlLayout& g = p.symm.layout;
  const int64_t H = g.hidden;
  float f[8];
  float amax = ll_vector_amax(raw, active, f);
  // The pair's larger amax (neither is NaN or -0: the reference's "a > amax ? a : amax").
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  const Nvfp4Scale s = nvfp4_block_scale(amax, gs);
  const uint32_t packed = nvfp4_pack8(f, s.inv);
  // Lane 8i gathers the scales of blocks 4i .. 4i + 3 of the warp (lanes 8i, +2, +4, +6).
  const uint32_t sf = s.sf;
  const uint32_t sf_word = sf | __shfl_down_sync(0xffffffffu, sf, 2) << 8 |
                           __shfl_down_sync(0xffffffffu, sf, 4) << 16 |
                           __shfl_down_sync(0xffffffffu, sf, 6) << 24;
  if (!active) return;
  ll_for_dests(p, dests, [&](char* msg) {
    *reinterpret_cast<uint32_t*>(msg + 4 * v) = packed;
    if ((threadIdx.x & 7) == 0) *reinterpret_cast<uint32_t*>(msg + H / 2 + v / 2) = sf_word;
  });
}

// bf16 step 3 of one vector: vector v of token t into the message of every destination in
// `dests`.
__device__ __forceinline__ void ll_send_bf16(const LlDispatchParams& p, const uint4& raw, int v,
                                             const LlSendDests& dests) {
  ll_for_dests(p, dests,
               [&](char* msg) { *reinterpret_cast<uint4*>(msg + 16 * v) = raw; });
}

// The format word of a header (LlSourceHeader::format).
__device__ __forceinline__ int32_t ll_format(const LlDispatchParams& p) {
  return p.use_fp8 | (p.round_scale << 1) | (p.use_nvfp4 << 2);
}

// The fused launch's barrier between its halves' warps (LlTeam): the routing warps arrive once
// their routing rows are stored (or their wait failed), the sending warps wait there before step
// 4 (or before leaving after a failed wait), so step 4's release covers the routing rows too (the
// hooked receive reads them after dispatch_sent alone). ll_routed_ok(): whether the routing warps
// stored them, written before the arrival, read after the wait (the barrier orders the two).
inline constexpr int kLlBarRouted = 3;
__device__ __forceinline__ void ll_bar_arrive_routed() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kLlBarRouted), "n"(kLlThreads) : "memory");
}
__device__ __forceinline__ void ll_bar_sync_routed() {
  asm volatile("bar.sync %0, %1;" ::"n"(kLlBarRouted), "n"(kLlThreads) : "memory");
}
__device__ __forceinline__ int& ll_routed_ok() {
  __shared__ int s_ok;
  return s_ok;
}

// Send step 4 (after the team's barrier): thread d < R of the team, d not masked, releases the
// CTA's stores to rank d: dispatch_sent[q][r] += 1 there, and (`routed`: the routing rows were
// stored by this team) dispatch_routed[q][r] += 1 behind the same fence.
__device__ __forceinline__ void ll_dispatch_signal(const LlDispatchParams& p, const LlTeam& team,
                                                   uint64_t masked, bool routed) {
  const LlLayout& g = p.symm.layout;
  const int d = team.tid();
  if (d >= g.num_ranks || rank_skipped(masked, d)) return;
  LlSync* sync = g.sync(p.symm.peers[d]);
  fence_acq_rel(p.symm.one_gpu);
  if (routed) red_add_relaxed_sys(&sync->dispatch_routed[p.slot][p.rank], 1u);
  red_add_relaxed_sys(&sync->dispatch_sent[p.slot][p.rank], 1u);
}

// The NVFP4 global scale g (element 0 of x_global_scale, written before this kernel, or the host
// value); 0 in the other formats.
template <int kQuant>
__device__ __forceinline__ float ll_global_scale(const LlDispatchParams& p) {
  return kQuant != kLlQuantNvfp4 ? 0.0f
         : p.global_scale_ptr    ? __ldg(p.global_scale_ptr)
                                 : p.global_scale;
}

// Step 2 (CTA 0, threads d < R of `team`, d not masked): the header into staging(d, q, r).
template <int kQuant>
__device__ __forceinline__ void ll_dispatch_header(const LlDispatchParams& p, const LlTeam& team,
                                                   uint64_t masked, float gs) {
  const int d = team.tid();
  if (blockIdx.x != 0 || d >= p.symm.layout.num_ranks || rank_skipped(masked, d)) return;
  LlSourceHeader* h = p.symm.layout.header(p.symm.peers[d], p.slot, p.rank);
  h->num_tokens = p.num_tokens;
  h->format = ll_format(p);
  h->global_scale_bits = kQuant == kLlQuantNvfp4 ? __float_as_uint(gs) : 0u;
}

// Send steps 1-4 on `team`: the whole CTA, or (`kSplit`, the fused launch) warps 0-7, while
// ll_dispatch_route stores the header and the routing rows on warps 8-15 and step 4 waits for
// them at kLlBarRouted. False when a wait failed (the team must leave its send).
template <int kQuant, bool kShrink, bool kSplit>
__device__ bool ll_dispatch_send(const LlDispatchParams& p, uint32_t e, const LlTeam& team) {
  // Vectors of x a thread loads ahead: every vector of a row at H <= 8192 (the fused launch's 256
  // sending threads load twice as many as the whole CTA's 512).
  constexpr int kPrefetch = kSplit ? 2 * kLlXPrefetch : kLlXPrefetch;
  __shared__ int32_t s_ids[kLlMaxTopK];
  __shared__ int32_t s_dest[kLlMaxTopK];
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, K = g.top_k, L = g.num_local_experts, E = g.num_experts;
  const int me = p.rank, q = p.slot;
  const int64_t H = g.hidden;
  const int lane = threadIdx.x & 31, tid = team.tid(), nt = team.count;
  const int nv = static_cast<int>(H / 8);  // 8-element vectors per row

  // This thread's first kPrefetch vectors of x[t] (v = tid + i * nt), loaded together before
  // they are needed: the first token's before the step-1 wait (x is an input), later tokens'
  // before their routing row is read. Vectors past the prefetch are loaded in the loop.
  uint4 xpre[kPrefetch];
  auto prefetch = [&](int64_t t) {
    const uint16_t* xrow = p.x + t * p.x_stride;
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      const int v = tid + i * nt;
      xpre[i] = v < nv ? ll_ld_input8(xrow + 8 * v, p.x_vec16) : uint4{0, 0, 0, 0};
    }
  };
  // The first token's routing ids too (threads < K), before the wait.
  int64_t first_id = -1;
  if (static_cast<int64_t>(blockIdx.x) < p.num_tokens) {
    prefetch(blockIdx.x);
    if (tid < K)
      first_id = ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, blockIdx.x, tid);
  }

  // 1. Pairs with the release in step "finish" of ll_dispatch_recv on every rank. Masked ranks
  // (enable_shrink) are skipped here and in steps 2-4: nothing is sent to them.
  if (!ll_wait_ranks<kShrink>(
          team, symm, me, g.sync(symm.local)->dispatch_freed[q], ll_masked_uniform<kShrink>(symm),
          [&](int) { return (e - 1) * gridDim.x; }, p.wait, kWaitReady)) {
    if constexpr (kSplit) ll_bar_sync_routed();  // (the routing warps arrive in any case)
    return false;
  }
  const uint64_t masked = ll_masked_uniform<kShrink>(symm);
  EPX_LL_STAMP(p, 0, kTrDFreed);

  const float gs = ll_global_scale<kQuant>(p);
  // 2. Header; the routing rows' stores below (the fused launch: ll_dispatch_route does both).
  if (!kSplit) ll_dispatch_header<kQuant>(p, team, masked, gs);
  const int route_n = kSplit ? 0 : R * K;

  // 3. Tokens.
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    if (t != blockIdx.x) prefetch(t);
    team.sync();  // the previous token's s_ids / s_dest are no longer read
    if (tid < K) {
      int64_t id = t == blockIdx.x
                       ? first_id
                       : ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, t, tid);
      if (id < -1 || id >= E) {
        record_error(p.wait, kDevErrBadExpert, -1, t * 64 + tid, id);
        id = -1;
      }
      s_ids[tid] = static_cast<int32_t>(id);
      s_dest[tid] = id >= 0 ? static_cast<int32_t>(id) / L : -1;
    }
    team.sync();
    if (t == blockIdx.x) EPX_LL_STAMP(p, 0, kTrDRouted);
    uint64_t mask = 0;  // ranks t goes to
    for (int k = 0; k < K; ++k) {
      const int d = s_dest[k];
      if (d >= 0) mask |= uint64_t{1} << d;
    }
    mask &= ~masked;
    for (int i = tid; i < route_n; i += nt) {
      const int d = i / K, k = i - d * K;
      if (!rank_skipped(masked, d)) g.topk(symm.peers[d], q, me)[t * K + k] = s_ids[k];
    }
    if (EPX_LL_ABLATED(p.ablate, kLlAblateSendRows)) mask = 0;
    if (mask == 0) continue;
    const uint16_t* xrow = p.x + t * p.x_stride;
    const LlSendDests dests = ll_send_dests(p, mask, g.msg_offset(q, me, t));
    if constexpr (kQuant != kLlQuantBf16) {
      // Lanes 0-15 and 16-31 of a warp each hold one 128-channel group (fp8) or 8 16-value
      // blocks (NVFP4) (nv is a multiple of 16, so a half-warp is active or not as a whole);
      // every lane takes part in the shuffles, so the loops below run per warp (`base`, the
      // warp's first vector, is warp-uniform).
      auto quantise_and_send = [&](const uint4& raw, int v) {
        if constexpr (kQuant == kLlQuantNvfp4)
          ll_send_nvfp4(p, raw, v, v < nv, dests, gs);
        else
          ll_send_fp8(p, raw, v, v < nv, dests);
      };
#pragma unroll
      for (int i = 0; i < kLlXPrefetch; ++i) {
        const int base = tid - lane + i * nt;
        if (base < nv) quantise_and_send(xpre[i], base + lane);
      }
      // The rest through one quantising call site: the fused launch's further prefetched
      // vectors first (selected, not indexed, so xpre stays in registers), then loads.
      int i = kLlXPrefetch;
      for (int base = tid - lane + kLlXPrefetch * nt; base < nv; base += nt, ++i) {
        const int v = base + lane;
        uint4 raw = uint4{0, 0, 0, 0};
#pragma unroll
        for (int j = kLlXPrefetch; j < kPrefetch; ++j)
          if (i == j) raw = xpre[j];
        if (i >= kPrefetch && v < nv) raw = ll_ld_input8(xrow + 8 * v, p.x_vec16);
        quantise_and_send(raw, v);
      }
    } else {
      auto send = [&](const uint4& raw, int v) { ll_send_bf16(p, raw, v, dests); };
#pragma unroll
      for (int i = 0; i < kLlXPrefetch; ++i) {
        const int v = tid + i * nt;
        if (v < nv) send(xpre[i], v);
      }
      int i = kLlXPrefetch;
      for (int v = tid + kLlXPrefetch * nt; v < nv; v += nt, ++i) {
        uint4 raw = uint4{0, 0, 0, 0};
#pragma unroll
        for (int j = kLlXPrefetch; j < kPrefetch; ++j)
          if (i == j) raw = xpre[j];
        if (i >= kPrefetch) raw = ll_ld_input8(xrow + 8 * v, p.x_vec16);
        send(raw, v);
      }
    }
  }

  // 4. Release this CTA's stores to every rank (the fused launch: the routing warps' too).
  if (static_cast<int64_t>(blockIdx.x) < p.num_tokens) EPX_LL_STAMP(p, 0, kTrDStored);
  if constexpr (kSplit) {
    ll_bar_sync_routed();
    if (!ll_routed_ok()) return false;  // no release without the routing rows
  } else {
    team.sync();
  }
  EPX_LL_STAMP(p, 0, kTrDSent);
  ll_dispatch_signal(p, team, masked, !kSplit);
  EPX_LL_STAMP(p, 0, kTrDSignal);
  return true;
}

// The fused launch's routing half (warps 8-15, beside ll_dispatch_send on warps 0-7; no
// enable_shrink): step 1's wait as the send's, then step 2's header (CTA 0) and the routing rows
// of the CTA's tokens (ids outside [-1, E) as -1; the send reports them) into topk(d, q, r) of
// every rank d; arrives at kLlBarRouted (always: the send waits there) and releases +1 into
// dispatch_routed[q][r] of every rank. False when its wait failed.
template <int kQuant>
__device__ bool ll_dispatch_route(const LlDispatchParams& p, uint32_t e, const LlTeam& team) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, K = g.top_k, E = g.num_experts;
  const int me = p.rank, q = p.slot, tid = team.tid(), nt = team.count;
  const int64_t T = p.num_tokens;
  auto id_at = [&](int64_t t, int i) {  // entry i = d * K + k of token t's rows
    return ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, t, i - (i / K) * K);
  };
  // The first token's id of this thread's first entry, before the wait.
  int64_t first_id = -1;
  if (static_cast<int64_t>(blockIdx.x) < T && tid < R * K) first_id = id_at(blockIdx.x, tid);
  const bool ok = ll_wait_ranks<false>(
      team, symm, me, g.sync(symm.local)->dispatch_freed[q], 0,
      [&](int) { return (e - 1) * gridDim.x; }, p.wait, kWaitReady);
  if (ok) {
    ll_dispatch_header<kQuant>(p, team, 0, ll_global_scale<kQuant>(p));
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
      for (int i = tid; i < R * K; i += nt) {
        int64_t id = t == blockIdx.x && i == tid ? first_id : id_at(t, i);
        if (id < -1 || id >= E) id = -1;
        g.topk(symm.peers[i / K], q, me)[t * K + i - (i / K) * K] = static_cast<int32_t>(id);
      }
    }
    team.sync();  // the team's stores before its releases (cumulativity)
  }
  if (tid == 0) ll_routed_ok() = ok;
  ll_bar_arrive_routed();
  if (!ok) return false;
  signal_ranks(
      R, 0, [&](int d) { return &g.sync(symm.peers[d])->dispatch_routed[q][me]; }, team.first,
      symm.one_gpu);
  EPX_LL_STAMP(p, 0, kTrDRoutedSig);
  return true;
}

// The one-pass receive's list (shared memory): per listed entry the addresses its copy needs,
// computed once when it is listed (ll_recv_list_put): its message, its row of [L, RT] (recv_x,
// src_info), its first scale element (column-major) and its source token index.
struct LlRecvList {
  const char* msg[kLlThreads];
  int64_t lrow[kLlThreads];  // l * RT + row
  // (l * G) * RT + row (f32) or (l * ceil(G / 4)) * RT + row (UE8M0); NVFP4: the 32-bit word of
  // scales 0..3 of the row, (l * pad128(RT) * H/16 + nvfp4_sf_offset(row, 0)) / 4
  int64_t sbase[kLlThreads];
  int32_t tok[kLlThreads];
};

// Lists token t of source s as entry `pos`: row `row` of local expert l.
template <int kQuant>
__device__ __forceinline__ void ll_recv_list_put(const LlDispatchParams& p, LlRecvList& list,
                                                 int pos, int s, int64_t t, int l, int64_t row) {
  const LlLayout& g = p.symm.layout;
  const int64_t RT = g.rows_per_expert;
  const int64_t per_row = p.use_ue8m0 ? (g.num_groups + 3) / 4 : g.num_groups;
  list.msg[pos] = g.msg(p.symm.local, p.slot, s, t);
  list.lrow[pos] = l * RT + row;
  if constexpr (kQuant == kLlQuantNvfp4) {
    const int64_t bytes = l * ll_nvfp4_scale_expert_bytes(RT, g.hidden) +
                          nvfp4_sf_offset(row, 0, g.hidden / kNvfp4Block);
    list.sbase[pos] = bytes / 4;
  } else {
    list.sbase[pos] = l * per_row * RT + row;
  }
  list.tok[pos] = static_cast<int32_t>(t);
}

// Bytes of one received row: e4m3 [H], e2m1 pairs [H/2] or bf16 [H].
template <int kQuant>
__device__ __forceinline__ int64_t ll_row_bytes(const LlDispatchParams& p) {
  const int64_t H = p.symm.layout.hidden;
  return kQuant == kLlQuantNvfp4 ? H / 2 : kQuant == kLlQuantFp8 ? H : 2 * H;
}

// 16-byte scale vectors of one message (0 without scales or without recv_scales): fp8 4 f32
// scales each, NVFP4 16 e4m3 scales (4 words) each.
template <int kQuant>
__device__ __forceinline__ int ll_scale_vectors(const LlDispatchParams& p) {
  const LlLayout& g = p.symm.layout;
  if (kQuant == kLlQuantBf16 || !p.recv_scales) return 0;
  if (kQuant == kLlQuantNvfp4) return static_cast<int>((g.hidden / kNvfp4Block + 15) / 16);
  return static_cast<int>((g.num_groups + 3) / 4);
}

// The scale vector j of an entry (16 bytes of its message after the row) into recv_scales: fp8
// groups 4j .. 4j + 3 column-major (f32) or packed into UE8M0 word j; NVFP4 words 4j .. 4j + 3
// of the interleaved layout (word k is 512 bytes after word k - 1).
template <int kQuant>
__device__ __forceinline__ void ll_store_scale_vector(const LlDispatchParams& p, int64_t sbase,
                                                      int j, const uint4& val) {
  const LlLayout& g = p.symm.layout;
  const int64_t RT = g.rows_per_expert;
  const int G = static_cast<int>(g.num_groups);
  const uint32_t w[4] = {val.x, val.y, val.z, val.w};
  if constexpr (kQuant == kLlQuantNvfp4) {
    const int nvfp4_words = static_cast<int>(g.hidden / (4 * kNvfp4Block));
    auto* out = static_cast<uint32_t*>(p.recv_scales);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (4 * j + c < nvfp4_words) out[sbase + (4 * j + c) * 128] = w[c];
  } else if (!p.use_ue8m0) {  // fp8 (bf16 has no scale vectors)
    auto* out = static_cast<float*>(p.recv_scales);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (4 * j + c < G) out[sbase + (4 * j + c) * RT] = __uint_as_float(w[c]);
  } else {
    uint32_t word = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (4 * j + c < G)
        word |= static_cast<uint32_t>(ue8m0_of_scale(__uint_as_float(w[c]))) << (8 * c);
    static_cast<int32_t*>(p.recv_scales)[sbase + j * RT] = static_cast<int32_t>(word);
  }
}

// Diagnostics (kLlVariantScaleSectors): the round's units as runs of the list, {first entry,
// entries} each, rows 0.. of their experts when `whole` (one scan round).
struct LlScaleRuns {
  const int32_t (*run)[2];
  int n;
  bool whole;
};

// The list copy: entries sub, sub + S, ... < total of `list`, each message's row vectors into
// recv_x and its scale vectors (right after the row in the message) into recv_scales.
// Rows: ll_copy_rows (a warp per (entry, 4 KB chunk); messages are 16-byte aligned).
// Scales: thread i takes scale vectors i, i + blockDim.x, ... of the entries' (entry, vector)
// list; its first load is issued before the row copies and stored after them, so the two
// latencies overlap, and the scatter's code (ll_store_scale_vector) sits outside the unrolled
// row loop: inlined once per vector it was most of the loop's instruction fetch (docs/perf.md
// §4.3). src_info first.
template <int kQuant>
__device__ void ll_dispatch_copy_entries(const LlDispatchParams& p, const LlRecvList& list,
                                         int total, int sub, int S,
                                         [[maybe_unused]] const LlScaleRuns& runs) {
  const int n_mine = total > sub ? (total - sub + S - 1) / S : 0;
  if (n_mine == 0) return;
  if (p.src_info) {
    for (int m = threadIdx.x; m < n_mine; m += blockDim.x) {
      const int idx = sub + m * S;
      p.src_info[list.lrow[idx]] = list.tok[idx];
    }
  }
  const int64_t row_bytes = ll_row_bytes<kQuant>(p);
  const int nvx = static_cast<int>(row_bytes / 16);  // row vectors
  const int nsv = ll_scale_vectors<kQuant>(p);       // scale vectors per entry
  const bool copy = !EPX_LL_ABLATED(p.ablate, kLlAblateRecvCopy);
  const int n_sc = copy && !EPX_LL_ABLATED(p.ablate, kLlAblateRecvScales) ? n_mine * nsv : 0;
  auto scale_src = [&](int i, int64_t* sbase, int* j) {
    const int m = i / nsv;
    const int idx = sub + m * S;
    *j = i - m * nsv;
    *sbase = list.sbase[idx];
    return list.msg[idx] + row_bytes + 16 * int64_t{*j};
  };
  [[maybe_unused]] bool sectors = false;
#ifdef EPX_DIAGNOSTICS
  // kLlVariantScaleSectors: item i of run u is (group g, 4-row slab a), a fastest, the slabs of a
  // run's sectors (8 rows) in pairs; its 4 scales loaded before the row copies, stored after them.
  const int64_t RT = p.symm.layout.rows_per_expert;
  const int G = static_cast<int>(p.symm.layout.num_groups);
  sectors = EPX_LL_ABLATED(p.ablate, kLlVariantScaleSectors) && n_sc > 0 &&
            kQuant == kLlQuantFp8 && !p.use_ue8m0 && runs.whole && S == 1 && RT % 8 == 0;
  auto slabs_of = [&](int u) { return 2 * ((runs.run[u][1] + 7) / 8); };  // run u's 4-row slabs
  int n_items = 0;
  if (sectors)
    for (int u = 0; u < runs.n; ++u) n_items += G * slabs_of(u);
  auto slab = [&](int i, float* v) {  // item i's 4 scales into v, its first one's address back
    int u = 0, rem = i;
    for (; u + 1 < runs.n && rem >= G * slabs_of(u); ++u) rem -= G * slabs_of(u);
    const int slabs = slabs_of(u);
    const int g = rem / slabs, a = rem - g * slabs;
    const int first = runs.run[u][0], count = runs.run[u][1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = 4 * a + k;
      v[k] = row < count ? ld_landed<float>(reinterpret_cast<const float*>(
                               list.msg[first + row] + row_bytes + 4 * int64_t{g}))
                         : 0.0f;
    }
    return static_cast<float*>(p.recv_scales) + list.sbase[first] + g * RT + 4 * a;
  };
  float sv[4] = {};
  float* sdst = nullptr;
  if (sectors && static_cast<int>(threadIdx.x) < n_items) sdst = slab(threadIdx.x, sv);
#endif
  int sj = 0;
  int64_t sbase = 0;
  uint4 sval{};
  if (static_cast<int>(threadIdx.x) < n_sc && !sectors)
    sval = ld_landed<uint4>(scale_src(threadIdx.x, &sbase, &sj));
  if (p.recv_x && copy) {
    ll_copy_rows<true>(n_mine, nvx, true, [&](int m, const uint16_t** src, uint4** dst) {
      const int idx = sub + m * S;
      *src = reinterpret_cast<const uint16_t*>(list.msg[idx]);  // 16-byte vectors of any format
      *dst = reinterpret_cast<uint4*>(p.recv_x + list.lrow[idx] * row_bytes);
    });
  }
#ifdef EPX_DIAGNOSTICS
  if (sectors) {  // (the default build has no such branch)
    for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
      if (i != static_cast<int>(threadIdx.x)) sdst = slab(i, sv);
      *reinterpret_cast<float4*>(sdst) = make_float4(sv[0], sv[1], sv[2], sv[3]);
    }
    return;
  }
#endif
  for (int i = threadIdx.x; i < n_sc; i += blockDim.x) {
    if (i != static_cast<int>(threadIdx.x)) sval = ld_landed<uint4>(scale_src(i, &sbase, &sj));
    ll_store_scale_vector<kQuant>(p, sbase, sj, sval);
  }
}

// Which of the n experts `experts[i]` the K ids of a staged routing row list (bit i), kLlIdBatch
// ids at a time (independent loads: one latency per batch); `vec4` (K % 4 == 0, the row 16-byte
// aligned): as int4 loads. *first: bits 5i .. 5i + 4 the first k that lists experts[i] (K <= 32).
__device__ __forceinline__ uint32_t ll_row_selects(const int32_t* row, int K,
                                                   const int32_t (&experts)[kLlUnitGroup], int n,
                                                   bool vec4, uint32_t* first) {
  static_assert(kLlIdBatch % 4 == 0, "int4 batches");
  static_assert(kLlMaxTopK <= 32 && kLlUnitGroup * 5 <= 32, "first k: 5 bits per unit");
  uint32_t sel = 0, firsts = 0;
  for (int k0 = 0; k0 < K; k0 += kLlIdBatch) {
    int32_t id[kLlIdBatch];
    if (vec4) {
#pragma unroll
      for (int k = 0; k < kLlIdBatch / 4; ++k) {
        const int4 v = k0 + 4 * k < K ? ld_landed<int4>(row + k0 + 4 * k) : int4{-1, -1, -1, -1};
        id[4 * k] = v.x, id[4 * k + 1] = v.y, id[4 * k + 2] = v.z, id[4 * k + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kLlIdBatch; ++k)
        id[k] = k0 + k < K ? ld_landed<int32_t>(row + k0 + k) : -1;
    }
#pragma unroll
    for (int i = 0; i < kLlUnitGroup; ++i) {
      if (i >= n) break;
      int f = -1;
#pragma unroll
      for (int k = kLlIdBatch - 1; k >= 0; --k)
        if (id[k] == experts[i]) f = k;
      if (f >= 0 && !(sel >> i & 1)) {
        sel |= 1u << i;
        firsts |= static_cast<uint32_t>(k0 + f) << (5 * i);
      }
    }
  }
  *first = firsts;
  return sel;
}

// The receive's view of the entries: the concatenated token list "source 0's tokens, source 1's,
// ..." (= the row order within every expert), entry j being token j - first[s] of source s; or,
// when one scan round covers every source's T_max slots (R * T_max <= kLlThreads), the slots
// themselves: entry j is slot j % T_max of source j / T_max, a token when that is below the
// source's count, read with the entry's routing row (one round trip for both; the slots' order
// is the concatenation's, so the compaction lists the same rows).
struct LlRecvSources {
  int64_t slot;          // > 0: the slot view, T_max slots per source
  uint64_t masked;       // the slot view: sources read as empty (enable_shrink)
  const int64_t* first;  // the concatenation: entries before source s (shared, [R + 1])
  int64_t total;         // entries
};

// Which of the group's experts entry j (< srcs.total) selects (bit i: experts[i], once however
// often its row lists it); *s / *t its source and token, *first the first k of each
// (ll_row_selects). A routing row's ids are loaded once.
__device__ __forceinline__ uint32_t ll_recv_selects(const LlDispatchParams& p,
                                                    const LlRecvSources& srcs, int64_t j,
                                                    const int32_t (&experts)[kLlUnitGroup], int n,
                                                    int* s, int32_t* t, uint32_t* first) {
  const LlLayout& g = p.symm.layout;
  const int K = g.top_k;
  int src = 0;
  if (srcs.slot > 0) {
    // The slot view holds R * T_max <= kLlThreads entries: a 32-bit division, inlined (a 64-bit
    // one is a call of ≈ 70 instructions on every scan round's critical path).
    src = static_cast<int>(static_cast<uint32_t>(j) / static_cast<uint32_t>(srcs.slot));
  } else {
    while (j >= srcs.first[src + 1]) ++src;
  }
  *s = src;
  *t = static_cast<int32_t>(j - (srcs.slot > 0 ? src * srcs.slot : srcs.first[src]));
  // The slot's token count and its routing row in one round trip: t (< T_max) and the count are
  // compared in 32 bits, at the end, so no instruction needs the count before the row's loads are
  // issued (a 64-bit t had ptxas sign-extend the count right after its load: two L2 round trips
  // in turn).
  const int32_t tokens = srcs.slot > 0 && !rank_skipped(srcs.masked, src)
                             ? ld_landed<int32_t>(&g.header(p.symm.local, p.slot, src)->num_tokens)
                             : 0;
  const uint32_t sel =
      ll_row_selects(g.topk(p.symm.local, p.slot, src) + *t * K, K, experts, n, K % 4 == 0, first);
  return srcs.slot == 0 || *t < tokens ? sel : 0;
}

// The receive's freed releases (pairs with step 1 of the send): threads first + d tell every rank
// d not masked that this CTA's reads of the staging of slot q are done (+1 into
// dispatch_freed[q][r] there). Block-wide (the mask read is a barrier when kShrink; without it the
// caller's barrier after the CTA's last reads comes first): the fence covers those reads.
template <bool kShrink>
__device__ __forceinline__ void ll_dispatch_release_freed(const LlDispatchParams& p, int first) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const uint64_t masked = ll_masked_uniform<kShrink>(symm);
  signal_ranks(
      g.num_ranks, masked,
      [&](int d) { return &g.sync(symm.peers[d])->dispatch_freed[p.slot][p.rank]; }, first,
      symm.one_gpu);
}

// Unit u's local expert: u / S, without the division where S = 1 (each unit its own expert; the
// common case, and the only one where a CTA has more than one unit: S > 1 only where L * S <= C).
__device__ __forceinline__ int ll_unit_expert(int u, int S) {
  return S == 1 ? u : u / S;
}
// How many of units u0, u0 + C, ... (up to kLlUnitGroup) are below `units` (u0 < units), by
// comparisons: min(kLlUnitGroup, ceil((units - u0) / C)) without a division by runtime values.
__device__ __forceinline__ int ll_unit_group_size(int u0, int C, int units) {
  int n = 1;
#pragma unroll
  for (int i = 1; i < kLlUnitGroup; ++i) n += u0 + i * C < units ? 1 : 0;
  return n;
}

// The receive's units, one pass over the sources: a CTA takes its units in groups of up to
// kLlUnitGroup (units u, u + C, ...: more than one only when L > C, e.g. R = 1, E = 288 on 128
// CTAs, and then S = 1), compacts the concatenated list for all of them at once, `team.count`
// entries at a time (one load of each routing row, one scan for the group), lists their rows
// together and copies them with ONE ll_dispatch_copy_entries round (rows and scales), so a CTA's
// units cost one scan and one copy latency instead of one each (a list that would overflow is
// copied first). layout_range comes from per-source counts (shared-memory adds: counts, never
// order). `stats0`: thread i's stats element of unit i of the CTA's first group, read before the
// wait (ll_dispatch_stats0), so the group's read-modify-write of stats waits for no load.
// After the last group's copies the freed releases go out from the last kMaxRanks threads
// (ll_dispatch_release_freed) while threads < n write the group's layout: the releases' fence
// waits for the CTA's row stores, which the layout writes need not wait for.
// Roles: `team` (the whole CTA, or warps 8-15 of the fused launch) scans and lists; every copy is
// the whole CTA's (`follow`: warps 0-7 of the fused launch run the same loops without scanning or
// listing: they learn NT at kLlBarRounds, which the team only arrives at, and each round's entries
// and units from s_round at the round's barrier). `ok` false: a wait of this thread's team
// failed; the next barrier of both tells every warp, and all leave (false).
inline constexpr int kLlBarRounds = 4;
template <int kQuant, bool kShrink>
__device__ bool ll_dispatch_recv_units_onepass(const LlDispatchParams& p, const LlRecvSources& srcs,
                                               int32_t stats0, uint32_t e, const LlTeam& team,
                                               bool follow, bool split, bool ok) {
  __shared__ LlRecvList list;
  __shared__ int32_t s_cnt[kLlUnitGroup][kMaxRanks];
  __shared__ int32_t s_round[3];  // the round's entries, its `sub`, its units' end (stop)
#ifdef EPX_DIAGNOSTICS
  __shared__ int32_t s_runs[kLlUnitGroup][2];  // LlScaleRuns of the round's units
#endif
  __shared__ int64_t s_nt;        // NT for the followers (-1: the team's wait failed)
  const LlLayout& g = p.symm.layout;
  const int R = g.num_ranks, L = g.num_local_experts, K = g.top_k;
  const int me = p.rank, S = p.units_per_expert;
  const int units = L * S;
  const int C = static_cast<int>(gridDim.x);
  const int tid = team.tid();
  // Whether this thread scans and lists, read anew where it is asked (volatile: the compiler
  // cannot hoist it and compile the loops once per role).
  auto lists = [&]() {
    int v = !follow;
    if (split) asm volatile("mov.b32 %0, %0;" : "+r"(v));
    return v != 0;
  };
  if (split) {
    if (!follow) {
      if (tid == 0) s_nt = ok ? srcs.total : -1;
      asm volatile("bar.arrive %0, %1;" ::"n"(kLlBarRounds), "n"(kLlThreads) : "memory");
    } else {
      asm volatile("bar.sync %0, %1;" ::"n"(kLlBarRounds), "n"(kLlThreads) : "memory");
      EPX_LL_STAMP(p, 0, kTrDFollowNt);
    }
  }
  if (!ok && !follow) return false;  // (the followers see s_nt < 0)
  const int64_t NT = follow ? s_nt : srcs.total;
  if (NT < 0) return false;
  EPX_LL_TRACE_DECL(scan);
  EPX_LL_TRACE_COUNT(rows);
  for (int u0 = blockIdx.x; u0 < units; u0 += kLlUnitGroup * C) {
    // The group: units u0 + i * C < units, i < n. With n > 1, S = 1 (L * S > C): sub = 0.
    const int n = ll_unit_group_size(u0, C, units);
    int l[kLlUnitGroup];
    int32_t expert[kLlUnitGroup];
    const int l0 = ll_unit_expert(u0, S);
#pragma unroll
    for (int i = 0; i < kLlUnitGroup; ++i) {
      l[i] = S == 1 ? u0 + i * C : l0;  // (S > 1: n = 1)
      expert[i] = me * L + l[i];
    }
    const int sub = u0 - l[0] * S;
    if (lists()) {
      team.sync();  // threads < n read the previous group's s_cnt
      for (int i = tid; i < n * kMaxRanks; i += team.count)
        s_cnt[i / kMaxRanks][i % kMaxRanks] = 0;
      team.sync();
    }
    int64_t running[kLlUnitGroup] = {};
    for (int64_t base = 0; base < NT; base += team.count) {
      uint32_t sel = 0, first = 0;
      int s = 0;
      int32_t t = 0;
      int pos[kLlUnitGroup] = {}, total[kLlUnitGroup] = {};
      if (lists()) {
        if (base == 0 && u0 == static_cast<int>(blockIdx.x)) EPX_LL_STAMP(p, 0, kTrDScanStart);
        EPX_LL_TRACE_BEGIN(scan);
        const int64_t j = base + tid;
        sel = j < NT ? ll_recv_selects(p, srcs, j, expert, n, &s, &t, &first) : 0;
        ll_block_scan_group(team, sel, n, pos, total);
        EPX_LL_TRACE_END(scan);
      }
      // Units [start, stop) are listed and copied together; a unit whose entries would overflow
      // the list starts the next copy (n > 1 then, so S = 1). One copy call site: inlined once per
      // unit, the copy's code sat three times between the scan and the copy every call runs.
      for (int start = 0; start < n;) {
        if (lists()) {
          int filled = 0, stop = n;  // entries listed, uniform
#pragma unroll
          for (int i = 0; i < kLlUnitGroup; ++i) {
            if (i < start || i >= stop) continue;
            if (filled > 0 && filled + total[i] > kLlThreads) {
              stop = i;
              continue;
            }
            if (sel >> i & 1) {
              if (!EPX_LL_ABLATED(p.ablate, kLlAblateRecvList)) {
                const int64_t row = running[i] + pos[i];
                ll_recv_list_put<kQuant>(p, list, filled + pos[i], s, t, l[i], row);
                // Where the token landed, into source s's row map (its combine's rows; the
                // unit's first CTA: its S CTAs list the same rows).
                if (sub == 0)
                  st_relaxed_sys(
                      g.row_map(p.symm.peers[s], p.slot) + t * K + (first >> (5 * i) & 31),
                      ll_row_entry(row, expert[i], e));
              }
              atomicAdd(&s_cnt[i][s], 1);
            }
#ifdef EPX_DIAGNOSTICS
            if (tid == 0) s_runs[i - start][0] = filled, s_runs[i - start][1] = total[i];
#endif
            filled += total[i];
            running[i] += total[i];
          }
          EPX_LL_TRACE_ADD(rows, filled > sub ? (filled - sub + S - 1) / S : 0);
          if (tid == 0) {
            s_round[0] = EPX_LL_ABLATED(p.ablate, kLlAblateRecvList) ? 0 : filled;
            s_round[2] = stop;
          }
          EPX_LL_STAMP(p, 0, kTrDListEnd);
#ifdef EPX_LL_TRACE
          if (split) {
            team.sync();
            EPX_LL_STAMP(p, 0, kTrDTeamListed);
          }
#endif
        }
        // The round's copy, by every warp; in the fused launch the barrier also tells whether
        // every warp's waits held.
        if (split) {
          if (follow) EPX_LL_STAMP(p, 0, kTrDFollowBar);
          if (!__syncthreads_and(ok)) return false;
        } else {
          __syncthreads();
        }
        EPX_LL_STAMP(p, 0, kTrDListed);
#ifdef EPX_DIAGNOSTICS
        const LlScaleRuns runs{s_runs, s_round[2] - start, NT <= team.count};
#else
        const LlScaleRuns runs{nullptr, 0, false};
#endif
        // (n > 1: S = 1, sub = 0)
        ll_dispatch_copy_entries<kQuant>(p, list, s_round[0], sub, S, runs);
        start = s_round[2];
        __syncthreads();  // the list and s_round are rewritten by the next round
        EPX_LL_STAMP(p, 0, kTrDCopied);
      }
    }
    if (lists()) {
      if (u0 + kLlUnitGroup * C >= units)  // the CTA's last group: its staging reads are done
        ll_dispatch_release_freed<kShrink>(p, static_cast<int>(blockDim.x) - kMaxRanks);
      if (sub == 0 && tid < n) {
        // Thread i: unit i's expert (computed, not indexed: l[] and running[] stay in registers).
        const int i = tid, li = ll_unit_expert(u0 + i * C, S);
        int64_t begin = 0;  // ends as the expert's rows (= running[i])
        for (int src = 0; src < R; ++src) {
          if (p.layout_range) p.layout_range[li * R + src] = (begin << 32) | s_cnt[i][src];
          begin += s_cnt[i][src];
        }
        if (p.recv_count) p.recv_count[li] = static_cast<int32_t>(begin);
        if (p.stats) {
          const int32_t before =
              u0 == static_cast<int>(blockIdx.x) ? stats0 : p.stats[li * p.stats_stride];
          p.stats[li * p.stats_stride] = before + static_cast<int32_t>(begin);
        }
      }
    }
  }
  // Without rounds no barrier told the warps whether the others' waits held.
  if (split && NT == 0 && !__syncthreads_and(ok)) return false;
  if (!follow) {  // (the trace: the scanning team's time and rows)
    EPX_LL_STAMP_V(p, 0, kTrDScan, kTrDRecvWait, scan);
    EPX_LL_TRACE_SM(p, 0, rows_n);
  }
  return true;
}

// Receive finish, every CTA: a CTA without units releases its freed flags here (one with units
// did after its copies), and every CTA advances its epoch word.
template <bool kShrink>
__device__ __forceinline__ void ll_dispatch_finish(const LlDispatchParams& p, uint32_t e,
                                                   bool released) {
  const LlSymm& symm = p.symm;
  if (!released) {
    __syncthreads();  // (nothing read, but every CTA releases once per dispatch)
    ll_dispatch_release_freed<kShrink>(p, 0);
  }
  if (threadIdx.x == 0) symm.layout.state(symm.local)->dispatch_epoch[p.slot][blockIdx.x] = e;
  EPX_LL_STAMP(p, 0, kTrDExit);
}

// enable_shrink: the receive's `n` CTAs with units agree on the mask before they read it. Each
// adds 1 to recv_waited[q] once its waits are over (release) and waits until all n have (e * n;
// acquire): a peer masked by any of them (a wait that timed out) is then masked in the view of
// all, so the CTAs sharing one expert's rows (S > 1) list the same sources. False when the wait
// failed.
__device__ __forceinline__ bool ll_dispatch_recv_agree(const LlDispatchParams& p, uint32_t e,
                                                       int n) {
  uint32_t* waited = &p.symm.layout.state(p.symm.local)->recv_waited[p.slot];
  bool ok = true;
  __syncthreads();  // every thread's mask updates before the release below (cumulativity)
  if (threadIdx.x == 0) {
    fence_acq_rel(p.symm.one_gpu);
    red_add_relaxed_sys(waited, 1u);
    ok = wait_flag<true>(waited, e * n, p.wait, kWaitBarrier, p.rank);
  }
  return __syncthreads_and(ok) != 0;
}

// The stats element of unit tid of this CTA's first group (units blockIdx.x + i * C, i < n, as
// ll_dispatch_recv_units_onepass takes them) when that thread of `team` writes it (sub 0), else
// 0. Read at the receive's start: the previous dispatch that wrote it is complete (stream order;
// with PDL, after pdl_begin), and only this dispatch's units write it now.
__device__ __forceinline__ int32_t ll_dispatch_stats0(const LlDispatchParams& p,
                                                      const LlTeam& team) {
  const int S = p.units_per_expert, units = p.symm.layout.num_local_experts * S;
  const int C = static_cast<int>(gridDim.x), u0 = static_cast<int>(blockIdx.x);
  const int n = ll_unit_group_size(u0, C, units);
  const int u = u0 + team.tid() * C;
  if (!p.stats || team.tid() >= n || (S != 1 && u0 % S != 0)) return 0;
  return p.stats[ll_unit_expert(u, S) * p.stats_stride];
}

// Receive half on `team` (the CTA, or in the fused launch either half: warps 8-15 wait for the
// routing rows, scan and list; warps 0-7 wait for the messages and join the copies). `ok` false:
// this team's send half failed (fused launch). False when a wait failed.
template <int kQuant, bool kShrink>
__device__ bool ll_dispatch_recv(const LlDispatchParams& p, uint32_t e, const LlTeam& team,
                                 bool split, bool ok) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, L = g.num_local_experts;
  const int q = p.slot, S = p.units_per_expert;
  const int units = L * S;
  const int tid = team.tid();
  const bool follow = split && team.first == 0;  // the fused launch's sending warps
  EPX_LL_STAMP(p, 0, kTrDRecvEntry);

  if (static_cast<int>(blockIdx.x) < units) {
    // Every source's tokens for this slot landed (pairs with step 4 of the send); CTA 0 times
    // each source's wait when asked to. A masked source (enable_shrink) counts as one without
    // tokens: not awaited, not read (layout_range count 0). The fused launch's routing warps
    // wait for the routing rows instead (dispatch_routed) and scan while its sending warps wait
    // for the messages.
    const int32_t stats0 = follow ? 0 : ll_dispatch_stats0(p, team);
    const bool routing = split && !follow;  // the fused launch's scanning warps
    if (ok)
      ok = ll_wait_ranks<kShrink>(
          team, symm, p.rank,
          routing ? g.sync(symm.local)->dispatch_routed[q] : g.sync(symm.local)->dispatch_sent[q],
          ll_masked_uniform<kShrink>(symm), [&](int) { return e * gridDim.x; }, p.wait,
          routing ? kWaitCounts : kWaitRows,
          !routing && blockIdx.x == 0 ? p.wait_stats : nullptr);
    if (kShrink && ok && !ll_dispatch_recv_agree(p, e, min(units, static_cast<int>(gridDim.x))))
      ok = false;
    const uint64_t masked = ok ? ll_masked_uniform<kShrink>(symm) : 0;
    EPX_LL_STAMP(p, 0, follow ? kTrDSentWait : kTrDRecvWait);
    // Every source's format and NVFP4 global scale equal this rank's (its own header, written by
    // its send half, holds its g): CTA 0's threads s < R load the two words now, while the
    // staging is this dispatch's, and compare them after the copies (compared here, their round
    // trip held CTA 0's listing back).
    const bool check = ok && !follow && blockIdx.x == 0 && tid < R && !rank_skipped(masked, tid);
    int64_t theirs = 0, mine = 0;
    if (check) {
      auto word = [&](int s) {
        const LlSourceHeader* h = g.header(symm.local, q, s);
        return static_cast<int64_t>(static_cast<uint32_t>(ld_landed<int32_t>(&h->format))) |
               static_cast<int64_t>(ld_landed<uint32_t>(&h->global_scale_bits)) << 32;
      };
      theirs = word(tid);
      mine = word(p.rank);
    }
    LlRecvSources srcs{0, masked, nullptr, 0};
    __shared__ int64_t s_first[kMaxRanks + 1];
    if (static_cast<int64_t>(R) * g.max_tokens <= static_cast<int64_t>(team.count)) {
      srcs.slot = g.max_tokens;  // the slot view: the counts are read with the routing rows
      srcs.total = R * g.max_tokens;
    } else if (ok && !follow) {
      // Every source's token count, read once (in parallel) for all units.
      __shared__ int32_t s_tokens[kMaxRanks];
      if (tid < R) {
        const int32_t n = rank_skipped(masked, tid)
                              ? 0
                              : ld_landed<int32_t>(&g.header(symm.local, q, tid)->num_tokens);
        s_tokens[tid] = n < 0 ? 0 : (n > g.max_tokens ? static_cast<int32_t>(g.max_tokens) : n);
      }
      team.sync();
      if (tid == 0) {
        s_first[0] = 0;
        for (int s = 0; s < R; ++s) s_first[s + 1] = s_first[s] + s_tokens[s];
      }
      team.sync();
      srcs.first = s_first;
      srcs.total = s_first[R];
    }
    if (!ll_dispatch_recv_units_onepass<kQuant, kShrink>(p, srcs, stats0, e, team, follow, split,
                                                         ok))
      return false;
    if (check && theirs != mine) record_error(p.wait, kDevErrLlFormat, tid, theirs, mine);
    EPX_LL_STAMP(p, 0, kTrDCopy);
  } else if (split && !__syncthreads_and(ok)) {
    return false;  // (a CTA without units: both halves' waits)
  } else if (!ok) {
    return false;
  }

  ll_dispatch_finish<kShrink>(p, e, static_cast<int>(blockIdx.x) < units);
  return true;
}

// The epoch of the running dispatch of slot q (see the file comment).
__device__ __forceinline__ uint32_t ll_dispatch_epoch(const LlDispatchParams& p) {
  const LlState* st = p.symm.layout.state(p.symm.local);
  return *reinterpret_cast<const volatile uint32_t*>(&st->dispatch_epoch[p.slot][blockIdx.x]) + 1;
}

// f(std::integral_constant<int, LlQuant>{}) for the message format p's options select
// (use_nvfp4, else use_fp8, else bf16): the one place the host maps them to a kernel's kQuant.
template <typename F>
void ll_with_quant(const LlDispatchParams& p, F&& f) {
  if (p.use_nvfp4)
    f(std::integral_constant<int, kLlQuantNvfp4>{});
  else if (p.use_fp8)
    f(std::integral_constant<int, kLlQuantFp8>{});
  else
    f(std::integral_constant<int, kLlQuantBf16>{});
}

}  // namespace epx::detail

// The hook's send half is a kernel of its own translation unit (src/cuda/ll_send.cu, which
// defines EPX_LL_DISPATCH_SEND_MODULE and a send-only epx::ll::dispatch<kQuant, kShrink, false>
// of the same name with internal linkage): its own module, so its code and registers do not
// follow the receive's. Every other form is the kernel below.
#ifndef EPX_LL_DISPATCH_SEND_MODULE
namespace epx::ll {

// The ll dispatch kernel, one instantiation per form (profilers show one name per op, hook or
// not): kQuant the message format (LlQuant, from p.use_fp8 / p.use_nvfp4), kShrink whether the
// group has rank masks (BufferConfig::enable_shrink = p.symm.shrink; false: no mask code),
// kFused the fused launch (both halves, no enable_shrink: the two teams above; the host's choice)
// or not. Not fused, p.phases selects the halves, every phase on the whole CTA: the receive half
// (the hook) or, with kShrink, both (no hook); the send half of a call with a hook is ll_send.cu's
// kernel, so without kShrink this one holds no send code. Each carries only its own code, so the
// hooked halves do not fetch the fused launch's.
template <int kQuant, bool kShrink, bool kFused>
__global__ void __launch_bounds__(detail::kLlThreads, 1) dispatch(detail::LlDispatchParams p) {
  using namespace detail;
  static_assert(!(kFused && kShrink), "the fused launch has no rank masks");
  pdl_begin(p.pdl);
  const uint32_t e = ll_dispatch_epoch(p);
  // kFused: warps 0-7 send (and then wait for the messages) while warps 8-15 store the routing
  // rows, wait for everyone's and scan and list; all 16 copy (ll_dispatch_route,
  // ll_dispatch_recv). The team is opaque to the compiler, so the receive's code, which both
  // teams run, is compiled once.
  const bool router = kFused && threadIdx.x >= kLlThreads / 2;
  const LlTeam team = !kFused ? ll_team_all()
                      : ll_team_opaque(router ? LlTeam{kLlThreads / 2, kLlThreads / 2, 2}
                                              : LlTeam{0, kLlThreads / 2, 1});
  bool ok = true;
  if (router) {
    ok = ll_dispatch_route<kQuant>(p, e, team);
  } else if (kFused || (kShrink && (p.phases & kLlPhaseSend))) {
    EPX_LL_STAMP(p, 0, kTrDEntry);
    ok = ll_dispatch_send<kQuant, kShrink, kFused>(p, e, team);
    if (!kFused && !ok) return;
  }
  if (kFused || (p.phases & kLlPhaseRecv))
    ll_dispatch_recv<kQuant, kShrink>(p, e, team, kFused, ok);
}

}  // namespace epx::ll
#endif  // EPX_LL_DISPATCH_SEND_MODULE
