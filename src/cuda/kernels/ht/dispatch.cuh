// src/cuda/kernels/ht/dispatch.cuh — ht dispatch: rows to the ranks that hold their experts.
//
// Grid: num_send_ctas sender CTAs, then receiver CTAs; 512 threads each. (R = 1: receivers only.)
// Zero-copy (R > 1): every CTA sends, then every CTA receives (recv_cta0 = 0).
// Sender warps (rank r, warp gw of G) push rows to the OTHER ranks: batches of send_batch (4)
//   consecutive tokens, batch gw first, then each warp drawing its next batch from a per-rank
//   counter (state->send_next), so the warps advance through the tokens together, the receivers'
//   32-row blocks fill roughly in order, and no warp idles while batches are left
//   (kHtSendStatic, the A/B: batches i*G + gw to warp gw). Token t goes to
//   every d != r with pos = send_pos[t][d] >= 0: row j = pos - rpm[r-1][d] of d's slot for r
//   (x, scales, meta) through the LSA pointer; after the batch: fence, then
//   counter[d's slot for r][j / 32] += rows.
// Receiver CTAs (rank r): first the rows r keeps, x[t] -> recv_*[send_pos[t][r]] (no waiting;
//   this overlaps the peers' pushes), then items (32-row block b, source s != r), block-major:
//   one thread waits until counter[slot s][b] == rows in that block, then the CTA copies the
//   rows to recv_*[rpm[s-1][r] + j] (a warp per row), then the block's metadata with every
//   thread at once (recv_block_meta): SPEC 3.2's order (source rank, then source token).
// Worst-case mode: rows >= num_rows are never written; N > num_rows is reported
//   (OutOfCapacity); rows [N, num_rows) get topk -1, weight 0, src_idx -1.
// End: the last CTA zeroes the counters it consumed and signals ready (finish_operation).
// Copy engines (host-selected, ht.cu): engine_kept — the kept rows' x is copied by the copy
//   engines, dispatch_self moves only scales and metadata; engine_x — no x row moves here at all
//   and the ready signal is left to ht_engine_sync.
// Zero-copy (host-selected, kWarp only): recv_x and recv_scales are views of this rank's region
//   (x_recv_row, scale_recv_row); senders store each row and its scales at send_pos in the
//   receiver's region and also place the rows their rank keeps (dispatch_kept_row); receivers
//   wait for the blocks and copy only the metadata out (not cached); the ready signal is
//   deferred to the rank's next op (finish_operation).
// Split exact dispatch (host-selected, opt-in kHtSplitSend): the sender CTAs [0, num_send_ctas)
//   as one kernel on a side stream, launched before the host's wait for the count exchange, the
//   receivers as a second one (cta_offset = num_send_ctas) after it; op_cta / op_ctas number the
//   CTAs of both.
// Copy path (kBulk, host-selected by HtCopyMode): x rows move through the bulk-copy engine
//   (bulk_copy.cuh: lane 0 of each warp drives its pipeline, the other lanes move scales and
//   metadata with ordinary stores); otherwise through copy_row (16-byte vectors per lane).
#pragma once

#include "cuda/kernels/ht/bulk_copy.cuh"
#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

inline constexpr int kDispatchBatch = 4;  // default tokens per warp between two signals

// This CTA's index in the op and the op's CTAs (the split dispatch's two kernels count as one
// grid: the receive kernel's CTAs follow the send kernel's).
__device__ __forceinline__ int op_cta(const HtDispatchParams& p) {
  return static_cast<int>(blockIdx.x) + p.cta_offset;
}
__device__ __forceinline__ int op_ctas(const HtDispatchParams& p) {
  return p.op_ctas > 0 ? p.op_ctas : static_cast<int>(gridDim.x);
}

__device__ __forceinline__ void store_topk_idx(void* out, int is_i64, int64_t i, int32_t v) {
  if (is_i64) {
    static_cast<int64_t*>(out)[i] = v;
  } else {
    static_cast<int32_t*>(out)[i] = v;
  }
}

// Word i of a dispatch meta row for destination d: {src_idx, local idx [K], weight [K]}, loaded
// where it is needed (the weight after the id) — the A/B path (kHtKeptMetaLate) only.
__device__ __forceinline__ uint32_t dispatch_meta_word(const HtDispatchParams& p, int64_t t, int d,
                                                       int i) {
  if (i == 0) return static_cast<uint32_t>(t);
  const int K = p.top_k, L = p.num_local_experts;
  const int k = i <= K ? i - 1 : i - 1 - K;
  const int64_t e = ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, k);
  const bool local = e >= static_cast<int64_t>(d) * L && e < static_cast<int64_t>(d + 1) * L;
  if (i <= K) return static_cast<uint32_t>(local ? static_cast<int32_t>(e - d * L) : -1);
  const float w = (local && p.topk_weights)
                      ? p.topk_weights[t * p.weights_stride + k * p.weights_stride1]
                      : 0.0f;
  return __float_as_uint(w);
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
// Whether a dispatch forms its routing metadata from registers (not cached; not the A/B).
__device__ __forceinline__ bool meta_in_regs(const HtDispatchParams& p) {
  return !p.cached && !(p.ablate & kHtKeptMetaLate);
}
// Word q of token t's meta row for destination d, from `m` (as dispatch_meta_word; 0 for
// q >= 1 + 2K). Every lane of the warp must call it (shuffles).
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
  return p.zero_copy && p.num_send_ctas == op_ctas(p) ? 0 : p.num_send_ctas;
}

// One row this rank keeps, x[t] -> recv_*[pos] (+ scales, src_idx, local ids); the x row when
// copy_x (false: a bulk copy moves it) unless the copy engines copy the kept rows (engine_kept)
// or move every row (engine_x).
// `sc`: token t's scale words (load_token_scales), `m` its routing (load_token_meta; unused under
// kHtKeptMetaLate), loaded by the caller.
template <typename V>
__device__ __forceinline__ void dispatch_kept_row(const HtDispatchParams& p, int64_t t, int64_t pos,
                                                  const V* src, int64_t nv, int lane, bool copy_x,
                                                  const TokenScales& sc, const TokenMeta& m) {
  if (copy_x && !p.engine_x && !p.engine_kept)
    copy_row<V, false>(src, reinterpret_cast<V*>(p.recv_x + pos * p.row_bytes), nv, lane);
  if (p.num_scales > 0)
    store_token_scales(p, t, sc, p.recv_scales + pos * static_cast<int64_t>(p.num_scales), lane);
  if (!p.cached) {
    if (lane == 0) p.recv_src_idx[pos] = static_cast<int32_t>(t);
    const int K = p.top_k, L = p.num_local_experts, me = p.rank;
    if (p.ablate & kHtKeptMetaLate) {  // the A/B: loaded here, the weight after the id
      for (int k = lane; k < K; k += 32) {
        const int64_t o = pos * static_cast<int64_t>(K) + k;
        store_topk_idx(p.recv_topk_idx, p.topk_is_i64, o,
                       static_cast<int32_t>(dispatch_meta_word(p, t, me, 1 + k)));
        if (p.recv_topk_weights)
          p.recv_topk_weights[o] = __uint_as_float(dispatch_meta_word(p, t, me, 1 + K + k));
      }
    } else if (lane < K) {
      const int64_t o = pos * static_cast<int64_t>(K) + lane;
      const bool local = m.e >= me * L && m.e < (me + 1) * L;
      store_topk_idx(p.recv_topk_idx, p.topk_is_i64, o, local ? m.e - me * L : -1);
      if (p.recv_topk_weights) p.recv_topk_weights[o] = local ? m.w : 0.0f;
    }
  }
}

// Sender warps push this rank's rows to the OTHER ranks (the receiver CTAs copy the rows this
// rank keeps, except under zero-copy, where the senders place them too).
template <typename V, bool kBulk>
__device__ void dispatch_send(const HtDispatchParams& p, uint32_t cur, BulkPipe& pipe) {
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
  }
  __syncthreads();
  if (!s_ok) return;
  EPX_HT_STAMP(p, 0, kHtTrStart);
  // Every peer finished reading its slots (acquired above); our bulk stores into them are
  // async-proxy writes, ordered after that acquire by a proxy fence.
  if constexpr (kBulk) {
    if (lane == 0) fence_proxy_async();
  }

  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t G = static_cast<int64_t>(p.num_send_ctas) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(op_cta(p)) * kHtWarps + warp;
  const int meta_words = 1 + 2 * p.top_k;
  // Routing metadata from registers (load_token_meta), unless cached or the A/B.
  const bool meta_regs = meta_in_regs(p);
  const int64_t batch = p.send_batch > 0 ? p.send_batch : kDispatchBatch;
  // Zero-copy: the senders also place the rows this rank keeps (d == me; the receivers only wait).
  const bool with_me = p.zero_copy != 0;
  // Batches (of `batch` consecutive tokens): warp gw sends batch gw first, then draws its next
  // batches from state->send_next (counting from G), so every warp keeps sending until the last
  // batch is taken and the warps finish together — the fixed order (kHtSendStatic: batches gw,
  // gw + G, ...) left warps idle for up to 40 % of the op while others still sent. The first
  // batch is fixed so that no warp waits on the counter at the start (eighth session: drawing
  // every batch cost 2-5 us at T = 1024). Each warp draws when it starts a batch: the atomic's
  // latency overlaps the batch.
  const int64_t num_batches = (p.num_tokens + batch - 1) / batch;
  // (No draws where every batch is some warp's first: no tail to balance.)
  const bool dynamic = !(p.ablate & kHtSendStatic) && num_batches > G;
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
      if (meta_regs) tm = load_token_meta(p, t, lane);
      const uint32_t dmask = __ballot_sync(0xffffffffu, pos >= 0);
      const V* src = reinterpret_cast<const V*>(p.x + t * p.x_stride);
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int32_t row = __shfl_sync(0xffffffffu, pos, d);  // in d's recv_x
        if (d == me) {                                         // zero-copy only
          if (row < p.num_rows) dispatch_kept_row<V>(p, t, row, src, nv, lane, true, sc, tm);
          continue;
        }
        const int64_t j = row - s_excl[d];
        const int slot = HtRegion::slot_of(me, d);
        char* peer = p.symm.peers[d];
        // Zero-copy: the row and its scales go straight to their place in d's recv_x view.
        char* dst = p.zero_copy ? g.x_recv_row(peer, row, p.row_bytes) : g.x_row(peer, slot, j);
        if constexpr (kBulk) {
          if (lane == 0) pipe.copy(p.x + t * p.x_stride, dst, p.row_bytes, p.wait);
        } else {
          if (!p.engine_x) copy_row<V, false>(src, reinterpret_cast<V*>(dst), nv, lane);
        }
        // Scales and metadata: lanes write consecutive words (coalesced across NVLink).
        if (p.num_scales > 0)
          store_token_scales(
              p, t, sc,
              reinterpret_cast<uint32_t*>(p.zero_copy ? g.scale_recv_row(peer, row, p.num_scales)
                                                      : g.scale_row(peer, slot, j)),
              lane);
        if (meta_regs) {
          uint32_t* meta = reinterpret_cast<uint32_t*>(g.meta_row(peer, slot, j));
          for (int q0 = 0; q0 < meta_words; q0 += 32) {  // every lane: meta_word shuffles
            const uint32_t v = meta_word(p, tm, t, d, q0 + lane);
            if (q0 + lane < meta_words) meta[q0 + lane] = v;
          }
        } else if (!p.cached) {  // the A/B (kHtKeptMetaLate): loaded here, per word
          uint32_t* meta = reinterpret_cast<uint32_t*>(g.meta_row(peer, slot, j));
          for (int q = lane; q < meta_words; q += 32) meta[q] = dispatch_meta_word(p, t, d, q);
        }
      }
      pos = next;
      sc = sc_next;
    }
    // Signal the batch: this warp's stores above, then one release per (destination, block).
    // Pairs with the receiver's wait_flag on counter[slot me][block].
    if constexpr (kBulk) {
      // Lane 0's bulk row stores are async-proxy writes: complete them (wait_group 0 in drain;
      // .read would not do), order them before lane 0's generic operations (fence.proxy.async),
      // then the __syncwarp + fence.acq_rel.sys + red.add below release them with the lanes'
      // scale and metadata stores (the fence is cumulative over what lane 0 observed).
      if (lane == 0) {
        pipe.drain(p.wait);
        fence_proxy_async();
      }
    }
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
template <typename V, bool kBulk>
__device__ void dispatch_self(const HtDispatchParams& p, BulkPipe& pipe) {
  const int R = p.num_ranks, me = p.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nv = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int recv0 = recv_cta0(p);
  const int64_t G = static_cast<int64_t>(op_ctas(p) - recv0) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(op_cta(p) - recv0) * kHtWarps + warp;
  for (int64_t t = gw; t < p.num_tokens; t += G) {
    const int32_t pos = p.send_pos[t * R + me];
    if (pos < 0 || pos >= p.num_rows) continue;  // past num_rows: worst-case overflow (reported)
    if constexpr (kBulk) {
      if (lane == 0)
        pipe.copy(p.x + t * p.x_stride, p.recv_x + pos * p.row_bytes, p.row_bytes, p.wait);
    }
    TokenScales sc{};
    if (p.num_scales > 0) sc = load_token_scales(p, t, lane);
    TokenMeta tm;
    if (meta_in_regs(p)) tm = load_token_meta(p, t, lane);
    dispatch_kept_row<V>(p, t, pos, reinterpret_cast<const V*>(p.x + t * p.x_stride), nv, lane,
                         !kBulk, sc, tm);
  }
  if constexpr (kBulk) {
    if (lane == 0) pipe.flush(p.wait);  // stores under way before the receive loop may wait
  }
}

// A received block's routing metadata out of the slot: rows [j0, j0 + rows) of `slot` (output
// rows from out0 + j0) -> recv_src_idx, recv_topk_idx, recv_topk_weights. Every thread of the CTA
// takes words of the block's rows (1 + 2K each), kMetaLoads loads issued before any store, so a
// block costs one memory latency (row by row, a warp's rows paid one each: kHtRecvMetaRows).
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
template <typename V, bool kBulk>
__device__ void dispatch_receive(const HtDispatchParams& p, BulkPipe& pipe) {
  // Zero-copy: the senders place the kept rows (R = 1: there are no senders).
  if (!(p.ablate & kAblateSelf) && (!p.zero_copy || p.num_send_ctas == 0))
    dispatch_self<V, kBulk>(p, pipe);
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
  const int num_recv = op_ctas(p) - recv0;
  const int64_t num_items = max_blocks * (R - 1);
  for (int64_t item = op_cta(p) - recv0; item < num_items; item += num_recv) {
    const int64_t b = item / (R - 1);
    const int slot = static_cast<int>(item % (R - 1));
    const int s = slot < me ? slot : slot + 1;
    const int rows = min(static_cast<int64_t>(kHtRowsPerBlock), s_cnt[s] - b * kHtRowsPerBlock);
    if (rows <= 0) continue;
    if (threadIdx.x == 0) {
      s_ok = wait_flag<false>(g.counter(p.symm.local, slot, b), static_cast<uint32_t>(rows), w,
                              kWaitRows, s);
    }
    __syncthreads();
    if (!s_ok) return;
    // The block's rows were acquired by thread 0 (ld.acquire.sys) and reach this thread through
    // __syncthreads; bulk loads read them through the async proxy, so lane 0 fences first.
    if constexpr (kBulk) {
      if (lane == 0) fence_proxy_async();
    }
    for (int r = warp; r < rows && !(p.ablate & kAblateRemoteCopy); r += kHtWarps) {
      const int64_t j = b * kHtRowsPerBlock + r;
      const int64_t out = s_excl[s] + j;
      if (out >= p.num_rows) continue;  // worst-case overflow, reported by the kernel
      if constexpr (kBulk) {
        if (lane == 0)
          pipe.copy(g.x_row(p.symm.local, slot, j), p.recv_x + out * p.row_bytes, p.row_bytes,
                    p.wait);
      } else if (!p.engine_x && !p.zero_copy) {  // zero-copy: the row is already in place
        copy_row<V, true>(reinterpret_cast<const V*>(g.x_row(p.symm.local, slot, j)),
                          reinterpret_cast<V*>(p.recv_x + out * p.row_bytes), nv, lane);
      }
      const uint32_t* sc = reinterpret_cast<const uint32_t*>(g.scale_row(p.symm.local, slot, j));
      for (int q = lane; q < p.num_scales && !p.zero_copy; q += 32)  // zero-copy: in place
        p.recv_scales[out * p.num_scales + q] = ld_landed(sc + q);
      if (!p.cached && (p.ablate & kHtRecvMetaRows)) {  // the A/B: row by row
        const uint32_t* meta = reinterpret_cast<const uint32_t*>(g.meta_row(p.symm.local, slot, j));
        if (lane == 0) p.recv_src_idx[out] = static_cast<int32_t>(ld_landed(meta));
        for (int k = lane; k < p.top_k; k += 32) {
          const int64_t o = out * p.top_k + k;
          store_topk_idx(p.recv_topk_idx, p.topk_is_i64, o,
                         static_cast<int32_t>(ld_landed(meta + 1 + k)));
          if (p.recv_topk_weights)
            p.recv_topk_weights[o] = __uint_as_float(ld_landed(meta + 1 + p.top_k + k));
        }
      }
    }
    if (!p.cached && !(p.ablate & (kHtRecvMetaRows | kAblateRemoteCopy)))
      recv_block_meta(p, slot, b * kHtRowsPerBlock, rows, s_excl[s]);
    // Start this item's stores before thread 0 may wait for the next block.
    if constexpr (kBulk) {
      if (lane == 0) pipe.flush(p.wait);
    }
    __syncthreads();
  }
}

template <typename V, bool kBulk>
__global__ void __launch_bounds__(kHtThreads, 1) ht_dispatch_kernel(HtDispatchParams p) {
  pdl_begin(p.pdl);
  const int cta = op_cta(p);
  EPX_HT_STAMP_CTA(p, 0, kHtTrEntry, cta);
  const uint32_t cur = p.wait.state->seq + 1;
  const int R = p.num_ranks, me = p.rank;
  if (cta == 0 && threadIdx.x == 0) publish_deferred_ready(p.symm, p.wait, R);
  BulkPipe pipe;
  if constexpr (kBulk) {
    if ((threadIdx.x & 31) == 0) pipe.init(threadIdx.x >> 5, p.bulk_stages, p.bulk_chunk);
  }
  if (cta < p.num_send_ctas) {
    dispatch_send<V, kBulk>(p, cur, pipe);
    EPX_HT_STAMP_CTA(p, 0, kHtTrWork, cta);
  }
  if (cta >= recv_cta0(p)) {
    dispatch_receive<V, kBulk>(p, pipe);
    EPX_HT_STAMP_CTA(p, 0, kHtTrRecv, cta);
  }
  // Every bulk copy of this warp complete (also on the early-return paths) before the padding
  // rows, the counter reset and the ready signal that lets the peers overwrite our region.
  // The proxy fence orders the drained async-proxy accesses before finish_operation's release.
  if constexpr (kBulk) {
    if ((threadIdx.x & 31) == 0) {
      pipe.drain(p.wait);
      fence_proxy_async();
    }
  }
  // Worst-case mode: overflow report and padding rows [N, num_rows) (any CTA, grid-stride):
  // x and scales 0, topk -1, weights 0, src_idx -1 (as the cpu backend).
  const int64_t n = p.rank_prefix_matrix[(R - 1) * R + me];
  if (p.worst_case) {  // (never split: one kernel)
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
  EPX_HT_STAMP_CTA(p, 0, kHtTrDone, cta);
  finish_operation(
      p.symm, p.wait, cur, R,
      [&] {
        zero_block_counters(p.symm, p.rank_prefix_matrix, R, me, /*rows_went_out=*/false);
        if (threadIdx.x == 0) p.wait.state->send_next = 0u;  // every sender warp has finished
      },
      p.engine_x    ? kReadyLater
      : p.zero_copy ? kReadyDeferred
                    : kReadyNow,
      /*wait_peers=*/false, op_ctas(p));
  // (The split's two kernels end independently; the host joins the send kernel's stream after
  // the receive kernel, so later work on the caller's stream follows both.)
  EPX_HT_STAMP_CTA(p, 0, kHtTrExit, cta);
}

}  // namespace epx::detail
