#include "epx/shape.h"

#include "core/check.h"
#include "core/host_view.h"
#include "core/validate.h"

namespace epx {

std::string MoeShape::describe() const {
  return detail::cat("H=", hidden, " K=", top_k, " E=", num_experts,
                     " max_tokens=", max_tokens_per_rank);
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kHt: return "ht";
    case Mode::kLl: return "ll";
    case Mode::kA2a: return "a2a";
  }
  return "?";
}

namespace detail {

void validate_shape(const MoeShape& s, int num_ranks, const char* op) {
  EPX_CHECK_ARG(s.hidden > 0, op, ": shape.hidden is ", s.hidden, ", expected > 0");
  EPX_CHECK_ARG(s.top_k >= 1 && s.top_k <= 32, op, ": shape.top_k is ", s.top_k,
                ", expected 1..32");
  EPX_CHECK_ARG(s.num_experts >= 1, op, ": shape.num_experts is ", s.num_experts,
                ", expected >= 1");
  EPX_CHECK_ARG(s.num_experts % num_ranks == 0, op, ": shape.num_experts is ", s.num_experts,
                ", expected a multiple of the group size ", num_ranks);
  EPX_CHECK_ARG(s.max_tokens_per_rank >= 1, op, ": shape.max_tokens_per_rank is ",
                s.max_tokens_per_rank, ", expected >= 1");
}

void validate_topk_idx(const TensorView& t, int top_k, int num_experts, Device device,
                       const char* op, const char* name) {
  check_defined(t, op, name);
  check_dtype(t, op, name, {DType::kI64, DType::kI32});
  check_shape(t, op, name, {-1, top_k});
  check_device(t, op, name, device);
  check_inner_contiguous(t, op, name);
  if (device.type != DeviceType::kCpu) return;  // checked on the device
  const int64_t T = t.shape[0];
  for (int64_t i = 0; i < T; ++i) {
    for (int k = 0; k < top_k; ++k) {
      const int64_t v = topk_at(t, i, k);
      EPX_CHECK_ARG(v >= -1 && v < num_experts, op, ": argument '", name, "' has value ", v,
                    " at [", i, ", ", k, "], expected -1 or an expert id in [0, ", num_experts,
                    ")");
    }
  }
}

}  // namespace detail
}  // namespace epx
