// src/cuda/kernels/ht/notify.cuh — ht layout and count exchange. One thread block cluster of C
// CTAs of 1024 threads (C = 1 .. kNotifyMaxCtas, host-chosen from T; one CTA: the same kernel),
// CTA c taking the tokens [c * ceil(T / C), (c + 1) * ceil(T / C)).
//
// Data flow on rank r (T tokens, K, E experts, L = E / R):
//   pass 1  (every CTA, its tokens) topk_idx[T, K] -> per token a mask of destination ranks (bit
//           d: some expert of the token lives on d); per-CTA counts of tokens per rank and of
//           selections per expert; is_token_in_rank[T, R]. Ids outside [-1, E) are reported
//           (InvalidArgument; with several, which one the error names depends on timing) and
//           routed nowhere.
//   merge   (cluster barrier) CTA 0 sums the CTAs' counts through distributed shared memory:
//           num_tokens_per_rank[R], num_tokens_per_expert[E]; every CTA sums the rank counts of
//           the CTAs before it (its tokens' first position per destination).
//   (layout-only calls stop here; no communication)
//   exchange  (CTA 0) rank r writes {flag, call[3], tokens_per_rank[R], tokens_per_expert[d's L
//           experts]} into rank d's count slot r, for every d != r, then waits for every peer's
//           message in its own slots; a message whose per-call values (call: x / scales dtype,
//           zero_copy, weights given, num_worst_tokens, expert_alignment) differ from this rank's
//           is reported (kDevErrHtCallDiffers; the exact-mode host raises it before launching
//           the dispatch). Result: the count matrix cnt[s][d], rank_prefix_matrix[s][d] =
//           sum_{s' <= s} cnt[s'][d], N = rpm[R-1][r], per-local-expert received selections
//           rounded up to expert_alignment (published to mapped host memory under `ticket`).
//   pass 2  (every CTA, its tokens, after a cluster barrier) send_pos[t][d] = rpm[r-1][d] +
//           (tokens before t that go to d), or -1: the row of token t in rank d's recv_x, which is
//           the order docs/semantics.md §1.2 requires (source rank, then source token index,
//           ascending).
#pragma once

#include <cooperative_groups.h>

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

// Destination-rank mask of token t; reports out-of-range ids when `report`. The ids are loaded
// kChunk at a time, each chunk's loads issued together (one memory latency per chunk; with
// kChunk = 1 every id waits for the one before, which took ~60 us at T = 4096).
// `s_rank_of`: expert -> rank table (shared memory), or null: a division per id (where the table
// is not filled yet).
template <int kChunk>
__device__ __forceinline__ uint32_t ht_token_mask(const HtNotifyParams& p, int64_t t, int* s_expert,
                                                  const uint8_t* s_rank_of, bool report) {
  uint32_t mask = 0;
  for (int k0 = 0; k0 < p.top_k; k0 += kChunk) {
    int64_t ids[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      ids[j] = k0 + j < p.top_k
                   ? ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, k0 + j)
                   : int64_t{-1};
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int64_t e = ids[j];
      if (e < -1 || e >= p.num_experts) {
        if (report) record_error(p.wait, kDevErrBadExpert, -1, t * 64 + k0 + j, e);
        continue;
      }
      if (e < 0) continue;
      if (s_expert) atomicAdd(&s_expert[e], 1);
      mask |= 1u << (s_rank_of ? static_cast<uint32_t>(s_rank_of[e])
                               : static_cast<uint32_t>(e / p.num_local_experts));
    }
  }
  return mask;
}

// Thread block clusters (sm_90+): CTA q's copy of a shared-memory object, and the cluster barrier.
// Built for older GPUs the count exchange runs on one CTA (launch_ht_notify), where these are the
// CTA's own object and nothing.
template <typename T>
__device__ __forceinline__ T* ht_cluster_ptr(T* p, int q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, q);
#else
  (void)q;
  return p;
#endif
}
__device__ __forceinline__ void ht_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#endif
}

// CTAs of the count exchange's cluster (portable cluster size) and the tokens per CTA that make
// another CTA worth it (pass 1 took ~4 us per 1024 tokens on one CTA; 5771cd1, 2026-12-01).
inline constexpr int kNotifyMaxCtas = 8;
inline int ht_notify_ctas(int64_t num_tokens) {
  const int64_t c = (num_tokens + kNotifyThreads - 1) / kNotifyThreads;
  return static_cast<int>(c < 1 ? 1 : (c > kNotifyMaxCtas ? kNotifyMaxCtas : c));
}
EPX_HT_HD int64_t ht_notify_chunk(int64_t num_tokens, int ctas) {
  return (num_tokens + ctas - 1) / ctas;
}

// Dynamic shared memory of ht_notify_kernel per CTA: the counters below, then, when `masks`, one
// mask word per token of the CTA (pass 2 reads them instead of loading topk_idx again), then the
// expert -> rank table (E bytes).
inline size_t ht_notify_smem(const HtNotifyParams& p, bool masks, int ctas) {
  const size_t words =
      static_cast<size_t>(p.num_experts + p.num_local_experts + p.num_ranks * p.num_ranks +
                          (kNotifyThreads / 32) * p.num_ranks);
  const int64_t chunk = ht_notify_chunk(p.num_tokens, ctas);
  return 4 * (words + (masks ? static_cast<size_t>(chunk) : 0)) +
         static_cast<size_t>(p.num_experts);
}
// Largest mask array kept in shared memory per CTA (more tokens: pass 2 reloads topk_idx).
inline constexpr int kNotifyMaxSmemMasks = 16384;

// kMasks: pass 1 keeps each token's mask in shared memory. Launched as one cluster of gridDim.x
// CTAs (1: any launch).
template <bool kMasks>
__global__ void __launch_bounds__(kNotifyThreads, 1) ht_notify_kernel(HtNotifyParams p) {
  constexpr int kChunk = 8;  // ids loaded together per token
  const int R = p.num_ranks, me = p.rank, L = p.num_local_experts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kWarps = kNotifyThreads / 32;
  const int C = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  const bool leader = c == 0;
  // Cluster barriers only where there is a cluster (C = 1 launches carry no cluster attribute).
  auto cluster_sync = [C] {
    if (C > 1) ht_cluster_sync();
  };
  // This CTA's tokens [t_begin, t_end).
  const int64_t chunk = ht_notify_chunk(p.num_tokens, C);
  const int64_t t_begin = min(static_cast<int64_t>(c) * chunk, static_cast<int64_t>(p.num_tokens));
  const int64_t t_end = min(t_begin + chunk, static_cast<int64_t>(p.num_tokens));
  extern __shared__ int s_dyn[];
  int* s_expert = s_dyn;                          // [E] selections per expert (CTA 0: all CTAs')
  int* s_recv_expert = s_expert + p.num_experts;  // [L] selections received per local expert
  int* s_matrix = s_recv_expert + L;              // [R][R] cnt[s][d]
  int* s_warp = s_matrix + R * R;                 // [kWarps][R] per-warp counts, then offsets
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_warp + kWarps * R);  // [chunk] if kMasks
  uint8_t* s_rank_of = reinterpret_cast<uint8_t*>(s_mask + (kMasks ? chunk : 0));  // [E]
  __shared__ int s_rank_count[kMaxHtRanks];  // this CTA's tokens per destination rank
  __shared__ int s_total[kMaxHtRanks];       // CTA 0: every CTA's
  __shared__ int s_run[kMaxHtRanks];
  __shared__ int s_offset[kMaxHtRanks];
  // Runs of consecutive tokens this rank keeps (published with the ticket, for the host's
  // copy-engine plan): starts and ends (first token after a run) as found, any order; each CTA
  // its own, CTA 0 appends the others'.
  __shared__ uint8_t s_kept[kNotifyThreads];
  __shared__ int s_kept_carry;  // kept(first token of this round - 1)
  __shared__ int s_num_starts, s_num_ends;
  __shared__ int32_t s_starts[kHtHostKeptRuns], s_ends[kHtHostKeptRuns];
  const bool find_runs = p.ticket != 0 && p.find_kept_runs;  // uniform
  const WaitContext& w = p.wait;
  // Read before the first cluster barrier: the last CTA to finish advances seq.
  const uint32_t cur = p.exchange ? w.state->seq + 1 : 0u;
  if (p.exchange && leader) EPX_HT_STAMP(p, 2, kHtTrEntry);
  if (p.exchange && leader && tid == 0) publish_deferred_ready(p.symm, p.wait, R);

  for (int i = tid; i < p.num_experts; i += kNotifyThreads) s_expert[i] = 0;
  for (int i = tid; i < L; i += kNotifyThreads) s_recv_expert[i] = 0;
  for (int i = tid; i < p.num_experts; i += kNotifyThreads)
    s_rank_of[i] = static_cast<uint8_t>(i / L);
  const uint8_t* rank_of = s_rank_of;
  if (tid < kMaxHtRanks) s_rank_count[tid] = s_run[tid] = 0;
  if (tid == 0) {
    s_num_starts = s_num_ends = 0;
    // Whether this rank keeps the token before this CTA's first (a run may cross CTAs).
    s_kept_carry =
        find_runs && t_begin > 0 && t_begin < t_end
            ? static_cast<int>(
                  (ht_token_mask<kChunk>(p, t_begin - 1, nullptr, nullptr, false) >> me) & 1u)
            : 0;
  }
  __syncthreads();
  if (p.exchange && leader) EPX_HT_STAMP(p, 2, kHtTrNotifySetUp);

  // ---- pass 1: masks and counts (this CTA's tokens) ---------------------------------------------
  for (int64_t base = t_begin; base < t_end; base += kNotifyThreads) {
    const int64_t t = base + tid;
    const uint32_t mask = t < t_end ? ht_token_mask<kChunk>(p, t, s_expert, rank_of, true) : 0u;
    if (kMasks && t < t_end) s_mask[t - t_begin] = mask;
    if (t < t_end && p.is_token_in_rank) {
      for (int d = 0; d < R; ++d) p.is_token_in_rank[t * R + d] = (mask >> d) & 1u;
    }
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (lane == 0 && bits) atomicAdd(&s_rank_count[d], __popc(bits));
    }
    if (find_runs) {
      const int kept = static_cast<int>((mask >> me) & 1u);  // 0 past the CTA's tokens (mask 0)
      s_kept[tid] = static_cast<uint8_t>(kept);
      __syncthreads();
      const int prev = tid > 0 ? s_kept[tid - 1] : s_kept_carry;
      if (t < t_end && kept != prev) {  // a run starts at t, or the run before t ends
        int* n = kept ? &s_num_starts : &s_num_ends;
        int32_t* list = kept ? s_starts : s_ends;
        const int i = atomicAdd(n, 1);
        if (i < kHtHostKeptRuns) list[i] = static_cast<int32_t>(t);
      }
      __syncthreads();
      if (tid == kNotifyThreads - 1) s_kept_carry = kept;
    }
#ifdef EPX_HT_TRACE
    if (base == t_begin && p.exchange) {
      __syncthreads();
      if (leader) EPX_HT_STAMP(p, 2, kHtTrNotifyRound0);
    }
#endif
  }
  __syncthreads();

  // ---- merge: the CTAs' counts (distributed shared memory) -------------------------------------
  cluster_sync();  // every CTA's pass-1 counts and run lists final
  if (tid < R) {
    int before = 0, total = 0;
    for (int q = 0; q < C; ++q) {
      const int v = q == c ? s_rank_count[tid] : *ht_cluster_ptr(&s_rank_count[tid], q);
      if (q < c) before += v;
      total += v;
    }
    s_run[tid] = before;  // pass 2's running count starts at the tokens before this CTA's
    s_total[tid] = total;
  }
  if (leader && C > 1) {
    for (int e = tid; e < p.num_experts; e += kNotifyThreads) {
      int sum = s_expert[e];
      for (int q = 1; q < C; ++q) sum += *ht_cluster_ptr(&s_expert[e], q);
      s_expert[e] = sum;
    }
    if (find_runs) {  // append the other CTAs' runs (any order; the counts are totals)
      int starts = s_num_starts, ends = s_num_ends;
      for (int q = 1; q < C; ++q) {
        const int ns = *ht_cluster_ptr(&s_num_starts, q);
        const int ne = *ht_cluster_ptr(&s_num_ends, q);
        const int32_t* qs = ht_cluster_ptr(s_starts, q);
        const int32_t* qe = ht_cluster_ptr(s_ends, q);
        for (int i = tid; i < min(ns, kHtHostKeptRuns); i += kNotifyThreads)
          if (starts + i < kHtHostKeptRuns) s_starts[starts + i] = qs[i];
        for (int i = tid; i < min(ne, kHtHostKeptRuns); i += kNotifyThreads)
          if (ends + i < kHtHostKeptRuns) s_ends[ends + i] = qe[i];
        starts += ns;
        ends += ne;
      }
      __syncthreads();  // every thread read the counts before thread 0 replaces them
      if (tid == 0) {
        s_num_starts = starts;
        s_num_ends = ends;
      }
    }
  }
  __syncthreads();
  if (leader) {
    if (p.num_tokens_per_rank && tid < R) p.num_tokens_per_rank[tid] = s_total[tid];
    if (p.num_tokens_per_expert) {
      for (int e = tid; e < p.num_experts; e += kNotifyThreads)
        p.num_tokens_per_expert[e] = s_expert[e];
    }
  }
  if (!p.exchange) {
    cluster_sync();  // no CTA leaves while another may still read its shared memory
    return;
  }
  if (leader) EPX_HT_STAMP(p, 2, kHtTrStart);

  // ---- exchange (CTA 0) -------------------------------------------------------------------------
  const HtRegion& g = p.symm.region;
  if (leader) {
    for (int q = warp; q < R; q += kWarps) {  // send to q
      if (q == me) continue;
      bool ok = true;
      if (lane == 0) ok = wait_peer_ready(p.symm, w, q, cur);
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (!ok) continue;
      HtCountMsg* msg = g.count_msg(p.symm.peers[q], me);
      int32_t* body = reinterpret_cast<int32_t*>(msg + 1);
      for (int i = lane; i < R + L; i += 32) body[i] = i < R ? s_total[i] : s_expert[q * L + i - R];
      if (lane < 3) msg->call[lane] = p.call[lane];
      __syncwarp();
      // Pairs with the wait_flag on count_msg(local, me)->flag in rank q's notify.
      if (lane == 0) st_release_sys(&msg->flag, cur);
    }
    for (int q = warp; q < R; q += kWarps) {  // receive from q
      if (q == me) {
        for (int i = lane; i < R; i += 32) s_matrix[me * R + i] = s_total[i];
        for (int l = lane; l < L; l += 32) atomicAdd(&s_recv_expert[l], s_expert[me * L + l]);
        continue;
      }
      HtCountMsg* msg = g.count_msg(p.symm.local, q);
      bool ok = true;
      if (lane == 0) ok = wait_flag<true>(&msg->flag, cur, w, kWaitCounts, q);
      ok = __shfl_sync(0xffffffffu, ok, 0);
      // The per-call values every rank must pass alike (the first that differs is reported).
      if (ok && lane == 0) {
        for (int f = 0; f < 3; ++f) {
          const uint32_t theirs = ld_landed(&msg->call[f]);
          if (theirs == p.call[f]) continue;
          record_error(w, kDevErrHtCallDiffers, q,
                       static_cast<int64_t>(static_cast<uint64_t>(f) << 32 | theirs),
                       static_cast<int64_t>(p.call[f]));
          break;
        }
      }
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
      for (int i = tid; i < ends; i += kNotifyThreads)
        runs_host[2 + kHtHostKeptRuns + i] = s_ends[i];
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
  }
  cluster_sync();  // CTA 0's offsets final
  if (!leader && tid < R) s_offset[tid] = *ht_cluster_ptr(&s_offset[tid], 0);
  cluster_sync();  // every CTA read them (CTA 0 may leave)

  // ---- pass 2: send positions (this CTA's tokens)
  // ------------------------------------------------
  for (int64_t base = t_begin; base < t_end; base += kNotifyThreads) {
    const int64_t t = base + tid;
    uint32_t mask = 0;
    if (t < t_end)
      mask = kMasks ? s_mask[t - t_begin] : ht_token_mask<kChunk>(p, t, nullptr, rank_of, false);
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (lane == 0) s_warp[warp * R + d] = __popc(bits);
    }
    __syncthreads();
    if (tid < R) {  // exclusive scan over warps, carried across rounds
      int run = s_run[tid];
      for (int v = 0; v < kWarps; ++v) {
        const int cnt = s_warp[v * R + tid];
        s_warp[v * R + tid] = run;
        run += cnt;
      }
      s_run[tid] = run;
    }
    __syncthreads();
    const uint32_t lt = (1u << lane) - 1u;
    for (int d = 0; d < R; ++d) {
      const uint32_t bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (t < t_end) {
        p.send_pos[t * R + d] =
            (mask >> d) & 1u ? s_offset[d] + s_warp[warp * R + d] + __popc(bits & lt) : -1;
      }
    }
    __syncthreads();
  }

  if (leader) EPX_HT_STAMP(p, 2, kHtTrDone);
  finish_operation(p.symm, w, cur, R, [] {});
  if (leader) EPX_HT_STAMP(p, 2, kHtTrExit);
}

}  // namespace epx::detail
