// src/cuda/kernels/ht/dispatch.cuh — ht dispatch: rows to the ranks that hold their experts.
//
// Grid: num_send_ctas sender CTAs, then receiver CTAs; 512 threads each. (R = 1: receivers only.)
// Zero-copy (R > 1): every CTA sends, then every CTA receives (recv_cta0 = 0).
// Sender warps (rank r, warp gw of G) push rows to the OTHER ranks: batches of kDispatchBatch
//   (4) consecutive tokens, batch gw first, then each warp drawing its next batch from a per-rank
//   counter (state->send_next), so the warps advance through the tokens together, the receivers'
//   32-row blocks fill roughly in order, and no warp idles while batches are left. Token t goes
//   to every d != r with pos = send_pos[t][d] >= 0: row j = pos - rpm[r-1][d] of d's slot for r
//   (x, scales, meta) through the LSA pointer; after the batch: fence, then
//   counter[d's slot for r][j / 32] += rows.
// Receiver CTAs (rank r): first the rows r keeps, x[t] -> recv_*[send_pos[t][r]] (no waiting;
//   this overlaps the peers' pushes), then items (32-row block b, source s != r), block-major:
//   one thread waits until counter[slot s][b] == rows in that block, then the CTA copies the
//   rows to recv_*[rpm[s-1][r] + j] (a warp per row), then the block's metadata with every
//   thread at once (recv_block_meta): the order of docs/semantics.md §1.2 (source rank, then
//   source token).
// Worst-case mode: rows >= num_rows are never written; N > num_rows is reported
//   (OutOfCapacity); rows [N, num_rows) get topk -1, weight 0, src_idx -1.
// End: the last CTA zeroes the counters it consumed and signals ready (finish_operation).
// Copy engines (host-selected, ht.cu): engine_kept — the kept rows' x is copied by the copy
//   engines, dispatch_self moves only scales and metadata.
// Zero-copy (host-selected): recv_x and recv_scales are views of this rank's region
//   (x_recv_row, scale_recv_row); senders store each row and its scales at send_pos in the
//   receiver's region and also place the rows their rank keeps (dispatch_kept_row); receivers
//   wait for the blocks and copy only the metadata out (not cached); the ready signal is
//   deferred to the rank's next op (finish_operation).
// Rows move through copy_row (16-byte vectors per lane where the addresses allow).
#pragma once

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

inline constexpr int kDispatchBatch = 4;  // tokens per warp between two signals

__device__ __forceinline__ void store_topk_idx(void* out, int is_i64, int64_t i, int32_t v) {
  if (is_i64) {
    static_cast<int64_t*>(out)[i] = v;
  } else {
    static_cast<int32_t*>(out)[i] = v;
  }
}

// A token's routing in registers (top_k <= 32): lane k < K holds its k-th expert id (-1 when
// outside [0, E): routed nowhere, as the count exchange has it) and weight (0 without weights).
// Loaded when the token starts, so the loads' latency overlaps its row copy; every metadata word
// and kept-row field is then formed from registers (meta_word).
struct TokenMeta {
  int32_t e = -1;
  float w = 0.0f;
};
__device__ __forceinline__ TokenMeta load_token_meta(const HtDispatchParams& p, int64_t t,
                                                     int lane) {
  TokenMeta m;
  if (lane < p.top_k) {
    const int64_t e = ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, lane);
    if (p.topk_weights) m.w = p.topk_weights[t * p.weights_stride + lane * p.weights_stride1];
    const int64_t E = static_cast<int64_t>(p.num_local_experts) * p.num_ranks;
    m.e = e >= 0 && e < E ? static_cast<int32_t>(e) : -1;
  }
  return m;
}
// Word q of token t's meta row for destination d, from `m`: {src_idx, local idx [K], weight
// [K]} (-1 / 0 where the expert is not d's), 0 for q >= 1 + 2K. Every lane of the warp must call
// it (shuffles).
__device__ __forceinline__ uint32_t meta_word(const HtDispatchParams& p, const TokenMeta& m,
                                              int64_t t, int d, int q) {
  const int K = p.top_k, L = p.num_local_experts;
  const int k = q == 0 ? 0 : (q <= K ? q - 1 : q - 1 - K);
  const int e = __shfl_sync(0xffffffffu, m.e, k & 31);
  const float w = __shfl_sync(0xffffffffu, m.w, k & 31);
  const bool local = e >= d * L && e < (d + 1) * L;
  if (q == 0) return static_cast<uint32_t>(t);
  if (q <= K) return static_cast<uint32_t>(local ? e - d * L : -1);
  if (q <= 2 * K) return __float_as_uint(local ? w : 0.0f);
  return 0u;
}

// A token's scale words in registers: lane holds words lane and lane + 32 (the first
// kScaleRegs * 32; H <= 8192 with 128-channel fp8 blocks needs 64). Loaded once per token and
// stored to every destination (the kept row included); the senders load them a token ahead.
inline constexpr int kScaleRegs = 2;
struct TokenScales {
  uint32_t w[kScaleRegs];
};
__device__ __forceinline__ TokenScales load_token_scales(const HtDispatchParams& p, int64_t t,
                                                         int lane) {
  TokenScales r;
#pragma unroll
  for (int i = 0; i < kScaleRegs; ++i) {
    const int s = lane + 32 * i;
    r.w[i] = s < p.num_scales ? ld_input(reinterpret_cast<const uint32_t*>(p.scales) +
                                         t * p.scale_stride0 + s * p.scale_stride1)
                              : 0u;
  }
  return r;
}
// Stores token t's scale words to dst[0, num_scales): the registers, then any words past them.
__device__ __forceinline__ void store_token_scales(const HtDispatchParams& p, int64_t t,
                                                   const TokenScales& r, uint32_t* dst, int lane) {
#pragma unroll
  for (int i = 0; i < kScaleRegs; ++i)
    if (lane + 32 * i < p.num_scales) dst[lane + 32 * i] = r.w[i];
  for (int s = lane + 32 * kScaleRegs; s < p.num_scales; s += 32)
    dst[s] = reinterpret_cast<const uint32_t*>(p.scales)[t * p.scale_stride0 + s * p.scale_stride1];
}

// Copies one row of nv vectors: kCopyUnroll independent loads per lane in flight, then the stores.
template <typename V, bool kLanded>
__device__ __forceinline__ void copy_row(const V* src, V* dst, int64_t nv, int lane) {
  for (int64_t v0 = 0; v0 < nv; v0 += 32 * kCopyUnroll) {
    V r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < nv) r[u] = kLanded ? ld_landed(src + v) : ld_input(src + v);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < nv) dst[v] = r[u];
    }
  }
}

// The first receiver CTA: after the senders, or 0 when every CTA sends and then receives
// (zero-copy: the receivers only wait for the blocks and copy the metadata out).
__device__ __forceinline__ int recv_cta0(const HtDispatchParams& p) {
  return p.zero_copy && p.num_send_ctas == static_cast<int>(gridDim.x) ? 0 : p.num_send_ctas;
}

// One row this rank keeps, x[t] -> recv_*[pos] (+ scales, src_idx, local ids); the x row unless
// the copy engines copy the kept rows (engine_kept).
// `sc`: token t's scale words (load_token_scales), `m` its routing (load_token_meta), loaded by
// the caller.
template <typename V>
__device__ __forceinline__ void dispatch_kept_row(const HtDispatchParams& p, int64_t t, int64_t pos,
                                                  const V* src, int64_t nv, int lane,
                                                  const TokenScales& sc, const TokenMeta& m) {
  if (!p.engine_kept)
    copy_row<V, false>(src, reinterpret_cast<V*>(p.recv_x + pos * p.row_bytes), nv, lane);
  if (p.num_scales > 0)
    store_token_scales(p, t, sc, p.recv_scales + pos * static_cast<int64_t>(p.num_scales), lane);
  if (!p.cached) {
    if (lane == 0) p.recv_src_idx[pos] = static_cast<int32_t>(t);
    const int K = p.top_k, L = p.num_local_experts, me = p.rank;
    if (lane < K) {
      const int64_t o = pos * static_cast<int64_t>(K) + lane;
      const bool local = m.e >= me * L && m.e < (me + 1) * L;
      store_topk_idx(p.recv_topk_idx, p.topk_is_i64, o, local ? m.e - me * L : -1);
      if (p.recv_topk_weights) p.recv_topk_weights[o] = local ? m.w : 0.0f;
    }
  }
}

// Sender warps push this rank's rows to the OTHER ranks (the receiver CTAs copy the rows this
// rank keeps, except under zero-copy, where the senders place them too).
template <typename V>
__device__ void dispatch_send(const HtDispatchParams& p, uint32_t cur) {
  const int R = p.num_ranks, me = p.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  __shared__ int32_t s_excl[kMaxHtRanks];  // rows d receives from ranks before me
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  if (threadIdx.x < R) {
    s_excl[threadIdx.x] = prefix_before(p.rank_prefix_matrix, R, me, threadIdx.x);
    if (threadIdx.x != me && !wait_peer_ready(p.symm, w, threadIdx.x, cur)) s_ok = 0;
    else if (threadIdx.x != me && p.cached)
      store_call_word(g.callword(p.symm.peers[threadIdx.x]) + me, p.call_word);
  }
  __syncthreads();
  if (!s_ok) return;
  EPX_HT_STAMP(p, 0, kHtTrStart);

  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t G = static_cast<int64_t>(p.num_send_ctas) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kHtWarps + warp;
  const int meta_words = 1 + 2 * p.top_k;
  const int64_t batch = kDispatchBatch;
  // Zero-copy: the senders also place the rows this rank keeps (d == me; the receivers only wait).
  const bool with_me = p.zero_copy != 0;
  // Batches (of `batch` consecutive tokens): warp gw sends batch gw first, then draws its next
  // batches from state->send_next (counting from G), so every warp keeps sending until the last
  // batch is taken and the warps finish together — the fixed order (batches gw, gw + G, ...)
  // left warps idle for up to 40 % of the op while others still sent. The first
  // batch is fixed so that no warp waits on the counter at the start (2c71edf, 2026-11-30: drawing
  // every batch cost 2-5 us at T = 1024). Each warp draws when it starts a batch: the atomic's
  // latency overlaps the batch.
  const int64_t num_batches = (p.num_tokens + batch - 1) / batch;
  // (No draws where every batch is some warp's first: no tail to balance.)
  const bool dynamic = num_batches > G;
  auto draw = [&]() -> uint32_t {
    return lane == 0 && dynamic ? static_cast<uint32_t>(G) + atomicAdd(&w.state->send_next, 1u)
                                : 0u;
  };
  int64_t bi = gw;
  while (bi < num_batches) {
    const uint32_t ticket = draw();
    const int64_t t0 = bi * batch;
    const int64_t t_end = min(t0 + batch, static_cast<int64_t>(p.num_tokens));
    // pos of the next token is loaded while the current one is copied.
    const bool mine = lane < R && (lane != me || with_me);
    int32_t pos = mine ? p.send_pos[t0 * R + lane] : -1;
    // Scale words (fp8) likewise: the next token's are loaded while this one is copied.
    TokenScales sc{};
    if (p.num_scales > 0) sc = load_token_scales(p, t0, lane);
    for (int64_t t = t0; t < t_end; ++t) {
      const int32_t next = (t + 1 < t_end && mine) ? p.send_pos[(t + 1) * R + lane] : -1;
      TokenScales sc_next{};
      if (p.num_scales > 0 && t + 1 < t_end) sc_next = load_token_scales(p, t + 1, lane);
      // The token's routing, before its rows are copied (the loads overlap the copy).
      TokenMeta tm;
      if (!p.cached) tm = load_token_meta(p, t, lane);
      const uint32_t dmask = __ballot_sync(0xffffffffu, pos >= 0);
      const V* src = reinterpret_cast<const V*>(p.x + t * p.x_stride);
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int32_t row = __shfl_sync(0xffffffffu, pos, d);  // in d's recv_x
        if (d == me) {                                         // zero-copy only
          if (row < p.num_rows) dispatch_kept_row<V>(p, t, row, src, nv, lane, sc, tm);
          continue;
        }
        const int64_t j = row - s_excl[d];
        const int slot = HtRegion::slot_of(me, d);
        char* peer = p.symm.peers[d];
        // Zero-copy: the row and its scales go straight to their place in d's recv_x view.
        char* dst = p.zero_copy ? g.x_recv_row(peer, row, p.row_bytes) : g.x_row(peer, slot, j);
        copy_row<V, false>(src, reinterpret_cast<V*>(dst), nv, lane);
        // Scales and metadata: lanes write consecutive words (coalesced across NVLink).
        if (p.num_scales > 0)
          store_token_scales(
              p, t, sc,
              reinterpret_cast<uint32_t*>(p.zero_copy ? g.scale_recv_row(peer, row, p.num_scales)
                                                      : g.scale_row(peer, slot, j)),
              lane);
        if (!p.cached) {
          uint32_t* meta = reinterpret_cast<uint32_t*>(g.meta_row(peer, slot, j));
          for (int q0 = 0; q0 < meta_words; q0 += 32) {  // every lane: meta_word shuffles
            const uint32_t v = meta_word(p, tm, t, d, q0 + lane);
            if (q0 + lane < meta_words) meta[q0 + lane] = v;
          }
        }
      }
      pos = next;
      sc = sc_next;
    }
    // Signal the batch: this warp's stores above, then one release per (destination, block).
    // Pairs with the receiver's wait_flag on counter[slot me][block].
    __syncwarp();
    fence_acq_rel_sys();
    if (lane < R && lane != me) {
      int64_t block = -1;
      uint32_t rows = 0;
      for (int64_t t = t0; t < t_end; ++t) {
        const int32_t q = p.send_pos[t * R + lane];
        if (q < 0) continue;
        const int64_t b = (q - s_excl[lane]) / kHtRowsPerBlock;
        if (b != block && rows) {
          red_add_relaxed_sys(g.counter(p.symm.peers[lane], HtRegion::slot_of(me, lane), block),
                              rows);
          rows = 0;
        }
        block = b;
        ++rows;
      }
      if (rows)
        red_add_relaxed_sys(g.counter(p.symm.peers[lane], HtRegion::slot_of(me, lane), block),
                            rows);
    }
    bi = dynamic ? static_cast<int64_t>(__shfl_sync(0xffffffffu, ticket, 0)) : bi + G;
  }
}

// The rows this rank keeps: x[t] -> recv_x[send_pos[t][me]] (+ scales, src_idx, local ids).
template <typename V>
__device__ void dispatch_self(const HtDispatchParams& p) {
  const int R = p.num_ranks, me = p.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int recv0 = recv_cta0(p);
  const int64_t G = static_cast<int64_t>(static_cast<int>(gridDim.x) - recv0) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(static_cast<int>(blockIdx.x) - recv0) * kHtWarps + warp;
  for (int64_t t = gw; t < p.num_tokens; t += G) {
    const int32_t pos = p.send_pos[t * R + me];
    if (pos < 0 || pos >= p.num_rows) continue;  // past num_rows: worst-case overflow (reported)
    TokenScales sc{};
    if (p.num_scales > 0) sc = load_token_scales(p, t, lane);
    TokenMeta tm;
    if (!p.cached) tm = load_token_meta(p, t, lane);
    dispatch_kept_row<V>(p, t, pos, reinterpret_cast<const V*>(p.x + t * p.x_stride), nv, lane, sc,
                         tm);
  }
}

// A received block's routing metadata out of the slot: rows [j0, j0 + rows) of `slot` (output
// rows from out0 + j0) -> recv_src_idx, recv_topk_idx, recv_topk_weights. Every thread of the CTA
// takes words of the block's rows (1 + 2K each), kMetaLoads loads issued before any store, so a
// block costs one memory latency (row by row, a warp's rows paid one each).
inline constexpr int kMetaLoads = 4;
__device__ __forceinline__ void recv_block_meta(const HtDispatchParams& p, int slot, int64_t j0,
                                                int rows, int64_t out0) {
  const HtRegion& g = p.symm.region;
  const int K = p.top_k, mw = 1 + 2 * K;
  const int words = rows * mw;
  for (int i0 = 0; i0 < words; i0 += kHtThreads * kMetaLoads) {
    uint32_t v[kMetaLoads];
#pragma unroll
    for (int u = 0; u < kMetaLoads; ++u) {
      const int i = i0 + u * kHtThreads + static_cast<int>(threadIdx.x);
      if (i < words) {
        const int r = i / mw;
        v[u] = ld_landed(reinterpret_cast<const uint32_t*>(g.meta_row(p.symm.local, slot, j0 + r)) +
                         (i - r * mw));
      }
    }
#pragma unroll
    for (int u = 0; u < kMetaLoads; ++u) {
      const int i = i0 + u * kHtThreads + static_cast<int>(threadIdx.x);
      if (i >= words) continue;
      const int r = i / mw, q = i - r * mw;
      const int64_t out = out0 + j0 + r;
      if (out >= p.num_rows) continue;  // worst-case overflow, reported by the kernel
      if (q == 0) {
        p.recv_src_idx[out] = static_cast<int32_t>(v[u]);
      } else if (q <= K) {
        store_topk_idx(p.recv_topk_idx, p.topk_is_i64, out * K + q - 1, static_cast<int32_t>(v[u]));
      } else if (p.recv_topk_weights) {
        p.recv_topk_weights[out * K + q - 1 - K] = __uint_as_float(v[u]);
      }
    }
  }
}

// Receiver CTAs: first the rows this rank keeps (no waiting), then the rows from the peers as
// their 32-row blocks complete.
template <typename V>
__device__ void dispatch_receive(const HtDispatchParams& p) {
  // Zero-copy: the senders place the kept rows (R = 1: there are no senders).
  if (!EPX_HT_ABLATED(p.ablate, kAblateSelf) && (!p.zero_copy || p.num_send_ctas == 0))
    dispatch_self<V>(p);
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (R == 1) return;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  __shared__ int32_t s_cnt[kMaxHtRanks], s_excl[kMaxHtRanks];
  __shared__ int s_ok;
  if (threadIdx.x < R) {
    s_cnt[threadIdx.x] = rows_between(p.rank_prefix_matrix, R, threadIdx.x, me);
    s_excl[threadIdx.x] = prefix_before(p.rank_prefix_matrix, R, threadIdx.x, me);
  }
  __syncthreads();
  int64_t max_blocks = 0;
  for (int s = 0; s < R; ++s) {
    if (s != me)
      max_blocks =
          max(max_blocks, static_cast<int64_t>((s_cnt[s] + kHtRowsPerBlock - 1) / kHtRowsPerBlock));
  }
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int recv0 = recv_cta0(p);
  const int num_recv = static_cast<int>(gridDim.x) - recv0;
  const int64_t num_items = max_blocks * (R - 1);
  for (int64_t item = static_cast<int>(blockIdx.x) - recv0; item < num_items; item += num_recv) {
    const int64_t b = item / (R - 1);
    const int slot = static_cast<int>(item % (R - 1));
    const int s = slot < me ? slot : slot + 1;
    const int rows = min(static_cast<int64_t>(kHtRowsPerBlock), s_cnt[s] - b * kHtRowsPerBlock);
    if (rows <= 0) continue;
    if (threadIdx.x == 0) {
      s_ok = wait_flag<false>(g.counter(p.symm.local, slot, b), static_cast<uint32_t>(rows), w,
                              kWaitRows, s);
      if (s_ok && p.cached && b == 0)
        s_ok = call_word_matches(w, g.callword(p.symm.local) + s, p.call_word, s);
    }
    __syncthreads();
    if (!s_ok) return;
    for (int r = warp; r < rows && !EPX_HT_ABLATED(p.ablate, kAblateRemoteCopy); r += kHtWarps) {
      const int64_t j = b * kHtRowsPerBlock + r;
      const int64_t out = s_excl[s] + j;
      if (out >= p.num_rows) continue;  // worst-case overflow, reported by the kernel
      if (!p.zero_copy) {               // zero-copy: the row is already in place
        copy_row<V, true>(reinterpret_cast<const V*>(g.x_row(p.symm.local, slot, j)),
                          reinterpret_cast<V*>(p.recv_x + out * p.row_bytes), nv, lane);
      }
      const uint32_t* sc = reinterpret_cast<const uint32_t*>(g.scale_row(p.symm.local, slot, j));
      for (int q = lane; q < p.num_scales && !p.zero_copy; q += 32)  // zero-copy: in place
        p.recv_scales[out * p.num_scales + q] = ld_landed(sc + q);
    }
    if (!p.cached && !EPX_HT_ABLATED(p.ablate, kAblateRemoteCopy))
      recv_block_meta(p, slot, b * kHtRowsPerBlock, rows, s_excl[s]);
    __syncthreads();
  }
}

template <typename V>
__global__ void __launch_bounds__(kHtThreads, 1) ht_dispatch_kernel(HtDispatchParams p) {
  pdl_begin(p.pdl);
  const int cta = static_cast<int>(blockIdx.x);
  EPX_HT_STAMP(p, 0, kHtTrEntry);
  const uint32_t cur = p.wait.state->seq + 1;
  const int R = p.num_ranks, me = p.rank;
  if (cta == 0 && threadIdx.x == 0) publish_deferred_ready(p.symm, p.wait, R);
  if (cta < p.num_send_ctas) {
    dispatch_send<V>(p, cur);
    EPX_HT_STAMP(p, 0, kHtTrWork);
  }
  if (cta >= recv_cta0(p)) {
    dispatch_receive<V>(p);
    EPX_HT_STAMP(p, 0, kHtTrRecv);
  }
  // Worst-case mode: overflow report and padding rows [N, num_rows) (any CTA, grid-stride):
  // x and scales 0, topk -1, weights 0, src_idx -1 (as the cpu backend).
  const int64_t n = p.rank_prefix_matrix[(R - 1) * R + me];
  if (p.worst_case) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && n > p.num_rows)
      record_error(p.wait, kDevErrOutOfCapacity, -1, n, p.num_rows);
    const int64_t pad = p.num_rows - n;
    const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t gsize = static_cast<int64_t>(gridDim.x) * blockDim.x;
    if (pad > 0) {
      const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
      V* x0 = reinterpret_cast<V*>(p.recv_x + n * p.row_bytes);
      for (int64_t i = gtid; i < pad * nv; i += gsize) x0[i] = V{};
      for (int64_t i = gtid; i < pad * p.num_scales; i += gsize)
        p.recv_scales[n * p.num_scales + i] = 0u;
      if (!p.cached) {
        for (int64_t row = n + gtid; row < p.num_rows; row += gsize) {
          p.recv_src_idx[row] = -1;
          for (int k = 0; k < p.top_k; ++k) {
            store_topk_idx(p.recv_topk_idx, p.topk_is_i64, row * p.top_k + k, -1);
            if (p.recv_topk_weights) p.recv_topk_weights[row * p.top_k + k] = 0.0f;
          }
        }
      }
    }
  }
  EPX_HT_TRACE_SYNC();
  EPX_HT_STAMP(p, 0, kHtTrDone);
  finish_operation(
      p.symm, p.wait, cur, R,
      [&] {
        zero_block_counters(p.symm, p.rank_prefix_matrix, R, me, /*rows_went_out=*/false);
        if (threadIdx.x == 0) p.wait.state->send_next = 0u;  // every sender warp has finished
      },
      p.zero_copy ? kReadyDeferred : kReadyNow);
  EPX_HT_STAMP(p, 0, kHtTrExit);
}

}  // namespace epx::detail
