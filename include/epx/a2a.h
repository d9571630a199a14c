// epx/a2a.h — fixed-geometry multi-payload all-to-all (FlashInfer/TensorRT-LLM style).
// docs/semantics.md §3.
//
// Data flow on rank r (R ranks, M = runtime_max_tokens_per_rank):
//   dispatch(topk_idx[T, K], payloads p_i[T, ...]) ->
//     recv_i[R, M, ...]  views of the receive workspace: row [s][j] is the j-th token (source
//                        index order) that rank s sent to r; a token goes to a rank once
//     recv_counts[R]     int32
//   combine(y[R, M, H])  -> out[T, H]: out[t] = sum over distinct ranks d that t went to, in
//                        ascending order, of y_d[r][slot_d(t)]; in float32, rounded once to y's
//                        dtype (bf16, f16 or f32; nearest, ties to even, f16 overflows to inf)
// The call order is dispatch -> combine -> dispatch ...; anything else raises InvalidArgument.
//
// Fault tolerance (set_active_ranks): ranks marked inactive are skipped. A selection whose expert
// lives on an inactive rank is treated like -1 (not sent; counted, see dropped_counts); an
// inactive rank is neither written to nor waited for, recv_counts[s] = 0 for it, and combine sums
// only active ranks (a token all of whose valid selections are on inactive ranks gets zeros).
// A peer that stops taking part makes the other ranks' calls raise Timeout (bounded by the group
// timeout, never a hang); they then call set_active_ranks without it and continue (docs/
// semantics.md, "a2a rank mask", states the guarantees and the limits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx {

namespace detail {
class A2aImpl;
}

inline constexpr int kMaxA2aPayloads = 8;

struct A2aShape {
  int64_t max_tokens_per_rank = 0;
  int top_k = 0;
  int num_experts = 0;
  std::vector<size_t> payload_bytes_per_token;  // up to 8 dispatch payloads, multiples of 4
  size_t combine_bytes_per_token = 0;           // H * element size of the combine payload
};

struct A2aDispatchArgs {
  TensorView topk_idx;              // [T, K] int32 (int64 accepted), values in [-1, E)
  // One per A2aShape::payload_bytes_per_token entry, each [T, ...] contiguous; its row bytes a
  // positive multiple of 4, <= the configured size, equal on every rank.
  std::vector<TensorView> payloads;
  // >= T and <= max_tokens_per_rank (else OutOfCapacity), equal on every rank (else every rank
  // raises InvalidArgument).
  int64_t runtime_max_tokens_per_rank = 0;
  std::optional<int32_t> invalid_expert_id;  // sanitise padding rows of the expert-id payload
  int expert_id_payload_index = -1;  // which payload holds expert ids (int32 [T, K]); required
                                     // with invalid_expert_id
  Stream stream = nullptr;
};

struct A2aDispatchResult {
  // Per payload [R, M, ...] views of the workspace (the payload's dtype and trailing dims).
  // Padding rows j >= recv_counts[s] are unspecified (the cpu backend zeroes them), except the
  // expert-id payload's with invalid_expert_id: all K entries = invalid_expert_id.
  std::vector<TensorView> recv;
  TensorView recv_counts;        // [R] int32, in the workspace
};

// What the rank mask dropped on this rank's dispatches (cumulative since construction or the last
// reset_dropped_counts). Only this rank's own tokens are counted (as a sender).
struct A2aDropCounts {
  // Tokens with at least one valid selection (an expert id in [0, E)) whose valid selections all
  // name experts on inactive ranks: they go nowhere and combine returns zeros for them.
  int64_t tokens = 0;
  // Valid selections (token, k) whose expert lives on an inactive rank, whether or not the token
  // also went to an active rank (duplicates of one expert count once each).
  int64_t selections = 0;
};

class A2a {
 public:
  // Collective. Every rank passes the same shape (compared first, in one small exchange, before
  // anything is allocated: else every rank raises InvalidArgument naming each differing field and
  // every rank's value).
  A2a(const Group& group, const A2aShape& shape);
  ~A2a();
  A2a(A2a&&) noexcept;
  A2a& operator=(A2a&&) noexcept;

  // Workspace bytes per rank for `shape` on `num_ranks` ranks of `backend`.
  static size_t workspace_bytes(const A2aShape& shape, int num_ranks, Backend backend);
  size_t bytes_allocated() const;
  const Group& group() const;
  Device device() const;  // cpu, or the group's GPU
  const A2aShape& shape() const;

  // Collective. Views stay valid until the next dispatch.
  A2aDispatchResult dispatch(const A2aDispatchArgs& args);
  // Local. [R, M, hidden] contiguous view of the workspace the MoE kernel writes into for
  // combine(payload_in_workspace); hidden * element size <= combine_bytes_per_token, dtype bf16,
  // f16 or f32. Write it after dispatch, before combine.
  TensorView combine_payload_view(int64_t runtime_max_tokens_per_rank, int64_t hidden,
                                  DType dtype);
  // Collective. y: [R, M, H] bf16, f16 or f32, stride(2) 1 (or the view above with
  // payload_in_workspace), M the preceding dispatch's, H and dtype equal on every rank. Returns
  // out [T, H] in y's dtype, from `allocator` (docs/semantics.md §3.3: the sum in f32, in
  // ascending rank order, rounded once).
  Tensor combine(const TensorView& y, int64_t runtime_max_tokens_per_rank,
                 bool payload_in_workspace = false, Stream stream = nullptr,
                 const Allocator& allocator = default_allocator());

  // Raises a pending asynchronous error. Local.
  void check() const;

  // ---- rank mask (fault tolerance) ------------------------------------------------------------
  // [IN] active: one entry per rank (size R), active[rank()] must be true (else InvalidArgument
  // naming the argument). Every rank marked active must call set_active_ranks with the SAME mask
  // at the same point of its call sequence (between a combine, or a failed call, and the next
  // dispatch); ranks marked inactive must not call dispatch/combine on this object any more (a
  // dead process, or a rank told to stop). It is collective over the active ranks only:
  //   - they resynchronise among themselves (epochs / barrier generations), so it is also the
  //     re-arm after a Timeout: the object becomes usable again (see below);
  //   - the dispatch -> combine order restarts (a dispatch not combined yet is abandoned);
  //   - masks that differ between active ranks raise InvalidArgument on the ranks that see it:
  //     the ranks that published a mask other than one of their members'. Ranks that agree among
  //     themselves go on; a rank whose mask counts ranks that do not count it is never answered
  //     by them, and raises InvalidArgument too, at once (it reads the masks they published),
  //     on both backends.
  // cpu: blocking; waits up to 2x the group timeout for the other active ranks (they may still be
  //   running into their own Timeout), else raises Timeout (the object stays unusable).
  // cuda: stream-ordered on `stream`, host returns at once. The mask lives in device memory and
  //   is written by a small kernel enqueued on `stream` (after earlier work on `stream`, before
  //   later work), which also runs the resynchronisation with the other active ranks on the
  //   device (bounded, 2x the group timeout). Captured CUDA graphs read the mask at replay, so a
  //   graph captured once keeps working across mask changes (set the mask between replays, on the
  //   stream the graph is launched on). Errors of the kernel are raised by the next check().
  //   All earlier work of this object must be ordered before `stream` (as for dispatch).
  // Initially every rank is active. After a Timeout caused by a dead peer, dispatch/combine raise
  // Internal ("unusable ...") until set_active_ranks is called.
  // Limits: masks only shrink: a rank once marked inactive cannot be marked active again on this
  // object (InvalidArgument; create a new group and A2a to bring it back). The recovery itself
  // is not fault tolerant beyond that: a rank dying during set_active_ranks makes it raise
  // Timeout on the others, which call it again without that rank. A rank marked inactive must
  // really have stopped using this object (a rank still running epx work on it could write into
  // the others' workspace).
  void set_active_ranks(const std::vector<bool>& active, Stream stream = nullptr);
  // Local. The current mask (size R).
  std::vector<bool> active_ranks() const;
  // Local. Drops of this rank's dispatches (see A2aDropCounts). cuda: the counters live in device
  // memory and are advanced by the dispatch kernel; this synchronises the device
  // (cudaDeviceSynchronize) and copies them back, so it counts every dispatch launched before the
  // call. Not for the hot path.
  A2aDropCounts dropped_counts() const;
  int64_t dropped_tokens() const { return dropped_counts().tokens; }
  // Local. Zeroes both counters; cuda: stream-ordered on `stream` (cudaMemsetAsync).
  void reset_dropped_counts(Stream stream = nullptr);

  detail::A2aImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<detail::A2aImpl> impl_;
};

}  // namespace epx
