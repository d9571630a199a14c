// epx::A2a: validation and the dispatch -> combine state machine, then the backend.
#include "epx/a2a.h"

#include "core/buffer_impl.h"
#include "core/check.h"
#include "core/validate.h"

namespace epx {

A2a::A2a(const Group& group, const A2aShape& shape) {
  detail::validate_a2a_shape(shape, group.size());
  impl_ = group.backend() == Backend::kCpu ? detail::make_cpu_a2a(group, shape)
                                           : detail::make_cuda_a2a(group, shape);
}

A2a::~A2a() = default;
A2a::A2a(A2a&&) noexcept = default;
A2a& A2a::operator=(A2a&&) noexcept = default;

size_t A2a::workspace_bytes(const A2aShape& shape, int num_ranks, Backend backend) {
  detail::validate_a2a_shape(shape, num_ranks);
  return backend == Backend::kCpu ? detail::cpu_a2a_bytes(shape, num_ranks)
                                  : detail::cuda_a2a_bytes(shape, num_ranks);
}

size_t A2a::bytes_allocated() const { return impl_->bytes_allocated(); }
const Group& A2a::group() const { return impl_->group; }
const A2aShape& A2a::shape() const { return impl_->shape; }
void A2a::check() const { impl_->check(); }

A2aDispatchResult A2a::dispatch(const A2aDispatchArgs& args) {
  impl_->check();
  EPX_CHECK_ARG(!impl_->dispatched,
                "a2a dispatch: called twice without combine in between; expected the order "
                "dispatch -> combine -> dispatch");
  detail::validate_a2a_dispatch(*impl_, args);
  A2aDispatchResult r = impl_->dispatch(args);
  impl_->dispatched = true;
  impl_->last_runtime_max = args.runtime_max_tokens_per_rank;
  impl_->last_num_tokens = args.topk_idx.shape[0];
  return r;
}

TensorView A2a::combine_payload_view(int64_t runtime_max, int64_t hidden, DType dtype) {
  EPX_CHECK_ARG(runtime_max >= 0 && runtime_max <= impl_->shape.max_tokens_per_rank,
                "a2a combine_payload_view: 'runtime_max_tokens_per_rank' is ", runtime_max,
                ", expected 0..", impl_->shape.max_tokens_per_rank);
  EPX_CHECK_ARG(dtype == DType::kBF16 || dtype == DType::kF32,
                "a2a combine_payload_view: 'dtype' is ", dtype_name(dtype), ", expected bf16 or f32");
  EPX_CHECK_ARG(hidden > 0 && static_cast<size_t>(hidden) * dtype_size(dtype) <=
                                  impl_->shape.combine_bytes_per_token,
                "a2a combine_payload_view: 'hidden' is ", hidden, " (", hidden * dtype_size(dtype),
                " bytes per token), expected 1..", impl_->shape.combine_bytes_per_token,
                " bytes (A2aShape::combine_bytes_per_token)");
  return impl_->combine_payload_view(runtime_max, hidden, dtype);
}

Tensor A2a::combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace,
                    Stream stream, const Allocator& allocator) {
  impl_->check();
  EPX_CHECK_ARG(impl_->dispatched,
                "a2a combine: called without a preceding dispatch; expected the order "
                "dispatch -> combine -> dispatch");
  detail::validate_a2a_combine(*impl_, y, runtime_max, payload_in_workspace);
  Tensor out = impl_->combine(y, runtime_max, payload_in_workspace, stream, allocator);
  impl_->dispatched = false;
  return out;
}

}  // namespace epx
