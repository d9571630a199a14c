// src/core/ll_validate.cc — argument validation of the ll mode (docs/semantics.md §2, §4), shared
// by every backend. Runs on the host before any communication, so a bad argument on one rank fails
// that rank's call without touching the symmetric buffer.
//
//   ll_dispatch: x bf16 [T, H] (H == shape.hidden, H % 128 == 0, innermost stride 1),
//                T <= T_max = shape.max_tokens_per_rank (else OutOfCapacity),
//                topk_idx [T, K] int64/int32 in [-1, E), use_ue8m0 => use_fp8 && round_scale,
//                use_nvfp4: not with use_fp8 (InvalidArgument) or use_ue8m0 (Unsupported), and
//                exactly one global scale: x_global_scale f32 of >= 1 element on the buffer's
//                device, or global_scale finite and > 0,
//                cumulative_local_expert_recv_stats int32 [L] when given,
//                dispatch_wait_recv_cost_stats int64 [R] contiguous when given.
//   ll_combine:  a handle of this buffer, topk_idx/topk_weights [T, K] with T == handle.num_tokens,
//                y bf16 [L, R * T_max, H] unless zero_copy, out bf16 [T, H] when given,
//                combine_wait_recv_cost_stats int64 [R] contiguous when given; overlap:
//                signals int32 contiguous on the buffer's device with at least
//                ll_overlap_num_signals elements, block_rows >= 0, expected in 1 .. 2^31 - 1,
//                num_sms >= 0, recv_count int32 [L] when given, not with use_logfmt
//                (Unsupported).
//   ll masks:    enable_ll and enable_shrink; ll_update_mask: rank in [0, R), not this rank when
//                masking; ll_query_mask: int32 [R] (any stride) on the buffer's device.
#include <limits>

#include "core/check.h"
#include "core/numeric.h"
#include "core/validate.h"

namespace epx::detail {
namespace {

void check_ll_enabled(const BufferImpl& b, const char* op) {
  EPX_CHECK_ARG(b.config.enable_ll, op, ": this buffer was created with enable_ll = false, ",
                "expected BufferConfig::enable_ll = true");
}

void check_ll_hidden(const BufferImpl& b, const char* op) {
  EPX_CHECK_ARG(b.shape.hidden % kQuantGroup == 0, op, ": shape.hidden is ", b.shape.hidden,
                ", expected a multiple of ", kQuantGroup, " in ll mode");
}

// A required tensor of `dtype` and `shape` on the buffer's device with innermost stride 1.
void check_tensor(const BufferImpl& b, const TensorView& t, const char* op, const char* name,
                  DType dtype, std::initializer_list<int64_t> shape) {
  check_defined(t, op, name);
  check_dtype(t, op, name, {dtype});
  check_shape(t, op, name, shape);
  check_device(t, op, name, b.device());
  check_inner_contiguous(t, op, name);
}

// An optional wait-cost statistics tensor (docs/semantics.md §2.5): int64 [R], contiguous (the
// kernels add into element s at offset s), on the buffer's device.
void check_wait_stats(const BufferImpl& b, const TensorView& t, const char* op, const char* name) {
  if (!t.defined()) return;
  check_tensor(b, t, op, name, DType::kI64, {b.group.size()});
  check_contiguous(t, op, name);
}

// use_nvfp4's options and its global scale.
void validate_ll_nvfp4(const BufferImpl& b, const LlDispatchArgs& args, const char* op) {
  EPX_CHECK_ARG(!args.use_fp8, op,
                ": arguments 'use_fp8' and 'use_nvfp4' are both true, expected at most one "
                "(use_fp8 = false with use_nvfp4 = true; DeepEP's use_fp8 defaults to true)");
  EPX_CHECK(!args.use_ue8m0, ErrorCode::kUnsupported, op,
            ": argument 'use_ue8m0' is true with use_nvfp4: UE8M0 block scales for NVFP4 are not "
            "built, expected use_ue8m0 = false (e4m3 block scales)");
  const TensorView& g = args.x_global_scale;
  EPX_CHECK_ARG(g.defined() != args.global_scale.has_value(), op,
                g.defined() ? ": arguments 'x_global_scale' and 'global_scale' are both given, "
                              "expected exactly one NVFP4 global scale"
                            : ": argument 'x_global_scale' is required with use_nvfp4, expected "
                              "a float32 tensor (element 0 is the global scale) or a host "
                              "global_scale");
  if (g.defined()) {
    check_dtype(g, op, "x_global_scale", {DType::kF32});
    check_device(g, op, "x_global_scale", b.device());
    EPX_CHECK_ARG(g.numel() >= 1 && g.data != nullptr, op, ": argument 'x_global_scale' is ",
                  g.describe(), ", expected at least one element (element 0 is read)");
  } else {
    const float v = *args.global_scale;
    EPX_CHECK_ARG(v > 0.0f && v < 3.0e38f, op, ": argument 'global_scale' is ", v,
                  ", expected a finite value > 0");
  }
}

// The overlapped combine's signals and options (epx/ll.h, LlCombineOverlap).
void validate_ll_overlap(const BufferImpl& b, const LlCombineArgs& args, const char* op) {
  const LlCombineOverlap& o = *args.overlap;
  EPX_CHECK(!args.use_logfmt, ErrorCode::kUnsupported, op,
            ": arguments 'overlap' and 'use_logfmt' are both set: LogFMT rows in the overlapped "
            "combine are not built, expected use_logfmt = false");
  EPX_CHECK_ARG(o.block_rows >= 0, op, ": argument 'overlap.block_rows' is ", o.block_rows,
                ", expected >= 0 (0: one signal per local expert)");
  EPX_CHECK_ARG(o.expected >= 1 && o.expected <= std::numeric_limits<int32_t>::max(), op,
                ": argument 'overlap.expected' is ", o.expected, ", expected 1 .. ",
                std::numeric_limits<int32_t>::max());
  EPX_CHECK_ARG(o.num_sms >= 0, op, ": argument 'overlap.num_sms' is ", o.num_sms,
                ", expected >= 0 (0: auto)");
  const char* name = "overlap.signals";
  check_defined(o.signals, op, name);
  check_dtype(o.signals, op, name, {DType::kI32});
  check_device(o.signals, op, name, b.device());
  check_contiguous(o.signals, op, name);
  const int R = b.group.size();
  const int64_t need = ll_overlap_num_signals(b.shape, R, o.block_rows);
  EPX_CHECK_ARG(o.signals.numel() >= need, op, ": argument 'overlap.signals' has ",
                o.signals.numel(), " elements, expected at least ", need,
                " (L = ", b.shape.num_local_experts(R), " local experts x ",
                need / b.shape.num_local_experts(R),
                " signals each for block_rows = ", o.block_rows, ")");
  if (o.recv_count.defined())
    check_tensor(b, o.recv_count, op, "overlap.recv_count", DType::kI32,
                 {b.shape.num_local_experts(R)});
}

}  // namespace

int64_t ll_overlap_blocks(const MoeShape& shape, int num_ranks, int64_t block_rows) {
  const int64_t RT = num_ranks * shape.max_tokens_per_rank;
  return block_rows > 0 ? (RT + block_rows - 1) / block_rows : 1;
}

int64_t ll_overlap_num_signals(const MoeShape& shape, int num_ranks, int64_t block_rows) {
  return shape.num_local_experts(num_ranks) * ll_overlap_blocks(shape, num_ranks, block_rows);
}

float ll_host_global_scale(const LlDispatchArgs& args) {
  if (args.global_scale) return *args.global_scale;
  return *static_cast<const float*>(args.x_global_scale.data);
}

void validate_ll_dispatch(const BufferImpl& b, const LlDispatchArgs& args) {
  const char* op = "ll_dispatch";
  check_ll_enabled(b, op);
  check_ll_hidden(b, op);
  const int64_t H = b.shape.hidden;
  const int64_t max_tokens = b.shape.max_tokens_per_rank;
  const int L = b.shape.num_local_experts(b.group.size());

  check_tensor(b, args.x, op, "x", DType::kBF16, {-1, H});
  const int64_t T = args.x.shape[0];
  EPX_CHECK(T <= max_tokens, ErrorCode::kOutOfCapacity, op, ": argument 'x' has T = ", T,
            " tokens, more than T_max = ", max_tokens,
            " (the buffer's shape.max_tokens_per_rank bounds the tokens of one ll call; create the "
            "buffer with a larger max_tokens_per_rank)");

  validate_topk_idx(args.topk_idx, b.shape.top_k, b.shape.num_experts, b.device(), op);
  EPX_CHECK_ARG(args.topk_idx.shape[0] == T, op, ": argument 'topk_idx' has ",
                args.topk_idx.shape[0], " rows, expected T = ", T, " (the rows of 'x')");

  if (args.use_nvfp4) validate_ll_nvfp4(b, args, op);
  EPX_CHECK_ARG(!args.use_ue8m0 || args.use_fp8, op,
                ": argument 'use_ue8m0' is true but use_fp8 is false, expected use_fp8 = true "
                "(UE8M0 packs fp8 scales)");
  EPX_CHECK_ARG(!args.use_ue8m0 || args.round_scale, op,
                ": argument 'use_ue8m0' is true but round_scale is false, expected round_scale = "
                "true (UE8M0 holds power-of-two scales only)");

  const TensorView& stats = args.cumulative_local_expert_recv_stats;
  if (stats.defined())
    check_tensor(b, stats, op, "cumulative_local_expert_recv_stats", DType::kI32, {L});
  check_wait_stats(b, args.dispatch_wait_recv_cost_stats, op, "dispatch_wait_recv_cost_stats");
}

void validate_ll_handle(const BufferImpl& b, const LlHandle& h, const char* op) {
  check_ll_enabled(b, op);
  const int R = b.group.size();
  const int L = b.shape.num_local_experts(R);
  const int64_t max_tokens = b.shape.max_tokens_per_rank;
  EPX_CHECK_ARG(h.buffer_id == b.id, op, ": argument 'handle' comes from buffer ", h.buffer_id,
                ", expected a handle returned by ll_dispatch of this buffer (id ", b.id, ")");
  EPX_CHECK_ARG(h.max_tokens == max_tokens, op, ": argument 'handle' has T_max = ", h.max_tokens,
                ", expected this buffer's ", max_tokens);
  EPX_CHECK_ARG(h.hidden == b.shape.hidden, op, ": argument 'handle' has H = ", h.hidden,
                ", expected this buffer's ", b.shape.hidden);
  EPX_CHECK_ARG(h.num_experts == b.shape.num_experts, op,
                ": argument 'handle' has E = ", h.num_experts, ", expected this buffer's ",
                b.shape.num_experts);
  EPX_CHECK_ARG(h.num_tokens >= 0 && h.num_tokens <= max_tokens, op,
                ": argument 'handle' has num_tokens = ", h.num_tokens, ", expected 0..",
                max_tokens);
  EPX_CHECK_ARG(h.slot == 0 || h.slot == 1, op, ": argument 'handle' has slot = ", h.slot,
                ", expected 0 or 1");
  check_tensor(b, h.src_info, op, "handle.src_info", DType::kI32, {L, R * max_tokens});
  check_tensor(b, h.layout_range, op, "handle.layout_range", DType::kI64, {L, R});
}

void validate_ll_combine(const BufferImpl& b, const LlCombineArgs& args) {
  const char* op = "ll_combine";
  check_ll_enabled(b, op);
  check_ll_hidden(b, op);
  EPX_CHECK_ARG(args.handle != nullptr, op,
                ": argument 'handle' is null, expected the handle of an ll_dispatch");
  const LlHandle& h = *args.handle;
  validate_ll_handle(b, h, op);
  const int R = b.group.size();
  const int L = b.shape.num_local_experts(R);
  const int64_t H = b.shape.hidden;
  const int K = b.shape.top_k;
  const int64_t T = h.num_tokens;

  if (!args.zero_copy)
    check_tensor(b, args.y, op, "y", DType::kBF16, {L, R * b.shape.max_tokens_per_rank, H});

  validate_topk_idx(args.topk_idx, K, b.shape.num_experts, b.device(), op);
  EPX_CHECK_ARG(args.topk_idx.shape[0] == T, op, ": argument 'topk_idx' has ",
                args.topk_idx.shape[0], " rows, expected T = ", T,
                " (the tokens of the dispatch that made 'handle')");
  check_tensor(b, args.topk_weights, op, "topk_weights", DType::kF32, {T, K});
  if (args.out.defined()) check_tensor(b, args.out, op, "out", DType::kBF16, {T, H});
  check_wait_stats(b, args.combine_wait_recv_cost_stats, op, "combine_wait_recv_cost_stats");
  if (args.overlap) validate_ll_overlap(b, args, op);
}

void validate_ll_mask_op(const BufferImpl& b, const char* op) {
  check_ll_enabled(b, op);
  EPX_CHECK_ARG(b.config.enable_shrink, op,
                ": this buffer was created with enable_shrink = false, expected "
                "BufferConfig::enable_shrink = true (the ll rank masks need it)");
}

void validate_ll_update_mask(const BufferImpl& b, int rank, bool mask) {
  const char* op = "ll_update_mask";
  validate_ll_mask_op(b, op);
  const int R = b.group.size();
  EPX_CHECK_ARG(rank >= 0 && rank < R, op, ": argument 'rank' is ", rank, ", expected 0..", R - 1);
  EPX_CHECK_ARG(!mask || rank != b.group.rank(), op, ": argument 'rank' is ", rank,
                ", this rank, with mask = true; expected another rank (a rank cannot mask itself)");
}

void validate_ll_query_mask(const BufferImpl& b, const TensorView& t) {
  const char* op = "ll_query_mask";
  validate_ll_mask_op(b, op);
  check_defined(t, op, "mask_status");
  check_dtype(t, op, "mask_status", {DType::kI32});
  check_shape(t, op, "mask_status", {b.group.size()});
  check_device(t, op, "mask_status", b.device());
}

}  // namespace epx::detail
