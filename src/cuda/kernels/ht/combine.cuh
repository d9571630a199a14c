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
//   block's counter is complete. Per element (SPEC 3.3, bit-exact with the cpu backend):
//     acc = 0.0f; acc += bias0; acc += bias1; acc += y_d for d ascending; out = bf16(acc)
//   combined_topk_weights[t][k] = 0.0f + w_d[k] for d ascending.
// End: the last CTA zeroes the consumed counters and signals ready (finish_operation).
#pragma once

#include "core/numeric.h"
#include "cuda/kernels/ht/row_copy.cuh"

namespace epx::detail {

inline constexpr int kReduceUnroll = 4;  // vectors per lane per step (register path)
inline constexpr int kReduceGroup = 4;   // row sources loaded together before their adds

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
__device__ void combine_send(const HtCombineParams& p, uint32_t cur, uint4* stage,
                             const V** list_src, V** list_dst) {
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
    // This warp's rows of the block: r = warp, warp + kHtWarps, ...
    const int r = warp + lane * kHtWarps;
    const int64_t j = b * kHtRowsPerBlock + r;
    const int64_t y_row = s_excl[s] + j;
    // y_row >= num_y_rows: worst-case overflow, reported at dispatch; nothing to send.
    const bool mine = lane < kMaxListRows && r < rows && y_row < p.num_y_rows;
    const uint32_t m = __ballot_sync(0xffffffffu, mine);
    if (mine) {
      const int q = __popc(m & ((1u << lane) - 1u));
      list_src[q] = reinterpret_cast<const V*>(p.y + y_row * p.y_stride);
      list_dst[q] = reinterpret_cast<V*>(g.x_row(peer, slot, j));
    }
    __syncwarp();
    warp_copy_rows<V, false>(list_src, list_dst, __popc(m), nv, lane, stage);
    for (int rr = warp; rr < rows; rr += kHtWarps) {
      const int64_t jj = b * kHtRowsPerBlock + rr;
      const int64_t yr = s_excl[s] + jj;
      if (yr >= p.num_y_rows) continue;
      // Weights (0 when this rank passed none, so the sum stays deterministic).
      float* wr = reinterpret_cast<float*>(g.meta_row(peer, slot, jj));
      for (int k = lane; k < p.top_k; k += 32)
        wr[k] = p.weights ? p.weights[yr * p.weights_stride + k] : 0.0f;
    }
    __syncwarp();
    __syncthreads();
    // Pairs with the reducer's wait_flag on counter[slot me][b] on rank s.
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      red_add_relaxed_sys(g.counter(peer, slot, b), static_cast<uint32_t>(rows));
    }
  }
}

// One output row from up to kReduceGroup row sources (16-byte vectors) through a
// kRedStages-deep cp.async pipeline: chunk k = kRedVecs vectors per lane of every source; the
// adds run in source order (bias0, bias1, y_d ascending) on chunk k while later chunks load.
// (All sources go through L2 (.cg): valid for peer-written rows after the acquire.)
inline constexpr int kRedStages = 3;
inline constexpr int kRedVecs = 2;
inline constexpr int kRedStageVecs = kRedStages * kReduceGroup * kRedVecs * 32;  // uint4 per warp
static_assert(kRedStageVecs >= kCopyStageVecs, "the reducer's staging also serves the copier");
inline constexpr size_t kCombineSmemBytes = size_t(kHtWarps) * kRedStageVecs * 16;

__device__ __forceinline__ void reduce_row_pipelined(const uint4* const* src, int num_src,
                                                     uint64_t /*landed*/, uint4* out, int64_t nv,
                                                     int lane, uint4* stage) {
  const int chunks = static_cast<int>((nv + 32 * kRedVecs - 1) / (32 * kRedVecs));
  auto slot = [&](int k, int q, int u) {
    return stage + (((k % kRedStages) * kReduceGroup + q) * kRedVecs + u) * 32 + lane;
  };
  auto issue = [&](int k) {
    if (k < chunks) {
      for (int q = 0; q < num_src; ++q) {
#pragma unroll
        for (int u = 0; u < kRedVecs; ++u) {
          const int64_t i = static_cast<int64_t>(k) * 32 * kRedVecs + u * 32 + lane;
          if (i < nv) cp_async16(slot(k, q, u), src[q] + i);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < kRedStages - 1; ++k) issue(k);
  for (int k = 0; k < chunks; ++k) {
    issue(k + kRedStages - 1);
    cp_async_wait<kRedStages - 1>();
    float acc[kRedVecs][8];
#pragma unroll
    for (int u = 0; u < kRedVecs; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
    for (int q = 0; q < num_src; ++q) {
#pragma unroll
      for (int u = 0; u < kRedVecs; ++u) accumulate(acc[u], *slot(k, q, u));
    }
#pragma unroll
    for (int u = 0; u < kRedVecs; ++u) {
      const int64_t i = static_cast<int64_t>(k) * 32 * kRedVecs + u * 32 + lane;
      if (i >= nv) continue;
      Bf16Pack<uint4> pk;
#pragma unroll
      for (int e = 0; e < 8; ++e) pk.h[e] = f32_to_bf16(acc[u][e]);
      out[i] = pk.v;
    }
  }
  cp_async_wait<0>();
}

template <typename V>
__device__ void combine_reduce(const HtCombineParams& p, int32_t* s_last_block, const V** s_src,
                               const float** s_wsrc, const V** s_rsrc, uint4* stage) {
  constexpr int kPerVec = sizeof(V) / 2;
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  int32_t* last_block = s_last_block + warp * kMaxHtRanks;
  const V** src = s_src + warp * kMaxHtRanks;
  const float** wsrc = s_wsrc + warp * kMaxHtRanks;
  const V** rsrc = s_rsrc + warp * (kMaxHtRanks + 2);
  if (lane < kMaxHtRanks) last_block[lane] = -1;
  __syncwarp();
  // This rank as the source: rows it sent to d start after rows from ranks before it.
  const int32_t excl = lane < R ? prefix_before(p.rank_prefix_matrix, R, me, lane) : 0;
  const int32_t cnt = lane < R ? rows_between(p.rank_prefix_matrix, R, me, lane) : 0;
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t G = static_cast<int64_t>(gridDim.x - p.num_send_ctas) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x - p.num_send_ctas) * kHtWarps + warp;
  for (int64_t t = gw; t < p.num_tokens; t += G) {
    const int32_t pos = lane < R ? p.send_pos[t * R + lane] : -1;
    bool use = pos >= 0;
    bool ok = true;
    int64_t j = 0;
    if (use && lane != me) {
      j = pos - excl;
      const int32_t b = static_cast<int32_t>(j / kHtRowsPerBlock);
      if (last_block[lane] != b) {
        const int rows = min(kHtRowsPerBlock, cnt - b * kHtRowsPerBlock);
        ok = wait_flag<false>(g.counter(p.symm.local, HtRegion::slot_of(lane, me), b),
                              static_cast<uint32_t>(rows), w, kWaitRows, lane);
        last_block[lane] = b;
      }
    }
    if (!__all_sync(0xffffffffu, ok)) return;
    if (use && lane == me && pos >= p.num_y_rows) use = false;  // worst-case overflow
    const uint32_t smask = __ballot_sync(0xffffffffu, use);
    if (use) {
      const int slot = __popc(smask & ((1u << lane) - 1u));
      if (lane == me) {
        src[slot] = reinterpret_cast<const V*>(p.y + pos * p.y_stride);
        wsrc[slot] = p.weights ? p.weights + pos * p.weights_stride : nullptr;
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
    V* o = reinterpret_cast<V*>(p.out + t * p.row_bytes);
    bool done = false;
    if constexpr (sizeof(V) == 16) {
      if (num_rs <= kReduceGroup) {
        reduce_row_pipelined(rsrc, num_rs, landed, o, nv, lane, stage);
        done = true;
      }
    }
    for (int64_t v0 = 0; !done && v0 < nv; v0 += 32 * kReduceUnroll) {
      float acc[kReduceUnroll][kPerVec];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) acc[u][e] = 0.0f;
      // Up to kReduceGroup sources' loads in flight at once; adds stay in source order.
      for (int g0 = 0; g0 < num_rs; g0 += kReduceGroup) {
        V in[kReduceGroup][kReduceUnroll];
#pragma unroll
        for (int q = 0; q < kReduceGroup; ++q) {
          if (g0 + q >= num_rs) break;
          const V* base = rsrc[g0 + q];
          const bool from_peer = (landed >> (g0 + q)) & 1u;
#pragma unroll
          for (int u = 0; u < kReduceUnroll; ++u) {
            const int64_t i = v0 + u * 32 + lane;
            if (i < nv) in[q][u] = from_peer ? ld_landed(base + i) : ld_input(base + i);
          }
        }
#pragma unroll
        for (int q = 0; q < kReduceGroup; ++q) {
          if (g0 + q >= num_rs) break;
#pragma unroll
          for (int u = 0; u < kReduceUnroll; ++u) {
            if (v0 + u * 32 + lane < nv) accumulate(acc[u], in[q][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int64_t i = v0 + u * 32 + lane;
        if (i >= nv) continue;
        Bf16Pack<V> pk;
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) pk.h[e] = f32_to_bf16(acc[u][e]);
        o[i] = pk.v;
      }
    }
    if (p.combined_weights) {
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

template <typename V>
__global__ void __launch_bounds__(kHtThreads, 1) ht_combine_kernel(HtCombineParams p) {
  __shared__ int32_t s_last_block[kHtWarps * kMaxHtRanks];
  __shared__ const V* s_src[kHtWarps * kMaxHtRanks];
  __shared__ const float* s_wsrc[kHtWarps * kMaxHtRanks];
  __shared__ const V* s_rsrc[kHtWarps * (kMaxHtRanks + 2)];
  extern __shared__ uint4 s_stage[];  // kCombineSmemBytes: one cp.async pipeline per warp
  const uint32_t cur = p.wait.state->seq + 1;
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5;
  uint4* stage = s_stage + warp * kRedStageVecs;
  if (static_cast<int>(blockIdx.x) < p.num_send_ctas) {
    combine_send<V>(
        p, cur, stage, s_src + warp * kMaxHtRanks,
        const_cast<V**>(reinterpret_cast<const V**>(s_rsrc + warp * (kMaxHtRanks + 2))));
  } else {
    combine_reduce<V>(p, s_last_block, s_src, s_wsrc, s_rsrc, stage);
  }
  finish_operation(p.symm, p.wait, cur, R, [&] {
    const HtRegion& g = p.symm.region;
    for (int d = 0; d < R; ++d) {
      if (d == me) continue;
      const int64_t nb =
          (rows_between(p.rank_prefix_matrix, R, me, d) + kHtRowsPerBlock - 1) / kHtRowsPerBlock;
      for (int64_t b = threadIdx.x; b < nb; b += blockDim.x)
        *g.counter(p.symm.local, HtRegion::slot_of(d, me), b) = 0u;
    }
  });
}

}  // namespace epx::detail
