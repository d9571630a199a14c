// src/cuda/kernels/ll/ll_layout.cuh — the ll symmetric region of the cuda backend: one struct,
// used on the host to size the allocation (cuda_ll_bytes) and in the kernels to find every part.
// Host + device.
//
// Per rank (offsets identical on every rank; R ranks, L = E / R local experts, T_max, H,
// G = H / 128 groups, RT = R * T_max rows per local expert, msg = max(2H, H + 4G) rounded to 16):
//   state     LlState                          local only: abort / error claim, per-slot epochs
//                                              and finished-CTA counters
//   sync      LlSync                           written by peers (column p by rank p): the flags
//   row map, slot 0 and slot 1:                written by the experts' ranks (their dispatch
//     uint64 [T_max, K]                        receives): entry (t, k) = where this rank's token
//                                              t landed for selection k, ll_row_entry (the first
//                                              k of each distinct expert of t only); read by this
//                                              rank's combine (combine.cuh, kDirect)
//   mask      LlMask                           local only: the ranks this rank masks
//                                              (enable_shrink; kept by ll_clean)
//   dispatch staging, slot 0 and slot 1:       what every source sent to this rank
//     for each source s (block of src_bytes):
//       header  LlSourceHeader                 {T_s, format (use_fp8 | round_scale << 1 |
//                                              use_nvfp4 << 2), NVFP4 global scale bits}
//       topk    int32 [T_max, K]               s's routing row of every token (ids out of [0, E)
//                                              already replaced by -1), for every token < T_s
//       msgs    [T_max, msg]                   token t's row: e4m3 [H] + f32 scales [G],
//                                              e2m1 pairs [H/2] + e4m3 scales [H/16] (NVFP4),
//                                              or bf16 [H]; written only for tokens going here
//   combine, slot 0 and slot 1:
//     layout  int64 [L, R]                     this rank's handle.layout_range of the combine
//                                              (begin << 32 | count), read by the sources
//     format  int32                            this rank's use_logfmt | overlap << 1 of the
//                                              combine, compared by the sources and, with
//                                              overlap, by the experts (kDevErrLlCombineFormat)
//     route   int32 [T_max, K]                 overlap: this rank's topk_idx of the combine (ids
//                                              out of [-1, E) as -1), read by the experts' sends
//                                              (where each row lands) and this rank's receive
//     meta    uint32 [L, RT, G]                use_logfmt: each row's LogFMT meta words
//                                              (core/logfmt.h), read by the sources
//     y       bf16 [L, RT, H]                  the expert outputs the sources pull; the view
//                                              ll_next_combine_buffer returns; use_logfmt: each
//                                              row's groups encoded in place (logfmt.h layout)
//     land    bf16 [T_max, K, H]               overlap: y(t, k0) pushed by the expert's rank,
//                                              k0 = the first k of each distinct expert of t
// Bytes per rank ≈ 2 * (R * T_max * (4K + msg) + L * RT * (2H + 4G) + T_max * K * (2H + 12)): at
// EP2, T_max = 128, H = 7168, E = 256 that is 7.4 MB of staging + 954 MB of combine buffers +
// 29.4 MB of landing rows + 16 KB of row maps.
//
// Flags (32-bit, never reset by the host; epochs count the operations of each slot):
//   dispatch_sent[q][s]    += 1 by each of s's C dispatch CTAs once its rows for this rank in
//                          slot q landed: e * C when the e-th dispatch of slot q is complete
//   dispatch_routed[q][s]  += 1 by each of s's C dispatch CTAs once its routing rows (and CTA 0's
//                          header) for this rank in slot q landed: e * C when every routing row
//                          of the e-th dispatch of slot q is there (dispatch_sent covers them
//                          too); the fused receive scans after it, copies after dispatch_sent
//   dispatch_freed[q][d]   += 1 by each of d's C receive CTAs once it finished reading d's slot-q
//                          staging: e * C after epoch e (a sender waits for (e - 1) * C on every
//                          d before writing slot q again)
//   combine_ready[q][d]    += 1 by each of d's C combine CTAs once d's combine slot q holds y
//                          and its layout: e * C when ready (d's own word too: a LogFMT
//                          receive waits for its own rows, which every CTA encodes)
//   combine_pulled[q][s]   += 1 by each of s's C receive CTAs once it finished pulling its rows
//                          of combine e from here: e * C
//   combine_routed[q][s]   = e, stored by CTA 0 of s's combine send (any form) once s's route,
//                          format and layout of combine e are in place; an overlapped send
//                          waits for it before reading s's route and pushing into s's land
//                          (s's previous receive through slot q is done by then: stream order)
//   combine_ready counts C per combine in either form: an overlapped send of S CTAs adds C / S
//   per CTA (+1 for the first C % S), so the receive's e * C and the next combine's hold.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device_error.h"
#include "epx/shape.h"
#include "transport/transport.h"

#if defined(__CUDACC__)
#define EPX_LL_HD __host__ __device__ __forceinline__
#else
#define EPX_LL_HD inline
#endif

namespace epx::detail {

inline constexpr int kLlThreads = 512;  // every ll kernel: CTAs of 16 warps
inline constexpr int kLlWarps = kLlThreads / 32;
inline constexpr int kLlMaxCtas = 128;      // per kernel (auto tuning: see resolve_ll_ctas)
inline constexpr int kLlMaxExperts = 2048;  // E: combine keeps [E] tables in shared memory
inline constexpr int kLlMaxTopK = 32;       // K
// dispatch: x vectors per thread loaded ahead (H <= 8192 on 512 threads; twice as many on the
// fused launch's 256 sending threads)
inline constexpr int kLlXPrefetch = 2;
inline constexpr int kLlIdBatch = 8;    // ids of a routing row loaded together
inline constexpr int kLlPrefixTopK = 16;    // combine step 4: rows up to this K kept in registers
inline constexpr int kLlCombineTokens = 8;  // tokens a combine CTA resolves at a time
inline constexpr int kLlLoadBatch = 8;      // combine: expert rows loaded together per thread
// Combine at T <= C / 2: each token's output vectors split over P CTAs (ll_combine_slices), each
// slice at least this many 16-byte vectors.
inline constexpr int kLlCombineSliceVectors = 128;
inline constexpr int kLlUnitGroup = 4;       // dispatch receive: units a CTA takes at once
inline constexpr int kLlCopyBatch = 8;      // row copies: 16-byte loads in flight per thread
// The plain and overlapped combine's CTAs per token (P; 1 with enable_shrink, combine.cuh): 1
// while T > C / 2 (CTA b reduces tokens [b * ceil(T / C), ...), whole rows); below, CTA b reduces
// slice b % P of token b / P's nv output vectors ([nv * (b % P) / P, nv * (b % P + 1) / P)), P =
// C / T capped so a slice keeps kLlCombineSliceVectors vectors: a token's K rows are pulled by P
// SMs instead of one, in one round of loads per thread (docs/design.md §7.3). Each vector is still
// reduced by one thread in the same order, so the output bits do not depend on P.
EPX_LL_HD int ll_combine_slices(int64_t num_tokens, int ctas, int64_t nv) {
  if (num_tokens <= 0 || 2 * num_tokens > ctas) return 1;
  const int by_ctas = ctas / static_cast<int>(num_tokens);  // 32-bit: T <= C / 2 here
  const int64_t by_width = nv / kLlCombineSliceVectors;
  const int p = by_width < by_ctas ? static_cast<int>(by_width) : by_ctas;
  return p > 1 ? p : 1;
}
// The first of slice `slice`'s vectors (of P slices of nv); slice P gives nv.
EPX_LL_HD int ll_combine_slice_begin(int nv, int slice, int P) {
  return nv * slice / P;
}

// Which halves one launch of epx::ll::dispatch / epx::ll::combine runs (LlDispatchParams::phases,
// LlCombineParams::phases): both without a hook; with one, the call runs the send and the hook
// the receive — the same kernel, so profilers show one name per op.
inline constexpr int32_t kLlPhaseSend = 1;
inline constexpr int32_t kLlPhaseRecv = 2;
inline constexpr int32_t kLlPhaseBoth = kLlPhaseSend | kLlPhaseRecv;

// DeviceErrorRecord::op / ::code values (kOpLl*, kDevErrLl*): device_error.h.

struct LlState {
  DeviceState dev;  // abort + error_claim (seq / finished unused)
  // Per slot q and CTA b: the dispatches (combines) of slot q that CTA b of the receive half
  // completed on this rank; CTA b of every ll kernel reads its own word at its start.
  uint32_t dispatch_epoch[2][kLlMaxCtas];
  uint32_t combine_epoch[2][kLlMaxCtas];
  // enable_shrink: per slot, the dispatch receive CTAs that finished their waits (+1 each per
  // dispatch: e * n after the e-th), so that all of them read the same mask (dispatch.cuh).
  uint32_t recv_waited[2];
};

struct LlSync {
  uint32_t dispatch_sent[2][kMaxRanks];
  uint32_t dispatch_routed[2][kMaxRanks];
  uint32_t dispatch_freed[2][kMaxRanks];
  uint32_t combine_ready[2][kMaxRanks];
  uint32_t combine_pulled[2][kMaxRanks];
  uint32_t combine_routed[2][kMaxRanks];
};

// CTA `cta` of an overlapped send of S CTAs: its share of C in combine_ready (C / S, + 1 for the
// first C % S CTAs), so the S shares add up to the C a plain send's CTAs add (1 <= S <= C).
EPX_LL_HD uint32_t ll_overlap_ready_share(int recv_ctas, int send_ctas, int cta) {
  return static_cast<uint32_t>(recv_ctas / send_ctas + (cta < recv_ctas % send_ctas ? 1 : 0));
}

// enable_shrink (docs/semantics.md §2.6): bit p = rank p masked. Written by the mask kernel
// (ll_update_mask / ll_clean_mask, stream-ordered), by ll_clean on the host (the ranks its
// barriers missed) and by this rank's ll waits that time out (atomicOr); read by every ll CTA.
struct LlMask {
  unsigned long long masked;
};

// A row map entry (layout above): the row of the expert's [RT] block (bits 0-31), the expert (bits
// 32-43) and the low 20 bits of the dispatch's epoch of the slot (bits 44-63), so a combine tells
// an entry of its handle's dispatch from an older one (a selection that dispatch did not deliver).
inline constexpr uint32_t kLlRowEpochMask = 0xFFFFF;
static_assert(kLlMaxExperts <= 4096, "row map entries hold the expert in 12 bits");
EPX_LL_HD uint64_t ll_row_entry(int64_t row, int32_t expert, uint32_t epoch) {
  return static_cast<uint64_t>(row) | static_cast<uint64_t>(expert) << 32 |
         static_cast<uint64_t>(epoch & kLlRowEpochMask) << 44;
}
// Whether `entry` is expert's row in the dispatch of epoch `epoch` (then ll_row_entry_row is it).
EPX_LL_HD bool ll_row_entry_is(uint64_t entry, int32_t expert, uint32_t epoch) {
  return entry >> 32 == (static_cast<uint64_t>(epoch & kLlRowEpochMask) << 12 |
                         static_cast<uint64_t>(expert));
}
EPX_LL_HD int64_t ll_row_entry_row(uint64_t entry) {
  return static_cast<int64_t>(entry & 0xFFFFFFFFu);
}

struct LlSourceHeader {
  int32_t num_tokens;
  int32_t format;              // use_fp8 | round_scale << 1 | use_nvfp4 << 2
  uint32_t global_scale_bits;  // use_nvfp4: the float32 global scale's bits, else 0
  int32_t pad[13];
};

EPX_LL_HD constexpr size_t ll_round_up(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

// The state and the flags open every rank's region at fixed offsets, so a kernel reaches its
// epoch words and flags from `local` alone: no layout field (a constant-cache line of the
// kernel's parameters) on its first path.
inline constexpr size_t kLlStateOff = 0;
inline constexpr size_t kLlSyncOff = ll_round_up(sizeof(LlState), 256);

// The dispatch's fields first, the combine's after them (docs/design.md §7.3, Parameters).
struct LlLayout {
  int32_t num_ranks = 1, num_local_experts = 1, top_k = 1, num_experts = 1;
  int64_t hidden = 0, msg_bytes = 0, max_tokens = 0, num_groups = 0, rows_per_expert = 0;
  size_t src_topk_off = 0, src_msgs_off = 0, src_bytes = 0;  // within one source's block
  size_t dispatch_off[2] = {};
  size_t row_map_off[2] = {};
  size_t combine_off[2] = {};
  size_t comb_layout_off = 0, comb_format_off = 0, comb_route_off = 0, comb_meta_off = 0,
         comb_y_off = 0, comb_land_off = 0;  // within one combine slot
  size_t mask_off = 0;
  size_t total_bytes = 0;

  // Host: the layout of `shape` on `num_ranks` ranks (shape already validated).
  static LlLayout make(const MoeShape& shape, int num_ranks) {
    LlLayout g;
    const size_t R = static_cast<size_t>(num_ranks);
    g.num_ranks = num_ranks;
    g.num_experts = shape.num_experts;
    g.num_local_experts = shape.num_experts / num_ranks;
    g.top_k = shape.top_k;
    g.max_tokens = shape.max_tokens_per_rank;
    g.hidden = shape.hidden;
    g.num_groups = shape.hidden / 128;
    g.rows_per_expert = num_ranks * shape.max_tokens_per_rank;
    const size_t H = static_cast<size_t>(g.hidden), G = static_cast<size_t>(g.num_groups);
    const size_t T = static_cast<size_t>(g.max_tokens),
                 L = static_cast<size_t>(g.num_local_experts);
    g.msg_bytes = static_cast<int64_t>(ll_round_up(2 * H > H + 4 * G ? 2 * H : H + 4 * G, 16));
    g.src_topk_off = ll_round_up(sizeof(LlSourceHeader), 64);
    g.src_msgs_off = g.src_topk_off + ll_round_up(4 * T * g.top_k, 64);
    g.src_bytes = ll_round_up(g.src_msgs_off + T * g.msg_bytes, 256);
    g.comb_layout_off = 0;
    g.comb_format_off = ll_round_up(8 * L * R, 16);
    g.comb_route_off = ll_round_up(g.comb_format_off + 16, 256);
    g.comb_meta_off = ll_round_up(g.comb_route_off + 4 * T * g.top_k, 256);
    g.comb_y_off = ll_round_up(g.comb_meta_off + 4 * L * g.rows_per_expert * G, 256);
    g.comb_land_off = ll_round_up(g.comb_y_off + 2 * L * g.rows_per_expert * H, 256);
    const size_t comb_bytes = ll_round_up(g.comb_land_off + 2 * T * g.top_k * H, 256);
    size_t off = kLlSyncOff + ll_round_up(sizeof(LlSync), 256);  // after the state and flags
    for (int q = 0; q < 2; ++q) {
      g.row_map_off[q] = off;
      off += ll_round_up(8 * T * g.top_k, 256);
    }
    g.mask_off = off;
    off += ll_round_up(sizeof(LlMask), 256);
    for (int q = 0; q < 2; ++q) {
      g.dispatch_off[q] = off;
      off += R * g.src_bytes;
    }
    for (int q = 0; q < 2; ++q) {
      g.combine_off[q] = off;
      off += comb_bytes;
    }
    g.total_bytes = off;
    return g;
  }

  // state + sync + row map: what ll_clean zeroes (not the mask).
  EPX_LL_HD size_t control_bytes() const { return mask_off; }

  EPX_LL_HD LlState* state(char* base) const {
    return reinterpret_cast<LlState*>(base + kLlStateOff);
  }
  EPX_LL_HD LlSync* sync(char* base) const { return reinterpret_cast<LlSync*>(base + kLlSyncOff); }
  EPX_LL_HD uint64_t* row_map(char* base, int slot) const {
    return reinterpret_cast<uint64_t*>(base + row_map_off[slot]);
  }
  EPX_LL_HD unsigned long long* mask(char* base) const {
    return &reinterpret_cast<LlMask*>(base + mask_off)->masked;
  }
  // Source src's staging block in slot `slot`, in bytes from any rank's base.
  EPX_LL_HD size_t staging_offset(int slot, int src) const {
    return dispatch_off[slot] + static_cast<size_t>(src) * src_bytes;
  }
  EPX_LL_HD char* staging(char* base, int slot, int src) const {
    return base + staging_offset(slot, src);
  }
  EPX_LL_HD LlSourceHeader* header(char* base, int slot, int src) const {
    return reinterpret_cast<LlSourceHeader*>(staging(base, slot, src));
  }
  EPX_LL_HD int32_t* topk(char* base, int slot, int src) const {
    return reinterpret_cast<int32_t*>(staging(base, slot, src) + src_topk_off);
  }
  // Token t's message from `src` in slot `slot`: at msg_offset bytes from any rank's base (the
  // offsets are the same on every rank, so a sender adds it to each destination's base).
  EPX_LL_HD size_t msg_offset(int slot, int src, int64_t t) const {
    return staging_offset(slot, src) + src_msgs_off + static_cast<size_t>(t) * msg_bytes;
  }
  EPX_LL_HD char* msg(char* base, int slot, int src, int64_t t) const {
    return base + msg_offset(slot, src, t);
  }
  EPX_LL_HD int64_t* comb_layout(char* base, int slot) const {
    return reinterpret_cast<int64_t*>(base + combine_off[slot] + comb_layout_off);
  }
  EPX_LL_HD int32_t* comb_format(char* base, int slot) const {
    return reinterpret_cast<int32_t*>(base + combine_off[slot] + comb_format_off);
  }
  EPX_LL_HD int32_t* comb_route(char* base, int slot) const {
    return reinterpret_cast<int32_t*>(base + combine_off[slot] + comb_route_off);
  }
  EPX_LL_HD uint16_t* comb_land(char* base, int slot) const {
    return reinterpret_cast<uint16_t*>(base + combine_off[slot] + comb_land_off);
  }
  EPX_LL_HD uint32_t* comb_meta(char* base, int slot) const {
    return reinterpret_cast<uint32_t*>(base + combine_off[slot] + comb_meta_off);
  }
  EPX_LL_HD uint16_t* comb_y(char* base, int slot) const {
    return reinterpret_cast<uint16_t*>(base + combine_off[slot] + comb_y_off);
  }
};

}  // namespace epx::detail
