// epx/ll.h — low-latency dispatch/combine (decode). SPEC 3.4–3.5.
//
// Data flow on rank r (L local experts, capacity T_max = shape.max_tokens_per_rank):
//   ll_dispatch(x[T, H], topk_idx[T, K]) ->
//     recv_x[L, R * T_max, H]   expert-major: local expert l's rows packed from row 0, grouped by
//                               source rank ascending, then source token index ascending
//     recv_scales               fp8: f32 [L, R*T_max, H/128] or packed UE8M0 i32
//                               [L, R*T_max, H/512], column-major in the last two dims
//     recv_count[L] int32       rows per local expert (masked_m)
//   ll_combine(y[L, R*T_max, H]) -> out[t] = sum over k of w[t][k] * y(t, k), float32 fma in k
//                               order, one rounding to bf16
// A token that selects the same local expert twice gets one row; both selections read it back.
#pragma once

#include <cstdint>
#include <functional>

#include "epx/tensor.h"

namespace epx {

struct LlHandle {
  Tensor src_info;      // [L, R * T_max] int32: source token index of each received row
  Tensor layout_range;  // [L, R] int64: (begin << 32) | count of each source rank's block
  int64_t max_tokens = 0;  // T_max
  int64_t hidden = 0;
  int num_experts = 0;
  int64_t num_tokens = 0;  // T on this rank at dispatch
  int slot = 0;            // double-buffer half used by this dispatch
  uint64_t buffer_id = 0;
};

// Waits for and finishes the receive half of an operation sent with return_recv_hook.
// Call exactly once, in the same order on every rank.
using LlHook = std::function<void()>;

struct LlDispatchArgs {
  TensorView x;         // [T, H] bf16, T <= T_max, H % 128 == 0
  TensorView topk_idx;  // [T, K] int64 or int32, values in [-1, E)
  bool use_fp8 = true;
  bool round_scale = false;  // power-of-two scales
  bool use_ue8m0 = false;    // packed exponent bytes; requires round_scale
  bool return_recv_hook = false;
  // Optional [L] int32, accumulated with the received tokens per local expert.
  TensorView cumulative_local_expert_recv_stats;
  Stream stream = nullptr;
};

struct LlDispatchResult {
  Tensor recv_x;       // see above
  Tensor recv_scales;  // fp8 only
  Tensor recv_count;   // [L] int32
  LlHandle handle;
  LlHook hook;         // set when return_recv_hook: outputs are valid after hook() returns
};

struct LlCombineArgs {
  TensorView y;             // [L, R * T_max, H] bf16 (ignored when zero_copy)
  TensorView topk_idx;      // [T, K], the dispatch's
  TensorView topk_weights;  // [T, K] f32
  const LlHandle* handle = nullptr;
  bool zero_copy = false;   // y was written into ll_next_combine_buffer(handle)
  bool return_recv_hook = false;
  TensorView out;           // optional [T, H] bf16 to write into
  Stream stream = nullptr;
};

struct LlCombineResult {
  Tensor out;  // [T, H] bf16 (aliases args.out when given)
  LlHook hook;
};

}  // namespace epx
