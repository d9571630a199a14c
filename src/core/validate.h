// src/core/validate.h — argument validation of every public operation, shared by all backends.
// Each function throws epx::Error (InvalidArgument / OutOfCapacity / Unsupported) with a message
// naming the operation, the argument, the value and what was expected.
#pragma once

#include "core/buffer_impl.h"

namespace epx::detail {

void validate_shape(const MoeShape& shape, int num_ranks, const char* op);
// topk_idx [T, K] int64/int32 on `device`; when readable on the host, every value in [-1, E).
void validate_topk_idx(const TensorView& topk_idx, int top_k, int num_experts, Device device,
                       const char* op, const char* name = "topk_idx");

// Rows of the outputs the dispatch that made `h` produced: num_worst_tokens in worst-case mode,
// else N (the rows combine's y and ht_combine_buffer have).
int64_t ht_handle_rows(const HtHandle& h);

void validate_ht_layout(const BufferImpl& b, const TensorView& topk_idx);
void validate_ht_dispatch(const BufferImpl& b, const HtDispatchArgs& args);
void validate_ht_combine(const BufferImpl& b, const HtCombineArgs& args);
void validate_ht_combine_buffer(const BufferImpl& b, const HtHandle& handle,
                                const char* op = "ht_combine_buffer");

void validate_ll_dispatch(const BufferImpl& b, const LlDispatchArgs& args);
// The NVFP4 global scale g of validated args whose g is on the host: global_scale, or element 0
// of a cpu x_global_scale.
float ll_host_global_scale(const LlDispatchArgs& args);
void validate_ll_combine(const BufferImpl& b, const LlCombineArgs& args);
// The overlapped combine's signals (epx/ll.h, LlCombineOverlap): blocks per local expert
// (ceil(R * T_max / block_rows), or 1 with block_rows = 0) and L times that.
int64_t ll_overlap_blocks(const MoeShape& shape, int num_ranks, int64_t block_rows);
int64_t ll_overlap_num_signals(const MoeShape& shape, int num_ranks, int64_t block_rows);
void validate_ll_handle(const BufferImpl& b, const LlHandle& handle, const char* op);
// The ll rank mask (docs/semantics.md §2.6): enable_ll and enable_shrink; a rank in [0, R) that is
// not this one when masking; an int32 [R] tensor on the buffer's device to query into.
void validate_ll_mask_op(const BufferImpl& b, const char* op);
void validate_ll_update_mask(const BufferImpl& b, int rank, bool mask);
void validate_ll_query_mask(const BufferImpl& b, const TensorView& mask_status);

void validate_a2a_shape(const A2aShape& shape, int num_ranks);

// Before any allocation (src/core/capacity.cc): OutOfCapacity naming the shape fields and the
// bytes when `mode`'s symmetric memory (per rank) exceeds kMaxSymmetricBytes (1 TiB), computed
// without overflow. The shape must have passed validate_shape / validate_a2a_shape. `num_nodes`:
// the group's (more than one adds the cpu backend's rail chunks).
void check_buffer_capacity(const MoeShape& shape, int num_ranks, Mode mode, Backend backend,
                           const char* op, int num_nodes = 1);
void check_a2a_capacity(const A2aShape& shape, int num_ranks, Backend backend, const char* op);
void validate_a2a_dispatch(const A2aImpl& a, const A2aDispatchArgs& args);
void validate_a2a_combine(const A2aImpl& a, const TensorView& y, int64_t runtime_max,
                          bool payload_in_workspace);

}  // namespace epx::detail
