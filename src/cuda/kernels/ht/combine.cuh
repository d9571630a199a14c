// src/cuda/kernels/ht/combine.cuh — ht combine: expert outputs back to their source ranks.
//
// Grid: num_send_ctas sender CTAs, then reducer CTAs; 512 threads each.
// Senders (rank r holds y[rows, H] in recv_x order): items (32-row block b, source s != r),
//   block-major. Rows j of block b are y[rpm[s-1][r] + j] (the j-th token s sent to r); they go
//   to row j of s's slot for r (x region; weights [K] in the meta region when given). Then one
//   fence and counter[s's slot for r][b] += rows: pairs with the reducer's wait.
// Reducers (rank r, one warp per token t, tokens interleaved over warps): the sources of t are
//   the ranks d with send_pos[t][d] >= 0, in ascending d: d == r reads y[send_pos[t][r]]
//   locally; d != r reads row j = send_pos[t][d] - rpm[r-1][d] of the slot for d once its
//   block's counter is complete. Per element (docs/semantics.md §1.6, bit-exact with the cpu
//   backend):
//     acc = 0.0f; acc += bias0; acc += bias1; acc += y_d for d ascending; out = bf16(acc)
//     (bf16 by the hardware conversion f32x2_to_bf16x2; vectors of one value: the emulation)
//   combined_topk_weights[t][k] = 0.0f + w_d[k] for d ascending.
// engine_y (copy engines push y rows, ht.cu): the copy engines push every row of a slot, the
//   senders every weight (and count every block as before); a reducer reading row j of the slot
//   for d also waits until d's copy engines signalled the chunk holding j (arrived[d] reached
//   cur * kHtEngineChunks + c, chunk c = rows [n * c / C, n * (c + 1) / C)).
// pull (zero-copy combine, ht.cu): no senders; every rank's y rows are in its own region
//   (combine_y_row at send_pos order, weights mirrored at combine_w_row). At the start one thread
//   signals yready[rank] = cur to every peer; a reducer reading rank d's rows waits once for
//   yready[d] and loads y_d[send_pos[t][d]] straight from d's memory. At the end the last CTA
//   signals ready and waits for every peer's ready (they finished reading this rank's y).
// kOutF32 (the hierarchical ht's node-local partials, ht_nodes.cu; launch_ht_combine_f32): out is
//   [T, H] float32, the same sums without the rounding.
// End: the last CTA zeroes the consumed counters and signals ready (finish_operation).
#pragma once

#include "core/numeric.h"
#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

// Rows of 16-byte vectors: 6 vectors per lane per step, 2 row sources loaded together before their
// adds (1.5x the bytes in flight of the 4 x 4 step where a token has <= 2 row sources, EP2 without
// biases; 2026-11-30, T = 4096 at 16 SMs: combine 338.6 -> 319.8 us).
inline constexpr int kReduceUnroll = 6;
inline constexpr int kReduceGroup = 2;
// Rows of narrower vectors: 4 vectors, 4 sources.
inline constexpr int kReduceUnrollNarrow = 4;
inline constexpr int kReduceGroupNarrow = 4;

template <typename V>
union Bf16Pack {
  V v;
  uint16_t h[sizeof(V) / 2];
};

template <typename V>
__device__ __forceinline__ void accumulate(float* acc, const V& v) {
  Bf16Pack<V> pk;
  pk.v = v;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(V) / 2); ++i) acc[i] = acc[i] + bf16_to_f32(pk.h[i]);
}

template <typename V>
__device__ void combine_send(const HtCombineParams& p, uint32_t cur) {
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  __shared__ int32_t s_cnt[kMaxHtRanks], s_excl[kMaxHtRanks];
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  if (threadIdx.x < R) {
    s_cnt[threadIdx.x] = rows_between(p.rank_prefix_matrix, R, threadIdx.x, me);
    s_excl[threadIdx.x] = prefix_before(p.rank_prefix_matrix, R, threadIdx.x, me);
    if (threadIdx.x != me && !wait_peer_ready(p.symm, w, threadIdx.x, cur)) s_ok = 0;
    else if (threadIdx.x != me)
      store_call_word(g.callword(p.symm.peers[threadIdx.x]) + me, p.call_word);
  }
  __syncthreads();
  if (!s_ok) return;
  int64_t max_blocks = 0;
  for (int s = 0; s < R; ++s) {
    if (s != me)
      max_blocks =
          max(max_blocks, static_cast<int64_t>((s_cnt[s] + kHtRowsPerBlock - 1) / kHtRowsPerBlock));
  }
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t num_items = max_blocks * (R - 1);
  for (int64_t item = blockIdx.x; item < num_items; item += p.num_send_ctas) {
    const int64_t b = item / (R - 1);
    const int si = static_cast<int>(item % (R - 1));
    const int s = si < me ? si : si + 1;
    const int rows = min(static_cast<int64_t>(kHtRowsPerBlock), s_cnt[s] - b * kHtRowsPerBlock);
    if (rows <= 0) continue;
    const int slot = HtRegion::slot_of(me, s);
    char* peer = p.symm.peers[s];
    // Rows pushed by the copy engines (engine_y): the senders move weights only.
    const bool engine_rows = p.engine_y != 0;
    for (int r = warp; r < rows; r += kHtWarps) {
      const int64_t j = b * kHtRowsPerBlock + r;
      const int64_t y_row = s_excl[s] + j;
      if (y_row >= p.num_y_rows) continue;  // worst-case overflow: reported at dispatch
      const V* src = reinterpret_cast<const V*>(p.y + y_row * p.y_stride);
      V* dst = reinterpret_cast<V*>(g.x_row(peer, slot, j));
      for (int64_t v0 = 0; v0 < nv && !engine_rows; v0 += 32 * kCopyUnroll) {
        V v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t i = v0 + u * 32 + lane;
          if (i < nv) v[u] = ld_input(src + i);
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t i = v0 + u * 32 + lane;
          if (i < nv) dst[i] = v[u];
        }
      }
      // Weights (0 when this rank passed none, so the sum stays deterministic).
      float* wr = reinterpret_cast<float*>(g.meta_row(peer, slot, j));
      for (int k = lane; k < p.top_k; k += 32)
        wr[k] = p.weights ? p.weights[y_row * p.weights_stride + k] : 0.0f;
    }
    __syncthreads();
    // Pairs with the reducer's wait_flag on counter[slot me][b] on rank s.
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      red_add_relaxed_sys(g.counter(peer, slot, b), static_cast<uint32_t>(rows));
    }
  }
}

// One output vector: its kPerVec float32 sums rounded once to bf16, by the hardware conversion
// (two values at a time) or, for vectors of one value, by the emulation (the same bits).
template <typename V>
__device__ __forceinline__ V round_to_bf16(const float* acc) {
  constexpr int kPerVec = sizeof(V) / 2;
  if constexpr (kPerVec % 2 == 0) {
    return f32_to_bf16_vec<V>(acc);
  } else {
    Bf16Pack<V> pk;
#pragma unroll
    for (int e = 0; e < kPerVec; ++e) pk.h[e] = f32_to_bf16(acc[e]);
    return pk.v;
  }
}

// Stores one vector's accumulators: rounded to bf16 into o[i], or (kOutF32, the node-local
// partials of the hierarchical ht, ht_nodes.cu) as float32 into the row `o` points at, i.e.
// elements i * kPerVec + e of a float row. A template parameter, so the bf16 instantiations are
// the one-node kernels unchanged.
template <typename V, bool kOutF32>
__device__ __forceinline__ void store_acc(V* o, int64_t i, const float* acc) {
  constexpr int kPerVec = sizeof(V) / 2;
  if constexpr (kOutF32) {
    float* f = reinterpret_cast<float*>(o) + i * kPerVec;
#pragma unroll
    for (int e = 0; e < kPerVec; ++e) f[e] = acc[e];
  } else {
    o[i] = round_to_bf16<V>(acc);
  }
}

// reduce_row for a token with at most two row sources (EP2 without biases: its own rank and one
// peer): kPairUnroll vectors of each source in flight per lane per step and no accumulator array
// across steps (fewer steps per row: each step waits for one round trip of its loads).
inline constexpr int kPairUnroll = 7;
template <typename V, bool kOutF32>
__device__ __forceinline__ void reduce_row_pair(const HtCombineParams& p, const V* const* rsrc,
                                                int num_rs, uint64_t landed, V* o, int64_t nv,
                                                int lane) {
  constexpr int kPerVec = sizeof(V) / 2;
  const V* s0 = num_rs > 0 ? rsrc[0] : nullptr;
  const V* s1 = num_rs > 1 ? rsrc[1] : nullptr;
  const bool peer0 = landed & 1u, peer1 = (landed >> 1) & 1u;
  for (int64_t v0 = 0; v0 < nv; v0 += 32 * kPairUnroll) {
    V a[kPairUnroll], b[kPairUnroll];
#pragma unroll
    for (int u = 0; u < kPairUnroll; ++u) {
      const int64_t i = v0 + u * 32 + lane;
      if (i < nv && s0) a[u] = peer0 ? ld_landed(s0 + i) : ld_input(s0 + i);
      if (i < nv && s1) b[u] = peer1 ? ld_landed(s1 + i) : ld_input(s1 + i);
    }
#pragma unroll
    for (int u = 0; u < kPairUnroll; ++u) {
      const int64_t i = v0 + u * 32 + lane;
      if (i >= nv) continue;
      float acc[kPerVec];
#pragma unroll
      for (int e = 0; e < kPerVec; ++e) acc[e] = 0.0f;
      if (s0) accumulate(acc, a[u]);  // sources in order, as reduce_row
      if (s1) accumulate(acc, b[u]);
      store_acc<V, kOutF32>(o, i, acc);
    }
  }
}

// One token's output row: the vectors of its row sources rsrc[0 .. num_rs) (bit q of `landed`:
// source q arrived from a peer, read through L2) accumulated in source order and rounded into o.
// kUnroll vectors per lane per step, up to kGroup sources' loads in flight before their adds.
template <typename V, int kUnroll, int kGroup, bool kOutF32>
__device__ __forceinline__ void reduce_row(const HtCombineParams& p, const V* const* rsrc,
                                           int num_rs, uint64_t landed, V* o, int64_t nv,
                                           int lane) {
  constexpr int kPerVec = sizeof(V) / 2;
  for (int64_t v0 = 0; v0 < nv; v0 += 32 * kUnroll) {
    float acc[kUnroll][kPerVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int e = 0; e < kPerVec; ++e) acc[u][e] = 0.0f;
    // Up to kGroup sources' loads in flight at once; adds stay in source order.
    for (int g0 = 0; g0 < num_rs; g0 += kGroup) {
      V in[kGroup][kUnroll];
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (g0 + q >= num_rs) break;
        const V* base = rsrc[g0 + q];
        const bool from_peer = (landed >> (g0 + q)) & 1u;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = v0 + u * 32 + lane;
          if (i < nv) in[q][u] = from_peer ? ld_landed(base + i) : ld_input(base + i);
        }
      }
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (g0 + q >= num_rs) break;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (v0 + u * 32 + lane < nv) accumulate(acc[u], in[q][u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = v0 + u * 32 + lane;
      if (i < nv) store_acc<V, kOutF32>(o, i, acc[u]);
    }
  }
}

// combined_topk_weights of a token with at most two weight sources: 0.0f + w0 (+ w1), in source
// order (docs/semantics.md §1.6; `num_src` of them count).
__device__ __forceinline__ float combined_weight_pair(int num_src, float w0, float w1) {
  float a = 0.0f;
  if (num_src > 0) a = a + w0;
  if (num_src > 1) a = a + w1;
  return a;
}

inline constexpr int32_t kPulledReady = 0x7fffffff;  // last_block[d]: d's yready acquired

// Reducer steps, one kernel instantiation each (together they spill): kStepWide (16-byte rows),
// kStepNarrow (narrower rows), kStepPair (16-byte rows where every token has at most two row
// sources: R + biases <= 2, chosen by the host).
enum HtReduceStep : int { kStepWide = 0, kStepNarrow = 1, kStepPair = 2 };

template <typename V, int kStep, bool kOutF32>
__device__ void combine_reduce(const HtCombineParams& p, uint32_t cur, int32_t* s_last_block,
                               int32_t* s_last_chunk, const V** s_src, const float** s_wsrc,
                               const V** s_rsrc) {
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  int32_t* last_block = s_last_block + warp * kMaxHtRanks;
  int32_t* last_chunk = s_last_chunk + warp * kMaxHtRanks;
  const V** src = s_src + warp * kMaxHtRanks;
  const float** wsrc = s_wsrc + warp * kMaxHtRanks;
  const V** rsrc = s_rsrc + warp * (kMaxHtRanks + 2);
  if (lane < kMaxHtRanks) last_block[lane] = last_chunk[lane] = -1;
  __syncwarp();
  // This rank as the source: rows it sent to d start after rows from ranks before it.
  const int32_t excl = lane < R ? prefix_before(p.rank_prefix_matrix, R, me, lane) : 0;
  const int32_t cnt = lane < R ? rows_between(p.rank_prefix_matrix, R, me, lane) : 0;
  // engine_y: the rows of the slot for `lane` come by copy engine, in chunks.
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t G = static_cast<int64_t>(gridDim.x - p.num_send_ctas) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x - p.num_send_ctas) * kHtWarps + warp;
  for (int64_t t = gw; t < p.num_tokens; t += G) {
    const int32_t pos = lane < R ? p.send_pos[t * R + lane] : -1;
    bool use = pos >= 0;
    bool ok = true;
    int64_t j = 0;
    if (use && lane != me && p.pull) {
      // Zero-copy combine: rank `lane` wrote its y before its combine began (yready).
      if (last_block[lane] != kPulledReady) {
        ok = wait_flag<true>(g.yready(p.symm.local) + lane, cur, w, kWaitRows, lane) &&
             call_word_matches(w, g.callword(p.symm.peers[lane]) + lane, p.call_word, lane);
        last_block[lane] = kPulledReady;
      }
    } else if (use && lane != me) {
      j = pos - excl;
      const int32_t b = static_cast<int32_t>(j / kHtRowsPerBlock);
      if (last_block[lane] != b) {
        const int rows = min(kHtRowsPerBlock, cnt - b * kHtRowsPerBlock);
        ok = wait_flag<false>(g.counter(p.symm.local, HtRegion::slot_of(lane, me), b),
                              static_cast<uint32_t>(rows), w, kWaitRows, lane) &&
             (b != 0 || call_word_matches(w, g.callword(p.symm.local) + lane, p.call_word, lane));
        last_block[lane] = b;
      }
      if (ok && p.engine_y) {
        const int c = engine_chunk(j, cnt);
        if (last_chunk[lane] < c) {
          ok =
              wait_flag<true>(g.arrived(p.symm.local) + lane,
                              cur * static_cast<uint32_t>(kHtEngineChunks) + c, w, kWaitRows, lane);
          last_chunk[lane] = c;
        }
      }
    }
    if (!__all_sync(0xffffffffu, ok)) return;
    if (EPX_HT_ABLATED(p.ablate, kAblateReduce)) continue;      // benchmark ablation: waits only
    if (use && lane == me && pos >= p.num_y_rows) use = false;  // worst-case overflow
    const uint32_t smask = __ballot_sync(0xffffffffu, use);
    if (use) {
      const int slot = __popc(smask & ((1u << lane) - 1u));
      if (lane == me) {
        src[slot] = reinterpret_cast<const V*>(p.y + pos * p.y_stride);
        wsrc[slot] = p.weights ? p.weights + pos * p.weights_stride : nullptr;
      } else if (p.pull) {  // straight from the peer's memory
        src[slot] =
            reinterpret_cast<const V*>(g.combine_y_row(p.symm.peers[lane], pos, p.row_bytes));
        wsrc[slot] = g.combine_w_row(p.symm.peers[lane], pos);
      } else {
        const int from = HtRegion::slot_of(lane, me);
        src[slot] = reinterpret_cast<const V*>(g.x_row(p.symm.local, from, j));
        wsrc[slot] = reinterpret_cast<const float*>(g.meta_row(p.symm.local, from, j));
      }
    }
    // Row sources in accumulation order: bias0, bias1, then y_d for d ascending (src[] above).
    const int num_src = __popc(smask);
    const int self_slot = (smask >> me) & 1u ? __popc(smask & ((1u << me) - 1u)) : -1;
    const int nb = (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0);
    if (lane == 0) {
      int q = 0;
      if (p.bias0) rsrc[q++] = reinterpret_cast<const V*>(p.bias0 + t * p.bias0_stride);
      if (p.bias1) rsrc[q++] = reinterpret_cast<const V*>(p.bias1 + t * p.bias1_stride);
    }
    if (use)
      rsrc[nb + __popc(smask & ((1u << lane) - 1u))] = src[__popc(smask & ((1u << lane) - 1u))];
    __syncwarp();
    const int num_rs = nb + num_src;
    // Bit q set: row source q landed from a peer during this kernel (read through L2).
    uint64_t landed = 0;
    for (int k = 0; k < num_src; ++k)
      if (k != self_slot) landed |= 1ull << (nb + k);
    V* o = reinterpret_cast<V*>(p.out + t * p.row_bytes * (kOutF32 ? 2 : 1));
    // The weights of up to two sources are loaded before the row (their latency overlaps it).
    const bool wpair = p.combined_weights && num_src <= 2 && p.top_k <= 32;
    float w0 = 0.0f, w1 = 0.0f;
    if (wpair && lane < p.top_k) {
      if (num_src > 0) w0 = self_slot == 0 ? wsrc[0][lane] : ld_landed(wsrc[0] + lane);
      if (num_src > 1) w1 = self_slot == 1 ? wsrc[1][lane] : ld_landed(wsrc[1] + lane);
    }
    if constexpr (kStep == kStepNarrow)
      reduce_row<V, kReduceUnrollNarrow, kReduceGroupNarrow, kOutF32>(p, rsrc, num_rs, landed, o,
                                                                       nv, lane);
    else if constexpr (kStep == kStepPair)
      reduce_row_pair<V, kOutF32>(p, rsrc, num_rs, landed, o, nv, lane);
    else
      reduce_row<V, kReduceUnroll, kReduceGroup, kOutF32>(p, rsrc, num_rs, landed, o, nv, lane);
    if (wpair) {
      if (lane < p.top_k)
        p.combined_weights[t * p.top_k + lane] = combined_weight_pair(num_src, w0, w1);
    } else if (p.combined_weights) {
      for (int k = lane; k < p.top_k; k += 32) {
        float a = 0.0f;
        for (int q = 0; q < num_src; ++q)
          a = a + (q == self_slot ? wsrc[q][k] : ld_landed(wsrc[q] + k));
        p.combined_weights[t * p.top_k + k] = a;
      }
    }
    __syncwarp();
  }
}

// kStep: the reducers' step (HtReduceStep; rows of vectors narrower than 16 bytes: kStepNarrow).
// kOutF32: out is float32 (store_acc).
template <typename V, int kStep = (sizeof(V) < 16 ? kStepNarrow : kStepWide),
          bool kOutF32 = false>
__global__ void __launch_bounds__(kHtThreads, 1) ht_combine_kernel(HtCombineParams p) {
  pdl_begin(p.pdl);
  __shared__ int32_t s_last_block[kHtWarps * kMaxHtRanks];
  __shared__ const V* s_src[kHtWarps * kMaxHtRanks];
  __shared__ const float* s_wsrc[kHtWarps * kMaxHtRanks];
  __shared__ const V* s_rsrc[kHtWarps * (kMaxHtRanks + 2)];
  __shared__ int32_t s_last_chunk[kHtWarps * kMaxHtRanks];
  const uint32_t cur = p.wait.state->seq + 1;
  const int R = p.num_ranks, me = p.rank;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    publish_deferred_ready(p.symm, p.wait, R);
    // Zero-copy combine: this rank's y (written by the work before this kernel) may be read.
    if (p.pull) {
      *reinterpret_cast<volatile uint32_t*>(p.symm.region.callword(p.symm.local) + me) =
          p.call_word;
      __threadfence_system();
      signal_peers(p.symm, &HtRegion::yready, R, me, cur);
    }
  }
  if (static_cast<int>(blockIdx.x) < p.num_send_ctas) {
    combine_send<V>(p, cur);
  } else {
    combine_reduce<V, kStep, kOutF32>(p, cur, s_last_block, s_last_chunk, s_src, s_wsrc, s_rsrc);
  }
  finish_operation(
      p.symm, p.wait, cur, R,
      [&] { zero_block_counters(p.symm, p.rank_prefix_matrix, R, me, /*rows_went_out=*/true); },
      kReadyNow, /*wait_peers=*/p.pull != 0);
}

}  // namespace epx::detail
