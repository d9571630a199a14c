// src/cuda/kernels/ht/ht_region.cuh — the ht symmetric buffer: one struct, used on the host to
// size the allocation (cuda_ht_bytes) and in the kernels to find every field. Host + device.
//
// Per rank (offsets identical on every rank; R ranks, L = E / R, K, H, T_max = max tokens):
//   state    DeviceState                          local only: op sequence, last-CTA count, abort
//   ready    uint32 [kMaxHtRanks]                 ready[p] = last op rank p finished (p writes)
//   arrived  uint32 [kMaxHtRanks]                 arrived[p] = op * kHtEngineChunks + chunk of
//                                                 the last copy-engine combine chunk rank p
//                                                 finished pushing here (p writes)
//   yready   uint32 [kMaxHtRanks]                 yready[p] = last zero-copy combine whose y rank
//                                                 p wrote (p writes, at the combine's start)
//   callword uint32 [kMaxHtRanks]                 cached dispatch / combine: the per-call format
//                                                 word (ht_call_format) of source p's call, p
//                                                 writes it before its rows' signals (push: into
//                                                 the receiver's [p] after its ready; zero-copy
//                                                 combine: into its own [p] before yready); the
//                                                 receiver compares it with its own on arrival
//   counts   [R] x HtCountMsg                     count exchange: slot s written by rank s
//                                                 {flag, per-call values [3], tokens per rank [R],
//                                                  tokens per expert of this rank's experts [L]}
//   counters uint32 [R-1][num_blocks]             rows landed per 32-row block, per source slot
//   x        [R][T_max][x_row_bytes]              row payloads (bf16/fp8 dispatch, bf16 combine):
//                                                 slots [R-1][T_max][x_row_bytes]; zero-copy
//                                                 dispatch: the received rows [N][row_bytes]
//                                                 packed in recv_x order (x_recv_row; N <= R T_max)
//   scales   [R][T_max][scale_row_bytes]          fp8 scales moved with their rows: slots, or the
//                                                 zero-copy recv_x_scales [N][S] (scale_recv_row)
//   meta     [R-1][T_max][meta_row_bytes]         dispatch: {src_idx, local topk idx [K],
//                                                  weights [K]}; combine: weights [K]
//   yw       [R][T_max][K] float                  zero-copy combine: this rank's y weights
// Zero-copy combine: y [rows][H] bf16 packed in the x area (combine_y_row), read by the peers.
// A sender s writes into receiver d's "source slot" slot_of(s, d) (its own slot is never used:
// a rank copies its own rows straight to its outputs). Row j of a slot is the j-th token (in
// source order) that s sends to d, so the receiver's output row is prefix(s, d) + j. A zero-copy
// dispatch stores row j at x_recv_row(prefix(s, d) + j) instead (= send_pos), every source and the
// kept rows in one contiguous [N, H] range that recv_x views.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define EPX_HT_HD __host__ __device__ __forceinline__
#else
#define EPX_HT_HD inline
#endif

namespace epx::detail {

inline constexpr int kMaxHtRanks = 32;  // one lane per rank in the kernels
inline constexpr int kHtRowsPerBlock = 32;

// Over the rank prefix matrix rpm [R, R] (rpm[s][d]: rows rank d receives from ranks 0..s), on
// the device or a host copy: the rows d receives from ranks before s, and from s alone.
EPX_HT_HD int32_t prefix_before(const int32_t* rpm, int R, int s, int d) {
  return s > 0 ? rpm[(s - 1) * R + d] : 0;
}
EPX_HT_HD int32_t rows_between(const int32_t* rpm, int R, int s, int d) {
  return rpm[s * R + d] - prefix_before(rpm, R, s, d);
}

// Rows moved by copy engines in chunks, each signalled (arrive steps, ht_params.cuh): chunk c of
// n rows is rows [engine_chunk_begin(n, c), engine_chunk_begin(n, c + 1)); the host copies chunk
// by chunk, a kernel waits for the chunk holding row j, engine_chunk(j, n). They must agree (a
// row waited for in a later chunk than it was sent in is late; in an earlier one, read early):
// tests/unit/ht_chunks_test.cc.
inline constexpr int kHtEngineChunks = 4;  // pipeline depth: reducing chunk c overlaps c + 1
EPX_HT_HD int64_t engine_chunk_begin(int64_t n, int c) {
  return n * c / kHtEngineChunks;
}
EPX_HT_HD int engine_chunk(int64_t j, int64_t n) {
  int c = 0;
  while (c + 1 < kHtEngineChunks && j >= engine_chunk_begin(n, c + 1)) ++c;
  return c;
}

EPX_HT_HD size_t ht_round_up(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

struct HtCountMsg {
  uint32_t flag;     // op sequence number, stored last (release)
  uint32_t call[3];  // the sender's per-call values (HtCallField order, cuda/device_error.h)
  // int32 tokens_per_rank[R]; int32 tokens_per_expert[L] follow
};

struct HtRegion {
  int num_ranks = 1;
  int num_local_experts = 1;
  int top_k = 1;
  int64_t max_tokens = 0;
  int64_t num_blocks = 0;  // per slot
  int64_t x_row_bytes = 0;
  int64_t scale_row_bytes = 0;
  int64_t meta_row_bytes = 0;
  size_t count_slot_bytes = 0;
  size_t state_off = 0, ready_off = 0, arrived_off = 0, yready_off = 0, callword_off = 0;
  size_t count_off = 0;
  size_t counter_off = 0, x_off = 0, scale_off = 0, meta_off = 0, yw_off = 0, total_bytes = 0;

  static HtRegion make(int64_t hidden, int top_k, int num_experts, int64_t max_tokens,
                       int num_ranks) {
    HtRegion g;
    g.num_ranks = num_ranks;
    g.num_local_experts = num_experts / num_ranks;
    g.top_k = top_k;
    g.max_tokens = max_tokens;
    g.num_blocks = (max_tokens + kHtRowsPerBlock - 1) / kHtRowsPerBlock;
    g.x_row_bytes = static_cast<int64_t>(ht_round_up(static_cast<size_t>(hidden) * 2, 16));
    g.scale_row_bytes =
        static_cast<int64_t>(ht_round_up(static_cast<size_t>((hidden + 127) / 128) * 4, 16));
    g.meta_row_bytes =
        static_cast<int64_t>(ht_round_up((1 + 2 * static_cast<size_t>(top_k)) * 4, 16));
    g.count_slot_bytes = ht_round_up(
        sizeof(HtCountMsg) + 4 * static_cast<size_t>(num_ranks + g.num_local_experts), 16);
    const size_t slots = static_cast<size_t>(num_ranks - 1);
    const size_t rows = slots * static_cast<size_t>(max_tokens);
    size_t off = 0;
    g.state_off = off;
    off += 64;
    g.ready_off = off;
    off += ht_round_up(4 * kMaxHtRanks, 64);
    g.arrived_off = off;
    off += ht_round_up(4 * kMaxHtRanks, 64);
    g.yready_off = off;
    off += ht_round_up(4 * kMaxHtRanks, 64);
    g.callword_off = off;
    off += ht_round_up(4 * kMaxHtRanks, 64);
    g.count_off = off;
    off += ht_round_up(g.count_slot_bytes * num_ranks, 256);
    g.counter_off = off;
    off += ht_round_up(4 * slots * g.num_blocks, 256);
    g.x_off = off = ht_round_up(off, 4096);
    // R * T_max rows: the R - 1 slots, or the N <= R * T_max rows of a zero-copy dispatch.
    off += static_cast<size_t>(num_ranks) * static_cast<size_t>(max_tokens) * g.x_row_bytes;
    g.scale_off = off = ht_round_up(off, 256);
    off += static_cast<size_t>(num_ranks) * static_cast<size_t>(max_tokens) * g.scale_row_bytes;
    g.meta_off = off = ht_round_up(off, 256);
    off += rows * g.meta_row_bytes;
    g.yw_off = off = ht_round_up(off, 256);
    off += static_cast<size_t>(num_ranks) * static_cast<size_t>(max_tokens) * top_k * 4;
    g.total_bytes = ht_round_up(off, 4096);
    return g;
  }

  // Slot on `receiver` that holds what `sender` sends it (sender != receiver).
  EPX_HT_HD static int slot_of(int sender, int receiver) {
    return sender < receiver ? sender : sender - 1;
  }
  EPX_HT_HD uint32_t* ready(char* base) const {
    return reinterpret_cast<uint32_t*>(base + ready_off);
  }
  EPX_HT_HD uint32_t* arrived(char* base) const {
    return reinterpret_cast<uint32_t*>(base + arrived_off);
  }
  EPX_HT_HD uint32_t* yready(char* base) const {
    return reinterpret_cast<uint32_t*>(base + yready_off);
  }
  EPX_HT_HD uint32_t* callword(char* base) const {
    return reinterpret_cast<uint32_t*>(base + callword_off);
  }
  // Zero-copy combine: row `row` of the rank's y (bf16, row_bytes = 2 H) and of its weights [K].
  EPX_HT_HD char* combine_y_row(char* base, int64_t row, int64_t row_bytes) const {
    return base + x_off + static_cast<size_t>(row) * row_bytes;
  }
  EPX_HT_HD float* combine_w_row(char* base, int64_t row) const {
    return reinterpret_cast<float*>(base + yw_off) + static_cast<size_t>(row) * top_k;
  }
  // Zero-copy dispatch: row `row` of the receiver's recv_x (packed at row_bytes <= x_row_bytes).
  EPX_HT_HD char* x_recv_row(char* base, int64_t row, int64_t row_bytes) const {
    return base + x_off + static_cast<size_t>(row) * row_bytes;
  }
  // Zero-copy dispatch: row `row` of the receiver's recv_x_scales ([N][num_scales] 4-byte words).
  EPX_HT_HD char* scale_recv_row(char* base, int64_t row, int num_scales) const {
    return base + scale_off + static_cast<size_t>(row) * num_scales * 4;
  }
  EPX_HT_HD HtCountMsg* count_msg(char* base, int source) const {
    return reinterpret_cast<HtCountMsg*>(base + count_off + count_slot_bytes * source);
  }
  EPX_HT_HD uint32_t* counter(char* base, int slot, int64_t block) const {
    return reinterpret_cast<uint32_t*>(base + counter_off) + slot * num_blocks + block;
  }
  EPX_HT_HD char* x_row(char* base, int slot, int64_t row) const {
    return base + x_off + (static_cast<size_t>(slot) * max_tokens + row) * x_row_bytes;
  }
  EPX_HT_HD char* scale_row(char* base, int slot, int64_t row) const {
    return base + scale_off + (static_cast<size_t>(slot) * max_tokens + row) * scale_row_bytes;
  }
  EPX_HT_HD char* meta_row(char* base, int slot, int64_t row) const {
    return base + meta_off + (static_cast<size_t>(slot) * max_tokens + row) * meta_row_bytes;
  }
};

// Results the exact-mode host path reads after the count exchange (mapped pinned host memory).
struct HtHostResult {
  uint32_t ticket;  // written last: the host's ticket of the notify launch that wrote the rest
  int32_t num_recv_tokens;
  int32_t pad[2];
  // then int32: num_recv_tokens_per_expert[L] (rounded up to expert_alignment), the rank prefix
  // matrix [R * R], and the runs of consecutive tokens this rank keeps (the copy-engine path
  // copies them): the number of runs, the number of ends, then up to kHtHostKeptRuns first
  // tokens and as many ends (the first token after a run; a run reaching T has none), each list
  // in any order.
};
inline constexpr int kHtHostKeptRuns = 32;  // >= kHtKeptCopyMaxRuns (cuda/tuning.h)
// The int32 words after HtHostResult.
EPX_HT_HD size_t ht_host_result_words(int num_local_experts, int num_ranks) {
  return static_cast<size_t>(num_local_experts) + static_cast<size_t>(num_ranks) * num_ranks + 2 +
         2 * kHtHostKeptRuns;
}

}  // namespace epx::detail
