// epx::A2a: validation and the dispatch -> combine state machine, then the backend.
#include "epx/a2a.h"

#include "core/agree.h"
#include "core/buffer_impl.h"
#include "core/check.h"
#include "core/validate.h"
#include "transport/transport.h"

namespace epx {

namespace {

// Runs f(); a Timeout leaves the object unusable until set_active_ranks (the peers' epochs or
// barrier generations are no longer known), so remember why before rethrowing.
template <typename F>
auto note_timeout(detail::A2aImpl& impl, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kTimeout) impl.failed = e.what();
    throw;
  }
}

void require_usable(const detail::A2aImpl& impl, const char* op) {
  EPX_CHECK(impl.failed.empty(), ErrorCode::kInternal, op,
            ": this A2a is unusable after an earlier error (", impl.failed,
            "); every surviving rank must call set_active_ranks (without the failed ranks) to "
            "continue");
}

}  // namespace

A2a::A2a(const Group& group, const A2aShape& shape) {
  // Every rank must pass the same shape: compared first, in one small exchange (core/agree.h), so
  // a difference is an InvalidArgument on every rank before anything is sized or mapped. (The
  // backends compare the published shape once more after their allocation.)
  std::vector<detail::AgreeField> fields = {
      {"shape.max_tokens_per_rank", shape.max_tokens_per_rank},
      {"shape.top_k", shape.top_k},
      {"shape.num_experts", shape.num_experts},
      {"shape.combine_bytes_per_token", static_cast<int64_t>(shape.combine_bytes_per_token)},
      {"the number of payloads (shape.payload_bytes_per_token.size())",
       static_cast<int64_t>(shape.payload_bytes_per_token.size())}};
  for (int i = 0; i < kMaxA2aPayloads; ++i)
    fields.push_back({detail::cat("shape.payload_bytes_per_token[", i, "]"),
                      i < static_cast<int>(shape.payload_bytes_per_token.size())
                          ? static_cast<int64_t>(shape.payload_bytes_per_token[i])
                          : 0});
  detail::agree(group, "A2a", fields);
  detail::validate_a2a_shape(shape, group.size());
  detail::check_a2a_capacity(shape, group.size(), group.backend(), "A2a");
  impl_ = group.backend() == Backend::kCpu ? detail::make_cpu_a2a(group, shape)
                                           : detail::make_cuda_a2a(group, shape);
}

A2a::~A2a() = default;
A2a::A2a(A2a&&) noexcept = default;
A2a& A2a::operator=(A2a&&) noexcept = default;

size_t A2a::workspace_bytes(const A2aShape& shape, int num_ranks, Backend backend) {
  detail::validate_a2a_shape(shape, num_ranks);
  detail::check_a2a_capacity(shape, num_ranks, backend, "A2a::workspace_bytes");
  return backend == Backend::kCpu ? detail::cpu_a2a_bytes(shape, num_ranks)
                                  : detail::cuda_a2a_bytes(shape, num_ranks);
}

size_t A2a::bytes_allocated() const { return impl_->bytes_allocated(); }
const Group& A2a::group() const { return impl_->group; }
Device A2a::device() const { return impl_->group.transport()->device(); }
const A2aShape& A2a::shape() const { return impl_->shape; }
void A2a::check() const {
  note_timeout(*impl_, [&] { impl_->check(); });
}

A2aDispatchResult A2a::dispatch(const A2aDispatchArgs& args) {
  require_usable(*impl_, "a2a dispatch");
  check();
  EPX_CHECK_ARG(!impl_->dispatched,
                "a2a dispatch: called twice without combine in between; expected the order "
                "dispatch -> combine -> dispatch");
  detail::validate_a2a_dispatch(*impl_, args);
  A2aDispatchResult r = note_timeout(*impl_, [&] { return impl_->dispatch(args); });
  impl_->dispatched = true;
  impl_->last_runtime_max = args.runtime_max_tokens_per_rank;
  impl_->last_num_tokens = args.topk_idx.shape[0];
  return r;
}

TensorView A2a::combine_payload_view(int64_t runtime_max, int64_t hidden, DType dtype) {
  EPX_CHECK_ARG(runtime_max >= 0 && runtime_max <= impl_->shape.max_tokens_per_rank,
                "a2a combine_payload_view: 'runtime_max_tokens_per_rank' is ", runtime_max,
                ", expected 0..", impl_->shape.max_tokens_per_rank);
  EPX_CHECK_ARG(dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32,
                "a2a combine_payload_view: 'dtype' is ", dtype_name(dtype),
                ", expected bf16, f16 or f32");
  EPX_CHECK_ARG(hidden > 0 && static_cast<size_t>(hidden) * dtype_size(dtype) <=
                                  impl_->shape.combine_bytes_per_token,
                "a2a combine_payload_view: 'hidden' is ", hidden, " (", hidden * dtype_size(dtype),
                " bytes per token), expected 1..", impl_->shape.combine_bytes_per_token,
                " bytes (A2aShape::combine_bytes_per_token)");
  return impl_->combine_payload_view(runtime_max, hidden, dtype);
}

Tensor A2a::combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace,
                    Stream stream, const Allocator& allocator) {
  require_usable(*impl_, "a2a combine");
  check();
  EPX_CHECK_ARG(impl_->dispatched,
                "a2a combine: called without a preceding dispatch; expected the order "
                "dispatch -> combine -> dispatch");
  detail::validate_a2a_combine(*impl_, y, runtime_max, payload_in_workspace);
  Tensor out = note_timeout(*impl_, [&] {
    return impl_->combine(y, runtime_max, payload_in_workspace, stream, allocator);
  });
  impl_->dispatched = false;
  return out;
}

void A2a::set_active_ranks(const std::vector<bool>& active, Stream stream) {
  const int R = impl_->group.size(), me = impl_->group.rank();
  EPX_CHECK_ARG(static_cast<int>(active.size()) == R, "a2a set_active_ranks: argument 'active' has ",
                active.size(), " entries, expected ", R, " (one per rank of the group)");
  EPX_CHECK_ARG(active[me], "a2a set_active_ranks: argument 'active[", me,
                "]' (this rank) is false, expected true: a rank cannot mark itself inactive");
  uint64_t mask = 0;
  for (int p = 0; p < R; ++p) {
    if (!active[p]) continue;
    // The active ranks resynchronise by counting set_active_ranks calls: a rank that was
    // inactive missed some, so it cannot rejoin (masks only shrink).
    EPX_CHECK_ARG((impl_->active_mask >> p) & 1, "a2a set_active_ranks: argument 'active[", p,
                  "]' is true but rank ", p,
                  " was marked inactive earlier; expected false (an inactive rank cannot rejoin "
                  "this A2a: create a new group and A2a to bring it back)");
    mask |= uint64_t{1} << p;
  }
  impl_->dispatched = false;  // the order restarts: a dispatch not combined yet is abandoned
  try {
    impl_->set_active_ranks(mask, stream);
  } catch (const Error& e) {
    impl_->failed = e.what();  // the active ranks may not agree on anything now
    throw;
  }
  impl_->active_mask = mask;
  impl_->failed.clear();
}

std::vector<bool> A2a::active_ranks() const {
  std::vector<bool> active(impl_->group.size());
  for (size_t p = 0; p < active.size(); ++p) active[p] = (impl_->active_mask >> p) & 1;
  return active;
}

A2aDropCounts A2a::dropped_counts() const { return impl_->dropped_counts(); }
void A2a::reset_dropped_counts(Stream stream) { impl_->reset_dropped_counts(stream); }

}  // namespace epx
