// epx::Buffer: validation, then the backend.
#include "epx/buffer.h"

#include <atomic>
#include <vector>

#include "core/agree.h"
#include "core/buffer_impl.h"
#include "core/check.h"
#include "core/validate.h"

namespace epx {

static uint64_t next_buffer_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

Buffer::Buffer(const Group& group, const MoeShape& shape, const BufferConfig& config) {
  // Every rank must pass the same geometry and options: compared first (one small exchange, before
  // anything is sized or mapped), so a difference is an InvalidArgument on every rank and the
  // checks below reach the same verdict on every rank.
  std::vector<detail::AgreeField> fields = {
      {"shape.hidden", shape.hidden},
      {"shape.top_k", shape.top_k},
      {"shape.num_experts", shape.num_experts},
      {"shape.max_tokens_per_rank", shape.max_tokens_per_rank},
      {"config.enable_ht", config.enable_ht, detail::show_bool},
      {"config.enable_ll", config.enable_ll, detail::show_bool},
      {"config.enable_shrink", config.enable_shrink, detail::show_bool},
      {"GroupOptions::ranks_per_node", group.ranks_per_node()}};
  if (group.backend() == Backend::kCuda) {
    // The ll kernels' flag targets count every rank's CTAs alike (src/cuda/ll.cu).
    fields.push_back({"the ll kernels' CTA count (from GroupOptions::num_sms and the GPU's SMs)",
                      config.enable_ll && shape.num_experts > 0 && shape.max_tokens_per_rank > 0
                          ? detail::cuda_ll_num_ctas(group, shape)
                          : 0});
  }
  detail::agree(group, "Buffer", fields);
  detail::validate_shape(shape, group.size(), "Buffer");
  EPX_CHECK_ARG(config.enable_ht || config.enable_ll,
                "Buffer: config enables neither ht nor ll, expected at least one");
  EPX_CHECK_ARG(!config.enable_ll || shape.hidden % 128 == 0, "Buffer: shape.hidden is ",
                shape.hidden, ", expected a multiple of 128 when ll is enabled (fp8 groups)");
  EPX_CHECK_ARG(!config.enable_shrink || config.enable_ll,
                "Buffer: config.enable_shrink is true but enable_ll is false, expected enable_ll = "
                "true (the rank masks are ll's)");
  EPX_CHECK(!config.enable_shrink || group.num_nodes() == 1, ErrorCode::kUnsupported,
            "Buffer: config.enable_shrink on ", group.num_nodes(),
            " nodes: the ll rank masks are built for one node (GroupOptions::ranks_per_node 0 or "
            "the group size)");
  // Sizes before any allocation (OutOfCapacity naming the fields and the bytes).
  if (config.enable_ht)
    detail::check_buffer_capacity(shape, group.size(), Mode::kHt, group.backend(), "Buffer",
                                  group.num_nodes());
  if (config.enable_ll)
    detail::check_buffer_capacity(shape, group.size(), Mode::kLl, group.backend(), "Buffer",
                                  group.num_nodes());
  const uint64_t id = next_buffer_id();
  impl_ = group.backend() == Backend::kCpu ? detail::make_cpu_buffer(group, shape, config, id)
                                           : detail::make_cuda_buffer(group, shape, config, id);
}

Buffer::~Buffer() = default;
Buffer::Buffer(Buffer&&) noexcept = default;
Buffer& Buffer::operator=(Buffer&&) noexcept = default;

size_t Buffer::bytes_needed(Mode mode, const MoeShape& shape, int num_ranks, Backend backend,
                            int ranks_per_node) {
  EPX_CHECK_ARG(num_ranks >= 1, "Buffer::bytes_needed: 'num_ranks' is ", num_ranks,
                ", expected >= 1");
  EPX_CHECK_ARG(ranks_per_node >= 0 && ranks_per_node <= num_ranks &&
                    (ranks_per_node == 0 || num_ranks % ranks_per_node == 0),
                "Buffer::bytes_needed: 'ranks_per_node' is ", ranks_per_node,
                ", expected 0 (one node) or a divisor of num_ranks = ", num_ranks);
  const int nodes = ranks_per_node == 0 ? 1 : num_ranks / ranks_per_node;
  detail::validate_shape(shape, num_ranks, "Buffer::bytes_needed");
  const bool cpu = backend == Backend::kCpu;
  if (mode != Mode::kA2a)
    detail::check_buffer_capacity(shape, num_ranks, mode, backend, "Buffer::bytes_needed", nodes);
  switch (mode) {
    case Mode::kHt:
      return cpu ? detail::cpu_ht_bytes(shape, num_ranks, nodes)
                 : detail::cuda_ht_bytes(shape, num_ranks, nodes);
    case Mode::kLl:
      return cpu ? detail::cpu_ll_bytes(shape, num_ranks, nodes)
                 : detail::cuda_ll_bytes(shape, num_ranks, nodes);
    case Mode::kA2a: break;
  }
  detail::throw_error(ErrorCode::kInvalidArgument,
                      "Buffer::bytes_needed: 'mode' is a2a, expected ht or ll (use "
                      "A2a::workspace_bytes)");
}

size_t Buffer::bytes_allocated() const { return impl_->bytes_allocated(); }
const Group& Buffer::group() const { return impl_->group; }
const MoeShape& Buffer::shape() const { return impl_->shape; }
Device Buffer::device() const { return impl_->device(); }
uint64_t Buffer::id() const { return impl_->id; }
void Buffer::check() const { impl_->check(); }

HtLayout Buffer::ht_layout(const TensorView& topk_idx, Stream stream,
                           const Allocator& allocator) const {
  impl_->check();
  detail::validate_ht_layout(*impl_, topk_idx);
  return impl_->ht_layout(topk_idx, stream, allocator);
}

HtDispatchResult Buffer::ht_dispatch(const HtDispatchArgs& args, const Allocator& allocator) {
  impl_->check();
  detail::validate_ht_dispatch(*impl_, args);
  return impl_->ht_dispatch(args, allocator);
}

HtCombineResult Buffer::ht_combine(const HtCombineArgs& args, const Allocator& allocator) {
  impl_->check();
  detail::validate_ht_combine(*impl_, args);
  return impl_->ht_combine(args, allocator);
}

TensorView Buffer::ht_combine_buffer(const HtHandle& handle) {
  impl_->check();
  detail::validate_ht_combine_buffer(*impl_, handle);
  return impl_->ht_combine_buffer(handle);
}

LlDispatchResult Buffer::ll_dispatch(const LlDispatchArgs& args, const Allocator& allocator) {
  impl_->check();
  detail::validate_ll_dispatch(*impl_, args);
  return impl_->ll_dispatch(args, allocator);
}

LlCombineResult Buffer::ll_combine(const LlCombineArgs& args, const Allocator& allocator) {
  impl_->check();
  detail::validate_ll_combine(*impl_, args);
  return impl_->ll_combine(args, allocator);
}

TensorView Buffer::ll_next_combine_buffer(const LlHandle& handle) {
  detail::validate_ll_handle(*impl_, handle, "ll_next_combine_buffer");
  return impl_->ll_next_combine_buffer(handle);
}

void Buffer::reset() { impl_->reset(); }

void Buffer::ll_clean() {
  EPX_CHECK_ARG(impl_->config.enable_ll,
                "ll_clean: this buffer was created with enable_ll = false, expected true");
  impl_->ll_clean();
}

void Buffer::ll_update_mask(int rank, bool mask, Stream stream) {
  impl_->check();
  detail::validate_ll_update_mask(*impl_, rank, mask);
  impl_->ll_update_mask(rank, mask, stream);
}

void Buffer::ll_query_mask(const TensorView& mask_status, Stream stream) const {
  impl_->check();
  detail::validate_ll_query_mask(*impl_, mask_status);
  impl_->ll_query_mask(mask_status, stream);
}

void Buffer::ll_clean_mask(Stream stream) {
  impl_->check();
  detail::validate_ll_mask_op(*impl_, "ll_clean_mask");
  impl_->ll_clean_mask(stream);
}

}  // namespace epx
