// src/core/ht_validate.cc — argument validation of the ht operations (docs/semantics.md §1, §4),
// shared by every backend and run before the backend is called.
//
// Data flow: epx::Buffer::ht_* -> validate_ht_* (here) -> BufferImpl::ht_*. Nothing here
// communicates; checks that need the peers' arguments (same x dtype on every rank, topk_weights
// given on every rank or none) are made by the backends after their first exchange.
//
// Conventions checked (H = shape.hidden, K = shape.top_k, E = shape.num_experts, R = group size):
//   x             [T, H] bf16 or fp8 e4m3, innermost stride 1 (rows may be strided),
//                 T <= max_tokens (else OutOfCapacity)
//   x_scales      fp8 only and required with it: [T, H/128] f32 or [T, ceil(H/512)] i32 (packed
//                 UE8M0, 4 exponent bytes per int), any strides; fp8 needs H % 128 == 0
//   topk_idx      [T, K] int64/int32 in [-1, E) (validate_topk_idx); cached mode ignores it and
//                 topk_weights (the routing comes from the handle)
//   topk_weights  optional [T, K] f32, any strides
//   handle        buffer_id == this buffer; rank_prefix_matrix [R, R] i32, recv_src_idx [rows] i32,
//                 send_pos [T, R] i32, is_token_in_rank [T, R] bool, all contiguous on the device;
//                 rows = num_worst_tokens if > 0 else num_recv_tokens
//   combine y     [rows, H] bf16, innermost stride 1; topk_weights [rows, K] f32, innermost stride
//                 1; bias [T, H] bf16; zero_copy: y is the view ht_combine_buffer(handle)
// ht_layout is local and needs no ht memory: it checks topk_idx only.
#include "core/check.h"
#include "core/validate.h"

namespace epx::detail {
namespace {

// Scale columns of one token row for a scale dtype (docs/semantics.md §1.2).
int64_t scale_cols(DType scale_dtype, int64_t hidden) {
  return scale_dtype == DType::kF32 ? hidden / 128 : (hidden / 128 + 3) / 4;
}

void check_ht_enabled(const BufferImpl& b, const char* op) {
  EPX_CHECK_ARG(b.config.enable_ht, op,
                ": this buffer was created with BufferConfig 'enable_ht' = false, expected true");
}

void check_handle_tensor(const Tensor& t, const char* op, const char* name, DType dtype,
                         std::initializer_list<int64_t> shape, Device device) {
  check_defined(t, op, name);
  check_dtype(t, op, name, {dtype});
  check_shape(t, op, name, shape);
  check_device(t, op, name, device);
  check_contiguous(t, op, name);
}

void validate_ht_handle(const BufferImpl& b, const HtHandle& h, const char* op) {
  EPX_CHECK_ARG(h.buffer_id == b.id, op, ": argument 'handle' was made by buffer ", h.buffer_id,
                ", expected a handle of this buffer (id ", b.id, ")");
  EPX_CHECK_ARG(h.top_k == b.shape.top_k, op, ": argument 'handle' has top_k ", h.top_k,
                ", expected ", b.shape.top_k);
  EPX_CHECK_ARG(h.num_tokens >= 0 && h.num_tokens <= b.shape.max_tokens_per_rank, op,
                ": argument 'handle' has num_tokens ", h.num_tokens, ", expected 0..",
                b.shape.max_tokens_per_rank);
  EPX_CHECK_ARG(h.num_worst_tokens >= 0, op, ": argument 'handle' has num_worst_tokens ",
                h.num_worst_tokens, ", expected >= 0");
  EPX_CHECK_ARG(h.num_worst_tokens > 0 || h.num_recv_tokens >= 0, op,
                ": argument 'handle' has num_recv_tokens ", h.num_recv_tokens,
                ", expected >= 0 (a handle returned by ht_dispatch)");
  const int64_t R = b.group.size();
  const Device dev = b.device();
  check_handle_tensor(h.rank_prefix_matrix, op, "handle.rank_prefix_matrix", DType::kI32, {R, R},
                      dev);
  check_handle_tensor(h.recv_src_idx, op, "handle.recv_src_idx", DType::kI32, {ht_handle_rows(h)},
                      dev);
  check_handle_tensor(h.send_pos, op, "handle.send_pos", DType::kI32, {h.num_tokens, R}, dev);
  check_handle_tensor(h.is_token_in_rank, op, "handle.is_token_in_rank", DType::kBool,
                      {h.num_tokens, R}, dev);
}

}  // namespace

int64_t ht_handle_rows(const HtHandle& h) {
  return h.num_worst_tokens > 0 ? h.num_worst_tokens : h.num_recv_tokens;
}

void validate_ht_layout(const BufferImpl& b, const TensorView& topk_idx) {
  const Device dev = b.device();
  validate_topk_idx(topk_idx, b.shape.top_k, b.shape.num_experts, dev, "ht_layout");
}

void validate_ht_dispatch(const BufferImpl& b, const HtDispatchArgs& a) {
  const char* op = "ht_dispatch";
  check_ht_enabled(b, op);
  const Device dev = b.device();
  const int64_t H = b.shape.hidden;
  const int K = b.shape.top_k;

  check_defined(a.x, op, "x");
  check_dtype(a.x, op, "x", {DType::kBF16, DType::kF8E4M3});
  check_shape(a.x, op, "x", {-1, H});
  check_device(a.x, op, "x", dev);
  check_inner_contiguous(a.x, op, "x");
  const int64_t T = a.x.shape[0];
  EPX_CHECK(T <= b.shape.max_tokens_per_rank, ErrorCode::kOutOfCapacity, op, ": argument 'x' has ",
            T, " tokens, more than the buffer's max_tokens_per_rank ", b.shape.max_tokens_per_rank,
            " (", b.shape.describe(), ")");

  if (a.x.dtype == DType::kF8E4M3) {
    EPX_CHECK_ARG(H % 128 == 0, op, ": argument 'x' is fp8 with hidden ", H,
                  ", expected a multiple of 128 (one scale per 128 channels)");
    EPX_CHECK_ARG(a.x_scales.defined(), op,
                  ": argument 'x_scales' is required with fp8 'x' but was not given");
    check_defined(a.x_scales, op, "x_scales");
    check_dtype(a.x_scales, op, "x_scales", {DType::kF32, DType::kI32});
    check_shape(a.x_scales, op, "x_scales", {T, scale_cols(a.x_scales.dtype, H)});
    check_device(a.x_scales, op, "x_scales", dev);
  } else {
    EPX_CHECK_ARG(!a.x_scales.defined(), op, ": argument 'x_scales' is ", a.x_scales.describe(),
                  " but 'x' is bf16, expected no scales (scales go with fp8 x only)");
  }

  EPX_CHECK_ARG(a.expert_alignment >= 1, op, ": argument 'expert_alignment' is ",
                a.expert_alignment, ", expected >= 1");
  EPX_CHECK_ARG(a.num_worst_tokens >= 0, op, ": argument 'num_worst_tokens' is ",
                a.num_worst_tokens, ", expected >= 0");
  if (a.zero_copy) {
    // The zero-copy view holds at most every rank's max_tokens_per_rank rows.
    const int64_t worst = a.handle != nullptr ? a.handle->num_worst_tokens : a.num_worst_tokens;
    const int64_t cap = b.shape.max_tokens_per_rank * b.group.size();
    EPX_CHECK_ARG(worst <= cap, op, ": argument 'zero_copy' is true with ", worst,
                  " worst-case rows, expected at most R * max_tokens_per_rank = ", cap,
                  " (the rows the zero-copy view holds)");
  }

  if (a.handle != nullptr) {  // cached mode: the routing comes from the handle
    validate_ht_handle(b, *a.handle, op);
    EPX_CHECK_ARG(T == a.handle->num_tokens, op, ": argument 'x' has ", T,
                  " tokens but argument 'handle' was made for ", a.handle->num_tokens,
                  " tokens, expected the same (cached dispatch reuses the routing)");
    EPX_CHECK_ARG(a.num_worst_tokens == 0 || a.num_worst_tokens == a.handle->num_worst_tokens, op,
                  ": argument 'num_worst_tokens' is ", a.num_worst_tokens,
                  " in cached mode, expected 0 or the handle's ", a.handle->num_worst_tokens);
    return;
  }

  validate_topk_idx(a.topk_idx, K, b.shape.num_experts, dev, op);
  EPX_CHECK_ARG(a.topk_idx.shape[0] == T, op, ": argument 'topk_idx' has ", a.topk_idx.shape[0],
                " rows, expected ", T, " (the tokens of 'x')");
  if (a.topk_weights.defined()) {
    check_defined(a.topk_weights, op, "topk_weights");
    check_dtype(a.topk_weights, op, "topk_weights", {DType::kF32});
    check_shape(a.topk_weights, op, "topk_weights", {T, K});
    check_device(a.topk_weights, op, "topk_weights", dev);
  }
}

void validate_ht_combine_buffer(const BufferImpl& b, const HtHandle& h, const char* op) {
  check_ht_enabled(b, op);
  validate_ht_handle(b, h, op);
  const int64_t cap = b.shape.max_tokens_per_rank * b.group.size();
  EPX_CHECK_ARG(ht_handle_rows(h) <= cap, op, ": argument 'handle' has ", ht_handle_rows(h),
                " rows, expected at most R * max_tokens_per_rank = ", cap,
                " (the rows the combine buffer holds)");
}

void validate_ht_combine(const BufferImpl& b, const HtCombineArgs& a) {
  const char* op = "ht_combine";
  check_ht_enabled(b, op);
  EPX_CHECK_ARG(a.handle != nullptr, op,
                ": argument 'handle' is required (the handle ht_dispatch returned) but was not "
                "given");
  const HtHandle& h = *a.handle;
  validate_ht_handle(b, h, op);
  const Device dev = b.device();
  const int64_t H = b.shape.hidden;
  const int64_t rows = ht_handle_rows(h);

  check_defined(a.y, op, "y");
  check_dtype(a.y, op, "y", {DType::kBF16});
  check_shape(a.y, op, "y", {rows, H});
  check_device(a.y, op, "y", dev);
  check_inner_contiguous(a.y, op, "y");
  if (a.zero_copy) {  // y must be the view ht_combine_buffer returned, already written
    validate_ht_combine_buffer(b, h, op);
    const TensorView view = b.ht_combine_buffer(h);
    // (No rows: nothing is read; frameworks give empty views any data pointer.)
    EPX_CHECK_ARG(a.y.numel() == 0 || (a.y.data == view.data && a.y.is_contiguous()), op,
                  ": argument 'y' is ", a.y.describe(),
                  " with zero_copy, expected the view ht_combine_buffer(handle) ", "returned (",
                  view.describe(), ")");
  }

  if (a.topk_weights.defined()) {
    check_defined(a.topk_weights, op, "topk_weights");
    check_dtype(a.topk_weights, op, "topk_weights", {DType::kF32});
    check_shape(a.topk_weights, op, "topk_weights", {rows, b.shape.top_k});
    check_device(a.topk_weights, op, "topk_weights", dev);
    check_inner_contiguous(a.topk_weights, op, "topk_weights");
  }
  const TensorView* biases[2] = {&a.bias0, &a.bias1};
  const char* names[2] = {"bias0", "bias1"};
  for (int i = 0; i < 2; ++i) {
    if (!biases[i]->defined()) continue;
    check_defined(*biases[i], op, names[i]);
    check_dtype(*biases[i], op, names[i], {DType::kBF16});
    check_shape(*biases[i], op, names[i], {h.num_tokens, H});
    check_device(*biases[i], op, names[i], dev);
    check_inner_contiguous(*biases[i], op, names[i]);
  }
}

}  // namespace epx::detail
