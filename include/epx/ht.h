// epx/ht.h — high-throughput dispatch/combine (prefill, training). docs/semantics.md §1.
//
// Data flow on rank r (R ranks, T tokens here, N tokens received):
//   ht_layout(topk_idx)   -> num_tokens_per_rank[R], num_tokens_per_expert[E], is_token_in_rank[T, R]
//   ht_dispatch(x, topk)  -> recv_x[N, H]: rows grouped by source rank ascending, then by source
//                            token index ascending (deterministic)
//   ht_combine(y[N, H])   -> out[T, H] = bias0 + bias1 + sum over destination ranks d ascending of
//                            y_d[pos_d(t)], float32 accumulation, one rounding to bf16
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "epx/tensor.h"

namespace epx {

struct HtLayout {
  Tensor num_tokens_per_rank;    // [R] int32: tokens that go to each rank
  Tensor num_tokens_per_expert;  // [E] int32: (token, k) selections per expert
  Tensor is_token_in_rank;       // [T, R] bool
};

// What combine and cached dispatch need; produced by ht_dispatch. Tensors live on the buffer's
// device. Opaque to callers apart from the fields documented here.
struct HtHandle {
  Tensor rank_prefix_matrix;  // [R, R] int32: [s][d] = tokens received by d from ranks 0..s
  Tensor recv_src_idx;        // [rows] int32: source token index of each received row
  Tensor is_token_in_rank;    // [T, R] bool, this rank's tokens
  Tensor send_pos;            // [T, R] int32: row of token t in rank d's recv_x, -1 if not sent
  int64_t num_tokens = 0;     // T of the dispatch on this rank
  int64_t num_recv_tokens = -1;  // N; -1 when not known on the host (worst-case mode on cuda)
  int64_t num_worst_tokens = 0;  // rows of the outputs in worst-case mode, else 0
  int top_k = 0;
  uint64_t buffer_id = 0;     // the buffer that made it (checked on use)
  // Backend-private state the dispatch left for the combine and cached dispatches of this handle
  // (cuda: what the host learnt from the count exchange for the copy engines); null otherwise.
  std::shared_ptr<const void> backend_state;
};

struct HtDispatchArgs {
  // [T, H] bf16, or fp8 e4m3 with x_scales (fp8 needs H % 128 == 0). T <= max_tokens_per_rank
  // (else OutOfCapacity). Rows may be strided (stride(1) must be 1). Every rank passes the same
  // dtypes (else every rank raises InvalidArgument).
  TensorView x;
  // fp8 only: [T, H/128] float32 or [T, ceil(H/512)] int32 (packed UE8M0: group g in byte g % 4
  // of int g / 4), any strides (column-major scales are accepted). Moved with their rows, never
  // re-quantised.
  TensorView x_scales;
  // [T, K] int64 or int32, values in [-1, E). Ignored in cached mode.
  TensorView topk_idx;
  // [T, K] float32, any strides. Optional; given on every rank or on none (else every rank
  // raises InvalidArgument). Ignored in cached mode.
  TensorView topk_weights;
  // Each per-expert count in num_recv_tokens_per_expert is rounded up to this (>= 1). The same on
  // every rank, as num_worst_tokens (else every rank raises InvalidArgument).
  int expert_alignment = 1;
  // > 0: worst-case mode. Outputs have exactly this many rows, no host synchronisation; rows past
  // N have recv_topk_idx = -1, recv_topk_weights = 0 and recv_src_idx = -1 (their recv_x and
  // scales are unspecified; the cpu backend zeroes them). N > num_worst_tokens is an
  // OutOfCapacity error of the rank that receives too many, never a truncation (cpu: raised by
  // this call; cuda: by the next call on the buffer or check()); its peers' calls complete.
  int64_t num_worst_tokens = 0;
  // Cached mode: reuse the routing of an earlier dispatch (x has the handle's T). No layout or
  // count exchange; only recv_x (and recv_x_scales) are returned, with the handle's row count
  // (num_worst_tokens must be 0 or the handle's), and result.handle is a copy of *handle.
  const HtHandle* handle = nullptr;
  // Zero-copy receive (any mode): recv_x (and recv_x_scales) are views of the buffer's symmetric
  // memory, where the peers store the rows directly (no copy into tensors of their own). The views
  // are valid until this rank's next ht_dispatch or ht_combine on the buffer begins on the device
  // (and while the buffer lives; they do not own their memory): order every read before that call
  // (the same stream, or an event) and copy what must live longer. A copying combine refuses them
  // as y (InvalidArgument: the peers write there during it); Buffer::ht_combine_buffer views the
  // same memory, so expert outputs may be written in place for a zero-copy combine. The other
  // outputs are tensors of their own. Worst-case mode needs num_worst_tokens <= R *
  // max_tokens_per_rank. Every rank passes the same value (else every rank raises
  // InvalidArgument; on cuda not detected in cached mode, docs/semantics.md §4.2). The cpu
  // backend accepts it and returns ordinary tensors.
  bool zero_copy = false;
  Stream stream = nullptr;
};

struct HtDispatchResult {
  Tensor recv_x;             // [rows, H], dtype of x (rows = N, or num_worst_tokens)
  Tensor recv_x_scales;      // [rows, H/128] f32 or [rows, ceil(H/512)] i32, fp8 only; contiguous
                             // row-major whatever the strides of x_scales
  Tensor recv_topk_idx;      // [rows, K], dtype of topk_idx: local expert index or -1
  Tensor recv_topk_weights;  // [rows, K] f32: weight where local, else 0 (if weights given)
  Tensor recv_src_idx;       // [rows] int32 (same tensor as handle.recv_src_idx)
  // Per local expert, received (row, k) selections rounded up to expert_alignment (a token that
  // lists the same expert twice counts twice). Empty in worst-case mode (no host
  // synchronisation) and in cached mode.
  std::vector<int> num_recv_tokens_per_expert;
  HtHandle handle;
};

struct HtCombineArgs {
  // [N or num_worst_tokens, H] bf16, in recv_x order; rows past N are not read. Rows may be
  // strided (stride(1) must be 1).
  TensorView y;
  // Required: the handle of the dispatch (every rank passes its handle of the same dispatch).
  const HtHandle* handle = nullptr;
  // Optional [rows, K] f32 (stride(1) must be 1), summed back into combined_topk_weights; given
  // on every rank or none.
  TensorView topk_weights;
  TensorView bias0;  // optional [T, H] bf16, stride(1) == 1
  TensorView bias1;  // optional [T, H] bf16, stride(1) == 1
  // Zero-copy combine: y is the view Buffer::ht_combine_buffer(handle) returned, already written
  // (InvalidArgument for any other y). On cuda the source ranks then read the rows straight from
  // this rank's memory (no push, no staging); the call returns on the stream once every rank has
  // read, so the view may be rewritten after it. Every rank passes the same value (the cpu
  // backend raises InvalidArgument on every rank otherwise; not detected on cuda).
  bool zero_copy = false;
  Stream stream = nullptr;
};

struct HtCombineResult {
  Tensor out;                    // [T, H] bf16
  Tensor combined_topk_weights;  // [T, K] f32, only if topk_weights was given
};

}  // namespace epx
