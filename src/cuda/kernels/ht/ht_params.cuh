// src/cuda/kernels/ht/ht_params.cuh — the trivially copyable parameter struct of each ht kernel
// (grid-invariant; passed by value). Shapes in comments; strides in bytes unless noted.
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/ht_region.cuh"
#include "cuda/kernels/sync.cuh"
#include "cuda/tuning.h"

namespace epx::detail {

// Where this rank's ht buffer and its peers' copies are (LSA pointers).
struct HtSymm {
  char* local;               // this rank's buffer
  char* peers[kMaxHtRanks];  // every rank's buffer as addressable from here (peers[rank] = local)
  HtRegion region;
};

// ht_notify: layout (+ count exchange when `exchange`). One cluster of 1-8 CTAs (notify.cuh).
struct HtNotifyParams {
  const void* topk_idx;  // [T, K] int64 or int32
  int64_t topk_stride;   // elements between rows
  int topk_is_i64;
  int num_tokens, top_k, num_experts, num_local_experts, num_ranks, rank;
  int expert_alignment;
  // The call's values every rank must pass alike, sent with the counts and compared by every
  // receiver (kDevErrHtCallDiffers): HtCallField order.
  uint32_t call[3];
  int exchange;                    // 0: layout only (no communication, no sequence number)
  int32_t* num_tokens_per_rank;    // [R] or null
  int32_t* num_tokens_per_expert;  // [E] or null
  bool* is_token_in_rank;          // [T, R] or null
  int32_t* send_pos;               // [T, R] (exchange): row in rank d's recv_x, or -1
  int32_t* rank_prefix_matrix;     // [R, R] (exchange): [s][d] = rows d receives from ranks 0..s
  HtHostResult* host;              // mapped host memory (exchange), device address
  uint32_t ticket;                 // non-zero: publish N and per-expert counts to `host`
  int find_kept_runs;              // with a ticket: also this rank's kept runs (the copy plan)
  HtSymm symm;
  WaitContext wait;
#ifdef EPX_HT_TRACE
  uint64_t* trace;  // kernels/ht/trace.cuh (null: off)
#endif
};

// ht_dispatch: rows (+ scales, + routing metadata unless cached) to their receivers.
struct HtDispatchParams {
  const char* x;  // [T, H] rows of row_bytes, x_stride apart
  int64_t x_stride;
  int64_t row_bytes;   // H * element size
  const char* scales;  // fp8: [T, num_scales] 4-byte elements, strides in elements
  int64_t scale_stride0, scale_stride1;
  int num_scales;
  const void* topk_idx;  // [T, K] int64/int32 (not cached)
  int64_t topk_stride;   // elements
  int topk_is_i64;
  const float* topk_weights;                // [T, K] or null
  int64_t weights_stride, weights_stride1;  // elements
  const int32_t* send_pos;                  // [T, R]
  const int32_t* rank_prefix_matrix;        // [R, R]
  int num_tokens, top_k, num_local_experts, num_ranks, rank;
  int cached;                // 1: only x (and scales) move
  uint32_t call_word;        // cached: ht_call_format of this call, compared on arrival
  char* recv_x;              // [num_rows, H] contiguous
  uint32_t* recv_scales;     // [num_rows, num_scales] or null
  void* recv_topk_idx;       // [num_rows, K], dtype of topk_idx (not cached)
  float* recv_topk_weights;  // [num_rows, K] or null
  int32_t* recv_src_idx;     // [num_rows] (not cached)
  int64_t num_rows;          // N (exact / cached) or num_worst_tokens
  int worst_case;            // rows past N get topk -1, weight 0, src -1; N > num_rows is an error
  int num_send_ctas;         // CTAs [0, num_send_ctas) send, the rest receive
#ifdef EPX_DIAGNOSTICS
  int ablate;  // HtAblate bits (cuda/tuning.h, diagnostics builds only)
#endif
  int pdl;  // launched with programmatic dependent launch (cuda/launch.h)
#ifdef EPX_HT_TRACE
  uint64_t* trace;  // kernels/ht/trace.cuh (null: off)
#endif
  int engine_kept;  // 1: the copy engines copy the kept rows' x (side stream, ht.cu)
  int zero_copy;    // 1: recv_x is this rank's x area (x_recv_row), peers store rows there
  HtSymm symm;
  WaitContext wait;
};

// ht_engine_sync (one warp, the copy-engine combine; op = state->seq + 1, the combine about to
// run: its copies run before and beside the combine kernel, which advances seq only at its end):
//   kEngineWaitReady  until ready[p] reached op - 1 for every peer p (p finished the op before:
//                  its slots may be written; the kernels' wait_peer_ready); notes op in
//                  state->engine_op for the arrive steps that run beside the kernel
//   kEngineArrive  arrived[rank] = op * kHtEngineChunks + chunk on every peer (this rank's rows
//                  of that chunk are in the peers' slots; the copies precede it on the stream)
// (kHtEngineChunks, engine_chunk_begin / engine_chunk: ht_region.cuh.)
enum HtEngineStep : int { kEngineArrive = 0, kEngineWaitReady = 1 };
struct HtEngineSyncParams {
  int num_ranks, rank;
  int step;   // HtEngineStep
  int chunk;  // kEngineArrive
  HtSymm symm;
  WaitContext wait;
};

// ht_combine: expert outputs back to their source ranks, reduced there.
struct HtCombineParams {
  const char* y;  // [num_y_rows, H] bf16 in recv_x order
  int64_t y_stride;
  int64_t num_y_rows;
  int64_t row_bytes;       // H * 2
  const float* weights;    // [num_y_rows, K] or null
  int64_t weights_stride;  // elements
  const char* bias0;       // [T, H] bf16 or null
  int64_t bias0_stride;
  const char* bias1;
  int64_t bias1_stride;
  const int32_t* send_pos;            // [T, R] from the handle
  const int32_t* rank_prefix_matrix;  // [R, R]
  int num_tokens, top_k, num_ranks, rank;
  char* out;                // [T, H] bf16 contiguous (float32: launch_ht_combine_f32)
  float* combined_weights;  // [T, K] or null
  int num_send_ctas;
  uint32_t call_word;  // ht_call_format of this call (weights given, zero_copy), compared on arrival
#ifdef EPX_DIAGNOSTICS
  int ablate;  // HtAblate bits (cuda/tuning.h, diagnostics builds only)
#endif
  int pdl;  // launched with programmatic dependent launch (cuda/launch.h)
#ifdef EPX_HT_TRACE
  uint64_t* trace;  // kernels/ht/trace.cuh (null: off)
#endif
  int engine_y;  // 1: the copy engines push every slot's y rows in kHtEngineChunks chunks
                 // (ht.cu); the senders move the weights only, and reducers also wait for the
                 // chunk of each row
  int pull;  // 1: zero-copy combine: y is this rank's combine_y_row area, weights are mirrored in
             // the yw area; reducers read the peers' rows there (no senders, no slots)
  int pull_stages;  // > 0: the staged reducer (combine_staged.cuh): stages per warp
  int pull_chunk;   // its bytes per source per stage (a multiple of 512)
  HtSymm symm;
  WaitContext wait;
};

}  // namespace epx::detail
