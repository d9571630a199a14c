// src/cuda/kernels/a2a/dispatch.cuh — a2a dispatch (docs/semantics.md §3.1): every rank pushes each
// payload row of its tokens into the receive rows of the ranks they go to, then waits for its own.
//
// Rank r, T tokens, C CTAs of kA2aThreads, token chunk of CTA b: [b*ceil(T/C), ...) (the last
// non-empty chunk ends at T). Call epoch e = ++state.dispatch_epoch[b].
//   1. CTA 0: entered[r] = e on every peer (release): r's readers of its views are done.
//   2. Routing: CTA b scans tokens [0, chunk end) in order, 512 at a time: mask(t) = OR over k of
//      bit (topk_idx[t][k] / L) for ids in [0, E) (ids < -1 or >= E are recorded as
//      InvalidArgument and dropped); slot_d(t) = number of tokens before t with bit d (block
//      ballots + a running base per d). It stores mask[t] and slot[t][d] (-1 where t does not go
//      to d) for its own chunk into the local workspace (combine reads them). CTA C-1 scans all T
//      and so ends with count_d = tokens going to d.
//   3. Before writing to peer p: wait entered[p] >= e (p's views of the previous call are free).
//   4. Copy: for each payload i, each token t of the chunk, each d in mask(t), each vector v:
//        recv_i of rank d, row (r * M + slot_d(t)), vector v  =  payload_i row t, vector v
//      (loaded once, stored to every destination; 16-byte vectors where row size and pointers
//      allow, else 8/4/2/1).
//   5. CTA C-1: recv_counts[r] = count_d and dispatch_geom[r] = {M, row bytes} on every d.
//   6. Every CTA: release +1 into dispatch_flag[r] of every d (common.cuh).
//   7. Every CTA waits dispatch_flag[s] >= e * C_s for all s: all rows for r landed. CTA 0
//      checks every peer's geometry against its own (mismatch -> InvalidArgument record).
//   8. Sanitise (invalid_expert_id given): expert-id rows j in [recv_counts[s], M) of every s get
//      invalid_expert_id in all K entries; the CTAs share the rows.
// Padding rows of the other payloads are not written (unspecified: docs/semantics.md §3.2).
// Rank mask (I = state.inactive_mask, read once at the start): step 2 clears the bits of I in
// mask(t) and counts what that drops for the CTA's own chunk (one atomicAdd per counter and CTA
// into state.dropped_*); steps 1, 3, 5, 6 and 7 skip the ranks of I (never written, never
// waited for); CTA C-1 sets the local recv_counts[s] = 0 for every s in I before its self-signal,
// so step 8 treats their rows as padding.
#pragma once

#include "cuda/kernels/a2a/common.cuh"

namespace epx::detail {

inline constexpr int kRouteLoads = 4;  // groups of 512 tokens whose ids are loaded together
inline constexpr int kCopyUnroll = 4;  // vectors in flight per thread in the row copy

struct A2aPayloadDesc {
  const char* src;    // [T, row_bytes], contiguous
  int64_t row_bytes;  // bytes per token in this call (multiple of 4)
  int32_t vec_bytes;  // copy unit: 16, 8, 4, 2 or 1 (divides row_bytes and src)
  int32_t pad;
};

struct A2aDispatchParams {
  const void* topk_idx;  // [T, K] int32 or int64, row stride topk_stride elements
  int64_t topk_stride;
  int32_t topk_is_i64;
  int32_t num_tokens;  // T
  int32_t top_k;
  int32_t num_experts;
  int32_t num_local_experts;
  int32_t num_ranks;
  int32_t rank;
  int32_t runtime_max;  // M
  int32_t num_payloads;
  int32_t sanitise_index;  // expert-id payload to sanitise, or -1
  int32_t invalid_expert_id;
  A2aPayloadDesc payloads[kMaxA2aPayloads];
  A2aSymm symm;
  WaitContext wait;
};

// Destination ranks of token t (bit d = goes to d), before the rank mask. Out-of-range ids are
// reported and dropped; *num_inactive = valid selections on ranks of `inactive`.
__device__ __forceinline__ uint64_t a2a_token_mask(const A2aDispatchParams& p, int64_t t,
                                                   uint64_t inactive, uint32_t* num_inactive) {
  uint64_t mask = 0;
  uint32_t n = 0;
  const int64_t row = t * p.topk_stride;
  for (int k = 0; k < p.top_k; ++k) {
    const int64_t e = p.topk_is_i64 ? __ldg(static_cast<const long long*>(p.topk_idx) + row + k)
                                    : __ldg(static_cast<const int32_t*>(p.topk_idx) + row + k);
    if (e >= 0 && e < p.num_experts) {
      const int d = static_cast<int32_t>(e) / p.num_local_experts;
      mask |= uint64_t{1} << d;
      n += (inactive >> d) & 1u;
    } else if (e != -1) {
      record_error(p.wait, kDevErrBadExpert, -1, t * 64 + k, e);
    }
  }
  *num_inactive = n;
  return mask;
}

// Step 2. s_count[d] ends as the number of tokens in [0, t_end) going to d (d active).
__device__ void a2a_route(const A2aDispatchParams& p, int64_t t_begin, int64_t t_end,
                          uint64_t inactive, uint32_t* s_count, A2aState* state) {
  __shared__ uint32_t s_warp[2][kA2aWarps][kMaxRanks];  // per warp: count, then exclusive offset
  const int R = p.num_ranks, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t* masks = p.symm.layout.mask(p.symm.local);
  int32_t* slots = p.symm.layout.slot(p.symm.local);
  if (threadIdx.x < R) s_count[threadIdx.x] = 0;
  const uint32_t lt = (1u << lane) - 1u;
  int parity = 0;
  unsigned long long dropped_tokens = 0, dropped_selections = 0;  // this thread's own tokens
  for (int64_t base = 0; base < t_end; base += kRouteLoads * kA2aThreads) {
    uint64_t mask[kRouteLoads];
#pragma unroll
    for (int q = 0; q < kRouteLoads; ++q) {
      const int64_t t = base + q * kA2aThreads + threadIdx.x;
      uint32_t n = 0;
      mask[q] = t < t_end ? a2a_token_mask(p, t, inactive, &n) : 0;
      if (t >= t_begin && t < t_end) {
        dropped_selections += n;
        dropped_tokens += mask[q] != 0 && (mask[q] & ~inactive) == 0;
      }
      mask[q] &= ~inactive;
    }
#pragma unroll
    for (int q = 0; q < kRouteLoads; ++q) {
      const int64_t group = base + q * kA2aThreads;
      if (group >= t_end) break;  // uniform over the CTA
      for (int d = 0; d < R; ++d) {
        const uint32_t b = __ballot_sync(0xffffffffu, (mask[q] >> d) & 1u);
        if (lane == 0) s_warp[parity][warp][d] = __popc(b);
      }
      __syncthreads();
      if (threadIdx.x < R) {  // exclusive scan over warps, on top of the running count
        uint32_t run = s_count[threadIdx.x];
        for (int w = 0; w < kA2aWarps; ++w) {
          const uint32_t c = s_warp[parity][w][threadIdx.x];
          s_warp[parity][w][threadIdx.x] = run;
          run += c;
        }
        s_count[threadIdx.x] = run;
      }
      __syncthreads();
      const int64_t t = group + threadIdx.x;
      const bool mine = t >= t_begin && t < t_end;
      if (mine) masks[t] = mask[q];
      for (int d = 0; d < R; ++d) {
        const bool bit = (mask[q] >> d) & 1u;
        const uint32_t b = __ballot_sync(0xffffffffu, bit);
        if (mine)
          slots[t * R + d] =
              bit ? static_cast<int32_t>(s_warp[parity][warp][d] + __popc(b & lt)) : -1;
      }
      parity ^= 1;  // the next group writes the other half; two barriers separate reuse
    }
  }
  if (inactive != 0) {  // only a mask can drop anything
    dropped_tokens = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(dropped_tokens));
    dropped_selections = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(dropped_selections));
    if (lane == 0 && dropped_tokens != 0) atomicAdd(&state->dropped_tokens, dropped_tokens);
    if (lane == 0 && dropped_selections != 0)
      atomicAdd(&state->dropped_selections, dropped_selections);
  }
  __syncthreads();
}

// Step 4 for one payload: rows of tokens [t_begin, t_end) to every destination.
template <typename V>
__device__ void a2a_push_rows(const A2aDispatchParams& p, const A2aPayloadDesc& pl, int i,
                              int64_t t_begin, int64_t t_end) {
  const int R = p.num_ranks, me = p.rank;
  const uint64_t* masks = p.symm.layout.mask(p.symm.local);
  const int32_t* slots = p.symm.layout.slot(p.symm.local);
  const int64_t nv = pl.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t num_rows = t_end - t_begin;
  if (num_rows <= 0 || nv == 0) return;
  const size_t recv_off = p.symm.layout.recv_off[i];
  const int64_t block_row = static_cast<int64_t>(me) * p.runtime_max;  // [r] block of each dest
  RowWalker w(nv, threadIdx.x);
  while (w.row < num_rows) {
    V val[kCopyUnroll];
    int64_t row[kCopyUnroll], vec[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      row[u] = w.row;
      vec[u] = w.vec;
      if (w.row < num_rows)
        val[u] = ld_input<V>(pl.src + (t_begin + w.row) * pl.row_bytes + w.vec * sizeof(V));
      w.advance();
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (row[u] >= num_rows) break;
      const int64_t t = t_begin + row[u];
      for (uint64_t m = masks[t]; m != 0; m &= m - 1) {
        const int d = __ffsll(static_cast<long long>(m)) - 1;
        const int64_t dst_row = block_row + slots[t * R + d];
        char* dst = p.symm.peers[d] + recv_off + dst_row * pl.row_bytes + vec[u] * sizeof(V);
        *reinterpret_cast<V*>(dst) = val[u];
      }
    }
  }
}

__device__ __forceinline__ void a2a_push_payload(const A2aDispatchParams& p, int i, int64_t t_begin,
                                                 int64_t t_end) {
  const A2aPayloadDesc& pl = p.payloads[i];
  switch (pl.vec_bytes) {
    case 16:
      a2a_push_rows<uint4>(p, pl, i, t_begin, t_end);
      break;
    case 8:
      a2a_push_rows<uint2>(p, pl, i, t_begin, t_end);
      break;
    case 4:
      a2a_push_rows<uint32_t>(p, pl, i, t_begin, t_end);
      break;
    case 2:
      a2a_push_rows<uint16_t>(p, pl, i, t_begin, t_end);
      break;
    default:
      a2a_push_rows<uint8_t>(p, pl, i, t_begin, t_end);
      break;
  }
}

__global__ void __launch_bounds__(kA2aThreads) a2a_dispatch_kernel(A2aDispatchParams p) {
  __shared__ uint32_t s_count[kMaxRanks];
  const int R = p.num_ranks, me = p.rank;
  const A2aSymm& symm = p.symm;
  const A2aLayout& g = symm.layout;
  const WaitContext& w = p.wait;
  A2aState* state = g.state(symm.local);
  const uint32_t e = a2a_next_epoch(state->dispatch_epoch);
  const uint64_t inactive = state->inactive_mask;  // written only by the resync kernel
  const uint64_t peers_skipped = inactive | (uint64_t{1} << me);

  // 1. Entry: pairs with the wait in step 3 of every peer's CTAs.
  if (blockIdx.x == 0 && threadIdx.x < R && !rank_skipped(peers_skipped, threadIdx.x))
    st_release_sys(&g.sync(symm.peers[threadIdx.x])->entered[me], e);

  // 2. Routing of this CTA's chunk.
  const int64_t T = p.num_tokens;
  const int64_t chunk = (T + gridDim.x - 1) / gridDim.x;
  const int64_t t_begin = min(static_cast<int64_t>(blockIdx.x) * chunk, T);
  const int64_t t_end = min(t_begin + chunk, T);
  // A CTA without tokens routes nothing, except the last one, which counts every token.
  if (t_begin < t_end || blockIdx.x == gridDim.x - 1)
    a2a_route(p, t_begin, t_end, inactive, s_count, state);

  // 3. Every active peer entered this call.
  if (!wait_ranks(
          g.sync(symm.local)->entered, R, peers_skipped, [&](int) { return e; }, w, kWaitReady))
    return;

  // 4. Rows.
  for (int i = 0; i < p.num_payloads; ++i) a2a_push_payload(p, i, t_begin, t_end);

  // 5. Counts and geometry, from the CTA that routed every token.
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < R && rank_skipped(inactive, threadIdx.x))
    g.counts(symm.local)[threadIdx.x] = 0;  // nothing comes from an inactive rank
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < R && !rank_skipped(inactive, threadIdx.x)) {
    char* peer = symm.peers[threadIdx.x];
    g.counts(peer)[me] = static_cast<int32_t>(s_count[threadIdx.x]);
    int32_t* geom = g.sync(peer)->dispatch_geom[me];
    geom[0] = p.runtime_max;
    for (int i = 0; i < p.num_payloads; ++i)
      geom[1 + i] = static_cast<int32_t>(p.payloads[i].row_bytes);
  }
  __syncthreads();

  // 6. Release this CTA's rows (and counts) to every active destination, self included.
  signal_ranks(R, inactive, [&](int d) { return &g.sync(symm.peers[d])->dispatch_flag[me]; });

  // 7. Everything sent to this rank landed.
  if (!wait_ranks(
          g.sync(symm.local)->dispatch_flag, R, inactive,
          [&](int s) { return e * symm.peer_ctas[s]; }, w, kWaitRows))
    return;
  const int32_t* counts = g.counts(symm.local);
  if (blockIdx.x == 0 && threadIdx.x < R && !rank_skipped(inactive, threadIdx.x)) {
    const int s = threadIdx.x;
    const volatile int32_t* geom = g.sync(symm.local)->dispatch_geom[s];
    auto compare = [&](int64_t field, int32_t mine, int32_t theirs) {
      if (mine == theirs) return;
      record_error(w, kDevErrA2aGeometry, s, field << 32 | static_cast<uint32_t>(mine), theirs);
    };
    compare(kGeomRuntimeMax, p.runtime_max, geom[0]);
    for (int i = 0; i < p.num_payloads; ++i)
      compare(kGeomRowBytes + i, static_cast<int32_t>(p.payloads[i].row_bytes), geom[1 + i]);
  }

  // 8. Padding of the expert-id payload.
  if (p.sanitise_index < 0) return;
  const int K = p.top_k;
  const int64_t M = p.runtime_max;
  int32_t* ids = reinterpret_cast<int32_t*>(g.recv(symm.local, p.sanitise_index));
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int s = 0; s < R; ++s) {
    const int64_t count = ld_landed<int32_t>(counts + s);
    const int64_t n = (M - count) * K;  // contiguous: rows are K int32 wide
    int32_t* pad = ids + (s * M + count) * K;
    for (int64_t j = start; j < n; j += stride) pad[j] = p.invalid_expert_id;
  }
}

}  // namespace epx::detail
