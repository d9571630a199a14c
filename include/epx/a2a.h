// epx/a2a.h — fixed-geometry multi-payload all-to-all (FlashInfer/TensorRT-LLM style). SPEC 3.6.
//
// Data flow on rank r (R ranks, M = runtime_max_tokens_per_rank):
//   dispatch(topk_idx[T, K], payloads p_i[T, ...]) ->
//     recv_i[R, M, ...]  views of the receive workspace: row [s][j] is the j-th token (source
//                        index order) that rank s sent to r; a token goes to a rank once
//     recv_counts[R]     int32
//   combine(y[R, M, H])  -> out[T, H]: out[t] = sum over distinct ranks d that t went to, in
//                        ascending order, of y_d[r][slot_d(t)]; float32, one rounding
// The call order is dispatch -> combine -> dispatch ...; anything else raises InvalidArgument.
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

class A2a {
 public:
  // Collective. Every rank passes the same shape (else every rank raises InvalidArgument naming
  // the field).
  A2a(const Group& group, const A2aShape& shape);
  ~A2a();
  A2a(A2a&&) noexcept;
  A2a& operator=(A2a&&) noexcept;

  // Workspace bytes per rank for `shape` on `num_ranks` ranks of `backend`.
  static size_t workspace_bytes(const A2aShape& shape, int num_ranks, Backend backend);
  size_t bytes_allocated() const;
  const Group& group() const;
  const A2aShape& shape() const;

  // Collective. Views stay valid until the next dispatch.
  A2aDispatchResult dispatch(const A2aDispatchArgs& args);
  // Local. [R, M, hidden] contiguous view of the workspace the MoE kernel writes into for
  // combine(payload_in_workspace); hidden * element size <= combine_bytes_per_token, dtype bf16
  // or f32. Write it after dispatch, before combine.
  TensorView combine_payload_view(int64_t runtime_max_tokens_per_rank, int64_t hidden,
                                  DType dtype);
  // Collective. y: [R, M, H] bf16 or f32, stride(2) 1 (or the view above with
  // payload_in_workspace), M the preceding dispatch's, H and dtype equal on every rank. Returns
  // out [T, H] in y's dtype, from `allocator`.
  Tensor combine(const TensorView& y, int64_t runtime_max_tokens_per_rank,
                 bool payload_in_workspace = false, Stream stream = nullptr,
                 const Allocator& allocator = default_allocator());

  // Raises a pending asynchronous error. Local.
  void check() const;

  detail::A2aImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<detail::A2aImpl> impl_;
};

}  // namespace epx
