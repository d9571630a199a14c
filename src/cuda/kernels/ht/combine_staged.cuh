// src/cuda/kernels/ht/combine_staged.cuh — the zero-copy (pull) combine's staged reducer: row
// sources loaded by the bulk-copy engine (cp.async.bulk, 1-D TMA) into shared memory, several
// chunks ahead, instead of into registers (2026-11-30, 16 SMs, T = 4096: 250 -> 195 us).
//
// Why: the register reducer (reduce_row_pair) keeps at most 7 vectors per source per lane in
// flight and waits for each step's round trip; at 16 SMs the pull combine is bound by those
// round trips. A bulk load needs no registers, so the bytes in flight per SM are
// bounded by shared memory (~200 KB) instead, and the loads of the next chunks (also across
// tokens) stay in flight while a chunk is reduced.
//
// Used for the zero-copy combine when every token has at most two row sources (R + biases <= 2:
// EP2 without biases), every row address and size is a multiple of 16 bytes, sm_90+, and the
// grid has at most kHtPullStaging.max_sms CTAs (cuda/tuning.h). Outputs are the same as every
// other reducer's: per element acc = 0.0f; acc += source 0; acc += source 1 (bias0, bias1, then
// y_d for d ascending); out = bf16(acc); combined_topk_weights[t][k] = 0.0f + w_d[k] for d
// ascending.
//
// Per warp (tokens t = global warp, + number of warps, ...): a ring of S stages, each holding
// chunk [off, off + C) of a token's two row sources, an mbarrier and the chunk's descriptor. The
// warp runs ahead: before reducing a stage it fills every free stage with the next chunks
// (lane 0: mbarrier.arrive.expect_tx + one cp.async.bulk per source), setting up the next token
// (its send_pos, prefetched one token earlier; the peer's yready; the source addresses) when it
// reaches it. Weights: the setup issues the loads of the token's weights, the next setup (or the
// end) adds and stores them, so their latency overlaps a whole token.
//
// Memory ordering: the peer's y (generic-proxy writes before its combine) is acquired by a
// lane's ld.acquire.sys of yready; __syncwarp; lane 0 fence.proxy.async; only then bulk loads of
// that peer's rows. A stage is refilled only after every lane read it (__syncwarp) and lane 0
// executed fence.proxy.async.shared::cta (generic reads before the async-proxy write). Every
// issued load is waited for before the warp leaves, also after a failed yready wait, so no bulk
// load writes shared memory after the CTA ends, and none reads a peer's y after this rank's end
// barrier — except when that wait itself times out (a load that never lands: the op has failed
// and is reported; each remaining stage then waits out its own timeout).
// kAblateReduce (diagnostics builds) skips only the adds and stores: the loads still run.
#pragma once

#include "cuda/kernels/ht/bulk_copy.cuh"
#include "cuda/kernels/ht/combine.cuh"

namespace epx::detail {

// Per stage after the data: mbarrier (8) + descriptor (token, sources, offset, bytes: 24).
inline constexpr int kPullStageMetaBytes = 32;

// Dynamic shared memory of one staged-reducer CTA: per warp S stages of two C-byte chunks.
EPX_HT_HD int pull_smem_bytes(int stages, int chunk) {
  return kHtWarps * stages * (2 * chunk + kPullStageMetaBytes);
}

struct PullStageDesc {
  int64_t t;       // token
  int32_t num_rs;  // row sources loaded (0..2)
  int32_t off;     // byte offset of the chunk in the row
  int32_t bytes;   // bytes of the chunk (a multiple of 16)
  int32_t pad;
};

__device__ void combine_reduce_staged(const HtCombineParams& p, uint32_t cur) {
  using V = uint4;
  const int R = p.num_ranks, me = p.rank, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const HtRegion& g = p.symm.region;
  const WaitContext& w = p.wait;
  const int S = p.pull_stages, C = p.pull_chunk;
  unsigned char* data = ht_dyn_smem + static_cast<size_t>(warp) * S * 2 * C;
  unsigned char* meta = ht_dyn_smem + static_cast<size_t>(kHtWarps) * S * 2 * C +
                        static_cast<size_t>(warp) * S * kPullStageMetaBytes;
  auto bar = [&](int s) { return smem_u32(meta + s * kPullStageMetaBytes); };
  auto desc = [&](int s) {
    return reinterpret_cast<PullStageDesc*>(meta + s * kPullStageMetaBytes + 8);
  };
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar(s));
    fence_mbar_init();
  }
  __syncwarp();

  const int64_t T = p.num_tokens, G = static_cast<int64_t>(gridDim.x) * kHtWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kHtWarps + warp;
  const int64_t row_bytes = p.row_bytes;
  const bool wfast = p.combined_weights && p.top_k <= 32;

  bool seen = false;  // lane d (a peer): d's yready acquired
  int32_t pos_next = lane < R && gw < T ? p.send_pos[gw * R + lane] : -1;
  // The token being issued: its sources and the next chunk.
  int64_t t_issue = gw;
  bool have = false;
  int c_off = 0, num_rs = 0;
  const char* rs0 = nullptr;
  const char* rs1 = nullptr;
  // Weights of the last token set up, stored by the next setup or at the end.
  bool wpend = false;
  int64_t wt = 0;
  int wn = 0;
  float w0 = 0.0f, w1 = 0.0f;
  const float* wp0 = nullptr;  // the slow path (top_k > 32): the sources' weight rows
  const float* wp1 = nullptr;
  bool ws0 = false, ws1 = false;  // source q is this rank (read-only input) for the slow path
  auto flush_weights = [&]() {
    if (!wpend) return;
    wpend = false;
    if (wfast) {
      if (lane < p.top_k)
        p.combined_weights[wt * p.top_k + lane] = combined_weight_pair(wn, w0, w1);
      return;
    }
    for (int k = lane; k < p.top_k; k += 32) {
      const float a0 = wn > 0 ? (ws0 ? ld_input(wp0 + k) : ld_landed(wp0 + k)) : 0.0f;
      const float a1 = wn > 1 ? (ws1 ? ld_input(wp1 + k) : ld_landed(wp1 + k)) : 0.0f;
      p.combined_weights[wt * p.top_k + k] = combined_weight_pair(wn, a0, a1);
    }
  };
  // Sets up token t_issue (all lanes); false on a failed wait (reported).
  auto setup = [&]() -> bool {
    int32_t pos = pos_next;
    const int64_t next = t_issue + G;
    pos_next = lane < R && next < T ? p.send_pos[next * R + lane] : -1;
    bool use = pos >= 0, ok = true, acquired = false;
    if (use && lane != me && !seen) {
      ok = wait_flag<true>(g.yready(p.symm.local) + lane, cur, w, kWaitRows, lane) &&
           call_word_matches(w, g.callword(p.symm.peers[lane]) + lane, p.call_word, lane);
      seen = acquired = true;
    }
    if (!__all_sync(0xffffffffu, ok)) return false;
    // A peer's y just acquired (by its lane): ordered before lane 0's bulk loads of it.
    const bool fence = __any_sync(0xffffffffu, acquired);
    __syncwarp();
    if (fence && lane == 0) fence_proxy_async();
    if (use && lane == me && pos >= p.num_y_rows) use = false;  // worst-case overflow
    const uint32_t smask = __ballot_sync(0xffffffffu, use);
    const char* row = nullptr;
    const float* wrow = nullptr;
    if (use) {
      if (lane == me) {
        row = p.y + pos * p.y_stride;
        wrow = p.weights ? p.weights + pos * p.weights_stride : nullptr;
      } else {
        row = g.combine_y_row(p.symm.peers[lane], pos, row_bytes);
        wrow = g.combine_w_row(p.symm.peers[lane], pos);
      }
    }
    const int num_src = __popc(smask);
    const int f0 = smask ? __ffs(smask) - 1 : 0;
    const uint32_t rest = smask & (smask - 1u);
    const int f1 = rest ? __ffs(rest) - 1 : 0;
    const char* y0 = reinterpret_cast<const char*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), f0));
    const char* y1 = reinterpret_cast<const char*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), f1));
    // Row sources in accumulation order: bias0, bias1, then y_d for d ascending (<= 2 in all).
    num_rs = 0;
    rs0 = rs1 = nullptr;
    auto add = [&](const char* r) {  // the host guarantees at most two
      if (num_rs == 0)
        rs0 = r;
      else
        rs1 = r;
      num_rs = min(num_rs + 1, 2);
    };
    if (p.bias0) add(p.bias0 + t_issue * p.bias0_stride);
    if (p.bias1) add(p.bias1 + t_issue * p.bias1_stride);
    if (num_src > 0) add(y0);
    if (num_src > 1) add(y1);
    // The weights: the previous token's are stored, this token's loads issued.
    flush_weights();
    if (p.combined_weights) {
      wpend = true;
      wt = t_issue;
      wn = num_src;
      wp0 = reinterpret_cast<const float*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(wrow), f0));
      wp1 = reinterpret_cast<const float*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(wrow), f1));
      ws0 = f0 == me;
      ws1 = f1 == me;
      if (wfast && lane < p.top_k) {
        if (num_src > 0) w0 = ws0 ? ld_input(wp0 + lane) : ld_landed(wp0 + lane);
        if (num_src > 1) w1 = ws1 ? ld_input(wp1 + lane) : ld_landed(wp1 + lane);
      }
    }
    c_off = 0;
    have = true;
    return true;
  };

  int head = 0, tail = 0, pending = 0;
  uint32_t phase = 0;  // bit s: parity of stage s's next completion
  bool ok = true;
  for (;;) {
    // Fill every free stage with the next chunks.
    while (ok && pending < S) {
      if (!have) {
        if (t_issue >= T) break;
        if (!setup()) {
          ok = false;
          break;
        }
        if (t_issue == gw) EPX_HT_STAMP(p, 1, kHtTrStart);  // the warp's first token
      }
      const int bytes = static_cast<int>(min(static_cast<int64_t>(C), row_bytes - c_off));
      if (lane == 0) {
        PullStageDesc* d = desc(head);
        d->t = t_issue;
        d->num_rs = num_rs;
        d->off = c_off;
        d->bytes = bytes;
        const uint32_t b = bar(head);
        mbar_arrive_expect_tx(b, static_cast<uint32_t>(num_rs * bytes));
        const uint32_t st = smem_u32(data + static_cast<size_t>(head) * 2 * C);
        if (num_rs > 0) bulk_load(st, rs0 + c_off, static_cast<uint32_t>(bytes), b);
        if (num_rs > 1) bulk_load(st + C, rs1 + c_off, static_cast<uint32_t>(bytes), b);
      }
      head = head + 1 == S ? 0 : head + 1;
      ++pending;
      c_off += bytes;
      if (c_off >= row_bytes) {
        have = false;
        t_issue += G;
      }
    }
    if (pending == 0) break;
    // Reduce the oldest stage (or, after a failed wait, only let its loads land).
    // (Uniform: a lane's timeout stops the whole warp.)
    if (!__all_sync(0xffffffffu, mbar_wait(bar(tail), (phase >> tail) & 1u, w))) ok = false;
    phase ^= 1u << tail;
    if (ok && !EPX_HT_ABLATED(p.ablate, kAblateReduce)) {
      const PullStageDesc d = *desc(tail);
      const V* a = reinterpret_cast<const V*>(data + static_cast<size_t>(tail) * 2 * C);
      const V* b = a + C / static_cast<int>(sizeof(V));
      V* o = reinterpret_cast<V*>(p.out + d.t * row_bytes + d.off);
      const int nv = d.bytes / static_cast<int>(sizeof(V));
#pragma unroll 4
      for (int i = lane; i < nv; i += 32) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
        if (d.num_rs > 0) accumulate(acc, a[i]);
        if (d.num_rs > 1) accumulate(acc, b[i]);
        o[i] = round_to_bf16<V>(acc);
      }
    }
    __syncwarp();
    if (lane == 0) fence_proxy_async_smem();  // the lanes' reads before the stage's refill
    tail = tail + 1 == S ? 0 : tail + 1;
    --pending;
  }
  if (ok) flush_weights();
  EPX_HT_STAMP(p, 1, kHtTrWork);
}

// The zero-copy combine with the staged reducer (every CTA reduces; no senders). Dynamic shared
// memory: pull_smem_bytes(p.pull_stages, p.pull_chunk).
__global__ void __launch_bounds__(kHtThreads, 1) ht_combine_staged_kernel(HtCombineParams p) {
  pdl_begin(p.pdl);
  EPX_HT_STAMP(p, 1, kHtTrEntry);
  const uint32_t cur = p.wait.state->seq + 1;
  const int R = p.num_ranks, me = p.rank;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    publish_deferred_ready(p.symm, p.wait, R);
    *reinterpret_cast<volatile uint32_t*>(p.symm.region.callword(p.symm.local) + me) = p.call_word;
    __threadfence_system();  // this rank's y (written before this kernel) may be read
    signal_peers(p.symm, &HtRegion::yready, R, me, cur);
  }
  combine_reduce_staged(p, cur);
  EPX_HT_TRACE_SYNC();
  EPX_HT_STAMP(p, 1, kHtTrDone);
  // No per-block counters in the pull protocol: nothing to reset. The end barrier: the peers
  // finished reading this rank's y when the kernel ends.
  finish_operation(
      p.symm, p.wait, cur, R, [] {}, kReadyNow, /*wait_peers=*/true);
  EPX_HT_STAMP(p, 1, kHtTrExit);
}

}  // namespace epx::detail
