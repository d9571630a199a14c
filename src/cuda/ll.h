// src/cuda/ll.h — the cuda ll mode's entry points for CudaBuffer (defined in src/cuda/ll.cu,
// where CudaLl lives).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/buffer_impl.h"

namespace epx::detail {

class CudaLl;

// Collective (allocates the ll region). `enable_shrink`: BufferConfig::enable_shrink.
std::shared_ptr<CudaLl> cuda_ll_create(const Group& group, const MoeShape& shape,
                                       bool enable_shrink);
size_t cuda_ll_allocated(const CudaLl* ll);  // 0 for null
void cuda_ll_check(CudaLl& ll);
LlDispatchResult cuda_ll_dispatch(CudaLl& ll, const LlDispatchArgs& args, const Allocator& alloc,
                                  uint64_t buffer_id);
LlCombineResult cuda_ll_combine(CudaLl& ll, const LlCombineArgs& args, const Allocator& alloc);
// The plain combine (copy or zero-copy; no hook, LogFMT or overlap) with the float32 sums,
// unrounded, into `out` [T, H] (contiguous, 16-byte aligned): CudaLlNodes' partials.
void cuda_ll_combine_f32(CudaLl& ll, const LlCombineArgs& args, float* out);
TensorView cuda_ll_next_combine_buffer(CudaLl& ll, const LlHandle& handle);
void cuda_ll_clean(CudaLl& ll);
// What a hook checks before it runs (docs/semantics.md §2.4; InvalidArgument naming `op`): its
// Buffer still `alive`, not `called` before, not `discarded` by an ll_clean since its operation.
// Sets `called`.
void ll_hook_begin(const char* op, bool alive, bool& called, bool discarded);
// What a dispatch checks of the slot it takes (InvalidArgument naming `op`): its previous
// dispatch, `slot` of two, does not still wait for its hook (`in_flight`).
void ll_require_dispatch_slot(const char* op, int slot, bool in_flight);
// The rank mask (docs/semantics.md §2.6), stream-ordered on `stream`.
void cuda_ll_update_mask(CudaLl& ll, int rank, bool mask, Stream stream);
void cuda_ll_query_mask(CudaLl& ll, const TensorView& mask_status, Stream stream);
void cuda_ll_clean_mask(CudaLl& ll, Stream stream);
size_t cuda_ll_layout_bytes(const MoeShape& shape, int num_ranks);
// A tensor from `alloc` on cuda:`device`, checked: `dtype`, `shape`, contiguous and 16-byte
// aligned, else InvalidArgument naming `op` and the output `name`.
Tensor allocate_ll_output(const Allocator& alloc, int device, DType dtype,
                          const std::vector<int64_t>& shape, const char* op, const char* name);
// A dispatch's outputs into `res` (recv_x, recv_scales as args' format wants them, recv_count,
// the handle's tensors; L local experts, R ranks, RT rows per expert, H): core/buffer_impl.h's two
// blocks, each through allocate_ll_output.
void allocate_ll_dispatch_outputs(LlDispatchResult& res, const Allocator& alloc, int device,
                                  const LlDispatchArgs& args, int L, int R, int64_t RT,
                                  int64_t H, const char* op);

}  // namespace epx::detail
