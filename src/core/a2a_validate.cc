// src/core/a2a_validate.cc — argument validation of the a2a mode (docs/semantics.md §3, §4), shared
// by every backend and run by epx::A2a (src/core/a2a.cc) before the backend sees the call.
//
// What is checked here is local to the calling rank. What only the group can see (the same
// runtime_max_tokens_per_rank, payload row sizes and combine hidden/dtype on every rank) is
// checked by the backend after its first barrier, identically on every rank.
//
// Error codes: InvalidArgument for bad shapes, dtypes, devices, ranges and pointers;
// OutOfCapacity for T > runtime_max_tokens_per_rank and runtime_max > max_tokens_per_rank.
#include "core/check.h"
#include "core/validate.h"
#include "transport/transport.h"

namespace epx::detail {
namespace {

constexpr const char* kShapeOp = "A2a";
constexpr const char* kDispatchOp = "a2a dispatch";
constexpr const char* kCombineOp = "a2a combine";

// Bytes of one row (everything but dim 0) of a tensor with ndim >= 1.
size_t row_bytes_of(const TensorView& t) {
  int64_t n = 1;
  for (int i = 1; i < t.ndim; ++i) n *= t.shape[i];
  return static_cast<size_t>(n) * dtype_size(t.dtype);
}

Device group_device(const A2aImpl& a) {
  return a.group.transport()->device();
}

}  // namespace

void validate_a2a_shape(const A2aShape& s, int num_ranks) {
  EPX_CHECK_ARG(s.max_tokens_per_rank >= 1, kShapeOp, ": shape.max_tokens_per_rank is ",
                s.max_tokens_per_rank, ", expected >= 1");
  EPX_CHECK_ARG(s.top_k >= 1 && s.top_k <= 32, kShapeOp, ": shape.top_k is ", s.top_k,
                ", expected 1..32");
  EPX_CHECK_ARG(s.num_experts >= 1, kShapeOp, ": shape.num_experts is ", s.num_experts,
                ", expected >= 1");
  EPX_CHECK_ARG(num_ranks >= 1 && s.num_experts % num_ranks == 0, kShapeOp,
                ": shape.num_experts is ", s.num_experts,
                ", expected a multiple of the group size ", num_ranks);
  const size_t n = s.payload_bytes_per_token.size();
  EPX_CHECK_ARG(n >= 1 && n <= static_cast<size_t>(kMaxA2aPayloads), kShapeOp,
                ": shape.payload_bytes_per_token has ", n, " entries, expected 1..",
                kMaxA2aPayloads, " (one per dispatch payload)");
  for (size_t i = 0; i < n; ++i) {
    const size_t b = s.payload_bytes_per_token[i];
    EPX_CHECK_ARG(b > 0 && b % 4 == 0, kShapeOp, ": shape.payload_bytes_per_token[", i, "] is ", b,
                  ", expected a positive multiple of 4 bytes");
  }
  EPX_CHECK_ARG(s.combine_bytes_per_token > 0 && s.combine_bytes_per_token % 4 == 0, kShapeOp,
                ": shape.combine_bytes_per_token is ", s.combine_bytes_per_token,
                ", expected a positive multiple of 4 bytes (H * element size of the combine "
                "payload)");
}

void validate_a2a_dispatch(const A2aImpl& a, const A2aDispatchArgs& args) {
  const A2aShape& s = a.shape;
  const Device device = group_device(a);
  validate_topk_idx(args.topk_idx, s.top_k, s.num_experts, device, kDispatchOp, "topk_idx");
  const int64_t T = args.topk_idx.shape[0];
  const int64_t M = args.runtime_max_tokens_per_rank;

  EPX_CHECK(T <= s.max_tokens_per_rank, ErrorCode::kOutOfCapacity, kDispatchOp,
            ": argument 'topk_idx' has T = ", T, " tokens, more than A2aShape::max_tokens_per_rank",
            " = ", s.max_tokens_per_rank, " the workspace was sized for");
  EPX_CHECK_ARG(M >= 0, kDispatchOp, ": argument 'runtime_max_tokens_per_rank' is ", M,
                ", expected 0..", s.max_tokens_per_rank, " and >= T on every rank");
  EPX_CHECK(M >= T, ErrorCode::kOutOfCapacity, kDispatchOp,
            ": argument 'runtime_max_tokens_per_rank' is ", M, ", less than this rank's T = ", T,
            " tokens; expected runtime_max_tokens_per_rank >= T on every rank (no truncation)");
  EPX_CHECK(M <= s.max_tokens_per_rank, ErrorCode::kOutOfCapacity, kDispatchOp,
            ": argument 'runtime_max_tokens_per_rank' is ", M,
            ", more than A2aShape::max_tokens_per_rank = ", s.max_tokens_per_rank,
            " the workspace was sized for");

  const size_t num_payloads = s.payload_bytes_per_token.size();
  EPX_CHECK_ARG(args.payloads.size() == num_payloads, kDispatchOp, ": argument 'payloads' has ",
                args.payloads.size(), " tensors, expected ", num_payloads,
                " (one per A2aShape::payload_bytes_per_token entry)");
  for (size_t i = 0; i < num_payloads; ++i) {
    const TensorView& p = args.payloads[i];
    const std::string name = cat("payloads[", i, "]");
    check_defined(p, kDispatchOp, name.c_str());
    EPX_CHECK_ARG(p.ndim >= 1 && p.ndim <= kMaxDims - 1, kDispatchOp, ": argument '", name,
                  "' has ", p.ndim, " dims, expected 1..", kMaxDims - 1, " ([T, ...])");
    check_device(p, kDispatchOp, name.c_str(), device);
    if (p.numel() != 0) check_contiguous(p, kDispatchOp, name.c_str());  // empty: any strides
    EPX_CHECK_ARG(p.shape[0] == T, kDispatchOp, ": argument '", name, "' has shape ", shape_str(p),
                  ", expected dim 0 == T = ", T, " (the tokens of 'topk_idx')");
    const size_t row = row_bytes_of(p);
    EPX_CHECK_ARG(row > 0 && row % 4 == 0, kDispatchOp, ": argument '", name, "' ", p.describe(),
                  " has ", row, " bytes per token, expected a positive multiple of 4");
    EPX_CHECK_ARG(row <= s.payload_bytes_per_token[i], kDispatchOp, ": argument '", name, "' ",
                  p.describe(), " has ", row, " bytes per token, expected at most ",
                  s.payload_bytes_per_token[i], " (A2aShape::payload_bytes_per_token[", i, "])");
  }

  const int idx = args.expert_id_payload_index;
  if (args.invalid_expert_id.has_value() || idx != -1) {
    EPX_CHECK_ARG(idx >= 0 && static_cast<size_t>(idx) < num_payloads, kDispatchOp,
                  ": argument 'expert_id_payload_index' is ", idx, ", expected 0..",
                  num_payloads - 1, " (the payload holding int32 expert ids [T, K])",
                  args.invalid_expert_id.has_value() ? " since 'invalid_expert_id' is given" : "");
  }
  if (args.invalid_expert_id.has_value()) {
    const TensorView& p = args.payloads[idx];
    const std::string name = cat("payloads[", idx, "]");
    EPX_CHECK_ARG(
        p.dtype == DType::kI32 && p.ndim == 2 && p.shape[1] == s.top_k, kDispatchOp, ": argument '",
        name, "' (the expert-id payload, 'expert_id_payload_index' = ", idx, ") is ", p.describe(),
        ", expected i32[T, ", s.top_k, "] when 'invalid_expert_id' is given");
  }
}

void validate_a2a_combine(const A2aImpl& a, const TensorView& y, int64_t runtime_max,
                          bool payload_in_workspace) {
  const A2aShape& s = a.shape;
  const int R = a.group.size();
  EPX_CHECK_ARG(runtime_max == a.last_runtime_max, kCombineOp,
                ": argument 'runtime_max_tokens_per_rank' is ", runtime_max,
                ", expected the value of the preceding dispatch, ", a.last_runtime_max);
  check_defined(y, kCombineOp, "y");
  check_dtype(y, kCombineOp, "y", {DType::kBF16, DType::kF16, DType::kF32});
  check_shape(y, kCombineOp, "y", {R, runtime_max, -1});
  check_device(y, kCombineOp, "y", group_device(a));
  const int64_t H = y.shape[2];
  const size_t hidden_bytes = static_cast<size_t>(H) * dtype_size(y.dtype);
  EPX_CHECK_ARG(H >= 1 && hidden_bytes <= s.combine_bytes_per_token, kCombineOp, ": argument 'y' ",
                y.describe(), " has ", hidden_bytes, " bytes per token, expected 1..",
                s.combine_bytes_per_token, " (A2aShape::combine_bytes_per_token)");
  if (!payload_in_workspace) {
    check_inner_contiguous(y, kCombineOp, "y");
    return;
  }
  // combine_payload_view only computes a pointer into the workspace; it does not mutate.
  const TensorView view = const_cast<A2aImpl&>(a).combine_payload_view(runtime_max, H, y.dtype);
  EPX_CHECK_ARG(y.data == view.data, kCombineOp,
                ": 'payload_in_workspace' is true but argument 'y' (", y.describe(),
                ") does not point into this rank's workspace; expected the view returned by "
                "combine_payload_view(",
                runtime_max, ", ", H, ", ", dtype_name(y.dtype),
                "), or payload_in_workspace = false to copy y");
  // (An empty y, M = 0, is contiguous whatever its strides.)
  EPX_CHECK_ARG(y.numel() == 0 || y.is_contiguous(), kCombineOp,
                ": 'payload_in_workspace' is true but argument 'y' is ", y.describe(),
                ", expected the contiguous view returned by combine_payload_view");
}

}  // namespace epx::detail
