// src/cuda/kernels/ht/notify.cuh — ht layout and count exchange. One CTA of 1024 threads.
//
// Data flow on rank r (T tokens, K, E experts, L = E / R):
//   pass 1  topk_idx[T, K] -> per token a mask of destination ranks (bit d: some expert of the
//           token lives on d); num_tokens_per_rank[R], num_tokens_per_expert[E] (selections),
//           is_token_in_rank[T, R]. Ids outside [-1, E) are reported (InvalidArgument) and
//           routed nowhere.
//   (layout-only calls stop here; no communication)
//   exchange  rank r writes {flag, tokens_per_rank[R], tokens_per_expert[d's L experts]} into
//           rank d's count slot r, for every d != r, then waits for every peer's message in its
//           own slots. Result: the count matrix cnt[s][d], rank_prefix_matrix[s][d] =
//           sum_{s' <= s} cnt[s'][d], N = rpm[R-1][r], per-local-expert received selections
//           rounded up to expert_alignment (published to mapped host memory under `ticket`).
//   pass 2  send_pos[t][d] = rpm[r-1][d] + (tokens before t that go to d), or -1: the row of
//           token t in rank d's recv_x, which is the order SPEC 3.2 requires (source rank, then
//           source token index, ascending).
#pragma once

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

// Destination-rank mask of token t; reports out-of-range ids when `report`. The ids are loaded
// kChunk at a time, each chunk's loads issued together (one memory latency per chunk; with
// kChunk = 1 every id waits for the one before, which took ~60 us at T = 4096).
// `s_rank_of`: expert -> rank table (shared memory), or null: a division per id (the A/B,
// kHtNotifyDivide; measured 15 of the 17 us pass 1 took at T = 4096 with the division).
template <int kChunk>
__device__ __forceinline__ uint32_t ht_token_mask(const HtNotifyParams& p, int64_t t, int* s_expert,
                                                  const uint8_t* s_rank_of, bool report) {
  uint32_t mask = 0;
  for (int k0 = 0; k0 < p.top_k; k0 += kChunk) {
    int64_t ids[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      ids[j] = k0 + j >= p.top_k ? int64_t{-1}
               : (p.ablate & kAblateNotifyLoads)
                   ? (t * p.top_k + k0 + j) % p.num_experts
                   : ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, k0 + j);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int64_t e = ids[j];
      if (e < -1 || e >= p.num_experts) {
        if (report) record_error(p.wait, kDevErrBadExpert, -1, t * 64 + k0 + j, e);
        continue;
      }
      if (e < 0) continue;
      if (s_expert && !(p.ablate & kAblateNotifyExperts)) atomicAdd(&s_expert[e], 1);
      mask |= 1u << (s_rank_of ? static_cast<uint32_t>(s_rank_of[e])
                               : static_cast<uint32_t>(e / p.num_local_experts));
    }
  }
  return mask;
}

// Dynamic shared memory of ht_notify_kernel: the counters below, then, when `masks`, one mask
// word per token (pass 2 reads them instead of loading topk_idx again), then the expert -> rank
// table (E bytes).
inline size_t ht_notify_smem(const HtNotifyParams& p, bool masks) {
  const size_t words =
      static_cast<size_t>(p.num_experts + p.num_local_experts + p.num_ranks * p.num_ranks +
                          (kNotifyThreads / 32) * p.num_ranks);
  return 4 * (words + (masks ? static_cast<size_t>(p.num_tokens) : 0)) +
         static_cast<size_t>(p.num_experts);
}
// Largest mask array kept in shared memory (tokens beyond it: pass 2 reloads topk_idx).
inline constexpr int kNotifyMaxSmemMasks = 16384;

// kOld: the kernel before the tenth session (ids loaded one by one; pass 2 reloads them), kept
// as the same-run A/B (kHtNotifyOld). kMasks: pass 1 keeps each token's mask in shared memory.
template <bool kOld, bool kMasks>
__global__ void __launch_bounds__(kNotifyThreads, 1) ht_notify_kernel(HtNotifyParams p) {
  constexpr int kChunk = kOld ? 1 : 8;
  const int R = p.num_ranks, me = p.rank, L = p.num_local_experts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kWarps = kNotifyThreads / 32;
  extern __shared__ int s_dyn[];
  int* s_expert = s_dyn;                          // [E] selections per expert (this rank's tokens)
  int* s_recv_expert = s_expert + p.num_experts;  // [L] selections received per local expert
  int* s_matrix = s_recv_expert + L;              // [R][R] cnt[s][d]
  int* s_warp = s_matrix + R * R;                 // [kWarps][R] per-warp counts, then offsets
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_warp + kWarps * R);  // [T] if kMasks
  uint8_t* s_rank_of = reinterpret_cast<uint8_t*>(s_mask + (kMasks ? p.num_tokens : 0));  // [E]
  __shared__ int s_rank_count[kMaxHtRanks];
  __shared__ int s_run[kMaxHtRanks];
  __shared__ int s_offset[kMaxHtRanks];
  // Runs of consecutive tokens this rank keeps (published with the ticket, for the host's
  // copy-engine plan): starts and ends (first token after a run) as found, any order.
  __shared__ uint8_t s_kept[kNotifyThreads];
  __shared__ int s_kept_carry;  // kept(first token of this round - 1)
  __shared__ int s_num_starts, s_num_ends;
  __shared__ int32_t s_starts[kHtHostKeptRuns], s_ends[kHtHostKeptRuns];
  const bool find_runs =
      p.ticket != 0 && p.find_kept_runs && !(p.ablate & kAblateNotifyRuns);  // uniform
  if (p.exchange) EPX_HT_STAMP(p, 2, kHtTrEntry);
  if (p.exchange && tid == 0) publish_deferred_ready(p.symm, p.wait, R);

  for (int i = tid; i < p.num_experts; i += kNotifyThreads) s_expert[i] = 0;
  for (int i = tid; i < L; i += kNotifyThreads) s_recv_expert[i] = 0;
  for (int i = tid; i < p.num_experts; i += kNotifyThreads)
    s_rank_of[i] = static_cast<uint8_t>(i / L);
  const uint8_t* rank_of = kOld || (p.ablate & kHtNotifyDivide) ? nullptr : s_rank_of;
  if (tid < kMaxHtRanks) s_rank_count[tid] = s_run[tid] = 0;
  if (tid == 0) s_kept_carry = s_num_starts = s_num_ends = 0;
  __syncthreads();
  if (p.exchange) EPX_HT_STAMP(p, 2, kHtTrNotifySetUp);

  // ---- pass 1: masks and counts ---------------------------------------------------------------
  for (int64_t base = 0; base < p.num_tokens; base += kNotifyThreads) {
    const int64_t t = base + tid;
    const uint32_t mask = t >= p.num_tokens ? 0u
                          : (p.ablate & kAblateNotifyMask)
                              ? (1u << R) - 1u
                              : ht_token_mask<kChunk>(p, t, s_expert, rank_of, true);
    if (kMasks && t < p.num_tokens) s_mask[t] = mask;
    if (t < p.num_tokens && p.is_token_in_rank && !(p.ablate & kAblateNotifyInRank)) {
      for (int d = 0; d < R; ++d) p.is_token_in_rank[t * R + d] = (mask >> d) & 1u;
    }
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (lane == 0 && bits) atomicAdd(&s_rank_count[d], __popc(bits));
    }
    if (find_runs) {
      const int kept = static_cast<int>((mask >> me) & 1u);  // 0 past T (mask 0)
      s_kept[tid] = static_cast<uint8_t>(kept);
      __syncthreads();
      const int prev = tid > 0 ? s_kept[tid - 1] : s_kept_carry;
      if (t < p.num_tokens && kept != prev) {  // a run starts at t, or the run before t ends
        int* n = kept ? &s_num_starts : &s_num_ends;
        int32_t* list = kept ? s_starts : s_ends;
        const int i = atomicAdd(n, 1);
        if (i < kHtHostKeptRuns) list[i] = static_cast<int32_t>(t);
      }
      __syncthreads();
      if (tid == kNotifyThreads - 1) s_kept_carry = kept;
    }
#ifdef EPX_HT_TRACE
    if (base == 0 && p.exchange) {
      __syncthreads();
      EPX_HT_STAMP(p, 2, kHtTrNotifyRound0);
    }
#endif
  }
  __syncthreads();
  if (p.num_tokens_per_rank && tid < R) p.num_tokens_per_rank[tid] = s_rank_count[tid];
  if (p.num_tokens_per_expert) {
    for (int e = tid; e < p.num_experts; e += kNotifyThreads)
      p.num_tokens_per_expert[e] = s_expert[e];
  }
  if (!p.exchange) return;
  EPX_HT_STAMP(p, 2, kHtTrStart);

  // ---- exchange --------------------------------------------------------------------------------
  const WaitContext& w = p.wait;
  const uint32_t cur = w.state->seq + 1;
  const HtRegion& g = p.symm.region;
  for (int q = warp; q < R; q += kWarps) {  // send to q
    if (q == me) continue;
    bool ok = true;
    if (lane == 0) ok = wait_peer_ready(p.symm, w, q, cur);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (!ok) continue;
    HtCountMsg* msg = g.count_msg(p.symm.peers[q], me);
    int32_t* body = reinterpret_cast<int32_t*>(msg + 1);
    for (int i = lane; i < R + L; i += 32)
      body[i] = i < R ? s_rank_count[i] : s_expert[q * L + i - R];
    __syncwarp();
    // Pairs with the wait_flag on count_msg(local, me)->flag in rank q's notify.
    if (lane == 0) st_release_sys(&msg->flag, cur);
  }
  for (int q = warp; q < R; q += kWarps) {  // receive from q
    if (q == me) {
      for (int i = lane; i < R; i += 32) s_matrix[me * R + i] = s_rank_count[i];
      for (int l = lane; l < L; l += 32) atomicAdd(&s_recv_expert[l], s_expert[me * L + l]);
      continue;
    }
    HtCountMsg* msg = g.count_msg(p.symm.local, q);
    bool ok = true;
    if (lane == 0) ok = wait_flag<true>(&msg->flag, cur, w, kWaitCounts, q);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    const int32_t* body = reinterpret_cast<const int32_t*>(msg + 1);
    for (int i = lane; i < R; i += 32) s_matrix[q * R + i] = ok ? ld_landed(body + i) : 0;
    for (int l = lane; l < L; l += 32)
      atomicAdd(&s_recv_expert[l], ok ? ld_landed(body + R + l) : 0);
  }
  __syncthreads();
  EPX_HT_STAMP(p, 2, kHtTrWork);

  // Prefix matrix, N, per-expert counts.
  if (tid < R) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      if (s == me) s_offset[tid] = acc;  // rows rank tid receives from ranks before me
      acc += s_matrix[s * R + tid];
      p.rank_prefix_matrix[s * R + tid] = acc;
      s_matrix[s * R + tid] = acc;
    }
  }
  __syncthreads();
  if (p.ticket != 0) {
    volatile int32_t* per_expert = reinterpret_cast<volatile int32_t*>(p.host + 1);
    const int a = p.expert_alignment;
    for (int l = tid; l < L; l += kNotifyThreads)
      per_expert[l] = (s_recv_expert[l] + a - 1) / a * a;
    volatile int32_t* rpm_host = per_expert + L;  // then the kept runs (HtHostResult)
    for (int i = tid; i < R * R; i += kNotifyThreads) rpm_host[i] = s_matrix[i];
    volatile int32_t* runs_host = rpm_host + R * R;
    if (tid == 0) {
      runs_host[0] = s_num_starts;
      runs_host[1] = s_num_ends;
    }
    const int listed = min(s_num_starts, kHtHostKeptRuns);
    const int ends = min(s_num_ends, kHtHostKeptRuns);
    for (int i = tid; i < listed; i += kNotifyThreads) runs_host[2 + i] = s_starts[i];
    for (int i = tid; i < ends; i += kNotifyThreads) runs_host[2 + kHtHostKeptRuns + i] = s_ends[i];
    if (tid == 0)
      reinterpret_cast<volatile HtHostResult*>(p.host)->num_recv_tokens =
          s_matrix[(R - 1) * R + me];
    __syncthreads();
    if (tid == 0) {
      __threadfence_system();
      // Read by the host's bounded poll in the exact-mode dispatch.
      reinterpret_cast<volatile HtHostResult*>(p.host)->ticket = p.ticket;
      __threadfence_system();
    }
  }
  EPX_HT_STAMP(p, 2, kHtTrRecv);

  // ---- pass 2: send positions ------------------------------------------------------------------
  for (int64_t base = 0; base < p.num_tokens; base += kNotifyThreads) {
    const int64_t t = base + tid;
    uint32_t mask = 0;
    if (t < p.num_tokens)
      mask = kMasks ? s_mask[t] : ht_token_mask<kChunk>(p, t, nullptr, rank_of, false);
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (lane == 0) s_warp[warp * R + d] = __popc(bits);
    }
    __syncthreads();
    if (tid < R) {  // exclusive scan over warps, carried across rounds
      int run = s_run[tid];
      for (int v = 0; v < kWarps; ++v) {
        const int c = s_warp[v * R + tid];
        s_warp[v * R + tid] = run;
        run += c;
      }
      s_run[tid] = run;
    }
    __syncthreads();
    const uint32_t lt = (1u << lane) - 1u;
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (t < p.num_tokens) {
        p.send_pos[t * R + d] =
            (mask >> d) & 1u ? s_offset[d] + s_warp[warp * R + d] + __popc(bits & lt) : -1;
      }
    }
    __syncthreads();
  }

  EPX_HT_STAMP(p, 2, kHtTrDone);
  finish_operation(p.symm, w, cur, R, [] {});
  EPX_HT_STAMP(p, 2, kHtTrExit);
}

}  // namespace epx::detail
