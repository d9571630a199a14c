// src/cuda/cuda_buffer.cc — CudaBuffer (the shell over CudaHt and CudaLl), the cuda factories and
// the sizing functions.
#include "cuda/cuda_buffer.h"

#include "core/check.h"
#include "core/cuda_runtime_shim.h"
#include "cuda/a2a.h"
#include "cuda/cuda_check.h"
#include "cuda/ht.h"
#include "cuda/ht_nodes.h"
#include "cuda/ll.h"
#include "cuda/ll_nodes.h"

namespace epx::detail {

CudaBuffer::CudaBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config,
                       uint64_t id)
    : BufferImpl(group, shape, config, id) {
  const int R = group.size();
  EPX_CHECK(R <= kMaxHtRanks, ErrorCode::kUnsupported, "Buffer: the group has ", R,
            " ranks; the cuda ht kernels support at most ", kMaxHtRanks);
  device_ = group.transport()->device().index;
  // Each collective, in this order on every rank.
  if (config.enable_ht && group.num_nodes() > 1)
    ht_nodes_ = std::make_unique<CudaHtNodes>(group, shape, id);
  else if (config.enable_ht)
    ht_ = std::make_unique<CudaHt>(group, shape, id);
  if (config.enable_ll && group.num_nodes() > 1)
    ll_nodes_ = std::make_unique<CudaLlNodes>(group, shape, id);
  else if (config.enable_ll)
    ll_ = cuda_ll_create(group, shape, config.enable_shrink);
}

CudaBuffer::~CudaBuffer() {
  ht_.reset();  // then ll_, as the members go
  ht_nodes_.reset();
  ll_nodes_.reset();
}

size_t CudaBuffer::bytes_allocated() const {
  return (ht_ ? ht_->bytes() : 0) + (ht_nodes_ ? ht_nodes_->bytes() : 0) +
         cuda_ll_allocated(ll_.get()) + (ll_nodes_ ? ll_nodes_->bytes() : 0);
}

void CudaBuffer::check() {
  if (ht_) ht_->require_usable("check");
  if (ht_nodes_) ht_nodes_->require_usable("check");
  if (ll_) cuda_ll_check(*ll_);
  if (ll_nodes_) ll_nodes_->check();
  if (ht_) ht_->check();
  if (ht_nodes_) ht_nodes_->check();
}

void CudaBuffer::require_ht(const char* op) const {
  EPX_CHECK(ht_ != nullptr || ht_nodes_ != nullptr, ErrorCode::kInvalidArgument, op,
            ": this buffer was created with BufferConfig::enable_ht = false, expected true");
}

const HtTuning& CudaBuffer::tuning() const {
  require_ht("tuning");
  return ht_ ? ht_->tuning() : ht_nodes_->tuning();
}

// ht: validated by epx::Buffer; the mode lives in ht.cu (one node) or ht_nodes.cu (across nodes).
HtLayout CudaBuffer::ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) {
  require_ht("ht_layout");
  return ht_ ? ht_->layout(topk_idx, stream, alloc) : ht_nodes_->layout(topk_idx, stream, alloc);
}
HtDispatchResult CudaBuffer::ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) {
  require_ht("ht_dispatch");
  // The exact dispatch waits on the host for the count exchange (across nodes: one per source
  // node), which a capture only records: refused before any launch on either path, so the
  // capture and the buffer stay usable.
  EPX_CHECK(args.handle != nullptr || args.num_worst_tokens > 0 ||
                !cuda_stream_is_capturing(args.stream, device_),
            ErrorCode::kUnsupported, "ht_dispatch: the exact dispatch waits on the host for the "
            "count exchange and cannot run while its stream (", args.stream, ") is being "
            "captured into a CUDA graph; expected it eagerly, and a cached dispatch (handle) or, "
            "on one node, worst-case mode (num_worst_tokens > 0) under capture");
  return ht_ ? ht_->dispatch(args, alloc) : ht_nodes_->dispatch(args, alloc);
}
HtCombineResult CudaBuffer::ht_combine(const HtCombineArgs& args, const Allocator& alloc) {
  require_ht("ht_combine");
  return ht_ ? ht_->combine(args, alloc) : ht_nodes_->combine(args, alloc);
}
TensorView CudaBuffer::ht_combine_buffer(const HtHandle& handle) const {
  require_ht("ht_combine_buffer");
  return ht_ ? ht_->combine_buffer(handle) : ht_nodes_->combine_buffer(handle);
}

// ll: validated by epx::Buffer (enable_ll, so ll_ or ll_nodes_ exists); the mode lives in ll.cu
// (one node) or ll_nodes.cu (across nodes).
LlDispatchResult CudaBuffer::ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  return ll_ ? cuda_ll_dispatch(*ll_, args, alloc, id) : ll_nodes_->dispatch(args, alloc);
}
LlCombineResult CudaBuffer::ll_combine(const LlCombineArgs& args, const Allocator& alloc) {
  return ll_ ? cuda_ll_combine(*ll_, args, alloc) : ll_nodes_->combine(args, alloc);
}
TensorView CudaBuffer::ll_next_combine_buffer(const LlHandle& handle) {
  if (!ll_)
    ll_nodes_->unsupported("ll_next_combine_buffer: the zero-copy combine", "ll_combine with y");
  return cuda_ll_next_combine_buffer(*ll_, handle);
}
void CudaBuffer::ll_clean() {
  if (ll_) cuda_ll_clean(*ll_);
  if (ll_nodes_) ll_nodes_->clean();
}
void CudaBuffer::ll_update_mask(int rank, bool mask, Stream stream) {
  if (!ll_) ll_nodes_->unsupported("ll_update_mask: the rank masks", "one node");
  cuda_ll_update_mask(*ll_, rank, mask, stream);
}
void CudaBuffer::ll_query_mask(const TensorView& mask_status, Stream stream) {
  if (!ll_) ll_nodes_->unsupported("ll_query_mask: the rank masks", "one node");
  cuda_ll_query_mask(*ll_, mask_status, stream);
}
void CudaBuffer::ll_clean_mask(Stream stream) {
  if (!ll_) ll_nodes_->unsupported("ll_clean_mask: the rank masks", "one node");
  cuda_ll_clean_mask(*ll_, stream);
}
void CudaBuffer::reset() {
  if (ht_) ht_->reset();
  if (ht_nodes_) ht_nodes_->reset();
  if (ll_) cuda_ll_clean(*ll_);
  if (ll_nodes_) ll_nodes_->clean();
}

// ---- factories and sizing ----------------------------------------------------------------------

std::unique_ptr<BufferImpl> make_cuda_buffer(const Group& group, const MoeShape& shape,
                                             const BufferConfig& config, uint64_t id) {
  EPX_CHECK(group.backend() == Backend::kCuda, ErrorCode::kInvalidArgument,
            "Buffer: the cuda backend needs a cuda group");
  return std::make_unique<CudaBuffer>(group, shape, config, id);
}

std::unique_ptr<A2aImpl> make_cuda_a2a(const Group& group, const A2aShape& shape) {
  return cuda_a2a_create(group, shape);
}

size_t cuda_ht_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  if (num_nodes > 1) return cuda_ht_nodes_bytes(shape, num_ranks, num_nodes);
  return HtRegion::make(shape.hidden, shape.top_k, shape.num_experts, shape.max_tokens_per_rank,
                        num_ranks)
      .total_bytes;
}
size_t cuda_ll_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  if (num_nodes > 1) return cuda_ll_nodes_bytes(shape, num_ranks, num_nodes);
  return cuda_ll_layout_bytes(shape, num_ranks);
}
size_t cuda_a2a_bytes(const A2aShape& shape, int num_ranks) {
  return cuda_a2a_layout_bytes(shape, num_ranks);
}

}  // namespace epx::detail
