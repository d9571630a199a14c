// src/cuda/kernels/ll/combine.cuh — ll combine (docs/semantics.md §2.3): every source pulls, for
// each of its tokens, the expert rows of its selections from the experts' ranks and reduces them in
// k order.
//
// Rank r, T tokens (the dispatch's), C CTAs, slot q = handle.slot, epoch
// e = state.combine_epoch[q][b] + 1 (CTA b's word, advanced by CTA b at the end of the receive).
//
// send half (epx::ll::combine with kLlPhaseSend: the call with a hook, or both halves), the
// expert side:
//   1. Copy mode (not zero_copy): rows y[l][begin_s .. begin_s + count_s) of every source s != r
//      (handle.layout_range) into comb_y(r, q) — what the sources pull; units (l, sub) as in
//      dispatch. zero_copy: the caller already wrote comb_y(r, q) (ll_next_combine_buffer).
//      With a hook (copy_own) also s = r, and topk_idx / topk_weights into the stash: the hook's
//      receive reads nothing of the caller's (they may be dropped once the call returned).
//      Without a hook copy_own is set where y's rows are not 16-byte aligned: s = r's rows go
//      to comb_y(r, q) too, so step 7 reads only aligned rows.
//      use_logfmt: instead every row of every source, s = r included, is encoded into comb_y(r,
//      q) and comb_meta(r, q) (from y, or in place with zero_copy; logfmt.cuh), same units.
//   2. CTA 0: handle.layout_range -> comb_layout(r, q), use_logfmt -> comb_format(r, q); then
//      combine_routed[q][r] = e on every rank (what an overlapped peer waits for, so ranks that
//      disagree on overlap raise InvalidArgument instead of timing out). With the receive half in
//      the same launch the last kMaxRanks threads of CTA 0 do step 2 after the send's barrier and
//      store combine_routed with step 3's releases (one fence; CTA 0's other warps go on).
//   3. Every CTA: release +1 into combine_ready[q][r] of every rank, this one included (with
//      use_logfmt the receive reads this rank's rows from comb_y(r, q), encoded by every CTA).
//      When the receive half runs in the same launch, its last kMaxRanks threads issue these as
//      it starts (ll_combine_recv), so the fence holds no busy warp until the receive's next
//      barrier.
//   overlap (LlCombineOverlap; docs/design.md §7.6): the send half is ll_combine_send_overlap
//   below, on S CTAs: it pushes each block of y, once its GEMM signal is reached, into
//   land(s, q)[t][k0] of its source s, and adds C in shares to combine_ready.
// receive half (kLlPhaseRecv: the hook, or the second half without one), the source:
//   Tokens in C contiguous chunks of whole rows; at T <= C / 2 (not use_logfmt, not
//   enable_shrink), P CTAs per token, each reducing one slice of its output vectors
//   (ll_combine_slices; steps 4-6 are then the same in the token's P CTAs). A CTA with tokens:
//   4. counts, per expert, the tokens before its chunk that select it (a row's duplicates once);
//   5. waits combine_ready[q][d] >= e * C for every peer d (and d = r with use_logfmt, overlap
//      or copy_own), compares comb_format(d, q) with its own (kDevErrLlCombineFormat; a rank
//      with T = 0 does this in CTA 0 too, so every rank reports), then reads begin/count of its
//      block in every expert: comb_layout(d, q)[l][r] of the expert's rank d (its own handle for
//      d = r); wait-cost statistics (docs/semantics.md §2.5; wait_stats non-null): CTA 0 (it has
//      tokens whenever T > 0) reads %globaltimer when its warp 0 starts waiting and adds, per
//      peer d, the nanoseconds until it saw combine_ready[q][d] reached to wait_stats[d]
//      (atomicAdd; nothing for d = r, whose rows are not waited for, and nothing when T = 0: no
//      tokens, no wait);
//   6. per token of the chunk, in order, per k: j = the running count of its expert (duplicates
//      of an expert in one row share the first one's j), row = begin + j; the source of y(t, k)
//      is comb_y(d, q)[l][row] (or the caller's y for d = r in copy mode without use_logfmt
//      and copy_own);
//      overlap: land(r, q)[t][k0] (k0: the first k of t's row with that expert), wherever the
//      expert lives (the row count is checked as above);
//   7. EXACT ORDER of the cpu backend (src/cpu/ll_combine.cc, one node), token t, element c:
//        acc = 0.0f;
//        for k = 0 .. K-1 with topk_idx[t][k] != -1:  acc = __fmaf_rn(w[t][k], f32(y(t, k)[c]),
//        acc); out[t][c] = f32_to_bf16(acc)   (core/numeric.h, one rounding; the device uses the
//        hardware conversion f32x2_to_bf16x2, the same bits)
//      (threads take (token, 8-element vector) pairs, two at a time: both vectors' kLlLoadBatch
//      rows loaded at once, ll_reduce8_pair).
//      use_logfmt: f32(y(t, k)[c]) is the LogFMT decoding of the pulled bytes (logfmt.cuh).
//   Finish, every CTA: releases +1 into combine_pulled[q][r] on every peer (its pulls are done)
//   and sets its epoch word to e; CTA 0 then waits combine_pulled[q][d] >= e * C for every peer
//   d (nobody reads this rank's comb_y(r, q) any more). So when a combine completes on a
//   rank (stream order), its slot-q buffer is free to be rewritten: by the caller through
//   ll_next_combine_buffer, or by the next copy.
// Ids outside [-1, E) are reported (InvalidArgument) and skipped; a selection whose row lies past
// what its expert received from this rank (topk_idx is not the dispatch's) is reported and skipped.
// Rank mask (enable_shrink, common.cuh): the send copies no rows for masked sources and signals
// only unmasked ranks; the receive neither waits for nor reads a masked expert rank (a wait that
// times out masks it): its selections are skipped as if their ids were -1 (step 6: no source),
// and the finish releases and awaits only unmasked ranks.
#pragma once

#include "cuda/kernels/ll/common.cuh"
#include "cuda/kernels/ll/logfmt.cuh"

namespace epx::detail {

// Field order: the scalars the kernel's first path reads, then the routing and output pointers,
// then the region (LlSymm), then the hook's, the overlap's and the rest. A fresh launch reads its
// parameters through the constant cache, and each line it reads first is a miss on the reading
// warp's path (docs/design.md §7.3, Parameters). LlDispatchParams keeps its own order: laid out
// this way, its hooked send lost 0.25 µs (docs/perf.md §5 item 70, variant D).
struct LlCombineParams {
  int32_t pdl;     // launched with programmatic dependent launch (cuda/launch.h)
  int32_t phases;  // kLlPhaseSend | kLlPhaseRecv: which halves this launch runs
  int32_t slot;    // q
  int32_t rank;    // r
  int32_t num_tokens;  // T
  int32_t units_per_expert;  // S
  int32_t zero_copy;   // y is comb_y(r, q)
  int32_t use_logfmt;  // rows cross as LogFMT-10 (core/logfmt.h); equal on every rank
  int32_t y_vec16;     // y rows 16-byte aligned
  int32_t topk_is_i64;
  int32_t out_vec16;
  int32_t recv_ctas;  // C: the receive's CTAs (the shares of combine_ready)
  // The rows this rank keeps go to comb_y(r, q) as the peers' do (step 1), and a receive in the
  // same launch reads them there after its wait for this rank's combine_ready (step 5): with a
  // hook, and where y's rows are not 16-byte aligned (step 7 reads only aligned rows).
  // Send half with a hook: every input the receive reads is copied into epx's memory, so the
  // caller may drop or overwrite y, topk_idx and topk_weights once the call returned: its own
  // rows by copy_own, the routing and weights [T, K] to stash_ids / stash_w (the hook's launch
  // reads them there, and comb_layout(r, q)).
  int32_t copy_own;
  // Overlap (LlCombineOverlap): the send half is ll_combine_send_overlap on S CTAs; the receive
  // reads land(r, q) and its routing from route(r, q) (topk_idx below points there), weights
  // from stash_w.
  int32_t overlap;
  // Expert side.
  const uint16_t* y;  // copy mode: the caller's [L, RT, H] bf16, strides y_stride0/1 (elements)
  int64_t y_stride0;
  int64_t y_stride1;
  const int64_t* layout_range;  // this rank's handle.layout_range [L, R], row stride below
  int64_t layout_stride;
  // Source side.
  const void* topk_idx;  // [T, K], row stride topk_stride elements
  int64_t topk_stride;
  const float* weights;  // [T, K] f32, row stride weights_stride elements
  int64_t weights_stride;
  uint16_t* out;  // [T, H] bf16, row stride out_stride elements (or null)
  // kF32Out (the node-local combine of the ll across nodes, src/cuda/ll_nodes.cu): the sums
  // unrounded, [T, H] float32, row stride out_stride elements, 16-byte aligned; `out` unused.
  float* out_f32;
  int64_t out_stride;
  LlSymm symm;
  int64_t* stash_ids;
  float* stash_w;
  // Optional [R] int64, contiguous: combine_wait_recv_cost_stats (the receive half adds to it).
  int64_t* wait_stats;
  const int32_t* signals;     // [L * blocks]: signal l * blocks + b covers block b of expert l
  int64_t block_rows;         // rows per block (0: the whole expert)
  int64_t blocks;             // signals per local expert
  uint32_t expected;          // reached when (int32_t)(signal - expected) >= 0
  const int32_t* recv_count;  // optional [L]: compared with the handle (kDevErrLlOverlapCount)
  const int32_t* src_info;    // the handle's [L, RT], row stride src_info_stride
  int64_t src_info_stride;
#ifdef EPX_DIAGNOSTICS
  int32_t ablate;  // LlAblate bits (cuda/tuning.h, diagnostics builds only)
#endif
  WaitContext wait;
#ifdef EPX_LL_TRACE
  uint64_t* trace;  // trace.cuh (null: off)
#endif
};

// The combine kernel's instantiations (epx::ll::combine<kMode, ...>): each form's code only, so
// the plain combine carries no LogFMT or overlap code (its registers, shared memory and
// instruction footprint as before those forms existed). The host picks the one matching
// use_logfmt / overlap, and kShrink = symm.shrink as the dispatch's (common.cuh: without
// enable_shrink no mask code is compiled in).
enum LlCombineMode : int { kLlCombinePlain = 0, kLlCombineLogfmt = 1, kLlCombineOverlap = 2 };

// This combine's format word: what every rank compares (kDevErrLlCombineFormat).
__device__ __forceinline__ int32_t ll_combine_format(const LlCombineParams& p) {
  return p.use_logfmt | p.overlap << 1;
}

// Step 2 (CTA 0, threads first, first + 1, ..., `count` of them): handle.layout_range ->
// comb_layout(r, q), the format word -> comb_format.
__device__ void ll_combine_publish_layout(const LlCombineParams& p, int first, int count) {
  const LlLayout& g = p.symm.layout;
  const int R = g.num_ranks, L = g.num_local_experts;
  if (static_cast<int>(threadIdx.x) == first)
    *g.comb_format(p.symm.local, p.slot) = ll_combine_format(p);
  int64_t* layout = g.comb_layout(p.symm.local, p.slot);
  for (int i = static_cast<int>(threadIdx.x) - first; i < L * R; i += count) {
    const int l = i / R, s = i - l * R;
    layout[i] = __ldg(reinterpret_cast<const long long*>(p.layout_range) + l * p.layout_stride + s);
  }
}

// Step 2's end, CTA 0 after a barrier: combine_routed[q][r] = e on every rank, releasing this
// CTA's writes of comb_layout, comb_format (and with overlap the route) of slot q.
__device__ __forceinline__ void ll_combine_publish_routed(const LlCombineParams& p, uint32_t e) {
  const LlSymm& symm = p.symm;
  const int d = threadIdx.x;
  if (d < symm.layout.num_ranks) {
    fence_acq_rel(symm.one_gpu);
    st_relaxed_sys(&symm.layout.sync(symm.peers[d])->combine_routed[p.slot][p.rank], e);
  }
}

// Step 3: threads first + d release +1 into combine_ready[q][r] of every rank d not in `masked`
// (after a barrier that follows the send's stores). `routed` (CTA 0 with the receive in the same
// launch): the same threads also store step 2's combine_routed[q][r] = e on every rank d, after
// the same fence.
__device__ __forceinline__ void ll_combine_signal_ready(const LlCombineParams& p, uint64_t masked,
                                                        int first, bool routed = false,
                                                        uint32_t e = 0) {
  const LlLayout& g = p.symm.layout;
  const int d = static_cast<int>(threadIdx.x) - first;
  if (d < 0 || d >= g.num_ranks || (!routed && rank_skipped(masked, d))) return;
  LlSync* sync = g.sync(p.symm.peers[d]);
  fence_acq_rel(p.symm.one_gpu);
  if (routed) st_relaxed_sys(&sync->combine_routed[p.slot][p.rank], e);
  if (!rank_skipped(masked, d)) red_add_relaxed_sys(&sync->combine_ready[p.slot][p.rank], 1u);
}

// Steps 1-3 (kMode: plain or LogFMT); returns the mask the send used. `defer` (the receive half
// runs in the same launch): step 3's releases are left to ll_combine_recv, which issues them from
// warps its steps 4-5 leave idle, so their fence overlaps the receive's first steps.
template <int kMode, bool kShrink>
__device__ uint64_t ll_combine_send(const LlCombineParams& p, uint32_t e, bool defer) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, L = g.num_local_experts, me = p.rank, q = p.slot;
  const int64_t H = g.hidden, RT = g.rows_per_expert;
  uint16_t* buf = g.comb_y(symm.local, q);
  const uint64_t masked = ll_masked_uniform<kShrink>(symm);

  if constexpr (kMode == kLlCombineLogfmt) {
    const int S = p.units_per_expert;
    for (int u = blockIdx.x; u < L * S; u += gridDim.x) {
      const int l = u / S, sub = u - l * S;
      int64_t rows = 0;  // expert l's rows [0, rows) hold data (every source's block, packed)
      for (int s = 0; s < R; ++s) {
        const int64_t range =
            __ldg(reinterpret_cast<const long long*>(p.layout_range) + l * p.layout_stride + s);
        rows = max(rows, min((range >> 32) + (range & 0xFFFFFFFF), RT));
      }
      const int64_t n_mine = rows > sub ? (rows - sub + S - 1) / S : 0;
      ll_logfmt_encode_rows(
          symm, q, n_mine, l * RT + sub, S, p.zero_copy != 0, [&](int64_t m, int64_t c) {
            const int64_t row = sub + m * S;
            if (p.zero_copy) return ld_landed<uint4>(buf + (l * RT + row) * H + c);
            return ll_ld_input8(p.y + l * p.y_stride0 + row * p.y_stride1 + c, p.y_vec16);
          });
    }
  } else if (!p.zero_copy && p.y) {
    const int S = p.units_per_expert;
    const int64_t nv = H / 8;
    for (int u = blockIdx.x; u < L * S; u += gridDim.x) {
      const int l = u / S, sub = u - l * S;
      for (int s = 0; s < R; ++s) {
        if (s == me && !p.copy_own) continue;   // read straight from y by this rank's pulls
        if (rank_skipped(masked, s)) continue;  // a masked source pulls nothing from here
        const int64_t range =
            __ldg(reinterpret_cast<const long long*>(p.layout_range) + l * p.layout_stride + s);
        const int64_t begin = range >> 32;
        int64_t count = range & 0xFFFFFFFF;
        if (begin + count > RT) count = begin < RT ? RT - begin : 0;
        const int64_t n_mine = count > sub ? (count - sub + S - 1) / S : 0;
        ll_copy_rows<false>(static_cast<int>(n_mine), static_cast<int>(nv), p.y_vec16,
                            [&](int m, const uint16_t** src, uint4** dst) {
                              const int64_t row = begin + sub + int64_t{m} * S;
                              *src = p.y + l * p.y_stride0 + row * p.y_stride1;
                              *dst = reinterpret_cast<uint4*>(buf + (l * RT + row) * H);
                            });
      }
    }
  }
  if (p.stash_ids) {
    const int K = g.top_k;
    const int64_t n = static_cast<int64_t>(p.num_tokens) * K;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t t = i / K;
      const int k = static_cast<int>(i - t * K);
      p.stash_ids[i] = ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, t, k);
      p.stash_w[i] = p.weights[t * p.weights_stride + k];
    }
  }
  // With the receive in this launch, step 2 goes to the warps that issue the deferred ready
  // releases (ll_combine_recv): the layout copy, combine_routed and the releases behind one fence
  // on warps with no other work, so CTA 0's receive starts with the other CTAs'.
  if (blockIdx.x == 0 && !defer) ll_combine_publish_layout(p, 0, blockDim.x);
  // 3. Pairs with step 5 of every peer's receive.
  __syncthreads();
  EPX_LL_STAMP(p, 1, kTrCSendCopy);
  if (defer) return masked;
  if (blockIdx.x == 0) ll_combine_publish_routed(p, e);
  ll_combine_signal_ready(p, masked, 0);
  EPX_LL_STAMP(p, 1, kTrCSignal);
  return masked;
}

// ---- the overlapped send (LlCombineOverlap; docs/design.md §7.6) -----------------------------
//
// S = gridDim.x CTAs (the call's SM budget), epoch e, slot q, rank r; n_l = the handle's rows of
// local expert l; block = block_rows, or n_l (one signal per expert):
//   O1. CTA 0: this rank's routing (topk_idx as int32; ids outside [-1, E) reported and stored
//       as -1) -> route(r, q), its weights -> stash_w (local, for its own receive), step 2's
//       layout and format word; recv_count, when given, compared with n_l
//       (kDevErrLlOverlapCount); a barrier, then combine_routed[q][r] = e on every rank.
//   O2. Every CTA: the handle's layout_range into shared memory; waits combine_routed[q][s] >= e
//       for every s: s's route, layout and format of this combine are in place, and s's previous
//       receive through slot q has finished reading land(s, q) (stream order on s). A source
//       whose format differs (a plain combine) is reported (kDevErrLlCombineFormat) and gets no
//       rows.
//   O3. Items (l, b) with rows, b < ceil(n_l / block), expert-major (the GEMM's order): CTA i
//       takes the blocks b = (i - l) mod S, + S, ... of each expert l < L - 1 (round robin across
//       experts too); every block of the last expert, which the GEMM finishes last, is split:
//       CTA i takes its rows i, i + S, ... Per item and chunk of up to kLlThreads rows, thread m
//       finds row m's destination: its source s (the block of layout_range holding it), t =
//       src_info[l][row], k0 = the first k of route(s, q)[t] that selects expert r * L + l (none:
//       kDevErrLlOverlapRoute, the row is not sent): land(s, q)[t][k0]. Meanwhile, before the
//       item's first chunk, thread 0 waits until the item's signal is reached
//       (ld.acquire.gpu with __nanosleep, bounded by the group timeout: Timeout naming l, b, the
//       value wanted and the value seen); a barrier; the chunk's rows are copied with coherent
//       (L2) loads of y — the GEMM wrote them during this kernel, never the read-only path — and
//       16-byte stores into the sources' land (s = r: this rank's own).
//   O4. Every CTA: a barrier, then releases its share of C (C / S, + 1 for the first C % S) into
//       combine_ready[q][r] of every rank: the shares sum to C, so the receive's e * C holds
//       whichever form each combine took. The receive half is ll_combine_recv with p.overlap.
// Dynamic shared memory (host: ll_overlap_smem_bytes): the layout ranges [L, R] int64 and one
// destination per row of a chunk [kLlThreads].

// Dynamic shared memory of the overlapped send.
EPX_LL_HD size_t ll_overlap_smem_bytes(const LlLayout& g) {
  return 8 * static_cast<size_t>(g.num_local_experts) * g.num_ranks + 8 * kLlThreads;
}

// O3's wait, one thread: signal i = l * blocks + b reached; false on timeout (recorded: Timeout,
// peer = b, a = kWaitSignal | l << 8 | i << 32, b = wanted << 32 | seen) or when the kernel
// aborted.
__device__ bool ll_overlap_wait_signal(const LlCombineParams& p, int l, int64_t b) {
  const int64_t i = l * p.blocks + b;
  const auto* signal = reinterpret_cast<const uint32_t*>(p.signals + i);
  uint32_t v = ld_acquire_gpu(signal);  // pairs with the GEMM's release (fence + add)
  if (seq_reached(v, p.expected)) return true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    __nanosleep(32);
    v = ld_acquire_gpu(signal);
    if (seq_reached(v, p.expected)) return true;
    if ((spins & 63u) == 63u) {
      if (*reinterpret_cast<volatile uint32_t*>(&p.wait.state->abort)) return false;
      if (globaltimer_ns() - start > p.wait.timeout_ns) {
        record_timeout(p.wait, static_cast<int32_t>(b),
                       static_cast<int64_t>(kWaitSignal) | static_cast<int64_t>(l) << 8 | i << 32,
                       static_cast<int64_t>(static_cast<uint64_t>(p.expected) << 32 | v));
        return false;
      }
    }
  }
}

// O3: where row `row` of local expert l lands (0: not sent), `ranges` the expert's [R] layout.
__device__ uintptr_t ll_overlap_dest(const LlCombineParams& p, const long long* ranges, int l,
                                     int64_t row, uint64_t skip) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, K = g.top_k;
  int s = 0;  // the last source whose block begins at or before the row (blocks are packed)
  while (s + 1 < R && (ranges[s + 1] >> 32) <= row) ++s;
  if (rank_skipped(skip, s)) return 0;
  const int64_t t = __ldg(p.src_info + l * p.src_info_stride + row);
  const int32_t expert = p.rank * g.num_local_experts + l;
  int k0 = -1;
  if (t >= 0 && t < g.max_tokens) {
    const int32_t* route = g.comb_route(symm.peers[s], p.slot) + t * K;
    for (int kb = 0; kb < K && k0 < 0; kb += kLlIdBatch) {
      int32_t id[kLlIdBatch];
#pragma unroll
      for (int u = 0; u < kLlIdBatch; ++u)
        id[u] = kb + u < K ? ld_landed<int32_t>(route + kb + u) : -1;
#pragma unroll
      for (int u = kLlIdBatch - 1; u >= 0; --u)
        if (id[u] == expert) k0 = kb + u;
    }
  }
  if (k0 < 0) {
    record_error(p.wait, kDevErrLlOverlapRoute, s, t, expert);
    return 0;
  }
  return reinterpret_cast<uintptr_t>(g.comb_land(symm.peers[s], p.slot) + (t * K + k0) * g.hidden);
}

// O1-O4. False when a wait failed (this CTA then signals nothing: the peers time out).
__device__ bool ll_combine_send_overlap(const LlCombineParams& p, uint32_t e) {
  __shared__ unsigned long long s_skip;
  __shared__ int s_ok;
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int R = g.num_ranks, L = g.num_local_experts, K = g.top_k, E = g.num_experts;
  const int me = p.rank, q = p.slot, S = gridDim.x;
  const int64_t H = g.hidden, RT = g.rows_per_expert;
  auto* s_range = reinterpret_cast<long long*>(ll_dyn_smem());  // [L, R]
  auto* s_dst = reinterpret_cast<uintptr_t*>(s_range + L * R);  // [kLlThreads]
  auto rows_of = [&](const long long* ranges) {                 // n_l (ranges: the expert's [R])
    int64_t n = 0;
    for (int s = 0; s < R; ++s) {
      const int64_t range = ranges[s];
      n = max(n, min((range >> 32) + (range & 0xFFFFFFFF), RT));
    }
    return n;
  };
  for (int i = threadIdx.x; i < L * R; i += blockDim.x)
    s_range[i] = __ldg(reinterpret_cast<const long long*>(p.layout_range) +
                       (i / R) * p.layout_stride + i % R);
  if (threadIdx.x == 0) s_skip = 0;
  __syncthreads();

  // O1.
  if (blockIdx.x == 0) {
    ll_combine_publish_layout(p, 0, blockDim.x);
    int32_t* route = g.comb_route(symm.local, q);
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(p.num_tokens) * K; i += blockDim.x) {
      const int64_t t = i / K;
      const int k = static_cast<int>(i - t * K);
      int64_t id = ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, t, k);
      if (id < -1 || id >= E) {
        record_error(p.wait, kDevErrBadExpert, -1, t * 64 + k, id);
        id = -1;
      }
      route[i] = static_cast<int32_t>(id);
      p.stash_w[i] = __ldg(p.weights + t * p.weights_stride + k);
    }
    for (int l = threadIdx.x; p.recv_count && l < L; l += blockDim.x) {
      const int64_t n = rows_of(s_range + l * R);
      const int32_t v = __ldg(p.recv_count + l);
      if (v != n)
        record_error(p.wait, kDevErrLlOverlapCount, -1, l, static_cast<int64_t>(v) << 32 | n);
    }
    __syncthreads();
    ll_combine_publish_routed(p, e);
  }

  // O2. Pairs with O1 (or step 2) of every rank.
  if (!wait_ranks(
          g.sync(symm.local)->combine_routed[q], R, 0, [&](int) { return e; }, p.wait, kWaitReady))
    return false;
  EPX_LL_STAMP(p, 1, kTrCRouted);
  if (static_cast<int>(threadIdx.x) < R) {
    const int d = threadIdx.x;
    const int32_t theirs = ld_landed<int32_t>(g.comb_format(symm.peers[d], q));
    const int32_t mine = ll_combine_format(p);
    if (theirs != mine) {
      if (blockIdx.x == 0) record_error(p.wait, kDevErrLlCombineFormat, d, theirs, mine);
      atomicOr(&s_skip, static_cast<unsigned long long>(rank_bit(d)));
    }
  }
  __syncthreads();

  // O3.
  const int64_t nv = H / 8;
  const uint16_t* own_y = g.comb_y(symm.local, q);
  for (int l = 0; l < L; ++l) {
    const long long* ranges = s_range + l * R;
    const int64_t n = rows_of(ranges);
    if (n == 0) continue;
    const int64_t block = p.block_rows > 0 ? p.block_rows : n;
    const int64_t nb = (n + block - 1) / block;
    // The last expert's blocks (the GEMM finishes it last) go to every CTA, rows i, i + S, ...
    // of each, so the tail after the last GEMM is 1/S of its push; the others round robin.
    const bool split = l == L - 1;
    const int64_t step = split ? S : 1;
    for (int64_t b = split ? 0 : ((static_cast<int>(blockIdx.x) - l) % S + S) % S; b < nb;
         b += split ? 1 : S) {
      const int64_t r0 = b * block, r1 = min(n, r0 + block);
      const int64_t first = split ? r0 + blockIdx.x : r0;  // this CTA's rows: first + j * step
      const int64_t mine = first < r1 ? (r1 - first + step - 1) / step : 0;
      EPX_LL_ITEM_DECL(item);
      for (int64_t c0 = 0; c0 < mine; c0 += kLlThreads) {
        const int rows = static_cast<int>(min(static_cast<int64_t>(kLlThreads), mine - c0));
        auto row_of = [&](int m) { return first + (c0 + m) * step; };
        if (static_cast<int>(threadIdx.x) < rows)
          s_dst[threadIdx.x] = ll_overlap_dest(p, ranges, l, row_of(threadIdx.x), s_skip);
        EPX_LL_ITEM_NOW(item, wait, c0 == 0);
        if (threadIdx.x == 0) s_ok = c0 != 0 || ll_overlap_wait_signal(p, l, b);
        EPX_LL_ITEM_NOW(item, seen, c0 == 0);
        __syncthreads();  // the block's rows were stored: y loads after the acquire
        if (!s_ok) return false;
        ll_copy_rows<true>(rows, static_cast<int>(nv), p.zero_copy || p.y_vec16,
                           [&](int m, const uint16_t** src, uint4** dst) {
                             const int64_t row = row_of(m);
                             *src = p.zero_copy ? own_y + (l * RT + row) * H
                                                : p.y + l * p.y_stride0 + row * p.y_stride1;
                             *dst = reinterpret_cast<uint4*>(s_dst[m]);
                           });
        __syncthreads();  // s_dst is rewritten by the next chunk
      }
      // (a split item: the record of whichever of its CTAs writes last)
      if (mine > 0) EPX_LL_ITEM_PUT(p, item, l * p.blocks + b);
    }
  }
  EPX_LL_STAMP(p, 1, kTrCSendCopy);

  // O4. Pairs with step 5 of every rank's receive.
  const uint32_t share = ll_overlap_ready_share(p.recv_ctas, S, static_cast<int>(blockIdx.x));
  if (static_cast<int>(threadIdx.x) < R) {
    fence_acq_rel(symm.one_gpu);
    red_add_relaxed_sys(&g.sync(symm.peers[threadIdx.x])->combine_ready[q][me], share);
  }
  EPX_LL_STAMP(p, 1, kTrCSignal);
  return true;
}

// Two combine output vectors at once (step 7, the plain form): acc[j] as ll_reduce8's for
// vector j (bf16 rows; sources src_j, weights w_j; a source of 0 is skipped); `two` false: vector
// 0 only, vector 1's code branched over (a thread's last, odd vector runs no more instructions
// than ll_reduce8). Each batch's loads of both vectors are issued before either is reduced, so a
// thread with two vectors waits one round of loads, not two. Each vector's fma order is
// ll_reduce8's (the same bits).
template <int kBatch, typename Load>
__device__ __forceinline__ void ll_reduce8_pair(int K, bool two, const uintptr_t* src0,
                                                const float* w0, const uintptr_t* src1,
                                                const float* w1, Load load, float (&acc)[2][8]) {
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[0][c] = acc[1][c] = 0.0f;
  for (int kb = 0; kb < K; kb += kBatch) {
    uint4 val[2][kBatch];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j == 1 && !two) break;
      const uintptr_t* src = j ? src1 : src0;
#pragma unroll
      for (int kk = 0; kk < kBatch; ++kk)
        if (kb + kk < K && src[kb + kk]) val[j][kk] = load(j, kb + kk);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j == 1 && !two) break;
      const uintptr_t* src = j ? src1 : src0;
      const float* w = j ? w1 : w0;
#pragma unroll
      for (int kk = 0; kk < kBatch; ++kk) {
        if (kb + kk >= K || !src[kb + kk]) continue;
        float f[8];
        ll_bf16x8_to_f32(val[j][kk], f);
        const float wk = w[kb + kk];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[j][c] = __fmaf_rn(wk, f[c], acc[j][c]);
      }
    }
  }
}

// Step 5's wait, by warp 0: combine_ready[q][d] >= e * C for every peer d not in `masked` (and
// this rank with use_logfmt: its encoded rows come from every CTA of its send half), each peer's
// use_logfmt compared with this rank's; `wait_ns` (optional) as in step 5 (with enable_shrink
// also for a peer masked while awaited). False when a wait failed (on every lane).
template <int kMode, bool kShrink>
__device__ bool ll_combine_wait_ready(const LlCombineParams& p, uint32_t e, int64_t* wait_ns,
                                      uint64_t masked) {
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const int me = p.rank, q = p.slot;
  bool ok = true;
  const uint64_t wait_start = wait_ns ? globaltimer_ns() : 0;
  const int32_t mine = ll_combine_format(p);
  for (int d = threadIdx.x; d < g.num_ranks && ok; d += 32) {
    if ((d == me && kMode == kLlCombinePlain && !p.copy_own) || rank_skipped(masked, d))
      continue;
    const uint32_t* ready = g.sync(symm.local)->combine_ready[q] + d;
    bool arrived = true;
    if (kShrink && symm.shrink && d != me)
      arrived = ll_wait_or_mask(symm, ready, e * gridDim.x, p.wait, kWaitRows, d);
    else
      ok = wait_flag<true>(ready, e * gridDim.x, p.wait, kWaitRows, d);
    if (!ok || d == me) continue;
    if (wait_ns) add_wait_ns(wait_ns + d, wait_start);
    if (!arrived) continue;
    const int32_t theirs = ld_landed<int32_t>(g.comb_format(symm.peers[d], q));
    if (theirs != mine) record_error(p.wait, kDevErrLlCombineFormat, d, theirs, mine);
  }
  ok = __all_sync(0xffffffffu, ok);
  __syncwarp();  // orders the lanes' loads below after the acquires (as a barrier)
  return ok;
}

// The mask now, read by lane 0 and shuffled to the warp (warp-uniform; 0 without enable_shrink).
template <bool kShrink>
__device__ __forceinline__ uint64_t ll_masked_warp(const LlSymm& symm) {
  if (!kShrink || !symm.shrink) return 0;
  uint64_t m = 0;
  if ((threadIdx.x & 31) == 0)
    m = *reinterpret_cast<volatile unsigned long long*>(symm.layout.mask(symm.local));
  return __shfl_sync(0xffffffffu, m, 0);
}

// Steps 4-7 and the finish. False when a wait failed. kF32Out: step 7 stores the float32 sums
// (out_f32) instead of rounding them (plain form only).
// `deferred` (the send half ran in this launch and left step 3 to the receive): the last
// kMaxRanks threads release it with `send_masked` first (in CTA 0 after step 2), so only their
// warps wait for the fence while the others start: in steps 4-5 warp 0 reads ranges and waits,
// and thread 32 + i counts the chunk's earlier tokens i, i + 480, ... and loads the first group's
// ids (kDirect: resolves selection i), which leaves warps 14-15 idle while the chunk starts at
// token <= 416.
template <int kMode, bool kShrink, bool kF32Out, bool kDirect>
__device__ bool ll_combine_recv(const LlCombineParams& p, uint32_t e, bool deferred,
                                uint64_t send_masked) {
  constexpr bool kLogfmt = kMode == kLlCombineLogfmt;
  constexpr int kSlots = kLlCombineTokens * kLlMaxTopK;
  __shared__ int32_t s_cnt[kLlMaxExperts];      // tokens so far per expert (step 4, 6)
  __shared__ long long s_range[kLlMaxExperts];  // begin << 32 | count of this rank's block
  __shared__ int32_t s_ids[kSlots];
  __shared__ int32_t s_row[kSlots];
  __shared__ uintptr_t s_src[kSlots];
  __shared__ float s_w[kSlots];
  __shared__ int s_ok;
  __shared__ uint64_t s_masked;                // the ranks this CTA skips (after its waits)
  uintptr_t* const s_mrow = ll_logfmt_rows();  // use_logfmt: the rows' meta words (0: skipped)
  const LlSymm& symm = p.symm;
  const LlLayout& g = symm.layout;
  const bool shrink = kShrink && symm.shrink;  // enable_shrink (false: no mask code)
  const int R = g.num_ranks, K = g.top_k, L = g.num_local_experts, E = g.num_experts;
  const int me = p.rank, q = p.slot;
  const int64_t H = g.hidden, RT = g.rows_per_expert, T = p.num_tokens;
  const int64_t nv = H / 8;
  // Tokens [t_begin, t_end) of this CTA, their vectors [v_begin, v_begin + v_count): whole rows,
  // or at small T one slice of one token (ll_combine_slices). Whole rows in the logfmt form, and
  // with enable_shrink: each CTA reads the mask after its own waits, so a token's P CTAs could
  // see different masks and one output row mix the two (one CTA per token needs no agreement).
  const int P = kLogfmt || shrink ? 1 : ll_combine_slices(T, static_cast<int>(gridDim.x), nv);
  // T is an int32: a 32-bit division, inlined (a 64-bit one is a call before the first wait).
  const int64_t chunk =
      P > 1 ? 1 : (static_cast<uint32_t>(T) + gridDim.x - 1) / gridDim.x;
  const int cta = static_cast<int>(blockIdx.x), slice = P > 1 ? cta % P : 0;  // 32-bit divisions
  const int64_t t_begin = min(static_cast<int64_t>(P > 1 ? cta / P : cta) * chunk, T);
  const int64_t t_end = min(t_begin + chunk, T);
  const int v_begin = P > 1 ? ll_combine_slice_begin(static_cast<int>(nv), slice, P) : 0;
  const int v_count = P > 1 ? ll_combine_slice_begin(static_cast<int>(nv), slice + 1, P) - v_begin
                            : static_cast<int>(nv);
  auto id_at = [&](int64_t t, int k) {
    return ll_topk_at(p.topk_idx, p.topk_is_i64, p.topk_stride, t, k);
  };
  // Selection (t, k)'s id `id` as the receive uses it: one outside [-1, E) is reported and -1.
  auto checked_id = [&](int64_t t, int k, int64_t id) {
    if (id < -1 || id >= E) {
      record_error(p.wait, kDevErrBadExpert, -1, t * 64 + k, id);
      id = -1;
    }
    return static_cast<int32_t>(id);
  };
  EPX_LL_STAMP(p, 1, kTrCRecvEntry);
  EPX_LL_TRACE_SM(p, 1, 0);
  EPX_LL_TRACE_DECL(ids);
  const uint64_t masked0 = ll_masked_uniform<kShrink>(symm);
  if (threadIdx.x == 0) s_masked = masked0;  // CTAs without tokens: read at the finish

  auto signal_deferred = [&]() {
    if (!deferred) return;
    static_assert(kMaxRanks % 32 == 0 && kMaxRanks < kLlThreads, "whole warps signal");
    const int first = static_cast<int>(blockDim.x) - kMaxRanks;  // the last two warps
    if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) >= first) {
      // Step 2 (ll_combine_send), then a barrier of these warps: the fence below covers every
      // one of their stores.
      ll_combine_publish_layout(p, first, kMaxRanks);
      asm volatile("bar.sync 1, %0;" ::"n"(kMaxRanks) : "memory");
    }
    ll_combine_signal_ready(p, send_masked, first, blockIdx.x == 0, e);
    EPX_LL_STAMP(p, 1, kTrCSignal);  // (threads 0 / 256: when the last warps issued it)
  };
  signal_deferred();
  auto weight_at = [&](int64_t t, int k) { return __ldg(p.weights + t * p.weights_stride + k); };
  // Step 6: the source of a selection of expert id whose row is `row` of the expert's block (d =
  // id / L, l = id % L): comb_y(d, q)[l][row] (the caller's y for d = r in copy mode without
  // use_logfmt; *mrow its meta words with use_logfmt), or with overlap land(r, q)[t][k0].
  auto source_of = [&](int id, int64_t row, int64_t t, int k0, uintptr_t* mrow) -> uintptr_t {
    const int d = id / L, l = id - d * L;
    if constexpr (kMode == kLlCombineOverlap) {
      return reinterpret_cast<uintptr_t>(g.comb_land(symm.local, q) + (t * K + k0) * H);
    } else {
      if (d == me && !p.zero_copy && !p.copy_own && !kLogfmt)
        return reinterpret_cast<uintptr_t>(p.y + l * p.y_stride0 + row * p.y_stride1);
      if constexpr (kLogfmt)
        *mrow = reinterpret_cast<uintptr_t>(g.comb_meta(symm.peers[d], q) +
                                            (l * RT + row) * g.num_groups);
      return reinterpret_cast<uintptr_t>(g.comb_y(symm.peers[d], q) + (l * RT + row) * H);
    }
  };
  // 7. Tokens [c0, c0 + n) of a group, their sources and weights in s_src / s_w (/ s_mrow); ends
  // with a barrier (s_* are rewritten by the next group).
  auto reduce_group = [&](int64_t c0, int n) {
    if constexpr (kLogfmt) {
      ll_logfmt_reduce(symm, c0, n, s_src, s_mrow, s_w, p.out, p.out_stride, p.out_vec16 != 0);
      // (it ends with a barrier, as the loop below)
    } else {
      // Output vector (tl, v_begin + v), tl * v_count + v = threadIdx.x + j * blockDim.x:
      // advanced without a division per vector (a 32-bit one when v wraps). A thread takes its
      // vectors two at a time, both vectors' loads in flight together (ll_reduce8_pair).
      const int nvi = v_count;
      auto next = [&](int& t, int& v) {
        v += blockDim.x;
        if (v >= nvi) {
          const int wrap = v / nvi;
          t += wrap;
          v -= wrap * nvi;
        }
      };
      auto put = [&](int t, int v, const float* acc) {
        if constexpr (kF32Out) {
          auto* o = reinterpret_cast<float4*>(p.out_f32 + (c0 + t) * p.out_stride +
                                              8 * (v_begin + v));
          o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
          o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        } else if (p.out) {
          const uint4 packed = f32_to_bf16_vec<uint4>(acc);
          ll_st8(p.out + (c0 + t) * p.out_stride + 8 * (v_begin + v), packed,
                 p.out_vec16 != 0);
        }
      };
      // (diagnostics: kLlAblateCombinePull leaves the pulls and the reduce out)
      int tl = static_cast<int>(threadIdx.x) / nvi;
      if (EPX_LL_ABLATED(p.ablate, kLlAblateCombinePull)) tl = n;
      int v = static_cast<int>(threadIdx.x) - tl * nvi;
      for (; tl < n;) {
        int tl2 = tl, v2 = v;
        next(tl2, v2);
        const bool two = tl2 < n;
        const uintptr_t* src = s_src + tl * K;
        const uintptr_t* src2 = s_src + (two ? tl2 : tl) * K;
        float acc[2][8];
        ll_reduce8_pair<kLlLoadBatch>(
            K, two, src, s_w + tl * K, src2, s_w + (two ? tl2 : tl) * K,
            [&](int j, int k) {
              return ld_landed<uint4>(reinterpret_cast<const uint4*>(j ? src2[k] : src[k]) +
                                      v_begin + (j ? v2 : v));
            },
            acc);
        put(tl, v, acc[0]);
        if (two) put(tl2, v2, acc[1]);
        tl = tl2, v = v2;
        next(tl, v);
      }
      __syncthreads();  // s_* are rewritten by the next group of tokens
    }
  };
  if (kDirect && t_begin < t_end) {
    // 4-6 with the row map (kDirect): each selection's row is the entry (t, k0) of this rank's
    // row map of slot q, stored by the expert's rank in its dispatch receive (k0: the first k of
    // the expert in t's row). In the first group warp 0 waits for the peers (step 5) while
    // threads 32 + i resolve selection i: its id, weight and entry in one round trip; a peer's
    // entry is used before the wait only when it is already this dispatch's (the rows are read
    // after the barrier). After the barrier the rest is resolved again (a duplicate, mapped at its
    // first k; a peer's entry not yet seen; with enable_shrink a peer's selection, once the mask
    // is known); an entry of another dispatch is reported (kDevErrLlCombineNotSent) and skipped.
    static_assert(kSlots <= kLlThreads - 32, "one selection per thread");
    const uint64_t* rmap = g.row_map(symm.local, q);
    const auto* depoch = reinterpret_cast<const volatile uint32_t*>(
        &g.state(symm.local)->dispatch_epoch[q][blockIdx.x]);
    // The first pass of selection i of the group at c0; true: resolve it after the barrier.
    auto resolve = [&](int64_t c0, int i, bool early) {
      const int64_t t = c0 + i / K;
      const int k = i - (i / K) * K;
      const int64_t raw = id_at(t, k);
      const float w = weight_at(t, k);
      const uint64_t entry = ld_relaxed_sys(rmap + t * K + k);
      const uint32_t de = *depoch;
      const int32_t id = checked_id(t, k, raw);
      s_ids[i] = id;
      uintptr_t src = 0, mrow = 0;
      bool later = false;
      if (id >= 0) {
        const int d = id / L;
        later = !ll_row_entry_is(entry, id, de) || (early && shrink && d != me);
        if (!later && (early || !rank_skipped(s_masked, d)))
          src = source_of(id, ll_row_entry_row(entry), t, k, &mrow);
      }
      s_src[i] = src;
      if constexpr (kLogfmt) s_mrow[i] = mrow;
      s_w[i] = src || later ? w : 0.0f;
      return later;
    };
    // The second pass (after the barrier: the group's ids and the mask are in shared memory).
    auto resolve_late = [&](int64_t c0, int i) {
      const int64_t t = c0 + i / K;
      const int k = i - (i / K) * K;
      const int* ids = s_ids + (i / K) * K;
      const int id = ids[k], d = id / L;
      int k0 = 0;
      while (ids[k0] != id) ++k0;
      uintptr_t src = 0, mrow = 0;
      if (!rank_skipped(s_masked, d)) {
        const uint64_t entry = ld_relaxed_sys(rmap + t * K + k0);
        if (ll_row_entry_is(entry, id, *depoch))
          src = source_of(id, ll_row_entry_row(entry), t, k0, &mrow);
        else if (!EPX_LL_ABLATED(p.ablate, kLlAblateRecvList))  // (no row map was listed)
          record_error(p.wait, kDevErrLlCombineNotSent, d, t * 64 + k, id);
      }
      s_src[i] = src;
      if constexpr (kLogfmt) s_mrow[i] = mrow;
      if (!src) s_w[i] = 0.0f;
    };
    for (int64_t c0 = t_begin; c0 < t_end; c0 += kLlCombineTokens) {
      const int n = static_cast<int>(min(static_cast<int64_t>(kLlCombineTokens), t_end - c0));
      const bool early = c0 == t_begin;
      EPX_LL_TRACE_BEGIN(ids);
      int i = static_cast<int>(threadIdx.x) - (early ? 32 : 0);
      bool later = false;
      if (i < 0) {
        // Warp 0, first group: step 5 (pairs with step 3 of every peer).
        const bool ok = ll_combine_wait_ready<kMode, kShrink>(
            p, e, blockIdx.x == 0 ? p.wait_stats : nullptr, masked0);
        EPX_LL_STAMP(p, 1, kTrCReadyWait);
        const uint64_t masked = ll_masked_warp<kShrink>(symm);  // with the ranks the waits masked
        if (threadIdx.x == 0) s_ok = ok, s_masked = masked;
        EPX_LL_STAMP(p, 1, kTrCRange);
      } else if (i < n * K) {
        later = resolve(c0, i, early);
      }
      const bool again = __syncthreads_or(later);
      if (early) {
        EPX_LL_STAMP(p, 1, kTrCPrefix);
        if (!s_ok) return false;
      }
      if (again) {
        if (later) resolve_late(c0, i);
        __syncthreads();
      }
      EPX_LL_TRACE_END(ids);
      reduce_group(c0, n);
    }
    EPX_LL_STAMP_V(p, 1, kTrCIds, kTrCRange, ids);
    EPX_LL_STAMP(p, 1, kTrCPull);
  } else if (t_begin < t_end) {
    // 4. The counts of the tokens before the chunk, per expert.
    for (int i = threadIdx.x; i < E; i += blockDim.x) s_cnt[i] = 0;
    __syncthreads();
    auto count_before = [&](int64_t first, int64_t stride) {
      for (int64_t t = first; t < t_begin; t += stride) {
        if (K <= kLlPrefixTopK) {
          // The row's ids loaded together (independent loads), duplicates found in registers;
          // ids outside [0, E) never count and never equal a valid one, so they become -1.
          int32_t ids[kLlPrefixTopK];
#pragma unroll
          for (int k = 0; k < kLlPrefixTopK; ++k) {
            const int64_t id = k < K ? id_at(t, k) : -1;
            ids[k] = id < 0 || id >= E ? -1 : static_cast<int32_t>(id);
          }
#pragma unroll
          for (int k = 0; k < kLlPrefixTopK; ++k) {
            if (ids[k] < 0) continue;
            bool dup = false;
#pragma unroll
            for (int k2 = 0; k2 < k; ++k2) dup |= ids[k2] == ids[k];
            if (!dup) atomicAdd(&s_cnt[ids[k]], 1);
          }
          continue;
        }
        for (int k = 0; k < K; ++k) {
          const int64_t id = id_at(t, k);
          if (id < 0 || id >= E) continue;
          bool dup = false;
          for (int k2 = 0; k2 < k && !dup; ++k2) dup = id_at(t, k2) == id;
          if (!dup) atomicAdd(&s_cnt[id], 1);
        }
      }
    };
    // 6a. A group's ids (out-of-range ones reported and dropped) and weights, threads `first`,
    // `first + stride`, ... (the weights of dropped selections are zeroed in 6c).
    auto put_group = [&](int64_t c0, int i, int64_t id, float w) {
      s_ids[i] = checked_id(c0 + i / K, i % K, id);
      s_w[i] = w;
    };
    auto load_group = [&](int64_t c0, int n, int first, int stride) {
      for (int i = first; i < n * K; i += stride) {
        const int tl = i / K, k = i - tl * K;
        put_group(c0, i, id_at(c0 + tl, k), weight_at(c0 + tl, k));
      }
    };
    // 5. The begin / count of this rank's block in every expert: comb_layout(d, q)[l][r] of the
    // expert's rank d (0 for a rank in `masked`: not read), threads `first`, `first + stride`,
    // ...: `own` the experts of this rank (its own handle, an input: read before the wait),
    // else the peers' (after it).
    auto load_ranges = [&](int first, int stride, uint64_t masked, bool own) {
      constexpr int kBatch = 8;  // loads in flight per thread (one round trip at n <= 8 * stride)
      const int n = own ? L : E - L;  // this pass's experts: j -> expert_of(j)
      auto expert_of = [&](int j) { return own ? me * L + j : j < me * L ? j : j + L; };
      for (int j0 = first; j0 < n; j0 += kBatch * stride) {
        long long v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int j = j0 + u * stride;
          if (j >= n) break;
          const int i = expert_of(j), d = i / L, l = i - d * L;
          v[u] = own ? __ldg(reinterpret_cast<const long long*>(p.layout_range) +
                             l * p.layout_stride + me)
                 : rank_skipped(masked, d)
                     ? 0
                     : ld_landed<long long>(g.comb_layout(symm.peers[d], q) + l * R + me);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          if (j0 + u * stride < n) s_range[expert_of(j0 + u * stride)] = v[u];
      }
    };
    const int n_first =
        static_cast<int>(min(static_cast<int64_t>(kLlCombineTokens), t_end - t_begin));
    // Warp 0 reads this rank's ranges, waits for the peers (step 5, pairs with step 3 of every
    // peer) and reads theirs, while warps 1.. count (step 4) and load the first group's ids and
    // weights (6a), the group's first element issued with the counted rows' ids (one round trip
    // for both): the wait and the ranges' round trips overlap the local work.
    if (threadIdx.x < 32) {
      load_ranges(threadIdx.x, 32, 0, true);
      const bool ok = ll_combine_wait_ready<kMode, kShrink>(
          p, e, blockIdx.x == 0 ? p.wait_stats : nullptr, masked0);
      EPX_LL_STAMP(p, 1, kTrCReadyWait);
      const uint64_t masked = ll_masked_warp<kShrink>(symm);  // with the ranks the waits masked
      if (ok) load_ranges(threadIdx.x, 32, masked, false);
      if (threadIdx.x == 0) s_ok = ok, s_masked = masked;
      EPX_LL_STAMP(p, 1, kTrCRange);
    } else {
      const int i = static_cast<int>(threadIdx.x) - 32, stride = blockDim.x - 32;
      int64_t id = -1;
      float w = 0.0f;
      if (i < n_first * K)
        id = id_at(t_begin + i / K, i % K), w = weight_at(t_begin + i / K, i % K);
      count_before(i, stride);
      if (i < n_first * K) put_group(t_begin, i, id, w);
      load_group(t_begin, n_first, i + stride, stride);
    }
    __syncthreads();
    EPX_LL_STAMP(p, 1, kTrCPrefix);
    if (!s_ok) return false;

    for (int64_t c0 = t_begin; c0 < t_end; c0 += kLlCombineTokens) {
      const int n = static_cast<int>(min(static_cast<int64_t>(kLlCombineTokens), t_end - c0));
      // 6. Ids and weights (the first group's already loaded), then rows token by
      // token (a token's distinct experts in parallel), then each selection's source.
      EPX_LL_TRACE_BEGIN(ids);
      if (c0 != t_begin) {
        load_group(c0, n, threadIdx.x, blockDim.x);
        __syncthreads();
      }
      for (int tl = 0; tl < n; ++tl) {
        if (threadIdx.x < K) {
          const int* ids = s_ids + tl * K;
          const int id = ids[threadIdx.x];
          bool first = id >= 0;
          for (int k2 = 0; k2 < static_cast<int>(threadIdx.x) && first; ++k2) first = ids[k2] != id;
          if (first) s_row[tl * K + threadIdx.x] = s_cnt[id]++;
        }
        __syncthreads();  // the next token sees the counts
      }
      for (int i = threadIdx.x; i < n * K; i += blockDim.x) {
        const int tl = i / K, k = i - tl * K;
        const int* ids = s_ids + tl * K;
        const int id = ids[k];
        uintptr_t src = 0, mrow = 0;
        if (id >= 0 && !rank_skipped(s_masked, id / L)) {
          int k0 = 0;
          while (ids[k0] != id) ++k0;
          const int64_t j = s_row[tl * K + k0];
          const int64_t range = s_range[id];
          const int64_t begin = range >> 32, count = range & 0xFFFFFFFF;
          if (j >= count || begin + j >= RT)
            record_error(p.wait, kDevErrLlCombineRows, id / L, (c0 + tl) * 64 + k, id);
          else
            src = source_of(id, begin + j, c0 + tl, k0, &mrow);
        }
        s_src[i] = src;
        if constexpr (kLogfmt) s_mrow[i] = mrow;
        if (!src) s_w[i] = 0.0f;
      }
      __syncthreads();
      EPX_LL_TRACE_END(ids);
      reduce_group(c0, n);
    }
    EPX_LL_STAMP_V(p, 1, kTrCIds, kTrCRange, ids);
    EPX_LL_STAMP(p, 1, kTrCPull);
  } else {
    if (blockIdx.x == 0) {
      // T = 0: no pulls, but the formats are compared too (step 5), so every rank reports.
      if (threadIdx.x < 32) {
        const bool ok = ll_combine_wait_ready<kMode, kShrink>(p, e, nullptr, masked0);
        if (threadIdx.x == 0) s_ok = ok;
      }
      __syncthreads();
      if (!s_ok) return false;
    }
  }

  // Finish (see the file comment): pairs with the same code on every peer, the ranks this CTA
  // masks left out.
  auto pulled = [&](int d) { return &g.sync(symm.peers[d])->combine_pulled[q][me]; };
  __syncthreads();  // the CTA's pulls are done: the fence below covers them (cumulativity)
  const uint64_t skip = s_masked | rank_bit(me);
  signal_ranks(R, skip, pulled, 0, symm.one_gpu);
  // One CTA waits for the peers (the kernel ends only after it), the others leave: a hook's
  // receive kernel holds one SM, not C, while a peer is late.
  if (blockIdx.x == 0 &&
      !ll_wait_ranks<kShrink>(
          ll_team_all(), symm, me, g.sync(symm.local)->combine_pulled[q],
          skip | ll_masked_uniform<kShrink>(symm), [&](int) { return e * gridDim.x; }, p.wait,
          kWaitBarrier))
    return false;
  if (threadIdx.x == 0) g.state(symm.local)->combine_epoch[q][blockIdx.x] = e;
  EPX_LL_STAMP(p, 1, kTrCExit);
  return true;
}

__device__ __forceinline__ uint32_t ll_combine_epoch(const LlCombineParams& p) {
  const LlState* st = p.symm.layout.state(p.symm.local);
  return *reinterpret_cast<const volatile uint32_t*>(&st->combine_epoch[p.slot][blockIdx.x]) + 1;
}

}  // namespace epx::detail

namespace epx::ll {

// The ll combine kernel, one instantiation per form (LlCombineMode; profilers show one name,
// epx::ll::combine, hook or not): p.phases selects the send half (the call with a hook), the
// receive half (the hook) or both (no hook). kShrink: symm.shrink (BufferConfig::enable_shrink;
// false: no mask code, as the dispatch's). kF32Out (plain only): float32 out, unrounded (the
// partials of the ll across nodes); the bf16 instantiations' code is unchanged by it. kDirect
// (plain and LogFMT): steps 4-6 read each selection's row from the row map, which the handle's
// dispatch wrote (the host's choice: the slot's last dispatch made the handle; else the prefix
// counts and range tables).
template <int kMode, bool kShrink, bool kF32Out = false, bool kDirect = false>
__global__ void __launch_bounds__(detail::kLlThreads, 1) combine(detail::LlCombineParams p) {
  using namespace detail;
  pdl_begin(p.pdl);
  const uint32_t e = ll_combine_epoch(p);
  if constexpr (kMode == kLlCombineLogfmt) ll_logfmt_load_table();
  bool deferred = false;  // step 3 left to the receive half (ll_combine_send)
  uint64_t send_masked = 0;
  if (p.phases & kLlPhaseSend) {
    EPX_LL_STAMP(p, 1, kTrCEntry);
    if constexpr (kMode == kLlCombineOverlap) {
      ll_combine_send_overlap(p, e);
    } else {
      deferred = (p.phases & kLlPhaseRecv) != 0;
      send_masked = ll_combine_send<kMode, kShrink>(p, e, deferred);
    }
  }
  static_assert(!kF32Out || kMode == kLlCombinePlain, "float32 out: the plain form only");
  static_assert(!kDirect || kMode != kLlCombineOverlap, "the overlapped form reads land");
  if (p.phases & kLlPhaseRecv)
    ll_combine_recv<kMode, kShrink, kF32Out, kDirect>(p, e, deferred, send_masked);
}

}  // namespace epx::ll
